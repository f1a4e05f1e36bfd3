"""``DistributeTranspiler``: the Paddle-compatible façade over the parameter-server pass pipeline.

``transpile`` validates its arguments, clones the caller's programs (they are never modified), runs
the pipeline ``collect_params → slice_variables → place_blocks → trainer_send_recv →
trainer_startup → pserver_program → pserver_startup → distributed_table`` under a PassManager, then
checks the whole ProgramSet with ``ir.verify.verify_program_set``. The ``get_*`` methods return
clones of the stored results, so they can be called in any order and any number of times.
``FLOTILLA_PRINT_IR_AFTER`` (``all`` or pass names) is read once, when the transpiler is created.
"""
from __future__ import annotations

import gc
import os
import sys
from typing import Any

from ir.core import Program, default_main_program, default_startup_program
from ir.program_set import ProgramSet
from ir.verify import verify_program_set

from passes import default_pipeline
from passes.dist_plan import DistPlan
from passes.pass_base import Instrument, PassContext, PassManager, PrintIRAfter, Timing
from passes.pserver_program import pserver_role
from passes.trainer_send_recv import trainer_role
from transpiler.config import (
    DistributeTranspilerConfig,
    TranspilerError,
    check_endpoint,
    check_trainers,
    parse_endpoints,
)


class DistributeTranspiler:
    """Turns one training program into a trainer program and one program per pserver."""

    def __init__(self, config: DistributeTranspilerConfig | None = None) -> None:
        if config is not None and not isinstance(config, DistributeTranspilerConfig):
            raise TranspilerError(f"config must be a DistributeTranspilerConfig, got {type(config).__name__}",
                                  code="E710")
        self.config = (config or DistributeTranspilerConfig()).validated()
        self._print_ir_after = os.environ.get("FLOTILLA_PRINT_IR_AFTER", "")
        self._programs: ProgramSet | None = None
        self._plan: DistPlan | None = None
        self.timings: dict[str, float] = {}
        self.warnings: list[str] = []

    # --- transpile
    def transpile(self, trainer_id: int, program: Program | None = None, pservers: Any = "127.0.0.1:6174",
                  trainers: int = 1, sync_mode: bool = True, startup_program: Program | None = None,
                  current_endpoint: str = "127.0.0.1:6174") -> None:
        """Build every role's programs (see the module docstring); the inputs are not modified."""
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
                   startup_program: Program | None, current_endpoint: str) -> None:
        program = default_main_program() if program is None else program
        startup_program = default_startup_program() if startup_program is None else startup_program
        for what, p in (("program", program), ("startup_program", startup_program)):
            if not isinstance(p, Program):
                raise TranspilerError(f"{what} must be a Program, got {type(p).__name__}", code="E712")
        eps = parse_endpoints(pservers)
        trainers, trainer_id = check_trainers(trainers, trainer_id)
        if current_endpoint is not None:
            check_endpoint(current_endpoint)
        if self.config.enable_dc_asgd and sync_mode:
            raise TranspilerError("enable_dc_asgd needs asynchronous training, but sync_mode is True",
                                  hint="pass sync_mode=False, or disable enable_dc_asgd", code="E709")
        origin_main, origin_startup = program.clone(), startup_program.clone()
        plan = DistPlan(trainer_id=trainer_id, trainers=trainers, sync_mode=bool(sync_mode), pservers=eps,
                        slice_var_up=self.config.slice_var_up, min_block_size=self.config.min_block_size,
                        enable_dc_asgd=self.config.enable_dc_asgd)
        ctx = PassContext(origin_main=origin_main, origin_startup=origin_startup, plan=plan,
                          dispatcher=self.config.split_method(list(eps)))
        programs = ProgramSet()
        programs.add(trainer_role(trainer_id), origin_main.clone(), origin_startup.clone())
        instruments: list[Instrument] = [Timing()]
        if self._print_ir_after:
            instruments.append(PrintIRAfter(self._print_ir_after))
        PassManager(default_pipeline(), instruments).run(programs, ctx)
        verify_program_set(programs)
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
        for role, progs in src.items():
            out.add(role, progs.main.clone(), progs.startup.clone())
        return out

    def _role(self, endpoint: str) -> str:
        if not isinstance(endpoint, str) or endpoint not in self.plan.pservers:
            raise TranspilerError(f"endpoint {endpoint!r} is not one of the pservers {list(self.plan.pservers)}",
                                  hint="pass one of the endpoints given to transpile(pservers=...)", code="E706")
        return pserver_role(endpoint)

    def get_trainer_program(self, wait_port: bool = True) -> Program:
        """The trainer's main program.

        ``wait_port`` is accepted for Paddle compatibility. Unlike Fluid, transpiling never touches the
        network: the runtime waits (bounded, naming the missing endpoints) for the pservers before its
        first RPC, so a program can be transpiled and inspected on a machine with no cluster.
        """
        return self._done()[trainer_role(self.plan.trainer_id)].main.clone()

    def get_trainer_startup_program(self) -> Program:
        return self._done()[trainer_role(self.plan.trainer_id)].startup.clone()

    def get_pserver_program(self, endpoint: str) -> Program:
        return self._done()[self._role(endpoint)].main.clone()

    def get_startup_program(self, endpoint: str, pserver_program: Program | None = None,
                            startup_program: Program | None = None) -> Program:
        """The pserver's startup program (``pserver_program`` and ``startup_program`` are accepted
        for Paddle compatibility and not needed)."""
        return self._done()[self._role(endpoint)].startup.clone()

    def get_pserver_programs(self, endpoint: str) -> tuple[Program, Program]:
        return self.get_pserver_program(endpoint), self.get_startup_program(endpoint)


