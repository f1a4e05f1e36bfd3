"""The same-host data plane (runtime/rpc/shm.py) against a real gRPC pserver on 127.0.0.1.

Values travel bit-exactly both ways through shared memory (a distributed table's prefetch too: equal to
the gRPC prefetch bit for bit, its forged, replayed, stale and out-of-shard requests refused with nothing
changed, gRPC once the control socket breaks); every bad request of test_server_errors.py that a data-plane
call can carry gets the same status and changes nothing; forged, truncated, oversized, out-of-range,
replayed and stale references are refused before a byte is read; segments are removed when the trainer's
incarnation changes, when it completes, when it is killed, and when the pserver stops;
``FLAGS_rpc_data_plane=off`` on either side gives pure gRPC. (The end-to-end trust and fault
tests of test_ps_training.py run over the data plane too: ``DATA_PLANE`` there.)
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import pytest

from runtime.flags import FlagError, data_plane_mode
from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.client import RPCClient, RPCError
from runtime.rpc.shm import (ALIGN_SLACK, CONTROL_GET, CONTROL_OK, CONTROL_PREFETCH, CONTROL_SEND, HEADER_BYTES,
                             NONCE_BYTES, TENSOR_ALIGN, BatchWriter, ControlFailed, PServerPlane, Segment, ShmError,
                             TrainerPlane, create_segment, leftover_segments, open_segment, ref_mac, write_batch)
from runtime.rpc.wire import decode_batch, encode_batch, encode_parts
from runtime.scope import SelectedRows
from tests.runtime.rpc.conftest import LR, PARAMS, PSHandle, Tracker, build_pserver, inc
from tests.runtime.rpc.test_server_errors import BAD, Raw, Served

CODE = grpc.StatusCode
REPO = pathlib.Path(__file__).resolve().parents[3]
ROOM = 1 << 16


class PlaneServed(Served):
    """A served PServer, a raw channel, and trainer 0's data plane to it: a client whose fetches and sends
    of any size take the data plane, and one segment held busy for hand-made references."""

    def __init__(self, handle: PSHandle) -> None:
        super().__init__(handle)
        self.client = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto")
        self.client.shm_threshold = 1
        got = self.client._segment(handle.endpoint, ROOM)
        assert got is not None, self.client._plane(handle.endpoint)
        self.plane, self.seg = got
        self.seq = self.seq  # per-variable send seqs (Served)
        self.ref_seq = 1 << 40  # above anything the client itself uses

    def put(self, payload: bytes) -> int:
        """Write ``payload`` at the start of the held segment's data area; its length."""
        self.seg.view(HEADER_BYTES, len(payload))[:] = payload
        return len(payload)

    def ref(self, length: int, purpose: bytes = b"send", **fields: Any) -> pb.ShmRef:
        """A correctly signed reference to the held segment (``fields`` override before signing)."""
        self.ref_seq += 1
        base = dict(trainer_id=0, incarnation=inc(0), segment=self.seg.number, offset=HEADER_BYTES, length=length,
                    seq=self.ref_seq)
        base.update(fields)
        ref = pb.ShmRef(**base)
        ref.mac = ref_mac(self.plane.key, purpose, ref)
        return ref

    def shm_send(self, payload: bytes) -> bytes:
        return self.raw.call("ShmSend", self.ref(self.put(payload)).SerializeToString())

    def good_send(self) -> None:
        """A valid gradient of fc_b from trainer 0, through the data plane."""
        self.shm_send(encode_batch([self.send_bytes("fc_b", np.full((30,), 0.5, np.float32))]))
        self.sent("fc_b")

    def close(self) -> None:
        self.plane.give_back(self.seg)
        self.client.close()
        self.raw.close()


@pytest.fixture(scope="module")
def planes() -> Iterator[dict[str, PlaneServed]]:
    tracker = Tracker()
    out = {mode: PlaneServed(build_pserver(mode == "sync", serve=True, tracker=tracker)) for mode in ("sync", "async")}
    yield out
    for s in out.values():
        s.close()
    tracker.close()


def _same_state(s: PlaneServed, before: dict[str, bytes], snapshot: Any) -> None:
    """The pserver kept serving and changed nothing; a good send through the data plane then works."""
    assert {p: s.raw.get(p) for p in PARAMS} == before
    assert s.h.snapshot() == snapshot
    health = s.raw.health()
    assert health.status == pb.HealthReply.SERVING and list(health.live_trainers) == [0, 1]
    s.good_send()


# --- values through shared memory -----------------------------------------------------------------------------------
def test_an_aligned_batch_puts_each_tensor_on_a_64_byte_boundary_and_parses_as_plain_protobuf() -> None:
    rng = np.random.default_rng(5)
    values = {"w": rng.normal(size=(429, 400)).astype(np.float32), "tiny": np.arange(3, dtype=np.int64),
              "rows": SelectedRows(np.arange(0, 600, 3), rng.normal(size=(200, 16)).astype(np.float32), 600),
              "d": rng.normal(size=(7, 33)).astype(np.float64)}
    memory = np.zeros(1 << 21, np.uint8)
    for start in range(0, 70, 13):  # wherever the slot and the entries before it begin
        view = memoryview(memory)[start:]
        writer = BatchWriter(view, align=True)
        for name, value in values.items():
            writer.put_parts(*encode_parts(name, value))
        decoded = decode_batch(view[:writer.pos])
        assert [d.name for d in decoded] == list(values)
        for d in decoded:
            got, want = (d.value.values, values[d.name].values) if d.name == "rows" else (d.value, values[d.name])
            np.testing.assert_array_equal(got, want)
            if want.nbytes >= 512:
                assert got.ctypes.data % TENSOR_ALIGN == 0, (start, d.name)
        assert len(pb.VariableBatch.FromString(bytes(view[:writer.pos])).vars) == len(values)  # pad: a known field
        plain = BatchWriter(view)
        for name, value in values.items():
            plain.put_parts(*encode_parts(name, value))
        assert writer.pos - plain.pos <= 3 * ALIGN_SLACK  # three tensors padded, at most the slack each


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_values_travel_bit_exactly_through_shared_memory(mode: str, planes: dict[str, PlaneServed]) -> None:
    s = planes[mode]
    c, ep = s.client, s.h.endpoint
    first = c.get([(ep, p) for p in PARAMS])  # learns the sizes (gRPC) ...
    second = c.get([(ep, p) for p in PARAMS])  # ... and then fetches through a segment
    plane = c._plane(ep)
    assert plane is not None and plane.state is True
    for p, a, b in zip(PARAMS, first, second):
        want = np.asarray(s.h.scope.find_var(p))
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b, want)
        assert any(np.shares_memory(b, seg.array) for seg in plane.segments), f"{p} did not come through shm"
        assert not b.flags.writeable
        if b.nbytes >= 512:  # read in place, and aligned so that XLA uses it in place too
            assert b.ctypes.data % TENSOR_ALIGN == 0, p
    # a later fetch never overwrites a value still held: it takes another segment
    third = c.get([(ep, p) for p in PARAMS])
    np.testing.assert_array_equal(second[0], third[0])
    assert not any(np.shares_memory(second[0], t) for t in third)
    grad = np.random.default_rng(3).normal(size=(30,)).astype(np.float32)
    name = s.h.grad_name("fc_b", 0)
    before = np.asarray(s.h.scope.find_var("fc_b")).copy()
    c.send(ep, name, grad)
    c.wait_sends()
    s.seq[0, name] += 1  # the client used that seq
    if mode == "sync":
        np.testing.assert_array_equal(np.asarray(s.h.scope.find_var(name)), grad)
    else:
        np.testing.assert_allclose(np.asarray(s.h.scope.find_var("fc_b")), before - np.float32(LR) * grad, rtol=1e-6)
    assert leftover_segments(pid=os.getpid()) == [], "a mapped segment keeps no name in /dev/shm"


def test_a_full_ring_sends_that_fetch_through_grpc(tracker: Tracker) -> None:
    from runtime.rpc.shm import MAX_SEGMENTS

    h = build_pserver(True, serve=True, tracker=tracker)
    c = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto")
    c.shm_threshold = 1
    try:
        c.get([(h.endpoint, "fc_b")])  # learns the size
        held = [c.get([(h.endpoint, "fc_b")])[0] for _ in range(MAX_SEGMENTS + 2)]  # every value kept alive
        plane = c._plane(h.endpoint)
        assert plane is not None and plane.state is True and len(plane.segments) == MAX_SEGMENTS
        via_shm = [any(np.shares_memory(v, seg.array) for seg in plane.segments) for v in held]
        assert via_shm == [True] * MAX_SEGMENTS + [False, False]
        for v in held:
            np.testing.assert_array_equal(v, np.asarray(h.scope.find_var("fc_b")))
        del held, v
        assert c.get([(h.endpoint, "fc_b")])[0] is not None and len(plane.segments) == MAX_SEGMENTS  # reused
    finally:
        c.close()


# --- every bad request a data-plane call can carry --------------------------------------------------------------------
SEND_CASES = [(n, m) for n, case in BAD.items()
              if case[0] in ("SendVariable", "SendVariables") and n != "sendbatch-empty" for m in case[4]]
# Where the data plane refuses earlier than the pserver would (its own check of whose gradients a
# trainer's segment carries), the words differ; the status is the same.
SHM_WORDS = {"send-trainer-out-of-range": "carries 'fc_b@GRAD' of trainer 2"}
GET_CASES = [(n, m) for n, case in BAD.items()
             if case[0] == "GetVariables" and n != "getbatch-garbage" for m in case[4]]


@pytest.mark.parametrize("name,mode", SEND_CASES, ids=[f"{n}-{m}" for n, m in SEND_CASES])
def test_a_bad_send_through_shared_memory_gets_its_status_and_changes_nothing(
        name: str, mode: str, planes: dict[str, PlaneServed]) -> None:
    method, request, code, words, _ = BAD[name]
    s = planes[mode]
    before, snapshot = {p: s.raw.get(p) for p in PARAMS}, s.h.snapshot()
    raw = request(s)
    batch = encode_batch([raw]) if method == "SendVariable" else raw
    err = s.raw.error("ShmSend", s.ref(s.put(batch)).SerializeToString())
    assert err.code() == code, err.details()
    assert SHM_WORDS.get(name, words) in err.details()
    _same_state(s, before, snapshot)


@pytest.mark.parametrize("name,mode", GET_CASES, ids=[f"{n}-{m}" for n, m in GET_CASES])
def test_a_bad_get_through_shared_memory_gets_its_status(name: str, mode: str, planes: dict[str, PlaneServed]) -> None:
    _, request, code, words, _ = BAD[name]
    s = planes[mode]
    before, snapshot = {p: s.raw.get(p) for p in PARAMS}, s.h.snapshot()
    req = pb.ShmGetRequest(get=pb.GetVariablesRequest.FromString(request(s)), slot=s.ref(ROOM, b"slot"))
    err = s.raw.error("ShmGet", req.SerializeToString())
    assert err.code() == code, err.details()
    assert words in err.details()
    _same_state(s, before, snapshot)


# --- the control socket: the same handlers, checks and statuses as gRPC ------------------------------------------------
def test_transfers_take_the_control_socket(tracker: Tracker) -> None:
    h = build_pserver(True, serve=True, tracker=tracker)
    c = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto")
    c.shm_threshold = 1
    control = h.pserver.data_plane.control
    try:
        c.get([(h.endpoint, "fc_w.block1")])  # learns the size (gRPC)
        assert control is not None and control.calls == 0
        got = c.get([(h.endpoint, "fc_w.block1")])[0]
        grad = np.full(30, 0.5, np.float32)
        c.send(h.endpoint, h.grad_name("fc_b", 0), grad)
        c.wait_sends()
        assert control.calls == 2 and control.connections() == 1  # one connection, reused
        np.testing.assert_array_equal(got, np.asarray(h.scope.find_var("fc_w.block1")))
        np.testing.assert_array_equal(np.asarray(h.scope.find_var(h.grad_name("fc_b", 0))), grad)
    finally:
        c.close()
    h.server.stop(grace=None).wait(5.0)
    h.pserver.close()  # the control socket goes with the pserver
    assert control.connections() == 0


CONTROL_REFS = ["bad-mac", "mac-of-a-reply", "truncated", "oversized", "unknown-segment", "stale-incarnation",
                "zero-seq"]


@pytest.mark.parametrize("case", CONTROL_REFS)
def test_a_bad_reference_through_the_control_socket_gets_the_grpc_status(case: str,
                                                                        planes: dict[str, PlaneServed]) -> None:
    make, code, words = REFS[case]
    s = planes["sync"]
    before, snapshot = {p: s.raw.get(p) for p in PARAMS}, s.h.snapshot()
    status, message = s.plane.call(CONTROL_SEND, make(s, s.put(_grad_batch(s))).SerializeToString(), 10.0)
    assert status == code.name and words in message.decode(), message
    _same_state(s, before, snapshot)


def test_a_replayed_or_bad_request_through_the_control_socket_is_refused(planes: dict[str, PlaneServed]) -> None:
    s = planes["async"]
    ref = s.ref(s.put(_grad_batch(s)))
    assert s.plane.call(CONTROL_SEND, ref.SerializeToString(), 10.0) == ("OK", pb.Reply().SerializeToString())
    s.sent("fc_b")
    before, snapshot = {p: s.raw.get(p) for p in PARAMS}, s.h.snapshot()
    status, message = s.plane.call(CONTROL_SEND, ref.SerializeToString(), 10.0)
    assert status == "INVALID_ARGUMENT" and b"a replayed reference is refused" in message
    req = pb.ShmGetRequest(get=pb.GetVariablesRequest(names=["nope"]), slot=s.ref(ROOM, b"slot"))
    status, message = s.plane.call(CONTROL_GET, req.SerializeToString(), 10.0)
    assert status == "NOT_FOUND" and b"no such variable" in message
    status, message = s.plane.call(b"X", b"", 10.0)
    assert status == "INVALID_ARGUMENT" and b"unknown control-socket method" in message
    _same_state(s, before, snapshot)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_pipelined_send_arrives_bit_exactly(mode: str, tracker: Tracker, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.rpc import client as client_mod, shm

    monkeypatch.setattr(client_mod, "PIPELINE_MIN_BYTES", 1)  # every send pipelined ...
    monkeypatch.setattr(shm, "PIECE_BYTES", 24)  # ... in many pieces, none aligned to an element
    h = build_pserver(mode == "sync", serve=True, tracker=tracker)
    c = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto")
    c.shm_threshold = 1
    try:
        c.get([(h.endpoint, "fc_b")])  # a segment, and the control socket
        control = h.pserver.data_plane.control
        before, calls = np.asarray(h.scope.find_var("fc_b")).copy(), control.calls
        grad = np.random.default_rng(5).normal(size=(30,)).astype(np.float32)
        c.send(h.endpoint, h.grad_name("fc_b", 0), grad)
        c.wait_sends()
        assert control.calls == calls + 1
        if mode == "sync":
            np.testing.assert_array_equal(np.asarray(h.scope.find_var(h.grad_name("fc_b", 0))), grad)
        else:
            np.testing.assert_allclose(np.asarray(h.scope.find_var("fc_b")), before - np.float32(LR) * grad, rtol=1e-6)
        bad = np.full(30, np.nan, np.float32)  # checked finite piece by piece, as it is copied out
        with pytest.raises(RPCError, match="NaN or Inf"):
            c.send(h.endpoint, h.grad_name("fc_b", 0), bad)
            c.wait_sends()
    finally:
        c.close()


def _pipelined(s: PlaneServed, request: bytes, reports: list[bytes]) -> bytes:
    """Send a pipelined request and ``reports`` on a connection of its own; the answer (b"": closed)."""
    import socket

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(10)
    try:
        conn.connect(s.plane.control)
        conn.send(b"P" + request)
        for r in reports:
            conn.send(r)
        return conn.recv(1 << 16)
    finally:
        conn.close()


def test_a_pipelined_send_that_breaks_off_or_lies_keeps_nothing(planes: dict[str, PlaneServed]) -> None:
    import struct

    s = planes["sync"]
    n = s.put(_grad_batch(s))
    before, snapshot = {p: s.raw.get(p) for p in PARAMS}, s.h.snapshot()
    report = struct.Struct("<cQ").pack
    # garbage progress: no answer, the connection is dropped
    assert _pipelined(s, s.ref(n).SerializeToString(), [b"garbage"]) == b""
    # the trainer says it wrote less than its reference covers
    answer = _pipelined(s, s.ref(n).SerializeToString(), [report(b"R", 8), report(b"F", 16)])
    assert answer.startswith(b"\1INVALID_ARGUMENT\n") and b"ended at byte 16" in answer
    # progress going backwards
    assert _pipelined(s, s.ref(n).SerializeToString(), [report(b"R", 16), report(b"R", 8)]) == b""
    # refused before reading (bad MAC): the reports are read to the last, the answer says why
    forged = pb.ShmRef(**{**_fields(s.ref(n)), "mac": b"\0" * 32})
    answer = _pipelined(s, forged.SerializeToString(), [report(b"R", 16), report(b"F", n)])
    assert answer.startswith(b"\1INVALID_ARGUMENT\n") and b"does not carry a valid HMAC" in answer
    _same_state(s, before, snapshot)


def test_without_a_control_socket_the_data_plane_takes_grpc(tracker: Tracker) -> None:
    h = build_pserver(True, serve=True, tracker=tracker)
    c = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto")
    c.shm_threshold = 1
    try:
        c.get([(h.endpoint, "fc_b")])
        plane = c._plane(h.endpoint)
        c.get([(h.endpoint, "fc_b")])
        assert plane is not None and plane.control is not None
        control = h.pserver.data_plane.control
        control.close()  # the trainer's connection breaks; the references still go, over gRPC
        before = control.calls
        got = c.get([(h.endpoint, "fc_b")])[0]
        assert plane.control is None and plane.state is True and control.calls == before
        assert any(np.shares_memory(got, seg.array) for seg in plane.segments)
        np.testing.assert_array_equal(got, np.asarray(h.scope.find_var("fc_b")))
        with pytest.raises(ControlFailed):
            plane.call(CONTROL_GET, b"", 1.0)
    finally:
        c.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_the_control_socket_serves_only_this_user(planes: dict[str, PlaneServed]) -> None:
    s = planes["sync"]
    address = s.plane.control
    assert address is not None
    other = textwrap.dedent(f"""
        import os, socket
        os.setgid(65534); os.setuid(65534)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(10)
        conn.connect({address!r})
        try:
            conn.send(b"S" + b"x" * 8)
            print("answer", conn.recv(1 << 16))
        except OSError as e:
            print("refused", e)
    """)
    done = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(("answer b''", "refused")), done.stdout


# --- references: forged, truncated, oversized, out of range, replayed, stale ------------------------------------------
def _grad_batch(s: PlaneServed) -> bytes:
    return encode_batch([s.send_bytes("fc_b", np.full((30,), 0.25, np.float32))])


REFS: dict[str, tuple[Callable[[PlaneServed, int], pb.ShmRef], CODE, str]] = {
    "bad-mac": (lambda s, n: pb.ShmRef(**{**_fields(s.ref(n)), "mac": b"\0" * 32}), CODE.INVALID_ARGUMENT,
                "does not carry a valid HMAC"),
    "no-mac": (lambda s, n: pb.ShmRef(**{**_fields(s.ref(n)), "mac": b""}), CODE.INVALID_ARGUMENT,
               "does not carry a valid HMAC"),
    "mac-of-other-fields": (lambda s, n: pb.ShmRef(**{**_fields(s.ref(n)), "length": n + 8}), CODE.INVALID_ARGUMENT,
                            "does not carry a valid HMAC"),
    "mac-of-a-reply": (lambda s, n: s.ref(n, b"reply"), CODE.INVALID_ARGUMENT, "does not carry a valid HMAC"),
    "mac-of-another-key": (lambda s, n: _resigned(s.ref(n), b"not the key"), CODE.INVALID_ARGUMENT,
                           "does not carry a valid HMAC"),
    "truncated": (lambda s, n: s.ref(n - 7), CODE.INVALID_ARGUMENT, "the batch is truncated"),
    "empty": (lambda s, n: s.ref(0), CODE.INVALID_ARGUMENT, "are not in the data area"),
    "oversized": (lambda s, n: s.ref(s.seg.size), CODE.INVALID_ARGUMENT, "are not in the data area"),
    "past-the-end": (lambda s, n: s.ref(n, offset=s.seg.size - n + 1), CODE.INVALID_ARGUMENT,
                     "are not in the data area"),
    "huge-offset": (lambda s, n: s.ref(n, offset=(1 << 64) - 8), CODE.INVALID_ARGUMENT, "are not in the data area"),
    "into-the-header": (lambda s, n: s.ref(n, offset=0), CODE.INVALID_ARGUMENT, "are not in the data area"),
    "unknown-segment": (lambda s, n: s.ref(n, segment=99), CODE.INVALID_ARGUMENT, "names segment 99"),
    "stale-incarnation": (lambda s, n: s.ref(n, incarnation=inc(0) + 2), CODE.FAILED_PRECONDITION,
                          "its segments belong to"),
    # without a job token each trainer's references are keyed by its own random key
    "another-trainers-reference": (lambda s, n: s.ref(n, trainer_id=1, incarnation=inc(1)), CODE.INVALID_ARGUMENT,
                                   "does not carry a valid HMAC"),
    "zero-seq": (lambda s, n: s.ref(n, seq=0), CODE.INVALID_ARGUMENT, "seq 0 was used already or is too old"),
}


def _fields(ref: pb.ShmRef) -> dict[str, Any]:
    return {f.name: getattr(ref, f.name) for f in pb.ShmRef.DESCRIPTOR.fields}


def _resigned(ref: pb.ShmRef, key: bytes) -> pb.ShmRef:
    ref.mac = ref_mac(key, b"send", ref)
    return ref


REF_CASES = [(n, m) for n in REFS for m in ("sync", "async")]


@pytest.mark.parametrize("case,mode", REF_CASES, ids=[f"{n}-{m}" for n, m in REF_CASES])
def test_a_bad_reference_is_refused_before_anything_is_read(case: str, mode: str,
                                                           planes: dict[str, PlaneServed]) -> None:
    make, code, words = REFS[case]
    s = planes[mode]
    before, snapshot = {p: s.raw.get(p) for p in PARAMS}, s.h.snapshot()
    n = s.put(_grad_batch(s))
    err = s.raw.error("ShmSend", make(s, n).SerializeToString())
    assert err.code() == code, err.details()
    assert words in err.details(), err.details()
    _same_state(s, before, snapshot)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_replayed_reference_is_refused(mode: str, planes: dict[str, PlaneServed]) -> None:
    s = planes[mode]
    ref = s.ref(s.put(_grad_batch(s)))
    s.raw.call("ShmSend", ref.SerializeToString())
    s.sent("fc_b")
    before, snapshot = {p: s.raw.get(p) for p in PARAMS}, s.h.snapshot()
    err = s.raw.error("ShmSend", ref.SerializeToString())
    assert err.code() == CODE.INVALID_ARGUMENT and "a replayed reference is refused" in err.details()
    _same_state(s, before, snapshot)


def test_a_get_slot_too_small_is_resource_exhausted(planes: dict[str, PlaneServed]) -> None:
    s = planes["sync"]
    req = pb.ShmGetRequest(get=pb.GetVariablesRequest(names=list(PARAMS)), slot=s.ref(100, b"slot"))
    err = s.raw.error("ShmGet", req.SerializeToString())
    assert err.code() == CODE.RESOURCE_EXHAUSTED, err.details()
    req = pb.ShmGetRequest(get=pb.GetVariablesRequest(names=list(PARAMS), trainer_id=1), slot=s.ref(ROOM, b"slot"))
    assert s.raw.error("ShmGet", req.SerializeToString()).code() == CODE.INVALID_ARGUMENT  # another trainer's slot


def test_a_send_carrying_another_trainers_gradient_is_refused(planes: dict[str, PlaneServed]) -> None:
    s = planes["async"]
    before, snapshot = {p: s.raw.get(p) for p in PARAMS}, s.h.snapshot()
    batch = encode_batch([s.send_bytes("fc_b", np.full((30,), 0.5, np.float32), trainer_id=1)])
    err = s.raw.error("ShmSend", s.ref(s.put(batch)).SerializeToString())
    assert err.code() == CODE.INVALID_ARGUMENT and "of trainer 1" in err.details()
    _same_state(s, before, snapshot)


def test_without_the_token_the_data_plane_is_unauthenticated(tracker: Tracker) -> None:
    from runtime.flags import RPCSecurity

    h = build_pserver(False, serve=True, tracker=tracker, security=RPCSecurity(token="s3cret"))
    raw = Raw(h.endpoint)
    try:
        for method, req in (("ShmOpen", pb.ShmOpenRequest(trainer_id=0, incarnation=inc(0), min_bytes=1)),
                            ("ShmSend", pb.ShmRef(trainer_id=0)), ("ShmGet", pb.ShmGetRequest())):
            assert raw.error(method, req.SerializeToString()).code() == CODE.UNAUTHENTICATED
    finally:
        raw.close()
    assert h.pserver.data_plane.segment_paths() == []
    c = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto", security=RPCSecurity(token="s3cret"))
    c.shm_threshold = 1
    try:
        c.get([(h.endpoint, "fc_b")])
        np.testing.assert_array_equal(c.get([(h.endpoint, "fc_b")])[0], np.asarray(h.scope.find_var("fc_b")))
        assert c._plane(h.endpoint).key == b"s3cret" and len(h.pserver.data_plane.segment_paths()) == 1
    finally:
        c.close()


# --- segment lifetime -------------------------------------------------------------------------------------------------
def test_segments_go_with_the_incarnation_the_trainer_and_the_pserver(tracker: Tracker) -> None:
    from runtime.flags import RPCSecurity

    token = RPCSecurity(token="job-secret")  # the references of every incarnation are keyed alike
    h = build_pserver(False, serve=True, tracker=tracker, security=token)  # async: a rejoin is immediate
    plane = h.pserver.data_plane
    old = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto", security=token)
    old.shm_threshold = 1
    old.get([(h.endpoint, "fc_b")])
    old.get([(h.endpoint, "fc_b")])
    assert len(plane.segment_paths()) == 1
    new = RPCClient(0, incarnation=inc(0) + 2, deadline=10.0, data_plane="auto", security=token)
    new.shm_threshold = 1
    new.announce([h.endpoint])  # the restarted trainer: its predecessor's segments are dropped
    assert plane.segment_paths() == []
    with pytest.raises(RPCError) as e:
        old._get_shm(h.endpoint, ["fc_b"])
    assert e.value.status == CODE.FAILED_PRECONDITION and "holds no segment here" in str(e.value)
    new.get([(h.endpoint, "fc_b")])  # learns the size
    new.get([(h.endpoint, "fc_b")])  # maps a segment
    with pytest.raises(RPCError) as e:  # the segment numbers now name the new incarnation's segments
        old._get_shm(h.endpoint, ["fc_b"])
    assert e.value.status == CODE.FAILED_PRECONDITION and "belong to another incarnation" in str(e.value)
    np.testing.assert_array_equal(new.get([(h.endpoint, "fc_b")])[0], np.asarray(h.scope.find_var("fc_b")))
    assert len(plane.segment_paths()) == 1
    new.close()  # Complete: the trainer is done, its segments go
    assert plane.segment_paths() == []
    old._closed = True  # its incarnation is gone: nothing to complete
    other = RPCClient(1, incarnation=inc(1), deadline=10.0, data_plane="auto", security=token)
    other.shm_threshold = 1
    other.get([(h.endpoint, "fc_b")])
    other.get([(h.endpoint, "fc_b")])
    assert len(plane.segment_paths()) == 1
    h.server.stop(None).wait(5.0)
    h.pserver.close()
    assert plane.segment_paths() == [] and leftover_segments(pid=os.getpid()) == []
    for c in (old, other):
        for p in c._planes.values():
            p.close()


KILLED_TRAINER = """
import sys, time
from runtime.rpc.client import RPCClient
c = RPCClient(1, incarnation=int(sys.argv[2]), deadline=10.0, data_plane="auto")
c.shm_threshold = 1
values = [c.get([(sys.argv[1], "fc_b")]) for _ in range(2)]
print("mapped", len(c._planes[sys.argv[1]].segments), flush=True)
time.sleep(60)
"""


@pytest.mark.serial  # trainer processes, one killed
def test_a_killed_trainer_leaves_nothing_and_the_pserver_serves_the_others(tracker: Tracker) -> None:
    h = build_pserver(False, serve=True, tracker=tracker, authenticated=True)
    plane = h.pserver.data_plane
    survivor = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto")
    survivor.shm_threshold = 1
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, h.endpoint, str(inc(1))], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()  # bounded: the child's RPC deadline is 10 s
        assert line.startswith("mapped 1"), line + proc.stdout.read() if proc.poll() is not None else line
        assert len(plane.segment_paths()) == 1
        assert leftover_segments(pid=os.getpid()) == []  # the trainer unlinked the name once it mapped it
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
    # the pserver keeps serving the others through the data plane
    survivor.get([(h.endpoint, "fc_b")])
    np.testing.assert_array_equal(survivor.get([(h.endpoint, "fc_b")])[0], np.asarray(h.scope.find_var("fc_b")))
    grad = np.full((30,), 0.5, np.float32)
    before = np.asarray(h.scope.find_var("fc_b")).copy()
    survivor.send(h.endpoint, h.grad_name("fc_b", 0), grad)
    survivor.wait_sends()
    np.testing.assert_allclose(np.asarray(h.scope.find_var("fc_b")), before - np.float32(LR) * grad, rtol=1e-6)
    # the killed trainer's restart drops its segments
    restarted = RPCClient(1, incarnation=inc(1) + 2, deadline=10.0, data_plane="auto")
    restarted.announce([h.endpoint])
    assert len(plane.segment_paths()) == 1  # the survivor's
    for c in (survivor, restarted):
        c.close()


# --- FLAGS_rpc_data_plane=off -----------------------------------------------------------------------------------
def test_a_send_applied_before_the_control_socket_broke_is_not_applied_again(tracker: Tracker) -> None:
    """The pserver applies a send that came through the control socket, then the socket breaks before the
    answer leaves: the trainer sends the segment again over gRPC (a fresh reference, the variables' same
    seqs), which the pserver drops as a retry (async mode: a second apply would move the parameter twice)."""
    h = build_pserver(False, serve=True, tracker=tracker)
    control = h.pserver.data_plane.control
    handle, applied = control._handle, []

    def applied_then_broken(method: bytes, request: bytes, progress: Any) -> bytes:
        answer = handle(method, request, progress)
        if method == CONTROL_SEND and not applied:
            applied.append(answer[:1])
            raise ConnectionResetError("the control socket broke after the pserver applied the send")
        return answer

    control._handle = applied_then_broken
    c = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto")
    c.shm_threshold = 1
    try:
        c.get([(h.endpoint, "fc_b")])  # the segments are open: the send below takes the control socket
        before = np.asarray(h.scope.find_var("fc_b")).copy()
        grad = np.full((30,), 0.5, np.float32)
        for times in (1, 2):  # the second send (seq 2) is applied as usual
            c.send(h.endpoint, h.grad_name("fc_b", 0), grad)
            c.wait_sends()
            np.testing.assert_allclose(np.asarray(h.scope.find_var("fc_b")), before - times * np.float32(LR) * grad,
                                       rtol=1e-6)
        assert applied == [CONTROL_OK]  # the first send was applied, its answer lost
    finally:
        c.close()


def test_off_on_the_trainer_is_pure_grpc(tracker: Tracker) -> None:
    h = build_pserver(True, serve=True, tracker=tracker)
    c = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="off")
    c.shm_threshold = 1
    try:
        for _ in range(2):
            np.testing.assert_array_equal(c.get([(h.endpoint, "fc_b")])[0], np.asarray(h.scope.find_var("fc_b")))
        c.send(h.endpoint, h.grad_name("fc_b", 0), np.ones(30, np.float32))
        c.wait_sends()
        assert c._planes == {} and h.pserver.data_plane.segment_paths() == []
    finally:
        c.close()


def test_off_on_the_pserver_leaves_the_trainer_on_grpc(tracker: Tracker) -> None:
    from runtime.kernels.rpc import max_message_bytes
    from runtime.rpc.server import start_server

    h = build_pserver(True, serve=False, tracker=tracker)
    endpoint = f"127.0.0.1:{__import__('runtime.launch', fromlist=['free_ports']).free_ports(1)[0]}"
    h.server = start_server(h.pserver, endpoint, max_message_bytes(h.program), data_plane="off")
    c = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto")
    c.shm_threshold = 1
    try:
        for _ in range(3):
            np.testing.assert_array_equal(c.get([(endpoint, "fc_b")])[0], np.asarray(h.scope.find_var("fc_b")))
        plane = c._planes[endpoint]
        assert plane.state is False and "FLAGS_rpc_data_plane=off" in plane.reason
        assert h.pserver.data_plane.segment_paths() == []
    finally:
        c.close()


def test_the_flag_reads_off_auto_and_tcp_only() -> None:
    assert data_plane_mode({}) == "auto"
    assert data_plane_mode({"FLAGS_rpc_data_plane": "OFF"}) == "off"
    assert data_plane_mode({"FLAGS_rpc_data_plane": " tcp"}) == "tcp"
    with pytest.raises(FlagError, match="FLAGS_rpc_data_plane='shm' is not one of"):
        data_plane_mode({"FLAGS_rpc_data_plane": "shm"})


# --- segment files ----------------------------------------------------------------------------------------------------
def _reply_for(seg: Segment, nonce: bytes, **over: Any) -> pb.ShmOpenReply:
    return pb.ShmOpenReply(**{"path": seg.path, "segment": 0, "size": seg.size, "nonce": nonce, **over})


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="mounting a small tmpfs in a private mount namespace needs root and unshare")
def test_a_segment_is_reserved_when_made_so_a_full_dev_shm_is_an_error_not_a_bus_error(
        tmp_path: pathlib.Path) -> None:
    """A segment's pages are allocated when it is made (posix_fallocate): in a 1 MiB tmpfs (a container's
    small /dev/shm) a 4 MiB segment is ENOSPC at once and leaves no file, where a sparse file would have
    been made and killed its first writer with SIGBUS; a segment that fits is written end to end."""
    room = tmp_path / "shm"
    room.mkdir()
    script = textwrap.dedent(f"""
        import errno, os
        from runtime.rpc.shm import create_segment
        try:
            create_segment(0, 4 << 20, {str(room)!r})
            print("made")
        except OSError as e:
            print("ENOSPC" if e.errno == errno.ENOSPC else f"errno {{e.errno}}")
        print(sorted(os.listdir({str(room)!r})))
        seg, _ = create_segment(1, 256 << 10, {str(room)!r})
        seg.array[:] = 7
        print("written", int(seg.array[-1]))
    """)
    run = subprocess.run(["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "{room}" || exit 77; '
                          f'exec "{sys.executable}" -c "$0"', script], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    if run.returncode == 77:
        pytest.skip(f"no tmpfs mount here: {run.stderr.strip()}")
    assert (run.returncode, run.stdout) == (0, "ENOSPC\n[]\nwritten 7\n"), run.stderr
    assert list(room.iterdir()) == []  # the mount went with its namespace


def test_a_segment_is_private_and_its_name_goes_once_mapped() -> None:
    seg, nonce = create_segment(0, 1 << 20)
    try:
        st = os.stat(seg.path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid() and st.st_size == 1 << 20
        mapped = open_segment(_reply_for(seg, nonce))
        assert not os.path.exists(seg.path)
        mapped.view(HEADER_BYTES, 4)[:] = b"abcd"
        assert bytes(seg.view(HEADER_BYTES, 4)) == b"abcd"  # one memory, two mappings
        mapped.close()
    finally:
        seg.unlink()
        seg.close()


@pytest.mark.parametrize("case", ["wrong-nonce", "wrong-size", "mode-644", "symlink", "outside-dev-shm"])
def test_a_planted_or_altered_segment_is_not_mapped(case: str, tmp_path: pathlib.Path) -> None:
    seg, nonce = create_segment(0, 1 << 20)
    link = seg.path + "-link"
    try:
        reply = _reply_for(seg, nonce)
        if case == "wrong-nonce":
            reply.nonce = b"\1" * NONCE_BYTES
        elif case == "wrong-size":
            reply.size = seg.size + 4096
        elif case == "mode-644":
            os.chmod(seg.path, 0o644)
        elif case == "symlink":
            os.symlink(seg.path, link)
            reply.path = link
        else:
            reply.path = str(tmp_path / os.path.basename(seg.path))
        with pytest.raises((ShmError, OSError)):
            open_segment(reply)
        if case != "symlink":
            assert os.path.exists(seg.path) or case == "outside-dev-shm"
    finally:
        for path in (seg.path, link):
            if os.path.lexists(path):
                os.unlink(path)
        seg.close()


def test_the_pserver_caps_what_a_trainer_holds() -> None:
    live = {0: inc(0)}
    from runtime.rpc.shm import host_id, round_size

    plane = PServerPlane(live.get, "tok", max_bytes=3 * round_size(1))

    try:
        req = pb.ShmOpenRequest(trainer_id=0, incarnation=inc(0), host=host_id(), min_bytes=1)
        got = [plane.open(req) for _ in range(4)]
        assert [bool(r.path) for r in got] == [True, True, True, False] and "above the limit" in got[3].reason
        assert got[3].later  # for now: a later, smaller request may be served
        elsewhere = plane.open(pb.ShmOpenRequest(trainer_id=0, incarnation=inc(0), host="elsewhere", min_bytes=1))
        assert elsewhere.path == "" and not elsewhere.later and "another host" in elsewhere.reason
        with pytest.raises(ShmError, match="live incarnation"):
            plane.open(pb.ShmOpenRequest(trainer_id=0, incarnation=5, host=host_id(), min_bytes=1))
        assert all(r.key == b"" for r in got[:3])  # with a token the key is the token
        live[0] = inc(0) + 2
        plane.sync_incarnation(0, inc(0) + 2)
        assert plane.segment_paths() == [] and not any(os.path.exists(r.path) for r in got[:3])
    finally:
        plane.close()


def test_trainer_plane_hands_out_a_segment_only_when_its_values_are_gone() -> None:
    seg, nonce = create_segment(0, 1 << 20)
    tp = TrainerPlane(0, inc(0), "tok")
    try:
        tp.add(seg)
        tp.give_back(seg)
        held = np.frombuffer(seg.view(HEADER_BYTES, 16), np.float32)
        assert tp.take(16) is None
        del held
        assert tp.take(16) is seg
        assert tp.take(16) is None  # busy until given back
        tp.give_back(seg)
        assert tp.take(2 << 20) is None  # too small
    finally:
        seg.unlink()
        tp.close()


@pytest.mark.parametrize("kind", ["float32", "float64-nan", "float32-inf-in-last-chunk", "int64", "rows", "empty"])
def test_copy_out_copies_bit_exactly_and_checks_finite_on_the_way(kind: str) -> None:
    from runtime.rpc.shm import copy_out
    from runtime.rpc.stream import ReceiveBuffers
    from runtime.rpc.wire import decode_variable, encode_variable
    from runtime.scope import SelectedRows

    rng = np.random.default_rng(0)
    value: Any = {"float32": lambda: rng.normal(size=(300, 700)).astype(np.float32),
                  "float64-nan": lambda: np.where(np.arange(5000) == 17, np.nan, 1.0).reshape(50, 100),
                  "float32-inf-in-last-chunk": lambda: np.where(np.arange(600_000) == 599_999, np.inf,
                                                                0.5).astype(np.float32),  # 3 pieces of 1 MiB
                  "int64": lambda: rng.integers(-5, 5, (1000, 3)),
                  "rows": lambda: SelectedRows(np.array([4, 1, 9]), rng.normal(size=(3, 8)).astype(np.float32), 10),
                  "empty": lambda: np.zeros((0, 4), np.float32)}[kind]()
    received = decode_variable(encode_variable("v", value))
    copied = copy_out(received, ReceiveBuffers())
    assert copied.finite == (kind not in ("float64-nan", "float32-inf-in-last-chunk"))
    got, want = copied.value, received.value
    if isinstance(want, SelectedRows):
        assert got.height == want.height and got.rows.tobytes() == want.rows.tobytes()
        got, want = got.values, want.values
    assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    assert not np.shares_memory(got, want) and not got.flags.writeable


# --- small values ride along ---------------------------------------------------------------------------------------
def test_a_batch_through_a_segment_carries_the_small_values_of_its_pserver(tracker: Tracker) -> None:
    import time

    h = build_pserver(False, serve=True, tracker=tracker)
    c = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto")
    c.shm_threshold = 1000  # fc_w.block1 (2400 bytes) takes a segment; fc_b (120 bytes) alone would not
    methods: list[str] = []
    retried = c._retried
    c._retried = lambda ep, method, what, invoke: methods.append(method) or retried(ep, method, what, invoke)
    pairs = [(h.endpoint, "fc_w.block1"), (h.endpoint, "fc_b")]
    control = h.pserver.data_plane.control  # ShmGet/ShmSend go through it; gRPC carries the rest
    assert control is not None
    try:
        for _ in range(2):  # the sizes become known, then the segment is opened
            c.get(pairs)
        methods.clear()
        calls = control.calls
        for (_, name), value in zip(pairs, c.get(pairs), strict=True):
            np.testing.assert_array_equal(value, np.asarray(h.scope.find_var(name)))
        assert methods == [] and control.calls == calls + 1  # one ShmGet, on the control socket
        before = {name: np.array(h.scope.find_var(name)) for _, name in pairs}
        methods.clear()
        calls = control.calls
        c.send(h.endpoint, h.grad_name("fc_w.block1", 0), np.ones((20, 30), np.float32))
        c.send(h.endpoint, h.grad_name("fc_b", 0), np.ones(30, np.float32))
        c.wait_sends()
        # one ShmSend on the control socket (a send may need a segment of its own: ShmOpen on gRPC)
        assert [m for m in methods if m != "ShmOpen"] == [] and control.calls == calls + 1
        end = time.monotonic() + 10.0  # an async pserver may apply just after answering
        while time.monotonic() < end and any(np.array_equal(np.asarray(h.scope.find_var(n)), v)
                                             for n, v in before.items()):
            time.sleep(0.01)
        for name, value in before.items():
            np.testing.assert_allclose(np.asarray(h.scope.find_var(name)), value - LR, rtol=1e-5, err_msg=name)
    finally:
        c.close()


# --- the distributed table's prefetch through the data plane -------------------------------------------------------
class TablePServer:
    """One served pserver of ps_worker's ``table`` model (a distributed table of ``TABLE_ROWS`` x ``EMB``
    float64 rows), trainers 0 and 1 announced, and a data-plane client of trainer 0 that has learned the
    prefetch's size (its first prefetch, over gRPC) and holds a segment for hand-made references."""

    def __init__(self) -> None:
        from runtime import Executor
        from runtime.kernels.rpc import max_message_bytes
        from runtime.rpc.pserver import PServer
        from runtime.rpc.server import start_server
        from runtime.scope import Scope
        from tests.runtime.rpc.conftest import free_port, listen_op
        from tests.runtime.rpc.ps_worker import build
        from transpiler import DistributeTranspiler, DistributeTranspilerConfig

        self.endpoint = f"127.0.0.1:{free_port()}"
        main, startup = build("table", "sgd", "const")
        t = DistributeTranspiler(DistributeTranspilerConfig())
        t.transpile(0, program=main, startup_program=startup, pservers=self.endpoint, trainers=2, sync_mode=False)
        program, pstartup = t.get_pserver_programs(self.endpoint)
        exe, self.scope = Executor(), Scope()
        exe.run(pstartup, scope=self.scope)
        self.pserver = PServer(program, self.scope, listen_op(program), lambda i, s: exe.run_block(program, i, s),
                               authenticated=False)
        for trainer in range(2):
            self.pserver.announce(trainer, inc(trainer))
        self.server = start_server(self.pserver, self.endpoint, max_message_bytes(program))
        (self.ids_name,) = self.pserver.config.prefetch_to_block
        self.client = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="auto")
        self.client.shm_threshold = 1
        self.grpc = RPCClient(0, incarnation=inc(0), deadline=10.0, data_plane="off")
        self.prefetch(self.client, IDS)  # learns the rows' size (gRPC)
        got = self.client._segment(self.endpoint, ROOM)
        assert got is not None, self.client.data_plane_state()
        self.plane, self.seg = got

    def prefetch(self, client: RPCClient, ids: np.ndarray) -> Any:
        return client.prefetch([(self.endpoint, self.ids_name, ids, "table")])[0]

    def table(self) -> bytes:
        return np.asarray(self.scope.find_var("table")).tobytes()

    def ref(self, length: int, purpose: bytes, **fields: Any) -> pb.ShmRef:
        """A signed reference to the held segment (numbered as the client numbers its own: it goes on)."""
        base = dict(trainer_id=0, incarnation=inc(0), segment=self.seg.number, offset=HEADER_BYTES, length=length,
                    seq=self.plane.next_seq())
        base.update(fields)
        ref = pb.ShmRef(**base)
        ref.mac = ref_mac(self.plane.key, purpose, ref)
        return ref

    def put_ids(self, ids: Any, trainer_id: int = 0, incarnation: int = inc(0)) -> int:
        return write_batch(self.seg.view(HEADER_BYTES, ROOM), [encode_parts(
            self.ids_name, ids, trainer_id=trainer_id, table_name="table", incarnation=incarnation)])

    def call(self, request: pb.ShmPrefetchRequest) -> tuple[str, bytes]:
        return self.plane.call(CONTROL_PREFETCH, request.SerializeToString(), 10.0)

    def close(self) -> None:
        self.plane.give_back(self.seg)
        self.client.close()
        self.grpc.close()
        self.server.stop(grace=None).wait(5.0)
        self.pserver.close()


IDS = np.array([[3], [7], [0], [100], [7], [42]], np.int64)


@pytest.fixture
def table_ps() -> Iterator[TablePServer]:
    s = TablePServer()
    yield s
    s.close()


def test_a_prefetch_through_the_data_plane_equals_the_grpc_prefetch_bit_for_bit(table_ps: TablePServer) -> None:
    s = table_ps
    control = s.pserver.data_plane.control
    assert control is not None
    before = control.calls
    for ids in (IDS, np.arange(0, 101, 2, dtype=np.int64).reshape(-1, 1), np.zeros((0, 1), np.int64)):
        got, want = s.prefetch(s.client, ids), s.prefetch(s.grpc, ids)
        assert (got.dtype, got.shape) == (want.dtype, want.shape) and got.tobytes() == want.tobytes()
        assert got.shape == (len(ids), 4)
    assert control.calls == before + 3
    assert any(np.shares_memory(s.prefetch(s.client, IDS), seg.array) for seg in s.plane.segments)


PREFETCH_REFS: dict[str, tuple[Callable[[TablePServer], pb.ShmPrefetchRequest], str, str]] = {
    "forged-ids-mac": (lambda s: pb.ShmPrefetchRequest(ids=pb.ShmRef(**{**_fields(s.ref(s.put_ids(IDS), b"ids")),
                                                                        "mac": b"\0" * 32}), slot=s.ref(ROOM, b"slot")),
                       "INVALID_ARGUMENT", "does not carry a valid HMAC"),
    "send-ref-as-ids": (lambda s: pb.ShmPrefetchRequest(ids=s.ref(s.put_ids(IDS), b"send"), slot=s.ref(ROOM, b"slot")),
                        "INVALID_ARGUMENT", "does not carry a valid HMAC"),
    "ids-ref-as-slot": (lambda s: pb.ShmPrefetchRequest(ids=s.ref(s.put_ids(IDS), b"ids"), slot=s.ref(ROOM, b"ids")),
                        "INVALID_ARGUMENT", "does not carry a valid HMAC"),
    "stale-incarnation": (lambda s: pb.ShmPrefetchRequest(
        ids=s.ref(s.put_ids(IDS, incarnation=inc(0) + 2), b"ids", incarnation=inc(0) + 2),
        slot=s.ref(ROOM, b"slot", incarnation=inc(0) + 2)), "FAILED_PRECONDITION", "its segments belong to"),
    "another-trainers-slot": (lambda s: pb.ShmPrefetchRequest(ids=s.ref(s.put_ids(IDS), b"ids"),
                                                              slot=s.ref(ROOM, b"slot", trainer_id=1)),
                              "INVALID_ARGUMENT", "names a slot of trainer 1"),
    "another-trainers-ids": (lambda s: pb.ShmPrefetchRequest(ids=s.ref(s.put_ids(IDS, trainer_id=1), b"ids"),
                                                             slot=s.ref(ROOM, b"slot")),
                             "INVALID_ARGUMENT", "of trainer 1"),
    "out-of-shard": (lambda s: pb.ShmPrefetchRequest(ids=s.ref(s.put_ids(np.array([[5], [101]], np.int64)), b"ids"),
                                                     slot=s.ref(ROOM, b"slot")), "INVALID_ARGUMENT", "not in shard 0"),
    "float-ids": (lambda s: pb.ShmPrefetchRequest(ids=s.ref(s.put_ids(np.ones((2, 1), np.float64)), b"ids"),
                                                  slot=s.ref(ROOM, b"slot")), "INVALID_ARGUMENT",
                  "ids must be a dense int64 tensor"),
    "truncated-ids": (lambda s: pb.ShmPrefetchRequest(ids=s.ref(s.put_ids(IDS) - 5, b"ids"), slot=s.ref(ROOM, b"slot")),
                      "INVALID_ARGUMENT", "truncated"),
    "slot-too-small": (lambda s: pb.ShmPrefetchRequest(ids=s.ref(s.put_ids(IDS), b"ids"), slot=s.ref(40, b"slot")),
                       "RESOURCE_EXHAUSTED", "does not fit its data-plane slot"),
}


@pytest.mark.parametrize("case", list(PREFETCH_REFS))
def test_a_bad_prefetch_through_the_data_plane_is_refused_and_changes_nothing(case: str,
                                                                           table_ps: TablePServer) -> None:
    s = table_ps
    make, status, words = PREFETCH_REFS[case]
    request = make(s)
    table, written = s.table(), bytes(s.seg.view(HEADER_BYTES, ROOM))
    got, message = s.call(request)
    assert (got, words in message.decode()) == (status, True), message
    assert s.table() == table
    if status != "RESOURCE_EXHAUSTED":  # the pserver wrote nothing into the segment
        assert bytes(s.seg.view(HEADER_BYTES, ROOM)) == written
    # and it goes on answering
    np.testing.assert_array_equal(s.prefetch(s.client, IDS), s.prefetch(s.grpc, IDS))


def test_a_replayed_prefetch_reference_is_refused(table_ps: TablePServer) -> None:
    s = table_ps
    request = pb.ShmPrefetchRequest(ids=s.ref(s.put_ids(IDS), b"ids"), slot=s.ref(ROOM, b"slot"))
    status, raw = s.call(request)
    assert status == "OK", raw
    reply = pb.ShmRef.FromString(raw)
    s.plane.check_reply(reply, request.slot)
    for replay in (lambda: request, lambda: pb.ShmPrefetchRequest(ids=s.ref(s.put_ids(IDS), b"ids"),
                                                                  slot=request.slot)):
        req = replay()
        table, written = s.table(), bytes(s.seg.view(HEADER_BYTES, ROOM))
        status, message = s.call(req)
        assert status == "INVALID_ARGUMENT" and b"a replayed reference is refused" in message, message
        assert s.table() == table and bytes(s.seg.view(HEADER_BYTES, ROOM)) == written


def test_a_prefetch_falls_back_to_grpc_when_the_control_socket_breaks(table_ps: TablePServer) -> None:
    s = table_ps
    control = s.pserver.data_plane.control
    s.prefetch(s.client, IDS)
    assert s.plane.control is not None and control.calls == 1
    control.close()
    got = s.prefetch(s.client, IDS)
    assert s.plane.control is None and control.calls == 1
    assert not any(np.shares_memory(got, seg.array) for seg in s.plane.segments)
    assert got.tobytes() == s.prefetch(s.grpc, IDS).tobytes()
