"""Scope (name → value) and SelectedRows, the sparse gradient value.

A Scope holds jax arrays (or SelectedRows) by variable name; child scopes see their parent's variables.
SelectedRows is a JAX pytree, so it flows through ``jax.jit`` like any array: ``rows`` are row indices
into a ``height``-row dense tensor (duplicates allowed: they add up), ``values`` holds one row each.
``scope_guard(scope)`` makes ``global_scope()`` return ``scope`` inside a ``with`` block, as in Fluid.

Fluid's surface: ``FluidScope`` (``fluid.Scope``, and the global scope) answers ``find_var`` with a
``ScopeVariable`` whose ``get_tensor()`` is a ``ScopeTensor``, Fluid's ``LoDTensor`` bound to the scope
(``np.array(t)``, ``t.set(array, place)``, ``shape()``, ``lod()``...). ``LoDTensor`` itself (a feed value)
lives here too, so the bound tensor shares its methods.

The runtime's errors live here, under one base ``ExecutionError`` (E680): ``FeedError`` (E681),
``FetchError`` (E682), ``ShapeDtypeError`` (E683), ``UninitializedVariableError`` (E684) and
``UntranspiledProgramError`` (E685); ``except ExecutionError`` catches them all.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from ir.errors import FlotillaError
from ir.names import seq_len_name
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
    """Variables by name. ``find_var`` returns a variable's value, looking in parent scopes too; ``set_var``
    writes here. This is the runtime's own scope: the executor and the kernels read values through it."""

    def __init__(self, parent: "Scope | None" = None) -> None:
        self.parent = parent
        self._vars: dict[str, Any] = {}
        self._writes = 0  # set_var and erase calls so far (``stamp``)

    def set_var(self, name: str, value: Any) -> None:
        self._vars[name] = value
        self._writes += 1

    def stamp(self) -> tuple[int, ...]:
        """The write counts of this scope and its ancestors: equal stamps mean no variable this scope
        can see was set or erased in between (what the executor's argument cache relies on)."""
        out = []
        scope: Scope | None = self
        while scope is not None:
            out.append(scope._writes)
            scope = scope.parent
        return tuple(out)

    def find_var(self, name: str) -> Any | None:
        return self._lookup(name)

    def _holder(self, name: str) -> "Scope | None":
        """The scope (this one or an ancestor) whose own variables include ``name``."""
        scope: Scope | None = self
        while scope is not None and name not in scope._vars:
            scope = scope.parent
        return scope

    def _lookup(self, name: str) -> Any | None:
        # The value lookup, which FluidScope's find_var does not replace: has_var and numpy (and the
        # executor's run scope, a plain Scope over the caller's) read values on every kind of scope.
        holder = self._holder(name)
        return None if holder is None else holder._vars[name]

    def has_var(self, name: str) -> bool:
        return self._lookup(name) is not None

    def var(self, name: str) -> Any:
        value = self._lookup(name)
        if value is None:
            raise UninitializedVariableError(f"variable {name!r} is not in the scope",
                                             hint=suggest(name, self.local_var_names()))
        return value

    def erase(self, names: list[str]) -> None:
        for n in names:
            self._vars.pop(n, None)
        self._writes += 1

    def local_var_names(self) -> list[str]:
        return list(self._vars)

    def new_scope(self) -> "Scope":
        return Scope(self)

    def __contains__(self, name: str) -> bool:
        return self.has_var(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._vars)

    def numpy(self, name: str) -> np.ndarray:
        value = Scope.var(self, name)
        if isinstance(value, SelectedRows):
            value = value.to_dense()
        return np.asarray(value)


class FluidScope(Scope):
    """Fluid's Scope (``fluid.Scope()``, and the process's ``global_scope()``): ``find_var(name)`` returns a
    ``ScopeVariable`` (or None), so ``np.array(scope.find_var(n).get_tensor())`` and
    ``scope.find_var(n).get_tensor().set(array, place)`` work as in Fluid; ``var(name)`` finds or creates one.

    Only what a script calls changes: the executor runs in a plain ``Scope`` whose parent is this one, and
    a plain scope's lookup walks its parents' variables directly, so kernels still read values."""

    def find_var(self, name: str) -> "ScopeVariable | None":
        return ScopeVariable(self, name) if self._lookup(name) is not None else None

    def var(self, name: str) -> "ScopeVariable":
        """Fluid's ``Scope.var``: the variable ``name``, created here (without a value) if no scope has it;
        ``get_tensor().set(...)`` gives it one."""
        return ScopeVariable(self, name)

    def new_scope(self) -> "FluidScope":
        return FluidScope(self)


class LoDTensor:
    """Fluid's LoDTensor: an array plus one level of sequence lengths (``recursive_sequence_lengths``).
    ``np.array(t)`` gives the rows, unpadded.

    The rows and the lengths are kept by four storage methods (``_value``, ``_store``, ``_lengths``,
    ``_store_lengths``); ``ScopeTensor`` replaces them to keep both in a scope instead."""

    def __init__(self, data: Any = None, recursive_seq_lens: Sequence[Sequence[int]] | None = None) -> None:
        self._data: np.ndarray | None = None if data is None else np.asarray(data)
        self._lens: list[list[int]] = []
        if recursive_seq_lens:
            self.set_recursive_sequence_lengths(recursive_seq_lens)

    def _value(self) -> np.ndarray | None:
        return self._data

    def _store(self, data: np.ndarray) -> None:
        self._data = data

    def _lengths(self) -> list[list[int]]:
        return self._lens

    def _store_lengths(self, lens: list[list[int]]) -> None:
        self._lens = lens

    def set(self, data: Any, place: Any = None) -> None:
        """Set the rows (``place`` is accepted for Fluid compatibility; arrays live on the host until fed)."""
        self._store(np.asarray(data))

    def set_recursive_sequence_lengths(self, recursive_seq_lens: Sequence[Sequence[int]]) -> None:
        lens = [[int(n) for n in level] for level in recursive_seq_lens]
        if len(lens) > 1:
            raise FeedError(f"LoDTensor: {len(lens)} levels of sequence lengths are not supported",
                            hint="use one level: [[len_0, len_1, ...]]")
        if any(n < 0 for level in lens for n in level):
            raise FeedError(f"LoDTensor: sequence lengths must be >= 0, got {lens}")
        self._store_lengths(lens)

    def recursive_sequence_lengths(self) -> list[list[int]]:
        return [list(level) for level in self._lengths()]

    def set_lod(self, lod: Sequence[Sequence[int]]) -> None:
        """Set the lengths from offsets (Fluid's ``lod``: ``[[0, 2, 5]]`` is lengths ``[[2, 3]]``)."""
        self.set_recursive_sequence_lengths([np.diff(np.asarray(level, np.int64)).tolist() for level in lod])

    def lod(self) -> list[list[int]]:
        return [np.concatenate([[0], np.cumsum(level, dtype=np.int64)]).tolist() for level in self._lengths()]

    def has_valid_recursive_sequence_lengths(self) -> bool:
        data, lens = self._value(), self._lengths()
        return data is not None and (not lens or sum(lens[-1]) == data.shape[0])

    def shape(self) -> list[int]:
        data = self._value()
        return [] if data is None else list(data.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = self._value()
        if data is None:
            raise self._no_data()
        return data if dtype is None else data.astype(dtype)

    def _no_data(self) -> ExecutionError:
        return FeedError("LoDTensor has no data", hint="call t.set(array, place) first")

    def __repr__(self) -> str:
        return f"LoDTensor(shape={self.shape()}, recursive_sequence_lengths={self._lengths()})"


class ScopeTensor(LoDTensor):
    """Fluid's LoDTensor as ``scope.find_var(name).get_tensor()`` returns it: a view of the scope's value, not a
    copy. ``set(array, place)`` replaces the value where the scope holds it, so the next ``Executor.run``
    reads it; it must keep the value's shape and dtype (an integer array whose values fit is narrowed),
    since the compiled program was built for them. The lengths live beside the rows, as the executor's
    feeds keep them, in the variable ``name@SEQ_LEN``."""

    def __init__(self, scope: Scope, name: str) -> None:
        self._scope, self._name = scope, name

    def _target(self, name: str) -> Scope:
        holder = self._scope._holder(name)
        return holder if holder is not None else self._scope

    def _value(self) -> np.ndarray | None:
        value = self._scope._lookup(self._name)
        if isinstance(value, SelectedRows):
            value = value.to_dense()
        return None if value is None else np.asarray(value)

    def _store(self, data: np.ndarray) -> None:
        old = self._scope._lookup(self._name)
        if old is not None:
            data = _like(self._name, old, data)
        self._target(self._name).set_var(self._name, np.array(data, copy=True))

    def _lengths(self) -> list[list[int]]:
        lens = self._scope._lookup(seq_len_name(self._name))
        return [] if lens is None else [np.asarray(lens).reshape(-1).tolist()]

    def _store_lengths(self, lens: list[list[int]]) -> None:
        key = seq_len_name(self._name)
        if lens:
            self._target(key).set_var(key, np.asarray(lens[-1], np.int64))
        else:
            self._target(key).erase([key])

    def _no_data(self) -> ExecutionError:
        return UninitializedVariableError(f"variable {self._name!r} has no value in the scope",
                                          hint="run the startup program first, or give it one with "
                                               "get_tensor().set(array, place)")

    def __repr__(self) -> str:
        return f"ScopeTensor({self._name!r}, shape={self.shape()}, recursive_sequence_lengths={self._lengths()})"


def _like(name: str, old: Any, data: np.ndarray) -> np.ndarray:
    """``data`` as the value replacing ``old``: same shape, same dtype (integers narrowed when they fit)."""
    if isinstance(old, SelectedRows):
        raise ShapeDtypeError(f"cannot set {name!r}: the scope holds it as SelectedRows (a sparse gradient)",
                              hint="set dense variables only (parameters, persistable state)")
    shape, dtype = tuple(old.shape), np.dtype(old.dtype)
    if tuple(data.shape) != shape:
        raise ShapeDtypeError(f"cannot set {name!r} to an array of shape {list(data.shape)}: the scope holds "
                              f"shape {list(shape)}", hint=f"pass an array of shape {list(shape)}")
    if data.dtype == dtype:
        return data
    cast = data.astype(dtype)
    if data.dtype.kind == dtype.kind == "i" and np.array_equal(cast, data):
        return cast
    raise ShapeDtypeError(f"cannot set {name!r} to a {data.dtype} array: the scope holds {dtype}",
                          hint=f"convert it first: array.astype({dtype.name!r})")


class ScopeVariable:
    """Fluid's Variable as ``FluidScope.find_var`` returns it: ``get_tensor()`` is the value's ``ScopeTensor``;
    ``np.array(variable)`` reads the value too."""

    def __init__(self, scope: Scope, name: str) -> None:
        self._scope, self.name = scope, name

    def get_tensor(self) -> ScopeTensor:
        return ScopeTensor(self._scope, self.name)

    def is_initialized(self) -> bool:
        return self._scope._lookup(self.name) is not None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.get_tensor().__array__(dtype)

    def __repr__(self) -> str:
        return f"ScopeVariable({self.name!r})"


_global_scope: Scope = FluidScope()


def global_scope() -> Scope:
    """The scope ``Executor.run`` uses when given none (``scope_guard`` swaps it)."""
    return _global_scope


@contextlib.contextmanager
def scope_guard(scope: Scope) -> Iterator[None]:
    """Fluid's ``scope_guard``: ``global_scope()`` is ``scope`` inside the ``with`` block."""
    global _global_scope
    if not isinstance(scope, Scope):
        raise ExecutionError(f"scope_guard needs a Scope, got {type(scope).__name__}",
                             hint="pass fluid.Scope() (or runtime.Scope())")
    old, _global_scope = _global_scope, scope
    try:
        yield
    finally:
        _global_scope = old
