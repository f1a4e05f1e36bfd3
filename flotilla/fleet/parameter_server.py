"""The parameter-server Fleet (Paddle's ``incubate.fleet.parameter_server.distribute_transpiler.fleet``).

``minimize`` builds the single-machine program, then transpiles it in pserver mode for this process's
role (or in hybrid mode, with ``StrategyFactory.create_hybrid_strategy()``: the workers allreduce the
dense gradients and the servers hold only the distributed table) with Fluid's in-place rule (``flotilla.fluid.DistributeTranspiler``): on a worker the default main
and startup programs *become* the trainer programs, so ``fleet.main_program`` /
``fleet.startup_program`` and ``fluid.default_main_program()`` / ``default_startup_program()`` are the
same objects; on a server ``main_program`` / ``startup_program`` are its pserver programs. A local job
(no pservers in the environment) keeps the single-machine programs.

``stop_worker`` tells the pservers this worker is done. The RPC clients belong to the Executor that ran
the trainer program (Fluid had one process-wide client), so it closes every live Executor of this process
that has talked to a pserver.
"""
from __future__ import annotations

from typing import Any

from flotilla.fleet.base import Fleet, FleetError, strategy_config
from flotilla.fluid.transpiler import DistributeTranspiler
from ir.core import Program
from runtime.role import Role as ProcessRole


class ParameterServerFleet(Fleet):
    """Fleet over ``DistributeTranspiler`` in pserver mode; see the module docstring."""

    collective = False

    def _check_job(self, role: ProcessRole) -> None:
        if not role.pserver_endpoints and role.trainers > 1:
            raise FleetError(f"the environment describes {role.trainers} trainers and no pservers (a collective job), "
                             "but this is the parameter-server Fleet",
                             hint="use 'from flotilla.fleet.collective import fleet', or start the job with "
                                  "'flotilla launch --server_num N --worker_num M'", code="E757")

    def _distribute(self, main: Program, startup: Program, strategy: Any) -> None:
        config, sync_mode = strategy_config(strategy, collective=False)
        role = self._role
        if not role.is_distributed:
            self.main_program, self.startup_program = main, startup
            return
        t = DistributeTranspiler(config)
        # The workers of a hybrid job form an allreduce group: every one needs every endpoint.
        trainers, own_endpoint = role.ps_transpile_peers(config.is_hybrid, "the hybrid strategy")
        t.transpile(role.trainer_id, program=main, startup_program=startup, pservers=role.pservers,
                    trainers=trainers, sync_mode=sync_mode, current_endpoint=own_endpoint)
        if role.is_trainer:
            self.main_program, self.startup_program = main, startup  # rewritten in place
        else:
            self.main_program, self.startup_program = t.get_pserver_programs(role.current_endpoint)

    # --- servers
    def _server_only(self, what: str) -> None:
        if not self.is_server():
            raise FleetError(f"fleet.{what}() is for servers, and this process is worker {self.worker_index()}",
                             hint="check fleet.is_server() first", code="E758")

    def init_server(self, model_dir: str | None = None) -> None:
        """Run the server's startup program (its slices of the parameters), then, with ``model_dir``, load
        the state ``save_persistables`` saved there."""
        self._server_only("init_server")
        main, startup = self._programs_ready()
        exe = self.executor()
        exe.run(startup)
        if model_dir is not None:
            from runtime.io import load_persistables

            load_persistables(exe, model_dir, main)

    def run_server(self) -> None:
        """Serve until every worker has called ``stop_worker`` (or closed its executor)."""
        self._server_only("run_server")
        main, _ = self._programs_ready()
        exe = self.executor()
        try:
            exe.run(main)
        finally:
            exe.close()

    # --- workers
    def _worker_only(self, what: str) -> None:
        if not self.is_worker():
            raise FleetError(f"fleet.{what}() is for workers, and this process is a server",
                             hint="check fleet.is_server() first", code="E758")

    def init_worker(self) -> None:
        """Nothing to prepare in sync or async pserver training: the worker's startup program receives the
        parameters from the servers, and the first RPC waits (bounded) for them."""
        self._worker_only("init_worker")

    def stop_worker(self) -> None:
        """Tell every server this worker is done (see the module docstring)."""
        self._worker_only("stop_worker")
        from runtime.executor import live_executors

        for exe in live_executors():
            if exe.rpc_session.active:
                exe.close()
