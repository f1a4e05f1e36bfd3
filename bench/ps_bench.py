"""Parameter-server benchmark: transport throughput, CTR training speed and bytes on the wire, all
measured in one run on 127.0.0.1 against baselines measured in the same run.

(a) Transport. A raw loopback TCP baseline (a sink process; requests of N bytes read with ``recv_into``
    into one reused buffer, answered with one byte; replies of N bytes received the same way) against
    the client's sends (``RPCClient.send`` + ``wait_sends``: encoding included) and fetches
    (``RPCClient.get``: decoding included; both stream tensors of 2 MiB or more) of float32 tensors of ``--sizes-mib`` to a real pserver (a
    transpiled program holding one parameter of each size, sync mode, one trainer: a send is stored, a
    get answers at once). Each figure is the median of ``--reps`` timed transfers after one warm-up; the
    ratio gRPC / raw TCP is for the same direction (target >= 0.6).
(b) Examples/s of the CTR reference job (``bench/ps_bench_worker.py``: 26 int64 slots sharing ONE
    1,000,000 x 16 table, 13 dense features, fc 400-400-400 relu, fc 2 softmax, mean cross entropy, SGD
    0.01, batch 512, synthetic data whose labels follow a fixed random linear rule): single-process
    training (table not distributed) as the baseline, then 1 pserver x 2 trainers and 2 x 2, sync and
    async, with the table distributed, every role its own process. Each trainer warms up (``--warmup``
    steps; a Geo-SGD job with k at least 2k, so two syncs), waits at a start gate until every trainer of
    the job has, then times ``--steps`` steps; per
    trainer is the mean of the trainers' own rates, total is all timed examples over the union of the
    trainers' windows; ratios are to the single-process run. CPU ms per 1,000 examples is the CPU time
    (/proc) of every process of the job, pservers included, over the timed window.
    ``--vs-paddle`` runs Paddle's own PS on the same job and data right after each PS job
    (``bench/paddle_ps_worker.py`` under ``--paddle-python``, an interpreter with paddlepaddle 2.6.2: a
    bench-only extra, e.g. a venv with ``paddlepaddle==2.6.2 "numpy<2" "protobuf<5"``); without it the
    per-trainer ratio uses the last figure measured on this machine, marked as not from this run.
(c) Bytes on the wire per trainer step (every gRPC request plus its reply, counted in the trainer,
    HTTP/2 framing excluded) against the theoretical minimum: every dense gradient sent and every dense
    parameter received once, plus for the table the unique ids of the step (8 bytes each) and their rows
    (64 bytes) prefetched, and one gradient row (64 bytes + an 8-byte row id) per unique id. The sparse
    line compares the gradient rows sent with the unique ids: sending only touched rows gives 1.00.

(d) With ``--trust``, every parameter-server job also runs with a job token (``FLOTILLA_JOB_TOKEN``), right
    after its plain run, and the ratios to the plain run are printed (target: >= 0.95). TLS is not measured
    here (its certificates differ per role; see tests/runtime/rpc/test_trust.py).
(e) Across hosts: ``--hosts NS1,NS2`` (network namespaces made by hand, each with an address) and/or
    ``--netns`` (two namespaced hosts on a bridge built here by ``tests/netns.py``, 10.213.7.1-2, run
    plain and then with their links shaped by ``--link RATE`` and ``--delay D``: ``tc netem``, or ``tbf``
    for the rate alone where the kernel has no netem, which the output then says) run every PS job again
    with pserver i and trainer i on host i mod n (endpoints on the hosts' addresses, a job token set: a
    pserver refuses a non-loopback endpoint without one), beside the loopback rows. Building namespaces
    needs root and iproute2. With ``--netns`` the transport section also runs across the two hosts (plain
    links): a transport pserver per data-plane mode on host 0 (a job token set) and the client
    (``ps_bench_worker.py transport-client``) on host 1, sending and fetching each size with
    ``FLAGS_rpc_data_plane=auto`` (the cross-host TCP plane, ``runtime.rpc.tcp_plane``) and ``off`` (gRPC),
    and raw TCP to a sink on host 0, in turn in every repetition; printed as GB/s and the ratios of the TCP
    plane to gRPC and to raw TCP.
(f) Data plane: ``--data-plane off|auto|tcp|both|all`` (or a comma list of modes) sets ``FLAGS_rpc_data_plane``
    of every process (default auto; ``both`` is off,auto, ``all`` off,auto,tcp; ``tcp``, the TCP plane on this
    one host as a container with a small /dev/shm would run, with a job token, which that plane needs).
    With several modes the transport runs against one pserver per mode (gRPC, shared memory: this process
    is on the pserver's host, the TCP plane) and every PS job runs each way (the auto run marked ``+shm``,
    the tcp one ``+tcp-plane``); a table puts
    each job's examples/s per trainer and job CPU per 1,000 examples off against auto. Goals: 64 MiB
    send/fetch through shared memory >= 2x raw loopback TCP, 4 MiB >= 1x; a 1x2 job's CPU per 1,000
    examples <= 1.3x the single-process job's.
The load average is printed before and after; ``--quick`` figures are marked not comparable.

Every process is started here and only those are killed (on failure, timeout or exit); every wait is
bounded (``--job-timeout``; the children's ``FLAGS_rpc_deadline`` and ``FLAGS_pserver_timeout_ms``).
``--skip-jobs`` runs the transport section alone. ``--plot FILE.png`` draws examples/s per trainer of every
job and system (``bench/plotting.py``; matplotlib, in the ``bench`` extra): Flotilla's single-process run,
each PS / hybrid / Geo job (gRPC and shm bars with ``--data-plane both``), and Paddle's PS, measured
(``--vs-paddle``) or its recorded 1x2 async figure, drawn hatched and labelled as not from this run.
``python bench/ps_bench.py [--quick] [--steps N] [--warmup N] [--sizes-mib 4,64] [--reps R] [--trust]
[--vs-paddle --paddle-python PATH] [--json PATH] [--plot FILE.png] [--skip-transport | --skip-jobs]``
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import plotting  # noqa: E402
from ir.errors import FlotillaError  # noqa: E402
from runtime.cpu_threads import XLA_NPROC_ENVS, available_cpus, xla_threads  # noqa: E402
from runtime.launch import free_ports  # noqa: E402
from runtime.rpc.shm import leftover_segments  # noqa: E402
from tests.netns import LOOPBACK, Host, Hosts, NetnsError, existing_hosts  # noqa: E402

WORKER = pathlib.Path(__file__).resolve().with_name("ps_bench_worker.py")
PADDLE_WORKER = WORKER.with_name("paddle_ps_worker.py")
REPO = WORKER.parents[1]
REFERENCE_PER_TRAINER = 9_906.0  # Paddle 2.6.2's PS, async 1x2, last measured on this machine (see --vs-paddle)
PADDLE_LAST_MEASURED = "Paddle 2.6.2, 2026-11-24, this 2-core machine, bench/paddle_ps_worker.py"
TRANSPORT_TARGET = 0.6
SHM_TARGET = {64: 2.0, 4: 1.0}  # same-host data plane against raw loopback TCP, by MiB (others: 1.0)
CPU_TARGET = 1.3  # a PS job's CPU per 1,000 examples against the single-process job's
DP_LABEL = {"off": "gRPC", "auto": "shm", "tcp": "TCP plane"}
DATA_PLANE_SETS = {"both": ["off", "auto"], "all": ["off", "auto", "tcp"]}
DP_SUFFIX = " +shm"
LOCAL_TCP_SUFFIX = " +tcp-plane"  # FLAGS_rpc_data_plane=tcp on one host (no shared memory)
CROSS_DP_SUFFIX = " +tcp"  # a job across hosts with the data plane on: TCP to the other host's pserver
JOB_TARGET = 0.6  # the whole 1x2 job against single-process training, examples/s
PADDLE_TARGET = 2.5  # issue 24; 1x2 async examples/s per trainer against Paddle's PS on the same job
GB = 1e9
EMB_ROW_BYTES = 16 * 4
ID_BYTES = 8


class BenchError(FlotillaError):
    """A benchmark process failed or did not finish in time."""

    code = "E791"


# --- processes ------------------------------------------------------------------------------------------
@dataclass
class Procs:
    """The processes this run started, their logs, and a bounded wait for them."""

    tmp: pathlib.Path
    env: dict[str, str]
    running: list[tuple[str, subprocess.Popen[bytes], pathlib.Path]] = field(default_factory=list)

    def start(self, tag: str, role: str, *argv: str, python: str = sys.executable,
              worker: pathlib.Path = WORKER, host: Host = LOOPBACK,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{tag}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(host.command([python, str(worker), role, *argv]), stdout=out,
                                    stderr=subprocess.STDOUT, env=env or self.env, cwd=str(REPO))
        self.running.append((tag, proc, log))
        return proc

    def wait_all(self, timeout: float, only: str = "") -> None:
        """Wait for every started process (whose tag starts with ``only``); raise BenchError naming the
        first that failed or hung. Every process still running is killed on return."""
        end = time.monotonic() + timeout
        try:
            while True:
                pending = []
                for tag, proc, log in self.running:
                    if not tag.startswith(only):
                        continue
                    rc = proc.poll()
                    if rc is None:
                        pending.append((tag, log))
                    elif rc != 0:
                        how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited {rc}"
                        raise BenchError(f"{tag} {how}; its log ends:\n{_tail(log)}")
                if not pending:
                    return
                if time.monotonic() > end:
                    tags = ", ".join(tag for tag, _ in pending)
                    raise BenchError(f"{tags} did not finish within {timeout:g}s; the log of {pending[0][0]} ends:\n"
                                     f"{_tail(pending[0][1])}",
                                     hint="raise --job-timeout, or look for a hang in the runtime")
                time.sleep(0.05)
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill every process this object started that still runs (by its own Popen handle)."""
        for _, proc, _ in self.running:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.running.clear()


def _tail(log: pathlib.Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def _wait_file(path: pathlib.Path, proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.stat().st_size:
            return json.loads(path.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    raise BenchError(f"{path.name} did not appear within {timeout:g}s (process exit code {proc.poll()})")


# --- (a) transport --------------------------------------------------------------------------------------
def bench_transport(procs: Procs, sizes_mib: list[int], reps: int, modes: list[str]
                    ) -> tuple[dict[int, dict[str, float]], dict[str, dict[int, dict[str, float]]]]:
    """(raw TCP, {data plane mode: figures}) GB/s by size and direction. The TCP sink and one transport
    pserver per data-plane mode (``FLAGS_rpc_data_plane`` off: gRPC; auto: shared memory, this process
    being on the pserver's host) run at once, and every transfer of a size takes its turn within every
    repetition, so load from other processes falls on them alike."""
    from bench.ps_bench_worker import TcpClient, time_transfers, transport_names
    from runtime.flags import RPCSecurity
    from runtime.rpc.client import RPCClient

    port_file = procs.tmp / "tcp_port.json"
    sink = procs.start("tcp-sink", "tcp-sink", "--out", str(port_file), "--buffer-mib", str(max(sizes_mib)),
                       "--timeout", "120")
    names = transport_names(sizes_mib)
    endpoints = {}
    token = os.urandom(32).hex()  # the TCP plane's (mode tcp) handshake needs one, as a real job's does
    for mode in modes:
        endpoints[mode] = f"127.0.0.1:{free_ports(1)[0]}"
        procs.start(f"transport-pserver-{mode}", "transport-pserver", "--endpoint", endpoints[mode],
                    "--sizes-mib", ",".join(map(str, sizes_mib)), env=mode_env(procs.env, mode, token))
    tcp_client = TcpClient(_wait_file(port_file, sink, 60.0)["port"], max(sizes_mib) << 20)
    clients = {mode: RPCClient(0, deadline=120.0, data_plane=mode,
                               security=RPCSecurity(token=token) if mode == "tcp" else None) for mode in modes}
    tcp: dict[int, dict[str, float]] = {}
    by_mode: dict[str, dict[int, dict[str, float]]] = {mode: {} for mode in modes}
    try:
        for mode, client in clients.items():
            client.wait_ready([endpoints[mode]])
        rng = np.random.default_rng(0)
        for mib in sizes_mib:
            grad, param, shape = names[mib]
            value = rng.random(shape, dtype=np.float32)
            n = value.nbytes
            got: dict[str, list[Any]] = {mode: [] for mode in modes}
            ways: dict[str, Callable[[], None]] = {"raw send": lambda: tcp_client.send(n)}
            for mode, client in clients.items():
                ways[f"{mode} send"] = lambda c=client, ep=endpoints[mode]: (c.send(ep, grad, value), c.wait_sends())
            ways["raw get"] = lambda: tcp_client.get(n)
            for mode, client in clients.items():
                def get(c: Any = client, ep: str = endpoints[mode], out: list[Any] = got[mode]) -> None:
                    out[:] = []  # the previous value goes first: its segment is free for this fetch
                    out[:] = c.get([(ep, param)])
                ways[f"{mode} get"] = get
            samples = time_transfers(ways, reps)
            for mode in modes:
                if np.asarray(got[mode][0]).nbytes != n:
                    raise BenchError(f"GetVariable of {param!r} returned {np.asarray(got[mode][0]).nbytes} bytes, "
                                     f"expected {n}")
            rate = {k: n / statistics.median(v) / GB for k, v in samples.items()}
            tcp[mib] = {"send": rate["raw send"], "get": rate["raw get"]}
            for mode in modes:
                by_mode[mode][mib] = {"send": rate[f"{mode} send"], "get": rate[f"{mode} get"]}
        planes = {mode: {ep: (p.state, p.reason) for ep, p in c._planes.items()} for mode, c in clients.items()}
        if "auto" in clients and not all(state for state, _ in planes["auto"].values()):
            raise BenchError(f"the data plane did not come up on this host: {planes['auto']}")
        if "tcp" in clients and not clients["tcp"].data_plane_state()[endpoints["tcp"]].startswith("tcp"):
            raise BenchError(f"the TCP plane did not come up on this host: {clients['tcp'].data_plane_state()}")
    finally:
        tcp_client.close()
        for client in clients.values():
            client.close()
    procs.wait_all(60.0)
    return tcp, by_mode


def bench_transport_netns(tmp: pathlib.Path, env: dict[str, str], sizes_mib: list[int], reps: int,
                          timeout: float) -> dict[str, Any]:
    """The transport across two namespaced hosts: ``{"rates": {mode: {MiB: {send, get}}}, "state": ...}``
    (``auto``: the TCP plane; ``off``: gRPC; ``tcp``: raw TCP), measured by the transport client on host 1
    against one transport pserver per mode and a tcp-sink on host 0."""
    env = {**env, "FLOTILLA_JOB_TOKEN": os.urandom(32).hex()}  # a pserver beyond loopback requires one
    sizes = ",".join(map(str, sizes_mib))
    out = tmp / "netns_transport.json"
    with Hosts.create(2) as built:
        server, client = built.hosts()
        procs = Procs(tmp, env)
        try:
            port_file = tmp / "netns_tcp_port.json"
            sink = procs.start("netns-tcp-sink", "tcp-sink", "--bind", server.address, "--out", str(port_file),
                               "--buffer-mib", str(max(sizes_mib)), "--timeout", str(timeout), host=server)
            sink_at = f"{server.address}:{_wait_file(port_file, sink, 60.0)['port']}"
            endpoints = {mode: f"{server.address}:{6170 + i}" for i, mode in enumerate(("auto", "off"))}
            for mode, ep in endpoints.items():
                procs.start(f"netns-transport-pserver-{mode}", "transport-pserver", "--endpoint", ep, "--sizes-mib",
                            sizes, host=server, env={**env, "FLAGS_rpc_data_plane": mode})
            procs.start("netns-transport-client", "transport-client", "--endpoints", ",".join(endpoints.values()),
                        "--modes", ",".join(endpoints), "--sizes-mib", sizes, "--reps", str(reps), "--out", str(out),
                        "--timeout", str(timeout), "--tcp-sink", sink_at, host=client)
            procs.wait_all(timeout)
        finally:
            procs.kill()
    result = json.loads(out.read_text())
    result["rates"] = {mode: {int(mib): v for mib, v in by.items()} for mode, by in result["rates"].items()}
    (tcp_state,) = result["state"]["auto"].values()
    if not tcp_state.startswith("tcp ("):
        raise BenchError(f"the TCP data plane did not carry the cross-host transfers: {result['state']}")
    return result


def print_transport_netns(netns: dict[str, Any]) -> None:
    rates = netns["rates"]
    print()
    print("(a) transport across 2 namespaced hosts (veth, bridge), GB/s, median: the TCP plane "
          "(FLAGS_rpc_data_plane=auto, another host) against gRPC (off) and raw TCP")
    print(f"{'size':>7} {'dir':>5} {'raw TCP':>9} {'gRPC':>8} {'TCP plane':>10} {'plane/gRPC':>11} {'plane/TCP':>10}")
    for mib in rates["off"]:
        for d, label in (("send", "Send"), ("get", "Get")):
            r, g, t = rates["tcp"][mib][d], rates["off"][mib][d], rates["auto"][mib][d]
            print(f"{mib:>4}MiB {label:>5} {r:9.2f} {g:8.2f} {t:10.2f} {t / g:11.2f} {t / r:10.2f}")


# --- (b), (c) the CTR job -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    name: str
    pservers: int  # 0: single-process training
    trainers: int
    mode: str
    paddle: str = ""  # the interpreter that runs Paddle's PS on this job instead of Flotilla's


@dataclass(frozen=True)
class Placement:
    """Where a job's processes run: pserver i and trainer i on ``hosts[i % len(hosts)]``."""

    label: str  # "" for this machine's loopback
    hosts: tuple[Host, ...] = (LOOPBACK,)

    def host(self, i: int) -> Host:
        return self.hosts[i % len(self.hosts)]


ON_LOOPBACK = Placement("")
CROSS_HOST_PORT = 6170  # pserver i listens on port 6170 + i of its host (a namespace's own port space)


def run_job(job: Job, args: argparse.Namespace, env: dict[str, str], tmp: pathlib.Path,
            placement: Placement = ON_LOOPBACK) -> dict[str, Any]:
    """Run one job in its own processes (placed by ``placement``); the trainers' JSON results, combined."""
    jobdir = tmp / (job.name + placement.label).replace(" ", "_").replace("@", "at_")
    jobdir.mkdir()
    procs = Procs(jobdir, env)
    common = ["--table-rows", str(args.table_rows), "--batch-size", str(args.batch_size), "--warmup",
              str(warmup_steps(job, args.warmup)), "--steps", str(args.steps), "--id-dist", args.id_dist]
    gate = jobdir / "gate"
    gate.mkdir()
    common += ["--gate", str(gate), "--gate-count", str(max(1, job.trainers)), "--timeout", str(args.job_timeout)]
    outs = []
    cpu = CPUWindow(procs, gate, max(1, job.trainers), args.job_timeout)
    try:
        if job.pservers == 0:
            outs.append(jobdir / "local.json")
            procs.start("local", "local", "--out", str(outs[0]), *common)
        else:
            if placement.label:
                eps = [f"{placement.host(i).address}:{CROSS_HOST_PORT + i}" for i in range(job.pservers)]
            else:
                eps = [f"127.0.0.1:{free_ports(1)[0]}" for _ in range(job.pservers)]
            mode = "async" if job.mode.startswith("geo") else job.mode.removeprefix("hybrid-")
            dist = ["--endpoints", ",".join(eps), "--trainers", str(job.trainers), "--mode", mode]
            if job.mode.startswith("hybrid-"):  # the trainers' allreduce group (loopback only)
                if job.paddle or placement.label:
                    raise BenchError(f"job {job.name!r}: hybrid jobs run on this machine's loopback, with Flotilla "
                                     "only", hint="leave hybrid jobs out of --vs-paddle, --hosts and --netns runs")
                dist += ["--trainer-endpoints", ",".join(f"127.0.0.1:{p}" for p in free_ports(job.trainers))]
            if job.mode.startswith("geo"):
                dist += ["--geo-k", job.mode[3:]]
            how: dict[str, Any] = {"python": job.paddle, "worker": PADDLE_WORKER} if job.paddle else {}
            hosts = [placement.host(i) for i in range(job.pservers)] + [placement.host(t) for t in range(job.trainers)]
            for i, ep in enumerate(eps):
                procs.start(f"pserver{i}", "pserver", "--endpoint", ep, *dist, *common, host=hosts[i],
                            env=None if job.paddle else launcher_env(env, hosts, hosts[i]), **how)
            for t in range(job.trainers):
                outs.append(jobdir / f"trainer{t}.json")
                host = hosts[job.pservers + t]
                procs.start(f"trainer{t}", "trainer", "--trainer-id", str(t), "--out", str(outs[-1]), *dist, *common,
                            host=host, env=None if job.paddle else launcher_env(env, hosts, host), **how)
        cpu.start()
        # Paddle's pservers outlive their trainers: the job ends with its trainers (the rest is killed).
        procs.wait_all(args.job_timeout, only="trainer" if job.paddle else "")
    finally:
        procs.kill()
    results = [json.loads(p.read_text()) for p in outs]
    row = summarise(job, results)
    row["placement"] = placement.label
    row["cpu_s"] = cpu.seconds
    row["cpu_s_by_process"] = cpu.by_process
    row["cpu_ms_per_kex"] = cpu.seconds / (sum(r["examples"] for r in results) / 1e3) * 1e3 if cpu.seconds else None
    return row


def launcher_env(env: dict[str, str], hosts: list[Host], host: Host) -> dict[str, str]:
    """``env`` with the XLA CPU threads ``flotilla launch`` would give a process of the job on ``host``
    (``runtime.cpu_threads``: its CPUs over the job's processes there), so the figures are what a launched
    job gets."""
    threads = xla_threads(sum(h is host for h in hosts), available_cpus(), env)
    return env if threads is None else {**env, XLA_NPROC_ENVS[0]: str(threads)}


class CPUWindow(threading.Thread):
    """Samples the CPU time (user + system, from /proc) of every process of a job when all its trainers
    have passed the start gate and again when all are done: ``seconds`` is what the whole job (pservers
    included) spent on the timed steps. None where /proc is unavailable or the gate was not reached."""

    def __init__(self, procs: "Procs", gate: pathlib.Path, count: int, timeout: float) -> None:
        super().__init__(daemon=True)
        self.procs, self.gate, self.count, self.timeout = procs, gate, count, timeout
        self.seconds: float | None = None
        self.by_process: dict[str, float] = {}

    def _wait_for(self, prefix: str, end: float) -> bool:
        while len(list(self.gate.glob(prefix + ".*"))) < self.count:
            if time.monotonic() > end:
                return False
            time.sleep(0.002)
        return True

    @staticmethod
    def _cpu(proc: subprocess.Popen[bytes]) -> float | None:
        try:
            fields = pathlib.Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def run(self) -> None:
        end = time.monotonic() + self.timeout
        if not self._wait_for("ready", end):
            return
        procs = {("trainer0" if tag == "local" else tag): proc for tag, proc, _ in list(self.procs.running)}
        first = {tag: self._cpu(proc) for tag, proc in procs.items()}
        last: dict[str, float | None] = {}
        while len(last) < len(procs) and time.monotonic() < end:
            done = {p.name.partition(".")[2] for p in self.gate.glob("done.*")}
            for tag in done - set(last):  # a trainer's own window ends when it is done
                last[tag] = self._cpu(procs[tag])
            if len(done) >= self.count:  # the pservers' ends with the last trainer's
                for tag in set(procs) - set(last):
                    last[tag] = self._cpu(procs[tag])
            time.sleep(0.002)
        spent = [(last.get(tag), first[tag]) for tag in procs]
        if all(a is not None and b is not None for a, b in spent):
            self.by_process = {tag: last[tag] - first[tag] for tag in procs}  # type: ignore[operator]
            self.seconds = sum(self.by_process.values())


def summarise(job: Job, results: list[dict[str, Any]]) -> dict[str, Any]:
    examples = sum(r["examples"] for r in results)
    window = max(r["end"] for r in results) - min(r["start"] for r in results)
    steps = sum(r["steps"] for r in results)
    row: dict[str, Any] = {
        "job": job.name, "pservers": job.pservers, "trainers": job.trainers, "mode": job.mode,
        "paddle": bool(job.paddle),
        "per_trainer": statistics.mean(r["examples_per_s"] for r in results), "total": examples / window,
        "loss_first": statistics.mean(float(np.mean(r["losses"][:5])) for r in results),
        "loss_last": statistics.mean(float(np.mean(r["losses"][-5:])) for r in results),
        # the trainers' main thread (the executor: host ops, dispatch), CPU ms a step
        "main_thread_ms_per_step": statistics.mean(r["cpu_main_thread_s"] / r["steps"] * 1e3 for r in results
                                                   if "cpu_main_thread_s" in r) if not job.paddle else None,
    }
    if job.pservers and not job.paddle:
        by_method: dict[str, float] = {}
        for r in results:
            for method, nbytes in r["wire"]["bytes"].items():
                by_method[method] = by_method.get(method, 0.0) + nbytes / steps
        unique = statistics.mean(r["unique_ids_per_step"] for r in results)
        dense = results[0]["dense_param_bytes"]
        table_min = unique * (ID_BYTES + EMB_ROW_BYTES) * 2
        row["wire"] = {
            "bytes_per_step": sum(by_method.values()), "by_method": by_method, "min_bytes_per_step": 2 * dense + table_min,
            "dense_min": 2 * dense, "table_min": table_min, "unique_ids_per_step": unique,
            "ids_per_step": results[0]["ids_per_step"],
            "sparse_rows_per_step": sum(r["wire"]["sparse_rows"] for r in results) / steps,
            "sparse_bytes_per_step": sum(r["wire"]["sparse_bytes"] for r in results) / steps,
            "sparse_min_per_step": unique * (ID_BYTES + EMB_ROW_BYTES),
        }
    return row


# --- report -----------------------------------------------------------------------------------------------
def print_transport(tcp: dict[int, dict[str, float]], by_mode: dict[str, dict[int, dict[str, float]]]) -> None:
    print()
    print("(a) transport, GB/s (1e9 bytes/s), median; gRPC = FLAGS_rpc_data_plane=off, shm = auto (same host), "
          "TCP plane = tcp")
    modes = [m for m in ("off", "auto", "tcp") if m in by_mode]
    head = "".join(f" {DP_LABEL[m]:>8} {DP_LABEL[m] + '/TCP':>9}" for m in modes)
    print(f"{'size':>7} {'dir':>5} {'raw TCP':>9}{head}")
    for mib in tcp:
        for d, label in (("send", "Send"), ("get", "Get")):
            cells = ""
            for m in modes:
                ratio = by_mode[m][mib][d] / tcp[mib][d]
                cells += f" {by_mode[m][mib][d]:8.2f} {ratio:9.2f}"
            print(f"{mib:>4}MiB {label:>5} {tcp[mib][d]:9.2f}{cells}")


def print_jobs(rows: list[dict[str, Any]], local: float, paddle: str | None) -> None:
    print()
    source = f"{paddle}'s PS measured in this run, same job" if paddle else (
        f"Paddle's PS, async 1x2, {REFERENCE_PER_TRAINER:,.0f} per trainer: last measured ({PADDLE_LAST_MEASURED}), "
        "NOT in this run (--vs-paddle runs it)")
    print(f"(b) CTR job, examples/s; ref: {source}")
    print("    CPU ms/1k ex: CPU time of every process of the job (pservers included) over the timed steps, per "
          "1,000 examples")
    print(f"{'job':<30} {'per trainer':>12} {'total':>9} {'total/local':>12} {'per tr./ref':>12} {'CPU ms/1k ex':>13} "
          f"{'loss first->last':>18}")
    for r in rows:
        cpu = f"{r['cpu_ms_per_kex']:13.1f}" if r.get("cpu_ms_per_kex") else f"{'-':>13}"
        ref = f"{r['per_trainer'] / reference(rows, r['job'])[0]:12.2f}" if r["pservers"] and not r.get("paddle") \
            else f"{'-':>12}"
        print(f"{r['job']:<30} {r['per_trainer']:12,.0f} {r['total']:9,.0f} {r['total'] / local:12.2f} "
              f"{ref} {cpu} {r['loss_first']:8.4f} -> {r['loss_last']:.4f}")
    print()
    print("(c) bytes moved per trainer step (gRPC requests + replies, and batches through shared memory), KB = 1e3 "
          "bytes")
    print(f"{'job':<30} {'send':>8} {'get':>8} {'prefetch':>9} {'other':>6} {'total':>8} {'minimum':>8} "
          f"{'tot/min':>8} {'grad rows':>10} {'unique':>7} {'rows/uniq':>10} {'sparse/min':>11}")
    for r in rows:
        w = r.get("wire")
        if not w:
            continue
        m = w["by_method"]
        print(f"{r['job']:<30} {m.get('send', 0) / 1e3:8.0f} {m.get('get', 0) / 1e3:8.0f} "
              f"{m.get('prefetch', 0) / 1e3:9.0f} {m.get('other', 0) / 1e3:6.1f} {w['bytes_per_step'] / 1e3:8.0f} "
              f"{w['min_bytes_per_step'] / 1e3:8.0f} {w['bytes_per_step'] / w['min_bytes_per_step']:8.2f} "
              f"{w['sparse_rows_per_step']:10.0f} {w['unique_ids_per_step']:7.0f} "
              f"{w['sparse_rows_per_step'] / w['unique_ids_per_step']:10.2f} "
              f"{w['sparse_bytes_per_step'] / w['sparse_min_per_step']:11.2f}")


def print_summary(tcp: dict[int, dict[str, float]], by_mode: dict[str, dict[int, dict[str, float]]],
                  rows: list[dict[str, Any]], local: float, paddle: str | None, local_cpu: float | None) -> None:
    """Each goal of the PS speed work, its figure, its baseline and the ratio."""
    print()
    print("summary (goal: figure / baseline = ratio, target)")

    def goal(what: str, ratio: float, target: float, detail: str) -> None:
        print(f"  {what:<44} {detail} = {ratio:5.2f}  target >= {target:g}  {'met' if ratio >= target else 'MISSED'}")

    for m in tcp:
        for d in ("send", "get"):
            if "off" in by_mode:
                goal(f"transport {m} MiB {d}, gRPC / raw TCP", by_mode["off"][m][d] / tcp[m][d], TRANSPORT_TARGET,
                     f"{by_mode['off'][m][d]:.2f} / {tcp[m][d]:.2f} GB/s")
            if "auto" in by_mode:
                goal(f"transport {m} MiB {d}, shm / raw TCP", by_mode["auto"][m][d] / tcp[m][d],
                     SHM_TARGET.get(m, 1.0), f"{by_mode['auto'][m][d]:.2f} / {tcp[m][d]:.2f} GB/s")
    for r in rows:
        if local_cpu and r["pservers"] and r.get("cpu_ms_per_kex") and not r.get("paddle") and not r.get("placement") \
                and "+token" not in r["job"]:
            if "cpu_ratio_rounds" in r:  # --rounds: each round against its own baseline; the median
                ratio, each = r["cpu_ratio"], r["cpu_ratio_rounds"]
                print(f"  {r['job'] + ' job CPU / single-process':<44} median of {len(each)} rounds "
                      f"{ratio:5.2f} (rounds: {', '.join(f'{x:.2f}' for x in each)})  target <= {CPU_TARGET:g}  "
                      f"{'met' if ratio <= CPU_TARGET else 'MISSED'}")
                continue
            ratio = r["cpu_ms_per_kex"] / local_cpu
            print(f"  {r['job'] + ' job CPU / single-process':<44} {r['cpu_ms_per_kex']:.1f} / {local_cpu:.1f} ms per "
                  f"1k ex = {ratio:5.2f}  target <= {CPU_TARGET:g}  {'met' if ratio <= CPU_TARGET else 'MISSED'}")
    for r in rows:  # the plain job and its data-plane variant (--data-plane both), not the trust ones
        if not r["pservers"] or r.get("paddle") or "+" in r["job"].replace(DP_SUFFIX, "") or r.get("placement"):
            continue
        ref, source = reference(rows, r["job"])
        if r["job"] in ("1x2 async", "1x2 async" + DP_SUFFIX):
            goal(f"{r['job']} per trainer / Paddle's PS", r["per_trainer"] / ref, PADDLE_TARGET,
                 f"{r['per_trainer']:,.0f} / {ref:,.0f} ({source})")
        if r["pservers"] == 1 and r["trainers"] == 2:
            goal(f"{r['job']} whole job / single-process", r["total"] / local, JOB_TARGET,
                 f"{r['total']:,.0f} / {local:,.0f} ex/s")
        w = r["wire"]
        print(f"  {r['job']}: wire {w['bytes_per_step'] / w['min_bytes_per_step']:.2f}x the minimum bytes, sparse "
              f"gradient rows {w['sparse_rows_per_step'] / w['unique_ids_per_step']:.2f}x the touched rows")


# --- main -----------------------------------------------------------------------------------------------
def child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"FLAGS_rpc_deadline": str(int(args.job_timeout * 1000)),
                "FLAGS_pserver_timeout_ms": str(int(args.job_timeout * 1000 * 3 // 4)),
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))})
    for var in ("TRAINING_ROLE", "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_PSERVERS_IP_PORT_LIST",
                "PADDLE_CURRENT_ENDPOINT", "POD_IP", "PADDLE_PORT", "PADDLE_TRAINER_ENDPOINTS"):
        env.pop(var, None)
    if args.hugetlb:
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Parameter-server transport, CTR training speed and wire bytes.")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run (< 60 s): 4 MiB only, 3 reps, few steps, jobs local, 1x2 async, 2x2 sync")
    ap.add_argument("--sizes-mib", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="transport tensor sizes in MiB (default 4,64)")
    ap.add_argument("--reps", type=int, default=None, help="timed transfers a size and direction (default 7)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps a trainer (default 100)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the job list this many times, interleaved; each job's figures are from the round "
                         "of its median job-CPU ratio (each round against its own single-process baseline)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5)")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--table-rows", type=int, default=1_000_000)
    ap.add_argument("--id-dist", choices=("zipf", "uniform"), default="zipf",
                    help="ids Zipf(1.2)-skewed (default) or uniform over the table")
    ap.add_argument("--jobs", nargs="+", default=None,
                    help="PS jobs as PxT-mode, e.g. 1x2-async 2x2-sync (default: 1x2 and 2x2, sync and async)")
    ap.add_argument("--skip-transport", action="store_true")
    ap.add_argument("--skip-jobs", action="store_true",
                    help="transport only: no CTR job (not even the single-process one)")
    ap.add_argument("--data-plane", default="auto",
                    help="FLAGS_rpc_data_plane of every figure: off (gRPC), auto (shared memory on one host; the "
                         "default), tcp (the TCP plane, on one host too), a comma list of them, both (off,auto) or "
                         "all (off,auto,tcp): each transport figure and PS job every way, in one run")
    ap.add_argument("--job-timeout", type=float, default=240.0, help="seconds a job's processes may take")
    ap.add_argument("--hugetlb", action="store_true", help="run the children with GLIBC_TUNABLES=glibc.malloc.hugetlb=1")
    ap.add_argument("--json", default="", help="also write the figures as JSON to this path")
    ap.add_argument("--plot", default="", metavar="FILE.png",
                    help="also draw examples/s per trainer of every job and system as a PNG (needs matplotlib: "
                         "the bench extra)")
    ap.add_argument("--vs-paddle", action="store_true",
                    help="after each PS job, run Paddle's own PS on the same job (bench/paddle_ps_worker.py) with "
                         "--paddle-python; without paddlepaddle there, print the last figure measured here")
    ap.add_argument("--paddle-python", default=sys.executable,
                    help="an interpreter with paddlepaddle 2.6.2 (a bench-only extra, e.g. a separate venv)")
    ap.add_argument("--trust", action="store_true",
                    help="also run every PS job with a job token and print the ratios to the plain run")
    ap.add_argument("--hosts", type=lambda v: [h for h in v.split(",") if h], default=[],
                    help="NS1,NS2,...: also run every PS job across these network namespaces (made by hand)")
    ap.add_argument("--netns", action="store_true",
                    help="also run every PS job across 2 namespaced hosts built here, plain and with --link/--delay")
    ap.add_argument("--link", default="10gbit", help="the emulated link's rate (tc syntax) for --netns (10gbit)")
    ap.add_argument("--delay", default="0.1ms", help="the emulated link's one-way delay for --netns (0.1ms; '' none)")
    args = ap.parse_args(argv)
    quick = args.quick
    args.data_plane = DATA_PLANE_SETS.get(args.data_plane) or [m.strip() for m in args.data_plane.split(",")]
    if not args.data_plane or any(m not in DP_LABEL for m in args.data_plane) or \
            len(set(args.data_plane)) != len(args.data_plane):
        ap.error(f"--data-plane: a mode of {list(DP_LABEL)}, a comma list of them, or one of {list(DATA_PLANE_SETS)}")
    args.sizes_mib = args.sizes_mib or ([4] if quick else [4, 64])
    args.reps = args.reps or (3 if quick else 7)
    args.steps = args.steps or (10 if quick else 100)
    args.warmup = args.warmup or (2 if quick else 5)
    args.jobs = args.jobs or (["1x2-async", "2x2-sync"] if quick else ["1x2-sync", "1x2-async", "2x2-sync", "2x2-async"])
    if min(args.sizes_mib) < 1 or args.reps < 1 or args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        ap.error("--sizes-mib, --reps, --steps and --rounds must be at least 1 and --warmup at least 0")
    if args.plot:
        if not args.plot.lower().endswith(".png"):
            ap.error(f"--plot writes a PNG: give a file name ending in .png, got {args.plot!r}")
        if args.skip_jobs:
            ap.error("--plot draws the jobs' examples/s: leave out --skip-jobs")
        try:  # before the run, not after it
            plotting.pyplot()
        except plotting.PlotUnavailable as e:
            ap.error(f"--plot: {e}")
    return args


def cross_host_jobs(jobs: list[Job], args: argparse.Namespace, env: dict[str, str], tmp: pathlib.Path) -> list[dict[str, Any]]:
    """The PS jobs again across ``--hosts`` and (``--netns``) across 2 namespaced hosts, plain and shaped,
    each with every ``--data-plane`` mode (``auto`` after ``off`` marked ``+tcp``: the trainer on the
    pserver's host uses shared memory, the other one the TCP plane)."""
    env = {**env, "FLOTILLA_JOB_TOKEN": os.urandom(32).hex()}  # the TCP plane needs it, as a real job does
    rows: list[dict[str, Any]] = []
    modes = [m for m in args.data_plane if m != "tcp"]  # across hosts auto is the TCP plane already

    def run_all(placement: Placement) -> None:
        for job, mode in ((job, mode) for job in jobs if job.pservers for mode in modes):
            suffix = CROSS_DP_SUFFIX if mode == "auto" and len(modes) > 1 else ""
            start = time.perf_counter()
            rows.append(run_job(Job(f"{job.name}{suffix} {placement.label}", job.pservers, job.trainers, job.mode),
                                args, {**env, "FLAGS_rpc_data_plane": mode}, tmp, placement))
            print(f"{rows[-1]['job']}: {rows[-1]['per_trainer']:,.0f} examples/s per trainer, "
                  f"{rows[-1]['total']:,.0f} total ({time.perf_counter() - start:.1f}s with start-up, "
                  f"load {os.getloadavg()[0]:.2f})", flush=True)

    if args.hosts:
        run_all(Placement("@" + ",".join(args.hosts), tuple(existing_hosts(args.hosts))))
    if args.netns:
        with Hosts.create(2) as built:
            run_all(Placement("@netns", tuple(built.hosts())))
            shaped = [built.shape(i, rate=args.link, delay=args.delay or None, fallback=True)
                      for i in range(2)]
            print(f"links shaped: {shaped[0]} (each host's egress)", flush=True)
            run_all(Placement(f"@netns {args.link}", tuple(built.hosts())))
    return rows


def print_cross_host(rows: list[dict[str, Any]]) -> None:
    """Per trainer examples/s of each PS job on loopback and across hosts, and the ratio."""
    loop = {r["job"]: r for r in rows if not r.get("placement") and r["pservers"] and not r.get("paddle")}
    cross = [r for r in rows if r.get("placement")]
    if not cross:
        return
    by_name = {r["job"]: r for r in cross}
    print()
    print("(e) across hosts: per trainer examples/s, against the same job (same data plane) on 127.0.0.1 in this "
          "run; +tcp: FLAGS_rpc_data_plane=auto (the cross-host trainer on the TCP plane), tcp/gRPC: against the "
          "same placement with the data plane off")
    print(f"{'job':<18} {'placement':<20} {'per trainer':>12} {'loopback':>10} {'ratio':>7} {'tcp/gRPC':>9} "
          f"{'CPU ms/1k ex':>13} {'total':>9}")
    for r in cross:
        base = r["job"][:-len(r["placement"]) - 1]
        lp = loop.get(base.replace(CROSS_DP_SUFFIX, DP_SUFFIX))
        ref = f"{lp['per_trainer']:10,.0f} {r['per_trainer'] / lp['per_trainer']:7.2f}" if lp else f"{'-':>10} {'-':>7}"
        off = by_name.get(r["job"].replace(CROSS_DP_SUFFIX, "")) if CROSS_DP_SUFFIX in r["job"] else None
        vs = f"{r['per_trainer'] / off['per_trainer']:9.2f}" if off else f"{'-':>9}"
        cpu = f"{r['cpu_ms_per_kex']:13.1f}" if r.get("cpu_ms_per_kex") else f"{'-':>13}"
        print(f"{base:<18} {r['placement']:<20} {r['per_trainer']:12,.0f} {ref} {vs} {cpu} {r['total']:9,.0f}")


def warmup_steps(job: Job, warmup: int) -> int:
    """Untimed steps before the gate: ``warmup``, and for a Geo-SGD job at least two syncs' worth
    (``2 K``), so the sync path has compiled for its row counts before the timing starts, as the
    step itself has."""
    return max(warmup, 2 * int(job.mode[3:])) if job.mode.startswith("geo") and not job.paddle else warmup


def parse_job(text: str) -> Job:
    """``PxT-sync``, ``PxT-async``, ``PxT-geoK`` (async Geo-SGD, dense parameters synced every K steps) or
    ``PxT-hybrid-sync``/``PxT-hybrid-async`` (dense gradients allreduced among the trainers, the table on the
    pservers; loopback only)."""
    shape, _, mode = text.partition("-")
    p, _, t = shape.partition("x")
    geo = mode.startswith("geo") and mode[3:].isdigit() and int(mode[3:]) >= 1
    if not (mode in ("sync", "async", "hybrid-sync", "hybrid-async") or geo) or not p.isdigit() or not t.isdigit() or int(p) < 1 or int(t) < 1:
        raise BenchError(f"job {text!r} is not of the form PxT-mode", hint="e.g. 1x2-async, 2x2-sync or 1x2-geo10")
    return Job(f"{p}x{t} {mode}", int(p), int(t), mode)


def trust_variants(args: argparse.Namespace, env: dict[str, str]) -> list[tuple[str, dict[str, str]]]:
    """(suffix, environment) of each way to run a PS job: plain, then (``--trust``) with a job token; each
    with every ``--data-plane`` mode (the first unmarked, ``auto`` after ``off`` marked ``+shm``)."""
    plain = {k: v for k, v in env.items() if not k.startswith(("FLOTILLA_JOB_TOKEN", "FLOTILLA_TLS_"))}
    out = [("", plain)]
    if args.trust:
        out.append((" +token", {**plain, "FLOTILLA_JOB_TOKEN": os.urandom(32).hex()}))
    modes = args.data_plane
    token = os.urandom(32).hex()
    marks = {"auto": DP_SUFFIX if len(modes) > 1 else "", "tcp": LOCAL_TCP_SUFFIX, "off": ""}
    return [(suffix + marks[mode], mode_env(e, mode, token)) for suffix, e in out for mode in modes]


def mode_env(env: dict[str, str], mode: str, token: str) -> dict[str, str]:
    """``env`` with ``FLAGS_rpc_data_plane=mode``; mode tcp also gets a job token unless it has one (the
    TCP plane is only offered in jobs with a token)."""
    out = {**env, "FLAGS_rpc_data_plane": mode}
    if mode == "tcp":
        out.setdefault("FLOTILLA_JOB_TOKEN", token)
    return out


def paddle_version(python: str) -> str | None:
    """``Paddle <version>`` if ``python`` imports paddle (bounded wait), else None."""
    try:
        done = subprocess.run([python, "-c", "import paddle; print(paddle.__version__)"], capture_output=True,
                              text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"Paddle {done.stdout.strip()}" if done.returncode == 0 else None


def reference(rows: list[dict[str, Any]], job: str) -> tuple[float, str]:
    """Paddle's per-trainer examples/s on ``job`` (a Geo-SGD job: on its async form; any variant, such as
    `` +shm``: on the plain job) measured in this run, else the last figure measured on this machine (async
    1x2), and where it comes from."""
    shape, _, mode = job.partition(" ")
    mode = mode.split(" +")[0]
    job = f"{shape} {'async' if mode.startswith('geo') else mode}"
    for r in rows:
        if r["job"] == f"paddle {job}":
            return r["per_trainer"], "this run"
    return REFERENCE_PER_TRAINER, "last measured, not this run"


def print_data_plane(rows: list[dict[str, Any]]) -> None:
    """Each PS job with the data plane off against auto (``--data-plane both``), same run."""
    by_name = {r["job"]: r for r in rows}
    pairs = [(by_name[r["job"].replace(DP_SUFFIX, "")], r) for r in rows
             if DP_SUFFIX in r["job"] and r["job"].replace(DP_SUFFIX, "") in by_name]
    if not pairs:
        return
    print()
    print("(f) data plane: FLAGS_rpc_data_plane=off (gRPC) against auto (shared memory on this host), same run")
    print(f"{'job':<24} {'per tr. off':>12} {'per tr. auto':>13} {'ratio':>6} {'CPU ms/1k off':>14} "
          f"{'CPU ms/1k auto':>15} {'ratio':>6}")
    for off, auto in pairs:
        co, ca = off.get("cpu_ms_per_kex"), auto.get("cpu_ms_per_kex")
        cpu = f"{co:14.1f} {ca:15.1f} {ca / co:6.2f}" if co and ca else f"{'-':>14} {'-':>15} {'-':>6}"
        print(f"{off['job']:<24} {off['per_trainer']:12,.0f} {auto['per_trainer']:13,.0f} "
              f"{auto['per_trainer'] / off['per_trainer']:6.2f} {cpu}")


def print_trust(rows: list[dict[str, Any]]) -> None:
    rows = [r for r in rows
            if DP_SUFFIX not in r["job"] and LOCAL_TCP_SUFFIX not in r["job"] and not r.get("placement")]
    plain = {r["job"]: r for r in rows if "+" not in r["job"]}
    lines = []
    for r in rows:
        base, _, variant = r["job"].partition(" +")
        if variant and base in plain:
            ratio = r["per_trainer"] / plain[base]["per_trainer"]
            lines.append(f"{base:<12} {'+' + variant:<13} {r['per_trainer']:12,.0f} {plain[base]['per_trainer']:12,.0f} "
                         f"{ratio:7.2f}  {'met' if ratio >= 0.95 else 'MISSED'}")
    if lines:
        print()
        print("(d) trust on the wire: per trainer examples/s with the job token against plain, same run")
        print(f"{'job':<12} {'variant':<13} {'with':>12} {'plain':>12} {'ratio':>7}  target >= 0.95")
        for line in lines:
            print(line)


def median_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row a job from ``--rounds`` runs of the job list: the round whose job-CPU ratio (the job's CPU
    per 1,000 examples over the single-process job's of the same round) is the median, that ratio's every
    round kept as ``cpu_ratio_rounds``. A job without a CPU figure (or a single round) keeps its first row."""
    if len(rounds) == 1:
        return rounds[0]
    local = [next((r.get("cpu_ms_per_kex") for r in rows if not r["pservers"]), None) for rows in rounds]
    by_job: dict[str, list[tuple[float | None, dict[str, Any]]]] = {}
    for rows, base in zip(rounds, local):
        for r in rows:
            cpu = r.get("cpu_ms_per_kex")
            by_job.setdefault(r["job"], []).append((cpu / base if cpu and base else None, r))
    out = []
    for runs in by_job.values():
        first = runs[0][1]
        if not first["pservers"]:  # the baseline: its median-CPU round
            order = sorted(range(len(runs)), key=lambda i: runs[i][1].get("cpu_ms_per_kex") or 0.0)
            out.append(runs[order[len(order) // 2]][1])
            continue
        ratios = [ratio for ratio, _ in runs]
        if None in ratios:
            out.append(first)
            continue
        at = sorted(range(len(runs)), key=lambda i: ratios[i])[len(runs) // 2]
        out.append({**runs[at][1], "cpu_ratio": ratios[at], "cpu_ratio_rounds": ratios})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    jobs = [] if args.skip_jobs else [Job("single-process", 0, 1, "local")] + [parse_job(j) for j in args.jobs]
    env = child_env(args)
    variants = trust_variants(args, env)
    paddle = paddle_version(args.paddle_python) if args.vs_paddle else None
    load_before = os.getloadavg()
    segments_before = set(leftover_segments())
    note = " (--quick: a smoke run; its figures are not comparable with a full run)" if args.quick else ""
    print(f"ps_bench: {os.cpu_count()} cores; table {args.table_rows:,} x 16, batch {args.batch_size}, "
          f"{args.warmup} warm-up + {args.steps} timed steps a trainer, ids {args.id_dist}{note}", flush=True)
    tcp: dict[int, dict[str, float]] = {}
    by_mode: dict[str, dict[int, dict[str, float]]] = {}
    netns_transport: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ps_bench_") as tmpdir:
        tmp = pathlib.Path(tmpdir)
        if not args.skip_transport:
            procs = Procs(tmp, env)
            try:
                tcp, by_mode = bench_transport(procs, args.sizes_mib, args.reps, args.data_plane)
                print("transport: " + ", ".join(
                    f"{m} MiB {d} TCP {tcp[m][d]:.2f} "
                    + " ".join(f"{DP_LABEL[k]} {v[m][d]:.2f}" for k, v in by_mode.items()) + " GB/s"
                    for m in tcp for d in ("send", "get")), flush=True)
            finally:
                procs.kill()
            if args.netns:
                try:
                    netns_transport = bench_transport_netns(tmp, env, args.sizes_mib, args.reps, args.job_timeout)
                except NetnsError as e:
                    raise BenchError(f"the cross-host transport could not be set up: {e}",
                                     hint="namespaces need root and iproute2; drop --netns") from e
                print("transport across hosts: " + ", ".join(
                    f"{m} MiB {d} gRPC {netns_transport['rates']['off'][m][d]:.2f} TCP plane "
                    f"{netns_transport['rates']['auto'][m][d]:.2f} GB/s"
                    for m in netns_transport["rates"]["off"] for d in ("send", "get")), flush=True)
        rounds: list[list[dict[str, Any]]] = []
        paddle_failures: dict[str, str] = {}
        for round_no in range(args.rounds):
            if args.rounds > 1:
                print(f"round {round_no + 1} of {args.rounds}", flush=True)
            rows = []
            here = tmp / f"round{round_no + 1}"  # each round's jobs in their own directories
            here.mkdir()
            for job in jobs:
                for suffix, job_env in (variants if job.pservers else variants[:1]):
                    start = time.perf_counter()
                    named = Job(job.name + suffix, job.pservers, job.trainers, job.mode)
                    rows.append(run_job(named, args, job_env, here))
                    print(f"{named.name}: {rows[-1]['per_trainer']:,.0f} examples/s per trainer, {rows[-1]['total']:,.0f} "
                          f"total ({time.perf_counter() - start:.1f}s with start-up)", flush=True)
                if job.pservers and paddle and job.mode in ("sync", "async"):
                    theirs = Job(f"paddle {job.name}", job.pservers, job.trainers, job.mode, paddle=args.paddle_python)
                    try:
                        rows.append(run_job(theirs, args, variants[0][1], here))
                    except BenchError as e:  # Paddle's own failure is a figure too, not the end of this run
                        paddle_failures[theirs.name] = str(e.message).splitlines()[0]
                        print(f"{theirs.name} ({paddle}) failed: {paddle_failures[theirs.name]}", flush=True)
                    else:
                        print(f"{theirs.name} ({paddle}): {rows[-1]['per_trainer']:,.0f} examples/s per trainer",
                              flush=True)
            rounds.append(rows)
        rows = median_rounds(rounds)
        if (args.hosts or args.netns) and jobs:
            try:
                rows += cross_host_jobs(jobs, args, env, tmp)
            except NetnsError as e:
                raise BenchError(f"the cross-host runs could not be set up: {e}",
                                 hint="namespaces need root and iproute2; drop --hosts/--netns") from e
    local = rows[0]["total"] if rows else 0.0
    if tcp:
        print_transport(tcp, by_mode)
    if netns_transport:
        print_transport_netns(netns_transport)
    if rows:
        print_jobs(rows, local, paddle)
    for name, why in paddle_failures.items():
        print(f"  {name}: Paddle's run failed ({why}); see its log")
    print_trust(rows)
    print_cross_host(rows)
    print_data_plane(rows)
    print_summary(tcp, by_mode, rows, local, paddle, rows[0].get("cpu_ms_per_kex") if rows else None)
    load_after = os.getloadavg()
    left = sorted(set(leftover_segments()) - segments_before)
    if left:
        print(f"data plane: {len(left)} segment file(s) left in /dev/shm: {left[:3]}")
    print(f"load average (1/5/15 min): {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f} before, "
          f"{load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} after{note}")
    result = {"transport": {"tcp": tcp, "grpc": by_mode.get("off", {}), "shm": by_mode.get("auto", {}),
                            "tcp_plane": by_mode.get("tcp", {}),
                            "netns": netns_transport},
              "jobs": rows, "local_examples_per_s": local,
              "reference_per_trainer": REFERENCE_PER_TRAINER, "paddle": paddle, "paddle_failures": paddle_failures,
              "load_average": {"before": load_before, "after": load_after},
              "config": {k: v for k, v in vars(args).items() if k != "json"}}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    if args.plot:
        plot_jobs(args.plot, result)
        print(f"plot: {args.plot}")
    return result


# --- the plot ---------------------------------------------------------------------------------------------
def plot_bars(result: dict[str, Any]) -> list[plotting.Bar]:
    """The bars of ``--plot`` from ``main``'s result: per job (single-process, then each PS / hybrid / Geo
    job and placement) examples/s per trainer of each system: Flotilla (with the data plane named when the
    run compared both), Paddle's PS where this run measured it, else Paddle's recorded figure on 1x2 async,
    marked as recorded."""
    modes = result["config"]["data_plane"]
    bars: list[plotting.Bar] = []
    for r in result["jobs"]:
        if r.get("paddle"):
            bars.append(plotting.Bar(r["job"].removeprefix("paddle "), f"{result['paddle'] or 'Paddle'} PS",
                                     r["per_trainer"]))
            continue
        if not r["pservers"]:
            bars.append(plotting.Bar(r["job"], "Flotilla", r["per_trainer"]))
            continue
        job = r["job"][:-len(r["placement"]) - 1] if r.get("placement") else r["job"]
        shm, local_tcp = DP_SUFFIX in job, LOCAL_TCP_SUFFIX in job
        job = job.replace(LOCAL_TCP_SUFFIX, "")  # before looking for CROSS_DP_SUFFIX: " +tcp" begins it
        tcp = CROSS_DP_SUFFIX in job
        base, _, variant = job.replace(DP_SUFFIX, "").replace(CROSS_DP_SUFFIX, "").partition(" +")
        extras = [f"+{variant}"] if variant else []
        if r.get("placement"):
            extras.append(r["placement"])
        plane = "TCP plane" if tcp or local_tcp else DP_LABEL["auto" if shm else modes[0]]
        series = ", ".join(["Flotilla", plane, *extras])
        bars.append(plotting.Bar(base, series, r["per_trainer"]))
    if "1x2 async" in {b.group for b in bars} and not any(b.group == "1x2 async" and "PS" in b.series for b in bars):
        bars.append(plotting.Bar("1x2 async", "Paddle 2.6.2 PS", result["reference_per_trainer"], recorded=True))
    return bars


def plot_jobs(path: str, result: dict[str, Any]) -> None:
    """Draw ``plot_bars(result)`` to ``path`` (PNG)."""
    quick = " (--quick: not comparable)" if result["config"].get("quick") else ""
    plotting.grouped_bars(path, plot_bars(result), ylabel="examples/s per trainer",
                          title=f"CTR job, examples/s per trainer (batch {result['config']['batch_size']}, "
                                f"127.0.0.1){quick}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        print(f"ps_bench failed: {e}", file=sys.stderr)
        sys.exit(1)
