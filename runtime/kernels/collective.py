"""Kernels of the collective ops: ``gen_nccl_id`` forms the trainer group (a host kernel); the others
are pure JAX and lower to XLA collectives inside the compiled step.

The executor traces a data-parallel run under ``jax.shard_map`` and names the mesh axis through
``collective_axis`` while it traces; outside such a run (one rank) every collective is the identity,
which is what a group of one computes.

- ``c_allreduce_sum`` of several dense variables concatenates them into one flat buffer per dtype, so a
  bucket costs one collective; a selected-rows gradient is gathered (rows and values of every rank,
  concatenated: their sum as a SelectedRows) instead of densified.
- ``c_broadcast`` is a ``psum`` of the root's value and zeros elsewhere.
- ``c_local_sgd`` averages only on every ``k_steps``-th step, under ``lax.cond``, so the other steps
  pay no communication.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax.numpy as jnp
from jax import lax

from runtime.kernels.registry import Ins, host_kernel, kernel, one
from runtime.scope import SelectedRows

_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("flotilla_collective_axis", default=None)


@contextlib.contextmanager
def collective_axis(axis: str | None) -> Iterator[None]:
    """Trace the kernels inside with collectives over mesh axis ``axis`` (None: a group of one)."""
    token = _AXIS.set(axis)
    try:
        yield
    finally:
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


def _allreduce_dense(xs: list[Any], axis: str) -> list[Any]:
    if len(xs) == 1:
        return [lax.psum(xs[0], axis)]
    out: list[Any] = [None] * len(xs)
    by_dtype: dict[Any, list[int]] = {}
    for i, x in enumerate(xs):
        by_dtype.setdefault(jnp.result_type(x), []).append(i)
    for idx in by_dtype.values():
        flat = lax.psum(jnp.concatenate([jnp.ravel(xs[i]) for i in idx]), axis)
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
    for i, y in zip(dense, _allreduce_dense([xs[i] for i in dense], axis) if dense else []):
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
    return {"Out": [lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis)]}


@kernel("c_local_sgd")
def c_local_sgd(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    params = list(ins["Param"])
    step = one(ins, "Step") + 1
    axis = current_axis()
    if axis is None:
        return {"ParamOut": params, "StepOut": [step]}
    n = lax.psum(1, axis)

    def average(ps: list[Any]) -> list[Any]:
        return [p / jnp.asarray(n, p.dtype) for p in _allreduce_dense(ps, axis)]

    due = jnp.reshape(step, (-1,))[0] % attrs["k_steps"] == 0
    return {"ParamOut": lax.cond(due, average, lambda ps: list(ps), params), "StepOut": [step]}


__all__ = ["collective_axis", "current_axis"]
