"""A Fluid script's trainer, as real processes (issue 21): it says which pservers it is still waiting for
instead of staying silent until its deadline, and a script that never calls ``exe.close()`` still ends
its job cleanly (Complete is sent at interpreter exit).

Each test starts ``fluid_no_close.py`` (a Fluid 1.5 script, only its import rewritten) under
``subprocess.run`` with a timeout, on free 127.0.0.1 ports.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from runtime.launch import free_ports

pytestmark = pytest.mark.serial(waits=True)  # a trainer process timed against its 3.5 s deadline

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = str(pathlib.Path(__file__).resolve().parent / "fluid_no_close.py")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "TRAINING_ROLE", "FLAGS_"))}
    env.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", **extra)
    return env


def test_trainer_reports_the_pservers_it_waits_for() -> None:
    """Nothing listens on the pserver's port: the trainer prints a line a second (FLAGS_rpc_wait_report_ms)
    naming the endpoint and the seconds left, then fails at the deadline naming it."""
    (port,) = free_ports(1)
    endpoint = f"127.0.0.1:{port}"
    env = _env(TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID="0", PADDLE_TRAINERS_NUM="1",
               PADDLE_PSERVERS_IP_PORT_LIST=endpoint, FLAGS_rpc_deadline="3500", FLAGS_rpc_wait_report_ms="1000")
    done = subprocess.run([sys.executable, SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    waits = [line for line in done.stderr.splitlines() if "waiting for pserver(s)" in line]
    assert len(waits) >= 2, done.stderr
    pattern = re.compile(rf"trainer 0: waiting for pserver\(s\) {re.escape(endpoint)} to accept connections; "
                         r"(\d+)s left of the 3.5s deadline \(FLAGS_rpc_deadline\)")
    lefts = [int(pattern.fullmatch(line).group(1)) for line in waits]  # type: ignore[union-attr]
    assert lefts == sorted(lefts, reverse=True) and lefts[0] <= 3
    assert f"pserver(s) ['{endpoint}'] did not come up within 3.5s" in done.stderr


def test_script_without_exe_close_finishes_cleanly() -> None:
    """Two pservers and two trainers under the launcher; the trainers exit without ``exe.close()``. Complete
    goes out at interpreter exit (and says so), the pservers exit by themselves, the launcher exits 0."""
    ports = free_ports(2)
    servers = ",".join(f"127.0.0.1:{p}" for p in ports)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "runtime.launch", "--servers", servers, "--worker_num", "2",
                           SCRIPT], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=150)
    took = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "trainer 0 done" in out and "trainer 1 done" in out
    assert "stopped by the launcher" not in out, out  # the pservers exited on their own
    assert out.count("sent Complete at interpreter exit") == 2, out
    assert took < 50, (took, out)  # the launcher's stop timeout (60 s) was never reached


def test_failed_script_sends_no_complete_at_exit() -> None:
    """A trainer that dies of an exception must not look finished: no Complete at exit, so the pservers
    keep waiting for it and the launcher stops the job as failed."""
    ports = free_ports(1)
    done = subprocess.run([sys.executable, "-m", "runtime.launch", "--servers", f"127.0.0.1:{ports[0]}",
                           "--worker_num", "1", SCRIPT, "--fail"], cwd=REPO_ROOT, env=_env(), capture_output=True,
                          text=True, timeout=150)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "trainer 0 fails after training" in out
    assert "the script failed, so its Executor sends no Complete at interpreter exit" in out, out
    assert "every trainer completed" not in out, out
