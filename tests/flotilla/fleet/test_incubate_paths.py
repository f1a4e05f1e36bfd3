"""Paddle 1.5's Fleet module paths (``paddle.fluid.incubate.fleet...``) port by the one rewrite
``paddle.fluid`` → ``flotilla.fluid``, and name the objects of ``flotilla.fleet`` (re-exports, one home)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from runtime.role import ROLE_ENV_VARS
from tests import launching

pytestmark = pytest.mark.serial  # the ported Fleet script run as a job

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]

# Paddle 1.5's parameter-server Fleet "ten lines", as its docs wrote them; run without role variables it is
# a local job (one worker, no servers).
PADDLE_SCRIPT = """
import numpy as np
import paddle.fluid as fluid
import paddle.fluid.incubate.fleet.base.role_maker as role_maker
from paddle.fluid.incubate.fleet.base.role_maker import Role, UserDefinedRoleMaker
from paddle.fluid.incubate.fleet.parameter_server.distribute_transpiler import fleet
from paddle.fluid.incubate.fleet.parameter_server.distribute_transpiler.distributed_strategy import StrategyFactory
from paddle.fluid.incubate.fleet.collective import fleet as collective_fleet, DistributedStrategy

x = fluid.layers.data(name="x", shape=[4], dtype="float32")
y = fluid.layers.data(name="y", shape=[1], dtype="float32")
pred = fluid.layers.fc(input=x, size=1)
loss = fluid.layers.mean(fluid.layers.square_error_cost(input=pred, label=y))

role = role_maker.PaddleCloudRoleMaker()
fleet.init(role)
optimizer = fleet.distributed_optimizer(fluid.optimizer.SGD(0.1), StrategyFactory.create_sync_strategy())
optimizer.minimize(loss)

if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
elif fleet.is_worker():
    exe = fluid.Executor(fluid.CPUPlace())
    fleet.init_worker()
    exe.run(fleet.startup_program)
    rng = np.random.RandomState(0)
    xs = rng.normal(size=(64, 4)).astype("float32")
    ys = xs @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    losses = [float(exe.run(fleet.main_program, feed={"x": xs, "y": ys}, fetch_list=[loss])[0][0])
              for _ in range(30)]
    fleet.stop_worker()
    print("worker %d: first loss %.4f last loss %.4f" % (fleet.worker_index(), losses[0], losses[-1]))
"""

SAME_OBJECTS = """
import flotilla.fleet, flotilla.fleet.base, flotilla.fleet.collective
assert fleet is flotilla.fleet.fleet and collective_fleet is flotilla.fleet.collective.fleet
assert role_maker.PaddleCloudRoleMaker is flotilla.fleet.PaddleCloudRoleMaker
assert UserDefinedRoleMaker is flotilla.fleet.UserDefinedRoleMaker and Role is flotilla.fleet.Role
assert DistributedStrategy is flotilla.fleet.DistributedStrategy
assert StrategyFactory is flotilla.fleet.StrategyFactory
from flotilla.fluid.incubate.fleet.base.fleet_base import Fleet
assert Fleet is flotilla.fleet.base.Fleet and fluid.incubate.fleet.base.role_maker is role_maker
print("same objects as flotilla.fleet")
"""


def _ported_script(folder: pathlib.Path) -> pathlib.Path:
    ported = PADDLE_SCRIPT.replace("paddle.fluid", "flotilla.fluid")
    assert ported.count("flotilla.fluid") == 6 and "paddle" not in ported  # the one rewrite, nothing else
    script = folder / "fleet_ps.py"
    script.write_text(ported + textwrap.dedent(SAME_OBJECTS))
    return script


def _losses(out: str) -> dict[int, tuple[float, float]]:
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"worker (\d+): first loss (\S+) last loss (\S+)", out)}


def test_a_paddle_fleet_script_ports_by_rewriting_the_import_prefix(tmp_path: pathlib.Path) -> None:
    script = _ported_script(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (first, last), = _losses(done.stdout).values()  # alone: one worker, no servers
    assert last < first / 10
    assert "same objects as flotilla.fleet" in done.stdout


def test_the_ported_fleet_script_runs_under_the_launcher(tmp_path: pathlib.Path) -> None:
    """1 pserver x 2 workers: the role makers read the variables the launcher sets, as Paddle's did."""
    script = _ported_script(tmp_path)
    out = launching.launch(tmp_path / "logs", ["--server_num", "1", "--worker_num", "2"], str(script), processes=3,
                           timeout=180)
    losses = _losses(out)
    assert sorted(losses) == [0, 1], out[-2000:]
    assert all(last < first / 10 for first, last in losses.values()), losses
    assert out.count("same objects as flotilla.fleet") == 3  # the server too, once run_server returns


def test_import_flotilla_fluid_leaves_incubate_unimported() -> None:
    code = ("import sys, flotilla.fluid as fluid; assert 'flotilla.fluid.incubate' not in sys.modules; "
            "fluid.incubate; assert 'flotilla.fluid.incubate' in sys.modules")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_the_ported_fleet_script_runs_started_by_hand_with_paddles_variables(tmp_path: pathlib.Path) -> None:
    """1 pserver and 1 worker started by hand, as Paddle's manual did: only Paddle's environment variables."""
    from runtime.launch import free_ports

    script = _ported_script(tmp_path)
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    env = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]),
               PADDLE_PSERVERS_IP_PORT_LIST=endpoint, PADDLE_TRAINERS_NUM="1")
    server = subprocess.Popen([sys.executable, str(script)], env={**env, "TRAINING_ROLE": "PSERVER",
                              "PADDLE_CURRENT_ENDPOINT": endpoint}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    worker = subprocess.Popen([sys.executable, str(script)], env={**env, "TRAINING_ROLE": "TRAINER",
                              "PADDLE_TRAINER_ID": "0"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        worker_out, _ = worker.communicate(timeout=120)
        server_out, _ = server.communicate(timeout=60)
    finally:
        for proc in (worker, server):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    assert worker.returncode == 0 and server.returncode == 0, worker_out[-2000:] + server_out[-2000:]
    (first, last), = _losses(worker_out).values()
    assert last < first / 10
    assert f"serving {endpoint}" in server_out and "same objects as flotilla.fleet" in server_out
