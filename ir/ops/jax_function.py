"""Op schemas of the JAX capture front end (``flotilla.jax``): the opaque ``jax_function`` op and
``load_value``, the startup op that initialises a captured parameter from the values it was given.

Invariants:
- ``jax_function`` carries one serialized ``jax.export`` (base64 text in ``exported``) of a run of JAX
  equations that has no Fluid counterpart. Its inputs ``X`` and outputs ``Out`` are the sub-function's
  arguments and results in order; ``out_dtypes``/``out_shapes`` record the export's ``out_avals`` at
  capture time (``-1`` for the batch dimension), which is all shape inference reads, so inspecting and
  transpiling a captured program never needs jax. ``primitives`` lists the JAX primitives inside, for
  people reading the program. Its gradient (``jax_function_grad``) is ``jax.vjp`` of the export.
- ``load_value`` is a host op: it reads the value of ``var_name`` from the archive ``file_path``
  (``runtime.io``'s format) and writes the part ``Out`` holds: all of it, the rows of a slice
  (``slice_offset``), or the strided rows of a distributed table's shard. It infers nothing (``Out``
  keeps its declared shape) and has no gradient.
"""
from __future__ import annotations

from ir.ops.registry import A, AttrKind as K, DefaultGrad, InferContext, NO_GRAD, REQUIRED, VarInfo, defop


def parse_shape(text: str) -> tuple[int, ...]:
    """``"-1,8"`` → ``(-1, 8)``; ``""`` is a scalar's shape."""
    return tuple(int(d) for d in text.split(",")) if text else ()


def format_shape(shape: tuple[int, ...]) -> str:
    return ",".join(str(int(d)) for d in shape)


def _infer_jax_function(ctx: InferContext) -> None:
    dtypes, shapes = ctx.attr("out_dtypes"), ctx.attr("out_shapes")
    if len(dtypes) != len(shapes):
        ctx.fail(f"out_dtypes has {len(dtypes)} entries but out_shapes has {len(shapes)}")
    if ctx.num_outputs("Out") != len(dtypes):
        ctx.fail(f"the export has {len(dtypes)} results but the op names {ctx.num_outputs('Out')} Out variables")
    ctx.set_output("Out", [VarInfo(parse_shape(s), d) for s, d in zip(shapes, dtypes)])


defop(
    "jax_function",
    inputs=["X*?"],
    outputs=["Out*"],
    attrs=[
        A("exported", K.STRING, REQUIRED, "base64 of the serialized jax.export of the sub-function (vjp order 1)"),
        A("primitives", K.STRINGS, [], "the JAX primitives inside, in order (for readers)"),
        A("out_dtypes", K.STRINGS, REQUIRED, "dtype of each Out, from the export's out_avals"),
        A("out_shapes", K.STRINGS, REQUIRED, "shape of each Out as 'd0,d1' (-1: batch), from the out_avals"),
        A("location", K.STRING, "", "file:line of the user's code the equations came from"),
    ],
    infer=_infer_jax_function,
    grad=DefaultGrad(inputs=("X",), out_grads=("Out",), wrt=("X",)),
    doc="Out = the exported JAX sub-function applied to X (a run of equations without a Fluid op)",
)

defop(
    "load_value",
    outputs=["Out"],
    attrs=[
        A("file_path", K.STRING, REQUIRED, "archive (runtime.io format) holding the value"),
        A("var_name", K.STRING, REQUIRED, "name of the whole value in the archive"),
    ],
    grad=NO_GRAD,
    traits=("host", "side_effect"),
    doc="Out = var_name from file_path, or the rows of it a slice or distributed-table shard Out holds",
)
