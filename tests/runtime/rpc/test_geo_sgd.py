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


def pserver_params(out: pathlib.Path, endpoints: list[str], trainers: int, when: str = "") -> dict[str, np.ndarray]:
    """The dense parameters the pservers ended with (``when="_init"``: started with), their blocks put
    together by the plan."""
    config = DistributeTranspilerConfig(min_block_size=64, geo_sgd_mode=True, geo_sgd_need_push_nums=2)
    t = DistributeTranspiler(config)
    main, startup = ps_worker.build("fc", "sgd", "const")
    t.transpile(0, program=main, startup_program=startup, pservers=",".join(endpoints), trainers=trainers,
                sync_mode=False)
    saved = [np.load(out / f"pserver_{i}{when}.npz") for i in range(len(endpoints))]
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
    # The pservers' initial values (a trainer's own first fetch may already hold the other's first delta).
    init = pserver_params(tmp_path, c.endpoints, 2, when="_init")
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


def test_the_tables_learning_rate_decays_per_table_gradient_not_per_delta() -> None:
    """A pserver in Geo-SGD mode advances its learning-rate block with the table's gradient (sent every
    step), never with the dense deltas (pushed every k steps)."""
    import runtime
    from ir import layers, optimizer
    from ir.core import Program, program_guard
    from ir.learning_rate import exponential_decay
    from ir.names import unique_name
    from ir.param_attr import ParamAttr
    from runtime.rpc.pserver import PServer
    from runtime.rpc.wire import decode_variable, encode_variable
    from runtime.scope import Scope, SelectedRows
    from tests.runtime.rpc.conftest import inc, listen_op

    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        ids = layers.data(name="ids", shape=[2], dtype="int64")
        emb = layers.embedding(ids, size=[50, 4], is_sparse=True, is_distributed=True,
                               param_attr=ParamAttr(name="table"))
        pred = layers.fc(layers.reshape(emb, [-1, 8]), 1, param_attr=ParamAttr(name="fc_w"))
        loss = layers.mean(layers.square_error_cost(input=pred, label=layers.data(name="y", shape=[1])))
        optimizer.SGD(learning_rate=exponential_decay(0.1, 10, 0.5)).minimize(loss)
    ep = "127.0.0.1:6174"
    t = DistributeTranspiler(DistributeTranspilerConfig(geo_sgd_mode=True, geo_sgd_need_push_nums=4))
    t.transpile(0, program=main, startup_program=startup, pservers=ep, trainers=1, sync_mode=False)
    prog, pstartup = t.get_pserver_programs(ep)
    exe, scope = runtime.Executor(), Scope()
    exe.run(pstartup, scope=scope)
    ps = PServer(prog, scope, listen_op(prog), lambda idx, s: exe.run_block(prog, idx, s))
    ps.announce(0, inc(0))
    (counter,) = [n for op in prog.block(ps.config.lr_block).ops if op.type == "increment" for n in op.output("Out")]

    def count() -> float:
        return float(np.asarray(scope.find_var(counter)).reshape(-1)[0])

    block = prog.global_block()
    deltas = [n for n in listen_op(prog).input("X") if n.endswith("@DELTA")]
    (table_grad,) = [n for n in listen_op(prog).input("X") if n in ps.config.sparse_grad_to_param]
    start = count()
    for seq in (1, 2):
        for name in deltas:
            value = np.zeros(block.var(name).shape, np.float32)
            ps.send(decode_variable(encode_variable(name, value, trainer_id=0, seq=seq, incarnation=inc(0))))
    assert count() == start  # deltas leave the learning rate alone
    rows = SelectedRows(np.array([3, 7]), np.ones((2, 4), np.float32), 50)
    for seq in (1, 2, 3):
        ps.send(decode_variable(encode_variable(table_grad, rows, trainer_id=0, seq=seq, incarnation=inc(0))))
    assert count() == start + 3


def test_a_geo_trainer_checkpoints_through_its_pservers_without_its_snapshots() -> None:
    """``runtime.io`` sees a Geo-SGD trainer program as distributed (its geo_sync names the pservers), so
    save_persistables notifies them; the trainer's own part leaves out the snapshots, which a restarted
    trainer takes anew from the parameters it fetches."""
    from runtime import io
    from tests.transpiler.test_distribute_transpiler import EPS2
    from tests.transpiler.test_geo_sgd import geo_fc

    t = geo_fc(k=3)
    trainer = t.get_trainer_program()
    role = io.distributed_role(trainer)
    assert role is not None and role[:2] == ("trainer", 0) and role[2] == sorted(EPS2.split(","))
    local = {v.name for v in io._trainer_local_vars(trainer)}
    assert not any(n.endswith("@GEO_SNAPSHOT") for n in local)
    assert "@GEO_SGD_STEP@" in local
