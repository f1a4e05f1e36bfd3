"""``flotilla launch`` for jobs that span hosts: the launcher runs on every host with the same arguments and
starts the processes listed at this host's addresses (or at ``--node_ip``).

- Planning (no process started): every host derives the same endpoints (fixed ports: ``--servers``' own,
  ``--started_port`` + position for the rest, never OS-chosen), keeps only its share, and names the
  others; a job spanning hosts without ``FLOTILLA_JOB_TOKEN`` (or mutual TLS) is refused with the command
  to make one; a ``--node_ip`` that is no address here, and lists naming no address here, are refused.
  127.0.0.1 and 127.0.0.2 are both this host's addresses, so ``--node_ip`` picks the "host".
- Across namespaced hosts (``tests/netns.py``; skipped where namespaces cannot be made): one launcher a
  host, same arguments, each starting its own share: a collective job trains to the same parameters as one
  process on the union of the batches; a parameter-server job's processes all see one consistent role
  table.
- Two "hosts" on loopback (127.0.0.1 and 127.0.0.2, ``--node_ip``): a launcher whose peer host is lost (its
  launcher killed: coordinator or not, PS or collective) exits 1 within 15 s naming the lost endpoint; gloo
  and the group listen only on each trainer's own address (or ``FLOTILLA_GLOO_INTERFACE``'s).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import pytest

from runtime.launch import build_parser, free_ports, plan_job
from runtime.role import ROLE_ENV_VARS, LaunchError
from tests.netns import Hosts
from tests.runtime.collective import worker as collective_worker
from tests.runtime.test_multihost_netns import COLLECTIVE_FLAGS, PS_FLAGS

pytestmark = pytest.mark.serial(waits=True)  # launchers and their jobs on two hosts

REPO = pathlib.Path(__file__).resolve().parents[2]
JOB = str(REPO / "tests" / "runtime" / "launch_scripts" / "job.py")
TOKEN_ENV = {"FLOTILLA_JOB_TOKEN": "t" * 64}


def plan(*argv: str, environ: dict[str, str] | None = None):  # noqa: ANN201 - a JobPlan
    args: argparse.Namespace = build_parser().parse_args([*argv, JOB])
    return plan_job(args, TOKEN_ENV if environ is None else environ)


def test_each_host_derives_the_same_endpoints_and_starts_its_share() -> None:
    job = ("--servers", "127.0.0.1:36170,127.0.0.2:36170", "--workers", "127.0.0.1,127.0.0.2",
           "--started_port", "36180")
    first, second = plan(*job, "--node_ip", "127.0.0.1"), plan(*job, "--node_ip", "127.0.0.2")
    assert first.pserver_endpoints == second.pserver_endpoints == ("127.0.0.1:36170", "127.0.0.2:36170")
    assert first.trainer_endpoints == second.trainer_endpoints == ("127.0.0.1:36180", "127.0.0.2:36181")
    assert [p.tag for p in first.processes] == ["pserver.0", "trainer.0"]
    assert [p.tag for p in second.processes] == ["pserver.1", "trainer.1"]
    assert second.remote == ("pserver.0", "trainer.0")
    assert {p.env["PADDLE_PSERVERS_IP_PORT_LIST"] for p in (*first.processes, *second.processes)} == {
        "127.0.0.1:36170,127.0.0.2:36170"}


def test_collective_hosts_times_nproc_per_node() -> None:
    job = ("--ips", "127.0.0.1,127.0.0.2", "--nproc_per_node", "2", "--started_port", "36190")
    second = plan(*job, "--cluster_node_ips", "127.0.0.1,127.0.0.2", "--node_ip", "127.0.0.2")
    assert second.trainer_endpoints == ("127.0.0.1:36190", "127.0.0.1:36191", "127.0.0.2:36190", "127.0.0.2:36191")
    assert [(p.tag, p.env["PADDLE_TRAINER_ID"], p.env["PADDLE_CURRENT_ENDPOINT"]) for p in second.processes] == [
        ("trainer.2", "2", "127.0.0.2:36190"), ("trainer.3", "3", "127.0.0.2:36191")]
    with_gpus = plan(*job, "--node_ip", "127.0.0.2", "--gpus", "3,5")
    assert [p.env["FLAGS_selected_gpus"] for p in with_gpus.processes] == ["3", "5"]


def test_a_job_spanning_hosts_needs_the_shared_secret() -> None:
    with pytest.raises(LaunchError, match="spans hosts.*FLOTILLA_JOB_TOKEN is not set") as info:
        plan("--ips", "127.0.0.1,127.0.0.2", "--node_ip", "127.0.0.1", "--started_port", "36200", environ={})
    assert "secrets.token_hex(32)" in (info.value.hint or "")
    # Every address local (no --node_ip): this launcher starts the whole job and draws its own token.
    whole = plan("--ips", "127.0.0.1,127.0.0.2", "--started_port", "36200", environ={})
    assert len(whole.processes) == 2 and not whole.remote


def test_addresses_not_of_this_host_are_named() -> None:
    with pytest.raises(LaunchError, match="--node_ip 10.255.255.1 is not an address of this host"):
        plan("--servers", "10.255.255.1:6174", "--worker_num", "1", "--node_ip", "10.255.255.1")
    with pytest.raises(LaunchError, match=r"matches no process of the job.*10\.255\.255\.1"):
        plan("--ips", "10.255.255.1,10.255.255.2", "--nproc_per_node", "1")
    with pytest.raises(LaunchError, match="does not resolve"):
        plan("--servers", "no-such-host.invalid:6174", "--worker_num", "1")


def test_a_local_port_in_use_is_named_before_starting() -> None:
    import socket

    with socket.socket() as held:
        held.bind((B, 0))
        port = held.getsockname()[1]
        with pytest.raises(LaunchError) as e:
            plan("--ips", f"{A},{B}", "--node_ip", B, "--started_port", str(port))
    assert e.value.code == "E811" and f"port {port} on {B}" in e.value.message


# --- two "hosts" on loopback: 127.0.0.1 and 127.0.0.2, each launcher told which it is --------------------

A, B = "127.0.0.1", "127.0.0.2"
SCRIPTS = pathlib.Path(__file__).resolve().parent / "launch_scripts"
LOOP = str(SCRIPTS / "collective_loop.py")
TOKEN = TOKEN_ENV


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **TOKEN, "PYTHONPATH": str(REPO), "FLAGS_collective_heartbeat_s": "3",
           "FLAGS_collective_timeout_s": "20", **extra}
    return env


def _launcher(me: str, port: int, *script_args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "runtime.launch", "--ips", f"{A},{B}", "--nproc_per_node", "1",
                             "--started_port", str(port), "--node_ip", me, LOOP, *script_args],
                            cwd=REPO, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc: subprocess.Popen[str], needle: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not seen within {timeout} s:\n" + "".join(lines[-40:]))


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)  # its children die with it (PR_SET_PDEATHSIG)
    proc.wait(timeout=10)


@pytest.mark.parametrize("victim", [B, A], ids=["lose-trainer-1", "lose-coordinator"])
def test_losing_a_host_ends_the_other_naming_the_lost_endpoint(victim: str) -> None:
    port = free_ports(1)[0]
    procs = {me: _launcher(me, port, "--seconds", "60") for me in (A, B)}
    survivor = A if victim == B else B
    try:
        _wait_for(procs[victim], "joined trainer", 60)
        _wait_for(procs[survivor], "joined trainer", 60)
        _kill(procs[victim])
        start = time.monotonic()
        out, _ = procs[survivor].communicate(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        for proc in procs.values():
            _kill(proc)
    lost = f"{victim}:{port}"
    assert procs[survivor].returncode == 1, out[-3000:]
    assert lost in out and ("lost endpoint(s)" in out), out[-3000:]
    assert elapsed < 15, elapsed


def _listening_hosts(**env: str) -> dict[str, set[str]]:
    """Run a 2-"host" collective job; each host's set of the addresses its trainer listened on."""
    port = free_ports(1)[0]
    procs = {me: _launcher(me, port, "--seconds", "2", "--report-sockets", **env) for me in (A, B)}
    outs: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 120
        for me in (A, B):
            outs[me] = procs[me].communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        for proc in procs.values():
            _kill(proc)
        late = {me: outs.get(me) or procs[me].communicate(timeout=10)[0] for me in (A, B)}
        pytest.fail("the 2-host job did not end within 120 s:\n" + "\n".join(
            f"--- launcher {me} (exit {procs[me].returncode}):\n{late[me][-3000:]}" for me in (A, B)))
    finally:
        for proc in procs.values():
            _kill(proc)
    hosts: dict[str, set[str]] = {}
    for me in (A, B):
        assert procs[me].returncode == 0, outs[me][-3000:]
        listening = [line.split("listening ", 1)[1].strip() for line in outs[me].splitlines() if "listening " in line]
        assert listening, outs[me][-3000:]
        # host:port as ss prints it, IPv4-mapped for the coordinator
        hosts[me] = {a.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") for a in listening}
    return hosts


def test_gloo_and_the_group_bind_only_the_trainers_own_addresses() -> None:
    assert _listening_hosts() == {A: {A}, B: {B}}  # never 0.0.0.0, nor what gethostname() resolves to


def test_gloo_interface_override() -> None:
    # lo's address is 127.0.0.1: trainer 1 (endpoint on 127.0.0.2) then listens there for gloo
    assert _listening_hosts(FLOTILLA_GLOO_INTERFACE="lo") == {A: {A}, B: {A}}


def test_ps_losing_a_host_ends_the_other_naming_the_lost_endpoints(tmp_path: pathlib.Path) -> None:
    port = free_ports(1)[0]
    args = ["--servers", f"{A}:{port},{B}:{port}", "--workers", f"{A},{B}", "--started_port", str(port + 1)]
    env = _env(FLAGS_rpc_deadline="4000", FLAGS_pserver_timeout_ms="3000", FLAGS_rpc_retry_times="2")
    procs = {me: subprocess.Popen([sys.executable, "-m", "runtime.launch", *args, "--node_ip", me,
                                   "--log_dir", str(tmp_path / me), str(REPO / "tests/runtime/rpc/ps_worker.py"),
                                   "--out", str(tmp_path), "--steps", "100000", "--sleep", "0.01"],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for me in (A, B)}
    try:
        for me in (A, B):
            _wait_for(procs[me], "started trainer", 30)
        deadline = time.monotonic() + 60  # both trainers are past their startup program: they trained a step
        while not all((tmp_path / f"trainer_{i}_init.npz").exists() for i in (0, 1)):
            assert time.monotonic() < deadline, "the trainers never started training"
            time.sleep(0.1)
        time.sleep(1.0)
        _kill(procs[B])
        start = time.monotonic()
        out, _ = procs[A].communicate(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        for proc in procs.values():
            _kill(proc)
    assert procs[A].returncode == 1, out[-3000:]
    assert f"{B}:{port}" in out or f"{B}:{port + 2}" in out, out[-3000:]
    assert f"pserver.1 at {B}:{port}" in out, out[-3000:]  # the launcher's probe of the lost host's pserver
    assert elapsed < 15, elapsed
    assert (tmp_path / A / "serverlog.0").exists() and (tmp_path / A / "workerlog.0").exists()


# --- across namespaced hosts -------------------------------------------------------------------------------


class Launchers:
    """One ``python -m runtime.launch`` a namespaced host, the same arguments everywhere."""

    def __init__(self, hosts: Hosts, out: pathlib.Path, flags: dict[str, str]) -> None:
        self.hosts, self.out = hosts, out
        base = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS and k != "XLA_FLAGS"}
        self.env = {**base, "PYTHONPATH": str(REPO), "FLOTILLA_JOB_TOKEN": secrets.token_hex(16), **flags}
        self.procs = []

    def start(self, argv: list[str]) -> None:
        for h in range(len(self.hosts.addresses)):
            with open(self.out / f"launch.{h}.log", "w") as log:
                self.procs.append(self.hosts.popen(h, [sys.executable, "-m", "runtime.launch", *argv],
                                                   env=self.env, cwd=REPO, stdout=log))

    def wait(self, timeout: float = 120.0) -> list[int]:
        codes = []
        for h, proc in enumerate(self.procs):
            try:
                codes.append(proc.wait(timeout=timeout))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: say which, with the logs
                pytest.fail(f"the launcher of host {h} did not exit within {timeout}s:\n{self.logs()}")
        return codes

    def logs(self) -> str:
        return "\n".join(f"--- host {h}\n{(self.out / f'launch.{h}.log').read_text()[-3000:]}"
                         for h in range(len(self.procs)))


def test_collective_launch_on_two_hosts_equals_one_process(tmp_path: pathlib.Path,
                                                           netns_hosts: Callable[..., Hosts]) -> None:
    hosts = netns_hosts(2, resolve_hostname=False)
    launchers = Launchers(hosts, tmp_path, COLLECTIVE_FLAGS)
    launchers.start(["--ips", ",".join(hosts.addresses), "--nproc_per_node", "1", "--started_port", "6170",
                     str(REPO / "tests" / "runtime" / "collective" / "worker.py"), "--out", str(tmp_path),
                     "--configs", "momentum_fused"])
    assert launchers.wait() == [0, 0], launchers.logs()
    ranks = [dict(np.load(tmp_path / f"momentum_fused.rank{r}.npz")) for r in (0, 1)]
    opt, _ = collective_worker.CONFIGS["momentum_fused"]
    for name, value in collective_worker.train_single(opt, seed=100).items():
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)
        np.testing.assert_allclose(ranks[0][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_ps_launch_on_two_hosts_starts_each_share_once(tmp_path: pathlib.Path,
                                                       netns_hosts: Callable[..., Hosts]) -> None:
    hosts = netns_hosts(2)
    a, b = hosts.addresses
    launchers = Launchers(hosts, tmp_path, PS_FLAGS)
    launchers.start(["--servers", f"{a}:6174,{b}:6174", "--workers", f"{a},{b}", JOB])
    assert launchers.wait() == [0, 0], launchers.logs()
    logs = [(tmp_path / f"launch.{h}.log").read_text() for h in (0, 1)]
    for h, (log, address) in enumerate(zip(logs, (a, b))):
        assert f"[pserver.{h}] role role=PSERVER trainer_id=0 trainers=2 current={address}:6174" in log, log
        assert f"[trainer.{h}] trainer {h} done" in log, log
        assert f"[pserver.{1 - h}]" not in log and f"[trainer.{1 - h}]" not in log, log
        assert f"the launchers of the other hosts start pserver.{1 - h}, trainer.{1 - h}" in log, log
