"""``memory_optimize`` and ``release_memory``: Fluid 1.5's memory transpiler API over the passes.

Both work **in place** on ``input_program``, as in Paddle: the one documented exception to "the
transpiler never modifies its inputs" (clone the program first to keep the original). Both return a
``MemoryReport`` (variables reused or deleted, peak bytes of temporaries by the liveness estimate
before and after); ``print_log=True`` prints it. A bad argument raises ``MemoryOptimizeError`` (a
``FlotillaError`` with code E660–E663) and leaves the program untouched.

Call ``memory_optimize(main, skip_grads=True)`` before ``DistributeTranspiler.transpile``: gradient
names stay intact for the send ops. See ``passes.memory_optimize`` and ``passes.release_memory`` for
what may be reused and what never is.
"""
from __future__ import annotations

import sys
from typing import Iterable

from ir.core import Program, Variable

from passes.memory_optimize import memory_optimize_program
from passes.memory_report import MemoryOptimizeError, MemoryReport
from passes.release_memory import release_memory_program

__all__ = ["MemoryOptimizeError", "MemoryReport", "memory_optimize", "release_memory"]


def memory_optimize(input_program: Program, skip_opt_set: Iterable[str | Variable] | None = None,
                    print_log: bool = False, level: int = 0, skip_grads: bool = False, *,
                    batch_size: int = 1) -> MemoryReport:
    """Rename later variables onto dead ones (level 0: same dtype and shape; level 1: same dtype and
    at least as large), in place. Never persistables, feeds, fetch targets (the loss, results no op
    reads), names in ``skip_opt_set``, variables read across blocks, RPC/collective operands, nor, with
    ``skip_grads=True``, parameter gradients. ``batch_size`` only sizes the -1 extents of the estimate."""
    if not isinstance(print_log, bool):
        raise MemoryOptimizeError(f"memory_optimize: print_log must be a bool, got {print_log!r}", code="E664")
    if not isinstance(skip_grads, bool):
        raise MemoryOptimizeError(f"memory_optimize: skip_grads must be a bool, got {skip_grads!r}", code="E664")
    report = memory_optimize_program(input_program, skip_opt_set, level, skip_grads, batch_size)
    if print_log:
        _print(report)
    return report


def release_memory(input_program: Program, skip_opt_set: Iterable[str | Variable] | None = None, *,
                   print_log: bool = False, batch_size: int = 1) -> MemoryReport:
    """Insert ``delete_var`` after each eligible variable's last use, in place (same exclusions as
    ``memory_optimize``); the Executor drops those values without splitting its compiled runs."""
    if not isinstance(print_log, bool):
        raise MemoryOptimizeError(f"release_memory: print_log must be a bool, got {print_log!r}", code="E664")
    report = release_memory_program(input_program, skip_opt_set, batch_size)
    if print_log:
        _print(report)
    return report


def _print(report: MemoryReport) -> None:
    sys.stdout.write(str(report) + "\n")
    sys.stdout.flush()
