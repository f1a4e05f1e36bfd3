"""The parameter-server helper kernels (split_byref, split_selected_rows, split_ids, merge_ids,
lookup_sparse_table, ref_by_trainer_id) against numpy references, each run as a one-op Program through
runtime.Executor (tests/runtime/op_samples.py builds the programs, so shape inference runs too)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ir.errors import IRError
from runtime.scope import ExecutionError, SelectedRows
from tests.runtime.op_samples import Sample, Sparse, build, run

RNG = np.random.default_rng(11)


def _run(op_type: str, inputs: dict[str, list[Any]], outputs: dict[str, int] | None = None,
         **attrs: Any) -> dict[str, list[Any]]:
    """Run ``op_type`` once; its outputs by slot, as the runtime holds them."""
    built = build(op_type, Sample(inputs=inputs, attrs=attrs, outputs=outputs or {}))
    names = [(slot, n) for slot, ns in built.outputs.items() for n in ns]
    values = run(built, [n for _, n in names])
    out: dict[str, list[Any]] = {}
    for (slot, _), value in zip(names, values):
        out.setdefault(slot, []).append(value)
    return out


def _rows(sr: Any) -> np.ndarray:
    assert isinstance(sr, SelectedRows), f"expected SelectedRows, got {type(sr).__name__}"
    return np.asarray(sr.rows)


# --- split_byref -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sections", [[2, 5], [3, 3, 1], [7], [0, 7]])
def test_split_byref_splits_rows_by_sections(sections: list[int]) -> None:
    x = RNG.normal(size=(7, 3)).astype(np.float32)
    outs = _run("split_byref", {"X": [x]}, {"Out": len(sections)}, sections=sections)["Out"]
    bounds = np.cumsum(sections)[:-1]
    for got, want in zip(outs, np.split(x, bounds, axis=0), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_split_byref_without_sections_is_rejected() -> None:
    x = RNG.normal(size=(6, 2, 2)).astype(np.float64)
    with pytest.raises(IRError, match="sections is empty"):
        _run("split_byref", {"X": [x]}, {"Out": 3})


# --- split_selected_rows -----------------------------------------------------------------------------------------
def _dense(rows: np.ndarray, values: np.ndarray, height: int) -> np.ndarray:
    out = np.zeros((height,) + values.shape[1:], values.dtype)
    np.add.at(out, rows, values)
    return out


def test_split_selected_rows_makes_rows_section_relative_and_merges_duplicates() -> None:
    rows = np.array([7, 0, 3, 4, 9, 3], np.int64)
    values = RNG.normal(size=(6, 2)).astype(np.float32)
    outs = _run("split_selected_rows", {"X": [Sparse(rows, values, 10)]}, {"Out": 3},
                height_sections=[4, 3, 3])["Out"]
    starts = [0, 4, 7]
    for out, start, height in zip(outs, starts, [4, 3, 3], strict=True):
        mask = (rows >= start) & (rows < start + height)
        np.testing.assert_allclose(_dense(_rows(out), np.asarray(out.values), height),
                                   _dense(rows[mask] - start, values[mask], height), rtol=1e-6)
        assert out.height == height
    assert [_rows(o).tolist() for o in outs] == [[0, 3], [0], [0, 2]]  # row 3 sent once, summed


def test_split_selected_rows_section_without_rows_is_empty() -> None:
    values = np.ones((2, 3), np.float32)
    outs = _run("split_selected_rows", {"X": [Sparse(np.array([0, 1]), values, 6)]}, {"Out": 2},
                height_sections=[3, 3])["Out"]
    assert _rows(outs[1]).shape == (0,) and outs[1].values.shape == (0, 3) and outs[1].height == 3
    # the sum of the pieces, placed at their offsets, is the input
    dense = np.concatenate([np.asarray(o.to_dense()) for o in outs])
    np.testing.assert_array_equal(dense, Sparse(np.array([0, 1]), values, 6).dense())


# --- split_ids ---------------------------------------------------------------------------------------------------
def test_split_ids_dense_ids_are_unique_sorted_and_sharded_by_modulo() -> None:
    ids = np.array([[9], [4], [4], [0], [7], [9], [2]], np.int64)
    outs = _run("split_ids", {"Ids": [ids]}, {"Out": 3})["Out"]
    unique = np.unique(ids)
    for i, out in enumerate(outs):
        got = np.asarray(out)
        assert got.shape[1:] == (1,) and got.dtype == np.int64
        np.testing.assert_array_equal(got.reshape(-1), unique[unique % 3 == i])
    assert [np.asarray(o).reshape(-1).tolist() for o in outs] == [[0, 9], [4, 7], [2]]


def test_split_ids_merges_several_ids_inputs() -> None:
    a = np.array([[5], [1]], np.int64)
    b = np.array([[1], [2], [6]], np.int64)
    outs = _run("split_ids", {"Ids": [a, b]}, {"Out": 2})["Out"]
    assert [np.asarray(o).reshape(-1).tolist() for o in outs] == [[2, 6], [1, 5]]


def test_split_ids_shard_without_ids_is_empty() -> None:
    outs = _run("split_ids", {"Ids": [np.array([[2], [4]], np.int64)]}, {"Out": 2})["Out"]
    assert np.asarray(outs[1]).size == 0


def test_split_ids_selected_rows_buckets_rows_keeping_global_ids_and_height() -> None:
    rows = np.array([5, 2, 8, 5, 3], np.int64)
    values = RNG.normal(size=(5, 4)).astype(np.float32)
    outs = _run("split_ids", {"Ids": [Sparse(rows, values, 12)]}, {"Out": 3})["Out"]
    for i, out in enumerate(outs):
        mask = rows % 3 == i
        np.testing.assert_allclose(_dense(_rows(out), np.asarray(out.values), 12),
                                   _dense(rows[mask], values[mask], 12), rtol=1e-6)
        assert out.height == 12
    assert [_rows(o).tolist() for o in outs] == [[3], [], [2, 5, 8]]  # merged: row 5 sent once


# --- merge_ids ---------------------------------------------------------------------------------------------------
TABLE = RNG.normal(size=(20, 3)).astype(np.float32)


def _shards(ids: list[np.ndarray], n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """What split_ids + prefetch give merge_ids: each shard's ids and their rows of TABLE."""
    unique = np.unique(np.concatenate([i.reshape(-1) for i in ids]))
    shard_ids = [unique[unique % n == k].reshape(-1, 1) for k in range(n)]
    return shard_ids, [TABLE[s.reshape(-1)] for s in shard_ids]


def test_merge_ids_puts_rows_back_in_the_ids_order_with_duplicates() -> None:
    ids = np.array([[7], [2], [7], [4], [0], [13]], np.int64)
    rows, xs = _shards([ids], 2)
    (out,) = _run("merge_ids", {"Ids": [ids], "Rows": rows, "X": xs})["Out"]
    np.testing.assert_array_equal(np.asarray(out), TABLE[ids.reshape(-1)])
    assert np.asarray(out).shape == (6, 3)


def test_merge_ids_several_ids_inputs_get_one_output_each() -> None:
    a = np.array([[3], [11], [3]], np.int64)
    b = np.array([[11], [6]], np.int64)
    rows, xs = _shards([a, b], 2)
    outs = _run("merge_ids", {"Ids": [a, b], "Rows": rows, "X": xs}, {"Out": 2})["Out"]
    np.testing.assert_array_equal(np.asarray(outs[0]), TABLE[[3, 11, 3]])
    np.testing.assert_array_equal(np.asarray(outs[1]), TABLE[[11, 6]])


def test_merge_ids_with_a_shard_that_got_no_ids() -> None:
    # ids 3, 6, 11 over 3 shards: shard 1 (ids r % 3 == 1) gets none, and prefetch answers it with 0 rows.
    ids = np.array([[3], [11], [6], [3]], np.int64)
    rows, xs = _shards([ids], 3)
    assert rows[1].size == 0 and xs[1].shape == (0, 3)
    (out,) = _run("merge_ids", {"Ids": [ids], "Rows": rows, "X": xs})["Out"]
    np.testing.assert_array_equal(np.asarray(out), TABLE[[3, 11, 6, 3]])


def test_merge_ids_drops_only_a_trailing_1_of_the_ids_shape() -> None:
    ids = np.array([[1, 4, 9], [9, 0, 1]], np.int64)
    rows, xs = _shards([ids], 2)
    (out,) = _run("merge_ids", {"Ids": [ids], "Rows": rows, "X": xs})["Out"]
    np.testing.assert_array_equal(np.asarray(out), TABLE[ids])
    assert np.asarray(out).shape == (2, 3, 3)


def test_merge_ids_with_unordered_shard_rows() -> None:
    ids = np.array([[8], [1], [5]], np.int64)
    rows = [np.array([[8]], np.int64), np.array([[5], [1]], np.int64)]
    xs = [TABLE[[8]], TABLE[[5, 1]]]
    (out,) = _run("merge_ids", {"Ids": [ids], "Rows": rows, "X": xs})["Out"]
    np.testing.assert_array_equal(np.asarray(out), TABLE[[8, 1, 5]])


def test_merge_ids_of_an_id_no_shard_fetched_fails() -> None:
    ids = np.array([[1], [3]], np.int64)
    with pytest.raises(ExecutionError, match="not fetched from any shard"):
        _run("merge_ids", {"Ids": [ids], "Rows": [np.array([[1]], np.int64)], "X": [TABLE[[1]]]})


# --- lookup_sparse_table -----------------------------------------------------------------------------------------
def test_lookup_sparse_table_gathers_rows() -> None:
    w = RNG.normal(size=(6, 4)).astype(np.float32)
    ids = np.array([[3], [0], [5], [3]], np.int64)
    (out,) = _run("lookup_sparse_table", {"W": [w], "Ids": [ids]})["Out"]
    np.testing.assert_array_equal(np.asarray(out), w[[3, 0, 5, 3]])


def test_lookup_sparse_table_padding_idx_reads_zeros() -> None:
    w = RNG.normal(size=(6, 4)).astype(np.float32)
    ids = np.array([[3], [0], [5], [0]], np.int64)
    (out,) = _run("lookup_sparse_table", {"W": [w], "Ids": [ids]}, padding_idx=0)["Out"]
    want = w[[3, 0, 5, 0]].copy()
    want[[1, 3]] = 0
    np.testing.assert_array_equal(np.asarray(out), want)


def test_lookup_sparse_table_ids_without_trailing_1() -> None:
    w = RNG.normal(size=(6, 2)).astype(np.float32)
    ids = np.array([[1, 2], [5, 1]], np.int64)
    (out,) = _run("lookup_sparse_table", {"W": [w], "Ids": [ids]})["Out"]
    np.testing.assert_array_equal(np.asarray(out), w[ids])


@pytest.mark.parametrize("bad", [6, -1])
def test_lookup_sparse_table_out_of_range_id_fails(bad: int) -> None:
    w = np.zeros((6, 2), np.float32)
    with pytest.raises(ExecutionError, match="outside the 6 rows"):
        _run("lookup_sparse_table", {"W": [w], "Ids": [np.array([[1], [bad]], np.int64)]})


# --- ref_by_trainer_id -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trainer", [0, 1, 2])
def test_ref_by_trainer_id_picks_the_trainers_input(trainer: int) -> None:
    xs = [RNG.normal(size=(2, 3)).astype(np.float32) for _ in range(3)]
    (out,) = _run("ref_by_trainer_id", {"X": xs, "TrainerId": [np.array([trainer], np.int64)]})["Out"]
    np.testing.assert_array_equal(np.asarray(out), xs[trainer])


@pytest.mark.parametrize("trainer", [3, -1])
def test_ref_by_trainer_id_out_of_range_fails(trainer: int) -> None:
    xs = [np.zeros((2,), np.float32)] * 3
    with pytest.raises(ExecutionError, match=f"trainer id {trainer} is out of range for 3 inputs"):
        _run("ref_by_trainer_id", {"X": xs, "TrainerId": [np.array([trainer], np.int64)]})
