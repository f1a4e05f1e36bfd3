"""Jobs across hosts: every process started by hand in its host, a network namespace of ``tests/netns.py``
(addresses 10.213.7.1 and 10.213.7.2 on one bridge), with Paddle's role variables as
``runtime.launch.pserver_env``/``trainer_env`` build them, endpoints on the hosts' addresses and one
``FLOTILLA_JOB_TOKEN`` everywhere (the pservers serve a non-loopback endpoint, so they require it).

- Sync PS, 2 pservers x 2 trainers, one pserver and one trainer a host: the parameters equal
  single-process training on the union of the trainers' batches from the same initial values
  (``tests/runtime/rpc/test_ps_training.py``'s criterion: float64, rtol 1e-9, atol 1e-12), for a model with
  a distributed table, Adam and a decaying learning rate.
- The same job with every batch on the data plane (``FLAGS_rpc_data_plane_min_bytes=1``): each trainer
  moves its batches to the pserver of the other host on the TCP plane (``runtime.rpc.tcp_plane``; its
  ``data plane:`` line says ``tcp (N transfers)``) and to the one of its own host through shared memory,
  and the parameters equal the same job on pure gRPC (``FLAGS_rpc_data_plane=off``), rtol 1e-9.
- The CTR example laid out the same way: every trainer trains its 14 batches, and trainer 0's test AUC
  passes the distributed examples' bar (``tests/examples/test_examples_distributed.py``: > 0.72) and is
  within ``AUC_MARGIN`` of one process trained on the union of the batches (batch 1024 of the same shuffle
  holds the two trainers' 512-row batches of a step). Not equal to rounding: the example sets no seed, and
  a random op draws by its index in its program, so the pservers' startup programs initialise the
  parameters with other draws than one process's (0.772 against 0.780 measured).
- nccl2, 2 trainers on 2 hosts: parameters equal one process on the union of the batches
  (``tests/runtime/collective``'s criterion, rtol 1e-5).
- A host taken down mid-run, by killing its processes or by setting its link down (PS jobs on gRPC and on
  the TCP data plane): the survivors on the other host exit non-zero within ``DOWN_WAIT_S``, their errors naming the lost endpoint (a pserver names
  the lost trainer by id: it knows trainers by id only; it may name trainer 0 too, which waits on the lost
  pserver). Except a collective host whose link goes down (xfail, see the test). The timeouts are set small for this
  (``FLAGS_rpc_deadline``, ``FLAGS_pserver_timeout_ms``, ``FLAGS_collective_timeout_s``,
  ``FLAGS_collective_heartbeat_s``).

Every process is killed by the fixture at the end (pass or fail) and every wait is bounded. Skipped, with
the reason, where network namespaces cannot be made (not root, no iproute2).
"""
from __future__ import annotations

import os
import pathlib
import re
import secrets
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import pytest

from examples.ctr import data as ctr_data
from runtime.launch import child_environ, pserver_env, trainer_env
from runtime.role import ROLE_ENV_VARS
from tests.netns import Hosts
from tests.runtime.collective import worker as collective_worker
from tests.runtime.rpc.test_ps_training import local_reference, trained

pytestmark = pytest.mark.serial(waits=True)  # jobs across namespaced hosts, timed against their deadlines

REPO = pathlib.Path(__file__).resolve().parents[2]
PORT_PS, PORT_TRAINER = 6170, 6171  # each host has its own port space: fixed ports cannot collide
JOB_WAIT_S = 120.0
DOWN_WAIT_S = 30.0  # from taking a host down to every survivor having exited
AUC_MARGIN = 0.05  # the examples' same-data convergence margin (ASYNC_MARGIN there)
CTR_ARGS = ("--hash-dim", "10007", "--hidden", "32", "32", "--epochs", "2", "--log-every", "100", "--no-slice")
PS_FLAGS = {"FLAGS_rpc_deadline": "8000", "FLAGS_pserver_timeout_ms": "4000", "FLAGS_rpc_wait_report_ms": "2000"}
COLLECTIVE_FLAGS = {"FLAGS_collective_timeout_s": "10", "FLAGS_collective_heartbeat_s": "3"}


class Job:
    """Processes of one job on namespaced hosts, each logging to ``<out>/<tag>.log``."""

    def __init__(self, hosts: Hosts, out: pathlib.Path, flags: dict[str, str]) -> None:
        self.hosts, self.out = hosts, out
        base = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS and k != "XLA_FLAGS"}
        self.base = {**base, "PYTHONPATH": str(REPO), "FLOTILLA_JOB_TOKEN": secrets.token_hex(16), **flags}
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.host_of: dict[str, int] = {}

    def start(self, host: int, tag: str, args: list[str], role_env: dict[str, str]) -> None:
        with open(self.out / f"{tag}.log", "w") as log:
            self.procs[tag] = self.hosts.popen(host, [sys.executable, *args], env=child_environ(self.base, role_env),
                                               cwd=REPO, stdout=log)
        self.host_of[tag] = host

    def log(self, tag: str) -> str:
        return (self.out / f"{tag}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"--- {tag} (host {self.host_of[tag]})\n{self.log(tag)[-2500:]}" for tag in self.procs)

    def wait(self, tags: list[str] | None = None, timeout: float = JOB_WAIT_S) -> dict[str, int]:
        """Exit codes of ``tags`` (all by default); the first failure or the timeout fails the test."""
        tags = list(self.procs) if tags is None else tags
        end = time.monotonic() + timeout
        while any(self.procs[t].poll() is None for t in tags):
            if time.monotonic() > end:
                pytest.fail(f"{tags} did not all exit within {timeout}s; logs:\n{self.logs()}")
            time.sleep(0.05)
        return {t: self.procs[t].returncode for t in tags}

    def wait_for_line(self, tag: str, pattern: str, timeout: float = JOB_WAIT_S) -> None:
        end = time.monotonic() + timeout
        while not re.search(pattern, self.log(tag), re.MULTILINE):
            failed = {t: p.returncode for t, p in self.procs.items() if p.poll() not in (None, 0)}
            if failed or time.monotonic() > end:
                pytest.fail(f"{tag} never printed {pattern!r} (failed: {failed}); logs:\n{self.logs()}")
            time.sleep(0.05)


def endpoints(hosts: Hosts, port: int) -> list[str]:
    return [f"{a}:{port}" for a in hosts.addresses]


def start_ps(job: Job, script: list[str]) -> tuple[list[str], list[str]]:
    """Pserver i and trainer i on host i (i = 0, 1); the pserver and trainer endpoints."""
    servers, workers = endpoints(job.hosts, PORT_PS), endpoints(job.hosts, PORT_TRAINER)
    for i in range(2):
        job.start(i, f"pserver.{i}", script, pserver_env(servers, workers, i))
    for i in range(2):
        job.start(i, f"trainer.{i}", script, trainer_env(servers, workers, i))
    return servers, workers


def start_collective(job: Job, args: list[str]) -> list[str]:
    """Trainer r on host r (r = 0, 1) running the collective test worker; the trainer endpoints."""
    workers = endpoints(job.hosts, PORT_TRAINER)
    for r in range(2):
        job.start(r, f"trainer.{r}", ["-m", "tests.runtime.collective.worker", "--out", str(job.out), *args],
                  trainer_env([], workers, r))
    return workers


@pytest.fixture(scope="module")
def ctr_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("ctr")
    ctr_data.generate_split(out, 8000, 1600, seed=0)
    return out


def test_ctr_2x2_sync_across_two_hosts_equals_one_process(tmp_path: pathlib.Path, ctr_dir: pathlib.Path,
                                                          netns_hosts: Callable[[int], Hosts]) -> None:
    from examples.ctr import train as ctr_train

    job = Job(netns_hosts(2), tmp_path, PS_FLAGS)
    start_ps(job, ["examples/ctr/train.py", "--data-dir", str(ctr_dir), "--batch-size", "512", "--sync", *CTR_ARGS])
    codes = job.wait()
    assert all(c == 0 for c in codes.values()), f"exit codes {codes}; logs:\n{job.logs()}"
    for t in (0, 1):  # 2 epochs of 7 of the 15 batches each
        assert f"trainer {t}: trained 14 steps" in job.log(f"trainer.{t}"), job.logs()
    m = re.search(r"trainer 0: test AUC: (\d\.\d+) \(exact: (\d\.\d+)\)", job.log("trainer.0"))
    assert m, job.logs()
    distributed = float(m.group(2))
    # One process on the union: batch 1024 of the same shuffle is trainer 0's and trainer 1's batches of a step.
    single = ctr_train.main(["--data-dir", str(ctr_dir), "--batch-size", "1024", *CTR_ARGS])
    assert single["steps"] == 14 and distributed > 0.72
    assert abs(distributed - single["test_auc_exact"]) <= AUC_MARGIN, (distributed, single["test_auc_exact"])


def test_ps_2x2_sync_across_two_hosts_equals_one_process(tmp_path: pathlib.Path,
                                                         netns_hosts: Callable[[int], Hosts]) -> None:
    model, opt, lr, steps = "table", "adam", "exp", 8
    job = Job(netns_hosts(2), tmp_path, PS_FLAGS)
    start_ps(job, ["-m", "tests.runtime.rpc.ps_worker", "--out", str(tmp_path), "--model", model, "--opt", opt,
                   "--lr", lr, "--steps", str(steps)])
    codes = job.wait()
    assert all(c == 0 for c in codes.values()), f"exit codes {codes}; logs:\n{job.logs()}"
    init, final = trained(tmp_path, model, 2, "_init"), trained(tmp_path, model, 2)
    other = dict(np.load(tmp_path / "trainer_1.npz"))
    for name in other:
        np.testing.assert_array_equal(other[name], final[name], err_msg=f"trainers disagree on {name}")
    for name, value in local_reference(model, opt, lr, init, 2, range(steps)).items():
        assert not np.allclose(value, init[name]), f"{name} did not train"
        np.testing.assert_allclose(final[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def test_ps_2x2_sync_across_two_hosts_on_the_tcp_plane_equals_grpc(tmp_path: pathlib.Path,
                                                                    netns_hosts: Callable[[int], Hosts]) -> None:
    model, opt, lr, steps = "table", "adam", "exp", 8
    final = {}
    for plane in ("auto", "off"):  # every batch on the data plane (min bytes 1), then pure gRPC
        out = tmp_path / plane
        out.mkdir()
        job = Job(netns_hosts(2), out, {**PS_FLAGS, "FLAGS_rpc_data_plane": plane,
                                        "FLAGS_rpc_data_plane_min_bytes": "1"})
        servers, _ = start_ps(job, ["-m", "tests.runtime.rpc.ps_worker", "--out", str(out), "--model", model, "--opt",
                                    opt, "--lr", lr, "--steps", str(steps)])
        codes = job.wait()
        assert all(c == 0 for c in codes.values()), f"{plane}: exit codes {codes}; logs:\n{job.logs()}"
        for t in (0, 1):  # trainer t: shared memory with the pserver of its host, TCP with the other's
            line = re.search(r"^data plane: (.*)$", job.log(f"trainer.{t}"), re.MULTILINE)
            assert line, job.logs()
            if plane == "auto":
                assert re.search(rf"{re.escape(servers[1 - t])} tcp \([1-9]\d* transfers\)", line.group(1)), \
                    line.group(1)
                assert f"{servers[t]} shm" in line.group(1), line.group(1)
            else:
                assert line.group(1) == "unused", line.group(1)
        final[plane] = trained(out, model, 2)
        if plane == "auto":
            init = trained(out, model, 2, "_init")
    for name, value in final["off"].items():
        assert not np.allclose(value, init[name]), f"{name} did not train"
        np.testing.assert_allclose(final["auto"][name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def test_nccl2_two_trainers_on_two_hosts_equal_one_process(tmp_path: pathlib.Path,
                                                           netns_hosts: Callable[[int], Hosts]) -> None:
    configs = ("momentum_fused", "sparse_embedding_sgd")
    # No hosts file: the hostname resolves as in the root namespace (to no address of these hosts), so this
    # passes only because gloo binds the trainer endpoint's address (runtime.collective._bind_gloo).
    job = Job(netns_hosts(2, resolve_hostname=False), tmp_path, COLLECTIVE_FLAGS)
    start_collective(job, ["--configs", ",".join(configs)])
    codes = job.wait()
    assert all(c == 0 for c in codes.values()), f"exit codes {codes}; logs:\n{job.logs()}"
    for config in configs:
        opt, _ = collective_worker.CONFIGS[config]
        ranks = [dict(np.load(tmp_path / f"{config}.rank{r}.npz")) for r in (0, 1)]
        reference = collective_worker.train_single(opt, seed=100)
        for name, value in reference.items():
            np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=f"{config}: {name}")
            np.testing.assert_allclose(ranks[0][name], value, rtol=1e-5, atol=1e-6, err_msg=f"{config}: {name}")


def take_down(hosts: Hosts, host: int, how: str) -> None:
    if how == "kill":
        hosts.kill_host(host)
    else:
        hosts.link_down(host)


@pytest.mark.parametrize("plane", ["grpc", "tcp"])
@pytest.mark.parametrize("how", ["kill", "link_down"])
def test_ps_host_down_is_named_by_the_survivors(tmp_path: pathlib.Path, netns_hosts: Callable[[int], Hosts],
                                                 how: str, plane: str) -> None:
    hosts = netns_hosts(2)
    # tcp: every batch on the data plane, so the survivors lose the other host on its TCP stream
    job = Job(hosts, tmp_path, {**PS_FLAGS, **({"FLAGS_rpc_data_plane_min_bytes": "1"} if plane == "tcp" else {})})
    servers, _ = start_ps(job, ["-m", "tests.runtime.rpc.ps_worker", "--out", str(tmp_path), "--steps", "400",
                                "--sleep", "0.05"])
    job.wait_for_line("trainer.0", r"step 3\b")
    take_down(hosts, 1, how)
    down_at = time.monotonic()
    codes = job.wait(["pserver.0", "trainer.0"], timeout=DOWN_WAIT_S)
    took = time.monotonic() - down_at
    assert codes["pserver.0"] != 0 and codes["trainer.0"] != 0, f"{codes}\n{job.logs()}"
    assert servers[1] in job.log("trainer.0"), job.logs()
    # trainer 1 is gone; trainer 0 may be too, from pserver 0's view (blocked on the lost pserver 1)
    assert re.search(r"trainer\(s\) \[(0, )?1\]", job.log("pserver.0")), job.logs()
    assert took < DOWN_WAIT_S


@pytest.mark.parametrize("how", ["kill", pytest.param("link_down", marks=pytest.mark.xfail(
    strict=True, reason="TODO(#22): a silent peer is found by JAX's heartbeat check, whose default handler "
                        "aborts the survivor (SIGABRT, naming task 1, not its endpoint); a Python "
                        "missed_heartbeat_callback cannot replace it (jaxlib 0.10 cannot pass it the "
                        "absl::Status: std::bad_cast, abort)"))])
def test_collective_host_down_is_named_by_the_survivor(tmp_path: pathlib.Path,
                                                       netns_hosts: Callable[[int], Hosts], how: str) -> None:
    hosts = netns_hosts(2)
    job = Job(hosts, tmp_path, COLLECTIVE_FLAGS)
    workers = start_collective(job, ["--configs", "sgd_allreduce", "--steps", "400", "--pause", "0.05"])
    job.wait_for_line("trainer.0", r"step 2 done")
    take_down(hosts, 1, how)
    down_at = time.monotonic()
    codes = job.wait(["trainer.0"], timeout=DOWN_WAIT_S)
    assert codes["trainer.0"] == 1, job.logs()  # the Flotilla error, then exit 1 (no abort)
    assert f"trainer(s) [1] ({workers[1]}) left the group" in job.log("trainer.0"), job.logs()
    assert time.monotonic() - down_at < DOWN_WAIT_S
