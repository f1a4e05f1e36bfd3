"""``runtime.rows``: compiled row gathers and in-place row writes on a device table."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from runtime.rows import gather_rows, set_rows


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 17])
def test_gather_rows_reads_exactly_the_rows_asked(n: int) -> None:
    host = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    rows = np.random.default_rng(n).choice(40, size=n, replace=False)
    got = gather_rows(jnp.asarray(host), rows)
    assert got.shape == (n, 3) and got.dtype == np.float32
    np.testing.assert_array_equal(got, host[rows])
    np.testing.assert_array_equal(gather_rows(host, rows), host[rows])  # a host table too


@pytest.mark.parametrize("n", [0, 1, 5, 8])
def test_set_rows_writes_those_rows_and_leaves_the_rest(n: int) -> None:
    host = np.zeros((20, 2), np.float64)
    rows = np.arange(n) * 2
    values = np.arange(n * 2, dtype=np.float64).reshape(n, 2) + 1
    out = np.asarray(set_rows(jnp.asarray(host), rows, values))
    expected = host.copy()
    expected[rows] = values
    np.testing.assert_array_equal(out, expected)  # the padding rows (== height) wrote nothing


def test_set_rows_donates_the_table() -> None:
    table = jnp.ones((8, 2), jnp.float32)
    out = set_rows(table, np.array([1]), np.zeros((1, 2), np.float32))
    assert table.is_deleted() and float(out[1, 0]) == 0.0 and float(out[0, 0]) == 1.0
