"""The user API: ``DistributeTranspiler`` (parameter-server mode) and its config and dispatchers."""
from __future__ import annotations

from passes.slice_variables import slice_variable
from transpiler.config import DistributeTranspilerConfig, TranspilerError
from transpiler.distribute_transpiler import DistributeTranspiler
from transpiler.ps_dispatcher import HashName, PSDispatcher, RoundRobin

__all__ = [
    "DistributeTranspiler", "DistributeTranspilerConfig", "HashName", "PSDispatcher", "RoundRobin",
    "TranspilerError", "slice_variable",
]
