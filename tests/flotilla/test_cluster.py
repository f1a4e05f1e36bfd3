"""``flotilla.cluster`` is the role helper a user's project (and every example) imports."""
from __future__ import annotations

import pytest

import ir
from flotilla import cluster
from runtime.role import LaunchError, Role


def test_local_and_collective_roles() -> None:
    main, startup = ir.Program(), ir.Program()
    local = cluster.distribute(main, startup, role=Role())
    assert local.main is main and not local.is_distributed and not local.is_collective
    job = cluster.Distributed(Role(trainer_id=1, trainers=2, trainer_endpoints=("127.0.0.1:1", "127.0.0.1:2"),
                                   current_endpoint="127.0.0.1:2"), main, startup)
    assert job.is_distributed and job.is_collective and job.tag == "trainer 1: "
    assert list(job.shard(range(5), total=5)) == [1, 3]


def test_parameter_server_transpile_peers() -> None:
    servers, workers = ("127.0.0.1:7", "127.0.0.1:8"), ("127.0.0.1:1", "127.0.0.1:2")
    trainer = Role(trainer_id=1, trainers=2, pserver_endpoints=servers, trainer_endpoints=workers,
                   current_endpoint=workers[1])
    assert trainer.ps_transpile_peers(False) == (2, None)
    assert trainer.ps_transpile_peers(True) == (",".join(workers), workers[1])
    pserver = Role(role="PSERVER", trainers=2, pserver_endpoints=servers, trainer_endpoints=workers,
                   current_endpoint=servers[0])
    assert pserver.ps_transpile_peers(True) == (",".join(workers), None)
    without = Role(trainer_id=0, trainers=2, pserver_endpoints=servers)
    with pytest.raises(LaunchError, match="PADDLE_TRAINER_ENDPOINTS is not set") as info:
        cluster.distribute(ir.Program(), ir.Program(), role=without,
                           config=cluster.DistributeTranspilerConfig(mode="hybrid"))
    assert info.value.code == "E805"
