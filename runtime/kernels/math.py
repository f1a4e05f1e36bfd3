"""Kernels: arithmetic, reductions, activations, comparisons and tensor creation (``ir/ops/math.py``).

Invariants:
- Every kernel honours declared dtypes: outputs have the dtype shape inference gives them (numeric
  results are cast back to the input's dtype, never left to JAX's promotion rules, which under x64
  would turn ``float32 * python float`` results of some helpers into float64).
- ``scale``, ``assign`` and ``sum`` accept SelectedRows; ``sum`` of only SelectedRows concatenates
  rows and values (gradient accumulation of a shared sparse table), a mix of dense and sparse is
  dense.
- Random kernels draw only from ``ins["@RNG"][0]``, a JAX PRNG key the executor derives from the
  program seed (or the op's ``seed`` attribute), so runs are reproducible.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from runtime.kernels.registry import RNG_SLOT, Ins, kernel, one, opt
from runtime.scope import ExecutionError, SelectedRows

Outs = dict[str, list[Any]]
Attrs = dict[str, Any]


def _flatten2(x: Any, num_col_dims: int) -> Any:
    rows = 1
    for d in x.shape[:num_col_dims]:
        rows *= d
    return x.reshape(rows, -1)


@kernel("mul")
def mul(ins: Ins, attrs: Attrs) -> Outs:
    x, y = one(ins, "X"), one(ins, "Y")
    xn, yn = attrs["x_num_col_dims"], attrs["y_num_col_dims"]
    out = _flatten2(x, xn) @ _flatten2(y, yn)
    return {"Out": [out.reshape(x.shape[:xn] + y.shape[yn:])]}


@kernel("matmul")
def matmul(ins: Ins, attrs: Attrs) -> Outs:
    """Fluid's matmul: a rank-1 X is a row vector and a rank-1 Y a column vector, whatever the
    transpose flags; their unit dims are dropped from Out; batch dims broadcast."""
    x, y = one(ins, "X"), one(ins, "Y")
    x2 = x[None, :] if x.ndim == 1 else (jnp.swapaxes(x, -1, -2) if attrs["transpose_X"] else x)
    y2 = y[:, None] if y.ndim == 1 else (jnp.swapaxes(y, -1, -2) if attrs["transpose_Y"] else y)
    out = jnp.matmul(x2, y2)
    if x.ndim == 1:
        out = jnp.squeeze(out, -2)
    if y.ndim == 1:
        out = jnp.squeeze(out, -1)
    if out.ndim == 0:
        out = out.reshape(1)
    alpha = attrs["alpha"]
    return {"Out": [out if alpha == 1.0 else (out * alpha).astype(out.dtype)]}


def _bcast_y(x: Any, y: Any, axis: int) -> Any:
    """Y reshaped so that numpy broadcasting puts its dims at X's ``axis`` (Fluid's rule)."""
    if y.ndim == x.ndim:
        return y
    start = x.ndim - y.ndim if axis == -1 else axis
    return y.reshape((1,) * start + y.shape + (1,) * (x.ndim - start - y.ndim))


_ELEMENTWISE: dict[str, Callable[[Any, Any], Any]] = {
    "elementwise_add": jnp.add,
    "elementwise_sub": jnp.subtract,
    "elementwise_mul": jnp.multiply,
    "elementwise_div": jnp.divide,
    "elementwise_max": jnp.maximum,
    "elementwise_min": jnp.minimum,
    "elementwise_pow": jnp.power,
}


def _elementwise(fn: Callable[[Any, Any], Any]) -> Callable[[Ins, Attrs], Outs]:
    def k(ins: Ins, attrs: Attrs) -> Outs:
        x, y = one(ins, "X"), one(ins, "Y")
        return {"Out": [fn(x, _bcast_y(x, y, attrs["axis"])).astype(x.dtype)]}

    return k


for _t, _f in _ELEMENTWISE.items():
    kernel(_t)(_elementwise(_f))


@kernel("mean")
def mean(ins: Ins, attrs: Attrs) -> Outs:
    x = one(ins, "X")
    return {"Out": [jnp.mean(x).astype(x.dtype).reshape(1)]}


@kernel("square")
def square(ins: Ins, attrs: Attrs) -> Outs:
    x = one(ins, "X")
    return {"Out": [x * x]}


@kernel("fill_constant")
def fill_constant(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [jnp.full(tuple(attrs["shape"]), attrs["value"], dtype=attrs["dtype"])]}


# --- scale, sum, assign -----------------------------------------------------------------------------
def _map_values(x: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to a dense array, or to the values of SelectedRows (rows and height kept)."""
    if isinstance(x, SelectedRows):
        return SelectedRows(x.rows, fn(x.values), x.height)
    return fn(x)


@kernel("scale")
def scale(ins: Ins, attrs: Attrs) -> Outs:
    s, b, after = attrs["scale"], attrs["bias"], attrs["bias_after_scale"]

    def f(v: Any) -> Any:
        out = v * s + b if after else (v + b) * s
        return out.astype(v.dtype)

    return {"Out": [_map_values(one(ins, "X"), f)]}


@kernel("sum")
def sum_(ins: Ins, attrs: Attrs) -> Outs:
    xs = ins["X"]
    sparse = [x for x in xs if isinstance(x, SelectedRows)]
    dense = [x for x in xs if not isinstance(x, SelectedRows)]
    if sparse and not dense:
        heights = sorted({s.height for s in sparse})
        if len(heights) != 1:
            raise ExecutionError(f"sum of selected rows with different heights {heights}",
                                 hint="every X of a sparse sum must describe rows of the same table")
        rows = jnp.concatenate([s.rows.astype(jnp.int64) for s in sparse])
        values = jnp.concatenate([s.values for s in sparse])
        return {"Out": [SelectedRows(rows, values, heights[0])]}
    out = dense[0]
    for d in dense[1:]:
        out = out + d
    for s in sparse:
        out = out.at[s.rows].add(s.values.astype(out.dtype))
    return {"Out": [out]}


@kernel("assign")
def assign(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [one(ins, "X")]}


@kernel("recompute_barrier")
def recompute_barrier(ins: Ins, attrs: Attrs) -> Outs:
    # One barrier over the values and their dependencies: XLA can neither CSE what follows with the
    # forward pass (the values are new) nor schedule it before the dependencies exist (jax.checkpoint's trick).
    xs, _ = jax.lax.optimization_barrier((list(ins["X"]), list(ins.get("Dep", []))))
    return {"Out": list(xs)}


# --- reductions ---------------------------------------------------------------------------------------
def _reduce(fn: Callable[..., Any]) -> Callable[[Ins, Attrs], Outs]:
    def k(ins: Ins, attrs: Attrs) -> Outs:
        x = one(ins, "X")
        keep = attrs["keep_dim"]
        axes = tuple(range(x.ndim)) if attrs["reduce_all"] else tuple(sorted({d % x.ndim for d in attrs["dim"]}))
        out = fn(x, axis=axes, keepdims=keep).astype(x.dtype)
        return {"Out": [out.reshape(1) if out.ndim == 0 else out]}

    return k


kernel("reduce_sum")(_reduce(jnp.sum))
kernel("reduce_mean")(_reduce(jnp.mean))
kernel("reduce_max")(_reduce(jnp.max))


# --- unary elementwise ------------------------------------------------------------------------------
_UNARY: dict[str, Callable[[Any], Any]] = {
    "sqrt": jnp.sqrt,
    "exp": jnp.exp,
    "log": jnp.log,
    "abs": jnp.abs,
    "relu": jax.nn.relu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "softsign": lambda x: x / (1 + jnp.abs(x)),
    "floor": jnp.floor,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # Fluid's exact erf form
}


def _unary(fn: Callable[[Any], Any]) -> Callable[[Ins, Attrs], Outs]:
    def k(ins: Ins, attrs: Attrs) -> Outs:
        x = one(ins, "X")
        return {"Out": [fn(x).astype(x.dtype)]}

    return k


for _t, _f in _UNARY.items():
    kernel(_t)(_unary(_f))


@kernel("softmax")
def softmax(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [jax.nn.softmax(one(ins, "X"), axis=attrs["axis"])]}


@kernel("cast")
def cast(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [one(ins, "X").astype(attrs["out_dtype"])]}


@kernel("cast_grad")
def cast_grad(ins: Ins, attrs: Attrs) -> Outs:
    """X@GRAD = Out@GRAD cast back to in_dtype (jax.vjp has no cotangent for an integer Out)."""
    x = one(ins, "X")
    g = opt(ins, "Out@GRAD")
    return {"X@GRAD": [jnp.zeros_like(x) if g is None else g.astype(attrs["in_dtype"]).reshape(x.shape)]}


# --- tensor creation ----------------------------------------------------------------------------------
def _static_shape(shape: list[int], op: str) -> tuple[int, ...]:
    if any(d < 0 for d in shape):
        raise ExecutionError(f"{op}: attr shape {shape} has an unknown (-1) extent at run time",
                             hint="give every extent, or use fill_constant_batch_size_like")
    return tuple(shape)


@kernel("fill_constant_batch_size_like")
def fill_constant_batch_size_like(ins: Ins, attrs: Attrs) -> Outs:
    x = one(ins, "Input")
    shape = list(attrs["shape"])
    shape[attrs["output_dim_idx"]] = x.shape[attrs["input_dim_idx"]]
    return {"Out": [jnp.full(tuple(shape), attrs["value"], dtype=attrs["dtype"])]}


@kernel("fill_zeros_like")
def fill_zeros_like(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [jnp.zeros_like(one(ins, "X"))]}


@kernel("uniform_random")
def uniform_random(ins: Ins, attrs: Attrs) -> Outs:
    shape = _static_shape(attrs["shape"], "uniform_random")
    out = jax.random.uniform(ins[RNG_SLOT][0], shape, attrs["dtype"], attrs["min"], attrs["max"])
    return {"Out": [out]}


@kernel("gaussian_random")
def gaussian_random(ins: Ins, attrs: Attrs) -> Outs:
    shape = _static_shape(attrs["shape"], "gaussian_random")
    z = jax.random.normal(ins[RNG_SLOT][0], shape, attrs["dtype"])
    return {"Out": [(z * attrs["std"] + attrs["mean"]).astype(attrs["dtype"])]}


@kernel("truncated_gaussian_random")
def truncated_gaussian_random(ins: Ins, attrs: Attrs) -> Outs:
    shape = _static_shape(attrs["shape"], "truncated_gaussian_random")
    z = jax.random.truncated_normal(ins[RNG_SLOT][0], -2.0, 2.0, shape, attrs["dtype"])
    return {"Out": [(z * attrs["std"] + attrs["mean"]).astype(attrs["dtype"])]}


@kernel("increment")
def increment(ins: Ins, attrs: Attrs) -> Outs:
    x = one(ins, "X")
    return {"Out": [x + jnp.asarray(attrs["step"]).astype(x.dtype)]}


# --- comparisons and logic ----------------------------------------------------------------------------
_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "less_than": jnp.less,
    "less_equal": jnp.less_equal,
    "greater_than": jnp.greater,
    "greater_equal": jnp.greater_equal,
    "equal": jnp.equal,
    "not_equal": jnp.not_equal,
}


def _compare(fn: Callable[[Any, Any], Any]) -> Callable[[Ins, Attrs], Outs]:
    def k(ins: Ins, attrs: Attrs) -> Outs:
        x, y = one(ins, "X"), one(ins, "Y")
        return {"Out": [fn(x, _bcast_y(x, y, attrs["axis"]))]}

    return k


for _t, _f in _COMPARE.items():
    kernel(_t)(_compare(_f))


@kernel("logical_and")
def logical_and(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [jnp.logical_and(one(ins, "X"), one(ins, "Y"))]}


@kernel("logical_or")
def logical_or(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [jnp.logical_or(one(ins, "X"), one(ins, "Y"))]}


@kernel("logical_not")
def logical_not(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [jnp.logical_not(one(ins, "X"))]}


@kernel("where")
def where(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [jnp.where(one(ins, "Condition"), one(ins, "X"), one(ins, "Y"))]}
