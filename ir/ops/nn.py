"""Op schemas: losses, embeddings, sequence pooling, tensor layout, convolution, normalisation,
dropout and metrics (the nn family).

Op types, slot names, attribute names and defaults follow Paddle Fluid 1.5. Sequence ops see a LoD
tensor (``layers.data(..., lod_level=1)``) as its flattened rows ``X [R, D...]`` plus a ``Length [N]``
input holding each sequence's row count (rows past ``sum(Length)`` are bucket padding and ignored; see
``runtime/lod.py``); ``sequence_pool`` also pools padded batches ``[N, T, D]`` (optional ids marking
padding steps) when given no ``Length``.
Shape inference uses -1 for an unknown extent and fails through ``ctx.fail`` naming what is
incompatible. Gradient ops read the forward inputs they need to recompute the forward (the runtime
differentiates forward kernels with ``jax.vjp``), except ``dropout_grad``, which must reuse ``Mask``.
"""
from __future__ import annotations

from typing import Sequence

from ir.ops.registry import A, AttrKind as K, DefaultGrad, InferContext, INT_DTYPES, NO_GRAD, VarInfo, defop
from ir.ops.shapes import check_dtype, check_same_shape, dim_eq, merge_dim, normalize_axis, prod

_IGNORE_INDEX = -100  # Fluid's kIgnoreIndex


def _check_label_like(ctx: InferContext, x_name: str, x: Sequence[int], label: Sequence[int], axis: int,
                      soft: bool) -> None:
    """Label has X's shape except at ``axis``, where it is 1 (hard labels) or X's extent (soft)."""
    if len(label) != len(x):
        ctx.fail(f"Label{list(label)} must have the rank of {x_name}{list(x)}")
    for i, (a, b) in enumerate(zip(x, label)):
        if i == axis:
            if soft and not dim_eq(a, b):
                ctx.fail(f"soft Label{list(label)} must match {x_name}{list(x)} at dim {i}")
            if not soft and not dim_eq(b, 1):
                ctx.fail(f"hard Label{list(label)} must have extent 1 at dim {i} (class ids), got {b}")
        elif not dim_eq(a, b):
            ctx.fail(f"Label{list(label)} and {x_name}{list(x)} differ at dim {i}")


def _check_hard_label_dtype(ctx: InferContext, label: VarInfo, soft: bool, x: VarInfo) -> None:
    if soft:
        if label.dtype != x.dtype:
            ctx.fail(f"soft Label has dtype {label.dtype}; expected the dtype of the scores, {x.dtype}")
    else:
        check_dtype(ctx, "hard Label", label.dtype, ("int64",))


# --- losses ---------------------------------------------------------------------------------------
def _infer_cross_entropy(ctx: InferContext) -> None:
    x, label = ctx.input("X"), ctx.input("Label")
    if not x.shape:
        ctx.fail("X must have rank >= 1 (its last dim holds the class probabilities)")
    soft = ctx.attr("soft_label")
    _check_label_like(ctx, "X", x.shape, label.shape, len(x.shape) - 1, soft)
    _check_hard_label_dtype(ctx, label, soft, x)
    ctx.set_output("Y", VarInfo(tuple(x.shape[:-1]) + (1,), x.dtype))


defop(
    "cross_entropy",
    inputs=["X", "Label"],
    outputs=["Y"],
    attrs=[
        A("soft_label", K.BOOL, False, "Label holds a distribution over classes instead of class ids"),
        A("ignore_index", K.INT, _IGNORE_INDEX, "hard labels equal to this contribute zero loss"),
    ],
    infer=_infer_cross_entropy,
    grad=DefaultGrad(wrt=("X",)),
    doc="Y = -log X[label] (or -sum Label * log X), X holding probabilities in its last dim",
)


def _infer_softmax_xent(ctx: InferContext) -> None:
    logits, label = ctx.input("Logits"), ctx.input("Label")
    rank = len(logits.shape)
    axis = normalize_axis(ctx, ctx.attr("axis"), rank)
    soft = ctx.attr("soft_label")
    _check_label_like(ctx, "Logits", logits.shape, label.shape, axis, soft)
    _check_hard_label_dtype(ctx, label, soft, logits)
    loss = tuple(1 if i == axis else d for i, d in enumerate(logits.shape))
    ctx.set_output("Softmax", VarInfo(logits.shape, logits.dtype))
    ctx.set_output("Loss", VarInfo(loss, logits.dtype))


defop(
    "softmax_with_cross_entropy",
    inputs=["Logits", "Label"],
    outputs=["Softmax", "Loss"],
    attrs=[
        A("soft_label", K.BOOL, False, "Label holds a distribution over classes instead of class ids"),
        A("ignore_index", K.INT, _IGNORE_INDEX, "hard labels equal to this contribute zero loss"),
        A("numeric_stable_mode", K.BOOL, True, "subtract the max logit first"),
        A("axis", K.INT, -1, "the class dimension"),
    ],
    infer=_infer_softmax_xent,
    grad=DefaultGrad(wrt=("Logits",), out_grads=("Loss",)),
    doc="Softmax = softmax(Logits) along axis; Loss = cross entropy of Softmax with Label",
)


def _infer_sigmoid_xent(ctx: InferContext) -> None:
    x, label = ctx.input("X"), ctx.input("Label")
    if label.dtype != x.dtype:
        ctx.fail(f"Label has dtype {label.dtype}; expected the dtype of X, {x.dtype}")
    ctx.set_output("Out", VarInfo(check_same_shape(ctx, "X", x.shape, "Label", label.shape), x.dtype))


defop(
    "sigmoid_cross_entropy_with_logits",
    inputs=["X", "Label"],
    outputs=["Out"],
    attrs=[
        A("ignore_index", K.INT, _IGNORE_INDEX, "labels equal to this contribute zero loss"),
        A("normalize", K.BOOL, False, "divide by the number of labels not equal to ignore_index"),
    ],
    infer=_infer_sigmoid_xent,
    grad=DefaultGrad(wrt=("X",)),
    doc="Out = max(X, 0) - X * Label + log(1 + exp(-|X|)), elementwise",
)


def _infer_log_loss(ctx: InferContext) -> None:
    p, labels = ctx.input("Predicted"), ctx.input("Labels")
    shape = check_same_shape(ctx, "Predicted", p.shape, "Labels", labels.shape)
    if len(shape) != 2 or not dim_eq(shape[1], 1):
        ctx.fail(f"Predicted{list(p.shape)} must have shape [N, 1]")
    ctx.set_output("Loss", VarInfo(shape, p.dtype))


defop(
    "log_loss",
    inputs=["Predicted", "Labels"],
    outputs=["Loss"],
    attrs=[A("epsilon", K.FLOAT, 1e-4, "added inside the logs for stability")],
    infer=_infer_log_loss,
    grad=DefaultGrad(wrt=("Predicted",)),
    doc="Loss = -Labels * log(Predicted + eps) - (1 - Labels) * log(1 - Predicted + eps)",
)


def _infer_cos_sim(ctx: InferContext) -> None:
    x, y = ctx.input("X"), ctx.input("Y")
    if len(x.shape) < 2 or len(y.shape) != len(x.shape):
        ctx.fail(f"X{list(x.shape)} and Y{list(y.shape)} must have one rank >= 2")
    check_same_shape(ctx, "X[1:]", x.shape[1:], "Y[1:]", y.shape[1:])
    if y.shape[0] != 1 and not dim_eq(x.shape[0], y.shape[0]):
        ctx.fail(f"Y{list(y.shape)} must have X's batch size {x.shape[0]} or 1 rows")
    ctx.set_output("Out", VarInfo((x.shape[0], 1), x.dtype))
    ctx.set_output("XNorm", VarInfo((x.shape[0], 1), x.dtype))
    ctx.set_output("YNorm", VarInfo((y.shape[0], 1), y.dtype))


defop(
    "cos_sim",
    inputs=["X", "Y"],
    outputs=["Out", "XNorm", "YNorm"],
    infer=_infer_cos_sim,
    grad=DefaultGrad(out_grads=("Out",)),
    doc="Out = cosine similarity of the rows of X and Y (Y may have one row); XNorm, YNorm the row norms",
)


# --- embeddings and sequences ---------------------------------------------------------------------
def _infer_lookup_table(ctx: InferContext) -> None:
    w, ids = ctx.input("W"), ctx.input("Ids")
    if len(w.shape) != 2:
        ctx.fail(f"W{list(w.shape)} must be a 2-D table [rows, width]")
    check_dtype(ctx, "Ids", ids.dtype, ("int64",))
    if not ids.shape:
        ctx.fail("Ids must have rank >= 1")
    lead = ids.shape[:-1] if ids.shape[-1] == 1 and len(ids.shape) > 1 else ids.shape
    ctx.set_output("Out", VarInfo(tuple(lead) + (w.shape[1],), w.dtype))


defop(
    "lookup_table",
    inputs=["W", "Ids"],
    outputs=["Out"],
    attrs=[
        A("is_sparse", K.BOOL, False, "W@GRAD is selected rows"),
        A("is_distributed", K.BOOL, False, "W lives split across the pservers"),
        A("padding_idx", K.INT, -1, "ids equal to this look up zeros (-1: none)"),
        A("remote_prefetch", K.BOOL, False, "rows are prefetched from the pservers"),
        A("trainer_id", K.INT, 0, "set by the transpiler for remote prefetch"),
        A("height_sections", K.INTS, [], "rows of each pserver's slice of W (remote prefetch)"),
        A("epmap", K.STRINGS, [], "endpoint of each slice of W (remote prefetch)"),
        A("table_names", K.STRINGS, [], "name of each slice of W (remote prefetch)"),
    ],
    infer=_infer_lookup_table,
    grad=DefaultGrad(wrt=("W",), sparse_grad=("W", "is_sparse")),
    doc="Out = W[Ids]; Ids [..., 1] or [...] (int64) gives Out [..., width]",
)

_POOL_TYPES = ("AVERAGE", "SUM", "MAX", "SQRT", "FIRST", "LAST")


def _check_length(ctx: InferContext) -> VarInfo:
    """The ``Length`` input: int64 [N], one row count per sequence."""
    length = ctx.input("Length")
    check_dtype(ctx, "Length", length.dtype, ("int64",))
    if len(length.shape) != 1:
        ctx.fail(f"Length{list(length.shape)} must be [N], one row count per sequence")
    return length


def _infer_sequence_pool(ctx: InferContext) -> None:
    x = ctx.input("X")
    pooltype = ctx.attr("pooltype")
    if pooltype not in _POOL_TYPES:
        ctx.fail(f"pooltype {pooltype!r} is unknown; expected one of {list(_POOL_TYPES)}")
    if ctx.has_input("Length"):
        length = _check_length(ctx)
        if len(x.shape) < 2:
            ctx.fail(f"X{list(x.shape)} must be the rows of a LoD tensor [R, D...]")
        if ctx.has_input("Ids"):
            ctx.fail("Ids (padding marks) and Length (LoD) cannot both be given")
        out = (length.shape[0],) + tuple(x.shape[1:])
        ctx.set_output("Out", VarInfo(out, x.dtype))
        ctx.set_output("MaxIndex", VarInfo(out, "int32"))
        return
    if len(x.shape) < 3:
        ctx.fail(f"X{list(x.shape)} is neither a padded batch [N, T, D...] nor a LoD tensor (no Length input)")
    n, t = x.shape[0], x.shape[1]
    if ctx.has_input("Ids"):
        ids = ctx.input("Ids")
        check_dtype(ctx, "Ids", ids.dtype, ("int64",))
        shape = ids.shape[:-1] if len(ids.shape) == 3 and dim_eq(ids.shape[2], 1) else ids.shape
        if len(shape) != 2 or not (dim_eq(shape[0], n) and dim_eq(shape[1], t)):
            ctx.fail(f"Ids{list(ids.shape)} must be [N, T] or [N, T, 1] matching X{list(x.shape)}")
    out = (n,) + tuple(x.shape[2:])
    ctx.set_output("Out", VarInfo(out, x.dtype))
    ctx.set_output("MaxIndex", VarInfo(out, "int32"))


defop(
    "sequence_pool",
    inputs=["X", "Ids?", "Length?"],
    outputs=["Out", "MaxIndex?"],
    attrs=[
        A("pooltype", K.STRING, "AVERAGE", "AVERAGE | SUM | MAX | SQRT | FIRST | LAST"),
        A("padding_idx", K.INT, -1, "padded form: time steps whose id equals this are excluded (-1: none)"),
        A("is_test", K.BOOL, False, "inference mode (MaxIndex is not needed)"),
        A("pad_value", K.FLOAT, 0.0, "Out for a sequence with no steps"),
    ],
    infer=_infer_sequence_pool,
    grad=DefaultGrad(wrt=("X",), out_grads=("Out",)),
    doc="pools each sequence to one row: LoD rows X [R, D] with Length [N] (or a padded batch X [N, T, D]) "
        "to Out [N, D]; MaxIndex (MAX) is the pooled row (LoD) or time step (padded)",
)


# --- layout ---------------------------------------------------------------------------------------
def _infer_concat(ctx: InferContext) -> None:
    xs = ctx.inputs("X")
    if not xs:
        ctx.fail("needs at least one input in slot X")
    first = xs[0]
    rank = len(first.shape)
    axis = normalize_axis(ctx, ctx.attr("axis"), rank)
    out = list(first.shape)
    for i, x in enumerate(xs[1:], start=1):
        if x.dtype != first.dtype:
            ctx.fail(f"X[{i}] dtype {x.dtype} differs from X[0] dtype {first.dtype}")
        if len(x.shape) != rank:
            ctx.fail(f"X[{i}]{list(x.shape)} has rank {len(x.shape)}; X[0]{list(first.shape)} has rank {rank}")
        for d in range(rank):
            if d == axis:
                out[d] = -1 if out[d] < 0 or x.shape[d] < 0 else out[d] + x.shape[d]
            elif not dim_eq(out[d], x.shape[d]):
                ctx.fail(f"X[{i}]{list(x.shape)} differs from X[0]{list(first.shape)} at dim {d} (axis is {axis})")
            else:
                out[d] = merge_dim(out[d], x.shape[d])
    ctx.set_output("Out", VarInfo(tuple(out), first.dtype))


defop(
    "concat",
    inputs=["X*"],
    outputs=["Out"],
    attrs=[A("axis", K.INT, 0, "the dimension to join along")],
    infer=_infer_concat,
    grad=DefaultGrad(),
    doc="Out = the X joined along axis",
)


def _infer_split(ctx: InferContext) -> None:
    x = ctx.input("X")
    axis = normalize_axis(ctx, ctx.attr("axis"), len(x.shape))
    num, sections = ctx.attr("num"), list(ctx.attr("sections"))
    count = ctx.num_outputs("Out")
    extent = x.shape[axis]
    if num > 0:
        if sections:
            ctx.fail(f"give num ({num}) or sections ({sections}), not both")
        if count != num:
            ctx.fail(f"num={num} but slot Out has {count} variables")
        if extent >= 0 and extent % num:
            ctx.fail(f"X{list(x.shape)} dim {axis} (extent {extent}) does not divide into num={num} parts")
        sizes = [extent // num if extent >= 0 else -1] * num
    else:
        if not sections:
            ctx.fail("needs num > 0 or a non-empty sections list")
        if count != len(sections):
            ctx.fail(f"sections {sections} name {len(sections)} parts but slot Out has {count} variables")
        unknown = [i for i, s in enumerate(sections) if s == -1]
        if len(unknown) > 1 or any(s < -1 for s in sections):
            ctx.fail(f"sections {sections} may hold at most one -1 and no other negative")
        known = sum(s for s in sections if s >= 0)
        if extent >= 0:
            if unknown:
                if known > extent:
                    ctx.fail(f"sections {sections} exceed X{list(x.shape)} dim {axis} (extent {extent})")
                sections[unknown[0]] = extent - known
            elif known != extent:
                ctx.fail(f"sections {sections} sum to {known}, not X{list(x.shape)} dim {axis} (extent {extent})")
        sizes = sections
    ctx.set_output("Out", [VarInfo(tuple(s if d == axis else e for d, e in enumerate(x.shape)), x.dtype)
                           for s in sizes])


defop(
    "split",
    inputs=["X"],
    outputs=["Out*"],
    attrs=[
        A("num", K.INT, 0, "split into this many equal parts (0: use sections)"),
        A("sections", K.INTS, [], "extent of each part (one may be -1: the rest)"),
        A("axis", K.INT, 0, "the dimension to split"),
    ],
    infer=_infer_split,
    grad=DefaultGrad(),
    doc="Out = X cut along axis into num equal parts or parts of the given sections",
)


def _infer_reshape(ctx: InferContext) -> None:
    x = ctx.input("X")
    shape = list(ctx.attr("shape"))
    if not shape:
        ctx.fail("attr shape is empty")
    if shape.count(-1) > 1 or any(s < -1 for s in shape):
        ctx.fail(f"shape {shape} may hold at most one -1 and no other negative")
    out = []
    for i, s in enumerate(shape):
        if s == 0:
            if i >= len(x.shape):
                ctx.fail(f"shape {shape} copies dim {i} (0) but X{list(x.shape)} has rank {len(x.shape)}")
            out.append(x.shape[i])
        else:
            out.append(s)
    # A dim copied by 0 appears on both sides, so it cancels even when unknown (the batch dim).
    copied = {i for i, s in enumerate(shape) if s == 0}
    x_rest = prod([d for i, d in enumerate(x.shape) if i not in copied])
    out_rest = prod([out[i] for i, s in enumerate(shape) if s > 0])
    if -1 in shape:
        at = shape.index(-1)
        if x_rest >= 0 and out_rest > 0:
            if x_rest % out_rest:
                ctx.fail(f"X{list(x.shape)} cannot be reshaped to {shape}: {x_rest} elements do not divide by {out_rest}")
            out[at] = x_rest // out_rest
        else:
            out[at] = -1
    elif x_rest >= 0 and out_rest >= 0 and x_rest != out_rest:
        ctx.fail(f"X{list(x.shape)} does not fit shape {shape}: {x_rest} elements against {out_rest}"
                 " (dims copied by 0 left out)")
    ctx.set_output("Out", VarInfo(tuple(out), x.dtype))


defop(
    "reshape",
    inputs=["X"],
    outputs=["Out"],
    attrs=[A("shape", K.INTS, doc="the new shape: 0 copies X's dim there, one -1 is inferred")],
    infer=_infer_reshape,
    grad=DefaultGrad(),
    doc="Out = X with a new shape and the same elements",
)


def _infer_transpose(ctx: InferContext) -> None:
    x = ctx.input("X")
    axis = list(ctx.attr("axis"))
    if sorted(axis) != list(range(len(x.shape))):
        ctx.fail(f"axis {axis} is not a permutation of the {len(x.shape)} dims of X{list(x.shape)}")
    ctx.set_output("Out", VarInfo(tuple(x.shape[a] for a in axis), x.dtype))


defop(
    "transpose",
    inputs=["X"],
    outputs=["Out"],
    attrs=[A("axis", K.INTS, doc="Out dim i is X dim axis[i]")],
    infer=_infer_transpose,
    grad=DefaultGrad(),
    doc="Out = X with its dims permuted",
)


# --- convolution and pooling ----------------------------------------------------------------------
_LAYOUTS = ("NCHW", "NHWC", "AnyLayout")


def _spatial(ctx: InferContext, x: VarInfo, layout: str, slot: str) -> tuple[int, int, tuple[int, int]]:
    """(batch, channels, (H, W)) of a 4-D input in ``layout``."""
    if layout not in _LAYOUTS:
        ctx.fail(f"data format {layout!r} is unknown; expected one of {list(_LAYOUTS)}")
    if len(x.shape) != 4:
        ctx.fail(f"{slot}{list(x.shape)} must be 4-D ({layout})")
    n, *rest = x.shape
    if layout == "NHWC":
        return n, rest[2], (rest[0], rest[1])
    return n, rest[0], (rest[1], rest[2])


def _pairs(ctx: InferContext, name: str, allow_four: bool = False) -> list[int]:
    value = list(ctx.attr(name))
    if len(value) == 2 or (allow_four and len(value) == 4):
        return value
    ctx.fail(f"attr {name}={value} must have 2 values (H, W)" + (" or 4" if allow_four else ""))
    return value


def _pad_totals(pads: list[int]) -> list[int]:
    """Total padding per spatial dim: [p_h, p_w] pads both sides; [top, bottom, left, right] as given."""
    return [2 * pads[0], 2 * pads[1]] if len(pads) == 2 else [pads[0] + pads[1], pads[2] + pads[3]]


def _layout_shape(n: int, c: int, hw: Sequence[int], layout: str) -> tuple[int, ...]:
    return (n, hw[0], hw[1], c) if layout == "NHWC" else (n, c, hw[0], hw[1])


def _infer_conv2d(ctx: InferContext) -> None:
    x, f = ctx.input("Input"), ctx.input("Filter")
    layout = ctx.attr("data_format")
    n, c, hw = _spatial(ctx, x, layout, "Input")
    if len(f.shape) != 4:
        ctx.fail(f"Filter{list(f.shape)} must be 4-D [out_channels, in_channels / groups, kh, kw]")
    groups = ctx.attr("groups")
    if groups < 1:
        ctx.fail(f"groups={groups} must be >= 1")
    m, fc, kh, kw = f.shape
    if c >= 0 and fc >= 0 and c != fc * groups:
        ctx.fail(f"Input{list(x.shape)} has {c} channels but Filter{list(f.shape)} takes {fc} x groups={groups}")
    if m >= 0 and m % groups:
        ctx.fail(f"Filter{list(f.shape)} has {m} output channels, not divisible by groups={groups}")
    strides, dil = _pairs(ctx, "strides"), _pairs(ctx, "dilations")
    pads = _pad_totals(_pairs(ctx, "paddings", allow_four=True))
    if min(strides) < 1 or min(dil) < 1:
        ctx.fail(f"strides {strides} and dilations {dil} must be >= 1")
    out = []
    for i, (size, k) in enumerate(zip(hw, (kh, kw))):
        if size < 0 or k < 0:
            out.append(-1)
            continue
        o = (size + pads[i] - (dil[i] * (k - 1) + 1)) // strides[i] + 1
        if o <= 0:
            ctx.fail(f"Input{list(x.shape)} is too small for Filter{list(f.shape)}: output extent {o} at spatial dim {i}")
        out.append(o)
    ctx.set_output("Output", VarInfo(_layout_shape(n, m, out, layout), x.dtype))


defop(
    "conv2d",
    inputs=["Input", "Filter"],
    outputs=["Output"],
    attrs=[
        A("strides", K.INTS, [1, 1], "stride (H, W)"),
        A("paddings", K.INTS, [0, 0], "zero padding (H, W) on both sides, or (top, bottom, left, right)"),
        A("dilations", K.INTS, [1, 1], "dilation (H, W)"),
        A("groups", K.INT, 1, "channel groups"),
        A("use_cudnn", K.BOOL, True, "Fluid's cuDNN switch (ignored)"),
        A("data_format", K.STRING, "NCHW", "layout of Input and Output: NCHW or NHWC"),
    ],
    infer=_infer_conv2d,
    grad=DefaultGrad(),
    doc="2-D convolution (cross-correlation) of Input with Filter [M, C/groups, kh, kw]",
)


def _infer_pool2d(ctx: InferContext) -> None:
    x = ctx.input("X")
    layout = ctx.attr("data_format")
    n, c, hw = _spatial(ctx, x, layout, "X")
    ptype = ctx.attr("pooling_type")
    if ptype not in ("max", "avg"):
        ctx.fail(f"pooling_type {ptype!r} is unknown; expected 'max' or 'avg'")
    ksize = _pairs(ctx, "ksize")
    if ctx.attr("global_pooling"):
        out = [1, 1]
    elif ctx.attr("adaptive"):
        out = ksize
    else:
        strides = _pairs(ctx, "strides")
        pads = _pad_totals(_pairs(ctx, "paddings", allow_four=True))
        if min(strides) < 1 or min(ksize) < 1:
            ctx.fail(f"ksize {ksize} and strides {strides} must be >= 1")
        out = []
        for i, size in enumerate(hw):
            if size < 0:
                out.append(-1)
                continue
            extra = strides[i] - 1 if ctx.attr("ceil_mode") else 0
            o = (size - ksize[i] + pads[i] + extra) // strides[i] + 1
            if o <= 0:
                ctx.fail(f"X{list(x.shape)} is too small for ksize {ksize}: output extent {o} at spatial dim {i}")
            out.append(o)
    ctx.set_output("Out", VarInfo(_layout_shape(n, c, out, layout), x.dtype))


defop(
    "pool2d",
    inputs=["X"],
    outputs=["Out"],
    attrs=[
        A("pooling_type", K.STRING, "max", "max | avg"),
        A("ksize", K.INTS, doc="window (H, W)"),
        A("global_pooling", K.BOOL, False, "pool the whole spatial extent (ksize and paddings ignored)"),
        A("strides", K.INTS, [1, 1], "stride (H, W)"),
        A("paddings", K.INTS, [0, 0], "zero padding (H, W) on both sides, or (top, bottom, left, right)"),
        A("exclusive", K.BOOL, True, "avg pooling divides by the unpadded window size"),
        A("adaptive", K.BOOL, False, "ksize is the output size"),
        A("ceil_mode", K.BOOL, False, "round the output size up"),
        A("use_cudnn", K.BOOL, True, "Fluid's cuDNN switch (ignored)"),
        A("data_format", K.STRING, "NCHW", "layout of X and Out: NCHW or NHWC"),
    ],
    infer=_infer_pool2d,
    grad=DefaultGrad(),
    doc="2-D max or average pooling",
)


# --- normalisation and dropout --------------------------------------------------------------------
def _infer_batch_norm(ctx: InferContext) -> None:
    x = ctx.input("X")
    layout = ctx.attr("data_layout")
    if layout not in _LAYOUTS:
        ctx.fail(f"data_layout {layout!r} is unknown; expected one of {list(_LAYOUTS)}")
    if not 2 <= len(x.shape) <= 5:
        ctx.fail(f"X{list(x.shape)} must have rank 2 to 5")
    c = x.shape[-1] if layout == "NHWC" else x.shape[1]
    for slot in ("Scale", "Bias", "Mean", "Variance"):
        v = ctx.input(slot)
        if len(v.shape) != 1 or not dim_eq(v.shape[0], c):
            ctx.fail(f"{slot}{list(v.shape)} must be [C] with C={c}, the channels of X{list(x.shape)} ({layout})")
        c = merge_dim(c, v.shape[0])
    ctx.set_output("Y", VarInfo(x.shape, x.dtype))
    mean, var = ctx.input("Mean"), ctx.input("Variance")
    ctx.set_output("MeanOut", VarInfo((c,), mean.dtype))
    ctx.set_output("VarianceOut", VarInfo((c,), var.dtype))
    ctx.set_output("SavedMean", VarInfo((c,), mean.dtype))
    ctx.set_output("SavedVariance", VarInfo((c,), var.dtype))


defop(
    "batch_norm",
    inputs=["X", "Scale", "Bias", "Mean", "Variance"],
    outputs=["Y", "MeanOut", "VarianceOut", "SavedMean", "SavedVariance"],
    attrs=[
        A("momentum", K.FLOAT, 0.9, "running stats: new = momentum * old + (1 - momentum) * batch"),
        A("epsilon", K.FLOAT, 1e-5, "added to the variance"),
        A("is_test", K.BOOL, False, "normalise with the running stats"),
        A("data_layout", K.STRING, "NCHW", "where the channel dim is: NCHW (dim 1) or NHWC (last)"),
        A("use_global_stats", K.BOOL, False, "normalise with the running stats even in training"),
    ],
    infer=_infer_batch_norm,
    grad=DefaultGrad(wrt=("X", "Scale", "Bias"), out_grads=("Y",)),
    doc="Y = Scale * (X - mean) / sqrt(var + eps) + Bias per channel; MeanOut/VarianceOut update Mean/Variance",
)


def _infer_layer_norm(ctx: InferContext) -> None:
    x = ctx.input("X")
    rank = len(x.shape)
    axis = ctx.attr("begin_norm_axis")
    if rank < 2:
        ctx.fail(f"X{list(x.shape)} must have rank >= 2 (rows before begin_norm_axis, features from it)")
    if not 1 <= axis < rank:
        ctx.fail(f"begin_norm_axis={axis} must be in [1, {rank}) for X{list(x.shape)}")
    if ctx.attr("epsilon") < 0:
        ctx.fail(f"epsilon={ctx.attr('epsilon')} must be >= 0")
    left, right = prod(x.shape[:axis]), prod(x.shape[axis:])
    for slot in ("Scale", "Bias"):
        if ctx.has_input(slot):
            p = ctx.input(slot)
            if len(p.shape) != 1 or not dim_eq(p.shape[0], right):
                ctx.fail(f"{slot}{list(p.shape)} must be [{right}], the size of X{list(x.shape)} from "
                         f"begin_norm_axis={axis} on")
            if p.dtype != x.dtype:
                ctx.fail(f"{slot} has dtype {p.dtype}; expected the dtype of X, {x.dtype}")
    ctx.set_output("Y", VarInfo(x.shape, x.dtype))
    ctx.set_output("Mean", VarInfo((left,), x.dtype))
    ctx.set_output("Variance", VarInfo((left,), x.dtype))


defop(
    "layer_norm",
    inputs=["X", "Scale?", "Bias?"],
    outputs=["Y", "Mean?", "Variance?"],
    attrs=[
        A("epsilon", K.FLOAT, 1e-5, "added to the variance"),
        A("begin_norm_axis", K.INT, 1, "X is normalised over dims [begin_norm_axis, rank) as one row"),
    ],
    infer=_infer_layer_norm,
    grad=DefaultGrad(wrt=("X", "Scale", "Bias"), out_grads=("Y",)),
    doc="Y = Scale * (X - mean) / sqrt(var + eps) + Bias, mean and var over dims from begin_norm_axis on; "
        "Mean, Variance [left] the row statistics",
)


def _infer_dropout(ctx: InferContext) -> None:
    x = ctx.input("X")
    p = ctx.attr("dropout_prob")
    if not 0.0 <= p <= 1.0:
        ctx.fail(f"dropout_prob={p} must be in [0, 1]")
    impl = ctx.attr("dropout_implementation")
    if impl not in ("downgrade_in_infer", "upscale_in_train"):
        ctx.fail(f"dropout_implementation {impl!r} is unknown; expected 'downgrade_in_infer' or 'upscale_in_train'")
    ctx.set_output("Out", VarInfo(x.shape, x.dtype))
    ctx.set_output("Mask", VarInfo(x.shape, x.dtype))


def _infer_dropout_grad(ctx: InferContext) -> None:
    mask = ctx.input("Mask")
    dtype = ctx.input("Out@GRAD").dtype if ctx.has_input("Out@GRAD") else mask.dtype
    ctx.set_output("X@GRAD", VarInfo(mask.shape, dtype))


defop(
    "dropout",
    inputs=["X"],
    outputs=["Out", "Mask"],
    attrs=[
        A("dropout_prob", K.FLOAT, 0.5, "probability of zeroing an element"),
        A("is_test", K.BOOL, False, "inference mode: no elements are dropped"),
        A("fix_seed", K.BOOL, False, "use seed rather than a fresh draw each step"),
        A("seed", K.INT, 0, "random seed; 0 draws from the program's random_seed"),
        A("dropout_implementation", K.STRING, "downgrade_in_infer",
          "downgrade_in_infer (scale by 1-p at inference) | upscale_in_train (scale by 1/(1-p) in training)"),
    ],
    infer=_infer_dropout,
    grad=DefaultGrad(inputs=(), outputs=("Mask",), out_grads=("Out",), wrt=("X",)),
    grad_infer=_infer_dropout_grad,
    traits=["random"],
    doc="Out = X * Mask (scaled per dropout_implementation); Mask holds X's dtype, as in Fluid 1.5",
)


# --- metrics --------------------------------------------------------------------------------------
def _infer_top_k(ctx: InferContext) -> None:
    x = ctx.input("X")
    k = ctx.attr("k")
    if not x.shape:
        ctx.fail("X must have rank >= 1")
    if k < 1 or (x.shape[-1] >= 0 and k > x.shape[-1]):
        ctx.fail(f"k={k} must be in [1, {x.shape[-1]}] for X{list(x.shape)}")
    out = tuple(x.shape[:-1]) + (k,)
    ctx.set_output("Out", VarInfo(out, x.dtype))
    ctx.set_output("Indices", VarInfo(out, "int64"))


defop(
    "top_k",
    inputs=["X"],
    outputs=["Out", "Indices"],
    attrs=[A("k", K.INT, 1, "how many of the largest entries of the last dim")],
    infer=_infer_top_k,
    grad=NO_GRAD,
    doc="Out, Indices = the k largest entries of X's last dim and their positions",
)


def _infer_accuracy(ctx: InferContext) -> None:
    out, idx, label = ctx.input("Out"), ctx.input("Indices"), ctx.input("Label")
    check_same_shape(ctx, "Out", out.shape, "Indices", idx.shape)
    check_dtype(ctx, "Indices", idx.dtype, INT_DTYPES)
    check_dtype(ctx, "Label", label.dtype, INT_DTYPES)
    if len(idx.shape) != 2:
        ctx.fail(f"Indices{list(idx.shape)} must be [N, k]")
    if len(label.shape) != 2 or not dim_eq(label.shape[1], 1) or not dim_eq(label.shape[0], idx.shape[0]):
        ctx.fail(f"Label{list(label.shape)} must be [N, 1] with N of Indices{list(idx.shape)}")
    ctx.set_output("Accuracy", VarInfo((1,), "float32"))
    ctx.set_output("Correct", VarInfo((1,), "int32"))
    ctx.set_output("Total", VarInfo((1,), "int32"))


defop(
    "accuracy",
    inputs=["Out", "Indices", "Label"],
    outputs=["Accuracy", "Correct", "Total"],
    infer=_infer_accuracy,
    grad=NO_GRAD,
    doc="top-k accuracy: the fraction of rows whose Label is among Indices",
)


def _infer_auc(ctx: InferContext) -> None:
    pred, label = ctx.input("Predict"), ctx.input("Label")
    if len(pred.shape) != 2 or not (pred.shape[1] in (1, 2) or pred.shape[1] < 0):
        ctx.fail(f"Predict{list(pred.shape)} must be [N, 2] (or [N, 1]): binary classification only")
    if prod(label.shape) >= 0 and pred.shape[0] >= 0 and prod(label.shape) != pred.shape[0]:
        ctx.fail(f"Label{list(label.shape)} must hold one label per row of Predict{list(pred.shape)}")
    curve = ctx.attr("curve")
    if curve not in ("ROC", "PR"):
        ctx.fail(f"curve {curve!r} is unknown; expected 'ROC' or 'PR'")
    buckets = ctx.attr("num_thresholds") + 1
    for slot in ("StatPos", "StatNeg"):
        s = ctx.input(slot)
        if not s.shape or not dim_eq(s.shape[-1], buckets):
            ctx.fail(f"{slot}{list(s.shape)} must end in num_thresholds + 1 = {buckets}")
    ctx.set_output("AUC", VarInfo((1,), "float64"))
    ctx.set_output("StatPosOut", VarInfo(ctx.input("StatPos").shape, ctx.input("StatPos").dtype))
    ctx.set_output("StatNegOut", VarInfo(ctx.input("StatNeg").shape, ctx.input("StatNeg").dtype))


defop(
    "auc",
    inputs=["Predict", "Label", "StatPos", "StatNeg"],
    outputs=["AUC", "StatPosOut", "StatNegOut"],
    attrs=[
        A("curve", K.STRING, "ROC", "ROC | PR"),
        A("num_thresholds", K.INT, 4095, "thresholds; the stats have num_thresholds + 1 buckets"),
        A("slide_steps", K.INT, 1, "batches in the sliding window (0: since the start)"),
    ],
    infer=_infer_auc,
    grad=NO_GRAD,
    doc="area under the curve from bucketed positive/negative counts; StatPosOut/StatNegOut update the stats",
)


# --- LoD sequence ops (rows X [R, ...] with Length [N]; see runtime/lod.py) ------------------------------
def _infer_sequence_softmax(ctx: InferContext) -> None:
    x = ctx.input("X")
    _check_length(ctx)
    if not (len(x.shape) == 1 or (len(x.shape) == 2 and dim_eq(x.shape[1], 1))):
        ctx.fail(f"X{list(x.shape)} must be the rows of a LoD tensor of scores, [R, 1] or [R]")
    ctx.set_output("Out", VarInfo(x.shape, x.dtype))


defop(
    "sequence_softmax",
    inputs=["X", "Length"],
    outputs=["Out"],
    attrs=[A("use_cudnn", K.BOOL, False, "accepted for Fluid compatibility; no effect")],
    infer=_infer_sequence_softmax,
    grad=DefaultGrad(wrt=("X",)),
    doc="Out = softmax of the scores X [R, 1] within each sequence (rows split by Length); padding rows are 0",
)


def _infer_sequence_conv(ctx: InferContext) -> None:
    x, w = ctx.input("X"), ctx.input("Filter")
    _check_length(ctx)
    if len(x.shape) != 2:
        ctx.fail(f"X{list(x.shape)} must be the rows of a LoD tensor [R, D]")
    if ctx.attr("contextStride") != 1:
        ctx.fail(f"contextStride={ctx.attr('contextStride')} is not supported; only 1 (as Fluid)")
    if ctx.attr("paddingTrainable"):
        ctx.fail("paddingTrainable=True is not supported; windows are zero-padded at sequence ends")
    length = ctx.attr("contextLength")
    if length < 1:
        ctx.fail(f"contextLength={length} must be >= 1")
    if len(w.shape) != 2 or not dim_eq(w.shape[0], length * x.shape[1] if x.shape[1] >= 0 else -1):
        ctx.fail(f"Filter{list(w.shape)} must be [contextLength * D, num_filters] = [{length} * {x.shape[1]}, F]")
    if w.dtype != x.dtype:
        ctx.fail(f"Filter has dtype {w.dtype}; expected the dtype of X, {x.dtype}")
    ctx.set_output("Out", VarInfo((x.shape[0], w.shape[1]), x.dtype))


defop(
    "sequence_conv",
    inputs=["X", "Filter", "Length"],
    outputs=["Out"],
    attrs=[
        A("contextLength", K.INT, 3, "rows in each window"),
        A("contextStart", K.INT, 0, "offset of a window's first row from the current row (e.g. -1)"),
        A("contextStride", K.INT, 1, "only 1 is supported, as in Fluid"),
        A("paddingTrainable", K.BOOL, False, "only False (zero padding) is supported"),
    ],
    infer=_infer_sequence_conv,
    grad=DefaultGrad(wrt=("X", "Filter")),
    doc="Out[r] = concat(X[r + contextStart + j] for j < contextLength, zero outside r's sequence) @ Filter",
)
