"""The examples run in collective (nccl2) mode: ``python -m runtime.launch --nproc_per_node 2`` starts two
trainers that form a group over 127.0.0.1 (gloo) and average their gradients every step; both must end
with the same test accuracy (their parameters are equal), and a trainer that fails stops the job."""
from __future__ import annotations

import pathlib
import re

import pytest

from tests import launching

pytestmark = pytest.mark.serial  # launched collective jobs

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def launch_collective(log_dir: pathlib.Path, script: str, *args: str, expect: int = 0) -> str:
    return launching.launch(log_dir, ["--nproc_per_node", "2"], script, *args, processes=2 if expect == 0 else None,
                            succeed=expect == 0, timeout=TIMEOUT_S)


def accuracies(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"\[trainer\.(\d)\] .*test accuracy: ([0-9.]+)", out)}


@pytest.mark.slow
def test_mlp_collective_trainers_agree(tmp_path: pathlib.Path) -> None:
    out = launch_collective(tmp_path / "logs", "examples/mlp/train.py", "--train-size", "4096", "--epochs", "1",
                            "--log-every", "8")
    acc = accuracies(out)
    assert set(acc) == {0, 1} and acc[0] == acc[1], out[-2000:]  # equal parameters, equal accuracy
    assert float(acc[0]) > 0.6
    assert (tmp_path / "logs" / "workerlog.1").exists()


@pytest.mark.slow
def test_transformer_collective(tmp_path: pathlib.Path) -> None:
    # The tiny model of tests/examples/test_collective_models.py: one encoder layer composes like two, and
    # compiling half the program is most of a run this short.
    out = launch_collective(tmp_path / "logs", "examples/transformer/train.py", "--steps", "6", "--log-every", "3",
                            "--layers", "1", "--d-model", "32", "--d-ff", "64", "--test-size", "64")
    acc = accuracies(out)
    assert set(acc) == {0, 1} and acc[0] == acc[1], out[-2000:]  # equal parameters, equal accuracy


@pytest.mark.slow
def test_a_trainer_killed_mid_run_fails_the_job(tmp_path: pathlib.Path) -> None:
    out = launch_collective(tmp_path / "logs", "tests/runtime/collective/worker.py", "--out", str(tmp_path),
                            "--configs", "sgd_allreduce", "--die-at-step", "2", "--die-rank", "1", expect=1)
    assert "trainer.1" in out and "exit 3" in out, out[-3000:]
