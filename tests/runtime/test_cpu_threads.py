"""XLA CPU threads of a job's processes on one host (``runtime.cpu_threads``): the rule, the flag, how
collective trainers (``runtime.collective.threads_per_trainer``) and the launcher apply it, and that the
XLA of this JAX honours ``PJRT_NPROC`` set in the process before its CPU client exists."""
from __future__ import annotations

import subprocess
import sys

import pytest

from runtime.collective import threads_per_trainer
from runtime.cpu_threads import THREADS_ENV, CPUThreadsError, xla_threads

LOCAL4 = [f"127.0.0.1:{6170 + i}" for i in range(4)]


def test_auto_splits_the_cpus_over_the_trainers_of_this_host() -> None:
    assert threads_per_trainer(0, LOCAL4[:2], cpus=2, environ={}) == 1
    assert threads_per_trainer(3, LOCAL4, cpus=16, environ={}) == 4
    assert threads_per_trainer(1, LOCAL4[:3], cpus=2, environ={}) == 1  # never below 1
    assert threads_per_trainer(0, LOCAL4[:1], cpus=6, environ={THREADS_ENV: "auto"}) == 6


def test_auto_counts_only_the_trainers_whose_endpoint_has_this_host() -> None:
    eps = ["10.0.0.1:6170", "10.0.0.1:6171", "10.0.0.2:6170", "10.0.0.2:6171", "10.0.0.2:6172"]
    assert threads_per_trainer(0, eps, cpus=8, environ={}) == 4
    assert threads_per_trainer(4, eps, cpus=8, environ={}) == 2


def test_a_number_is_taken_as_is_and_0_or_a_users_nproc_leaves_xla_alone() -> None:
    assert threads_per_trainer(0, LOCAL4, cpus=2, environ={THREADS_ENV: "3"}) == 3
    assert threads_per_trainer(0, LOCAL4, cpus=2, environ={THREADS_ENV: "0"}) is None
    assert threads_per_trainer(0, LOCAL4, cpus=2, environ={"PJRT_NPROC": "2"}) is None
    assert threads_per_trainer(0, LOCAL4, cpus=2, environ={"NPROC": "2", THREADS_ENV: "1"}) is None


@pytest.mark.parametrize("raw", ["two", "-1", "1.5"])
def test_a_bad_flag_value_is_an_error_naming_it(raw: str) -> None:
    with pytest.raises(CPUThreadsError) as e:
        threads_per_trainer(0, LOCAL4, cpus=2, environ={THREADS_ENV: raw})
    assert e.value.code == "E653" and THREADS_ENV in str(e.value) and repr(raw) in str(e.value)


def _threads_with_pjrt_nproc(n: int) -> int:
    code = ("import os\n"
            f"os.environ['PJRT_NPROC'] = '{n}'  # set in the process, as join_group does, before the client\n"
            "import jax, jax.numpy as jnp\n"
            "x = jnp.ones((256, 256)); (x @ x).block_until_ready()\n"
            "print(len(os.listdir('/proc/self/task')))\n")
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_xla_sizes_its_cpu_thread_pools_by_pjrt_nproc_set_in_process() -> None:
    # If a JAX upgrade stops reading PJRT_NPROC, the per-trainer default silently stops applying: fail here.
    assert _threads_with_pjrt_nproc(5) - _threads_with_pjrt_nproc(1) >= 4


def test_joining_sets_pjrt_nproc_to_the_share_unless_the_user_set_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime import collective

    for name in ("PJRT_NPROC", "NPROC", THREADS_ENV, "JAX_PLATFORMS"):
        monkeypatch.setenv(name, "")  # recorded, so what the join sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(collective.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(collective, "_has_gpu_platform", lambda: False)
    collective._limit_cpu_threads(1, LOCAL4[:2])
    assert collective.os.environ["PJRT_NPROC"] == "2"
    monkeypatch.setenv("PJRT_NPROC", "3")
    collective._limit_cpu_threads(1, LOCAL4[:2])
    assert collective.os.environ["PJRT_NPROC"] == "3"


def test_the_launcher_splits_the_cpus_over_every_process_it_starts_here(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime import launch
    from runtime.role import LaunchError

    script = __file__
    monkeypatch.setattr(launch, "available_cpus", lambda: 8)

    def plan(*argv: str, **environ: str) -> list[str | None]:
        job = launch.plan_job(launch.build_parser().parse_args([*argv, script]), environ)
        return [p.env.get("PJRT_NPROC") for p in job.processes]

    assert plan("--server_num", "1", "--worker_num", "2") == ["2", "2", "2"]  # 8 CPUs / 3 processes
    assert plan("--nproc_per_node", "4") == ["2"] * 4
    assert plan("--server_num", "1", "--worker_num", "1", **{THREADS_ENV: "3"}) == ["3", "3"]
    assert plan("--server_num", "1", "--worker_num", "1", **{THREADS_ENV: "0"}) == [None, None]
    assert plan("--nproc_per_node", "2", PJRT_NPROC="5") == [None, None]  # the user's, passed on by the child's env
    with pytest.raises(LaunchError, match=THREADS_ENV):
        plan("--nproc_per_node", "2", **{THREADS_ENV: "many"})
    assert xla_threads(3, 2, {}) == 1  # never below 1
