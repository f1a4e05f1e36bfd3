"""Kernels of the collective ops: ``gen_nccl_id`` forms the trainer group (a host kernel); the others
are pure JAX and lower to XLA collectives inside the compiled step.

The executor traces a data-parallel run under ``jax.shard_map`` and names the mesh axis through
``collective_axis`` while it traces; outside such a run (one rank) every collective is the identity,
which is what a group of one computes.

- ``c_allreduce_sum`` of several dense variables concatenates them into one flat buffer per dtype, so a
  bucket costs one collective; a selected-rows gradient is gathered (rows and values of every rank,
  concatenated: their sum as a SelectedRows) instead of densified.
- ``c_broadcast`` is a sum of the root's value and zeros elsewhere.
- A dense sum is ``lax.psum`` (XLA's collective: NCCL on GPU, gloo on CPU), or, when the run was traced
  with the group's shared-memory arena (``runtime.shm_collective``: every trainer on this host, CPU), a
  call of its XLA FFI target (``runtime.shm_ffi``) summing in place, chained to the step's other such
  calls in trace order.
- ``c_local_sgd`` averages only on every ``k_steps``-th step, under ``lax.cond``, so the other steps
  pay no communication.
- ``c_allgather`` is XLA's ``all_gather``; DGC's kernels (``runtime.kernels.dgc``) use ``allgather``
  (which can also gather through the arena, as a sum of per-rank slots), ``allreduce_dense`` and
  ``switch_shared`` (a ``lax.switch`` whose branches may use the arena: the token is threaded through).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import jax.numpy as jnp
from jax import lax

from runtime.kernels.registry import Ins, host_kernel, kernel, one
from runtime.scope import SelectedRows

_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("flotilla_collective_axis", default=None)


class _SharedSum:
    """A traced step's dense sums through the group's shared-memory arena (``runtime.shm_collective``):
    each is a call of the XLA FFI target ``runtime.shm_ffi``, summing in place; a token chains them so
    XLA runs them in trace order on every rank."""

    def __init__(self, arena: Any) -> None:
        self.arena = arena
        self.token: Any = None

    def __call__(self, x: Any, axis: str) -> Any:
        from runtime import shm_ffi

        dtype = jnp.dtype(x.dtype)
        if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)) \
                or jnp.issubdtype(dtype, jnp.complexfloating):
            return lax.psum(x, axis)  # booleans, complex: XLA's collective
        token = self.token if self.token is not None else jnp.zeros((), jnp.int32)
        self.token, total = shm_ffi.allreduce(token, x)
        return total


_SHARED: contextvars.ContextVar[_SharedSum | None] = contextvars.ContextVar("flotilla_shared_sum", default=None)


@contextlib.contextmanager
def collective_axis(axis: str | None, arena: Any = None) -> Iterator[None]:
    """Trace the kernels inside with collectives over mesh axis ``axis`` (None: a group of one); dense
    sums go through ``arena`` (a ``runtime.shm_collective.Arena``) when given."""
    token = _AXIS.set(axis)
    shared = _SHARED.set(_SharedSum(arena) if arena is not None and axis is not None else None)
    try:
        yield
    finally:
        _SHARED.reset(shared)
        _AXIS.reset(token)


def current_axis() -> str | None:
    return _AXIS.get()


@host_kernel("gen_nccl_id")
def gen_nccl_id(ctx: Any, op: Any) -> None:
    from runtime.collective import join_group

    trainer_id = int(op.attr("trainer_id"))
    others = list(op.attr("other_endpoints"))
    endpoints = others[:trainer_id] + [op.attr("endpoint")] + others[trainer_id:]
    join_group(trainer_id, endpoints, program=ctx.program)


def _sum(x: Any, axis: str, shared: bool) -> Any:
    """The sum of ``x`` over the group: through the shared arena when the run has one (and ``shared``:
    not inside control flow, whose trace cannot hand the chaining token back out), else ``psum``."""
    via = _SHARED.get() if shared else None
    return via(x, axis) if via is not None else lax.psum(x, axis)


def allreduce_dense(xs: list[Any], axis: str, shared: bool = True) -> list[Any]:
    if len(xs) == 1:
        return [_sum(xs[0], axis, shared)]
    out: list[Any] = [None] * len(xs)
    by_dtype: dict[Any, list[int]] = {}
    for i, x in enumerate(xs):
        by_dtype.setdefault(jnp.result_type(x), []).append(i)
    for idx in by_dtype.values():
        flat = _sum(jnp.concatenate([jnp.ravel(xs[i]) for i in idx]), axis, shared)
        offset = 0
        for i in idx:
            size = xs[i].size
            out[i] = flat[offset:offset + size].reshape(xs[i].shape)
            offset += size
    return out


@kernel("c_allreduce_sum")
def c_allreduce_sum(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    xs = list(ins["X"])
    axis = current_axis()
    if axis is None:
        return {"Out": xs}
    dense = [i for i, x in enumerate(xs) if not isinstance(x, SelectedRows)]
    out: list[Any] = list(xs)
    for i, y in zip(dense, allreduce_dense([xs[i] for i in dense], axis) if dense else []):
        out[i] = y
    for i, x in enumerate(xs):
        if isinstance(x, SelectedRows):
            out[i] = SelectedRows(lax.all_gather(x.rows, axis, tiled=True),
                                  lax.all_gather(x.values, axis, tiled=True), x.height)
    return {"Out": out}


@kernel("c_broadcast")
def c_broadcast(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    x = one(ins, "X")
    axis = current_axis()
    if axis is None:
        return {"Out": [x]}
    mine = lax.axis_index(axis) == attrs["root"]
    return {"Out": [_sum(jnp.where(mine, x, jnp.zeros_like(x)), axis, True)]}


@kernel("c_local_sgd")
def c_local_sgd(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    params = list(ins["Param"])
    step = one(ins, "Step") + 1
    axis = current_axis()
    if axis is None:
        return {"ParamOut": params, "StepOut": [step]}
    n = lax.psum(1, axis)

    def average(ps: list[Any]) -> list[Any]:
        return [p / jnp.asarray(n, p.dtype) for p in allreduce_dense(ps, axis, shared=False)]

    due = jnp.reshape(step, (-1,))[0] % attrs["k_steps"] == 0
    return {"ParamOut": lax.cond(due, average, lambda ps: list(ps), params), "StepOut": [step]}


def switch_shared(index: Any, branches: list[Callable[[], Any]]) -> Any:
    """``lax.switch(index, branches)`` with the run's shared-memory arena usable inside the branches: the
    arena's chaining token goes into the switch as an operand and comes back out of it (every rank takes
    the same branch, so the arena's calls still pair up in order)."""
    outer = _SHARED.get()
    if outer is None:
        return lax.switch(index, branches)

    def wrap(fn: Callable[[], Any]) -> Callable[[Any], Any]:
        def run(token: Any) -> Any:
            inner = _SharedSum(outer.arena)
            inner.token = token
            reset = _SHARED.set(inner)
            try:
                out = fn()
            finally:
                _SHARED.reset(reset)
            return out, (inner.token if inner.token is not None else token)

        return run

    token = outer.token if outer.token is not None else jnp.zeros((), jnp.int32)
    out, outer.token = lax.switch(index, [wrap(f) for f in branches], token)
    return out


def allgather(x: Any, axis: str, shared: bool = False) -> Any:
    """Every rank's ``x`` concatenated along the first dimension, in rank order: XLA's ``all_gather``
    (gloo on CPU, NCCL on GPU); with ``shared`` (outside control flow) and the run's shared-memory arena,
    a sum through the arena of each rank's ``x`` in its own slot of a zero buffer (exact: the other slots
    add zeros; ``nranks`` times the bytes, so for the small payloads of DGC, where the arena's latency
    beats gloo's)."""
    via = _SHARED.get() if shared else None
    if via is None:
        return lax.all_gather(x, axis, tiled=True)
    n = lax.axis_size(axis)
    slots = jnp.zeros((n, *x.shape), x.dtype).at[lax.axis_index(axis)].set(x)
    return via(slots, axis).reshape((n * x.shape[0], *x.shape[1:]))


@kernel("c_allgather")
def c_allgather(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    x = one(ins, "X")
    axis = current_axis()
    return {"Out": [x if axis is None else allgather(x, axis)]}


__all__ = ["allgather", "allreduce_dense", "collective_axis", "current_axis", "switch_shared"]
