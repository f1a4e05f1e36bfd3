"""Kernels of the JAX capture front end (``ir/ops/jax_function.py``).

- ``jax_function``: deserializes its ``exported`` attr once per distinct blob (cached) and calls it.
  Inputs are reshaped to the export's argument shapes where only a unit/scalar form differs (Fluid
  gives reductions the shape ``[1]`` where JAX gives ``[]``).
- ``jax_function_grad``: ``jax.vjp`` of the export (serialized with vjp order 1). Non-float inputs get
  zeros (autodiff names them ``@EMPTY@``), non-float outputs a ``float0`` cotangent, and a missing
  ``Out@GRAD`` counts as zeros.
- ``load_value`` (host): reads a value from a ``runtime.io`` archive and writes the part its output
  variable holds (see ``rows_held``).
"""
from __future__ import annotations

import base64
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.io import check_declared, read_archive
from runtime.kernels.registry import Ins, host_kernel, kernel
from runtime.scope import ExecutionError


@functools.lru_cache(maxsize=256)
def load_exported(blob: str) -> Any:
    """The ``jax.export.Exported`` of a ``jax_function``'s ``exported`` attr (cached on the text)."""
    return jax.export.deserialize(bytearray(base64.b64decode(blob)))


def _args(exp: Any, xs: list[Any]) -> list[Any]:
    if len(xs) != len(exp.in_avals):
        raise ExecutionError(f"jax_function: the export takes {len(exp.in_avals)} arguments, the op gives {len(xs)}")
    out = []
    for x, aval in zip(xs, exp.in_avals):
        x = jnp.asarray(x)
        if x.ndim != len(aval.shape) and all(isinstance(d, int) for d in aval.shape) \
                and x.size == math.prod(aval.shape):
            x = x.reshape(aval.shape)
        if x.dtype != aval.dtype:
            x = x.astype(aval.dtype)
        out.append(x)
    return out


@kernel("jax_function")
def jax_function(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    exp = load_exported(attrs["exported"])
    return {"Out": list(exp.call(*_args(exp, list(ins.get("X", [])))))}


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


@kernel("jax_function_grad")
def jax_function_grad(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    exp = load_exported(attrs["exported"])
    xs = _args(exp, list(ins.get("X", [])))
    diff = [i for i, x in enumerate(xs) if _inexact(x)]

    def f(*d: Any) -> Any:
        full = list(xs)
        for i, v in zip(diff, d):
            full[i] = v
        return tuple(exp.call(*full))

    outs, pullback = jax.vjp(f, *[xs[i] for i in diff])
    given = ins.get("Out@GRAD")
    cts = []
    for k, o in enumerate(outs):
        if not _inexact(o):
            cts.append(np.zeros(o.shape, jax.dtypes.float0))
        elif given is None:
            cts.append(jnp.zeros(o.shape, o.dtype))
        else:
            cts.append(jnp.asarray(given[k], o.dtype).reshape(o.shape))
    grads = iter(pullback(tuple(cts)))
    by_index = {i: next(grads) for i in diff}
    return {"X@GRAD": [by_index[i] if i in by_index else jnp.zeros(x.shape, jnp.float32) for i, x in enumerate(xs)]}


def rows_held(var: Any, whole_rows: int, held_rows: int) -> Any:
    """The rows of a whole value that variable ``var`` holds: all of them, a contiguous slice starting
    at ``slice_offset``, or, for a distributed table's shard (``slice_of`` is its own name), the rows
    ``i, i + n, i + 2n…`` with ``i = slice_offset`` and ``n`` the only pserver count giving the shard
    ``held_rows = ceil(whole_rows / n)`` rows."""
    if var is None or var.slice_of is None:
        return slice(None)
    offset = int(var.slice_offset or 0)
    if var.slice_of != var.name:
        return slice(offset, offset + held_rows)
    counts = [n for n in range(offset + 1, whole_rows + 1) if -(-whole_rows // n) == held_rows]
    if len(counts) != 1:
        raise ExecutionError(f"cannot tell the pserver count of shard {offset} of table {var.name!r} "
                             f"({held_rows} of {whole_rows} rows): {counts or 'none'} fit",
                             hint="initialise this table with a random initializer, or pick a table "
                                  "size whose shard size determines the number of pservers")
    n = counts[0]
    return np.arange(offset, offset + n * held_rows, n)


@host_kernel("load_value")
def load_value(ctx: Any, op: Any) -> None:
    out = op.output("Out")[0]
    path, name = op.attr("file_path"), op.attr("var_name")
    value = np.asarray(read_archive(path, [name])[name])
    var = ctx.block.find_var_recursive(out)
    if var is not None and var.slice_of is not None and value.ndim and var.shape:
        rows = rows_held(var, value.shape[0], var.shape[0])
        if isinstance(rows, np.ndarray):
            padded = np.zeros((var.shape[0],) + value.shape[1:], value.dtype)
            keep = rows < value.shape[0]
            padded[keep] = value[rows[keep]]
            value = padded
        else:
            value = value[rows]
    if var is not None:
        check_declared(var, value, path)
    device = ctx.executor.device
    if device.process_index != jax.process_index():
        # In a multi-process group the place's device may be another process's: use our own.
        device = jax.local_devices(backend=device.platform)[0]
    ctx.scope.set_var(out, jax.device_put(value, device))
