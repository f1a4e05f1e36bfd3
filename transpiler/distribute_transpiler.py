"""``DistributeTranspiler``: the Paddle-compatible façade over the distributed pass pipelines.

``transpile`` validates its arguments, clones the caller's programs (see below for when they change), runs a
pipeline under a PassManager, then checks the whole ProgramSet with ``ir.verify.verify_program_set``.
In ``pserver`` mode the pipeline is ``collect_params → slice_variables → place_blocks →
trainer_send_recv → trainer_startup → pserver_program → pserver_startup → distributed_table`` (with
``geo_sgd_mode`` the trainer keeps every optimizer, the distributed table's too, and syncs parameter
and touched-row deltas every k steps, and ``geo_sgd_startup`` follows ``trainer_startup``); in
``nccl2``/``collective`` mode (``trainers`` is then the comma-separated trainer endpoints, as in Fluid)
it is ``collective_startup → grad_allreduce`` (or ``local_sgd``) and there are no pserver programs. In
``hybrid`` mode ``trainers`` is the trainer endpoints too and ``pservers`` the pserver endpoints: the pserver
pipeline runs over a plan that moves only the distributed lookup table to the pservers (no
``trainer_startup``), then ``collective_startup → grad_allreduce`` over the dense gradients that stay
(``passes.hybrid_pipeline``); ``sync_mode`` applies to the table.
The ``get_*`` methods return clones of the stored results, so they can be called in any order and any
number of times.

In-place transpile (Fluid 1.5's rule), a separate last step: when ``program`` (or ``startup_program``) is
not given, the default program it stands for is rewritten **in place** into the trainer's program (the
same object then holds the trainer main / startup program), so ``exe.run(default_startup_program())``
and ``exe.run(default_main_program())`` run the right thing on a trainer; ``in_place = True`` (what
``flotilla.fluid.DistributeTranspiler`` sets) applies that rule to programs passed explicitly too.
A program given explicitly to the native API is untouched but marked (``Program.superseded_by``), and
``runtime.Executor`` refuses to run a marked program in a distributed trainer process, naming the
``get_*`` method whose result to run instead. Transpiling an in-place-rewritten program again starts from
its origin (``_IN_PLACE_ORIGINS``, while it is unchanged since), so a second call gives the same programs. (E716: a
result with fewer blocks than the program to rewrite, which the passes never produce.)
``FLOTILLA_PRINT_IR_AFTER`` (``all`` or pass names) is read once, when the transpiler is created.
"""
from __future__ import annotations

import gc
import os
import sys
import weakref
from typing import Any, NamedTuple

from ir import endpoints
from ir.core import Program, default_main_program, default_startup_program
from ir.program_set import ProgramRole, ProgramSet
from ir.verify import verify_program_set

from passes import collective_pipeline, default_pipeline, hybrid_pipeline
from passes.collective_plan import CollectivePlan
from passes.dgc import has_dgc
from passes.dist_plan import DistPlan
from passes.geo_sgd_startup import GeoSgdStartup
from passes.pass_base import Instrument, PassContext, PassManager, PrintIRAfter, Timing
from passes.trainer_startup import TrainerStartup
from transpiler.config import (
    DistributeTranspilerConfig,
    TranspilerError,
    check_endpoint,
    check_trainers,
    parse_endpoints,
)


class DistributeTranspiler:
    """Turns one training program into a trainer program and one program per pserver."""

    #: Rewrite the given programs in place even when passed explicitly (Fluid 1.5's rule; the default
    #: programs, meant when ``program``/``startup_program`` is omitted, are always rewritten in place).
    in_place: bool = False

    def __init__(self, config: DistributeTranspilerConfig | None = None) -> None:
        if config is not None and not isinstance(config, DistributeTranspilerConfig):
            raise TranspilerError(f"config must be a DistributeTranspilerConfig, got {type(config).__name__}",
                                  code="E718")
        self.config = (config or DistributeTranspilerConfig()).validated()
        self._print_ir_after = os.environ.get("FLOTILLA_PRINT_IR_AFTER", "")
        self._programs: ProgramSet | None = None
        self._plan: DistPlan | None = None
        self.timings: dict[str, float] = {}
        self.warnings: list[str] = []

    # --- transpile
    def transpile(self, trainer_id: int, program: Program | None = None, pservers: Any = "127.0.0.1:6174",
                  trainers: int = 1, sync_mode: bool = True, startup_program: Program | None = None,
                  current_endpoint: str | None = None) -> None:
        """Build every role's programs (see the module docstring). A program passed explicitly is not
        modified (unless ``in_place``); an omitted one means the default program, rewritten in place.

        ``config.sync_mode`` (or ``completely_not_async``), when set, wins over the ``sync_mode`` argument.
        In the collective modes ``trainers`` lists every trainer's endpoint (``"ip:port,ip:port"``),
        ``pservers`` and ``sync_mode`` are ignored, and ``current_endpoint`` (default: entry
        ``trainer_id`` of ``trainers``) must be this trainer's entry. In hybrid mode ``trainers`` is that
        list too, and ``pservers`` and ``sync_mode`` are those of the distributed table."""
        # The passes allocate many small long-lived objects and no cycles worth collecting; the cyclic
        # GC walking that growing heap made 3,000-parameter programs ~18x slower (bench/transpile_bench.py).
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._transpile(trainer_id, program, pservers, trainers, sync_mode, startup_program, current_endpoint)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _transpile(self, trainer_id: int, program: Program | None, pservers: Any, trainers: int, sync_mode: bool,
                   startup_program: Program | None, current_endpoint: str | None) -> None:
        main_in_place, startup_in_place = self.in_place or program is None, self.in_place or startup_program is None
        program = default_main_program() if program is None else program
        startup_program = default_startup_program() if startup_program is None else startup_program
        for what, p in (("program", program), ("startup_program", startup_program)):
            if not isinstance(p, Program):
                raise TranspilerError(f"{what} must be a Program, got {type(p).__name__}", code="E712")
        targets = (program, main_in_place), (startup_program, startup_in_place)
        sources = [_origin_of(p) if in_place else p for p, in_place in targets]
        program, startup_program = sources
        if self.config.is_collective:
            self._transpile_collective(trainer_id, program, startup_program, trainers, current_endpoint)
        elif self.config.is_hybrid:
            self._transpile_hybrid(trainer_id, program, startup_program, pservers, trainers, sync_mode,
                                   current_endpoint)
        else:
            self._transpile_pserver(trainer_id, program, startup_program, pservers, trainers, sync_mode,
                                    current_endpoint)
        role = self._done()[ProgramRole.trainer(self.plan.trainer_id)]
        getters = ("get_trainer_program()", "get_trainer_startup_program()")
        for (target, in_place), source, result, getter in zip(targets, sources, (role.main, role.startup), getters):
            if in_place:
                _rewrite_in_place(target, result, source.clone() if source is target else source)
            else:
                target.superseded_by = f"the result of DistributeTranspiler.{getter}"

    def _transpile_pserver(self, trainer_id: int, program: Program, startup_program: Program, pservers: Any,
                           trainers: int, sync_mode: bool, current_endpoint: str | None) -> None:
        eps = parse_endpoints(pservers)
        trainers, trainer_id = check_trainers(trainers, trainer_id)
        if current_endpoint is not None:
            check_endpoint(current_endpoint)
        sync_mode = self.config.effective_sync_mode(sync_mode)
        if self.config.enable_dc_asgd and sync_mode:
            raise TranspilerError("enable_dc_asgd needs asynchronous training, but sync_mode is True",
                                  hint="pass sync_mode=False, or disable enable_dc_asgd", code="E709")
        if self.config.geo_sgd_mode and sync_mode:
            raise TranspilerError("geo_sgd_mode needs asynchronous training, but sync_mode is True",
                                  hint="pass sync_mode=False, or disable geo_sgd_mode", code="E717")
        if has_dgc(program):
            raise TranspilerError("DGCMomentumOptimizer (dgc ops) is only supported in collective training; "
                                  "the pserver mode cannot run it (Fluid 1.6 likewise supports DGC in nccl2 mode only)",
                                  hint='transpile with config.mode = "nccl2" (or "collective"), or use '
                                       "MomentumOptimizer with parameter servers", code="E772")
        origin_main, origin_startup = program.clone(), startup_program.clone()
        plan = DistPlan(trainer_id=trainer_id, trainers=trainers, sync_mode=bool(sync_mode), pservers=eps,
                        slice_var_up=self.config.slice_var_up, min_block_size=self.config.min_block_size,
                        enable_dc_asgd=self.config.enable_dc_asgd,
                        geo_sgd_push_nums=self.config.geo_sgd_need_push_nums if self.config.geo_sgd_mode else 0)
        ctx = PassContext(origin_main=origin_main, origin_startup=origin_startup, plan=plan,
                          dispatcher=self.config.split_method(list(eps)))
        programs = ProgramSet()
        programs.add(ProgramRole.trainer(trainer_id), origin_main.clone(), origin_startup.clone())
        pipeline = default_pipeline()
        if plan.geo_sgd:
            at = next(i for i, p in enumerate(pipeline) if isinstance(p, TrainerStartup)) + 1
            pipeline.insert(at, GeoSgdStartup())
        self._run_pipeline(pipeline, programs, ctx)

    def _trainer_group(self, trainer_id: Any, trainers: Any, current_endpoint: str | None) -> CollectivePlan:
        """The collective plan of this trainer: ``trainers`` is every trainer's endpoint, in rank order."""
        if isinstance(trainers, int) and not isinstance(trainers, bool):
            raise TranspilerError(f"trainers is {trainers!r}, but mode {self.config.mode!r} needs every trainer's "
                                  "endpoint", hint='pass trainers="ip:port,ip:port" (one endpoint a trainer, in rank '
                                                   'order), as Fluid does in nccl2 mode', code="E702")
        eps = parse_endpoints(trainers, what="trainers")
        _, trainer_id = check_trainers(len(eps), trainer_id)
        if current_endpoint is not None and check_endpoint(current_endpoint) != eps[trainer_id]:
            raise TranspilerError(f"current_endpoint {current_endpoint!r} is not entry {trainer_id} of trainers "
                                  f"({eps[trainer_id]!r}) for trainer_id {trainer_id}",
                                  hint="trainer i's endpoint is entry i of trainers; fix trainer_id or "
                                       "current_endpoint", code="E703")
        cfg = self.config
        return CollectivePlan(trainer_id=trainer_id, endpoints=eps, kind=cfg.collective_mode or "grad_allreduce",
                              fuse_grad_size_mb=cfg.fuse_grad_size_in_MB, local_sgd_steps=cfg.local_sgd_steps,
                              nccl_comm_num=cfg.nccl_comm_num)

    def _transpile_collective(self, trainer_id: Any, program: Program, startup_program: Program, trainers: Any,
                              current_endpoint: str | None) -> None:
        coll = self._trainer_group(trainer_id, trainers, current_endpoint)
        trainer_id, eps = coll.trainer_id, coll.endpoints
        origin_main, origin_startup = program.clone(), startup_program.clone()
        plan = DistPlan(trainer_id=trainer_id, trainers=len(eps), sync_mode=True, pservers=())
        ctx = PassContext(origin_main=origin_main, origin_startup=origin_startup, plan=plan, collective=coll)
        programs = ProgramSet()
        programs.add(ProgramRole.trainer(trainer_id), origin_main.clone(), origin_startup.clone())
        self._run_pipeline(collective_pipeline(coll.kind), programs, ctx)

    def _transpile_hybrid(self, trainer_id: Any, program: Program, startup_program: Program, pservers: Any,
                          trainers: Any, sync_mode: bool, current_endpoint: str | None) -> None:
        coll = self._trainer_group(trainer_id, trainers, current_endpoint)
        eps = parse_endpoints(pservers)
        shared = [ep for ep in eps if ep in coll.endpoints]
        if shared:
            raise TranspilerError(f"endpoint {shared[0]!r} is both a pserver and a trainer",
                                  hint="every process of a hybrid job needs an endpoint of its own (the trainers' "
                                       "endpoints form the allreduce group)", code="E722")
        origin_main, origin_startup = program.clone(), startup_program.clone()
        plan = DistPlan(trainer_id=coll.trainer_id, trainers=coll.nranks, sync_mode=self.config.effective_sync_mode(
            sync_mode), pservers=eps, slice_var_up=self.config.slice_var_up, min_block_size=self.config.min_block_size,
                        hybrid=True)
        ctx = PassContext(origin_main=origin_main, origin_startup=origin_startup, plan=plan,
                          dispatcher=self.config.split_method(list(eps)), collective=coll)
        programs = ProgramSet()
        programs.add(ProgramRole.trainer(coll.trainer_id), origin_main.clone(), origin_startup.clone())
        self._run_pipeline(hybrid_pipeline(), programs, ctx)

    def _run_pipeline(self, pipeline: list[Any], programs: ProgramSet, ctx: PassContext) -> None:
        instruments: list[Instrument] = [Timing()]
        if self._print_ir_after:
            instruments.append(PrintIRAfter(self._print_ir_after))
        PassManager(pipeline, instruments).run(programs, ctx)
        verify_program_set(programs, cache=ctx.verify_cache)
        self._programs, self._plan = programs, ctx.plan
        self.timings, self.warnings = dict(ctx.timings), list(ctx.warnings)
        if self.config.print_log:
            for name, secs in self.timings.items():
                print(f"transpile: pass {name} took {secs * 1e3:.2f} ms", file=sys.stderr)

    # --- results
    def _done(self) -> ProgramSet:
        if self._programs is None:
            raise TranspilerError("transpile() has not been called", hint="call transpile(...) first", code="E713")
        return self._programs

    @property
    def plan(self) -> DistPlan:
        self._done()
        assert_plan = self._plan
        if assert_plan is None:
            raise TranspilerError("no plan", code="E713")
        return assert_plan

    @property
    def program_set(self) -> ProgramSet:
        """A copy of every role's programs (trainer first, then the pservers in order)."""
        src = self._done()
        out = ProgramSet()
        for _, progs in src.items():
            out.add(progs.role, progs.main.clone(), progs.startup.clone())
        return out

    def _role(self, endpoint: str) -> ProgramRole:
        if self.config.is_collective:
            raise TranspilerError(f"mode {self.config.mode!r} has no parameter servers, so there is no pserver "
                                  f"program for {endpoint!r}",
                                  hint="every process is a trainer: use get_trainer_program() and "
                                       "get_trainer_startup_program()", code="E714")
        hint = "pass one of the endpoints given to transpile(pservers=...)"
        try:  # "127.0.0.1:06174 " names 127.0.0.1:6174 too
            endpoint = endpoints.canonical_endpoint(endpoint, "endpoint")
        except endpoints.EndpointSyntaxError as err:
            hint = f"{err.message}; {hint}"
        if not isinstance(endpoint, str) or endpoint not in self.plan.pservers:
            raise TranspilerError(f"endpoint {endpoint!r} is not one of the pservers {list(self.plan.pservers)}",
                                  hint=hint, code="E706")
        return ProgramRole.pserver(endpoint)

    def get_trainer_program(self, wait_port: bool = True) -> Program:
        """The trainer's main program.

        ``wait_port`` is accepted for Paddle compatibility. Unlike Fluid, transpiling never touches the
        network: the runtime waits (bounded, naming the missing endpoints) for the pservers before its
        first RPC, so a program can be transpiled and inspected on a machine with no cluster.
        """
        return self._done()[ProgramRole.trainer(self.plan.trainer_id)].main.clone()

    def get_trainer_startup_program(self) -> Program:
        return self._done()[ProgramRole.trainer(self.plan.trainer_id)].startup.clone()

    def get_pserver_program(self, endpoint: str) -> Program:
        return self._done()[self._role(endpoint)].main.clone()

    def get_startup_program(self, endpoint: str, pserver_program: Program | None = None,
                            startup_program: Program | None = None) -> Program:
        """The pserver's startup program (``pserver_program`` and ``startup_program`` are accepted
        for Paddle compatibility and not needed)."""
        return self._done()[self._role(endpoint)].startup.clone()

    def get_pserver_programs(self, endpoint: str) -> tuple[Program, Program]:
        return self.get_pserver_program(endpoint), self.get_startup_program(endpoint)


# --- in-place transpile (Fluid 1.5's rule; see the module docstring) --------------------------------------
class _InPlaceOrigin(NamedTuple):
    """What a program rewritten in place was transpiled from, and its version right after the rewrite."""

    origin: Program
    version: int


# Every program rewritten in place, weakly (a dead program's entry goes with it), over every transpiler:
# a second transpiler given the default program must start from the same origin as the first.
_IN_PLACE_ORIGINS: "weakref.WeakKeyDictionary[Program, _InPlaceOrigin]" = weakref.WeakKeyDictionary()


def _origin_of(program: Program) -> Program:
    """What to transpile for a program rewritten in place: its stored origin while it is unchanged since an
    earlier in-place transpile (so transpiling twice gives the same programs), else the program itself."""
    stored = _IN_PLACE_ORIGINS.get(program)
    if stored is not None and stored.version == program.version:
        return stored.origin
    return program


def _rewrite_in_place(target: Program, result: Program, origin: Program) -> None:
    """Make ``target`` (the same object) hold a copy of ``result``, through the Block API; remember the
    ``origin`` it was transpiled from and drop any mark from an earlier native transpile."""
    if target.num_blocks > result.num_blocks:
        raise TranspilerError(f"cannot rewrite a {target.num_blocks}-block program in place with a "
                              f"{result.num_blocks}-block result", hint="pass program= and use the get_* results",
                              code="E716")
    while target.num_blocks < result.num_blocks:
        target.create_block(result.block(target.num_blocks).parent_idx)
    while target.current_block().idx != 0:
        target.rollback()
    for dst, src in zip(target.blocks, result.blocks):
        for index in range(len(dst.ops) - 1, -1, -1):
            dst.remove_op(index)
        for name in list(dst.vars):
            dst.remove_var(name)
        for var in src.vars.values():
            dst.add_var(var)
        for op in src.ops:
            # Exactly as transpiled (already verified): no defaults added, no shape inference re-run.
            dst._append_raw_op(op.type, {k: list(v) for k, v in op.inputs.items()},
                               {k: list(v) for k, v in op.outputs.items()},
                               {k: list(v) if isinstance(v, list) else v for k, v in op.attrs.items()})
    target.random_seed = result.random_seed
    _IN_PLACE_ORIGINS[target] = _InPlaceOrigin(origin, target.version)
    target.superseded_by = None


