"""``flotilla launch --ray``: every pserver and trainer a Ray actor of a real two-node Ray cluster.

The cluster runs across two namespaced hosts of ``tests/netns.py`` (``ray start --block`` in each: the head on
10.213.7.1, a second node on 10.213.7.2), so its traffic stays inside namespaces the test made; the launcher
runs on the head's host. One cluster serves the module (about 7 s to start), and is killed with its
namespaces at the end. Skipped, with the reason, where Ray is not installed (``pip install 'flotilla[ray]'``)
or namespaces cannot be made.

- PS mode: Ray spreads the two pservers over the two nodes; every process sees one consistent role table
  with endpoints on its node's address; the job ends 0 when the trainers are done and the pservers exit.
- Collective mode: two trainers as actors train to the same parameters as one process on the union of the
  batches (``tests/runtime/collective``'s criterion, rtol 1e-5).
- A failing trainer fails the job (started through ``flotilla.ray.launch``): exit 1, the trainer named with its last lines, every other process
  stopped.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Callable, Iterator

import numpy as np
import pytest

from runtime.role import ROLE_ENV_VARS
from tests.netns import Hosts, NetnsUnavailable
from tests.runtime.collective import worker as collective_worker

pytestmark = pytest.mark.serial  # a Ray cluster and the jobs it runs

pytest.importorskip("ray", reason="Ray is not installed (pip install 'flotilla[ray]')")

REPO = pathlib.Path(__file__).resolve().parents[2]
JOB = str(REPO / "tests" / "runtime" / "launch_scripts" / "job.py")
RAY_PORT = 6379
NODE_ARGS = ("--num-cpus=2", "--object-store-memory=80000000", "--disable-usage-stats")


class RayCluster:
    def __init__(self, hosts: Hosts) -> None:
        self.hosts = hosts
        self.ray = os.path.join(os.path.dirname(sys.executable), "ray")
        base = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS and k != "XLA_FLAGS"}
        self.env = {**base, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0",
                    "FLAGS_collective_timeout_s": "30"}
        self.address = f"{hosts.addresses[0]}:{RAY_PORT}"

    def start(self) -> None:
        head, node = self.hosts.addresses
        self.hosts.popen(0, [self.ray, "start", "--head", "--block", f"--node-ip-address={head}",
                             f"--port={RAY_PORT}", "--include-dashboard=false", *NODE_ARGS], env=self.env,
                         stdout=subprocess.DEVNULL)
        self.hosts.popen(1, [self.ray, "start", "--block", f"--address={self.address}", f"--node-ip-address={node}",
                             *NODE_ARGS], env=self.env, stdout=subprocess.DEVNULL)
        probe = ("import ray, time\n"
                 f"ray.init(address='{self.address}', logging_level='ERROR')\n"
                 "end = time.monotonic() + 60\n"
                 "while sum(n['Alive'] for n in ray.nodes()) < 2 and time.monotonic() < end: time.sleep(0.1)\n"
                 "print('nodes', sum(n['Alive'] for n in ray.nodes()))\n")
        end = time.monotonic() + 90
        while True:  # the head may not listen yet: retry the probe until both nodes are up
            done = subprocess.run(["ip", "netns", "exec", self.hosts.ns(0), sys.executable, "-c", probe],
                                  env=self.env, capture_output=True, text=True, timeout=90)
            if "nodes 2" in done.stdout:
                return
            if time.monotonic() > end:
                pytest.fail(f"the Ray cluster did not come up:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            time.sleep(0.5)

    def launch(self, *argv: str, timeout: float = 150) -> tuple[int, str]:
        proc = self.hosts.popen(0, [sys.executable, "-m", "runtime.launch", "--ray", self.address, *argv],
                                env=self.env, cwd=REPO)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=10)
            pytest.fail(f"flotilla launch --ray did not finish within {timeout}s:\n{out[-4000:]}")
        return proc.returncode, out


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    if shutil.which("ip") is None:
        pytest.skip("no iproute2")
    try:
        hosts = Hosts.create(2)
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    try:
        ray_cluster = RayCluster(hosts)
        ray_cluster.start()
        yield ray_cluster
    finally:
        hosts.close()


def test_ps_job_on_ray_spreads_pservers_and_ends_cleanly(cluster: RayCluster) -> None:
    code, out = cluster.launch("--server_num", "2", "--worker_num", "2", JOB)
    assert code == 0, out
    started = dict(re.findall(r"\[launch\] started (\S+) \(pid \d+\) at (\S+) on Ray", out))
    assert sorted(started) == ["pserver.0", "pserver.1", "trainer.0", "trainer.1"], out
    assert {started["pserver.0"].split(":")[0], started["pserver.1"].split(":")[0]} == set(cluster.hosts.addresses)
    pservers = f"{started['pserver.0']},{started['pserver.1']}"
    for i in (0, 1):
        assert f"[pserver.{i}] role role=PSERVER trainer_id=0 trainers=2 current={started[f'pserver.{i}']} " \
               f"pservers={pservers}" in out, out
        assert f"[trainer.{i}] trainer {i} done" in out, out
    assert "summary: pserver.0 exit 0, pserver.1 exit 0, trainer.0 exit 0, trainer.1 exit 0" in out, out


def test_collective_job_on_ray_equals_one_process(cluster: RayCluster, tmp_path: pathlib.Path) -> None:
    code, out = cluster.launch("--nproc_per_node", "2", str(REPO / "tests" / "runtime" / "collective" / "worker.py"),
                               "--out", str(tmp_path), "--configs", "momentum_fused")
    assert code == 0, out
    ranks = [dict(np.load(tmp_path / f"momentum_fused.rank{r}.npz")) for r in (0, 1)]
    opt, _ = collective_worker.CONFIGS["momentum_fused"]
    for name, value in collective_worker.train_single(opt, seed=100).items():
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)
        np.testing.assert_allclose(ranks[0][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_failing_trainer_fails_the_ray_job(cluster: RayCluster) -> None:
    # Through the Python call this time: flotilla.ray.launch builds the same arguments as the command line.
    call = (f"import sys; from flotilla import ray; sys.exit(ray.launch({cluster.address!r}, {JOB!r}, "
            "['--pserver', 'hang', '--fail-trainer', '1'], server_num=1, worker_num=2))")
    proc = cluster.hosts.popen(0, [sys.executable, "-c", call], env=cluster.env, cwd=REPO)
    out, _ = proc.communicate(timeout=150)
    code = proc.returncode
    assert code == 1, out
    assert "[launch] trainer.1 failed with exit code 1; stopping the job" in out, out
    assert "|   trainer 1 fails now" in out or "| trainer 1 fails now" in out, out
    assert re.search(r"summary: .*pserver\.0 (stopped|killed by signal)", out), out


def test_ray_refuses_fixed_endpoints(cluster: RayCluster) -> None:
    code, out = cluster.launch("--servers", "127.0.0.1:6174", "--worker_num", "1", JOB, timeout=60)
    assert code == 2 and "cannot be combined with --ray" in out, out
