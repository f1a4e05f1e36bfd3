"""How two programs differ, block by block, in the IR's own text forms.

It lives beside the printer because it compares what the printer writes (a variable's line, an op's line);
``flotilla diff`` prints it, and tests use it to show where two programs part.
"""
from __future__ import annotations

import difflib

from ir.core import Block, Program
from ir.printer import format_op, format_program, format_var

__all__ = ["diff_programs"]


def diff_programs(a: Program, b: Program, a_name: str = "A", b_name: str = "B") -> list[str]:
    """The differences between two programs, block by block, as lines; empty when they are equal.

    Blocks are matched by index. Variables are matched by name (removed, added, changed with their old
    and new text); ops, which have no identity, are compared as a unified diff of their text lines.
    """
    if format_program(a) == format_program(b):
        return []
    lines = [f"--- {a_name}", f"+++ {b_name}"]
    if a.random_seed != b.random_seed:
        lines.append(f"program: random_seed {a.random_seed} -> {b.random_seed}")
    for idx in range(max(a.num_blocks, b.num_blocks)):
        if idx >= b.num_blocks:
            blk = a.blocks[idx]
            lines.append(f"block {idx}: removed ({len(blk.vars)} vars, {len(blk.ops)} ops)")
            continue
        if idx >= a.num_blocks:
            blk = b.blocks[idx]
            lines.append(f"block {idx}: added ({len(blk.vars)} vars, {len(blk.ops)} ops)")
            continue
        lines += _diff_block(a.blocks[idx], b.blocks[idx], a_name, b_name)
    return lines


def _diff_block(ba: Block, bb: Block, a_name: str, b_name: str) -> list[str]:
    out: list[str] = []
    if ba.parent_idx != bb.parent_idx:
        out.append(f"  parent: {ba.parent_idx} -> {bb.parent_idx}")
    removed = [format_var(v) for name, v in ba.vars.items() if name not in bb.vars]
    added = [format_var(v) for name, v in bb.vars.items() if name not in ba.vars]
    changed = [
        (format_var(v), format_var(bb.vars[name]))
        for name, v in ba.vars.items()
        if name in bb.vars and format_var(v) != format_var(bb.vars[name])
    ]
    a_ops = [format_op(op) for op in ba.ops]
    b_ops = [format_op(op) for op in bb.ops]
    op_diff = list(
        difflib.unified_diff(a_ops, b_ops, fromfile=f"{a_name} block {ba.idx}", tofile=f"{b_name} block {bb.idx}",
                             lineterm="", n=2)
    )
    if removed or added or changed:
        out.append(f"  variables: {len(removed)} removed, {len(added)} added, {len(changed)} changed")
        out += [f"    - {t}" for t in removed]
        out += [f"    + {t}" for t in added]
        for old, new in changed:
            out += [f"    ~ {old}", f"      -> {new}"]
    if op_diff:
        n_a, n_b = len(a_ops), len(b_ops)
        out.append(f"  ops: {n_a} -> {n_b}")
        out += ["    " + line for line in op_diff]
    if not out:
        return []
    return [f"block {ba.idx}:"] + out
