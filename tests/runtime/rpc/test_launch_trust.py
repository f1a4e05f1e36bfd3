"""``python -m runtime.launch`` running a real 1-pserver x 2-trainer job (``tests.runtime.rpc.ps_worker``):
the launcher hands every process one random job token (the pservers then require it), keeps a token
set by hand, and when a trainer is SIGSTOPped it names that trainer as the cause, not the healthy
processes that timed out waiting for it. Every process is started by the launcher this test starts;
every wait is bounded; the launcher is killed by pid if it outlives its wait.
"""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from runtime.launch import child_environ

pytestmark = pytest.mark.serial(waits=True)  # launched jobs, one stopped against a 3 s pserver timeout

REPO = pathlib.Path(__file__).resolve().parents[3]
WORKER = REPO / "tests" / "runtime" / "rpc" / "ps_worker.py"
WAIT_S = 120.0


class Launched:
    """A launcher process and its output lines, collected by a reader thread."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.launch", *args], cwd=REPO, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO), **env},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = WAIT_S) -> re.Match[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        pytest.fail(f"{pattern!r} did not appear; output:\n{self.text}")

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            pytest.fail(f"the launcher did not finish within {timeout}s; output:\n{self.text}")
        self.reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the launcher stops its own children on SIGTERM
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _job(out: pathlib.Path, *script_args: str) -> list[str]:
    return ["--server_num", "1", "--worker_num", "2", str(WORKER), "--out", str(out), *script_args]


def test_child_environ_passes_the_job_token_and_keeps_a_hand_set_one() -> None:
    role = {"TRAINING_ROLE": "TRAINER"}
    assert child_environ({"PATH": "/bin"}, role, "t0k")["FLOTILLA_JOB_TOKEN"] == "t0k"
    assert child_environ({"FLOTILLA_JOB_TOKEN": "by-hand"}, role, "t0k")["FLOTILLA_JOB_TOKEN"] == "by-hand"
    assert "FLOTILLA_JOB_TOKEN" not in child_environ({"PATH": "/bin"}, role)


def test_launched_job_authenticates_with_its_token(tmp_path: pathlib.Path) -> None:
    job = Launched(_job(tmp_path, "--steps", "3"), {})
    try:
        assert job.wait() == 0, job.text
    finally:
        job.kill()
    assert re.search(r"\[pserver\.0\] pserver 0 serving \S+ \(sync, 2 trainers, token\)", job.text), job.text
    assert (tmp_path / "trainer_1.npz").exists()
    assert not re.search(r"[0-9a-f]{64}", job.text)  # the token is never printed


def test_sigstopped_trainer_is_named_as_the_cause(tmp_path: pathlib.Path) -> None:
    job = Launched(_job(tmp_path, "--steps", "400", "--sleep", "0.05"), {"FLAGS_pserver_timeout_ms": "3000"})
    stopped_pid = None
    try:
        pid = int(job.wait_for(r"\[launch\] started trainer\.1 \(pid (\d+)\)").group(1))
        job.wait_for(r"\[trainer\.1\] trainer 1 step 2")
        os.kill(pid, signal.SIGSTOP)
        stopped_pid = pid
        start = time.monotonic()
        assert job.wait(timeout=60) == 1, job.text
        assert time.monotonic() - start < 45
    finally:
        job.kill()
        if stopped_pid is not None:
            try:
                os.kill(stopped_pid, signal.SIGCONT)  # the launcher killed it; this is for a failed test
            except ProcessLookupError:
                pass
    assert f"[launch] trainer.1 (pid {pid}) is stopped (SIGSTOP or SIGTSTP) and makes no progress: it is the " \
           "process that hung the job" in job.text, job.text
    summary = [line for line in job.lines if line.startswith("[launch] summary: ")]
    assert len(summary) == 1 and f"trainer.1 (pid {pid})" in summary[0] and "(was stopped: the cause)" in summary[0]
    assert summary[0].count("(was stopped: the cause)") == 1
