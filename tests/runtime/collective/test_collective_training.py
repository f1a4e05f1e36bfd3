"""nccl2/collective training on real processes over 127.0.0.1 (gloo on CPU): numerics equal to one
process on the union of the batches, the same with several devices in one process, local SGD, and
failures (a trainer that dies, a trainer that never comes) that end in bounded time naming the rank."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from typing import Iterator

import numpy as np
import pytest

from runtime.launch import free_ports
from tests.runtime.collective import worker

pytestmark = pytest.mark.serial  # collective jobs of two processes

REPO = pathlib.Path(__file__).resolve().parents[3]
RTOL, ATOL = 1e-5, 1e-6
WAIT_S = 120



def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "TRAINING_ROLE", "XLA_FLAGS"))}
    e.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "FLAGS_collective_timeout_s": "60",
              "FLAGS_collective_heartbeat_s": "10", **extra})
    return e


class Procs:
    """Processes this test started; every one is killed (by pid) at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], **extra: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "tests.runtime.collective.worker", *args], cwd=REPO,
                             env=env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        return p

    def wait(self, p: subprocess.Popen, timeout: float = WAIT_S) -> tuple[int, str]:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def procs() -> Iterator[Procs]:
    ps = Procs()
    try:
        yield ps
    finally:
        ps.kill_all()


def trainers(procs: Procs, out: pathlib.Path, n: int = 2, configs: str | None = None,
             **kw: str) -> list[tuple[int, str]]:
    endpoints = ",".join(f"127.0.0.1:{p}" for p in free_ports(n))
    extra = ["--configs", configs] if configs else []
    started = [procs.start(["--rank", str(r), "--endpoints", endpoints, "--out", str(out), *extra], **kw)
               for r in range(n)]
    return [procs.wait(p) for p in started]


def load(path: pathlib.Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module", params=["auto", "xla"])
def two_trainers(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> pathlib.Path:
    """One 2-process job training every configuration of ``worker.CONFIGS``, the DGC ones included (one
    group for all of them), its dense sums through shared memory (``FLAGS_cpu_allreduce=auto``, every
    trainer on this host; ``dgc_static`` then gathers its pairs through the group's arena) or XLA's gloo."""
    out = tmp_path_factory.mktemp("collective")
    ps = Procs()
    try:
        results = trainers(ps, out, FLAGS_cpu_allreduce=request.param)
    finally:
        ps.kill_all()
    via = "shared memory" if request.param == "auto" else "XLA"
    for code, text in results:
        assert code == 0, text
        assert f"dense sums through {via}" in text, text[-2000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", ["momentum_fused", "adam_unfused", "sgd_allreduce", "sparse_embedding_sgd"])
def test_two_processes_equal_one_process_on_the_union(two_trainers: pathlib.Path, config: str) -> None:
    opt, _ = worker.CONFIGS[config]
    rank0, rank1 = (load(two_trainers / f"{config}.rank{r}.npz") for r in (0, 1))
    reference = worker.train_single(opt, seed=100)  # trainer 0's initial values, the whole batches
    for name, value in reference.items():
        np.testing.assert_array_equal(rank0[name], rank1[name], err_msg=f"{config}: {name} differs between ranks")
        np.testing.assert_allclose(rank0[name], value, rtol=RTOL, atol=ATOL, err_msg=f"{config}: {name}")
    # the ranks started from different seeds: without the broadcast they could not agree
    assert not np.allclose(worker.train_single(opt, seed=101)["w0"], reference["w0"])


@pytest.mark.slow
@pytest.mark.parametrize("local,allreduce", [("sgd_local_sgd_k1", "sgd_allreduce")])
def test_local_sgd_k1_equals_grad_allreduce(two_trainers: pathlib.Path, local: str, allreduce: str) -> None:
    a, b = load(two_trainers / f"{local}.rank0.npz"), load(two_trainers / f"{allreduce}.rank0.npz")
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.slow
def test_local_sgd_momentum_k1_and_k2_keep_ranks_equal(two_trainers: pathlib.Path) -> None:
    # Momentum's velocity is linear in the gradients: averaging parameters every step equals averaging
    # gradients. With k=2 and 5 steps the last step is local, so the ranks differ, as they should.
    a = load(two_trainers / "momentum_local_sgd_k1.rank0.npz")
    ref = worker.train_single("momentum", seed=100)
    for name in a:
        np.testing.assert_allclose(a[name], ref[name], rtol=RTOL, atol=ATOL, err_msg=name)
    k2 = [load(two_trainers / f"sgd_local_sgd_k2.rank{r}.npz") for r in (0, 1)]
    assert not np.allclose(k2[0]["w0"], k2[1]["w0"])


DEVICE_CONFIGS = ("momentum_fused", "adam_unfused")


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One process with two CPU devices training each of ``DEVICE_CONFIGS`` in turn (``--devices``)."""
    out = tmp_path_factory.mktemp("devices")
    ps = Procs()
    try:
        p = ps.start(["--devices", "--configs", ",".join(DEVICE_CONFIGS), "--out", str(out)],
                     XLA_FLAGS="--xla_force_host_platform_device_count=2")
        code, text = ps.wait(p)
    finally:
        ps.kill_all()
    assert code == 0, text
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", DEVICE_CONFIGS)
def test_two_devices_in_one_process(two_devices: pathlib.Path, config: str) -> None:
    got = load(two_devices / f"{config}.devices.npz")
    assert got.pop("losses").shape == (2,)  # one loss a device, as Fluid's ParallelExecutor fetches
    ref = worker.train_single(worker.CONFIGS[config][0], seed=100)
    for name, value in ref.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.slow
def test_a_trainer_that_dies_fails_the_other_naming_it(tmp_path: pathlib.Path, procs: Procs) -> None:
    endpoints = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    start = time.monotonic()
    p0 = procs.start(["--rank", "0", "--endpoints", endpoints, "--out", str(tmp_path), "--configs", "sgd_allreduce"])
    p1 = procs.start(["--rank", "1", "--endpoints", endpoints, "--out", str(tmp_path), "--configs", "sgd_allreduce",
                      "--die-at-step", "2"])
    code1, _ = procs.wait(p1)
    code0, text0 = procs.wait(p0, timeout=60)
    assert code1 == 3
    assert code0 == 1, text0[-3000:]  # the Flotilla error, then exit 1: no SIGABRT from JAX's shutdown
    assert f"trainer(s) [1] ({endpoints.split(',')[1]}) left the group" in text0, text0[-3000:]
    assert "Check failure stack trace" not in text0, text0[-3000:]
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_a_trainer_that_never_comes_is_named(tmp_path: pathlib.Path, procs: Procs) -> None:
    endpoints = ",".join(f"127.0.0.1:{p}" for p in free_ports(3))
    p0 = procs.start(["--rank", "0", "--endpoints", endpoints, "--out", str(tmp_path), "--configs", "sgd_allreduce"],
                     FLAGS_collective_timeout_s="4")
    p1 = procs.start(["--rank", "1", "--endpoints", endpoints, "--out", str(tmp_path), "--configs", "sgd_allreduce"],
                     FLAGS_collective_timeout_s="4")
    (code0, text0), (code1, text1) = procs.wait(p0, 60), procs.wait(p1, 60)
    assert code0 != 0 and code1 != 0
    missing = endpoints.split(",")[2]
    for text in (text0, text1):
        assert f"trainer(s) [2] ({missing}) did not join the group" in text, text[-2000:]


def test_ranks_running_different_programs_fail_naming_the_first_difference(tmp_path: pathlib.Path,
                                                                          procs: Procs) -> None:
    """Learning rate 0.1 on rank 0 and 0.2 on rank 1: both fail at group formation (no gloo abort, no
    silently diverging replicas), naming the ranks and the learning rate's fill_constant."""
    endpoints = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    started = [procs.start(["--rank", str(r), "--endpoints", endpoints, "--out", str(tmp_path), "--configs",
                            "sgd_allreduce", "--lr-factor", str(1 + r)]) for r in range(2)]
    for code, out in [procs.wait(p) for p in started]:
        assert code != 0 and "Traceback" not in out.split("[E650]")[-1], out
        assert "[E650] trainer(s) [1] run a different program than trainer 0 (the program forming the group); " \
               "trainer 1 first differs at op 1 of block 0 (fill_constant(Out=['learning_rate_0'])): attribute " \
               "'value' is 0.1 on trainer 0, 0.2 on trainer 1" in out, out
        assert "SIGABRT" not in out and "Fatal Python error" not in out
    assert not list(tmp_path.glob("*.npz"))


def test_ranks_whose_main_programs_differ_fail_at_their_first_run(tmp_path: pathlib.Path, procs: Procs) -> None:
    """Momentum 0.9 on rank 0 and 0.8 on rank 1: the startup programs agree (the group forms), the main
    programs do not; both fail before the first step, naming the momentum op, and exit 1 (no abort)."""
    endpoints = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    started = [procs.start(["--rank", str(r), "--endpoints", endpoints, "--out", str(tmp_path), "--configs",
                            "momentum_fused", "--momentum", str(0.9 - 0.1 * r)]) for r in range(2)]
    for code, out in [procs.wait(p) for p in started]:
        assert code == 1, out
        assert "[E650] trainer(s) [1] run a different program than trainer 0; trainer 1 first differs at op " in out
        assert "(momentum(Grad=['b0@GRAD']" in out and "attribute 'mu' is 0.9 on trainer 0, 0.8 on trainer 1" in out, out
        assert "Check failure stack trace" not in out
    assert not list(tmp_path.glob("*.npz"))


def test_fingerprints_ignore_names_seeds_and_rank_attributes() -> None:
    """A rank that built another program first (its variable names are offset), with its own random seed
    and trainer id, runs the same program; a different layer size does not."""
    from flotilla.fluid import layers, optimizer
    from ir.core import Program, program_guard
    from ir.names import unique_name
    from runtime.collective import _first_difference, fingerprint
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    def make(rank: int, offset: bool, size: int = 4) -> tuple[Program, Program]:
        main, startup = Program(), Program()
        main.random_seed = startup.random_seed = 10 + rank
        with unique_name.guard():
            if offset:
                with program_guard(Program(), Program()):
                    layers.fc(input=layers.data(name="z", shape=[3], dtype="float32"), size=2)
            with program_guard(main, startup):
                x = layers.data(name="x", shape=[6], dtype="float32")
                loss = layers.mean(layers.fc(input=x, size=size))
                optimizer.SGD(0.1).minimize(loss)
        t = DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2"))
        t.transpile(rank, program=main, startup_program=startup, trainers="127.0.0.1:1,127.0.0.1:2")
        return t.get_trainer_program(), t.get_trainer_startup_program()

    (m0, s0), (m1, s1), (m2, s2) = make(0, False), make(1, True), make(1, False, size=5)
    assert _first_difference(fingerprint(m0), fingerprint(m1), 1) is None
    assert _first_difference(fingerprint(s0), fingerprint(s1), 1) is None
    difference = _first_difference(fingerprint(s0), fingerprint(s2), 1)
    assert difference == "op 2 of block 0 (fill_constant(Out=['fc_0.b_0'])): attribute 'shape' is [4] on trainer 0, " \
                         "[5] on trainer 1; variable 'fc_0.b_0' is [[4], 'float32'] on trainer 0, [[5], 'float32'] on " \
                         "trainer 1"


DGC_RTOL, DGC_ATOL = 1e-4, 1e-5  # float32 training against a float64 numpy simulation


def test_dgc_two_processes_equal_a_simulation_of_the_algorithm(two_trainers: pathlib.Path) -> None:
    """2-trainer DGC (2 dense steps, then sparsity 0.75, 0.9, 0.9; local clipping) equals the numpy
    simulation of DGC over the same shards of the same batches; both ranks hold the same parameters."""
    rank0, rank1 = (load(two_trainers / f"dgc.rank{r}.npz") for r in (0, 1))
    reference = worker.train_dgc_simulated(seed=100)
    for name, value in reference.items():
        np.testing.assert_array_equal(rank0[name], rank1[name], err_msg=f"dgc: {name} differs between ranks")
        np.testing.assert_allclose(rank0[name], value, rtol=DGC_RTOL, atol=DGC_ATOL, err_msg=f"dgc: {name}")
    # compression changed the result: the run is not plain dense momentum
    assert not np.allclose(rank0["w0"], worker.train_single("momentum", seed=100)["w0"], rtol=1e-3, atol=1e-4)


def test_dgc_before_rampup_equals_dense_momentum(two_trainers: pathlib.Path) -> None:
    got = load(two_trainers / "dgc_dense.rank0.npz")
    for name, value in worker.train_single("momentum", seed=100).items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=f"dgc_dense: {name}")


def test_dgc_compressed_from_step_0_equals_the_simulation_and_lowers_the_loss(two_trainers: pathlib.Path) -> None:
    """Sparsity 0.75 from step 0 (one branch: the pairs go through the shared-memory arena when the job has
    one): equal to the simulation, equal on both ranks, and the loss over the run's batches falls."""
    rank0, rank1 = (load(two_trainers / f"dgc_static.rank{r}.npz") for r in (0, 1))
    for name, value in worker.train_dgc_simulated(seed=100, attrs=worker.DGC_STATIC_ATTRS).items():
        np.testing.assert_array_equal(rank0[name], rank1[name], err_msg=f"dgc_static: {name} differs between ranks")
        np.testing.assert_allclose(rank0[name], value, rtol=DGC_RTOL, atol=DGC_ATOL, err_msg=f"dgc_static: {name}")
    before = worker.eval_loss(worker.train_single("sgd", seed=100, steps=0))
    after = worker.eval_loss(dict(rank0))
    assert after < 0.7 * before, (before, after)


def test_dgc_in_one_process_is_dgc_with_a_group_of_one() -> None:
    got = worker.train_single("dgc", seed=100)
    for name, value in worker.train_dgc_simulated(seed=100, nranks=1).items():
        np.testing.assert_allclose(got[name], value, rtol=DGC_RTOL, atol=DGC_ATOL, err_msg=f"dgc, 1 process: {name}")
