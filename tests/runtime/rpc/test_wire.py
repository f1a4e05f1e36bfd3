"""The wire format (runtime.rpc.wire): round trips of every wire dtype, 0-d, empty and big-endian
tensors and selected rows; interop with the generated protobuf class both ways; zero-copy decoding;
and a WireError naming the problem for every kind of malformed message (never another exception)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.wire import WIRE_DTYPES, Decoded, WireError, decode_variable, encode_variable
from runtime.scope import SelectedRows

RNG = np.random.default_rng(7)


def _sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "bool":
        return RNG.integers(0, 2, shape).astype(bool)
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        return RNG.integers(info.min, info.max, shape, endpoint=True, dtype=dtype)
    return RNG.normal(size=shape).astype(dtype)


def _round_trip(value: Any, **header: Any) -> Decoded:
    return decode_variable(encode_variable("v", value, **header))


def _assert_same_array(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype.newbyteorder("=") and got.shape == want.shape
    assert got.tobytes() == want.astype(want.dtype.newbyteorder("<")).tobytes()


# --- round trips -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", WIRE_DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (7,), (), (0,), (2, 0, 3)], ids=["2d", "1d", "0d", "empty", "empty3d"])
def test_dense_round_trip_is_bit_exact(dtype: str, shape: tuple[int, ...]) -> None:
    value = _sample(dtype, shape)
    decoded = _round_trip(value, trainer_id=3, step=11, seq=5)
    _assert_same_array(decoded.value, value)
    h = decoded.header
    assert (decoded.name, h.type, h.dtype, list(h.dims)) == ("v", pb.LOD_TENSOR, dtype, list(shape))
    assert (h.trainer_id, h.step, h.seq) == (3, 11, 5)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32", "float16", "int16"])
def test_big_endian_input_is_sent_little_endian(dtype: str) -> None:
    native = _sample(dtype, (4, 3))
    big = native.astype(np.dtype(dtype).newbyteorder(">"))
    raw = encode_variable("v", big)
    msg = pb.VariableMessage.FromString(raw)
    assert msg.dtype == dtype
    assert msg.data == native.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    _assert_same_array(decode_variable(raw).value, native)


def test_non_contiguous_input_is_sent_in_c_order() -> None:
    x = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2].T
    _assert_same_array(_round_trip(x).value, np.ascontiguousarray(x))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
def test_selected_rows_round_trip(dtype: str) -> None:
    rows = np.array([4, 0, 4, 9], np.int64)
    values = _sample(dtype, (4, 3))
    decoded = _round_trip(SelectedRows(rows, values, 10), table_name="emb")
    sr = decoded.value
    assert isinstance(sr, SelectedRows) and sr.height == 10
    np.testing.assert_array_equal(np.asarray(sr.rows), rows)
    _assert_same_array(sr.values, values)
    assert decoded.header.type == pb.SELECTED_ROWS and decoded.header.table_name == "emb"


def test_selected_rows_with_no_rows_round_trip() -> None:
    sr = _round_trip(SelectedRows(np.zeros((0,), np.int64), np.zeros((0, 5), np.float32), 8)).value
    assert isinstance(sr, SelectedRows) and sr.height == 8
    assert np.asarray(sr.rows).shape == (0,) and np.asarray(sr.rows).dtype == np.int64
    assert sr.values.shape == (0, 5) and sr.values.dtype == np.float32


def test_selected_rows_int32_row_ids_travel_as_int64() -> None:
    raw = encode_variable("v", SelectedRows(np.array([2, 1], np.int32), np.ones((2, 2), np.float32), 3))
    assert pb.VariableMessage.FromString(raw).rows == np.array([2, 1], "<i8").tobytes()


def test_jax_arrays_encode_like_numpy() -> None:
    import jax.numpy as jnp

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert encode_variable("v", jnp.asarray(x)) == encode_variable("v", x)


# --- interop with the generated protobuf class --------------------------------------------------------------------
def test_encoded_bytes_parse_with_the_generated_class() -> None:
    x = _sample("float32", (3, 4))
    msg = pb.VariableMessage.FromString(encode_variable("w", x, trainer_id=1, step=2, seq=3, table_name="t"))
    assert (msg.name, msg.type, msg.dtype, list(msg.dims), msg.trainer_id, msg.step, msg.seq, msg.table_name) == \
        ("w", pb.LOD_TENSOR, "float32", [3, 4], 1, 2, 3, "t")
    assert msg.data == x.tobytes() and msg.rows == b""
    sr = pb.VariableMessage.FromString(encode_variable("g", SelectedRows(np.array([1, 2]), x[:2], 5)))
    assert (sr.type, sr.height, list(sr.dims)) == (pb.SELECTED_ROWS, 5, [2, 4])
    assert sr.rows == np.array([1, 2], "<i8").tobytes() and sr.data == x[:2].tobytes()


def test_message_built_by_the_generated_class_decodes() -> None:
    x = _sample("float64", (2, 3))
    dense = pb.VariableMessage(name="p", dtype="float64", dims=[2, 3], data=x.tobytes(), trainer_id=1, step=4)
    decoded = decode_variable(dense.SerializeToString())
    _assert_same_array(decoded.value, x)
    assert (decoded.name, decoded.header.trainer_id, decoded.header.step) == ("p", 1, 4)
    sparse = pb.VariableMessage(name="g", type=pb.SELECTED_ROWS, dtype="float64", dims=[2, 3], height=6,
                                rows=np.array([5, 0], "<i8").tobytes(), data=x.tobytes())
    sr = decode_variable(sparse.SerializeToString()).value
    np.testing.assert_array_equal(np.asarray(sr.rows), [5, 0])
    _assert_same_array(sr.values, x)
    assert sr.height == 6


def test_field_order_does_not_matter() -> None:
    x = _sample("int32", (4,))
    m = pb.VariableMessage(name="x", dtype="int32", dims=[4], data=x.tobytes())
    data_first = pb.VariableMessage(data=x.tobytes()).SerializeToString() + \
        pb.VariableMessage(name="x", dtype="int32", dims=[4]).SerializeToString()
    _assert_same_array(decode_variable(data_first).value, x)
    _assert_same_array(decode_variable(m.SerializeToString()).value, x)


def test_unknown_header_fields_are_ignored() -> None:
    x = _sample("float32", (2,))
    raw = encode_variable("x", x) + bytes([(100 << 3 | 0) & 0x7F | 0x80, 100 >> 4, 7])
    _assert_same_array(decode_variable(raw).value, x)


# --- no copy -----------------------------------------------------------------------------------------------------
def test_decoding_returns_read_only_views_of_the_buffer() -> None:
    x = _sample("float32", (64, 16))
    raw = encode_variable("w", x)
    value = decode_variable(raw).value
    assert np.shares_memory(value, np.frombuffer(raw, np.uint8))
    assert not value.flags.writeable


def test_decoding_selected_rows_returns_views_of_the_buffer() -> None:
    raw = bytearray(encode_variable("g", SelectedRows(np.array([3, 1]), _sample("float32", (2, 8)), 4)))
    sr = decode_variable(raw).value
    whole = np.frombuffer(raw, np.uint8)
    assert np.shares_memory(sr.values, whole) and np.shares_memory(sr.rows, whole)


# --- malformed messages ------------------------------------------------------------------------------------------
def _msg(**fields: Any) -> bytes:
    return pb.VariableMessage(name="v", **fields).SerializeToString()


F32x6 = np.arange(6, dtype=np.float32).tobytes()
GOOD = encode_variable("v", np.arange(6, dtype=np.float32).reshape(2, 3), trainer_id=1)

MALFORMED = {
    "truncated-data": (GOOD[:-5], "truncated"),
    "truncated-varint": (GOOD[:1] + b"\x85", "truncated"),
    "truncated-header": (_msg(dtype="float32")[:-3], "truncated"),
    "garbage": (b"\xff" * 12, "varint"),
    "garbage-wire-type": (b"\x0f\x01\x02\x03", "wire type 7"),
    "garbage-group": (b"\x0b\x0c", "wire type 3"),
    "garbage-header": (b"\x0a\x02\xff\xfe", "does not decode"),
    "empty": (b"", "dtype ''"),
    "data-too-short": (_msg(dtype="float32", dims=[2, 3], data=F32x6[:-4]), "data holds 20 bytes, expected 24"),
    "data-too-long": (_msg(dtype="float32", dims=[2, 3], data=F32x6 + b"\0" * 4), "data holds 28 bytes, expected 24"),
    "data-missing": (_msg(dtype="float32", dims=[2, 3]), "data holds 0 bytes, expected 24"),
    "unknown-dtype": (_msg(dtype="complex64", dims=[3], data=F32x6), "dtype 'complex64'"),
    "object-dtype": (_msg(dtype="object", dims=[1], data=b"\0" * 8), "dtype 'object'"),
    "negative-dims": (_msg(dtype="float32", dims=[-2, -3], data=F32x6), "negative dims [-2, -3]"),
    "negative-dim": (_msg(dtype="float32", dims=[6, -1], data=F32x6), "negative dims"),
    "huge-dims-overflow": (_msg(dtype="float32", dims=[1 << 32, 1 << 32]), "more than 1099511627776 elements"),
    "huge-dims": (_msg(dtype="float32", dims=[1 << 62, 4]), "an extent above 1099511627776"),
    "huge-dims-zero-size": (_msg(dtype="float32", dims=[0, 1 << 40, 1 << 40]), "more than 1099511627776 elements"),
    "too-many-dims": (_msg(dtype="float32", dims=[1] * 70), "has 70 dims, at most 32"),
    "rows-fewer-than-data": (_msg(type=pb.SELECTED_ROWS, dtype="float32", dims=[3, 2], height=5, data=F32x6,
                                  rows=np.array([0, 1], "<i8").tobytes()), "16 bytes of row ids for 3 rows"),
    "rows-more-than-data": (_msg(type=pb.SELECTED_ROWS, dtype="float32", dims=[2, 3], height=5, data=F32x6,
                                 rows=np.array([0, 1, 2], "<i8").tobytes()), "24 bytes of row ids for 2 rows"),
    "rows-not-int64": (_msg(type=pb.SELECTED_ROWS, dtype="float32", dims=[2, 3], height=5, data=F32x6,
                            rows=np.array([0, 1, 2, 3], "<i4").tobytes()[:12]), "12 bytes of row ids for 2 rows"),
    "rows-missing": (_msg(type=pb.SELECTED_ROWS, dtype="float32", dims=[2, 3], height=5, data=F32x6),
                     "0 bytes of row ids for 2 rows"),
    "row-id-too-big": (_msg(type=pb.SELECTED_ROWS, dtype="float32", dims=[2, 3], height=5, data=F32x6,
                            rows=np.array([1, 5], "<i8").tobytes()), "row ids must lie in [0, 5), got [1, 5]"),
    "row-id-negative": (_msg(type=pb.SELECTED_ROWS, dtype="float32", dims=[2, 3], height=5, data=F32x6,
                             rows=np.array([-1, 2], "<i8").tobytes()), "row ids must lie in [0, 5), got [-1, 2]"),
    "negative-height": (_msg(type=pb.SELECTED_ROWS, dtype="float32", dims=[0, 3], height=-1), "[0, -1)"),
    "selected-rows-scalar": (_msg(type=pb.SELECTED_ROWS, dtype="float32", data=F32x6[:4], height=3), "scalar data"),
    "dense-with-rows": (_msg(dtype="float32", dims=[2, 3], data=F32x6, rows=np.array([0, 1], "<i8").tobytes()),
                        "dense tensor but carries rows"),
    "unknown-type": (_msg(type=7, dtype="float32", dims=[2, 3], data=F32x6), "unknown type 7"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_message_raises_wire_error_naming_the_problem(case: str) -> None:
    raw, words = MALFORMED[case]
    with pytest.raises(WireError) as info:
        decode_variable(raw)
    assert words in str(info.value)
    assert info.value.code == "E710"


def test_errors_name_the_variable() -> None:
    with pytest.raises(WireError, match="variable 'v'"):
        decode_variable(_msg(dtype="float32", dims=[2], data=b"\0"))


def test_random_corruption_raises_only_wire_errors() -> None:
    rng = np.random.default_rng(2024)
    good = [GOOD, encode_variable("g", SelectedRows(np.array([1, 3]), np.ones((2, 2), np.float32), 5))]
    for i in range(3000):
        buf = bytearray(good[i % 2])
        for _ in range(int(rng.integers(1, 4))):
            kind = int(rng.integers(0, 3))
            if kind == 0 and buf:
                buf[int(rng.integers(len(buf)))] = int(rng.integers(256))
            elif kind == 1 and buf:
                del buf[int(rng.integers(len(buf))):]
            else:
                buf.insert(int(rng.integers(len(buf) + 1)), int(rng.integers(256)))
        try:
            decode_variable(bytes(buf))
        except WireError:
            pass


# --- encode_parts and chunks (the streamed form; runtime.rpc.stream) ---------------------------------------------
def test_encode_parts_join_to_the_encoded_message_and_count_its_bytes() -> None:
    from runtime.rpc.wire import encode_parts

    x = _sample("float32", (5, 7))
    for value in (x, SelectedRows(np.array([4, 0]), x[:2], 6), np.zeros((0, 3), np.float32)):
        parts, total = encode_parts("w", value, trainer_id=1, step=2, seq=3, incarnation=9)
        whole = encode_variable("w", value, trainer_id=1, step=2, seq=3, incarnation=9)
        assert b"".join(parts) == whole and total == len(whole)


def test_encode_parts_view_the_tensor_without_copying_it() -> None:
    from runtime.rpc.wire import encode_parts

    x = _sample("float64", (32, 8))
    parts, _ = encode_parts("w", x)
    assert any(isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), x) for p in parts)


@pytest.mark.parametrize("chunk_bytes", [1, 3, 64, 1000, 4096])
def test_chunks_cut_the_message_into_chunk_messages_that_rejoin_exactly(chunk_bytes: int) -> None:
    from runtime.rpc.stream import chunks
    from runtime.rpc.wire import encode_parts

    value = SelectedRows(np.array([7, 2, 5]), _sample("float32", (3, 50)), 8)
    parts, total = encode_parts("g", value, seq=4)
    msgs = [pb.Chunk.FromString(c) for c in chunks(parts, total, chunk_bytes=chunk_bytes)]
    assert msgs[0].total == total and all(m.total == 0 for m in msgs[1:])
    assert all(len(m.data) == chunk_bytes for m in msgs[:-1]) and 1 <= len(msgs[-1].data) <= chunk_bytes
    assert len(msgs) == -(-total // chunk_bytes)
    assert b"".join(m.data for m in msgs) == encode_variable("g", value, seq=4)


def test_chunks_are_plain_bytes_and_the_default_size_is_at_most_4_mib() -> None:
    from runtime.rpc.stream import CHUNK_BYTES, MAX_CHUNK_BYTES, chunks

    assert CHUNK_BYTES <= MAX_CHUNK_BYTES < 4 << 20
    out = list(chunks([b"ab", memoryview(b"cdef"), bytearray(b"g")], chunk_bytes=3))
    assert all(type(c) is bytes for c in out)
    assert [pb.Chunk.FromString(c).data for c in out] == [b"abc", b"def", b"g"]


@pytest.mark.parametrize("kwargs,words", [
    ({"total": 5}, "the parts hold 4 bytes but the message was announced as 5 bytes"),
    ({"chunk_bytes": 0}, "chunk size 0 is out of range"),
    ({"chunk_bytes": 4 << 20}, f"chunk size {4 << 20} is out of range"),
])
def test_chunks_reject_bad_arguments_at_the_call(kwargs: dict[str, int], words: str) -> None:
    from runtime.rpc.stream import chunks

    with pytest.raises(WireError, match=words):
        chunks([b"abcd"], **kwargs)  # not iterated: the check happens at the call
    with pytest.raises(WireError, match="an empty message cannot be streamed"):
        chunks([b"", b""])
