"""Pass ``grad_allreduce``: sum every parameter gradient over the trainers and take the mean.

Needs: a ``CollectivePlan`` (kind ``grad_allreduce``) and the role ``trainer.<id>`` whose main program is
a clone of the input's, with optimize ops naming their (parameter, gradient) pairs in ``op_role_var``.

Guarantees:
- every trained gradient is allreduced exactly once, by a ``c_allreduce_sum`` placed right after the
  last op that writes it (and of every gradient of its bucket) and before the first optimize-role op
  that reads any of them (regularization, clipping, the optimizer), followed by ``scale(1/nranks)``
  per gradient, so the update sees the mean over the union of the trainers' batches;
- dense gradients are grouped into buckets in backward order (the order their last writers run),
  one dtype a bucket, at most ``fuse_grad_size_mb`` MiB each (a larger gradient gets a bucket of its
  own; 0 disables fusion): one collective a bucket instead of one a gradient;
- a sparse (``selected_rows``) gradient gets its own ``c_allreduce_sum``, which gathers every rank's
  rows (their sum is the concatenation) instead of densifying the table;
- a gradient a ``dgc`` op compresses (Deep Gradient Compression) is left alone: its ``dgc_allreduce``
  exchanges it (dense mean before the rampup, an allgather of the top-k pairs after; the ``dgc`` pass
  readies it), so it gets no ``c_allreduce_sum`` and no ``scale``;
- rings (``ring_id``) cycle over ``nccl_comm_num`` in bucket order. Learning-rate ops stay as they are.
Raises ``PassError`` E620 when a gradient is never written before the optimizer reads it, E621 when
some op reads a gradient for its update before the last op that writes it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ir.core import Block, Program
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OpRole

from passes.collective_plan import GRAD_ALLREDUCE, CollectivePlan, trained_pairs
from passes.pass_base import Pass, PassContext, PassError

_MIB = 1 << 20


@dataclass(frozen=True)
class Bucket:
    """Gradients reduced by one collective, and where it goes (after op ``after``)."""

    pairs: tuple[tuple[str, str], ...]
    after: int
    sparse: bool = False


def _positions(block: Block, pairs: list[tuple[str, str]]) -> tuple[dict[str, int], dict[str, int]]:
    """Per gradient: the index of its last writer before the optimize section, and of its first
    optimize-role reader."""
    optimize = int(OpRole.OPTIMIZE)
    grads = {g for _, g in pairs}
    last_write: dict[str, int] = {}
    first_read: dict[str, int] = {}
    for i, op in enumerate(block.ops):
        if op.role & optimize:
            for n in op.input_arg_names:
                if n in grads and n not in first_read:
                    first_read[n] = i
            continue
        for n in op.output_arg_names:
            if n in grads and n not in first_read:
                last_write[n] = i
    return last_write, first_read


DGC_OP = "dgc"


def dgc_grads(program: Program) -> set[str]:
    """The gradients ``dgc`` ops compress (their ``dgc_allreduce`` exchanges them)."""
    return {n for op in program.global_block().ops if op.type == DGC_OP for n in op.input("Grad")}


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(abs(d) for d in shape) if shape else 1


def plan_buckets(program: Program, plan: CollectivePlan) -> list[Bucket]:
    """The buckets of the program's gradients (see the module docstring), in backward order."""
    block = program.global_block()
    compressed = dgc_grads(program)
    pairs = [pg for pg in trained_pairs(program) if pg[1] not in compressed]
    last_write, first_read = _positions(block, pairs)
    for param, grad in pairs:
        if grad not in last_write:
            raise PassError(f"gradient {grad!r} of parameter {param!r} is read by the optimizer but no op before it "
                            "writes it", hint="build the program with optimizer.minimize(loss)", code="E620")
    ordered = sorted(pairs, key=lambda pg: last_write[pg[1]])
    limit = plan.fuse_grad_size_mb * _MIB
    buckets: list[Bucket] = []
    current: list[tuple[str, str]] = []
    current_bytes = 0
    current_dtype = ""

    def close() -> None:
        nonlocal current, current_bytes
        if current:
            buckets.append(Bucket(tuple(current), max(last_write[g] for _, g in current)))
        current, current_bytes = [], 0

    for param, grad in ordered:
        var = block.var(grad)
        if var.type == "selected_rows":
            close()
            buckets.append(Bucket(((param, grad),), last_write[grad], sparse=True))
            continue
        size = _numel(var.shape) * _itemsize(var.dtype)
        if current and (var.dtype != current_dtype or current_bytes + size > limit):
            close()
        current.append((param, grad))
        current_bytes += size
        current_dtype = var.dtype
    close()
    for b in buckets:
        reads = [first_read[g] for _, g in b.pairs if g in first_read]
        if reads and min(reads) <= b.after:
            grad = next(g for _, g in b.pairs if first_read.get(g, b.after + 1) <= b.after)
            raise PassError(f"gradient {grad!r} is read for its update (op {first_read[grad]}) before the last op "
                            f"that writes its bucket (op {b.after})",
                            hint="lower config.fuse_grad_size_in_MB (0 reduces each gradient on its own)", code="E621")
    return buckets


def _itemsize(dtype: str) -> int:
    digits = "".join(c for c in dtype if c.isdigit())
    return max(1, int(digits) // 8) if digits else 1


@dataclass(frozen=True)
class GradAllReduce(Pass):
    """See the module docstring."""

    name = "grad_allreduce"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.require_collective(self.name)
        if plan.kind != GRAD_ALLREDUCE:
            raise PassError(f"pass {self.name!r} needs collective_mode 'grad_allreduce', got {plan.kind!r}")
        main = programs[ProgramRole.trainer(plan.trainer_id)].main
        block = main.global_block()
        buckets = plan_buckets(main, plan)
        backward = int(OpRole.BACKWARD)
        # Insert from the last position backwards so earlier indices stay valid.
        for ring, b in sorted(enumerate(buckets), key=lambda rb: rb[1].after, reverse=True):
            grads = [g for _, g in b.pairs]
            role_var = [n for pair in b.pairs for n in pair]
            at = b.after + 1
            block.insert_op(at, "c_allreduce_sum", {"X": grads}, {"Out": grads},
                            {"ring_id": ring % plan.nccl_comm_num, "nranks": plan.nranks, OP_ROLE_ATTR: backward,
                             OP_ROLE_VAR_ATTR: role_var})
            for k, (param, grad) in enumerate(b.pairs, start=1):
                block.insert_op(at + k, "scale", {"X": [grad]}, {"Out": [grad]},
                                {"scale": 1.0 / plan.nranks, OP_ROLE_ATTR: backward,
                                 OP_ROLE_VAR_ATTR: [param, grad]})
        return True


__all__ = ["Bucket", "DGC_OP", "GradAllReduce", "dgc_grads", "plan_buckets"]
