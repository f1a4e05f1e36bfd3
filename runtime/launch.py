"""The local cluster launcher: ``python -m runtime.launch`` (and ``flotilla launch``).

Parameter-server mode starts pservers and trainers on this machine::

    python -m runtime.launch --server_num 2 --worker_num 2 [--log_dir DIR] [--started_port P]
                             [--stop_timeout S] train.py [script args...]
    python -m runtime.launch --servers 127.0.0.1:6174,127.0.0.1:6175 --workers 127.0.0.1,127.0.0.1 train.py

collective mode starts N trainers that know each other's endpoints (no pservers); trainer 0's endpoint
is the group's rendezvous and coordinator::

    python -m runtime.launch --nproc_per_node 2 train.py
    python -m runtime.launch --trainers 127.0.0.1:6170,127.0.0.1:6171 train.py
    python -m runtime.launch --gpus 0,1 train.py        # one trainer a GPU, FLAGS_selected_gpus=<its GPU>

Jobs spanning hosts: run the launcher on every host with the same arguments. Each host starts the
processes listed at its own addresses (those an interface here has: binding them succeeds), or at
``--node_ip``; the others are named as started by the other hosts' launchers::

    python -m runtime.launch --servers 10.0.0.1:6174,10.0.0.2:6174 --workers 10.0.0.1,10.0.0.2 train.py
    python -m runtime.launch --ips 10.0.0.1,10.0.0.2 --nproc_per_node 2 [--started_port 6170] train.py

Every host must derive the same endpoints, so no port of a job spanning hosts comes from the OS: an entry
without a port gets ``--started_port`` (default 6170) plus its position among such entries (``--ips``:
host k's local rank j is trainer k*N+j at ``ip_k:started_port+j``). Such a job needs one secret on every
host, ``FLOTILLA_JOB_TOKEN`` (or mutual TLS): the launcher refuses to start without it. A lost host
ends the job on the others through their own processes' bounded waits (a trainer's RPC deadline names
the lost pserver endpoint; a pserver's trainer timeout names the trainer ids; a collective trainer names
the endpoints that left the group), after which each launcher stops its local share as usual.

Restarts (``--max_restarts N``): a trainer that fails is started again, N times in all, with
``FLOTILLA_RESTART_COUNT`` set to the restart's number (0 at the first start): alone in parameter-server mode
(it rejoins at the pservers' next step boundary), with every other trainer of this host in collective mode.

Each child gets Paddle's variables (``TRAINING_ROLE``, ``PADDLE_TRAINER_ID``, ``PADDLE_TRAINERS_NUM``,
``PADDLE_PSERVERS_IP_PORT_LIST``, ``PADDLE_CURRENT_ENDPOINT``, ``PADDLE_PORT``, ``POD_IP``,
``PADDLE_TRAINER_ENDPOINTS``; ``runtime.role.role_from_env`` reads them back) and ``PYTHONUNBUFFERED=1``,
and the job token ``FLOTILLA_JOB_TOKEN``: a fresh random one per job (never printed), or the launcher's
own when it is set (a job spanning machines sets the same value everywhere by hand); the pservers then
answer UNAUTHENTICATED to any call without it (``runtime.flags``). The processes this host starts share
its cores: each gets ``PJRT_NPROC`` = its CPUs divided by their number (``runtime.cpu_threads``;
``FLAGS_cpu_threads_per_trainer`` changes the rule, a ``PJRT_NPROC`` set here is passed on as it is).
Its output lines (stdout and stderr together) are echoed on the launcher's stdout tagged
``[pserver.0] `` / ``[trainer.1] ``, and written to ``DIR/serverlog.<i>`` / ``DIR/workerlog.<i>`` with
``--log_dir``. The launcher's own lines are tagged ``[launch] ``.

Ending: when every trainer has exited 0 the pservers get ``--stop_timeout`` seconds to exit by
themselves (Flotilla's pservers exit 0 once every trainer has sent Complete); any still running are
stopped. When any process exits non-zero the launcher names it (tag, pid, exit code, its last lines) and
stops all the others; a child it then finds stopped (SIGSTOP/SIGTSTP) is named first, as the cause (the
others only timed out waiting for it). SIGINT/SIGTERM to the launcher stop the job. A summary line lists every process.

Exit status: 0 every process exited 0 by itself; 1 a process failed, could not start, or had to be
stopped; 2 a usage error (nothing was started); 128+N the launcher got signal N.

Invariants:
- Each child runs in a session of its own (``start_new_session``), so its process group id is its pid.
  The launcher signals only those groups, and only while it has not reaped the group leader (exits are
  observed with ``waitid(WNOWAIT)``, the leader is reaped last), so a group id can never have been
  reused by a process the launcher did not start.
- Children die with the launcher (Linux): each gets SIGKILL when the launcher's main thread ends, even by
  ``kill -9`` (``prctl(PR_SET_PDEATHSIG)``), so no pserver outlives its job serving a port.
- Every wait is bounded: polling, the stop timeout, the grace between SIGTERM and SIGKILL, reader joins.
- Ports are taken from the OS on 127.0.0.1 (or consecutive from ``--started_port``), checked by binding
  without SO_REUSEADDR; a port in use is a usage error naming it.
"""
from __future__ import annotations

import argparse
import collections
import errno
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Mapping, NoReturn, Sequence

from runtime.cpu_threads import XLA_NPROC_ENVS, CPUThreadsError, available_cpus, xla_threads
from runtime.flags import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TOKEN_ENV as JOB_TOKEN_ENV
from runtime.launch_common import (EXIT_FAILED, EXIT_OK, EXIT_USAGE, POLL_S, PSERVER_KIND, TAIL_LINES, TERM_GRACE_S,
                                   TRAINER_KIND, _Output, child_environ, die_with_parent, new_job_token, pserver_env, trainer_env)
from runtime.role import LaunchError, format_endpoint, parse_endpoint, parse_endpoint_list

PROG = "python -m runtime.launch"
LOCAL_HOST = "127.0.0.1"
RESTART_COUNT_ENV = "FLOTILLA_RESTART_COUNT"  # a child's restart count: 0 at the first start
DEFAULT_STARTED_PORT = 6170  # Paddle's launcher's first port, for jobs whose hosts must agree on their ports

REAP_TIMEOUT_S = 5.0  # after SIGKILL, how long to wait for a child to be reaped
READER_JOIN_S = 5.0  # how long to wait for a child's output to drain after it exited
PROBE_TIMEOUT_S = 1.0  # a failed job spanning hosts: how long each remote endpoint gets to accept a connection


# --- arguments -------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ``LaunchError`` (one line) instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        raise LaunchError(f"{message} (see '{self.prog} --help')", code="E810")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The launcher's argument parser; everything after the training script goes to the script."""
    parser = _Parser(prog=prog, description="Start a local Flotilla cluster (pservers and trainers, or collective "
                                            "trainers) running one training script, and watch it.")
    ps = parser.add_argument_group("parameter-server mode")
    ps.add_argument("--server_num", type=int, default=None, metavar="N",
                    help="start N pservers on free ports of 127.0.0.1")
    ps.add_argument("--worker_num", type=int, default=None, metavar="M", help="start M trainers")
    ps.add_argument("--servers", default=None, metavar="IP:PORT,...",
                    help="the pserver endpoints (instead of --server_num)")
    ps.add_argument("--workers", default=None, metavar="IP[:PORT],...",
                    help="the trainers' hosts, optionally with ports (instead of --worker_num)")
    coll = parser.add_argument_group("collective mode")
    coll.add_argument("--nproc_per_node", type=int, default=None, metavar="N",
                      help="start N trainers with PADDLE_TRAINER_ENDPOINTS set and no pservers")
    coll.add_argument("--trainers", default=None, metavar="IP:PORT,...",
                      help="the collective trainers' endpoints (instead of --nproc_per_node)")
    coll.add_argument("--ips", "--cluster_node_ips", dest="ips", default=None, metavar="IP,IP,...",
                      help="the job's hosts, in order: host k runs trainers k*N..k*N+N-1 (N: --nproc_per_node) "
                           "at IP:P, IP:P+1, ... (P: --started_port, default 6170); run the launcher on each")
    coll.add_argument("--gpus", "--selected_gpus", dest="gpus", default=None, metavar="I,J,...",
                      help="one trainer a GPU: trainer k gets FLAGS_selected_gpus=<k-th id> (with --ips: the "
                           "local rank's id)")
    parser.add_argument("--node_ip", default=None, metavar="IP",
                        help="this host's address in the job's lists: start only the processes listed at it "
                             "(default: every process whose address belongs to an interface of this host)")
    parser.add_argument("--max_restarts", type=int, default=0, metavar="N",
                        help="restart failed trainers, N times in all: a PS trainer alone (it rejoins at the next "
                             "step), every collective trainer of this host together (the script resumes from its "
                             "checkpoint); each gets FLOTILLA_RESTART_COUNT (default: 0, a failure ends the job)")
    on_ray = parser.add_argument_group("on a Ray cluster (pip install 'flotilla[ray]'; runtime/ray_launch.py)")
    on_ray.add_argument("--ray", default=None, metavar="ADDRESS",
                        help="run every process as an actor of the Ray cluster at ADDRESS (host:port, or auto)")
    on_ray.add_argument("--cpus_per_trainer", type=float, default=1.0, metavar="C", help="CPUs a trainer holds (1)")
    on_ray.add_argument("--gpus_per_trainer", type=float, default=0.0, metavar="G", help="GPUs a trainer holds (0)")
    on_ray.add_argument("--cpus_per_pserver", type=float, default=1.0, metavar="C", help="CPUs a pserver holds (1)")
    on_ray.add_argument("--ray_timeout", type=float, default=120.0, metavar="S",
                        help="seconds to wait for Ray to place the job's processes (120)")
    parser.add_argument("--log_dir", default=None, metavar="DIR",
                        help="write each process's output to DIR/serverlog.<i> or DIR/workerlog.<i>")
    parser.add_argument("--started_port", type=int, default=None, metavar="P",
                        help="use consecutive ports from P instead of free ports from the OS")
    parser.add_argument("--stop_timeout", type=float, default=60.0, metavar="S",
                        help="seconds the pservers get to exit after every trainer finished (default: 60)")
    parser.add_argument("training_script", metavar="training_script", help="the script every process runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, metavar="...",
                        help="arguments for the training script")
    return parser


# --- the plan --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: its tag (``pserver.0``), kind, index, role variables and log file name."""

    tag: str
    kind: str
    index: int
    env: dict[str, str]
    log_name: str


@dataclass(frozen=True)
class JobPlan:
    """Everything the launcher starts, decided before anything is started."""

    mode: str  # "pserver" | "collective"
    pserver_endpoints: tuple[str, ...]
    trainer_endpoints: tuple[str, ...]
    processes: tuple[ProcessSpec, ...]
    script: str
    script_args: tuple[str, ...]
    log_dir: str | None
    stop_timeout: float
    remote: tuple[str, ...] = ()  # tags of the processes other hosts' launchers start
    max_restarts: int = 0  # failed trainers restarted at most this many times in all (see _Job._restart)
    remote_listeners: tuple[tuple[str, str], ...] = ()  # (tag, endpoint) listening on other hosts: what a
    # failed job probes to name the lost (every remote pserver; in collective mode trainer 0, the coordinator)


def _usage(message: str, hint: str | None = None) -> LaunchError:
    return LaunchError(message, hint=hint, code="E810")


def _count(value: int, flag: str) -> int:
    if value < 1:
        raise _usage(f"{flag} is {value}: expected at least 1", hint=f"pass {flag} 1 or more")
    return value


def _hosts_and_ports(text: str, flag: str) -> list[tuple[str, int | None]]:
    """``--workers``: hosts, each optionally with a port."""
    out: list[tuple[str, int | None]] = []
    for position, item in enumerate(text.split(",")):
        item = item.strip()
        if not item:
            raise LaunchError(f"{flag}: item {position} of {text!r} is empty",
                              hint="write hosts as 127.0.0.1,127.0.0.1 (optionally host:port)", code="E803")
        if ":" in item and not (item.startswith("[") and item.endswith("]")):
            host, port = parse_endpoint(item, flag)
            out.append((host, port))
        else:
            if any(c.isspace() for c in item):
                raise LaunchError(f"{flag}: {item!r} is not a host", hint="no blanks inside a host", code="E803")
            out.append((item, None))
    return out


def plan_job(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> JobPlan:
    """Validate the parsed arguments, choose ports and build every process's role variables; keep the
    processes this host starts (``environ``, ``os.environ`` by default, is checked for the job token)."""
    environ = os.environ if environ is None else environ
    if not math.isfinite(args.stop_timeout) or args.stop_timeout < 0:
        raise _usage(f"--stop_timeout is {args.stop_timeout}: expected a number of seconds, 0 or more")
    if args.max_restarts < 0:
        raise _usage(f"--max_restarts is {args.max_restarts}: expected 0 or more")
    if args.started_port is not None and not 1 <= args.started_port <= 65535:
        raise _usage(f"--started_port is {args.started_port}: expected a port in 1..65535")
    ps_flags = [f for f, v in (("--server_num", args.server_num), ("--worker_num", args.worker_num),
                               ("--servers", args.servers), ("--workers", args.workers)) if v is not None]
    gpus = _gpu_ids(args.gpus) if args.gpus is not None else None
    coll_flags = [f for f, v in (("--nproc_per_node", args.nproc_per_node), ("--trainers", args.trainers),
                                 ("--ips", args.ips), ("--gpus", args.gpus)) if v is not None]
    local_gpus: dict[int, int] = {}  # trainer index -> its GPU
    if coll_flags:
        if ps_flags:
            raise _usage(f"{', '.join(coll_flags)} (collective mode) cannot be combined with {', '.join(ps_flags)} "
                         "(parameter-server mode)", hint="choose one mode")
        servers: list[tuple[str, int | None]] = []
        workers = _collective_workers(args, gpus, local_gpus)
        mode = "collective"
    else:
        if not ps_flags:
            raise _usage("no job given: pass --server_num N --worker_num M (or --servers/--workers) for "
                         "parameter-server mode, or --nproc_per_node N for collective mode")
        servers = _servers(args)
        workers = _workers(args)
        mode = "pserver"

    script = args.training_script
    if not os.path.isfile(script):
        what = "is a directory" if os.path.isdir(script) else "does not exist"
        raise LaunchError(f"training script {script!r} {what}", hint="give the path of a Python file", code="E812")

    wanted = [(PSERVER_KIND, i, host, port) for i, (host, port) in enumerate(servers)]
    wanted += [(TRAINER_KIND, i, host, port) for i, (host, port) in enumerate(workers)]
    mine = _own_hosts(args.node_ip, [host for _, _, host, _ in wanted])
    spans_hosts = any(host not in mine for _, _, host, _ in wanted)
    if spans_hosts:
        _require_shared_secret(environ, sorted({host for _, _, host, _ in wanted if host not in mine}))
    portless = [(host, f"{kind}.{i}") for kind, i, host, port in wanted if port is None]
    if spans_hosts:  # every host must derive the same ports: no OS-chosen ones
        base = args.started_port if args.started_port is not None else DEFAULT_STARTED_PORT
        fresh = iter(_consecutive_ports(base, len(portless), "--started_port"))
    else:
        fresh = iter(pick_ports(portless, args.started_port))
    endpoints: dict[str, str] = {}  # endpoint -> the process it belongs to
    local: set[str] = set()  # tags of the processes this host starts
    for kind, i, host, port in wanted:
        endpoint = format_endpoint(host, port if port is not None else next(fresh))
        if endpoint in endpoints:
            raise LaunchError(f"endpoint {endpoint} is given to {endpoints[endpoint]} and to {kind}.{i}",
                              hint="every process needs an endpoint of its own", code="E803")
        endpoints[endpoint] = f"{kind}.{i}"
        if host not in mine:
            continue
        local.add(f"{kind}.{i}")
        if port is not None or spans_hosts:  # a port not from the OS: make sure it is usable before starting
            source = "--servers" if kind == PSERVER_KIND else ("--workers" if mode == "pserver" else "--trainers")
            if port is None:
                source = f"--started_port {args.started_port or DEFAULT_STARTED_PORT}"
            if kind == PSERVER_KIND or mode == "collective":  # PS-mode trainers bind no port
                _check_port_free(host, int(endpoint.rsplit(":", 1)[1]), f"{kind}.{i}", source)
    if not local:
        raise LaunchError(f"this host matches no process of the job: its addresses {sorted(mine) or '(none listed)'} "
                          f"are not among the job's hosts {sorted({h for _, _, h, _ in wanted})}",
                          hint="run the launcher on the hosts the lists name, give this host's address with "
                               "--node_ip, or fix the lists", code="E813")
    ordered = list(endpoints)  # pservers first, then trainers
    server_eps = tuple(ordered[:len(servers)])
    worker_eps = tuple(ordered[len(servers):])

    if args.log_dir is not None:
        try:
            os.makedirs(args.log_dir, exist_ok=True)
        except OSError as e:
            raise LaunchError(f"--log_dir {args.log_dir!r}: cannot create it: {e.strerror or e}",
                              hint="choose a writable directory", code="E812") from None

    try:  # the job's processes on this host share its cores (runtime.cpu_threads)
        threads = xla_threads(len(local), available_cpus(), environ)
    except CPUThreadsError as e:
        raise LaunchError(e.message, hint=e.hint) from None
    shared = {XLA_NPROC_ENVS[0]: str(threads)} if threads is not None else {}
    processes = [ProcessSpec(f"{PSERVER_KIND}.{i}", PSERVER_KIND, i,
                             {**pserver_env(server_eps, worker_eps, i), **shared}, f"serverlog.{i}")
                 for i in range(len(server_eps))]
    processes += [ProcessSpec(f"{TRAINER_KIND}.{i}", TRAINER_KIND, i,
                              {**trainer_env(server_eps, worker_eps, i), **shared,
                               **({"FLAGS_selected_gpus": str(local_gpus[i])} if i in local_gpus else {})},
                              f"workerlog.{i}") for i in range(len(worker_eps))]
    return JobPlan(mode=mode, pserver_endpoints=server_eps, trainer_endpoints=worker_eps,
                   processes=tuple(p for p in processes if p.tag in local), script=script,
                   script_args=tuple(args.training_script_args), log_dir=args.log_dir,
                   stop_timeout=float(args.stop_timeout), max_restarts=args.max_restarts,
                   remote=tuple(p.tag for p in processes if p.tag not in local),
                   remote_listeners=tuple((tag, ep) for ep, tag in endpoints.items() if tag not in local and (
                       tag.startswith(PSERVER_KIND) or (mode == "collective" and tag == f"{TRAINER_KIND}.0"))))


def _collective_workers(args: argparse.Namespace, gpus: list[int] | None,
                        local_gpus: dict[int, int]) -> list[tuple[str, int | None]]:
    """Collective mode's trainers: ``--trainers`` endpoints, ``--ips`` hosts times ``--nproc_per_node``, or
    ``--nproc_per_node`` (or one a ``--gpus`` id) on 127.0.0.1; fills ``local_gpus`` (trainer -> GPU)."""
    if args.trainers is not None and args.ips is not None:
        raise _usage("--trainers and --ips both given", hint="give the endpoints, or the hosts with --nproc_per_node")
    per_node = args.nproc_per_node
    if args.ips is not None:
        ips = [parse_endpoint(f"{ip.strip()}:1", "--ips")[0] if ip.strip() else "" for ip in args.ips.split(",")]
        if "" in ips or len(set(ips)) != len(ips):
            raise LaunchError(f"--ips {args.ips!r} must list distinct hosts, none empty",
                              hint="e.g. --ips 10.0.0.1,10.0.0.2", code="E803")
        per_node = _count(per_node if per_node is not None else len(gpus or []) or 1, "--nproc_per_node")
        base = args.started_port if args.started_port is not None else DEFAULT_STARTED_PORT
        ports = _consecutive_ports(base, per_node, "--started_port")
        workers: list[tuple[str, int | None]] = [(ip, port) for ip in ips for port in ports]
        if gpus is not None and len(gpus) != per_node:
            raise _usage(f"--gpus lists {len(gpus)} GPU(s) for {per_node} trainer(s) a host",
                         hint="with --ips, one GPU id a local trainer: as many ids as --nproc_per_node")
        if gpus is not None:
            local_gpus.update({k: gpus[k % per_node] for k in range(len(workers))})
        return workers
    if args.trainers is not None:
        workers = [parse_endpoint(ep, "--trainers") for ep in parse_endpoint_list(args.trainers, "--trainers")]
    else:
        count = per_node if per_node is not None else len(gpus or [])
        workers = [(LOCAL_HOST, None)] * _count(count, "--nproc_per_node")
    if per_node is not None and len(workers) != per_node:
        raise _usage(f"--nproc_per_node {per_node} but --trainers lists {len(workers)} endpoint(s)",
                     hint="give one of them, or make them agree")
    if gpus is not None and len(gpus) != len(workers):
        raise _usage(f"--gpus lists {len(gpus)} GPU(s) for {len(workers)} trainer(s)",
                     hint="one GPU a trainer: as many ids as trainers")
    if gpus is not None:
        local_gpus.update(enumerate(gpus))
    return workers


def _consecutive_ports(base: int, n: int, flag: str) -> list[int]:
    if base + n - 1 > 65535:
        raise _usage(f"{flag} {base} leaves no room for {n} port(s) below 65536", hint=f"choose a lower {flag}")
    return list(range(base, base + n))


def probe_endpoints(listeners: Sequence[tuple[str, str]], timeout: float = PROBE_TIMEOUT_S) -> list[tuple[str, str, str]]:
    """(tag, endpoint, why) for each of ``listeners`` that does not accept a TCP connection within
    ``timeout`` seconds (all probed at once, so the whole probe takes about ``timeout`` at most)."""
    results: dict[int, str] = {}

    def probe(i: int, endpoint: str) -> None:
        host, port = parse_endpoint(endpoint, "endpoint")
        try:
            socket.create_connection((host.strip("[]"), port), timeout=timeout).close()
        except OSError as e:
            results[i] = "no answer" if isinstance(e, socket.timeout) else (e.strerror or str(e))

    threads = [threading.Thread(target=probe, args=(i, ep), daemon=True) for i, (_, ep) in enumerate(listeners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1.0)
    return [(tag, ep, results[i]) for i, (tag, ep) in enumerate(listeners) if i in results]


def is_local_address(host: str) -> bool:
    """Whether ``host`` (an address or a name) is an address of an interface of this host: binding a socket
    to it succeeds (any 127.x address is this host's on Linux). A name that does not resolve is an error."""
    family = socket.AF_INET6 if host.startswith("[") or ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host.strip("[]"), 0))
        return True
    except socket.gaierror as e:
        raise LaunchError(f"host {host!r} does not resolve: {e.strerror or e}",
                          hint="give hosts as IP addresses, or names this host can resolve", code="E803") from None
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            return False
        raise LaunchError(f"cannot tell whether {host} is an address of this host: {e.strerror or e}",
                          code="E811") from None
    finally:
        sock.close()


def _own_hosts(node_ip: str | None, hosts: Sequence[str]) -> set[str]:
    """The hosts of the job's lists that are this host: ``--node_ip`` alone when given (it must be an
    address here), else every listed host that is an address of this host."""
    if node_ip is not None:
        node = parse_endpoint(f"{node_ip.strip()}:1", "--node_ip")[0]
        if not is_local_address(node):
            raise LaunchError(f"--node_ip {node_ip} is not an address of this host",
                              hint="give an address of one of this host's interfaces ('ip addr' lists them)",
                              code="E813")
        return {node}
    return {host for host in dict.fromkeys(hosts) if is_local_address(host)}


def _require_shared_secret(environ: Mapping[str, str], others: Sequence[str]) -> None:
    """A job spanning hosts authenticates its processes with one secret set everywhere by hand (or mutual TLS)."""
    if environ.get(JOB_TOKEN_ENV) or (environ.get(TLS_CERT_ENV) and environ.get(TLS_CA_ENV)):
        return
    raise LaunchError(f"this job spans hosts (also {', '.join(others)}) but {JOB_TOKEN_ENV} is not set: its processes "
                      "could not tell each other from anyone who reaches their ports",
                      hint=f"make one secret and set it on every host before launching: export {JOB_TOKEN_ENV}=$(python "
                           "-c \"import secrets; print(secrets.token_hex(32))\") (or configure mutual TLS: "
                           f"{TLS_CERT_ENV}, {TLS_KEY_ENV}, {TLS_CA_ENV})", code="E813")


def _gpu_ids(text: str) -> list[int]:
    """``--gpus 0,1``: distinct non-negative GPU ids."""
    items = [t.strip() for t in text.split(",")]
    if not items or any(not t.isdigit() for t in items):
        raise _usage(f"--gpus {text!r} is not a list of GPU ids", hint="e.g. --gpus 0,1")
    ids = [int(t) for t in items]
    if len(set(ids)) != len(ids):
        raise _usage(f"--gpus {text!r} names a GPU twice", hint="one trainer a GPU")
    return ids


def _servers(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    if args.servers is not None and args.server_num is not None:
        raise _usage("--servers and --server_num both given", hint="give the endpoints or the count, not both")
    if args.servers is not None:
        return [parse_endpoint(ep, "--servers") for ep in parse_endpoint_list(args.servers, "--servers")]
    if args.server_num is None:
        raise _usage("parameter-server mode needs --server_num N or --servers IP:PORT,...",
                     hint="e.g. --server_num 2 --worker_num 2 (or --nproc_per_node N for collective mode)")
    return [(LOCAL_HOST, None)] * _count(args.server_num, "--server_num")


def _workers(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    if args.workers is not None and args.worker_num is not None:
        raise _usage("--workers and --worker_num both given", hint="give the hosts or the count, not both")
    if args.workers is not None:
        return _hosts_and_ports(args.workers, "--workers")
    if args.worker_num is None:
        raise _usage("parameter-server mode needs --worker_num M or --workers IP,...",
                     hint="e.g. --server_num 2 --worker_num 2")
    return [(LOCAL_HOST, None)] * _count(args.worker_num, "--worker_num")


# --- ports -----------------------------------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # No SO_REUSEADDR: a port that is bound, listening or lingering elsewhere must fail here.
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


def _check_port_free(host: str, port: int, who: str, source: str) -> None:
    try:
        _bind(host, port).close()
    except OSError as e:
        raise LaunchError(f"port {port} on {host} (from {source}, for {who}) cannot be used: {e.strerror or e}",
                          hint="stop whatever holds it, choose another port, or leave the ports to the launcher",
                          code="E811") from None


def pick_ports(needed: Sequence[tuple[str, str]], started_port: int | None) -> list[int]:
    """One port per ``(host, who)`` in ``needed``: free ones from the OS (all held open together, so they
    are distinct), or consecutive ones from ``started_port``, each checked free."""
    if started_port is not None:
        ports = []
        for offset, (host, who) in enumerate(needed):
            port = started_port + offset
            if port > 65535:
                raise _usage(f"--started_port {started_port} leaves no port for {who}: {len(needed)} ports needed "
                             "from it, past 65535", hint="choose a lower --started_port")
            try:
                _bind(host, port).close()
            except OSError as e:
                raise LaunchError(f"port {port} on {host} (--started_port {started_port} + {offset}, for {who}) "
                                  f"is not free: {e.strerror or e}",
                                  hint="choose another --started_port, or leave it out to get free ports from the OS",
                                  code="E811") from None
            ports.append(port)
        return ports
    held: list[socket.socket] = []
    try:
        for host, who in needed:
            try:
                held.append(_bind(host, 0))
            except OSError as e:
                raise LaunchError(f"cannot get a free port on {host} for {who}: {e.strerror or e}",
                                  hint="the local launcher starts every process on this machine: give hosts that "
                                       "are addresses of it, such as 127.0.0.1", code="E811") from None
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports of ``host`` that the OS says are free now (all held open while choosing): what
    tests and benchmarks give the processes they start."""
    return pick_ports([(host, f"port {i + 1} of {n}") for i in range(n)], None)


# --- running ---------------------------------------------------------------------------------------------
@dataclass
class _Child:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    log: IO[bytes] | None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None
    returncode: int | None = None  # set when its exit is observed (the leader is still unreaped)
    stopped: bool = False  # the launcher signalled it
    lost_ranks: list[int] = field(default_factory=list)  # trainers JAX's distributed service said stopped
    heartbeat_list_next: bool = False  # the reader just saw JAX's "stopped sending heartbeats):" line

    @property
    def pid(self) -> int:
        return self.popen.pid

    def observe(self) -> int | None:
        """Its exit status if it has exited, without reaping it (the zombie keeps its pid and group id ours)."""
        if self.returncode is not None:
            return self.returncode
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped by someone else; fall back to Popen's own record
            self.returncode = self.popen.returncode if self.popen.returncode is not None else -1
            return self.returncode
        if info is None or info.si_pid == 0:
            return None
        self.returncode = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        return self.returncode

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the child's process group; only valid while the leader is unreaped."""
        if self.popen.returncode is not None:
            return
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass


def _pump(child: _Child, out: _Output) -> None:
    """Reader thread: copy the child's output lines to its log, its tail and the tagged echo."""
    prefix = f"[{child.spec.tag}] "
    stream = child.popen.stdout
    if stream is None:
        return
    for raw in iter(stream.readline, b""):
        if not raw.endswith(b"\n"):
            raw += b"\n"
        if child.log is not None:
            try:
                child.log.write(raw)
                child.log.flush()
            except (OSError, ValueError):
                child.log = None
        text = raw.decode("utf-8", "replace")
        _note_lost_ranks(child, text)
        child.tail.append(text.rstrip("\n"))
        out.write(prefix + text)
    stream.close()


JAX_UNHEALTHY = "stopped sending heartbeats):"  # JAX's fatal error; the next line lists the dead task ids


def _note_lost_ranks(child: _Child, line: str) -> None:
    """JAX's distributed service aborts a survivor with "The following tasks are unhealthy (stopped sending
    heartbeats):" and the task ids (= trainer ids) on the next line: remember them, so the failure report
    names the lost endpoints (the abort's stack trace would push them out of the tail)."""
    if child.heartbeat_list_next:
        child.heartbeat_list_next = False
        ids = line.replace(",", " ").split()
        if ids and all(i.isdigit() for i in ids):
            child.lost_ranks.extend(int(i) for i in ids)
    if JAX_UNHEALTHY in line:
        child.heartbeat_list_next = True


class _Signals:
    """Catches SIGINT/SIGTERM while the job runs (main thread only) and wakes the supervisor."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.wake = threading.Event()
        self._old: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        self.wake.set()

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, old in self._old.items():
            signal.signal(signum, old)  # type: ignore[arg-type]


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (Linux ``/proc``; False where it cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]  # the field after "(comm)"
    return state in (b"T", b"t")


def _describe(child: _Child) -> str:
    rc = child.returncode
    if rc is None:
        text = "still running"
    elif rc >= 0:
        text = f"exit {rc}"
    else:
        try:
            text = f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            text = f"killed by signal {-rc}"
    if child.stopped:
        text += " (stopped by the launcher)"
    return f"{child.spec.tag} (pid {child.pid}) {text}"


class _Job:
    """The running job: starts the children, supervises them and always cleans up."""

    def __init__(self, plan: JobPlan, out: _Output, signals: _Signals) -> None:
        self.plan = plan
        self.out = out
        self.signals = signals
        self.children: list[_Child] = []
        self.token = new_job_token()  # one per job; never printed
        self.stuck: set[str] = set()  # tags of children found stopped when the job failed
        self.restarts = 0  # restarts made so far (--max_restarts bounds them)
        self.preexec = die_with_parent()  # resolved once, in the thread that starts every child

    def start(self) -> None:
        if self.plan.remote:
            self.out.status(f"this host starts {len(self.plan.processes)} of the job's "
                            f"{len(self.plan.processes) + len(self.plan.remote)} processes; the launchers of the "
                            f"other hosts start {', '.join(self.plan.remote)}")
        for spec in self.plan.processes:  # pservers come first in the plan
            self.children.append(self._spawn(spec))

    def _spawn(self, spec: ProcessSpec) -> _Child:
        """Start one process of the plan (again, after a restart: its log is appended to)."""
        command = [sys.executable, self.plan.script, *self.plan.script_args]
        log = None
        if self.plan.log_dir is not None:
            log = open(os.path.join(self.plan.log_dir, spec.log_name), "ab" if self.restarts else "wb")
        env = child_environ(os.environ, {**spec.env, RESTART_COUNT_ENV: str(self.restarts)}, self.token)
        try:
            popen = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=self.preexec)
        except OSError:
            if log is not None:
                log.close()
            raise
        child = _Child(spec, popen, log)
        child.reader = threading.Thread(target=_pump, args=(child, self.out), name=f"launch-{spec.tag}", daemon=True)
        child.reader.start()
        self.out.status(f"started {spec.tag} (pid {popen.pid}) at {spec.env['PADDLE_CURRENT_ENDPOINT']}")
        return child

    def _retire(self, children: Sequence[_Child]) -> None:
        """Stop, sweep, reap and drain ``children`` (exited or not) before they are replaced."""
        self.stop(children)
        for child in children:
            child.signal_group(signal.SIGKILL)  # the leader is unreaped: its group id is still ours
            try:
                child.popen.wait(timeout=REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.out.status(f"{child.spec.tag} (pid {child.pid}) did not exit after SIGKILL", error=True)
            if child.reader is not None:
                child.reader.join(timeout=READER_JOIN_S)
            if child.log is not None:
                child.log.close()

    def _restart(self, failed: _Child) -> None:
        """Restart after ``failed`` (a trainer) failed: that trainer alone in parameter-server mode (it rejoins
        the pservers at their next step boundary), every trainer of this host in collective mode (a group is
        formed once: the survivors cannot take a new member, so the group starts again)."""
        self.restarts += 1
        group = [c for c in self.children if c.spec.kind == TRAINER_KIND] if self.plan.mode == "collective" else [failed]
        self.out.status(f"{_describe(failed)}: restarting {', '.join(c.spec.tag for c in group)} (restart "
                        f"{self.restarts} of --max_restarts {self.plan.max_restarts}, {RESTART_COUNT_ENV}="
                        f"{self.restarts})", error=True)
        self._retire(group)
        for child in group:
            self.children[self.children.index(child)] = self._spawn(child.spec)

    def supervise(self) -> int:
        """Wait for the job to end; the exit status of the launcher."""
        trainers_done_at: float | None = None
        while True:
            trainers = [c for c in self.children if c.spec.kind == TRAINER_KIND]
            if self.signals.received:
                name = signal.Signals(self.signals.received[0]).name
                self.out.status(f"got {name}: stopping the job", error=True)
                self.stop(self.running())
                return 128 + self.signals.received[0]
            for child in self.children:
                was_running = child.returncode is None
                rc = child.observe()
                if rc is None or not was_running:
                    continue
                self.out.status(f"{_describe(child)}")
                if rc != 0 and child.spec.kind == TRAINER_KIND and self.restarts < self.plan.max_restarts:
                    self._restart(child)
                    break  # the children changed: look at them afresh
                if rc != 0:
                    self._report_failure(child)
                    self.stop(self.running())
                    return EXIT_FAILED
            running = self.running()
            if not running:
                return EXIT_OK
            if trainers and all(t.returncode == 0 for t in trainers):
                now = time.monotonic()
                if trainers_done_at is None:
                    trainers_done_at = now
                    self.out.status(f"every trainer finished; waiting up to {self.plan.stop_timeout:g} s for "
                                    f"{len(running)} pserver(s) to exit")
                elif now - trainers_done_at >= self.plan.stop_timeout:
                    names = ", ".join(f"{c.spec.tag} (pid {c.pid})" for c in running)
                    self.out.status(f"{names} still running {self.plan.stop_timeout:g} s after every trainer "
                                    "finished (--stop_timeout): stopping it", error=True)
                    self.stop(running)
                    return EXIT_FAILED
            self.signals.wake.wait(POLL_S)
            self.signals.wake.clear()

    def running(self) -> list[_Child]:
        return [c for c in self.children if c.observe() is None]

    def _report_failure(self, child: _Child) -> None:
        # A stopped process (SIGSTOP/SIGTSTP) fails nobody by itself: the processes waiting for it time out
        # and exit first. Name the stopped one as the cause, before the one that merely noticed.
        stuck = [c for c in self.children if c is not child and c.observe() is None and _is_stopped(c.pid)]
        for c in stuck:
            self.stuck.add(c.spec.tag)
            self.out.status(f"{c.spec.tag} (pid {c.pid}) is stopped (SIGSTOP or SIGTSTP) and makes no progress: "
                            f"it is the process that hung the job; {child.spec.tag} failed waiting for it",
                            error=True)
        if child.reader is not None:
            child.reader.join(timeout=2.0)  # let its last lines arrive
        lines = [f"{child.spec.tag} (pid {child.pid}) failed with exit code {child.returncode}; stopping the job"]
        if child.tail:
            lines.append(f"last {len(child.tail)} line(s) of {child.spec.tag}:")
            lines += [f"  | {line}" for line in child.tail]
        else:
            lines.append(f"{child.spec.tag} printed nothing")
        for line in lines:
            self.out.status(line, error=True)
        eps = self.plan.trainer_endpoints
        if child.lost_ranks and child.spec.kind == TRAINER_KIND:
            self.out.status(f"{child.spec.tag} lost the collective group: JAX's distributed service says trainer(s) "
                            f"{child.lost_ranks} stopped sending heartbeats; lost endpoint(s): " +
                            ", ".join(eps[r] for r in child.lost_ranks if 0 <= r < len(eps)), error=True)
        if self.plan.remote_listeners:
            lost = probe_endpoints(self.plan.remote_listeners)
            if lost:
                self.out.status("lost endpoint(s) on other hosts: " + ", ".join(
                    f"{tag} at {ep} ({why})" for tag, ep, why in lost), error=True)

    def stop(self, children: Sequence[_Child]) -> None:
        """SIGTERM each still-running child's group, then SIGKILL after the grace period (at once on a
        second signal to the launcher)."""
        alive = [c for c in children if c.observe() is None]
        for child in alive:
            child.stopped = True
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        signals_before = len(self.signals.received)
        while alive and time.monotonic() < deadline and len(self.signals.received) == signals_before:
            time.sleep(POLL_S)
            alive = [c for c in alive if c.observe() is None]
        for child in alive:
            child.signal_group(signal.SIGKILL)

    def cleanup(self) -> None:
        """Stop anything left, kill stragglers of every group, reap every leader, drain the readers."""
        self.stop(self.running())
        for child in self.children:
            # The leader is dead but unreaped here, so its group id is still ours: sweep what it left.
            child.signal_group(signal.SIGKILL)
        for child in self.children:
            try:
                child.popen.wait(timeout=REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.out.status(f"{child.spec.tag} (pid {child.pid}) did not exit after SIGKILL", error=True)
            if child.returncode is None:
                child.returncode = child.popen.returncode
        deadline = time.monotonic() + READER_JOIN_S
        for child in self.children:
            if child.reader is not None:
                child.reader.join(timeout=max(0.0, deadline - time.monotonic()))
            if child.log is not None:
                child.log.close()

    def summary(self) -> str:
        return "summary: " + ", ".join(_describe(c) + (" (was stopped: the cause)" if c.spec.tag in self.stuck else "")
                                       for c in self.children)


def run_job(plan: JobPlan, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Start the planned processes, supervise them to the end and clean up; the launcher's exit status."""
    output = _Output(out or sys.stdout, err or sys.stderr)
    with _Signals() as signals:
        job = _Job(plan, output, signals)
        status = EXIT_FAILED
        try:
            job.start()
            status = job.supervise()
        except OSError as e:
            output.status(f"cannot start a process of the job: {e}; stopping the job", error=True)
            status = EXIT_FAILED
        finally:
            job.cleanup()
        output.status(job.summary())
    return status


def error_line(prog: str, exc: LaunchError) -> str:
    """The one line a usage error prints."""
    text = f"{prog}: error: {exc.message}"
    if exc.hint:
        text += f" (hint: {exc.hint})"
    return text


def launch(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the launcher on ``argv`` (``sys.argv[1:]`` by default); returns its exit status."""
    try:
        args = build_parser(prog).parse_args(list(argv) if argv is not None else None)
        if args.ray is not None:
            from runtime.ray_launch import check_args, run_ray_job

            check_args(args)
            return run_ray_job(args)
        plan = plan_job(args)
    except LaunchError as e:
        sys.stderr.write(error_line(prog, e) + "\n")
        return EXIT_USAGE
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else EXIT_OK
    return run_job(plan)


def main() -> None:
    """Entry point of ``python -m runtime.launch``."""
    sys.exit(launch())


if __name__ == "__main__":
    main()
