"""Issue 21's acceptance: a Paddle 1.5 job ports by rewriting ``paddle.fluid`` to ``flotilla.fluid`` and nothing
else. Each ``*.py.paddle`` here is a script as Paddle 1.5's docs wrote it (Paddle's imports, Paddle's environment
variables read with ``os.getenv``); the tests apply that one rewrite into ``tmp_path`` and run the result as real
processes, under the launcher and started by hand with only Paddle's variables set. (The Fleet
parameter-server "ten lines" is ported the same way, both ways, in tests/flotilla/fleet/test_incubate_paths.py.)"""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from runtime.launch import free_ports
from runtime.role import ROLE_ENV_VARS
from tests import launching

pytestmark = pytest.mark.serial  # the ported scripts run as jobs, launched and by hand

HERE = pathlib.Path(__file__).resolve().parent
REPO = launching.REPO
TIMEOUT_S = 180


def port(name: str, dest: pathlib.Path) -> pathlib.Path:
    """``name`` with the README's one rewrite applied, written into ``dest``; no other Paddle name survives."""
    original = (HERE / name).read_text()
    assert "flotilla" not in original  # the script is Paddle's own: the rewrite below is its only edit
    ported = original.replace("paddle.fluid", "flotilla.fluid")
    # No Paddle module is left: what remains of the name is Paddle's environment variables (PADDLE_*), its
    # class names (PaddleCloudRoleMaker) and comments.
    for line in ported.splitlines():
        assert not re.search(r"\bpaddle\b", line.split("#", 1)[0]), line
    assert "import flotilla.fluid as fluid" in ported
    path = dest / name.removesuffix(".paddle")
    path.write_text(ported)
    return path


def clean_env(**extra: str) -> dict[str, str]:
    """This environment less any role variable, with the repository importable (as an installed package is)."""
    env = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS and not k.startswith("PADDLE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def run_by_hand(script: pathlib.Path, roles: list[dict[str, str]], *args: str) -> list[str]:
    """Start one process per role environment (pservers first), wait for all within the deadline, and return
    their outputs; every one must exit 0. Leftovers are killed by pid."""
    procs = [subprocess.Popen([sys.executable, str(script), *args], cwd=script.parent, env=clean_env(**role),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for role in roles]
    outs: list[str] = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            outs.append(out)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script.name} did not finish within {TIMEOUT_S}s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{out[-4000:]}"
    return outs


def losses(out: str) -> dict[int, tuple[float, ...]]:
    found = {}
    for m in re.finditer(r"trainer (\d): loss (\d+\.\d+) -> (\d+\.\d+)(?:, weights (-?\d+\.\d+))?", out):
        found[int(m.group(1))] = tuple(float(g) for g in m.groups()[1:] if g is not None)
    return found


def endpoints(n: int) -> list[str]:
    return [f"127.0.0.1:{p}" for p in free_ports(n)]


# --- 1. the manual's parameter-server script, save_persistables to an absolute directory ----------------------
def check_pserver_job(out: str, checkpoint: pathlib.Path) -> None:
    found = losses(out)
    assert sorted(found) == [0, 1], out[-3000:]
    assert all(after < before / 3 for before, after in found.values()), found
    assert checkpoint.is_dir(), out[-3000:]
    inspect = subprocess.run([sys.executable, "-m", "flotilla.cli", "checkpoint", "inspect", str(checkpoint)],
                             cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    # The model's parameters, saved from the pservers that hold them, with the manifests checked.
    assert "fc_0.w_0 lod_tensor float32 [4, 1]" in inspect.stdout and "fc_0.b_0" in inspect.stdout, inspect.stdout
    assert "manifests verified" in inspect.stdout, inspect.stdout


def test_manual_pserver_script_under_the_launcher(tmp_path: pathlib.Path) -> None:
    script = port("dist_train.py.paddle", tmp_path)
    checkpoint = tmp_path / "ckpt"
    out = launching.launch(tmp_path / "logs", ["--server_num", "2", "--worker_num", "2"], str(script),
                           str(checkpoint), processes=4, timeout=TIMEOUT_S)
    check_pserver_job(out, checkpoint)


def test_manual_pserver_script_started_by_hand(tmp_path: pathlib.Path) -> None:
    script = port("dist_train.py.paddle", tmp_path)
    checkpoint = tmp_path / "ckpt"
    pservers = endpoints(2)
    common = {"PADDLE_PSERVERS_IP_PORT_LIST": ",".join(pservers), "PADDLE_TRAINERS_NUM": "2"}
    roles = [{**common, "PADDLE_TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_ENDPOINT": ep} for ep in pservers]
    roles += [{**common, "PADDLE_TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(i)} for i in range(2)]
    outs = run_by_hand(script, roles, str(checkpoint))
    check_pserver_job("\n".join(outs), checkpoint)


# --- 2. Fleet collective "ten lines" and 3. nccl2 with get_tensor: both trainers end identical --------------
def check_collective(out: str, ratio: float) -> None:
    found = losses(out)
    assert sorted(found) == [0, 1], out[-3000:]
    assert found[0][2] == found[1][2], found  # the parameters' checksum, printed via get_tensor()
    assert all(after < before / ratio for before, after, _ in found.values()), found


def collective_roles() -> list[dict[str, str]]:
    trainers = endpoints(2)
    return [{"PADDLE_TRAINER_ID": str(i), "PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ENDPOINTS": ",".join(trainers),
             "PADDLE_CURRENT_ENDPOINT": ep} for i, ep in enumerate(trainers)]


@pytest.mark.parametrize("name, ratio", [("fleet_collective.py.paddle", 3), ("fluid_nccl2.py.paddle", 100)])
def test_collective_script_under_the_launcher(tmp_path: pathlib.Path, name: str, ratio: float) -> None:
    script = port(name, tmp_path)
    out = launching.launch(tmp_path / "logs", ["--nproc_per_node", "2"], str(script), processes=2,
                           timeout=TIMEOUT_S)
    check_collective(out, ratio)


@pytest.mark.parametrize("name, ratio", [("fleet_collective.py.paddle", 3), ("fluid_nccl2.py.paddle", 100)])
def test_collective_script_started_by_hand(tmp_path: pathlib.Path, name: str, ratio: float) -> None:
    script = port(name, tmp_path)
    check_collective("\n".join(run_by_hand(script, collective_roles())), ratio)
