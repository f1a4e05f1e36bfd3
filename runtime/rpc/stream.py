"""Large variables as gRPC streams of ``Chunk`` messages: cutting, reassembling, receive buffers.

gRPC Python moves one large unary message slowly; the same bytes as a stream of ``CHUNK_BYTES`` pieces
go several times faster. A message of ``STREAM_THRESHOLD`` bytes or more therefore travels chunked
(``SendVariableStream``, ``GetVariableStream``); smaller ones stay unary, where one call is cheaper than a
stream's setup. Both numbers were measured here (2 cores, loopback, trainer and pserver processes): 1 MiB
chunks were as fast as or faster than 256 KiB, 2 MiB and 4 MiB ones at 4 and 64 MiB (64 MiB: ~1.2-2.0 GB/s
streamed against ~0.35-0.5 GB/s unary); streaming overtook unary between 1 and 2 MiB.

Framing: each stream element is a protobuf ``flotilla.rpc.Chunk``. The first chunk carries ``total``, the
length of the whole ``VariableMessage`` (at least 1); every chunk carries ``data``, the next bytes of it;
the data, in order, is exactly ``total`` bytes. ``chunks`` writes the chunks by hand from the parts
``wire.encode_parts`` makes (header, tag and length prefixes, views of the tensor): the tensor is copied
once, into the chunks, and the whole message is never joined. ``ReceiveBuffers.assemble`` checks
``total`` against the receiver's limit before it allocates anything and copies each chunk's data into a
pooled buffer; a truncated, over-long or malformed stream raises ``WireError`` naming the sizes.

Buffer ownership: the pool never overwrites memory a live value can see. ``assemble`` returns a
read-only view of a pooled buffer, and ``decode_variable`` builds the values as views of it (no copy),
so every value made from a receive keeps a reference to its buffer. A pooled buffer is handed out again
only when nothing but the pool refers to it (its reference count says so), i.e. once every value decoded
from it, and everything aliasing those (numpy views; ``jax.device_put`` of a value on CPU keeps it
referenced too), is gone: the check is conservative, never early. No release call is
needed and none can be forgotten; a receive while the previous value of the same size is still alive
simply takes a second buffer (steady state: two per size class, ping-pong). Reusing a buffer avoids the
page faults of fresh memory (~25 ms per 64 MiB here, against ~3 ms to copy into memory already mapped).
The pool keeps at most ``capacity_bytes``; beyond that a receive gets a fresh buffer the pool forgets.
Buffers are page-aligned (``aligned_empty``): a value copied to a buffer's start is 64-byte aligned,
which is what lets XLA's CPU client use it in place instead of copying it into every compiled call that
reads it (measured: a CTR step's ~3 MB of arguments cost ~0.5 ms of copies a call unaligned, ~0.02 ms
aligned).

These are pure helpers: no pserver logic. ``send_chunked`` and ``get_chunked`` drive gRPC multi-callables
made with identity (de)serializers (``channel.stream_unary`` / ``channel.unary_stream``).
"""
from __future__ import annotations

import mmap
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.wire import Decoded, WireError, _read_varint, _varint, decode_variable, encode_parts

CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = (4 << 20) - 64  # a chunk plus its framing stays under gRPC's default 4 MiB message limit
STREAM_THRESHOLD = 2 << 20
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_POOL_BYTES = 1 << 30

_TOTAL_KEY = pb.Chunk.DESCRIPTOR.fields_by_name["total"].number << 3 | 0  # varint
_DATA_KEY = pb.Chunk.DESCRIPTOR.fields_by_name["data"].number << 3 | 2  # length-delimited
_TOTAL_TAG = _varint(_TOTAL_KEY)
_DATA_TAG = _varint(_DATA_KEY)
_CHUNK_HINT = "stream the message as flotilla.rpc.Chunk messages (runtime.rpc.stream.chunks)"


def chunks(parts: Sequence[Any], total: int | None = None, *,
           chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The serialised ``Chunk`` messages of the message ``b"".join(parts)`` (``total`` bytes, computed if
    not given): every chunk but the last holds exactly ``chunk_bytes`` of data, the first also ``total``.

    Each chunk is built by one ``join`` of the slices of ``parts`` it covers, so every byte of the message
    is copied exactly once and the whole message never exists in one piece. The parts are read lazily, as
    the chunks are taken: they must not change until the iterator is exhausted. Arguments are checked at
    the call (not at the first chunk), so a bad call fails before any stream starts."""
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise WireError(f"chunk size {chunk_bytes} is out of range; expected 1 to {MAX_CHUNK_BYTES} bytes",
                        hint="keep chunks at most 4 MiB (gRPC's default message limit)")
    views = [memoryview(p).cast("B") for p in parts]
    size = sum(v.nbytes for v in views)
    if total is not None and total != size:
        raise WireError(f"the parts hold {size} bytes but the message was announced as {total} bytes",
                        hint="pass the (parts, total) pair encode_parts returned, unchanged")
    if size == 0:
        raise WireError("an empty message cannot be streamed", hint="a VariableMessage is never empty")
    return _cut(views, size, chunk_bytes)


def _cut(views: list[memoryview], size: int, chunk_bytes: int) -> Iterator[bytes]:
    first = _TOTAL_TAG + _varint(size)
    pending: list[memoryview] = []
    filled = 0
    for view in views:
        while view.nbytes:
            take = min(view.nbytes, chunk_bytes - filled)
            pending.append(view[:take])
            view = view[take:]
            filled += take
            if filled == chunk_bytes:
                yield b"".join([first, _DATA_TAG, _varint(filled), *pending])
                first, pending, filled = b"", [], 0
    if filled:
        yield b"".join([first, _DATA_TAG, _varint(filled), *pending])


def encode_chunks(name: str, value: Any, **header: Any) -> list[bytes]:
    """Every chunk of ``value`` encoded as variable ``name`` (``header``: encode_variable's keywords), made
    now: one copy of the tensor, after which ``value`` may change (a pserver encodes under its locks)."""
    return list(chunks(*encode_parts(name, value, **header)))


def _parse_chunk(chunk: Any, index: int) -> tuple[int | None, memoryview]:
    """``(total or None, data)`` of one serialised Chunk; ``data`` is a view of ``chunk``."""
    view = memoryview(chunk).cast("B")
    pos, n = 0, view.nbytes
    total: int | None = None
    data: memoryview | None = None

    def varint(at: int) -> tuple[int, int]:
        try:
            return _read_varint(view, at)
        except WireError:
            raise WireError(f"chunk {index} does not parse as a flotilla.rpc.Chunk: a varint at byte {at} of {n} "
                            "is truncated or overlong", hint=_CHUNK_HINT) from None

    while pos < n:
        key, pos = varint(pos)
        if key == _TOTAL_KEY and total is None:
            total, pos = varint(pos)
        elif key == _DATA_KEY and data is None:
            length, pos = varint(pos)
            if pos + length > n:
                raise WireError(f"chunk {index} is truncated: its data ends at byte {pos + length} of {n}",
                                hint=_CHUNK_HINT)
            data = view[pos:pos + length]
            pos += length
        else:
            what = "twice" if key in (_TOTAL_KEY, _DATA_KEY) else "which Chunk does not have"
            raise WireError(f"chunk {index} holds field {key >> 3} (wire type {key & 7}) {what}; a Chunk is "
                            "`uint64 total = 1` (first chunk only) and `bytes data = 15`", hint=_CHUNK_HINT)
    return total, data if data is not None else view[:0]


@dataclass
class PoolStats:
    """What a ``ReceiveBuffers`` did: buffers ``allocated`` (fresh memory, pooled or not), receives that
    ``reused`` a pooled buffer, ``unpooled`` fresh buffers the pool did not keep (it was full of buffers
    in use), buffers ``evicted`` to make room, and the pool's current ``buffers`` and ``pooled_bytes``."""

    allocated: int = 0
    reused: int = 0
    unpooled: int = 0
    evicted: int = 0
    buffers: int = 0
    pooled_bytes: int = 0


def size_class(nbytes: int) -> int:
    """The buffer size a message of ``nbytes`` gets: rounded up to an eighth of its power of two (at
    least 64 KiB), so sizes a few header bytes apart share buffers and at most 1/8 is wasted."""
    granule = max(1 << 16, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // granule) * granule


class ReceiveBuffers:
    """A thread-safe pool of receive buffers (numpy uint8 arrays) by size class; see the module docstring
    for the ownership rule. ``capacity_bytes`` bounds the memory the pool keeps."""

    def __init__(self, capacity_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray] = []  # least recently handed out first (the eviction order)
        self._stats = PoolStats()

    def stats(self) -> PoolStats:
        """A snapshot of the counters."""
        with self._lock:
            return PoolStats(**vars(self._stats))

    def _take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` that nothing outside the pool refers to; the caller's reference
        marks it in use from the moment it is returned (under the lock)."""
        size = size_class(nbytes)
        with self._lock:
            i = self._free_index(size)
            if i >= 0:
                buf = self._buffers.pop(i)
                self._buffers.append(buf)
                self._stats.reused += 1
                return buf
            self._make_room(size)
            buf = aligned_empty(size)
            self._stats.allocated += 1
            if self._stats.pooled_bytes + size <= self.capacity_bytes:
                self._buffers.append(buf)
                self._stats.buffers += 1
                self._stats.pooled_bytes += size
            else:
                self._stats.unpooled += 1
            return buf

    def _free_index(self, size: int) -> int:
        """The index of a free pooled buffer of ``size`` bytes, or -1 (lock held). Scans by index: an
        iterator, or a variable left over afterwards, would be one more reference to a buffer."""
        for i in range(len(self._buffers)):
            buf = self._buffers[i]
            if buf.nbytes == size and _refs(buf) <= _FREE_REFS:
                return i
        return -1

    def _make_room(self, nbytes: int) -> None:
        """Forget free buffers, least recently used first, until ``nbytes`` more fit (lock held)."""
        i = 0
        while i < len(self._buffers) and self._stats.pooled_bytes + nbytes > self.capacity_bytes:
            buf = self._buffers[i]
            if _refs(buf) > _FREE_REFS:
                i += 1
                continue
            del self._buffers[i]
            self._stats.evicted += 1
            self._stats.buffers -= 1
            self._stats.pooled_bytes -= buf.nbytes

    def assemble(self, stream: Iterable[Any], max_bytes: int) -> memoryview:
        """The message carried by ``stream`` (serialised Chunks), as a read-only view of a pooled buffer.

        Raises WireError, having allocated nothing beyond ``max_bytes``, when the first chunk announces no
        total or more than ``max_bytes``, when the chunks carry more data than announced (checked before
        each copy), when the stream ends early, or when a chunk is not a Chunk."""
        buf: np.ndarray | None = None
        out: memoryview | None = None
        total = pos = 0
        index = -1
        for index, chunk in enumerate(stream):
            announced, data = _parse_chunk(chunk, index)
            if index == 0:
                if not announced:
                    raise WireError("the first chunk of the stream announces no total length",
                                    hint="the first Chunk carries `total`, the message's length in bytes")
                if announced > max_bytes:
                    raise WireError(f"the stream announces a {announced}-byte message; this receiver accepts at "
                                    f"most {max_bytes} bytes",
                                    hint="send a smaller variable, or raise the receiver's message limit (it "
                                         "follows the largest variable of the program)")
                total = announced
                buf = self._take(total)
                out = memoryview(buf)
            elif announced is not None:
                raise WireError(f"chunk {index} announces a total length again ({announced} bytes)",
                                hint="only the first Chunk carries `total`")
            n = data.nbytes
            if pos + n > total:
                raise WireError(f"the stream carries more than the {total} bytes it announced: chunk {index} "
                                f"brings the data to {pos + n} bytes",
                                hint="the chunks' data must add up to exactly the announced total")
            out[pos:pos + n] = data
            pos += n
        if index < 0:
            raise WireError("the stream carried no chunk", hint="stream at least one Chunk")
        if pos != total:
            raise WireError(f"the stream ended after {pos} of the {total} bytes it announced "
                            f"({index + 1} chunk(s))", hint="the sender stopped early; send the whole message")
        return out[:total].toreadonly()


    def take(self, nbytes: int) -> np.ndarray:
        """A pooled uint8 buffer of at least ``nbytes`` that nothing else refers to (the ownership rule:
        it is handed out again once every view of it is gone)."""
        return self._take(nbytes)

    def copy(self, data: memoryview) -> memoryview:
        """``data`` copied into a pooled buffer, as a read-only view (the same ownership rule as ``assemble``):
        a receiver's copy of bytes it must not keep a view of (the data plane's shared memory)."""
        n = data.nbytes
        out = memoryview(self._take(n))
        out[:n] = data
        return out[:n].toreadonly()


def aligned_empty(nbytes: int) -> np.ndarray:
    """A new writable uint8 array of ``nbytes`` that starts on a page boundary (anonymous memory, freed
    with the last reference to it). numpy's own allocations are only 16-byte aligned here, and XLA's CPU
    client copies any argument that is not 64-byte aligned."""
    return np.frombuffer(mmap.mmap(-1, max(1, nbytes)), np.uint8, count=nbytes)


def _refs(buf: np.ndarray) -> int:
    """``buf``'s reference count as seen from a caller that holds it in one list slot and one variable."""
    return sys.getrefcount(buf)


def _calibrate() -> int:
    """What ``_refs`` reports for a buffer nothing but the pool's list and the scanning loop's variable
    holds (interpreter-specific, so measured exactly the way the pool checks rather than assumed)."""
    buffers = [aligned_empty(1)]
    for i in range(len(buffers)):
        buf = buffers[i]
        return _refs(buf)
    raise RuntimeError("unreachable")


# A pooled buffer is free when ``_refs`` sees no more than this: every value decoded from it holds it
# (numpy keeps the memoryview it was built on as the value's base, and that view holds the buffer as
# its exporter), and so does anything aliasing such a value (numpy views, zero-copy arrays).
_FREE_REFS = _calibrate()


def send_chunked(call: Callable[..., bytes], parts: Sequence[Any], total: int, timeout: float,
                 metadata: Any = None, *, chunk_bytes: int = CHUNK_BYTES) -> bytes:
    """Stream the message ``parts`` (``total`` bytes, from ``wire.encode_parts``) through ``call``, a
    ``channel.stream_unary`` callable with identity (de)serializers; returns the reply bytes. gRPC errors
    propagate as ``grpc.RpcError``. The parts are checked (WireError) before the call starts; a retry
    calls this again (the chunks are made afresh from the parts)."""
    return call(chunks(parts, total, chunk_bytes=chunk_bytes), timeout=timeout, metadata=metadata)


def get_chunked(call: Callable[..., Any], request: bytes, buffers: ReceiveBuffers, timeout: float,
                metadata: Any = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Decoded:
    """The variable streamed back by ``call`` (a ``channel.unary_stream`` callable with identity
    (de)serializers) for ``request``, decoded from a buffer of ``buffers`` (values are read-only views of
    it; see the ownership rule). A malformed stream raises WireError and cancels the call; gRPC errors
    propagate as ``grpc.RpcError``."""
    responses = call(request, timeout=timeout, metadata=metadata)
    try:
        return decode_variable(buffers.assemble(responses, max_bytes))
    except BaseException:
        responses.cancel()
        raise
