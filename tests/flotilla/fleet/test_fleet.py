"""Fleet in one process: role makers, the programs ``minimize`` gives each role, the local job, misuse.
The multi-process runs (2 pservers x 2 workers, 2 collective workers) are in
``tests/flotilla/test_examples.py``."""
from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

from flotilla import fluid
from flotilla.fleet import (DistributedStrategy, FleetError, PaddleCloudRoleMaker, ParameterServerFleet, Role,
                            StrategyFactory, UserDefinedCollectiveRoleMaker, UserDefinedRoleMaker)
from flotilla.fleet.collective import CollectiveFleet
from ir.errors import FlotillaError
from runtime.role import ROLE_ENV_VARS, LaunchError

SERVERS = ["127.0.0.1:6174", "127.0.0.1:6175"]


@pytest.fixture(autouse=True)
def no_role_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ROLE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def regression() -> tuple[object, object]:
    x = fluid.layers.data(name="x", shape=[4], dtype="float32")
    y = fluid.layers.data(name="y", shape=[1], dtype="float32")
    pred = fluid.layers.fc(input=x, size=1)
    return pred, fluid.layers.mean(fluid.layers.square_error_cost(input=pred, label=y))


def regression_batch(rows: int = 64) -> dict[str, np.ndarray]:
    """A batch of ``y = x . [1, -2, 0.5, 3]`` for ``regression()``."""
    xs = np.random.RandomState(0).normal(size=(rows, 4)).astype("float32")
    return {"x": xs, "y": xs @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")}


def minimized(fleet: object, role_maker: object, strategy: object = None) -> tuple[fluid.Program, fluid.Program]:
    main, startup = fluid.Program(), fluid.Program()
    with fluid.program_guard(main, startup), fluid.unique_name.guard():
        _, loss = regression()
        fleet.init(role_maker)
        fleet.distributed_optimizer(fluid.optimizer.SGD(0.1), strategy).minimize(loss)
    return main, startup


def test_local_job_trains_the_single_machine_programs(tmp_path: pathlib.Path) -> None:
    fleet = ParameterServerFleet()
    main, startup = fluid.Program(), fluid.Program()
    with fluid.program_guard(main, startup), fluid.unique_name.guard(), fluid.scope_guard(fluid.Scope()):
        pred, loss = regression()
        fleet.init(PaddleCloudRoleMaker())
        opt = fleet.distributed_optimizer(fluid.optimizer.SGD(0.1), DistributedStrategy())
        opt.minimize(loss)
        assert fleet.main_program is main and fleet.startup_program is startup
        assert fleet.is_worker() and not fleet.is_server() and fleet.is_first_worker()
        assert (fleet.worker_index(), fleet.worker_num(), fleet.server_endpoints()) == (0, 1, [])
        exe = fluid.Executor(fluid.CPUPlace())
        fleet.init_worker()
        exe.run(fleet.startup_program)
        feed = regression_batch()
        losses = [float(exe.run(fleet.main_program, feed=feed, fetch_list=[loss])[0][0]) for _ in range(30)]
        assert losses[-1] < losses[0] / 10
        fleet.save_inference_model(exe, str(tmp_path / "model"), ["x"], [pred])
        fleet.save_persistables(exe, str(tmp_path / "ckpt"))
        fleet.stop_worker()
    assert (tmp_path / "model" / "__model__").exists() and (tmp_path / "ckpt" / "fc_0.w_0").exists()


def test_worker_and_server_programs() -> None:
    worker = ParameterServerFleet()
    main, startup = minimized(worker, UserDefinedRoleMaker(current_id=1, role=Role.WORKER, worker_num=2,
                                                           server_endpoints=SERVERS))
    assert worker.main_program is main and worker.startup_program is startup  # rewritten in place, as Fluid
    assert "send" in [op.type for op in main.global_block().ops] and worker.worker_index() == 1
    assert not worker.is_first_worker() and worker.server_endpoints(to_string=True) == ",".join(SERVERS)
    server = ParameterServerFleet()
    minimized(server, UserDefinedRoleMaker(current_id=1, role=Role.SERVER, worker_num=2, server_endpoints=SERVERS),
              fluid.DistributeTranspilerConfig(slice_var_up=False))
    assert server.is_server() and server.server_index() == 1
    assert server.main_program.global_block().ops[0].type == "listen_and_serv"
    assert server.main_program.global_block().ops[0].attr("endpoint") == SERVERS[1]
    with pytest.raises(FleetError, match=r"fleet.stop_worker\(\) is for workers"):
        server.stop_worker()
    with pytest.raises(FleetError, match=r"fleet.run_server\(\) is for servers"):
        worker.run_server()


def test_async_strategy_reaches_the_transpiler() -> None:
    strategy = DistributedStrategy()
    strategy.sync_mode = False
    fleet = ParameterServerFleet()
    minimized(fleet, UserDefinedRoleMaker(current_id=0, role=Role.WORKER, worker_num=2, server_endpoints=SERVERS),
              strategy)
    ops = [op.type for op in fleet.main_program.global_block().ops]
    assert "send" in ops and "send_barrier" not in ops and "fetch_barrier" not in ops


@pytest.mark.parametrize("make", [
    lambda: StrategyFactory.create_geo_strategy(8),
    lambda: fluid.DistributeTranspilerConfig(geo_sgd_mode=True, geo_sgd_need_push_nums=8),
])
def test_geo_strategy_reaches_the_transpiler(make: Any) -> None:
    fleet = ParameterServerFleet()
    minimized(fleet, UserDefinedRoleMaker(current_id=0, role=Role.WORKER, worker_num=2, server_endpoints=SERVERS),
              make())
    ops = fleet.main_program.global_block().ops
    assert [op.type for op in ops if op.type in ("sgd", "send", "recv", "geo_sync")] == ["sgd", "sgd", "geo_sync"]
    assert ops[-1].attr("push_nums") == 8
    assert StrategyFactory.create_async_strategy().sync_mode is False
    assert StrategyFactory.create_sync_strategy().sync_mode is True


def test_geo_strategy_in_sync_mode_is_refused() -> None:
    strategy = StrategyFactory.create_geo_strategy(8)
    strategy.sync_mode = True
    fleet = ParameterServerFleet()
    with pytest.raises(FlotillaError, match="geo_sgd_mode needs asynchronous training"):
        minimized(fleet, UserDefinedRoleMaker(current_id=0, role=Role.WORKER, worker_num=2,
                                              server_endpoints=SERVERS), strategy)


def test_collective_worker_programs() -> None:
    fleet = CollectiveFleet()
    main, startup = minimized(fleet, UserDefinedCollectiveRoleMaker(1, ["127.0.0.1:6170", "127.0.0.1:6171"]))
    assert fleet.main_program is main and "c_allreduce_sum" in [op.type for op in main.global_block().ops]
    assert "gen_nccl_id" in [op.type for op in startup.global_block().ops]
    assert fleet.worker_num() == 2 and not fleet.is_server()
    with pytest.raises(FleetError, match="a collective job has no servers"):
        fleet.run_server()


def test_misuse_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = ParameterServerFleet()
    with pytest.raises(FleetError, match=r"fleet.init\(role_maker\) has not been called"):
        fleet.is_server()
    fleet.init(UserDefinedRoleMaker(worker_num=1))
    with pytest.raises(FleetError, match="the Fleet has no programs yet"):
        fleet.save_persistables(None, "x")
    with pytest.raises(FleetError, match="strategy must be a DistributedStrategy or a DistributeTranspilerConfig"):
        fleet.distributed_optimizer(fluid.optimizer.SGD(0.1), strategy="sync")
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:6170,127.0.0.1:6171")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    with pytest.raises(FleetError, match=r"a collective job\), but this is the parameter-server Fleet\n"
                                         r"  hint: use 'from flotilla.fleet.collective import fleet'"):
        ParameterServerFleet().init(PaddleCloudRoleMaker())
    monkeypatch.delenv("PADDLE_TRAINER_ENDPOINTS")
    monkeypatch.setenv("PADDLE_PSERVERS_IP_PORT_LIST", ",".join(SERVERS))
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    with pytest.raises(FleetError, match="parameter-server job.*but this is the collective Fleet"):
        CollectiveFleet().init(PaddleCloudRoleMaker(is_collective=True))


def _hybrid_minimized(fleet: object, strategy: object) -> tuple[fluid.Program, fluid.Program]:
    """A regression on x and a distributed embedding of ids, minimized by ``fleet`` under ``strategy``."""
    main, startup = fluid.Program(), fluid.Program()
    with fluid.program_guard(main, startup), fluid.unique_name.guard():
        ids = fluid.layers.data(name="ids", shape=[1], dtype="int64")
        emb = fluid.layers.embedding(ids, size=[50, 4], is_sparse=True, is_distributed=True)
        x = fluid.layers.data(name="x", shape=[4], dtype="float32")
        y = fluid.layers.data(name="y", shape=[1], dtype="float32")
        pred = fluid.layers.fc(input=fluid.layers.concat([x, emb], axis=1), size=1)
        loss = fluid.layers.mean(fluid.layers.square_error_cost(input=pred, label=y))
        fleet.init(PaddleCloudRoleMaker())
        fleet.distributed_optimizer(fluid.optimizer.SGD(0.1), strategy).minimize(loss)
    return main, startup


HYBRID_WORKERS = "127.0.0.1:6170,127.0.0.1:6171"


@pytest.mark.parametrize("make", [
    lambda: StrategyFactory.create_hybrid_strategy(),
    lambda: fluid.DistributeTranspilerConfig(mode="hybrid"),
])
def test_hybrid_strategy_reaches_the_transpiler(monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    monkeypatch.setenv("PADDLE_PSERVERS_IP_PORT_LIST", ",".join(SERVERS))
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", HYBRID_WORKERS)
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setenv("TRAINING_ROLE", "TRAINER")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setenv("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:6171")
    fleet = ParameterServerFleet()
    main, startup = _hybrid_minimized(fleet, make())
    ops = [op.type for op in main.global_block().ops]
    assert fleet.main_program is main and "c_allreduce_sum" in ops and "prefetch" in ops and "recv" not in ops
    assert [op.type for op in main.global_block().ops if op.type == "sgd"] == ["sgd", "sgd"]  # fc_w, fc_b
    gen = startup.global_block().ops[0]
    assert gen.type == "gen_nccl_id" and gen.attr("endpoint") == "127.0.0.1:6171" and gen.attr("trainer_id") == 1
    monkeypatch.setenv("TRAINING_ROLE", "PSERVER")
    monkeypatch.setenv("PADDLE_CURRENT_ENDPOINT", SERVERS[1])
    server = ParameterServerFleet()
    served, _ = _hybrid_minimized(server, make())
    held = [v.name for v in server.main_program.global_block().vars.values() if v.is_parameter]
    assert len(held) == 1 and "embedding" in held[0], held


def test_hybrid_strategy_misuse_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PADDLE_PSERVERS_IP_PORT_LIST", ",".join(SERVERS))
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setenv("TRAINING_ROLE", "TRAINER")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    with pytest.raises(LaunchError, match="PADDLE_TRAINER_ENDPOINTS is not set") as info:
        _hybrid_minimized(ParameterServerFleet(), StrategyFactory.create_hybrid_strategy())
    assert info.value.code == "E805"
    collective = CollectiveFleet()
    collective.init(UserDefinedCollectiveRoleMaker(0, HYBRID_WORKERS.split(",")))
    for strategy in (StrategyFactory.create_hybrid_strategy(), fluid.DistributeTranspilerConfig(mode="hybrid")):
        with pytest.raises(FleetError, match="this is the collective Fleet") as info:
            collective.distributed_optimizer(fluid.optimizer.SGD(0.1), strategy)
        assert info.value.code == "E754"
