"""Run a Flotilla job on a Ray cluster: ``flotilla launch --ray ADDRESS ...`` (``pip install 'flotilla[ray]'``).

Each pserver and trainer is a Ray actor holding its resources (``--cpus_per_pserver``,
``--cpus_per_trainer``, ``--gpus_per_trainer``) in one placement group whose bundles Ray spreads over the
nodes (``SPREAD``: pservers first, so they land on distinct nodes when there are enough). Each actor reports
its node's address and a free port there; the launcher builds every process's role variables from those
endpoints exactly as the local launcher does (``runtime.launch.pserver_env``/``trainer_env``) plus one fresh
job token, and each actor runs the training script in a child process of its own (a fresh interpreter per
role, as ``jax.distributed`` needs) with its node's environment and those variables. Output comes back to
the launcher tagged ``[pserver.0] `` / ``[trainer.1] ``; the job ends as a local one does: 0 when every
trainer exited 0 and the pservers then exited by themselves (``--stop_timeout``), 1 as soon as any process
fails (named, with its last lines; every other process is stopped) or an actor dies with its node.

Modes: ``--server_num N --worker_num M`` (parameter servers) or ``--nproc_per_node N`` (collective: N
trainers in all, anywhere in the cluster). Endpoints come from Ray, so ``--servers``/``--workers``/
``--trainers``/``--ips`` are refused with ``--ray``. The script must exist at the same path on every node
(a shared file system, or an image that holds it); the children start in the launcher's working directory.

Invariants: ``ray`` is imported only here and only when ``--ray`` is given; every wait is bounded (placement
by ``--ray_timeout``, stopping by the local launcher's grace periods); the placement group, the actors and
their children are removed however the job ends.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from runtime.launch_common import (EXIT_FAILED, EXIT_OK, POLL_S, PSERVER_KIND, TAIL_LINES, TERM_GRACE_S, TRAINER_KIND,
                            _Output, child_environ, die_with_parent, new_job_token, pserver_env, trainer_env)
from runtime.flags import TOKEN_ENV as JOB_TOKEN_ENV
from runtime.role import LaunchError, format_endpoint

RAY_HINT = "pip install 'flotilla[ray]'"


def _usage(message: str, hint: str | None = None) -> LaunchError:
    return LaunchError(message, hint=hint, code="E810")


def check_args(args: argparse.Namespace) -> tuple[int, int]:
    """(pservers, trainers) of a ``--ray`` job; refuses what Ray decides instead of the user."""
    fixed = [f for f, v in (("--servers", args.servers), ("--workers", args.workers), ("--trainers", args.trainers),
                            ("--ips", args.ips), ("--node_ip", args.node_ip), ("--started_port", args.started_port),
                            ("--max_restarts", args.max_restarts or None))
             if v is not None]
    if fixed:
        raise _usage(f"{', '.join(fixed)} cannot be combined with --ray: Ray places the processes and their "
                     "endpoints", hint="give counts: --server_num N --worker_num M, or --nproc_per_node N")
    for flag, value in (("--cpus_per_trainer", args.cpus_per_trainer), ("--cpus_per_pserver", args.cpus_per_pserver),
                        ("--gpus_per_trainer", args.gpus_per_trainer)):
        if not value >= 0:
            raise _usage(f"{flag} is {value}: expected a number of CPUs/GPUs, 0 or more")
    if not os.path.isfile(args.training_script):
        raise LaunchError(f"training script {args.training_script!r} does not exist", code="E812")
    if args.nproc_per_node is not None:
        if args.server_num is not None or args.worker_num is not None:
            raise _usage("--nproc_per_node (collective mode) cannot be combined with --server_num/--worker_num")
        if args.nproc_per_node < 1:
            raise _usage(f"--nproc_per_node is {args.nproc_per_node}: expected at least 1")
        return 0, args.nproc_per_node
    if args.server_num is None or args.worker_num is None or args.server_num < 1 or args.worker_num < 1:
        raise _usage("a --ray job needs --server_num N --worker_num M (N, M >= 1), or --nproc_per_node N")
    return args.server_num, args.worker_num


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise LaunchError("--ray needs Ray, which is not installed", hint=RAY_HINT, code="E810") from None
    return ray


class RoleProcess:
    """The body of a Ray actor: one role's child process on the actor's node, its output kept for polling."""

    def __init__(self) -> None:
        self.popen: subprocess.Popen[bytes] | None = None
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.reader: threading.Thread | None = None

    def endpoint(self) -> str:
        """This node's address and a port free on it now."""
        import socket

        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return format_endpoint(host, sock.getsockname()[1])

    def start(self, command: Sequence[str], role_env: dict[str, str], token: str, cwd: str) -> int:
        env = child_environ(os.environ, role_env)
        env[JOB_TOKEN_ENV] = token  # the job's own, whatever the node's environment holds
        self.popen = subprocess.Popen([sys.executable, *command], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=die_with_parent())  # dies with the actor, even ray.kill'ed
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()
        return self.popen.pid

    def _pump(self) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        for raw in iter(self.popen.stdout.readline, b""):
            with self.lock:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def poll(self) -> tuple[list[str], int | None]:
        """New output lines and the exit status (None while running; lines drained first)."""
        assert self.popen is not None
        code = self.popen.poll()
        if code is not None and self.reader is not None:
            self.reader.join(timeout=2.0)
        with self.lock:
            lines, self.lines = self.lines, []
        return lines, code

    def stop(self) -> int | None:
        """SIGTERM the child's group, SIGKILL after the grace period; its exit status."""
        if self.popen is None or self.popen.poll() is not None:
            return None if self.popen is None else self.popen.returncode
        for signum, wait in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, TERM_GRACE_S)):
            try:
                os.killpg(self.popen.pid, signum)
            except ProcessLookupError:
                break
            try:
                return self.popen.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return self.popen.poll()


class _Member:
    def __init__(self, tag: str, kind: str, actor: Any) -> None:
        self.tag, self.kind, self.actor = tag, kind, actor
        self.code: int | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)


def run_ray_job(args: argparse.Namespace, out: Any = None, err: Any = None) -> int:
    """Run the job the arguments describe on the Ray cluster at ``args.ray``; the launcher's exit status."""
    servers, trainers = check_args(args)
    ray = _import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    output = _Output(out or sys.stdout, err or sys.stderr)
    ray.init(address=args.ray, log_to_driver=False, logging_level="WARNING")
    kinds = [PSERVER_KIND] * servers + [TRAINER_KIND] * trainers
    bundles = [{"CPU": float(args.cpus_per_pserver)} if k == PSERVER_KIND else
               {"CPU": float(args.cpus_per_trainer), **({"GPU": float(args.gpus_per_trainer)}
                                                        if args.gpus_per_trainer else {})} for k in kinds]
    bundles = [{k: v for k, v in b.items() if v > 0} or {"CPU": 0.001} for b in bundles]
    group = placement_group(bundles, strategy="SPREAD")
    members: list[_Member] = []
    status = EXIT_FAILED
    try:
        ready, _ = ray.wait([group.ready()], timeout=args.ray_timeout)
        if not ready:
            output.status(f"Ray could not place the job's {len(bundles)} processes ({bundles[0]} a pserver, "
                          f"{bundles[-1]} a trainer) within --ray_timeout {args.ray_timeout:g} s: the cluster "
                          f"has {ray.cluster_resources()}", error=True)
            return EXIT_FAILED
        actor_class = ray.remote(RoleProcess)
        counters = {PSERVER_KIND: 0, TRAINER_KIND: 0}
        for i, (kind, bundle) in enumerate(zip(kinds, bundles)):
            tag = f"{kind}.{counters[kind]}"
            counters[kind] += 1
            actor = actor_class.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                     placement_group_bundle_index=i)).remote()
            members.append(_Member(tag, kind, actor))
        endpoints = ray.get([m.actor.endpoint.remote() for m in members], timeout=args.ray_timeout)
        server_eps, worker_eps = endpoints[:servers], endpoints[servers:]
        token = new_job_token()
        command = [os.path.abspath(args.training_script), *args.training_script_args]
        starts = []
        for m, endpoint in zip(members, endpoints):
            index = int(m.tag.split(".")[1])
            env = (pserver_env(server_eps, worker_eps, index) if m.kind == PSERVER_KIND
                   else trainer_env(server_eps, worker_eps, index))
            starts.append(m.actor.start.remote(command, env, token, os.getcwd()))
        for m, endpoint, pid in zip(members, endpoints, ray.get(starts, timeout=args.ray_timeout)):
            output.status(f"started {m.tag} (pid {pid}) at {endpoint} on Ray")
        status = _supervise(ray, members, output, args.stop_timeout)
    except ray.exceptions.RayActorError as e:
        output.status(f"a Ray actor of the job died (its node lost?): {str(e).splitlines()[0]}; stopping the job",
                      error=True)
        status = EXIT_FAILED
    finally:
        _cleanup(ray, members)
        remove_placement_group(group)
        ray.shutdown()
        output.status("summary: " + ", ".join(f"{m.tag} {_describe(m.code)}" for m in members))
    return status


def _describe(code: int | None) -> str:
    if code is None:
        return "stopped"
    return f"exit {code}" if code >= 0 else f"killed by signal {-code}"


def _supervise(ray: Any, members: list[_Member], output: _Output, stop_timeout: float) -> int:
    trainers_done_at: float | None = None
    while True:
        polls = ray.get([m.actor.poll.remote() for m in members if m.code is None], timeout=60)
        for m, (lines, code) in zip([m for m in members if m.code is None], polls):
            for line in lines:
                m.tail.append(line)
                output.write(f"[{m.tag}] {line}\n")
            if code is None:
                continue
            m.code = code
            output.status(f"{m.tag} {_describe(code)}")
            if code != 0:
                output.status(f"{m.tag} failed with exit code {code}; stopping the job", error=True)
                output.status(f"last {len(m.tail)} line(s) of {m.tag}:", error=True)
                for line in m.tail:
                    output.status(f"  | {line}", error=True)
                return EXIT_FAILED
        running = [m for m in members if m.code is None]
        if not running:
            return EXIT_OK
        if all(m.code == 0 for m in members if m.kind == TRAINER_KIND):
            now = time.monotonic()
            if trainers_done_at is None:
                trainers_done_at = now
            elif now - trainers_done_at >= stop_timeout:
                output.status(f"{', '.join(m.tag for m in running)} still running {stop_timeout:g} s after every "
                              "trainer finished (--stop_timeout): stopping it", error=True)
                return EXIT_FAILED
        time.sleep(POLL_S * 2)


def _cleanup(ray: Any, members: list[_Member]) -> None:
    stops = [m.actor.stop.remote() for m in members]
    try:
        ray.get(stops, timeout=3 * TERM_GRACE_S)
    except Exception:  # noqa: BLE001 - an actor already gone (its node died): nothing of it is left to stop
        pass
    for m in members:
        ray.kill(m.actor, no_restart=True)
