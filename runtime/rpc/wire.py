"""Tensors on the wire: a ``VariableMessage`` whose ``rows`` and ``data`` fields hold raw bytes.

``encode_variable`` serialises the small header fields with protobuf and appends the ``rows`` and
``data`` fields by hand (tag, length, bytes): the tensor is copied exactly once, into the message,
and the result is an ordinary protobuf encoding that any protobuf reader accepts.
``decode_variable`` walks the top-level fields itself, parses the header fields with protobuf and
returns numpy arrays that are read-only views of the received buffer (no copy).

Invariants: tensors are little-endian and C-ordered; ``len(data) == prod(dims) * itemsize``; selected
rows carry one int64 row id per row of ``data``, each in ``[0, height)``. Every violation raises
``WireError`` naming the field, what was found and what was expected, before any value is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from ir.errors import FlotillaError
from runtime.rpc import send_recv_pb2 as pb
from runtime.scope import SelectedRows

ROWS_FIELD = pb.VariableMessage.DESCRIPTOR.fields_by_name["rows"].number
DATA_FIELD = pb.VariableMessage.DESCRIPTOR.fields_by_name["data"].number
_RAW_FIELDS = (ROWS_FIELD, DATA_FIELD)
MAX_RANK = 32  # numpy allows 64; no variable of a program has more than a handful
MAX_DIM = 1 << 40  # above any real extent; keeps every element count far from overflow
WIRE_DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")


class WireError(FlotillaError):
    """A message that does not decode to a valid variable."""

    code = "E710"


@dataclass
class Decoded:
    """A received variable: its header fields and its value (numpy array or SelectedRows of numpy).
    ``finite``: the receiver already found every value finite while copying it (the data plane does), so
    a pserver need not scan it again; False says nothing."""

    header: pb.VariableMessage
    value: Any
    finite: bool = False

    @property
    def name(self) -> str:
        return self.header.name


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:  # one byte: every tag and most lengths and header values
        return _ONE_BYTE[n]
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


_ONE_BYTE = tuple(bytes((i,)) for i in range(0x80))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    if pos < len(buf) and buf[pos] < 0x80:  # one byte (the common case)
        return buf[pos], pos + 1
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated or overlong varint in the message",
                            hint="the sender must write a complete VariableMessage")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _raw_field(number: int, payload: Any, nbytes: int) -> list[Any]:
    return [_varint(number << 3 | 2), _varint(nbytes), payload]


def as_host_array(value: Any) -> np.ndarray:
    """``value`` (jax or numpy array, or a Python scalar) as a C-ordered little-endian numpy array."""
    arr = np.asarray(value, order="C")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, remembered (numpy works it out in Python each time: ~5 us a tensor)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


def encode_parts(name: str, value: Any, *, trainer_id: int = 0, step: int = 0, seq: int = 0,
                 table_name: str = "", incarnation: int = 0) -> tuple[list[Any], int]:
    """The wire bytes of ``value`` (an array or SelectedRows) as variable ``name``, in pieces: ``(parts,
    total)`` where ``b"".join(parts)`` is the message and ``total`` its length. The parts are the serialised
    header, the raw fields' tag and length prefixes, and read-only views of the tensor's own memory (no copy
    yet), so a sender can either join them (``encode_variable``: one copy) or cut them into chunks
    (``runtime.rpc.stream.chunks``: one copy, into the chunks) without ever holding the message twice.
    The views alias ``value``: use the parts before anything can change ``value`` in place."""
    header = pb.VariableMessage(name=name, trainer_id=trainer_id, step=step, seq=seq, table_name=table_name,
                                incarnation=incarnation)
    parts: list[Any] = []
    if isinstance(value, SelectedRows):
        values = as_host_array(value.values)
        rows = as_host_array(value.rows).astype("<i8", copy=False).reshape(-1)
        header.type = pb.SELECTED_ROWS
        header.height = int(value.height)
        parts += _raw_field(ROWS_FIELD, rows.data.cast("B"), rows.nbytes)
    else:
        values = as_host_array(value)
    header.dtype = _dtype_name(values.dtype)
    header.dims.extend(values.shape)
    flat = values.reshape(-1).view(np.uint8) if values.size else b""
    parts += _raw_field(DATA_FIELD, flat.data if values.size else b"", values.nbytes)
    parts.insert(0, header.SerializeToString())
    return parts, sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


def encode_variable(name: str, value: Any, *, trainer_id: int = 0, step: int = 0, seq: int = 0,
                    table_name: str = "", incarnation: int = 0) -> bytes:
    """The wire bytes of ``value`` (an array or SelectedRows) as variable ``name``."""
    parts, _ = encode_parts(name, value, trainer_id=trainer_id, step=step, seq=seq, table_name=table_name,
                            incarnation=incarnation)
    return b"".join(parts)


def decode_variable(buf: bytes | memoryview) -> Decoded:
    """The variable in ``buf``; raises WireError if it is not a valid VariableMessage."""
    view = memoryview(buf).cast("B")
    pos, n = 0, len(view)
    header_spans: list[memoryview] = []
    raw: dict[int, memoryview] = {}
    while pos < n:
        start = pos
        key, pos = _read_varint(view, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(view, pos)
            if number in _RAW_FIELDS and pos + length <= n:
                raw[number] = view[pos:pos + length]
            pos += length
        else:
            raise WireError(f"field {number} has wire type {wire_type}, which VariableMessage never uses",
                            hint="send a protobuf-encoded flotilla.rpc.VariableMessage")
        if pos > n:
            raise WireError(f"the message is truncated: field {number} ends at byte {pos} of {n}",
                            hint="send the whole message")
        if number not in _RAW_FIELDS:
            header_spans.append(view[start:pos])
    try:
        header = pb.VariableMessage.FromString(b"".join(header_spans))
    except DecodeError as e:
        raise WireError(f"the message header does not decode as VariableMessage: {e}") from None
    return Decoded(header, _value(header, raw.get(ROWS_FIELD), raw.get(DATA_FIELD)))


def _value(header: pb.VariableMessage, rows: memoryview | None, data: memoryview | None) -> Any:
    name = header.name or "<unnamed>"
    if header.dtype not in WIRE_DTYPES:
        raise WireError(f"variable {name!r} has dtype {header.dtype!r}, expected one of {list(WIRE_DTYPES)}")
    dims = tuple(int(d) for d in header.dims)
    if len(dims) > MAX_RANK:
        raise WireError(f"variable {name!r} has {len(dims)} dims, at most {MAX_RANK} are allowed",
                        hint="send the tensor's real shape")
    if any(d < 0 for d in dims):
        raise WireError(f"variable {name!r} has negative dims {list(dims)}")
    if any(d > MAX_DIM for d in dims):
        raise WireError(f"variable {name!r} has dims {list(dims)}: an extent above {MAX_DIM} cannot be a tensor "
                        "of this job", hint="send the tensor's real shape")
    if math.prod(d for d in dims if d) > MAX_DIM:
        raise WireError(f"variable {name!r} has dims {list(dims)}: more than {MAX_DIM} elements even ignoring "
                        "zero extents", hint="send the tensor's real shape")
    dtype = np.dtype(header.dtype).newbyteorder("<")
    expected = math.prod(dims) * dtype.itemsize  # Python ints: huge dims cannot wrap around
    got = 0 if data is None else len(data)
    if got != expected:
        raise WireError(f"variable {name!r}: data holds {got} bytes, expected {expected} "
                        f"({list(dims)} x {dtype.itemsize}-byte {header.dtype})",
                        hint="data must be the raw little-endian bytes of the whole tensor")
    values = np.frombuffer(data, dtype=dtype).reshape(dims) if expected else np.zeros(dims, dtype)
    if header.type == pb.LOD_TENSOR:
        if rows is not None and len(rows):
            raise WireError(f"variable {name!r} is a dense tensor but carries rows")
        return values
    if header.type != pb.SELECTED_ROWS:
        raise WireError(f"variable {name!r} has unknown type {header.type}")
    if not dims:
        raise WireError(f"selected rows {name!r} has scalar data; expected [rows, ...]")
    n_rows = 0 if rows is None else len(rows) // 8
    if rows is not None and len(rows) % 8 or n_rows != dims[0]:
        raise WireError(f"selected rows {name!r}: {0 if rows is None else len(rows)} bytes of row ids for "
                        f"{dims[0]} rows of data; expected 8 bytes (int64) per row")
    ids = np.frombuffer(rows, dtype="<i8") if n_rows else np.zeros((0,), np.int64)
    if header.height < 0 or (n_rows and (ids.min() < 0 or ids.max() >= header.height)):
        raise WireError(f"selected rows {name!r}: row ids must lie in [0, {header.height}), "
                        f"got [{ids.min() if n_rows else '-'}, {ids.max() if n_rows else '-'}]")
    return SelectedRows(ids, values, int(header.height))


# --- batches: SendVariables requests and GetVariables replies
BATCH_FIELD = pb.VariableBatch.DESCRIPTOR.fields_by_name["vars"].number
MAX_BATCH = 1 << 16  # far above the variables one trainer exchanges with one pserver in a step


def encode_batch(messages: list[Any]) -> bytes:
    """A ``VariableBatch`` of ``VariableMessage``s, each given as ``encode_parts``'s ``(parts, total)``
    (every tensor copied once, into the batch) or as already encoded bytes."""
    out: list[Any] = []
    for msg in messages:
        parts, total = ([msg], len(msg)) if isinstance(msg, (bytes, bytearray, memoryview)) else msg
        out += [_varint(BATCH_FIELD << 3 | 2), _varint(total), *parts]
    return b"".join(out)


def decode_batch(buf: bytes | memoryview) -> list[Decoded]:
    """The variables of a ``VariableBatch``, in order (each a view of ``buf``, as ``decode_variable``);
    raises WireError naming the entry if the batch or any variable in it is malformed."""
    view = memoryview(buf).cast("B")
    pos, n = 0, len(view)
    out: list[Decoded] = []
    while pos < n:
        key, pos = _read_varint(view, pos)
        if key != (BATCH_FIELD << 3 | 2):
            raise WireError(f"a VariableBatch holds field {key >> 3} (wire type {key & 7}); only repeated "
                            f"VariableMessage vars = {BATCH_FIELD} is allowed",
                            hint="send a protobuf-encoded flotilla.rpc.VariableBatch")
        length, pos = _read_varint(view, pos)
        if pos + length > n:
            raise WireError(f"the batch is truncated: entry {len(out)} ends at byte {pos + length} of {n}",
                            hint="send the whole message")
        if len(out) >= MAX_BATCH:
            raise WireError(f"a VariableBatch holds more than {MAX_BATCH} variables")
        try:
            out.append(decode_variable(view[pos:pos + length]))
        except WireError as e:
            raise WireError(f"entry {len(out)} of the batch: {e.message}", hint=e.hint) from None
        pos += length
    return out
