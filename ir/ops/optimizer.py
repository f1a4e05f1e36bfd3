"""Op schemas: the optimizer family (Fluid 1.5 names, slots and attributes), plus ``clip`` and
``clip_by_norm``, which gradient clipping inserts before the optimizer ops.

Invariants:
- Every optimizer op has the ``optimizer`` trait: each ``*Out`` output aliases an input (``ParamOut``
  is ``Param``, ``MomentOut`` is ``Moment``…) and shape inference gives it that input's shape, dtype
  and type. None of them is differentiated (``NO_GRAD``).
- Inference checks what the update needs: ``Grad`` has ``Param``'s shape (a ``selected_rows`` grad
  holds a subset of the rows, so only its rank and row width are compared), every accumulator has
  ``Param``'s shape, and ``LearningRate`` (and Adam's ``Beta1Pow``/``Beta2Pow``) has one element.
  An extent of -1 matches anything.
- As in Fluid 1.5, ``adam`` does not update ``Beta1Pow``/``Beta2Pow``: the optimizer appends a
  ``scale`` op for each after the ``adam`` op.
"""
from __future__ import annotations

from typing import Callable, Mapping, NoReturn, Sequence

from ir.errors import IRError
from ir.ops.registry import A, AttrKind as K, DefaultGrad, InferContext, NO_GRAD, REQUIRED, VarInfo, defop
from ir.ops.shapes import dim_eq, same_as

OPTIMIZER_TRAITS = ("optimizer",)


def _fail(ctx: InferContext, message: str, hint: str) -> NoReturn:
    raise IRError(f"{ctx.op_type}: {message}", hint=hint)


def _check_grad(ctx: InferContext, param: VarInfo, grad: VarInfo) -> None:
    """``Grad`` has ``Param``'s shape; a selected_rows grad only its rank and row width."""
    sparse = grad.type == "selected_rows"
    same_rank = len(grad.shape) == len(param.shape)
    dims = zip(grad.shape[1:], param.shape[1:]) if sparse else zip(grad.shape, param.shape)
    if same_rank and all(dim_eq(g, p) for g, p in dims):
        return
    what = "selected_rows Grad (rows of Param)" if sparse else "Grad"
    expected = "rank and row width" if sparse else "shape"
    _fail(ctx, f"{what} has shape {list(grad.shape)} but Param has shape {list(param.shape)}; "
               f"expected the same {expected}",
          "pass the gradient of this parameter (op_role_var names the [param, grad] pair)")


def _check_same_shape(ctx: InferContext, slot: str, info: VarInfo, param: VarInfo) -> None:
    if len(info.shape) == len(param.shape) and all(dim_eq(a, b) for a, b in zip(info.shape, param.shape)):
        return
    _fail(ctx, f"accumulator {slot} has shape {list(info.shape)} but Param has shape {list(param.shape)}; "
               "expected the same shape",
          f"create {slot} with the parameter's shape (sliced like the parameter on a pserver)")


def _check_scalar(ctx: InferContext, slot: str, info: VarInfo) -> None:
    """One element: every known extent is 1 (an unknown extent cannot be judged)."""
    if all(d == 1 or d < 0 for d in info.shape):
        return
    _fail(ctx, f"{slot} has shape {list(info.shape)}, which is not one element; expected shape [1]",
          f"{slot} must be a one-element tensor, e.g. a global variable of shape [1]")


def _optimizer_infer(aliases: Mapping[str, str], accumulators: Sequence[str],
                     scalars: Sequence[str] = ("LearningRate",)) -> Callable[[InferContext], None]:
    """Check Param/Grad/accumulators/scalars, then give each ``out slot`` its aliased input's info.

    ``aliases`` maps output slot → the input slot it aliases; an absent dispensable input is skipped.
    """

    def infer(ctx: InferContext) -> None:
        param = ctx.input("Param")
        _check_grad(ctx, param, ctx.input("Grad"))
        for slot in accumulators:
            if ctx.has_input(slot):
                _check_same_shape(ctx, slot, ctx.input(slot), param)
        for slot in scalars:
            _check_scalar(ctx, slot, ctx.input(slot))
        for out_slot, in_slot in aliases.items():
            if not ctx.has_output(out_slot):
                continue
            if not ctx.has_input(in_slot):
                _fail(ctx, f"output {out_slot} is given but input {in_slot} is not",
                      f"give {in_slot} (the variable {out_slot} aliases) or drop {out_slot}")
            info = ctx.input(in_slot)
            ctx.set_output(out_slot, VarInfo(info.shape, info.dtype, info.type))

    return infer


defop(
    "sgd",
    inputs=["Param", "Grad", "LearningRate"],
    outputs=["ParamOut"],
    infer=_optimizer_infer({"ParamOut": "Param"}, ()),
    grad=NO_GRAD,
    traits=OPTIMIZER_TRAITS,
    doc="ParamOut = Param - LearningRate * Grad (dense or selected_rows Grad)",
)

defop(
    "momentum",
    inputs=["Param", "Grad", "Velocity", "LearningRate"],
    outputs=["ParamOut", "VelocityOut"],
    attrs=[
        A("mu", K.FLOAT, REQUIRED, "momentum coefficient"),
        A("use_nesterov", K.BOOL, False, "use Nesterov accelerated gradient"),
    ],
    infer=_optimizer_infer({"ParamOut": "Param", "VelocityOut": "Velocity"}, ("Velocity",)),
    grad=NO_GRAD,
    traits=OPTIMIZER_TRAITS,
    doc="VelocityOut = mu * Velocity + Grad; ParamOut = Param - LearningRate * VelocityOut (or Nesterov)",
)

defop(
    "adagrad",
    inputs=["Param", "Grad", "Moment", "LearningRate"],
    outputs=["ParamOut", "MomentOut"],
    attrs=[A("epsilon", K.FLOAT, 1.0e-6, "added to the denominator for numerical stability")],
    infer=_optimizer_infer({"ParamOut": "Param", "MomentOut": "Moment"}, ("Moment",)),
    grad=NO_GRAD,
    traits=OPTIMIZER_TRAITS,
    doc="MomentOut = Moment + Grad^2; ParamOut = Param - LearningRate * Grad / (sqrt(MomentOut) + epsilon)",
)

defop(
    "adam",
    inputs=["Param", "Grad", "LearningRate", "Moment1", "Moment2", "Beta1Pow", "Beta2Pow"],
    outputs=["ParamOut", "Moment1Out", "Moment2Out"],
    attrs=[
        A("beta1", K.FLOAT, 0.9, "exponential decay rate of the first moment"),
        A("beta2", K.FLOAT, 0.999, "exponential decay rate of the second moment"),
        A("epsilon", K.FLOAT, 1.0e-8, "added to the denominator for numerical stability"),
        A("lazy_mode", K.BOOL, False, "with a selected_rows Grad, update only the rows present"),
    ],
    infer=_optimizer_infer({"ParamOut": "Param", "Moment1Out": "Moment1", "Moment2Out": "Moment2"},
                           ("Moment1", "Moment2"), ("LearningRate", "Beta1Pow", "Beta2Pow")),
    grad=NO_GRAD,
    traits=OPTIMIZER_TRAITS,
    doc="Adam update; Beta1Pow/Beta2Pow are advanced by separate scale ops, as in Fluid 1.5",
)

_rmsprop_common = _optimizer_infer(
    {"ParamOut": "Param", "MomentOut": "Moment", "MeanSquareOut": "MeanSquare", "MeanGradOut": "MeanGrad"},
    ("Moment", "MeanSquare", "MeanGrad"))


def _infer_rmsprop(ctx: InferContext) -> None:
    if ctx.attr("centered") and not (ctx.has_input("MeanGrad") and ctx.has_output("MeanGradOut")):
        _fail(ctx, "centered=true but MeanGrad or MeanGradOut is missing",
              "centered RMSProp tracks the mean gradient: give MeanGrad and MeanGradOut (the same variable)")
    _rmsprop_common(ctx)


defop(
    "rmsprop",
    inputs=["Param", "MeanSquare", "MeanGrad?", "LearningRate", "Grad", "Moment"],
    outputs=["ParamOut", "MomentOut", "MeanSquareOut", "MeanGradOut?"],
    attrs=[
        A("epsilon", K.FLOAT, 1.0e-10, "added to the denominator for numerical stability"),
        A("decay", K.FLOAT, 0.9, "discounting factor of the mean square"),
        A("momentum", K.FLOAT, 0.0, "momentum coefficient"),
        A("centered", K.BOOL, False, "normalise by the variance (needs MeanGrad and MeanGradOut)"),
    ],
    infer=_infer_rmsprop,
    grad=NO_GRAD,
    traits=OPTIMIZER_TRAITS,
    doc="RMSProp update; centered mode also tracks the mean gradient (MeanGrad)",
)

defop(
    "decayed_adagrad",
    inputs=["Param", "Grad", "Moment", "LearningRate"],
    outputs=["ParamOut", "MomentOut"],
    attrs=[
        A("decay", K.FLOAT, 0.95, "discounting factor of the accumulated squares"),
        A("epsilon", K.FLOAT, 1.0e-6, "added to the denominator for numerical stability"),
    ],
    infer=_optimizer_infer({"ParamOut": "Param", "MomentOut": "Moment"}, ("Moment",)),
    grad=NO_GRAD,
    traits=OPTIMIZER_TRAITS,
    doc="MomentOut = decay * Moment + (1 - decay) * Grad^2; ParamOut = Param - lr * Grad / (sqrt(MomentOut) + eps)",
)

defop(
    "ftrl",
    inputs=["Param", "SquaredAccumulator", "LinearAccumulator", "Grad", "LearningRate"],
    outputs=["ParamOut", "SquaredAccumOut", "LinearAccumOut"],
    attrs=[
        A("l1", K.FLOAT, 0.0, "L1 regularisation strength"),
        A("l2", K.FLOAT, 0.0, "L2 regularisation strength"),
        A("lr_power", K.FLOAT, -0.5, "learning-rate power"),
    ],
    infer=_optimizer_infer({"ParamOut": "Param", "SquaredAccumOut": "SquaredAccumulator",
                            "LinearAccumOut": "LinearAccumulator"},
                           ("SquaredAccumulator", "LinearAccumulator")),
    grad=NO_GRAD,
    traits=OPTIMIZER_TRAITS,
    doc="FTRL-proximal update",
)


defop(
    "clip",
    inputs=["X"],
    outputs=["Out"],
    attrs=[
        A("min", K.FLOAT, REQUIRED, "lower bound"),
        A("max", K.FLOAT, REQUIRED, "upper bound"),
    ],
    infer=same_as(),
    grad=DefaultGrad(),
    doc="Out = min(max(X, min), max) elementwise (X dense or selected_rows)",
)

defop(
    "clip_by_norm",
    inputs=["X"],
    outputs=["Out"],
    attrs=[A("max_norm", K.FLOAT, REQUIRED, "largest allowed L2 norm of X")],
    infer=same_as(),
    grad=NO_GRAD,
    doc="Out = X * max_norm / max(norm(X), max_norm)",
)
