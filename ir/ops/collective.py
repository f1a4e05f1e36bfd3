"""Op schemas: the collective family (Fluid names, slots and attributes) used by the nccl2 mode.

Invariants:
- Every op here has the ``collective`` trait; ``gen_nccl_id`` also ``host`` and ``side_effect`` (it
  sets up the communicator across processes before training), while ``c_allreduce_sum`` and
  ``c_broadcast`` lower to XLA collectives inside the compiled step. ``c_allreduce_sum`` and
  ``c_local_sgd`` are also ``replica_reduce`` (they keep the replicas' training in step; ``c_broadcast``
  only copies the startup parameters from root). ``c_allgather`` (Fluid 1.6) concatenates every rank's
  ``X`` along the first dimension; DGC's exchange (``ir.ops.dgc``) uses the same lowering.
- ``NCCLID`` is a ``raw`` variable (shape ``[]``, ``ir.ops.shapes.RAW_INFO``); collectives keep
  their input's shape, dtype and type. No op here is differentiated (``NO_GRAD``).
- ``c_allreduce_sum`` takes several variables at once (a fused bucket: one collective for all of
  them); ``Out[i]`` has the shape of ``X[i]``. ``nranks`` on a collective is the group size the program
  was transpiled for (0: not recorded); the runtime refuses to run it on a group of another size.
"""
from __future__ import annotations

from ir.ops.registry import A, AttrKind as K, InferContext, NO_GRAD, VarInfo, defop
from ir.ops.shapes import same_as, set_raw

# The attributes every communicator op shares (Fluid's c_* ops).
RING_ID = A("ring_id", K.INT, 0, "communicator (ring) to use")
CALC_STREAM = A("use_calc_stream", K.BOOL, False, "run on the compute stream (no extra synchronisation)")
NRANKS = A("nranks", K.INT, 0, "ranks the program was transpiled for (0: not recorded)")


def _infer_each(ctx: InferContext) -> None:
    """``Out[i]`` is shaped and typed as ``X[i]``."""
    xs = ctx.inputs("X")
    if ctx.num_outputs("Out") != len(xs):
        ctx.fail(f"slot X has {len(xs)} variables but slot Out has {ctx.num_outputs('Out')}; expected one "
                 "output per input")
    ctx.set_output("Out", xs)


def _infer_local_sgd(ctx: InferContext) -> None:
    params = ctx.inputs("Param")
    if ctx.num_outputs("ParamOut") != len(params):
        ctx.fail(f"slot Param has {len(params)} variables but slot ParamOut has {ctx.num_outputs('ParamOut')}")
    ctx.set_output("ParamOut", params)
    ctx.set_output("StepOut", ctx.input("Step"))

defop(
    "gen_nccl_id",
    outputs=["NCCLID"],
    attrs=[
        A("trainer_id", K.INT, 0, "rank of this trainer (0 generates the id)"),
        A("endpoint", K.STRING, "", "ip:port of this trainer"),
        A("other_endpoints", K.STRINGS, [], "ip:port of every other trainer (Fluid 1.5's endpoint_list)"),
        A("nccl_comm_num", K.INT, 1, "number of communicators (rings)"),
    ],
    infer=lambda ctx: set_raw(ctx, "NCCLID"),
    grad=NO_GRAD,
    traits=("collective", "host", "side_effect"),
    doc="agree on a communicator id across trainers (initialises jax.distributed at run time)",
)

defop(
    "c_allreduce_sum",
    inputs=["X*"],
    outputs=["Out*"],
    attrs=[
        RING_ID,
        CALC_STREAM,
        NRANKS,
    ],
    infer=_infer_each,
    grad=NO_GRAD,
    traits=("collective", "replica_reduce"),
    doc="Out[i] = the sum of X[i] over every rank (several X: one fused collective; selected rows gather)",
)

defop(
    "c_broadcast",
    inputs=["X"],
    outputs=["Out"],
    attrs=[
        RING_ID,
        A("root", K.INT, 0, "rank whose X every rank receives"),
        CALC_STREAM,
        NRANKS,
    ],
    infer=same_as(),
    grad=NO_GRAD,
    traits=("collective",),
    doc="Out = X of rank root, on every rank",
)

defop(
    "c_local_sgd",
    inputs=["Param*", "Step"],
    outputs=["ParamOut*", "StepOut"],
    attrs=[
        A("k_steps", K.INT, 1, "average the parameters every k_steps calls"),
        RING_ID,
        NRANKS,
    ],
    infer=_infer_local_sgd,
    grad=NO_GRAD,
    traits=("collective", "replica_reduce"),
    doc="StepOut = Step + 1; every k_steps-th call ParamOut = the mean of Param over every rank, else Param",
)


def _infer_allgather(ctx: InferContext) -> None:
    x = ctx.input("X")
    nranks = int(ctx.attr("nranks"))
    if not x.shape:
        ctx.fail("X is a scalar; c_allgather concatenates along the first dimension, so X needs rank >= 1")
    first = x.shape[0] * nranks if nranks > 0 and x.shape[0] >= 0 else -1
    ctx.set_output("Out", VarInfo((first, *x.shape[1:]), x.dtype, x.type))


defop(
    "c_allgather",
    inputs=["X"],
    outputs=["Out"],
    attrs=[
        RING_ID,
        CALC_STREAM,
        A("nranks", K.INT, 0, "ranks the program was transpiled for (0: not recorded, Out's first extent -1)"),
    ],
    infer=_infer_allgather,
    grad=NO_GRAD,
    traits=("collective",),
    doc="Out = the X of every rank concatenated along the first dimension, in rank order",
)
