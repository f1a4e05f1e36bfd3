"""Runtime flags and settings from the environment, read once where a component is created (never in a
hot path), validated, and handed on in explicit objects.

``FLAGS_rpc_deadline``          ms, deadline of every RPC and of the wait for pservers to come up (180000)
``FLAGS_rpc_wait_report_ms``    ms between two stderr lines of a trainer waiting for pservers to come up,
                                naming the ones still missing and the time left (10000)
``FLAGS_rpc_retry_times``       attempts of an idempotent RPC that failed UNAVAILABLE (3)
``FLAGS_pserver_timeout_ms``    ms a pserver waits for a missing trainer before failing (120000); keep it
                                below FLAGS_rpc_deadline so the pserver names the missing trainer first
``FLAGS_pserver_allow_rejoin``  1: a restarted trainer (same id, new incarnation) rejoins at the next step
                                boundary; 0: it is refused (FAILED_PRECONDITION) (1)
``FLAGS_pserver_check_finite``  1: a pserver refuses gradients holding NaN or Inf; 0: no check (1)
``FLAGS_rpc_tune_malloc``      1: a process that talks to pservers (or is one) keeps large freed buffers for
                                reuse instead of page-faulting fresh ones per message (runtime.malloc) (1)
``FLAGS_rpc_data_plane``        off: every tensor travels on gRPC; auto: a trainer on its pserver's host moves
                                large batches through shared memory, gRPC carrying only signed references
                                (runtime.rpc.shm), one on another host on a TCP stream authenticated by the
                                job token (runtime.rpc.tcp_plane; jobs with a token and no TLS); tcp: that
                                TCP stream to every pserver, no shared memory (a container whose /dev/shm is
                                small, or a test of the TCP plane on one host) (auto)
``FLAGS_rpc_data_plane_min_bytes``  bytes from which a batch (send) or a variable (fetch) takes the data
                                plane (262144)
``FLAGS_communicator_max_staleness``  async mode: how many steps a trainer's parameters may lag its own
                                sends (1). Each step's sends and the next parameter pull run in the
                                background while the trainer computes; at step s the parameters reflect
                                the trainer's gradients of every step up to s - 1 - K. 0: block on every
                                step's sends and pull, as in sync mode (see runtime.rpc.client)

Trust (``rpc_security``):

``FLOTILLA_JOB_TOKEN``       the job's shared secret. Every RPC carries it (metadata ``authorization:
                             Bearer <token>``) and a pserver that has one answers UNAUTHENTICATED to any
                             call without it, changing nothing. ``flotilla launch`` draws a random one per
                             job and hands it to every process; set it by hand (the same value everywhere)
                             for a job started across machines. Unset on a pserver: no check, so a pserver
                             without it (or mutual TLS) serves only a loopback endpoint, unless opted out.
``FLOTILLA_INSECURE_PSERVER`` 1: a pserver without a token or mutual TLS serves a non-loopback endpoint
                             anyway (it says so at start: anyone who reaches the port can drive it); unset or 0:
                             it refuses to start there.
``FLOTILLA_TLS_CERT``/``FLOTILLA_TLS_KEY``  PEM certificate chain and key of this process: a pserver serves
                             TLS with them; a trainer presents them as its client certificate.
``FLOTILLA_TLS_CA``          PEM CA bundle: a trainer verifies pservers against it (and then uses TLS); a
                             pserver given it requires and verifies client certificates (mutual TLS).
``FLOTILLA_TLS_SERVER_NAME`` the name a trainer expects in pserver certificates (default: the endpoint's
                             host).

``FLOTILLA_CHECKPOINT_ROOT`` optional: the directory relative checkpoint names resolve under (a relative name
                             must stay below it). A trainer's ``save_persistables`` names a checkpoint under
                             it relative to it; any other directory goes by its absolute path, which the
                             pservers take as it is (the job's own requests, as in Fluid).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ir.errors import FlotillaError

DEFAULTS = {"FLAGS_rpc_deadline": 180_000, "FLAGS_rpc_retry_times": 3, "FLAGS_pserver_timeout_ms": 120_000,
            "FLAGS_communicator_max_staleness": 1, "FLAGS_rpc_wait_report_ms": 10_000,
            "FLAGS_rpc_data_plane_min_bytes": 256 << 10}
MINIMUMS = {"FLAGS_communicator_max_staleness": 0}  # every other integer flag is at least 1
BOOL_DEFAULTS = {"FLAGS_pserver_allow_rejoin": True, "FLAGS_pserver_check_finite": True, "FLAGS_rpc_tune_malloc": True,
                 "FLOTILLA_INSECURE_PSERVER": False}

TOKEN_ENV = "FLOTILLA_JOB_TOKEN"
TLS_CERT_ENV = "FLOTILLA_TLS_CERT"
TLS_KEY_ENV = "FLOTILLA_TLS_KEY"
TLS_CA_ENV = "FLOTILLA_TLS_CA"
TLS_SERVER_NAME_ENV = "FLOTILLA_TLS_SERVER_NAME"
CHECKPOINT_ROOT_ENV = "FLOTILLA_CHECKPOINT_ROOT"
INSECURE_ENV = "FLOTILLA_INSECURE_PSERVER"


class FlagError(FlotillaError):
    code = "E760"


def flag(name: str, environ: Mapping[str, str] | None = None) -> int:
    """The integer value of flag ``name`` (its default when unset), at least its minimum (1 unless
    ``MINIMUMS`` says otherwise)."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw == "":
        return DEFAULTS[name]
    try:
        value = int(raw)
    except ValueError:
        raise FlagError(f"{name}={raw!r} is not an integer", hint=f"unset it for the default {DEFAULTS[name]}") from None
    least = MINIMUMS.get(name, 1)
    if value < least:
        raise FlagError(f"{name}={value} must be at least {least}", hint=f"unset it for the default {DEFAULTS[name]}")
    return value


DATA_PLANE_MODES = ("off", "auto", "tcp")


def data_plane_mode(environ: Mapping[str, str] | None = None) -> str:
    """``FLAGS_rpc_data_plane``: ``off`` (pure gRPC), ``auto`` (shared memory with a pserver on this host,
    ``runtime.rpc.shm``; a TCP stream to one on another host, ``runtime.rpc.tcp_plane``) or ``tcp`` (the TCP
    stream to every pserver, no shared memory); auto when unset."""
    env = os.environ if environ is None else environ
    raw = (env.get("FLAGS_rpc_data_plane") or "auto").strip().lower()
    if raw not in DATA_PLANE_MODES:
        raise FlagError(f"FLAGS_rpc_data_plane={raw!r} is not one of {list(DATA_PLANE_MODES)}",
                        hint="off: every tensor on gRPC; auto (the default): shared memory when trainer and pserver "
                             "share a host, the TCP data plane when not; tcp: the TCP data plane, never shared "
                             "memory")
    return raw


def bool_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """The value of the 0/1 flag ``name`` (its default when unset)."""
    env = os.environ if environ is None else environ
    raw = (env.get(name) or "").strip().lower()
    if raw == "":
        return BOOL_DEFAULTS[name]
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise FlagError(f"{name}={raw!r} is not 0 or 1", hint=f"unset it for the default {int(BOOL_DEFAULTS[name])}")


@dataclass(frozen=True)
class RPCSecurity:
    """How the processes of a job trust each other on the wire (see the module docstring).

    ``token`` None: no token is sent or checked. TLS is on for a server when ``cert`` and ``key`` are
    given, for a client when ``ca`` is given. The PEM fields hold file contents (bytes), read once.
    ``insecure`` is the explicit opt-out that lets a pserver without authentication serve beyond loopback."""

    token: str | None = None
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    server_name: str | None = None
    insecure: bool = False

    def __repr__(self) -> str:  # never show the token or the key
        return (f"RPCSecurity(token={'set' if self.token else None}, cert={'set' if self.cert else None}, "
                f"key={'set' if self.key else None}, ca={'set' if self.ca else None}, "
                f"server_name={self.server_name!r}, insecure={self.insecure})")

    @property
    def server_tls(self) -> bool:
        return self.cert is not None and self.key is not None

    @property
    def client_tls(self) -> bool:
        return self.ca is not None

    @property
    def authenticates_clients(self) -> bool:
        """Whether a pserver with these settings knows its callers belong to the job: a token, or TLS
        that requires client certificates."""
        return self.token is not None or (self.server_tls and self.ca is not None)


def _read_pem(env: Mapping[str, str], name: str) -> bytes | None:
    path = env.get(name) or ""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise FlagError(f"{name}={path!r} cannot be read: {e.strerror or e}",
                        hint="point it at a readable PEM file, or unset it") from None


def rpc_security(environ: Mapping[str, str] | None = None) -> RPCSecurity:
    """The job's ``RPCSecurity`` from the environment (a set but unreadable file is an error, never a
    silent fallback to plaintext)."""
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_ENV)
    if token is not None and token.strip() == "":
        raise FlagError(f"{TOKEN_ENV} is set but empty", hint="unset it (no authentication) or give the job's token")
    if token is not None and any(c.isspace() or not c.isprintable() for c in token):
        raise FlagError(f"{TOKEN_ENV} holds blanks or control characters",
                        hint="use printable characters only (flotilla launch draws a hex token)")
    cert, key = _read_pem(env, TLS_CERT_ENV), _read_pem(env, TLS_KEY_ENV)
    if (cert is None) != (key is None):
        raise FlagError(f"only one of {TLS_CERT_ENV} and {TLS_KEY_ENV} is set", hint="set both, or neither")
    return RPCSecurity(token=token, cert=cert, key=key, ca=_read_pem(env, TLS_CA_ENV),
                       server_name=env.get(TLS_SERVER_NAME_ENV) or None, insecure=bool_flag(INSECURE_ENV, env))


def checkpoint_root(environ: Mapping[str, str] | None = None) -> str | None:
    """``FLOTILLA_CHECKPOINT_ROOT`` as an absolute path, or None when unset."""
    env = os.environ if environ is None else environ
    root = env.get(CHECKPOINT_ROOT_ENV) or ""
    return os.path.abspath(root) if root else None
