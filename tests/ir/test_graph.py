"""Tests of the networkx views: dependency edges, def-use chains, topological order and caching."""
from __future__ import annotations

import gc
import time
import weakref

import networkx as nx
import pytest

from ir.core import Block, Program
from ir.graph import def_use_chains, op_dependency_graph, topological_order


def edges(graph: nx.DiGraph) -> dict[tuple[int, int], tuple[tuple[str, ...], tuple[str, ...]]]:
    return {(a, b): (d["kinds"], d["vars"]) for a, b, d in graph.edges(data=True)}


def hazard_block() -> Block:
    """0: a = fill; 1: b = square(a); 2: a = square(b); 3: c = mean(a); 4: a = square(a) (in place)."""
    p = Program()
    b = p.global_block()
    for name in ("a", "b", "c"):
        b.create_var(name)
    b.append_op("fill_constant", {}, {"Out": "a"}, {"shape": [2, 2]})
    b.append_op("square", {"X": "a"}, {"Out": "b"})
    b.append_op("square", {"X": "b"}, {"Out": "a"})
    b.append_op("mean", {"X": "a"}, {"Out": "c"})
    b.append_op("square", {"X": "a"}, {"Out": "a"})
    return b


def test_raw_war_waw_edges_are_the_nearest_ones() -> None:
    block = hazard_block()
    g = op_dependency_graph(block)
    assert sorted(g.nodes) == [0, 1, 2, 3, 4]
    assert g.nodes[2]["op"] is block.ops[2]
    assert edges(g) == {
        (0, 1): (("raw",), ("a",)),
        (1, 2): (("raw", "war"), ("a", "b")),  # reads b from op 1; op 1 read a, which op 2 overwrites
        (0, 2): (("waw",), ("a",)),
        (2, 3): (("raw",), ("a",)),
        (2, 4): (("raw", "waw"), ("a",)),
        (3, 4): (("war",), ("a",)),
    }
    # Not kept: 0 → 3 (op 2 rewrote a in between), 1 → 4 (op 2's write separates them).
    assert all(a < b for a, b in g.edges)


def test_control_variables_order_send_and_recv() -> None:
    p = Program()
    b = p.global_block()
    b.create_var("g", (4,))
    b.create_var("w", (4,), persistable=True)
    b.create_var("dummy", type="raw")
    b.create_var("barrier", type="raw")
    b._append_raw_op("send", {"X": ["g"]}, {"Out": ["dummy"]}, {})
    b._append_raw_op("send_barrier", {"X": ["dummy"]}, {"Out": ["barrier"]}, {})
    b._append_raw_op("recv", {"X": ["barrier"]}, {"Out": ["w"]}, {})
    b._append_raw_op("fetch_barrier", {}, {"Out": ["w"]}, {})
    assert edges(op_dependency_graph(b)) == {
        (0, 1): (("raw",), ("dummy",)),
        (1, 2): (("raw",), ("barrier",)),
        (2, 3): (("waw",), ("w",)),
    }
    assert topological_order(b) == [0, 1, 2, 3]


def test_def_use_chains_in_order() -> None:
    chains = def_use_chains(hazard_block())
    assert chains == {
        "a": [(0, "def"), (1, "use"), (2, "def"), (3, "use"), (4, "use"), (4, "def")],
        "b": [(1, "def"), (2, "use")],
        "c": [(3, "def")],
    }
    assert list(chains) == ["a", "b", "c"]


def test_topological_order_respects_edges_lowest_index_first() -> None:
    p = Program()
    b = p.global_block()
    for name in ("x", "y", "u", "v"):
        b.create_var(name)
    b._append_raw_op("square", {"X": ["y"]}, {"Out": ["v"]}, {})  # 0: independent of 1
    b._append_raw_op("square", {"X": ["x"]}, {"Out": ["u"]}, {})  # 1
    b._append_raw_op("square", {"X": ["u"]}, {"Out": ["y"]}, {})  # 2: after 0 (WAR on y) and 1 (RAW u)
    order = topological_order(b)
    assert order == [0, 1, 2]
    g = op_dependency_graph(b)
    assert set(g.edges) == {(0, 2), (1, 2)}
    position = {n: k for k, n in enumerate(order)}
    assert all(position[a] < position[c] for a, c in g.edges)


def test_results_are_cached_until_the_program_mutates() -> None:
    block = hazard_block()
    g1 = op_dependency_graph(block)
    assert op_dependency_graph(block) is g1
    with pytest.raises(nx.NetworkXError):
        g1.add_edge(0, 4)  # the cached graph is frozen
    chains = def_use_chains(block)
    chains["a"].clear()  # callers get copies
    assert def_use_chains(block)["a"][0] == (0, "def")
    block.append_op("mean", {"X": "c"}, {"Out": "b"})
    g2 = op_dependency_graph(block)
    assert g2 is not g1
    assert g2.number_of_nodes() == 6
    assert edges(g2)[(3, 5)] == (("raw",), ("c",))
    assert def_use_chains(block)["b"][-1] == (5, "def")
    assert topological_order(block) == [0, 1, 2, 3, 4, 5]
    block.remove_op(5)
    assert op_dependency_graph(block).number_of_nodes() == 5


def test_cache_does_not_keep_the_program_alive() -> None:
    block = hazard_block()
    op_dependency_graph(block)
    ref = weakref.ref(block.program)
    del block
    gc.collect()
    assert ref() is None


@pytest.mark.serial  # timed (< 2 s)
def test_graph_of_a_long_chain_is_linear() -> None:
    p = Program()
    b = p.global_block()
    n = 20_000
    for i in range(n + 1):
        b.create_var(f"v{i}", (8,))
    for i in range(n):
        b._append_raw_op("square", {"X": [f"v{i}"]}, {"Out": [f"v{i + 1}"]}, {})
    start = time.perf_counter()
    g = op_dependency_graph(b)
    elapsed = time.perf_counter() - start
    assert g.number_of_nodes() == n
    assert g.number_of_edges() == n - 1
    assert elapsed < 2.0, f"building the graph of {n} ops took {elapsed:.2f}s"
