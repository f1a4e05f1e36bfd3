"""The user API: ``DistributeTranspiler`` (parameter-server and nccl2/collective modes) and its config
and dispatchers; ``CompiledProgram`` (data parallel over devices and trainers; ``ParallelExecutor`` over it is
``flotilla.parallel_executor``);
``memory_optimize`` and ``release_memory`` (in place, as in Fluid)."""
from __future__ import annotations

from passes.slice_variables import slice_variable
from transpiler.compiled_program import BuildStrategy, CompiledProgram, ExecutionStrategy
from transpiler.config import DistributeTranspilerConfig, TranspilerError
from transpiler.distribute_transpiler import DistributeTranspiler
from transpiler.memory_optimization import MemoryOptimizeError, MemoryReport, memory_optimize, release_memory
from transpiler.ps_dispatcher import HashName, PSDispatcher, RoundRobin

__all__ = [
    "BuildStrategy", "CompiledProgram", "ExecutionStrategy",
    "DistributeTranspiler", "DistributeTranspilerConfig", "HashName", "MemoryOptimizeError", "MemoryReport",
    "PSDispatcher", "RoundRobin", "TranspilerError", "memory_optimize", "release_memory", "slice_variable",
]
