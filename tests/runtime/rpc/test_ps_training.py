"""End to end: pservers and trainers as separate processes talking gRPC on 127.0.0.1.

Sync training on 2 pservers x 2 trainers must give the parameters of single-process training on the
union of the trainers' batches from the same initial values (float64 models: rtol 1e-9, atol 1e-12 —
the orders of summation differ); uneven data finishes; a dead trainer or pserver makes the others
fail with an error naming it, within the configured timeout; a checkpointed and restarted job continues
bit-identically. Every process is started here and killed by pid on teardown; every wait is bounded.
"""
from __future__ import annotations

import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time
from typing import Any, Callable

import grpc
import numpy as np
import pytest

from runtime.launch import free_ports
from tests.runtime.rpc import ps_worker

pytestmark = pytest.mark.serial  # pservers and trainers as processes, some with seconds-long timeouts

REPO = pathlib.Path(__file__).resolve().parents[3]
WAIT = 90.0
AUTHENTICATED = {"FLOTILLA_JOB_TOKEN": secrets.token_hex(16)}
# The jobs of the trust and fault tests run with the data plane off (pure gRPC) and forced on for every
# tensor, through shared memory (from 1 byte; runtime/rpc/shm.py) or on the TCP plane on this one host
# (FLAGS_rpc_data_plane=tcp, which needs the job token; runtime/rpc/tcp_plane.py): what holds on gRPC
# must hold on either data plane.
DATA_PLANE = {"grpc": {"FLAGS_rpc_data_plane": "off"},
              "shm": {"FLAGS_rpc_data_plane": "auto", "FLAGS_rpc_data_plane_min_bytes": "1"},
              "tcp": {"FLAGS_rpc_data_plane": "tcp", "FLAGS_rpc_data_plane_min_bytes": "1", **AUTHENTICATED}}


@pytest.fixture(params=list(DATA_PLANE))
def plane(request: pytest.FixtureRequest) -> str:
    """``grpc``, ``shm`` or ``tcp``: the data plane of the test's job (``DATA_PLANE``)."""
    return request.param


def check_plane(c: "Cluster", plane: str, trainers: list[str]) -> None:
    """Every trainer of ``trainers`` that finished moved its tensors the way ``plane`` says."""
    for tag in trainers:
        line = [ln for ln in c.log(tag).splitlines() if ln.startswith("data plane: ")]
        assert line, c.log(tag)
        if plane != "grpc":
            assert line[0].count(" shm" if plane == "shm" else " tcp (") == len(c.endpoints), line[0]
        else:
            assert line[0] == "data plane: unused", line[0]



class Cluster:
    """Pserver and trainer processes of ``tests.runtime.rpc.ps_worker`` with Paddle's environment."""

    def __init__(self, tmp: pathlib.Path, pservers: int, trainers: int, args: list[str],
                 env: dict[str, str] | None = None, trainer_args: dict[int, list[str]] | None = None) -> None:
        self.out = tmp
        self.endpoints = [f"127.0.0.1:{p}" for p in free_ports(pservers)]
        base = {**os.environ, "PYTHONPATH": str(REPO), "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(self.endpoints),
                "PADDLE_TRAINERS_NUM": str(trainers), "FLAGS_rpc_deadline": "60000", **(env or {})}
        cmd = [sys.executable, "-m", "tests.runtime.rpc.ps_worker", "--out", str(tmp), *args]
        self.env, self.cmd = base, cmd
        self.dead: dict[str, subprocess.Popen[str]] = {}
        self.procs: dict[str, subprocess.Popen[str]] = {}
        for i, ep in enumerate(self.endpoints):
            self._start(f"pserver.{i}", cmd, {**base, "TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_ENDPOINT": ep,
                                              "PADDLE_TRAINER_ID": "0"})
        for t in range(trainers):
            self._start(f"trainer.{t}", cmd + (trainer_args or {}).get(t, []),
                        {**base, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(t)})

    def restart_trainer(self, t: int, args: list[str]) -> None:
        """Start trainer ``t`` again (same id, a new process) as ``trainer.<t>.restarted``."""
        env = {**self.env, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(t)}
        old = self.procs.pop(f"trainer.{t}")
        if old.poll() is None:
            raise AssertionError(f"trainer.{t} is still running")
        self.dead[f"trainer.{t}"] = old
        self._start(f"trainer.{t}.restarted", self.cmd + args, env)

    def _start(self, tag: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.out / f"{tag}.log", "w")
        self.procs[tag] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        log.close()

    def log(self, tag: str) -> str:
        return (self.out / f"{tag}.log").read_text()

    def wait(self, timeout: float = WAIT, fail_fast: bool = False) -> dict[str, int]:
        """Exit codes of every process; with ``fail_fast`` the first failure kills the rest and fails."""
        end = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs.values()):
            failed = [tag for tag, p in self.procs.items() if p.poll() not in (None, 0)]
            if fail_fast and failed:
                self.kill()
                pytest.fail(f"{failed} failed; logs:\n" + self.logs())
            if time.monotonic() > end:
                self.kill()
                pytest.fail(f"the job did not finish within {timeout}s; logs:\n" + self.logs())
            time.sleep(0.05)
        return {tag: p.returncode for tag, p in self.procs.items()}

    def wait_for(self, path: pathlib.Path, timeout: float = WAIT) -> None:
        end = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > end or any(p.poll() not in (None, 0) for p in self.procs.values()):
                self.kill()
                pytest.fail(f"{path.name} did not appear; logs:\n" + self.logs())
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(f"--- {tag}\n{self.log(tag)[-3000:]}" for tag in self.procs)

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def clusters() -> Any:
    made: list[Cluster] = []
    yield made
    for c in made:
        c.kill()


def run_ok(clusters: list[Cluster], tmp: pathlib.Path, pservers: int, trainers: int, args: list[str],
           **kw: Any) -> Cluster:
    c = Cluster(tmp, pservers, trainers, args, **kw)
    clusters.append(c)
    codes = c.wait(fail_fast=True)
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}; logs:\n{c.logs()}"
    return c


def local_reference(model: str, opt: str, lr: str, init: dict[str, np.ndarray], trainers: int,
                    steps: range, present: Callable[[int, int], bool] | None = None) -> dict[str, np.ndarray]:
    """Single-process training on the union of the trainers' batches (of the trainers ``present(t, step)``
    says took part in each step; all by default), from ``init``."""
    import runtime

    main, startup = ps_worker.build(model, opt, lr)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    for name, value in init.items():
        scope.set_var(name, value)
    for step in steps:
        feeds = [ps_worker.batch(model, t, step) for t in range(trainers) if present is None or present(t, step)]
        exe.run(main, feed={k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}, scope=scope)
    return {n: scope.numpy(n) for n in init}


def gather_table(out: pathlib.Path, pservers: int, suffix: str) -> np.ndarray:
    """The whole table from the pservers' shards (shard i holds global row r at local row r // n)."""
    shards = [np.load(out / f"pserver_{i}{suffix}.npz")["table"] for i in range(pservers)]
    table = np.zeros((ps_worker.TABLE_ROWS, ps_worker.EMB))
    for i, shard in enumerate(shards):
        rows = np.arange(i, ps_worker.TABLE_ROWS, pservers)
        table[rows] = shard[rows // pservers]
    return table


def trained(out: pathlib.Path, model: str, pservers: int, suffix: str = "") -> dict[str, np.ndarray]:
    params = dict(np.load(out / f"trainer_0{suffix}.npz"))
    if model == "table":
        params["table"] = gather_table(out, pservers, "_init" if suffix == "_init" else "")
    return params


SYNC_CASES = [("fc", "momentum", "const"), ("fc", "adam", "const"), ("fc", "sgd", "exp"), ("table", "sgd", "const")]
# Every case on gRPC; on the data plane a sparse one here and a dense one in
# test_forged_complete_and_sequence_numbers_change_nothing[token-shm] (fc/sgd/const, 12 steps, the same
# ``check_sync_job``): the transport does not depend on the optimizer. Two more gRPC cases run as jobs other
# tests need anyway, with the same checks: fc/sgd/const in
# test_forged_complete_and_sequence_numbers_change_nothing[no-token-grpc] (forged requests refused) and
# table/adam/exp in test_sync_table_adam_exp_matches_local (8 steps, the job
# test_checkpoint_restart_is_bit_identical resumes against).
SYNC_RUNS = [(*case, "grpc") for case in SYNC_CASES] + [("table", "sgd", "const", "shm")]


def check_sync_job(out: pathlib.Path, c: Cluster, model: str, opt: str, lr: str, plane: str, steps: int) -> None:
    """The 2 x 2 sync job ``c`` that wrote ``out`` moved its tensors as ``plane`` says, both trainers hold the
    same parameters, every one trained, and they are single-process training's on the union of the batches."""
    check_plane(c, plane, ["trainer.0", "trainer.1"])
    init, final = trained(out, model, 2, "_init"), trained(out, model, 2)
    other = dict(np.load(out / "trainer_1.npz"))
    for name in other:
        np.testing.assert_array_equal(other[name], final[name], err_msg=f"trainers disagree on {name}")
    expected = local_reference(model, opt, lr, init, 2, range(steps))
    for name, value in expected.items():
        assert not np.allclose(value, init[name]), f"{name} did not train"
        np.testing.assert_allclose(final[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("model,opt,lr,plane", SYNC_RUNS, ids=["-".join(r) for r in SYNC_RUNS])
def test_sync_training_matches_local(tmp_path: pathlib.Path, clusters: list[Cluster], model: str, opt: str,
                                     lr: str, plane: str) -> None:
    steps = 5  # past the exp rate's first step down (at 3), Adam's bias correction moving every step
    c = run_ok(clusters, tmp_path, 2, 2, ["--model", model, "--opt", opt, "--lr", lr, "--steps", str(steps)],
               env=DATA_PLANE[plane])
    check_sync_job(tmp_path, c, model, opt, lr, plane, steps)


TABLE_ADAM_EXP = ["--model", "table", "--opt", "adam", "--lr", "exp"]


@pytest.fixture(scope="module")
def table_adam_exp_job(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(out, cluster) of one 2 x 2 sync job of the table model, Adam, the exp rate (it steps down at 3 and
    6), 8 steps, data plane off; its processes are killed (by pid) at the module's end."""
    out = tmp_path_factory.mktemp("table_adam_exp")
    made: list[Cluster] = []
    try:
        yield out, run_ok(made, out, 2, 2, TABLE_ADAM_EXP + ["--steps", "8"], env=DATA_PLANE["grpc"])
    finally:
        for c in made:
            c.kill()


def test_sync_table_adam_exp_matches_local(table_adam_exp_job: Any) -> None:
    out, c = table_adam_exp_job
    check_sync_job(out, c, "table", "adam", "exp", "grpc", 8)


def test_async_training_moves_every_parameter(tmp_path: pathlib.Path, clusters: list[Cluster]) -> None:
    run_ok(clusters, tmp_path, 2, 2, ["--model", "table", "--async", "--steps", "10"])
    init, final = trained(tmp_path, "table", 2, "_init"), trained(tmp_path, "table", 2)
    for name in init:
        assert np.all(np.isfinite(final[name])) and not np.allclose(final[name], init[name]), name


def test_uneven_data_finishes(tmp_path: pathlib.Path, clusters: list[Cluster]) -> None:
    run_ok(clusters, tmp_path, 2, 3, ["--steps", "3"],
           trainer_args={1: ["--steps", "6"], 2: ["--steps", "9"]})
    assert "every trainer completed after 9 updates" in clusters[0].log("pserver.0")


def test_uneven_data_averages_over_the_trainers_present(tmp_path: pathlib.Path, clusters: list[Cluster]) -> None:
    """After trainer 1 completes, a step is the mean over trainer 0's batch alone: single-process training
    on the batches actually present (not the same step at half the learning rate)."""
    run_ok(clusters, tmp_path, 2, 2, ["--opt", "momentum", "--steps", "8"], trainer_args={1: ["--steps", "3"]})
    init, final = trained(tmp_path, "fc", 2, "_init"), trained(tmp_path, "fc", 2)
    expected = local_reference("fc", "momentum", "const", init, 2, range(8), present=lambda t, step: t == 0 or step < 3)
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def _forge(endpoints: list[str], token: str | None) -> list[grpc.StatusCode]:
    """Forged requests of a process outside the job: Complete for every trainer (twice) and a send with a
    huge sequence number; the status codes they got."""
    from runtime.rpc import send_recv_pb2 as pb
    from runtime.rpc.server import SERVICE, grpc_options
    from runtime.rpc.wire import encode_variable

    codes = []
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    forged = [("Complete", pb.CompleteRequest(trainer_id=t).SerializeToString()) for t in (0, 1, 0, 1)]
    forged.append(("SendVariable", encode_variable("fc_b@GRAD.trainer_0", np.ones(ps_worker.HIDDEN), trainer_id=0,
                                                   seq=1 << 62)))
    for ep in endpoints:
        with grpc.insecure_channel(ep, options=grpc_options(0)) as channel:
            for method, request in forged:
                call = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=lambda x: x,
                                           response_deserializer=lambda x: x)
                try:
                    call(request, timeout=10, metadata=metadata)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())
    return codes


@pytest.mark.parametrize("token,plane", [(None, "grpc"), ("job-secret", "grpc"), ("job-secret", "shm")],
                         ids=["no-token-grpc", "token-grpc", "token-shm"])
def test_forged_complete_and_sequence_numbers_change_nothing(tmp_path: pathlib.Path, clusters: list[Cluster],
                                                             token: str | None, plane: str) -> None:
    """Issue 13 cases 1 and 2 on a live 2x2 job: forged Complete calls cannot end it, a forged huge seq
    cannot make the pservers drop real gradients; the job ends with the parameters of local training."""
    steps = 12
    env = {**({"FLOTILLA_JOB_TOKEN": token} if token else {}), **DATA_PLANE[plane]}
    c = Cluster(tmp_path, 2, 2, ["--steps", str(steps), "--sleep", "0.1"], env=env)
    clusters.append(c)
    end = time.monotonic() + WAIT
    while "step 1" not in c.log("trainer.0") and time.monotonic() < end and c.procs["trainer.0"].poll() is None:
        time.sleep(0.1)
    codes = _forge(c.endpoints, None)
    expected = grpc.StatusCode.UNAUTHENTICATED if token else grpc.StatusCode.FAILED_PRECONDITION
    completes, sends = codes[:4] + codes[5:9], [codes[4], codes[9]]
    assert completes == [expected] * 8, codes
    # the send reaches the pserver holding fc_b's gradient; the other one holds no such variable
    assert sorted(sends, key=str) == sorted([expected, grpc.StatusCode.UNAUTHENTICATED if token
                                             else grpc.StatusCode.NOT_FOUND], key=str), codes
    assert c.procs["pserver.0"].poll() is None and c.procs["pserver.1"].poll() is None
    codes = c.wait(fail_fast=True)
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}; logs:\n{c.logs()}"
    check_sync_job(tmp_path, c, "fc", "sgd", "const", plane, steps)  # also SYNC_RUNS' fc/sgd/const on gRPC


def test_restarted_trainer_rejoins_and_nothing_is_lost(tmp_path: pathlib.Path, clusters: list[Cluster],
                                                       plane: str) -> None:
    """Issue 13 case 4: trainer 1 dies at the start of step 3 and is restarted with the same id. It died
    owing its FETCH barrier of step 2 (it rides on the SEND barrier of step 3), so the pservers hold at
    step 2 and admit it at step 3: its sends are applied from its first one, and the result is
    single-process training on every batch, none dropped."""
    steps = 10
    c = Cluster(tmp_path, 2, 2, ["--steps", str(steps)], trainer_args={1: ["--die-at", "3"]},
                env={**AUTHENTICATED, **DATA_PLANE[plane]})  # only an authenticated pserver trusts a restart
    clusters.append(c)
    assert c.procs["trainer.1"].wait(timeout=WAIT) == -signal.SIGKILL, c.logs()
    c.restart_trainer(1, ["--steps", str(steps), "--resume"])
    codes = c.wait(fail_fast=True)
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}; logs:\n{c.logs()}"
    assert "trainer 1 resumes at step 3" in c.log("trainer.1.restarted"), c.log("trainer.1.restarted")
    check_plane(c, plane, ["trainer.0", "trainer.1.restarted"])
    for tag in ("pserver.0", "pserver.1"):
        assert "trainer 1 rejoined as incarnation" in c.log(tag) and "it takes part from step 3" in c.log(tag)
    init, final = trained(tmp_path, "fc", 2, "_init"), trained(tmp_path, "fc", 2)
    expected = local_reference("fc", "sgd", "const", init, 2, range(steps))
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
    np.testing.assert_array_equal(dict(np.load(tmp_path / "trainer_1.npz"))["fc_w"], final["fc_w"])


def test_dead_trainer_fails_the_pservers_naming_it(tmp_path: pathlib.Path, clusters: list[Cluster],
                                                   plane: str) -> None:
    c = Cluster(tmp_path, 2, 2, ["--steps", "10"], env={"FLAGS_pserver_timeout_ms": "4000", **DATA_PLANE[plane]},
                trainer_args={1: ["--die-at", "3"]})
    clusters.append(c)
    start = time.monotonic()
    codes = c.wait(timeout=60)
    assert codes["trainer.1"] == -signal.SIGKILL
    assert codes["pserver.0"] != 0 and codes["pserver.1"] != 0 and codes["trainer.0"] != 0, c.logs()
    assert time.monotonic() - start < 45
    for tag in ("pserver.0", "pserver.1"):
        assert "trainer(s) [1]" in c.log(tag) and "step 3" in c.log(tag), c.log(tag)
    assert "trainer(s) [1]" in c.log("trainer.0"), c.log("trainer.0")


def test_dead_pserver_fails_the_trainers_naming_it(tmp_path: pathlib.Path, clusters: list[Cluster],
                                                   plane: str) -> None:
    c = Cluster(tmp_path, 2, 2, ["--steps", "200", "--sleep", "0.05"],
                env={"FLAGS_rpc_deadline": "3000", **DATA_PLANE[plane]})
    clusters.append(c)
    end = time.monotonic() + WAIT
    while "step 2" not in c.log("trainer.0") and time.monotonic() < end:
        time.sleep(0.1)
    victim = c.procs["pserver.1"]
    victim.kill()
    victim.wait(timeout=10)
    killed_at = time.monotonic()
    for tag in ("trainer.0", "trainer.1"):
        code = c.procs[tag].wait(timeout=30)
        assert code != 0
        assert c.endpoints[1] in c.log(tag), c.log(tag)
    assert time.monotonic() - killed_at < 15


def test_checkpoint_restart_is_bit_identical(tmp_path: pathlib.Path, clusters: list[Cluster],
                                            table_adam_exp_job: Any) -> None:
    args = TABLE_ADAM_EXP
    whole, _ = table_adam_exp_job  # 8 steps: the exp rate steps down at 3 and 6, in both halves

    first, ckpt = tmp_path / "first", tmp_path / "ckpt"
    first.mkdir()
    c = Cluster(first, 2, 2, args + ["--steps", "4", "--save-at", "4", "--ckpt", str(ckpt), "--hold"],
                env={"FLOTILLA_CHECKPOINT_ROOT": str(tmp_path), **DATA_PLANE["grpc"]})  # as the whole job
    clusters.append(c)
    c.wait_for(first / "saved")
    c.kill()
    assert sorted(os.listdir(ckpt)) == ["pserver_0", "pserver_1"]  # the trainer holds no state of its own

    second = tmp_path / "second"
    second.mkdir()
    run_ok(clusters, second, 2, 2, args + ["--first-step", "4", "--steps", "4", "--load", str(ckpt)],
           env=DATA_PLANE["grpc"])
    expected, got = trained(whole, "table", 2), trained(second, "table", 2)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
