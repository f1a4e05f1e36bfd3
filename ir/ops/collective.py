"""Op schemas: the collective family (Fluid names, slots and attributes) used by the nccl2 mode.

Invariants:
- Every op here has the ``collective`` trait; ``gen_nccl_id`` also ``host`` and ``side_effect`` (it
  sets up the communicator across processes before training), while ``c_allreduce_sum`` and
  ``c_broadcast`` lower to XLA collectives inside the compiled step.
- ``NCCLID`` is a ``raw`` variable (shape ``[]``, ``ir.ops.shapes.RAW_INFO``); collectives keep
  their input's shape, dtype and type. No op here is differentiated (``NO_GRAD``).
"""
from __future__ import annotations

from ir.ops.registry import A, AttrKind as K, NO_GRAD, defop
from ir.ops.shapes import same_as, set_raw

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
    inputs=["X"],
    outputs=["Out"],
    attrs=[
        A("ring_id", K.INT, 0, "communicator (ring) to use"),
        A("use_calc_stream", K.BOOL, False, "run on the compute stream (no extra synchronisation)"),
    ],
    infer=same_as(),
    grad=NO_GRAD,
    traits=("collective",),
    doc="Out = the sum of X over every rank",
)

defop(
    "c_broadcast",
    inputs=["X"],
    outputs=["Out"],
    attrs=[
        A("ring_id", K.INT, 0, "communicator (ring) to use"),
        A("root", K.INT, 0, "rank whose X every rank receives"),
        A("use_calc_stream", K.BOOL, False, "run on the compute stream (no extra synchronisation)"),
    ],
    infer=same_as(),
    grad=NO_GRAD,
    traits=("collective",),
    doc="Out = X of rank root, on every rank",
)
