"""The local launcher (``runtime.launch``, ``flotilla launch``) and ``runtime.role.role_from_env``.

Role parsing and job planning are tested in-process; jobs run as real processes: the launcher under
``subprocess.run`` with a timeout, starting ``launch_scripts/job.py`` (which prints its role and then
exits, fails or hangs as told). Every wait is bounded; a test signals only the launcher it started.
"""
from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from ir.errors import FlotillaError
from runtime.launch import JobPlan, build_parser, child_environ, free_ports, launch, plan_job
from runtime.role import ROLE_ENV_VARS, LaunchError, Role, role_from_env

pytestmark = pytest.mark.serial(waits=True)  # launched jobs, timed against their stop timeouts

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
JOB = str(pathlib.Path(__file__).resolve().parent / "launch_scripts" / "job.py")
LAUNCHER = [sys.executable, "-m", "runtime.launch"]
JOB_TIMEOUT_S = 60


# --- role_from_env -----------------------------------------------------------------------------------------


def test_no_variables_is_a_local_single_trainer() -> None:
    role = role_from_env({})
    assert role == Role(role="TRAINER", trainer_id=0, trainers=1, pserver_endpoints=(), current_endpoint="",
                        trainer_endpoints=())
    assert role.is_trainer and not role.is_pserver
    assert not role.is_distributed and not role.is_collective
    assert role.pservers == ""
    assert role.pserver_index is None


def test_empty_values_count_as_unset() -> None:
    assert role_from_env({"TRAINING_ROLE": "", "PADDLE_TRAINER_ID": " ", "PADDLE_TRAINERS_NUM": ""}) == Role()


def test_pserver_role() -> None:
    role = role_from_env({
        "TRAINING_ROLE": "PSERVER",
        "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6174, 127.0.0.1:6175",
        "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:6175",
        "PADDLE_TRAINERS_NUM": "2",
    })
    assert role.is_pserver and role.is_distributed
    assert role.pserver_endpoints == ("127.0.0.1:6174", "127.0.0.1:6175")
    assert role.pservers == "127.0.0.1:6174,127.0.0.1:6175"
    assert role.current_endpoint == "127.0.0.1:6175"
    assert role.pserver_index == 1
    assert (role.trainers, role.trainer_id) == (2, 0)


def test_pserver_endpoint_from_pod_ip_and_port() -> None:
    role = role_from_env({"TRAINING_ROLE": "pserver", "PADDLE_PSERVERS_IP_PORT_LIST": "10.0.0.1:7000,10.0.0.2:7000",
                          "POD_IP": "10.0.0.2", "PADDLE_PORT": "07000"})
    assert role.role == "PSERVER"
    assert role.current_endpoint == "10.0.0.2:7000"
    assert role.pserver_index == 1


def test_trainer_role() -> None:
    role = role_from_env({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "3",
                          "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6174"})
    assert role.is_trainer and role.is_distributed and not role.is_collective
    assert (role.trainer_id, role.trainers, role.current_endpoint) == (1, 3, "")
    assert role.pservers == "127.0.0.1:6174"


def test_collective_trainer_role() -> None:
    role = role_from_env({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1",
                          "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7000,127.0.0.1:7001",
                          "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:7001"})
    assert role.is_collective and not role.is_distributed
    assert role.trainers == 2  # taken from the endpoint list when PADDLE_TRAINERS_NUM is unset
    assert role.current_endpoint == "127.0.0.1:7001"
    assert role.trainer_endpoints == ("127.0.0.1:7000", "127.0.0.1:7001")


_PS_LIST = {"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6174,127.0.0.1:6175"}

BAD_ENVIRONMENTS = [
    ("unknown-role", {"TRAINING_ROLE": "WORKER"}, "E801", ["TRAINING_ROLE='WORKER'", "PSERVER or TRAINER"]),
    ("id-not-int", {"PADDLE_TRAINER_ID": "one"}, "E802", ["PADDLE_TRAINER_ID='one'", "not an integer"]),
    ("id-negative", {"PADDLE_TRAINER_ID": "-1"}, "E802", ["PADDLE_TRAINER_ID='-1'", "below 0"]),
    ("id-out-of-range", {"PADDLE_TRAINER_ID": "2", "PADDLE_TRAINERS_NUM": "2"}, "E802",
     ["PADDLE_TRAINER_ID=2", "out of range", "0..1"]),
    ("trainers-zero", {"PADDLE_TRAINERS_NUM": "0"}, "E802", ["PADDLE_TRAINERS_NUM='0'", "below 1"]),
    ("trainers-not-int", {"PADDLE_TRAINERS_NUM": "2.5"}, "E802", ["PADDLE_TRAINERS_NUM='2.5'", "not an integer"]),
    ("endpoint-no-port", {"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1"}, "E803",
     ["PADDLE_PSERVERS_IP_PORT_LIST", "'127.0.0.1'", "is malformed"]),
    ("endpoint-bad-port", {"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6174,127.0.0.1:99999"}, "E803",
     ["PADDLE_PSERVERS_IP_PORT_LIST", "127.0.0.1:99999", "outside 1..65535"]),
    ("endpoint-port-text", {"PADDLE_PSERVERS_IP_PORT_LIST": "host:http"}, "E803", ["'host:http'", "'http'"]),
    ("endpoint-empty-item", {"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6174,"}, "E803",
     ["PADDLE_PSERVERS_IP_PORT_LIST", "item 1", "empty"]),
    ("endpoint-duplicate", {"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6174,127.0.0.1:6174"}, "E803",
     ["127.0.0.1:6174 appears twice"]),
    ("ipv6-unbracketed", {"PADDLE_TRAINER_ENDPOINTS": "::1:7000"}, "E803",
     ["PADDLE_TRAINER_ENDPOINTS", "bracketed"]),
    ("pserver-without-list", {"TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:6174"}, "E804",
     ["PADDLE_PSERVERS_IP_PORT_LIST is not set"]),
    ("pserver-without-endpoint", {"TRAINING_ROLE": "PSERVER", **_PS_LIST, "POD_IP": "127.0.0.1"}, "E804",
     ["PADDLE_CURRENT_ENDPOINT is not set", "PADDLE_PORT"]),
    ("pserver-endpoint-not-listed", {"TRAINING_ROLE": "PSERVER", **_PS_LIST,
                                     "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:7000"}, "E804",
     ["127.0.0.1:7000", "PADDLE_CURRENT_ENDPOINT='127.0.0.1:7000'", "not in PADDLE_PSERVERS_IP_PORT_LIST"]),
    ("pserver-port-not-int", {"TRAINING_ROLE": "PSERVER", **_PS_LIST, "POD_IP": "127.0.0.1", "PADDLE_PORT": "x"},
     "E803", ["POD_IP:PADDLE_PORT", "'127.0.0.1:x'"]),
    ("pserver-malformed-current", {"TRAINING_ROLE": "PSERVER", **_PS_LIST, "PADDLE_CURRENT_ENDPOINT": "6174"},
     "E803", ["PADDLE_CURRENT_ENDPOINT", "'6174'"]),
    ("trainer-endpoints-count", {"PADDLE_TRAINERS_NUM": "3", "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:1,127.0.0.1:2"},
     "E805", ["2 endpoint(s)", "PADDLE_TRAINERS_NUM=3"]),
    ("trainer-current-mismatch", {"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:1,127.0.0.1:2",
                                  "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:2"}, "E805",
     ["PADDLE_CURRENT_ENDPOINT='127.0.0.1:2'", "entry 0", "127.0.0.1:1"]),
]


@pytest.mark.parametrize("env, code, fragments", [case[1:] for case in BAD_ENVIRONMENTS],
                         ids=[case[0] for case in BAD_ENVIRONMENTS])
def test_bad_environment_is_named(env: dict[str, str], code: str, fragments: list[str]) -> None:
    with pytest.raises(LaunchError) as info:
        role_from_env(env)
    err = info.value
    assert isinstance(err, FlotillaError)
    assert err.code == code
    for fragment in fragments:
        assert fragment in err.message
    assert err.hint  # every error says how to fix it


def test_role_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ROLE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "3")
    assert (role_from_env().trainer_id, role_from_env().trainers) == (3, 4)


def test_role_constructor_validates_and_freezes() -> None:
    role = Role(role="PSERVER", pserver_endpoints=["a:1", "b:2"], current_endpoint="b:2")  # type: ignore[arg-type]
    assert role.pserver_endpoints == ("a:1", "b:2")
    hash(role)  # frozen and hashable: the lists became tuples
    with pytest.raises(LaunchError, match="Role.role is 'BOSS'"):
        Role(role="BOSS")
    with pytest.raises(LaunchError, match="trainer_id is 2, expected 0..1"):
        Role(trainer_id=2, trainers=2)
    with pytest.raises(LaunchError, match="current_endpoint 'c:3' is not one of"):
        Role(role="PSERVER", pserver_endpoints=("a:1",), current_endpoint="c:3")


# --- planning (no processes) -------------------------------------------------------------------------------


def _plan(*argv: str) -> JobPlan:
    return plan_job(build_parser().parse_args([*argv, JOB, "--x", "1"]))


def test_plan_pserver_mode_envs() -> None:
    plan = _plan("--server_num", "2", "--worker_num", "3")
    assert plan.mode == "pserver"
    assert [p.tag for p in plan.processes] == ["pserver.0", "pserver.1", "trainer.0", "trainer.1", "trainer.2"]
    assert [p.log_name for p in plan.processes] == ["serverlog.0", "serverlog.1", "workerlog.0", "workerlog.1",
                                                    "workerlog.2"]
    endpoints = plan.pserver_endpoints + plan.trainer_endpoints
    assert len(set(endpoints)) == 5
    assert all(ep.startswith("127.0.0.1:") for ep in endpoints)
    assert plan.script_args == ("--x", "1")
    for spec in plan.processes:
        env = spec.env
        own = (plan.pserver_endpoints if spec.kind == "pserver" else plan.trainer_endpoints)[spec.index]
        assert env["PADDLE_CURRENT_ENDPOINT"] == own
        assert env["POD_IP"] + ":" + env["PADDLE_PORT"] == own
        assert env["PADDLE_TRAINERS_NUM"] == "3"
        assert env["PADDLE_PSERVERS_IP_PORT_LIST"] == ",".join(plan.pserver_endpoints)
        assert env["PADDLE_TRAINER_ENDPOINTS"] == ",".join(plan.trainer_endpoints)
        role = role_from_env(env)  # what the launcher writes, role_from_env reads back
        assert role.role == spec.kind.upper()
        assert role.current_endpoint == own
        if spec.kind == "trainer":
            assert env["PADDLE_TRAINER_ID"] == str(spec.index) and role.trainer_id == spec.index
        else:
            assert "PADDLE_TRAINER_ID" not in env and role.pserver_index == spec.index


def test_plan_collective_mode_envs() -> None:
    plan = _plan("--nproc_per_node", "2")
    assert plan.mode == "collective" and plan.pserver_endpoints == ()
    assert [p.tag for p in plan.processes] == ["trainer.0", "trainer.1"]
    for spec in plan.processes:
        assert "PADDLE_PSERVERS_IP_PORT_LIST" not in spec.env
        role = role_from_env(spec.env)
        assert role.is_collective and role.trainer_id == spec.index
        assert role.current_endpoint == plan.trainer_endpoints[spec.index]


def test_plan_collective_explicit_trainers_and_gpus() -> None:
    free = free_ports(2)
    trainers = f"127.0.0.1:{free[0]},127.0.0.1:{free[1]}"
    plan = _plan("--trainers", trainers, "--gpus", "3,5")
    assert plan.mode == "collective" and plan.trainer_endpoints == tuple(trainers.split(","))
    assert [p.env["FLAGS_selected_gpus"] for p in plan.processes] == ["3", "5"]
    assert [role_from_env(p.env).current_endpoint for p in plan.processes] == trainers.split(",")
    plan = _plan("--gpus", "0,1,2")  # one trainer a GPU
    assert len(plan.processes) == 3 and plan.processes[2].env["FLAGS_selected_gpus"] == "2"


def test_plan_explicit_servers_and_workers() -> None:
    free = free_ports(2)
    plan = _plan("--servers", f"127.0.0.1:{free[0]},localhost:{free[1]}", "--workers", "127.0.0.1,localhost")
    assert plan.pserver_endpoints == (f"127.0.0.1:{free[0]}", f"localhost:{free[1]}")
    assert [ep.split(":")[0] for ep in plan.trainer_endpoints] == ["127.0.0.1", "localhost"]


def test_plan_started_port_uses_consecutive_ports() -> None:
    base = _free_run_of_ports(3)
    plan = _plan("--server_num", "1", "--worker_num", "2", "--started_port", str(base))
    assert plan.pserver_endpoints == (f"127.0.0.1:{base}",)
    assert plan.trainer_endpoints == (f"127.0.0.1:{base + 1}", f"127.0.0.1:{base + 2}")


def test_child_environ_drops_inherited_role_variables() -> None:
    base = {"PATH": "/bin", "PADDLE_PSERVERS_IP_PORT_LIST": "10.0.0.1:1", "PADDLE_TRAINER_ID": "7"}
    env = child_environ(base, {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0"})
    assert env == {"PATH": "/bin", "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0", "PYTHONUNBUFFERED": "1"}


USAGE_ERRORS = [
    ("no-args", [], "required: training_script"),
    ("no-mode", [JOB], "no job given"),
    ("no-servers", ["--worker_num", "1", JOB], "--server_num N or --servers"),
    ("no-workers", ["--server_num", "1", JOB], "--worker_num M or --workers"),
    ("zero-servers", ["--server_num", "0", "--worker_num", "1", JOB], "--server_num is 0: expected at least 1"),
    ("negative-servers", ["--server_num", "-1", "--worker_num", "1", JOB], "--server_num is -1"),
    ("negative-workers", ["--server_num", "1", "--worker_num", "-2", JOB], "--worker_num is -2"),
    ("zero-nproc", ["--nproc_per_node", "0", JOB], "--nproc_per_node is 0"),
    ("count-not-int", ["--server_num", "two", "--worker_num", "1", JOB], "invalid int value: 'two'"),
    ("script-missing", ["--server_num", "1", "--worker_num", "1", "no_such_script.py"],
     "training script 'no_such_script.py' does not exist"),
    ("script-is-dir", ["--server_num", "1", "--worker_num", "1", str(REPO_ROOT)], "is a directory"),
    ("malformed-servers", ["--servers", "127.0.0.1", "--worker_num", "1", JOB], "endpoint '127.0.0.1' is malformed"),
    ("duplicate-servers", ["--servers", "127.0.0.1:7000,127.0.0.1:7000", "--worker_num", "1", JOB], "appears twice"),
    ("empty-worker", ["--server_num", "1", "--workers", "127.0.0.1,,127.0.0.1", JOB], "item 1"),
    ("both-server-flags", ["--server_num", "1", "--servers", "127.0.0.1:7000", "--worker_num", "1", JOB],
     "--servers and --server_num both given"),
    ("modes-mixed", ["--nproc_per_node", "2", "--server_num", "1", JOB], "cannot be combined with --server_num"),
    ("trainers-mixed", ["--trainers", "127.0.0.1:7000", "--worker_num", "1", JOB], "cannot be combined"),
    ("nproc-vs-trainers", ["--nproc_per_node", "3", "--trainers", "127.0.0.1:7000,127.0.0.1:7001", JOB],
     "--nproc_per_node 3 but --trainers lists 2"),
    ("gpus-vs-nproc", ["--nproc_per_node", "2", "--gpus", "0", JOB], "--gpus lists 1 GPU(s) for 2 trainer(s)"),
    ("gpus-bad", ["--gpus", "0,x", JOB], "not a list of GPU ids"),
    ("gpus-twice", ["--gpus", "1,1", JOB], "names a GPU twice"),
    ("negative-stop-timeout", ["--server_num", "1", "--worker_num", "1", "--stop_timeout", "-1", JOB],
     "--stop_timeout is -1.0"),
    ("port-out-of-range", ["--server_num", "1", "--worker_num", "1", "--started_port", "70000", JOB],
     "--started_port is 70000"),
]


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in USAGE_ERRORS], ids=[c[0] for c in USAGE_ERRORS])
def test_usage_error_is_one_line_and_exit_2(argv: list[str], fragment: str, capsys: pytest.CaptureFixture) -> None:
    assert launch(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing was started
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("python -m runtime.launch: error: ")
    assert fragment in lines[0]


# --- jobs of real processes --------------------------------------------------------------------------------


def _free_run_of_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports on 127.0.0.1."""
    for _ in range(50):
        base = free_ports(1)[0]
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free consecutive ports found")


def _run(argv: list[str], *, launcher: list[str] = LAUNCHER) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*launcher, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)


def _lines_of(stdout: str, tag: str) -> list[str]:
    prefix = f"[{tag}] "
    return [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]


def _pid_of(stdout: str, tag: str) -> int:
    pids = [int(line[4:]) for line in _lines_of(stdout, tag) if line.startswith("pid=")]
    assert len(pids) == 1, stdout
    return pids[0]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_job_runs_to_the_end(tmp_path: pathlib.Path) -> None:
    log_dir = tmp_path / "logs"
    done = _run(["--server_num", "2", "--worker_num", "2", "--log_dir", str(log_dir), JOB,
                 "--trainer-sleep", "0.3", "--log_dir", "for-the-script"])
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    roles = {}
    for tag in ("pserver.0", "pserver.1", "trainer.0", "trainer.1"):
        lines = _lines_of(out, tag)
        # arguments after the script, even ones the launcher also has, go to the script
        assert 'args=["--trainer-sleep", "0.3", "--log_dir", "for-the-script"]' in lines
        assert f"stderr line from {tag.split('.')[0]}" in lines  # stderr is captured and tagged too
        assert "env PYTHONUNBUFFERED=1" in lines
        roles[tag] = [line for line in lines if line.startswith("role ")][0]
        kind, index = tag.split(".")
        log = (log_dir / f"{'serverlog' if kind == 'pserver' else 'workerlog'}.{index}").read_text()
        assert log.splitlines() == lines  # the log holds exactly the process's own output, untagged
    pservers = re.search(r"pservers=(\S+)", roles["trainer.0"]).group(1)
    assert re.fullmatch(r"127\.0\.0\.1:\d+,127\.0\.0\.1:\d+", pservers)
    assert roles["pserver.1"].startswith("role role=PSERVER trainer_id=0 trainers=2 current=")
    assert f"pservers={pservers} pserver_index=1" in roles["pserver.1"]
    assert roles["trainer.1"].startswith("role role=TRAINER trainer_id=1 trainers=2 ")
    assert "trainer 1 done" in _lines_of(out, "trainer.1")
    summary = [line for line in out.splitlines() if line.startswith("[launch] summary: ")]
    assert len(summary) == 1
    for tag in ("pserver.0", "pserver.1", "trainer.0", "trainer.1"):
        assert re.search(rf"{re.escape(tag)} \(pid \d+\) exit 0(,|$)", summary[0]), summary[0]
    assert "stopped by the launcher" not in summary[0]  # the pservers exited by themselves
    assert sorted(p.name for p in log_dir.iterdir()) == ["serverlog.0", "serverlog.1", "workerlog.0", "workerlog.1"]


def test_failing_trainer_stops_the_job() -> None:
    start = time.monotonic()
    done = _run(["--server_num", "1", "--worker_num", "2", JOB, "--pserver", "hang", "--fail-trainer", "1",
                 "--trainer-sleep", "0.3"])
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr
    assert elapsed < 15, elapsed  # the hanging pserver did not keep the job alive
    trainer_pid = _pid_of(done.stdout, "trainer.1")
    assert f"[launch] trainer.1 (pid {trainer_pid}) failed with exit code 1; stopping the job" in done.stderr
    assert "[launch]   | trainer 1 fails now" in done.stderr  # the tail of its output
    pserver_pid = _pid_of(done.stdout, "pserver.0")
    assert "pserver hanging" in _lines_of(done.stdout, "pserver.0")
    assert _gone(pserver_pid)
    assert f"pserver.0 (pid {pserver_pid}) killed by SIGTERM (stopped by the launcher)" in done.stdout
    assert f"trainer.1 (pid {trainer_pid}) exit 1" in done.stdout


def test_pserver_that_never_exits_is_stopped_after_stop_timeout() -> None:
    start = time.monotonic()
    done = _run(["--server_num", "1", "--worker_num", "1", "--stop_timeout", "1", JOB, "--pserver", "hang"])
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr
    assert 1.0 <= elapsed < 15, elapsed
    pserver_pid = _pid_of(done.stdout, "pserver.0")
    assert _gone(pserver_pid)
    assert f"pserver.0 (pid {pserver_pid}) still running 1 s after every trainer finished (--stop_timeout)" \
        in done.stderr
    assert "trainer 0 done" in _lines_of(done.stdout, "trainer.0")


def test_started_port_in_use_is_a_usage_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _run(["--server_num", "1", "--worker_num", "1", "--started_port", str(port), JOB])
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert f"port {port} on 127.0.0.1 (--started_port {port} + 0, for pserver.0) is not free" in lines[0]
    assert "choose another --started_port" in lines[0]


def test_explicit_server_port_in_use_is_a_usage_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _run(["--servers", f"127.0.0.1:{port}", "--worker_num", "1", JOB])
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 (from --servers, for pserver.0) cannot be used" in done.stderr


def test_sigint_to_the_launcher_stops_the_job(tmp_path: pathlib.Path) -> None:
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen([*LAUNCHER, "--server_num", "1", "--worker_num", "1", "--log_dir", str(log_dir), JOB,
                             "--pserver", "hang", "--trainer-sleep", "60"], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pids: dict[str, int] = {}
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
            for name in ("serverlog.0", "workerlog.0"):
                path = log_dir / name
                text = path.read_text() if path.exists() else ""
                # the trainer's role line comes after its pid line: the process is well under way
                if "role role=" in text:
                    pids[name] = int(re.search(r"^pid=(\d+)$", text, re.M).group(1))
            time.sleep(0.05)
        assert len(pids) == 2, f"the job did not start in time: {pids}"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 128 + signal.SIGINT, out + err
    assert "[launch] got SIGINT: stopping the job" in err
    assert all(_gone(pid) for pid in pids.values())
    assert "(stopped by the launcher)" in out


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for whoever adopted it to reap it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_children_die_with_a_killed_launcher(tmp_path: pathlib.Path) -> None:
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen([*LAUNCHER, "--server_num", "1", "--worker_num", "1", "--log_dir", str(log_dir), JOB,
                             "--pserver", "hang", "--trainer-sleep", "60"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
            for name in ("serverlog.0", "workerlog.0"):
                path = log_dir / name
                match = re.search(r"^pid=(\d+)$", path.read_text() if path.exists() else "", re.M)
                if match:
                    pids[name] = int(match.group(1))
            time.sleep(0.05)
        assert len(pids) == 2, f"the job did not start in time: {pids}"
        proc.kill()  # kill -9: the launcher cannot stop anything itself
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while not all(_dead(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_dead(pid) for pid in pids.values()), f"children outlived the launcher: {pids}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in pids.values():
            if not _dead(pid):
                os.kill(pid, signal.SIGKILL)


def test_flotilla_launch_runs_a_collective_job() -> None:
    done = _run(["launch", "--nproc_per_node", "2", JOB], launcher=[sys.executable, "-m", "flotilla.cli"])
    assert done.returncode == 0, done.stdout + done.stderr
    for index in (0, 1):
        lines = _lines_of(done.stdout, f"trainer.{index}")
        assert "env TRAINING_ROLE=TRAINER" in lines
        assert "env PADDLE_PSERVERS_IP_PORT_LIST=<unset>" in lines
        endpoints = [line.split("=", 1)[1] for line in lines if line.startswith("env PADDLE_TRAINER_ENDPOINTS=")]
        assert len(endpoints) == 1 and len(endpoints[0].split(",")) == 2
        own = endpoints[0].split(",")[index]
        assert f"role role=TRAINER trainer_id={index} trainers=2 current={own} pservers= pserver_index=None" in lines
    assert "[pserver." not in done.stdout


def test_flotilla_launch_help_and_usage_errors() -> None:
    cli = [sys.executable, "-m", "flotilla.cli"]
    done = _run(["launch", "--help"], launcher=cli)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: flotilla launch ")
    for flag in ("--server_num", "--worker_num", "--servers", "--workers", "--nproc_per_node", "--log_dir",
                 "--started_port", "--stop_timeout"):
        assert flag in done.stdout
    bad = _run(["launch", "--server_num", "0", "--worker_num", "1", JOB], launcher=cli)
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        "flotilla launch: error: --server_num is 0: expected at least 1 (hint: pass --server_num 1 or more)"]
