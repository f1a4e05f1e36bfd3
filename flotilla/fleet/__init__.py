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
a ``DistributedStrategy`` or a ``DistributeTranspilerConfig``.
"""
from __future__ import annotations

from flotilla.fleet.base import (DistributedOptimizer, DistributedStrategy, Fleet, FleetError, PaddleCloudRoleMaker,
                                 Role, RoleMakerBase, UserDefinedCollectiveRoleMaker, UserDefinedRoleMaker)
from flotilla.fleet.parameter_server import ParameterServerFleet

fleet = ParameterServerFleet()

__all__ = ["DistributedOptimizer", "DistributedStrategy", "Fleet", "FleetError", "PaddleCloudRoleMaker",
           "ParameterServerFleet", "Role", "RoleMakerBase", "UserDefinedCollectiveRoleMaker", "UserDefinedRoleMaker",
           "fleet"]
