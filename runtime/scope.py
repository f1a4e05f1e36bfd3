"""Scope (name → value) and SelectedRows, the sparse gradient value.

A Scope holds jax arrays (or SelectedRows) by variable name; child scopes see their parent's variables.
SelectedRows is a JAX pytree, so it flows through ``jax.jit`` like any array: ``rows`` are row indices
into a ``height``-row dense tensor (duplicates allowed: they add up), ``values`` holds one row each.
``scope_guard(scope)`` makes ``global_scope()`` return ``scope`` inside a ``with`` block, as in Fluid.

The runtime's errors live here, under one base ``ExecutionError`` (E680): ``FeedError`` (E681),
``FetchError`` (E682), ``ShapeDtypeError`` (E683), ``UninitializedVariableError`` (E684) and
``UntranspiledProgramError`` (E685); ``except ExecutionError`` catches them all.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import jax
import numpy as np

from ir.errors import FlotillaError
from ir.ops.registry import suggest
from runtime.x64 import with_x64


class ExecutionError(FlotillaError):
    """The base of every error the runtime raises while running a program (codes E680-E685)."""

    code = "E680"


class FeedError(ExecutionError):
    """A feed names no variable of the program, or a variable the program reads was not fed."""

    code = "E681"


class FetchError(ExecutionError):
    """A fetch names no variable of the program, or one this run did not compute."""

    code = "E682"


class ShapeDtypeError(ExecutionError):
    """A value's shape or dtype disagrees with the variable's declaration (a feed, a loaded file)."""

    code = "E683"


class UninitializedVariableError(ExecutionError):
    """A variable is read before anything gave it a value (e.g. the startup program has not run)."""

    code = "E684"


class UntranspiledProgramError(ExecutionError):
    """A distributed trainer was asked to run a program that was handed to ``DistributeTranspiler.transpile``
    instead of the program the transpiler made from it."""

    code = "E685"


@jax.tree_util.register_pytree_node_class
@dataclass
class SelectedRows:
    rows: Any  # int64 [n]
    values: Any  # [n, *row_shape]
    height: int

    def tree_flatten(self) -> tuple[tuple[Any, Any], int]:
        return (self.rows, self.values), self.height

    @classmethod
    def tree_unflatten(cls, height: int, children: tuple[Any, Any]) -> "SelectedRows":
        return cls(children[0], children[1], height)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.height, *self.values.shape[1:])

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    @with_x64  # a user's Scope.numpy or fetched rows too: int64/float64 values stay 64-bit
    def to_dense(self) -> Any:
        import jax.numpy as jnp

        dense = jnp.zeros(self.shape, self.values.dtype)
        return dense.at[self.rows].add(self.values)


class Scope:
    """Variables by name. ``find_var`` looks in parent scopes too; ``set_var`` writes here."""

    def __init__(self, parent: "Scope | None" = None) -> None:
        self.parent = parent
        self._vars: dict[str, Any] = {}

    def set_var(self, name: str, value: Any) -> None:
        self._vars[name] = value

    def find_var(self, name: str) -> Any | None:
        scope: Scope | None = self
        while scope is not None:
            if name in scope._vars:
                return scope._vars[name]
            scope = scope.parent
        return None

    def has_var(self, name: str) -> bool:
        return self.find_var(name) is not None

    def var(self, name: str) -> Any:
        value = self.find_var(name)
        if value is None:
            raise UninitializedVariableError(f"variable {name!r} is not in the scope",
                                             hint=suggest(name, self.local_var_names()))
        return value

    def erase(self, names: list[str]) -> None:
        for n in names:
            self._vars.pop(n, None)

    def local_var_names(self) -> list[str]:
        return list(self._vars)

    def new_scope(self) -> "Scope":
        return Scope(self)

    def __contains__(self, name: str) -> bool:
        return self.has_var(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._vars)

    def numpy(self, name: str) -> np.ndarray:
        value = self.var(name)
        if isinstance(value, SelectedRows):
            value = value.to_dense()
        return np.asarray(value)


_global_scope = Scope()


def global_scope() -> Scope:
    """The scope ``Executor.run`` uses when given none (``scope_guard`` swaps it)."""
    return _global_scope


@contextlib.contextmanager
def scope_guard(scope: Scope) -> Iterator[None]:
    """Fluid's ``scope_guard``: ``global_scope()`` is ``scope`` inside the ``with`` block."""
    global _global_scope
    if not isinstance(scope, Scope):
        raise ExecutionError(f"scope_guard needs a Scope, got {type(scope).__name__}",
                             hint="pass runtime.Scope() (or fluid.Scope())")
    old, _global_scope = _global_scope, scope
    try:
        yield
    finally:
        _global_scope = old
