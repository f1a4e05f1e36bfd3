"""Reading and writing a few rows of a large table held on the device, without touching the rest, and
the per-step bookkeeping of a distributed table's ids.

``np.asarray`` of a device array can copy the whole table (about 4 ms for 64 MB on this machine), and a
host write would need a copy back; these compiled gathers and scatters move only the rows. Row counts are
padded to a power of two so each compiles for a few sizes, not once per call.

A step's ids (``UniqueIds``): sorted once on the host (``IdSorter``), then shared by the three places
that need them: the shards ``split_ids`` hands to ``prefetch``, ``merge_ids`` putting the fetched rows
back in the ids' order (one numpy gather by the inverse), and the merge of the gradient's duplicate
rows (``sum_rows``: a compiled segment sum by the same inverse, where the gradient already is, so only
the merged rows come to the host). Measured on a
CTR step (26 x 512 ids, zipf; CPU time): the numpy bookkeeping this replaces (sort-unique, argsort +
searchsorted + gather, stable argsort + reduceat, ~2.4 ms) against ~0.4 ms; a fixed-size
``jnp.unique(size=n, return_inverse=True)`` inside compiled code took ~2 ms for the unique alone, so
the unique stays on the host.

Invariants: ``ids == unique[inverse]``; ``unique`` is sorted and free of duplicates; ``sum_rows`` pads
its segment count to a power of two (padding segments are never read back).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from runtime.scope import ExecutionError

from runtime.x64 import with_x64


def padded_size(n: int) -> int:
    """The power of two at least ``n`` (0 for 0): the row counts compiled code is padded to."""
    return 1 << (n - 1).bit_length() if n else 0


@with_x64  # called from pserver handlers too, outside any Executor.run
def gather_rows(table: Any, rows: np.ndarray) -> np.ndarray:
    """``table[rows]`` as a new host array (``rows`` in range)."""
    n = len(rows)
    if not n:
        return np.zeros((0,) + tuple(np.shape(table)[1:]), np.dtype(table.dtype))
    padded = np.zeros(padded_size(n), np.int64)
    padded[:n] = rows
    return np.asarray(_gather(table, padded))[:n]


@with_x64
def set_rows(table: Any, rows: np.ndarray, values: np.ndarray) -> Any:
    """``table`` with ``rows`` set to ``values``, in place: ``table`` is donated and must not be used again."""
    n = len(rows)
    size = padded_size(n)
    padded_rows = np.full(size, np.shape(table)[0], np.int64)  # row ``height``: dropped by the scatter
    padded_rows[:n] = rows
    padded = np.zeros((size,) + tuple(np.shape(table)[1:]), np.dtype(table.dtype))
    padded[:n] = values
    return _set(table, padded_rows, padded)


@jax.jit
def _gather(table: Any, rows: Any) -> Any:
    return table[rows]


@functools.partial(jax.jit, donate_argnums=0)
def _set(table: Any, rows: Any, values: Any) -> Any:
    return table.at[rows].set(values, mode="drop")


@dataclass(frozen=True)
class UniqueIds:
    """A step's ids (``ids``, flat int64, as given), their sorted unique values and the inverse
    (``ids == unique[inverse]``, int32: the index of the compiled segment sum)."""

    ids: np.ndarray
    unique: np.ndarray
    inverse: np.ndarray

    def shard_positions(self, shards: int) -> np.ndarray:
        """Where each unique id sits in its shards' rows laid end to end, shard ``k`` holding the ids
        ``id % shards == k`` in sorted order (as ``split_ids`` cuts them and ``prefetch`` answers them)."""
        if shards == 1:
            return np.arange(len(self.unique), dtype=np.int32)
        by_shard = np.argsort(self.unique % shards, kind="stable")
        positions = np.empty(len(self.unique), np.int32)
        positions[by_shard] = np.arange(len(self.unique), dtype=np.int32)
        return positions


class IdSorter:
    """``unique_ids`` for one thread, keeping scratch memory between steps. Three ways, by the ids' range:

    - ids in ``[0, SPAN_PER_ID * len(ids))`` (at least ``[0, MIN_SPAN)``): marked in a boolean array over
      that span, read back in order (``np.flatnonzero``), each unique id's position written to a lookup
      array that then gives the inverse (a CTR step's 13k ids of a 1M-row table: ~0.2 ms, against
      ~0.65 ms for ``np.unique`` with its inverse). The scratch (5 bytes an id of the span) is kept
      and grows to the largest span met; only the touched marks are cleared.
    - otherwise, ids and positions packed into one int64 key when both fit (one ``np.sort``, no argsort);
    - otherwise ``np.unique``.
    """

    MIN_SPAN = 1 << 21  # 10 MB of scratch at most for any step
    SPAN_PER_ID = 64

    def __init__(self) -> None:
        self._mark = np.zeros(0, bool)
        self._position = np.zeros(0, np.int32)

    def __call__(self, ids: np.ndarray) -> UniqueIds:
        """Sort ``ids`` (flat int64) once: their unique values and the inverse."""
        n = len(ids)
        if n >= np.iinfo(np.int32).max:
            raise ExecutionError(f"{n} ids in one step; at most {np.iinfo(np.int32).max - 1} are supported",
                                 hint="feed smaller batches")
        if not n:
            return UniqueIds(ids, ids[:0].copy(), np.zeros(0, np.int32))
        low, high = int(ids.min()), int(ids.max())
        if low >= 0 and high < max(self.MIN_SPAN, self.SPAN_PER_ID * n):
            return self._marked(ids, high + 1)
        index_bits = (n - 1).bit_length()
        if low >= 0 and high.bit_length() + index_bits <= 62:
            return _packed_unique(ids, index_bits)
        unique, inverse = np.unique(ids, return_inverse=True)
        return UniqueIds(ids, unique, inverse.astype(np.int32, copy=False).reshape(-1))

    def _marked(self, ids: np.ndarray, span: int) -> UniqueIds:
        if len(self._mark) < span:
            size = padded_size(span)
            self._mark, self._position = np.zeros(size, bool), np.empty(size, np.int32)
        mark = self._mark
        mark[ids] = True
        unique = np.flatnonzero(mark[:span]).astype(np.int64, copy=False)
        mark[unique] = False
        self._position[unique] = np.arange(len(unique), dtype=np.int32)
        return UniqueIds(ids, unique, self._position[ids])


def _packed_unique(ids: np.ndarray, index_bits: int) -> UniqueIds:
    """``unique_ids`` by one sort of ``id << index_bits | position`` keys (non-negative ids that fit)."""
    n = len(ids)
    keys = (ids << index_bits) | np.arange(n, dtype=np.int64)
    keys.sort()
    ordered = keys >> index_bits
    starts = np.empty(n, bool)
    starts[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    inverse = np.empty(n, np.int32)
    inverse[keys & ((1 << index_bits) - 1)] = np.cumsum(starts, dtype=np.int32) - 1
    return UniqueIds(ids, ordered[starts], inverse)


def unique_ids(ids: np.ndarray) -> UniqueIds:
    """Sort ``ids`` (flat int64) once: their unique values and the inverse (``IdSorter`` without kept
    scratch)."""
    return IdSorter()(ids)


@with_x64
def sum_rows(values: Any, inverse: np.ndarray, count: int) -> np.ndarray:
    """Per unique id ``k < count`` the sum of the ``values`` rows whose ``inverse`` is ``k``, as a host
    array ``[count, ...]``: a compiled segment sum, where ``values`` lives (a device array stays there)."""
    if not count:
        return np.zeros((0,) + tuple(np.shape(values)[1:]), np.dtype(values.dtype))
    return np.asarray(_segment_sum(values, inverse, padded_size(count)))[:count]


@functools.partial(jax.jit, static_argnums=2)
def _segment_sum(values: Any, inverse: Any, segments: int) -> Any:
    return jax.ops.segment_sum(values, inverse, num_segments=segments, indices_are_sorted=False)
