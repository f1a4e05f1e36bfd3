"""The gRPC face of a pserver: a ``flotilla.rpc.ParameterServer`` service over a ``PServer``.

Every handler takes the raw request bytes (identity deserializer), decodes them itself and maps every
problem to a status code, so a garbage request gets INVALID_ARGUMENT with a message instead of a
generic INTERNAL, and the server keeps serving. Tensors go out as bytes already encoded by
``runtime.rpc.wire`` (identity serializer): one copy of a parameter per response. SendVariableStream and
GetVariableStream move large variables as streams of Chunks (``runtime.rpc.stream``) under the same guard:
the token is checked before any chunk is read, a stream's announced length is bounded by the same message
limit as a unary call, and a truncated, over-long or garbage stream is INVALID_ARGUMENT.

The same-host data plane (``runtime.rpc.shm``): ShmOpen, ShmSend and ShmGet run under the same guard. The
servicer checks a reference completely (HMAC, incarnation, segment, range, sequence number) before it reads a
byte of shared memory, copies a sent batch out of the segment before it decodes it (the trainer reuses the
segment once the call returns), and writes a fetched batch straight into the trainer's slot (one copy of each
value, under the pserver's read locks); the decoded batch then goes through exactly the checks of
SendVariables / GetVariables. ``start_server(..., data_plane="off")`` answers every ShmOpen with no segment.
With the data plane on it also starts the pserver's control socket (``runtime.rpc.shm.ControlServer``):
ShmSend and ShmGet arriving there go to the same two handlers (``control_call``), their errors mapped to
the same status names as ``_statuses`` gives gRPC; it stops with the pserver (``pserver.closers``). A
distributed table's prefetch may arrive there too (``shm_prefetch``, no gRPC method): both references
checked, the ids copied out of the segment, then exactly PrefetchVariable's checks and lookup
(``PServer.prefetch``), the rows written into the trainer's slot under the table's lock.

The cross-host data plane (``runtime.rpc.tcp_plane``): with the data plane on and a job token (and no TLS:
its frames are not encrypted), ``start_server`` also starts a TCP listener on the endpoint's host, a port from
the OS, answered to trainers on other hosts in ``ShmOpenReply.tcp_port``. Its frames carry the bytes of
SendVariables, GetVariables and PrefetchVariable, decoded and checked as gRPC's (``tcp_call``), on a
connection bound by its handshake to one trainer incarnation; errors are the statuses ``_statuses`` gives.

Server options: message limits from the largest variable the program moves (at least 4 MiB),
``grpc.so_reuseport`` off (binding a taken port fails instead of sharing it), no HTTP proxy, keepalive
pings allowed every 10 s. The handler pool has room for a blocked barrier per trainer plus the sends and
gets of every trainer, so blocking barriers cannot starve the calls that release them.

Trust: with a job token (``RPCSecurity.token``) every call must carry ``authorization: Bearer <token>``
metadata; anything else is answered UNAUTHENTICATED before the request is even decoded (constant-time
compare; the token is never logged). Without a token nothing is checked. With a certificate and key the
server speaks TLS only; given a CA too, it requires client certificates signed by it (mutual TLS). A
pserver that authenticates nobody (no token, no mutual TLS) can be driven by any process that reaches its
port, so it serves only a loopback endpoint unless ``FLOTILLA_INSECURE_PSERVER=1`` opts out (and it then
says so at start): ``check_exposure``.
"""
from __future__ import annotations

import collections
import contextlib
import hmac
import ipaddress
import socket
import sys
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from runtime.flags import INSECURE_ENV, TOKEN_ENV, FlagError, RPCSecurity
from runtime import malloc
from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.pserver import BarrierKind, PServer, PServerError, Status
from runtime.rpc.shm import (CONTROL_ERROR, CONTROL_GET, CONTROL_OK, CONTROL_PIPELINED, CONTROL_PREFETCH,
                             CONTROL_SEND, MAX_CONTROL_MESSAGE, BatchWriter, ControlServer, PServerPlane, Progress, ShmError, copy_out)
from runtime.rpc.stream import ReceiveBuffers, encode_chunks
from runtime.rpc.tcp_plane import GET as TCP_GET, PREFETCH as TCP_PREFETCH, SEND as TCP_SEND, TcpPlaneServer
from runtime.role import parse_endpoint
from runtime.rpc.wire import BATCH_FIELD, WireError, _varint, decode_batch, decode_variable, encode_batch, \
    encode_parts, encode_variable
from runtime.scope import ExecutionError

SERVICE = "flotilla.rpc.ParameterServer"
MIN_MESSAGE = 4 << 20
AUTH_METADATA = "authorization"
_REPLY = pb.Reply().SerializeToString()


def grpc_options(max_message: int) -> list[tuple[str, Any]]:
    """Channel and server options shared by both ends."""
    size = max(MIN_MESSAGE, int(max_message))
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            ("grpc.so_reuseport", 0), ("grpc.enable_http_proxy", 0),
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1)]


def _parse(message_cls: Any, raw: bytes) -> Any:
    try:
        return message_cls.FromString(raw)
    except DecodeError as e:
        raise WireError(f"the request does not decode as {message_cls.DESCRIPTOR.full_name}: {e}") from None


class ParameterServerService:
    """The handlers; each returns response bytes or aborts the call with a status and a message."""

    def __init__(self, pserver: PServer, token: str | None = None, max_message: int = MIN_MESSAGE,
                 data_plane: PServerPlane | None = None) -> None:
        self.pserver = pserver
        self._expected = f"Bearer {token}".encode("utf-8") if token else None
        self.max_message = max(MIN_MESSAGE, int(max_message))  # streams obey the unary calls' limit
        self.buffers = ReceiveBuffers()
        # Without one (a servicer made by hand): a data plane that answers every ShmOpen with no segment.
        self.plane = data_plane if data_plane is not None else PServerPlane(lambda t: pserver.live_incarnation(t),
                                                                          token, enabled=False)

    def _authenticated(self, context: grpc.ServicerContext) -> bool:
        if self._expected is None:
            return True
        got = b""
        for key, value in context.invocation_metadata() or ():
            if key == AUTH_METADATA:
                got = value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)
                break
        return hmac.compare_digest(got, self._expected)

    def _check_token(self, context: grpc.ServicerContext) -> None:
        if not self._authenticated(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"pserver {self.pserver.config.endpoint}: the call does not carry this job's token; "
                          "nothing was done (hint: run every process of the job with the same "
                          "FLOTILLA_JOB_TOKEN; flotilla launch sets it)")

    @contextlib.contextmanager
    def _statuses(self, context: grpc.ServicerContext) -> Iterator[None]:
        """Map what the body raises to the call's status (``context.abort`` raises)."""
        try:
            yield
        except PServerError as e:
            context.abort(getattr(grpc.StatusCode, e.status.value), str(e))
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ShmError as e:
            context.abort(getattr(grpc.StatusCode, e.status), f"pserver {self.pserver.config.endpoint}: {e}")
        except grpc.RpcError:  # a request stream broke off: the client cancelled or its deadline passed
            context.abort(grpc.StatusCode.CANCELLED, "the request stream ended abnormally; nothing was done")
        except Exception as e:  # noqa: BLE001 - a bug must not take the server down
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    def _guard(self, fn: Callable[[Any], Any], *,
               stream_out: bool = False) -> Callable[[Any, grpc.ServicerContext], Any]:
        """``fn`` (request bytes, or the request chunks of a client stream) as a gRPC handler: the token is
        checked before the request is touched, errors become statuses. With ``stream_out`` ``fn`` returns
        the response messages and the handler yields them, still under the guard."""
        if stream_out:
            def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
                self._check_token(context)
                with self._statuses(context):
                    yield from fn(request)

            return streaming

        def handler(request: Any, context: grpc.ServicerContext) -> bytes:
            self._check_token(context)
            with self._statuses(context):
                return fn(request)
            raise AssertionError("unreachable: context.abort raises")

        return handler

    def send_variable(self, raw: bytes) -> bytes:
        self.pserver.send(decode_variable(raw))
        return _REPLY

    def send_variables(self, raw: bytes) -> bytes:
        msgs = decode_batch(raw)
        if not msgs:
            raise WireError("SendVariables carries no variable", hint="send at least one gradient in a batch")
        self.pserver.send_batch(msgs)
        return _REPLY

    def get_variables(self, raw: bytes) -> bytes:
        req = _parse(pb.GetVariablesRequest, raw)
        names = self._get_names(req)
        # Sync mode: nothing changes a parameter before this trainer's next SEND barrier, so the batch is built
        # from views (one copy); async: each value is copied under its writer's lock (see PServer.get_many).
        encode = encode_parts if self.pserver.config.sync_mode else encode_variable
        return encode_batch(self.pserver.get_many(req.trainer_id, names, encode, max_bytes=self.max_message))

    def get_variable(self, raw: bytes) -> bytes:
        req = _parse(pb.VariableRequest, raw)
        return self.pserver.get(req.trainer_id, req.name)

    def send_variable_stream(self, chunks: Iterator[bytes]) -> bytes:
        """SendVariable for a message streamed as Chunks (``runtime.rpc.stream``)."""
        self.pserver.send(decode_variable(self.buffers.assemble(chunks, self.max_message)))
        return _REPLY

    def get_variable_stream(self, raw: bytes) -> list[bytes]:
        """GetVariable answered as Chunks, all made (the value copied) under the pserver's read locks."""
        req = _parse(pb.VariableRequest, raw)
        return self.pserver.get_encoded(req.trainer_id, req.name, encode_chunks)

    # --- the same-host data plane (runtime.rpc.shm): gRPC carries references, shared memory the bytes
    def shm_open(self, raw: bytes) -> bytes:
        req = _parse(pb.ShmOpenRequest, raw)
        trainers = self.pserver.config.trainers
        if not 0 <= req.trainer_id < trainers:
            raise PServerError(Status.INVALID_ARGUMENT, f"ShmOpen: trainer_id {req.trainer_id} is out of range; this "
                               f"pserver serves {trainers} trainers (ids 0..{trainers - 1})")
        return self.plane.open(req).SerializeToString()

    def shm_send(self, raw: bytes, progress: Progress | None = None) -> bytes:
        """SendVariables whose batch lies in shared memory: checked reference, copied out, then as gRPC's.
        ``progress`` (a pipelined send through the control socket): the tensors' bytes are copied out as the
        trainer reports them written (everything else was written before the request)."""
        ref = _parse(pb.ShmRef, raw)
        seg, view = self.plane.resolve(ref, b"send")
        ready = None
        if progress is not None:
            start = seg.array.ctypes.data + ref.offset

            def ready(address: int) -> None:
                progress.wait(address - start)
        # the trainer reuses the segment once this call returns: the values are copied out (checked finite
        # on the way), and what is validated and kept is the copy
        msgs = [copy_out(d, self.buffers, ready) for d in decode_batch(view)]
        del view
        if not msgs:
            raise WireError("ShmSend carries no variable", hint="send at least one gradient in a batch")
        for m in msgs:
            if (m.header.trainer_id, m.header.incarnation) != (ref.trainer_id, ref.incarnation):
                raise ShmError(f"ShmSend of trainer {ref.trainer_id} (incarnation {ref.incarnation:#x}) carries "
                               f"{m.name!r} of trainer {m.header.trainer_id} (incarnation {m.header.incarnation:#x})",
                               hint="a trainer sends only its own gradients through its own segments")
        self.pserver.send_batch(msgs)
        return _REPLY

    def shm_get(self, raw: bytes) -> bytes:
        """GetVariables answered into the trainer's slot (one copy of each value, into shared memory)."""
        req = _parse(pb.ShmGetRequest, raw)
        names = self._get_names(req.get)
        if req.get.trainer_id != req.slot.trainer_id:
            raise ShmError(f"ShmGet of trainer {req.get.trainer_id} names a slot of trainer {req.slot.trainer_id}")
        _, view = self.plane.resolve(req.slot, b"slot")
        writer = BatchWriter(view, align=True)

        def encode(name: str, value: Any) -> None:
            writer.put_parts(*encode_parts(name, value))

        self.pserver.get_many(req.get.trainer_id, names, encode, max_bytes=len(view))
        return self.plane.reply(req.slot, writer.pos).SerializeToString()

    def shm_prefetch(self, raw: bytes) -> bytes:
        """PrefetchVariable whose ids lie in shared memory and whose rows are answered into the trainer's
        slot (control socket only): both references checked before a byte is read, the ids copied out,
        then exactly the checks and the lookup of a gRPC prefetch, the rows written under the table's lock."""
        req = _parse(pb.ShmPrefetchRequest, raw)
        if (req.ids.trainer_id, req.ids.incarnation) != (req.slot.trainer_id, req.slot.incarnation):
            raise ShmError(f"ShmPrefetch of trainer {req.ids.trainer_id} names a slot of trainer "
                           f"{req.slot.trainer_id} (incarnation {req.slot.incarnation:#x}); nothing was read",
                           hint="a trainer prefetches through its own segments")
        _, ids_view = self.plane.resolve(req.ids, b"ids")
        _, view = self.plane.resolve(req.slot, b"slot")
        # the slot may overlap the ids (the trainer reuses the segment): they are copied out first, and what
        # is validated and looked up is the copy
        msgs = [copy_out(d, self.buffers) for d in decode_batch(ids_view)]
        del ids_view
        if len(msgs) != 1:
            raise WireError(f"ShmPrefetch carries {len(msgs)} variables; expected the ids of one prefetch",
                            hint="a prefetch sends one ids variable per pserver")
        (msg,) = msgs
        if (msg.header.trainer_id, msg.header.incarnation) != (req.ids.trainer_id, req.ids.incarnation):
            raise ShmError(f"ShmPrefetch of trainer {req.ids.trainer_id} (incarnation {req.ids.incarnation:#x}) "
                           f"carries {msg.name!r} of trainer {msg.header.trainer_id} (incarnation "
                           f"{msg.header.incarnation:#x})", hint="a trainer prefetches only its own ids")
        writer = BatchWriter(view, align=True)
        self.pserver.prefetch(msg, lambda name, value: writer.put_parts(*encode_parts(name, value)))
        return self.plane.reply(req.slot, writer.pos).SerializeToString()

    def control_call(self, method: bytes, raw: bytes, progress: Progress | None = None) -> bytes:
        """A ShmSend (``progress``: pipelined), ShmGet or ShmPrefetch that came through the control socket
        (``runtime.rpc.shm.ControlServer``): the same handler and checks as over gRPC, its status and
        message in the answer."""
        try:
            if method in (CONTROL_SEND, CONTROL_PIPELINED):
                return CONTROL_OK + self.shm_send(raw, progress)
            if method == CONTROL_GET:
                return CONTROL_OK + self.shm_get(raw)
            if method == CONTROL_PREFETCH:
                return CONTROL_OK + self.shm_prefetch(raw)
            status, message = "INVALID_ARGUMENT", f"unknown control-socket method {method!r}; expected S, P, G or L"
        except Exception as e:  # noqa: BLE001 - mapped to a status; a bug must not take the server down
            status, message = self._failure(e)
        return CONTROL_ERROR + f"{status}\n{message}".encode("utf-8", "replace")[:MAX_CONTROL_MESSAGE - 1]

    def _failure(self, e: Exception) -> tuple[str, str]:
        """The status name and message gRPC's ``_statuses`` would give ``e`` (the data planes' answers)."""
        if isinstance(e, PServerError):
            return e.status.value, str(e)
        if isinstance(e, WireError):
            return "INVALID_ARGUMENT", str(e)
        if isinstance(e, ShmError):
            return e.status, f"pserver {self.pserver.config.endpoint}: {e}"
        return "INTERNAL", f"{type(e).__name__}: {e}"

    # --- the cross-host data plane (runtime.rpc.tcp_plane): the bytes gRPC would carry, on a TCP stream
    def tcp_call(self, method: bytes, body: memoryview, trainer_id: int, incarnation: int) -> tuple[str, list[Any]]:
        """A SendVariables, GetVariables or PrefetchVariable frame from a TCP connection bound to
        (``trainer_id``, ``incarnation``): the checks and state calls of the gRPC handler, plus that the
        request is that trainer's own. ``("OK", reply parts)`` (never joined) or ``(status, [message])``."""
        try:
            if method == TCP_SEND:
                msgs = decode_batch(body)
                if not msgs:
                    raise WireError("SendVariables carries no variable", hint="send at least one gradient in a batch")
                for m in msgs:
                    if (m.header.trainer_id, m.header.incarnation) != (trainer_id, incarnation):
                        raise self._not_own(trainer_id, incarnation, f"carries {m.name!r} of trainer "
                                            f"{m.header.trainer_id} (incarnation {m.header.incarnation:#x})")
                self.pserver.send_batch(msgs)
                return "OK", [_REPLY]
            if method == TCP_GET:
                req = _parse(pb.GetVariablesRequest, body)
                if req.trainer_id != trainer_id:
                    raise self._not_own(trainer_id, incarnation, f"asks for trainer {req.trainer_id}'s variables")
                names = self._get_names(req)
                sync = self.pserver.config.sync_mode

                def encode(name: str, value: Any) -> tuple[list[Any], int]:
                    if sync:  # views, as GetVariables builds its reply from (see there)
                        return encode_parts(name, value)
                    raw = encode_variable(name, value)  # async: copied under the variable's writer lock
                    return [raw], len(raw)

                out: list[Any] = []
                for parts, n in self.pserver.get_many(trainer_id, names, encode, max_bytes=self.max_message):
                    out += [_varint(BATCH_FIELD << 3 | 2), _varint(n), *parts]
                return "OK", out
            if method == TCP_PREFETCH:
                msg = decode_variable(body)
                if msg.header.trainer_id != trainer_id:
                    raise self._not_own(trainer_id, incarnation, f"prefetches for trainer {msg.header.trainer_id}")
                return "OK", [self.pserver.prefetch(msg)]
            status, message = "INVALID_ARGUMENT", f"unknown TCP data-plane method {method!r}"
        except Exception as e:  # noqa: BLE001 - mapped to a status; a bug must not take the server down
            status, message = self._failure(e)
        return status, [message.encode("utf-8", "replace")]

    @staticmethod
    def _not_own(trainer_id: int, incarnation: int, what: str) -> PServerError:
        return PServerError(Status.INVALID_ARGUMENT, f"a TCP data-plane request of trainer {trainer_id} (incarnation "
                            f"{incarnation:#x}) {what}; nothing was done",
                            hint="a trainer sends and fetches only its own variables on its own connection")

    def _get_names(self, req: pb.GetVariablesRequest) -> list[str]:
        if not req.names:
            raise WireError("GetVariables names no variable", hint="list the parameter blocks to fetch")
        names = list(req.names)
        if len(set(names)) != len(names):
            twice = sorted(n for n, k in collections.Counter(names).items() if k > 1)
            raise PServerError(Status.INVALID_ARGUMENT,
                               f"GetVariables names {twice[:5]} more than once ({len(names)} names, "
                               f"{len(set(names))} distinct); refused before building the reply",
                               hint="name each variable once per request")
        return names

    def prefetch_variable(self, raw: bytes) -> bytes:
        return self.pserver.prefetch(decode_variable(raw))

    def barrier(self, raw: bytes) -> bytes:
        req = _parse(pb.BarrierRequest, raw)
        if req.kind not in (pb.SEND, pb.FETCH):
            raise PServerError(Status.INVALID_ARGUMENT, f"unknown barrier kind {req.kind}; expected SEND or FETCH")
        self.pserver.barrier(req.trainer_id, req.step, BarrierKind(req.kind), req.incarnation)
        return _REPLY

    def complete(self, raw: bytes) -> bytes:
        req = _parse(pb.CompleteRequest, raw)
        self.pserver.complete(req.trainer_id, req.incarnation)
        return _REPLY

    def checkpoint_notify(self, raw: bytes) -> bytes:
        req = _parse(pb.CheckpointRequest, raw)
        self.pserver.checkpoint(req.trainer_id, req.dirname, req.incarnation)
        return _REPLY

    def announce(self, raw: bytes) -> bytes:
        req = _parse(pb.AnnounceRequest, raw)
        step = self.pserver.announce(req.trainer_id, req.incarnation, req.join_at)
        return pb.AnnounceReply(step=step).SerializeToString()

    def health(self, raw: bytes) -> bytes:
        _parse(pb.HealthRequest, raw)
        h = self.pserver.health()
        return pb.HealthReply(status=pb.HealthReply.SERVING if h["serving"] else pb.HealthReply.NOT_SERVING,
                              endpoint=h["endpoint"], pserver_id=h["pserver_id"], sync_mode=h["sync_mode"],
                              step=h["step"], live_trainers=h["live_trainers"],
                              rejected_nonfinite=h["rejected_nonfinite"]).SerializeToString()

    def generic_handler(self) -> grpc.GenericRpcHandler:
        methods = {"SendVariable": self.send_variable, "GetVariable": self.get_variable,
                   "PrefetchVariable": self.prefetch_variable, "Barrier": self.barrier, "Complete": self.complete,
                   "CheckpointNotify": self.checkpoint_notify, "Health": self.health, "Announce": self.announce,
                   "SendVariables": self.send_variables, "GetVariables": self.get_variables,
                   "ShmOpen": self.shm_open, "ShmSend": self.shm_send, "ShmGet": self.shm_get}
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._guard(fn)) for name, fn in methods.items()}
        handlers["SendVariableStream"] = grpc.stream_unary_rpc_method_handler(self._guard(self.send_variable_stream))
        handlers["GetVariableStream"] = grpc.unary_stream_rpc_method_handler(
            self._guard(self.get_variable_stream, stream_out=True))
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


def server_credentials(security: RPCSecurity) -> grpc.ServerCredentials | None:
    """TLS credentials of a pserver (None: plaintext); mutual TLS when ``security.ca`` is given."""
    if not security.server_tls:
        return None
    return grpc.ssl_server_credentials([(security.key, security.cert)], root_certificates=security.ca,
                                       require_client_auth=security.ca is not None)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an endpoint's host: a name, an IPv4 address or a bracketed IPv6 one) reaches
    only this machine: every address it resolves to is a loopback address. A wildcard (0.0.0.0, [::])
    listens on every interface and is not; neither is a name that does not resolve."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {info[4][0].split("%", 1)[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def check_exposure(endpoint: str, security: RPCSecurity) -> str | None:
    """Refuse (FlagError) to serve ``endpoint`` beyond loopback without authentication unless the user
    opted out; returns the warning to log when they did (None otherwise)."""
    if security.authenticates_clients:
        return None
    host, _ = parse_endpoint(endpoint, "the pserver's endpoint")
    if is_loopback(host):
        return None
    if not security.insecure:
        raise FlagError(f"pserver {endpoint}: {host} is reachable from other machines and this pserver authenticates "
                        f"nobody: any process that reaches the port could send gradients, complete trainers and "
                        "trigger checkpoints; refusing to start",
                        hint=f"set {TOKEN_ENV} to the job's secret in every process (flotilla launch draws one), or "
                             f"use mutual TLS (FLOTILLA_TLS_CERT, FLOTILLA_TLS_KEY, FLOTILLA_TLS_CA); to serve "
                             f"unauthenticated anyway (a private network), set {INSECURE_ENV}=1")
    return (f"pserver {endpoint}: WARNING: serving without authentication beyond loopback ({INSECURE_ENV}=1): "
            "anyone who reaches this port can send gradients, complete trainers and trigger checkpoints")


def start_server(pserver: PServer, endpoint: str, max_message: int,
                 security: RPCSecurity | None = None, data_plane: str = "auto") -> grpc.Server:
    """Bind ``endpoint`` and start serving ``pserver``; raises ExecutionError if the port cannot be bound.
    ``security`` (default: none) gives the job token and TLS settings; without authentication only a
    loopback endpoint is served unless ``security.insecure`` (``check_exposure``). ``data_plane``
    (``FLAGS_rpc_data_plane``): ``auto`` offers shared-memory segments to trainers on this host and, with a
    job token and no TLS, the TCP data plane to trainers on other hosts; ``tcp`` offers that TCP plane to
    every trainer and no segment; ``off`` refuses both.
    ``pserver.close()`` (after stopping the server) removes the segments and stops the TCP plane."""
    security = security or RPCSecurity()
    warning = check_exposure(endpoint, security)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    malloc.tune()
    workers = 16 + 4 * pserver.config.trainers
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pserver"),
                         options=grpc_options(max_message))
    plane = PServerPlane(pserver.live_incarnation, security.token, endpoint=endpoint, enabled=data_plane != "off",
                         segments=data_plane == "auto")
    pserver.incarnation_listeners.append(plane.sync_incarnation)
    pserver.closers.append(plane.close)
    pserver.data_plane = plane
    service = ParameterServerService(pserver, security.token, max_message, data_plane=plane)
    if plane.segments:
        try:
            control = ControlServer(service.control_call)
        except OSError as e:  # the trainers' data-plane calls then take gRPC
            print(f"pserver {endpoint}: no data-plane control socket ({e}); ShmSend/ShmGet/prefetches go over gRPC",
                  file=sys.stderr, flush=True)
        else:
            plane.control = control
            pserver.closers.append(control.close)
    if plane.enabled and security.token and not security.server_tls:  # the TCP plane (other hosts; tcp: all)
        host, _ = parse_endpoint(endpoint, "the pserver's endpoint")
        try:
            tcp = TcpPlaneServer(host, key=security.token.encode("utf-8"), trainers=pserver.config.trainers,
                                 live=pserver.live_incarnation, handle=service.tcp_call,
                                 max_message=service.max_message, buffers=service.buffers)
        except OSError as e:  # the trainers it would have served then stay on gRPC
            print(f"pserver {endpoint}: no TCP data plane ({e}); the trainers it would serve use gRPC",
                  file=sys.stderr, flush=True)
        else:
            plane.tcp = tcp
            pserver.closers.append(tcp.close)
    server.add_generic_rpc_handlers((service.generic_handler(),))
    creds = server_credentials(security)
    try:
        port = server.add_secure_port(endpoint, creds) if creds is not None else server.add_insecure_port(endpoint)
    except RuntimeError as e:
        port, detail = 0, str(e)
    else:
        detail = "the port is taken or the address is not local"
    if port == 0:
        raise ExecutionError(f"pserver cannot bind {endpoint}: {detail}",
                             hint="pick a free port (flotilla launch does) and an address of this machine")
    server.start()
    return server
