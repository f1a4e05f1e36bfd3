"""Reading and writing a few rows of a large table held on the device, without touching the rest, and
the per-step bookkeeping of a distributed table's ids.

``np.asarray`` of a device array can copy the whole table (about 4 ms for 64 MB on this machine), and a
host write would need a copy back; these compiled gathers and scatters move only the rows. Row counts are
padded to a power of two so each compiles for a few sizes, not once per call.

A step's ids (``UniqueIds``): sorted once on the host (``np.unique`` with the inverse, ~0.15 ms for a CTR
step's 13k ids), then shared by the three places that need them: the shards ``split_ids`` hands to
``prefetch``, ``merge_ids`` putting the fetched rows back in the ids' order (one numpy gather by the
inverse), and the merge of the gradient's duplicate rows (``sum_rows``: a compiled segment sum by the
same inverse, where the gradient already is, so only the merged rows come to the host). Measured on a
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


def unique_ids(ids: np.ndarray) -> UniqueIds:
    """Sort ``ids`` (flat int64) once: their unique values and the inverse."""
    if len(ids) >= np.iinfo(np.int32).max:
        raise ExecutionError(f"{len(ids)} ids in one step; at most {np.iinfo(np.int32).max - 1} are supported",
                             hint="feed smaller batches")
    unique, inverse = np.unique(ids, return_inverse=True)
    return UniqueIds(ids, unique, inverse.astype(np.int32, copy=False).reshape(-1))


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
