"""Trust on the wire (issue 13) against real gRPC pservers on free 127.0.0.1 ports: the job token, TLS and
mutual TLS, trainer incarnations (forged Complete, forged sequence numbers, restarted trainers),
checkpoints confined to the pserver's own root, and non-finite gradients.

Each refused request is checked for its status code and message, then a good request succeeds and the
pserver's variables are compared bit for bit with their state before the refused one.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
import pathlib
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import pytest

from runtime import io
from runtime.flags import FlagError, RPCSecurity, rpc_security
from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.client import RPCClient, RPCError
from runtime.rpc.pserver import BarrierKind, PServerError, Status
from runtime.rpc.server import SERVICE, grpc_options
from runtime.rpc.wire import decode_variable, encode_variable
from runtime.scope import ExecutionError, Scope
from tests.runtime.rpc.conftest import LR, PARAMS, SHAPES, PSHandle, inc, random_grads

TIMEOUT_S = 5.0
CODE = grpc.StatusCode
TOKEN = "0123456789abcdef" * 4


def _identity(x: bytes) -> bytes:
    return x


class Raw:
    """Raw calls to a pserver; ``metadata`` goes with every call (e.g. the job token)."""

    def __init__(self, endpoint: str, metadata: tuple[tuple[str, str], ...] | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        options = grpc_options(0)
        self.channel = (grpc.secure_channel(endpoint, credentials, options=options) if credentials is not None
                        else grpc.insecure_channel(endpoint, options=options))
        self.metadata = metadata

    def call(self, method: str, request: bytes) -> bytes:
        fn = self.channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=_identity,
                                      response_deserializer=_identity)
        return fn(request, timeout=TIMEOUT_S, metadata=self.metadata)

    def error(self, method: str, request: bytes) -> grpc.RpcError:
        try:
            reply = self.call(method, request)
        except grpc.RpcError as e:
            return e
        raise AssertionError(f"{method} succeeded ({reply!r}); expected an error status")

    def get(self, name: str) -> np.ndarray:
        return np.array(decode_variable(self.call("GetVariable", pb.VariableRequest(name=name).SerializeToString()))
                        .value)

    def health(self) -> Any:
        return pb.HealthReply.FromString(self.call("Health", pb.HealthRequest().SerializeToString()))

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def raws() -> Iterator[Callable[..., Raw]]:
    made: list[Raw] = []

    def make(*args: Any, **kw: Any) -> Raw:
        r = Raw(*args, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def _grad_msg(h: PSHandle, param: str, value: np.ndarray, *, trainer_id: int = 0, step: int = 0, seq: int = 1,
              incarnation: int | None = None) -> bytes:
    return encode_variable(h.grad_name(param, trainer_id), value, trainer_id=trainer_id, step=step, seq=seq,
                           incarnation=inc(trainer_id) if incarnation is None else incarnation)


def _forged_requests(h: PSHandle) -> dict[str, bytes]:
    """One request of each kind that changes state, as a process outside the job would send it."""
    return {
        "Complete": pb.CompleteRequest(trainer_id=1).SerializeToString(),
        "SendVariable": encode_variable(h.grad_name("fc_b", 0), np.ones(30, np.float32), trainer_id=0, seq=1 << 62),
        "Barrier": pb.BarrierRequest(trainer_id=0, step=0, kind=pb.SEND).SerializeToString(),
        "CheckpointNotify": pb.CheckpointRequest(trainer_id=0, dirname="x").SerializeToString(),
        "Announce": pb.AnnounceRequest(trainer_id=1, incarnation=77).SerializeToString(),
    }


# --- the job token ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),),
                                      (("flotilla-token", f"Bearer {TOKEN}"),)],
                         ids=["none", "wrong", "no-bearer", "other-key"])
def test_without_the_job_token_every_call_is_unauthenticated(make_pserver: Callable[..., PSHandle],
                                                             raws: Callable[..., Raw], metadata: Any) -> None:
    h = make_pserver(True, serve=True, security=RPCSecurity(token=TOKEN))
    stranger = raws(h.endpoint, metadata)
    snapshot = h.snapshot()
    requests = {**_forged_requests(h), "GetVariable": pb.VariableRequest(name="fc_b").SerializeToString(),
                "Health": pb.HealthRequest().SerializeToString()}
    for method, request in requests.items():
        err = stranger.error(method, request)
        assert err.code() == CODE.UNAUTHENTICATED, (method, err.details())
        assert "does not carry this job's token" in err.details() and TOKEN not in err.details()
    assert h.snapshot() == snapshot and h.pserver.health()["live_trainers"] == [0, 1]
    # the job's own client, carrying the token, is served; the same forged Complete with the token but
    # without the incarnation is still refused
    member = raws(h.endpoint, (("authorization", f"Bearer {TOKEN}"),))
    assert member.health().status == pb.HealthReply.SERVING
    np.testing.assert_array_equal(member.get("fc_b"), h.params()["fc_b"])
    assert member.error("Complete", requests["Complete"]).code() == CODE.FAILED_PRECONDITION
    member.call("SendVariable", _grad_msg(h, "fc_b", np.full(30, 0.5, np.float32)))
    assert h.snapshot() != snapshot


def test_rpc_client_carries_the_token(make_pserver: Callable[..., PSHandle]) -> None:
    h = make_pserver(True, serve=True, security=RPCSecurity(token=TOKEN))
    good = RPCClient(0, deadline=TIMEOUT_S, security=RPCSecurity(token=TOKEN), incarnation=inc(0))
    bad = RPCClient(0, deadline=TIMEOUT_S, security=RPCSecurity(token="not-it"), incarnation=inc(0))
    try:
        (value,) = good.get([(h.endpoint, "fc_b")])
        np.testing.assert_array_equal(value, h.params()["fc_b"])
        with pytest.raises(RPCError) as info:
            bad.get([(h.endpoint, "fc_b")])
        assert info.value.status == CODE.UNAUTHENTICATED and h.endpoint in info.value.message
    finally:
        bad.close()
        good.close()
    assert h.pserver.health()["live_trainers"] == [1]


def test_rpc_security_reads_the_environment(tmp_path: pathlib.Path) -> None:
    assert rpc_security({}) == RPCSecurity()
    assert rpc_security({"FLOTILLA_JOB_TOKEN": "abc"}).token == "abc"
    assert "abc" not in repr(rpc_security({"FLOTILLA_JOB_TOKEN": "abc"}))
    with pytest.raises(FlagError, match="set but empty"):
        rpc_security({"FLOTILLA_JOB_TOKEN": " "})
    with pytest.raises(FlagError, match="cannot be read"):
        rpc_security({"FLOTILLA_TLS_CA": str(tmp_path / "missing.pem")})
    (tmp_path / "c.pem").write_bytes(b"cert")
    with pytest.raises(FlagError, match="only one of FLOTILLA_TLS_CERT and FLOTILLA_TLS_KEY"):
        rpc_security({"FLOTILLA_TLS_CERT": str(tmp_path / "c.pem")})


# --- TLS ----------------------------------------------------------------------------------------------------------
def _pki(tmp: pathlib.Path) -> dict[str, bytes]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with ``cryptography``."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> Any:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def pem_key(key: Any) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("flotilla test CA")).issuer_name(name("flotilla test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usage: Any) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM), pem_key(key)

    server_cert, server_key = leaf("pserver", ExtendedKeyUsageOID.SERVER_AUTH)
    client_cert, client_key = leaf("trainer", ExtendedKeyUsageOID.CLIENT_AUTH)
    return {"ca": ca.public_bytes(serialization.Encoding.PEM), "server_cert": server_cert,
            "server_key": server_key, "client_cert": client_cert, "client_key": client_key}


def test_tls_server_refuses_plaintext_and_serves_tls_clients(make_pserver: Callable[..., PSHandle],
                                                             tmp_path: pathlib.Path) -> None:
    pki = _pki(tmp_path)
    h = make_pserver(True, serve=True, security=RPCSecurity(token=TOKEN, cert=pki["server_cert"],
                                                            key=pki["server_key"]))
    plain = RPCClient(0, deadline=1.0, security=RPCSecurity(token=TOKEN), incarnation=inc(0))
    tls = RPCClient(0, deadline=TIMEOUT_S, security=RPCSecurity(token=TOKEN, ca=pki["ca"]), incarnation=inc(0))
    try:
        with pytest.raises(RPCError) as info:
            plain.get([(h.endpoint, "fc_b")])
        assert h.endpoint in info.value.message
        (value,) = tls.get([(h.endpoint, "fc_b")])
        np.testing.assert_array_equal(value, h.params()["fc_b"])
    finally:
        plain.close()
        tls.close()
    assert h.pserver.health()["live_trainers"] == [1]


def test_mutual_tls_requires_a_client_certificate(make_pserver: Callable[..., PSHandle],
                                                  tmp_path: pathlib.Path) -> None:
    pki = _pki(tmp_path)
    h = make_pserver(True, serve=True, security=RPCSecurity(cert=pki["server_cert"], key=pki["server_key"],
                                                            ca=pki["ca"]))
    anonymous = RPCClient(0, deadline=1.0, security=RPCSecurity(ca=pki["ca"]), incarnation=inc(0))
    member = RPCClient(0, deadline=TIMEOUT_S, incarnation=inc(0),
                       security=RPCSecurity(ca=pki["ca"], cert=pki["client_cert"], key=pki["client_key"]))
    snapshot = h.snapshot()
    try:
        with pytest.raises(RPCError):
            anonymous.get([(h.endpoint, "fc_b")])
        assert h.snapshot() == snapshot
        (value,) = member.get([(h.endpoint, "fc_b")])
        np.testing.assert_array_equal(value, h.params()["fc_b"])
    finally:
        anonymous.close()
        member.close()


# --- incarnations: forged Complete and sequence numbers (issue cases 1 and 2) -------------------------------------
def test_forged_complete_cannot_end_the_job(make_pserver: Callable[..., PSHandle], raws: Callable[..., Raw]) -> None:
    h = make_pserver(True, serve=True)
    raw = raws(h.endpoint)
    snapshot = h.snapshot()
    for t in (0, 1, 0, 1):
        for request in (pb.CompleteRequest(trainer_id=t), pb.CompleteRequest(trainer_id=t, incarnation=inc(t) + 2)):
            err = raw.error("Complete", request.SerializeToString())
            assert err.code() == CODE.FAILED_PRECONDITION
            assert f"Complete from incarnation {request.incarnation:#x} of trainer {t}, but its live incarnation " \
                   f"is {inc(t):#x}" in err.details()
    assert raw.health().status == pb.HealthReply.SERVING and list(raw.health().live_trainers) == [0, 1]
    assert h.snapshot() == snapshot
    # the real trainers complete: then the pserver is done
    for t in (0, 1):
        raw.call("Complete", pb.CompleteRequest(trainer_id=t, incarnation=inc(t)).SerializeToString())
    assert list(raw.health().live_trainers) == []


def test_an_unannounced_trainer_is_refused(make_pserver: Callable[..., PSHandle], raws: Callable[..., Raw]) -> None:
    h = make_pserver(True, serve=True, announce=False)
    raw = raws(h.endpoint)
    snapshot = h.snapshot()
    err = raw.error("SendVariable", _grad_msg(h, "fc_b", np.ones(30, np.float32)))
    assert err.code() == CODE.FAILED_PRECONDITION and "which has not announced itself" in err.details()
    err = raw.error("Announce", pb.AnnounceRequest(trainer_id=0).SerializeToString())
    assert err.code() == CODE.INVALID_ARGUMENT and "incarnation 0 must be a positive random id" in err.details()
    assert h.snapshot() == snapshot
    reply = pb.AnnounceReply.FromString(raw.call("Announce", pb.AnnounceRequest(
        trainer_id=0, incarnation=inc(0)).SerializeToString()))
    assert reply.step == 0
    raw.call("SendVariable", _grad_msg(h, "fc_b", np.ones(30, np.float32)))


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_a_sequence_jump_is_refused_and_later_sends_are_applied(make_pserver: Callable[..., PSHandle],
                                                                raws: Callable[..., Raw], sync: bool) -> None:
    h = make_pserver(sync, serve=True)
    raw = raws(h.endpoint)
    before, snapshot = h.params(), h.snapshot()
    g = np.full(30, 0.5, np.float32)
    # a forged send without the incarnation, and one from the live incarnation that skips ahead
    err = raw.error("SendVariable", _grad_msg(h, "fc_b", g * 100, seq=1 << 62, incarnation=0))
    assert err.code() == CODE.FAILED_PRECONDITION and "has not announced" not in err.details()
    err = raw.error("SendVariable", _grad_msg(h, "fc_b", g * 100, seq=1 << 62))
    assert err.code() == CODE.FAILED_PRECONDITION
    assert f"seq {1 << 62} skips ahead; the next is 1" in err.details()
    assert h.snapshot() == snapshot
    # the real sends that follow are applied, not taken for retries
    raw.call("SendVariable", _grad_msg(h, "fc_b", g, seq=1))
    raw.call("SendVariable", _grad_msg(h, "fc_b", g * 9, seq=1))  # a retry of seq 1: dropped
    if sync:
        raw.call("SendVariable", _grad_msg(h, "fc_b", g, trainer_id=1, seq=1))
        send = [raw.channel.unary_unary(f"/{SERVICE}/Barrier", request_serializer=_identity,
                                        response_deserializer=_identity).future(
            pb.BarrierRequest(trainer_id=t, step=0, kind=pb.SEND, incarnation=inc(t)).SerializeToString(),
            timeout=TIMEOUT_S) for t in (0, 1)]
        for f in send:
            f.result()
    np.testing.assert_allclose(h.params()["fc_b"], before["fc_b"] - np.float32(LR) * g, rtol=1e-6, atol=1e-7)


# --- restarted trainers (issue case 4) ----------------------------------------------------------------------------
def _sync_step(h: PSHandle, spawn: Callable[..., Any], step: int, grads: dict[int, dict[str, np.ndarray]],
               seq: int) -> None:
    for t, g in grads.items():
        h.send_grads(g, trainer_id=t, step=step, seq=seq)
    ts = sorted(grads)
    waiting = [spawn(lambda t=t: h.pserver.barrier(t, step, BarrierKind.SEND, inc(t))) for t in ts[1:]]
    h.pserver.barrier(ts[0], step, BarrierKind.SEND, inc(ts[0]))
    for w in waiting:
        w.join()
    for t in ts:
        h.pserver.barrier(t, step, BarrierKind.FETCH, inc(t))


def test_a_restarted_trainer_rejoins_at_the_next_step_and_nothing_is_dropped(
        make_pserver: Callable[..., PSHandle], spawn: Callable[..., Any], capfd: pytest.CaptureFixture[str]) -> None:
    h = make_pserver(True)
    ps = h.pserver
    g = {k: random_grads(40 + k) for k in range(6)}
    _sync_step(h, spawn, 0, {0: g[0], 1: g[1]}, seq=1)
    # step 1: trainer 0 sends and waits; trainer 1's first incarnation sends, then dies before its barrier
    h.send_grads(g[2], trainer_id=0, step=1, seq=2)
    h.send_grads(g[3], trainer_id=1, step=1, seq=2)
    before1 = h.params()
    waiting = spawn(lambda: ps.barrier(0, 1, BarrierKind.SEND, inc(0)))
    new = inc(1) + 0x100
    joined = spawn(lambda: ps.announce(1, new))  # the restarted trainer: admitted at step 2
    waiting.join()
    # step 1 ran without waiting for trainer 1, with everything it had acknowledged: the mean of both
    want = {p: before1[p] - np.float32(LR) * (g[2][p] + g[3][p]) * np.float32(0.5) for p in PARAMS}
    for p in PARAMS:
        np.testing.assert_allclose(h.params()[p], want[p], rtol=1e-6, atol=1e-6)
    assert joined.alive()  # it joins at the step boundary: after trainer 0's FETCH barrier
    ps.barrier(0, 1, BarrierKind.FETCH, inc(0))
    assert joined.join() == 2 and ps.health()["step"] == 2
    assert "trainer 1 rejoined as incarnation" in capfd.readouterr().err
    # the dead incarnation is shut out, changing nothing
    snapshot = h.snapshot()
    for call in (lambda: h.send(h.grad_name("fc_b", 1), g[4]["fc_b"], trainer_id=1, step=2, seq=3),
                 lambda: ps.barrier(1, 2, BarrierKind.SEND, inc(1)), lambda: ps.complete(1, inc(1))):
        with pytest.raises(PServerError) as info:
            call()
        assert info.value.status is Status.FAILED_PRECONDITION
        assert f"its live incarnation is {new:#x}" in str(info.value)
    assert h.snapshot() == snapshot
    # the new incarnation's sequence numbers start again at 1, and its first sends are applied
    before2 = h.params()
    for param, value in g[5].items():
        ps.send(decode_variable(encode_variable(h.grad_name(param, 1), value, trainer_id=1, step=2, seq=1,
                                                incarnation=new)))
    h.send_grads(g[4], trainer_id=0, step=2, seq=3)
    other = spawn(lambda: ps.barrier(1, 2, BarrierKind.SEND, new))
    ps.barrier(0, 2, BarrierKind.SEND, inc(0))
    other.join()
    for p in PARAMS:
        np.testing.assert_allclose(h.params()[p], before2[p] - np.float32(LR) * (g[4][p] + g[5][p]) * np.float32(0.5),
                                   rtol=1e-6, atol=1e-6)


def test_a_trainer_restarted_after_sending_for_the_next_step_joins_one_step_later(
        make_pserver: Callable[..., PSHandle], spawn: Callable[..., Any]) -> None:
    h = make_pserver(True)
    ps = h.pserver
    g = {k: random_grads(60 + k) for k in range(4)}
    h.send_grads(g[0], trainer_id=0, step=0, seq=1)
    h.send_grads(g[1], trainer_id=1, step=0, seq=1)
    first = spawn(lambda: ps.barrier(1, 0, BarrierKind.SEND, inc(1)))
    ps.barrier(0, 0, BarrierKind.SEND, inc(0))
    first.join()
    ps.barrier(1, 0, BarrierKind.FETCH, inc(1))
    h.send_grads(g[2], trainer_id=1, step=1, seq=2)  # acknowledged for step 1, then trainer 1 dies
    joined = spawn(lambda: ps.announce(1, inc(1) + 0x100))
    ps.barrier(0, 0, BarrierKind.FETCH, inc(0))
    before1 = h.params()
    h.send_grads(g[3], trainer_id=0, step=1, seq=2)
    ps.barrier(0, 1, BarrierKind.SEND, inc(0))  # step 1 does not wait for trainer 1, and keeps its sends
    for p in PARAMS:
        np.testing.assert_allclose(h.params()[p], before1[p] - np.float32(LR) * (g[2][p] + g[3][p]) * np.float32(0.5),
                                   rtol=1e-6, atol=1e-6)
    ps.barrier(0, 1, BarrierKind.FETCH, inc(0))
    assert joined.join() == 2


def test_a_trainer_restarted_owing_its_fetch_barrier_joins_at_the_next_step_and_loses_no_batch(
        make_pserver: Callable[..., PSHandle], spawn: Callable[..., Any]) -> None:
    """RPCClient's FETCH barrier rides on its next SEND barrier: a trainer killed between its fetches of
    step 0 and its SEND barrier of step 1 holds the pserver at step 0 until its restart, which takes part
    in step 1 (its batch of step 1 is not dropped)."""
    h = make_pserver(True)
    ps = h.pserver
    g = {k: random_grads(70 + k) for k in range(4)}
    h.send_grads(g[0], trainer_id=0, step=0, seq=1)
    h.send_grads(g[1], trainer_id=1, step=0, seq=1)
    first = spawn(lambda: ps.barrier(1, 0, BarrierKind.SEND, inc(1)))
    ps.barrier(0, 0, BarrierKind.SEND, inc(0))
    first.join()  # trainer 1 fetches, then dies before its SEND barrier of step 1
    h.send_grads(g[2], trainer_id=0, step=1, seq=2)
    waiting = spawn(lambda: ps.barrier(0, 1, BarrierKind.SEND, inc(0)))
    waiting.thread.join(0.3)
    assert waiting.alive() and ps.health()["step"] == 0
    new = inc(1) + 0x200
    assert ps.announce(1, new) == 1 and ps.health()["step"] == 1  # the step boundary it owed is passed
    waiting.thread.join(0.3)
    assert waiting.alive(), "step 1 ran without the restarted trainer"
    before1 = h.params()
    for param, value in g[3].items():
        ps.send(decode_variable(encode_variable(h.grad_name(param, 1), value, trainer_id=1, step=1, seq=1,
                                                incarnation=new)))
    ps.barrier(1, 1, BarrierKind.SEND, new)
    waiting.join()
    for p in PARAMS:
        np.testing.assert_allclose(h.params()[p], before1[p] - np.float32(LR) * (g[2][p] + g[3][p]) * np.float32(0.5),
                                   rtol=1e-6, atol=1e-6)


def test_a_restarted_trainer_is_refused_when_the_job_forbids_rejoin(make_pserver: Callable[..., PSHandle],
                                                                    raws: Callable[..., Raw]) -> None:
    h = make_pserver(True, serve=True, allow_rejoin=False)
    raw = raws(h.endpoint)
    snapshot = h.snapshot()
    err = raw.error("Announce", pb.AnnounceRequest(trainer_id=1, incarnation=inc(1) + 5).SerializeToString())
    assert err.code() == CODE.FAILED_PRECONDITION
    assert f"trainer 1 restarted (incarnation {inc(1) + 5:#x} replaces {inc(1):#x}), but this job forbids " \
           "rejoining" in err.details() and "FLAGS_pserver_allow_rejoin" in err.details()
    assert h.snapshot() == snapshot
    # the live incarnation goes on: its announcement again is a harmless retry, its sends are applied
    assert pb.AnnounceReply.FromString(raw.call("Announce", pb.AnnounceRequest(
        trainer_id=1, incarnation=inc(1)).SerializeToString())).step == 0
    raw.call("SendVariable", _grad_msg(h, "fc_b", np.ones(30, np.float32), trainer_id=1))
    assert h.snapshot() != snapshot


# --- checkpoints (issue case 3) -----------------------------------------------------------------------------------
def test_checkpoint_requests_stay_under_the_pservers_root(make_pserver: Callable[..., PSHandle],
                                                          raws: Callable[..., Raw], tmp_path: pathlib.Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    (root / "afile").mkdir()
    victim = root / "afile" / "pserver_0"
    victim.write_text("precious")
    h = make_pserver(True, serve=True, checkpoint_root=str(root))
    raw = raws(h.endpoint)
    snapshot = h.snapshot()
    cases = {"../outside": "'..' is refused",
             "a/../../outside": "'..' is refused", "escape": "leads out of the checkpoint root",
             "escape/deeper": "leads out of the checkpoint root", "": "empty"}
    for name, words in cases.items():
        err = raw.error("CheckpointNotify", pb.CheckpointRequest(trainer_id=0, dirname=name,
                                                                 incarnation=inc(0)).SerializeToString())
        assert err.code() == CODE.INVALID_ARGUMENT, (name, err.details())
        assert words in err.details(), (name, err.details())
    err = raw.error("CheckpointNotify", pb.CheckpointRequest(trainer_id=0, dirname="afile",
                                                             incarnation=inc(0)).SerializeToString())
    assert err.code() == CODE.FAILED_PRECONDITION and "something that is not a checkpoint is there" in err.details()
    assert victim.read_text() == "precious"
    assert list(outside.iterdir()) == [] and sorted(p.name for p in root.iterdir()) == ["afile", "escape"]
    assert h.snapshot() == snapshot
    # a good request saves under the root; saving again replaces it whole
    for _ in range(2):
        raw.call("CheckpointNotify", pb.CheckpointRequest(trainer_id=0, dirname="run1/step10",
                                                          incarnation=inc(0)).SerializeToString())
    part = root / "run1" / "step10" / "pserver_0"
    manifest = json.loads((part / io.MANIFEST).read_text())
    assert set(manifest["files"]) == {io.var_filename(n) for n in ("fc_b", "fc_w.block1", "learning_rate_0")}
    assert sorted(p.name for p in part.parent.iterdir()) == ["pserver_0"]  # no temporaries left


def test_an_authenticated_request_names_any_absolute_directory(make_pserver: Callable[..., PSHandle],
                                                                raws: Callable[..., Raw], tmp_path: pathlib.Path) -> None:
    target = tmp_path / "anywhere" / "ck"
    h = make_pserver(True, serve=True, security=RPCSecurity(token=TOKEN))  # no checkpoint root
    request = pb.CheckpointRequest(trainer_id=0, dirname=str(target), incarnation=inc(0)).SerializeToString()
    err = raws(h.endpoint, (("authorization", "Bearer wrong"),)).error("CheckpointNotify", request)
    assert err.code() == CODE.UNAUTHENTICATED and not (tmp_path / "anywhere").exists()
    raws(h.endpoint, (("authorization", f"Bearer {TOKEN}"),)).call("CheckpointNotify", request)
    assert io.var_filename("fc_b") in os.listdir(target / "pserver_0")
    io.verify_checkpoint_part(str(target / "pserver_0"))


def test_an_unauthenticated_pserver_says_anyone_may_checkpoint(make_pserver: Callable[..., PSHandle],
                                                               raws: Callable[..., Raw], tmp_path: pathlib.Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    h = make_pserver(True, serve=True)
    err = capfd.readouterr().err
    assert err.count("anyone who reaches its port may trigger checkpoints") == 1, err
    raws(h.endpoint).call("CheckpointNotify", pb.CheckpointRequest(trainer_id=0, dirname=str(tmp_path / "ck"),
                                                                   incarnation=inc(0)).SerializeToString())
    io.verify_checkpoint_part(str(tmp_path / "ck" / "pserver_0"))


def test_relative_checkpoint_without_a_root_is_refused(make_pserver: Callable[..., PSHandle],
                                                       raws: Callable[..., Raw]) -> None:
    h = make_pserver(True, serve=True)
    err = raws(h.endpoint).error("CheckpointNotify", pb.CheckpointRequest(trainer_id=0, dirname="ck",
                                                                          incarnation=inc(0)).SerializeToString())
    assert err.code() == CODE.FAILED_PRECONDITION and "no checkpoint root" in err.details()
    assert "FLOTILLA_CHECKPOINT_ROOT" in err.details()


def test_loading_refuses_torn_and_tampered_checkpoints(make_pserver: Callable[..., PSHandle],
                                                       tmp_path: pathlib.Path) -> None:
    import runtime

    h = make_pserver(True, checkpoint_root=str(tmp_path))
    path = h.pserver.checkpoint(0, "ck", inc(0))
    exe, vars = runtime.Executor(), io.pserver_checkpoint_vars(h.program)

    def load() -> Scope:
        scope = Scope()
        io.load_checkpoint_part(exe, path, h.program, vars=vars, scope=scope)
        return scope

    loaded = load()
    for p in PARAMS:
        np.testing.assert_array_equal(np.asarray(loaded.find_var(p)), h.params()[p])
    victim = os.path.join(path, io.var_filename("fc_b"))
    data = bytearray(open(victim, "rb").read())
    data[-1] ^= 1
    with open(victim, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(ExecutionError, match="was tampered with or damaged: fc_b"):
        load()
    os.remove(victim)
    with pytest.raises(ExecutionError, match="is torn: fc_b is missing"):
        load()
    os.remove(os.path.join(path, io.MANIFEST))
    with pytest.raises(ExecutionError, match="is torn or not a checkpoint: it has no MANIFEST.json"):
        load()


def test_trainer_names_its_checkpoint_relative_to_the_root_or_absolute(tmp_path: pathlib.Path) -> None:
    assert io.checkpoint_name("ck/1", str(tmp_path)) == "ck/1"
    assert io.checkpoint_name(str(tmp_path / "ck"), str(tmp_path)) == "ck"
    assert io.checkpoint_name(str(tmp_path / "ck"), None) == str(tmp_path / "ck")
    assert io.checkpoint_name("ck/1", None) == os.path.abspath("ck/1")
    assert io.checkpoint_name("/elsewhere/ck", str(tmp_path)) == "/elsewhere/ck"


# --- non-finite gradients (issue case 5) --------------------------------------------------------------------------
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_gradients_are_refused(make_pserver: Callable[..., PSHandle], raws: Callable[..., Raw],
                                          sync: bool, bad: float) -> None:
    h = make_pserver(sync, serve=True)
    raw = raws(h.endpoint)
    before, snapshot = h.params(), h.snapshot()
    g = np.full(SHAPES["fc_w.block1"], 0.25, np.float32)
    g[3, 4] = bad
    err = raw.error("SendVariable", _grad_msg(h, "fc_w.block1", g, trainer_id=1))
    assert err.code() == CODE.INVALID_ARGUMENT
    assert (f"send of {h.grad_name('fc_w.block1', 1)!r} from trainer 1 for step 0: the gradient holds 1 NaN or Inf "
            "value(s); refused, the parameter is unchanged") in err.details()
    assert h.snapshot() == snapshot
    health = raw.health()
    assert health.status == pb.HealthReply.SERVING and health.rejected_nonfinite == 1
    # a good gradient with the same seq is then accepted (the refused one used nothing up)
    raw.call("SendVariable", _grad_msg(h, "fc_w.block1", np.full(SHAPES["fc_w.block1"], 0.25, np.float32),
                                       trainer_id=1))
    if not sync:
        np.testing.assert_allclose(h.params()["fc_w.block1"], before["fc_w.block1"] - np.float32(LR * 0.25),
                                   rtol=1e-6, atol=1e-7)
    assert np.all(np.isfinite(h.params()["fc_w.block1"]))


def test_the_finite_check_can_be_turned_off(make_pserver: Callable[..., PSHandle]) -> None:
    h = make_pserver(False, check_finite=False)
    g = np.full(30, np.nan, np.float32)
    h.send(h.grad_name("fc_b", 0), g, trainer_id=0, seq=1)
    assert np.all(np.isnan(h.params()["fc_b"])) and h.pserver.health()["rejected_nonfinite"] == 0


# --- malformed dims -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dims", [[0, 1 << 62], [1] * 70, [0, 1 << 40, 1 << 40], [(1 << 63) - 1, 0]],
                         ids=["huge-extent", "rank-70", "zero-size-overflow", "int64-max"])
def test_malformed_dims_are_invalid_argument(make_pserver: Callable[..., PSHandle], raws: Callable[..., Raw],
                                             dims: list[int]) -> None:
    h = make_pserver(True, serve=True)
    raw = raws(h.endpoint)
    snapshot = h.snapshot()
    request = pb.VariableMessage(name=h.grad_name("fc_b", 0), dtype="float32", dims=dims, trainer_id=0, seq=1,
                                 incarnation=inc(0)).SerializeToString()
    for method in ("SendVariable", "PrefetchVariable"):
        err = raw.error(method, request)
        assert err.code() == CODE.INVALID_ARGUMENT, err.details()
        assert "dims" in err.details()
    assert h.snapshot() == snapshot
    raw.call("SendVariable", _grad_msg(h, "fc_b", np.ones(30, np.float32)))


def test_the_finite_check_covers_sparse_rows_and_skips_integers() -> None:
    from runtime.rpc.pserver import _nonfinite_count
    from runtime.scope import SelectedRows

    rows = SelectedRows(np.array([1, 4], np.int64), np.array([[0.5, np.nan], [np.inf, 1.0]], np.float32), 10)
    assert _nonfinite_count(rows) == 2
    assert _nonfinite_count(SelectedRows(np.array([1], np.int64), np.ones((1, 2), np.float64), 10)) == 0
    assert _nonfinite_count(np.array([1, 2], np.int64)) == 0
    assert _nonfinite_count(np.zeros((0, 3), np.float32)) == 0
