"""Kernel registry: one JAX function per op type, and host kernels for ops that run between
compiled runs.

A kernel is a pure function ``(ins, attrs) -> outs`` where ``ins`` and ``outs`` map slot names to lists
of arrays (always lists, in the op's slot order) and ``attrs`` is the op's attribute dict (static under
``jax.jit``). Random kernels find a PRNG key in ``ins["@RNG"]``. A ``*_grad`` op without a kernel of its
own gets ``jax.vjp`` of its forward kernel (see ``vjp_grad_kernel``); write one by hand only where that
is wrong or slow.

A host kernel is ``(ctx, op) -> None``: it reads and writes the scope itself (RPC, IO, delete_var).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from ir.names import GRAD_SUFFIX
from ir.ops.registry import find_op_def, suggest
from runtime.scope import ExecutionError, SelectedRows

Ins = dict[str, list[Any]]
Kernel = Callable[[Ins, dict[str, Any]], dict[str, list[Any]]]
HostKernel = Callable[[Any, Any], None]
RNG_SLOT = "@RNG"

_KERNELS: dict[str, Kernel] = {}
_HOST_KERNELS: dict[str, HostKernel] = {}
_SHAPE_ONLY: dict[str, tuple[str, ...]] = {}


def kernel(*op_types: str, shape_only: tuple[str, ...] = ()) -> Callable[[Kernel], Kernel]:
    """Register a JAX kernel for each of ``op_types``. The kernel reads only the shape and dtype of the
    inputs in the ``shape_only`` slots: the executor passes their declared ``jax.ShapeDtypeStruct``
    instead of a value (so e.g. ``lookup_table_grad`` runs on a trainer that does not hold the table)."""

    def deco(fn: Kernel) -> Kernel:
        for t in op_types:
            if t in _KERNELS or t in _HOST_KERNELS:
                raise ExecutionError(f"a kernel for op type {t!r} is registered twice")
            _KERNELS[t] = fn
            if shape_only:
                _SHAPE_ONLY[t] = tuple(shape_only)
        return fn

    return deco


def shape_only_slots(op_type: str) -> tuple[str, ...]:
    """The input slots of ``op_type`` whose kernel reads only shape and dtype."""
    return _SHAPE_ONLY.get(op_type, ())


def host_kernel(*op_types: str) -> Callable[[HostKernel], HostKernel]:
    """Register a host kernel ``(ctx, op) -> None`` for each of ``op_types``."""

    def deco(fn: HostKernel) -> HostKernel:
        for t in op_types:
            if t in _KERNELS or t in _HOST_KERNELS:
                raise ExecutionError(f"a kernel for op type {t!r} is registered twice")
            _HOST_KERNELS[t] = fn
        return fn

    return deco


def is_host_op(op_type: str) -> bool:
    return op_type in _HOST_KERNELS


def get_host_kernel(op_type: str) -> HostKernel:
    return _HOST_KERNELS[op_type]


def has_kernel(op_type: str) -> bool:
    return op_type in _KERNELS or op_type in _HOST_KERNELS or _vjp_source(op_type) is not None


def get_kernel(op_type: str) -> Kernel:
    """The JAX kernel of ``op_type`` (a generated vjp kernel for ``*_grad`` ops without their own)."""
    k = _KERNELS.get(op_type)
    if k is not None:
        return k
    if _vjp_source(op_type) is not None:
        k = vjp_grad_kernel(op_type)
        _KERNELS[op_type] = k
        return k
    raise ExecutionError(f"op type {op_type!r} has no kernel",
                         hint=suggest(op_type, list(_KERNELS) + list(_HOST_KERNELS)) or
                         "register one with runtime.kernels.registry.kernel")


def registered_kernel_types() -> list[str]:
    return sorted(set(_KERNELS) | set(_HOST_KERNELS))


def _vjp_source(op_type: str) -> str | None:
    op_def = find_op_def(op_type)
    if op_def is None or op_def.forward_type is None or op_def.forward_type not in _KERNELS:
        return None
    return op_def.forward_type


def _differentiable(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def vjp_grad_kernel(grad_type: str) -> Kernel:
    """A kernel for ``grad_type`` computed as ``jax.vjp`` of the forward op's kernel.

    Inputs of the forward op that are not floating point (ids, labels) get no gradient; a missing
    ``Out@GRAD`` input counts as zeros (that output does not reach the loss).
    """
    grad_def = find_op_def(grad_type)
    fwd_def = find_op_def(grad_def.forward_type)
    fwd_kernel = _KERNELS[grad_def.forward_type]
    fwd_in = [s.name for s in fwd_def.inputs]
    out_slots = [s.name[: -len(GRAD_SUFFIX)] for s in grad_def.inputs if s.name.endswith(GRAD_SUFFIX)]
    wrt = [s.name[: -len(GRAD_SUFFIX)] for s in grad_def.outputs]

    def grad_kernel(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
        primal = {s: ins[s] for s in fwd_in if s in ins}
        if RNG_SLOT in ins:
            primal[RNG_SLOT] = ins[RNG_SLOT]
        diff = {s: list(primal[s]) for s in wrt if s in primal and all(_differentiable(v) for v in primal[s])}
        given = [s for s in out_slots if (s + GRAD_SUFFIX) in ins]

        def f(d: dict[str, list[Any]]) -> dict[str, list[Any]]:
            outs = fwd_kernel({**primal, **d}, attrs)
            return {s: outs[s] for s in given}

        outs, pullback = jax.vjp(f, diff)
        cot = {s: [jnp.asarray(g, o.dtype).reshape(o.shape) for g, o in zip(ins[s + GRAD_SUFFIX], outs[s])]
               for s in given}
        (grads,) = pullback(cot)
        return {s + GRAD_SUFFIX: grads[s] for s in grads}

    grad_kernel.__name__ = f"vjp_{grad_type}"
    return grad_kernel


def one(ins: Ins, slot: str) -> Any:
    """The single array of ``slot``."""
    return ins[slot][0]


def opt(ins: Ins, slot: str) -> Any | None:
    """The single array of a dispensable ``slot``, or None."""
    values = ins.get(slot)
    return values[0] if values else None


def dense(x: Any) -> Any:
    """A dense array for ``x`` (SelectedRows are scattered into zeros)."""
    return x.to_dense() if isinstance(x, SelectedRows) else x
