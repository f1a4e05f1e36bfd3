"""networkx views of a Block: the op dependency graph, def-use chains and a topological order.

Fluid programs are not SSA (optimizers write parameters in place, memory reuse renames), so the
dependency graph records all three hazards between ops on the same variable:
- RAW (read after write): the last writer of ``v`` → each later reader of ``v``;
- WAR (write after read): each reader of ``v`` since its last write → the next writer of ``v``;
- WAW (write after write): the previous writer of ``v`` → the next writer of ``v``.
Only these nearest edges are kept (the rest follow by transitivity), so the graph has O(ops + args)
edges, never O(ops²). Control-dependency variables (type ``raw``, e.g. send's dummy outputs) are
ordinary variables here and so produce the same edges: the send → send_barrier → recv ordering is kept.

Every edge goes from a lower op index to a higher one. Results are cached per block on its program's
``version``, so any mutation of the program invalidates them; the cache is stored on the block, so it
never outlives it. The cached graph is frozen; the other results are returned as fresh copies.
"""
from __future__ import annotations

from typing import Any

import networkx as nx

from ir.core import Block

__all__ = ["def_use_chains", "op_dependency_graph", "topological_order"]

RAW, WAR, WAW = "raw", "war", "waw"

# The cache lives on the Block itself (as an attribute), not in a module-level weak mapping: the cached
# graph holds the Operators, which hold their Block, so a mapping keyed weakly on the block would keep
# it alive through its own value. On the block, the cache dies with it.
_CACHE_ATTR = "_flotilla_graph_cache"


def _cached(block: Block) -> dict[str, Any]:
    """The analyses cached for ``block`` at its program's current version (emptied on mutation)."""
    version = block.program.version
    entry: tuple[int, dict[str, Any]] | None = getattr(block, _CACHE_ATTR, None)
    if entry is None or entry[0] != version:
        entry = (version, {})
        setattr(block, _CACHE_ATTR, entry)
    return entry[1]


def _op_vars(op: Any) -> tuple[list[str], list[str]]:
    """An op's distinct read and written variable names, in slot order."""
    reads = list(dict.fromkeys(n for names in op.inputs.values() for n in names))
    writes = list(dict.fromkeys(n for names in op.outputs.values() for n in names))
    return reads, writes


def _build_graph(block: Block) -> nx.DiGraph:
    ops = block.ops
    edges: dict[tuple[int, int], tuple[set[str], set[str]]] = {}

    def link(a: int, b: int, kind: str, var: str) -> None:
        kinds, names = edges.setdefault((a, b), (set(), set()))
        kinds.add(kind)
        names.add(var)

    last_writer: dict[str, int] = {}
    readers: dict[str, list[int]] = {}  # readers of v since its last write
    for i, op in enumerate(ops):
        reads, writes = _op_vars(op)
        for v in reads:
            w = last_writer.get(v)
            if w is not None:
                link(w, i, RAW, v)
        for v in writes:
            for r in readers.get(v, ()):
                if r != i:
                    link(r, i, WAR, v)
            w = last_writer.get(v)
            if w is not None:
                link(w, i, WAW, v)
        for v in reads:
            readers.setdefault(v, []).append(i)
        for v in writes:
            last_writer[v] = i
            readers[v] = []
    graph = nx.DiGraph()
    graph.add_nodes_from((i, {"op": op}) for i, op in enumerate(ops))
    graph.add_edges_from(
        (a, b, {"kinds": tuple(sorted(kinds)), "vars": tuple(sorted(names))})
        for (a, b), (kinds, names) in sorted(edges.items())
    )
    return nx.freeze(graph)


def op_dependency_graph(block: Block) -> nx.DiGraph:
    """The (frozen) dependency graph of ``block``'s ops: nodes are op indices with the Operator as
    node attribute ``op``; an edge a → b (a < b) carries ``kinds`` (sorted tuple of "raw"/"war"/"waw")
    and ``vars`` (sorted tuple of the variable names behind it)."""
    cache = _cached(block)
    graph = cache.get("graph")
    if graph is None:
        graph = cache["graph"] = _build_graph(block)
    return graph


def def_use_chains(block: Block) -> dict[str, list[tuple[int, str]]]:
    """Per variable (in order of first appearance), its ordered (op index, "def" | "use") events;
    an op that reads and writes a variable contributes its use before its def."""
    cache = _cached(block)
    chains = cache.get("chains")
    if chains is None:
        chains = {}
        for i, op in enumerate(block.ops):
            reads, writes = _op_vars(op)
            for v in reads:
                chains.setdefault(v, []).append((i, "use"))
            for v in writes:
                chains.setdefault(v, []).append((i, "def"))
        cache["chains"] = chains
    return {v: list(events) for v, events in chains.items()}


def topological_order(block: Block) -> list[int]:
    """A deterministic topological order of ``block``'s op indices (networkx's lexicographical
    topological sort of the dependency graph: among ready ops, the lowest index first)."""
    cache = _cached(block)
    order = cache.get("topo")
    if order is None:
        order = cache["topo"] = list(nx.lexicographical_topological_sort(op_dependency_graph(block)))
    return list(order)
