"""The trainer's side of the protocol: one ``RPCClient`` per (Executor, trainer id).

The RPC kernels (``runtime.kernels.rpc``) call it. Sends are asynchronous: ``send`` encodes and sends
on a small thread pool and returns at once, so every gradient of a step is in flight while the
backward pass goes on; anything that must see the sends (a barrier, a recv, a prefetch, Complete)
first waits for them and raises the first send error.

Robustness: every call has a deadline (``FLAGS_rpc_deadline`` ms, read when the client is made);
calls that failed UNAVAILABLE are retried with backoff up to ``FLAGS_rpc_retry_times`` attempts (every
call here is idempotent: sends carry a per-variable sequence number the pserver deduplicates on,
barriers and Complete count trainers). The first contact with each endpoint waits (bounded by the
deadline) until the pserver accepts connections and names every endpoint still missing.
Errors are ``RPCError``s naming the method, the endpoint and the pserver's message.

Identity: each client draws a random incarnation id and announces (trainer id, incarnation) to every
pserver before its first other call there (``announce``; the kernels announce every endpoint of the
program at once, so a restarted trainer is admitted on every pserver at the same step boundary). The
pservers answer the step the trainer joins at; it becomes ``step``. Sends, barriers, Complete and
CheckpointNotify carry the incarnation. Trust: with a job token every call carries it as
``authorization: Bearer <token>`` metadata; with a CA the channels are TLS (mutual when this process
has a certificate and key). Settings come from ``runtime.flags.rpc_security`` unless given.
"""
from __future__ import annotations

import secrets
import threading
import time
import weakref
from concurrent import futures
from typing import Any, Iterable, Sequence

import grpc

from ir.errors import FlotillaError
from runtime.flags import RPCSecurity, flag, rpc_security
from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.server import SERVICE, grpc_options
from runtime.rpc.wire import decode_variable, encode_variable

DEFAULT_MAX_MESSAGE = 1 << 30
_RETRY_BACKOFF = (0.1, 0.3, 1.0)
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
        options = grpc_options(max_message)
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
                                                      "Announce")}


class RPCClient:
    """Talks to the pservers for trainer ``trainer_id``; ``step`` counts the trainer's SEND barriers."""

    def __init__(self, trainer_id: int, *, deadline: float | None = None, retries: int | None = None,
                 max_message: int = DEFAULT_MAX_MESSAGE, security: RPCSecurity | None = None,
                 incarnation: int | None = None) -> None:
        self.trainer_id = trainer_id
        self.security = security if security is not None else rpc_security()
        self._metadata = (("authorization", f"Bearer {self.security.token}"),) if self.security.token else None
        self.incarnation = incarnation if incarnation is not None else secrets.randbits(63) | 1
        self._joined = False
        self.announced_programs: set[tuple[int, int]] = set()
        # The recv kernel's batching (runtime.kernels.rpc.recv): per program (weakly: a dead program's ids
        # must never match a new one's), per (version, block index), the runs of consecutive recv ops; and
        # the recv ops whose blocks the run's first one fetched.
        self.recv_runs: "weakref.WeakKeyDictionary[Any, dict[tuple[int, int], dict[int, list[Any]]]]" = (
            weakref.WeakKeyDictionary())
        self.recv_ahead: set[int] = set()
        self.deadline = deadline if deadline is not None else flag("FLAGS_rpc_deadline") / 1000.0
        self.retries = retries if retries is not None else flag("FLAGS_rpc_retry_times")
        self.max_message = max_message
        self.step = 0
        self._barrier_sent = False
        self._endpoints: dict[str, _Endpoint] = {}
        self._seq: dict[str, int] = {}
        self._pending: list[futures.Future[None]] = []
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"trainer{trainer_id}-rpc")
        self._lock = threading.Lock()
        self._closed = False

    # --- connections
    def _endpoint(self, endpoint: str) -> _Endpoint:
        with self._lock:
            ep = self._endpoints.get(endpoint)
            if ep is None:
                ep = self._endpoints[endpoint] = _Endpoint(endpoint, self.max_message, self.security)
            return ep

    def wait_ready(self, endpoints: Iterable[str]) -> None:
        """Wait (at most the deadline) until every endpoint accepts connections."""
        eps = [self._endpoint(e) for e in dict.fromkeys(endpoints)]
        waiting = {ep.endpoint: grpc.channel_ready_future(ep.channel) for ep in eps if not ep.ready}
        end = time.monotonic() + self.deadline
        missing = []
        for name, fut in waiting.items():
            try:
                fut.result(timeout=max(0.0, end - time.monotonic()))
                self._endpoints[name].ready = True
            except grpc.FutureTimeoutError:
                fut.cancel()
                missing.append(name)
        if missing:
            raise RPCError(f"trainer {self.trainer_id}: pserver(s) {missing} did not come up within "
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
                return ep.calls[method](request, timeout=max(0.001, end - time.monotonic()), metadata=self._metadata)
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
        """Run the calls ``(endpoint, method, request, what)`` concurrently; results in order."""
        if len(jobs) == 1:
            return [self._call(*jobs[0])]
        futs = [self._pool.submit(self._call, *job) for job in jobs]
        return [f.result() for f in futs]

    # --- the operations the kernels need
    def send(self, endpoint: str, name: str, value: Any) -> None:
        """Send ``value`` as ``name`` without waiting (see ``wait_sends``)."""
        self._check_open()
        if not self._endpoint(endpoint).announced:
            self.announce([endpoint])
        seq = self._seq[name] = self._seq.get(name, 0) + 1
        step = self.step

        def job() -> None:
            msg = encode_variable(name, value, trainer_id=self.trainer_id, step=step, seq=seq,
                                  incarnation=self.incarnation)
            self._call(endpoint, "SendVariable", msg, f"of {name!r}")

        self._pending.append(self._pool.submit(job))

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, []
        errors = []
        for f in pending:
            try:
                f.result()
            except RPCError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def get(self, requests: Sequence[tuple[str, str]]) -> list[Any]:
        """The values of ``(endpoint, name)`` pairs, fetched concurrently."""
        self.wait_sends()
        jobs = [(ep, "GetVariable", pb.VariableRequest(name=name, trainer_id=self.trainer_id,
                                                        step=self.step).SerializeToString(), f"of {name!r}")
                for ep, name in requests]
        return [decode_variable(raw).value for raw in self._all(jobs)]

    def prefetch(self, requests: Sequence[tuple[str, str, Any, str]]) -> list[Any]:
        """Rows for ``(endpoint, ids_name, ids, table)`` requests, fetched concurrently."""
        self.wait_sends()
        jobs = [(ep, "PrefetchVariable", encode_variable(name, ids, trainer_id=self.trainer_id, table_name=table),
                 f"of {name!r}") for ep, name, ids, table in requests]
        return [decode_variable(raw).value for raw in self._all(jobs)]

    def barrier(self, endpoints: Sequence[str], send: bool) -> None:
        """This trainer's SEND (``send``) or FETCH barrier of its current step on every endpoint."""
        self.wait_sends()
        kind = pb.SEND if send else pb.FETCH
        req = pb.BarrierRequest(trainer_id=self.trainer_id, step=self.step, kind=kind,
                                incarnation=self.incarnation).SerializeToString()
        self._all([(ep, "Barrier", req, f"({'SEND' if send else 'FETCH'}, step {self.step})") for ep in endpoints])
        if send:
            self._barrier_sent = True
        elif self._barrier_sent:
            self.step += 1
            self._barrier_sent = False

    def checkpoint(self, endpoints: Sequence[str], dirname: str) -> None:
        self.wait_sends()
        req = pb.CheckpointRequest(trainer_id=self.trainer_id, dirname=dirname,
                                   incarnation=self.incarnation).SerializeToString()
        self._all([(ep, "CheckpointNotify", req, f"of {dirname!r}") for ep in endpoints])

    def health(self, endpoint: str) -> pb.HealthReply:
        return pb.HealthReply.FromString(self._call(endpoint, "Health", pb.HealthRequest().SerializeToString(), ""))

    def close(self) -> None:
        """Send Complete to every pserver this client talked to, then release the channels."""
        if self._closed:
            return
        try:
            self.wait_sends()
            req = pb.CompleteRequest(trainer_id=self.trainer_id, incarnation=self.incarnation).SerializeToString()
            talked = [name for name, ep in self._endpoints.items() if ep.announced]
            self._all([(ep, "Complete", req, "") for ep in talked])
        finally:
            self._closed = True
            self._pool.shutdown(wait=False)
            for ep in self._endpoints.values():
                ep.channel.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RPCError(f"trainer {self.trainer_id}: this client was closed (Executor.close() sent Complete)",
                           hint="use a new Executor for more training")


def client_for(executor: Any, trainer_id: int) -> RPCClient:
    """The executor's client for ``trainer_id`` (made on first use; ``executor.close()`` closes it)."""
    clients: dict[int, RPCClient] | None = getattr(executor, "_rpc_clients", None)
    if clients is None:
        clients = executor._rpc_clients = {}
    client = clients.get(trainer_id)
    if client is None:
        client = clients[trainer_id] = RPCClient(trainer_id)
        executor.add_close_hook(client.close)
    return client
