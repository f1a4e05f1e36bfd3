"""``from flotilla import fluid``: the names a Fluid 1.5 script touches, in one namespace.

A Fluid 1.5 script runs by changing its import line alone (``import paddle.fluid as fluid`` →
``from flotilla import fluid``). Everything is re-exported from ``ir``, ``runtime`` and ``transpiler``;
nothing is written twice. The submodules ``layers`` (with the learning-rate schedules), ``optimizer``,
``regularizer``, ``clip``, ``initializer``, ``io`` and ``transpiler`` are real modules, so
``from flotilla.fluid.layers import fc`` works too.

The one behaviour that differs from the native API: ``fluid.DistributeTranspiler`` follows Fluid's
in-place rule (``transpile`` rewrites the main and startup programs it is given, or the defaults, into
the trainer's programs), so the manual's ``exe.run(fluid.default_startup_program())`` on a trainer
receives the parameters from the pservers instead of initialising them locally. A distributed trainer
that runs a program handed to a native ``transpile`` instead of its result stops with
``runtime.scope.UntranspiledProgramError``.

``LoDTensor``, ``create_lod_tensor`` and ``DataFeeder`` come from ``runtime.lod`` (LoD sequences).
"""
from __future__ import annotations

import runtime  # noqa: F401  (enables 64-bit JAX types and registers every kernel)
from flotilla.fluid import clip, initializer, io, layers, optimizer, regularizer, transpiler
from flotilla.fluid.transpiler import (DistributeTranspiler, DistributeTranspilerConfig, memory_optimize,
                                       release_memory)
from ir.backward import append_backward
from ir.core import (Parameter, Program, Variable, default_main_program, default_startup_program, program_guard)
from ir.names import unique_name
from ir.param_attr import ParamAttr
from runtime.executor import Executor
from runtime.lod import DataFeeder, LoDTensor, create_lod_tensor
from runtime.place import CPUPlace, CUDAPlace
from runtime.scope import Scope, global_scope, scope_guard
from flotilla.parallel_executor import ParallelExecutor
from transpiler.compiled_program import BuildStrategy, CompiledProgram, ExecutionStrategy

__all__ = [
    "BuildStrategy", "CPUPlace", "CUDAPlace", "CompiledProgram", "DataFeeder", "DistributeTranspiler",
    "DistributeTranspilerConfig", "ExecutionStrategy", "Executor", "LoDTensor", "ParallelExecutor", "ParamAttr",
    "Parameter", "Program", "Scope", "Variable", "append_backward", "clip", "create_lod_tensor",
    "default_main_program", "default_startup_program", "global_scope", "initializer", "io", "layers",
    "memory_optimize", "optimizer", "program_guard", "regularizer", "release_memory", "scope_guard", "transpiler",
    "unique_name",
]
