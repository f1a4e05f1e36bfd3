"""Fluid's ``save_inference_model`` / ``load_inference_model``: a forward-only program and its parameters.

An inference model directory holds:

- ``__model__`` (or ``model_filename``): the pruned program in the protobuf file form
  (``ir.serialize.save_program``);
- ``__model__.feed_fetch.json`` (``<model file>.feed_fetch.json``): ``{"format": 1, "feed": [names],
  "fetch": [names]}``, the program's inputs and outputs in order (Fluid records them as ``feed`` /
  ``fetch`` ops; Flotilla has no such ops, so they travel beside the program);
- the persistable variables the pruned program reads, saved with ``runtime.io.save_vars`` (one file each,
  or one archive ``params_filename``).

The pruned program keeps, from the forward ops of ``main_program`` (``clone(for_test=True)``), only those
the targets depend on, and only the variables those ops use; ops with an ``is_test`` attribute (dropout,
batch_norm) get ``is_test=True``. The caller's program is never modified. Every failure is an
``ExecutionError`` (or the ``runtime.io`` error of the variable concerned) naming the file or variable.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

from ir.core import Program, Variable, default_main_program
from ir.errors import SerializationError
from ir.names import seq_len_name
from ir.serialize import load_program, save_program
from runtime.io import is_persistable, load_vars, save_vars
from runtime.scope import ExecutionError, Scope

__all__ = ["load_inference_model", "prune_for_inference", "save_inference_model"]

MODEL_FILENAME = "__model__"
FEED_FETCH_SUFFIX = ".feed_fetch.json"
FORMAT = 1


def _names(items: Sequence[Any], what: str) -> list[str]:
    if isinstance(items, (str, Variable)):
        items = [items]
    names: list[str] = []
    for item in items:
        if isinstance(item, Variable):
            names.append(item.name)
        elif isinstance(item, str) and item:
            names.append(item)
        else:
            raise ExecutionError(f"save_inference_model: {what} must be variables or names, got {item!r}",
                                 hint=f"pass a list of {what} (Variables or their names)")
    return names


def prune_for_inference(program: Program, feed_names: Sequence[str], target_names: Sequence[str]) -> Program:
    """A forward-only copy of ``program`` with just the ops ``target_names`` need (see the module
    docstring). Raises ``ExecutionError`` for a name the program does not have, or a target that
    depends on a variable that is neither fed nor persistable nor computed."""
    pruned = program.clone(for_test=True)
    block = pruned.global_block()
    for name in [*feed_names, *target_names]:
        if block.find_var_recursive(name) is None:
            raise ExecutionError(f"save_inference_model: {name!r} is not a variable of the program",
                                 hint="name the program's data variables as feeds and its outputs as targets")
    needed = set(target_names)
    keep: list[int] = []
    for index in range(len(block.ops) - 1, -1, -1):
        op = block.ops[index]
        if needed.intersection(op.output_arg_names):
            keep.append(index)
            needed.update(n for n in op.input_arg_names if n not in feed_names)
    kept = set(keep)
    for index in range(len(block.ops) - 1, -1, -1):
        if index not in kept:
            block.remove_op(index)
    used = set(feed_names) | set(target_names)
    for op in block.ops:
        used.update(op.input_arg_names)
        used.update(op.output_arg_names)
        if op.has_attr("is_test"):
            op.set_attr("is_test", True)
    for name in [n for n in block.vars if n not in used]:
        block.remove_var(name)
    produced = {n for op in block.ops for n in op.output_arg_names}
    # A LoD feed's sequence lengths are fed with it (runtime.lod); anything else a kept op reads must be
    # fed, persistable or computed.
    fed = set(feed_names) | {seq_len_name(n) for n in feed_names}
    missing = sorted(n for n in used - produced - fed
                     if block.find_var_recursive(n) is not None and not block.var_recursive(n).persistable)
    if missing:
        raise ExecutionError(f"save_inference_model: the targets need {missing}, which are neither fed, "
                             "persistable nor computed by a forward op",
                             hint=f"add {missing} to feeded_var_names")
    return pruned


def save_inference_model(dirname: str, feeded_var_names: Sequence[Any], target_vars: Sequence[Any], executor: Any,
                         main_program: Program | None = None, model_filename: str | None = None,
                         params_filename: str | None = None, export_for_deployment: bool = True, *,
                         scope: Scope | None = None) -> list[str]:
    """Fluid 1.5's signature: save the program pruned to ``target_vars`` (fed by ``feeded_var_names``) and the
    persistable variables it reads (from ``scope``, default ``global_scope()``) into ``dirname``. Returns
    the target names. ``export_for_deployment`` is accepted for compatibility (the saved form is one)."""
    program = main_program if main_program is not None else default_main_program()
    if not isinstance(program, Program):
        raise ExecutionError(f"save_inference_model: main_program must be a Program, got {type(program).__name__}")
    feeds, targets = _names(feeded_var_names, "feeded_var_names"), _names(target_vars, "target_vars")
    pruned = prune_for_inference(program, feeds, targets)
    os.makedirs(dirname, exist_ok=True)
    model_path = os.path.join(dirname, model_filename or MODEL_FILENAME)
    save_program(pruned, model_path)
    with open(model_path + FEED_FETCH_SUFFIX, "w") as f:
        json.dump({"format": FORMAT, "feed": feeds, "fetch": targets}, f)
    params = [v for v in pruned.list_vars() if is_persistable(v)]
    save_vars(executor, dirname, pruned, vars=params, filename=params_filename, scope=scope)
    return targets


def load_inference_model(dirname: str, executor: Any, model_filename: str | None = None,
                         params_filename: str | None = None, *,
                         scope: Scope | None = None) -> list[Any]:
    """Load what ``save_inference_model`` saved: ``[program, feed_target_names, fetch_targets]`` (the
    fetch targets are the program's Variables), with the parameters loaded into ``scope`` (default
    ``global_scope()``)."""
    model_path = os.path.join(dirname, model_filename or MODEL_FILENAME)
    try:
        program = load_program(model_path)
    except SerializationError as e:
        raise ExecutionError(f"load_inference_model: {e.message}",
                             hint="point dirname at a directory written by save_inference_model") from None
    meta_path = model_path + FEED_FETCH_SUFFIX
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ExecutionError(f"load_inference_model: cannot read {meta_path}: {e}",
                             hint="the feed and fetch names are saved beside the model file") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not all(
            isinstance(meta.get(k), list) and all(isinstance(n, str) for n in meta[k]) for k in ("feed", "fetch")):
        raise ExecutionError(f"load_inference_model: {meta_path} is not a format-{FORMAT} feed/fetch file")
    block = program.global_block()
    params = [v for v in program.list_vars() if is_persistable(v)]
    load_vars(executor, dirname, program, vars=params, filename=params_filename, scope=scope)
    return [program, list(meta["feed"]), [block.var_recursive(n) for n in meta["fetch"]]]
