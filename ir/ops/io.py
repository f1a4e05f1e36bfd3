"""Op schemas: the io family (Fluid names, slots and attributes): saving, loading, deleting and
fake-initialising variables.

Invariants:
- Every op here has the traits ``host`` and ``side_effect``: it touches files or the scope, runs
  between compiled runs and is never removed or reordered. No op here is differentiated (``NO_GRAD``).
- ``load`` and ``load_combine`` infer nothing: the shape is in the file, so their outputs keep their
  declared shapes. ``fake_init`` gives ``Out`` its ``shape`` attribute (dtype float32, Fluid's
  default; a persistable output keeps its declared dtype, as inference never rewrites persistables).
"""
from __future__ import annotations

from ir.ops.registry import A, AttrKind as K, InferContext, NO_GRAD, REQUIRED, VarInfo, defop

IO_TRAITS = ("host", "side_effect")


defop(
    "delete_var",
    inputs=["X*"],
    grad=NO_GRAD,
    traits=IO_TRAITS,
    doc="drop every X from the scope (release_memory inserts it after last uses)",
)

defop(
    "save",
    inputs=["X"],
    attrs=[
        A("file_path", K.STRING, REQUIRED, "file to write X into"),
        A("overwrite", K.BOOL, True, "replace an existing file (else fail)"),
    ],
    grad=NO_GRAD,
    traits=IO_TRAITS,
    doc="write X to file_path",
)

defop(
    "load",
    outputs=["Out"],
    attrs=[A("file_path", K.STRING, REQUIRED, "file to read Out from")],
    grad=NO_GRAD,
    traits=IO_TRAITS,
    doc="read Out from file_path (its shape comes from the file)",
)


def _infer_fake_init(ctx: InferContext) -> None:
    ctx.set_output("Out", VarInfo(tuple(ctx.attr("shape")), "float32"))


defop(
    "fake_init",
    outputs=["Out"],
    attrs=[A("shape", K.INTS, REQUIRED, "shape of Out")],
    infer=_infer_fake_init,
    grad=NO_GRAD,
    traits=IO_TRAITS,
    doc="declare Out without initialising it (a pserver-resident table on the trainer)",
)

defop(
    "save_combine",
    inputs=["X*"],
    attrs=[
        A("file_path", K.STRING, REQUIRED, "file to write every X into, in order"),
        A("overwrite", K.BOOL, True, "replace an existing file (else fail)"),
    ],
    grad=NO_GRAD,
    traits=IO_TRAITS,
    doc="write every X into one file",
)

defop(
    "load_combine",
    outputs=["Out*"],
    attrs=[A("file_path", K.STRING, REQUIRED, "file to read every Out from, in order")],
    grad=NO_GRAD,
    traits=IO_TRAITS,
    doc="read every Out from one file written by save_combine",
)
