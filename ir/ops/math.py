"""Op schemas: arithmetic, reductions, activations and tensor-creation ops (Fluid names and slots)."""
from __future__ import annotations

from ir.ops.registry import A, AttrKind as K, DefaultGrad, InferContext, NO_GRAD, VarInfo, defop
from ir.ops.shapes import broadcast_shape, dim_eq, prod, same_as


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
