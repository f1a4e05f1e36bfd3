"""Op schemas: Deep Gradient Compression (Lin et al., ICLR 2018), as Fluid 1.6 split it into ops.

``DGCMomentumOptimizer`` appends, for every parameter it compresses, a ``dgc`` op (local: clipping,
momentum correction, accumulation, top-k selection, momentum factor masking), then one ``dgc_allreduce``
for all of them (the exchange: a dense mean before ``rampup_begin_step``, an allgather of the selected
(index, value) pairs decoded into a dense mean after), then a ``dgc_momentum`` per parameter (momentum
before ``rampup_begin_step``, plain SGD after: the momentum is already in what was sent).

Invariants:
- Shapes are static. ``EncodeIndex``/``EncodeValue`` of a parameter of ``numel`` elements hold
  ``k_max = dgc_k(numel, min(sparsity))`` entries (the first stage's k); at a sparser stage only the
  first ``k_stage`` are meaningful and only those travel (the exchange picks its per-stage branch).
- ``dgc_k`` and ``dgc_stage`` are the one definition of the schedule; the kernels import them.
- ``dgc`` is not an optimizer op (it updates no parameter); ``dgc_allreduce`` has the ``collective`` and
  ``replica_reduce`` traits; ``dgc_momentum`` the ``optimizer`` trait. Nothing here is differentiated.
"""
from __future__ import annotations

from typing import NoReturn

from ir.errors import IRError
from ir.ops.collective import RING_ID
from ir.ops.registry import A, AttrKind as K, InferContext, NO_GRAD, REQUIRED, VarInfo, defop
from ir.ops.shapes import dim_eq

SPARSITY_HINT = "e.g. sparsity=[0.75, 0.9375, 0.984375, 0.996, 0.999]"


def dgc_k(numel: int, sparsity: float) -> int:
    """Entries sent at ``sparsity`` (``numel * (1 - sparsity)`` rounded down, at least one; the
    product is first rounded to 6 decimals so 40 * (1 - 0.9) is 4, not 3)."""
    return max(1, min(numel, int(round(numel * (1.0 - sparsity), 6))))


def dgc_stage(step: int, begin: int, rampup_step: int, stages: int) -> int:
    """Index into the sparsity list at (0-based) ``step`` >= ``begin`` (Fluid's ``get_period_sparcity``):
    the list is walked through in ``rampup_step`` steps, then its last value holds."""
    return min(max((step - begin) * stages // max(1, rampup_step), 0), stages - 1)


def _fail(ctx: InferContext, message: str, hint: str = "") -> NoReturn:
    raise IRError(f"{ctx.op_type}: {message}", hint=hint or None)


def _numel(ctx: InferContext, slot: str, info: VarInfo) -> int:
    if any(d < 0 for d in info.shape):
        _fail(ctx, f"{slot} has shape {list(info.shape)} with an unknown extent; DGC needs a static size "
                 "(its encoded buffers have a fixed length)")
    n = 1
    for d in info.shape:
        n *= d
    return n


def _check_sparsity(ctx: InferContext) -> list[float]:
    sparsity = list(ctx.attr("sparsity"))
    if not sparsity or any(not 0.0 < s < 1.0 for s in sparsity):
        _fail(ctx, f"sparsity {sparsity} must be a non-empty list of values inside (0, 1)", hint=SPARSITY_HINT)
    return sparsity


def _check_like(ctx: InferContext, slot: str, info: VarInfo, ref: VarInfo, ref_slot: str) -> None:
    if info.type == "selected_rows":
        _fail(ctx, f"{slot} is selected_rows; DGC compresses dense gradients only",
                 hint="use is_sparse=False for this embedding, or another optimizer")
    if len(info.shape) != len(ref.shape) or not all(dim_eq(a, b) for a, b in zip(info.shape, ref.shape)):
        _fail(ctx, f"{slot} has shape {list(info.shape)} but {ref_slot} has shape {list(ref.shape)}; expected the "
                 "same shape", hint="U, V and Grad of one dgc op belong to one parameter")


def _check_one(ctx: InferContext, slot: str) -> None:
    info = ctx.input(slot)
    if not all(d == 1 or d < 0 for d in info.shape):
        _fail(ctx, f"{slot} has shape {list(info.shape)}, which is not one element; expected shape [1]",
                 hint="the DGC step counter is a one-element global variable")


def _infer_dgc(ctx: InferContext) -> None:
    sparsity = _check_sparsity(ctx)
    u, v, g = ctx.input("U"), ctx.input("V"), ctx.input("Grad")
    _check_like(ctx, "V", v, u, "U")
    _check_like(ctx, "Grad", g, u, "U")
    _check_one(ctx, "Step")
    k_max = dgc_k(_numel(ctx, "U", u), min(sparsity))
    ctx.set_output("UOut", VarInfo(u.shape, u.dtype, u.type))
    ctx.set_output("VOut", VarInfo(v.shape, v.dtype, v.type))
    ctx.set_output("EncodeIndex", VarInfo((k_max,), "int32", "lod_tensor"))
    ctx.set_output("EncodeValue", VarInfo((k_max,), v.dtype, "lod_tensor"))


_SCHEDULE_ATTRS = [
    A("sparsity", K.FLOATS, [0.999], "sparsity schedule (each in (0, 1)); the last value holds after rampup"),
    A("rampup_begin_step", K.INT, 0, "steps of dense allreduce + momentum before compression starts"),
    A("rampup_step", K.INT, 1, "steps over which the sparsity list is walked through"),
    A("nranks", K.INT, 0, "size of the trainer group (set by the dgc pass; 0: not recorded)"),
]

defop(
    "dgc",
    inputs=["U", "V", "Grad", "Step"],
    outputs=["UOut", "VOut", "EncodeIndex", "EncodeValue"],
    attrs=[
        A("m", K.FLOAT, REQUIRED, "momentum coefficient"),
        A("use_nesterov", K.BOOL, False, "Nesterov momentum correction"),
        *_SCHEDULE_ATTRS,
        A("local_grad_clip_norm", K.FLOAT, -1.0, "clip the local gradient to this norm * num_trainers^-0.5 "
          "(<= 0: off)"),
        A("num_trainers", K.INT, 0, "trainers the clip norm is scaled for (0: the size of the trainer group)"),
    ],
    infer=_infer_dgc,
    grad=NO_GRAD,
    doc="DGC encode: before rampup_begin_step U, V unchanged and nothing encoded; then clip Grad, U = m*U + Grad, "
        "V += U, select the top-k of |V| (k of the step's sparsity), encode (index, value), zero them in U and V",
)


def _infer_dgc_allreduce(ctx: InferContext) -> None:
    sparsity = _check_sparsity(ctx)
    grads, idx, vals = ctx.inputs("Grad"), ctx.inputs("EncodeIndex"), ctx.inputs("EncodeValue")
    if not (len(grads) == len(idx) == len(vals) == ctx.num_outputs("Out")):
        _fail(ctx, f"slots Grad, EncodeIndex, EncodeValue, Out hold {len(grads)}, {len(idx)}, {len(vals)}, "
                   f"{ctx.num_outputs('Out')} variables; expected one of each per compressed gradient",
              "the dgc pass wires one (Grad, EncodeIndex, EncodeValue) per dgc op")
    _check_one(ctx, "Step")
    for i, (g, ix, vx) in enumerate(zip(grads, idx, vals)):
        k_max = dgc_k(_numel(ctx, f"Grad[{i}]", g), min(sparsity))
        for slot, info in ((f"EncodeIndex[{i}]", ix), (f"EncodeValue[{i}]", vx)):
            if tuple(info.shape) != (k_max,):
                _fail(ctx, f"{slot} has shape {list(info.shape)}; expected [{k_max}] (k of sparsity {min(sparsity)} "
                         f"for Grad[{i}]'s {g.shape})", hint="feed it the matching dgc op's output")
    ctx.set_output("Out", grads)


defop(
    "dgc_allreduce",
    inputs=["Grad*", "EncodeIndex*", "EncodeValue*", "Step"],
    outputs=["Out*"],
    attrs=[*_SCHEDULE_ATTRS, RING_ID],
    infer=_infer_dgc_allreduce,
    grad=NO_GRAD,
    traits=("collective", "replica_reduce"),
    doc="before rampup_begin_step Out[i] = mean over ranks of Grad[i] (one fused allreduce); then one allgather "
        "of every gradient's first k_stage (index, value) pairs, Out[i] = their scatter-add / nranks",
)


def _infer_dgc_momentum(ctx: InferContext) -> None:
    p, g, u = ctx.input("Param"), ctx.input("Grad"), ctx.input("U")
    _check_like(ctx, "Grad", g, p, "Param")
    _check_like(ctx, "U", u, p, "Param")
    _check_one(ctx, "LearningRate")
    _check_one(ctx, "Step")
    ctx.set_output("ParamOut", VarInfo(p.shape, p.dtype, p.type))
    ctx.set_output("UOut", VarInfo(u.shape, u.dtype, u.type))


defop(
    "dgc_momentum",
    inputs=["Param", "Grad", "U", "LearningRate", "Step"],
    outputs=["ParamOut", "UOut"],
    attrs=[
        A("mu", K.FLOAT, REQUIRED, "momentum coefficient"),
        A("use_nesterov", K.BOOL, False, "Nesterov momentum (before rampup)"),
        A("rampup_begin_step", K.INT, 0, "steps of momentum before plain SGD on the decoded gradient"),
    ],
    infer=_infer_dgc_momentum,
    grad=NO_GRAD,
    traits=("optimizer",),
    doc="before rampup_begin_step U = mu*U + Grad, Param -= lr*U (Nesterov: lr*(Grad + mu*U)); then "
        "Param -= lr*Grad (Grad: the decoded mean of the trainers' sparse gradients)",
)

__all__ = ["dgc_k", "dgc_stage"]
