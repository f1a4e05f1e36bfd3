"""Hybrid mode end to end: pservers and two trainers as separate processes on 127.0.0.1, the trainers forming
a real collective group (gloo) for the dense parameters and talking real gRPC to the pservers for the
distributed table (prefetch, sparse gradient, sync barriers), in one trainer program.

Sync hybrid training must give the parameters of single-process training on the union of the trainers'
batches from the same initial values (float64 model: rtol 1e-9, atol 1e-12, tighter than the 1e-5 asked of
the mode), on one pserver and on two; in async mode the trainers' dense parameters stay identical (they
apply the same allreduced mean) while the table trains on the pservers. Processes are started by
``tests.runtime.rpc.test_ps_training.Cluster`` and killed by pid on teardown; every wait is bounded.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from runtime.launch import free_ports
from tests.runtime.rpc.test_ps_training import Cluster, clusters, local_reference, run_ok, trained  # noqa: F401

pytestmark = pytest.mark.serial  # pservers and a collective group of trainers as processes

TRAINERS = 2


def _env() -> dict[str, str]:
    endpoints = ",".join(f"127.0.0.1:{p}" for p in free_ports(TRAINERS))
    return {"PADDLE_TRAINER_ENDPOINTS": endpoints, "FLAGS_collective_timeout_s": "60"}


@pytest.mark.parametrize("opt,lr,pservers", [("sgd", "const", 1), ("adam", "exp", 2)])
def test_sync_hybrid_training_matches_local(tmp_path: pathlib.Path, clusters: list[Cluster], opt: str, lr: str,
                                            pservers: int) -> None:
    steps = 4  # past the exp rate's first step down (at 3)
    run_ok(clusters, tmp_path, pservers, TRAINERS,
           ["--model", "table", "--hybrid", "--opt", opt, "--lr", lr, "--steps", str(steps)], env=_env())
    init, final = trained(tmp_path, "table", pservers, "_init"), trained(tmp_path, "table", pservers)
    other_init, other = dict(np.load(tmp_path / "trainer_1_init.npz")), dict(np.load(tmp_path / "trainer_1.npz"))
    for name in other:
        np.testing.assert_array_equal(other_init[name], init[name], err_msg=f"{name} not broadcast from trainer 0")
        np.testing.assert_array_equal(other[name], final[name], err_msg=f"trainers disagree on {name}")
    expected = local_reference("table", opt, lr, init, TRAINERS, range(steps))
    assert set(expected) == {"fc_w", "fc_b", "out_w", "out_b", "table"}
    for name, value in expected.items():
        assert not np.allclose(value, init[name]), f"{name} did not train"
        np.testing.assert_allclose(final[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def test_async_hybrid_training_keeps_dense_parameters_in_lockstep(tmp_path: pathlib.Path,
                                                                  clusters: list[Cluster]) -> None:
    run_ok(clusters, tmp_path, 1, TRAINERS, ["--model", "table", "--hybrid", "--async", "--steps", "4"], env=_env())
    init, final = trained(tmp_path, "table", 1, "_init"), trained(tmp_path, "table", 1)
    other = dict(np.load(tmp_path / "trainer_1.npz"))
    for name in other:
        np.testing.assert_array_equal(other[name], final[name], err_msg=f"trainers disagree on {name}")
    for name in final:
        assert not np.allclose(final[name], init[name]), f"{name} did not train"
