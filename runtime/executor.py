"""The Executor: runs a Program's global block against a Scope.

A block is split into maximal runs of pure ops (ops with a JAX kernel) and host ops (RPC, IO). A
``delete_var`` (``release_memory``) never splits a run: one that follows a pure op is folded into its run,
which then stops returning the deleted values (and an erase step drops what the scope still held). Each
pure run becomes one ``jax.jit`` function over the variables it reads, returning only
what is needed afterwards: persistable variables, variables later runs or host ops read, and fetches;
intermediates stay inside XLA. Persistable variables that a run both reads and writes (parameters,
accumulators) are donated, so updates happen in place. Plans are cached on program identity, version,
the fed names and the fetch list; jax caches compilations on feed shapes and dtypes. A plan of one pure
run (a training step) also keeps its persistable arguments for the next ``run`` (``_ArgCache``): what it
wrote in their place, used as long as the caller's scope has seen no other write (``Scope.stamp``), so a
step with 183 parameters does not read and convert each of them again.

Sub-blocks: ``run_block`` runs one (a pserver's optimize block); ``run_blocks`` plans several independent
ones (``runtime.block_sets.block_dependency``: none reads or writes what another writes, except that all
may read what the first writes) as ONE plan over their ops in order, so a pserver request that updates
nine parameters is one compiled call, not nine. Its result equals running the blocks one by one; a
dependent set is refused (E689). It may also be told variables to keep (not donated: the caller's values
stay intact) and to check (their new values' finiteness comes back from the same compiled call). Plans of
block sets are cached per program version, set, kept and checked names.

Randomness is deterministic: a random op draws from ``fold_in(PRNGKey(seed or program.random_seed),
op index, run counter)`` (the index counts no ``delete_var`` op, so ``release_memory`` changes no draw) so the same program and seed give the same numbers in every process (and, in a
data-parallel run, the rank is folded in too, so ranks draw different dropout masks).

Data parallelism (``runtime.collective``): a block holding collective ops (``c_allreduce_sum``...) runs
each pure run under ``jax.shard_map`` over a mesh of one device per trainer process; a program handed
in as a ``CompiledProgram.with_data_parallel`` runs over every device of every process. Collectives then
lower to XLA collectives inside the compiled step, so a training step stays one compiled call. The mesh
is resolved when the first pure run executes, after host ops before it (``gen_nccl_id``) formed the group.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np

from ir.core import Block, Operator, Program, Variable, default_main_program
from ir.data_parallel import DataParallelSource
from ir.names import EMPTY_VAR_NAME
from ir.ops.registry import find_op_def, op_has_trait, suggest
from runtime.kernels.collective import collective_axis
from runtime.kernels.registry import (RNG_SLOT, get_host_kernel, get_kernel, has_kernel, is_host_op,
                                      shape_only_slots)
from runtime.place import CPUPlace, CUDAPlace
from runtime.collective import local_value
from runtime.block_sets import block_dependency
from runtime.lod import expand_lod_feeds
from runtime.rpc.session import RPCSession
from runtime.x64 import with_x64
from runtime.scope import (ExecutionError, FeedError, FetchError, Scope, SelectedRows, ShapeDtypeError,
                           UninitializedVariableError, UntranspiledProgramError, global_scope)


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
    batch: frozenset[str] = frozenset()  # batch-major names (split over the data-parallel mesh)
    random: bool = False  # some op draws random numbers (keyed on the run counter)
    checked: list[str] = field(default_factory=list)  # outputs whose finiteness the call also returns
    fn: Any = None  # compiled on first use, when the data-parallel mesh (if any) is known
    dp: Any = None  # the runtime.collective.DataParallel it was compiled for
    args: "_ArgCache | None" = None  # the persistable arguments of the next run (Executor.run, one-run plans)
    canonical: bool | None = None  # whether its outputs are what a read of them would give (checked once)


@dataclass
class _ArgCache:
    """A one-run plan's persistable arguments for its next run (the values its last run passed, or wrote in
    their place), valid while the caller's scope and its ancestors have seen no write since that run
    (``Scope.stamp``) and the mesh is the same: then reading and converting each of them again (~3 us an
    argument; a Transformer step has 183) would give these very objects."""

    scope: "weakref.ref[Scope]"
    stamp: tuple[int, ...]
    mesh: Any
    values: dict[str, Any]

    def get(self, scope: Scope, mesh: Any) -> dict[str, Any] | None:
        if self.scope() is scope and self.mesh is mesh and scope.stamp() == self.stamp:
            return self.values
        return None


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
    collective_nranks: int | None = None  # not None: the block has collective ops (0: size not recorded)


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


@dataclass(frozen=True)
class _IdBound:
    """A fed variable read as ids of ``table`` (``height`` rows); ``padding`` (-1: none) reads zeros."""

    table: str
    height: int
    padding: int


#: Per program: (version, feed name -> the tables it indexes), a static fact of the program.
_ID_BOUNDS: "weakref.WeakKeyDictionary[Program, tuple[int, dict[str, list[_IdBound]]]]" = weakref.WeakKeyDictionary()


def _id_bounds(program: Program, block: Block) -> dict[str, list[_IdBound]]:
    """The variables of ``block`` read directly as the Ids of a lookup_table (a local table) or split for
    a distributed table's prefetch, with each table's height."""
    cached = _ID_BOUNDS.get(program)
    if cached is not None and cached[0] == program.version:
        return cached[1]
    bounds: dict[str, list[_IdBound]] = {}

    def add(ids: str, table: str, padding: int) -> None:
        var = block.find_var_recursive(table)
        if var is not None and var.shape and var.shape[0] > 0:
            bounds.setdefault(ids, []).append(_IdBound(table, int(var.shape[0]), padding))

    split_by_output = {tuple(op.output("Out")): op for op in block.ops if op.type == "split_ids"}
    for op in block.ops:
        if op.type == "lookup_table":
            add(op.input("Ids")[0], op.input("W")[0], int(op.attr("padding_idx")))
        elif op.type == "prefetch" and op.attr("table_names"):
            split = split_by_output.get(tuple(op.input("X")))
            for ids in split.input("Ids") if split is not None else ():
                add(ids, op.attr("table_names")[0], -1)
    _ID_BOUNDS[program] = (program.version, bounds)
    return bounds


def _check_ids(program: Program, block: Block, feed: Mapping[str, Any]) -> None:
    """Refuse a fed id outside its table before the compiled step: there it would read a NaN row (the
    kernel's fill), and the loss, not the input, would show the mistake. The ids are numpy already."""
    bounds = _id_bounds(program, block)
    for name, value in feed.items():
        if name not in bounds or not isinstance(value, np.ndarray) or not value.size:
            continue
        low, high = int(value.min()), int(value.max())
        for bound in bounds[name]:
            if low >= 0 and high < bound.height:
                continue
            bad = value[(value < 0) | (value >= bound.height)]
            bad = bad[bad != bound.padding] if bound.padding != -1 else bad
            if bad.size:
                raise FeedError(f"feed {name!r} holds id {int(bad.flat[0])}, outside the table {bound.table!r} of "
                                f"height {bound.height} ({bad.size} such id(s) in the batch)",
                                hint=f"ids index rows 0..{bound.height - 1}: fix the data, or enlarge the table "
                                     "(the size of layers.embedding)")


def _op_where(block: Block, i: int, op: Operator) -> str:
    return f"block {block.idx}/op {i} ({op.type})"


_LIVE: "weakref.WeakSet[Executor]" = weakref.WeakSet()  # open executors, for Fleet's stop_worker


def live_executors() -> list["Executor"]:
    """The executors of this process that are not closed (Fleet's ``stop_worker`` closes them: Fluid had
    one RPC client a process, Flotilla one an executor)."""
    return [e for e in list(_LIVE) if not e._closed]


class Executor:
    """``Executor(place).run(program, feed, fetch_list, scope)``, as Fluid's."""

    def __init__(self, place: CPUPlace | CUDAPlace | None = None) -> None:
        self.place = place or CPUPlace()
        self._device: Any = None  # resolved on first use: a collective group must form before JAX starts
        self._plans: "weakref.WeakKeyDictionary[Program, dict[Any, _Plan]]" = weakref.WeakKeyDictionary()
        self._closed = False
        self.rpc_session = RPCSession()  # this executor's pserver clients, closed with it
        _LIVE.add(self)

    @property
    def device(self) -> Any:
        """The jax device of this executor's place."""
        if self._device is None:
            self._device = self.place.device()
        return self._device

    # --- public API
    @with_x64  # the program's declared 64-bit dtypes, without changing JAX's global configuration
    def run(self, program: Program | None = None, feed: Mapping[str, Any] | None = None,
            fetch_list: Sequence[Any] | None = None, scope: Scope | None = None,
            return_numpy: bool = True, use_program_cache: bool = True) -> list[Any]:
        if self._closed:
            raise ExecutionError("this Executor is closed", hint="create a new runtime.Executor")
        program = program if program is not None else default_main_program()
        dp = None
        if isinstance(program, DataParallelSource):  # a CompiledProgram (transpiler/ builds them)
            program, kind, program_for = program.data_parallel_run()
            if kind is not None:
                from runtime import collective

                dp = collective.process_mesh() if kind == "process" else collective.device_mesh()
                program = program_for(dp.nranks)
        if not isinstance(program, Program):
            raise ExecutionError(f"Executor.run needs an ir.Program, got {type(program).__name__}")
        run_instead = program.superseded_by
        if run_instead is not None and _is_distributed_trainer():
            raise UntranspiledProgramError(f"this distributed trainer was asked to run the program handed to "
                                           f"DistributeTranspiler.transpile; run {run_instead} instead",
                                           hint="untranspiled, a startup program initialises every parameter "
                                                "locally and a main program trains alone, unseen by the rest of "
                                                "the job")
        scope = scope if scope is not None else global_scope()
        feed = dict(feed or {})
        block = program.global_block()
        fetch = [_trainer_copy_of(block, _fetch_name(f)) for f in (fetch_list or [])]
        feed = expand_lod_feeds(block, feed)  # a LoD feed becomes its bucket-padded rows and its lengths
        checked = {name: self._check_feed(block, name, value) for name, value in feed.items()}
        _check_ids(program, block, checked)
        plan = self._plan(program, tuple(sorted(feed)), tuple(fetch))
        # Feeds and temporaries live in a per-run scope: a later run that omits a feed fails instead of
        # silently reusing the previous batch. Persistable results go through to the caller's scope.
        scope = _RunScope(scope, plan.persistable)
        for name, value in checked.items():
            scope.set_var(name, value)
        if plan.collective_nranks:  # every rank must run this same program: checked once a version
            from runtime.collective import check_program
            check_program(program)
        try:
            self._execute(program, block, plan, scope, dp, cache_args=True)
            plan.runs += 1
            results = []
            for name in fetch:
                value = scope.find_var(name)
                if value is None:
                    raise FetchError(f"fetch variable {name!r} was not computed by this run",
                                     hint="fetch a variable an op of the program writes, or one in the scope")
                value = local_value(value, batch=_is_batch(block, name, plan.persistable),
                                    merge=name not in plan.persistable)
                results.append(_to_numpy(value) if return_numpy else value)
        except jax.errors.JaxRuntimeError as e:
            if dp is None and plan.collective_nranks is None:
                raise
            from runtime.collective import describe_failure

            raise describe_failure(e) from e  # a collective step failed: a peer died or hung up
        return results

    @with_x64
    def run_block(self, program: Program, block_idx: int, scope: Scope) -> None:
        """Run block ``block_idx`` of ``program`` (e.g. a pserver's optimize block) against ``scope``: reads
        fall through to ``scope``, persistable results are written to it, temporaries die with the run.
        Compiled and cached like ``run``; safe to call from several threads for different blocks."""
        if self._closed:
            raise ExecutionError("this Executor is closed", hint="create a new runtime.Executor")
        plan = self._plan(program, (), (), (block_idx,))
        self._execute(program, program.block(block_idx), plan, _RunScope(scope, plan.persistable))
        plan.runs += 1

    @with_x64
    def run_blocks(self, program: Program, block_ids: Sequence[int], scope: Scope, *,
                   keep: frozenset[str] = frozenset(), check: frozenset[str] = frozenset()) -> list[str]:
        """Run the sub-blocks ``block_ids`` of ``program`` (e.g. the optimize blocks one pserver request
        updates) as one plan: their ops concatenated in that order, so a stretch of pure ops, across
        blocks, is one compiled call. The result equals ``run_block`` of each in turn, because the set
        must be independent (``runtime.block_sets.block_dependency``; ExecutionError E689 otherwise): no block reads or
        writes what another block of the set writes, except that every block may read what the FIRST one
        writes (a learning-rate block, then computed first within the same trace).

        ``keep``: variables whose buffers are not donated (the caller's values stay intact, so a refused
        update needs no copies). ``check``: variables whose new values are checked for NaN/Inf inside the
        same compiled call; returns those of them written that hold one (in write order; [] if none).
        Cached per program version, ``block_ids``, ``keep`` and ``check``; jax caches compilations per
        input shapes, so callers keep the number of distinct sets (and of selected-rows row counts: pad
        them) small. A random op draws from its index in its own block and this set's run counter."""
        if self._closed:
            raise ExecutionError("this Executor is closed", hint="create a new runtime.Executor")
        ids = tuple(int(i) for i in block_ids)
        plan = self._plan(program, (), (), ids, frozenset(keep), frozenset(check))
        checks = self._execute(program, program.block(ids[0]), plan, _RunScope(scope, plan.persistable))
        plan.runs += 1
        return [n for names, flags in checks for n, ok in zip(names, np.asarray(flags)) if not ok]

    def close(self) -> None:
        """Release the executor; its RPC session tells every pserver it talked to that this trainer is
        done."""
        if self._closed:
            return
        self._closed = True
        self.rpc_session.close()

    # --- feeding
    def _check_feed(self, block: Block, name: str, value: Any) -> Any:
        var = block.find_var_recursive(name)
        if var is None:
            raise FeedError(f"feed variable {name!r} is not a variable of the program",
                            hint=suggest(name, block.vars) or "feed the names of layers.data variables")
        if isinstance(value, SelectedRows):
            return value
        if isinstance(value, np.ndarray) or hasattr(value, "dtype"):
            arr = value
            if str(arr.dtype) != var.dtype:
                raise ShapeDtypeError(
                    f"feed {name!r} has dtype {arr.dtype}, expected {var.dtype}",
                    hint=f"convert it with .astype('{var.dtype}')")
        else:
            try:
                arr = np.asarray(value, dtype=var.dtype)
            except (TypeError, ValueError) as e:
                raise ShapeDtypeError(f"feed {name!r} cannot be converted to {var.dtype}: {e}") from None
        shape = tuple(arr.shape)
        if len(shape) != len(var.shape) or any(d >= 0 and d != s for d, s in zip(var.shape, shape)):
            raise ShapeDtypeError(f"feed {name!r} has shape {list(shape)}, expected {list(var.shape)} (-1: any)",
                                  hint="reshape the batch to the variable's declared shape")
        return arr  # handed to the compiled call as is: one transfer with the call, not one per feed

    # --- planning
    def _plan(self, program: Program, feed: tuple[str, ...], fetch: tuple[str, ...],
              block_ids: tuple[int, ...] = (0,), keep: frozenset[str] = frozenset(),
              check: frozenset[str] = frozenset()) -> _Plan:
        per_program = self._plans.setdefault(program, {})
        key = (program.version, block_ids, feed, fetch, keep, check)
        plan = per_program.get(key)
        if plan is None:
            for stale in [k for k in per_program if k[0] != program.version]:
                del per_program[stale]  # an older version's plans are dead
            if len(block_ids) > 1:
                _check_independent(program, block_ids)
            plan = self._build_plan(program, [program.block(i) for i in block_ids], fetch, keep, check)
            per_program[key] = plan
        return plan

    def _build_plan(self, program: Program, blocks: list[Block], fetch: tuple[str, ...],
                    keep: frozenset[str] = frozenset(), check: frozenset[str] = frozenset()) -> _Plan:
        """The plan of ``blocks``' ops concatenated (one block, or an independent set of sub-blocks); see
        ``run_blocks`` for ``keep`` and ``check``."""
        block = blocks[0]
        for name in fetch:
            if block.find_var_recursive(name) is None:
                raise FetchError(f"fetch variable {name!r} is not a variable of the program",
                                 hint=suggest(name, block.vars))
        groups: list[Any] = []
        folded: dict[int, list[tuple[int, Operator]]] = {}  # id(pure group) → (position, delete_var op)
        for i, op in ((i, op) for b in blocks for i, op in enumerate(b.ops)):
            if op.type == "delete_var" and groups and isinstance(groups[-1], list):
                # Folded into the pure run it follows, which does not split (see _fold_deletes).
                folded.setdefault(id(groups[-1]), []).append((len(groups[-1]), op))
                continue
            if is_host_op(op.type):
                groups.append(_HostStep(i, op))
                continue
            if not has_kernel(op.type):
                raise ExecutionError(f"{_op_where(op.block, i, op)} has no kernel",
                                     hint="this op type cannot run on this runtime yet" if find_op_def(op.type)
                                     else suggest(op.type, []) or "the op type is not registered")
            if groups and isinstance(groups[-1], list):
                groups[-1].append((i, op))
            else:
                groups.append([(i, op)])
        # Variables needed after each step: read by later steps, fetched, or persistable.
        persistable = {n for n, v in _all_vars(program) if v.persistable}
        if any(b.idx != 0 for b in blocks):
            # A sub-block run on its own (a pserver's optimize or learning-rate block) keeps what it
            # writes into global variables: they are state shared with the other blocks.
            persistable |= set(program.global_block().vars)
        needed_later: set[str] = set(fetch)
        steps: list[Any] = []
        for group in reversed(groups):
            if isinstance(group, _HostStep):
                steps.append(group)
                if group.op.type == "delete_var":
                    needed_later -= set(group.op.input("X"))  # deleted: not needed before either
                else:
                    needed_later |= set(group.op.input_arg_names)
                continue
            deletes = folded.get(id(group), [])
            dead = _fold_deletes(group, deletes) - set(fetch)
            run = self._make_run(program, block, group, needed_later - dead, persistable - dead, keep, check)
            # Only names the scope may hold: a value the run made and does not return never reached it.
            made = {n for _, op in group for n in op.output_arg_names} - set(run.reads)
            erase = [n for _, op in deletes for n in op.input("X") if n not in run.outputs and n not in made]
            if erase:
                last = deletes[-1][1]
                if erase != last.input("X"):  # a detached delete_var of just what the run does not return
                    last = Operator(last.block, "delete_var", {"X": list(dict.fromkeys(erase))}, {}, dict(last.attrs))
                steps.append(_HostStep(group[-1][0], last))
            steps.append(run)
            needed_later |= set(run.reads)
        steps.reverse()
        nranks = [int(op.attr("nranks", 0)) for b in blocks for op in b.ops
                  if op_has_trait(op.type, "collective") and not op_has_trait(op.type, "host")]
        return _Plan(steps, program.random_seed, frozenset(persistable), fetch=list(fetch),
                     collective_nranks=(max(nranks) if nranks else None))

    def _make_run(self, program: Program, block: Block, ops: list[tuple[int, Operator]],
                  needed_later: set[str], persistable: set[str], keep: frozenset[str] = frozenset(),
                  check: frozenset[str] = frozenset()) -> _PureRun:
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
        donated = [n for n in reads if n in persistable and n in written and n not in keep]
        kept = [n for n in reads if n not in donated]
        batch = frozenset(n for n in reads + outputs if _is_batch(block, n, persistable))
        return _PureRun(ops, reads, donated, kept, outputs, batch, any(_is_random(op) for _, op in ops),
                        checked=[n for n in outputs if n in check])

    def _compile(self, run: _PureRun, block: Block, dp: Any) -> Any:
        """One jitted function for ``run``; under ``shard_map`` over ``dp``'s mesh when given."""
        if dp is None:
            return jax.jit(_trace_run(run, block, None), donate_argnums=(0,))
        from jax.sharding import PartitionSpec as P

        from runtime.collective import AXIS, shared_arena

        def specs(names: list[str]) -> tuple[Any, ...]:
            return tuple(dp.spec(n in run.batch) for n in names)

        body = jax.shard_map(_trace_run(run, block, AXIS, shared_arena(dp)), mesh=dp.mesh,
                             in_specs=(specs(run.donated), specs(run.kept), P()),
                             out_specs=specs(run.outputs), check_vma=False)
        return jax.jit(body, donate_argnums=(0,))

    def _data_parallel(self, plan: _Plan, dp: Any) -> Any:
        """The mesh a plan's pure runs use: ``dp`` (a CompiledProgram's), one device per trainer process
        for a block with collective ops, or None (an ordinary single-device run)."""
        if dp is None and plan.collective_nranks is None:
            return None
        from runtime import collective

        mesh = dp if dp is not None else collective.process_mesh()
        want = plan.collective_nranks
        if want and want != mesh.nranks:
            group = collective.current_group()
            raise collective.CollectiveError(
                f"the program was transpiled for {want} trainers, but this process runs in a group of "
                f"{mesh.nranks} rank(s)" + ("" if group else " (it has not joined a trainer group)"),
                hint="run the trainer startup program first (its gen_nccl_id joins the group), under "
                     f"'flotilla launch --nproc_per_node {want}' or with PADDLE_TRAINER_ENDPOINTS listing "
                     f"{want} trainers; a ParallelExecutor over several local devices needs the untranspiled "
                     "program")
        return mesh

    # --- execution
    def _execute(self, program: Program, block: Block, plan: _Plan, scope: Scope,
                 dp: Any = None, cache_args: bool = False) -> list[tuple[list[str], Any]]:
        """Run ``plan``; returns (checked names, their finiteness flags) of each pure run that checks any.
        ``cache_args`` (``run``; ``scope`` is a ``_RunScope``): a plan of one pure run keeps its persistable
        arguments for the next run (``_ArgCache``)."""
        checks: list[tuple[list[str], Any]] = []
        mesh: Any = False  # resolved at the first pure run (after gen_nccl_id may have formed the group)
        cacheable = cache_args and len(plan.steps) == 1
        for step in plan.steps:
            if isinstance(step, _HostStep):
                get_host_kernel(step.op.type)(HostContext(self, scope, program, step.op.block), step.op)
                continue
            if mesh is False:
                mesh = self._data_parallel(plan, dp)
            if step.fn is None or step.dp is not mesh:
                step.fn, step.dp = self._compile(step, block, mesh), mesh
            donated, kept = self._arguments(scope, block, step, plan, mesh, cacheable)
            if mesh is None:
                outs = step.fn(donated, kept, np.uint32(plan.runs))
            else:  # the run counter only keys random ops: a run without any takes one cached global zero
                outs = step.fn(donated, kept, mesh.counter(plan.runs if step.random else 0))
            if step.checked:
                checks.append((step.checked, outs[-1]))
            for name, value in zip(step.outputs, outs):
                scope.set_var(name, value)
            if cacheable:
                step.args = self._next_arguments(scope, step, plan, mesh, donated, kept, outs)
        return checks

    def _arguments(self, scope: Scope, block: Block, step: _PureRun, plan: _Plan, mesh: Any,
                   cacheable: bool) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The donated and kept arguments of ``step``: read from ``scope`` (over a mesh: as global arrays,
        a converted persistable kept in the scope so the next step takes it as it is), persistable ones
        from the step's ``_ArgCache`` when it is valid."""
        cached = step.args.get(scope.parent, mesh) if cacheable and step.args is not None else None
        step.args = None  # a call that fails after donating must not leave deleted buffers cached

        def read(name: str, donate: bool) -> Any:
            if mesh is None:
                return self._read(scope, block, step, name, donate=donate)
            held = self._read(scope, block, step, name, local=False)
            value = mesh.to_global(held, name in step.batch)
            if value is not held and name in plan.persistable:
                scope.set_var(name, value)
            return value

        if cached is None:
            return (tuple(read(n, True) for n in step.donated), tuple(read(n, False) for n in step.kept))
        return (tuple(cached[n] if n in cached else read(n, True) for n in step.donated),
                tuple(cached[n] if n in cached else read(n, False) for n in step.kept))

    def _next_arguments(self, scope: Scope, step: _PureRun, plan: _Plan, mesh: Any, donated: tuple[Any, ...],
                        kept: tuple[Any, ...], outs: Sequence[Any]) -> _ArgCache | None:
        """After a run of a one-run plan: its persistable arguments for the next run (what it wrote in
        their place, or what it passed), or None when a read would not give its outputs back as they are
        (decided once a step)."""
        made = dict(zip(step.outputs, outs))
        values: dict[str, Any] = {}
        for names, given in ((step.donated, donated), (step.kept, kept)):
            for name, value in zip(names, given):
                if name in plan.persistable:
                    values[name] = made.get(name, value)
        if step.canonical is None:
            step.canonical = all(_as_read(values[n], n in step.batch, mesh) for n in values if n in made)
        if not step.canonical:
            return None
        owner = scope.parent
        assert owner is not None  # a _RunScope over the caller's scope
        return _ArgCache(weakref.ref(owner), owner.stamp(), mesh, values)

    def _read(self, scope: Scope, block: Block, run: _PureRun, name: str, donate: bool = False,
              local: bool = True) -> Any:
        value = scope.find_var(name)
        if value is None:
            var = block.find_var_recursive(name)
            reader = next((f"{_op_where(op.block, i, op)}" for i, op in run.ops if name in op.input_arg_names), "?")
            if var is not None and var.is_data:
                raise FeedError(f"feed variable {name!r} is missing (read by {reader})",
                                hint=f"pass feed={{'{name}': ...}} to Executor.run")
            if var is not None and var.persistable:
                raise UninitializedVariableError(
                    f"persistable variable {name!r} is not initialised (read by {reader})",
                    hint="run the startup program first, or load the parameters")
            raise UninitializedVariableError(f"variable {name!r} has no value (read by {reader})")
        if local and _on_mesh(value):
            # A data-parallel run's value read by an ordinary run (e.g. evaluation on one trainer): use
            # this process's own copy; a donated one is copied so the mesh's array stays intact.
            value = local_value(value, batch=name in run.batch)
            return jax.numpy.array(value, copy=True) if donate else value
        if isinstance(value, (jax.Array, SelectedRows)) or (isinstance(value, np.ndarray) and not donate):
            return value
        # A value set by the user (numpy, a Python number): keep a device copy, which can be donated.
        value = jax.device_put(np.asarray(value), self.device)
        scope.set_var(name, value)
        return value


def _trace_run(run: _PureRun, block: Block, axis: str | None, arena: Any = None) -> Any:
    # A run of several blocks' ops (Executor.run_blocks) keys each op's draws on its index in its block.
    deletes_before = {b.idx: _deletes_before(b) for b in {id(op.block): op.block for _, op in run.ops}.values()}
    ops = [(i, op, get_kernel(op.type), dict(op.attrs), _is_random(op)) for i, op in run.ops]
    program_seed = block.program.random_seed

    def fn(donated: tuple[Any, ...], kept: tuple[Any, ...], runs: Any) -> tuple[Any, ...]:
        with collective_axis(axis, arena):
            return body(donated, kept, runs)

    def body(donated: tuple[Any, ...], kept: tuple[Any, ...], runs: Any) -> tuple[Any, ...]:
        env: dict[str, Any] = dict(zip(run.donated, donated))
        env.update(zip(run.kept, kept))
        key = jax.random.fold_in(jax.random.PRNGKey(program_seed), runs) if any(r for *_, r in ops) else None
        if key is not None and axis is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(axis))
        for i, op, kern, attrs, random in ops:
            shape_only = shape_only_slots(op.type)
            ins = {slot: [env[n] if slot not in shape_only else _declared(op.block, n) for n in names
                          if n != EMPTY_VAR_NAME]
                   for slot, names in op.inputs.items()}
            if random:
                # Fluid's dropout honours its seed only with fix_seed; other random ops always do.
                op_seed = attrs.get("seed", 0) if attrs.get("fix_seed", True) else 0
                ins[RNG_SLOT] = [jax.random.PRNGKey(op_seed) if op_seed
                                 else jax.random.fold_in(key, i - deletes_before[op.block.idx][i])]
            try:
                outs = kern(ins, attrs)
            except ExecutionError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with the op's location
                raise ExecutionError(f"{_op_where(op.block, i, op)} failed: {type(e).__name__}: {e}") from e
            for slot, names in op.outputs.items():
                values = outs.get(slot)
                if values is None:
                    if any(n != EMPTY_VAR_NAME for n in names):
                        raise ExecutionError(f"{_op_where(op.block, i, op)}: its kernel produced no {slot!r} output")
                    continue
                if len(values) != len(names):
                    raise ExecutionError(f"{_op_where(op.block, i, op)}: its kernel produced {len(values)} {slot!r} "
                                         f"values for {len(names)} variables")
                for n, v in zip(names, values):
                    if n != EMPTY_VAR_NAME:
                        env[n] = v
        outs = tuple(env[n] for n in run.outputs)
        if run.checked:  # one flag a checked output, computed in this same compiled call
            outs += (jax.numpy.stack([_finite(env[n]) for n in run.checked]),)
        return outs

    return fn


def _check_independent(program: Program, block_ids: tuple[int, ...]) -> None:
    why = block_dependency(program, block_ids)
    if why is not None:
        raise ExecutionError(f"Executor.run_blocks of blocks {list(block_ids)}: {why}; they depend on each other "
                             "and cannot run as one plan", code="E689",
                             hint="run them one by one with run_block, or pass only independent blocks (only the "
                                  "first block's results, e.g. a learning rate, may be read by the others)")


def _finite(value: Any) -> Any:
    """Whether every value of ``value`` (an array or selected rows; traced) is finite; True if not floating."""
    arr = value.values if isinstance(value, SelectedRows) else value
    if not jax.numpy.issubdtype(arr.dtype, jax.numpy.floating):
        return jax.numpy.bool_(True)
    return jax.numpy.isfinite(arr).all()


def _deletes_before(block: Block) -> list[int]:
    """For each op index, how many ``delete_var`` ops come before it (random keys skip them)."""
    out, count = [], 0
    for op in block.ops:
        out.append(count)
        count += op.type == "delete_var"
    return out


def _trainer_copy_of(block: Block, name: str) -> str:
    """``name`` itself, or, when the program has no such variable but holds this trainer's copy of it (a
    sync pserver trainer sends ``w@GRAD`` as ``w@GRAD.trainer_<id>``), that copy: users fetch the name
    they wrote. The relation is read from the copy's ``copy_of``/``trainer_id``, never from the name."""
    if block.find_var_recursive(name) is not None:
        return name
    copies = [v.name for v in block.vars.values() if v.copy_of == name and v.trainer_id is not None]
    return copies[0] if len(copies) == 1 else name


def _is_batch(block: Block, name: str, persistable: frozenset[str] | set[str]) -> bool:
    """Batch-major: split along dim 0 over a data-parallel mesh (declared dim 0 is -1, not persistable)."""
    if name in persistable:
        return False
    var = block.find_var_recursive(name)
    return var is not None and bool(var.shape) and var.shape[0] == -1 and var.type != "selected_rows"


def _as_read(value: Any, batch: bool, mesh: Any) -> bool:
    """Whether reading ``value`` (a run's output) as the next run's argument gives it back unchanged."""
    if not isinstance(value, jax.Array):
        return False
    return not _on_mesh(value) if mesh is None else mesh.to_global(value, batch) is value


def _on_mesh(value: Any) -> bool:
    if isinstance(value, SelectedRows):
        return _on_mesh(value.values)
    return isinstance(value, jax.Array) and len(value.sharding.device_set) > 1


def _fold_deletes(group: list[tuple[int, Operator]], deletes: list[tuple[int, Operator]]) -> set[str]:
    """``delete_var`` ops folded into a pure run (``(position in the run, op)``): the names dead when the
    run ends (deleted, and not written again by a later op of the run). The run does not return them,
    and an erase step after it drops them (and any value of theirs from before the run) from the scope."""
    dead: set[str] = set()
    for pos, op in deletes:
        for n in op.input("X"):
            if not any(n in later.output_arg_names for _, later in group[pos:]):
                dead.add(n)
    return dead


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
    raise FetchError(f"fetch_list items must be variables or names, got {type(f).__name__} {f!r}")


def _is_distributed_trainer() -> bool:
    """Whether this process's role (Paddle's environment variables) is a trainer of a distributed job."""
    from runtime.role import role_from_env

    role = role_from_env()
    return role.is_trainer and (role.is_distributed or len(role.trainer_endpoints) > 1)


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, SelectedRows):
        value = value.to_dense()
    return np.array(value)  # a copy: donated buffers may be reused by the next run
