"""How two programs differ, block by block, in the IR's own text forms.

It lives beside the printer because it compares what the printer writes (a variable's line, an op's line);
``flotilla diff`` prints it, and tests use it to show where two programs part.

Alignment by structure. Two programs built in one process get different ``unique_name`` names for the
same layers (``fc_0.w_0`` in the first, ``fc_2.w_0`` in the second), so a diff by name would report every
variable removed and added. Before comparing, ``structural_renames`` pairs a variable only B has with one
only A has when they play the same part: the ops of each block are aligned (``difflib`` over each op's type
and slot arities), and an aligned pair of ops pairs the names in the same slot and position; variables no
aligned op pairs are then paired in declaration order when their names agree once digits are ignored
(``fc_#.w_#``) and their declarations agree once names are. A pairing must be one-to-one: a name claimed
twice keeps its first partner. B is then compared under A's names, and the renames are reported in one
line, so a diff of the same model built twice says only that. Names that are no variable of the block
(in attributes such as a pserver's ``grad_to_block_id`` or a variable's ``copy_of``) follow through the
``unique_name`` prefixes the renames agree on (``fc_2`` → ``fc_0``), applied to B's text as compared.
"""
from __future__ import annotations

import difflib
import re
from typing import Callable, Iterator

from ir.core import Block, Operator, Program, Variable
from ir.printer import format_op, format_program, format_var

__all__ = ["diff_programs", "structural_renames"]

_SHOWN_RENAMES = 4  # renames spelled out in the summary line
_STEM = re.compile(r"^(.+?)_(\d+)((?:[.@].*)?)$")  # unique_name's ``key_N`` prefix, then the rest


def diff_programs(a: Program, b: Program, a_name: str = "A", b_name: str = "B", align: bool = True) -> list[str]:
    """The differences between two programs, block by block, as lines; empty when they are equal.

    Blocks are matched by index. With ``align`` (the default), B's variables are first renamed to the A
    variables they correspond to by structure (``structural_renames``; one summary line). Variables are then
    matched by name (removed, added, changed with their old and new text); ops, which have no identity, are
    compared as a unified diff of their text lines.
    """
    if format_program(a) == format_program(b):
        return []
    lines = [f"--- {a_name}", f"+++ {b_name}"]
    renames = structural_renames(a, b) if align else {}
    translate: Callable[[str], str] = _unchanged
    if renames:
        stems = _stem_renames(renames, format_program(b))
        b = _renamed(b, renames)
        translate = _translator(stems)
        lines.append(_rename_summary(renames, stems, a_name, b_name))
        if format_program(a) == translate(format_program(b)):
            return lines + ["no other difference"]
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
        lines += _diff_block(a.blocks[idx], b.blocks[idx], a_name, b_name, translate)
    return lines


def structural_renames(a: Program, b: Program) -> dict[int, dict[str, str]]:
    """Block index → {B's name: A's name} for the variables declared in that block of only one program each
    that play the same part (see the module docstring); blocks are matched by index."""
    a_names = {n for blk in a.blocks for n in blk.vars}
    b_names = {n for blk in b.blocks for n in blk.vars}
    out: dict[int, dict[str, str]] = {}
    for idx in range(min(a.num_blocks, b.num_blocks)):
        ba, bb = a.blocks[idx], b.blocks[idx]
        mapping: dict[str, str] = {}
        claimed: set[str] = set()

        def pair(bn: str, an: str) -> None:
            if (bn != an and bn in bb.vars and an in ba.vars and bn not in a_names and an not in b_names
                    and bn not in mapping and an not in claimed):
                mapping[bn] = an
                claimed.add(an)

        for op_a, op_b in _aligned_ops(ba, bb):
            for slots_a, slots_b in ((op_a.inputs, op_b.inputs), (op_a.outputs, op_b.outputs)):
                for slot, names in slots_a.items():
                    for an, bn in zip(names, slots_b.get(slot, [])):
                        pair(bn, an)
        left_a = [v for n, v in ba.vars.items() if n not in b_names and n not in claimed]
        left_b = [v for n, v in bb.vars.items() if n not in a_names and n not in mapping]
        for va in left_a:
            vb = next((v for v in left_b if v.name not in mapping and _same_shape(va, v)), None)
            if vb is not None:
                pair(vb.name, va.name)
        if mapping:
            out[idx] = mapping
    return out


def _signature(op: Operator) -> tuple[object, ...]:
    """What two ops must share to be aligned: the type and each slot's number of arguments, not the names."""
    return (op.type, tuple((s, len(n)) for s, n in sorted(op.inputs.items())),
            tuple((s, len(n)) for s, n in sorted(op.outputs.items())))


def _aligned_ops(ba: Block, bb: Block) -> Iterator[tuple[Operator, Operator]]:
    matcher = difflib.SequenceMatcher(None, [_signature(op) for op in ba.ops], [_signature(op) for op in bb.ops],
                                      autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            yield ba.ops[block.a + k], bb.ops[block.b + k]


def _same_shape(va: Variable, vb: Variable) -> bool:
    """Whether two variables could be one renamed: names equal once digits are ignored, declarations equal
    once names are."""
    return (re.sub(r"\d+", "#", va.name) == re.sub(r"\d+", "#", vb.name)
            and format_var(va).replace(va.name, "", 1) == format_var(vb).replace(vb.name, "", 1))


def _stem_renames(renames: dict[int, dict[str, str]], b_text: str) -> dict[str, str]:
    """The ``unique_name`` prefixes the renames agree on (``fc_2`` → ``fc_0`` when ``fc_2.w_0`` became
    ``fc_0.w_0`` and no rename says otherwise), for the names that are no variable of the block: in
    attributes (``grad_to_block_id``, ``copy_of``) and in ops' slots. A prefix whose target B already uses
    is left out, so translating never merges two of B's names."""
    stems: dict[str, str] = {}
    refused: set[str] = set()
    for mapping in renames.values():
        for old, new in mapping.items():
            mo, mn = _STEM.match(old), _STEM.match(new)
            if mo is None or mn is None or (mo[1], mo[3]) != (mn[1], mn[3]) or mo[2] == mn[2]:
                continue
            src, dst = f"{mo[1]}_{mo[2]}", f"{mn[1]}_{mn[2]}"
            if stems.setdefault(src, dst) != dst:
                refused.add(src)
    targets = [dst for src, dst in stems.items() if src not in refused]
    return {src: dst for src, dst in stems.items()
            if src not in refused and targets.count(dst) == 1 and not _stem_pattern([dst]).search(b_text)}


def _stem_pattern(stems: list[str]) -> re.Pattern[str]:
    """Where a prefix stands as a whole name's prefix: not inside a longer identifier or number."""
    return re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, stems)) + r")(?![0-9A-Za-z_])")


def _translator(stems: dict[str, str]) -> Callable[[str], str]:
    if not stems:
        return _unchanged
    pattern = _stem_pattern(sorted(stems, key=len, reverse=True))
    return lambda text: pattern.sub(lambda m: stems[m[1]], text)


def _unchanged(text: str) -> str:
    return text


def _rename_summary(renames: dict[int, dict[str, str]], stems: dict[str, str], a_name: str, b_name: str) -> str:
    translate = _translator(stems)
    shown = [f"{old}* -> {new}*" for old, new in stems.items()]
    shown += [f"{old} -> {new}" for mapping in renames.values() for old, new in mapping.items()
              if translate(old) != new]
    count = sum(len(m) for m in renames.values())
    more = f", ... ({len(shown) - _SHOWN_RENAMES} more)" if len(shown) > _SHOWN_RENAMES else ""
    return (f"renamed by structure: {count} variable(s) of {b_name} compared under {a_name}'s names "
            f"({', '.join(shown[:_SHOWN_RENAMES])}{more})")


def _renamed(program: Program, renames: dict[int, dict[str, str]]) -> Program:
    copy = program.clone()
    for idx, mapping in renames.items():
        copy.blocks[idx].rename_vars(mapping)
    return copy


def _diff_block(ba: Block, bb: Block, a_name: str, b_name: str,
                translate: Callable[[str], str] = _unchanged) -> list[str]:
    """One block's differences; ``translate`` rewrites B's text (the prefixes of ``_stem_renames``)."""
    out: list[str] = []
    if ba.parent_idx != bb.parent_idx:
        out.append(f"  parent: {ba.parent_idx} -> {bb.parent_idx}")
    b_vars = {translate(name): translate(format_var(v)) for name, v in bb.vars.items()}
    removed = [format_var(v) for name, v in ba.vars.items() if name not in b_vars]
    added = [text for name, text in b_vars.items() if name not in ba.vars]
    changed = [(format_var(v), b_vars[name]) for name, v in ba.vars.items()
               if name in b_vars and format_var(v) != b_vars[name]]
    a_ops = [format_op(op) for op in ba.ops]
    b_ops = [translate(format_op(op)) for op in bb.ops]
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
