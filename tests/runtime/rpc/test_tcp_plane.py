"""The cross-host data plane (runtime/rpc/tcp_plane.py) against a real pserver on 127.0.0.1.

The trainer is put on "another host" by passing ``RPCClient(host=...)`` a host identity other than this
machine's (what a trainer on another machine reports in ShmOpen); everything else is the real path: the
pserver answers ShmOpen with its TCP port, the client connects, handshakes and moves its batches there.
(``tests/runtime/test_multihost_netns.py`` runs a whole job across two namespaced hosts on it.)

Values travel bit-exactly both ways (and a prefetch equals the gRPC prefetch); every bad send or get of
test_server_errors.py gets the gRPC status and changes nothing; the handshake refuses a forged or replayed
HMAC, the wrong token, a stale incarnation, and a pserver that cannot prove the token; a truncated, oversized,
garbage or unknown frame, a connection whose incarnation went stale, and a trainer killed mid-frame leave the
parameters untouched while the pserver serves the others; an unreachable or broken TCP plane falls back to
gRPC; ``FLAGS_rpc_data_plane=off`` (either side), a job without a token and a TLS job are pure gRPC.
"""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import grpc
import numpy as np
import pytest

from runtime.flags import RPCSecurity
from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.client import RPCClient, RPCError
from runtime.rpc.tcp_plane import (_CLAIM, _HELLO, ERROR, FRAME, GET, MAGIC, OK, PREFETCH, SEND, LinkFailed,
                                   TcpLink, TcpPlaneServer, handshake_mac)
from runtime.rpc.stream import ReceiveBuffers
from runtime.rpc.wire import decode_batch, encode_batch, encode_variable
from tests.runtime.rpc.conftest import LR, PARAMS, PSHandle, Tracker, build_pserver, inc
from tests.runtime.rpc.test_data_plane import GET_CASES, SEND_CASES, SHM_WORDS
from tests.runtime.rpc.test_server_errors import BAD, Served

CODE = grpc.StatusCode
REPO = pathlib.Path(__file__).resolve().parents[3]
TOKEN = "tcp-plane-job-token"
SECURITY = RPCSecurity(token=TOKEN)
ELSEWHERE = "another-host"  # the host identity the test trainers report: not this machine's
TIMEOUT_S = 10.0
BYTECODE_ENV = ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")  # where a child writes its bytecode, if at all


def tcp_client(trainer_id: int = 0, incarnation: int | None = None, **kw: Any) -> RPCClient:
    kw.setdefault("security", SECURITY)
    kw.setdefault("data_plane", "auto")
    c = RPCClient(trainer_id, incarnation=inc(trainer_id) if incarnation is None else incarnation,
                  deadline=TIMEOUT_S, host=ELSEWHERE, **kw)
    c.shm_threshold = 1  # every batch takes the data plane
    return c


class RawTcp:
    """A hand-driven connection to a pserver's TCP plane: the handshake and frames byte by byte."""

    def __init__(self, port: int) -> None:
        self.conn = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        hello = self._read(_HELLO.size)
        magic, self.server_nonce = _HELLO.unpack(hello)
        assert magic == MAGIC

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            got = self.conn.recv(n - len(out))
            if not got:
                break
            out += got
        return out

    def claim(self, key: bytes = TOKEN.encode(), trainer_id: int = 0, incarnation: int = inc(0),
              nonce: bytes = b"n" * 32, mac: bytes | None = None) -> bytes:
        if mac is None:
            mac = handshake_mac(key, b"trainer", self.server_nonce, nonce, trainer_id, incarnation)
        return _CLAIM.pack(MAGIC, trainer_id, incarnation, nonce, mac)

    def handshake(self, claim: bytes | None = None) -> tuple[str, str]:
        """Send ``claim`` (default: a correct one of trainer 0); ("OK", "") or the refusal (then closed)."""
        claim = self.claim() if claim is None else claim
        self.conn.sendall(claim)
        first = self._read(1)
        if first == OK:
            mac = self._read(32)
            _, _, _, nonce, _ = _CLAIM.unpack(claim)
            trainer_id, incarnation = _CLAIM.unpack(claim)[1:3]
            assert mac == handshake_mac(TOKEN.encode(), b"pserver", self.server_nonce, nonce, trainer_id, incarnation)
            return "OK", ""
        assert first == ERROR, first
        (n,) = struct.unpack("<I", self._read(4))
        status, _, message = self._read(n).decode().partition("\n")
        assert self._read(1) == b"", "a refused handshake closes the connection"
        return status, message

    def frame(self, method: bytes, body: bytes, length: int | None = None) -> tuple[str, bytes]:
        """Send one frame (``length`` overrides the header's); the answer, or ("CLOSED", b"")."""
        self.conn.sendall(FRAME.pack(method, len(body) if length is None else length) + body)
        return self.answer()

    def answer(self) -> tuple[str, bytes]:
        head = self._read(FRAME.size)
        if not head:
            return "CLOSED", b""
        status, n = FRAME.unpack(head)
        body = self._read(n)
        if status == OK:
            return "OK", body
        name, _, message = body.decode().partition("\n")
        return name, message.encode()

    def closed(self) -> bool:
        """Whether the pserver closed the connection (a reset too: it closed with our bytes unread)."""
        try:
            return self._read(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.conn.close()


class TcpServed(Served):
    """A served PServer with a job token, a raw gRPC channel, and its TCP plane."""

    def __init__(self, handle: PSHandle) -> None:
        super().__init__(handle)
        self.tcp: TcpPlaneServer = handle.pserver.data_plane.tcp
        assert self.tcp is not None
        self.client = tcp_client()  # closed (Complete) only at the fixture's teardown: trainer 0 stays live

    def raw_tcp(self) -> RawTcp:
        """A connection handshaken as trainer 0 (live incarnation)."""
        raw = RawTcp(self.tcp.port)
        assert raw.handshake() == ("OK", "")
        return raw

    def good_send(self) -> None:
        """A valid gradient of fc_b from trainer 0, on the TCP plane."""
        raw = self.raw_tcp()
        try:
            assert raw.frame(SEND, encode_batch([self.send_bytes("fc_b", np.full((30,), 0.5, np.float32))]))[0] == "OK"
        finally:
            raw.close()
        self.sent("fc_b")


def served_with_token(tracker: Tracker, sync: bool) -> TcpServed:
    return TcpServed(build_pserver(sync, serve=True, tracker=tracker, security=SECURITY))


@pytest.fixture(scope="module")
def planes() -> Iterator[dict[str, TcpServed]]:
    tracker = Tracker()
    out = {mode: served_with_token(tracker, mode == "sync") for mode in ("sync", "async")}
    yield out
    for s in out.values():
        s.client.close()
        s.raw.close()
    tracker.close()


def _grpc_raw(s: TcpServed) -> Any:
    """gRPC calls of ``s`` carrying the token (the pserver requires it)."""
    metadata = (("authorization", f"Bearer {TOKEN}"),)

    class WithToken:
        def call(self, name: str, request: bytes) -> bytes:
            return s.raw.method(name)(request, timeout=TIMEOUT_S, metadata=metadata)

        def get(self, name: str) -> bytes:
            return self.call("GetVariable", pb.VariableRequest(name=name).SerializeToString())

        def health(self) -> Any:
            return pb.HealthReply.FromString(self.call("Health", pb.HealthRequest().SerializeToString()))

    return WithToken()


def _state(s: TcpServed) -> tuple[dict[str, bytes], Any]:
    g = _grpc_raw(s)
    return {p: g.get(p) for p in PARAMS}, s.h.snapshot()


def _same_state(s: TcpServed, before: tuple[dict[str, bytes], Any]) -> None:
    """The pserver kept serving and changed nothing; a good send on the TCP plane then works."""
    assert _state(s) == before
    health = _grpc_raw(s).health()
    assert health.status == pb.HealthReply.SERVING and list(health.live_trainers) == [0, 1]
    s.good_send()


# --- values on the TCP plane ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_values_travel_bit_exactly_on_the_tcp_plane(mode: str, planes: dict[str, TcpServed]) -> None:
    s = planes[mode]
    ep, c = s.h.endpoint, s.client
    first = c.get([(ep, p) for p in PARAMS])  # learns the sizes (gRPC), is told the TCP port
    calls = s.tcp.calls
    second = c.get([(ep, p) for p in PARAMS])  # on the TCP plane
    assert s.tcp.calls == calls + 1 and c.data_plane_state()[ep].startswith("tcp (")
    for p, a, b in zip(PARAMS, first, second):
        want = np.asarray(s.h.scope.find_var(p))
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b, want)
        assert not b.flags.writeable  # a read-only view of the client's pooled receive buffer
    grad = np.random.default_rng(3).normal(size=(30,)).astype(np.float32)
    name = s.h.grad_name("fc_b", 0)
    before = np.asarray(s.h.scope.find_var("fc_b")).copy()
    c.send(ep, name, grad)
    c.wait_sends()
    s.seq[0, name] += 1  # the client used that seq
    assert s.tcp.calls == calls + 2 and c._links[ep].calls == 2 and s.tcp.connections() == 1  # one, reused
    if mode == "sync":
        np.testing.assert_array_equal(np.asarray(s.h.scope.find_var(name)), grad)
    else:
        np.testing.assert_allclose(np.asarray(s.h.scope.find_var("fc_b")), before - np.float32(LR) * grad, rtol=1e-6)
    assert s.h.pserver.data_plane.segment_paths() == []  # another host: no shared memory


def test_a_prefetch_on_the_tcp_plane_equals_the_grpc_prefetch(tracker: Tracker) -> None:
    from runtime import Executor
    from runtime.kernels.rpc import max_message_bytes
    from runtime.rpc.pserver import PServer
    from runtime.rpc.server import start_server
    from runtime.scope import Scope
    from tests.runtime.rpc.conftest import free_port, listen_op
    from tests.runtime.rpc.ps_worker import build
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    endpoint = f"127.0.0.1:{free_port()}"
    main, startup = build("table", "sgd", "const")
    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(0, program=main, startup_program=startup, pservers=endpoint, trainers=2, sync_mode=False)
    program, pstartup = t.get_pserver_programs(endpoint)
    exe, scope = Executor(), Scope()
    exe.run(pstartup, scope=scope)
    pserver = PServer(program, scope, listen_op(program), lambda i, sc: exe.run_block(program, i, sc))
    for trainer in range(2):
        pserver.announce(trainer, inc(trainer))
    server = start_server(pserver, endpoint, max_message_bytes(program), SECURITY)
    (ids_name,) = pserver.config.prefetch_to_block
    ids = np.array([[3], [7], [0], [100], [7], [42]], np.int64)
    c, plain = tcp_client(), tcp_client(data_plane="off")
    try:
        c._segment(endpoint, 1)  # the ShmOpen that tells the TCP port (a first large transfer asks it)
        tcp = pserver.data_plane.tcp
        got = c.prefetch([(endpoint, ids_name, ids, "table")])[0]
        assert tcp.calls == 1 and c.data_plane_state() == {endpoint: "tcp (1 transfers)"}
        want = plain.prefetch([(endpoint, ids_name, ids, "table")])[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.asarray(got).dtype == np.asarray(want).dtype and tcp.calls == 1
        with pytest.raises(RPCError) as e:  # an id out of the shard: the gRPC prefetch's status
            c.prefetch([(endpoint, ids_name, np.array([[10 ** 9]], np.int64), "table")])
        assert e.value.status == CODE.INVALID_ARGUMENT and "TCP data plane" in str(e.value)
    finally:
        c.close()
        plain.close()
        server.stop(grace=None).wait(5.0)
        pserver.close()


# --- every bad request a TCP frame can carry -------------------------------------------------------------------------
@pytest.mark.parametrize("name,mode", SEND_CASES, ids=[f"{n}-{m}" for n, m in SEND_CASES])
def test_a_bad_send_on_the_tcp_plane_gets_its_status_and_changes_nothing(name: str, mode: str,
                                                                        planes: dict[str, TcpServed]) -> None:
    method, request, code, words, _ = BAD[name]
    s = planes[mode]
    before = _state(s)
    raw = request(s)
    batch = encode_batch([raw]) if method == "SendVariable" else raw
    conn = s.raw_tcp()
    try:
        status, message = conn.frame(SEND, batch)
        assert status == code.name, message
        assert SHM_WORDS.get(name, words) in message.decode(), message
        assert conn.frame(GET, pb.GetVariablesRequest(names=["fc_b"]).SerializeToString())[0] == "OK"  # serves on
    finally:
        conn.close()
    _same_state(s, before)


@pytest.mark.parametrize("name,mode", GET_CASES, ids=[f"{n}-{m}" for n, m in GET_CASES])
def test_a_bad_get_on_the_tcp_plane_gets_its_status(name: str, mode: str, planes: dict[str, TcpServed]) -> None:
    _, request, code, words, _ = BAD[name]
    s = planes[mode]
    before = _state(s)
    conn = s.raw_tcp()
    try:
        status, message = conn.frame(GET, request(s))
        assert status == code.name and words in message.decode(), message
    finally:
        conn.close()
    _same_state(s, before)


@pytest.mark.parametrize("method,body,code,words", [
    (SEND, b"garbage!", "INVALID_ARGUMENT", "wire type 7"),
    (SEND, b"", "INVALID_ARGUMENT", "carries no variable"),
    (GET, b"garbage!", "INVALID_ARGUMENT", "does not decode as flotilla.rpc.GetVariablesRequest"),
    (GET, pb.GetVariablesRequest(names=["fc_b"], trainer_id=1).SerializeToString(), "INVALID_ARGUMENT",
     "asks for trainer 1's variables"),
    (PREFETCH, b"garbage!", "INVALID_ARGUMENT", "wire type 7"),
    (PREFETCH, encode_variable("ids", np.zeros((2, 1), np.int64)), "NOT_FOUND", "answers no such ids variable"),
])
def test_a_garbage_frame_is_refused_and_the_connection_serves_on(method: bytes, body: bytes, code: str, words: str,
                                                                 planes: dict[str, TcpServed]) -> None:
    s = planes["sync"]
    before = _state(s)
    conn = s.raw_tcp()
    try:
        status, message = conn.frame(method, body)
        assert status == code and words in message.decode(), message
        status, reply = conn.frame(GET, pb.GetVariablesRequest(names=["fc_b"]).SerializeToString())
        assert status == "OK" and decode_batch(reply)[0].name == "fc_b"
    finally:
        conn.close()
    _same_state(s, before)


def test_another_trainers_gradient_is_refused(planes: dict[str, TcpServed]) -> None:
    s = planes["async"]
    before = _state(s)
    conn = s.raw_tcp()  # bound to trainer 0
    try:
        status, message = conn.frame(SEND, encode_batch([s.send_bytes("fc_b", np.full((30,), 0.5, np.float32),
                                                                      trainer_id=1)]))
        assert status == "INVALID_ARGUMENT" and b"carries 'fc_b@GRAD' of trainer 1" in message, message
    finally:
        conn.close()
    _same_state(s, before)


# --- frames: oversized, unknown, truncated, killed mid-frame ----------------------------------------------------------
@pytest.mark.parametrize("case", ["oversized", "huge-length", "unknown-method"])
def test_an_oversized_or_unknown_frame_is_refused_and_the_connection_dropped(case: str,
                                                                             planes: dict[str, TcpServed]) -> None:
    s = planes["sync"]
    before = _state(s)
    conn = s.raw_tcp()
    try:
        if case == "unknown-method":
            status, message = conn.frame(b"X", b"abc")
            assert status == "INVALID_ARGUMENT" and b"unknown TCP data-plane method" in message
        else:
            length = s.tcp.max_message + 1 if case == "oversized" else (1 << 64) - 1
            status, message = conn.frame(SEND, b"", length=length)  # no body sent: nothing is read
            assert status == "RESOURCE_EXHAUSTED" and f"a {length}-byte SendVariables frame".encode() in message
            assert f"message limit of {s.tcp.max_message} bytes".encode() in message
        assert conn.closed()
    finally:
        conn.close()
    _same_state(s, before)


@pytest.mark.parametrize("cut", ["in-the-header", "in-the-body"])
def test_a_truncated_frame_keeps_nothing(cut: str, planes: dict[str, TcpServed]) -> None:
    s = planes["sync"]
    before = _state(s)
    batch = encode_batch([s.send_bytes("fc_b", np.full((30,), 0.25, np.float32))])
    conn = s.raw_tcp()
    head = FRAME.pack(SEND, len(batch))
    conn.conn.sendall(head[:5] if cut == "in-the-header" else head + batch[:-7])
    conn.conn.shutdown(socket.SHUT_WR)  # the trainer is gone mid-frame
    assert conn.closed()  # no answer: the pserver dropped the connection
    conn.close()
    _same_state(s, before)


KILLED_TRAINER = """
import socket, sys
from runtime.rpc.tcp_plane import _CLAIM, _HELLO, FRAME, MAGIC, OK, SEND, handshake_mac
port, token, incarnation, size = int(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
conn = socket.create_connection(("127.0.0.1", port), timeout=10)
_, theirs = _HELLO.unpack(conn.recv(_HELLO.size, socket.MSG_WAITALL))
conn.sendall(_CLAIM.pack(MAGIC, 1, incarnation, b"k" * 32, handshake_mac(token, b"trainer", theirs, b"k" * 32, 1,
                                                                          incarnation)))
assert conn.recv(33, socket.MSG_WAITALL)[:1] == OK
conn.sendall(FRAME.pack(SEND, size) + b"\\0" * (size // 2))  # half a frame, then killed
print("half sent", flush=True)
sys.stdin.read()
"""


@pytest.mark.serial  # a trainer process, killed
def test_a_trainer_killed_mid_frame_leaves_the_parameters_untouched(planes: dict[str, TcpServed]) -> None:
    s = planes["async"]
    before = _state(s)
    connections = s.tcp.connections()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, str(s.tcp.port), TOKEN, str(inc(1)), str(4 << 20)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", **{  # no __pycache__ in the tree
                                k: v for k, v in os.environ.items() if k in BYTECODE_ENV}})
    try:
        line = proc.stdout.readline()  # bounded: the child's socket timeout is 10 s
        assert line.startswith("half sent"), line + (proc.stdout.read() if proc.poll() is not None else "")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stdin.close()
    _same_state(s, before)
    end = time.monotonic() + TIMEOUT_S
    while s.tcp.connections() > connections and time.monotonic() < end:  # the pserver drops the reset connection
        time.sleep(0.05)
    assert s.tcp.connections() <= connections


# --- the handshake ---------------------------------------------------------------------------------------------------
HANDSHAKES = {
    "forged-mac": (lambda r: r.claim(mac=b"\0" * 32), "UNAUTHENTICATED", "does not carry this job's token's HMAC"),
    "wrong-token": (lambda r: r.claim(key=b"not the token"), "UNAUTHENTICATED", "does not carry this job's token"),
    "mac-for-another-trainer": (lambda r: _CLAIM.pack(MAGIC, 1, inc(1), b"n" * 32, handshake_mac(
        TOKEN.encode(), b"trainer", r.server_nonce, b"n" * 32, 0, inc(0))), "UNAUTHENTICATED", "HMAC"),
    "pserver-side-mac": (lambda r: r.claim(mac=handshake_mac(TOKEN.encode(), b"pserver", r.server_nonce, b"n" * 32,
                                                             0, inc(0))), "UNAUTHENTICATED", "HMAC"),
    "bad-magic": (lambda r: b"x" * _CLAIM.size, "INVALID_ARGUMENT", "magic"),
    "stale-incarnation": (lambda r: r.claim(incarnation=inc(0) + 2), "FAILED_PRECONDITION",
                          "which is not its live incarnation"),
    "trainer-out-of-range": (lambda r: r.claim(trainer_id=2, incarnation=inc(2)), "INVALID_ARGUMENT",
                             "trainer_id 2 is out of range"),
}


@pytest.mark.parametrize("case", list(HANDSHAKES))
def test_a_bad_handshake_is_refused_and_changes_nothing(case: str, planes: dict[str, TcpServed]) -> None:
    make, status, words = HANDSHAKES[case]
    s = planes["sync"]
    before, refused = _state(s), s.tcp.refused
    raw = RawTcp(s.tcp.port)
    try:
        got_status, message = raw.handshake(make(raw))
    finally:
        raw.close()
    assert got_status == status and words in message, message
    assert s.tcp.refused == refused + 1
    _same_state(s, before)


def test_a_recorded_handshake_does_not_replay(planes: dict[str, TcpServed]) -> None:
    s = planes["sync"]
    first = RawTcp(s.tcp.port)
    claim = first.claim()
    assert first.handshake(claim) == ("OK", "")
    first.close()
    second = RawTcp(s.tcp.port)  # a fresh pserver nonce: the recorded MAC no longer matches
    try:
        status, message = second.handshake(claim)
    finally:
        second.close()
    assert status == "UNAUTHENTICATED", message


def test_the_trainer_refuses_a_pserver_that_cannot_prove_the_token() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor() -> None:  # speaks the protocol, but does not know the token
        conn, _ = listener.accept()
        with conn:
            conn.sendall(_HELLO.pack(MAGIC, b"s" * 32))
            conn.recv(_CLAIM.size, socket.MSG_WAITALL)
            conn.sendall(OK + b"\0" * 32)
            conn.recv(1)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    link = TcpLink(("127.0.0.1", port), 0, inc(0), TOKEN.encode(), 1 << 20)
    try:
        with pytest.raises(LinkFailed, match="did not prove it holds the job token"):
            link.call(SEND, [b"x"], time.monotonic() + TIMEOUT_S, ReceiveBuffers())
        assert not link.up
    finally:
        link.close()
        listener.close()
        thread.join(TIMEOUT_S)
    assert not thread.is_alive()


@pytest.mark.serial  # timed: the call ends 0.4-3 s after a 0.5 s deadline
def test_a_pserver_that_does_not_answer_fails_the_call_at_the_deadline() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    release = threading.Event()

    def silent() -> None:  # a correct handshake, then it reads the frame and never answers
        conn, _ = listener.accept()
        with conn:
            conn.sendall(_HELLO.pack(MAGIC, b"s" * 32))
            claim = conn.recv(_CLAIM.size, socket.MSG_WAITALL)
            _, trainer_id, incarnation, nonce, _ = _CLAIM.unpack(claim)
            conn.sendall(OK + handshake_mac(TOKEN.encode(), b"pserver", b"s" * 32, nonce, trainer_id, incarnation))
            release.wait(TIMEOUT_S)

    thread = threading.Thread(target=silent, daemon=True)
    thread.start()
    link = TcpLink(("127.0.0.1", port), 0, inc(0), TOKEN.encode(), 1 << 20)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="within the deadline"):
            link.call(SEND, [b"x" * 100], start + 0.5, ReceiveBuffers())
        assert 0.4 < time.monotonic() - start < 3.0
        assert link.up  # a slow pserver is not a broken plane: the next call tries again
    finally:
        release.set()
        link.close()
        listener.close()
        thread.join(TIMEOUT_S)
    assert not thread.is_alive()


def test_a_connection_whose_incarnation_went_stale_is_refused(tracker: Tracker) -> None:
    s = served_with_token(tracker, False)  # async: a restarted trainer is admitted at once
    conn = s.raw_tcp()
    try:
        new = RPCClient(0, incarnation=inc(0) + 2, deadline=TIMEOUT_S, security=SECURITY, data_plane="off")
        new.announce([s.h.endpoint])  # trainer 0 restarted: the old connection's incarnation is stale
        before = _state(s)
        status, message = conn.frame(SEND, encode_batch([s.send_bytes("fc_b", np.full((30,), 0.5, np.float32))]))
        assert status == "FAILED_PRECONDITION" and b"is no longer live" in message, message
        assert conn.closed()
        assert _state(s) == before
        new.close()
    finally:
        conn.close()


# --- fallback to gRPC, FLAGS off, no token ---------------------------------------------------------------------------
def test_an_unreachable_tcp_plane_falls_back_to_grpc(tracker: Tracker) -> None:
    s = served_with_token(tracker, True)
    ep = s.h.endpoint
    s.tcp.close()  # the port is closed: the trainer's connect is refused
    c = tcp_client()
    try:
        for _ in range(2):
            got = c.get([(ep, "fc_w.block1")])[0]
            np.testing.assert_array_equal(got, np.asarray(s.h.scope.find_var("fc_w.block1")))
        grad = np.full((30,), 0.5, np.float32)
        c.send(ep, s.h.grad_name("fc_b", 0), grad)
        c.wait_sends()
        np.testing.assert_array_equal(np.asarray(s.h.scope.find_var(s.h.grad_name("fc_b", 0))), grad)
        state = c.data_plane_state()[ep]
        assert state.startswith("grpc: connecting to the TCP data plane") and "refused" in state, state
        assert s.tcp.calls == 0
    finally:
        c.close()


def test_a_broken_connection_falls_back_to_grpc(tracker: Tracker) -> None:
    s = served_with_token(tracker, False)  # async: a send applied twice would show
    ep = s.h.endpoint
    c = tcp_client()
    try:
        c.get([(ep, "fc_b")])
        c.get([(ep, "fc_b")])
        assert c.data_plane_state() == {ep: "tcp (1 transfers)"}
        s.tcp.close()  # the pserver's TCP plane goes away under the trainer's connection
        before = np.asarray(s.h.scope.find_var("fc_b")).copy()
        grad = np.full((30,), 0.5, np.float32)
        c.send(ep, s.h.grad_name("fc_b", 0), grad)
        c.wait_sends()
        np.testing.assert_allclose(np.asarray(s.h.scope.find_var("fc_b")), before - np.float32(LR) * grad, rtol=1e-6)
        assert c.data_plane_state()[ep].startswith("grpc: the TCP data plane"), c.data_plane_state()
        np.testing.assert_array_equal(c.get([(ep, "fc_b")])[0], np.asarray(s.h.scope.find_var("fc_b")))
    finally:
        c.close()


def test_a_send_applied_before_the_connection_broke_is_not_applied_again(tracker: Tracker) -> None:
    """The pserver applies a send, then the connection breaks before its answer leaves: the trainer sends
    the batch again over gRPC with the same seq, which the pserver drops as a retry (async mode: a second
    apply would move the parameter twice). The break is injected where it can really happen: after the
    handler returned, before the answer is written."""
    s = served_with_token(tracker, False)
    ep = s.h.endpoint
    handle, applied = s.tcp._handle, []

    def applied_then_broken(method: bytes, body: memoryview, trainer_id: int, incarnation: int) -> Any:
        answer = handle(method, body, trainer_id, incarnation)
        if method == SEND and not applied:
            applied.append(answer[0])
            raise ConnectionResetError("the connection broke after the pserver applied the send")
        return answer

    s.tcp._handle = applied_then_broken
    c = tcp_client()
    try:
        c.get([(ep, "fc_b")])  # connected: the send below goes on the TCP plane
        before = np.asarray(s.h.scope.find_var("fc_b")).copy()
        grad = np.full((30,), 0.5, np.float32)
        c.send(ep, s.h.grad_name("fc_b", 0), grad)
        c.wait_sends()
        assert applied == ["OK"]
        np.testing.assert_allclose(np.asarray(s.h.scope.find_var("fc_b")), before - np.float32(LR) * grad, rtol=1e-6)
        assert c.data_plane_state()[ep].startswith("grpc: the TCP data plane"), c.data_plane_state()
        c.send(ep, s.h.grad_name("fc_b", 0), grad)  # the next send (seq 2) is applied as usual, over gRPC
        c.wait_sends()
        np.testing.assert_allclose(np.asarray(s.h.scope.find_var("fc_b")), before - 2 * np.float32(LR) * grad,
                                   rtol=1e-6)
    finally:
        c.close()


def test_off_on_the_trainer_is_pure_grpc(tracker: Tracker) -> None:
    s = served_with_token(tracker, True)
    c = tcp_client(data_plane="off")
    try:
        for _ in range(2):
            np.testing.assert_array_equal(c.get([(s.h.endpoint, "fc_b")])[0], np.asarray(s.h.scope.find_var("fc_b")))
        c.send(s.h.endpoint, s.h.grad_name("fc_b", 0), np.ones(30, np.float32))
        c.wait_sends()
        assert c._links == {} and c._planes == {} and s.tcp.calls == 0 and s.tcp.connections() == 0
    finally:
        c.close()


def _same_host_job(tracker: Tracker, pserver_mode: str) -> tuple[PSHandle, str]:
    """A sync pserver with the job token serving on a free port, its data plane ``pserver_mode``."""
    from runtime.kernels.rpc import max_message_bytes
    from runtime.rpc.server import start_server
    from tests.runtime.rpc.conftest import free_port

    h = build_pserver(True, serve=False, tracker=tracker)
    endpoint = f"127.0.0.1:{free_port()}"
    h.server = start_server(h.pserver, endpoint, max_message_bytes(h.program), SECURITY, data_plane=pserver_mode)
    return h, endpoint


@pytest.mark.parametrize("side", ["trainer", "pserver"])
def test_tcp_mode_puts_a_trainer_of_this_host_on_the_tcp_plane(side: str, tracker: Tracker) -> None:
    """``FLAGS_rpc_data_plane=tcp`` on either side: a trainer on the pserver's own host gets no segment (nothing
    in /dev/shm) and moves its batches on the TCP plane, bit-exactly; the reason names the flag."""
    h, endpoint = _same_host_job(tracker, "tcp" if side == "pserver" else "auto")
    assert (h.pserver.data_plane.control is None) == (side == "pserver")
    c = RPCClient(0, incarnation=inc(0), deadline=TIMEOUT_S, security=SECURITY,
                  data_plane="tcp" if side == "trainer" else "auto")
    c.shm_threshold = 1
    try:
        for _ in range(2):
            np.testing.assert_array_equal(c.get([(endpoint, "fc_w.block1")])[0],
                                          np.asarray(h.scope.find_var("fc_w.block1")))
        grad = np.full((30,), 0.5, np.float32)
        c.send(endpoint, h.grad_name("fc_b", 0), grad)
        c.wait_sends()
        np.testing.assert_array_equal(np.asarray(h.scope.find_var(h.grad_name("fc_b", 0))), grad)
        assert c.data_plane_state() == {endpoint: "tcp (2 transfers)"}
        assert f"{'this pserver' if side == 'pserver' else 'the trainer'} runs with FLAGS_rpc_data_plane=tcp" in \
            c._planes[endpoint].reason
        assert h.pserver.data_plane.segment_paths() == [] and h.pserver.data_plane.tcp.calls == 2
    finally:
        c.close()


@pytest.mark.parametrize("why", ["off-on-the-pserver", "no-token", "tls"])
def test_without_a_tcp_plane_on_the_pserver_the_trainer_stays_on_grpc(why: str, tracker: Tracker,
                                                                      tmp_path: pathlib.Path) -> None:
    from runtime.kernels.rpc import max_message_bytes
    from runtime.rpc.server import start_server
    from tests.runtime.rpc.conftest import free_port
    from tests.runtime.rpc.test_trust import _pki

    h = build_pserver(True, serve=False, tracker=tracker)
    endpoint = f"127.0.0.1:{free_port()}"
    server_security, client_security = {
        "off-on-the-pserver": (SECURITY, SECURITY), "no-token": (None, RPCSecurity())}.get(why, (None, None))
    if why == "tls":  # a token too: the frames would leave the TLS channel in clear, so no TCP plane
        pki = _pki(tmp_path)
        server_security = RPCSecurity(token=TOKEN, cert=pki["server_cert"], key=pki["server_key"])
        client_security = RPCSecurity(token=TOKEN, ca=pki["ca"])
    h.server = start_server(h.pserver, endpoint, max_message_bytes(h.program), server_security,
                            data_plane="off" if why == "off-on-the-pserver" else "auto")
    assert h.pserver.data_plane.tcp is None
    c = tcp_client(security=client_security)
    try:
        for _ in range(3):
            np.testing.assert_array_equal(c.get([(endpoint, "fc_b")])[0], np.asarray(h.scope.find_var("fc_b")))
        state = c.data_plane_state()[endpoint]
        assert c._links == {}
        assert state == ("grpc: this pserver runs with FLAGS_rpc_data_plane=off" if why == "off-on-the-pserver" else
                         "grpc: the trainer runs on another host and this pserver has no TCP data plane (no job "
                         "token, or TLS)"), state
        assert h.pserver.data_plane.segment_paths() == []
    finally:
        c.close()
