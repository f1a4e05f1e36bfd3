"""Flotilla's runtime: JAX kernels, Scope, Executor (and, later, the gRPC pserver and collectives).

Programs declare int64 ids and float64 tensors and the runtime honours the declared dtypes (kernels never
rely on JAX's default dtype). The 64-bit types are on only inside Flotilla's own calls (``runtime.x64``):
importing the runtime leaves JAX's global configuration, and so a user's own JAX code, alone.
"""
from __future__ import annotations

from runtime import kernels  # noqa: F401  (registers every kernel)
from runtime.executor import Executor
from runtime.place import CPUPlace, CUDAPlace
from runtime.role import LaunchError, Role, role_from_env
from runtime.scope import ExecutionError, Scope, SelectedRows, global_scope

__all__ = ["CPUPlace", "CUDAPlace", "ExecutionError", "Executor", "LaunchError", "Role", "Scope", "SelectedRows",
           "global_scope", "role_from_env"]
