"""Flotilla's runtime: JAX kernels, Scope, Executor (and, later, the gRPC pserver and collectives).

Programs declare int64 ids and float64 tensors and the runtime honours the declared dtypes (kernels never
rely on JAX's default dtype). The 64-bit types are on only inside Flotilla's own calls (``runtime.x64``):
importing the runtime leaves JAX's global configuration, and so a user's own JAX code, alone.

The names below load on first use (PEP 562), so a process that needs no JAX, such as the launcher
(``python -m runtime.launch``, which only starts and watches processes), does not import it: importing
``runtime.launch`` used to cost every launched job about 0.45 s of CPU for JAX alone. Anything that runs a
program goes through ``runtime.executor``, which imports ``runtime.kernels`` and so registers every kernel
before its first run. Submodules are reachable as attributes (``runtime.io``) as when this module imported
them eagerly.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_LAZY = {
    "Executor": "runtime.executor",
    "CPUPlace": "runtime.place",
    "CUDAPlace": "runtime.place",
    "LaunchError": "runtime.role",
    "Role": "runtime.role",
    "role_from_env": "runtime.role",
    "ExecutionError": "runtime.scope",
    "Scope": "runtime.scope",
    "SelectedRows": "runtime.scope",
    "global_scope": "runtime.scope",
}

__all__ = ["CPUPlace", "CUDAPlace", "ExecutionError", "Executor", "LaunchError", "Role", "Scope", "SelectedRows",
           "global_scope", "role_from_env"]


def __getattr__(name: str) -> Any:
    source = _LAZY.get(name)
    if source is None:
        if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
