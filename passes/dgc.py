"""Pass ``dgc``: ready Deep Gradient Compression's ops (``ir.ops.dgc``) for the trainer group.

Needs: a ``CollectivePlan`` (kind ``grad_allreduce``; DGC replaces the gradient allreduce, so it cannot go
with ``local_sgd``) and the role ``trainer.<id>`` whose main program holds what
``DGCMomentumOptimizer`` appends: per compressed parameter a ``dgc`` op reading its gradient, one
``dgc_allreduce`` exchanging all of them, a ``dgc_momentum`` per parameter.

Guarantees:
- each gradient a ``dgc`` op reads is exchanged by exactly one ``dgc_allreduce``, placed after every
  ``dgc`` op that encodes into it and before every ``dgc_momentum`` that reads its output; no other op
  writes that gradient between its ``dgc`` op and its ``dgc_momentum`` (the exchange reads the raw
  gradient before rampup, so nothing may change it in between);
- ``nranks`` on every ``dgc`` and ``dgc_allreduce`` op is the group's size (the clip scale
  ``N**-0.5`` and the runtime's group-size check read it), ``ring_id`` on the exchange is 0;
- ``grad_allreduce`` (run after this pass) leaves these gradients alone (it finds them by the ``dgc``
  ops that read them).
- the gradient a ``dgc`` op reads is the backward pass's own (written by a backward op): a clip or
  regularization op in front of it would leave the raw gradient to ``grad_allreduce``, which would then
  average it densely as well (all of dense allreduce's bytes, and DGC's on top). DGC clips locally
  (``local_grad_clip_norm``), as the paper does.
A program without ``dgc`` ops is left unchanged (returns False). Raises ``PassError`` E773 when the ops
are not wired as above, E774 for DGC under ``local_sgd``, E776 for a gradient clipped or regularized in
front of its ``dgc`` op.
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.core import Block, Program
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OP_ROLE_ATTR, OpRole

from passes.collective_plan import GRAD_ALLREDUCE
from passes.pass_base import Pass, PassContext, PassError

ENCODE_OP = "dgc"
EXCHANGE_OP = "dgc_allreduce"
UPDATE_OP = "dgc_momentum"
DGC_OPS = (ENCODE_OP, EXCHANGE_OP, UPDATE_OP)


def has_dgc(program: Program) -> bool:
    return any(op.type in DGC_OPS for op in program.global_block().ops)


def _wiring_error(message: str) -> PassError:
    return PassError(message, hint="build the program with DGCMomentumOptimizer.minimize(loss) and do not edit "
                                   "its dgc, dgc_allreduce and dgc_momentum ops", code="E773")


def check_wiring(block: Block) -> None:
    """Raise E773 unless the DGC ops of ``block`` are wired as the module docstring says."""
    encode = {op.input("Grad")[0]: i for i, op in enumerate(block.ops) if op.type == ENCODE_OP}
    exchange: dict[str, int] = {}
    for i, op in enumerate(block.ops):
        if op.type != EXCHANGE_OP:
            continue
        for g in op.input("Grad"):
            if g in exchange:
                raise _wiring_error(f"gradient {g!r} is exchanged by two dgc_allreduce ops (ops {exchange[g]}, {i})")
            if g not in encode or encode[g] > i:
                raise _wiring_error(f"dgc_allreduce (op {i}) exchanges {g!r}, which no dgc op before it encodes")
            exchange[g] = i
    for g, i in encode.items():
        if g not in exchange:
            raise _wiring_error(f"gradient {g!r} is encoded by dgc (op {i}) but no dgc_allreduce exchanges it")
        for j in range(i + 1, exchange[g]):
            if g in block.ops[j].output_arg_names:
                raise _wiring_error(f"op {j} ({block.ops[j].type}) writes {g!r} between its dgc op ({i}) and its "
                                    f"exchange ({exchange[g]})")
    for i, op in enumerate(block.ops):
        if op.type == UPDATE_OP:
            g = op.input("Grad")[0]
            if exchange.get(g, len(block.ops)) > i:
                raise _wiring_error(f"dgc_momentum (op {i}) reads {g!r} before a dgc_allreduce exchanges it")


def check_raw_gradients(block: Block) -> None:
    """Raise E776 unless every ``dgc`` op of ``block`` reads a gradient its last writer wrote in the backward
    pass (see the module docstring)."""
    writer: dict[str, int] = {}
    for i, op in enumerate(block.ops):
        if op.type == ENCODE_OP:
            g = op.input("Grad")[0]
            w = writer.get(g)
            if w is not None and int(block.ops[w].attr(OP_ROLE_ATTR, 0)) & OpRole.BACKWARD:
                continue
            what = f"op {w} ({block.ops[w].type})" if w is not None else "no op"
            raise PassError(f"dgc (op {i}) compresses {g!r}, which {what} computes after the backward pass "
                            "(gradient clipping or regularization): the gradient allreduce would then average the "
                            "raw gradient densely too, so DGC would send more than dense training",
                            hint="clip with DGCMomentumOptimizer(local_grad_clip_norm=...) and leave grad_clip, "
                                 "set_gradient_clip and regularization off the parameters DGC compresses",
                            code="E776")
        for n in op.output_arg_names:
            writer[n] = i


@dataclass(frozen=True)
class DGC(Pass):
    """See the module docstring."""

    name = "dgc"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.require_collective(self.name)
        main = programs[ProgramRole.trainer(plan.trainer_id)].main
        if not has_dgc(main):
            return False
        if plan.kind != GRAD_ALLREDUCE:
            raise PassError(f"DGCMomentumOptimizer needs collective_mode {GRAD_ALLREDUCE!r}, got {plan.kind!r}: DGC "
                            "replaces the gradient allreduce, local_sgd averages parameters instead",
                            hint="use collective_mode='grad_allreduce', or MomentumOptimizer with local_sgd",
                            code="E774")
        block = main.global_block()
        check_wiring(block)
        check_raw_gradients(block)
        for op in block.ops:
            if op.type in (ENCODE_OP, EXCHANGE_OP):
                op.set_attr("nranks", plan.nranks)
            if op.type == EXCHANGE_OP:
                op.set_attr("ring_id", 0)
        return True


__all__ = ["DGC", "DGC_OPS", "ENCODE_OP", "EXCHANGE_OP", "UPDATE_OP", "check_raw_gradients", "check_wiring", "has_dgc"]
