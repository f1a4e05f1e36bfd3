"""Roles of trainers started by ``mpirun``/``mpiexec`` (Open MPI, MPICH) or ``srun`` (Slurm) with no Flotilla
launcher: ``runtime.role.role_from_env`` reads the scheduler's rank and size when Paddle's variables are
absent, with the coordinator from ``FLOTILLA_COORDINATOR``, ``MASTER_ADDR``/``MASTER_PORT``, Slurm's first
node, or 127.0.0.1 for a job on one host.

The environment parsing is tested for each scheduler (Slurm only so: no Slurm here); ``mpiexec`` from the
``mpi`` extra (MPICH's wheel) runs a real two-rank collective job that must equal one process on the union of
the batches (skipped, with the reason, where no ``mpiexec`` is installed).
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from runtime.launch import free_ports
from runtime.role import ROLE_ENV_VARS, LaunchError, expand_hostlist, role_from_env
from tests.runtime.collective import worker as collective_worker

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[8-10],gpu-a[1-2]", ["node8", "node9", "node10", "gpu-a1", "gpu-a2"]),
    ("rack[1-2]-n[09-10]", ["rack1-n09", "rack1-n10", "rack2-n09", "rack2-n10"]),
    ("a,b[000-001],c", ["a", "b000", "b001", "c"]),
])
def test_slurm_hostlists_expand(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node[3-1]", "node[a]", "a,,b", "n[[1]]"])
def test_bad_hostlists_are_named(text: str) -> None:
    with pytest.raises(LaunchError, match="host list") as info:
        expand_hostlist(text)
    assert info.value.code == "E806"


def test_open_mpi_on_one_host() -> None:
    role = role_from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"})
    assert (role.trainer_id, role.trainers, role.is_collective) == (1, 3, True)
    assert role.trainer_endpoints == ("127.0.0.1:6170", "127.0.0.1:6171", "127.0.0.1:6172")
    assert role.current_endpoint == "127.0.0.1:6171"


def test_mpich_with_torchrun_style_coordinator() -> None:
    role = role_from_env({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": "29500"})
    assert role.trainer_endpoints == ("127.0.0.1:29500", "127.0.0.1:29501")


def test_mpi_spanning_hosts_needs_a_coordinator() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LaunchError, match="FLOTILLA_COORDINATOR=host:port"):
        role_from_env(env)
    role = role_from_env({**env, "FLOTILLA_COORDINATOR": "127.0.0.1:7000"})
    assert role.trainer_endpoints[0] == "127.0.0.1:7000" and role.current_endpoint == "127.0.0.1:7002"


def test_slurm_places_ranks_on_their_nodes() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "5", "SLURM_STEP_NODELIST": "gpu[07-08],cpu1",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}
    role = role_from_env(env)
    assert role.trainer_endpoints == ("gpu07:6170", "gpu07:6171", "gpu08:6172", "gpu08:6173", "cpu1:6174")
    assert role.trainer_id == 3 and role.current_endpoint == "gpu08:6173"
    with pytest.raises(LaunchError, match="does not place 5 task"):
        role_from_env({**env, "SLURM_STEP_TASKS_PER_NODE": "2,2,2"})


def test_paddle_variables_win_and_garbage_is_named() -> None:
    paddle = {"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "1", "OMPI_COMM_WORLD_RANK": "5",
              "OMPI_COMM_WORLD_SIZE": "8"}
    assert role_from_env(paddle).trainers == 1
    with pytest.raises(LaunchError, match="PMI_SIZE is not"):
        role_from_env({"PMI_RANK": "0"})
    with pytest.raises(LaunchError, match="SLURM_PROCID=4 is out of range for SLURM_NTASKS=4"):
        role_from_env({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"})


@pytest.mark.serial  # a collective job under mpiexec
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec installed (pip install 'flotilla[mpi]')")
def test_mpiexec_starts_a_collective_job_equal_to_one_process(tmp_path: pathlib.Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS and not k.startswith(("OMPI_", "PMI_"))}
    env.update(PYTHONPATH=str(REPO), FLOTILLA_COORDINATOR=f"127.0.0.1:{free_ports(1)[0]}",
               FLAGS_collective_timeout_s="30")
    cmd = ["mpiexec", "-n", "2", sys.executable, str(REPO / "tests" / "runtime" / "collective" / "worker.py"),
           "--out", str(tmp_path), "--configs", "momentum_fused"]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [dict(np.load(tmp_path / f"momentum_fused.rank{r}.npz")) for r in (0, 1)]
    opt, _ = collective_worker.CONFIGS["momentum_fused"]
    for name, value in collective_worker.train_single(opt, seed=100).items():
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)
        np.testing.assert_allclose(ranks[0][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
