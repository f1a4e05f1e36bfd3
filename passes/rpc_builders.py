"""Builders the pserver-mode passes share: the attrs every RPC op carries, control-dependency variables,
the trainer-side variables of parameter blocks and of Geo-SGD's state, and where gradients are last
written. Several passes build the same variables (a trainer's startup declares what its main program
reads), so each is declared here once, idempotently.
"""
from __future__ import annotations

from ir.core import Block, Operator, Variable
from ir.names import GEO_STEP_VAR, geo_snapshot_name, geo_touched_name
from ir.roles import OP_ROLE_ATTR, OpRole

from passes.dist_plan import DistPlan, ParamPlan, TablePlan
from passes.pass_base import PassError


def geo_state_vars(block: Block, plan: DistPlan) -> list[Variable]:
    """Declare (if needed) Geo-SGD's persistable trainer state in ``block``: the step counter, then one
    snapshot per planned parameter, in plan order; return them in that order."""
    if not block.has_var(GEO_STEP_VAR):
        block.create_var(GEO_STEP_VAR, shape=(1,), dtype="int64", persistable=True, stop_gradient=True)
    out = [block.var(GEO_STEP_VAR)]
    for pp in plan.params:
        name = geo_snapshot_name(pp.param)
        if not block.has_var(name):
            pvar = block.var(pp.param)
            block.add_var(Variable(name=name, shape=pvar.shape, dtype=pvar.dtype, persistable=True,
                                   stop_gradient=True, copy_of=pp.param))
        out.append(block.var(name))
    return out


def geo_table_state_vars(block: Block, table: TablePlan) -> tuple[Variable, Variable]:
    """Declare (if needed) Geo-SGD's persistable trainer state for the distributed table in ``block``: its
    snapshot (``copy_of`` the table) and its touched-rows mask (bool ``[rows]``); return both."""
    snapshot = geo_snapshot_name(table.table)
    if not block.has_var(snapshot):
        tvar = block.var(table.table)
        block.add_var(Variable(name=snapshot, shape=tvar.shape, dtype=tvar.dtype, persistable=True,
                               stop_gradient=True, copy_of=table.table))
    touched = geo_touched_name(table.table)
    if not block.has_var(touched):
        block.create_var(touched, shape=table.shape[:1], dtype="bool", persistable=True, stop_gradient=True)
    return block.var(snapshot), block.var(touched)


def table_lookups(block: Block, table: TablePlan) -> list[Operator]:
    """The ``lookup_table`` ops of ``block`` on the distributed table; PassError (E651) when there is none."""
    lookups = [op for op in block.ops if op.type == "lookup_table" and op.input("W") == [table.table]]
    if not lookups:
        raise PassError(f"the trainer program has no lookup_table op on the distributed table {table.table!r}",
                        hint="look the table up with layers.embedding(is_distributed=True)", code="E651")
    return lookups


def control_var(block: Block, name: str) -> Variable:
    if block.has_var(name):
        return block.var(name)
    return block.create_var(name, shape=(), dtype="float32", type="raw")


def rpc_attrs(**extra: object) -> dict[str, object]:
    return {OP_ROLE_ATTR: int(OpRole.RPC), **extra}


def param_block_vars(block: Block, pp: ParamPlan) -> list[str]:
    """Declare (if needed) the trainer-side variables receiving each block of ``pp``'s parameter."""
    if not pp.is_sliced:
        return [pp.param]
    pvar = block.var(pp.param)
    names = []
    for b in pp.param_blocks:
        if not block.has_var(b.name):
            block.add_var(Variable(name=b.name, shape=b.shape, dtype=pvar.dtype, type=pvar.type,
                                   slice_of=pp.param, slice_index=b.index, slice_offset=b.offset_rows))
        names.append(b.name)
    return names


def last_writers(block: Block, names: list[str]) -> dict[str, int]:
    """The index of the last op of ``block`` writing each of ``names``, found in one backward scan.

    Raises ``PassError`` (E630) naming the first of ``names`` that no op produces."""
    wanted = set(names)
    found: dict[str, int] = {}
    ops = block.ops
    for i in range(len(ops) - 1, -1, -1):
        if len(found) == len(wanted):
            break
        for n in ops[i].output_arg_names:
            if n in wanted and n not in found:
                found[n] = i
    for name in names:
        if name not in found:
            raise PassError(f"no op of the trainer program produces gradient {name!r}",
                            hint="the program must contain the backward pass (optimizer.minimize)", code="E630")
    return found
