"""Pass ``trainer_send_recv``: rewrite the trainer's main program for the parameter servers.

Needs: a placed plan and the role ``trainer.<id>`` whose main program is a clone of the input.
Guarantees, as Fluid 1.5 (``transpile`` + ``get_trainer_program``):
- optimizer, regularizer, clip and learning-rate ops are gone (they run on the pservers), and so are
  the variables only they used;
- in sync mode with several trainers a gradient with one block is renamed to its trainer copy
  (``g.trainer_<id>``, recorded as ``copy_of``/``trainer_id``);
- after the backward (right after the last op that is a backward op or writes a sent gradient, so
  the forward and backward compile as one run): first every ``split_byref`` (``split_selected_rows``
  for a sparse gradient) of a gradient with several blocks, then every ``send`` (one endpoint per
  block), both in the order the gradients are completed (by last writer; gradients with the same last
  writer in reverse plan order, as Fluid's one-by-one insertion left them);
- after everything: ``send_barrier`` (sync), one ``recv`` per parameter, ``fetch_barrier`` (sync),
  and ``concat`` of the blocks of every sliced parameter.
Control-dependency variables are ``raw`` with shape ``[]`` and deterministic names.

Hybrid mode (``plan.hybrid``): the plan has no dense parameter, so only the distributed table's optimize
ops leave the trainer (the dense ones and the learning-rate ops stay, for the allreduced update there);
nothing is split, sent or received here (``distributed_table`` sends the table's gradient), and in sync
mode ``send_barrier`` and ``fetch_barrier`` still close every step.

Geo-SGD (``plan.geo_sgd``): every parameter trains locally, the distributed table included (the
trainer holds the whole table and its optimizer state, as Fluid 1.6's Geo-SGD does), so no op is
dropped and no gradient is split, sent or received; one ``geo_sync`` op is appended last, over every
planned parameter in plan order (``X``/``Out``), their snapshots (``<param>@GEO_SNAPSHOT``, persistable,
``copy_of`` the parameter; ``Snapshot``/``SnapshotOut``) and the persistable int64 step counter
``@GEO_SGD_STEP@`` (``Step``/``StepOut``), with each block's endpoint, rows, pserver name and delta name
(``VarBlock.delta_name``) and ``push_nums`` = k. With a distributed table it also takes the table
(``Table``/``TableOut``), its snapshot (``TableSnapshot``/``TableSnapshotOut``), the ids of every lookup
of it (``TableIds``), a persistable bool ``[rows]`` mask of the rows looked up since the last sync
(``table@GEO_TOUCHED``; ``Touched``/``TouchedOut``), the shards' endpoints (``table_epmap``), the delta's
name (``TablePlan.delta_name``) and the updates' name (``ir.names.geo_updates_name``).
(``geo_sgd_startup`` initialises the state.)
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.core import Block, Parameter, Program, Variable
from ir.names import FETCH_BARRIER_OUT, GEO_STEP_VAR, SEND_BARRIER_OUT, geo_updates_name, send_dummy_name
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OpRole

from passes.dist_plan import DistPlan, ParamPlan
from passes.optimizer_ops import lr_ops, optimize_ops, param_optimize_ops
from passes.pass_base import Pass, PassContext
from passes.rpc_builders import (control_var, geo_state_vars, geo_table_state_vars, last_writers, param_block_vars,
                                 rpc_attrs, table_lookups)

def remove_unused_vars(block: Block) -> None:
    """Drop variables no op of the program uses, except parameters and fed data."""
    used = {n for b in block.program.blocks for op in b.ops for table in (op.inputs, op.outputs)
            for names in table.values() for n in names}
    for name, var in list(block.vars.items()):
        if name not in used and not isinstance(var, Parameter) and not var.is_data:
            block.remove_var(name)


@dataclass(frozen=True)
class TrainerSendRecv(Pass):
    """See the module docstring."""

    name = "trainer_send_recv"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.require_placed(self.name)
        program = programs[ProgramRole.trainer(plan.trainer_id)].main
        block = program.global_block()
        if plan.geo_sgd:
            self._geo_sync(program, plan)
            return True
        self._drop_optimize_ops(program, plan)
        sent: dict[str, list[str]] = {}
        # Unsliced gradients are renamed to their trainer copies in one pass over the ops.
        renames = {pp.grad: plan.trainer_grad_name(pp.grad_blocks[0]) for pp in plan.params if not pp.is_sliced}
        renames = {old: new for old, new in renames.items() if old != new}
        block.rename_vars(renames)
        for old, new in renames.items():
            block.replace_var(new, copy_of=old, trainer_id=plan.trainer_id)
        # Variables are declared in plan order. The splits and sends all go after the backward: a send
        # is a host op, and one between two backward ops would cut the compiled step in two (the
        # executor jits maximal runs of pure ops). The splits come first, for the same reason.
        produced = [pp.grad if pp.is_sliced else plan.trainer_grad_name(pp.grad_blocks[0]) for pp in plan.params]
        writers = last_writers(block, produced)
        for pp in plan.params:
            sent[pp.param] = self._declare_send_vars(block, plan, pp)
        order = [plan.params[k] for k in sorted(range(len(plan.params)), key=lambda k: (writers[produced[k]], -k))]
        at = max([*writers.values(), last_backward_op(block)]) + 1
        for pp in order:
            at = self._insert_split(block, pp, sent[pp.param], at)
        for pp in order:
            at = self._insert_send(block, plan, pp, sent[pp.param], at)
        dummies = [send_dummy_name(pp.grad) for pp in plan.params]
        barrier = [SEND_BARRIER_OUT]
        if plan.sync_mode:
            control_var(block, SEND_BARRIER_OUT)
            block.append_op("send_barrier", {"X": dummies}, {"Out": [SEND_BARRIER_OUT]},
                            rpc_attrs(endpoints=list(plan.pservers), trainer_id=plan.trainer_id, sync_mode=True))
        received: list[str] = []
        for pp in plan.params:
            outs = param_block_vars(block, pp)
            received += outs
            deps = barrier if plan.sync_mode else [send_dummy_name(pp.grad)]
            role_grad = sent[pp.param][0] if not pp.is_sliced else pp.grad
            block.append_op("recv", {"X": deps}, {"Out": outs},
                            rpc_attrs(epmap=list(pp.endpoints), trainer_id=plan.trainer_id,
                                      sync_mode=not plan.sync_mode, **{OP_ROLE_VAR_ATTR: [pp.param, role_grad]}))
        if plan.sync_mode:
            control_var(block, FETCH_BARRIER_OUT)
            block.append_op("fetch_barrier", {"X": received}, {"Out": [FETCH_BARRIER_OUT]},
                            rpc_attrs(endpoints=list(plan.pservers), trainer_id=plan.trainer_id))
        for pp in plan.params:
            if pp.is_sliced:
                block.append_op("concat", {"X": [b.name for b in pp.param_blocks]}, {"Out": [pp.param]},
                                {"axis": 0, OP_ROLE_ATTR: int(OpRole.DIST)})
        remove_unused_vars(block)
        return True

    @staticmethod
    def _geo_sync(program: Program, plan: DistPlan) -> None:
        """Geo-SGD: keep every op, append ``geo_sync`` (module docstring)."""
        block = program.global_block()
        if not plan.params and plan.table is None:
            return
        state = geo_state_vars(block, plan)
        ins: dict[str, list[str]] = {"X": [pp.param for pp in plan.params], "Snapshot": [v.name for v in state[1:]],
                                     "Step": [GEO_STEP_VAR]}
        outs = {"Out": ins["X"], "SnapshotOut": ins["Snapshot"], "StepOut": [GEO_STEP_VAR]}
        blocks = [b for pp in plan.params for b in pp.param_blocks]
        attrs = rpc_attrs(block_counts=[len(pp.param_blocks) for pp in plan.params], sections=[b.rows for b in blocks],
                          epmap=[ep for pp in plan.params for ep in pp.endpoints],
                          block_names=[b.name for b in blocks], delta_names=[b.delta_name for b in blocks],
                          push_nums=plan.geo_sgd_push_nums, trainer_id=plan.trainer_id)
        table = plan.table
        if table is not None:
            snapshot, touched = geo_table_state_vars(block, table)
            ids = list(dict.fromkeys(op.input("Ids")[0] for op in table_lookups(block, table)))
            ins.update(Table=[table.table], TableSnapshot=[snapshot.name], TableIds=ids, Touched=[touched.name])
            outs.update(TableOut=[table.table], TableSnapshotOut=[snapshot.name], TouchedOut=[touched.name])
            attrs.update(table_epmap=list(table.endpoints), table_delta_name=table.delta_name,
                         table_updates_name=geo_updates_name(table.table))
        block.append_op("geo_sync", ins, outs, attrs)
        remove_unused_vars(block)

    @staticmethod
    def _drop_optimize_ops(program: Program, plan: DistPlan) -> None:
        block = program.global_block()
        if plan.hybrid:  # only the table is updated on the pservers
            doomed = {id(op) for op in param_optimize_ops(program, plan.table.table)} if plan.table else set()
        else:
            doomed = {id(op) for op in optimize_ops(program) + lr_ops(program)}
        # By index, from the end: removing by op would search the block once per op.
        for index in reversed([i for i, op in enumerate(block.ops) if id(op) in doomed]):
            block.remove_op(index)

    @staticmethod
    def _declare_send_vars(block: Block, plan: DistPlan, pp: ParamPlan) -> list[str]:
        """Declare the gradient blocks ``pp``'s gradient is sent as (one per slice, sliced gradients)
        and its send's control output; return the names sent. An unsliced gradient is sent under its
        trainer copy's name (renamed by ``run``)."""
        if not pp.is_sliced:
            names = [plan.trainer_grad_name(pp.grad_blocks[0])]
        else:
            gvar = block.var(pp.grad)
            names = []
            for b in pp.grad_blocks:
                n = plan.trainer_grad_name(b)
                block.add_var(Variable(name=n, shape=b.shape, dtype=gvar.dtype, type=gvar.type,
                                       slice_of=pp.grad, slice_index=b.index, slice_offset=b.offset_rows,
                                       copy_of=b.name if n != b.name else None,
                                       trainer_id=plan.trainer_id if n != b.name else None))
                names.append(n)
        control_var(block, send_dummy_name(pp.grad))
        return names

    @staticmethod
    def _insert_split(block: Block, pp: ParamPlan, names: list[str], at: int) -> int:
        """Insert at ``at`` the op splitting ``pp``'s gradient into its blocks ``names``, when it has
        several; return the position after it."""
        if not pp.is_sliced:
            return at
        split = "split_selected_rows" if pp.sparse else "split_byref"
        sections = "height_sections" if pp.sparse else "sections"
        block.insert_op(at, split, {"X": [pp.grad]}, {"Out": names},
                        {sections: pp.sections, OP_ROLE_ATTR: int(OpRole.DIST)})
        return at + 1

    @staticmethod
    def _insert_send(block: Block, plan: DistPlan, pp: ParamPlan, names: list[str], at: int) -> int:
        """Insert at ``at`` the send of ``pp``'s gradient, as ``names``; return the position after it."""
        role_grad = names[0] if not pp.is_sliced else pp.grad
        block.insert_op(at, "send", {"X": names}, {"Out": [send_dummy_name(pp.grad)]},
                        rpc_attrs(epmap=list(pp.endpoints), sync_mode=not plan.sync_mode, trainer_id=plan.trainer_id,
                                  **{OP_ROLE_VAR_ATTR: [pp.param, role_grad]}))
        return at + 1


def last_backward_op(block: Block) -> int:
    """The index of the last backward op of ``block`` (-1 when there is none)."""
    for i in range(len(block.ops) - 1, -1, -1):
        if block.ops[i].role & OpRole.BACKWARD:
            return i
    return -1
