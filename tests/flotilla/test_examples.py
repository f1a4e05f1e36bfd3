"""The ported Fluid scripts and the Fleet example run distributed under the launcher, every process
exiting 0: ``examples/fluid_port`` on 2 pservers x 2 trainers, ``examples/fleet_ctr`` on 2 pservers x 2 workers
and on 2 collective workers, and ``examples/fleet_ctr`` alone (in-process); and a trainer that runs the
untranspiled program fails at once (``scripts/untranspiled_trainer.py``).

Bars (2 cores, generated data, a few seconds of training), with the figures measured when set:
- fluid_port: each trainer's held-out loss falls by over 3x (0.179 -> 0.032 measured), and both trainers
  report the same figures (sync training: the same parameters at the end).
- fleet_ctr: test AUC > 0.78 alone, with pservers and collective (0.84 measured each), both workers agree;
  worker 0's inference model loads and reproduces its test predictions.

Every launch is bounded; on expiry the launcher gets SIGTERM (it stops what it started), then SIGKILL.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from examples.fleet_ctr import train as fleet_ctr
from flotilla import fluid
from runtime.role import ROLE_ENV_VARS
from tests import launching

pytestmark = pytest.mark.serial  # launched jobs

REPO = pathlib.Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 180


def launch(log_dir: pathlib.Path, mode: list[str], script: str, *args: str, processes: int) -> str:
    return launching.launch(log_dir, mode, script, *args, processes=processes, timeout=LAUNCH_TIMEOUT_S)


def per_trainer(out: str, pattern: str) -> dict[int, tuple[str, ...]]:
    found = {}
    for m in re.finditer(r"^\[trainer\.(\d)\] (?:trainer|worker) (\d): " + pattern, out, re.MULTILINE):
        assert m.group(1) == m.group(2), m.group(0)
        found[int(m.group(1))] = m.groups()[2:]
    return found


def test_fluid_port_runs_under_the_launcher(tmp_path: pathlib.Path) -> None:
    out = launch(tmp_path, ["--server_num", "2", "--worker_num", "2"], "examples/fluid_port/train.py", processes=4)
    losses = per_trainer(out, r"test loss (\d+\.\d+) -> (\d+\.\d+)")
    assert sorted(losses) == [0, 1] and losses[0] == losses[1], out[-2000:]
    before, after = (float(v) for v in losses[0])
    assert after < before / 3


def test_trainer_running_the_untranspiled_program_fails_at_once(tmp_path: pathlib.Path) -> None:
    """Issue 12's silent failure: the trainer stops at its first run naming the program to run instead, and
    the launcher stops the job (no pserver waits for a trainer that trains alone)."""
    env = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS}
    cmd = [sys.executable, "-m", "runtime.launch", "--server_num", "1", "--worker_num", "1", "--log_dir",
           str(tmp_path), "tests/flotilla/scripts/untranspiled_trainer.py"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 1, done.stdout[-3000:]
    assert ("UntranspiledProgramError: [E685] this distributed trainer was asked to run the program handed to "
            "DistributeTranspiler.transpile; run the result of DistributeTranspiler.get_trainer_startup_program() "
            "instead") in done.stdout, done.stdout[-3000:]
    assert "trainer.0 (pid" in done.stdout and "exit 1" in done.stdout


def check_ctr(out: str) -> float:
    steps = per_trainer(out, r"trained (\d+) steps")
    aucs = per_trainer(out, r"test AUC (\d\.\d+)")
    assert steps == {0: ("64",), 1: ("64",)} and sorted(aucs) == [0, 1], out[-2000:]
    assert aucs[0] == aucs[1], out[-2000:]
    return float(aucs[0][0])


def test_fleet_ctr_with_parameter_servers(tmp_path: pathlib.Path) -> None:
    model_dir = tmp_path / "model"
    out = launch(tmp_path / "logs", ["--server_num", "2", "--worker_num", "2"], "examples/fleet_ctr/train.py",
                 "--model-dir", str(model_dir), processes=4)
    assert check_ctr(out) > 0.78
    # Worker 0's inference model: forward only, and it scores the test set as the worker did.
    exe = fluid.Executor(fluid.CPUPlace())
    with fluid.scope_guard(fluid.Scope()):
        program, feeds, fetches = fluid.io.load_inference_model(str(model_dir), exe)
        assert feeds == [f"slot_{i}" for i in range(fleet_ctr.SLOTS)] + ["dense"]
        test = fleet_ctr.generate(1024, seed=2)
        feeder = fluid.DataFeeder(feed_list=feeds, place=fluid.CPUPlace(), program=program)
        (probs,) = exe.run(program, feed=feeder.feed([s[:-1] for s in test]), fetch_list=fetches)
    labels = np.array([s[-1][0] for s in test])
    assert abs(fleet_ctr.auc(probs[:, 1], labels) - check_ctr(out)) < 2e-3


def test_fleet_ctr_collective(tmp_path: pathlib.Path) -> None:
    out = launch(tmp_path, ["--nproc_per_node", "2"], "examples/fleet_ctr/train.py", "--collective", processes=2)
    assert check_ctr(out) > 0.78


def test_fleet_ctr_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ROLE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    with fluid.program_guard(fluid.Program(), fluid.Program()), fluid.unique_name.guard(), \
            fluid.scope_guard(fluid.Scope()):
        result = fleet_ctr.main([])
    assert result["steps"] == 128 and result["test_auc"] > 0.78
