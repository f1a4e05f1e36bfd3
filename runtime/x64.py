"""64-bit JAX types for Flotilla's own work, and only there.

Programs declare int64 ids and float64 tensors, and the runtime honours the declared dtypes, which JAX
allows only with ``jax_enable_x64``. Turning that flag on for the process would make a user's own JAX
code (outside any Flotilla program) compute in float64, so Flotilla never changes JAX's global
configuration: each entry point that hands values to JAX (``Executor.run``, ``Executor.run_block``, the
row gathers and scatters of ``runtime.rows``, ``SelectedRows.to_dense``, and JAX capture of a model with
64-bit leaves) enters ``jax.enable_x64(True)``, which is thread-local. A thread Flotilla runs JAX on (a
pserver's gRPC handlers) goes through one of those entry points, so it needs no setting of its own. JAX's
compilation caches key on the flag, so code compiled here is never reused outside, or the other way round.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])


def x64() -> Any:
    """A context in which the calling thread's JAX work has 64-bit types (thread-local; nests)."""
    return jax.enable_x64(True)


def with_x64(fn: F) -> F:
    """``fn`` run under ``x64()``: for an entry point that hands values to JAX."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with jax.enable_x64(True):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
