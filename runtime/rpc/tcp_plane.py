"""The cross-host data plane: large batches of tensors on a TCP stream beside gRPC, negotiated over gRPC.

gRPC stays the control plane and the default path (``FLAGS_rpc_data_plane=off`` keeps everything on it).
With ``auto`` (the default) a trainer whose pserver runs on another host moves batches of at least
``FLAGS_rpc_data_plane_min_bytes`` (256 KiB) on a TCP connection to the pserver instead of gRPC, and a
distributed table's prefetches too once that connection is up: gRPC Python carries a 64 MiB message at
well under half of what a plain socket carries (``bench/grpc_ceiling.py``; ``bench/ps_bench.py --netns``
measures this plane against gRPC across two namespaced hosts). Same-host pservers use shared memory
(``runtime.rpc.shm``) as before; "another host" is what ``shm.host_id`` says (boot, name, ``/dev/shm``,
network namespace).

Negotiation. ``start_server`` starts a ``TcpPlaneServer`` beside the gRPC server when the data plane is on
and the job has a token and no TLS, bound to the host of the gRPC endpoint on a port the OS picks (no flag:
a port a firewall blocks only makes the connect fail, and the trainers stay on gRPC). A trainer's first
large transfer asks ``ShmOpen`` over gRPC (authenticated, its incarnation checked); a pserver on another
host answers no segment and ``tcp_port``, a field of ``ShmOpenReply`` (no new RPC: the question "which data
plane?" is already asked there, once per pserver). The trainer connects to that port on the host it reached
gRPC at (so a name or a wildcard bind works as for gRPC) and keeps the connection for every later transfer
(one more for each call that overlaps another, e.g. an async pull beside a send).

Handshake, before any frame (bounded: ``HANDSHAKE_TIMEOUT_S`` on the pserver, the RPC deadline on the
trainer), HMAC-SHA256 keyed by the job token, mutual::

    pserver -> trainer   MAGIC, pserver nonce (32 random bytes)
    trainer -> pserver   MAGIC, trainer id, incarnation, trainer nonce, HMAC("trainer" | nonces | id | incarnation)
    pserver -> trainer   OK, HMAC("pserver" | nonces | id | incarnation)    or ERROR, status, message; closes

Each side proves it holds the token without sending it, over a nonce the other side just drew (a recorded
handshake does not replay); MACs are compared in constant time. The pserver checks the MAC first
(UNAUTHENTICATED), then the trainer id and that the incarnation is the trainer's live one (else
FAILED_PRECONDITION, as gRPC answers); a refused handshake changes nothing and closes the connection. The
connection is then bound to (trainer id, incarnation): a frame is answered only while that incarnation is
live, and carries only that trainer's gradients and requests.

Frames. A request is a method byte (``SEND``: SendVariables, ``GET``: GetVariables, ``PREFETCH``:
PrefetchVariable), its length (``FRAME``: little-endian u64), then exactly the bytes gRPC carries for that
method. The pserver hands them to the very handler gRPC calls (``ParameterServerService.tcp_call``), so every
check applies unchanged. The answer is a status byte (``OK`` or ``ERROR``), a length, then the bytes gRPC
would answer, or ``STATUS\\nmessage``, the status and message gRPC would give. A length above the pserver's
message limit (gRPC's max message size) is answered RESOURCE_EXHAUSTED and the connection dropped before a
byte of the body is read; an unknown method is INVALID_ARGUMENT and the connection dropped (the stream
cannot be trusted to be in step); a request is handled only once every byte of it has arrived, so a peer
that dies mid-frame leaves nothing, and one silent mid-frame for ``FRAME_TIMEOUT_S`` is dropped. A garbage
body is the error gRPC gives it, and the connection serves on. One thread a connection, at most
``max_connections`` of them.

Buffers (who owns what). Each side receives a body with ``recv_into`` straight into a pooled buffer
(``stream.ReceiveBuffers``): the values decoded from it are read-only views, and the buffer is handed out
again only once they are all gone (the pool's rule), so a value is never overwritten under its holder and a
64 MiB frame costs no fresh allocation. Each side sends the parts of a batch (headers, and views of the
tensors as ``wire.encode_parts`` makes them) with ``sendmsg``, never joining them: the sender's values must
not change until the call returns (a trainer's gradients of a flush; a sync pserver's parameters, unchanged
until this trainer's next SEND barrier, as for gRPC; an async pserver copies each value under its lock first).

Trust. No token (an insecure or mTLS-only job): no key, so no TCP plane; that pserver's transfers all take
gRPC. TLS (with or without a token): no TCP plane either, since its frames are not encrypted and tensors
would leave the TLS channel in clear. The handshake authenticates both ends; the frames carry no MAC of
their own (one over 64 MiB costs about what sending it does): as for gRPC with a bearer token and no TLS, a
job whose network may be tampered with runs TLS, and then gRPC.

Failures. On the trainer every socket operation is bounded by what is left of the RPC deadline (a connect by
at most ``CONNECT_TIMEOUT_S`` of it, the handshake by at most ``HANDSHAKE_TIMEOUT_S``). A connect or handshake that fails, or a connection that breaks, raises
``LinkFailed``: that call and every later one to that pserver go over gRPC (with gRPC's deadline and
retries: a send is idempotent by its per-variable seq, a fetch or prefetch is a read). A timeout is
``TimeoutError`` (the caller fails DEADLINE_EXCEEDED, as over gRPC) and drops that connection.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable, Sequence

from runtime.rpc.stream import ReceiveBuffers

MAGIC = b"flotcp01"
NONCE_BYTES = 32
MAC_BYTES = 32
_HELLO = struct.Struct(f"<{len(MAGIC)}s{NONCE_BYTES}s")
_CLAIM = struct.Struct(f"<{len(MAGIC)}siQ{NONCE_BYTES}s{MAC_BYTES}s")  # magic, trainer id, incarnation, nonce, MAC
_ID = struct.Struct("<iQ")
FRAME = struct.Struct("<cQ")  # request: method, length; answer: status byte, length
SEND, GET, PREFETCH = b"S", b"G", b"L"
METHODS = {SEND: "SendVariables", GET: "GetVariables", PREFETCH: "PrefetchVariable"}
OK, ERROR = b"\0", b"\1"
MAX_ERROR_BYTES = 1 << 16  # a handshake refusal's or an error answer's message
HANDSHAKE_TIMEOUT_S = 10.0
FRAME_TIMEOUT_S = 60.0  # the pserver drops a peer silent this long in the middle of a frame
CONNECT_TIMEOUT_S = 5.0
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)


class LinkFailed(Exception):
    """The TCP plane to a pserver could not be set up or broke: the call is made over gRPC instead."""


def handshake_mac(key: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes, trainer_id: int,
                  incarnation: int) -> bytes:
    """HMAC-SHA256 keyed by ``key`` (the job token) of who proves (``side``: ``trainer`` or ``pserver``), both
    nonces and the identity the connection will be bound to."""
    msg = side + b"\0" + server_nonce + client_nonce + _ID.pack(trainer_id, incarnation)
    return hmac.new(key, msg, hashlib.sha256).digest()


def recv_exact(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``. False if the peer closed before the first byte; ConnectionError if it
    closed after it (a truncated message)."""
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return True


def send_parts(conn: socket.socket, parts: Sequence[Any]) -> None:
    """Send the concatenation of ``parts`` (bytes, memoryviews, arrays) with ``sendmsg``, never joining them."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    i = 0
    while i < len(views):
        sent = conn.sendmsg(views[i:i + _IOV_MAX])
        while sent:
            if sent >= views[i].nbytes:
                sent -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def _error_body(status: str, message: str) -> bytes:
    return f"{status}\n{message}".encode("utf-8", "replace")[:MAX_ERROR_BYTES]


def _parse_error(body: bytes | memoryview) -> tuple[str, bytes]:
    status, _, message = bytes(body).decode("utf-8", "replace").partition("\n")
    return status, message.encode("utf-8")


# --- the pserver's side ---------------------------------------------------------------------------------
Handler = Callable[[bytes, memoryview, int, int], "tuple[str, list[Any]]"]


class TcpPlaneServer:
    """The pserver's TCP listener on ``host`` (a port from the OS: ``port``). ``handle(method, body, trainer id,
    incarnation)`` answers a frame: ``("OK", reply parts)`` or ``(status name, [message bytes])``. ``live(t)`` is
    trainer ``t``'s live incarnation (None: not announced or completed); ``key`` the job token. ``close``
    stops accepting and ends every connection. Counters: ``calls`` (frames answered), ``refused``
    (handshakes refused)."""

    def __init__(self, host: str, *, key: bytes, trainers: int, live: Callable[[int], int | None],
                 handle: Handler, max_message: int, buffers: ReceiveBuffers | None = None,
                 max_connections: int | None = None) -> None:
        if not key:
            raise ValueError("the TCP data plane needs the job token as its key")
        self._key, self._trainers, self._live, self._handle = key, trainers, live, handle
        self.max_message = int(max_message)
        self.buffers = buffers if buffers is not None else ReceiveBuffers()
        self.max_connections = max_connections if max_connections is not None else 4 * trainers + 16
        name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        family = socket.AF_INET6 if ":" in name else socket.AF_INET
        self._sock = socket.create_server((name, 0), family=family, backlog=64)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        self.calls = 0
        self.refused = 0
        threading.Thread(target=self._accept, name="tcp-plane", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.1)  # out of file descriptors, say: the trainers meanwhile time out to gRPC
                continue
            with self._lock:
                if self._closed or len(self._conns) >= self.max_connections:
                    conn.close()
                    if self._closed:
                        return
                    continue
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="tcp-plane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            who = self._handshake(conn)
            if who is None:
                with self._lock:
                    self.refused += 1
                return
            self._frames(conn, *who)
        except OSError:  # the trainer went away, broke off mid-frame, or close(): nothing of it is kept
            return
        finally:
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> tuple[int, int] | None:
        """The (trainer id, incarnation) the trainer proved, or None (refused; the answer says why)."""
        mine = secrets.token_bytes(NONCE_BYTES)
        conn.sendall(_HELLO.pack(MAGIC, mine))
        claim = bytearray(_CLAIM.size)
        if not recv_exact(conn, memoryview(claim)):
            return None
        magic, trainer_id, incarnation, theirs, mac = _CLAIM.unpack(claim)
        if magic != MAGIC:
            return self._refuse(conn, "INVALID_ARGUMENT", "this is a flotilla TCP data plane; the handshake does "
                                                          "not start with its magic")
        if not hmac.compare_digest(mac, handshake_mac(self._key, b"trainer", mine, theirs, trainer_id, incarnation)):
            return self._refuse(conn, "UNAUTHENTICATED", "the handshake does not carry this job's token's HMAC; "
                                                         "nothing was done (hint: run every process of the job "
                                                         "with the same FLOTILLA_JOB_TOKEN)")
        if not 0 <= trainer_id < self._trainers:
            return self._refuse(conn, "INVALID_ARGUMENT", f"trainer_id {trainer_id} is out of range; this pserver "
                                                          f"serves {self._trainers} trainers")
        live = self._live(trainer_id)
        if live != incarnation:
            return self._refuse(conn, "FAILED_PRECONDITION",
                                f"trainer {trainer_id} connects as incarnation {incarnation:#x}, which is not its "
                                "live incarnation (or it completed); nothing was done (hint: a trainer announces "
                                "itself before it connects)")
        conn.sendall(OK + handshake_mac(self._key, b"pserver", mine, theirs, trainer_id, incarnation))
        return trainer_id, incarnation

    @staticmethod
    def _refuse(conn: socket.socket, status: str, message: str) -> None:
        body = _error_body(status, message)
        conn.sendall(ERROR + struct.pack("<I", len(body)) + body)
        return None

    def _frames(self, conn: socket.socket, trainer_id: int, incarnation: int) -> None:
        """Answer the frames of a connection bound to (``trainer_id``, ``incarnation``) until it closes."""
        head = bytearray(FRAME.size)
        while True:
            conn.settimeout(None)  # between frames a trainer may be idle for as long as it likes
            if not recv_exact(conn, memoryview(head)):
                return
            method, length = FRAME.unpack(head)
            if method not in METHODS:
                return self._answer(conn, "INVALID_ARGUMENT", [f"unknown TCP data-plane method {method!r}; expected "
                                                               f"{b''.join(METHODS).decode()}; connection closed"
                                                               .encode()])
            if length > self.max_message:
                return self._answer(conn, "RESOURCE_EXHAUSTED", [
                    f"a {length}-byte {METHODS[method]} frame is above this pserver's message limit of "
                    f"{self.max_message} bytes; nothing was read, connection closed".encode()])
            conn.settimeout(FRAME_TIMEOUT_S)
            buf = self.buffers.take(length) if length else bytearray(0)
            body = memoryview(buf)[:length]
            del buf  # the view holds the pooled buffer; it is free again once nothing decoded from it lives
            if not recv_exact(conn, body) and length:
                raise ConnectionError(f"the trainer closed the connection before the {length}-byte body of its "
                                      "frame; nothing was kept")
            if self._live(trainer_id) != incarnation:
                return self._answer(conn, "FAILED_PRECONDITION", [
                    f"trainer {trainer_id}'s incarnation {incarnation:#x} is no longer live (a restart or "
                    "Complete); nothing was done, connection closed".encode()])
            status, parts = self._handle(method, body.toreadonly(), trainer_id, incarnation)
            del body
            with self._lock:
                self.calls += 1
            self._answer(conn, status, parts)

    @staticmethod
    def _answer(conn: socket.socket, status: str, parts: list[Any]) -> None:
        if status != "OK":  # parts: the message
            parts = [_error_body(status, b"".join(bytes(p) for p in parts).decode("utf-8", "replace"))]
        views = [memoryview(p).cast("B") for p in parts]
        send_parts(conn, [FRAME.pack(OK if status == "OK" else ERROR, sum(v.nbytes for v in views)), *views])

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        for s in (self._sock, *conns):
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept or recv
            except OSError:
                pass
        self._sock.close()


# --- the trainer's side ---------------------------------------------------------------------------------
class TcpLink:
    """One trainer's TCP data plane to one pserver at ``address`` (host, port): idle connections (each
    handshaken and bound to ``trainer_id``/``incarnation``), ``up`` until one fails (``reason`` says why),
    ``calls`` answered. Thread-safe."""

    def __init__(self, address: tuple[str, int], trainer_id: int, incarnation: int, key: bytes,
                 max_message: int) -> None:
        host, port = address
        self.address = (host[1:-1] if host.startswith("[") and host.endswith("]") else host, port)
        self.trainer_id, self.incarnation, self.max_message = trainer_id, incarnation, max_message
        self._key = key
        self.up, self.reason, self.calls = True, "", 0
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []

    def _connect(self, end: float) -> socket.socket:
        """A connection that passed the handshake, by ``end`` and within ``CONNECT_TIMEOUT_S`` +
        ``HANDSHAKE_TIMEOUT_S`` (a pserver that accepts but does not answer costs no more)."""
        timeout = max(0.001, min(CONNECT_TIMEOUT_S, end - time.monotonic()))
        conn = socket.create_connection(self.address, timeout=timeout)
        end = min(end, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _bound(conn, end)
            hello = bytearray(_HELLO.size)
            if not recv_exact(conn, memoryview(hello)):
                raise ConnectionError("the pserver closed the connection before its hello")
            magic, theirs = _HELLO.unpack(hello)
            if magic != MAGIC:
                raise ConnectionError("the pserver's hello does not carry the TCP data plane's magic")
            mine = secrets.token_bytes(NONCE_BYTES)
            mac = handshake_mac(self._key, b"trainer", theirs, mine, self.trainer_id, self.incarnation)
            conn.sendall(_CLAIM.pack(MAGIC, self.trainer_id, self.incarnation, mine, mac))
            answer = bytearray(1 + MAC_BYTES)
            if not recv_exact(conn, memoryview(answer)[:1]):
                raise ConnectionError("the pserver closed the connection during the handshake")
            if answer[:1] != OK:
                size = bytearray(4)
                recv_exact(conn, memoryview(size))
                body = bytearray(min(struct.unpack("<I", size)[0], MAX_ERROR_BYTES))
                recv_exact(conn, memoryview(body))
                status, message = _parse_error(body)
                raise ConnectionRefusedError(f"the pserver refused the handshake ({status}): {message.decode()}")
            if not recv_exact(conn, memoryview(answer)[1:]):
                raise ConnectionError("the pserver closed the connection during the handshake")
            want = handshake_mac(self._key, b"pserver", theirs, mine, self.trainer_id, self.incarnation)
            if not hmac.compare_digest(bytes(answer[1:]), want):
                raise ConnectionRefusedError("the pserver did not prove it holds the job token; not used")
        except BaseException:
            conn.close()
            raise
        return conn

    def call(self, method: bytes, parts: Sequence[Any], end: float,
             buffers: ReceiveBuffers) -> tuple[str, memoryview]:
        """Send ``method`` with the body ``parts`` and wait for the answer, by ``end`` (``time.monotonic``):
        ``("OK", reply)`` (a read-only view of a buffer of ``buffers``) or ``(status name, message)``. Raises
        LinkFailed when the plane is down or the connection fails or breaks (it is down from then on),
        TimeoutError when ``end`` passes (that connection is dropped: its answer may still come)."""
        with self._lock:
            if not self.up:
                raise LinkFailed(self.reason)
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            try:
                conn = self._connect(end)
            except OSError as e:  # refused, unreachable, timed out, or the handshake failed: gRPC
                self.down(f"connecting to the TCP data plane at {self.address[0]}:{self.address[1]} failed: {e}")
                raise LinkFailed(self.reason) from None
        try:
            views = [memoryview(p).cast("B") for p in parts]
            _bound(conn, end)
            send_parts(conn, [FRAME.pack(method, sum(v.nbytes for v in views)), *views])
            head = bytearray(FRAME.size)
            _bound(conn, end)
            if not recv_exact(conn, memoryview(head)):
                raise ConnectionResetError("the pserver closed the connection before answering")
            status, length = FRAME.unpack(head)
            if status not in (OK, ERROR) or length > (self.max_message if status == OK else MAX_ERROR_BYTES):
                raise ConnectionError(f"the pserver answered garbage (status {status!r}, {length} bytes)")
            buf = buffers.take(length) if length else bytearray(0)
            body = memoryview(buf)[:length]
            del buf
            _bound(conn, end)
            if not recv_exact(conn, body) and length:
                raise ConnectionResetError(f"the pserver closed the connection before its {length}-byte answer")
        except TimeoutError:  # socket.timeout too
            conn.close()
            raise TimeoutError(f"no answer on the TCP data plane to {self.address[0]}:{self.address[1]} "
                               "within the deadline") from None
        except OSError as e:
            conn.close()
            self.down(f"the TCP data plane to {self.address[0]}:{self.address[1]} failed: {e}")
            raise LinkFailed(self.reason) from None
        with self._lock:
            self.calls += 1
            if self.up:
                self._idle.append(conn)
                conn = None
        if conn is not None:
            conn.close()
        if status == OK:
            return "OK", body.toreadonly()
        status_name, message = _parse_error(body)
        return status_name, memoryview(message)

    def down(self, reason: str) -> None:
        """Take the plane down (later calls raise LinkFailed) and close its idle connections."""
        with self._lock:
            if self.up:
                self.up, self.reason = False, reason
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        self.down("the client was closed")


def _bound(conn: socket.socket, end: float) -> None:
    """The next socket operation on ``conn`` may take until ``end`` (``time.monotonic``)."""
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    conn.settimeout(left)
