"""End to end Geo-SGD (``geo_sgd_mode``): pservers and trainers as processes talking gRPC on 127.0.0.1.

With one trainer, k = 1 and SGD, every step is a local step followed by a sync that sends
``p1 - p0`` and fetches ``p0 + (p1 - p0)``: the parameters equal single-process training within
rtol 1e-5 (the distributed table, trained on the trainer and synced by its touched rows, too). With
two trainers and k = 2 the job trains (the loss over its batches falls), and every trainer ends with
the merged parameters (and table rows) it fetched at its last sync: the last trainer to sync holds
exactly the pservers' final ones.
"""
from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

from tests.runtime.rpc import ps_worker
from tests.runtime.rpc.test_ps_training import (AUTHENTICATED, Cluster, clusters,  # noqa: F401
                                                gather_table, local_reference, run_ok, trained)
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


@pytest.mark.serial  # a pserver and trainer processes
@pytest.mark.parametrize("model", ["fc", "table"])
def test_one_trainer_k1_matches_local(tmp_path: pathlib.Path, clusters: Any, model: str) -> None:
    steps = 6
    c = run_ok(clusters, tmp_path, 2, 1, ["--model", model, "--async", "--geo", "1", "--steps", str(steps)])
    init, final = trained(tmp_path, model, 2, "_init"), trained(tmp_path, model, 2)
    expected = local_reference(model, "sgd", "const", init, 1, range(steps))
    for name, value in expected.items():
        assert not np.allclose(value, init[name]), f"{name} did not train"
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-9, err_msg=name)
    held = pserver_params(tmp_path, c.endpoints, 1) if model == "fc" else {"table": final["table"]}
    mine = dict(np.load(tmp_path / "trainer_0.npz"))  # final["table"] is the pservers' (gather_table)
    for name, value in held.items():
        np.testing.assert_array_equal(mine[name], value, err_msg=f"trainer and pserver disagree on {name}")


@pytest.mark.serial  # pservers and trainers as processes
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


@pytest.mark.serial  # pservers and trainers as processes
def test_two_trainers_share_the_table_through_its_touched_rows(tmp_path: pathlib.Path, clusters: Any) -> None:
    """Each trainer trains its own copy of the distributed table and every 2nd step pushes its touched rows'
    change and takes every row either trainer changed: the trainer whose sync came last holds exactly the
    pservers' table."""
    steps = 8
    c = run_ok(clusters, tmp_path, 2, 2, ["--model", "table", "--async", "--geo", "2", "--steps", str(steps)])
    init, held = gather_table(tmp_path, 2, "_init"), gather_table(tmp_path, 2, "")
    tables = [np.load(tmp_path / f"trainer_{t}.npz")["table"] for t in range(2)]
    assert np.all(np.isfinite(held)) and not np.allclose(held, init)
    assert any(np.array_equal(table, held) for table in tables), "no trainer holds the pservers' final table"
    for table in tables:  # and each trainer's copy moved away from the start on the rows its batches touched
        assert not np.allclose(table, init)
    assert len(c.endpoints) == 2


@pytest.mark.serial  # pservers and trainers as processes
def test_a_restarted_geo_trainer_takes_the_table_anew(tmp_path: pathlib.Path, clusters: Any) -> None:
    """Trainer 1 dies at step 3 and is restarted: its startup fetches the pservers' table (with what the
    others pushed meanwhile), its new incarnation's deltas are accepted, and the job ends synced."""
    import signal

    args = ["--model", "table", "--async", "--geo", "2", "--steps", "8"]
    c = Cluster(tmp_path, 2, 2, args, trainer_args={1: ["--die-at", "3"]}, env=AUTHENTICATED)
    clusters.append(c)
    assert c.procs["trainer.1"].wait(timeout=60) == -signal.SIGKILL, c.logs()
    c.restart_trainer(1, args)
    codes = c.wait(fail_fast=True)
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}; logs:\n{c.logs()}"
    for tag in ("pserver.0", "pserver.1"):
        assert "trainer 1 rejoined as incarnation" in c.log(tag), c.log(tag)
    held = gather_table(tmp_path, 2, "")
    tables = [np.load(tmp_path / f"trainer_{t}.npz")["table"] for t in range(2)]
    assert np.all(np.isfinite(held)) and not np.allclose(held, gather_table(tmp_path, 2, "_init"))
    assert any(np.array_equal(table, held) for table in tables), "no trainer holds the pservers' final table"


def fc_loss(p: dict[str, np.ndarray], feeds: list[dict[str, np.ndarray]]) -> float:
    """The mean square error of ``ps_worker``'s fc model with parameters ``p`` over ``feeds``."""
    x, y = np.concatenate([f["x"] for f in feeds]), np.concatenate([f["y"] for f in feeds])
    h = np.maximum(x @ p["fc_w"] + p["fc_b"], 0.0)
    return float(np.mean((h @ p["out_w"] + p["out_b"] - y) ** 2))


def small_table_geo(trainers: int, endpoint: str = "127.0.0.1:6174") -> DistributeTranspiler:
    """A 50 x 4 distributed table and an fc, transpiled for Geo-SGD (k = 4) on one pserver."""
    from flotilla.fluid import layers, optimizer
    from ir.core import Program, program_guard
    from ir.names import unique_name
    from flotilla.fluid.param_attr import ParamAttr

    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        ids = layers.data(name="ids", shape=[2], dtype="int64")
        emb = layers.embedding(ids, size=[50, 4], is_sparse=True, is_distributed=True,
                               param_attr=ParamAttr(name="table"))
        pred = layers.fc(layers.reshape(emb, [-1, 8]), 1, param_attr=ParamAttr(name="fc_w"))
        loss = layers.mean(layers.square_error_cost(input=pred, label=layers.data(name="y", shape=[1])))
        optimizer.SGD(learning_rate=0.1).minimize(loss)
    t = DistributeTranspiler(DistributeTranspilerConfig(geo_sgd_mode=True, geo_sgd_need_push_nums=4))
    t.transpile(0, program=main, startup_program=startup, pservers=endpoint, trainers=trainers, sync_mode=False)
    return t


SMALL_EP = "127.0.0.1:6174"


def geo_table_pserver(trainers: int = 2) -> tuple[Any, Any, Any]:
    """``small_table_geo``'s pserver (no gRPC), every trainer announced: ``(pserver, its scope, program)``."""
    import runtime
    from runtime.rpc.pserver import PServer
    from runtime.scope import Scope
    from tests.runtime.rpc.conftest import inc, listen_op

    prog, pstartup = small_table_geo(trainers).get_pserver_programs(SMALL_EP)
    exe, scope = runtime.Executor(), Scope()
    exe.run(pstartup, scope=scope)
    ps = PServer(prog, scope, listen_op(prog), lambda idx, s: exe.run_block(prog, idx, s),
                 run_blocks=lambda ids, s, **kw: exe.run_blocks(prog, ids, s, **kw))
    for trainer in range(trainers):
        ps.announce(trainer, inc(trainer))
    return ps, scope, prog


@pytest.mark.parametrize("rows", [50, 60])
def test_geo_table_init_takes_the_served_table_or_names_the_mismatch(rows: int) -> None:
    """geo_table_init fetches the shard over gRPC from a real pserver; a table the pserver does not hold
    (60 rows asked, 50 served) is an error naming both shapes, with nothing written."""
    import runtime
    from ir.core import Program
    from runtime.kernels.rpc import max_message_bytes
    from runtime.rpc.pserver import PServer
    from runtime.rpc.server import start_server
    from runtime.scope import ExecutionError, Scope
    from tests.runtime.rpc.conftest import free_port, listen_op

    endpoint = f"127.0.0.1:{free_port()}"
    prog, pstartup = small_table_geo(1, endpoint).get_pserver_programs(endpoint)
    pexe, pscope = runtime.Executor(), Scope()
    pexe.run(pstartup, scope=pscope)
    pserver = PServer(prog, pscope, listen_op(prog), lambda idx, s: pexe.run_block(prog, idx, s))
    server = start_server(pserver, endpoint, max_message_bytes(prog))
    init = Program()
    block = init.global_block()
    for name, shape, dtype in (("table", (rows, 4), "float32"), ("snap", (rows, 4), "float32"),
                               ("touched", (rows,), "bool")):
        block.create_var(name, shape=shape, dtype=dtype, persistable=True)
    block.append_op("geo_table_init", {}, {"Table": ["table"], "TableSnapshot": ["snap"], "Touched": ["touched"]},
                    {"epmap": [endpoint], "table_name": "table", "rows": rows, "width": 4, "dtype": "float32",
                     "trainer_id": 0, "op_role": 4})
    exe, scope = runtime.Executor(), Scope()
    try:
        if rows == 60:
            with pytest.raises(ExecutionError, match=r"holds 'table' as float32\[50, 4\]; expected float32\[60, 4\]"):
                exe.run(init, scope=scope)
            assert scope.find_var("table") is None and scope.find_var("snap") is None
            return
        exe.run(init, scope=scope)
        served = np.asarray(pscope.find_var("table"))
        np.testing.assert_array_equal(np.asarray(scope.find_var("table")), served)
        np.testing.assert_array_equal(np.asarray(scope.find_var("snap")), served)
        assert not np.shares_memory(scope.find_var("table"), scope.find_var("snap"))
        assert np.asarray(scope.find_var("touched")).tolist() == [False] * 50
    finally:
        exe.close()
        server.stop(grace=None).wait(5.0)


def test_geo_sync_refuses_ids_outside_the_table() -> None:
    """A lookup reads NaN for an id outside the table; a fed one is refused before the step (the executor's
    feed check, ahead of geo_sync's own check of the rows it marks), naming it."""
    import runtime
    from runtime.scope import ExecutionError, Scope

    main = small_table_geo(trainers=1).get_trainer_program()
    scope = Scope()
    for v in main.global_block().vars.values():
        if v.persistable:  # no pserver: the state starts at zero (the step is not a sync step)
            scope.set_var(v.name, np.zeros(v.shape, v.dtype))
    feed = {"ids": np.array([[1, 60]], np.int64), "y": np.zeros((1, 1), np.float32)}
    with pytest.raises(ExecutionError, match=r"feed 'ids' holds id 60, outside the table 'table' of height 50"):
        runtime.Executor().run(main, feed=feed, scope=scope)


def test_a_pserver_answers_each_trainer_the_table_rows_changed_since_its_last_fetch() -> None:
    from runtime.rpc.pserver import PServerError, Status
    from runtime.rpc.wire import WireError, decode_variable, encode_variable
    from runtime.scope import SelectedRows
    from tests.runtime.rpc.conftest import inc

    ps, scope, _ = geo_table_pserver()
    start = np.array(scope.find_var("table"))

    def push(trainer: int, seq: int, rows: list[int], value: float) -> None:
        delta = SelectedRows(np.array(rows), np.full((len(rows), 4), value, np.float32), 50)
        ps.send(decode_variable(encode_variable("table@DELTA", delta, trainer_id=trainer, seq=seq,
                                                incarnation=inc(trainer))))

    def updates(trainer: int) -> tuple[list[int], np.ndarray]:
        got = decode_variable(ps.get(trainer, "table@GEO_UPDATES")).value
        assert isinstance(got, SelectedRows) and got.height == 50
        return np.asarray(got.rows).tolist(), np.asarray(got.values)

    push(0, 1, [7, 3], 1.0)
    push(1, 1, [3, 9], 0.5)  # deltas add: row 3 gets both
    expected = start.copy()
    expected[[3, 7]] += 1.0
    expected[[3, 9]] += 0.5
    np.testing.assert_allclose(np.asarray(scope.find_var("table")), expected, rtol=1e-6)
    for trainer in (0, 1):  # every trainer gets every changed row, its own too, once
        rows, values = updates(trainer)
        assert rows == [3, 7, 9]
        np.testing.assert_allclose(values, expected[[3, 7, 9]], rtol=1e-6)
        assert updates(trainer)[0] == []
    push(0, 2, [20], -1.0)

    def refuse(name: str, value: object) -> bytes:
        raise PServerError(Status.RESOURCE_EXHAUSTED, "the slot is too small")

    with pytest.raises(PServerError, match="too small"):  # an encoder that refuses takes nothing
        ps.get_many(1, ["table@GEO_UPDATES"], encode=refuse)
    assert updates(1)[0] == [20] and updates(0)[0] == [20]

    # Garbage is refused with the table untouched and nothing recorded.
    before = np.array(scope.find_var("table"))
    with pytest.raises(WireError, match=r"row ids must lie in \[0, 50\)"):
        push(0, 3, [60], 1.0)
    with pytest.raises(PServerError, match="NaN or Inf"):
        push(0, 3, [5], float("nan"))
    with pytest.raises(PServerError, match="trainer_id 5 is out of range"):
        ps.get(5, "table@GEO_UPDATES")
    with pytest.raises(PServerError, match="no such variable") as info:
        ps.get(0, "table@GEO_UPDATE")
    assert "table@GEO_UPDATES" in str(info.value)
    np.testing.assert_array_equal(np.asarray(scope.find_var("table")), before)
    assert updates(0)[0] == [] and updates(1)[0] == []


def test_a_geo_trainer_checkpoints_through_its_pservers_without_its_snapshots() -> None:
    """``runtime.io`` sees a Geo-SGD trainer program as distributed (its geo_sync names the pservers), so
    save_persistables notifies them; the trainer's own part leaves out the snapshots, which a restarted
    trainer takes anew from the parameters it fetches."""
    from ir.dist_info import distributed_role
    from runtime import io
    from tests.transpiler.test_distribute_transpiler import EPS2
    from tests.transpiler.test_geo_sgd import geo_ctr, geo_fc

    t = geo_fc(k=3)
    trainer = t.get_trainer_program()
    role = distributed_role(trainer)
    assert role is not None and role[:2] == ("trainer", 0) and role[2] == sorted(EPS2.split(","))
    local = {v.name for v in io._trainer_local_vars(trainer)}
    assert not any(n.endswith("@GEO_SNAPSHOT") for n in local)
    assert "@GEO_SGD_STEP@" in local
    table_trainer = geo_ctr().get_trainer_program()
    local = {v.name for v in io._trainer_local_vars(table_trainer)}
    assert "table_moment1_0" in local and not {"table", "table@GEO_SNAPSHOT", "table@GEO_TOUCHED"} & local


def test_a_client_fetches_the_table_updates_alone_within_the_reply_limit() -> None:
    """The pserver bounds a fetch of ``table@GEO_UPDATES`` by its whole shard, whatever the last reply was:
    batched with the parameters it could pass the reply limit (RESOURCE_EXHAUSTED), so the client fetches it
    in a call of its own. Here the limit leaves room for the shard and nothing else."""
    import runtime
    from runtime.rpc.client import RPCClient
    from runtime.rpc.pserver import PServer
    from runtime.rpc.server import start_server
    from runtime.scope import Scope, SelectedRows
    from tests.runtime.rpc.conftest import free_port, inc, listen_op

    endpoint = f"127.0.0.1:{free_port()}"
    prog, pstartup = small_table_geo(1, endpoint).get_pserver_programs(endpoint)
    pexe, pscope = runtime.Executor(), Scope()
    pexe.run(pstartup, scope=pscope)
    pserver = PServer(prog, pscope, listen_op(prog), lambda idx, s: pexe.run_block(prog, idx, s))
    limit = pserver._reply_bytes("table@GEO_UPDATES") + 64  # the shard bound; not the fc's weights as well
    server = start_server(pserver, endpoint, limit)
    client = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="off")
    methods: list[str] = []
    retried = client._retried
    client._retried = lambda ep, method, what, invoke: methods.append(method) or retried(ep, method, what, invoke)
    pairs = [(endpoint, "fc_w"), (endpoint, "table@GEO_UPDATES")]
    try:
        for _ in range(2):  # the second time the client knows both (small) sizes
            fc_w, updates = client.get(pairs)
            np.testing.assert_array_equal(fc_w, np.asarray(pscope.find_var("fc_w")))
            assert isinstance(updates, SelectedRows) and np.asarray(updates.rows).size == 0
        assert "GetVariables" not in methods and methods.count("GetVariable") == 4
    finally:
        client.close()
        server.stop(grace=None).wait(5.0)
