"""Liveness of variables over a block's control-flow graph, and what memory reuse may touch.

Shared by ``memory_optimize`` and ``release_memory`` (Fluid 1.5's ``ControlFlowGraph``):

- ``block_cfg``: a networkx DiGraph whose nodes are a block's op indices and whose edges are the
  control flow between them. A block's ops run in order (i → i + 1); an op that owns sub-blocks
  (``listen_and_serv``) is one node whose uses and defs include, conservatively, every variable of
  this block or an ancestor that its sub-blocks (recursively) read or write: such a variable is live
  across the op.
- ``block_liveness``: the backward data-flow fixed point ``live_out[i] = ∪ live_in[succ]``,
  ``live_in[i] = uses[i] ∪ (live_out[i] − defs[i])``, solved with a worklist over the CFG.
- ``reuse_exclusions``: the variables no rewrite may rename or delete, each with the reason
  (persistable, fed, fetch target, in ``skip_opt_set``, read across blocks, an RPC or collective
  operand, a parameter gradient under ``skip_grads``, not a dense tensor, unknown rank).
  Parameter gradients are read from the recorded ``op_role_var`` pairs, fetch targets from the
  ``loss`` op role; names are never parsed.
- ``var_nbytes`` and ``peak_bytes``: the liveness estimate of memory: every temporary holds its
  buffer from its first write until its ``delete_var`` (or the end of the run, as Fluid's scopes did),
  so reusing a dead variable's name or deleting it lowers the peak.

Invariants: nothing here mutates a program; results are deterministic (insertion-ordered, sorted).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import networkx as nx

from ir.core import Block, Operator, Program, Variable, block_refs
from ir.names import EMPTY_VAR_NAME
from ir.ops.registry import find_op_def
from ir.roles import OpRole
from ir.verify import ITEMSIZE

__all__ = [
    "Liveness", "block_cfg", "block_liveness", "fetch_targets", "op_uses_defs", "parameter_gradients",
    "peak_bytes", "program_peak_bytes", "reuse_exclusions", "var_nbytes",
]


@dataclass(frozen=True)
class Liveness:
    """Per op of a block (by index): the names it reads and writes, and the names live before and after it."""

    uses: tuple[frozenset[str], ...]
    defs: tuple[frozenset[str], ...]
    live_in: tuple[frozenset[str], ...]
    live_out: tuple[frozenset[str], ...]

    def dying_at(self, i: int) -> list[str]:
        """Names whose value is dead after op ``i`` (read or written there, not live after it), sorted."""
        return sorted((self.uses[i] | self.defs[i]) - self.live_out[i])


def _sub_block_names(program: Program, idx: int, seen: set[int]) -> set[str]:
    """Every name the ops of block ``idx`` and of the blocks they own read or write, minus the block's own
    variables (those are local to the sub-block)."""
    if idx in seen or not 0 <= idx < program.num_blocks:
        return set()
    seen.add(idx)
    block = program.block(idx)
    names: set[str] = set()
    for op in block.ops:
        names.update(op.input_arg_names)
        names.update(op.output_arg_names)
        for value in op.attrs.values():
            for sub in block_refs(value):
                names |= _sub_block_names(program, sub, seen)
    return {n for n in names if n not in block.vars}


def op_uses_defs(op: Operator) -> tuple[frozenset[str], frozenset[str]]:
    """The names ``op`` reads and writes; for an op owning sub-blocks, every outer name those blocks touch
    counts as both read and written (conservative: it stays live across the op)."""
    uses = {n for n in op.input_arg_names if n != EMPTY_VAR_NAME}
    defs = {n for n in op.output_arg_names if n != EMPTY_VAR_NAME}
    inner: set[str] = set()
    for value in op.attrs.values():
        for sub in block_refs(value):
            inner |= _sub_block_names(op.block.program, sub, set())
    return frozenset(uses | inner), frozenset(defs | inner)


def block_cfg(block: Block) -> nx.DiGraph:
    """The control-flow graph of ``block``: one node per op index, an edge from each op to the next."""
    graph = nx.DiGraph()
    n = len(block.ops)
    graph.add_nodes_from(range(n))
    graph.add_edges_from((i, i + 1) for i in range(n - 1))
    return graph


def block_liveness(block: Block) -> Liveness:
    """Solve liveness for ``block`` over ``block_cfg`` with a worklist (last op first)."""
    ops = block.ops
    pairs = [op_uses_defs(op) for op in ops]
    uses = [u for u, _ in pairs]
    defs = [d for _, d in pairs]
    graph = block_cfg(block)
    live_in: list[frozenset[str]] = [frozenset()] * len(ops)
    live_out: list[frozenset[str]] = [frozenset()] * len(ops)
    work = list(range(len(ops)))  # popped from the end: the last op first
    queued = set(work)
    while work:
        i = work.pop()
        queued.discard(i)
        out: frozenset[str] = frozenset().union(*(live_in[s] for s in graph.successors(i)))
        new_in = uses[i] | (out - defs[i])
        live_out[i] = out
        if new_in != live_in[i]:
            live_in[i] = new_in
            for p in graph.predecessors(i):
                if p not in queued:
                    queued.add(p)
                    work.append(p)
    return Liveness(tuple(uses), tuple(defs), tuple(live_in), tuple(live_out))


def parameter_gradients(program: Program) -> set[str]:
    """The gradient of every (parameter, gradient) pair an op records in ``op_role_var``."""
    grads: set[str] = set()
    for block in program.blocks:
        for op in block.ops:
            rv = op.role_var
            grads.update(rv[i + 1] for i in range(0, len(rv) - 1, 2))
    return grads


def fetch_targets(program: Program) -> set[str]:
    """What a user may fetch and so must keep its name and value: the outputs of ops with the ``loss``
    role (the loss and its seed gradient), and every variable some op writes but no op reads (a result
    of the program, e.g. an accuracy)."""
    read: set[str] = set()
    written: set[str] = set()
    targets: set[str] = set()
    for block in program.blocks:
        for op in block.ops:
            read.update(op.input_arg_names)
            written.update(op.output_arg_names)
            if op.role & int(OpRole.LOSS):
                targets.update(op.output_arg_names)
    return (targets | (written - read)) - {EMPTY_VAR_NAME}


def _owner(block: Block, name: str) -> Block | None:
    b: Block | None = block
    while b is not None:
        if name in b.vars:
            return b
        b = b.parent
    return None


def reuse_exclusions(program: Program, skip_opt_set: Iterable[str] = (),
                     skip_grads: bool = False) -> list[dict[str, str]]:
    """Per block (by index): the variables of that block that memory reuse must leave alone, name → reason."""
    skip_names = sorted(set(skip_opt_set))
    fetches = sorted(fetch_targets(program))
    grads = sorted(parameter_gradients(program)) if skip_grads else []
    out: list[dict[str, str]] = [{} for _ in program.blocks]

    def skip(block: Block, name: str, reason: str) -> None:
        if name in block.vars and name not in out[block.idx]:
            out[block.idx][name] = reason

    for block in program.blocks:
        for name in skip_names:
            skip(block, name, "in skip_opt_set")
        for name in fetches:
            skip(block, name, "fetch target")
        for name in grads:
            skip(block, name, "parameter gradient (skip_grads)")
        for op in block.ops:
            op_def = find_op_def(op.type)
            talks = op_def is not None and (op_def.has_trait("rpc") or op_def.has_trait("collective"))
            for name in op.input_arg_names + op.output_arg_names:
                owner = _owner(block, name)
                if owner is None:
                    continue
                if owner is not block:
                    skip(owner, name, f"read across blocks (by block {block.idx})")
                if talks:
                    skip(owner, name, f"operand of {op.type}")
    for block in program.blocks:
        for name, var in block.vars.items():
            if var.persistable:
                skip(block, name, "persistable")
            elif var.is_data:
                skip(block, name, "fed (data)")
            elif var.type != "lod_tensor":
                skip(block, name, f"{var.type}, not a dense tensor")
            elif not var.shape:
                skip(block, name, "rank 0 (shape unknown)")
    return out


def var_nbytes(var: Variable, batch_size: int = 1) -> int:
    """Bytes of ``var`` with every unknown extent (-1) taken as ``batch_size``."""
    n = 1
    for d in var.shape:
        n *= batch_size if d < 0 else d
    return n * ITEMSIZE.get(var.dtype, 4)


def peak_bytes(block: Block, sizes: Mapping[str, int] | None = None, batch_size: int = 1) -> int:
    """The liveness estimate of the peak bytes of ``block``'s temporaries: a non-persistable variable of
    the block holds its buffer from the op that first writes it (from the start, when it is fed) until a
    ``delete_var`` drops it, or until the end of the run. ``sizes`` overrides a variable's bytes (a
    shared buffer's size is that of its largest user: after a level-1 ``memory_optimize`` a shared
    variable's differing extents are declared -1 and would otherwise count as ``batch_size`` each)."""
    def size(name: str) -> int:
        if sizes is not None and name in sizes:
            return sizes[name]
        return var_nbytes(block.vars[name], batch_size)

    temps = {n for n, v in block.vars.items() if not v.persistable}
    held: set[str] = {n for n in temps if block.vars[n].is_data}
    current = sum(size(n) for n in held)
    peak = current
    for op in block.ops:
        for n in op.output_arg_names:
            if n in temps and n not in held:
                held.add(n)
                current += size(n)
        peak = max(peak, current)
        if op.type == "delete_var":
            for n in op.input("X"):
                if n in held:
                    held.discard(n)
                    current -= size(n)
    return peak


def program_peak_bytes(program: Program, sizes: Sequence[Mapping[str, int]] | None = None,
                       batch_size: int = 1) -> int:
    """The largest ``peak_bytes`` over the program's blocks (each block runs on its own)."""
    return max((peak_bytes(b, sizes[b.idx] if sizes is not None else None, batch_size) for b in program.blocks),
               default=0)
