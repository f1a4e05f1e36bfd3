"""Kernels: the optimizer family (sgd, momentum, adagrad, adam, rmsprop, decayed_adagrad, ftrl) and the
gradient clipping ops (clip, clip_by_norm), with Fluid 1.5's update formulas.

Invariants:
- Every ``*Out`` has its input's shape and dtype: ``LearningRate`` (a [1] tensor), ``Beta1Pow`` and
  ``Beta2Pow`` and the gradient are cast to ``Param``'s dtype, float attributes are Python floats (weakly
  typed), so a float32 parameter stays float32 under x64.
- Every kernel is jittable: a SelectedRows ``Grad`` has a static number of rows; merging duplicate rows
  (``merge_rows``) sorts them and sums with ``segment_sum`` over that static size, and unused slots
  carry the out-of-range row ``height`` that row scatters drop (``mode="drop"``).
- Sparse (SelectedRows) ``Grad`` semantics follow Fluid 1.5 op by op:

  ============================  =====================================================================
  sgd                           ``Param[rows[i]] -= lr * values[i]`` per row, duplicates add up
  momentum, rmsprop             the dense update with a zero gradient for untouched rows (Fluid's
                                ``SparseMomentumFunctor`` / ``SparseRmspropGradFunctor``): every
                                velocity / moment decays, every row can move
  adam, ``lazy_mode=False``     the dense update with a zero gradient for untouched rows
  adam, ``lazy_mode=True``      merged rows only: untouched rows of Param/Moment1/Moment2 are unchanged
  adagrad, ftrl                 merged rows only (Fluid's ``SparseAdagradFunctor``/``SparseFTRLFunctor``)
  decayed_adagrad               merged rows only (Fluid 1.5 accepts only a dense Grad here; this is
                                the row-wise extension, consistent with adagrad)
  clip, clip_by_norm            merge duplicate rows, then clip the merged values (Out is SelectedRows)
  ============================  =====================================================================
- ``adam`` does not advance ``Beta1Pow``/``Beta2Pow``; the optimizer appends ``scale`` ops for that.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from runtime.kernels.registry import kernel, one, opt
from runtime.scope import SelectedRows

Outs = dict[str, list[Any]]


# --- helpers
def _scalar(x: Any, dtype: Any) -> Any:
    """The single element of a [1] tensor as a 0-d array of ``dtype``."""
    return jnp.asarray(x, dtype).reshape(())


def _lr(ins: dict, param: Any) -> Any:
    return _scalar(one(ins, "LearningRate"), param.dtype)


def merge_rows(grad: SelectedRows) -> SelectedRows:
    """Each distinct row of ``grad`` once (ascending), with the sum of its values.

    The result keeps the static length ``n`` of ``grad.rows``: slots past the number of distinct rows have
    row ``height`` (out of range, so row scatters with ``mode="drop"`` and ``to_dense`` skip them) and zero
    values.
    """
    rows = jnp.asarray(grad.rows)
    values = jnp.asarray(grad.values)
    n = rows.shape[0]
    if n == 0:
        return SelectedRows(rows, values, grad.height)
    order = jnp.argsort(rows, stable=True)
    sorted_rows = rows[order]
    is_new = jnp.concatenate([jnp.ones((1,), bool), sorted_rows[1:] != sorted_rows[:-1]])
    segment = jnp.cumsum(is_new) - 1
    summed = jax.ops.segment_sum(values[order], segment, num_segments=n, indices_are_sorted=True)
    unique_rows = jnp.full((n,), grad.height, rows.dtype).at[segment].set(sorted_rows)
    return SelectedRows(unique_rows, summed.astype(values.dtype), grad.height)


def _dense_grad(grad: Any, param: Any) -> Any:
    """The gradient as a dense array of Param's shape and dtype (SelectedRows rows add up)."""
    if isinstance(grad, SelectedRows):
        values = jnp.asarray(grad.values, param.dtype).reshape((-1, *param.shape[1:]))
        return jnp.zeros(param.shape, param.dtype).at[grad.rows].add(values, mode="drop")
    return jnp.asarray(grad, param.dtype).reshape(param.shape)


def _merged(grad: SelectedRows, param: Any) -> tuple[Any, Any]:
    """Merged (rows, values) of a SelectedRows grad, values cast to Param's dtype and row shape."""
    merged = merge_rows(grad)
    return merged.rows, jnp.asarray(merged.values, param.dtype).reshape((-1, *param.shape[1:]))


def _take(x: Any, rows: Any) -> Any:
    return x.at[rows].get(mode="fill", fill_value=0)


def _put(x: Any, rows: Any, new: Any) -> Any:
    return x.at[rows].set(new.astype(x.dtype), mode="drop")


# --- sgd
@kernel("sgd")
def sgd(ins: dict, attrs: dict) -> Outs:
    param, grad = one(ins, "Param"), one(ins, "Grad")
    lr = _lr(ins, param)
    if isinstance(grad, SelectedRows):
        values = jnp.asarray(grad.values, param.dtype).reshape((-1, *param.shape[1:]))
        return {"ParamOut": [param.at[grad.rows].add(-lr * values, mode="drop")]}
    return {"ParamOut": [param - lr * _dense_grad(grad, param)]}


# --- momentum
@kernel("momentum")
def momentum(ins: dict, attrs: dict) -> Outs:
    param, velocity = one(ins, "Param"), one(ins, "Velocity")
    g = _dense_grad(one(ins, "Grad"), param)  # sparse: zero gradient for untouched rows, as Fluid
    lr = _lr(ins, param)
    mu = attrs["mu"]
    v_out = velocity * mu + g
    if attrs.get("use_nesterov", False):
        p_out = param - (g + v_out * mu) * lr
    else:
        p_out = param - lr * v_out
    return {"ParamOut": [p_out], "VelocityOut": [v_out.astype(velocity.dtype)]}


# --- adagrad and decayed_adagrad
def _adagrad_step(param: Any, moment: Any, g: Any, lr: Any, eps: float, decay: float | None) -> tuple[Any, Any]:
    m_out = moment + g * g if decay is None else decay * moment + (1.0 - decay) * g * g
    return param - lr * g / (jnp.sqrt(m_out) + eps), m_out


def _adagrad_like(ins: dict, attrs: dict, decay: float | None) -> Outs:
    param, moment, grad = one(ins, "Param"), one(ins, "Moment"), one(ins, "Grad")
    lr = _lr(ins, param)
    eps = attrs["epsilon"]
    if isinstance(grad, SelectedRows):
        rows, g = _merged(grad, param)
        p_rows, m_rows = _adagrad_step(_take(param, rows), _take(moment, rows), g, lr, eps, decay)
        return {"ParamOut": [_put(param, rows, p_rows)], "MomentOut": [_put(moment, rows, m_rows)]}
    p_out, m_out = _adagrad_step(param, moment, _dense_grad(grad, param), lr, eps, decay)
    return {"ParamOut": [p_out], "MomentOut": [m_out]}


@kernel("adagrad")
def adagrad(ins: dict, attrs: dict) -> Outs:
    return _adagrad_like(ins, attrs, None)


@kernel("decayed_adagrad")
def decayed_adagrad(ins: dict, attrs: dict) -> Outs:
    return _adagrad_like(ins, attrs, attrs["decay"])


# --- adam
@kernel("adam")
def adam(ins: dict, attrs: dict) -> Outs:
    param, grad = one(ins, "Param"), one(ins, "Grad")
    m1, m2 = one(ins, "Moment1"), one(ins, "Moment2")
    b1, b2, eps = attrs["beta1"], attrs["beta2"], attrs["epsilon"]
    b1p = _scalar(one(ins, "Beta1Pow"), param.dtype)
    b2p = _scalar(one(ins, "Beta2Pow"), param.dtype)
    lr = _lr(ins, param) * jnp.sqrt(1.0 - b2p) / (1.0 - b1p)

    def step(p: Any, m1_: Any, m2_: Any, g: Any) -> tuple[Any, Any, Any]:
        m1_out = b1 * m1_ + (1.0 - b1) * g
        m2_out = b2 * m2_ + (1.0 - b2) * g * g
        return p - lr * (m1_out / (jnp.sqrt(m2_out) + eps)), m1_out, m2_out

    if isinstance(grad, SelectedRows) and attrs.get("lazy_mode", False):
        rows, g = _merged(grad, param)
        p_r, m1_r, m2_r = step(_take(param, rows), _take(m1, rows), _take(m2, rows), g)
        return {"ParamOut": [_put(param, rows, p_r)], "Moment1Out": [_put(m1, rows, m1_r)],
                "Moment2Out": [_put(m2, rows, m2_r)]}
    p_out, m1_out, m2_out = step(param, m1, m2, _dense_grad(grad, param))
    return {"ParamOut": [p_out], "Moment1Out": [m1_out], "Moment2Out": [m2_out]}


# --- rmsprop
@kernel("rmsprop")
def rmsprop(ins: dict, attrs: dict) -> Outs:
    param, ms, mom = one(ins, "Param"), one(ins, "MeanSquare"), one(ins, "Moment")
    g = _dense_grad(one(ins, "Grad"), param)  # sparse: zero gradient for untouched rows, as Fluid
    lr = _lr(ins, param)
    rho, eps, momentum_ = attrs["decay"], attrs["epsilon"], attrs["momentum"]
    ms_out = rho * ms + (1.0 - rho) * g * g
    outs: Outs = {}
    if attrs.get("centered", False):
        mg = opt(ins, "MeanGrad")
        mg_out = rho * mg + (1.0 - rho) * g
        mom_out = momentum_ * mom + lr * g / jnp.sqrt(ms_out - mg_out * mg_out + eps)
        outs["MeanGradOut"] = [mg_out]
    else:
        mom_out = momentum_ * mom + lr * g / jnp.sqrt(ms_out + eps)
        mg = opt(ins, "MeanGrad")
        if mg is not None:
            outs["MeanGradOut"] = [mg]
    outs.update({"ParamOut": [param - mom_out], "MomentOut": [mom_out], "MeanSquareOut": [ms_out]})
    return outs


# --- ftrl
def _ftrl_step(p: Any, sq: Any, lin: Any, g: Any, lr: Any, l1: float, l2: float,
               lr_power: float) -> tuple[Any, Any, Any]:
    new_sq = sq + g * g
    if lr_power == -0.5:  # Fluid's fast path: pow(x, 0.5) as sqrt
        lin_out = lin + g - (jnp.sqrt(new_sq) - jnp.sqrt(sq)) / lr * p
        y = jnp.sqrt(new_sq) / lr + 2.0 * l2
    else:
        lin_out = lin + g - (jnp.power(new_sq, -lr_power) - jnp.power(sq, -lr_power)) / lr * p
        y = jnp.power(new_sq, -lr_power) / lr + 2.0 * l2
    x = l1 * jnp.sign(lin_out) - lin_out
    p_out = jnp.where(jnp.abs(lin_out) > l1, x / y, jnp.zeros_like(p))
    return p_out, new_sq, lin_out


@kernel("ftrl")
def ftrl(ins: dict, attrs: dict) -> Outs:
    param, grad = one(ins, "Param"), one(ins, "Grad")
    sq, lin = one(ins, "SquaredAccumulator"), one(ins, "LinearAccumulator")
    lr = _lr(ins, param)
    # Fluid adds 1e-10 to both strengths (in the parameter's precision).
    l1 = attrs["l1"] + 1e-10
    l2 = attrs["l2"] + 1e-10
    lr_power = attrs["lr_power"]
    if isinstance(grad, SelectedRows):
        rows, g = _merged(grad, param)
        p_r, sq_r, lin_r = _ftrl_step(_take(param, rows), _take(sq, rows), _take(lin, rows), g, lr, l1, l2,
                                      lr_power)
        return {"ParamOut": [_put(param, rows, p_r)], "SquaredAccumOut": [_put(sq, rows, sq_r)],
                "LinearAccumOut": [_put(lin, rows, lin_r)]}
    p_out, sq_out, lin_out = _ftrl_step(param, sq, lin, _dense_grad(grad, param), lr, l1, l2, lr_power)
    return {"ParamOut": [p_out], "SquaredAccumOut": [sq_out], "LinearAccumOut": [lin_out]}


# --- gradient clipping
def _valid_rows(merged: SelectedRows) -> Any:
    """Mask of the slots of a merged SelectedRows that hold a row (the rest are padding)."""
    return merged.rows < merged.height


def _mask_rows(values: Any, valid: Any) -> Any:
    return jnp.where(valid.reshape((-1,) + (1,) * (values.ndim - 1)), values, jnp.zeros_like(values))


@kernel("clip")
def clip(ins: dict, attrs: dict) -> Outs:
    x = one(ins, "X")
    lo, hi = attrs["min"], attrs["max"]
    if isinstance(x, SelectedRows):
        merged = merge_rows(x)
        values = _mask_rows(jnp.clip(merged.values, lo, hi), _valid_rows(merged))
        return {"Out": [SelectedRows(merged.rows, values, merged.height)]}
    return {"Out": [jnp.clip(x, lo, hi)]}


def _clip_by_norm(x: Any, max_norm: float) -> Any:
    norm = jnp.sqrt(jnp.sum(x * x))
    # Fluid divides by the norm even when it is not used; a zero gradient would give NaN there.
    scale = jnp.where(norm > max_norm, max_norm / jnp.where(norm > 0, norm, 1), 1)
    return (x * scale).astype(x.dtype)


@kernel("clip_by_norm")
def clip_by_norm(ins: dict, attrs: dict) -> Outs:
    x = one(ins, "X")
    max_norm = attrs["max_norm"]
    if isinstance(x, SelectedRows):
        merged = merge_rows(x)
        return {"Out": [SelectedRows(merged.rows, _clip_by_norm(merged.values, max_norm), merged.height)]}
    return {"Out": [_clip_by_norm(x, max_norm)]}
