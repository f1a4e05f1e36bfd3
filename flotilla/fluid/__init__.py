"""``from flotilla import fluid``: the Fluid 1.5 front end, and the names a Fluid 1.5 script touches.

A Fluid 1.5 script runs by changing its import line alone (``import paddle.fluid as fluid`` →
``from flotilla import fluid``). The program builder lives here: ``layers`` (with the learning-rate
schedules of ``learning_rate``), ``layer_helper``, ``param_attr``, ``initializer``, ``optimizer``,
``regularizer`` and ``clip``, with what the optimizer side shares in ``spec``. It builds ``ir`` programs
and imports only ``ir``: building a program needs no jax or grpc.

The rest is re-exported from ``runtime`` and ``transpiler`` (``Executor``, ``CPUPlace``, ``DataFeeder``,
``DistributeTranspiler``, the submodules ``io``, ``transpiler`` and ``incubate`` (Paddle 1.5's Fleet paths,
``fluid.incubate.fleet...``, re-exporting ``flotilla.fleet``)...) and imported on first use, so
``import flotilla.fluid`` stays jax-free until a script touches the runtime.

The one behaviour that differs from the native API: ``fluid.DistributeTranspiler`` follows Fluid's
in-place rule (``transpile`` rewrites the main and startup programs it is given, or the defaults, into
the trainer's programs), so the manual's ``exe.run(fluid.default_startup_program())`` on a trainer
receives the parameters from the pservers instead of initialising them locally. A distributed trainer
that runs a program handed to a native ``transpile`` instead of its result stops with
``runtime.scope.UntranspiledProgramError``.

``LoDTensor``, ``create_lod_tensor`` and ``DataFeeder`` come from ``runtime.scope`` and ``runtime.lod`` (LoD
sequences). ``Scope`` is ``runtime.scope.FluidScope``, whose ``find_var`` answers with Fluid's Variable
(``scope.find_var(n).get_tensor()``), as ``global_scope()`` does.
"""
from __future__ import annotations

import importlib
from typing import Any

from flotilla.fluid import clip, initializer, layers, learning_rate, optimizer, regularizer
from flotilla.fluid.param_attr import ParamAttr
from ir.backward import append_backward
from ir.core import Parameter, Program, Variable, default_main_program, default_startup_program, program_guard
from ir.names import unique_name

# name → module it comes from (``module:attribute`` where the names differ), imported on first access
# (``runtime`` brings jax; ``transpiler`` the passes)
_LAZY = {
    "incubate": "flotilla.fluid.incubate",
    "io": "flotilla.fluid.io",
    "transpiler": "flotilla.fluid.transpiler",
    "DistributeTranspiler": "flotilla.fluid.transpiler",
    "DistributeTranspilerConfig": "flotilla.fluid.transpiler",
    "memory_optimize": "flotilla.fluid.transpiler",
    "release_memory": "flotilla.fluid.transpiler",
    "BuildStrategy": "transpiler.compiled_program",
    "CompiledProgram": "transpiler.compiled_program",
    "ExecutionStrategy": "transpiler.compiled_program",
    "Executor": "runtime.executor",
    "DataFeeder": "runtime.lod",
    "LoDTensor": "runtime.scope",
    "create_lod_tensor": "runtime.lod",
    "CPUPlace": "runtime.place",
    "CUDAPlace": "runtime.place",
    "Scope": "runtime.scope:FluidScope",
    "global_scope": "runtime.scope",
    "scope_guard": "runtime.scope",
    "ParallelExecutor": "flotilla.parallel_executor",
}

__all__ = [
    "BuildStrategy", "CPUPlace", "CUDAPlace", "CompiledProgram", "DataFeeder", "DistributeTranspiler",
    "DistributeTranspilerConfig", "ExecutionStrategy", "Executor", "LoDTensor", "ParallelExecutor", "ParamAttr",
    "Parameter", "Program", "Scope", "Variable", "append_backward", "clip", "create_lod_tensor",
    "default_main_program", "default_startup_program", "global_scope", "incubate", "initializer", "io", "layers",
    "memory_optimize", "optimizer", "program_guard", "regularizer", "release_memory", "scope_guard", "transpiler",
    "unique_name",
]


def __getattr__(name: str) -> Any:
    source = _LAZY.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, _, attribute = source.partition(":")
    module = importlib.import_module(module_name)
    value = module if module_name == f"{__name__}.{name}" else getattr(module, attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
