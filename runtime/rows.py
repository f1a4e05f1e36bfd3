"""Reading and writing a few rows of a large table held on the device, without touching the rest.

``np.asarray`` of a device array can copy the whole table (about 4 ms for 64 MB on this machine), and a
host write would need a copy back; these compiled gathers and scatters move only the rows. Row counts are
padded to a power of two so each compiles for a few sizes, not once per call.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

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
