"""``flotilla.cluster`` is the role helper a user's project (and every example) imports."""
from __future__ import annotations

import ir
from flotilla import cluster
from runtime.role import Role


def test_local_and_collective_roles() -> None:
    main, startup = ir.Program(), ir.Program()
    local = cluster.distribute(main, startup, role=Role())
    assert local.main is main and not local.is_distributed and not local.is_collective
    job = cluster.Distributed(Role(trainer_id=1, trainers=2, trainer_endpoints=("127.0.0.1:1", "127.0.0.1:2"),
                                   current_endpoint="127.0.0.1:2"), main, startup)
    assert job.is_distributed and job.is_collective and job.tag == "trainer 1: "
    assert list(job.shard(range(5), total=5)) == [1, 3]
