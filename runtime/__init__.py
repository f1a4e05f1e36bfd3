"""Flotilla's runtime: JAX kernels, Scope, Executor (and, later, the gRPC pserver and collectives).

Importing the runtime enables 64-bit types in JAX: programs declare int64 ids and float64 tensors and
the runtime honours the declared dtypes (kernels never rely on JAX's default dtype).
"""
from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

from runtime import kernels  # noqa: E402,F401  (registers every kernel)
from runtime.executor import Executor  # noqa: E402
from runtime.place import CPUPlace, CUDAPlace  # noqa: E402
from runtime.role import LaunchError, Role, role_from_env  # noqa: E402
from runtime.scope import ExecutionError, Scope, SelectedRows, global_scope  # noqa: E402

__all__ = ["CPUPlace", "CUDAPlace", "ExecutionError", "Executor", "LaunchError", "Role", "Scope", "SelectedRows",
           "global_scope", "role_from_env"]
