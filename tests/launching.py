"""Process helpers for the tests: run ``python -m runtime.launch`` bounded in time (the launcher stopped
with SIGTERM, then SIGKILL, if it overruns; its exit status and summary line checked), and free ports."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from runtime.role import ROLE_ENV_VARS

REPO = pathlib.Path(__file__).resolve().parents[1]


def launch(log_dir: pathlib.Path, mode: list[str], script: str, *args: str, processes: int | None = None,
           succeed: bool = True, timeout: float = 180) -> str:
    """The launcher's output for ``script`` run under ``mode`` (e.g. ``["--nproc_per_node", "2"]``).

    With ``succeed`` it must exit 0 and (given ``processes``) its summary must show that many ``exit 0``;
    without, it must exit non-zero."""
    env = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS}
    cmd = [sys.executable, "-m", "runtime.launch", *mode, "--log_dir", str(log_dir), script, *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=10)
        pytest.fail(f"{script} did not finish within {timeout}s:\n{out[-3000:]}")
    if not succeed:
        assert proc.returncode != 0, f"{script} was expected to fail:\n{out[-3000:]}"
        return out
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{out[-4000:]}"
    if processes is not None:
        summary = [line for line in out.splitlines() if line.startswith("[launch] summary:")]
        assert len(summary) == 1 and summary[0].count("exit 0") == processes, out[-2000:]
    return out


