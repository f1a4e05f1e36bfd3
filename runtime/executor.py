"""The Executor: runs a Program's global block against a Scope.

A block is split into maximal runs of pure ops (ops with a JAX kernel) and host ops (RPC, IO,
delete_var). Each pure run becomes one ``jax.jit`` function over the variables it reads, returning only
what is needed afterwards: persistable variables, variables later runs or host ops read, and fetches;
intermediates stay inside XLA. Persistable variables that a run both reads and writes (parameters,
accumulators) are donated, so updates happen in place. Plans are cached on program identity, version,
the fed names and the fetch list; jax caches compilations on feed shapes and dtypes.

Randomness is deterministic: a random op draws from ``fold_in(PRNGKey(seed or program.random_seed),
op index, run counter)`` so the same program and seed give the same numbers in every process.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np

from ir.core import Block, Operator, Program, Variable, default_main_program
from ir.names import EMPTY_VAR_NAME
from ir.ops.registry import find_op_def, suggest
from runtime.kernels.registry import (RNG_SLOT, get_host_kernel, get_kernel, has_kernel, is_host_op,
                                      shape_only_slots)
from runtime.place import CPUPlace, CUDAPlace
from runtime.scope import ExecutionError, Scope, SelectedRows, global_scope


@dataclass
class HostContext:
    """What a host kernel sees: the executor, the scope, the program and the block."""

    executor: "Executor"
    scope: Scope
    program: Program
    block: Block


@dataclass
class _PureRun:
    ops: list[tuple[int, Operator]]
    reads: list[str]
    donated: list[str]
    kept: list[str]
    outputs: list[str]
    fn: Any = None


@dataclass
class _HostStep:
    index: int
    op: Operator


@dataclass
class _Plan:
    steps: list[Any]
    random_seed: int
    persistable: frozenset[str]
    runs: int = 0
    fetch: list[str] = field(default_factory=list)


class _RunScope(Scope):
    """The scope of one run: reads fall through to the caller's scope; writes of persistable variables
    go to the caller's scope, everything else (feeds, temporaries) dies with the run."""

    def __init__(self, parent: Scope, persistable: frozenset[str]) -> None:
        super().__init__(parent)
        self._persistable = persistable

    def set_var(self, name: str, value: Any) -> None:
        if name in self._persistable:
            self.parent.set_var(name, value)
        else:
            super().set_var(name, value)

    def erase(self, names: list[str]) -> None:
        super().erase(names)
        self.parent.erase(names)


def _op_where(block: Block, i: int, op: Operator) -> str:
    return f"block {block.idx}/op {i} ({op.type})"


class Executor:
    """``Executor(place).run(program, feed, fetch_list, scope)``, as Fluid's."""

    def __init__(self, place: CPUPlace | CUDAPlace | None = None) -> None:
        self.place = place or CPUPlace()
        self.device = self.place.device()
        self._plans: "weakref.WeakKeyDictionary[Program, dict[Any, _Plan]]" = weakref.WeakKeyDictionary()
        self._closed = False
        self._close_hooks: list[Any] = []

    # --- public API
    def run(self, program: Program | None = None, feed: Mapping[str, Any] | None = None,
            fetch_list: Sequence[Any] | None = None, scope: Scope | None = None,
            return_numpy: bool = True, use_program_cache: bool = True) -> list[Any]:
        if self._closed:
            raise ExecutionError("this Executor is closed", hint="create a new runtime.Executor")
        program = program if program is not None else default_main_program()
        if not isinstance(program, Program):
            raise ExecutionError(f"Executor.run needs an ir.Program, got {type(program).__name__}")
        scope = scope if scope is not None else global_scope()
        feed = dict(feed or {})
        fetch = [_fetch_name(f) for f in (fetch_list or [])]
        block = program.global_block()
        checked = {name: self._check_feed(block, name, value) for name, value in feed.items()}
        plan = self._plan(program, tuple(sorted(feed)), tuple(fetch))
        # Feeds and temporaries live in a per-run scope: a later run that omits a feed fails instead of
        # silently reusing the previous batch. Persistable results go through to the caller's scope.
        scope = _RunScope(scope, plan.persistable)
        for name, value in checked.items():
            scope.set_var(name, value)
        self._execute(program, block, plan, scope)
        plan.runs += 1
        results = []
        for name in fetch:
            value = scope.find_var(name)
            if value is None:
                raise ExecutionError(f"fetch variable {name!r} was not computed by this run",
                                     hint="fetch a variable an op of the program writes, or one in the scope")
            results.append(_to_numpy(value) if return_numpy else value)
        return results

    def run_block(self, program: Program, block_idx: int, scope: Scope) -> None:
        """Run block ``block_idx`` of ``program`` (e.g. a pserver's optimize block) against ``scope``: reads
        fall through to ``scope``, persistable results are written to it, temporaries die with the run.
        Compiled and cached like ``run``; safe to call from several threads for different blocks."""
        if self._closed:
            raise ExecutionError("this Executor is closed", hint="create a new runtime.Executor")
        plan = self._plan(program, (), (), block_idx)
        self._execute(program, program.block(block_idx), plan, _RunScope(scope, plan.persistable))
        plan.runs += 1

    def close(self) -> None:
        """Release the executor; hooks registered by distributed kernels (e.g. telling pservers this
        trainer is done) run here."""
        if self._closed:
            return
        self._closed = True
        for hook in self._close_hooks:
            hook()
        self._close_hooks.clear()

    def add_close_hook(self, hook: Any) -> None:
        self._close_hooks.append(hook)

    # --- feeding
    def _check_feed(self, block: Block, name: str, value: Any) -> Any:
        var = block.find_var_recursive(name)
        if var is None:
            raise ExecutionError(f"feed variable {name!r} is not a variable of the program",
                                 hint=suggest(name, block.vars) or "feed the names of layers.data variables")
        if isinstance(value, SelectedRows):
            return value
        if isinstance(value, np.ndarray) or hasattr(value, "dtype"):
            arr = value
            if str(arr.dtype) != var.dtype:
                raise ExecutionError(
                    f"feed {name!r} has dtype {arr.dtype}, expected {var.dtype}",
                    hint=f"convert it with .astype('{var.dtype}')")
        else:
            try:
                arr = np.asarray(value, dtype=var.dtype)
            except (TypeError, ValueError) as e:
                raise ExecutionError(f"feed {name!r} cannot be converted to {var.dtype}: {e}") from None
        shape = tuple(arr.shape)
        if len(shape) != len(var.shape) or any(d >= 0 and d != s for d, s in zip(var.shape, shape)):
            raise ExecutionError(f"feed {name!r} has shape {list(shape)}, expected {list(var.shape)} (-1: any)",
                                 hint="reshape the batch to the variable's declared shape")
        return arr  # handed to the compiled call as is: one transfer with the call, not one per feed

    # --- planning
    def _plan(self, program: Program, feed: tuple[str, ...], fetch: tuple[str, ...], block_idx: int = 0) -> _Plan:
        per_program = self._plans.setdefault(program, {})
        key = (program.version, block_idx, feed, fetch)
        plan = per_program.get(key)
        if plan is None:
            for stale in [k for k in per_program if k[0] != program.version]:
                del per_program[stale]  # an older version's plans are dead
            plan = self._build_plan(program, program.block(block_idx), fetch)
            per_program[key] = plan
        return plan

    def _build_plan(self, program: Program, block: Block, fetch: tuple[str, ...]) -> _Plan:
        for name in fetch:
            if block.find_var_recursive(name) is None:
                raise ExecutionError(f"fetch variable {name!r} is not a variable of the program",
                                     hint=suggest(name, block.vars))
        groups: list[Any] = []
        for i, op in enumerate(block.ops):
            if is_host_op(op.type):
                groups.append(_HostStep(i, op))
                continue
            if not has_kernel(op.type):
                raise ExecutionError(f"{_op_where(block, i, op)} has no kernel",
                                     hint="this op type cannot run on this runtime yet" if find_op_def(op.type)
                                     else suggest(op.type, []) or "the op type is not registered")
            if groups and isinstance(groups[-1], list):
                groups[-1].append((i, op))
            else:
                groups.append([(i, op)])
        # Variables needed after each step: read by later steps, fetched, or persistable.
        persistable = {n for n, v in _all_vars(program) if v.persistable}
        if block.idx != 0:
            # A sub-block run on its own (a pserver's optimize or learning-rate block) keeps what it
            # writes into global variables: they are state shared with the other blocks.
            persistable |= set(program.global_block().vars)
        needed_later: set[str] = set(fetch)
        steps: list[Any] = []
        for group in reversed(groups):
            if isinstance(group, _HostStep):
                steps.append(group)
                needed_later |= set(group.op.input_arg_names)
                continue
            run = self._make_run(program, block, group, needed_later, persistable)
            steps.append(run)
            needed_later |= set(run.reads)
        steps.reverse()
        return _Plan(steps, program.random_seed, frozenset(persistable), fetch=list(fetch))

    def _make_run(self, program: Program, block: Block, ops: list[tuple[int, Operator]],
                  needed_later: set[str], persistable: set[str]) -> _PureRun:
        reads: list[str] = []
        written: dict[str, None] = {}
        for _, op in ops:
            for n in _value_inputs(op):
                if n not in written and n not in reads and n != EMPTY_VAR_NAME:
                    reads.append(n)
            for n in op.output_arg_names:
                if n != EMPTY_VAR_NAME:
                    written[n] = None
        outputs = [n for n in written if n in needed_later or n in persistable]
        donated = [n for n in reads if n in persistable and n in written]
        kept = [n for n in reads if n not in donated]
        run = _PureRun(ops, reads, donated, kept, outputs)
        run.fn = jax.jit(_trace_run(run, block), donate_argnums=(0,))
        return run

    # --- execution
    def _execute(self, program: Program, block: Block, plan: _Plan, scope: Scope) -> None:
        for step in plan.steps:
            if isinstance(step, _HostStep):
                get_host_kernel(step.op.type)(HostContext(self, scope, program, block), step.op)
                continue
            donated = tuple(self._read(scope, block, step, n, donate=True) for n in step.donated)
            kept = tuple(self._read(scope, block, step, n) for n in step.kept)
            outs = step.fn(donated, kept, np.uint32(plan.runs))
            for name, value in zip(step.outputs, outs):
                scope.set_var(name, value)

    def _read(self, scope: Scope, block: Block, run: _PureRun, name: str, donate: bool = False) -> Any:
        value = scope.find_var(name)
        if value is None:
            var = block.find_var_recursive(name)
            reader = next((f"{_op_where(block, i, op)}" for i, op in run.ops if name in op.input_arg_names), "?")
            if var is not None and var.is_data:
                raise ExecutionError(f"feed variable {name!r} is missing (read by {reader})",
                                     hint=f"pass feed={{'{name}': ...}} to Executor.run")
            if var is not None and var.persistable:
                raise ExecutionError(f"persistable variable {name!r} is not initialised (read by {reader})",
                                     hint="run the startup program first, or load the parameters")
            raise ExecutionError(f"variable {name!r} has no value (read by {reader})")
        if isinstance(value, (jax.Array, SelectedRows)) or (isinstance(value, np.ndarray) and not donate):
            return value
        # A value set by the user (numpy, a Python number): keep a device copy, which can be donated.
        value = jax.device_put(np.asarray(value), self.device)
        scope.set_var(name, value)
        return value


def _trace_run(run: _PureRun, block: Block) -> Any:
    ops = [(i, op, get_kernel(op.type), dict(op.attrs), _is_random(op)) for i, op in run.ops]
    program_seed = block.program.random_seed

    def fn(donated: tuple[Any, ...], kept: tuple[Any, ...], runs: Any) -> tuple[Any, ...]:
        env: dict[str, Any] = dict(zip(run.donated, donated))
        env.update(zip(run.kept, kept))
        key = jax.random.fold_in(jax.random.PRNGKey(program_seed), runs) if any(r for *_, r in ops) else None
        for i, op, kern, attrs, random in ops:
            shape_only = shape_only_slots(op.type)
            ins = {slot: [env[n] if slot not in shape_only else _declared(block, n) for n in names
                          if n != EMPTY_VAR_NAME]
                   for slot, names in op.inputs.items()}
            if random:
                # Fluid's dropout honours its seed only with fix_seed; other random ops always do.
                op_seed = attrs.get("seed", 0) if attrs.get("fix_seed", True) else 0
                ins[RNG_SLOT] = [jax.random.PRNGKey(op_seed) if op_seed else jax.random.fold_in(key, i)]
            try:
                outs = kern(ins, attrs)
            except ExecutionError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with the op's location
                raise ExecutionError(f"{_op_where(block, i, op)} failed: {type(e).__name__}: {e}") from e
            for slot, names in op.outputs.items():
                values = outs.get(slot)
                if values is None:
                    if any(n != EMPTY_VAR_NAME for n in names):
                        raise ExecutionError(f"{_op_where(block, i, op)}: its kernel produced no {slot!r} output")
                    continue
                if len(values) != len(names):
                    raise ExecutionError(f"{_op_where(block, i, op)}: its kernel produced {len(values)} {slot!r} "
                                         f"values for {len(names)} variables")
                for n, v in zip(names, values):
                    if n != EMPTY_VAR_NAME:
                        env[n] = v
        return tuple(env[n] for n in run.outputs)

    return fn


def _value_inputs(op: Operator) -> list[str]:
    """The input names of ``op`` whose values its kernel reads (not only their shapes)."""
    shape_only = shape_only_slots(op.type)
    return [n for slot, names in op.inputs.items() if slot not in shape_only for n in names]


def _declared(block: Block, name: str) -> jax.ShapeDtypeStruct:
    var = block.find_var_recursive(name)
    if var is None or any(d < 0 for d in var.shape):
        raise ExecutionError(f"variable {name!r} needs a fully known declared shape (its kernel reads only the shape)",
                             hint="declare the variable with every dimension known")
    return jax.ShapeDtypeStruct(var.shape, np.dtype(var.dtype))


def _is_random(op: Operator) -> bool:
    op_def = find_op_def(op.type)
    return op_def is not None and ("random" in op_def.traits or (
        op_def.forward_type is not None and "random" in find_op_def(op_def.forward_type).traits))


def _all_vars(program: Program) -> Iterable[tuple[str, Variable]]:
    for b in program.blocks:
        yield from b.vars.items()


def _fetch_name(f: Any) -> str:
    if isinstance(f, Variable):
        return f.name
    if isinstance(f, str):
        return f
    raise ExecutionError(f"fetch_list items must be variables or names, got {type(f).__name__} {f!r}")


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, SelectedRows):
        value = value.to_dense()
    return np.array(value)  # a copy: donated buffers may be reused by the next run
