"""What every Flotilla launcher shares (the local one, ``runtime.launch``, and the Ray one,
``runtime.ray_launch``): each process's role variables and environment, the job token, the tagged output,
and the timing constants. Standard library only."""
from __future__ import annotations

import ctypes
import os
import secrets
import signal
import sys
import threading
from typing import IO, Callable, Mapping, Sequence

from runtime.flags import TOKEN_ENV as JOB_TOKEN_ENV
from runtime.role import ROLE_ENV_VARS, parse_endpoint

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

POLL_S = 0.05  # how often a launcher looks at its processes
TERM_GRACE_S = 5.0  # SIGTERM → SIGKILL
TAIL_LINES = 20  # lines of a failed process's output shown in the failure report

PSERVER_KIND = "pserver"
TRAINER_KIND = "trainer"


def _common_env(server_eps: Sequence[str], worker_eps: Sequence[str]) -> dict[str, str]:
    env = {"PADDLE_TRAINERS_NUM": str(len(worker_eps)), "PADDLE_TRAINER_ENDPOINTS": ",".join(worker_eps)}
    if server_eps:
        env["PADDLE_PSERVERS_IP_PORT_LIST"] = ",".join(server_eps)
    return env


def _own_endpoint_env(endpoint: str) -> dict[str, str]:
    host, port = parse_endpoint(endpoint, "endpoint")
    return {"PADDLE_CURRENT_ENDPOINT": endpoint, "POD_IP": host, "PADDLE_PORT": str(port)}


def pserver_env(server_eps: Sequence[str], worker_eps: Sequence[str], index: int) -> dict[str, str]:
    """The role variables of pserver ``index``."""
    return {"TRAINING_ROLE": "PSERVER", **_common_env(server_eps, worker_eps), **_own_endpoint_env(server_eps[index])}


def trainer_env(server_eps: Sequence[str], worker_eps: Sequence[str], index: int) -> dict[str, str]:
    """The role variables of trainer ``index`` (collective mode when ``server_eps`` is empty)."""
    return {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(index), **_common_env(server_eps, worker_eps),
            **_own_endpoint_env(worker_eps[index])}


def new_job_token() -> str:
    """A fresh random job token (256 bits, hex)."""
    return secrets.token_hex(32)


def child_environ(base: Mapping[str, str], role_env: dict[str, str], token: str | None = None) -> dict[str, str]:
    """A child's whole environment: ``base`` without any inherited role variable, plus ``role_env``, plus
    the job token ``FLOTILLA_JOB_TOKEN`` (``token``, unless ``base`` already has one: a job spanning
    machines sets the same token by hand everywhere)."""
    env = {k: v for k, v in base.items() if k not in ROLE_ENV_VARS}
    env.update(role_env)
    env["PYTHONUNBUFFERED"] = "1"
    if token is not None and not base.get(JOB_TOKEN_ENV):
        env[JOB_TOKEN_ENV] = token
    return env


class _Output:
    """The launcher's stdout/stderr, shared by the reader threads under one lock; a closed pipe stops the
    echo (the log files keep being written)."""

    def __init__(self, out: IO[str], err: IO[str]) -> None:
        self._out, self._err = out, err
        self._lock = threading.Lock()
        self._broken = False

    def write(self, text: str, *, error: bool = False) -> None:
        with self._lock:
            if self._broken:
                return
            stream = self._err if error else self._out
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: stop echoing
                self._broken = True

    def status(self, line: str, *, error: bool = False) -> None:
        self.write(f"[launch] {line}\n", error=error)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when the process starting it dies (Linux
    ``PR_SET_PDEATHSIG``; None elsewhere). The death signal follows the thread that forks: start children
    from a thread that lives as long as the launcher (its main thread). libc is resolved here, before the
    fork, so the child only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody will signal this child
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec
