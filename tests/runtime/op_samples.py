"""One or more small samples per op type, with numpy references, and helpers that build and run them.

A ``Sample`` gives input arrays per slot (or ``Sparse`` for SelectedRows inputs), attrs, how many
variables each output slot gets, a numpy reference (``ref``) or a property check (``check``, for random
ops), and whether the op's gradient is checked against finite differences (``grad``). ``build``
turns a sample into a one-op Program through ``Block.create_var`` / ``append_op`` (so the schema's
shape inference runs); ``build_with_grad`` also appends the gradient ops ``make_grad`` gives, in
float64. Inputs are drawn from a fixed seed, away from kinks and ties where gradients are checked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import runtime
from ir.core import Block, Operator, Program
from ir.names import grad_name
from ir.ops import get_op_def
from runtime.scope import Scope, SelectedRows

Arrays = dict[str, list[Any]]
Ref = Callable[[Arrays, dict[str, Any]], dict[str, list[np.ndarray]]]
Check = Callable[[dict[str, list[np.ndarray]], Arrays, dict[str, Any]], None]

_RNG = np.random.default_rng(20190605)


@dataclass(frozen=True)
class Sparse:
    """A SelectedRows input: ``rows`` (int64, duplicates add up) of a ``height``-row table."""

    rows: np.ndarray
    values: np.ndarray
    height: int

    def to_runtime(self) -> SelectedRows:
        return SelectedRows(self.rows, self.values, self.height)

    def dense(self) -> np.ndarray:
        out = np.zeros((self.height,) + self.values.shape[1:], self.values.dtype)
        np.add.at(out, self.rows, self.values)
        return out

    def astype(self, dtype: str) -> "Sparse":
        return Sparse(self.rows, self.values.astype(dtype), self.height)


@dataclass(frozen=True)
class Sample:
    inputs: Arrays
    attrs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)  # variables per output slot (default 1)
    ref: Ref | None = None
    check: Check | None = None
    grad: bool = False
    grad_attrs: dict[str, Any] = field(default_factory=dict)  # attr overrides for the float64 grad build
    label: str = ""


# --- input makers ---------------------------------------------------------------------------------------
def rand(*shape: int, lo: float = -1.0, hi: float = 1.0, dtype: str = "float32") -> np.ndarray:
    return _RNG.uniform(lo, hi, shape).astype(dtype)


def away(*shape: int, gap: float = 0.2, dtype: str = "float32") -> np.ndarray:
    """Values with |x| in [gap, 1]: away from the kink at 0."""
    return (_RNG.choice([-1.0, 1.0], shape) * _RNG.uniform(gap, 1.0, shape)).astype(dtype)


def distinct(*shape: int, dtype: str = "float32") -> np.ndarray:
    """Values in [-1, 1] that differ pairwise by at least 2/size: no ties (max, top_k, pooling)."""
    n = int(np.prod(shape))
    grid = (np.arange(n) - (n - 1) / 2) * (2.0 / max(n, 1)) + _RNG.uniform(-0.2, 0.2, n) / max(n, 1)
    return _RNG.permutation(grid).reshape(shape).astype(dtype)


def ints(*shape: int, lo: int, hi: int, dtype: str = "int64") -> np.ndarray:
    return _RNG.integers(lo, hi, shape).astype(dtype)


def arr(values: Any, dtype: str) -> np.ndarray:
    return np.asarray(values, dtype=dtype)


# --- numpy references -------------------------------------------------------------------------------------
def _np_bcast(x: np.ndarray, y: np.ndarray, axis: int) -> np.ndarray:
    if y.ndim == x.ndim:
        return y
    start = x.ndim - y.ndim if axis == -1 else axis
    return y.reshape((1,) * start + y.shape + (1,) * (x.ndim - start - y.ndim))


def binary_ref(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Ref:
    def ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
        x, y = ins["X"][0], ins["Y"][0]
        return {"Out": [fn(x, _np_bcast(x, y, attrs["axis"]))]}

    return ref


def unary_ref(fn: Callable[[np.ndarray], np.ndarray]) -> Ref:
    return lambda ins, attrs: {"Out": [fn(ins["X"][0])]}


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def mul_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x, y = ins["X"][0], ins["Y"][0]
    xn, yn = attrs["x_num_col_dims"], attrs["y_num_col_dims"]
    out = x.reshape(int(np.prod(x.shape[:xn])), -1) @ y.reshape(int(np.prod(y.shape[:yn])), -1)
    return {"Out": [out.reshape(x.shape[:xn] + y.shape[yn:])]}


def matmul_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x, y = ins["X"][0], ins["Y"][0]
    if x.ndim > 1 and attrs["transpose_X"]:
        x = np.swapaxes(x, -1, -2)
    if y.ndim > 1 and attrs["transpose_Y"]:
        y = np.swapaxes(y, -1, -2)
    out = np.asarray(np.matmul(x, y) * attrs["alpha"], dtype=x.dtype)
    return {"Out": [out.reshape(1) if out.ndim == 0 else out]}


def reduce_ref(fn: Callable[..., np.ndarray]) -> Ref:
    def ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
        x = ins["X"][0]
        axes = tuple(range(x.ndim)) if attrs["reduce_all"] else tuple(d % x.ndim for d in attrs["dim"])
        out = np.asarray(fn(x, axis=axes, keepdims=attrs["keep_dim"]))
        return {"Out": [out.reshape(1) if out.ndim == 0 else out]}

    return ref


def scale_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x = ins["X"][0]
    s, b = attrs["scale"], attrs["bias"]
    f = (lambda v: v * s + b) if attrs["bias_after_scale"] else (lambda v: (v + b) * s)
    if isinstance(x, Sparse):
        return {"Out": [Sparse(x.rows, f(x.values), x.height).dense()]}
    return {"Out": [f(x)]}


def sum_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    return {"Out": [sum(x.dense() if isinstance(x, Sparse) else x for x in ins["X"])]}


def xent_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x, label = ins["X"][0], ins["Label"][0]
    if attrs["soft_label"]:
        return {"Y": [-(label * np.log(x)).sum(-1, keepdims=True)]}
    picked = np.take_along_axis(x, np.where(label == attrs["ignore_index"], 0, label), -1)
    return {"Y": [np.where(label == attrs["ignore_index"], 0, -np.log(picked))]}


def softmax_xent_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    logits, label = ins["Logits"][0].astype(np.float64), ins["Label"][0]
    axis = attrs["axis"] % logits.ndim
    shifted = logits - logits.max(axis=axis, keepdims=True)
    log_sm = shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
    if attrs["soft_label"]:
        loss = -(label * log_sm).sum(axis, keepdims=True)
    else:
        ignored = label == attrs["ignore_index"]
        loss = np.where(ignored, 0, -np.take_along_axis(log_sm, np.where(ignored, 0, label), axis))
    return {"Softmax": [np.exp(log_sm)], "Loss": [loss]}


def sigmoid_xent_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x, label = ins["X"][0].astype(np.float64), ins["Label"][0]
    keep = label != attrs["ignore_index"]
    out = np.where(keep, np.maximum(x, 0) - x * label + np.log1p(np.exp(-np.abs(x))), 0)
    if attrs["normalize"]:
        out = out / max(keep.sum(), 1e-5)
    return {"Out": [out]}


def cos_sim_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x, y = ins["X"][0].astype(np.float64), ins["Y"][0].astype(np.float64)
    xn = np.sqrt((x * x).sum(1, keepdims=True))
    yn = np.sqrt((y * y).sum(1, keepdims=True))
    return {"Out": [(x * y).sum(1, keepdims=True) / (xn * yn)], "XNorm": [xn], "YNorm": [yn]}


def lookup_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    w, ids = ins["W"][0], ins["Ids"][0]
    if ids.ndim > 1 and ids.shape[-1] == 1:
        ids = ids[..., 0]
    out = w[ids]
    out[ids == attrs["padding_idx"]] = 0
    return {"Out": [out]}


def sequence_pool_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x = ins["X"][0].astype(np.float64)
    ids = ins["Ids"][0].reshape(x.shape[:2]) if "Ids" in ins else None
    out = np.full((x.shape[0],) + x.shape[2:], attrs["pad_value"])
    max_index = np.zeros(out.shape, np.int32)
    for n in range(x.shape[0]):
        steps = [t for t in range(x.shape[1]) if ids is None or attrs["padding_idx"] == -1
                 or ids[n, t] != attrs["padding_idx"]]
        if not steps:
            continue
        seq = x[n, steps]
        ptype = attrs["pooltype"]
        if ptype == "MAX":
            out[n] = seq.max(0)
            max_index[n] = np.asarray(steps)[seq.argmax(0)]
        else:
            out[n] = {"SUM": lambda: seq.sum(0), "AVERAGE": lambda: seq.mean(0),
                      "SQRT": lambda: seq.sum(0) / np.sqrt(len(steps)), "FIRST": lambda: seq[0],
                      "LAST": lambda: seq[-1]}[ptype]()
    result = {"Out": [out]}
    if attrs["pooltype"] == "MAX":
        result["MaxIndex"] = [max_index]
    return result


def split_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x = ins["X"][0]
    axis = attrs["axis"]
    if attrs["num"]:
        return {"Out": np.split(x, attrs["num"], axis=axis)}
    sizes = list(attrs["sections"])
    if -1 in sizes:
        sizes[sizes.index(-1)] = x.shape[axis] - sum(s for s in sizes if s != -1)
    return {"Out": np.split(x, np.cumsum(sizes)[:-1], axis=axis)}


def _pad_pairs(pads: list[int]) -> list[tuple[int, int]]:
    return [(pads[0], pads[0]), (pads[1], pads[1])] if len(pads) == 2 else [(pads[0], pads[1]), (pads[2], pads[3])]


def conv2d_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x, w = ins["Input"][0].astype(np.float64), ins["Filter"][0].astype(np.float64)
    nhwc = attrs["data_format"] == "NHWC"
    if nhwc:
        x = x.transpose(0, 3, 1, 2)
    xp = np.pad(x, [(0, 0), (0, 0)] + _pad_pairs(attrs["paddings"]))
    m, cg, kh, kw = w.shape
    g = attrs["groups"]
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilations"]
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((x.shape[0], m, oh, ow))
    mg = m // g
    for gi in range(g):
        xs, ws = xp[:, gi * cg:(gi + 1) * cg], w[gi * mg:(gi + 1) * mg]
        for i in range(oh):
            for j in range(ow):
                patch = xs[:, :, i * sh:i * sh + dh * (kh - 1) + 1:dh, j * sw:j * sw + dw * (kw - 1) + 1:dw]
                out[:, gi * mg:(gi + 1) * mg, i, j] = np.einsum("nchw,mchw->nm", patch, ws)
    return {"Output": [out.transpose(0, 2, 3, 1) if nhwc else out]}


def pool2d_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    """Fluid's window rule: window (i, j) covers [i*s - pad, i*s - pad + k) clipped to the input;
    exclusive avg divides by the clipped size, non-exclusive by kh*kw."""
    x = ins["X"][0].astype(np.float64)
    nhwc = attrs["data_format"] == "NHWC"
    if nhwc:
        x = x.transpose(0, 3, 1, 2)
    h, w = x.shape[2:]
    is_max = attrs["pooling_type"] == "max"

    def reduce(win: np.ndarray, size: int) -> np.ndarray:
        return win.max((2, 3)) if is_max else win.sum((2, 3)) / size

    if attrs["global_pooling"]:
        out = reduce(x, h * w)[:, :, None, None]
    elif attrs["adaptive"]:
        oh, ow = attrs["ksize"]
        out = np.zeros(x.shape[:2] + (oh, ow))
        for i in range(oh):
            for j in range(ow):
                h0, h1 = i * h // oh, -(-(i + 1) * h // oh)
                w0, w1 = j * w // ow, -(-(j + 1) * w // ow)
                out[:, :, i, j] = reduce(x[:, :, h0:h1, w0:w1], (h1 - h0) * (w1 - w0))
    else:
        (kh, kw), (sh, sw) = attrs["ksize"], attrs["strides"]
        (pt, pb), (pl, pr) = _pad_pairs(attrs["paddings"])
        extra_h, extra_w = (sh - 1, sw - 1) if attrs["ceil_mode"] else (0, 0)
        oh = (h - kh + pt + pb + extra_h) // sh + 1
        ow = (w - kw + pl + pr + extra_w) // sw + 1
        out = np.zeros(x.shape[:2] + (oh, ow))
        for i in range(oh):
            for j in range(ow):
                hs, ws = i * sh - pt, j * sw - pl
                h0, h1, w0, w1 = max(hs, 0), min(hs + kh, h), max(ws, 0), min(ws + kw, w)
                size = (h1 - h0) * (w1 - w0) if attrs["exclusive"] else kh * kw
                out[:, :, i, j] = reduce(x[:, :, h0:h1, w0:w1], size)
    return {"Out": [out.transpose(0, 2, 3, 1) if nhwc else out]}


def batch_norm_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x = ins["X"][0].astype(np.float64)
    scale, bias, mean, var = (ins[s][0].astype(np.float64) for s in ("Scale", "Bias", "Mean", "Variance"))
    ch = x.ndim - 1 if attrs["data_layout"] == "NHWC" else 1
    axes = tuple(i for i in range(x.ndim) if i != ch)
    shape = [x.shape[ch] if i == ch else 1 for i in range(x.ndim)]
    mom = attrs["momentum"]
    if attrs["is_test"] or attrs["use_global_stats"]:
        m, v, mean_out, var_out = mean, var, mean, var
    else:
        m, v = x.mean(axes), x.var(axes)
        mean_out, var_out = mean * mom + m * (1 - mom), var * mom + v * (1 - mom)
    inv = 1 / np.sqrt(v + attrs["epsilon"])
    y = (x - m.reshape(shape)) * (inv * scale).reshape(shape) + bias.reshape(shape)
    return {"Y": [y], "MeanOut": [mean_out], "VarianceOut": [var_out], "SavedMean": [m], "SavedVariance": [inv]}


def layer_norm_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x = ins["X"][0].astype(np.float64)
    axis = attrs["begin_norm_axis"]
    rows = x.reshape(int(np.prod(x.shape[:axis])), -1)
    m, var = rows.mean(1), rows.var(1)
    y = (rows - m[:, None]) / np.sqrt(var[:, None] + attrs["epsilon"])
    if "Scale" in ins:
        y = y * ins["Scale"][0].astype(np.float64)
    if "Bias" in ins:
        y = y + ins["Bias"][0].astype(np.float64)
    return {"Y": [y.reshape(x.shape)], "Mean": [m], "Variance": [var]}


def gelu_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x = ins["X"][0].astype(np.float64)
    return {"Out": [0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))]}


def top_k_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x = ins["X"][0]
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :attrs["k"]]
    return {"Out": [np.take_along_axis(x, idx, -1)], "Indices": [idx.astype(np.int64)]}


def accuracy_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    idx, label = ins["Indices"][0], ins["Label"][0]
    correct = int((idx == label).any(1).sum())
    n = idx.shape[0]
    return {"Accuracy": [np.array([correct / n], np.float32)], "Correct": [np.array([correct], np.int32)],
            "Total": [np.array([n], np.int32)]}


def auc_np(pos: np.ndarray, neg: np.ndarray) -> float:
    """Fluid's calcAuc, literally."""
    area = tot_pos = tot_neg = 0.0
    for idx in range(len(pos) - 1, -1, -1):
        prev_pos, prev_neg = tot_pos, tot_neg
        tot_pos += pos[idx]
        tot_neg += neg[idx]
        area += abs(tot_neg - prev_neg) * (tot_pos + prev_pos) / 2.0
    return area / tot_pos / tot_neg if tot_pos > 0 and tot_neg > 0 else area


def auc_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    p, label = ins["Predict"][0][:, -1], ins["Label"][0].reshape(-1)
    nt = attrs["num_thresholds"]
    bpos, bneg = np.zeros(nt + 1, np.int64), np.zeros(nt + 1, np.int64)
    for pi, li in zip(p, label):
        b = int(pi * nt)
        (bpos if li else bneg)[b] += 1
    outs = []
    for stat, batch in ((ins["StatPos"][0], bpos), (ins["StatNeg"][0], bneg)):
        rows = stat.reshape(-1, nt + 1).copy()
        if attrs["slide_steps"] == 0:
            rows[-1] += batch
        else:
            rows = np.concatenate([rows[1:], batch[None]])
        outs.append(rows.reshape(stat.shape))
    value = auc_np(outs[0].reshape(-1, nt + 1).sum(0), outs[1].reshape(-1, nt + 1).sum(0))
    return {"AUC": [np.array([value])], "StatPosOut": [outs[0]], "StatNegOut": [outs[1]]}


# --- property checks for random ops ---------------------------------------------------------------------------
def uniform_check(outs: dict[str, list[np.ndarray]], ins: Arrays, attrs: dict[str, Any]) -> None:
    o = outs["Out"][0]
    lo, hi = attrs["min"], attrs["max"]
    assert o.min() >= lo and o.max() < hi, (o.min(), o.max())
    assert abs(o.mean() - (lo + hi) / 2) < 0.15 * (hi - lo), o.mean()
    assert len(np.unique(o)) > o.size // 2


def gaussian_check(outs: dict[str, list[np.ndarray]], ins: Arrays, attrs: dict[str, Any]) -> None:
    o = outs["Out"][0].astype(np.float64)
    assert abs(o.mean() - attrs["mean"]) < 0.25 * attrs["std"], o.mean()
    assert abs(o.std() - attrs["std"]) < 0.2 * attrs["std"], o.std()


def truncated_check(outs: dict[str, list[np.ndarray]], ins: Arrays, attrs: dict[str, Any]) -> None:
    o = outs["Out"][0].astype(np.float64)
    m, s = attrs["mean"], attrs["std"]
    assert np.all(np.abs(o - m) <= 2 * s * (1 + 1e-6)), (o.min(), o.max())
    assert abs(o.mean() - m) < 0.25 * s, o.mean()
    # The std of N(0, 1) truncated to +-2 is 0.880.
    assert abs(o.std() - 0.880 * s) < 0.15 * s, o.std()


def dropout_check(outs: dict[str, list[np.ndarray]], ins: Arrays, attrs: dict[str, Any]) -> None:
    x, out, mask = ins["X"][0], outs["Out"][0], outs["Mask"][0]
    p = attrs["dropout_prob"]
    assert set(np.unique(mask).tolist()) <= {0.0, 1.0}
    assert abs((mask == 0).mean() - p) < 0.15, (mask == 0).mean()
    factor = 1 / (1 - p) if attrs["dropout_implementation"] == "upscale_in_train" else 1.0
    np.testing.assert_allclose(out, x * mask * factor, rtol=1e-6)


# --- the samples ---------------------------------------------------------------------------------------------------
F32, F64, I64 = "float32", "float64", "int64"


def _elementwise_samples(kind: str) -> list[Sample]:
    fns = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum,
           "min": np.minimum, "pow": np.power}
    if kind == "div":
        mk = (lambda *s: rand(*s)), (lambda *s: rand(*s, lo=0.5, hi=1.5))
    elif kind == "pow":
        mk = (lambda *s: rand(*s, lo=0.5, hi=1.5)), (lambda *s: rand(*s, lo=-2.0, hi=2.0))
    elif kind in ("max", "min"):
        mk = (lambda *s: distinct(*s)), (lambda *s: distinct(*s) * 0.97 + 0.003)
    else:
        mk = (lambda *s: rand(*s)), (lambda *s: rand(*s))
    ref = binary_ref(fns[kind])
    return [
        Sample({"X": [mk[0](2, 3, 4)], "Y": [mk[1](3)]}, {"axis": 1}, ref=ref, grad=True, label="mid"),
        Sample({"X": [mk[0](2, 3)], "Y": [mk[1](2, 3)]}, ref=ref, label="same"),
        Sample({"X": [mk[0](3, 4)], "Y": [mk[1](4)]}, ref=ref, grad=True, label="right"),
    ]


def _reduce_samples(fn: Callable[..., np.ndarray]) -> list[Sample]:
    ref = reduce_ref(fn)
    return [
        Sample({"X": [distinct(2, 3, 4)]}, {"dim": [1]}, ref=ref, grad=True, label="dim1"),
        Sample({"X": [distinct(2, 3, 4)]}, {"dim": [-1, 0], "keep_dim": True}, ref=ref, grad=True, label="keep"),
        Sample({"X": [distinct(3, 2)]}, {"reduce_all": True}, ref=ref, grad=True, label="all"),
    ]


_SPARSE = Sparse(arr([4, 1, 4], I64), rand(3, 2), 6)

_SEQ_IDS = arr([[3, 5, 0, 0], [7, 2, 9, 1], [0, 0, 0, 0]], I64)  # padding_idx 0: row 2 is empty
_SEQ_POOL = [
    Sample({"X": [distinct(3, 4, 2)], "Ids": [_SEQ_IDS]}, {"pooltype": t, "padding_idx": 0},
           ref=sequence_pool_ref, grad=True, label=t)
    for t in ("AVERAGE", "SUM", "MAX", "SQRT", "FIRST", "LAST")
] + [
    Sample({"X": [rand(2, 3, 2, 2)], "Ids": [_SEQ_IDS[:2, :3, None]]}, {"pooltype": "LAST", "padding_idx": 0},
           ref=sequence_pool_ref, label="ids3d"),
    Sample({"X": [rand(2, 3, 2)]}, {"pooltype": "AVERAGE"}, outputs={"MaxIndex": 0}, ref=sequence_pool_ref,
           grad=True, label="noids"),
    Sample({"X": [rand(2, 3, 2)], "Ids": [_SEQ_IDS[:2, :3]]}, {"pooltype": "SQRT", "padding_idx": 0, "pad_value": 0.5},
           ref=sequence_pool_ref, grad=True, label="padvalue"),
]


def _probs(*shape: int) -> np.ndarray:
    return _softmax(rand(*shape, lo=-1, hi=1, dtype=F64), -1).astype(F32)


SAMPLES: dict[str, list[Sample]] = {
    # --- math
    "mul": [
        Sample({"X": [rand(3, 4)], "Y": [rand(4, 2)]}, ref=mul_ref, grad=True),
        Sample({"X": [rand(2, 3, 4)], "Y": [rand(2, 2, 3)]}, {"x_num_col_dims": 2, "y_num_col_dims": 2},
               ref=mul_ref, grad=True, label="flatten"),
    ],
    "matmul": [
        Sample({"X": [rand(2, 3, 4)], "Y": [rand(2, 4, 5)]}, ref=matmul_ref, grad=True, label="batched"),
        Sample({"X": [rand(4, 3)], "Y": [rand(5, 4)]}, {"transpose_X": True, "transpose_Y": True, "alpha": 2.0},
               ref=matmul_ref, grad=True, label="transposed"),
        Sample({"X": [rand(2, 3, 4)], "Y": [rand(4, 2)]}, ref=matmul_ref, grad=True, label="bcast"),
        Sample({"X": [rand(4)], "Y": [rand(3, 4, 2)]}, ref=matmul_ref, grad=True, label="vec_x"),
        Sample({"X": [rand(2, 3)], "Y": [rand(3)]}, ref=matmul_ref, grad=True, label="vec_y"),
        Sample({"X": [rand(3)], "Y": [rand(3)]}, {"alpha": 0.5}, ref=matmul_ref, grad=True, label="dot"),
        Sample({"X": [rand(2, 2, 3, 4)], "Y": [rand(2, 2, 5, 4)]}, {"transpose_Y": True, "alpha": 0.5},
               ref=matmul_ref, grad=True, label="attention_4d"),
    ],
    **{f"elementwise_{k}": _elementwise_samples(k) for k in ("add", "sub", "mul", "div", "max", "min", "pow")},
    "mean": [Sample({"X": [rand(3, 4)]}, ref=lambda i, a: {"Out": [i["X"][0].mean().reshape(1)]}, grad=True)],
    "square": [Sample({"X": [rand(3, 4)]}, ref=unary_ref(np.square), grad=True)],
    "fill_constant": [
        Sample({}, {"shape": [2, 3], "dtype": I64, "value": 7.0},
               ref=lambda i, a: {"Out": [np.full((2, 3), 7, np.int64)]}, label="int64"),
        Sample({}, {"shape": [4], "dtype": F32, "value": 0.25},
               ref=lambda i, a: {"Out": [np.full((4,), 0.25, np.float32)]}, label="float32"),
    ],
    "scale": [
        Sample({"X": [rand(3, 4)]}, {"scale": 2.5, "bias": 0.5}, ref=scale_ref, grad=True, label="after"),
        Sample({"X": [rand(3, 4)]}, {"scale": -1.5, "bias": 0.5, "bias_after_scale": False}, ref=scale_ref,
               grad=True, label="before"),
        Sample({"X": [_SPARSE]}, {"scale": 3.0}, ref=scale_ref, label="sparse"),
        Sample({"X": [ints(3, lo=-5, hi=5)]}, {"scale": 2.0, "bias": 1.0}, ref=scale_ref, label="int"),
    ],
    "sum": [
        Sample({"X": [rand(2, 3), rand(2, 3), rand(2, 3)]}, ref=sum_ref, grad=True, label="dense"),
        Sample({"X": [_SPARSE, Sparse(arr([0, 4], I64), rand(2, 2), 6)]}, ref=sum_ref, label="sparse"),
        Sample({"X": [rand(6, 2), _SPARSE]}, ref=sum_ref, label="mixed"),
    ],
    "reduce_sum": _reduce_samples(np.sum),
    "reduce_mean": _reduce_samples(np.mean),
    "reduce_max": _reduce_samples(np.max),
    "sqrt": [Sample({"X": [rand(3, 4, lo=0.5, hi=2.0)]}, ref=unary_ref(np.sqrt), grad=True)],
    "exp": [Sample({"X": [rand(3, 4)]}, ref=unary_ref(np.exp), grad=True)],
    "log": [Sample({"X": [rand(3, 4, lo=0.5, hi=2.0)]}, ref=unary_ref(np.log), grad=True)],
    "abs": [Sample({"X": [away(3, 4)]}, ref=unary_ref(np.abs), grad=True)],
    "relu": [Sample({"X": [away(3, 4)]}, ref=unary_ref(lambda x: np.maximum(x, 0)), grad=True)],
    "sigmoid": [Sample({"X": [rand(3, 4, lo=-3, hi=3)]}, ref=unary_ref(lambda x: 1 / (1 + np.exp(-x))), grad=True)],
    "tanh": [Sample({"X": [rand(3, 4, lo=-2, hi=2)]}, ref=unary_ref(np.tanh), grad=True)],
    "softsign": [Sample({"X": [away(3, 4)]}, ref=unary_ref(lambda x: x / (1 + np.abs(x))), grad=True)],
    "floor": [Sample({"X": [arr([[-1.5, -0.25, 0.0], [0.75, 2.5, 3.99]], F32)]}, ref=unary_ref(np.floor))],
    "softmax": [
        Sample({"X": [rand(2, 3, 4, lo=-2, hi=2)]}, ref=lambda i, a: {"Out": [_softmax(i["X"][0], -1)]}, grad=True,
               label="last"),
        Sample({"X": [rand(2, 3, 4, lo=-2, hi=2)]}, {"axis": 1}, ref=lambda i, a: {"Out": [_softmax(i["X"][0], 1)]},
               grad=True, label="axis1"),
    ],
    "cast": [
        Sample({"X": [rand(2, 3)]}, {"in_dtype": F32, "out_dtype": F64},
               ref=lambda i, a: {"Out": [i["X"][0].astype(F64)]}, grad=True, grad_attrs={"in_dtype": F64},
               label="f32_f64"),
        Sample({"X": [arr([[-2.7, -0.5, 0.0], [0.5, 1.9, 3.2]], F32)]}, {"in_dtype": F32, "out_dtype": "int32"},
               ref=lambda i, a: {"Out": [i["X"][0].astype("int32")]}, label="f32_i32"),
        Sample({"X": [arr([True, False, True], "bool")]}, {"in_dtype": "bool", "out_dtype": F32},
               ref=lambda i, a: {"Out": [i["X"][0].astype(F32)]}, label="bool_f32"),
    ],
    "fill_constant_batch_size_like": [
        Sample({"Input": [rand(3, 5)]}, {"shape": [-1, 4], "value": 1.5, "dtype": F64},
               ref=lambda i, a: {"Out": [np.full((3, 4), 1.5)]}),
        Sample({"Input": [rand(2, 5)]}, {"shape": [7, 1, 2], "value": 3.0, "dtype": I64, "input_dim_idx": 1,
                                         "output_dim_idx": 2},
               ref=lambda i, a: {"Out": [np.full((7, 1, 5), 3, np.int64)]}, label="dims"),
    ],
    "fill_zeros_like": [Sample({"X": [rand(2, 3)]}, ref=lambda i, a: {"Out": [np.zeros((2, 3), F32)]})],
    "uniform_random": [
        Sample({}, {"shape": [400], "min": -2.0, "max": 3.0}, check=uniform_check, label="f32"),
        Sample({}, {"shape": [20, 20], "dtype": F64, "seed": 11}, check=uniform_check, label="f64_seed"),
    ],
    "gaussian_random": [Sample({}, {"shape": [40, 20], "mean": 1.0, "std": 2.0}, check=gaussian_check)],
    "truncated_gaussian_random": [
        Sample({}, {"shape": [800], "mean": -1.0, "std": 0.5, "dtype": F64}, check=truncated_check),
    ],
    "assign": [
        Sample({"X": [rand(2, 3)]}, ref=lambda i, a: {"Out": [i["X"][0]]}, grad=True),
        Sample({"X": [_SPARSE]}, ref=lambda i, a: {"Out": [i["X"][0].dense()]}, label="sparse"),
    ],
    "increment": [
        Sample({"X": [arr([3], I64)]}, {"step": 2.0}, ref=lambda i, a: {"Out": [arr([5], I64)]}, label="int64"),
        Sample({"X": [arr([1.25], F32)]}, {"step": -0.5}, ref=lambda i, a: {"Out": [arr([0.75], F32)]}, label="f32"),
    ],
    **{t: [Sample({"X": [_x := distinct(2, 3)], "Y": [_x[0].copy()]}, ref=binary_ref(f)),
           Sample({"X": [ints(2, 3, lo=0, hi=3)], "Y": [ints(2, 3, lo=0, hi=3)]}, ref=binary_ref(f), label="int")]
       for t, f in (("less_than", np.less), ("less_equal", np.less_equal), ("greater_than", np.greater),
                    ("greater_equal", np.greater_equal), ("equal", np.equal), ("not_equal", np.not_equal))},
    "logical_and": [Sample({"X": [rand(2, 3) > 0], "Y": [rand(2, 3) > 0]}, ref=lambda i, a: {"Out": [i["X"][0] & i["Y"][0]]})],
    "logical_or": [Sample({"X": [rand(2, 3) > 0], "Y": [rand(2, 3) > 0]}, ref=lambda i, a: {"Out": [i["X"][0] | i["Y"][0]]})],
    "logical_not": [Sample({"X": [rand(2, 3) > 0]}, ref=lambda i, a: {"Out": [~i["X"][0]]})],
    "gelu": [Sample({"X": [rand(3, 4, lo=-3, hi=3)]}, ref=gelu_ref, grad=True)],
    "where": [Sample({"Condition": [rand(2, 3) > 0], "X": [rand(2, 3)], "Y": [rand(2, 3)]},
                     ref=lambda i, a: {"Out": [np.where(i["Condition"][0], i["X"][0], i["Y"][0])]}, grad=True)],
    # --- optimizer family ops that are plain math (their update rules are tested elsewhere)
    "clip": [Sample({"X": [arr([[-0.9, -0.3, 0.1], [0.25, 0.6, 0.9]], F32)]}, {"min": -0.5, "max": 0.5},
                    ref=lambda i, a: {"Out": [np.clip(i["X"][0], -0.5, 0.5)]}, grad=True)],
    "clip_by_norm": [
        Sample({"X": [rand(3, 4)]}, {"max_norm": 0.5},
               ref=lambda i, a: {"Out": [i["X"][0] * 0.5 / max(np.linalg.norm(i["X"][0]), 0.5)]}),
    ],
    # --- nn: losses
    "cross_entropy": [
        Sample({"X": [_probs(4, 5)], "Label": [arr([[1], [2], [4], [0]], I64)]}, {"ignore_index": 2}, ref=xent_ref,
               grad=True, label="hard"),
        Sample({"X": [_probs(2, 3, 4)], "Label": [ints(2, 3, 1, lo=0, hi=4)]}, ref=xent_ref, label="rank3"),
        Sample({"X": [_probs(3, 4)], "Label": [_probs(3, 4)]}, {"soft_label": True}, ref=xent_ref, grad=True,
               label="soft"),
    ],
    "softmax_with_cross_entropy": [
        Sample({"Logits": [rand(4, 5, lo=-3, hi=3)], "Label": [arr([[1], [3], [0], [3]], I64)]}, {"ignore_index": 3},
               ref=softmax_xent_ref, grad=True, label="hard"),
        Sample({"Logits": [rand(3, 4, lo=-3, hi=3)], "Label": [_probs(3, 4)]}, {"soft_label": True},
               ref=softmax_xent_ref, grad=True, label="soft"),
        Sample({"Logits": [rand(2, 4, 3, lo=-3, hi=3)], "Label": [ints(2, 1, 3, lo=0, hi=4)]}, {"axis": 1},
               ref=softmax_xent_ref, grad=True, label="axis1"),
        Sample({"Logits": [arr([[1000.0, 0.0, -1000.0]], F32)], "Label": [arr([[2]], I64)]},
               ref=softmax_xent_ref, label="stable"),
    ],
    "sigmoid_cross_entropy_with_logits": [
        Sample({"X": [rand(3, 4, lo=-3, hi=3)], "Label": [arr([[0, 1, -100, 1], [1, 0, 0, -100], [1, 1, 0, 0]], F32)]},
               {"normalize": True}, ref=sigmoid_xent_ref, grad=True, label="ignore_norm"),
        Sample({"X": [rand(3, 4, lo=-3, hi=3)], "Label": [rand(3, 4, lo=0, hi=1)]}, ref=sigmoid_xent_ref, grad=True,
               label="soft"),
    ],
    "log_loss": [
        Sample({"Predicted": [rand(4, 1, lo=0.1, hi=0.9)], "Labels": [arr([[0], [1], [1], [0]], F32)]},
               ref=lambda i, a: {"Loss": [-i["Labels"][0] * np.log(i["Predicted"][0] + a["epsilon"])
                                          - (1 - i["Labels"][0]) * np.log(1 - i["Predicted"][0] + a["epsilon"])]},
               grad=True),
    ],
    "cos_sim": [
        Sample({"X": [rand(3, 4)], "Y": [rand(3, 4)]}, ref=cos_sim_ref, grad=True, label="rows"),
        Sample({"X": [rand(3, 4)], "Y": [rand(1, 4)]}, ref=cos_sim_ref, grad=True, label="bcast"),
    ],
    # --- nn: embeddings and sequences
    "lookup_table": [
        Sample({"W": [rand(6, 3)], "Ids": [arr([[1], [2], [5], [1]], I64)]}, {"padding_idx": 2}, ref=lookup_ref,
               grad=True, label="dense_pad"),
        Sample({"W": [rand(6, 3)], "Ids": [arr([[0, 4, 4], [2, 3, 0]], I64)]}, ref=lookup_ref, grad=True,
               label="rank2_ids"),
        Sample({"W": [rand(6, 3)], "Ids": [arr([[3], [0], [3], [5]], I64)]}, {"is_sparse": True, "padding_idx": 0},
               ref=lookup_ref, grad=True, label="sparse_pad"),
    ],
    "sequence_pool": _SEQ_POOL,
    # --- nn: layout
    "concat": [
        Sample({"X": [rand(2, 3), rand(1, 3), rand(4, 3)]},
               ref=lambda i, a: {"Out": [np.concatenate(i["X"], 0)]}, outputs={}, grad=True, label="axis0"),
        Sample({"X": [rand(2, 3, 1), rand(2, 3, 2)]}, {"axis": -1},
               ref=lambda i, a: {"Out": [np.concatenate(i["X"], -1)]}, grad=True, label="last"),
    ],
    "split": [
        Sample({"X": [rand(4, 3)]}, {"num": 2}, outputs={"Out": 2}, ref=split_ref, grad=True, label="num"),
        Sample({"X": [rand(2, 5, 2)]}, {"sections": [1, -1, 1], "axis": 1}, outputs={"Out": 3}, ref=split_ref,
               grad=True, label="sections"),
    ],
    "reshape": [
        Sample({"X": [rand(2, 3, 4)]}, {"shape": [0, -1]}, ref=lambda i, a: {"Out": [i["X"][0].reshape(2, 12)]},
               grad=True, label="copy_infer"),
        Sample({"X": [rand(2, 6)]}, {"shape": [3, 2, 2]}, ref=lambda i, a: {"Out": [i["X"][0].reshape(3, 2, 2)]},
               grad=True, label="plain"),
    ],
    "transpose": [Sample({"X": [rand(2, 3, 4)]}, {"axis": [2, 0, 1]},
                         ref=lambda i, a: {"Out": [i["X"][0].transpose(2, 0, 1)]}, grad=True)],
    # --- nn: convolution and pooling
    "conv2d": [
        Sample({"Input": [rand(2, 4, 5, 5)], "Filter": [rand(6, 2, 3, 3)]},
               {"groups": 2, "strides": [2, 1], "paddings": [1, 0], "dilations": [1, 2]}, ref=conv2d_ref, grad=True,
               label="groups"),
        Sample({"Input": [rand(1, 4, 4, 3)], "Filter": [rand(2, 3, 2, 2)]}, {"data_format": "NHWC", "paddings": [0, 1, 1, 0]},
               ref=conv2d_ref, grad=True, label="nhwc_pad4"),
    ],
    "pool2d": [
        Sample({"X": [distinct(1, 2, 4, 4)]}, {"ksize": [2, 2], "strides": [2, 2]}, ref=pool2d_ref, grad=True, label="max"),
        Sample({"X": [rand(1, 2, 5, 5)]}, {"pooling_type": "avg", "ksize": [3, 3], "strides": [2, 2], "paddings": [1, 1]},
               ref=pool2d_ref, grad=True, label="avg_excl"),
        Sample({"X": [rand(1, 2, 5, 5)]}, {"pooling_type": "avg", "ksize": [3, 3], "strides": [2, 2], "paddings": [1, 1],
                                           "exclusive": False}, ref=pool2d_ref, label="avg_incl"),
        Sample({"X": [distinct(1, 2, 5, 5)]}, {"ksize": [2, 2], "strides": [2, 2], "ceil_mode": True}, ref=pool2d_ref,
               grad=True, label="max_ceil"),
        Sample({"X": [rand(1, 2, 5, 5)]}, {"pooling_type": "avg", "ksize": [2, 2], "strides": [2, 2], "ceil_mode": True},
               ref=pool2d_ref, grad=True, label="avg_ceil"),
        Sample({"X": [rand(2, 3, 3, 4)]}, {"pooling_type": "avg", "ksize": [1, 1], "global_pooling": True},
               ref=pool2d_ref, grad=True, label="global_avg"),
        Sample({"X": [rand(1, 2, 5, 7)]}, {"pooling_type": "avg", "ksize": [2, 3], "adaptive": True}, ref=pool2d_ref,
               grad=True, label="adaptive"),
        Sample({"X": [distinct(1, 4, 4, 2)]}, {"ksize": [3, 3], "strides": [1, 1], "data_format": "NHWC"},
               ref=pool2d_ref, grad=True, label="max_nhwc"),
    ],
    # --- nn: normalisation and dropout
    "batch_norm": [
        Sample({"X": [rand(3, 2, 2, 2)], "Scale": [rand(2, lo=0.5, hi=1.5)], "Bias": [rand(2)],
                "Mean": [rand(2)], "Variance": [rand(2, lo=0.5, hi=1.5)]}, ref=batch_norm_ref, grad=True, label="train"),
        Sample({"X": [rand(3, 2, 2, 2)], "Scale": [rand(2, lo=0.5, hi=1.5)], "Bias": [rand(2)],
                "Mean": [rand(2)], "Variance": [rand(2, lo=0.5, hi=1.5)]}, {"is_test": True}, ref=batch_norm_ref,
               grad=True, label="test"),
        Sample({"X": [rand(4, 3)], "Scale": [rand(3, lo=0.5, hi=1.5)], "Bias": [rand(3)],
                "Mean": [rand(3)], "Variance": [rand(3, lo=0.5, hi=1.5)]}, {"momentum": 0.5}, ref=batch_norm_ref,
               label="rank2"),
        Sample({"X": [rand(2, 2, 2, 3)], "Scale": [rand(3, lo=0.5, hi=1.5)], "Bias": [rand(3)],
                "Mean": [rand(3)], "Variance": [rand(3, lo=0.5, hi=1.5)]}, {"data_layout": "NHWC"},
               ref=batch_norm_ref, grad=True, label="nhwc"),
    ],
    "dropout": [
        Sample({"X": [rand(20, 20)]}, {"dropout_prob": 0.3, "seed": 7, "fix_seed": True}, check=dropout_check, grad=True, label="downgrade"),
        Sample({"X": [rand(20, 20)]}, {"dropout_prob": 0.4, "dropout_implementation": "upscale_in_train", "seed": 5, "fix_seed": True},
               check=dropout_check, grad=True, label="upscale"),
        Sample({"X": [rand(3, 4)]}, {"dropout_prob": 0.25, "is_test": True},
               ref=lambda i, a: {"Out": [i["X"][0] * 0.75]}, label="infer_downgrade"),
        Sample({"X": [rand(3, 4)]}, {"dropout_prob": 0.25, "is_test": True, "dropout_implementation": "upscale_in_train"},
               ref=lambda i, a: {"Out": [i["X"][0]]}, label="infer_upscale"),
    ],
    "layer_norm": [
        Sample({"X": [rand(3, 2, 4)], "Scale": [rand(8, lo=0.5, hi=1.5)], "Bias": [rand(8)]},
               ref=layer_norm_ref, grad=True, label="axis1"),
        Sample({"X": [rand(2, 3, 5)], "Scale": [rand(5, lo=0.5, hi=1.5)], "Bias": [rand(5)]},
               {"begin_norm_axis": 2, "epsilon": 1e-3}, ref=layer_norm_ref, grad=True, label="axis2"),
        Sample({"X": [rand(4, 6)]}, ref=layer_norm_ref, grad=True,
               label="no_affine"),
    ],
    # --- nn: metrics
    "top_k": [Sample({"X": [distinct(3, 5)]}, {"k": 2}, ref=top_k_ref)],
    "accuracy": [
        Sample({"Out": [rand(4, 2)], "Indices": [arr([[1, 0], [2, 3], [4, 1], [0, 2]], I64)],
                "Label": [arr([[0], [1], [4], [3]], I64)]}, ref=accuracy_ref),
    ],
    "auc": [
        Sample({"Predict": [np.stack([1 - (_p := rand(12, lo=0, hi=1, dtype=F32)), _p], 1)],
                "Label": [ints(12, 1, lo=0, hi=2)], "StatPos": [np.zeros((1, 11), np.int64)],
                "StatNeg": [np.zeros((1, 11), np.int64)]}, {"num_thresholds": 10, "slide_steps": 0},
               ref=auc_ref, label="global"),
        Sample({"Predict": [rand(10, 1, lo=0, hi=1, dtype=F32)], "Label": [ints(10, 1, lo=0, hi=2)],
                "StatPos": [ints(2, 11, lo=0, hi=3)], "StatNeg": [ints(2, 11, lo=0, hi=3)]},
               {"num_thresholds": 10, "slide_steps": 2}, ref=auc_ref, label="window"),
    ],
}


# --- building and running -----------------------------------------------------------------------------------------
@dataclass
class Built:
    """A sample's Program, the op, the feed and the variable names of the forward op's slots."""

    program: Program
    op: Operator
    feed: dict[str, Any]
    inputs: dict[str, list[str]]
    outputs: dict[str, list[str]]
    grad_ops: list[Operator] = field(default_factory=list)
    grads: dict[str, str] = field(default_factory=dict)  # forward input var -> its gradient var


def _upcast(value: Any, dtype: str | None) -> Any:
    if dtype is None:
        return value
    if isinstance(value, Sparse):
        return value.astype(dtype)
    return value.astype(dtype) if np.issubdtype(value.dtype, np.floating) else value


def _add_input(block: Block, feed: dict[str, Any], name: str, value: Any) -> None:
    if isinstance(value, Sparse):
        shape = (value.height,) + value.values.shape[1:]
        block.create_var(name, shape, str(value.values.dtype), type="selected_rows", is_data=True)
        feed[name] = value.to_runtime()
    else:
        block.create_var(name, value.shape, str(value.dtype), is_data=True)
        feed[name] = value


def build(op_type: str, sample: Sample, dtype: str | None = None) -> Built:
    """A one-op Program for ``sample``; ``dtype`` (e.g. float64) converts every float input."""
    program = Program()
    block = program.global_block()
    feed: dict[str, Any] = {}
    inputs: dict[str, list[str]] = {}
    for slot, values in sample.inputs.items():
        inputs[slot] = []
        for j, value in enumerate(values):
            name = f"in_{slot}_{j}"
            _add_input(block, feed, name, _upcast(value, dtype))
            inputs[slot].append(name)
    outputs: dict[str, list[str]] = {}
    for slot in get_op_def(op_type).outputs:
        count = sample.outputs.get(slot.name, 1)
        if count:
            outputs[slot.name] = [f"out_{slot.name}_{j}" for j in range(count)]
            for name in outputs[slot.name]:
                block.create_var(name)
    attrs = {**sample.attrs, **(sample.grad_attrs if dtype is not None else {})}
    op = block.append_op(op_type, inputs, outputs, attrs)
    return Built(program, op, feed, inputs, outputs)


def build_with_grad(op_type: str, sample: Sample, cotangent_seed: int = 0) -> Built:
    """The sample's op in float64 followed by its gradient ops (``make_grad``); every ``@GRAD`` input of
    a gradient op is fed a random cotangent of its forward variable's shape."""
    built = build(op_type, sample, dtype="float64")
    block = built.program.global_block()
    fwd_of = {grad_name(n): n for names in (*built.inputs.values(), *built.outputs.values()) for n in names}
    rng = np.random.default_rng(cotangent_seed)
    for spec in get_op_def(op_type).make_grad(built.op):
        for names in spec.inputs.values():
            for n in names:
                if not block.has_var(n):
                    fwd = block.var(fwd_of[n])
                    block.create_var(n, fwd.shape, fwd.dtype, is_data=True)
                    built.feed[n] = rng.normal(size=fwd.shape).astype(fwd.dtype)
        for names in spec.outputs.values():
            for n in names:
                if not block.has_var(n):
                    block.create_var(n)
                built.grads[fwd_of[n]] = n
        built.grad_ops.append(block.append_op(spec.type, spec.inputs, spec.outputs, spec.attrs))
    return built


def run(built: Built, fetch: list[str], scope: Scope | None = None) -> list[Any]:
    """Run ``built`` with a fresh Executor; the fetched values as the runtime holds them (jax arrays or
    SelectedRows)."""
    exe = runtime.Executor()
    return exe.run(built.program, feed=built.feed, fetch_list=fetch, scope=scope or Scope(), return_numpy=False)


def sample_id(op_type: str, i: int, sample: Sample) -> str:
    return f"{op_type}-{sample.label or i}"


# --- LoD sequence ops: rows [R, ...] with Length [N]; rows past sum(Length) are bucket padding ------------
def _segments_np(length: np.ndarray) -> list[range]:
    ends = np.cumsum(length)
    return [range(int(e - n), int(e)) for e, n in zip(ends, length)]


def sequence_pool_lod_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x, length = ins["X"][0].astype(np.float64), ins["Length"][0]
    out = np.full((len(length),) + x.shape[1:], attrs["pad_value"])
    max_index = np.zeros(out.shape, np.int32)
    for n, rows in enumerate(_segments_np(length)):
        if not len(rows):
            continue
        seq = x[rows.start:rows.stop]
        ptype = attrs["pooltype"]
        if ptype == "MAX":
            out[n] = seq.max(0)
            max_index[n] = rows.start + seq.argmax(0)
        else:
            out[n] = {"SUM": lambda: seq.sum(0), "AVERAGE": lambda: seq.mean(0),
                      "SQRT": lambda: seq.sum(0) / np.sqrt(len(rows)), "FIRST": lambda: seq[0],
                      "LAST": lambda: seq[-1]}[ptype]()
    result = {"Out": [out]}
    if attrs["pooltype"] == "MAX":
        result["MaxIndex"] = [max_index]
    return result


def sequence_softmax_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x, length = ins["X"][0].astype(np.float64), ins["Length"][0]
    out = np.zeros_like(x)
    for rows in _segments_np(length):
        e = np.exp(x[rows.start:rows.stop] - x[rows.start:rows.stop].max(initial=-np.inf))
        out[rows.start:rows.stop] = e / e.sum()
    return {"Out": [out]}


def sequence_conv_ref(ins: Arrays, attrs: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    x, w, length = ins["X"][0].astype(np.float64), ins["Filter"][0].astype(np.float64), ins["Length"][0]
    out = np.zeros((x.shape[0], w.shape[1]))
    for rows in _segments_np(length):
        for r in rows:
            window = [x[s] if rows.start <= s < rows.stop else np.zeros(x.shape[1])
                      for s in range(r + attrs["contextStart"], r + attrs["contextStart"] + attrs["contextLength"])]
            out[r] = np.concatenate(window) @ w
    return {"Out": [out]}


_LOD_LEN = arr([2, 0, 4], I64)  # 6 rows in 3 sequences (one empty), padded to 8 rows
SAMPLES["sequence_pool"] += [
    Sample({"X": [distinct(8, 2)], "Length": [_LOD_LEN]}, {"pooltype": t, "pad_value": 0.25},
           ref=sequence_pool_lod_ref, grad=True, label=f"lod_{t}")
    for t in ("AVERAGE", "SUM", "MAX", "SQRT", "FIRST", "LAST")
]
SAMPLES["sequence_softmax"] = [
    Sample({"X": [rand(8, 1)], "Length": [_LOD_LEN]}, ref=sequence_softmax_ref, grad=True, label="lod"),
]
SAMPLES["sequence_conv"] = [
    Sample({"X": [rand(8, 2)], "Filter": [rand(6, 3)], "Length": [_LOD_LEN]},
           {"contextLength": 3, "contextStart": -1}, ref=sequence_conv_ref, grad=True, label="centred"),
    Sample({"X": [rand(8, 2)], "Filter": [rand(4, 3)], "Length": [arr([3, 5], I64)]},
           {"contextLength": 2, "contextStart": 0}, ref=sequence_conv_ref, grad=True, label="forward"),
]
