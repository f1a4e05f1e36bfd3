"""Large variables as streams of Chunks (runtime.rpc.stream): the receive buffers' pool and its ownership
rule, every way a stream can be malformed (WireError naming the sizes), and SendVariableStream /
GetVariableStream over real gRPC servers on free 127.0.0.1 ports: the servicer over a stand-in pserver
(transport only: several MiB dense and selected-rows values, bit-exact both ways) and over a real PServer
with a 4 MiB parameter (bit-exact, bad streams answered INVALID_ARGUMENT with the parameters untouched and
the server still serving, streams without the job token UNAUTHENTICATED before any chunk is read)."""
from __future__ import annotations

import gc
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import pytest

import runtime
from ir.core import Program
from runtime.flags import RPCSecurity
from runtime.kernels.rpc import max_message_bytes
from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.pserver import PServer
from runtime.rpc.server import MIN_MESSAGE, SERVICE, ParameterServerService, grpc_options, start_server
from runtime.rpc.stream import (CHUNK_BYTES, STREAM_THRESHOLD, ReceiveBuffers, chunks, encode_chunks, get_chunked,
                                send_chunked, size_class)
from runtime.rpc.wire import Decoded, WireError, decode_variable, encode_parts, encode_variable
from runtime.scope import Scope, SelectedRows
from tests.runtime.rpc.conftest import TRAINERS, Tracker, PSHandle, free_port, inc, listen_op, small_fc

TIMEOUT_S = 10.0
CODE = grpc.StatusCode
MiB = 1 << 20
RNG = np.random.default_rng(11)


def _identity(x: bytes) -> bytes:
    return x


def _f32(n_bytes: int) -> np.ndarray:
    return RNG.standard_normal(n_bytes // 4).astype(np.float32)


def _same_variable(got: Decoded, name: str, want: Any, **header: Any) -> None:
    """``got`` is ``want`` as variable ``name`` bit for bit: it re-encodes to the same message."""
    assert got.name == name
    assert encode_variable(name, got.value, **header) == encode_variable(name, want, **header)


# --- the receive buffers, no gRPC ---------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_bytes", [1, 7, 1000, CHUNK_BYTES])
def test_assemble_rebuilds_the_message_from_chunks_of_any_size(chunk_bytes: int) -> None:
    value = SelectedRows(np.array([9, 0, 4]), RNG.standard_normal((3, 300)).astype(np.float64), 10)
    parts, total = encode_parts("g", value, trainer_id=1, seq=2)
    view = ReceiveBuffers().assemble(chunks(parts, total, chunk_bytes=chunk_bytes), total)
    assert view.readonly and bytes(view) == b"".join(parts)
    _same_variable(decode_variable(view), "g", value, trainer_id=1, seq=2)


def test_a_buffer_is_reused_once_the_values_decoded_from_it_are_gone() -> None:
    pool = ReceiveBuffers()
    x = _f32(3 * MiB)
    first = decode_variable(pool.assemble(encode_chunks("w", x), 8 * MiB))
    assert first.value.tobytes() == x.tobytes() and not first.value.flags.writeable
    del first
    second = decode_variable(pool.assemble(encode_chunks("w", -x), 8 * MiB))
    stats = pool.stats()
    assert (stats.allocated, stats.reused, stats.buffers) == (1, 1, 1)
    assert stats.pooled_bytes == size_class(len(encode_variable("w", x))) >= 3 * MiB
    assert second.value.tobytes() == (-x).tobytes()


def test_a_live_value_is_never_overwritten_by_a_later_receive() -> None:
    pool = ReceiveBuffers()
    x, y = _f32(2 * MiB), _f32(2 * MiB)
    kept = decode_variable(pool.assemble(encode_chunks("w", x), 8 * MiB)).value
    rows = decode_variable(pool.assemble(encode_chunks("g", SelectedRows(np.arange(4), x[:4 * 1000].reshape(4, 1000),
                                                                         9)), 8 * MiB)).value
    view_only = kept[5:]  # a numpy view alone keeps the buffer too
    del kept
    gc.collect()
    later = decode_variable(pool.assemble(encode_chunks("w", y), 8 * MiB)).value
    assert pool.stats().allocated == 3 and pool.stats().reused == 0
    assert view_only.tobytes() == x[5:].tobytes() and later.tobytes() == y.tobytes()
    assert rows.values.tobytes() == x[:4000].tobytes()
    del view_only, later
    decode_variable(pool.assemble(encode_chunks("w", x), 8 * MiB))
    assert pool.stats().reused == 1 and rows.values.tobytes() == x[:4000].tobytes()


def test_concurrent_receives_never_share_a_buffer() -> None:
    pool = ReceiveBuffers()
    values = [np.full(MiB // 4, i, np.float32) for i in range(8)]

    def receive(i: int) -> np.ndarray:
        return decode_variable(pool.assemble(encode_chunks("w", values[i]), 4 * MiB)).value

    with futures.ThreadPoolExecutor(4) as ex:
        for _ in range(3):
            got = list(ex.map(receive, range(8)))
            for i, v in enumerate(got):
                assert (v == i).all()
            del got, v
    assert pool.stats().allocated <= 8 + 4  # held values plus at most one per thread in flight


def test_the_pool_keeps_at_most_its_capacity() -> None:
    pool = ReceiveBuffers(capacity_bytes=3 * MiB)
    a = decode_variable(pool.assemble(encode_chunks("a", _f32(2 * MiB)), 8 * MiB))
    b = decode_variable(pool.assemble(encode_chunks("b", _f32(2 * MiB)), 8 * MiB))  # a is alive: no room
    s = pool.stats()
    assert (s.allocated, s.unpooled, s.buffers) == (2, 1, 1) and s.pooled_bytes <= 3 * MiB
    del a, b
    decode_variable(pool.assemble(encode_chunks("c", _f32(MiB)), 8 * MiB))  # evicts the free 2 MiB buffer
    s = pool.stats()
    assert (s.evicted, s.buffers) == (1, 1) and s.pooled_bytes <= 3 * MiB


GOOD = encode_chunks("w", np.arange(1000, dtype=np.float32), seq=1)  # 4 KiB in 1 chunk of the default size
SMALL = list(chunks(*encode_parts("w", np.arange(1000, dtype=np.float32)), chunk_bytes=1024))
TOTAL = pb.Chunk.FromString(SMALL[0]).total

# (stream, max_bytes, words in the WireError)
MALFORMED: dict[str, tuple[list[bytes], int, str]] = {
    "truncated": (SMALL[:-1], MiB, f"the stream ended after {TOTAL - len(pb.Chunk.FromString(SMALL[-1]).data)} of "
                  f"the {TOTAL} bytes it announced"),
    "over-long": (SMALL + [pb.Chunk(data=b"x" * 10).SerializeToString()], MiB,
                  f"more than the {TOTAL} bytes it announced: chunk {len(SMALL)} brings the data to {TOTAL + 10}"),
    "over-the-limit": (SMALL, TOTAL - 1, f"announces a {TOTAL}-byte message; this receiver accepts at most "
                       f"{TOTAL - 1} bytes"),
    "huge-announced": ([pb.Chunk(total=1 << 62, data=b"x").SerializeToString()], MiB,
                       f"announces a {1 << 62}-byte message"),
    "no-total": ([pb.Chunk(data=b"x").SerializeToString()], MiB, "the first chunk of the stream announces no total"),
    "total-again": ([SMALL[0], pb.Chunk(total=TOTAL, data=b"x").SerializeToString()], MiB,
                    "chunk 1 announces a total length again"),
    "empty": ([], MiB, "the stream carried no chunk"),
    "garbage": ([b"garbage!"], MiB, "chunk 0 holds field 12 (wire type 7) which Chunk does not have"),
    "bad-varint": ([b"\x08" + b"\xff" * 12], MiB, "chunk 0 does not parse as a flotilla.rpc.Chunk: a varint at byte 1"),
    "cut-chunk": ([SMALL[0][:-5]], MiB, "chunk 0 is truncated: its data ends at byte"),
    "data-twice": ([SMALL[0] + pb.Chunk(data=b"x").SerializeToString()], MiB, "chunk 0 holds field 15 (wire type 2) "
                   "twice"),
    "not-a-variable": ([pb.Chunk(total=8, data=b"garbage!").SerializeToString()], MiB, "wire type 7"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_stream_raises_wire_error_naming_the_problem(case: str) -> None:
    stream, max_bytes, words = MALFORMED[case]
    pool = ReceiveBuffers()
    with pytest.raises(WireError) as info:
        decode_variable(pool.assemble(iter(stream), max_bytes))
    assert words in info.value.message and info.value.code == "E710"
    if case in ("over-the-limit", "huge-announced", "no-total", "empty", "garbage", "bad-varint", "cut-chunk"):
        assert pool.stats().allocated == 0  # refused before any buffer was taken


def test_an_over_long_stream_is_refused_before_the_extra_chunk_is_copied_or_more_is_read() -> None:
    pulled = []

    def stream() -> Iterator[bytes]:
        for c in SMALL + [pb.Chunk(data=b"x").SerializeToString()] * 5:
            pulled.append(c)
            yield c

    with pytest.raises(WireError, match="more than the"):
        ReceiveBuffers().assemble(stream(), MiB)
    assert len(pulled) == len(SMALL) + 1


def test_the_thresholds_keep_chunks_small_and_stream_only_large_messages() -> None:
    assert 64 << 10 <= CHUNK_BYTES <= 4 * MiB and CHUNK_BYTES <= STREAM_THRESHOLD <= 4 * MiB


# --- the servicer over a stand-in pserver: transport only ---------------------------------------------------------
@dataclass
class _Config:
    endpoint: str


@dataclass
class FakePServer:
    """What the servicer calls: ``send`` records, ``get_encoded`` encodes a stored value."""

    config: _Config
    values: dict[str, Any] = field(default_factory=dict)
    sent: list[Decoded] = field(default_factory=list)

    def send(self, msg: Decoded) -> None:
        self.sent.append(msg)

    def get_encoded(self, trainer_id: int, name: str, encode: Callable[[str, Any], Any]) -> Any:
        return encode(name, self.values[name])


class Stub:
    """Raw streaming calls to a ParameterServer endpoint, with a client-side ReceiveBuffers."""

    def __init__(self, endpoint: str, token: str | None = None) -> None:
        self.channel = grpc.insecure_channel(endpoint, options=grpc_options(0))
        grpc.channel_ready_future(self.channel).result(timeout=TIMEOUT_S)
        self.send_call = self.channel.stream_unary(f"/{SERVICE}/SendVariableStream", request_serializer=_identity,
                                                   response_deserializer=_identity)
        self.get_call = self.channel.unary_stream(f"/{SERVICE}/GetVariableStream", request_serializer=_identity,
                                                  response_deserializer=_identity)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.buffers = ReceiveBuffers()

    def send(self, name: str, value: Any, **header: Any) -> bytes:
        parts, total = encode_parts(name, value, **header)
        return send_chunked(self.send_call, parts, total, TIMEOUT_S, self.metadata)

    def send_raw(self, stream: list[bytes]) -> bytes:
        return self.send_call(iter(stream), timeout=TIMEOUT_S, metadata=self.metadata)

    def get(self, name: str, trainer_id: int = 0) -> Decoded:
        request = pb.VariableRequest(name=name, trainer_id=trainer_id).SerializeToString()
        return get_chunked(self.get_call, request, self.buffers, TIMEOUT_S, self.metadata, max_bytes=256 * MiB)

    def error(self, fn: Callable[[], Any]) -> grpc.RpcError:
        try:
            got = fn()
        except grpc.RpcError as e:
            return e
        raise AssertionError(f"the call succeeded ({got!r}); expected an error status")

    def close(self) -> None:
        self.channel.close()


@dataclass
class FakeServed:
    pserver: FakePServer
    service: ParameterServerService
    stub: Stub


@pytest.fixture
def fake_served() -> Iterator[FakeServed]:
    endpoint = f"127.0.0.1:{free_port()}"
    fake = FakePServer(_Config(endpoint))
    service = ParameterServerService(fake, None, 128 * MiB)  # type: ignore[arg-type]  # duck-typed stand-in
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=grpc_options(128 * MiB))
    server.add_generic_rpc_handlers((service.generic_handler(),))
    server.add_insecure_port(endpoint)
    server.start()
    stub = Stub(endpoint)
    try:
        yield FakeServed(fake, service, stub)
    finally:
        stub.close()
        server.stop(grace=None).wait(5.0)


VALUES = {
    "dense-4MiB": lambda: _f32(4 * MiB).reshape(1024, 1024),
    "dense-64MiB-odd": lambda: RNG.integers(-9, 9, (64 * MiB + 24) // 8, dtype=np.int64),
    "selected-rows-3MiB": lambda: SelectedRows(RNG.permutation(3000)[:768], _f32(3 * MiB).reshape(768, 1024), 3000),
    "small-float64": lambda: np.arange(7, dtype=np.float64),
}


@pytest.mark.parametrize("kind", list(VALUES))
def test_variables_round_trip_through_the_streaming_calls_bit_exactly(kind: str, fake_served: FakeServed) -> None:
    value = VALUES[kind]()
    header = {"trainer_id": 1, "step": 3, "seq": 4, "incarnation": 77}
    assert fake_served.stub.send("v", value, **header) == pb.Reply().SerializeToString()
    (got,) = fake_served.pserver.sent
    _same_variable(got, "v", value, **header)
    fake_served.pserver.values["p"] = value
    _same_variable(fake_served.stub.get("p"), "p", value)


def test_repeated_receives_reuse_the_buffers_on_both_sides(fake_served: FakeServed) -> None:
    x = _f32(4 * MiB)
    fake_served.pserver.values["p"] = x
    for _ in range(3):
        assert fake_served.stub.get("p").value.tobytes() == x.tobytes()  # dropped at once
        fake_served.stub.send("g", x)
        fake_served.pserver.sent.clear()
    client, server = fake_served.stub.buffers.stats(), fake_served.service.buffers.stats()
    assert (client.allocated, client.reused) == (1, 2)
    assert (server.allocated, server.reused) == (1, 2)


def test_a_value_received_earlier_is_unchanged_by_later_receives(fake_served: FakeServed) -> None:
    x, y = _f32(2 * MiB), _f32(2 * MiB)
    fake_served.pserver.values.update(x=x, y=y)
    kept = fake_served.stub.get("x").value
    for _ in range(2):
        assert fake_served.stub.get("y").value.tobytes() == y.tobytes()
    assert kept.tobytes() == x.tobytes()
    assert fake_served.stub.buffers.stats().allocated == 2  # one held by ``kept``, one reused for y
    fake_served.stub.send("g", x)
    fake_served.stub.send("g", y)  # the first is still held by the pserver
    first, second = fake_served.pserver.sent
    assert first.value.tobytes() == x.tobytes() and second.value.tobytes() == y.tobytes()


def test_a_stream_above_the_servers_limit_is_refused_without_reading_on(fake_served: FakeServed) -> None:
    stream = [pb.Chunk(total=129 * MiB, data=b"x").SerializeToString()] * 3
    err = fake_served.stub.error(lambda: fake_served.stub.send_raw(stream))
    assert err.code() == CODE.INVALID_ARGUMENT
    assert f"announces a {129 * MiB}-byte message; this receiver accepts at most {128 * MiB} bytes" in err.details()
    assert fake_served.service.buffers.stats().allocated == 0 and not fake_served.pserver.sent


def test_a_send_the_client_abandons_midway_stores_nothing_and_the_server_keeps_serving(
        fake_served: FakeServed) -> None:
    good = encode_chunks("g", _f32(3 * MiB))

    def broken() -> Iterator[bytes]:
        yield good[0]
        raise RuntimeError("the sender failed midway")

    err = fake_served.stub.error(lambda: fake_served.stub.send_call(broken(), timeout=TIMEOUT_S))
    assert err.code() in (CODE.CANCELLED, CODE.UNKNOWN), err.details()
    assert not fake_served.pserver.sent
    fake_served.stub.send_raw(good)
    assert len(fake_served.pserver.sent) == 1


def test_the_servers_stream_limit_is_at_least_the_unary_minimum() -> None:
    assert ParameterServerService(FakePServer(_Config("x")), None, 0).max_message == MIN_MESSAGE  # type: ignore


# --- the guard: token checked before any chunk is read --------------------------------------------------------------
class _Aborted(Exception):
    pass


class FakeContext:
    """A servicer context that records ``abort`` (and raises, as gRPC's does)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.metadata = metadata
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)


def test_the_token_is_checked_before_any_chunk_is_read() -> None:
    fake = FakePServer(_Config("127.0.0.1:1"), values={"p": _f32(2 * MiB)})
    handlers = ParameterServerService(fake, "s3cret", 8 * MiB)  # type: ignore[arg-type]
    pulled: list[bytes] = []

    def stream() -> Iterator[bytes]:
        for c in encode_chunks("g", np.ones(10, np.float32)):
            pulled.append(c)
            yield c

    for metadata in ((), (("authorization", "Bearer wrong"),)):
        ctx = FakeContext(metadata)
        with pytest.raises(_Aborted):
            handlers._guard(handlers.send_variable_stream)(stream(), ctx)
        assert ctx.code == CODE.UNAUTHENTICATED and "does not carry this job's token" in ctx.details
        ctx = FakeContext(metadata)
        with pytest.raises(_Aborted):
            next(handlers._guard(handlers.get_variable_stream, stream_out=True)(
                pb.VariableRequest(name="p").SerializeToString(), ctx))
        assert ctx.code == CODE.UNAUTHENTICATED
    assert pulled == [] and fake.sent == []
    ctx = FakeContext((("authorization", "Bearer s3cret"),))
    handlers._guard(handlers.send_variable_stream)(stream(), ctx)
    assert ctx.code is None and len(fake.sent) == 1 and len(pulled) == 1


# --- a real PServer with a 4 MiB parameter --------------------------------------------------------------------------
def big_fc() -> tuple[Program, Program]:
    """x[1024] → fc 1024 (fc_w: 4 MiB of float32) → square error → mean, SGD: (main, startup)."""
    return small_fc(width=1024, out=1024, lr=0.1)


def big_pserver(tracker: Tracker, security: RPCSecurity | None = None) -> PSHandle:
    """A served sync-mode PServer (the job's only one) holding the whole of fc_w and fc_b."""
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    endpoint = f"127.0.0.1:{free_port()}"
    main, startup = big_fc()
    t = DistributeTranspiler(DistributeTranspilerConfig(slice_var_up=False))
    t.transpile(0, program=main, startup_program=startup, pservers=endpoint, trainers=TRAINERS, sync_mode=True)
    program, pstartup = t.get_pserver_programs(endpoint)
    exe, scope = runtime.Executor(), Scope()
    exe.run(pstartup, scope=scope)
    pserver = PServer(program, scope, listen_op(program), lambda idx, s: exe.run_block(program, idx, s),
                      barrier_timeout=30.0)
    for trainer in range(TRAINERS):
        pserver.announce(trainer, inc(trainer))
    handle = PSHandle(pserver, program, scope, endpoint)
    tracker.handles.append(handle)
    handle.server = start_server(pserver, endpoint, max_message_bytes(program), security)
    return handle


def grad_copy(h: PSHandle, trainer_id: int) -> str:
    block = h.program.global_block()
    (name,) = [n for n in listen_op(h.program).input("X")
               if block.var(n).copy_of == "fc_w@GRAD" and block.var(n).trainer_id == trainer_id]
    return name


@pytest.fixture(scope="module")
def big() -> Iterator[tuple[PSHandle, Stub]]:
    tracker = Tracker()
    h = big_pserver(tracker)
    stub = Stub(h.endpoint)
    yield h, stub
    stub.close()
    tracker.close()


def test_a_real_pserver_streams_its_parameter_bit_exactly(big: tuple[PSHandle, Stub]) -> None:
    h, stub = big
    want = np.asarray(h.scope.find_var("fc_w"))
    assert want.shape == (1024, 1024) and want.nbytes >= STREAM_THRESHOLD
    for _ in range(2):
        _same_variable(stub.get("fc_w"), "fc_w", want)
    _same_variable(stub.get("fc_b"), "fc_b", np.asarray(h.scope.find_var("fc_b")))  # small: streams all the same


def test_a_real_pserver_stores_a_streamed_gradient_bit_exactly(tracker: Tracker) -> None:
    h = big_pserver(tracker)
    stub = Stub(h.endpoint)
    try:
        g = _f32(4 * MiB).reshape(1024, 1024)
        name = grad_copy(h, 1)
        stub.send(name, g, trainer_id=1, step=0, seq=1, incarnation=inc(1))
        assert np.asarray(h.scope.find_var(name)).tobytes() == g.tobytes()
        stub.send(name, -g, trainer_id=1, step=0, seq=1, incarnation=inc(1))  # a retry: dropped
        assert np.asarray(h.scope.find_var(name)).tobytes() == g.tobytes()
    finally:
        stub.close()


def _bad_streams(h: PSHandle) -> dict[str, tuple[list[bytes], CODE, str]]:
    name = grad_copy(h, 0)
    good = encode_chunks(name, _f32(4 * MiB).reshape(1024, 1024), trainer_id=0, step=0, seq=1,
                         incarnation=inc(0))
    total = pb.Chunk.FromString(good[0]).total
    limit = max(MIN_MESSAGE, max_message_bytes(h.program))
    return {
        "truncated": (good[:-1], CODE.INVALID_ARGUMENT,
                      f"the stream ended after {(len(good) - 1) * CHUNK_BYTES} of the {total} bytes it announced"),
        "over-long": (good + [pb.Chunk(data=b"\0" * 8).SerializeToString()], CODE.INVALID_ARGUMENT,
                      f"more than the {total} bytes it announced"),
        "garbage": ([b"garbage!"] + good[1:], CODE.INVALID_ARGUMENT, "which Chunk does not have"),
        "above-the-limit": ([pb.Chunk(total=limit + 1, data=b"x").SerializeToString()], CODE.INVALID_ARGUMENT,
                            f"announces a {limit + 1}-byte message; this receiver accepts at most {limit} bytes"),
        "wrong-shape": (encode_chunks(name, _f32(4 * MiB).reshape(2048, 512), trainer_id=0, seq=1,
                                      incarnation=inc(0)), CODE.INVALID_ARGUMENT, "shape [2048, 512], expected"),
        "unknown-variable": (encode_chunks("fc_v@GRAD", _f32(MiB), seq=1, incarnation=inc(0)), CODE.NOT_FOUND,
                             "this pserver receives no such variable"),
    }


@pytest.mark.parametrize("case", ["truncated", "over-long", "garbage", "above-the-limit", "wrong-shape",
                                  "unknown-variable"])
def test_a_bad_stream_gets_its_status_and_changes_nothing(case: str, big: tuple[PSHandle, Stub]) -> None:
    h, stub = big
    stream, code, words = _bad_streams(h)[case]
    before = stub.get("fc_w").value.tobytes()
    snapshot = {n: np.asarray(h.scope.find_var(n)).tobytes() for n in h.scope.local_var_names()}
    err = stub.error(lambda: stub.send_raw(stream))
    assert err.code() == code, err.details()
    assert words in err.details()
    assert {n: np.asarray(h.scope.find_var(n)).tobytes() for n in h.scope.local_var_names()} == snapshot
    assert stub.get("fc_w").value.tobytes() == before  # and the server keeps serving


def test_get_variable_stream_errors_are_statuses(big: tuple[PSHandle, Stub]) -> None:
    h, stub = big
    err = stub.error(lambda: stub.get("fc_x"))
    assert err.code() == CODE.NOT_FOUND and "get of 'fc_x': this pserver holds no such variable" in err.details()
    err = stub.error(lambda: stub.get("fc_w", trainer_id=7))
    assert err.code() == CODE.INVALID_ARGUMENT and "trainer_id 7 is out of range" in err.details()
    bad = stub.get_call(b"garbage!", timeout=TIMEOUT_S)
    err = stub.error(lambda: list(bad))
    assert err.code() == CODE.INVALID_ARGUMENT and "does not decode as flotilla.rpc.VariableRequest" in err.details()


def test_streams_without_the_job_token_are_unauthenticated(tracker: Tracker) -> None:
    h = big_pserver(tracker, RPCSecurity(token="s3cret"))
    for token in (None, "wrong"):
        stub = Stub(h.endpoint, token)
        try:
            err = stub.error(lambda: stub.get("fc_w"))
            assert err.code() == CODE.UNAUTHENTICATED, err.details()
            err = stub.error(lambda: stub.send(grad_copy(h, 0), _f32(4 * MiB).reshape(1024, 1024), seq=1,
                                               incarnation=inc(0)))
            assert err.code() == CODE.UNAUTHENTICATED, err.details()
        finally:
            stub.close()
    good = Stub(h.endpoint, "s3cret")
    try:
        _same_variable(good.get("fc_w"), "fc_w", np.asarray(h.scope.find_var("fc_w")))
    finally:
        good.close()


def test_the_client_streams_large_variables_and_batches_the_rest(tracker: Tracker) -> None:
    """RPCClient end to end: a 4 MiB gradient goes as SendVariableStream beside a SendVariable of the small
    one; the first get of fc_w learns its size (GetVariables), later ones stream; values are exact. (The
    gRPC path: with the data plane on, same host, these go through shared memory; test_data_plane.py.)"""
    from runtime.rpc.client import RPCClient

    h = big_pserver(tracker)
    client = RPCClient(1, deadline=10.0, incarnation=inc(1), data_plane="off")
    calls: list[str] = []
    original = client._retried

    def recorded(endpoint: str, method: str, what: str, invoke: Any) -> Any:
        calls.append(method)
        return original(endpoint, method, what, invoke)

    client._retried = recorded  # type: ignore[method-assign]
    try:
        client.announce([h.endpoint])
        calls.clear()
        g = _f32(4 * MiB).reshape(1024, 1024)
        bias = (h.program.global_block().var(n) for n in listen_op(h.program).input("X"))
        b_name = next(v.name for v in bias if v.copy_of == "fc_b@GRAD" and v.trainer_id == 1)
        client.send(h.endpoint, grad_copy(h, 1), g)
        client.send(h.endpoint, b_name, np.ones((1024,), np.float32))
        client.wait_sends()
        assert sorted(calls) == ["SendVariable", "SendVariableStream"]
        assert np.asarray(h.scope.find_var(grad_copy(h, 1))).tobytes() == g.tobytes()
        want = np.asarray(h.scope.find_var("fc_w")).tobytes()
        calls.clear()
        for _ in range(2):
            w, b = client.get([(h.endpoint, "fc_w"), (h.endpoint, "fc_b")])
            assert w.tobytes() == want and b.tobytes() == np.asarray(h.scope.find_var("fc_b")).tobytes()
        assert calls[0] == "GetVariables" and sorted(calls[1:]) == ["GetVariable", "GetVariableStream"]
    finally:
        client.close()
