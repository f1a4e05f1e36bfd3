"""Trust holes of issue 21, against real gRPC pservers: a small GetVariables request must not make a
pserver build a huge reply (amplification), an update whose sum overflows is refused with the parameters
unchanged, a pserver reachable beyond loopback needs the job token or an explicit opt-out, and without
authentication a second incarnation of a live trainer id is refused.

The pserver processes started here (``tests.runtime.rpc.lone_pserver``) listen on free 127.0.0.1 ports and
are killed by pid at teardown; every wait is bounded.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import pytest

from runtime.flags import FlagError, RPCSecurity, rpc_security
from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.pserver import PServerError, Status
from runtime.rpc.server import SERVICE, check_exposure, grpc_options
from runtime.rpc.wire import decode_batch, encode_variable
from tests.runtime.rpc.conftest import LR, PARAMS, PSHandle, free_port, inc

TIMEOUT_S = 5.0
START_S = 60.0
CODE = grpc.StatusCode
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _identity(x: bytes) -> bytes:
    return x


def _call(channel: grpc.Channel, method: str, request: bytes) -> bytes:
    fn = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=_identity, response_deserializer=_identity)
    return fn(request, timeout=TIMEOUT_S)


def _error(channel: grpc.Channel, method: str, request: bytes) -> grpc.RpcError:
    try:
        reply = _call(channel, method, request)
    except grpc.RpcError as e:
        return e
    raise AssertionError(f"{method} answered {len(reply)} bytes; expected an error status")


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmHWM for process {pid}")


class Process:
    """A started test process; killed (by pid) and reaped at teardown."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
        for key in ("FLOTILLA_JOB_TOKEN", "FLOTILLA_INSECURE_PSERVER"):
            if key not in (env or {}):
                full.pop(key, None)
        self.proc = subprocess.Popen([sys.executable, *args], env=full, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

        self.out: str | None = None

    def output(self, timeout: float = START_S) -> tuple[int, str]:
        """The exit status and everything the process wrote, once it has exited."""
        if self.out is None:
            self.out = self.proc.communicate(timeout=timeout)[0]
        return self.proc.returncode, self.out

    def kill(self) -> str:
        """Kill the process if it still runs; what it wrote."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.output(TIMEOUT_S)[1]


@pytest.fixture
def processes() -> Iterator[Callable[..., Process]]:
    started: list[Process] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> Process:
        p = Process(args, env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


def _serving(channel: grpc.Channel, proc: Process) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise AssertionError(f"the pserver exited with {proc.proc.returncode}: {proc.output()[1]}")
        try:
            _call(channel, "Health", pb.HealthRequest().SerializeToString())
            return
        except grpc.RpcError:
            time.sleep(0.2)
    raise AssertionError(f"the pserver did not serve within {START_S:g}s")


# --- amplification ----------------------------------------------------------------------------------------------
@pytest.mark.serial  # a pserver process; the refusal timed (< 2 s)
def test_a_get_naming_a_block_many_times_is_refused_before_the_reply_is_built(
        processes: Callable[..., Process]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    proc = processes(["-m", "tests.runtime.rpc.lone_pserver", endpoint])  # fc_w: 512 x 256 float32, 512 KiB
    with grpc.insecure_channel(endpoint, options=grpc_options(1 << 30)) as channel:
        _serving(channel, proc)
        before = _peak_rss_kib(proc.proc.pid)
        started = time.monotonic()
        request = pb.GetVariablesRequest(names=["fc_w"] * 400, trainer_id=0).SerializeToString()  # 200 MiB asked
        err = _error(channel, "GetVariables", request)
        assert err.code() == CODE.INVALID_ARGUMENT, err.details()
        assert "GetVariables names ['fc_w'] more than once (400 names, 1 distinct)" in err.details()
        assert time.monotonic() - started < 2.0
        assert _peak_rss_kib(proc.proc.pid) - before < 32 << 10, "the pserver built the reply it refused"
        # the server keeps serving: a good request is answered
        (w, b) = decode_batch(_call(channel, "GetVariables", pb.GetVariablesRequest(
            names=["fc_w", "fc_b"], trainer_id=0).SerializeToString()))
        assert (w.name, w.value.shape, b.name, b.value.shape) == ("fc_w", (512, 256), "fc_b", (256,))


def test_a_get_asking_more_than_the_message_limit_is_refused(make_pserver: Callable[..., PSHandle]) -> None:
    h = make_pserver(True)
    sizes = {"fc_b": 30 * 4, "fc_w.block1": 20 * 30 * 4}
    with pytest.raises(PServerError) as info:
        h.pserver.get_many(0, ["fc_b", "fc_w.block1"], max_bytes=sum(sizes.values()) - 1)
    assert info.value.status is Status.RESOURCE_EXHAUSTED
    assert f"asks for {sum(sizes.values())} bytes, above this pserver's reply limit of " \
           f"{sum(sizes.values()) - 1} bytes" in str(info.value)
    assert len(h.pserver.get_many(0, ["fc_b", "fc_w.block1"], max_bytes=sum(sizes.values()))) == 2


# --- overflow after the sum -------------------------------------------------------------------------------------
def _barrier(channel: grpc.Channel, t: int, step: int, kind: int) -> Any:
    fn = channel.unary_unary(f"/{SERVICE}/Barrier", request_serializer=_identity, response_deserializer=_identity)
    return fn.future(pb.BarrierRequest(trainer_id=t, step=step, kind=kind, incarnation=inc(t)).SerializeToString(),
                     timeout=TIMEOUT_S)


def test_finite_gradients_whose_sum_overflows_are_refused_with_the_parameters_unchanged(
        make_pserver: Callable[..., PSHandle]) -> None:
    h = make_pserver(True, serve=True)
    before = h.params()
    with grpc.insecure_channel(h.endpoint, options=grpc_options(0)) as channel:
        for t in (0, 1):  # each 3e38 is finite; their sum is not
            _call(channel, "SendVariable", encode_variable(h.grad_name("fc_b", t), np.full(30, 3e38, np.float32),
                                                            trainer_id=t, seq=1, incarnation=inc(t)))
        errors = []
        for f in [_barrier(channel, t, 0, pb.SEND) for t in (0, 1)]:
            with pytest.raises(grpc.RpcError) as info:
                f.result()
            errors.append(info.value)
        for err in errors:
            assert err.code() == CODE.ABORTED, err.details()
            assert f"pserver {h.endpoint}: step 0 refused: its update of 'fc_b' holds 30 NaN or Inf value(s) " \
                   "although every gradient was finite" in err.details()
            assert "the parameters are unchanged" in err.details()
    after = h.params()
    for p in PARAMS:
        np.testing.assert_array_equal(after[p], before[p])
    assert h.pserver.health()["rejected_nonfinite"] == 1


def test_an_async_update_that_overflows_is_refused_and_the_next_is_applied(make_pserver: Callable[..., PSHandle]) -> None:
    h = make_pserver(False, serve=True)
    g = np.full(30, -3e38, np.float32)  # finite; SGD adds 3e37 a send, so the 12th leaves float32's range
    with grpc.insecure_channel(h.endpoint, options=grpc_options(0)) as channel:
        def send(value: np.ndarray, seq: int) -> bytes:
            return encode_variable(h.grad_name("fc_b", 0), value, trainer_id=0, step=seq, seq=seq, incarnation=inc(0))

        for seq in range(1, 12):
            _call(channel, "SendVariable", send(g, seq))
        before = h.params()
        assert np.isfinite(before["fc_b"]).all() and before["fc_b"].min() > 3e38
        err = _error(channel, "SendVariable", send(g, 12))
        assert err.code() == CODE.INVALID_ARGUMENT
        assert "send of 'fc_b@GRAD' from trainer 0 for step 12: applying it makes 'fc_b' hold 30 NaN or Inf " \
               "value(s) although the gradient is finite; refused, the parameters are unchanged" in err.details()
        np.testing.assert_array_equal(h.params()["fc_b"], before["fc_b"])
        _call(channel, "SendVariable", send(-g, 13))  # the pserver goes on serving and applying
    np.testing.assert_allclose(h.params()["fc_b"], before["fc_b"] - np.float32(LR) * -g, rtol=1e-6)


# --- a pserver without a token ----------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "127.0.1.1"])
def test_a_loopback_pserver_needs_no_token(host: str) -> None:
    assert check_exposure(f"{host}:6174", RPCSecurity()) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "10.0.0.1", "nosuchhost.invalid"])
def test_a_pserver_beyond_loopback_needs_a_token_or_the_opt_out(host: str) -> None:
    with pytest.raises(FlagError) as info:
        check_exposure(f"{host}:6174", RPCSecurity())
    assert f"pserver {host}:6174: {host} is reachable from other machines and this pserver authenticates " \
           "nobody" in info.value.message
    assert "FLOTILLA_JOB_TOKEN" in info.value.hint and "FLOTILLA_INSECURE_PSERVER=1" in info.value.hint
    assert check_exposure(f"{host}:6174", RPCSecurity(token="t")) is None
    assert check_exposure(f"{host}:6174", RPCSecurity(cert=b"c", key=b"k", ca=b"ca")) is None  # mutual TLS
    with pytest.raises(FlagError):
        check_exposure(f"{host}:6174", RPCSecurity(cert=b"c", key=b"k"))  # TLS alone authenticates nobody
    warning = check_exposure(f"{host}:6174", RPCSecurity(insecure=True))
    assert warning is not None and "serving without authentication beyond loopback" in warning
    assert rpc_security({"FLOTILLA_INSECURE_PSERVER": "1"}).insecure


@pytest.mark.serial  # pserver processes
def test_a_pserver_started_on_every_interface_without_a_token_is_refused(processes: Callable[..., Process]) -> None:
    port = free_port()
    refused = processes(["-m", "tests.runtime.rpc.lone_pserver", f"0.0.0.0:{port}"])
    code, out = refused.output()
    assert code != 0, out
    assert f"[E760] pserver 0.0.0.0:{port}: 0.0.0.0 is reachable from other machines" in out
    assert "FLOTILLA_JOB_TOKEN" in out and "FLOTILLA_INSECURE_PSERVER=1" in out
    # the explicit opt-out starts it, and it says so
    opted = processes(["-m", "tests.runtime.rpc.lone_pserver", f"0.0.0.0:{port}"],
                      env={"FLOTILLA_INSECURE_PSERVER": "1"})
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options(0)) as channel:
        _serving(channel, opted)
    assert "WARNING: serving without authentication beyond loopback (FLOTILLA_INSECURE_PSERVER=1)" in opted.kill()


def test_without_authentication_a_second_incarnation_of_a_live_trainer_is_refused(
        make_pserver: Callable[..., PSHandle]) -> None:
    h = make_pserver(True, serve=True)  # no token: trainers 0 and 1 announced as inc(0), inc(1)
    snapshot = h.snapshot()
    forged = inc(1) + 0x77
    with grpc.insecure_channel(h.endpoint, options=grpc_options(0)) as channel:
        err = _error(channel, "Announce", pb.AnnounceRequest(trainer_id=1, incarnation=forged).SerializeToString())
        assert err.code() == CODE.FAILED_PRECONDITION
        assert f"Announce of trainer 1 as incarnation {forged:#x}, but that trainer is live as {inc(1):#x}; this " \
               "pserver authenticates nobody" in err.details() and "FLOTILLA_JOB_TOKEN" in err.details()
        err = _error(channel, "Complete", pb.CompleteRequest(trainer_id=1, incarnation=forged).SerializeToString())
        assert err.code() == CODE.FAILED_PRECONDITION
        assert h.snapshot() == snapshot and h.pserver.health()["live_trainers"] == [0, 1]
        # the live incarnation goes on
        _call(channel, "SendVariable", encode_variable(h.grad_name("fc_b", 1), np.ones(30, np.float32), trainer_id=1,
                                                        seq=1, incarnation=inc(1)))
    assert h.snapshot() != snapshot
