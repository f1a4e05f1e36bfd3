"""Fleet: single-machine code to distributed training in a few lines (Paddle Fluid 1.5's Fleet API).

::

    from flotilla import fluid
    from flotilla.fleet import fleet, PaddleCloudRoleMaker, DistributedStrategy

    fleet.init(PaddleCloudRoleMaker())                      # the role from Paddle's environment variables
    opt = fleet.distributed_optimizer(fluid.optimizer.SGD(0.01), DistributedStrategy())
    opt.minimize(loss)
    if fleet.is_server():
        fleet.init_server(); fleet.run_server()
    else:
        fleet.init_worker(); exe.run(fleet.startup_program)
        ... exe.run(fleet.main_program, feed=..., fetch_list=...) ...
        fleet.stop_worker()

``fleet`` here is the parameter-server Fleet (``flotilla.fleet.parameter_server``); the collective one
(allreduce among trainers, nccl2 mode) is ``from flotilla.fleet.collective import fleet``. The strategy is
a ``DistributedStrategy`` (``StrategyFactory.create_sync_strategy()``, ``create_async_strategy()``,
``create_geo_strategy(k)``, as in Paddle 1.6) or a ``DistributeTranspilerConfig``.
"""
from __future__ import annotations

from flotilla.fleet.base import (DistributedOptimizer, DistributedStrategy, Fleet, FleetError, PaddleCloudRoleMaker,
                                 Role, RoleMakerBase, StrategyFactory, UserDefinedCollectiveRoleMaker,
                                 UserDefinedRoleMaker)
from flotilla.fleet.parameter_server import ParameterServerFleet

fleet = ParameterServerFleet()

__all__ = ["DistributedOptimizer", "DistributedStrategy", "Fleet", "FleetError", "PaddleCloudRoleMaker",
           "ParameterServerFleet", "Role", "RoleMakerBase", "StrategyFactory", "UserDefinedCollectiveRoleMaker",
           "UserDefinedRoleMaker", "fleet"]
