"""The request a data-parallel program wrapper makes of the executor that runs it.

Why in ``ir``: the wrapper (``transpiler.compiled_program.CompiledProgram``) never imports the runtime, and
the runtime never imports the transpiler; both import this, so the hand-over is a declared type, not an
attribute the executor probes for.
"""
from __future__ import annotations

import abc
from typing import Callable, NamedTuple

from ir.core import Program


class DataParallelRun(NamedTuple):
    """``program``: the wrapped program. ``mesh``: None to run it as it is; ``"process"`` for one device a
    trainer process (a program already transpiled for collectives); ``"devices"`` for every device of
    this process. ``program_for(n)``: the program to run on a mesh of ``n`` ranks (None when ``mesh`` is)."""

    program: Program
    mesh: str | None
    program_for: Callable[[int], Program] | None


class DataParallelSource(abc.ABC):
    """Something ``runtime.Executor.run`` accepts in place of a Program, and asks how to run."""

    @abc.abstractmethod
    def data_parallel_run(self) -> DataParallelRun:
        """The program and the mesh to run it on; the executor resolves the mesh."""


__all__ = ["DataParallelRun", "DataParallelSource"]
