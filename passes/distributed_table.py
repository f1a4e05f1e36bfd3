"""Pass ``distributed_table``: rewrite the programs for a distributed lookup table (Fluid 1.5 §4.6, §5.5).

Needs: a placed plan, the trainer role and the ``pserver@<endpoint>`` roles with their startup
programs (it runs last). With no distributed table in the plan it changes nothing.

Sharding: pserver ``i`` of ``n`` holds the table rows whose global id ``r`` has ``r % n == i``, at
local row ``r // n``. Every shard declares ``ceil(rows / n)`` rows (the same for all, so the last
shards may have one unused row). Shards are NOT contiguous row ranges: the shard variable records
``slice_of = table``, ``slice_index = i`` and ``slice_offset = i`` meaning "the first global row
held"; the stride ``n`` is the ``pservers`` attribute of every pserver's ``listen_and_serv`` (set by
``pserver_program``), which the runtime uses to map global rows to local ones (the cross-program
verifier does not tile distributed tables).

Guarantees:
- trainer main: every ``lookup_table`` on the table is removed; at the first one's place
  ``split_ids`` (all ids → one shard of ids per pserver) → ``prefetch`` (one shard per pserver) →
  ``merge_ids`` (rows back in the original order, into the original outputs). Right after the op
  producing the table's gradient: ``split_ids`` on the selected-rows gradient (rows bucketed by
  ``row % n``, values copied, rows stay global ids, height stays the table's) → one ``send`` to every
  pserver; in sync mode its control output joins the ``send_barrier``. In hybrid mode (``plan.hybrid``) the
  split and send go instead right before the barriers (at the end in async mode), after the dense
  optimizer ops that stay on the trainer, so forward, backward, allreduce and the dense update compile
  as one run (a host op between them would cut it in two). Names: ``table@GRAD.pserver_<i>``,
  or ``table@GRAD.trainer_<t>.pserver_<i>`` (``copy_of``/``trainer_id`` recorded) in sync mode with
  several trainers. No recv or concat: the table never lives on the trainer (``lookup_table_grad``
  still names it as ``W``, for its height only).
- trainer startup: the init ops of the table and of its optimizer's row-shaped accumulators are
  dropped, with their variables (Fluid used ``fake_init``).
- each pserver: the shard in block 0 (a persistable dense ``[ceil(rows / n), width]`` tensor indexed by
  local row; Fluid declared it ``selected_rows``, but its initialisers write dense tensors); a table-optimize block (``sum`` and
  ``scale`` 1/trainers of the trainers' copies in sync mode, then the table's optimize ops — the
  user's SGD, Adagrad or Adam, applied sparsely, with accumulators of the shard's shape); a
  prefetch block (``lookup_sparse_table`` on the shard); a checkpoint block (``save`` of the shard).
  ``listen_and_serv`` gets the gradient inputs, ``grad_to_block_id``, ``sparse_grad_to_param``,
  ``prefetch_var_name_to_block_id`` and ``checkpoint_block_id`` entries.
- each pserver startup: the table's and its accumulators' init ops (same attributes and seeds), shape
  set to the shard's; the other inputs of the table optimizer (its beta powers) initialised whole.

Geo-SGD (``plan.geo_sgd``): the trainer programs keep the table (``trainer_send_recv`` and
``geo_sgd_startup`` add its sync); each pserver declares the shard and the delta ``table@DELTA``
(selected rows of the whole table's height, not persistable), and its table block is
``sum(table, table@DELTA) -> table``; there is no prefetch block, no optimizer and no accumulator on the
pserver; ``grad_to_block_id`` and ``sparse_grad_to_param`` map the delta.
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.core import Block, Operator, Program, Variable, copy_op
from ir.names import send_dummy_name
from ir.ops.registry import BlockRef
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OpRole

from passes.dist_plan import DistPlan, TablePlan
from passes.optimizer_ops import ACCUMULATOR_SLOTS, is_optimizer_op, param_optimize_ops
from passes.pass_base import Pass, PassContext
from passes.rpc_builders import control_var, last_writers, rpc_attrs, table_lookups

CHECKPOINT_PATH = "none"  # Fluid's kLookupTablePath placeholder: checkpoint_notify gives the directory


def table_ops(ctx: PassContext, table: TablePlan) -> list[Operator]:
    """The table's optimize ops in the input program (the optimizer, then e.g. Adam's beta-pow scales)."""
    return param_optimize_ops(ctx.origin_main, table.table)


def sharded_accumulators(ops: list[Operator]) -> list[str]:
    """Accumulators of the table's optimizer that follow the table's shape (sharded with it)."""
    out: list[str] = []
    for op in ops:
        if is_optimizer_op(op):
            for slot in ACCUMULATOR_SLOTS.get(op.type, ()):
                out += [n for n in op.input(slot) if n not in out]
    return out


@dataclass(frozen=True)
class DistributedTable(Pass):
    """See the module docstring."""

    name = "distributed_table"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        table = ctx.plan.table
        if table is None:
            return False
        plan = ctx.require_placed(self.name)
        if not plan.geo_sgd:  # a Geo-SGD trainer keeps the table (trainer_send_recv, geo_sgd_startup)
            role = programs[ProgramRole.trainer(plan.trainer_id)]
            self._rewrite_trainer(role.main.global_block(), plan, table)
            self._rewrite_trainer_startup(role.startup.global_block(), ctx, table)
        for i, ep in enumerate(plan.pservers):
            ps = programs[ProgramRole.pserver(ep)]
            self._rewrite_pserver(ps.main, ctx, plan, table, i)
            self._rewrite_pserver_startup(ps.startup, ps.main, ctx, table)
        return True

    # --- trainer
    @staticmethod
    def _rewrite_trainer(block: Block, plan: DistPlan, table: TablePlan) -> None:
        n = len(table.endpoints)
        lookups = table_lookups(block, table)
        at = block.ops.index(lookups[0])
        ids = [op.input("Ids")[0] for op in lookups]
        outs = [op.output("Out")[0] for op in lookups]
        for op in lookups:
            block.remove_op(op)
        tvar = block.var(table.table)
        ids_dtype = block.var(ids[0]).dtype
        ins = [table.prefetch_in_name(i) for i in range(n)]
        fetched = [table.prefetch_out_name(i) for i in range(n)]
        for a, b in zip(ins, fetched):
            block.add_var(Variable(name=a, shape=(-1, 1), dtype=ids_dtype))
            block.add_var(Variable(name=b, shape=(-1,) + tuple(table.shape[1:]), dtype=tvar.dtype))
        dist = {OP_ROLE_ATTR: int(OpRole.DIST)}
        block.insert_op(at, "split_ids", {"Ids": ids}, {"Out": ins}, dist)
        block.insert_op(at + 1, "prefetch", {"X": ins}, {"Out": fetched},
                        rpc_attrs(epmap=list(table.endpoints), table_names=[table.table] * n,
                                  height_sections=[table.shard_rows] * n, trainer_id=plan.trainer_id))
        block.insert_op(at + 2, "merge_ids", {"Ids": ids, "Rows": ins, "X": fetched}, {"Out": outs}, dist)

        gvar = block.var(table.grad)
        tid = plan.trainer_id if plan.uses_trainer_copies else None
        shards = []
        for i in range(n):
            name = table.shard_grad_name(i, tid)
            block.add_var(Variable(name=name, shape=gvar.shape, dtype=gvar.dtype, type="selected_rows",
                                   copy_of=table.shard_grad_name(i) if tid is not None else None, trainer_id=tid))
            shards.append(name)
        at = last_writers(block, [table.grad])[table.grad] + 1
        if plan.hybrid:
            at = next((i for i, op in enumerate(block.ops) if op.type in ("send_barrier", "fetch_barrier")),
                      len(block.ops))
        block.insert_op(at, "split_ids", {"Ids": [table.grad]}, {"Out": shards}, dist)
        dummy = send_dummy_name(table.grad)
        control_var(block, dummy)
        block.insert_op(at + 1, "send", {"X": shards}, {"Out": [dummy]},
                        rpc_attrs(epmap=list(table.endpoints), sync_mode=not plan.sync_mode,
                                  trainer_id=plan.trainer_id, **{OP_ROLE_VAR_ATTR: [table.table, table.grad]}))
        for op in block.ops:
            if op.type == "send_barrier":
                op.set_input("X", list(op.input("X")) + [dummy])

    @staticmethod
    def _rewrite_trainer_startup(block: Block, ctx: PassContext, table: TablePlan) -> None:
        doomed = {table.table, *sharded_accumulators(table_ops(ctx, table))}
        for op in [op for op in block.ops if set(op.output_arg_names) & doomed]:
            block.remove_op(op)
        for name in sorted(doomed):
            if block.has_var(name):
                block.remove_var(name)

    # --- pservers
    def _rewrite_pserver(self, prog: Program, ctx: PassContext, plan: DistPlan, table: TablePlan, i: int) -> None:
        g = prog.global_block()
        ob = ctx.origin_main.global_block()
        serv = next(op for op in g.ops if op.type == "listen_and_serv")
        tvar = ob.var(table.table)
        g.add_var(tvar.replace(shape=table.shard_shape, persistable=True,
                               slice_of=table.table, slice_index=i, slice_offset=i))
        gvar = ob.var(table.grad)
        if plan.geo_sgd:
            merged = Variable(name=table.delta_name, shape=gvar.shape, dtype=gvar.dtype, type="selected_rows")
        else:
            merged = Variable(name=table.shard_grad_name(i), shape=gvar.shape, dtype=gvar.dtype,
                              type="selected_rows", persistable=True)
        g.add_var(merged)
        inputs = [merged.name]
        if plan.uses_trainer_copies:
            inputs = [table.shard_grad_name(i, t) for t in range(plan.trainers)]
            for t, name in enumerate(inputs):
                g.add_var(merged.replace(name=name, persistable=False, copy_of=merged.name, trainer_id=t))

        opt_blocks = [b.idx for b in serv.attr("optimize_blocks")]
        lr_block = serv.attr("lr_decay_block_id")
        param_blocks = [b for b in opt_blocks if b != lr_block]
        if param_blocks:
            parent = prog.block(param_blocks[0]).parent_idx
        else:
            parent = prog.num_blocks - 1 if lr_block >= 0 else 0
        tblk = prog.create_block(parent)
        prog.rollback()
        if plan.geo_sgd:
            tblk.append_op("sum", {"X": [table.table, merged.name]}, {"Out": [table.table]},
                           {OP_ROLE_ATTR: int(OpRole.OPTIMIZE), OP_ROLE_VAR_ATTR: [table.table, merged.name],
                            "use_mkldnn": False})
        else:
            self._fill_table_block(tblk, ob, plan, table, merged.name, inputs, table_ops(ctx, table))
            ids_dtype = "int64"
            pin, pout = table.prefetch_in_name(i), table.prefetch_out_name(i)
            g.add_var(Variable(name=pin, shape=(-1, 1), dtype=ids_dtype))
            g.add_var(Variable(name=pout, shape=(-1,) + tuple(table.shape[1:]), dtype=tvar.dtype))
            pblk = prog.create_block(tblk.idx)
            prog.rollback()
            pblk.append_op("lookup_sparse_table", {"W": [table.table], "Ids": [pin]}, {"Out": [pout]},
                           {"is_sparse": True, "is_distributed": True, "padding_idx": -1,
                            OP_ROLE_ATTR: int(OpRole.OPTIMIZE)})
            serv.set_attr("prefetch_var_name_to_block_id",
                          list(serv.attr("prefetch_var_name_to_block_id")) + [f"{pin}:{pblk.idx}"])
        cblk = prog.create_block(tblk.idx)
        prog.rollback()
        cblk.append_op("save", {"X": [table.table]}, {}, {"file_path": CHECKPOINT_PATH,
                                                          OP_ROLE_ATTR: int(OpRole.OPTIMIZE)})

        serv.set_input("X", list(serv.input("X")) + inputs)
        serv.set_attr("optimize_blocks", [BlockRef(b) for b in opt_blocks + [tblk.idx]])
        serv.set_attr("grad_to_block_id", list(serv.attr("grad_to_block_id")) + [f"{merged.name}:{tblk.idx}"])
        serv.set_attr("sparse_grad_to_param",
                      list(serv.attr("sparse_grad_to_param")) + [f"{merged.name}:{table.table}"])
        serv.set_attr("checkpoint_block_id", cblk.idx)

    @staticmethod
    def _fill_table_block(blk: Block, ob: Block, plan: DistPlan, table: TablePlan, merged: str,
                          inputs: list[str], ops: list[Operator]) -> None:
        g = blk.program.global_block()
        attrs = {OP_ROLE_ATTR: int(OpRole.OPTIMIZE), OP_ROLE_VAR_ATTR: [table.table, merged]}
        if plan.uses_trainer_copies:
            blk.append_op("sum", {"X": inputs}, {"Out": [merged]}, {**attrs, "use_mkldnn": False})
            blk.append_op("scale", {"X": [merged]}, {"Out": [merged]}, {**attrs, "scale": 1.0 / plan.trainers})
        sharded = set(sharded_accumulators(ops))
        rename = {table.grad: merged}
        for op in ops:
            for n in op.input_arg_names + op.output_arg_names:
                if n in rename or n == table.table or g.has_var(n) or blk.has_var(n):
                    continue
                var = ob.var_recursive(n)
                if not var.persistable:
                    blk.add_var(var)
                elif n in sharded:
                    g.add_var(var.replace(shape=table.shard_shape))
                else:
                    g.add_var(var)
            copy_op(blk, op, rename)

    @staticmethod
    def _rewrite_pserver_startup(startup: Program, main: Program, ctx: PassContext, table: TablePlan) -> None:
        """Initialise what the table added to block 0 and the startup does not initialise yet."""
        g = startup.global_block()
        mg = main.global_block()
        for v in mg.vars.values():
            if not g.has_var(v.name):
                g.add_var(v)
        done = {n for op in g.ops for n in op.output_arg_names}
        wanted = {table.table}
        if not ctx.plan.geo_sgd:  # the table's optimizer runs here
            wanted.update(n for op in table_ops(ctx, table) for n in op.input_arg_names)
        src = ctx.origin_startup.global_block()
        for op in src.ops:
            outs = op.output_arg_names
            if not outs or outs[0] not in wanted or outs[0] in done or not mg.has_var(outs[0]):
                continue
            new = copy_op(g, op, {})
            shape = list(mg.var(outs[0]).shape)
            if new.has_attr("shape") and list(new.attr("shape")) != shape:
                new.set_attr("shape", shape)
            done.add(outs[0])
