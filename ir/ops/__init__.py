"""Op schemas, one family a module; importing this package registers every op type."""
from __future__ import annotations

from ir.ops import registry
from ir.ops.registry import (
    A,
    AttrDef,
    AttrKind,
    BlockRef,
    DefaultGrad,
    InferContext,
    NO_GRAD,
    OpDef,
    OpSpec,
    Slot,
    VarInfo,
    all_op_defs,
    defop,
    find_op_def,
    get_op_def,
    has_op,
    op_has_trait,
)
from ir.ops import math, nn, optimizer, rpc, collective, dgc, io, jax_function  # noqa: F401  (registration side effect)

__all__ = [
    "A", "AttrDef", "AttrKind", "BlockRef", "DefaultGrad", "InferContext", "NO_GRAD", "OpDef", "OpSpec", "Slot",
    "VarInfo", "all_op_defs", "defop", "find_op_def", "get_op_def", "has_op", "op_has_trait",
    "registry",
]
