"""``fluid.transpiler``: the transpiler API under Fluid 1.5's names. ``DistributeTranspiler`` here follows
Fluid's in-place rule for every call (``transpile`` rewrites the main and startup programs it is given, or
the default ones, into the trainer's programs; ``get_*`` still return every role's programs); the native
``transpiler.DistributeTranspiler`` rewrites only the default programs in place and leaves programs
passed explicitly untouched. Everything else is re-exported from ``transpiler``."""
from __future__ import annotations

from transpiler import DistributeTranspiler as _NativeDistributeTranspiler
from transpiler import (DistributeTranspilerConfig, HashName, PSDispatcher, RoundRobin, memory_optimize,
                        release_memory, slice_variable)

__all__ = ["DistributeTranspiler", "DistributeTranspilerConfig", "HashName", "PSDispatcher", "RoundRobin",
           "memory_optimize", "release_memory", "slice_variable"]


class DistributeTranspiler(_NativeDistributeTranspiler):
    """Fluid 1.5's ``DistributeTranspiler``: ``transpile`` rewrites the programs it is given in place."""

    in_place = True
