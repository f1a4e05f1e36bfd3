"""The collective Fleet (Paddle's ``incubate.fleet.collective.fleet``): every process is a worker and the
gradients are averaged by allreduce (``DistributeTranspiler`` in nccl2 mode).

``minimize`` builds the single-machine program, then, in a job of several trainers
(``PADDLE_TRAINER_ENDPOINTS``; ``flotilla launch --nproc_per_node N`` sets it), transpiles it in nccl2
mode with Fluid's in-place rule: the default main and startup programs become this trainer's, and
``fleet.main_program`` / ``fleet.startup_program`` are those same objects. The startup program joins the
trainer group and takes trainer 0's parameters; each step of the main program averages the gradients
over the trainers inside the compiled step. A single trainer keeps the single-machine programs.
The strategy is a ``DistributedStrategy`` (``mode``, ``collective_mode``/``use_local_sgd``,
``nccl_comm_num``, ``fuse_grad_size_in_MB``) or a ``DistributeTranspilerConfig`` (switched to nccl2 mode
when it says pserver).
"""
from __future__ import annotations

from typing import Any

from flotilla.fleet.base import (DistributedOptimizer, DistributedStrategy, Fleet, FleetError, PaddleCloudRoleMaker,
                                 Role, UserDefinedCollectiveRoleMaker, strategy_config)
from flotilla.fluid.transpiler import DistributeTranspiler
from ir.core import Program
from runtime.role import Role as ProcessRole


class CollectiveFleet(Fleet):
    """Fleet over ``DistributeTranspiler`` in nccl2 mode; see the module docstring."""

    collective = True

    def _check_job(self, role: ProcessRole) -> None:
        if role.pserver_endpoints:
            raise FleetError("the environment describes a parameter-server job (PADDLE_PSERVERS_IP_PORT_LIST is set), "
                             "but this is the collective Fleet",
                             hint="use 'from flotilla.fleet import fleet', or start the job with "
                                  "'flotilla launch --nproc_per_node N'", code="E757")
        if role.trainers > 1 and not role.trainer_endpoints:
            raise FleetError(f"{role.trainers} trainers, but PADDLE_TRAINER_ENDPOINTS is not set: a collective job "
                             "needs every trainer's endpoint",
                             hint="start the job with 'flotilla launch --nproc_per_node N', or set "
                                  "PADDLE_TRAINER_ENDPOINTS=ip:port,ip:port", code="E757")

    def _distribute(self, main: Program, startup: Program, strategy: Any) -> None:
        config, _ = strategy_config(strategy, collective=True)
        role = self._role
        if role.trainers > 1:
            t = DistributeTranspiler(config)
            t.transpile(role.trainer_id, program=main, startup_program=startup,
                        trainers=",".join(role.trainer_endpoints), current_endpoint=role.current_endpoint)
        self.main_program, self.startup_program = main, startup  # rewritten in place (or local)

    def init_worker(self) -> None:
        """Nothing to prepare: the startup program joins the trainer group."""

    def stop_worker(self) -> None:
        """Nothing to tell: collective trainers have no servers."""

    def init_server(self, model_dir: str | None = None) -> None:
        raise FleetError("a collective job has no servers", hint="every process is a worker: skip init_server",
                         code="E758")

    def run_server(self) -> None:
        raise FleetError("a collective job has no servers", hint="every process is a worker: skip run_server",
                         code="E758")


fleet = CollectiveFleet()

__all__ = ["CollectiveFleet", "DistributedOptimizer", "DistributedStrategy", "PaddleCloudRoleMaker", "Role",
           "UserDefinedCollectiveRoleMaker", "fleet"]
