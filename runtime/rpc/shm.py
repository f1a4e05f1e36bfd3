"""The same-host data plane: large batches of tensors through shared memory, negotiated over gRPC.

gRPC stays the control plane and the default path (``FLAGS_rpc_data_plane=off`` keeps everything on it).
With ``auto`` (the default) a trainer whose pserver runs on its own host moves batches of at least
``FLAGS_rpc_data_plane_min_bytes`` (256 KiB) through segments of shared memory; the call (through the
pserver's control socket, else gRPC) carries only a reference. A trainer on another host (another
``host_id``: machine, ``/dev/shm`` or network namespace) is answered no segment and, where the pserver has
one, the port of its TCP data plane (``runtime.rpc.tcp_plane``); so is every trainer when either side runs
with ``tcp`` (the trainer then reports no host).

Segments. A trainer asks its pserver for a segment (``ShmOpen``: trainer id, live incarnation, the
trainer's ``host_id`` and a size). The pserver checks the incarnation and the host, creates a file under
``/dev/shm`` with a random name, ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 (readable and writable by
the job's user only), maps it with ``MAP_POPULATE`` (no page faults on first use; a trainer keeps its
segments and reuses them for every later transfer), writes a random nonce and its control socket's id into
its first ``HEADER_BYTES`` and answers the path, number,
size and nonce. The trainer opens it without following links, checks it is a regular file of its own
user, mode 0600, of the announced size and carrying the nonce (so it mapped the pserver's file, not one
planted under that name), maps it, and unlinks the name: from then on only the two mappings hold the
memory, and a killed process leaves nothing behind in ``/dev/shm``. The pserver unlinks too (ignoring
a name already gone) whenever it drops a segment: when the trainer's incarnation changes, when the
trainer completes, and when the pserver stops (``PServerPlane.close``). A trainer incarnation holds at
most ``MAX_SEGMENTS`` segments and ``max_bytes`` bytes; beyond that ``ShmOpen`` answers no path and the
trainer stays on gRPC for that transfer.

Control socket. Creating segments (``ShmOpen``) always goes over gRPC; the per-transfer calls (``ShmSend``,
``ShmGet``: a reference each way) go through the pserver's control socket when it has one, a gRPC round
trip costing about as much as copying 4 MiB. So does a distributed table's prefetch (``CONTROL_PREFETCH``,
a ``ShmPrefetchRequest``: a reference to the ids, one to the slot for the rows; it has no gRPC form: a
trainer without the socket sends a ``PrefetchVariable``). The pserver (``ControlServer``, started with its gRPC server
when the data plane is on) listens on an abstract Unix socket (``SOCK_SEQPACKET``; nothing on disk, gone
with the process) named by 16 random bytes it writes into every segment's header after the nonce, so a
trainer learns it from a segment it has verified. The server serves only peers of its own user
(``SO_PEERCRED`` at accept; the trainer checks the pserver's uid the same way) and hands each request,
the bytes gRPC would carry, to the very handler gRPC calls: every check below applies unchanged, and an
error comes back as the status and message gRPC would give. Without the job token on the socket the
reference's MAC (keyed by the token) is what authenticates a request, as the segment's mode does for the
payload. A trainer whose control socket cannot be reached or breaks (a stopping pserver) makes that call, and
the later ones, over gRPC (with gRPC's deadline and retries: a send is idempotent by its per-variable seq, a
retried get gets a fresh slot seq); a call that times out fails DEADLINE_EXCEEDED as over gRPC.

References. A segment holds one transfer at a time, from ``HEADER_BYTES`` on: the bytes of a
``VariableBatch`` exactly as gRPC would carry them, so ``wire.decode_batch`` validates them exactly as
it validates a gRPC request. The pserver's answers (``ShmGet``, ``CONTROL_PREFETCH``), which the trainer
reads in place, put each tensor of 512 bytes or more on a 64-byte boundary of the segment with a ``pad``
field (``BatchWriter(align=True)``): XLA then uses it in place too instead of copying it into every
compiled call that reads it. A ``ShmRef`` names (trainer id, incarnation, segment, offset, length, seq)
and carries ``mac``, HMAC-SHA256 over those fields and the reference's purpose (``send``, ``ids``, ``slot``,
``reply``), keyed by the job token (or, in a job without one, by a random key the pserver answered in
``ShmOpen``). The receiver checks, before it reads a byte of the segment: the MAC (constant-time), the
trainer's live incarnation, the segment number, ``HEADER_BYTES <= offset``, ``length > 0`` and
``offset + length <= size``, and the sequence number: each side numbers its references from 1 and the
pserver accepts each number once, within a window of ``SEQ_WINDOW`` below the highest seen (a trainer's
sends and pulls may overtake each other); a reply must echo the number of its request. Anything else
is ``ShmError`` (INVALID_ARGUMENT, or FAILED_PRECONDITION for a stale incarnation) and changes nothing.
The payload itself is protected as the job's memory is: by the segment's mode and owner; the MAC makes
the reference unforgeable by anyone without the key, and binds it to its range and sequence number.

Ownership (the rule that makes reading a view safe):
- A send segment is the trainer's until its ``ShmSend`` returns; the pserver copies the values out (into
  pooled buffers, as a gRPC receive does: a sync pserver stores gradients until the step's optimize, an
  async update may still be reading its input after the call returns, and what the pserver validates
  must be what it keeps, whatever happens to the segment) before it answers. The copy checks floating
  values finite as it goes (``copy_out``), so the pserver does not scan them again, and checks a
  selected-rows value's row ids against its height again, on the copy.
- A pipelined send (``CONTROL_PIPELINED``: a batch of ``PIPELINE_MIN_BYTES`` or more, through the control
  socket) overlaps the two copies: the trainer writes everything but the tensors' bytes, sends the
  request, then writes the tensors in ``PIECE_BYTES`` pieces, reporting after each how far the batch is
  written (``Progress``); the pserver decodes the headers at once and copies each tensor out as far as the
  reports go (while the piece is still in the shared cache), and reads no byte the trainer has not
  reported written. A report that is malformed or goes backwards drops the connection with nothing kept;
  a final report short of the reference is INVALID_ARGUMENT. So neither side ever writes what the other
  reads at that moment, and the pserver still validates and keeps only its copy.
- A get segment (``ShmGet``'s slot) is written by the pserver only while it answers that call; the
  trainer then decodes read-only numpy views of it and hands the segment out again only when nothing
  but its pool refers to the segment's array (the reference count says so, as ``stream.ReceiveBuffers``
  does): a value fetched earlier is never overwritten.
- A prefetch segment holds the trainer's ids (a batch of one message, ``ids`` reference) and, from the
  same offset, the slot for the rows: the pserver checks both references, copies the ids out (what it
  validates and looks up is the copy), and only then writes the rows over them; the trainer reads the
  rows as it reads a get's values.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import mmap
import os
import secrets
import socket
import stat
import struct
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ir.errors import FlotillaError
from runtime.rpc import send_recv_pb2 as pb
from runtime.rpc.stream import ReceiveBuffers
from runtime.rpc.wire import BATCH_FIELD, Decoded, _varint
from runtime.scope import SelectedRows

SHM_DIR = "/dev/shm"
HEADER_BYTES = 64  # the nonce and the control socket's id live here; transfers start after it (cache-line aligned)
NONCE_BYTES = 32
CONTROL_ID_BYTES = 16  # header bytes [NONCE_BYTES, NONCE_BYTES + 16): the pserver's control socket (0s: none)
CONTROL_PREFIX = b"\0flotilla-ctl-"  # an abstract Unix socket: nothing on disk, gone with its process
MAX_CONTROL_MESSAGE = 1 << 16  # a larger request (a ShmGet of very many names) takes gRPC
CONTROL_SEND, CONTROL_GET, CONTROL_PIPELINED, CONTROL_PREFETCH = b"S", b"G", b"P", b"L"
PIPELINE_MIN_BYTES = 16 << 20  # a send of this many bytes or more is written and copied out at once, by pieces
PIECE_BYTES = 4 << 20  # the trainer reports its progress every piece (the pserver copies it while it is in cache)
_PROGRESS = struct.Struct("<cQ")  # b"R" (written up to offset) or b"F" (all written, up to offset)
CONTROL_OK, CONTROL_ERROR = b"\0", b"\1"
MAX_SEGMENTS = 8  # per trainer incarnation and pserver: one send and a few get slots in flight
DEFAULT_MAX_BYTES = 4 << 30
SEQ_WINDOW = 1024
_MAC_FIELDS = struct.Struct("<6sqQIQQQ")


class ShmError(FlotillaError):
    """A data-plane reference or segment that is not valid."""

    code = "E736"

    def __init__(self, message: str, hint: str | None = None, status: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message, hint=hint)
        self.status = status


def host_id() -> str:
    """What identifies this host's shared memory: the kernel's boot id, the host name, the device and
    inode of ``/dev/shm`` (two containers of one kernel with separate ``/dev/shm`` differ), and the network
    namespace (the control socket, an abstract Unix socket, lives in one; ``runtime.shm_collective`` counts
    it too): processes in other namespaces are on another host, and take the TCP plane
    (``runtime.rpc.tcp_plane``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{boot}/{socket.gethostname()}/{st.st_dev}:{st.st_ino}/net:{net}"


def ref_mac(key: bytes, purpose: bytes, ref: pb.ShmRef) -> bytes:
    """HMAC-SHA256 of ``ref``'s fields (all but ``mac``) and ``purpose``, keyed by ``key``."""
    msg = _MAC_FIELDS.pack(purpose, ref.trainer_id, ref.incarnation, ref.segment, ref.offset, ref.length, ref.seq)
    return hmac.new(key, msg, hashlib.sha256).digest()


def signed_ref(key: bytes, purpose: bytes, **fields: Any) -> pb.ShmRef:
    """A ``ShmRef`` of ``fields`` with its MAC for ``purpose`` (``send``, ``slot`` or ``reply``)."""
    ref = pb.ShmRef(**fields)
    ref.mac = ref_mac(key, purpose, ref)
    return ref


def check_mac(key: bytes, purpose: bytes, ref: pb.ShmRef) -> None:
    """Raise ShmError unless ``ref`` carries the MAC of its fields for ``purpose`` (constant-time compare)."""
    if not hmac.compare_digest(ref.mac, ref_mac(key, purpose, ref)):
        raise ShmError(f"data-plane reference of trainer {ref.trainer_id} (segment {ref.segment}, offset {ref.offset}, "
                       f"length {ref.length}, seq {ref.seq}) does not carry a valid HMAC; nothing was read",
                       hint="every process of the job must run with the same FLOTILLA_JOB_TOKEN")


class Segment:
    """One mapped segment: ``array`` is a uint8 numpy view of the whole mapping."""

    def __init__(self, number: int, path: str, size: int, fd: int) -> None:
        self.number, self.path, self.size = number, path, size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            self._mmap = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, np.uint8)
        self.busy = False  # a send or get is using it now (trainer side)

    def check_range(self, ref: pb.ShmRef) -> None:
        """``ref``'s range lies in this segment's data area (raises ShmError naming the bounds)."""
        end = ref.offset + ref.length
        if ref.length == 0 or ref.offset < HEADER_BYTES or end > self.size:
            raise ShmError(f"data-plane reference of trainer {ref.trainer_id}: bytes [{ref.offset}, {end}) are not in "
                           f"the data area [{HEADER_BYTES}, {self.size}) of segment {self.number}; nothing was read",
                           hint="a reference names a non-empty range of a segment the pserver created for it")

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self.array)[offset:offset + length]

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap, unless a view is still alive (then the mapping goes with the last view)."""
        self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass


def create_segment(number: int, size: int, directory: str = SHM_DIR,
                   control_id: bytes = b"") -> tuple[Segment, bytes]:
    """A fresh segment of ``size`` bytes (mode 0600, random name) and the nonce written at its start, the
    pserver's control socket id (``control_id``, if any) after it."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    path = os.path.join(directory, f"flotilla-{os.getpid()}-{secrets.token_hex(12)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, size)
            # reserved now: a sparse file in a /dev/shm that fills up later would kill whoever first writes
            # an unbacked page (SIGBUS); this way a full /dev/shm is ENOSPC here, and the transfer takes gRPC
            os.posix_fallocate(fd, 0, size)
        except BaseException:
            os.close(fd)
            raise
        seg = Segment(number, path, size, fd)  # closes fd
    except BaseException:
        try:
            os.unlink(path)
        finally:
            raise
    seg.array[:NONCE_BYTES] = np.frombuffer(nonce, np.uint8)
    if control_id:
        seg.array[NONCE_BYTES:NONCE_BYTES + CONTROL_ID_BYTES] = np.frombuffer(control_id, np.uint8)
    return seg, nonce


def open_segment(reply: pb.ShmOpenReply) -> Segment:
    """Map the segment a pserver answered, after checking it is the pserver's file (regular, this user's,
    mode 0600, the announced size, the nonce at its start), and unlink its name."""
    path = reply.path
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith("flotilla-"):
        raise ShmError(f"the pserver answered segment path {path!r}, not a flotilla segment under {SHM_DIR}")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        problem = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"owned by uid {st.st_uid}, not {os.geteuid()}" if st.st_uid != os.geteuid() else
                   f"mode {stat.S_IMODE(st.st_mode):o}, not 600" if stat.S_IMODE(st.st_mode) != 0o600 else
                   f"{st.st_size} bytes, not the announced {reply.size}" if st.st_size != reply.size else "")
        if problem or reply.size <= HEADER_BYTES:
            raise ShmError(f"segment {path} is {problem or 'too small'}; not mapped",
                           hint="another process may have planted the file; nothing of it was used")
    except BaseException:
        os.close(fd)
        raise
    seg = Segment(reply.segment, path, reply.size, fd)
    if bytes(seg.array[:NONCE_BYTES]) != reply.nonce:
        seg.close()
        raise ShmError(f"segment {path} does not carry the nonce the pserver wrote; not used",
                       hint="the file was replaced after the pserver created it")
    seg.unlink()
    return seg


def round_size(nbytes: int) -> int:
    """A segment's size for a transfer of ``nbytes``: the header plus ``nbytes`` rounded up to an eighth of its
    power of two (at least 1 MiB), so transfers a few bytes apart share segments."""
    granule = max(1 << 17, 1 << max(0, nbytes.bit_length() - 3))
    return HEADER_BYTES + max(1 << 20, -(-nbytes // granule) * granule)


def write_batch(dst: memoryview, messages: list[tuple[list[Any], int]], defer: bool = False) -> int:
    """Write the VariableBatch of ``messages`` (``encode_parts`` results) into ``dst``; its length. Each
    tensor is copied once, into ``dst``. Raises ShmError if it does not fit (nothing else is changed). With
    ``defer`` the last part of each message (its tensor's bytes) is left to ``write_deferred``."""
    total = sum(len(_varint(BATCH_FIELD << 3 | 2)) + len(_varint(n)) + n for _, n in messages)
    if total > len(dst):
        raise ShmError(f"a batch of {total} bytes does not fit the {len(dst)} bytes of its data-plane slot",
                       hint="the trainer asks for a larger segment")
    writer = BatchWriter(dst)
    for parts, n in messages:
        writer.put_parts(parts, n, defer)
    return writer.pos


def deferred_parts(messages: list[tuple[list[Any], int]]) -> list[tuple[int, memoryview]]:
    """(position in the batch, bytes) of the part ``write_batch(..., defer=True)`` left out of each message."""
    out, pos = [], 0
    for parts, n in messages:
        pos += len(_varint(BATCH_FIELD << 3 | 2)) + len(_varint(n)) + n
        last = memoryview(parts[-1]).cast("B")
        out.append((pos - last.nbytes, last))
    return out


def write_deferred(dst: memoryview, deferred: list[tuple[int, memoryview]],
                   written: Callable[[int], None] | None = None) -> None:
    """Write the ``deferred_parts`` into ``dst`` in order, by pieces of ``PIECE_BYTES``, calling
    ``written(end)`` after each piece (every byte of the batch before ``end`` is then in place)."""
    for pos, part in deferred:
        for at in range(0, part.nbytes, PIECE_BYTES):
            end = min(at + PIECE_BYTES, part.nbytes)
            dst[pos + at:pos + end] = part[at:end]
            if written is not None:
                written(pos + end)


PAD_FIELD = pb.VariableMessage.DESCRIPTOR.fields_by_name["pad"].number
TENSOR_ALIGN = 64  # bytes: XLA's CPU client uses an argument in place only at this alignment
ALIGN_SLACK = TENSOR_ALIGN + 2  # the most a tensor's alignment adds to its message (the pad field)
_ALIGN_MIN_BYTES = 512  # smaller tensors are not worth the padding


class BatchWriter:
    """Appends VariableBatch entries to ``dst``; ``put`` matches ``PServer.get_many``'s ``encode``. With
    ``align`` (the pserver's answers, which the trainer reads in place), each tensor of 512 bytes or more
    starts ``TENSOR_ALIGN``-aligned in memory: a ``pad`` field of zeros (which every reader ignores) goes
    between the message's header and its raw fields, adding at most ``ALIGN_SLACK`` bytes."""

    def __init__(self, dst: memoryview, align: bool = False) -> None:
        self.dst, self.pos = dst, 0
        self._base = np.frombuffer(dst, np.uint8).ctypes.data if align and len(dst) else None

    def put_parts(self, parts: list[Any], n: int, defer_last: bool = False) -> None:
        if self._base is not None and memoryview(parts[-1]).nbytes >= _ALIGN_MIN_BYTES:
            parts, n = self._aligned(parts, n)
        prefix = _varint(BATCH_FIELD << 3 | 2) + _varint(n)
        if self.pos + len(prefix) + n > len(self.dst):
            raise ShmError(f"the reply does not fit its data-plane slot of {len(self.dst)} bytes",
                           hint="the trainer asks again with a larger slot", status="RESOURCE_EXHAUSTED")
        pos = self.pos
        pieces = (prefix, *parts[:-1]) if defer_last else (prefix, *parts)
        for piece in pieces:
            view = memoryview(piece).cast("B")
            self.dst[pos:pos + view.nbytes] = view
            pos += view.nbytes
        self.pos = self.pos + len(prefix) + n

    def _aligned(self, parts: list[Any], n: int) -> tuple[list[Any], int]:
        """``parts`` (header first, tensor bytes last) with a pad field after the header that puts the tensor
        on a ``TENSOR_ALIGN`` boundary when written at ``self.pos``; unchanged if no pad length does."""
        assert self._base is not None
        tensor = memoryview(parts[-1]).nbytes
        before_tensor = n - tensor  # the header and the raw fields' prefixes
        tag = _varint(PAD_FIELD << 3 | 2)
        pad = 0
        for _ in range(3):  # the entry's length prefix may grow by a byte with the pad: settle it
            entry = n + len(tag) + 1 + pad
            start = self._base + self.pos + len(_varint(BATCH_FIELD << 3 | 2)) + len(_varint(entry))
            want = -(start + len(tag) + 1 + before_tensor) % TENSOR_ALIGN
            if want == pad:
                return [parts[0], tag + _varint(pad) + bytes(pad), *parts[1:]], entry
            pad = want
        return parts, n


# bytes a piece: each is copied, then checked while it is still in the cache (source and copy, 2 MiB, fit
# an L2 of this size; 1 MiB pieces sent 64 MiB at 6.5-7.1 GB/s against 5.2-6.3 for 256 KiB pieces)
_CHECK_BYTES = 1 << 20


def copy_out(decoded: Decoded, buffers: ReceiveBuffers, ready: Callable[[int], None] | None = None) -> Decoded:
    """``decoded`` (read-only views of a segment) with its arrays copied into pooled buffers (read-only),
    every floating value checked finite on the way: one pass over the memory instead of a copy and a scan.
    ``finite`` of the result says whether all were; the copy is what the pserver validates and keeps (a
    selected-rows value's row ids are checked against its height again, on the copy). ``ready(address)``,
    if given, is called before the bytes below ``address`` are read (a pipelined send: they may still be
    being written)."""
    value = decoded.value
    if isinstance(value, SelectedRows):
        rows, _ = _copy_array(np.asarray(value.rows), buffers, ready)
        if rows.size and (rows.min() < 0 or rows.max() >= value.height):
            raise ShmError(f"selected rows {decoded.name!r}: the row ids changed while they were copied out of the "
                           "segment; refused", hint="a trainer writes a segment only before its call")
        values, finite = _copy_array(np.asarray(value.values), buffers, ready)
        return Decoded(decoded.header, SelectedRows(rows, values, value.height), finite)
    copied, finite = _copy_array(value, buffers, ready)
    return Decoded(decoded.header, copied, finite)


def _copy_array(src: np.ndarray, buffers: ReceiveBuffers,
                ready: Callable[[int], None] | None = None) -> tuple[np.ndarray, bool]:
    """A read-only copy of the C-contiguous ``src`` in a pooled buffer, and whether every value is finite
    (True for non-floating dtypes); ``ready`` as in ``copy_out``."""
    if src.size == 0:
        empty = src.copy()
        empty.flags.writeable = False
        return empty, True
    nbytes = src.nbytes
    buf = buffers.take(nbytes)
    flat = buf[:nbytes].view(src.dtype)
    out, into = memoryview(src.reshape(-1)).cast("B"), memoryview(buf)
    finite = True
    base = src.ctypes.data
    if src.dtype.kind != "f":
        if ready is not None:
            ready(base + nbytes)
        into[:nbytes] = out
    else:
        size = src.dtype.itemsize
        step = max(1, _CHECK_BYTES // size)
        flags = np.empty(min(flat.size, step), bool)
        for at in range(0, flat.size, step):
            end = min(at + step, flat.size)
            if ready is not None:
                ready(base + end * size)
            into[at * size:end * size] = out[at * size:end * size]
            if finite:
                chunk = flags[:end - at]
                np.isfinite(flat[at:end], out=chunk)
                finite = bool(chunk.all())
    copied = flat.reshape(src.shape)
    copied.flags.writeable = False
    return copied, finite


# --- the pserver's side ---------------------------------------------------------------------------------
@dataclass
class _TrainerSegments:
    incarnation: int
    key: bytes
    segments: list[Segment] = field(default_factory=list)
    top_seq: int = 0
    seen: set[int] = field(default_factory=set)  # accepted seqs in (top_seq - SEQ_WINDOW, top_seq]
    reply_seq: int = 0


class PServerPlane:
    """The segments a pserver created, per trainer; thread-safe. ``live(trainer_id)`` gives the trainer's
    live incarnation (None if not announced); ``token`` keys the MACs (None: a random key per trainer)."""

    def __init__(self, live: Callable[[int], int | None], token: str | None, *, endpoint: str = "",
                 enabled: bool = True, segments: bool = True, max_bytes: int = DEFAULT_MAX_BYTES,
                 directory: str = SHM_DIR) -> None:
        self._live = live
        self._token = token.encode("utf-8") if token else None
        self.endpoint, self.enabled, self.max_bytes, self.directory = endpoint, enabled, max_bytes, directory
        self.segments = segments  # False (FLAGS_rpc_data_plane=tcp): only the TCP plane is offered
        self._host = host_id()
        self._lock = threading.Lock()
        self._trainers: dict[int, _TrainerSegments] = {}
        self._closed = False
        self.control: ControlServer | None = None  # announced in every segment's header (start_server sets it)
        self.tcp: Any = None  # the runtime.rpc.tcp_plane.TcpPlaneServer answered to other hosts (start_server sets it)

    def open(self, req: pb.ShmOpenRequest) -> pb.ShmOpenReply:
        """Create one more segment for the trainer (see the module docstring), or say why not."""
        live = self._live(req.trainer_id)
        if live is None or live != req.incarnation:
            raise ShmError(f"ShmOpen of trainer {req.trainer_id} from incarnation {req.incarnation:#x}, which is not "
                           "its live incarnation (or it completed); nothing was created",
                           hint="a trainer announces itself before asking for segments",
                           status="FAILED_PRECONDITION")
        if not self.enabled:
            return pb.ShmOpenReply(reason="this pserver runs with FLAGS_rpc_data_plane=off")
        if not self.segments or not self._host or req.host != self._host:
            port = self.tcp.port if self.tcp is not None else 0
            why = ("this pserver runs with FLAGS_rpc_data_plane=tcp" if not self.segments else
                   "the trainer runs with FLAGS_rpc_data_plane=tcp" if not req.host else
                   "the trainer runs on another host")
            return pb.ShmOpenReply(reason=why + ("" if port else " and this pserver has no TCP data plane (no job "
                                                                 "token, or TLS)"), tcp_port=port)
        size = round_size(int(req.min_bytes))
        with self._lock:
            if self._closed:
                return pb.ShmOpenReply(reason="the pserver is stopping")
            mine = self._trainers.get(req.trainer_id)
            if mine is None or mine.incarnation != req.incarnation:
                self._drop_locked(req.trainer_id)
                mine = self._trainers[req.trainer_id] = _TrainerSegments(
                    req.incarnation, self._token or secrets.token_bytes(32))
            held = sum(s.size for s in mine.segments)
            if len(mine.segments) >= MAX_SEGMENTS or held + size > self.max_bytes:
                return pb.ShmOpenReply(reason=f"trainer {req.trainer_id} holds {len(mine.segments)} segments of "
                                              f"{held} bytes; a {size}-byte one is above the limit", later=True)
            try:
                free = os.statvfs(self.directory)
                if size > free.f_bavail * free.f_frsize // 2:
                    return pb.ShmOpenReply(reason=f"{self.directory} has too little room for {size} bytes",
                                           later=True)
                seg, nonce = create_segment(len(mine.segments), size, self.directory,
                                            self.control.id if self.control is not None else b"")
            except OSError as e:
                return pb.ShmOpenReply(reason=f"creating a segment failed: {e}", later=e.errno == errno.ENOSPC)
            mine.segments.append(seg)
        return pb.ShmOpenReply(path=seg.path, segment=seg.number, size=size, nonce=nonce,
                               key=b"" if self._token else mine.key)

    def resolve(self, ref: pb.ShmRef, purpose: bytes) -> tuple[Segment, memoryview]:
        """The segment and the bytes ``ref`` names, after every check of the module docstring; the seq is
        then used up. Raises ShmError (nothing read, nothing changed but nothing)."""
        with self._lock:
            mine = self._trainers.get(ref.trainer_id)
            key = mine.key if mine is not None else (self._token or b"")
            if mine is None:
                check_mac(key or secrets.token_bytes(32), purpose, ref)
                raise ShmError(f"data-plane reference of trainer {ref.trainer_id}, which holds no segment here",
                               hint="ask for a segment (ShmOpen) first", status="FAILED_PRECONDITION")
            check_mac(key, purpose, ref)
            live = self._live(ref.trainer_id)
            if ref.incarnation != mine.incarnation or live != ref.incarnation:
                raise ShmError(f"data-plane reference of trainer {ref.trainer_id} from incarnation "
                               f"{ref.incarnation:#x}, but its segments belong to another incarnation (or it "
                               "completed); nothing was read",
                               hint="a restarted trainer asks for new segments", status="FAILED_PRECONDITION")
            if ref.segment >= len(mine.segments):
                raise ShmError(f"data-plane reference of trainer {ref.trainer_id} names segment {ref.segment}; it "
                               f"holds {len(mine.segments)}", hint="name a segment ShmOpen answered")
            seg = mine.segments[ref.segment]
            seg.check_range(ref)
            if ref.seq == 0 or ref.seq <= mine.top_seq - SEQ_WINDOW or ref.seq in mine.seen:
                raise ShmError(f"data-plane reference of trainer {ref.trainer_id}: seq {ref.seq} was used already or "
                               f"is too old (highest {mine.top_seq}); a replayed reference is refused",
                               hint="each reference carries a fresh sequence number")
            mine.seen.add(ref.seq)
            if ref.seq > mine.top_seq:
                mine.top_seq = ref.seq
                if len(mine.seen) > 2 * SEQ_WINDOW:
                    mine.seen = {s for s in mine.seen if s > mine.top_seq - SEQ_WINDOW}
            return seg, seg.view(ref.offset, ref.length)

    def reply(self, slot: pb.ShmRef, length: int) -> pb.ShmRef:
        """The signed reference to the ``length`` bytes written at ``slot``'s start."""
        with self._lock:
            mine = self._trainers.get(slot.trainer_id)
            if mine is None or mine.incarnation != slot.incarnation:  # a restart or Complete while answering
                raise ShmError(f"trainer {slot.trainer_id}'s segments were dropped while its ShmGet was answered",
                               hint="a restarted trainer asks for new segments", status="FAILED_PRECONDITION")
            return signed_ref(mine.key, b"reply", trainer_id=slot.trainer_id, incarnation=slot.incarnation,
                              segment=slot.segment, offset=slot.offset, length=length, seq=slot.seq)

    def drop(self, trainer_id: int) -> None:
        """Forget (unlink, unmap) every segment of ``trainer_id``."""
        with self._lock:
            self._drop_locked(trainer_id)

    def _drop_locked(self, trainer_id: int) -> None:
        mine = self._trainers.pop(trainer_id, None)
        for seg in mine.segments if mine is not None else ():
            seg.unlink()
            seg.close()

    def sync_incarnation(self, trainer_id: int, incarnation: int | None) -> None:
        """The trainer's live incarnation is now ``incarnation`` (None: completed): drop stale segments."""
        with self._lock:
            mine = self._trainers.get(trainer_id)
            if mine is not None and mine.incarnation != incarnation:
                self._drop_locked(trainer_id)

    def segment_paths(self) -> list[str]:
        with self._lock:
            return [s.path for t in self._trainers.values() for s in t.segments]

    def close(self) -> None:
        """Drop every segment; later ShmOpens answer no path."""
        with self._lock:
            self._closed = True
            for t in list(self._trainers):
                self._drop_locked(t)


# --- the control socket ----------------------------------------------------------------------------------
def control_address(control_id: bytes) -> bytes:
    """The abstract Unix socket address of the control server with ``control_id``."""
    return CONTROL_PREFIX + control_id.hex().encode("ascii")


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of the Unix socket ``conn`` (SO_PEERCRED)."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


class Progress:
    """How far the trainer of a pipelined send (``CONTROL_PIPELINED``) has written its batch: its reports
    (``_PROGRESS``: ``R`` + offset after each piece, ``F`` + offset once all is written) arrive on the
    request's connection. ``wait(offset)`` blocks until the bytes of the segment before ``offset`` are
    written; ``drain`` reads the reports up to the final one, so the connection carries requests again."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.upto, self.final, self.broken = conn, 0, False, False

    def _next(self) -> None:
        try:
            msg = self.conn.recv(MAX_CONTROL_MESSAGE)
        except OSError:
            msg = b""
        if len(msg) != _PROGRESS.size or msg[:1] not in (b"R", b"F") or _PROGRESS.unpack(msg)[1] < self.upto:
            self.broken = True
            raise ShmError("the trainer's pipelined send broke off or reported garbage progress; nothing was kept")
        kind, self.upto = _PROGRESS.unpack(msg)
        self.final = kind == b"F"

    def wait(self, offset: int) -> None:
        while self.upto < offset:
            if self.final:
                raise ShmError(f"the trainer's pipelined send ended at byte {self.upto} of its segment, before byte "
                               f"{offset} the reference covers; nothing was kept")
            self._next()

    def drain(self) -> None:
        while not self.final and not self.broken:
            try:
                self._next()
            except ShmError:
                return


class ControlServer:
    """The pserver's same-host control socket: ShmSend, ShmGet and ShmPrefetch requests (the bytes gRPC would carry,
    after a one-byte method) answered by ``handle(method, request, progress)`` (``CONTROL_OK`` + the reply,
    or ``CONTROL_ERROR`` + ``STATUS\nmessage``), one thread per connected trainer; ``progress`` is a
    ``Progress`` for a pipelined send, else None. Only processes of this user get served (their uid,
    SO_PEERCRED, is checked at accept); every reference is checked exactly as over gRPC. ``close`` stops
    accepting and ends every connection."""

    def __init__(self, handle: Callable[[bytes, bytes, "Progress | None"], bytes]) -> None:
        self.id = secrets.token_bytes(CONTROL_ID_BYTES)
        self._handle = handle
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(control_address(self.id))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        self.calls = 0  # requests answered (a test checks transfers take this path)
        threading.Thread(target=self._accept, name="shm-control", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            if peer_uid(conn) != os.geteuid():
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="shm-control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                msg = conn.recv(MAX_CONTROL_MESSAGE)
                if not msg:
                    return
                progress = Progress(conn) if msg[:1] == CONTROL_PIPELINED else None
                answer = self._handle(msg[:1], msg[1:], progress)
                if progress is not None:
                    progress.drain()  # the reports the handler did not need (it refused the batch early)
                    if progress.broken:
                        return
                with self._lock:
                    self.calls += 1
                conn.send(answer)
        except OSError:  # the trainer went away, or close()
            return
        finally:
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            conn.close()

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


class ControlFailed(Exception):
    """The control socket broke before an answer came: the call is made over gRPC instead."""


# --- the trainer's side ---------------------------------------------------------------------------------
class TrainerPlane:
    """The segments one trainer holds with one pserver (``state``: None before the first ShmOpen, True
    while the data plane is up, False once the pserver said no or the plane is off). Thread-safe."""

    def __init__(self, trainer_id: int, incarnation: int, token: str | None) -> None:
        self.trainer_id, self.incarnation = trainer_id, incarnation
        self.key = token.encode("utf-8") if token else b""
        self.state: bool | None = None
        self.reason = ""
        self.segments: list[Segment] = []
        self.lock = threading.Lock()  # guards the fields above, `busy` and the connections below
        self._seq = 0
        self.control: bytes | None = None  # the pserver's control socket (from a segment's header); None: gRPC
        self._idle: list[socket.socket] = []  # connected, not in use

    def next_seq(self) -> int:
        with self.lock:
            self._seq += 1
            return self._seq

    def take(self, nbytes: int) -> Segment | None:
        """A free segment with room for ``nbytes`` (marked busy), the smallest that fits, or None."""
        need = HEADER_BYTES + nbytes
        with self.lock:
            best = -1
            for i in range(len(self.segments)):  # by index: an iterator would be one more reference
                seg = self.segments[i]
                if not seg.busy and seg.size >= need and _refs(seg.array) <= _FREE_REFS and (
                        best < 0 or seg.size < self.segments[best].size):
                    best = i
            if best < 0:
                return None
            seg = self.segments[best]
            seg.busy = True
            return seg

    def add(self, seg: Segment) -> None:
        with self.lock:
            seg.busy = True
            if not self.segments:  # the pserver's control socket, if it has one
                control_id = bytes(seg.array[NONCE_BYTES:NONCE_BYTES + CONTROL_ID_BYTES])
                self.control = control_address(control_id) if any(control_id) else None
            self.segments.append(seg)

    def call(self, method: bytes, request: bytes, timeout: float,
             pipelined: tuple[memoryview, list[tuple[int, memoryview]]] | None = None) -> tuple[str, bytes]:
        """``method`` (``CONTROL_SEND``/``CONTROL_GET``) through the pserver's control socket: ``("OK",
        reply)`` or ``(status name, message)``. Raises ControlFailed when there is no control socket or it
        broke before answering (from then on this pserver's calls take gRPC), TimeoutError after ``timeout``
        seconds (that connection is dropped: its answer may still come). ``pipelined``: (the segment from
        its start, the ``deferred_parts`` at their offsets in it): a ``CONTROL_PIPELINED`` send whose parts
        are written here, piece by piece, after the request left, each piece reported (``Progress``)."""
        with self.lock:
            address = self.control
            conn = self._idle.pop() if self._idle else None
        if address is None or len(request) >= MAX_CONTROL_MESSAGE:
            if conn is not None:
                conn.close()
            raise ControlFailed("no control socket")
        try:
            if conn is None:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
                conn.settimeout(timeout)
                conn.connect(address)
                if peer_uid(conn) != os.geteuid():
                    raise ConnectionRefusedError("the control socket belongs to another user")
            conn.settimeout(timeout)
            conn.send(method + request)
            if pipelined is not None:
                segment, deferred = pipelined
                write_deferred(segment, deferred, lambda end: conn.send(_PROGRESS.pack(b"R", end)))
                conn.send(_PROGRESS.pack(b"F", max((pos + part.nbytes for pos, part in deferred), default=0)))
            answer = conn.recv(MAX_CONTROL_MESSAGE)
            if not answer:
                raise ConnectionResetError("the pserver closed the control socket")
        except (socket.timeout, TimeoutError):
            conn.close()
            raise TimeoutError(f"no answer through the control socket in {timeout:.3g}s") from None
        except OSError as e:
            if conn is not None:
                conn.close()
            with self.lock:
                self.control = None
                idle, self._idle = self._idle, []
            for c in idle:
                c.close()
            raise ControlFailed(str(e)) from None
        with self.lock:
            if self.control is not None:
                self._idle.append(conn)
                conn = None
        if conn is not None:
            conn.close()
        if answer[:1] == CONTROL_OK:
            return "OK", answer[1:]
        status, _, message = answer[1:].decode("utf-8", "replace").partition("\n")
        return status, message.encode("utf-8")

    def give_back(self, seg: Segment) -> None:
        with self.lock:
            seg.busy = False

    def sign(self, purpose: bytes, seg: Segment, length: int, seq: int) -> pb.ShmRef:
        return signed_ref(self.key, purpose, trainer_id=self.trainer_id, incarnation=self.incarnation,
                          segment=seg.number, offset=HEADER_BYTES, length=length, seq=seq)

    def check_reply(self, ref: pb.ShmRef, slot: pb.ShmRef) -> None:
        """``ref`` is the pserver's signed answer to ``slot``: same segment and offset, within its room,
        same seq."""
        check_mac(self.key, b"reply", ref)
        same = (ref.trainer_id, ref.incarnation, ref.segment, ref.offset, ref.seq) == (
            slot.trainer_id, slot.incarnation, slot.segment, slot.offset, slot.seq)
        if not same or not 0 < ref.length <= slot.length:
            raise ShmError(f"the pserver's data-plane reply (segment {ref.segment}, offset {ref.offset}, length "
                           f"{ref.length}, seq {ref.seq}) does not answer the slot asked for (segment {slot.segment}, "
                           f"offset {slot.offset}, room {slot.length}, seq {slot.seq})")

    def close(self) -> None:
        with self.lock:
            segments, self.segments = self.segments, []
            idle, self._idle = self._idle, []
            self.state, self.control = False, None
        for conn in idle:
            conn.close()
        for seg in segments:
            seg.close()


def _refs(buf: np.ndarray) -> int:
    return sys.getrefcount(buf)


def _calibrate() -> int:
    """What ``_refs`` reports for an array held only by a Segment and the scanning loop's variable."""
    class Holder:
        array = None

    holder = Holder()
    holder.array = np.empty(1, np.uint8)
    holders = [holder]
    for i in range(len(holders)):
        seg = holders[i]
        if seg.array is not None:
            return _refs(seg.array)
    raise RuntimeError("unreachable")


_FREE_REFS = _calibrate()


def leftover_segments(directory: str = SHM_DIR, pid: int | None = None) -> list[str]:
    """Flotilla segment files under ``directory`` (of process ``pid`` when given): a test checks none is
    left after the pservers stop."""
    prefix = "flotilla-" if pid is None else f"flotilla-{pid}-"
    try:
        return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(prefix))
    except OSError as e:
        if e.errno == errno.ENOENT:
            return []
        raise
