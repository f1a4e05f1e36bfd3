"""Shape-inference building blocks shared by the op families.

Shapes use -1 for an unknown extent (the batch dimension); arithmetic on an unknown extent
stays unknown.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from ir.ops.registry import InferContext, VarInfo


def prod(dims: Sequence[int]) -> int:
    """Product of extents, -1 if any is unknown."""
    if any(d < 0 for d in dims):
        return -1
    return math.prod(dims)


def same_as(in_slot: str = "X", out_slot: str = "Out", dtype: str | None = None) -> Callable[[InferContext], None]:
    """Out has the shape (and dtype, unless given) of In."""

    def infer(ctx: InferContext) -> None:
        x = ctx.input(in_slot)
        ctx.set_output(out_slot, VarInfo(x.shape, dtype or x.dtype, x.type))

    return infer


def fixed(out_slot: str, shape: Sequence[int], dtype_attr: str | None = None, dtype: str = "float32") -> Callable[[InferContext], None]:
    def infer(ctx: InferContext) -> None:
        ctx.set_output(out_slot, VarInfo(tuple(shape), dtype_attr and ctx.attr(dtype_attr) or dtype))

    return infer


def dim_eq(a: int, b: int) -> bool:
    """Two extents agree when equal or either is unknown."""
    return a == b or a < 0 or b < 0


def broadcast_shape(ctx: InferContext, x: Sequence[int], y: Sequence[int], axis: int) -> tuple[int, ...]:
    """Fluid's elementwise broadcast: Y's dims match X's starting at ``axis`` (-1: aligned right)."""
    if len(y) > len(x):
        ctx.fail(f"Y has rank {len(y)} > X rank {len(x)}; Fluid broadcasts Y onto X")
    start = len(x) - len(y) if axis == -1 else axis
    if start < 0 or start + len(y) > len(x):
        ctx.fail(f"axis {axis} does not fit Y{list(y)} into X{list(x)}")
    for i, d in enumerate(y):
        if d != 1 and not dim_eq(x[start + i], d):
            ctx.fail(f"Y{list(y)} does not broadcast onto X{list(x)} at axis {start}")
    return tuple(x)


def dtype_str(code_or_name: object) -> str:
    """A dtype attribute value (Fluid uses enum ints; we store numpy names) as a numpy name."""
    return str(code_or_name)


# A variable of type ``raw`` holds no tensor (a control dependency, an NCCL id): by convention it is
# declared with shape [] and dtype float32, and shape inference sets exactly this on such outputs.
RAW_INFO = VarInfo((), "float32", "raw")


def set_raw(ctx: InferContext, slot: str) -> None:
    """Mark every variable of output ``slot`` (if any) as a ``raw`` variable (``RAW_INFO``)."""
    ctx.set_output(slot, RAW_INFO)


def normalize_axis(ctx: InferContext, axis: int, rank: int, what: str = "axis") -> int:
    """``axis`` in ``[-rank, rank)`` as a non-negative index; anything else fails naming the value."""
    if not -rank <= axis < rank:
        ctx.fail(f"{what}={axis} is out of range for rank {rank}; expected {-rank} <= {what} < {rank}")
    return axis % rank


def merge_dim(a: int, b: int) -> int:
    """The better-known of two extents that agree (``dim_eq``): a known one wins over -1."""
    return a if a >= 0 else b


def check_same_shape(ctx: InferContext, a_name: str, a: Sequence[int], b_name: str, b: Sequence[int]) -> tuple[int, ...]:
    """Fail unless shapes ``a`` and ``b`` agree dim by dim (-1 matches anything); the merged shape."""
    if len(a) != len(b) or not all(dim_eq(x, y) for x, y in zip(a, b)):
        ctx.fail(f"{a_name}{list(a)} and {b_name}{list(b)} must have the same shape")
    return tuple(merge_dim(x, y) for x, y in zip(a, b))


def check_dtype(ctx: InferContext, what: str, dtype: str, allowed: Sequence[str]) -> None:
    """Fail unless ``dtype`` is one of ``allowed``."""
    if dtype not in allowed:
        ctx.fail(f"{what} has dtype {dtype}; expected one of {list(allowed)}")
