"""Op schemas: arithmetic, reductions, activations, comparisons and tensor-creation ops.

Op types, slot names, attribute names and defaults follow Paddle Fluid 1.5. dtype attributes hold
numpy dtype names ("float32"). Random ops carry the ``random`` trait and an int ``seed`` attribute
(0: draw from the program's ``random_seed``). Every shape inference writes every output it is given,
uses -1 for an unknown extent, and fails through ``ctx.fail`` naming what is incompatible.
"""
from __future__ import annotations

from typing import Callable

from ir.ops.registry import (
    A, AttrKind as K, DTYPES, DefaultGrad, FLOAT_DTYPES, InferContext, NO_GRAD, VarInfo, defop,
)
from ir.ops.shapes import (
    broadcast_shape, check_dtype, check_same_shape, dim_eq, merge_dim, normalize_axis, prod, same_as,
)


def _infer_mul(ctx: InferContext) -> None:
    x, y = ctx.input("X"), ctx.input("Y")
    xn, yn = ctx.attr("x_num_col_dims"), ctx.attr("y_num_col_dims")
    if not (0 < xn < len(x.shape) + 1 and 0 < yn < len(y.shape)):
        ctx.fail(f"x_num_col_dims={xn}, y_num_col_dims={yn} do not fit X{list(x.shape)}, Y{list(y.shape)}")
    k_x, k_y = prod(x.shape[xn:]), prod(y.shape[:yn])
    if not dim_eq(k_x, k_y):
        ctx.fail(f"X{list(x.shape)} flattened at {xn} has width {k_x} but Y{list(y.shape)} flattened at {yn} has height {k_y}")
    ctx.set_output("Out", VarInfo(tuple(x.shape[:xn]) + tuple(y.shape[yn:]), x.dtype))


defop(
    "mul",
    inputs=["X", "Y"],
    outputs=["Out"],
    attrs=[
        A("x_num_col_dims", K.INT, 1, "X is flattened to a matrix: dims [0, x_num_col_dims) become rows"),
        A("y_num_col_dims", K.INT, 1, "Y is flattened to a matrix: dims [0, y_num_col_dims) become rows"),
    ],
    infer=_infer_mul,
    grad=DefaultGrad(),
    doc="matrix product of X and Y, each flattened to 2-D",
)


def _infer_elementwise(ctx: InferContext) -> None:
    x, y = ctx.input("X"), ctx.input("Y")
    if x.dtype != y.dtype:
        ctx.fail(f"X dtype {x.dtype} differs from Y dtype {y.dtype}")
    ctx.set_output("Out", VarInfo(broadcast_shape(ctx, x.shape, y.shape, ctx.attr("axis")), x.dtype))


for _kind in ("add", "sub", "mul", "div", "max", "min", "pow"):
    defop(
        f"elementwise_{_kind}",
        inputs=["X", "Y"],
        outputs=["Out"],
        attrs=[A("axis", K.INT, -1, "dimension of X where Y's dims start (-1: align right)")],
        infer=_infer_elementwise,
        grad=DefaultGrad(),
        doc=f"elementwise {_kind} of X and Y, Y broadcast onto X",
    )


defop(
    "mean",
    inputs=["X"],
    outputs=["Out"],
    infer=lambda ctx: ctx.set_output("Out", VarInfo((1,), ctx.input("X").dtype)),
    grad=DefaultGrad(),
    doc="mean of all elements, shape [1]",
)

defop(
    "fill_constant",
    outputs=["Out"],
    attrs=[
        A("shape", K.INTS, doc="shape of Out"),
        A("dtype", K.STRING, "float32", "numpy dtype name of Out"),
        A("value", K.FLOAT, 0.0, "the constant"),
        A("force_cpu", K.BOOL, False, "keep Out on the host"),
    ],
    infer=lambda ctx: ctx.set_output("Out", VarInfo(tuple(ctx.attr("shape")), ctx.attr("dtype"))),
    grad=NO_GRAD,
    doc="Out = value, of the given shape and dtype",
)

defop("square", inputs=["X"], outputs=["Out"], infer=same_as(), grad=DefaultGrad(), doc="Out = X * X")


# --- matrix products ------------------------------------------------------------------------------
def _infer_matmul(ctx: InferContext) -> None:
    x, y = ctx.input("X"), ctx.input("Y")
    if x.dtype != y.dtype:
        ctx.fail(f"X dtype {x.dtype} differs from Y dtype {y.dtype}")
    xs, ys = list(x.shape), list(y.shape)
    if not xs or not ys:
        ctx.fail(f"X{xs} and Y{ys} must have rank >= 1")
    tx, ty = ctx.attr("transpose_X"), ctx.attr("transpose_Y")
    # A rank-1 operand is a vector whatever its transpose flag (Fluid's GetMatDim does the same).
    if len(xs) == 1:
        m, k_x, x_batch = 1, xs[0], []
    else:
        m, k_x = (xs[-1], xs[-2]) if tx else (xs[-2], xs[-1])
        x_batch = xs[:-2]
    if len(ys) == 1:
        k_y, n, y_batch = ys[0], 1, []
    else:
        k_y, n = (ys[-1], ys[-2]) if ty else (ys[-2], ys[-1])
        y_batch = ys[:-2]
    if not dim_eq(k_x, k_y):
        ctx.fail(f"X{xs} (transpose_X={tx}) has width {k_x} but Y{ys} (transpose_Y={ty}) has height {k_y}")
    if x_batch and y_batch:
        if len(x_batch) != len(y_batch) or not all(dim_eq(a, b) for a, b in zip(x_batch, y_batch)):
            ctx.fail(f"batch dims of X{xs} and Y{ys} differ: {x_batch} vs {y_batch}")
        batch = [merge_dim(a, b) for a, b in zip(x_batch, y_batch)]
    else:
        batch = x_batch or y_batch
    out = batch + ([m] if len(xs) > 1 else []) + ([n] if len(ys) > 1 else [])
    ctx.set_output("Out", VarInfo(tuple(out) or (1,), x.dtype))


defop(
    "matmul",
    inputs=["X", "Y"],
    outputs=["Out"],
    attrs=[
        A("transpose_X", K.BOOL, False, "transpose the last two dims of X first"),
        A("transpose_Y", K.BOOL, False, "transpose the last two dims of Y first"),
        A("alpha", K.FLOAT, 1.0, "Out is scaled by alpha"),
    ],
    infer=_infer_matmul,
    grad=DefaultGrad(),
    doc="batched matrix product alpha * op(X) @ op(Y); rank-1 operands are vectors",
)


# --- scale and sum --------------------------------------------------------------------------------
defop(
    "scale",
    inputs=["X"],
    outputs=["Out"],
    attrs=[
        A("scale", K.FLOAT, 1.0, "the multiplier"),
        A("bias", K.FLOAT, 0.0, "the offset"),
        A("bias_after_scale", K.BOOL, True, "Out = X*scale + bias if true, else (X + bias)*scale"),
    ],
    infer=same_as(),
    grad=DefaultGrad(),
    doc="Out = scale * X + bias (on dense or selected-rows X; Out has X's type)",
)


def _infer_sum(ctx: InferContext) -> None:
    xs = ctx.inputs("X")
    if not xs:
        ctx.fail("needs at least one input in slot X")
    first = xs[0]
    shape = first.shape
    for i, x in enumerate(xs[1:], start=1):
        if x.dtype != first.dtype:
            ctx.fail(f"X[{i}] dtype {x.dtype} differs from X[0] dtype {first.dtype}")
        if x.type == "selected_rows" and first.type != "selected_rows":
            # Rows added into a dense X[0]: only the row width must agree (the height names the table the
            # rows index, of which X[0] may be a distributed shard whose rows the runtime maps).
            check_same_shape(ctx, "X[0] rows", tuple(shape[1:]), f"X[{i}] rows", tuple(x.shape[1:]))
            continue
        shape = check_same_shape(ctx, "X[0]", shape, f"X[{i}]", x.shape)
    ctx.set_output("Out", VarInfo(shape, first.dtype, first.type))


defop(
    "sum",
    inputs=["X*"],
    outputs=["Out"],
    attrs=[A("use_mkldnn", K.BOOL, False, "Fluid's MKL-DNN switch (ignored)")],
    infer=_infer_sum,
    grad=DefaultGrad(),
    doc="Out = sum of the X; accumulates gradients; Out has the type of X[0] (dense or selected rows)",
)


# --- reductions -----------------------------------------------------------------------------------
def _infer_reduce(ctx: InferContext) -> None:
    x = ctx.input("X")
    rank = len(x.shape)
    keep = ctx.attr("keep_dim")
    if ctx.attr("reduce_all"):
        out = (1,) * rank if keep else ()
    else:
        dims = {normalize_axis(ctx, d, rank, "dim") for d in ctx.attr("dim")}
        out = tuple((1 if i in dims else d) for i, d in enumerate(x.shape) if keep or i not in dims)
    ctx.set_output("Out", VarInfo(out or (1,), x.dtype))


for _kind in ("sum", "mean", "max"):
    defop(
        f"reduce_{_kind}",
        inputs=["X"],
        outputs=["Out"],
        attrs=[
            A("dim", K.INTS, [0], "dimensions to reduce (negative counts from the end)"),
            A("keep_dim", K.BOOL, False, "keep reduced dimensions with extent 1"),
            A("reduce_all", K.BOOL, False, "reduce every dimension (Out is [1] unless keep_dim)"),
        ],
        infer=_infer_reduce,
        grad=DefaultGrad(),
        doc=f"reduce_{_kind} of X over dim",
    )


# --- unary elementwise ----------------------------------------------------------------------------
_UNARY = {
    "sqrt": "Out = sqrt(X)",
    "exp": "Out = exp(X)",
    "log": "Out = ln(X)",
    "abs": "Out = |X|",
    "relu": "Out = max(X, 0)",
    "sigmoid": "Out = 1 / (1 + exp(-X))",
    "tanh": "Out = tanh(X)",
    "softsign": "Out = X / (1 + |X|)",
}
for _kind, _doc in _UNARY.items():
    defop(_kind, inputs=["X"], outputs=["Out"], infer=same_as(), grad=DefaultGrad(), doc=_doc)

defop("floor", inputs=["X"], outputs=["Out"], infer=same_as(), grad=NO_GRAD,
      doc="Out = floor(X); its gradient is zero almost everywhere, so it has none")


def _infer_softmax(ctx: InferContext) -> None:
    x = ctx.input("X")
    normalize_axis(ctx, ctx.attr("axis"), len(x.shape))
    ctx.set_output("Out", VarInfo(x.shape, x.dtype))


defop(
    "softmax",
    inputs=["X"],
    outputs=["Out"],
    attrs=[
        A("axis", K.INT, -1, "the dimension softmax normalises over"),
        A("use_cudnn", K.BOOL, False, "Fluid's cuDNN switch (ignored)"),
    ],
    infer=_infer_softmax,
    grad=DefaultGrad(),
    doc="Out = exp(X) / sum(exp(X)) along axis",
)


def _infer_cast(ctx: InferContext) -> None:
    x = ctx.input("X")
    in_dtype, out_dtype = ctx.attr("in_dtype"), ctx.attr("out_dtype")
    check_dtype(ctx, "attr out_dtype", out_dtype, DTYPES)
    check_dtype(ctx, "attr in_dtype", in_dtype, DTYPES)
    if in_dtype != x.dtype:
        ctx.fail(f"attr in_dtype={in_dtype} but X has dtype {x.dtype}")
    ctx.set_output("Out", VarInfo(x.shape, out_dtype))


defop(
    "cast",
    inputs=["X"],
    outputs=["Out"],
    attrs=[
        A("in_dtype", K.STRING, doc="numpy dtype name of X"),
        A("out_dtype", K.STRING, doc="numpy dtype name of Out"),
    ],
    infer=_infer_cast,
    grad=DefaultGrad(),
    doc="Out = X converted to out_dtype",
)


# --- tensor creation ------------------------------------------------------------------------------
def _infer_fill_batch_like(ctx: InferContext) -> None:
    x = ctx.input("Input")
    shape = list(ctx.attr("shape"))
    dtype = ctx.attr("dtype")
    check_dtype(ctx, "attr dtype", dtype, DTYPES)
    i, o = ctx.attr("input_dim_idx"), ctx.attr("output_dim_idx")
    if not 0 <= i < len(x.shape):
        ctx.fail(f"input_dim_idx={i} is out of range for Input{list(x.shape)}")
    if not 0 <= o < len(shape):
        ctx.fail(f"output_dim_idx={o} is out of range for shape {shape}")
    shape[o] = x.shape[i]
    ctx.set_output("Out", VarInfo(tuple(shape), dtype))


defop(
    "fill_constant_batch_size_like",
    inputs=["Input"],
    outputs=["Out"],
    attrs=[
        A("shape", K.INTS, doc="shape of Out; dim output_dim_idx is replaced by the batch size"),
        A("dtype", K.STRING, "float32", "numpy dtype name of Out"),
        A("value", K.FLOAT, 0.0, "the constant"),
        A("input_dim_idx", K.INT, 0, "dimension of Input that holds the batch size"),
        A("output_dim_idx", K.INT, 0, "dimension of Out that gets the batch size"),
    ],
    infer=_infer_fill_batch_like,
    grad=NO_GRAD,
    doc="Out = value with shape, its batch dimension taken from Input",
)

defop("fill_zeros_like", inputs=["X"], outputs=["Out"], infer=same_as(), grad=NO_GRAD,
      doc="Out = zeros with the shape and dtype of X")


def _random_infer(check: Callable[[InferContext], None]) -> Callable[[InferContext], None]:
    def infer(ctx: InferContext) -> None:
        dtype = ctx.attr("dtype")
        check_dtype(ctx, "attr dtype", dtype, FLOAT_DTYPES)
        shape = tuple(ctx.attr("shape"))
        if any(d < -1 for d in shape):
            ctx.fail(f"shape {list(shape)} has an extent below -1")
        check(ctx)
        ctx.set_output("Out", VarInfo(shape, dtype))

    return infer


def _check_uniform(ctx: InferContext) -> None:
    if not ctx.attr("min") < ctx.attr("max"):
        ctx.fail(f"min={ctx.attr('min')} must be less than max={ctx.attr('max')}")


def _check_gaussian(ctx: InferContext) -> None:
    if ctx.attr("std") < 0:
        ctx.fail(f"std={ctx.attr('std')} must be >= 0")


_SEED = A("seed", K.INT, 0, "random seed; 0 draws from the program's random_seed")
_RANDOM_SHAPE = A("shape", K.INTS, doc="shape of Out")
_RANDOM_DTYPE = A("dtype", K.STRING, "float32", "numpy dtype name of Out (a float type)")

defop(
    "uniform_random",
    outputs=["Out"],
    attrs=[_RANDOM_SHAPE, A("min", K.FLOAT, -1.0, "lower bound"), A("max", K.FLOAT, 1.0, "upper bound"),
           _SEED, _RANDOM_DTYPE],
    infer=_random_infer(_check_uniform),
    grad=NO_GRAD,
    traits=["random"],
    doc="Out ~ U[min, max)",
)
for _kind, _doc in (("gaussian_random", "Out ~ N(mean, std^2)"),
                    ("truncated_gaussian_random", "Out ~ N(mean, std^2) truncated to mean +- 2 std")):
    defop(
        _kind,
        outputs=["Out"],
        attrs=[_RANDOM_SHAPE, A("mean", K.FLOAT, 0.0, "mean"), A("std", K.FLOAT, 1.0, "standard deviation"),
               _SEED, _RANDOM_DTYPE],
        infer=_random_infer(_check_gaussian),
        grad=NO_GRAD,
        traits=["random"],
        doc=_doc,
    )


# --- copies and counters --------------------------------------------------------------------------
defop("assign", inputs=["X"], outputs=["Out"], infer=same_as(), grad=DefaultGrad(),
      doc="Out = X (a copy; dense or selected rows)")


def _infer_barrier(ctx: InferContext) -> None:
    xs = ctx.inputs("X")
    if ctx.num_outputs("Out") != len(xs):
        ctx.fail(f"slot X has {len(xs)} variables but slot Out has {ctx.num_outputs('Out')}; expected one each")
    ctx.set_output("Out", xs)


defop("recompute_barrier", inputs=["X*", "Dep*?"], outputs=["Out*"], infer=_infer_barrier, grad=NO_GRAD,
      doc="Out[i] = X[i], computed only once every Dep is (XLA optimization barrier): the start of a "
          "recomputed segment, so the compiler neither merges it with the forward pass nor hoists it")


def _infer_increment(ctx: InferContext) -> None:
    x = ctx.input("X")
    if prod(x.shape) not in (-1, 1):
        ctx.fail(f"X{list(x.shape)} must hold exactly one element")
    ctx.set_output("Out", VarInfo(x.shape, x.dtype))


defop(
    "increment",
    inputs=["X"],
    outputs=["Out"],
    attrs=[A("step", K.FLOAT, 1.0, "the amount added")],
    infer=_infer_increment,
    grad=NO_GRAD,
    doc="Out = X + step, X a one-element counter",
)


# --- comparisons and logic ------------------------------------------------------------------------
def _infer_compare(ctx: InferContext) -> None:
    x, y = ctx.input("X"), ctx.input("Y")
    if x.dtype != y.dtype:
        ctx.fail(f"X dtype {x.dtype} differs from Y dtype {y.dtype}")
    ctx.set_output("Out", VarInfo(broadcast_shape(ctx, x.shape, y.shape, ctx.attr("axis")), "bool"))


for _kind, _sym in (("less_than", "<"), ("less_equal", "<="), ("greater_than", ">"), ("greater_equal", ">="),
                    ("equal", "=="), ("not_equal", "!=")):
    defop(
        _kind,
        inputs=["X", "Y"],
        outputs=["Out"],
        attrs=[
            A("axis", K.INT, -1, "dimension of X where Y's dims start (-1: align right)"),
            A("force_cpu", K.BOOL, False, "keep Out on the host"),
        ],
        infer=_infer_compare,
        grad=NO_GRAD,
        doc=f"Out = X {_sym} Y elementwise (bool), Y broadcast onto X",
    )


def _infer_logical_binary(ctx: InferContext) -> None:
    x, y = ctx.input("X"), ctx.input("Y")
    check_dtype(ctx, "X", x.dtype, ("bool",))
    check_dtype(ctx, "Y", y.dtype, ("bool",))
    ctx.set_output("Out", VarInfo(check_same_shape(ctx, "X", x.shape, "Y", y.shape), "bool"))


def _infer_logical_not(ctx: InferContext) -> None:
    x = ctx.input("X")
    check_dtype(ctx, "X", x.dtype, ("bool",))
    ctx.set_output("Out", VarInfo(x.shape, "bool"))


for _kind in ("and", "or"):
    defop(f"logical_{_kind}", inputs=["X", "Y"], outputs=["Out"], infer=_infer_logical_binary, grad=NO_GRAD,
          doc=f"Out = X {_kind} Y elementwise, bool tensors of one shape")
defop("logical_not", inputs=["X"], outputs=["Out"], infer=_infer_logical_not, grad=NO_GRAD,
      doc="Out = not X elementwise, a bool tensor")


def _infer_where(ctx: InferContext) -> None:
    c, x, y = ctx.input("Condition"), ctx.input("X"), ctx.input("Y")
    check_dtype(ctx, "Condition", c.dtype, ("bool",))
    if x.dtype != y.dtype:
        ctx.fail(f"X dtype {x.dtype} differs from Y dtype {y.dtype}")
    shape = check_same_shape(ctx, "X", x.shape, "Y", y.shape)
    shape = check_same_shape(ctx, "Condition", c.shape, "X", shape)
    ctx.set_output("Out", VarInfo(shape, x.dtype))


defop(
    "where",
    inputs=["Condition", "X", "Y"],
    outputs=["Out"],
    infer=_infer_where,
    grad=DefaultGrad(wrt=("X", "Y")),
    doc="Out = X where Condition else Y, elementwise over one shape",
)


# --- transformer activations ----------------------------------------------------------------------
defop(
    "gelu",
    inputs=["X"],
    outputs=["Out"],
    infer=same_as(),
    grad=DefaultGrad(),
    doc="Out = 0.5 * X * (1 + erf(X / sqrt(2))), the exact (erf) form of GELU",
)
