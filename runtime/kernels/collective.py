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
- ``dgc_momentum`` (Deep Gradient Compression, Lin et al. 2018, as Fluid 1.6's ``dgc_momentum``) is an
  optimizer op that does its own exchange: before ``rampup_begin_step`` a dense ``psum`` (mean) and a
  momentum update; from then on local clipping (``local_grad_clip_norm * nranks**-0.5``), momentum
  correction (``U = mu*U + g``), local accumulation (``V += U``), top-k of ``|V|``, an ``all_gather``
  of the (index, value) pairs, momentum factor masking (sent entries zeroed in ``U`` and ``V``) and
  ``Param -= lr * mean of the gathered sparse gradients``. Shapes stay static: ``k`` is the k of the
  *smallest* sparsity of the schedule; at a later (sparser) stage only the first ``k_stage`` of the
  sorted top-k entries are kept, the rest are sent as (index, 0) and not masked, so the bytes on the
  wire are those of the first stage throughout.
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


def _allreduce_dense(xs: list[Any], axis: str, shared: bool = True) -> list[Any]:
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
        return [p / jnp.asarray(n, p.dtype) for p in _allreduce_dense(ps, axis, shared=False)]

    due = jnp.reshape(step, (-1,))[0] % attrs["k_steps"] == 0
    return {"ParamOut": lax.cond(due, average, lambda ps: list(ps), params), "StepOut": [step]}


def dgc_k(numel: int, sparsity: float) -> int:
    """Entries sent at ``sparsity`` (``numel * (1 - sparsity)`` rounded down, at least one; the
    product is first rounded to 6 decimals so 40 * (1 - 0.9) is 4, not 3)."""
    return max(1, min(numel, int(round(numel * (1.0 - sparsity), 6))))


def dgc_stage(step: Any, begin: int, rampup_step: int, stages: int) -> Any:
    """Index into the sparsity list at (0-based) ``step`` >= ``begin`` (Fluid's ``get_period_sparcity``)."""
    idx = (step - begin) * stages // max(1, rampup_step)
    return jnp.clip(idx, 0, stages - 1)


def _dgc_dense(p: Any, u: Any, v: Any, g: Any, lr: Any, mu: float, nesterov: bool, axis: str | None,
               n: Any) -> tuple[Any, Any, Any]:
    if axis is not None:
        g = lax.psum(g, axis) / jnp.asarray(n, g.dtype)
    u2 = u * mu + g
    step = g + u2 * mu if nesterov else u2
    return p - lr * step, u2, v


def _dgc_sparse(p: Any, u: Any, v: Any, g: Any, lr: Any, stage: Any, attrs: dict[str, Any], axis: str | None,
                n: Any) -> tuple[Any, Any, Any]:
    mu = attrs["mu"]
    clip = float(attrs.get("local_grad_clip_norm", -1.0))
    if clip > 0:
        trainers = int(attrs.get("num_trainers", 0)) or n
        limit = jnp.asarray(clip, g.dtype) / jnp.sqrt(jnp.asarray(trainers, g.dtype))
        norm = jnp.sqrt(jnp.sum(g * g))
        g = g * (limit / jnp.maximum(norm, limit))
    if attrs.get("use_nesterov", False):
        u2 = (u + g) * mu
        v2 = v + u2 + g
    else:
        u2 = u * mu + g
        v2 = v + u2
    flat = jnp.ravel(v2)
    sparsity = list(attrs["sparsity"])
    ks = jnp.asarray([dgc_k(flat.size, s) for s in sparsity], jnp.int32)
    k = dgc_k(flat.size, min(sparsity))
    _, idx = lax.top_k(jnp.abs(flat), k)
    keep = jnp.arange(k) < ks[stage]
    vals = jnp.where(keep, flat[idx], jnp.zeros((), flat.dtype))
    sent = jnp.zeros(flat.shape, bool).at[idx].set(keep)
    u3 = jnp.where(sent.reshape(u2.shape), jnp.zeros((), u2.dtype), u2)
    v3 = jnp.where(sent.reshape(v2.shape), jnp.zeros((), v2.dtype), v2)
    if axis is not None:
        idx = lax.all_gather(idx, axis, tiled=True)
        vals = lax.all_gather(vals, axis, tiled=True)
    dense = jnp.zeros(flat.shape, flat.dtype).at[idx].add(vals) / jnp.asarray(n, flat.dtype)
    return p - lr * dense.reshape(p.shape), u3, v3


@kernel("dgc_momentum")
def dgc_momentum(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    p, u, v = one(ins, "Param"), one(ins, "U"), one(ins, "V")
    g = jnp.asarray(one(ins, "Grad"), p.dtype).reshape(p.shape)
    lr = jnp.asarray(one(ins, "LearningRate"), p.dtype).reshape(())
    step_in = one(ins, "Step")
    step = jnp.reshape(step_in, (-1,))[0].astype(jnp.int32)
    axis = current_axis()
    n = 1 if axis is None else lax.psum(1, axis)
    begin = int(attrs.get("rampup_begin_step", 0))
    stage = dgc_stage(step, begin, int(attrs.get("rampup_step", 1)), len(attrs["sparsity"]))
    p2, u2, v2 = lax.cond(step < begin,
                          lambda: _dgc_dense(p, u, v, g, lr, attrs["mu"], bool(attrs.get("use_nesterov", False)),
                                             axis, n),
                          lambda: _dgc_sparse(p, u, v, g, lr, stage, attrs, axis, n))
    return {"ParamOut": [p2.astype(p.dtype)], "UOut": [u2.astype(u.dtype)], "VOut": [v2.astype(v.dtype)],
            "StepOut": [step_in + jnp.ones_like(step_in)]}


__all__ = ["collective_axis", "dgc_k", "dgc_stage", "current_axis"]
