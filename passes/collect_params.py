"""Pass ``collect_params``: find the trained (parameter, gradient) pairs and the distributed table.

Reads ``op_role_var`` of the ops whose role is exactly Optimize, in program order; a parameter is
recorded the first time any such op mentions it (regularizer and clip ops included), as Fluid does.
Non-trainable parameters are skipped. The distributed lookup table (``lookup_table`` ops with
``is_distributed=True``) is recorded apart, as a ``TablePlan``, and is not sliced by the normal path.

Guarantees: ``ctx.plan.params`` lists every trained parameter once, in that order, with
``sparse`` set when its gradient is ``selected_rows``; ``ctx.plan.table`` is set when there is a
distributed table. Raises ``PassError`` when there is no optimizer op (E601), several distributed
tables (E602), an optimizer op the pserver cannot run (E603), or a distributed table whose
optimizer has no sparse update (E604).

Hybrid mode (``plan.hybrid``): only the distributed table goes to the pservers, so ``params`` stays empty
and only the table's optimizer must run on a pserver (the dense optimizers stay on the trainers); a
program without a distributed table is refused (E605: it is plain nccl2 training).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ir.core import Block, Operator, Parameter
from ir.names import grad_name
from ir.program_set import ProgramSet

from passes.dist_plan import ParamPlan, TablePlan
from passes.optimizer_ops import ACCUMULATOR_SLOTS, is_optimizer_op, optimize_ops
from passes.pass_base import Pass, PassContext, PassError

SPARSE_TABLE_OPTIMIZERS = ("sgd", "adagrad", "adam")  # the optimizers a distributed table can update sparsely


def find_distributed_table(block: Block) -> str | None:
    tables: list[str] = []
    for op in block.ops:
        if op.type == "lookup_table" and op.attr("is_distributed", False):
            w = op.input("W")[0]
            if w not in tables:
                tables.append(w)
    if len(tables) > 1:
        raise PassError(f"found {len(tables)} distributed lookup tables {tables}; expected at most one",
                        hint="share one table (the same param_attr name) between the distributed embeddings",
                        code="E602")
    return tables[0] if tables else None


@dataclass(frozen=True)
class CollectParams(Pass):
    """Needs: the origin program in ``ctx``. Guarantees: see the module docstring."""

    name = "collect_params"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        program = ctx.origin_main
        block = program.global_block()
        ops = optimize_ops(program)
        if not ops:
            raise PassError("the program has no optimizer ops (no op with op_role == Optimize)",
                            hint="call optimizer.minimize(loss) on the program before transpiling", code="E601")
        table_name = find_distributed_table(block)
        hybrid = ctx.plan.hybrid
        if hybrid and table_name is None:
            raise PassError("hybrid mode needs a distributed lookup table (an embedding with is_distributed=True), "
                            "but the program has none", hint="use config.mode = 'nccl2' to allreduce every "
                            "gradient, or make the large embedding distributed", code="E605")
        for op in ops:
            on_pserver = not hybrid or op.input("Param") == [table_name]
            if is_optimizer_op(op) and op.type not in ACCUMULATOR_SLOTS and on_pserver:
                raise PassError(f"optimizer op {op.type!r} cannot run on a parameter server; expected one of "
                                f"{sorted(ACCUMULATOR_SLOTS)}", hint="use a supported optimizer", code="E603")
        pairs: dict[str, str] = {}
        for op in ops:
            rv = op.role_var
            for i in range(0, len(rv) - 1, 2):
                param, grad = rv[i], rv[i + 1]
                if hybrid or param in pairs or param == table_name:
                    continue
                var = block.find_var_recursive(param)
                if not isinstance(var, Parameter) or not var.trainable:
                    continue
                pairs[param] = grad
        params = tuple(ParamPlan(param=p, grad=g, sparse=block.var(g).type == "selected_rows")
                       for p, g in pairs.items())
        table = None
        if table_name is not None:
            table = self._table_plan(block, ops, table_name, ctx.plan.pservers)
        ctx.plan = dataclasses.replace(ctx.plan, params=params, table=table)
        return True

    @staticmethod
    def _table_plan(block: Block, ops: list[Operator], table: str, pservers: tuple[str, ...]) -> TablePlan:
        opt = [op for op in ops if is_optimizer_op(op) and op.input("Param") == [table]]
        if not opt:
            raise PassError(f"the distributed lookup table {table!r} has no optimizer op",
                            hint="make the table trainable and call minimize", code="E604")
        kind = opt[0].type
        if kind not in SPARSE_TABLE_OPTIMIZERS:
            raise PassError(f"the distributed lookup table {table!r} uses optimizer {kind!r}, which has no sparse "
                            f"update on the pserver; expected one of {list(SPARSE_TABLE_OPTIMIZERS)}",
                            hint="use SGD, Adagrad or Adam for a model with a distributed table", code="E604")
        grad = opt[0].role_var[1] if len(opt[0].role_var) >= 2 else grad_name(table)
        return TablePlan(table=table, grad=grad, shape=tuple(block.var(table).shape), endpoints=pservers,
                         optimizer=kind)
