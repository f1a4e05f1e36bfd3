"""What the memory rewrites (``memory_optimize``, ``release_memory``) share: their argument checks, their
error and the report they return.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ir.core import Program, Variable

from passes.pass_base import PassError

__all__ = ["Deletion", "MemoryOptimizeError", "MemoryReport", "Reuse", "check_arguments"]


class MemoryOptimizeError(PassError):
    """A bad argument of ``memory_optimize`` or ``release_memory``; nothing was modified."""

    code = "E660"


@dataclass(frozen=True)
class Reuse:
    """Variable ``var`` (first written by op ``op_index`` of block ``block``) now uses ``onto``'s buffer."""

    block: int
    op_index: int
    var: str
    onto: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def line(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return (f"block {self.block} op {self.op_index}: {self.var} ({self.dtype}[{dims}], {self.nbytes} B) "
                f"reuses {self.onto}")


@dataclass(frozen=True)
class Deletion:
    """``release_memory`` dropped ``names`` after op ``after_op`` (an index of the input program's block)."""

    block: int
    after_op: int
    names: tuple[str, ...]

    def line(self) -> str:
        return f"block {self.block} after op {self.after_op}: delete {', '.join(self.names)}"


@dataclass(frozen=True)
class MemoryReport:
    """What a memory rewrite did, and the peak bytes of temporaries by the liveness estimate
    (``passes.liveness.peak_bytes``, every -1 extent taken as ``batch_size``) before and after."""

    rewrite: str
    level: int | None
    batch_size: int
    bytes_before: int
    bytes_after: int
    reused: tuple[Reuse, ...] = ()
    deleted: tuple[Deletion, ...] = ()
    skipped: tuple[tuple[int, str, str], ...] = field(default=(), repr=False)  # (block, name, reason)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    @property
    def variables_reused(self) -> int:
        return len(self.reused)

    def lines(self) -> list[str]:
        what = f"{self.rewrite}" + (f" level {self.level}" if self.level is not None else "")
        head = (f"{what}: {len(self.reused)} variable(s) reused, {sum(len(d.names) for d in self.deleted)} "
                f"deleted; peak live bytes (liveness estimate, batch {self.batch_size}) {self.bytes_before} -> "
                f"{self.bytes_after} (saved {self.bytes_saved})")
        return [head] + ["  " + r.line() for r in self.reused] + ["  " + d.line() for d in self.deleted]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def check_arguments(program: Any, skip_opt_set: Any, level: Any = 0, batch_size: Any = 1,
                    what: str = "memory_optimize") -> frozenset[str]:
    """Validate the arguments shared by the memory rewrites; the skip set as names. Raises
    ``MemoryOptimizeError`` (E660 level, E661 skip_opt_set, E662 program, E663 batch_size)."""
    if not isinstance(program, Program):
        raise MemoryOptimizeError(f"{what}: input_program must be an ir.Program, got {type(program).__name__}",
                                  hint="pass the main program (e.g. ir.default_main_program())", code="E662")
    if isinstance(level, bool) or level not in (0, 1):
        raise MemoryOptimizeError(f"{what}: only level 0 or 1 is supported, got {level!r}",
                                  hint="level 0: same shape; level 1: same dtype and at least as large", code="E660")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise MemoryOptimizeError(f"{what}: batch_size must be a positive int, got {batch_size!r}", code="E663")
    if skip_opt_set is None:
        return frozenset()
    if not isinstance(skip_opt_set, (set, frozenset, list, tuple)):
        raise MemoryOptimizeError(f"{what}: skip_opt_set must be a set or list of variable names, got "
                                  f"{type(skip_opt_set).__name__}", hint="e.g. skip_opt_set={loss.name}", code="E661")
    names = []
    for item in skip_opt_set:
        if isinstance(item, Variable):
            names.append(item.name)
        elif isinstance(item, str):
            names.append(item)
        else:
            raise MemoryOptimizeError(f"{what}: skip_opt_set holds {type(item).__name__} {item!r}, expected "
                                      "variable names (str) or Variables", code="E661")
    return frozenset(names)
