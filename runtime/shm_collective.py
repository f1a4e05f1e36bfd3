"""Allreduce through shared memory, for a trainer group whose processes all run on one host (CPU).

XLA's CPU collectives (gloo over TCP) move 0.5-0.9 GB/s of bus bandwidth between two processes of this
machine, where a memory copy runs at ~20 GB/s. When every trainer of the group shares this host (same
kernel boot, network and PID namespaces, ``/dev/shm``), the group maps one arena of shared memory and a
dense ``c_allreduce_sum`` becomes a call, inside the compiled step, of an XLA FFI target
(``runtime.shm_ffi``) that sums through it:

1. each rank copies its chunk of the buffer into its own slot of the arena and arrives at a barrier;
2. each rank sums its 1/n share of the chunk over the n slots into the arena's result region (the
   reduction work is split, as in a reduce-scatter) and arrives at a second barrier;
3. each rank copies the summed chunk back into the step's buffer, in place (``runtime.shm_ffi``: the
   compiled step calls this through an XLA FFI target whose result aliases its operand).
A buffer larger than the arena's chunk goes through in chunks. Rounds alternate between two halves of
the arena, so a rank may write round r+2 only after every rank arrived at round r+1, i.e. after every
rank finished reading round r: no barrier is needed at the end of a round.

Invariants:
- Every rank runs the same sequence of allreduce calls (the compiled steps are the same program, which
  ``runtime.collective`` checks by fingerprint); within a step the calls are chained by a token operand,
  so XLA runs them in trace order on every rank. Each call's sequence number, size and dtype are
  compared at the first barrier; a mismatch fails every rank alike instead of summing unrelated data.
- Barrier counters are int64 stores to their own cache lines, written after the data they publish; the
  arena is used only on x86-64, whose stores are not reordered with one another (other machines keep
  XLA's collectives).
- Every wait is bounded by ``FLAGS_collective_timeout_s``; a peer whose process is gone is noticed within
  ~0.1 s and named. A failed call leaves the arena unusable (the group is broken, as after any failed
  collective step).
- The arena's file is created 0600 by trainer 0 under ``/dev/shm`` with a random name and unlinked as
  soon as every rank has mapped it: nothing outlives the job, even a killed one. Its size is reserved
  with ``posix_fallocate`` (the chunk halves until it fits, down to 1 MiB), so a small ``/dev/shm`` (a
  container's 64 MiB) means smaller chunks or XLA's collectives, never a SIGBUS.
- Whether the group uses the arena is decided once, when it is formed, from what every rank published in
  the group's key-value store, so all ranks decide alike. ``FLAGS_cpu_allreduce``: ``auto`` (default:
  the arena when possible), ``shm`` (the arena or an error saying why not), ``xla`` (XLA's collectives).
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import secrets
import time
from typing import Any

import numpy as np

from runtime.scope import ExecutionError

FLAG = "FLAGS_cpu_allreduce"
CHOICES = ("auto", "shm", "xla")
SHM_DIR = "/dev/shm"
PREFIX = "flotilla-allreduce-"  # the arena files' names in SHM_DIR
MAX_CHUNK = 16 << 20  # bytes of one rank's slot; larger buffers go through in chunks
MIN_CHUNK = 1 << 20
_MAGIC = 0x464C5453484D3031  # "FLTSHM01"
_LINE = 8  # int64 words a cache line (64 bytes): one line a rank, one for the header
_HEADER_WORDS = _LINE  # magic, nranks, chunk bytes
# A rank's line: the barrier phase it reached, its pid, and the call it is in (sequence, bytes, dtype).
_PHASE, _PID, _SEQ, _NBYTES, _DTYPE = range(5)
_MAPPED = "mapped"  # a rank's answer in the key-value store when it mapped the arena (else why not)
_SPINS = 200  # polls before yielding the CPU
_LIVENESS_S = 0.1  # seconds of waiting between two checks that the awaited peers still exist


class ShmAllreduceError(ExecutionError):
    """The shared-memory allreduce could not be set up, or a call of it failed (``gone``: the trainers
    whose processes no longer exist, when that is why)."""

    code = "E652"

    def __init__(self, message: str, *, hint: str | None = None, gone: list[int] | None = None) -> None:
        super().__init__(message, hint=hint)
        self.gone = list(gone or [])


def choice(environ: Any = None) -> str:
    raw = (environ if environ is not None else os.environ).get(FLAG, "auto").strip().lower() or "auto"
    if raw not in CHOICES:
        raise ShmAllreduceError(f"{FLAG}={raw!r} is not one of {', '.join(CHOICES)}",
                                hint=f"{FLAG}=auto uses shared memory when every trainer runs on this host")
    return raw


def host_identity() -> dict[str, Any]:
    """What two processes share when they can share memory and are meant to (one host, one network
    namespace: namespaced "hosts" of one machine keep their own collectives, as real hosts would)."""
    def ino(path: str) -> list[int]:
        try:
            st = os.stat(path)
            return [st.st_dev, st.st_ino]
        except OSError:
            return []

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return {"boot": boot, "netns": ino("/proc/self/ns/net"), "pidns": ino("/proc/self/ns/pid"), "shm": ino(SHM_DIR),
            "uid": os.getuid(),
            "machine": platform.machine()}


def unusable_reason(identities: list[dict[str, Any]]) -> str | None:
    """Why the group of these ranks' ``host_identity()`` cannot use an arena; None if it can."""
    first = identities[0]
    if first["machine"] not in ("x86_64", "AMD64"):
        return f"this machine is {first['machine']}, not x86-64"
    if not first["boot"] or not first["shm"]:
        return f"{SHM_DIR} or the kernel's boot id is not available"
    for rank, other in enumerate(identities[1:], 1):
        if other != first:
            what = [k for k in first if other.get(k) != first[k]]
            return f"trainer {rank} runs on another host than trainer 0 (its {', '.join(what)} differ)"
    return None


class Arena:
    """One process's mapping of the group's shared arena, and the allreduce through it."""

    def __init__(self, fd: int, rank: int, nranks: int, timeout_s: float) -> None:
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size)
        words = np.frombuffer(self._map, np.int64, count=(nranks + 1) * _LINE)
        if words[0] != _MAGIC or words[1] != nranks:
            raise ShmAllreduceError("the shared-memory arena's header does not match this group",
                                    hint=f"set {FLAG}=xla and report this")
        self.rank, self.nranks, self.chunk = rank, nranks, int(words[2])
        self.timeout_s = timeout_s
        self._lines = words[_LINE:].reshape(nranks, _LINE)
        self._words = self._lines.ctypes.data  # address of trainer 0's line (its phase word first)
        self._mine = self._lines[rank]
        self._bytes = np.frombuffer(self._map, np.uint8)
        self._data = (nranks + 1) * _LINE * 8
        self._phase = 0
        self._round = 0
        self._seq = 0
        self._pids: dict[int, int] = {}
        self.failure: str | None = None  # why a call failed: the arena is unusable from then on
        self.gone: list[int] = []  # the trainers whose processes were gone when it failed
        self._mine[_PID] = os.getpid()

    @staticmethod
    def size_for(nranks: int, chunk: int) -> int:
        return (nranks + 1) * _LINE * 8 + 2 * (nranks + 1) * chunk

    def _region(self, half: int, index: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Slot ``index`` (a rank's, or ``nranks``: the result) of half ``half``, as ``count`` values."""
        start = self._data + (half * (self.nranks + 1) + index) * self.chunk
        return self._bytes[start:start + count * dtype.itemsize].view(dtype)

    def allreduce(self, x: np.ndarray) -> np.ndarray:
        """The sum of ``x`` over the group's ranks, as a new array (every rank calls with the same shape
        and dtype)."""
        out = np.array(x, copy=True, order="C")
        self.allreduce_into(out)
        return out

    def allreduce_into(self, buf: np.ndarray) -> None:
        """Replace ``buf`` (C-contiguous) by its sum over the group's ranks: its chunks go through the arena
        one round each, the sum copied back into it (the compiled step's own buffer, ``runtime.shm_ffi``)."""
        if self.failure is not None:
            raise ShmAllreduceError(f"the group's shared-memory allreduce failed earlier: {self.failure}")
        flat = buf.reshape(-1)
        self._seq += 1
        per_chunk = max(1, self.chunk // max(1, buf.dtype.itemsize))
        try:
            for start in range(0, flat.size, per_chunk):
                part = flat[start:start + per_chunk]
                np.copyto(part, self._round_trip(part, buf.nbytes, buf.dtype.num, first=start == 0))
        except ShmAllreduceError as e:
            self.failure, self.gone = e.message, e.gone
            raise

    def _round_trip(self, part: np.ndarray, nbytes: int, dtype_num: int, first: bool) -> np.ndarray:
        half = self._round % 2
        self._round += 1
        n = part.size
        np.copyto(self._region(half, self.rank, part.dtype, n), part)
        if first:
            self._mine[_SEQ], self._mine[_NBYTES], self._mine[_DTYPE] = self._seq, nbytes, dtype_num
        self._arrive()
        if first:
            self._check_same_call()
        lo, hi = self.rank * n // self.nranks, (self.rank + 1) * n // self.nranks
        result = self._region(half, self.nranks, part.dtype, n)
        if hi > lo:
            share = result[lo:hi]
            if self.nranks == 1:
                np.copyto(share, self._region(half, 0, part.dtype, n)[lo:hi])
            else:
                np.add(self._region(half, 0, part.dtype, n)[lo:hi], self._region(half, 1, part.dtype, n)[lo:hi],
                       out=share)
            for r in range(2, self.nranks):
                np.add(share, self._region(half, r, part.dtype, n)[lo:hi], out=share)
        self._arrive()
        return result

    def _check_same_call(self) -> None:
        mine = [int(v) for v in self._mine[_SEQ:_DTYPE + 1]]
        for r in range(self.nranks):
            theirs = [int(v) for v in self._lines[r, _SEQ:_DTYPE + 1]]
            if theirs != mine:
                raise ShmAllreduceError(f"trainer {r} is at allreduce call {theirs[0]} of {theirs[1]} bytes "
                                        f"(dtype {theirs[2]}) where trainer {self.rank} is at call {mine[0]} of "
                                        f"{mine[1]} bytes (dtype {mine[2]})",
                                        hint="every trainer must run the same programs in the same order")

    def _arrive(self) -> None:
        """Publish this rank's next phase and wait until every rank reached it (bounded; names the
        trainers that did not come, or whose process is gone). A waiter polls briefly, then sleeps on the
        peer's phase word (a futex: the peer's arrival wakes it), so oversubscribed cores are not spent
        spinning."""
        self._phase += 1
        phase = self._phase
        self._mine[_PHASE] = phase
        _futex.wake(self._words + self.rank * _LINE * 8)
        lines = self._lines
        start = 0.0
        for r in range(self.nranks):
            spins = 0
            while lines[r, _PHASE] < phase:
                spins += 1
                if spins < _SPINS:
                    continue
                seen = int(lines[r, _PHASE])
                if seen >= phase:
                    break
                _futex.wait(self._words + r * _LINE * 8, seen, _LIVENESS_S)
                now = time.monotonic()
                if not start:
                    start = now
                elif now - start > _LIVENESS_S:
                    self._check_alive(phase, now - start)

    def _check_alive(self, phase: int, waited: float) -> None:
        late = [r for r in range(self.nranks) if self._lines[r, _PHASE] < phase]
        gone = [r for r in late if not _alive(int(self._lines[r, _PID]))]
        if gone:
            raise ShmAllreduceError(f"trainer(s) {gone} left the group (process gone) during a shared-memory "
                                    "allreduce", hint="see the failed trainer's log", gone=gone)
        if waited > self.timeout_s:
            raise ShmAllreduceError(f"trainer(s) {late} did not reach the shared-memory allreduce within "
                                    f"FLAGS_collective_timeout_s={self.timeout_s:g} s",
                                    hint="a trainer hangs or runs other programs than the rest")

    def close(self) -> None:
        self._lines = self._mine = self._bytes = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view of it; the mapping goes with the process
            pass


class _Futex:
    """Linux futexes on 32-bit words of the shared mapping (the low half of a little-endian int64 phase):
    ``wait`` sleeps while the word still holds the value seen, up to a timeout; ``wake`` wakes every
    sleeper on it. Where the system call is unavailable, ``wait`` yields the CPU instead."""

    SYS_FUTEX = 202  # x86-64
    FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the word is in memory of several processes

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def __init__(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._syscall = libc.syscall
            self._syscall.restype = ctypes.c_long
        except (OSError, AttributeError):
            self._syscall = None

    def wait(self, address: int, seen: int, timeout_s: float) -> None:
        if self._syscall is None:
            os.sched_yield()
            return
        ts = self._Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        self._syscall(ctypes.c_long(self.SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(self.FUTEX_WAIT),
                      ctypes.c_uint32(seen & 0xFFFFFFFF), ctypes.byref(ts), None, ctypes.c_int(0))

    def wake(self, address: int) -> None:
        if self._syscall is not None:
            self._syscall(ctypes.c_long(self.SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(self.FUTEX_WAKE),
                          ctypes.c_int(1 << 30), None, None, ctypes.c_int(0))


_futex = _Futex()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped by its parent, does not)."""
    if pid <= 0:
        return True  # not published yet
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def create(nranks: int, chunk: int = MAX_CHUNK) -> tuple[int, str]:
    """Trainer 0: the arena's file for ``nranks``, reserved in full (``chunk`` bytes a slot, halved until
    the reservation fits); its descriptor and path. The caller unlinks it once every rank mapped it."""
    path = os.path.join(SHM_DIR, f"{PREFIX}{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            try:
                os.posix_fallocate(fd, 0, Arena.size_for(nranks, chunk))
                break
            except OSError:
                if chunk <= MIN_CHUNK:
                    raise
                chunk //= 2
        os.ftruncate(fd, Arena.size_for(nranks, chunk))
        header = np.array([_MAGIC, nranks, chunk] + [0] * (_LINE - 3), np.int64).tobytes()
        os.pwrite(fd, header, 0)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return fd, path


def setup(client: Any, rank: int, nranks: int, timeout_s: float, on_cpu: bool) -> Arena | None:
    """Decide, alike on every rank, whether the group allreduces through a shared arena, and map it.

    ``client`` is the group's key-value store (``jax.distributed``'s client). Returns None where the
    group keeps XLA's collectives (``FLAGS_cpu_allreduce=xla``, not every rank on this host, not a CPU
    platform, or the arena could not be made); raises where ``shm`` was asked for and cannot be had."""
    wanted = choice()
    timeout_ms = int(timeout_s * 1000)
    key = "flotilla/shm_allreduce"
    mine = {"want": wanted, "cpu": on_cpu, "host": host_identity()}
    client.key_value_set(f"{key}/identity/{rank}", json.dumps(mine))
    everyone = [json.loads(client.blocking_key_value_get(f"{key}/identity/{r}", timeout_ms)) for r in range(nranks)]
    wants = {e["want"] for e in everyone}
    if len(wants) > 1:
        raise ShmAllreduceError(f"trainers set {FLAG} differently ({sorted(wants)})",
                                hint=f"set the same {FLAG} for every trainer")
    reason = "it was asked to (xla)" if wanted == "xla" else \
        "not every trainer runs on CPU" if not all(e["cpu"] for e in everyone) else \
        unusable_reason([e["host"] for e in everyone])
    arena: Arena | None = None
    if reason is None:
        arena, reason = _map_arena(client, key, rank, nranks, timeout_s, timeout_ms)
    if reason is not None and wanted == "shm":
        raise ShmAllreduceError(f"{FLAG}=shm, but the group cannot allreduce through shared memory: {reason}",
                                hint=f"unset {FLAG} (auto) to fall back to XLA's collectives")
    return arena


def _map_arena(client: Any, key: str, rank: int, nranks: int, timeout_s: float,
               timeout_ms: int) -> tuple[Arena | None, str | None]:
    fd, path, problem = -1, "", ""
    if rank == 0:
        try:
            fd, path = create(nranks)
        except OSError as e:
            problem = f"cannot reserve an arena in {SHM_DIR}: {e.strerror or e}"
        client.key_value_set(f"{key}/arena", json.dumps({"path": path, "error": problem}))
    else:
        published = json.loads(client.blocking_key_value_get(f"{key}/arena", timeout_ms))
        path, problem = published["path"], published["error"]
        if not problem:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as e:
                problem = f"trainer {rank} cannot open the arena: {e.strerror or e}"
    arena = None
    if fd >= 0:
        try:
            arena = Arena(fd, rank, nranks, timeout_s)
        except (OSError, ValueError, ShmAllreduceError) as e:
            problem = f"trainer {rank} cannot map the arena: {e}"
        finally:
            os.close(fd)
    client.key_value_set(f"{key}/mapped/{rank}", problem or _MAPPED)
    problems = [client.blocking_key_value_get(f"{key}/mapped/{r}", timeout_ms) for r in range(nranks)]
    if rank == 0 and path:
        try:
            os.unlink(path)  # every rank has mapped it (or given up): nothing outlives the job
        except OSError:
            pass
    problem = next((p for p in problems if p != _MAPPED), "")
    if problem:
        if arena is not None:
            arena.close()
        return None, problem
    return arena, None


__all__ = ["Arena", "CHOICES", "FLAG", "PREFIX", "create", "ShmAllreduceError", "choice", "host_identity", "setup", "unusable_reason"]
