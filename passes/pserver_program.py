"""Pass ``pserver_program``: build one main program per pserver endpoint (Fluid 1.5 §5).

Needs: a placed plan. Adds the role ``pserver@<endpoint>`` for every endpoint, in the user's
order, with an empty startup program (``pserver_startup`` fills it).

Guarantees, per endpoint:
- block 0 declares the endpoint's parameter slices (persistable, ``slice_of`` recorded), the merged
  gradient of each slice (persistable) and, in sync mode with several trainers, the per-trainer
  copies (``copy_of``/``trainer_id``); then one ``listen_and_serv`` (appended last);
- if the input has learning-rate ops, block 1 (parent 0) holds clones of them (and clones of any
  sub-block they own); their variables are declared in block 0; the parameter blocks then have the
  last learning-rate block as parent so the runtime runs it first;
- one block per (optimizer op, owned slice of its parameter), in optimizer-op order: ``sum`` of the
  trainer copies and ``scale`` 1/trainers (sync, trainers > 1), then the parameter's other optimize
  ops (regularizer, clip) and its optimizer op, mapped onto the slice. Accumulators that follow the
  parameter's shape are sliced with it; optimizer state the ops write (beta powers) stays whole.
  For a sliced parameter both get the block name (``acc.block<i>``, with ``slice_of``/``copy_of``),
  so two slices on one endpoint never share state; read-only inputs (the learning rate) keep their
  names. Temporaries live in the optimize block itself.
- an endpoint owning nothing (and no distributed table) gets one empty optimize block and a warning.
- DC-ASGD (``enable_dc_asgd``, async): per slice and trainer a backup ``<slice>.trainer_<k>_bak``
  (``copy_of``/``trainer_id``) in block 0; the optimize block starts with ``ref_by_trainer_id`` and the
  compensation ``g + g*g*(w - bak)`` that the optimizer op then uses as ``Grad``.
- Geo-SGD (``plan.geo_sgd``): instead of the merged gradient, block 0 declares each owned slice's
  delta (``VarBlock.delta_name``, same shape and dtype, received as is) and the slice's optimize
  block is ``sum(slice, delta) -> slice``; ``grad_to_block_id`` maps the deltas; there is no
  learning-rate block; ``distributed_mode`` is 3. (The trainers run every optimizer, the distributed
  table's too: see ``distributed_table``.)
- ``grad_to_block_id`` lists ``"<merged grad>:<block>"`` in block order; ``pservers`` is the number of
  pserver endpoints (the row stride of a distributed table's shards).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

from ir.core import Block, Operator, Program, Variable, copy_op
from ir.names import TRAINER_ID_VAR, block_name, dc_asgd_backup_name, dc_asgd_local_name, dc_asgd_temp_name
from ir.ops.registry import BlockRef
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OP_ROLE_ATTR, OpRole

from passes.dist_plan import DistPlan, ParamPlan
from passes.optimizer_ops import ACCUMULATOR_SLOTS, is_optimizer_op, lr_ops, optimize_ops
from passes.pass_base import Pass, PassContext, PassError


class _OriginOps(NamedTuple):
    lr: list[Operator]
    chains: dict[str, list[Operator]]  # parameter -> its optimize ops, in program order
    updates: list[tuple[str, ParamPlan]]  # (parameter, its plan) of each optimizer op on a planned parameter

    @classmethod
    def of(cls, origin: Program, plan: DistPlan) -> "_OriginOps":
        opt_ops = optimize_ops(origin)
        chains: dict[str, list[Operator]] = {}
        for op in opt_ops:
            rv = op.role_var
            if rv:
                chains.setdefault(rv[0], []).append(op)
        updates = []
        for op in opt_ops:
            if is_optimizer_op(op):
                param = op.input("Param")[0]
                if plan.has_param(param):
                    updates.append((param, plan.param_plan(param)))
        return cls([] if plan.geo_sgd else lr_ops(origin), chains, updates)


@dataclass(frozen=True)
class PserverProgram(Pass):
    """See the module docstring."""

    name = "pserver_program"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.require_placed(self.name)
        # The input's optimize and learning-rate ops, found once for every endpoint.
        origin_ops = _OriginOps.of(ctx.origin_main, plan)
        for ep in plan.pservers:
            programs.add(ProgramRole.pserver(ep), self.build(ctx, plan, ep, origin_ops), Program())
        return True

    def build(self, ctx: PassContext, plan: DistPlan, ep: str, origin_ops: _OriginOps) -> Program:
        origin = ctx.origin_main
        ob = origin.global_block()
        prog = Program()
        prog.random_seed = origin.random_seed
        g = prog.global_block()
        owned = plan.blocks_on(ep)
        inputs: list[str] = []
        for pp, i in owned:
            b = pp.param_blocks[i]
            pvar = ob.var(pp.param)
            if b.is_slice:
                g.add_var(pvar.replace(name=b.name, shape=b.shape, slice_of=pp.param, slice_index=i,
                                       slice_offset=b.offset_rows))
            else:
                g.add_var(pvar)
        for pp, i in owned:
            if plan.geo_sgd:
                pb = pp.param_blocks[i]
                g.add_var(Variable(name=pb.delta_name, shape=pb.shape, dtype=ob.var(pp.param).dtype))
                inputs.append(pb.delta_name)
                continue
            gb = pp.grad_blocks[i]
            gvar = ob.var(pp.grad)
            merged = Variable(name=gb.name, shape=gb.shape, dtype=gvar.dtype, type=gvar.type, persistable=True,
                              slice_of=pp.grad if gb.is_slice else None, slice_index=i if gb.is_slice else None,
                              slice_offset=gb.offset_rows if gb.is_slice else None)
            g.add_var(merged)
            if plan.uses_trainer_copies:
                for t in range(plan.trainers):
                    name = plan.trainer_grad_name(gb, t)
                    g.add_var(merged.replace(name=name, persistable=False, slice_of=None, slice_index=None,
                                             slice_offset=None, copy_of=gb.name, trainer_id=t))
                    inputs.append(name)
            else:
                inputs.append(gb.name)
        opt_blocks: list[int] = []
        lr_block = -1
        lrs = origin_ops.lr  # none with Geo-SGD: every optimizer runs on the trainers
        if lrs:
            lr_block = self._lr_block(origin, prog, lrs)
            opt_blocks.append(lr_block)
        pre_block = prog.num_blocks - 1
        grad_to_block: list[str] = []
        sparse_to_param: list[str] = []
        chains = origin_ops.chains
        owned_blocks: dict[str, list[int]] = {}
        for owned_pp, i in owned:
            owned_blocks.setdefault(owned_pp.param, []).append(i)
        for param, pp in origin_ops.updates:
            for i in owned_blocks.get(param, ()):
                blk = prog.create_block(pre_block)
                prog.rollback()
                opt_blocks.append(blk.idx)
                if plan.geo_sgd:
                    pb = pp.param_blocks[i]
                    blk.append_op("sum", {"X": [pb.name, pb.delta_name]}, {"Out": [pb.name]},
                                  {OP_ROLE_ATTR: int(OpRole.OPTIMIZE), "use_mkldnn": False})
                    grad_to_block.append(f"{pb.delta_name}:{blk.idx}")
                    continue
                self._fill_block(blk, ob, plan, pp, i, chains.get(pp.param, []))
                grad_to_block.append(f"{pp.grad_blocks[i].name}:{blk.idx}")
                if pp.sparse:
                    sparse_to_param.append(f"{pp.grad_blocks[i].name}:{pp.param_blocks[i].name}")
        if len(opt_blocks) == (1 if lrs else 0) and plan.table is None:
            blk = prog.create_block(prog.num_blocks - 1)
            prog.rollback()
            opt_blocks.append(blk.idx)
            message = f"pserver {ep} holds no parameter block: it gets one empty optimize block"
            warnings.warn(message, stacklevel=2)
            ctx.warnings.append(message)
        g.append_op("listen_and_serv", {"X": inputs}, {}, {
            "endpoint": ep, "Fanin": plan.trainers, "optimize_blocks": [BlockRef(b) for b in opt_blocks],
            "grad_to_block_id": grad_to_block, "sparse_grad_to_param": sparse_to_param,
            "sync_mode": plan.sync_mode, "pserver_id": plan.endpoint_index(ep), "lr_decay_block_id": lr_block,
            "distributed_mode": 0 if plan.sync_mode else 3 if plan.geo_sgd else 1, "dc_asgd": plan.enable_dc_asgd,
            "pservers": len(plan.pservers), OP_ROLE_ATTR: int(OpRole.RPC)})
        return prog

    def _lr_block(self, origin: Program, prog: Program, lrs: list[Operator]) -> int:
        g = prog.global_block()
        ob = origin.global_block()
        blk = prog.create_block(0)
        prog.rollback()
        block_map: dict[int, int] = {}
        for op in lrs:
            for n in op.input_arg_names + op.output_arg_names:
                if not g.has_var(n):
                    g.add_var(ob.var_recursive(n))
            for v in op.attrs.values():
                for ref in ([v] if isinstance(v, BlockRef) else v if isinstance(v, list) else []):
                    if isinstance(ref, BlockRef):
                        self._clone_sub_block(origin, prog, ref.idx, blk.idx, block_map)
            copy_op(blk, op, {}, block_map)
        return blk.idx

    def _clone_sub_block(self, origin: Program, prog: Program, src: int, parent: int,
                         block_map: dict[int, int]) -> None:
        sb = origin.block(src)
        nb = prog.create_block(parent)
        prog.rollback()
        block_map[src] = nb.idx
        for v in sb.vars.values():
            nb.add_var(v)
        for op in sb.ops:
            for v in op.attrs.values():
                for ref in ([v] if isinstance(v, BlockRef) else v if isinstance(v, list) else []):
                    if isinstance(ref, BlockRef) and ref.idx not in block_map:
                        self._clone_sub_block(origin, prog, ref.idx, nb.idx, block_map)
            copy_op(nb, op, {}, block_map)

    def _fill_block(self, blk: Block, ob: Block, plan: DistPlan, pp: ParamPlan, i: int,
                    chain: list[Operator]) -> None:
        """Fill optimize block ``blk`` for block ``i`` of ``pp``'s parameter; ``chain`` is the
        parameter's optimize ops (``op_role_var`` naming it first), in program order."""
        prog = blk.program
        g = prog.global_block()
        pb, gb = pp.param_blocks[i], pp.grad_blocks[i]
        attrs = {OP_ROLE_ATTR: int(OpRole.OPTIMIZE)}
        if plan.uses_trainer_copies:
            copies = [plan.trainer_grad_name(gb, t) for t in range(plan.trainers)]
            blk.append_op("sum", {"X": copies}, {"Out": [gb.name]}, {**attrs, "use_mkldnn": False})
            blk.append_op("scale", {"X": [gb.name]}, {"Out": [gb.name]}, {**attrs, "scale": 1.0 / plan.trainers})
        dc_grad = _dc_asgd_ops(blk, plan, pp, i) if plan.enable_dc_asgd else None
        written = {n for op in chain for n in op.output_arg_names}
        rename = {pp.param: pb.name, pp.grad: gb.name}
        for op in chain:
            sliced = set()
            if is_optimizer_op(op):
                for slot in ACCUMULATOR_SLOTS.get(op.type, ()):
                    sliced.update(op.input(slot))
            for n in op.input_arg_names + op.output_arg_names:
                if n in rename or g.has_var(n):
                    continue  # mapped already, or a global such as the learning rate of the lr block
                var = ob.var_recursive(n)
                if not var.persistable:
                    if not blk.has_var(n):
                        blk.add_var(var)
                    continue
                if n in sliced:
                    name = block_name(n, i) if pp.is_sliced else n
                    new = var.replace(name=name, shape=(pb.rows,) + tuple(var.shape[1:]),
                                      slice_of=n if pp.is_sliced else None,
                                      slice_index=i if pp.is_sliced else None,
                                      slice_offset=pb.offset_rows if pp.is_sliced else None)
                elif n in written and pp.is_sliced:
                    new = var.replace(name=block_name(n, i), copy_of=n)
                else:
                    new = var
                rename[n] = new.name
                if not g.has_var(new.name):
                    g.add_var(new)
            copied = copy_op(blk, op, rename)
            if dc_grad is not None and is_optimizer_op(op):
                copied.set_input("Grad", [dc_grad])


def _dc_asgd_ops(blk: Block, plan: DistPlan, pp: ParamPlan, i: int) -> str:
    """DC-ASGD (Fluid 1.5): declare the per-trainer backups of the slice in block 0 and append
    ``ref_by_trainer_id`` → ``elementwise_sub`` → ``elementwise_mul`` ×2 → ``elementwise_add``, computing
    ``g + g * g * (w - w_bak[trainer])`` (lambda = 1, as Fluid). Returns the compensated gradient."""
    if pp.sparse:
        raise PassError(f"enable_dc_asgd cannot compensate the sparse (selected_rows) gradient of {pp.param!r}",
                        hint="disable enable_dc_asgd, or use a dense parameter", code="E641")
    g = blk.program.global_block()
    pb, gb = pp.param_blocks[i], pp.grad_blocks[i]
    pvar = g.var(pb.name)
    baks = []
    for t in range(plan.trainers):
        name = dc_asgd_backup_name(pb.name, t)
        if not g.has_var(name):
            g.add_var(Variable(name=name, shape=pb.shape, dtype=pvar.dtype, persistable=True, copy_of=pb.name,
                               trainer_id=t))
        baks.append(name)
    if not g.has_var(TRAINER_ID_VAR):
        g.add_var(Variable(name=TRAINER_ID_VAR, shape=(1,), dtype="int64"))
    tmp = [dc_asgd_local_name(pb.name)] + [dc_asgd_temp_name(gb.name, k) for k in range(4)]
    for name in tmp:
        blk.add_var(Variable(name=name, shape=pb.shape, dtype=pvar.dtype))
    attrs = {OP_ROLE_ATTR: int(OpRole.OPTIMIZE)}
    ew = {**attrs, "axis": -1}
    blk.append_op("ref_by_trainer_id", {"X": baks, "TrainerId": [TRAINER_ID_VAR]}, {"Out": [tmp[0]]}, attrs)
    blk.append_op("elementwise_sub", {"X": [pb.name], "Y": [tmp[0]]}, {"Out": [tmp[1]]}, ew)
    blk.append_op("elementwise_mul", {"X": [tmp[1]], "Y": [gb.name]}, {"Out": [tmp[2]]}, ew)
    blk.append_op("elementwise_mul", {"X": [tmp[2]], "Y": [gb.name]}, {"Out": [tmp[3]]}, ew)
    blk.append_op("elementwise_add", {"X": [gb.name], "Y": [tmp[3]]}, {"Out": [tmp[4]]}, ew)
    return tmp[4]
