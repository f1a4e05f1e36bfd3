"""End to end Geo-SGD (``geo_sgd_mode``): pservers and trainers as processes talking gRPC on 127.0.0.1.

With one trainer, k = 1 and SGD, every step is a local step followed by a sync that sends
``p1 - p0`` and fetches ``p0 + (p1 - p0)``: the parameters equal single-process training within
rtol 1e-5 (the distributed table, trained on the pservers as in async mode, too). With two trainers
and k = 2 the job trains (the loss over its batches falls), and every trainer ends with the merged
parameters it fetched at its last sync: the last trainer to sync holds exactly the pservers' final ones.
"""
from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

from tests.runtime.rpc import ps_worker
from tests.runtime.rpc.test_ps_training import Cluster, clusters, local_reference, run_ok, trained  # noqa: F401
from transpiler import DistributeTranspiler, DistributeTranspilerConfig


def pserver_params(out: pathlib.Path, endpoints: list[str], trainers: int) -> dict[str, np.ndarray]:
    """The dense parameters the pservers ended with, their blocks put together by the plan."""
    config = DistributeTranspilerConfig(min_block_size=64, geo_sgd_mode=True, geo_sgd_need_push_nums=2)
    t = DistributeTranspiler(config)
    main, startup = ps_worker.build("fc", "sgd", "const")
    t.transpile(0, program=main, startup_program=startup, pservers=",".join(endpoints), trainers=trainers,
                sync_mode=False)
    saved = [np.load(out / f"pserver_{i}.npz") for i in range(len(endpoints))]
    params = {}
    for name in ps_worker.DENSE_PARAMS:
        pp = t.plan.param_plan(name)
        params[name] = np.concatenate([saved[endpoints.index(ep)][b.name] for b, ep in zip(pp.param_blocks,
                                                                                            pp.endpoints)])
    return params


@pytest.mark.parametrize("model", ["fc", "table"])
def test_one_trainer_k1_matches_local(tmp_path: pathlib.Path, clusters: Any, model: str) -> None:
    steps = 6
    c = run_ok(clusters, tmp_path, 2, 1, ["--model", model, "--async", "--geo", "1", "--steps", str(steps)])
    init, final = trained(tmp_path, model, 2, "_init"), trained(tmp_path, model, 2)
    expected = local_reference(model, "sgd", "const", init, 1, range(steps))
    for name, value in expected.items():
        assert not np.allclose(value, init[name]), f"{name} did not train"
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-9, err_msg=name)
    if model == "fc":
        held = pserver_params(tmp_path, c.endpoints, 1)
        for name, value in held.items():
            np.testing.assert_array_equal(final[name], value, err_msg=f"trainer and pserver disagree on {name}")


def test_two_trainers_k2_train_and_end_synced(tmp_path: pathlib.Path, clusters: Any) -> None:
    steps = 20
    c = run_ok(clusters, tmp_path, 2, 2, ["--async", "--geo", "2", "--steps", str(steps)])
    init = dict(np.load(tmp_path / "trainer_0_init.npz"))
    held = pserver_params(tmp_path, c.endpoints, 2)
    finals = [dict(np.load(tmp_path / f"trainer_{t}.npz")) for t in range(2)]
    for name in ps_worker.DENSE_PARAMS:
        assert np.all(np.isfinite(held[name])) and not np.allclose(held[name], init[name]), name
    # Each trainer's last step is a sync (20 % 2 == 0): it holds what it fetched then. The pservers change
    # only when a delta arrives, so the trainer whose sync came last holds exactly their final values.
    synced_last = [t for t in range(2) if all(np.array_equal(finals[t][n], held[n]) for n in held)]
    assert synced_last, "no trainer holds the pservers' final parameters"
    for t in range(2):
        loss = np.load(tmp_path / f"trainer_{t}_loss.npy")
        assert len(loss) == steps and np.all(np.isfinite(loss))
    # The batches are noise, so one step's loss says little: the loss over every batch trained on falls.
    feeds = [ps_worker.batch("fc", t, step) for t in range(2) for step in range(steps)]
    assert fc_loss(held, feeds) < 0.9 * fc_loss(init, feeds), (fc_loss(held, feeds), fc_loss(init, feeds))


def fc_loss(p: dict[str, np.ndarray], feeds: list[dict[str, np.ndarray]]) -> float:
    """The mean square error of ``ps_worker``'s fc model with parameters ``p`` over ``feeds``."""
    x, y = np.concatenate([f["x"] for f in feeds]), np.concatenate([f["y"] for f in feeds])
    h = np.maximum(x @ p["fc_w"] + p["fc_b"], 0.0)
    return float(np.mean((h @ p["out_w"] + p["out_b"] - y) ** 2))
