"""Kernels: the io family. ``delete_var``, ``save``, ``load``, ``save_combine`` and ``load_combine`` are
host kernels (they touch the scope and files between compiled runs); ``fake_init`` is a pure kernel.

Invariants:
- Files use the format documented in ``runtime.io``; a load checks each value against the variable's
  declaration in the running block (type, dtype, shape with -1 matching any extent) before it touches
  the scope, and puts the value on the executor's device.
- A failing save or load raises ExecutionError naming the variable and the file; a load that fails
  leaves the scope as it was (``load_combine`` reads and checks every variable before setting any).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from runtime.io import check_declared, read_archive, read_var_file, write_archive, write_var_file
from runtime.kernels.registry import host_kernel, kernel
from runtime.scope import ExecutionError, SelectedRows


@host_kernel("delete_var")
def delete_var(ctx: Any, op: Any) -> None:
    """Drop every X from the scope. The Executor runs this only where a ``delete_var`` does not follow a
    compiled run; after a run it folds the op into the run (the run stops returning the values) and
    erases just what the scope may still hold, so ``release_memory`` never splits compiled runs."""
    ctx.scope.erase(list(op.input("X")))


def _value_to_save(ctx: Any, name: str, path: str) -> Any:
    value = ctx.scope.find_var(name)
    if value is None:
        raise ExecutionError(f"cannot save variable {name!r} to {path}: it is not in the scope",
                             hint="run the startup program (or the step that computes it) before saving")
    return value


@host_kernel("save")
def save(ctx: Any, op: Any) -> None:
    name = op.input("X")[0]
    path = op.attr("file_path")
    write_var_file(path, name, _value_to_save(ctx, name, path), overwrite=op.attr("overwrite"))


@host_kernel("save_combine")
def save_combine(ctx: Any, op: Any) -> None:
    path = op.attr("file_path")
    items = [(n, _value_to_save(ctx, n, path)) for n in op.input("X")]
    write_archive(path, items, overwrite=op.attr("overwrite"))


def _checked(ctx: Any, name: str, value: Any, path: str) -> Any:
    var = ctx.block.find_var_recursive(name)
    if var is not None:
        check_declared(var, value, path)
    device = ctx.executor.device
    if isinstance(value, SelectedRows):
        return SelectedRows(jax.device_put(value.rows, device), jax.device_put(value.values, device), value.height)
    return jax.device_put(value, device)


@host_kernel("load")
def load(ctx: Any, op: Any) -> None:
    name = op.output("Out")[0]
    path = op.attr("file_path")
    ctx.scope.set_var(name, _checked(ctx, name, read_var_file(path, name), path))


@host_kernel("load_combine")
def load_combine(ctx: Any, op: Any) -> None:
    path = op.attr("file_path")
    names = list(op.output("Out"))
    loaded = read_archive(path, names)
    values = [_checked(ctx, n, loaded[n], path) for n in names]
    for n, v in zip(names, values):
        ctx.scope.set_var(n, v)


@kernel("fake_init")
def fake_init(ins: dict, attrs: dict) -> dict:
    return {"Out": [jnp.zeros(tuple(attrs["shape"]), jnp.float32)]}
