"""Recompute (activation checkpointing) as a program rewrite: ``apply_recompute(block, checkpoints)``.

The forward ops between two consecutive checkpoints form a segment. Instead of keeping a segment's
activations alive from the forward pass until their gradient ops run, the rewrite inserts, right before
the first backward op that reads one of them, a copy of the segment's forward ops computing
``name@RECOMPUTE`` values (``ir.names.recompute_name``, recorded as ``copy_of``), and makes the backward
ops read those. The copy starts with a ``recompute_barrier`` over the segment's inputs from outside (the
checkpoint and any other saved activation) and over the gradients that reach the segment: in XLA this is
an optimization barrier, so the compiler neither merges the copy with the forward pass (common
subexpressions) nor hoists it before the backward pass gets there, which is what ``jax.checkpoint`` does
inside JAX. Ops before the first checkpoint and after the last are not recomputed (as in Paddle).

Invariants: the forward ops and the numerics are unchanged (the copy computes the same values); a random
op inside a segment must draw from a fixed seed (``fix_seed`` and a non-zero ``seed``), else the copy
would draw another mask and the rewrite refuses; parameters and other persistables are read directly,
never copied.
"""
from __future__ import annotations

from typing import Any, Sequence

from ir.core import Block, Operator
from ir.errors import IRError
from ir.names import GRAD_SUFFIX, recompute_name
from ir.ops.registry import find_op_def
from ir.roles import OP_ROLE_ATTR, OpRole


def _names(checkpoints: Sequence[Any]) -> list[str]:
    out = []
    for c in checkpoints:
        name = c if isinstance(c, str) else getattr(c, "name", None)
        if not isinstance(name, str):
            raise IRError(f"checkpoints must be Variables or names, got {type(c).__name__} {c!r}",
                          hint="pass the outputs of layers, e.g. the output of each block of the network")
        out.append(name)
    return out


def _is_random(op: Operator) -> bool:
    op_def = find_op_def(op.type)
    return op_def is not None and op_def.has_trait("random")


def apply_recompute(block: Block, checkpoints: Sequence[Any]) -> int:
    """Rewrite ``block`` (forward and backward ops appended, no optimizer ops yet) to recompute the
    segments between ``checkpoints``; returns how many segments were rewritten."""
    names = _names(checkpoints)
    ops = list(block.ops)
    first_backward = next((i for i, op in enumerate(ops) if op.role & OpRole.BACKWARD), None)
    if first_backward is None:
        raise IRError("recompute needs the backward ops: apply it after append_backward",
                      hint="use RecomputeOptimizer(optimizer, checkpoints).minimize(loss)")
    producer: dict[str, int] = {}
    for i, op in enumerate(ops[:first_backward]):
        for n in op.output_arg_names:
            producer[n] = i
    missing = [n for n in names if n not in producer]
    if missing:
        raise IRError(f"checkpoints {missing} are not produced by any forward op of the block",
                      hint="checkpoints are forward activations (layer outputs), not parameters or feeds")
    cuts = sorted(set(producer[n] for n in names))
    if len(cuts) < 2:
        raise IRError(f"recompute needs at least 2 checkpoints at different ops, got {names}",
                      hint="checkpoint the output of every block of the network")
    persistable = {n for n, v in block.vars.items() if v.persistable}
    segments = [list(range(a + 1, b + 1)) for a, b in zip(cuts, cuts[1:]) if b > a]
    rewritten = 0
    # From the last segment backwards: the backward ops of later segments come first, and inserting
    # there leaves the indices of earlier segments' forward ops untouched.
    for seg in reversed(segments):
        if _rewrite_segment(block, seg, set(names), persistable):
            rewritten += 1
    return rewritten


def _rewrite_segment(block: Block, seg: list[int], checkpoints: set[str], persistable: set[str]) -> bool:
    ops = list(block.ops)
    seg_ops = [ops[i] for i in seg]
    for op in seg_ops:
        if _is_random(op) and not (op.attr("fix_seed", True) and op.attr("seed", 0)):
            raise IRError(f"op {op.type!r} in a recompute segment draws random numbers without a fixed seed, so "
                          "its recomputation would draw different ones",
                          hint="give it seed=<non-zero> (dropout: fix_seed), or put a checkpoint after it")
    produced = [n for op in seg_ops for n in op.output_arg_names]
    recomputed = [n for n in dict.fromkeys(produced) if n not in checkpoints and n not in persistable]
    if not recomputed:
        return False
    wanted = set(recomputed)
    backward_readers = [i for i, op in enumerate(ops) if op.role & OpRole.BACKWARD and wanted & set(op.input_arg_names)]
    if not backward_readers:
        return False
    at = backward_readers[0]
    inside = set(produced)
    outside = [n for op in seg_ops for n in op.input_arg_names
               if n not in inside and n not in persistable and block.find_var_recursive(n) is not None]
    outside = list(dict.fromkeys(outside))
    # What reaches the segment's backward: the gradients the first reader consumes.
    deps = [n for n in ops[at].input_arg_names if n.endswith(GRAD_SUFFIX) and n not in wanted]
    mapping = {n: recompute_name(n) for n in recomputed + outside}
    for n in recomputed + outside:
        var = block.find_var_recursive(n)
        if var is None:
            raise IRError(f"recompute: variable {n!r} is not declared")
        block.create_var(mapping[n], shape=var.shape, dtype=var.dtype, type=var.type, copy_of=n)
    role = int(OpRole.BACKWARD)
    block.insert_op(at, "recompute_barrier", {"X": outside, "Dep": deps}, {"Out": [mapping[n] for n in outside]},
                    {OP_ROLE_ATTR: role})
    for k, op in enumerate(seg_ops, start=1):
        ins = {slot: [mapping.get(n, n) for n in vs] for slot, vs in op.inputs.items()}
        outs = {slot: [mapping.get(n, n) if n in wanted else _unused(block, n, mapping) for n in vs]
                for slot, vs in op.outputs.items()}
        block.insert_op(at + k, op.type, ins, outs, {**op.attrs, OP_ROLE_ATTR: role})
    readers = {id(op) for op in ops[at:] if op.role & OpRole.BACKWARD}
    only = {n: mapping[n] for n in recomputed}
    for op in block.ops[at + 1 + len(seg_ops):]:
        if id(op) in readers:
            for n in set(op.input_arg_names) & wanted:
                op.rename_input(n, only[n])
    return True


def _unused(block: Block, name: str, mapping: dict[str, str]) -> str:
    """An output of a recomputed op that is not recomputed (a checkpoint, a persistable): the copy writes
    a fresh variable instead, so the original keeps its forward value."""
    fresh = recompute_name(name)
    if fresh not in mapping.values() and not block.has_var(fresh):
        var = block.find_var_recursive(name)
        if var is not None:
            block.create_var(fresh, shape=var.shape, dtype=var.dtype, type=var.type, copy_of=name,
                             persistable=False)
    mapping.setdefault(name, fresh)
    return fresh


__all__ = ["apply_recompute"]
