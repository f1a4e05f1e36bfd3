"""Bad requests against a real gRPC pserver on a free 127.0.0.1 port: each gets the exact status code and
a message naming the problem, the server keeps serving, a good request then succeeds, and the pserver's
variables are bit-identical. Also: RPCClient against a dead port, Health, a flood of garbage, and the
``listen_and_serv`` kernel serving until every trainer completed."""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import pytest

import runtime
from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.client import RPCClient, RPCError
from runtime.rpc.server import SERVICE, grpc_options
from runtime.rpc.wire import decode_batch, decode_variable, encode_batch, encode_variable
from runtime.scope import Scope, SelectedRows
from tests.runtime.rpc.conftest import (LR, PARAMS, SHAPES, JOIN_S, PSHandle, Tracker, build_pserver, free_port,
                                        inc, listen_op, pserver_programs)

TIMEOUT_S = 5.0
CODE = grpc.StatusCode


def _identity(x: bytes) -> bytes:
    return x


class Raw:
    """Raw calls on a channel to ``endpoint``: request and response are bytes."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.channel = grpc.insecure_channel(endpoint, options=grpc_options(0))
        grpc.channel_ready_future(self.channel).result(timeout=TIMEOUT_S)

    def method(self, name: str) -> Any:
        return self.channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=_identity,
                                        response_deserializer=_identity)

    def call(self, name: str, request: bytes) -> bytes:
        return self.method(name)(request, timeout=TIMEOUT_S)

    def error(self, name: str, request: bytes) -> grpc.RpcError:
        try:
            reply = self.call(name, request)
        except grpc.RpcError as e:
            return e
        raise AssertionError(f"{name} succeeded ({reply!r}); expected an error status")

    def get(self, name: str, trainer_id: int = 0) -> bytes:
        return self.call("GetVariable", pb.VariableRequest(name=name, trainer_id=trainer_id).SerializeToString())

    def health(self) -> Any:
        return pb.HealthReply.FromString(self.call("Health", pb.HealthRequest().SerializeToString()))

    def close(self) -> None:
        self.channel.close()


class Served:
    """A served PServer, a raw channel to it, and the next send sequence number."""

    def __init__(self, handle: PSHandle) -> None:
        self.h = handle
        self.raw = Raw(handle.endpoint)
        self.seq: dict[tuple[int, str], int] = collections.defaultdict(lambda: 1)  # the next seq of each

    def send_bytes(self, param: str, value: Any, *, trainer_id: int = 0, step: int = 0, name: str | None = None) -> bytes:
        return encode_variable(name or self.h.grad_name(param, trainer_id), value, trainer_id=trainer_id, step=step,
                               seq=self.seq[trainer_id, name or self.h.grad_name(param, trainer_id)],
                               incarnation=inc(trainer_id))

    def sent(self, param: str, trainer_id: int = 0) -> None:
        """Count an accepted send: the next one carries the next seq."""
        self.seq[trainer_id, self.h.grad_name(param, trainer_id)] += 1

    def good_send(self) -> None:
        """A valid gradient of fc_b from trainer 0 (sync: stored for step 0; async: applied)."""
        self.raw.call("SendVariable", self.send_bytes("fc_b", np.full((30,), 0.5, np.float32)))
        self.sent("fc_b")


@pytest.fixture(scope="module")
def served() -> Iterator[dict[str, Served]]:
    tracker = Tracker()
    out = {mode: Served(build_pserver(mode == "sync", serve=True, tracker=tracker)) for mode in ("sync", "async")}
    yield out
    for s in out.values():
        s.raw.close()
    tracker.close()


@pytest.fixture
def one_served(tracker: Tracker) -> Iterator[Callable[[bool], Served]]:
    """A fresh served PServer for a test that changes the trainers' state (stopped at teardown)."""
    made: list[Served] = []

    def make(sync: bool) -> Served:
        s = Served(build_pserver(sync, serve=True, tracker=tracker))
        made.append(s)
        return s

    yield make
    for s in made:
        s.raw.close()


def _f32(shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    return np.full(shape, 0.125, dtype)


def _var_msg(**fields: Any) -> bytes:
    return pb.VariableMessage(**fields).SerializeToString()


# (method, request(served), code, words in the details, modes)
BOTH = ("sync", "async")
BAD: dict[str, tuple[str, Callable[[Served], bytes], CODE, str, tuple[str, ...]]] = {
    "send-garbage": ("SendVariable", lambda s: b"\xff" * 16, CODE.INVALID_ARGUMENT, "overlong varint", BOTH),
    "send-garbage-text": ("SendVariable", lambda s: b"garbage!", CODE.INVALID_ARGUMENT, "wire type 7", BOTH),
    "get-garbage": ("GetVariable", lambda s: b"garbage!", CODE.INVALID_ARGUMENT,
                    "does not decode as flotilla.rpc.VariableRequest", BOTH),
    "barrier-garbage": ("Barrier", lambda s: b"\xff" * 16, CODE.INVALID_ARGUMENT,
                        "does not decode as flotilla.rpc.BarrierRequest", BOTH),
    "prefetch-garbage": ("PrefetchVariable", lambda s: b"garbage!", CODE.INVALID_ARGUMENT, "wire type 7", BOTH),
    "complete-garbage": ("Complete", lambda s: b"\x08", CODE.INVALID_ARGUMENT,
                         "does not decode as flotilla.rpc.CompleteRequest", BOTH),
    "checkpoint-garbage": ("CheckpointNotify", lambda s: b"\x0f\x01", CODE.INVALID_ARGUMENT,
                           "does not decode as flotilla.rpc.CheckpointRequest", BOTH),
    "health-garbage": ("Health", lambda s: b"garbage!", CODE.INVALID_ARGUMENT,
                       "does not decode as flotilla.rpc.HealthRequest", BOTH),
    "send-wrong-data-length": ("SendVariable", lambda s: _var_msg(
        name="fc_b@GRAD", dtype="float32", dims=[30], data=b"\0" * 100), CODE.INVALID_ARGUMENT,
        "data holds 100 bytes, expected 120", BOTH),
    "send-unknown-dtype": ("SendVariable", lambda s: _var_msg(name="fc_b@GRAD", dtype="complex64", dims=[30],
                                                              data=b"\0" * 240), CODE.INVALID_ARGUMENT,
                           "dtype 'complex64'", BOTH),
    "send-wrong-dtype": ("SendVariable", lambda s: s.send_bytes("fc_b", _f32((30,), "float64")),
                         CODE.INVALID_ARGUMENT, "dtype float64, expected float32", BOTH),
    "send-wrong-shape": ("SendVariable", lambda s: s.send_bytes("fc_w.block1", _f32((30, 20))),
                         CODE.INVALID_ARGUMENT, "shape [30, 20], expected [20, 30]", BOTH),
    "send-sparse-for-dense": ("SendVariable", lambda s: s.send_bytes("fc_b", SelectedRows(
        np.array([3]), _f32((1,)), 30)), CODE.INVALID_ARGUMENT, "got a selected_rows value, expected lod_tensor", BOTH),
    "send-unknown-variable": ("SendVariable", lambda s: s.send_bytes("fc_b", _f32((30,)), name="fc_bias@GRAD"),
                              CODE.NOT_FOUND, "'fc_bias@GRAD': this pserver receives no such variable", BOTH),
    "get-unknown-variable": ("GetVariable", lambda s: pb.VariableRequest(name="fc_c").SerializeToString(),
                             CODE.NOT_FOUND, "'fc_c': this pserver holds no such variable", BOTH),
    "prefetch-unknown-ids": ("PrefetchVariable", lambda s: encode_variable("ids", np.zeros((2, 1), np.int64)),
                             CODE.NOT_FOUND, "answers no such ids variable", BOTH),
    "send-trainer-out-of-range": ("SendVariable", lambda s: encode_variable(
        "fc_b@GRAD", _f32((30,)), trainer_id=2, seq=1), CODE.INVALID_ARGUMENT,
        "trainer_id 2 is out of range; this pserver serves 2 trainers", BOTH),
    "get-trainer-out-of-range": ("GetVariable", lambda s: pb.VariableRequest(name="fc_b", trainer_id=-3)
                                 .SerializeToString(), CODE.INVALID_ARGUMENT, "trainer_id -3 is out of range", BOTH),
    "barrier-trainer-out-of-range": ("Barrier", lambda s: pb.BarrierRequest(trainer_id=9).SerializeToString(),
                                     CODE.INVALID_ARGUMENT, "trainer_id 9 is out of range", BOTH),
    "complete-trainer-out-of-range": ("Complete", lambda s: pb.CompleteRequest(trainer_id=2, incarnation=inc(2))
                                      .SerializeToString(),
                                      CODE.INVALID_ARGUMENT, "trainer_id 2 is out of range", BOTH),
    "unknown-barrier-kind": ("Barrier", lambda s: pb.BarrierRequest(trainer_id=0, kind=5).SerializeToString(),
                             CODE.INVALID_ARGUMENT, "unknown barrier kind 5; expected SEND or FETCH", BOTH),
    "send-another-trainers-copy": ("SendVariable", lambda s: s.send_bytes("fc_b", _f32((30,)),
                                                                          name="fc_b@GRAD.trainer_1"),
                                   CODE.INVALID_ARGUMENT, "trainer 1's copy, but the request comes from trainer 0",
                                   ("sync",)),
    "send-future-step": ("SendVariable", lambda s: s.send_bytes("fc_b", _f32((30,)), step=4),
                         CODE.FAILED_PRECONDITION, "for step 4, but the pserver is at step 0", ("sync",)),
    "barrier-future-step": ("Barrier", lambda s: pb.BarrierRequest(trainer_id=1, step=3, incarnation=inc(1))
                            .SerializeToString(),
                            CODE.FAILED_PRECONDITION, "SEND barrier of step 3 from trainer 1", ("sync",)),
    # batches: one request per pserver per step, validated whole before anything is stored or applied
    "sendbatch-garbage": ("SendVariables", lambda s: b"\xff" * 16, CODE.INVALID_ARGUMENT, "overlong varint", BOTH),
    "sendbatch-wrong-field": ("SendVariables", lambda s: pb.GetVariablesRequest(names=["fc_b"]).SerializeToString(),
                              CODE.INVALID_ARGUMENT, "a VariableBatch holds field 3", BOTH),
    "sendbatch-empty": ("SendVariables", lambda s: b"", CODE.INVALID_ARGUMENT, "carries no variable", BOTH),
    "sendbatch-truncated": ("SendVariables", lambda s: encode_batch([s.send_bytes("fc_b", _f32((30,)))])[:-7],
                            CODE.INVALID_ARGUMENT, "the batch is truncated", BOTH),
    "sendbatch-one-bad-entry": ("SendVariables", lambda s: encode_batch([
        s.send_bytes("fc_b", _f32((30,))), s.send_bytes("fc_w.block1", _f32((30, 20)))]),
        CODE.INVALID_ARGUMENT, "shape [30, 20], expected [20, 30]", BOTH),
    "sendbatch-bad-entry-wire": ("SendVariables", lambda s: encode_batch([
        s.send_bytes("fc_b", _f32((30,))), _var_msg(name="fc_b@GRAD", dtype="float32", dims=[30], data=b"\0" * 8)]),
        CODE.INVALID_ARGUMENT, "entry 1 of the batch: variable 'fc_b@GRAD': data holds 8 bytes", BOTH),
    "sendbatch-duplicate": ("SendVariables", lambda s: encode_batch([s.send_bytes("fc_b", _f32((30,)))] * 2),
                            CODE.INVALID_ARGUMENT, "more than once", BOTH),
    "sendbatch-nan": ("SendVariables", lambda s: encode_batch([
        s.send_bytes("fc_b", _f32((30,))), s.send_bytes("fc_w.block1", np.full((20, 30), np.nan, np.float32))]),
        CODE.INVALID_ARGUMENT, "NaN or Inf", BOTH),
    "getbatch-garbage": ("GetVariables", lambda s: b"garbage!", CODE.INVALID_ARGUMENT,
                         "does not decode as flotilla.rpc.GetVariablesRequest", BOTH),
    "getbatch-no-names": ("GetVariables", lambda s: pb.GetVariablesRequest(trainer_id=0).SerializeToString(),
                          CODE.INVALID_ARGUMENT, "names no variable", BOTH),
    "getbatch-unknown-variable": ("GetVariables", lambda s: pb.GetVariablesRequest(names=["fc_b", "fc_c"])
                                  .SerializeToString(), CODE.NOT_FOUND, "'fc_c': this pserver holds no such", BOTH),
}
CASES = [(name, mode) for name, case in BAD.items() for mode in case[4]]


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_bad_request_gets_its_status_and_changes_nothing(name: str, mode: str, served: dict[str, Served]) -> None:
    method, request, code, words, _ = BAD[name]
    s = served[mode]
    before = {p: s.raw.get(p) for p in PARAMS}
    snapshot = s.h.snapshot()
    err = s.raw.error(method, request(s))
    assert err.code() == code, err.details()
    assert words in err.details()
    # the server keeps serving: the parameters read back bit-identical, nothing else moved, a send succeeds
    assert {p: s.raw.get(p) for p in PARAMS} == before
    assert s.h.snapshot() == snapshot
    health = s.raw.health()
    assert health.status == pb.HealthReply.SERVING and list(health.live_trainers) == [0, 1]
    s.good_send()
    if mode == "async":
        want = decode_variable(before["fc_b"]).value - np.float32(LR) * np.float32(0.5)
        np.testing.assert_allclose(decode_variable(s.raw.get("fc_b")).value, want, rtol=1e-6, atol=1e-6)


def test_batched_get_answers_in_request_order_bit_exactly(served: dict[str, Served]) -> None:
    for s in served.values():
        one = {p: s.raw.get(p) for p in PARAMS}
        names = list(reversed(PARAMS))
        batch = decode_batch(s.raw.call("GetVariables", pb.GetVariablesRequest(names=names).SerializeToString()))
        assert [d.name for d in batch] == names
        for d in batch:
            assert d.value.tobytes() == decode_variable(one[d.name]).value.tobytes()


def test_batched_send_applies_every_entry(one_served: Callable[[bool], Served]) -> None:
    s = one_served(False)  # async: applied on arrival
    before = {p: decode_variable(s.raw.get(p)).value.copy() for p in PARAMS}
    grads = {p: np.full(SHAPES[p], 0.25 * (i + 1), np.float32) for i, p in enumerate(PARAMS)}
    s.raw.call("SendVariables", encode_batch([s.send_bytes(p, g) for p, g in grads.items()]))
    for p in PARAMS:
        s.sent(p)
    # a retried batch (same seqs) is acknowledged and applies nothing again
    for p in PARAMS:
        s.seq[0, s.h.grad_name(p, 0)] -= 1
    s.raw.call("SendVariables", encode_batch([s.send_bytes(p, g) for p, g in grads.items()]))
    for p in PARAMS:
        want = before[p] - np.float32(LR) * grads[p]
        np.testing.assert_allclose(decode_variable(s.raw.get(p)).value, want, rtol=1e-6, atol=1e-6)


def test_send_after_complete_is_failed_precondition(one_served: Callable[[bool], Served]) -> None:
    s = one_served(True)
    g = {p: np.full(SHAPES[p], 0.5, np.float32) for p in PARAMS}
    for t in (0, 1):
        for p in PARAMS:
            s.raw.call("SendVariable", s.send_bytes(p, g[p], trainer_id=t))
            s.sent(p, t)
    s.raw.call("Complete", pb.CompleteRequest(trainer_id=1, incarnation=inc(1)).SerializeToString())
    before = {p: s.raw.get(p) for p in PARAMS}
    snapshot = s.h.snapshot()
    err = s.raw.error("SendVariable", s.send_bytes("fc_b", _f32((30,)), trainer_id=1))
    assert err.code() == CODE.FAILED_PRECONDITION
    assert "send of 'fc_b@GRAD.trainer_1' from trainer 1, which already sent Complete" in err.details()
    err = s.raw.error("Barrier", pb.BarrierRequest(trainer_id=1, step=0, incarnation=inc(1)).SerializeToString())
    assert err.code() == CODE.FAILED_PRECONDITION and "which already sent Complete" in err.details()
    assert {p: s.raw.get(p) for p in PARAMS} == before
    assert s.h.snapshot() == snapshot
    # Complete is idempotent, and the remaining trainer alone finishes the step; trainer 1's gradients of
    # this step were acknowledged before it completed, so they still count: the step averages both
    s.raw.call("Complete", pb.CompleteRequest(trainer_id=1, incarnation=inc(1)).SerializeToString())
    assert list(s.raw.health().live_trainers) == [0]
    s.raw.call("Barrier", pb.BarrierRequest(trainer_id=0, step=0, kind=pb.SEND, incarnation=inc(0)).SerializeToString())
    for p in PARAMS:
        want = decode_variable(before[p]).value - np.float32(LR) * g[p]
        np.testing.assert_allclose(decode_variable(s.raw.get(p)).value, want, rtol=1e-6, atol=1e-6)


def test_health_reports_serving_and_the_live_trainers(served: dict[str, Served]) -> None:
    for mode, s in served.items():
        h = s.raw.health()
        assert h.status == pb.HealthReply.SERVING
        assert (h.endpoint, h.pserver_id, h.sync_mode) == (s.h.endpoint, 0, mode == "sync")
        assert list(h.live_trainers) == [0, 1] and h.step == 0


def test_health_after_every_trainer_completed_is_not_serving(one_served: Callable[[bool], Served]) -> None:
    s = one_served(False)
    for t in (0, 1):
        s.raw.call("Complete", pb.CompleteRequest(trainer_id=t, incarnation=inc(t)).SerializeToString())
    h = s.raw.health()
    assert h.status == pb.HealthReply.NOT_SERVING and list(h.live_trainers) == []


def test_get_variable_returns_the_parameter_bit_exactly(served: dict[str, Served]) -> None:
    s = served["sync"]
    for p in PARAMS:
        got = decode_variable(s.raw.get(p))
        assert got.name == p and got.value.shape == SHAPES[p]
        assert got.value.tobytes() == np.asarray(s.h.scope.find_var(p)).tobytes()


def test_many_concurrent_garbage_requests_leave_the_server_serving(served: dict[str, Served]) -> None:
    s = served["async"]
    before = {p: s.raw.get(p) for p in PARAMS}
    methods = ["SendVariable", "GetVariable", "Barrier", "PrefetchVariable"]
    rng = np.random.default_rng(3)
    calls = []
    for i in range(200):
        garbage = b"\xff" * int(rng.integers(11, 40)) if i % 2 else b"garbage!" + rng.bytes(int(rng.integers(0, 64)))
        calls.append(s.raw.method(methods[i % len(methods)]).future(garbage, timeout=30.0))
    codes = []
    for call in calls:
        try:
            call.result()
            codes.append(CODE.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
    assert set(codes) == {CODE.INVALID_ARGUMENT}
    assert s.raw.health().status == pb.HealthReply.SERVING
    assert {p: s.raw.get(p) for p in PARAMS} == before


# --- the client ---------------------------------------------------------------------------------------------------
@pytest.mark.serial  # timed: < 3 s for a 1 s deadline
def test_client_against_a_dead_port_fails_within_its_deadline_naming_the_endpoint() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    client = RPCClient(0, deadline=1.0)
    start = time.monotonic()
    try:
        with pytest.raises(RPCError) as info:
            client.get([(endpoint, "fc_b")])
    finally:
        client.close()
    assert time.monotonic() - start < 3.0
    assert endpoint in info.value.message and "did not come up within 1s" in info.value.message


def test_client_errors_carry_the_status_and_name_the_endpoint(one_served: Callable[[bool], Served]) -> None:
    s = one_served(True)
    client = RPCClient(0, deadline=TIMEOUT_S, incarnation=inc(0))  # the incarnation the fixture announced
    try:
        (value,) = client.get([(s.h.endpoint, "fc_b")])
        assert value.tobytes() == decode_variable(s.raw.get("fc_b")).value.tobytes()
        with pytest.raises(RPCError) as info:
            client.get([(s.h.endpoint, "fc_c")])
    finally:
        client.close()  # sends Complete for trainer 0
    assert info.value.status == CODE.NOT_FOUND
    assert s.h.endpoint in info.value.message and "no such variable" in info.value.message
    assert list(s.raw.health().live_trainers) == [1]


# --- listen_and_serv ----------------------------------------------------------------------------------------------
def test_listen_and_serv_serves_until_every_trainer_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLAGS_pserver_timeout_ms", "20000")
    endpoint = f"127.0.0.1:{free_port()}"
    program, startup = pserver_programs(True, endpoint)
    assert listen_op(program).attr("endpoint") == endpoint
    exe, scope = runtime.Executor(), Scope()
    exe.run(startup, scope=scope)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            exe.run(program, scope=scope)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    raw = Raw(endpoint)
    try:
        assert raw.health().status == pb.HealthReply.SERVING
        for t in (0, 1):
            raw.call("Announce", pb.AnnounceRequest(trainer_id=t, incarnation=inc(t)).SerializeToString())
        for t in (0, 1):
            raw.call("Complete", pb.CompleteRequest(trainer_id=t, incarnation=inc(t)).SerializeToString())
        thread.join(JOIN_S)
        assert not thread.is_alive(), "listen_and_serv did not return after every trainer completed"
        assert errors == []
    finally:
        raw.close()
    # the server is gone: a fresh channel cannot connect
    probe = grpc.insecure_channel(endpoint, options=grpc_options(0))
    try:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(probe).result(timeout=0.5)
    finally:
        probe.close()


def test_a_barrier_names_the_lost_pserver_not_the_live_one_it_waited_on(tracker: Tracker) -> None:
    """Trainer 0's SEND barrier goes to two pservers; one is stopped. The live one's barrier can only time
    out (trainer 1 never comes), the lost one's is UNAVAILABLE: the error raised names the lost one."""
    live, lost = (build_pserver(True, serve=True, tracker=tracker) for _ in range(2))
    client = RPCClient(0, deadline=2.0, incarnation=inc(0))
    try:
        client.announce([live.endpoint, lost.endpoint])
        assert lost.server is not None
        lost.server.stop(None).wait(JOIN_S)
        with pytest.raises(RPCError) as info:
            client.barrier([live.endpoint, lost.endpoint], send=True)
    finally:
        with pytest.raises(RPCError, match=lost.endpoint):  # its Complete cannot reach the lost one either
            client.close()
    assert info.value.status == CODE.UNAVAILABLE and lost.endpoint in info.value.message, info.value.message
