"""The ``x64`` fixture, for tests that call kernels or build 64-bit JAX values themselves."""
from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture
def x64() -> Iterator[None]:
    """Run the test under ``runtime.x64.x64()``: kernels called directly (not through ``Executor.run``, which
    enters it) see the 64-bit types they always see in a run, and the test's own ``jnp`` int64/float64
    values stay 64-bit. JAX's global configuration is left alone, as Flotilla leaves it."""
    from runtime.x64 import x64 as scoped

    with scoped():
        yield
