"""The placement report of a pserver transpile: which parameter block lives on which pserver, the bytes per
pserver and their balance, as a text table or a Graphviz digraph.

It reads a ``DistPlan`` and the trainer program's dtypes, so it belongs with the transpiler that makes the
plan; ``flotilla plan`` prints it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ir.verify import ITEMSIZE

__all__ = ["PlanRow", "plan_rows", "plan_loads", "plan_balance", "format_plan_text", "format_plan_dot"]


@dataclass(frozen=True)
class PlanRow:
    """One block of the plan: which parameter, which block, its rows, its bytes, where it lives."""

    param: str
    block: str
    first_row: int
    rows: int
    shape: tuple[int, ...]
    nbytes: int
    endpoint: str


def plan_rows(plan: Any, programs: Any) -> list[PlanRow]:
    """Every parameter block of ``plan`` (params in plan order, blocks in index order; a distributed
    table as one shard per pserver), sized with the dtypes the trainer program declares."""
    from ir.verify import ITEMSIZE

    trainer = programs.trainers()[0].main
    gblock = trainer.global_block()

    def itemsize(name: str) -> int:
        var = gblock.find_var_recursive(name)
        return ITEMSIZE.get(var.dtype, 4) if var is not None else 4

    rows: list[PlanRow] = []
    for pp in plan.params:
        size = itemsize(pp.param)
        for pblock, _, ep in pp.blocks():
            rows.append(PlanRow(pp.param, pblock.name, pblock.offset_rows, pblock.rows, tuple(pblock.shape),
                                pblock.numel * size, ep))
    table = plan.table
    if table is not None:
        size = itemsize(table.table)
        shard_numel = 1
        for d in table.shard_shape:
            shard_numel *= d
        for i, ep in enumerate(table.endpoints):
            rows.append(PlanRow(table.table, f"{table.table} (shard {i}: ids % {len(table.endpoints)} == {i})",
                                0, table.shard_rows, tuple(table.shard_shape), shard_numel * size, ep))
    return rows


def plan_loads(plan: Any, rows: Sequence[PlanRow]) -> dict[str, tuple[int, int]]:
    """Per pserver endpoint (in the user's order): (blocks, bytes)."""
    loads = {ep: (0, 0) for ep in plan.pservers}
    for r in rows:
        n, b = loads[r.endpoint]
        loads[r.endpoint] = (n + 1, b + r.nbytes)
    return loads


def plan_balance(loads: dict[str, tuple[int, int]]) -> float | None:
    """max/mean of the bytes per pserver (1.0 is perfect balance); None when nothing is placed."""
    sizes = [b for _, b in loads.values()]
    mean = sum(sizes) / len(sizes) if sizes else 0.0
    return max(sizes) / mean if mean > 0 else None


def _table(header: Sequence[str], body: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
    out = []
    for row in [header, *body]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def format_plan_text(plan: Any, rows: Sequence[PlanRow]) -> str:
    head = (f"plan: {len(plan.pservers)} pserver(s), {plan.trainers} trainer(s), "
            f"{'sync' if plan.sync_mode else 'async'}, "
            f"{'min_block_size ' + str(plan.min_block_size) if plan.slice_var_up else 'no slicing'}")
    body = [(r.param, r.block, f"[{r.first_row}, {r.first_row + r.rows})", _fmt_dims(r.shape), str(r.nbytes),
             r.endpoint) for r in rows]
    lines = [head, ""]
    lines += _table(("param", "block", "rows", "shape", "bytes", "endpoint"), body, {4})
    loads = plan_loads(plan, rows)
    lines.append("")
    lines += _table(("endpoint", "blocks", "bytes"), [(ep, str(n), str(b)) for ep, (n, b) in loads.items()], {1, 2})
    balance = plan_balance(loads)
    total = sum(b for _, b in loads.values())
    lines.append("")
    lines.append(f"total {total} bytes in {len(rows)} block(s); balance (max/mean bytes per pserver): "
                 + (f"{balance:.3f}" if balance is not None else "n/a (nothing placed)"))
    return "\n".join(lines) + "\n"


def _fmt_dims(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _dot_id(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def format_plan_dot(plan: Any, rows: Sequence[PlanRow]) -> str:
    """The plan as a Graphviz digraph: parameters on the left, pservers on the right, one edge per block."""
    loads = plan_loads(plan, rows)
    lines = ["digraph plan {", "  rankdir=LR;", '  node [fontname="monospace", fontsize=10];',
             '  edge [fontname="monospace", fontsize=9];']
    params: dict[str, tuple[int, ...]] = {}
    for pp in plan.params:
        first = pp.param_blocks[0]
        params[pp.param] = (sum(b.rows for b in pp.param_blocks),) + tuple(first.shape[1:])
    if plan.table is not None:
        params[plan.table.table] = tuple(plan.table.shape)
    for name, shape in params.items():
        lines.append(f"  {_dot_id('param:' + name)} [shape=ellipse, label={_dot_id(name + chr(10) + _fmt_dims(shape))}];")
    for ep, (n, b) in loads.items():
        label = f"{ep}\n{n} block(s), {b} bytes"
        lines.append(f"  {_dot_id('pserver:' + ep)} [shape=box, label={_dot_id(label)}];")
    for r in rows:
        label = f"{r.block}\nrows [{r.first_row}, {r.first_row + r.rows}), {r.nbytes} B"
        lines.append(f"  {_dot_id('param:' + r.param)} -> {_dot_id('pserver:' + r.endpoint)} [label={_dot_id(label)}];")
    balance = plan_balance(loads)
    lines.append(f"  label={_dot_id('balance (max/mean bytes): ' + (f'{balance:.3f}' if balance else 'n/a'))};")
    lines.append("}")
    return "\n".join(lines) + "\n"
