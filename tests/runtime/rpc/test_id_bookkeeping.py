"""A distributed table's per-step id bookkeeping: ``runtime.rows``' shared sort (``unique_ids``,
``sum_rows``) against numpy references, and the trainer's helper ops reusing it in one
program (``split_ids`` → ``lookup_sparse_table`` per shard, standing in for a pserver's prefetch answer
→ ``merge_ids``, then ``split_ids`` of the table's selected-rows gradient): the same rows and values as
the numpy merges they replace, with duplicate ids, zero (padding) rows, row counts that are not powers
of two, several shards and several Ids inputs."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

import runtime
from ir.core import Program
from runtime.kernels import rpc as rpc_kernels
from runtime.kernels.rpc import merge_duplicate_rows
from runtime.rows import IdSorter, sum_rows, unique_ids
from runtime.scope import ExecutionError, Scope, SelectedRows
from runtime.x64 import x64

RNG = np.random.default_rng(24)
WIDTH = 3
HEIGHT = 50


# --- runtime.rows --------------------------------------------------------------------------------------------
def _zipf_ids(n: int) -> np.ndarray:
    return ((RNG.zipf(1.3, n) - 1) % HEIGHT).astype(np.int64)


@pytest.mark.parametrize("n", [1, 7, 64, 1000])
def test_unique_ids_inverse_rebuilds_the_ids(n: int) -> None:
    ids = _zipf_ids(n)
    got = unique_ids(ids)
    np.testing.assert_array_equal(got.unique, np.unique(ids))
    np.testing.assert_array_equal(got.unique[got.inverse], ids)
    assert got.inverse.dtype == np.int32 and got.ids is ids


def _ids_for(path: str, n: int) -> np.ndarray:
    """``n`` zipf-skewed ids whose range sends ``IdSorter`` down ``path``."""
    ids = _zipf_ids(n)
    if path == "marked":  # within the marked span
        return ids * 997
    if path == "packed":  # past the marked span, small enough to pack with the positions
        return ids * (1 << 30) + 5
    return ids * (1 << 40) - (1 << 45)  # negative and wide: np.unique


@pytest.mark.parametrize("path", ["marked", "packed", "np.unique"])
@pytest.mark.parametrize("n", [0, 1, 2, 300, 5000])
def test_every_way_of_the_sorter_gives_numpys_unique_and_inverse(path: str, n: int) -> None:
    sorter = IdSorter()
    for _ in range(3):  # the marked way's scratch is reused: a step's marks must not leak into the next
        ids = _ids_for(path, n)
        got = sorter(ids)
        want, inverse = np.unique(ids, return_inverse=True)
        np.testing.assert_array_equal(got.unique, want)
        np.testing.assert_array_equal(got.inverse, inverse.reshape(-1))
        assert got.unique.dtype == np.int64 and got.inverse.dtype == np.int32 and got.ids is ids


def test_the_marked_scratch_grows_to_the_largest_span() -> None:
    sorter = IdSorter()
    small, large = np.array([3, 1, 3], np.int64), np.array([IdSorter.MIN_SPAN - 1, 0, 7], np.int64)
    np.testing.assert_array_equal(sorter(small).unique, [1, 3])
    np.testing.assert_array_equal(sorter(large).unique, [0, 7, IdSorter.MIN_SPAN - 1])
    np.testing.assert_array_equal(sorter(small).inverse, [1, 0, 1])


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_shard_positions_index_the_shards_laid_end_to_end(shards: int) -> None:
    ids = unique_ids(_zipf_ids(300))
    laid = np.concatenate([ids.unique[ids.unique % shards == k] for k in range(shards)])
    np.testing.assert_array_equal(laid[ids.shard_positions(shards)], ids.unique)


@pytest.mark.parametrize("n", [1, 6, 129])
@pytest.mark.parametrize("on_device", [False, True])
def test_sum_rows_matches_numpy_merge_of_duplicates(n: int, on_device: bool) -> None:
    ids = unique_ids(_zipf_ids(n))
    values = RNG.normal(size=(n, WIDTH))
    values[ids.ids == ids.ids[0]] = 0.0  # a padding id's rows: lookup_table_grad zeroes them
    with x64():
        got = sum_rows(jax.device_put(values) if on_device else values, ids.inverse, len(ids.unique))
    want_rows, want = merge_duplicate_rows(ids.ids, values)
    np.testing.assert_array_equal(ids.unique, want_rows)
    assert got.dtype == np.float64 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(got[ids.inverse[0]], 0.0)  # the padding id's rows sum to zero


def test_sum_rows_of_no_ids_is_empty() -> None:
    got = sum_rows(np.zeros((0, WIDTH), np.float32), np.zeros(0, np.int32), 0)
    assert got.shape == (0, WIDTH) and got.dtype == np.float32


# --- the helper ops in one program ----------------------------------------------------------------------------
def _program(ids_shapes: list[tuple[int, ...]], shards: int, x_of: list[int] | None = None) -> Program:
    """split_ids(ids...) → lookup_sparse_table(W, shard k) → merge_ids → emb_j; split_ids(grad) → gshard_k.
    ``x_of[k]``: the shard whose rows stand in for shard k's prefetch answer (default k)."""
    program = Program()
    block = program.global_block()
    ids = [f"ids_{j}" for j in range(len(ids_shapes))]
    for name, shape in zip(ids, ids_shapes):
        block.create_var(name, shape, "int64", is_data=True)
    block.create_var("W", (HEIGHT, WIDTH), "float64", is_data=True)
    block.create_var("grad", (HEIGHT, WIDTH), "float64", type="selected_rows", is_data=True)
    shard = [f"shard_{k}" for k in range(shards)]
    rows = [f"rows_{k}" for k in range(shards)]
    for name in shard + rows + [f"emb_{j}" for j in range(len(ids))] + [f"gshard_{k}" for k in range(shards)]:
        block.create_var(name)
    block.append_op("split_ids", {"Ids": ids}, {"Out": shard}, {})
    for k in range(shards):
        block.append_op("lookup_sparse_table", {"W": ["W"], "Ids": [shard[(x_of or range(shards))[k]]]},
                        {"Out": [rows[k]]}, {})
    block.append_op("merge_ids", {"Ids": ids, "Rows": shard, "X": rows}, {"Out": [f"emb_{j}" for j in range(len(ids))]},
                    {})
    block.append_op("split_ids", {"Ids": ["grad"]}, {"Out": [f"gshard_{k}" for k in range(shards)]}, {})
    return program


def _run(program: Program, feed: dict[str, Any], fetch: list[str], exe: Any = None) -> list[Any]:
    exe = exe or runtime.Executor()
    return exe.run(program, feed=feed, fetch_list=fetch, scope=Scope(), return_numpy=False)


CASES = [([(13, 1)], 1), ([(13, 1)], 3), ([(4, 6)], 2), ([(9, 1), (5, 1)], 2), ([(2, 1)], 4)]


@pytest.mark.parametrize("shapes,shards", CASES, ids=[f"{s}-x{n}" for s, n in CASES])
def test_split_merge_and_gradient_merge_share_one_sort(shapes: list[tuple[int, ...]], shards: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    merged_by_split = []
    real = rpc_kernels._merge_split
    monkeypatch.setattr(rpc_kernels, "_merge_split", lambda *a: merged_by_split.append(1) or real(*a))
    ids = [_zipf_ids(int(np.prod(s))).reshape(s) for s in shapes]
    ids[0].flat[1] = ids[0].flat[0]  # at least one duplicate
    table = RNG.normal(size=(HEIGHT, WIDTH))
    flat = np.concatenate([i.reshape(-1) for i in ids])
    grad_values = RNG.normal(size=(len(flat), WIDTH))
    grad_values[flat == flat[0]] = 0.0  # padding rows
    feed = {**{f"ids_{j}": v for j, v in enumerate(ids)}, "W": table,
            "grad": SelectedRows(flat, grad_values, HEIGHT)}
    exe = runtime.Executor()
    fetch = [f"emb_{j}" for j in range(len(ids))] + [f"gshard_{k}" for k in range(shards)]
    got = _run(_program(shapes, shards), feed, fetch, exe)
    assert merged_by_split == [1], "merge_ids searched instead of using split_ids' sort"
    for j, i in enumerate(ids):
        lead = i.shape[:-1] if i.shape[-1] == 1 else i.shape
        np.testing.assert_array_equal(np.asarray(got[j]), table[i.reshape(lead)])
        assert np.asarray(got[j]).ctypes.data % 64 == 0, "merged rows outside aligned memory: XLA copies them"
    want_rows, want_values = merge_duplicate_rows(flat, grad_values)
    for k, out in enumerate(got[len(ids):]):
        mine = want_rows % shards == k
        assert isinstance(out, SelectedRows) and out.height == HEIGHT
        np.testing.assert_array_equal(np.asarray(out.rows), want_rows[mine])
        np.testing.assert_allclose(np.asarray(out.values), want_values[mine], rtol=1e-12, atol=1e-12)


def test_gradient_of_other_ids_is_merged_by_numpy() -> None:
    ids = np.array([[4], [1], [4], [7]], np.int64)
    rows = np.array([3, 3, 9], np.int64)  # not the ids split_ids sorted
    values = RNG.normal(size=(3, WIDTH))
    got = _run(_program([(4, 1)], 2), {"ids_0": ids, "W": RNG.normal(size=(HEIGHT, WIDTH)),
                                          "grad": SelectedRows(rows, values, HEIGHT)}, ["gshard_0", "gshard_1"])
    np.testing.assert_array_equal(np.asarray(got[0].rows), [])
    np.testing.assert_array_equal(np.asarray(got[1].rows), [3, 9])
    np.testing.assert_allclose(np.asarray(got[1].values), [values[0] + values[1], values[2]])


def test_prefetch_answer_of_the_wrong_length_fails() -> None:
    ids = np.array([[0], [1], [3], [5]], np.int64)  # shard 0: [0]; shard 1: [1, 3, 5]
    program = _program([(4, 1)], 2, x_of=[1, 1])  # shard 0 "answered" with shard 1's three rows
    with pytest.raises(ExecutionError, match="3 rows for the 1 ids of its shard"):
        _run(program, {"ids_0": ids, "W": RNG.normal(size=(HEIGHT, WIDTH)),
                       "grad": SelectedRows(ids.reshape(-1), np.zeros((4, WIDTH)), HEIGHT)}, ["emb_0"])

