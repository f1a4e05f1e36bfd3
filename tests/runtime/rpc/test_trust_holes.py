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

from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.pserver import PServerError, Status
from runtime.rpc.server import SERVICE, grpc_options
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

    def output(self, timeout: float = START_S) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=TIMEOUT_S)


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
