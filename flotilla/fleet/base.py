"""What both Fleets share: role makers, ``DistributedStrategy`` and the ``Fleet`` base class.

A role maker turns a description of the job (Paddle's environment variables, or the user's own
arguments) into a ``runtime.role.Role``; ``Fleet.init(role_maker)`` asks it once. The Fleet then
answers where this process stands (``is_worker``, ``worker_index``, ``server_endpoints``...) and, after
``distributed_optimizer(opt, strategy).minimize(loss)``, which programs to run (``main_program``,
``startup_program``).

Invariants:
- A role maker reads the environment once, in ``generate_role`` (called by ``Fleet.init``).
- Every misuse (a Fleet method before ``init``, programs before ``minimize``, a strategy of the wrong
  type, a role maker of the wrong kind for this Fleet) raises ``FleetError`` (E750-E759) with a hint.
- A local job (no pservers, one trainer) trains the single-machine programs unchanged.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, Sequence

from ir.core import Program, Variable, default_main_program, default_startup_program
from ir.errors import FlotillaError
from ir.ops.registry import suggest
from runtime.role import PSERVER, TRAINER
from runtime.role import Role as ProcessRole
from runtime.role import role_from_env
from transpiler.config import DistributeTranspilerConfig
from transpiler.ps_dispatcher import PSDispatcher


class FleetError(FlotillaError):
    """A misuse of the Fleet API."""

    code = "E750"


class Role(enum.IntEnum):
    """Fleet's role of a process (Paddle's ``role_maker.Role``)."""

    WORKER = 1
    SERVER = 2


class RoleMakerBase(abc.ABC):
    """Makes this process's ``runtime.role.Role``; ``generate_role`` fills ``role``."""

    #: True for the collective Fleet's role makers (every process a worker, endpoints known).
    is_collective: bool = False

    def __init__(self) -> None:
        self._role: ProcessRole | None = None

    def generate_role(self) -> None:
        if self._role is None:
            self._role = self._make_role()

    @abc.abstractmethod
    def _make_role(self) -> ProcessRole:
        """This process's role (read once)."""

    @property
    def role(self) -> ProcessRole:
        self.generate_role()
        if self._role is None:
            raise FleetError("the role maker produced no role", code="E751")
        return self._role

    # Paddle's role-maker queries.
    def is_worker(self) -> bool:
        return self.role.is_trainer

    def is_server(self) -> bool:
        return self.role.is_pserver

    def is_first_worker(self) -> bool:
        return self.role.is_trainer and self.role.trainer_id == 0

    def worker_index(self) -> int:
        return self.role.trainer_id

    def server_index(self) -> int:
        index = self.role.pserver_index
        if index is None:
            raise FleetError("server_index() asked on a worker", hint="check is_server() first", code="E751")
        return index

    def worker_num(self) -> int:
        return self.role.trainers

    def server_num(self) -> int:
        return len(self.role.pserver_endpoints)

    def get_pserver_endpoints(self) -> list[str]:
        return list(self.role.pserver_endpoints)

    def get_trainer_endpoints(self) -> list[str]:
        return list(self.role.trainer_endpoints)


class PaddleCloudRoleMaker(RoleMakerBase):
    """The role from Paddle's environment variables (``runtime.role.role_from_env``; ``flotilla launch``
    sets them). With none set the process is a local single worker. ``is_collective`` is accepted for
    Paddle compatibility; the environment itself says which kind of job it is."""

    def __init__(self, is_collective: bool = False) -> None:
        super().__init__()
        self.is_collective = bool(is_collective)

    def _make_role(self) -> ProcessRole:
        return role_from_env()


class UserDefinedRoleMaker(RoleMakerBase):
    """A parameter-server role given by hand (Paddle's signature): ``current_id`` is this worker's id, or
    this server's index in ``server_endpoints``."""

    def __init__(self, current_id: int = 0, role: Role = Role.WORKER, worker_num: int = 0,
                 server_endpoints: Sequence[str] | None = None) -> None:
        super().__init__()
        if role not in (Role.WORKER, Role.SERVER):
            raise FleetError(f"UserDefinedRoleMaker: role must be Role.WORKER or Role.SERVER, got {role!r}",
                             code="E752")
        if isinstance(worker_num, bool) or not isinstance(worker_num, int) or worker_num < 1:
            raise FleetError(f"UserDefinedRoleMaker: worker_num must be an int >= 1, got {worker_num!r}",
                             hint="pass the number of workers (trainers)", code="E752")
        self._args = (current_id, Role(role), worker_num, list(server_endpoints or []))

    def _make_role(self) -> ProcessRole:
        current_id, role, worker_num, servers = self._args
        if role == Role.SERVER:
            if not isinstance(current_id, int) or not 0 <= current_id < len(servers):
                raise FleetError(f"UserDefinedRoleMaker: server current_id {current_id!r} is not an index of "
                                 f"server_endpoints {servers}", code="E752")
            return ProcessRole(role=PSERVER, trainers=worker_num, pserver_endpoints=tuple(servers),
                               current_endpoint=servers[current_id])
        if not isinstance(current_id, int) or not 0 <= current_id < worker_num:
            raise FleetError(f"UserDefinedRoleMaker: worker current_id {current_id!r} is not in 0..{worker_num - 1}",
                             code="E752")
        return ProcessRole(role=TRAINER, trainer_id=current_id, trainers=worker_num, pserver_endpoints=tuple(servers))


class UserDefinedCollectiveRoleMaker(RoleMakerBase):
    """A collective role given by hand: this worker's index and every worker's endpoint."""

    is_collective = True

    def __init__(self, current_id: int = 0, worker_endpoints: Sequence[str] | None = None) -> None:
        super().__init__()
        self._args = (current_id, list(worker_endpoints or []))

    def _make_role(self) -> ProcessRole:
        current_id, endpoints = self._args
        if not endpoints:
            return ProcessRole()
        if not isinstance(current_id, int) or not 0 <= current_id < len(endpoints):
            raise FleetError(f"UserDefinedCollectiveRoleMaker: current_id {current_id!r} is not an index of "
                             f"worker_endpoints {endpoints}", code="E752")
        return ProcessRole(role=TRAINER, trainer_id=current_id, trainers=len(endpoints),
                           trainer_endpoints=tuple(endpoints), current_endpoint=endpoints[current_id])


@dataclass
class DistributedStrategy:
    """How Fleet distributes the program. Parameter-server fields: ``sync_mode``, ``slice_var_up``,
    ``split_method``, ``min_block_size``, ``enable_dc_asgd``, ``geo_sgd_mode`` and
    ``geo_sgd_need_push_nums`` (async only); collective fields: ``mode`` (``"nccl2"`` or
    ``"collective"``), ``collective_mode``, ``use_local_sgd`` (= ``collective_mode="local_sgd"``),
    ``local_sgd_steps``, ``nccl_comm_num``, ``fuse_grad_size_in_MB``. ``mode="hybrid"`` (the
    parameter-server Fleet only; ``StrategyFactory.create_hybrid_strategy``) allreduces the dense
    gradients among the workers (``nccl_comm_num``, ``fuse_grad_size_in_MB``) and keeps the distributed
    lookup table on the servers (``sync_mode``). A misspelt field raises, naming the closest one."""

    sync_mode: bool = True
    slice_var_up: bool = True
    split_method: type[PSDispatcher] | None = None
    min_block_size: int = 8192
    enable_dc_asgd: bool = False
    geo_sgd_mode: bool = False
    geo_sgd_need_push_nums: int = 100
    mode: str = "nccl2"
    collective_mode: str | None = None
    use_local_sgd: bool = False
    local_sgd_steps: int = 1
    nccl_comm_num: int = 1
    fuse_grad_size_in_MB: float = 32.0

    def __setattr__(self, name: str, value: Any) -> None:
        fields = type(self).__dataclass_fields__
        if name not in fields:
            raise FleetError(f"DistributedStrategy has no field {name!r}",
                             hint=suggest(name, fields) or f"the fields are {', '.join(fields)}", code="E753")
        object.__setattr__(self, name, value)

    def transpiler_config(self, collective: bool) -> DistributeTranspilerConfig:
        """The ``DistributeTranspilerConfig`` for a parameter-server (or, with ``collective``, an allreduce)
        transpile."""
        if self.mode == "hybrid":
            if collective:
                raise FleetError("the hybrid strategy keeps the distributed table on parameter servers, but this "
                                 "is the collective Fleet", hint="use 'from flotilla.fleet import fleet' (the "
                                 "parameter-server Fleet) with the hybrid strategy", code="E754")
            return DistributeTranspilerConfig(mode="hybrid", slice_var_up=self.slice_var_up,
                                              split_method=self.split_method, min_block_size=self.min_block_size,
                                              enable_dc_asgd=self.enable_dc_asgd, geo_sgd_mode=self.geo_sgd_mode,
                                              nccl_comm_num=self.nccl_comm_num,
                                              fuse_grad_size_in_MB=self.fuse_grad_size_in_MB)
        if not collective:
            return DistributeTranspilerConfig(slice_var_up=self.slice_var_up, split_method=self.split_method,
                                              min_block_size=self.min_block_size, enable_dc_asgd=self.enable_dc_asgd,
                                              geo_sgd_mode=self.geo_sgd_mode,
                                              geo_sgd_need_push_nums=self.geo_sgd_need_push_nums)
        kind = "local_sgd" if self.use_local_sgd else self.collective_mode
        return DistributeTranspilerConfig(mode=self.mode, collective_mode=kind, local_sgd_steps=self.local_sgd_steps,
                                          nccl_comm_num=self.nccl_comm_num,
                                          fuse_grad_size_in_MB=self.fuse_grad_size_in_MB)


class StrategyFactory:
    """Paddle 1.6's strategy constructors for the parameter-server Fleet (``distributed_strategy``)."""

    @staticmethod
    def create_sync_strategy() -> DistributedStrategy:
        return DistributedStrategy(sync_mode=True)

    @staticmethod
    def create_async_strategy() -> DistributedStrategy:
        return DistributedStrategy(sync_mode=False)

    @staticmethod
    def create_geo_strategy(update_frequency: int = 100) -> DistributedStrategy:
        """Async Geo-SGD: trainers optimize locally and push their parameters' change every
        ``update_frequency`` steps."""
        return DistributedStrategy(sync_mode=False, geo_sgd_mode=True, geo_sgd_need_push_nums=update_frequency)

    @staticmethod
    def create_hybrid_strategy(sync_mode: bool = True) -> DistributedStrategy:
        """Hybrid: the dense gradients allreduced among the workers every step, the distributed lookup table
        on the servers (prefetch and sparse update, sync or async)."""
        return DistributedStrategy(sync_mode=sync_mode, mode="hybrid")


def strategy_config(strategy: Any, collective: bool) -> tuple[DistributeTranspilerConfig, bool]:
    """``(transpiler config, sync_mode)`` for ``strategy``: None, a ``DistributedStrategy`` or a
    ``DistributeTranspilerConfig`` (then sync training, or async with ``geo_sgd_mode``; collective Fleets
    switch its mode to nccl2)."""
    if strategy is None:
        strategy = DistributedStrategy()
    if isinstance(strategy, DistributedStrategy):
        return strategy.transpiler_config(collective), bool(strategy.sync_mode)
    if isinstance(strategy, DistributeTranspilerConfig):
        if collective and strategy.is_hybrid:
            raise FleetError("a hybrid config keeps the distributed table on parameter servers, but this is the "
                             "collective Fleet", hint="use 'from flotilla.fleet import fleet' (the parameter-server "
                             "Fleet) with mode='hybrid'", code="E754")
        if collective and not strategy.is_collective:
            import dataclasses

            strategy = dataclasses.replace(strategy, mode="nccl2")
        return strategy, not strategy.geo_sgd_mode
    raise FleetError(f"strategy must be a DistributedStrategy or a DistributeTranspilerConfig, got "
                     f"{type(strategy).__name__}", hint="from flotilla.fleet import DistributedStrategy", code="E754")


class Fleet(abc.ABC):
    """The state both Fleets share: the role, the programs ``minimize`` produced, an executor for the
    servers. Subclasses define ``_distribute(main, startup, strategy)``."""

    #: Whether this Fleet drives collective (allreduce) jobs.
    collective: bool = False

    def __init__(self) -> None:
        self._role_maker: RoleMakerBase | None = None
        self._origin_main: Program | None = None
        self.main_program: Program | None = None
        self.startup_program: Program | None = None
        self._executor: Any = None

    # --- role
    def init(self, role_maker: RoleMakerBase | None = None) -> None:
        """Take this process's role from ``role_maker`` (default: ``PaddleCloudRoleMaker()``)."""
        role_maker = role_maker if role_maker is not None else PaddleCloudRoleMaker(is_collective=self.collective)
        if not isinstance(role_maker, RoleMakerBase):
            raise FleetError(f"fleet.init needs a role maker, got {type(role_maker).__name__}",
                             hint="fleet.init(PaddleCloudRoleMaker())", code="E755")
        role_maker.generate_role()
        self._check_job(role_maker.role)
        self._role_maker = role_maker
        self._origin_main = self.main_program = self.startup_program = None

    def _check_job(self, role: ProcessRole) -> None:
        """Refuse a job this Fleet cannot drive (subclasses)."""

    @property
    def _role(self) -> ProcessRole:
        if self._role_maker is None:
            raise FleetError("fleet.init(role_maker) has not been called",
                             hint="call fleet.init(PaddleCloudRoleMaker()) first", code="E755")
        return self._role_maker.role

    def is_worker(self) -> bool:
        return self._role.is_trainer

    def is_server(self) -> bool:
        return self._role.is_pserver

    def is_first_worker(self) -> bool:
        return self._role.is_trainer and self._role.trainer_id == 0

    def worker_index(self) -> int:
        return self._role.trainer_id

    def worker_num(self) -> int:
        return self._role.trainers

    def server_num(self) -> int:
        return len(self._role.pserver_endpoints)

    def server_index(self) -> int:
        if self._role.pserver_index is None:
            raise FleetError("server_index() asked on a worker", hint="check fleet.is_server() first", code="E751")
        return self._role.pserver_index

    def server_endpoints(self, to_string: bool = False) -> list[str] | str:
        eps = list(self._role.pserver_endpoints)
        return ",".join(eps) if to_string else eps

    def worker_endpoints(self, to_string: bool = False) -> list[str] | str:
        eps = list(self._role.trainer_endpoints)
        return ",".join(eps) if to_string else eps

    # --- programs
    def distributed_optimizer(self, optimizer: Any, strategy: Any = None) -> "DistributedOptimizer":
        """Wrap ``optimizer``: its ``minimize(loss)`` builds the single-machine backward and optimizer ops,
        then distributes the programs for this process's role (see the subclass)."""
        _ = self._role  # before init: the error that says to call fleet.init first
        strategy_config(strategy, self.collective)  # reject a bad strategy now, not at minimize
        return DistributedOptimizer(self, optimizer, strategy)

    def _programs_ready(self) -> tuple[Program, Program]:
        if self.main_program is None or self.startup_program is None:
            raise FleetError("the Fleet has no programs yet", hint="call fleet.distributed_optimizer(opt, strategy)"
                             ".minimize(loss) first", code="E756")
        return self.main_program, self.startup_program

    @abc.abstractmethod
    def _distribute(self, main: Program, startup: Program, strategy: Any) -> None:
        """Set ``main_program`` / ``startup_program`` for this process's role from the built programs."""

    def executor(self) -> Any:
        """The executor the Fleet itself runs programs with (servers); made on first use."""
        if self._executor is None:
            import runtime

            self._executor = runtime.Executor(runtime.CPUPlace())
        return self._executor

    # --- saving
    def save_persistables(self, executor: Any, dirname: str, main_program: Program | None = None) -> None:
        """Save the persistable state (``runtime.io.save_persistables``): on a parameter-server worker the
        pservers save their slices and the worker its own state (see ``runtime.io``)."""
        from runtime.io import save_persistables

        save_persistables(executor, dirname, main_program if main_program is not None else self._programs_ready()[0])

    def save_inference_model(self, executor: Any, dirname: str, feeded_var_names: Sequence[Any],
                             target_vars: Sequence[Any], main_program: Program | None = None,
                             export_for_deployment: bool = True) -> list[str]:
        """Save the forward program (from the single-machine program ``minimize`` saw) and the parameters
        this worker holds (``runtime.inference_io.save_inference_model``)."""
        from runtime.inference_io import save_inference_model

        self._programs_ready()
        program = main_program if main_program is not None else self._origin_main
        return save_inference_model(dirname, feeded_var_names, target_vars, executor, program,
                                    export_for_deployment=export_for_deployment)


class DistributedOptimizer:
    """``fleet.distributed_optimizer(optimizer, strategy)``: ``minimize`` as the wrapped optimizer's, then
    the Fleet distributes the programs."""

    def __init__(self, fleet: Fleet, optimizer: Any, strategy: Any) -> None:
        if not hasattr(optimizer, "minimize"):
            raise FleetError(f"distributed_optimizer needs an optimizer, got {type(optimizer).__name__}",
                             hint="e.g. fluid.optimizer.SGD(learning_rate=0.01)", code="E754")
        self._fleet, self._optimizer, self._strategy = fleet, optimizer, strategy

    def minimize(self, loss: Variable, startup_program: Program | None = None, parameter_list: Any = None,
                 no_grad_set: Any = None) -> tuple[list[Any], list[Any]]:
        """Append backward and optimizer ops for ``loss`` to the default main program, then distribute
        it and ``startup_program`` (default: the default startup program); returns (optimize ops,
        params and grads), as Fluid's."""
        if not isinstance(loss, Variable):
            raise FleetError(f"minimize needs the loss Variable, got {type(loss).__name__}", code="E754")
        result = self._optimizer.minimize(loss, startup_program=startup_program, parameter_list=parameter_list,
                                          no_grad_set=no_grad_set)
        main = default_main_program()
        startup = startup_program if startup_program is not None else default_startup_program()
        self._fleet._origin_main = main.clone()
        self._fleet._distribute(main, startup, self._strategy)
        return result
