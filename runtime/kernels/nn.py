"""Kernels: losses, embeddings, sequence ops (LoD rows with lengths, or padded batches), layout,
convolution, pooling, batch norm, layer norm, dropout and metrics (``ir/ops/nn.py``), with Fluid 1.5's semantics.

Invariants:
- Outputs have the shapes and dtypes shape inference declares (float results in the input's dtype,
  indices int64 unless the schema says int32, AUC float64).
- Hand-written gradients exist only where ``jax.vjp`` of the forward kernel is wrong or slow:
  ``lookup_table_grad`` (a scatter-add, or SelectedRows when ``is_sparse``: rows = the flattened ids,
  values = the rows of Out@GRAD, so it is cheap and jittable) and ``dropout_grad`` (it must reuse the
  forward's ``Mask``, not draw a new one).
- Kernels are NaN-free on degenerate inputs where Fluid's are: a padded sequence with no steps left
  pools to ``pad_value``, and its gradient is zero.
- LoD sequence kernels take the rows ``X [R, ...]`` and ``Length [N]``; rows past ``sum(Length)`` are
  bucket padding (``runtime/lod.py``): they never reach a pooled result, and their outputs and
  gradients are zero. Segment ids come from ``searchsorted`` over the cumulative lengths, so one
  compilation serves every batch of the same bucket.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from runtime.kernels.registry import RNG_SLOT, Ins, kernel, one, opt
from runtime.scope import SelectedRows

Outs = dict[str, list[Any]]
Attrs = dict[str, Any]


# --- losses ---------------------------------------------------------------------------------------------
def _pick(x: Any, label: Any, ignore_index: int, axis: int) -> tuple[Any, Any]:
    """(x at the class ids of ``label`` along ``axis``, mask of labels not ignored); label has extent 1
    at ``axis``. Ignored labels pick class 0 (their value is masked out by the caller)."""
    keep = label != ignore_index
    safe = jnp.where(keep, label, 0)
    return jnp.take_along_axis(x, safe, axis=axis), keep


@kernel("cross_entropy")
def cross_entropy(ins: Ins, attrs: Attrs) -> Outs:
    x, label = one(ins, "X"), one(ins, "Label")
    if attrs["soft_label"]:
        y = -jnp.sum(label * jnp.log(x), axis=-1, keepdims=True)
    else:
        picked, keep = _pick(x, label, attrs["ignore_index"], -1)
        y = jnp.where(keep, -jnp.log(jnp.where(keep, picked, 1)), 0)
    return {"Y": [y.astype(x.dtype)]}


@kernel("softmax_with_cross_entropy")
def softmax_with_cross_entropy(ins: Ins, attrs: Attrs) -> Outs:
    logits, label = one(ins, "Logits"), one(ins, "Label")
    axis = attrs["axis"] % logits.ndim
    log_p = jax.nn.log_softmax(logits, axis=axis)
    if attrs["soft_label"]:
        loss = -jnp.sum(label * log_p, axis=axis, keepdims=True)
    else:
        picked, keep = _pick(log_p, label, attrs["ignore_index"], axis)
        loss = jnp.where(keep, -picked, 0)
    return {"Softmax": [jnp.exp(log_p).astype(logits.dtype)], "Loss": [loss.astype(logits.dtype)]}


@kernel("sigmoid_cross_entropy_with_logits")
def sigmoid_cross_entropy_with_logits(ins: Ins, attrs: Attrs) -> Outs:
    x, label = one(ins, "X"), one(ins, "Label")
    keep = label != attrs["ignore_index"]
    # softplus(x) - x*label == max(x, 0) - x*label + log(1 + exp(-|x|)), smooth at 0.
    out = jnp.where(keep, jnp.logaddexp(x, 0) - x * label, 0)
    if attrs["normalize"]:
        out = out / jnp.maximum(jnp.sum(keep).astype(x.dtype), 1e-5)
    return {"Out": [out.astype(x.dtype)]}


@kernel("log_loss")
def log_loss(ins: Ins, attrs: Attrs) -> Outs:
    p, y = one(ins, "Predicted"), one(ins, "Labels")
    eps = attrs["epsilon"]
    loss = -y * jnp.log(p + eps) - (1 - y) * jnp.log(1 - p + eps)
    return {"Loss": [loss.astype(p.dtype)]}


@kernel("cos_sim")
def cos_sim(ins: Ins, attrs: Attrs) -> Outs:
    x, y = one(ins, "X"), one(ins, "Y")
    x2, y2 = x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1)
    xn = jnp.sqrt(jnp.sum(x2 * x2, axis=1, keepdims=True))
    yn = jnp.sqrt(jnp.sum(y2 * y2, axis=1, keepdims=True))
    out = jnp.sum(x2 * y2, axis=1, keepdims=True) / (xn * yn)  # Y with one row broadcasts
    return {"Out": [out], "XNorm": [xn], "YNorm": [yn]}


# --- embeddings -------------------------------------------------------------------------------------------
def _flat_ids(ids: Any) -> Any:
    """Ids ``[..., 1]`` (rank > 1) or ``[...]`` as an array of the lookup's lead shape."""
    return ids[..., 0] if ids.ndim > 1 and ids.shape[-1] == 1 else ids


@kernel("lookup_table")
def lookup_table(ins: Ins, attrs: Attrs) -> Outs:
    w, ids = one(ins, "W"), _flat_ids(one(ins, "Ids"))
    # Out-of-range ids read NaN rows, so a bad id shows in the loss instead of silently clamping.
    out = jnp.take(w, ids, axis=0, mode="fill")
    pad = attrs["padding_idx"]
    if pad != -1:
        out = jnp.where((ids == pad)[..., None], jnp.zeros((), w.dtype), out)
    return {"Out": [out]}


@kernel("lookup_table_grad", shape_only=("W",))  # W only for its height, width, dtype
def lookup_table_grad(ins: Ins, attrs: Attrs) -> Outs:
    w = one(ins, "W")
    ids = _flat_ids(one(ins, "Ids")).reshape(-1).astype(jnp.int64)
    g = opt(ins, "Out@GRAD")
    width = w.shape[1]
    values = jnp.zeros((ids.shape[0], width), w.dtype) if g is None else g.reshape(-1, width).astype(w.dtype)
    pad = attrs["padding_idx"]
    if pad != -1:
        values = jnp.where((ids == pad)[:, None], jnp.zeros((), w.dtype), values)
    if attrs["is_sparse"]:
        return {"W@GRAD": [SelectedRows(ids, values, w.shape[0])]}
    return {"W@GRAD": [jnp.zeros(w.shape, w.dtype).at[ids].add(values)]}


# --- padded sequence pooling --------------------------------------------------------------------------------
def _gather_steps(x: Any, idx: Any) -> Any:
    """x[n, idx[n], ...] for x [N, T, ...] and idx [N] or [N, ...] (per feature)."""
    if idx.ndim == 1:
        idx = idx.reshape((idx.shape[0],) + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx[:, None], axis=1)[:, 0]


# --- LoD sequences: rows X [R, ...] and Length [N] (runtime/lod.py pads R to a bucket) -------------------
def _segments(length: Any, rows: int) -> tuple[Any, Any, Any]:
    """(segment id per row, in [0, N] with N for padding rows; start row; end row) of each sequence."""
    length = length.astype(jnp.int32)
    ends = jnp.cumsum(length)
    starts = ends - length
    seg = jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right")
    return seg, starts, ends


def _sequence_pool_lod(x: Any, length: Any, attrs: Attrs) -> Outs:
    n, rows = length.shape[0], x.shape[0]
    seg, starts, ends = _segments(length, rows)
    feat = (1,) * (x.ndim - 1)
    nonempty = (length > 0).reshape((n,) + feat)
    safe_len = jnp.maximum(length, 1).astype(x.dtype).reshape((n,) + feat)
    ptype = attrs["pooltype"]
    max_index = jnp.zeros((n,) + x.shape[1:], jnp.int32)
    if ptype in ("SUM", "AVERAGE", "SQRT"):
        total = jax.ops.segment_sum(x, seg, num_segments=n + 1)[:n]
        out = {"SUM": total, "AVERAGE": total / safe_len, "SQRT": total / jnp.sqrt(safe_len)}[ptype]
    elif ptype == "MAX":
        best = lax.stop_gradient(jax.ops.segment_max(x, seg, num_segments=n + 1))
        row = jnp.arange(rows, dtype=jnp.int32).reshape((rows,) + feat)
        hit = (x == best[seg]) & (seg < n).reshape((rows,) + feat)
        first_hit = jax.ops.segment_min(jnp.where(hit, row, rows), seg, num_segments=n + 1)[:n]
        arg = jnp.minimum(first_hit, rows - 1)
        out = jnp.take_along_axis(x, arg, axis=0)  # the max row, differentiable through the gather
        max_index = jnp.where(nonempty, arg, 0).astype(jnp.int32)
    elif ptype == "FIRST":
        out = jnp.take(x, jnp.minimum(starts, rows - 1), axis=0)
    else:  # LAST (the schema's inference rejects anything else)
        out = jnp.take(x, jnp.clip(ends - 1, 0, rows - 1), axis=0)
    out = jnp.where(nonempty, out, jnp.asarray(attrs["pad_value"]).astype(x.dtype))
    return {"Out": [out.astype(x.dtype)], "MaxIndex": [max_index]}


@kernel("sequence_softmax")
def sequence_softmax(ins: Ins, attrs: Attrs) -> Outs:
    x, length = one(ins, "X"), one(ins, "Length")
    n, rows = length.shape[0], x.shape[0]
    seg, _, _ = _segments(length, rows)
    v = x.reshape(rows)
    real = seg < n
    top = lax.stop_gradient(jax.ops.segment_max(jnp.where(real, v, -jnp.inf), seg, num_segments=n + 1))
    e = jnp.where(real, jnp.exp(v - jnp.where(real, top[seg], 0)), 0)
    total = jax.ops.segment_sum(e, seg, num_segments=n + 1)
    out = e / jnp.where(real, total[seg], 1)
    return {"Out": [out.reshape(x.shape).astype(x.dtype)]}


@kernel("sequence_conv")
def sequence_conv(ins: Ins, attrs: Attrs) -> Outs:
    x, w, length = one(ins, "X"), one(ins, "Filter"), one(ins, "Length")
    n, rows = length.shape[0], x.shape[0]
    seg, starts, ends = _segments(length, rows)
    real = seg < n
    seg_c = jnp.minimum(seg, n - 1) if n > 0 else seg
    lo, hi = starts[seg_c], ends[seg_c]
    r = jnp.arange(rows, dtype=jnp.int32)
    cols = []
    for j in range(attrs["contextLength"]):
        src = r + attrs["contextStart"] + j
        ok = real & (src >= lo) & (src < hi)  # zero padding outside the row's own sequence
        cols.append(jnp.where(ok[:, None], jnp.take(x, jnp.clip(src, 0, rows - 1), axis=0), 0))
    out = jnp.concatenate(cols, axis=1) @ w.astype(x.dtype)
    return {"Out": [jnp.where(real[:, None], out, 0).astype(x.dtype)]}


@kernel("sequence_pool")
def sequence_pool(ins: Ins, attrs: Attrs) -> Outs:
    x = one(ins, "X")
    length = opt(ins, "Length")
    if length is not None:
        return _sequence_pool_lod(x, length, attrs)
    n, t = x.shape[0], x.shape[1]
    ids = opt(ins, "Ids")
    pad = attrs["padding_idx"]
    if ids is not None and pad != -1:
        valid = ids.reshape(n, t) != pad
    else:
        valid = jnp.ones((n, t), bool)
    feat = (1,) * (x.ndim - 2)
    m = valid.reshape((n, t) + feat)
    length = jnp.sum(valid, axis=1).reshape((n,) + feat)
    nonempty = length > 0
    safe_len = jnp.maximum(length, 1).astype(x.dtype)
    ptype = attrs["pooltype"]
    max_index = jnp.zeros((n,) + x.shape[2:], jnp.int32)
    if ptype in ("SUM", "AVERAGE", "SQRT"):
        total = jnp.sum(jnp.where(m, x, 0), axis=1)
        out = {"SUM": total, "AVERAGE": total / safe_len, "SQRT": total / jnp.sqrt(safe_len)}[ptype]
    elif ptype == "MAX":
        lowest = jnp.finfo(x.dtype).min if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
        arg = jnp.argmax(jnp.where(m, x, lowest), axis=1)
        out = _gather_steps(x, arg)
        max_index = arg.astype(jnp.int32)
    elif ptype == "FIRST":
        out = _gather_steps(x, jnp.argmax(valid, axis=1))
    else:  # LAST (the schema's inference rejects anything else)
        out = _gather_steps(x, t - 1 - jnp.argmax(valid[:, ::-1], axis=1))
    out = jnp.where(nonempty, out, jnp.asarray(attrs["pad_value"]).astype(x.dtype))
    return {"Out": [out.astype(x.dtype)], "MaxIndex": [max_index]}


# --- layout ---------------------------------------------------------------------------------------------------
@kernel("concat")
def concat(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [jnp.concatenate(ins["X"], axis=attrs["axis"])]}


@kernel("split")
def split(ins: Ins, attrs: Attrs) -> Outs:
    x = one(ins, "X")
    axis = attrs["axis"] % x.ndim
    extent = x.shape[axis]
    if attrs["num"] > 0:
        sizes = [extent // attrs["num"]] * attrs["num"]
    else:
        sizes = list(attrs["sections"])
        if -1 in sizes:
            sizes[sizes.index(-1)] = extent - sum(s for s in sizes if s != -1)
    bounds = np.cumsum(sizes)[:-1].tolist()
    return {"Out": list(jnp.split(x, bounds, axis=axis))}


@kernel("reshape")
def reshape(ins: Ins, attrs: Attrs) -> Outs:
    x = one(ins, "X")
    shape = [x.shape[i] if s == 0 else s for i, s in enumerate(attrs["shape"])]
    return {"Out": [x.reshape(shape)]}


@kernel("transpose")
def transpose(ins: Ins, attrs: Attrs) -> Outs:
    return {"Out": [jnp.transpose(one(ins, "X"), attrs["axis"])]}


# --- convolution and pooling ------------------------------------------------------------------------------
def _pad_pairs(pads: list[int]) -> list[tuple[int, int]]:
    """[p_h, p_w] pads both sides; [top, bottom, left, right] as given."""
    if len(pads) == 2:
        return [(pads[0], pads[0]), (pads[1], pads[1])]
    return [(pads[0], pads[1]), (pads[2], pads[3])]


@kernel("conv2d")
def conv2d(ins: Ins, attrs: Attrs) -> Outs:
    x, w = one(ins, "Input"), one(ins, "Filter")
    layout = "NHWC" if attrs["data_format"] == "NHWC" else "NCHW"
    out = lax.conv_general_dilated(
        x, w.astype(x.dtype),
        window_strides=tuple(attrs["strides"]),
        padding=_pad_pairs(list(attrs["paddings"])),
        rhs_dilation=tuple(attrs["dilations"]),
        dimension_numbers=(layout, "OIHW", layout),
        feature_group_count=attrs["groups"],
    )
    return {"Output": [out.astype(x.dtype)]}


def _adaptive_pool(x: Any, out_hw: list[int], is_max: bool) -> Any:
    """Adaptive pooling of NCHW x: output cell i covers [floor(i*H/o), ceil((i+1)*H/o))."""
    h, w = x.shape[2], x.shape[3]
    rows = []
    for i in range(out_hw[0]):
        h0, h1 = (i * h) // out_hw[0], -((-(i + 1) * h) // out_hw[0])
        cols = []
        for j in range(out_hw[1]):
            w0, w1 = (j * w) // out_hw[1], -((-(j + 1) * w) // out_hw[1])
            cell = x[:, :, h0:h1, w0:w1]
            cols.append(jnp.max(cell, axis=(2, 3)) if is_max else jnp.mean(cell, axis=(2, 3)))
        rows.append(jnp.stack(cols, axis=-1))
    return jnp.stack(rows, axis=-2)


@kernel("pool2d")
def pool2d(ins: Ins, attrs: Attrs) -> Outs:
    x = one(ins, "X")
    nhwc = attrs["data_format"] == "NHWC"
    if nhwc:
        x = jnp.moveaxis(x, -1, 1)
    is_max = attrs["pooling_type"] == "max"
    if attrs["global_pooling"]:
        out = (jnp.max if is_max else jnp.mean)(x, axis=(2, 3), keepdims=True)
    elif attrs["adaptive"]:
        out = _adaptive_pool(x, list(attrs["ksize"]), is_max)
    else:
        kh, kw = attrs["ksize"]
        sh, sw = attrs["strides"]
        pads = _pad_pairs(list(attrs["paddings"]))
        if attrs["ceil_mode"]:  # one more, partial window at the end of each spatial dim
            pads = [(pads[0][0], pads[0][1] + sh - 1), (pads[1][0], pads[1][1] + sw - 1)]
        window, strides = (1, 1, kh, kw), (1, 1, sh, sw)
        padding = ((0, 0), (0, 0), pads[0], pads[1])
        if is_max:
            init = np.array(-np.inf, dtype=x.dtype)
            out = lax.reduce_window(x, init, lax.max, window, strides, padding)
        else:
            zero = np.array(0, dtype=x.dtype)
            total = lax.reduce_window(x, zero, lax.add, window, strides, padding)
            if attrs["exclusive"]:
                ones = jnp.ones((1, 1) + x.shape[2:], x.dtype)
                count = lax.reduce_window(ones, zero, lax.add, window, strides, padding)
                out = total / count
            else:
                out = total / (kh * kw)
    out = out.astype(x.dtype)
    return {"Out": [jnp.moveaxis(out, 1, -1) if nhwc else out]}


# --- normalisation and dropout --------------------------------------------------------------------------
@kernel("batch_norm")
def batch_norm(ins: Ins, attrs: Attrs) -> Outs:
    """Training: batch statistics (biased variance), MeanOut = Mean*momentum + batch_mean*(1-momentum)
    (VarianceOut likewise); SavedMean is the batch mean, SavedVariance the inverse std, as Fluid.
    is_test or use_global_stats: normalise with the running statistics, which pass through."""
    x = one(ins, "X")
    scale, bias = one(ins, "Scale"), one(ins, "Bias")
    mean, var = one(ins, "Mean"), one(ins, "Variance")
    ch = x.ndim - 1 if attrs["data_layout"] == "NHWC" else 1
    axes = tuple(i for i in range(x.ndim) if i != ch)
    bshape = tuple(x.shape[ch] if i == ch else 1 for i in range(x.ndim))
    ct = jnp.promote_types(x.dtype, scale.dtype)
    xc = x.astype(ct)
    eps, mom = attrs["epsilon"], attrs["momentum"]
    if attrs["is_test"] or attrs["use_global_stats"]:
        use_mean, use_var = mean.astype(ct), var.astype(ct)
        mean_out, var_out = mean, var
    else:
        use_mean = jnp.mean(xc, axis=axes)
        use_var = jnp.mean(jnp.square(xc - use_mean.reshape(bshape)), axis=axes)
        mean_out = (mean * mom + use_mean.astype(mean.dtype) * (1 - mom)).astype(mean.dtype)
        var_out = (var * mom + use_var.astype(var.dtype) * (1 - mom)).astype(var.dtype)
    inv_std = lax.rsqrt(use_var + eps)
    y = (xc - use_mean.reshape(bshape)) * (inv_std * scale.astype(ct)).reshape(bshape) + bias.astype(ct).reshape(bshape)
    return {"Y": [y.astype(x.dtype)], "MeanOut": [mean_out], "VarianceOut": [var_out],
            "SavedMean": [use_mean.astype(mean.dtype)], "SavedVariance": [inv_std.astype(var.dtype)]}


@kernel("layer_norm")
def layer_norm(ins: Ins, attrs: Attrs) -> Outs:
    """X seen as [left, right] (split at begin_norm_axis): each row normalised by its mean and biased
    variance; Mean and Variance ``[left]`` hold those (the variance, not the inverse std, as Fluid).
    Scale and Bias, when given, are ``[right]``."""
    x = one(ins, "X")
    scale, bias = opt(ins, "Scale"), opt(ins, "Bias")
    axis = attrs["begin_norm_axis"]
    axes = tuple(range(axis, x.ndim))
    row_mean = jnp.mean(x, axis=axes, keepdims=True)
    centred = x - row_mean
    row_var = jnp.mean(jnp.square(centred), axis=axes, keepdims=True)
    y = centred * lax.rsqrt(row_var + jnp.asarray(attrs["epsilon"], x.dtype))
    feature_shape = x.shape[axis:]
    if scale is not None:
        y = y * scale.reshape(feature_shape).astype(x.dtype)
    if bias is not None:
        y = y + bias.reshape(feature_shape).astype(x.dtype)
    left = int(np.prod(x.shape[:axis]))
    return {"Y": [y.astype(x.dtype)], "Mean": [row_mean.reshape(left).astype(x.dtype)],
            "Variance": [row_var.reshape(left).astype(x.dtype)]}


def _dropout_train_scale(attrs: Attrs) -> float:
    """The factor kept elements are multiplied by in training."""
    if attrs["dropout_implementation"] != "upscale_in_train":
        return 1.0
    p = attrs["dropout_prob"]
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


@kernel("dropout")
def dropout(ins: Ins, attrs: Attrs) -> Outs:
    """Mask holds 0/1 in X's dtype (Fluid 1.5). Training: Out = X*Mask (times 1/(1-p) for
    upscale_in_train); is_test: Out = X*(1-p) for downgrade_in_infer, X for upscale_in_train."""
    x = one(ins, "X")
    p = attrs["dropout_prob"]
    if attrs["is_test"]:
        out = x if attrs["dropout_implementation"] == "upscale_in_train" else x * (1.0 - p)
        return {"Out": [out.astype(x.dtype)], "Mask": [jnp.ones_like(x)]}
    u = jax.random.uniform(ins[RNG_SLOT][0], x.shape, jnp.float32)
    mask = (u >= p).astype(x.dtype)
    return {"Out": [(x * mask * _dropout_train_scale(attrs)).astype(x.dtype)], "Mask": [mask]}


@kernel("dropout_grad")
def dropout_grad(ins: Ins, attrs: Attrs) -> Outs:
    mask = one(ins, "Mask")
    g = opt(ins, "Out@GRAD")
    if g is None:
        return {"X@GRAD": [jnp.zeros_like(mask)]}
    if attrs["is_test"]:
        factor = 1.0 if attrs["dropout_implementation"] == "upscale_in_train" else 1.0 - attrs["dropout_prob"]
    else:
        factor = _dropout_train_scale(attrs)
    return {"X@GRAD": [(g * mask * factor).astype(g.dtype)]}


# --- metrics --------------------------------------------------------------------------------------------
@kernel("top_k")
def top_k(ins: Ins, attrs: Attrs) -> Outs:
    values, indices = lax.top_k(one(ins, "X"), attrs["k"])
    return {"Out": [values], "Indices": [indices.astype(jnp.int64)]}


@kernel("accuracy")
def accuracy(ins: Ins, attrs: Attrs) -> Outs:
    indices, label = one(ins, "Indices"), one(ins, "Label")
    n = indices.shape[0]
    hit = jnp.any(indices == label.reshape(n, 1).astype(indices.dtype), axis=1)
    correct = jnp.sum(hit).astype(jnp.int32)
    acc = correct.astype(jnp.float32) / max(n, 1)
    return {"Accuracy": [acc.reshape(1)], "Correct": [correct.reshape(1)],
            "Total": [jnp.full((1,), n, jnp.int32)]}


def _roc_auc(pos: Any, neg: Any) -> Any:
    """Fluid's calcAuc: walk the buckets from the highest threshold down, summing trapezoids of
    (cumulative negatives, cumulative positives), then normalise by total positives x negatives."""
    tp = jnp.cumsum(pos[::-1].astype(jnp.float64))
    fp = jnp.cumsum(neg[::-1].astype(jnp.float64))
    tp_prev = jnp.concatenate([jnp.zeros(1, jnp.float64), tp[:-1]])
    fp_prev = jnp.concatenate([jnp.zeros(1, jnp.float64), fp[:-1]])
    area = jnp.sum(jnp.abs(fp - fp_prev) * (tp + tp_prev) / 2.0)
    tot_pos, tot_neg = tp[-1], fp[-1]
    ok = (tot_pos > 0) & (tot_neg > 0)
    return jnp.where(ok, area / jnp.where(ok, tot_pos * tot_neg, 1.0), area)


@kernel("auc")
def auc(ins: Ins, attrs: Attrs) -> Outs:
    """Bucketed ROC AUC, as Fluid 1.5's auc op: prediction p (the last column of Predict) falls in
    bucket int(p * num_thresholds); StatPos/StatNeg ``[rows, num_thresholds + 1]`` hold per-bucket
    counts of positive and negative labels. slide_steps == 0 accumulates since the start;
    slide_steps > 0 keeps the last ``rows`` batches (a window shifted by one row per batch). AUC is
    computed from the sum of the rows. (Fluid 1.5 computes ROC whatever ``curve`` says; so do we.)"""
    predict, label = one(ins, "Predict"), one(ins, "Label")
    stat_pos, stat_neg = one(ins, "StatPos"), one(ins, "StatNeg")
    nt = attrs["num_thresholds"]
    buckets = nt + 1
    p = predict[:, -1]
    idx = jnp.clip(jnp.floor(p * nt).astype(jnp.int64), 0, nt)
    is_pos = label.reshape(-1) != 0
    batch_pos = jnp.zeros(buckets, stat_pos.dtype).at[idx].add(is_pos.astype(stat_pos.dtype))
    batch_neg = jnp.zeros(buckets, stat_neg.dtype).at[idx].add((~is_pos).astype(stat_neg.dtype))

    def update(stat: Any, batch: Any) -> Any:
        rows = stat.reshape(-1, buckets)
        if attrs["slide_steps"] == 0:
            rows = rows.at[-1].add(batch)
        else:
            rows = jnp.concatenate([rows[1:], batch[None]], axis=0)
        return rows.reshape(stat.shape)

    new_pos, new_neg = update(stat_pos, batch_pos), update(stat_neg, batch_neg)
    value = _roc_auc(new_pos.reshape(-1, buckets).sum(0), new_neg.reshape(-1, buckets).sum(0))
    return {"AUC": [value.reshape(1)], "StatPosOut": [new_pos], "StatNegOut": [new_neg]}

