"""``flotilla launch --max_restarts N``: failed trainers are started again, with ``FLOTILLA_RESTART_COUNT``.

- Parameter-server mode, 2 pservers x 2 trainers, sync: trainer 1 SIGKILLs itself at the start of step 3;
  the launcher restarts it alone; it rejoins the pservers at their next step boundary (the job token the
  launcher gives every process lets the pservers trust the new incarnation) and resumes at the step it is
  admitted at: step 3, since it died owing its FETCH barrier of step 2 (the pservers count the next SEND
  barrier as it). Every batch is applied exactly once: the parameters equal single-process training on
  all of them (rtol 1e-9).
- Collective mode, 2 trainers: trainer 1 dies at step 2; the launcher stops the group and starts both
  trainers again (a group is formed once), which train from the start (this worker keeps no checkpoint; a
  real script resumes from its last one): the result equals an uninterrupted run.
- With the budget spent, the next failure ends the job as without restarts.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from tests.launching import launch
from tests.runtime.collective import worker as collective_worker
from tests.runtime.rpc.test_ps_training import local_reference, trained

pytestmark = pytest.mark.serial  # launched jobs whose processes are killed and restarted

REPO = pathlib.Path(__file__).resolve().parents[2]
PS_WORKER = str(REPO / "tests" / "runtime" / "rpc" / "ps_worker.py")
COLLECTIVE_WORKER = str(REPO / "tests" / "runtime" / "collective" / "worker.py")


def test_a_killed_ps_trainer_is_restarted_and_every_other_batch_applied_once(tmp_path: pathlib.Path) -> None:
    steps = 8
    out = launch(tmp_path / "logs", ["--server_num", "2", "--worker_num", "2", "--max_restarts", "1"], PS_WORKER,
                 "--out", str(tmp_path), "--steps", str(steps), "--die-at", "3", "--die-rank", "1", processes=4)
    assert "trainer.1 (pid" in out and "killed by SIGKILL: restarting trainer.1 (restart 1 of --max_restarts 1" in out
    assert "trainer 1 resumes at step 3" in out, out[-3000:]  # it died owing its FETCH barrier of step 2
    init, final = trained(tmp_path, "fc", 2, "_init"), trained(tmp_path, "fc", 2)
    expected = local_reference("fc", "sgd", "const", init, 2, range(steps))
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def test_a_collective_group_restarts_whole(tmp_path: pathlib.Path) -> None:
    out = launch(tmp_path / "logs", ["--nproc_per_node", "2", "--max_restarts", "1"], COLLECTIVE_WORKER,
                 "--out", str(tmp_path), "--configs", "momentum_fused", "--die-at-step", "2", "--die-rank", "1",
                 processes=2)
    assert "restarting trainer.0, trainer.1 (restart 1 of --max_restarts 1" in out, out[-3000:]
    ranks = [dict(np.load(tmp_path / f"momentum_fused.rank{r}.npz")) for r in (0, 1)]
    opt, _ = collective_worker.CONFIGS["momentum_fused"]
    for name, value in collective_worker.train_single(opt, seed=100).items():
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)
        np.testing.assert_allclose(ranks[0][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_spent_restart_budget_fails_the_job(tmp_path: pathlib.Path) -> None:
    job = str(REPO / "tests" / "runtime" / "launch_scripts" / "job.py")
    out = launch(tmp_path / "logs", ["--server_num", "1", "--worker_num", "2", "--max_restarts", "1"], job,
                 "--fail-trainer", "1", succeed=False)
    assert "restarting trainer.1 (restart 1 of --max_restarts 1" in out, out
    assert out.count("[trainer.1] trainer 1 fails now") == 2, out  # the first run and the restarted one
    assert "trainer.1 (pid" in out and "failed with exit code 1; stopping the job" in out, out
