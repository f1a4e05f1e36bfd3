"""``flotilla.cluster`` is the role helper a user's project imports; ``examples/cluster.py`` re-exports it."""
from __future__ import annotations

import ir
from examples import cluster as examples_cluster
from flotilla import cluster
from runtime.role import Role


def test_examples_cluster_re_exports_flotilla_cluster() -> None:
    for name in examples_cluster.__all__:
        assert getattr(examples_cluster, name) is getattr(cluster, name)


def test_local_and_collective_roles() -> None:
    main, startup = ir.Program(), ir.Program()
    local = cluster.distribute(main, startup, role=Role())
    assert local.main is main and not local.is_distributed and not local.is_collective
    job = cluster.Distributed(Role(trainer_id=1, trainers=2, trainer_endpoints=("127.0.0.1:1", "127.0.0.1:2"),
                                   current_endpoint="127.0.0.1:2"), main, startup)
    assert job.is_distributed and job.is_collective and job.tag == "trainer 1: "
    assert list(job.shard(range(5), total=5)) == [1, 3]
