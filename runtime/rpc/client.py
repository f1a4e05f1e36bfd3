"""The trainer's side of the protocol: one ``RPCClient`` per (Executor, trainer id), held by the
Executor's ``runtime.rpc.session.RPCSession``.

The RPC kernels (``runtime.kernels.rpc``) call it. One round trip per pserver per step: ``send`` only
queues a gradient; ``flush`` (the send kernel calls it after the last send op of a run) puts the queue
on the wire as one ``SendVariables`` request per pserver, every pserver at once, encoded and sent on a
small thread pool; ``get`` fetches a step's parameter blocks as one ``GetVariables`` per pserver. Anything
that must see the sends (a barrier, a recv, a prefetch, Complete) first waits for them and raises the
first send error. A pserver's requests leave in the order they were flushed. A variable of
``runtime.rpc.stream.STREAM_THRESHOLD`` bytes or more travels on its own as a stream of 1 MiB chunks
(SendVariableStream; GetVariableStream once the client has seen its size), received into reused buffers.

Async mode (``pull``): a trainer never waits for its own sends of the step. Step ``r``'s recv hands the
step's sends to a background pull, which waits until they are acknowledged and then fetches every
parameter block; the recv returns the newest pull that has finished, waiting only for pull ``r - K``
(``K`` = ``FLAGS_communicator_max_staleness``, default 1). So the parameters a trainer computes step
``s`` with reflect its own gradients of every step up to ``s - 1 - K`` (and whatever the pservers
applied from other trainers before that pull began), and at most ``K + 1`` steps of its sends are in
flight. ``K = 0`` blocks on every step's sends and fetch.

Robustness: every call has a deadline (``FLAGS_rpc_deadline`` ms, read when the client is made);
calls that failed UNAVAILABLE are retried with backoff up to ``FLAGS_rpc_retry_times`` attempts (every
call here is idempotent: sends carry a per-variable sequence number the pserver deduplicates on,
barriers and Complete count trainers). The first contact with each endpoint waits (bounded by the
deadline) until the pserver accepts connections, printing every ``FLAGS_rpc_wait_report_ms`` (10 s) to
stderr the endpoints still missing and the time left, and at the deadline names every one still missing.
Errors are ``RPCError``s naming the method, the endpoint and the pserver's message.

Identity: each client draws a random incarnation id and announces (trainer id, incarnation) to every
pserver before its first other call there (``announce``; the kernels announce every endpoint of the
program at once, so a restarted trainer is admitted on every pserver at the same step boundary). The
pservers answer the step the trainer joins at; it becomes ``step``. Sends, barriers, Complete and
CheckpointNotify carry the incarnation. Trust: with a job token every call carries it as
``authorization: Bearer <token>`` metadata; with a CA the channels are TLS (mutual when this process
has a certificate and key). Settings come from ``runtime.flags.rpc_security`` unless given.

Data plane (``runtime.rpc.shm``; ``FLAGS_rpc_data_plane``, read when the client is made): with ``auto``
the first large transfer to a pserver asks it for a shared-memory segment; a pserver on this host
creates one and from then on a batch of at least ``FLAGS_rpc_data_plane_min_bytes`` (256 KiB: the large
gradients of a flush; the parameters of a fetch this client has seen at that size) travels through
segments, the gRPC call carrying only a signed reference; that pserver's small values of the same flush
(or fetch, those of a size seen before) go in the same segment, so a step makes one call each way. A
pserver on another host (then the TCP plane below, where it has one), one with the data plane off, or a
segment that cannot be mapped leaves that pserver without segments for good; a full ring (every segment still
holding values the trainer uses) sends that one transfer through gRPC. A distributed table's prefetch
(``prefetch``) whose answer size the client knows (from an earlier prefetch of those ids) goes through a
segment too, once the plane to that pserver is up or its ids or rows are that large: the ids written there,
the rows answered into the same segment, the request on the control socket (without one, or when it breaks, a
PrefetchVariable over gRPC).

A pserver on another host answers ShmOpen with the port of its TCP data plane (``runtime.rpc.tcp_plane``;
it has one when the job has a token and no TLS): this client then connects (one connection per pserver,
reused, after a mutual HMAC handshake) and sends and fetches the batches it would have put in segments on
that connection, as the bytes SendVariables / GetVariables carry, and its prefetches to that pserver too.
A connection that cannot be made or breaks leaves that pserver on gRPC for good, that call included.
With ``tcp`` the client reports no host in ShmOpen, so every pserver (this host's too) answers its TCP plane
and never a segment.
"""
from __future__ import annotations

import collections
import os
import secrets
import sys
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterable, Sequence

import grpc
import numpy as np

from ir.errors import FlotillaError
from ir.names import is_geo_updates_name
from runtime import malloc
from runtime.flags import RPCSecurity, data_plane_mode, flag, rpc_security
from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.server import SERVICE, grpc_options
from runtime.rpc.shm import (ALIGN_SLACK, CONTROL_GET, CONTROL_PIPELINED, CONTROL_PREFETCH, CONTROL_SEND, HEADER_BYTES,
                             MAX_SEGMENTS, PIPELINE_MIN_BYTES, ControlFailed, Segment, ShmError, TrainerPlane,
                             deferred_parts, host_id, open_segment, write_batch, write_deferred)
from runtime.rpc.stream import STREAM_THRESHOLD, ReceiveBuffers, get_chunked, send_chunked
from runtime.rpc.tcp_plane import GET as TCP_GET, PREFETCH as TCP_PREFETCH, SEND as TCP_SEND, LinkFailed, TcpLink
from runtime.role import parse_endpoint
from runtime.rpc.wire import BATCH_FIELD, _varint, decode_batch, decode_variable, encode_batch, encode_parts, \
    encode_variable

DEFAULT_MAX_MESSAGE = 1 << 30
_RETRY_BACKOFF = (0.1, 0.3, 1.0)
# gRPC waits 1 s after a refused connection, then 1.6x longer each time (up to 2 min): a trainer started
# beside its pservers (as a launcher starts a job) connected a second or more after they were listening.
# Loopback and LAN refusals cost nothing, so retry from 100 ms, never more than a second apart.
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
_UNANNOUNCED = ("Announce", "Health")  # the calls that need no announcement first


class RPCError(FlotillaError):
    """An RPC to a pserver failed."""

    code = "E730"

    def __init__(self, message: str, hint: str | None = None, status: grpc.StatusCode | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status


def _identity(x: bytes) -> bytes:
    return x


class _Endpoint:
    """A channel to one pserver and its method callables."""

    def __init__(self, endpoint: str, max_message: int, security: RPCSecurity) -> None:
        self.endpoint = endpoint
        options = grpc_options(max_message) + _RECONNECT
        if security.client_tls:
            if security.server_name:
                options.append(("grpc.ssl_target_name_override", security.server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=security.ca, private_key=security.key,
                                                 certificate_chain=security.cert)
            self.channel = grpc.secure_channel(endpoint, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(endpoint, options=options)
        self.ready = False
        self.announced = False

        def method(name: str) -> Any:
            return self.channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=_identity,
                                            response_deserializer=_identity)

        self.calls = {name: method(name) for name in ("SendVariable", "GetVariable", "PrefetchVariable", "Barrier",
                                                      "Complete", "CheckpointNotify", "Health",
                                                      "Announce", "SendVariables", "GetVariables", "ShmOpen",
                                                      "ShmSend", "ShmGet")}
        self.calls["SendVariableStream"] = self.channel.stream_unary(
            f"/{SERVICE}/SendVariableStream", request_serializer=_identity, response_deserializer=_identity)
        self.calls["GetVariableStream"] = self.channel.unary_stream(
            f"/{SERVICE}/GetVariableStream", request_serializer=_identity, response_deserializer=_identity)
        self.last_send: futures.Future[None] | None = None  # requests to one pserver leave in order


class RPCClient:
    """Talks to the pservers for trainer ``trainer_id``; ``step`` counts the trainer's SEND barriers."""

    def __init__(self, trainer_id: int, *, deadline: float | None = None, retries: int | None = None,
                 max_message: int = DEFAULT_MAX_MESSAGE, security: RPCSecurity | None = None,
                 incarnation: int | None = None, data_plane: str | None = None, host: str | None = None) -> None:
        """``host``: the host identity this client reports in ShmOpen (default ``shm.host_id()``); a test
        passes another to take the cross-host (TCP) data plane to a pserver of this machine."""
        self.trainer_id = trainer_id
        self.security = security if security is not None else rpc_security()
        self._metadata = (("authorization", f"Bearer {self.security.token}"),) if self.security.token else None
        self.incarnation = incarnation if incarnation is not None else secrets.randbits(63) | 1
        self._joined = False
        self.deadline = deadline if deadline is not None else flag("FLAGS_rpc_deadline") / 1000.0
        self.wait_report = flag("FLAGS_rpc_wait_report_ms") / 1000.0
        self.retries = retries if retries is not None else flag("FLAGS_rpc_retry_times")
        self.max_message = max_message
        self.step = 0
        self._barrier_sent = False  # a SEND barrier of `step` went out (to `_barrier_eps`)
        self._barrier_eps: frozenset[str] = frozenset()
        self._fetch_owed: list[str] = []  # pservers owed the FETCH barrier of `step - 1` (see `barrier`)
        self._endpoints: dict[str, _Endpoint] = {}
        self._seq: dict[tuple[str, str], int] = {}  # (endpoint, variable) -> the last seq sent
        self._outbox: dict[str, list[tuple[str, Any, int, int]]] = {}  # endpoint -> (name, value, seq, step)
        self._pending: list[futures.Future[None]] = []
        self._pulls: dict[Any, collections.deque[tuple[int, futures.Future[list[Any]]]]] = {}
        self._round = 0
        self._sizes: dict[str, int] = {}  # bytes of each variable fetched so far: large ones are streamed
        # (endpoint, ids name) -> (bytes of rows per id, bytes of the reply beyond them) of the last prefetch
        self._prefetch_sizes: dict[tuple[str, str], tuple[float, int]] = {}
        self._buffers = ReceiveBuffers()
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"trainer{trainer_id}-rpc")
        self._puller = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"trainer{trainer_id}-pull")
        self._lock = threading.Lock()
        self._closed = False
        self.data_plane = data_plane if data_plane is not None else data_plane_mode()
        # tcp: no host is reported, so no pserver offers segments (only its TCP plane)
        self._host = (host if host is not None else host_id()) if self.data_plane == "auto" else ""
        self._planes: dict[str, TrainerPlane] = {}  # endpoint -> its shared-memory segments
        self._links: dict[str, TcpLink] = {}  # endpoint (on another host) -> its TCP data plane
        # bytes of a batch (send) or a variable (get) from which it goes through shared memory
        self.shm_threshold = flag("FLAGS_rpc_data_plane_min_bytes")
        malloc.tune()

    # --- connections
    def _endpoint(self, endpoint: str) -> _Endpoint:
        with self._lock:
            ep = self._endpoints.get(endpoint)
            if ep is None:
                ep = self._endpoints[endpoint] = _Endpoint(endpoint, self.max_message, self.security)
            return ep

    def wait_ready(self, endpoints: Iterable[str]) -> None:
        """Wait (at most the deadline) until every endpoint accepts connections, saying on stderr every
        ``wait_report`` seconds which ones are still missing: a silent wait looks like a hang. The probe is
        a Health call that waits for the channel to connect (``wait_for_ready``): any answer, an error
        status too, means the pserver is up. (``grpc.channel_ready_future`` would leave a thread polling
        the channel, which dies with "Channel closed!" on stderr when the client closes soon after.)"""
        eps = [self._endpoint(e) for e in dict.fromkeys(endpoints)]
        end = time.monotonic() + self.deadline
        probe = pb.HealthRequest().SerializeToString()
        pending = {ep.endpoint: ep.calls["Health"].future(probe, timeout=self.deadline, metadata=self._metadata,
                                                          wait_for_ready=True) for ep in eps if not ep.ready}
        next_report = time.monotonic() + self.wait_report
        missed: list[str] = []  # never connected within the deadline
        while pending:
            for name in list(pending):
                try:
                    pending[name].result(timeout=max(0.0, min(end, next_report) - time.monotonic()))
                except grpc.FutureTimeoutError:
                    continue
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        missed.append(name)
                        del pending[name]
                        continue
                self._endpoints[name].ready = True
                del pending[name]
            now = time.monotonic()
            if not pending or now >= end:
                break
            if now >= next_report:
                _log_stderr(f"trainer {self.trainer_id}: waiting for pserver(s) {', '.join(pending)} to accept "
                            f"connections; {end - now:.0f}s left of the {self.deadline:g}s deadline "
                            "(FLAGS_rpc_deadline)")
                next_report = now + self.wait_report
        for fut in pending.values():
            fut.cancel()
        missed += pending
        if missed:
            raise RPCError(f"trainer {self.trainer_id}: pserver(s) {missed} did not come up within "
                           f"{self.deadline:g}s", hint="start the pservers first (flotilla launch does), check the "
                           "endpoints, or raise FLAGS_rpc_deadline")

    def announce(self, endpoints: Iterable[str]) -> None:
        """Announce this trainer incarnation to each endpoint not yet told (concurrently); the pservers'
        join steps must agree (a rejoining trainer asks the ones behind to join at the latest)."""
        todo = [e for e in dict.fromkeys(endpoints) if not self._endpoint(e).announced]
        if not todo:
            return
        self.wait_ready(todo)

        def ask(join_at: int, eps: list[str]) -> dict[str, int]:
            req = pb.AnnounceRequest(trainer_id=self.trainer_id, incarnation=self.incarnation,
                                     join_at=join_at).SerializeToString()
            raws = self._all([(ep, "Announce", req, f"(incarnation {self.incarnation:#x})") for ep in eps])
            return {ep: pb.AnnounceReply.FromString(raw).step for ep, raw in zip(eps, raws)}

        steps = ask(0, todo)
        join = max(steps.values())
        if self._joined:
            join = max(join, self.step)
        behind = [ep for ep, s in steps.items() if s < join]
        if behind:
            steps.update(ask(join, behind))
        wrong = {ep: s for ep, s in steps.items() if s != join}
        if wrong:
            raise RPCError(f"trainer {self.trainer_id}: pservers disagree on the step to join at: {steps}",
                           hint="the pservers of one job must serve the same steps; restart the job")
        if not self._joined:
            self.step, self._joined = join, True
        for ep in todo:
            self._endpoints[ep].announced = True

    def _call(self, endpoint: str, method: str, request: bytes, what: str) -> bytes:
        """One unary call, retried (see the module docstring); the reply bytes."""
        return self._retried(endpoint, method, what, lambda call, timeout: call(request, timeout=timeout,
                                                                                metadata=self._metadata))

    def _retried(self, endpoint: str, method: str, what: str, invoke: Callable[[Any, float], Any]) -> Any:
        """``invoke(callable, timeout)`` for ``method`` on ``endpoint``, retried with backoff while it
        fails UNAVAILABLE and time and attempts are left; other failures raise RPCError."""
        ep = self._endpoint(endpoint)
        if not ep.ready:
            self.wait_ready([endpoint])
        if not ep.announced and method not in _UNANNOUNCED:
            self.announce([endpoint])
        end = time.monotonic() + self.deadline
        attempt = 0
        while True:
            attempt += 1
            try:
                return invoke(ep.calls[method], max(0.001, end - time.monotonic()))
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE and attempt < self.retries and time.monotonic() < end:
                    time.sleep(min(_RETRY_BACKOFF[min(attempt - 1, len(_RETRY_BACKOFF) - 1)],
                                   max(0.0, end - time.monotonic())))
                    continue
                hint = ("the pserver is down or unreachable" if code in (grpc.StatusCode.UNAVAILABLE,
                                                                         grpc.StatusCode.DEADLINE_EXCEEDED)
                        else None)
                raise RPCError(f"trainer {self.trainer_id}: {method} {what} to pserver {endpoint} failed "
                               f"({code.name}, attempt {attempt}): {e.details()}", hint=hint, status=code) from None

    def _all(self, jobs: Sequence[tuple[str, str, bytes, str]]) -> list[bytes]:
        """Run the calls ``(endpoint, method, request, what)`` concurrently; results in order. When several
        fail, the error raised names an unreachable pserver if one is (UNAVAILABLE): a SEND barrier to a live
        pserver times out only because the job lost another one, which is the cause to report."""
        if len(jobs) == 1:
            return [self._call(*jobs[0])]
        futs = [self._pool.submit(self._call, *job) for job in jobs]
        results, errors = [], []
        for f in futs:
            try:
                results.append(f.result())
            except RPCError as e:
                errors.append(e)
        if errors:
            raise next((e for e in errors if e.status == grpc.StatusCode.UNAVAILABLE), errors[0])
        return results

    # --- the operations the kernels need
    def send(self, endpoint: str, name: str, value: Any) -> None:
        """Queue ``value`` to be sent as ``name`` at the next ``flush``."""
        self._check_open()
        if not self._endpoint(endpoint).announced:
            self.announce([endpoint])
        queue = self._outbox.setdefault(endpoint, [])
        if any(entry[0] == name for entry in queue):
            self.flush()  # a second value of the same variable goes in a later request
            queue = self._outbox.setdefault(endpoint, [])
        seq = self._seq[endpoint, name] = self._seq.get((endpoint, name), 0) + 1
        queue.append((name, value, seq, self.step))

    def flush(self) -> None:
        """Put every queued send on the wire without waiting: one request per pserver, all at once."""
        outbox, self._outbox = self._outbox, {}
        for endpoint, entries in outbox.items():
            ep = self._endpoint(endpoint)
            ep.last_send = self._pool.submit(self._send_entries, endpoint, entries, ep.last_send)
            self._pending.append(ep.last_send)

    def _send_entries(self, endpoint: str, entries: list[tuple[str, Any, int, int]],
                      before: futures.Future[None] | None) -> None:
        """Send one pserver's queued gradients: through a segment when one of them has at least
        ``shm_threshold`` bytes and the data plane is up (the whole batch then, small ones included: one
        call); otherwise those of at least ``STREAM_THRESHOLD`` bytes each as a chunked stream, the rest as
        one SendVariables (or SendVariable when alone)."""
        msgs = [(name, encode_parts(name, value, trainer_id=self.trainer_id, step=step, seq=seq,
                                    incarnation=self.incarnation)) for name, value, seq, step in entries]
        shm: list[tuple[str, tuple[list[Any], int]]] = []
        if self.data_plane != "off" and any(total >= self.shm_threshold for _, (_, total) in msgs) \
                and self._on_a_plane(endpoint):
            shm, msgs = msgs, []  # the batch takes the data plane: its small gradients ride along, saving a call
        small = [(name, msg) for name, msg in msgs if msg[1] < STREAM_THRESHOLD]
        large = [(name, msg) for name, msg in msgs if msg[1] >= STREAM_THRESHOLD]
        if before is not None:
            futures.wait([before])  # its error, if any, is reported by whoever waits for it
        if shm and not (self._send_shm(endpoint, shm) or self._send_tcp(endpoint, shm)):
            for name, msg in shm:
                (large if msg[1] >= STREAM_THRESHOLD else small).append((name, msg))
        for name, (parts, total) in large:
            self._retried(endpoint, "SendVariableStream", f"of {name!r}",
                          lambda call, timeout, parts=parts, total=total: send_chunked(
                              call, parts, total, timeout, self._metadata))
        if len(small) == 1:
            name, (parts, _) = small[0]
            self._call(endpoint, "SendVariable", b"".join(parts), f"of {name!r}")
        elif small:
            self._call(endpoint, "SendVariables", encode_batch([m for _, m in small]), f"of {[n for n, _ in small]}")

    def wait_sends(self) -> None:
        if len(self._outbox) == 1 and all(f.done() for f in self._pending):
            # one pserver's queue and nothing in flight: sent from this thread, without a hop to the pool
            (endpoint, entries), = self._outbox.items()
            self._outbox = {}
            pending, self._pending = self._pending, []
            _wait_all(pending)
            self._send_entries(endpoint, entries, None)
            return
        self.flush()
        pending, self._pending = self._pending, []
        _wait_all(pending)

    def get(self, requests: Sequence[tuple[str, str]]) -> list[Any]:
        """The values of ``(endpoint, name)`` pairs after every send so far: one request per pserver,
        every pserver at once."""
        self.wait_sends()
        return self._get_now(requests)

    def _get_now(self, requests: Sequence[tuple[str, str]]) -> list[Any]:
        """Fetch now: per pserver one GetVariables (GetVariable when alone), and a chunked stream for each
        variable this client has seen at ``STREAM_THRESHOLD`` bytes or more; or one ShmGet for a pserver
        with a variable this client has seen at ``shm_threshold`` bytes or more (with every variable of
        that pserver of a known size); every call in flight at once."""
        by_endpoint: dict[str, list[int]] = {}
        streamed: list[int] = []
        shm: dict[str, list[int]] = {}
        alone: list[int] = []
        for i, (ep, name) in enumerate(requests):
            size = self._sizes.get(name, 0)
            if size >= self.shm_threshold and self._on_a_plane(ep):
                shm.setdefault(ep, []).append(i)
            elif size >= STREAM_THRESHOLD:
                streamed.append(i)
            elif is_geo_updates_name(name):
                # Its size is that of the last reply, but the pserver bounds a request by the whole table
                # shard: in a batch with the parameters it could exceed the reply limit.
                alone.append(i)
            else:
                by_endpoint.setdefault(ep, []).append(i)
        for ep, idx in list(by_endpoint.items()):
            # A pserver's fetch that takes a segment anyway brings the small values of known size along.
            known = [i for i in idx if self._sizes.get(requests[i][1], 0)]
            if ep in shm and known:
                shm[ep] = sorted(shm[ep] + known)
                by_endpoint[ep] = [i for i in idx if not self._sizes.get(requests[i][1], 0)]
                if not by_endpoint[ep]:
                    del by_endpoint[ep]
        values: list[Any] = [None] * len(requests)
        if len(shm) == 1 and not streamed and not by_endpoint and not alone:  # one fetch: no hop to the pool
            (ep, idx), = shm.items()
            got = self._get_plane(ep, [requests[i][1] for i in idx])
            return got if got is not None else [self._get_one(ep, requests[i][1]) for i in idx]
        shm_jobs = {ep: self._pool.submit(self._get_plane, ep, [requests[i][1] for i in idx]) for ep, idx in shm.items()}
        stream_jobs = [self._pool.submit(self._get_streamed, *requests[i]) for i in streamed]
        alone_jobs = [self._pool.submit(self._get_one, *requests[i]) for i in alone]
        jobs = []
        for ep, idx in by_endpoint.items():
            names = [requests[i][1] for i in idx]
            if len(names) == 1:
                req = pb.VariableRequest(name=names[0], trainer_id=self.trainer_id, step=self.step)
                jobs.append((ep, "GetVariable", req.SerializeToString(), f"of {names[0]!r}"))
            else:
                req = pb.GetVariablesRequest(names=names, trainer_id=self.trainer_id, step=self.step)
                jobs.append((ep, "GetVariables", req.SerializeToString(), f"of {names}"))
        for (ep, idx), (_, method, _, what), raw in zip(by_endpoint.items(), jobs, self._all(jobs)):
            decoded = [decode_variable(raw)] if method == "GetVariable" else decode_batch(raw)
            names = [requests[i][1] for i in idx]
            if [d.name for d in decoded] != names:
                raise RPCError(f"trainer {self.trainer_id}: GetVariables {what} from pserver {ep} answered "
                               f"{[d.name for d in decoded]}", hint="the pserver runs a different program version")
            for i, d in zip(idx, decoded):
                values[i] = d.value
                self._sizes[d.name] = d.value.nbytes if hasattr(d.value, "nbytes") else 0
        for i, fut in zip(streamed + alone, stream_jobs + alone_jobs):
            values[i] = fut.result()
        for ep, job in shm_jobs.items():
            got = job.result()
            for k, i in enumerate(shm[ep]):  # None: no free segment or no room; those take gRPC (rare)
                values[i] = got[k] if got is not None else self._get_one(ep, requests[i][1])
        return values

    def _get_one(self, endpoint: str, name: str) -> Any:
        """One variable through gRPC: streamed when large, else a GetVariable."""
        if self._sizes.get(name, 0) >= STREAM_THRESHOLD:
            return self._get_streamed(endpoint, name)
        req = pb.VariableRequest(name=name, trainer_id=self.trainer_id, step=self.step).SerializeToString()
        decoded = decode_variable(self._call(endpoint, "GetVariable", req, f"of {name!r}"))
        if decoded.name != name:
            raise RPCError(f"trainer {self.trainer_id}: GetVariable of {name!r} from pserver {endpoint} answered "
                           f"{decoded.name!r}", hint="the pserver runs a different program version")
        self._sizes[name] = decoded.value.nbytes if hasattr(decoded.value, "nbytes") else 0
        return decoded.value

    # --- the same-host data plane (runtime.rpc.shm)
    def _plane(self, endpoint: str) -> TrainerPlane | None:
        """``endpoint``'s segments, unless the data plane is off or that pserver cannot have one (with ``tcp``
        the plane's state only: the pserver answers its TCP plane, never a segment)."""
        if self.data_plane == "off":
            return None
        with self._lock:
            plane = self._planes.get(endpoint)
            if plane is None:
                plane = self._planes[endpoint] = TrainerPlane(self.trainer_id, self.incarnation, self.security.token)
        return None if plane.state is False else plane

    def data_plane_state(self) -> dict[str, str]:
        """Per pserver this client moved a large tensor with: ``shm`` (its segments are up), ``grpc: <why>``
        (the data plane is unavailable there), ``tcp (N transfers)`` (another host: the TCP plane is up, N
        calls answered on it) or ``pending`` (not asked yet)."""
        state = {ep: "shm" if p.state else "pending" if p.state is None else f"grpc: {p.reason}"
                 for ep, p in sorted(self._planes.items())}
        for ep, link in self._links.items():
            state[ep] = f"tcp ({link.calls} transfers)" if link.up else f"grpc: {link.reason}"
        return state

    def _segment(self, endpoint: str, nbytes: int) -> tuple[TrainerPlane, Segment] | None:
        """A free segment of ``endpoint`` with room for ``nbytes`` (marked busy; give it back), asking the
        pserver for a new one when none is free; None: use gRPC for this transfer."""
        plane = self._plane(endpoint)
        if plane is None:
            return None
        seg = plane.take(nbytes)
        if seg is not None:
            return plane, seg
        with plane.lock:
            if len(plane.segments) >= MAX_SEGMENTS:
                return None
        req = pb.ShmOpenRequest(trainer_id=self.trainer_id, incarnation=self.incarnation, host=self._host,
                                min_bytes=nbytes).SerializeToString()
        reply = pb.ShmOpenReply.FromString(self._call(endpoint, "ShmOpen", req, f"of {nbytes} bytes"))
        if not reply.path:
            if not reply.later:  # another host, or the data plane off there: no segments for good
                plane.state, plane.reason = False, reply.reason
            if reply.tcp_port and self.security.token and not self.security.client_tls:
                host, _ = parse_endpoint(endpoint, "the pserver's endpoint")
                with self._lock:
                    self._links.setdefault(endpoint, TcpLink((host, reply.tcp_port), self.trainer_id,
                                                             self.incarnation, self.security.token.encode("utf-8"),
                                                             self.max_message))
            return None
        try:
            seg = open_segment(reply)
        except (OSError, ShmError) as e:  # e.g. a /dev/shm of its own: this pserver stays on gRPC
            plane.state, plane.reason = False, f"mapping {reply.path} failed: {e}"
            try:
                os.unlink(reply.path)
            except OSError:
                pass
            return None
        if reply.key:
            plane.key = reply.key
        plane.state = True
        plane.add(seg)
        return plane, seg

    def _send_shm(self, endpoint: str, messages: list[tuple[str, tuple[list[Any], int]]]) -> bool:
        """Send ``messages`` as one batch through a segment; False when no segment could be had."""
        total = sum(len(_varint(BATCH_FIELD << 3 | 2)) + len(_varint(n)) + n for _, (_, n) in messages)
        got = self._segment(endpoint, total)
        if got is None:
            return False
        plane, seg = got
        what = f"of {[n for n, _ in messages]}"
        data = seg.view(HEADER_BYTES, seg.size - HEADER_BYTES)
        # A large batch is pipelined: its tensors are written piece by piece after the request left, the
        # pserver copying each piece out while the next is written (and while the piece is in cache).
        pipelined = (data, deferred_parts([m for _, m in messages])) if (
            total >= PIPELINE_MIN_BYTES and plane.control is not None) else None

        try:
            length = write_batch(data, [m for _, m in messages], defer=pipelined is not None)
            if self._control(plane, CONTROL_PIPELINED if pipelined else CONTROL_SEND,
                             plane.sign(b"send", seg, length, plane.next_seq()).SerializeToString(),
                             f"ShmSend {what} to pserver {endpoint}", pipelined=pipelined) is None:
                self._retried(endpoint, "ShmSend", what,
                              lambda call, timeout: call(plane.sign(b"send", seg, length, plane.next_seq())
                                                         .SerializeToString(), timeout=timeout, metadata=self._metadata))
        finally:
            plane.give_back(seg)
        return True

    def _control(self, plane: TrainerPlane, method: bytes, request: bytes, what: str, *, pipelined: Any = None,
                 may_not_fit: bool = False) -> tuple[str, bytes] | None:
        """``(status, answer)`` of one call on ``plane``'s control socket; None when it has none or it broke
        (the caller goes to gRPC; a pipelined send's tensors are written out first). A timeout, or an error
        status, is an RPCError as over gRPC; with ``may_not_fit`` RESOURCE_EXHAUSTED (a slot too small) is
        answered instead."""
        try:
            status, answer = plane.call(method, request, self.deadline, pipelined)
        except ControlFailed:
            if pipelined is not None:  # the whole batch must be in place for gRPC
                write_deferred(*pipelined)
            return None
        except TimeoutError as e:
            raise RPCError(f"trainer {self.trainer_id}: {what} failed (DEADLINE_EXCEEDED): {e}",
                           hint="the pserver is down or unreachable",
                           status=grpc.StatusCode.DEADLINE_EXCEEDED) from None
        if status == "OK" or (may_not_fit and status == "RESOURCE_EXHAUSTED"):
            return status, answer
        raise RPCError(f"trainer {self.trainer_id}: {what} failed ({status}, control socket): "
                       f"{answer.decode('utf-8', 'replace')}",
                       status=getattr(grpc.StatusCode, status, grpc.StatusCode.UNKNOWN))

    def _get_shm(self, endpoint: str, names: list[str]) -> list[Any] | None:
        """The values of ``names`` fetched into a segment (read-only views of it), or None: use gRPC."""
        room = sum(self._sizes.get(n, 0) + len(n) + 64 + ALIGN_SLACK for n in names) + 1024
        got = self._segment(endpoint, room)
        if got is None:
            return None
        plane, seg = got
        try:
            room = seg.size - HEADER_BYTES
            asked = pb.GetVariablesRequest(names=names, trainer_id=self.trainer_id, step=self.step)
            slots: list[pb.ShmRef] = []

            def invoke(call: Any, timeout: float) -> bytes:
                slots.append(plane.sign(b"slot", seg, room, plane.next_seq()))
                return call(pb.ShmGetRequest(get=asked, slot=slots[-1]).SerializeToString(), timeout=timeout,
                            metadata=self._metadata)

            slots.append(plane.sign(b"slot", seg, room, plane.next_seq()))
            answered = self._control(plane, CONTROL_GET, pb.ShmGetRequest(get=asked, slot=slots[-1]).SerializeToString(),
                                     f"ShmGet of {names} from pserver {endpoint}", may_not_fit=True)
            if answered is not None:
                status, raw = answered
                if status == "RESOURCE_EXHAUSTED":  # sizes changed: gRPC knows them
                    return None
            else:  # no control socket (or it broke): gRPC
                try:
                    raw = self._retried(endpoint, "ShmGet", f"of {names}", invoke)
                except RPCError as e:
                    if e.status == grpc.StatusCode.RESOURCE_EXHAUSTED:  # sizes changed: gRPC knows them
                        return None
                    raise
            ref = pb.ShmRef.FromString(raw)
            plane.check_reply(ref, slots[-1])
            decoded = decode_batch(seg.view(ref.offset, ref.length).toreadonly())
        finally:
            plane.give_back(seg)  # reused once the values decoded from it are gone
        if [d.name for d in decoded] != names:
            raise RPCError(f"trainer {self.trainer_id}: ShmGet of {names} from pserver {endpoint} answered "
                           f"{[d.name for d in decoded]}", hint="the pserver runs a different program version")
        for d in decoded:
            self._sizes[d.name] = d.value.nbytes if hasattr(d.value, "nbytes") else 0
        return [d.value for d in decoded]

    # --- the cross-host data plane (runtime.rpc.tcp_plane)
    def _link(self, endpoint: str) -> TcpLink | None:
        """``endpoint``'s TCP data plane while it is up (None: none, or it failed)."""
        link = self._links.get(endpoint)
        return link if link is not None and link.up else None

    def _on_a_plane(self, endpoint: str) -> bool:
        """Whether a large transfer to ``endpoint`` tries a data plane (shared memory or TCP) first."""
        return self._plane(endpoint) is not None or self._link(endpoint) is not None

    def _get_plane(self, endpoint: str, names: list[str]) -> list[Any] | None:
        """The values of ``names`` through shared memory or the TCP plane; None: use gRPC."""
        got = self._get_shm(endpoint, names)
        return got if got is not None else self._get_tcp(endpoint, names)

    def _tcp(self, endpoint: str, method: bytes, parts: list[Any], what: str) -> memoryview | None:
        """The reply to ``method`` with body ``parts`` on ``endpoint``'s TCP plane, within the deadline; None
        when it has none or it failed (the caller takes gRPC). An error status is the RPCError gRPC gives."""
        link = self._link(endpoint)
        if link is None:
            return None
        try:
            status, answer = link.call(method, parts, time.monotonic() + self.deadline, self._buffers)
        except LinkFailed:
            return None
        except TimeoutError as e:
            raise RPCError(f"trainer {self.trainer_id}: {what} failed (DEADLINE_EXCEEDED): {e}",
                           hint="the pserver is down or unreachable",
                           status=grpc.StatusCode.DEADLINE_EXCEEDED) from None
        if status != "OK":
            raise RPCError(f"trainer {self.trainer_id}: {what} failed ({status}, TCP data plane): "
                           f"{bytes(answer).decode('utf-8', 'replace')}",
                           status=getattr(grpc.StatusCode, status, grpc.StatusCode.UNKNOWN))
        return answer

    def _send_tcp(self, endpoint: str, messages: list[tuple[str, tuple[list[Any], int]]]) -> bool:
        """Send ``messages`` as one SendVariables batch on the TCP plane (never joined); False: use gRPC."""
        parts: list[Any] = []
        for _, (msg, n) in messages:
            parts += [_varint(BATCH_FIELD << 3 | 2), _varint(n), *msg]
        return self._tcp(endpoint, TCP_SEND, parts,
                         f"SendVariables of {[n for n, _ in messages]} to pserver {endpoint}") is not None

    def _get_tcp(self, endpoint: str, names: list[str]) -> list[Any] | None:
        """The values of ``names`` fetched on the TCP plane (read-only views of a pooled buffer); None: gRPC."""
        req = pb.GetVariablesRequest(names=names, trainer_id=self.trainer_id, step=self.step).SerializeToString()
        raw = self._tcp(endpoint, TCP_GET, [req], f"GetVariables of {names} from pserver {endpoint}")
        if raw is None:
            return None
        decoded = decode_batch(raw)
        if [d.name for d in decoded] != names:
            raise RPCError(f"trainer {self.trainer_id}: GetVariables of {names} from pserver {endpoint} answered "
                           f"{[d.name for d in decoded]} (TCP data plane)",
                           hint="the pserver runs a different program version")
        for d in decoded:
            self._sizes[d.name] = d.value.nbytes if hasattr(d.value, "nbytes") else 0
        return [d.value for d in decoded]

    def _prefetch_tcp(self, endpoint: str, name: str, ids: Any, table: str) -> Any | None:
        """The rows for ``ids`` as a PrefetchVariable on the TCP plane; None: use gRPC."""
        parts, _ = encode_parts(name, ids, trainer_id=self.trainer_id, table_name=table)
        raw = self._tcp(endpoint, TCP_PREFETCH, parts, f"PrefetchVariable of {name!r} from pserver {endpoint}")
        if raw is None:
            return None
        value = decode_variable(raw).value
        self._learn_prefetch(endpoint, name, int(np.size(ids)), value, len(raw))
        return value

    def _get_streamed(self, endpoint: str, name: str) -> Any:
        req = pb.VariableRequest(name=name, trainer_id=self.trainer_id, step=self.step).SerializeToString()
        decoded = self._retried(endpoint, "GetVariableStream", f"of {name!r}",
                                lambda call, timeout: get_chunked(call, req, self._buffers, timeout, self._metadata,
                                                                  max_bytes=self.max_message))
        if decoded.name != name:
            raise RPCError(f"trainer {self.trainer_id}: GetVariableStream of {name!r} from pserver {endpoint} "
                           f"answered {decoded.name!r}", hint="the pserver runs a different program version")
        return decoded.value

    def pull(self, key: Any, requests: Sequence[tuple[str, str]], max_staleness: int,
             have_values: bool = True) -> list[Any] | None:
        """Async mode: the values of ``requests`` for the next step, at most ``max_staleness`` steps behind
        this trainer's own sends (see the module docstring), or None when no pull has finished and none
        must have (``have_values``: the caller holds values recent enough); starts this step's pull in
        the background. ``key`` names the recv run the requests belong to: each run has its own pulls."""
        self.flush()
        sends, self._pending = self._pending, []
        self._round += 1
        pulls = self._pulls.setdefault(key, collections.deque())
        pulls.append((self._round, self._puller.submit(self._pull_after, sends, list(requests))))
        newest = None
        while pulls and (pulls[0][0] <= self._round - max_staleness or pulls[0][1].done()
                         or newest is None and not have_values):
            newest = pulls.popleft()[1].result()
        return newest

    def _pull_after(self, sends: list[futures.Future[None]], requests: list[tuple[str, str]]) -> list[Any]:
        _wait_all(sends)
        return self._get_now(requests)

    def _drain_pulls(self) -> None:
        pulls, self._pulls = self._pulls, {}
        _wait_all([f for queue in pulls.values() for _, f in queue])

    def prefetch(self, requests: Sequence[tuple[str, str, Any, str]]) -> list[Any]:
        """Rows for ``(endpoint, ids_name, ids, table)`` requests, fetched concurrently (one from this thread)."""
        self.wait_sends()
        if not requests:
            return []
        futs = [self._pool.submit(self._prefetch_one, *r) for r in requests[1:]]
        try:
            first = self._prefetch_one(*requests[0])
        except BaseException:
            futures.wait(futs)  # nothing of this prefetch is left running
            raise
        return [first] + [f.result() for f in futs]

    def _prefetch_one(self, endpoint: str, name: str, ids: Any, table: str) -> Any:
        """One pserver's rows for ``ids``: through the data plane once this client knows that prefetch's
        answer size (from an earlier one) and either the plane to that pserver is up already (another
        transfer opened it: the prefetch rides along, one call on the control socket instead of a gRPC
        round trip) or the ids or rows take ``shm_threshold`` bytes or more; else (or when that fails short
        of an answer) a PrefetchVariable over gRPC."""
        count = int(np.size(ids))
        if self._link(endpoint) is not None:
            got = self._prefetch_tcp(endpoint, name, ids, table)
            if got is not None:
                return got
        known = self._prefetch_sizes.get((endpoint, name))
        plane = self._plane(endpoint) if known is not None else None
        if known is not None and plane is not None:
            per_id, extra = known
            rows_bytes = int(per_id * count) + extra
            ids_bytes = 8 * count + len(name) + len(table) + 64
            if plane.state or max(rows_bytes, ids_bytes) >= self.shm_threshold:
                got = self._prefetch_shm(endpoint, name, ids, table, rows_bytes)
                if got is not None:
                    return got
        raw = self._call(endpoint, "PrefetchVariable",
                         encode_variable(name, ids, trainer_id=self.trainer_id, table_name=table), f"of {name!r}")
        value = decode_variable(raw).value
        self._learn_prefetch(endpoint, name, count, value, len(raw))
        return value

    def _learn_prefetch(self, endpoint: str, name: str, count: int, value: Any, length: int) -> None:
        nbytes = int(getattr(value, "nbytes", 0))
        if count:
            self._prefetch_sizes[endpoint, name] = (nbytes / count, max(0, length - nbytes))

    def _prefetch_shm(self, endpoint: str, name: str, ids: Any, table: str, rows_bytes: int) -> Any | None:
        """The rows for ``ids`` through a segment (ids written there, rows answered into it: a read-only view
        of it), the request over the control socket; None: use gRPC (no segment, no control socket or it
        broke, or the rows outgrew the room)."""
        parts, n = encode_parts(name, ids, trainer_id=self.trainer_id, table_name=table, incarnation=self.incarnation)
        got = self._segment(endpoint, max(n + 16, rows_bytes + 1024))
        if got is None:
            return None
        plane, seg = got
        what = f"ShmPrefetch of {name!r} from pserver {endpoint}"
        try:
            length = write_batch(seg.view(HEADER_BYTES, seg.size - HEADER_BYTES), [(parts, n)])
            ids_ref = plane.sign(b"ids", seg, length, plane.next_seq())
            slot = plane.sign(b"slot", seg, seg.size - HEADER_BYTES, plane.next_seq())
            answered = self._control(plane, CONTROL_PREFETCH,
                                     pb.ShmPrefetchRequest(ids=ids_ref, slot=slot).SerializeToString(), what,
                                     may_not_fit=True)
            if answered is None or answered[0] == "RESOURCE_EXHAUSTED":
                return None  # no control socket (or it broke), or the rows outgrew the room: gRPC
            raw = answered[1]
            ref = pb.ShmRef.FromString(raw)
            plane.check_reply(ref, slot)
            decoded = decode_batch(seg.view(ref.offset, ref.length).toreadonly())
        finally:
            plane.give_back(seg)  # reused once the rows decoded from it are gone
        if len(decoded) != 1:
            raise RPCError(f"trainer {self.trainer_id}: {what} answered {len(decoded)} variables, not the rows",
                           hint="the pserver runs a different program version")
        value = decoded[0].value
        self._learn_prefetch(endpoint, name, int(np.size(ids)), value, ref.length)
        return value

    def barrier(self, endpoints: Sequence[str], send: bool) -> None:
        """This trainer's SEND (``send``) or FETCH barrier of its current step on every endpoint.

        A FETCH barrier is not sent: a pserver counts the trainer's next SEND barrier (or its Complete) as
        its FETCH barrier of the step before (``runtime.rpc.pserver``), so a sync step costs one call per
        pserver. Only a pserver the next SEND barrier does not go to is sent the FETCH barrier it is owed,
        with that SEND barrier; one the trainer sent no SEND barrier to is owed none."""
        self.wait_sends()
        self._drain_pulls()
        if not send:
            if self._barrier_sent:  # else the trainer startup program's: it changes nothing at the pservers
                self._fetch_owed = [ep for ep in endpoints if ep in self._barrier_eps]
                self.step += 1
                self._barrier_sent = False
            return
        req = self._barrier_request(pb.SEND, self.step)
        jobs = [(ep, "Barrier", req, f"(SEND, step {self.step})") for ep in endpoints]
        owed = [ep for ep in self._fetch_owed if ep not in endpoints]
        if owed:
            fetch = self._barrier_request(pb.FETCH, self.step - 1)
            jobs += [(ep, "Barrier", fetch, f"(FETCH, step {self.step - 1})") for ep in owed]
        self._all(jobs)
        self._fetch_owed = []
        self._barrier_sent, self._barrier_eps = True, frozenset(endpoints)

    def _barrier_request(self, kind: int, step: int) -> bytes:
        return pb.BarrierRequest(trainer_id=self.trainer_id, step=step, kind=kind,
                                 incarnation=self.incarnation).SerializeToString()

    def checkpoint(self, endpoints: Sequence[str], dirname: str) -> None:
        self.wait_sends()
        req = pb.CheckpointRequest(trainer_id=self.trainer_id, dirname=dirname,
                                   incarnation=self.incarnation).SerializeToString()
        self._all([(ep, "CheckpointNotify", req, f"of {dirname!r}") for ep in endpoints])

    def health(self, endpoint: str) -> pb.HealthReply:
        return pb.HealthReply.FromString(self._call(endpoint, "Health", pb.HealthRequest().SerializeToString(), ""))

    @property
    def closed(self) -> bool:
        return self._closed

    def announced_endpoints(self) -> list[str]:
        """The pservers this client announced itself to: the ones its Complete goes to."""
        return [name for name, ep in self._endpoints.items() if ep.announced]

    def close(self, at_exit: bool = False) -> None:
        """Send Complete to every pserver this client talked to, then release the channels. ``at_exit``:
        the interpreter is exiting, the thread pools are shut down, so the Completes go one by one."""
        if self._closed:
            return
        try:
            self.wait_sends()
            self._drain_pulls()
            req = pb.CompleteRequest(trainer_id=self.trainer_id, incarnation=self.incarnation).SerializeToString()
            jobs = [(ep, "Complete", req, "") for ep in self.announced_endpoints()]
            if at_exit:
                for job in jobs:
                    self._call(*job)
            else:
                self._all(jobs)
        finally:
            self._closed = True
            self._pool.shutdown(wait=False)
            self._puller.shutdown(wait=False)
            for ep in self._endpoints.values():
                ep.channel.close()
            for plane in self._planes.values():
                plane.close()
            for link in self._links.values():
                link.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RPCError(f"trainer {self.trainer_id}: this client was closed (Executor.close() sent Complete)",
                           hint="use a new Executor for more training")


def _log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _wait_all(pending: Sequence[futures.Future[Any]]) -> None:
    """Wait for every future; raise the first RPCError among them."""
    errors = []
    for f in pending:
        try:
            f.result()
        except RPCError as e:
            errors.append(e)
    if errors:
        raise errors[0]
