"""Collectives: the trainer group (``jax.distributed``), the data-parallel mesh, and the moves between a
process's own values and the mesh's global arrays.

A collective job is one process a trainer; the group is formed once per process by ``join_group`` (the
``gen_nccl_id`` kernel calls it), after a rendezvous of our own on trainer 0's endpoint that is bounded
in time and names the trainers that did not come (``jax.distributed.initialize`` alone aborts the
process without saying who is missing). JAX then picks the transport: gloo on CPU, NCCL on GPU.

Data parallelism runs each compiled step under ``jax.shard_map`` over a 1-D mesh (axis ``dp``) of one
device a rank. Every value is a rank's own value ("per rank"):
- batch-major variables (declared dim 0 is -1: feeds, activations, their gradients) are split along
  dim 0 over the mesh (``P('dp')``): a process feeds its own batch, split over its local devices;
- every other variable (parameters, accumulators, the loss, gradients of parameters) is declared
  replicated (``P()``) and each device holds its own copy. Copies differ until a collective makes them
  equal (``c_broadcast`` at startup, ``c_allreduce_sum`` on gradients); ``shard_map`` runs with
  ``check_vma=False`` so JAX does not second-guess that.
Ranks must run the same program: the rendezvous compares each trainer's fingerprint of the program that
forms the group (the trainer startup program, whose ``gen_nccl_id`` joins it) with trainer 0's: every op's
type, arguments, attributes and argument shapes, rank-specific attributes left out (``RANK_ATTRS``: the
trainer id, endpoints, random seeds, which ``c_broadcast`` makes irrelevant). A difference (another learning
rate, another layer size) fails every rank with an error naming the ranks and the first differing op,
before any collective could hang or abort on mismatched shapes. Each later program's first collective run
is checked the same way (``check_program``), through the group's key-value store.

A process reads its own value of a global array with ``local_value`` (its first device's copy, or its
batch rows; fetches of other values concatenate its devices' copies along dim 0, as Fluid's
ParallelExecutor did).

Invariants: the group is joined at most once per process and never re-formed; no JAX computation may run
in the process before it is joined (JAX's rule; ``join_group`` says so when broken); every wait here is
bounded by ``FLAGS_collective_timeout_s`` (default 120 s, read when the group is joined).

CPU threads: several trainers of one host share its cores. When the group is joined (before JAX's CPU
client exists) each trainer's XLA thread pools are sized to its share of the CPUs it may run on, counting
the trainers whose endpoint has this trainer's host (``runtime.cpu_threads``: the rule and its flag),
through ``PJRT_NPROC``, which XLA reads when it makes the client.
"""
from __future__ import annotations

import atexit
import hmac
import json
import os
import socket
import struct
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from runtime import cpu_threads
from runtime.role import parse_endpoint
from runtime.scope import ExecutionError, SelectedRows

AXIS = "dp"
TIMEOUT_ENV = "FLAGS_collective_timeout_s"
HEARTBEAT_ENV = "FLAGS_collective_heartbeat_s"
TOKEN_ENV = "FLOTILLA_JOB_TOKEN"
GLOO_INTERFACE_ENV = "FLOTILLA_GLOO_INTERFACE"  # gloo's interface by name, instead of the trainer endpoint's address
_MAGIC = b"FLT2"  # rendezvous hello: magic, rank, token digest, program fingerprint (length-prefixed JSON)
_GO, _ABORT, _MISMATCH = b"G", b"A", b"M"
MAX_FINGERPRINT = 64 << 20  # bytes of a fingerprint a leader reads (a startup program is far smaller)
RANK_ATTRS = frozenset({"trainer_id", "endpoint", "other_endpoints", "trainer_endpoints", "current_endpoint",
                        "seed", "op_callstack", "op_role_var"})  # op_role_var names variables: see fingerprint


class CollectiveError(ExecutionError):
    """The trainer group could not be formed, or a collective step failed."""

    code = "E650"


@dataclass(frozen=True)
class Group:
    """This process's trainer group."""

    trainer_id: int
    endpoints: tuple[str, ...]

    @property
    def nranks(self) -> int:
        return len(self.endpoints)


_group: Group | None = None  # jax.distributed is process-global state; so is the group it forms
_arena: Any = None  # the group's shared-memory allreduce arena (runtime.shm_collective), when it has one
_failed = False  # a collective step of the group failed (describe_failure): the group is broken for good
EXIT_BROKEN_GROUP = 1


def current_group() -> Group | None:
    return _group


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise CollectiveError(f"{env}={raw!r} is not a number of seconds", hint=f"e.g. {env}={int(default)}") from None
    if not 0 < value < 1e6:
        raise CollectiveError(f"{env}={raw!r} is out of range; expected seconds > 0")
    return value


def join_group(trainer_id: int, endpoints: Sequence[str], program: Any = None) -> Group:
    """Form the trainer group (once per process): rendezvous on ``endpoints[0]`` (checking that every
    trainer runs the same ``program``, see the module docstring), then ``jax.distributed.initialize`` with
    trainer 0 as the coordinator, bound on that endpoint only.

    Joining again with the same arguments returns the group; with others it raises."""
    global _group
    eps = tuple(endpoints)
    if not 0 <= trainer_id < len(eps):
        raise CollectiveError(f"trainer_id {trainer_id} is out of range for {len(eps)} trainer endpoint(s)")
    if _group is not None:
        if _group.trainer_id == trainer_id and _group.endpoints == eps:
            return _group
        raise CollectiveError(f"this process already joined a group as trainer {_group.trainer_id} of "
                              f"{list(_group.endpoints)}; it cannot join {list(eps)} as trainer {trainer_id}",
                              hint="a process belongs to one collective group for its whole life")
    if len(eps) == 1:
        _group = Group(trainer_id, eps)
        return _group
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise CollectiveError("JAX already ran a computation in this process, so it can no longer join the "
                              f"group of {len(eps)} trainers",
                              hint="run the trainer startup program (its gen_nccl_id op) before anything else "
                                   "touches JAX, e.g. before building arrays with jax.numpy")
    timeout = _seconds(TIMEOUT_ENV, 120.0)
    heartbeat = _seconds(HEARTBEAT_ENV, 30.0)
    token = os.environ.get(TOKEN_ENV, "")
    _rendezvous(trainer_id, eps, timeout, token, fingerprint(program) if program is not None else [])
    kwargs: dict[str, Any] = {}
    gpus = os.environ.get("FLAGS_selected_gpus", "").strip()
    if gpus and _has_gpu_platform():
        kwargs["local_device_ids"] = [int(g) for g in gpus.split(",")]
    _limit_cpu_threads(trainer_id, eps)
    _bind_gloo(parse_endpoint(eps[trainer_id], "trainer endpoint")[0])
    started = time.monotonic()
    if trainer_id != 0:
        _await_coordinator(eps[0], started + timeout)
    jax.distributed.initialize(coordinator_address=eps[0], num_processes=len(eps), process_id=trainer_id,
                               coordinator_bind_address=eps[0] if trainer_id == 0 else None,
                               initialization_timeout=max(1, int(timeout - (time.monotonic() - started))),
                               heartbeat_timeout_seconds=max(1, int(heartbeat)), **kwargs)
    _group = Group(trainer_id, eps)
    atexit.register(_exit_if_broken)  # runs before JAX's own exit handler, registered when JAX was imported
    _set_up_arena(trainer_id, len(eps), timeout)
    return _group


def threads_per_trainer(trainer_id: int, endpoints: Sequence[str], cpus: int, environ: Any = None) -> int | None:
    """XLA CPU threads for trainer ``trainer_id`` of ``endpoints`` when it may run on ``cpus`` CPUs:
    ``runtime.cpu_threads.xla_threads`` over the trainers whose endpoint has this trainer's host."""
    host = parse_endpoint(endpoints[trainer_id], "trainer endpoint")[0]
    local = sum(parse_endpoint(ep, "trainer endpoint")[0] == host for ep in endpoints)
    return cpu_threads.xla_threads(local, cpus, environ)


def _limit_cpu_threads(trainer_id: int, endpoints: Sequence[str]) -> None:
    """Size this process's XLA CPU thread pools (``threads_per_trainer``) before JAX makes its CPU client,
    which reads ``PJRT_NPROC`` once, then: co-located trainers each sized to every CPU oversubscribe the
    cores, and their threads' handoffs cost CPU (the Transformer example, 2 trainers on 2 cores: ~15% less
    CPU per example with 1 thread each)."""
    if _has_gpu_platform():
        return
    count = threads_per_trainer(trainer_id, endpoints, cpu_threads.available_cpus())
    if count is not None:
        os.environ[cpu_threads.XLA_NPROC_ENVS[0]] = str(count)


def _set_up_arena(trainer_id: int, nranks: int, timeout: float) -> None:
    """The group's shared-memory allreduce (``runtime.shm_collective``), decided alike on every rank."""
    global _arena
    from jax._src import distributed

    from runtime import shm_collective, shm_ffi

    on_cpu = all(d.platform == "cpu" for d in jax.local_devices())
    _arena = shm_collective.setup(distributed.global_state.client, trainer_id, nranks, timeout, on_cpu)
    if _arena is not None:
        shm_ffi.install(_arena)


def shared_arena(dp: "DataParallel") -> Any:
    """The shared-memory arena a compiled run over ``dp`` sums through, or None (XLA's collectives): only
    over the group's process mesh (one device a trainer: one FFI call a process)."""
    group = _group
    if _arena is None or group is None or dp.nranks != group.nranks or len(dp.local_devices) != 1:
        return None
    return _arena


def _bind_gloo(host: str) -> None:
    """Make JAX's CPU client use gloo on this trainer's own address (``host``, from its endpoint), or on the
    interface ``FLOTILLA_GLOO_INTERFACE`` names. Left alone, gloo binds and advertises whatever this host's
    name resolves to (often 127.0.1.1 or another interface than the job's). Must run before JAX's backends
    exist: it replaces the CPU backend's factory, which JAX calls when the first computation needs it."""
    from jax._src import distributed, xla_bridge
    from jaxlib import _jax

    if jax.config.jax_cpu_collectives_implementation not in (None, "gloo"):
        return  # another transport (MPI) chooses its own interfaces
    interface = os.environ.get(GLOO_INTERFACE_ENV, "").strip() or None

    def make_cpu_client() -> Any:
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client,
                                                     hostname=None if interface else host.strip("[]"),
                                                     interface=interface)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


_checked: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # program -> version checked
_programs_checked = 0  # programs checked so far: every rank checks its programs in the same order


def check_program(program: Any) -> None:
    """Before ``program``'s first collective run (and after any change to it): every rank publishes its
    fingerprint in the group's key-value store and compares every rank's with trainer 0's; all ranks
    fail alike (CollectiveError naming the ranks and the first differing op) if any differs. A wait
    for a rank that does not publish is bounded by ``FLAGS_collective_timeout_s``."""
    global _programs_checked
    group = _group
    version = getattr(program, "version", 0)
    if group is None or group.nranks == 1 or _checked.get(program) == version:
        return
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    mine = fingerprint(program)
    text = json.dumps(mine)
    key = f"flotilla/program/{_programs_checked}"
    _programs_checked += 1
    compared = json.dumps([[entry[k] for k in _COMPARED] for entry in mine])
    digest = hmac.new(b"flotilla-program", compared.encode(), "sha256").hexdigest()
    client.key_value_set(f"{key}/digest/{group.trainer_id}", digest)
    client.key_value_set(f"{key}/fingerprint/{group.trainer_id}", text)
    timeout_ms = int(_seconds(TIMEOUT_ENV, 120.0) * 1000)
    digests = {}
    for rank in range(group.nranks):
        try:
            digests[rank] = client.blocking_key_value_get(f"{key}/digest/{rank}", timeout_ms)
        except Exception as e:  # noqa: BLE001 - the store says only that the wait failed
            raise CollectiveError(f"trainer {rank} did not reach the first collective run of this program within "
                                  f"{TIMEOUT_ENV}={timeout_ms / 1000:g} s ({str(e).splitlines()[0]})",
                                  hint="every trainer must run the same programs in the same order") from None
    differing = [r for r in range(1, group.nranks) if digests[r] != digests[0]]
    if differing:
        first = differing[0]
        lead = mine if group.trainer_id == 0 else json.loads(client.blocking_key_value_get(
            f"{key}/fingerprint/0", timeout_ms))
        theirs = mine if group.trainer_id == first else json.loads(client.blocking_key_value_get(
            f"{key}/fingerprint/{first}", timeout_ms))
        difference = _first_difference(lead, theirs, first) or "an op"
        # Every rank fails alike and the group is intact: JAX's shutdown barrier at exit passes, and the
        # coordinator (trainer 0) keeps the store up until every rank has read what it needs.
        raise CollectiveError(f"trainer(s) {differing} run a different program than trainer 0; trainer {first} "
                              f"first differs at {difference}", hint=_MISMATCH_HINT)
    _checked[program] = version


def _exit_if_broken() -> None:
    """At exit of a process whose group broke: end now, with status 1, instead of letting JAX shut the
    group down (its shutdown barrier cannot pass without the lost peer, and it aborts the process with a
    C++ stack trace below the Flotilla error already printed)."""
    if _failed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_BROKEN_GROUP)


def _has_gpu_platform() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return "cuda" in platforms or "gpu" in platforms or (not platforms and os.path.exists("/dev/nvidia0"))


def _digest(token: str) -> bytes:
    return hmac.new(token.encode(), b"flotilla-collective", "sha256").digest()


def fingerprint(program: Any) -> list[dict[str, Any]]:
    """What must be equal on every rank of ``program``: per op (in block order) its block, type, arguments,
    attributes (less ``RANK_ATTRS``) and the shape and dtype of each argument, as JSON-able values.
    Variables are compared by structure, numbered in order of first use (``args``), so a rank whose
    names are offset (it built another program first) still matches; ``names`` keeps them for messages."""
    out = []
    number: dict[str, str] = {}
    for block in program.blocks:
        for op in block.ops:
            shapes: dict[str, Any] = {}
            args: list[Any] = []
            real: list[Any] = []
            for slots in (op.inputs, op.outputs):
                for slot, names in sorted(slots.items()):
                    args.append([slot, [number.setdefault(n, f"v{len(number)}") for n in names]])
                    real.append([slot, list(names)])
                    for n in names:
                        var = block.find_var_recursive(n)
                        if var is not None:
                            shapes[number[n]] = [list(var.shape), str(var.dtype)]
            out.append({"block": block.idx, "type": op.type, "args": args, "shapes": shapes,
                        "attrs": {k: _plain(v) for k, v in sorted(op.attrs.items()) if k not in RANK_ATTRS},
                        "names": real})
    return out


_COMPARED = ("block", "type", "args", "shapes", "attrs")  # a fingerprint entry less its names


def _same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return all(a[k] == b[k] for k in _COMPARED)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    idx = getattr(value, "idx", None)  # a block reference
    return f"block {idx}" if isinstance(idx, int) else str(value)


def _describe_op(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "no op there"
    args = ", ".join(f"{slot}={names}" for slot, names in entry["names"])
    return f"{entry['type']}({args})"


def _first_difference(mine: list[dict[str, Any]], theirs: list[dict[str, Any]], rank: int) -> str | None:
    """Where trainer ``rank``'s program fingerprint first differs from trainer 0's, in words; None if equal."""
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else None
        b = theirs[i] if i < len(theirs) else None
        if _same(a, b):
            continue
        some = a if a is not None else b
        where = f"op {i} of block {some['block']} ({_describe_op(some)})"
        if a is None or b is None or a["type"] != b["type"] or a["block"] != b["block"]:
            return f"{where}: trainer 0 has {_describe_op(a)}, trainer {rank} {_describe_op(b)}"
        diffs = [f"arguments {_describe_op(a)} on trainer 0, {_describe_op(b)} on trainer {rank}"] \
            if a["args"] != b["args"] else []
        diffs += [f"attribute {k!r} is {a['attrs'].get(k)!r} on trainer 0, {b['attrs'].get(k)!r} on trainer {rank}"
                  for k in sorted(set(a["attrs"]) | set(b["attrs"])) if a["attrs"].get(k) != b["attrs"].get(k)]
        real = {c: n for (_, cs), (_, ns) in zip(a["args"], a["names"]) for c, n in zip(cs, ns)}
        diffs += [f"variable {real.get(c, c)!r} is {a['shapes'].get(c)} on trainer 0, {b['shapes'].get(c)} on "
                  f"trainer {rank}" for c in sorted(set(a["shapes"]) | set(b["shapes"]))
                  if a["shapes"].get(c) != b["shapes"].get(c)]
        return f"{where}: " + "; ".join(diffs[:4])
    return None


def _rendezvous(trainer_id: int, eps: tuple[str, ...], timeout: float, token: str,
                program: list[dict[str, Any]]) -> None:
    """Every trainer reports to trainer 0 on its endpoint with its program fingerprint; trainer 0 answers
    GO once all are in and run its program, MISMATCH naming the ranks and the first differing op, or
    ABORT naming the missing ones when ``timeout`` passes. The listener is closed before JAX binds the
    same endpoint for its coordinator."""
    host, port = parse_endpoint(eps[0], "trainer 0's endpoint")
    deadline = time.monotonic() + timeout
    digest = _digest(token)
    if trainer_id == 0:
        _lead(host, port, len(eps), deadline, digest, eps, program)
    else:
        _follow(host, port, trainer_id, deadline, digest, eps, json.dumps(program).encode())


def _await_coordinator(endpoint: str, deadline: float) -> None:
    """Return once trainer 0's endpoint accepts a connection (its JAX coordinator is up), or at ``deadline``.

    JAX's client, started before the coordinator listens, is refused and retries only after gRPC's 1 s
    reconnect backoff, and every trainer of the group waited that second. Returning at the deadline without
    a connection leaves the error to ``jax.distributed.initialize``, as before; a connection that reached the
    rendezvous listener in its last moments only brings back the old wait."""
    host, port = parse_endpoint(endpoint, "trainer 0's endpoint")
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError:
            time.sleep(0.02)


def _mismatch_message(differences: dict[int, str]) -> str:
    ranks = sorted(differences)
    first = ranks[0]
    return (f"trainer(s) {ranks} run a different program than trainer 0 (the program forming the group); "
            f"trainer {first} first differs at {differences[first]}")


def _lead(host: str, port: int, n: int, deadline: float, digest: bytes, eps: tuple[str, ...],
          program: list[dict[str, Any]]) -> None:
    peers: dict[int, socket.socket] = {}
    differences: dict[int, str] = {}
    try:
        with socket.create_server((host, port), reuse_port=False) as server:
            server.settimeout(0.2)
            while len(peers) < n - 1 and time.monotonic() < deadline:
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    msg = _recv_exact(conn, 4 + 4 + 32 + 4)
                    rank, size = struct.unpack("!I", msg[4:8])[0], struct.unpack("!I", msg[40:44])[0]
                    if msg[:4] != _MAGIC or not 0 < rank < n or rank in peers or size > MAX_FINGERPRINT \
                            or not hmac.compare_digest(msg[8:40], digest):
                        raise ConnectionError("not one of ours")
                    theirs = json.loads(_recv_exact(conn, size))
                except (OSError, ValueError):
                    conn.close()  # not one of ours (or a wrong job token): ignore it
                    continue
                peers[rank] = conn
                difference = _first_difference(program, theirs, rank)
                if difference is not None:
                    differences[rank] = difference
            missing = [r for r in range(1, n) if r not in peers]
            if missing:
                answer = _ABORT + struct.pack("!I", len(missing)) + b"".join(struct.pack("!I", r) for r in missing)
            elif differences:
                text = _mismatch_message(differences).encode()
                answer = _MISMATCH + struct.pack("!I", len(text)) + text
            else:
                answer = _GO + struct.pack("!I", 0)
            for conn in peers.values():
                try:
                    conn.sendall(answer)
                except OSError:
                    pass
            for conn in peers.values():  # let the followers close first (no TIME_WAIT on our port)
                try:
                    conn.settimeout(1.0)
                    conn.recv(1)
                except OSError:
                    pass
    except OSError as e:
        raise CollectiveError(f"trainer 0 cannot listen on its endpoint {eps[0]}: {e.strerror or e}",
                              hint="the endpoint must be this machine's address and a free port") from None
    finally:
        for conn in peers.values():
            conn.close()
    if missing:
        raise CollectiveError(f"trainer(s) {missing} ({', '.join(eps[r] for r in missing)}) did not join the group "
                              f"within {TIMEOUT_ENV}={_seconds(TIMEOUT_ENV, 120.0):g} s",
                              hint="start every trainer (flotilla launch --nproc_per_node N does), with the same "
                                   "PADDLE_TRAINER_ENDPOINTS and job token")
    if differences:
        raise CollectiveError(_mismatch_message(differences), hint=_MISMATCH_HINT)


_MISMATCH_HINT = ("every trainer must build the same program (same layers, sizes and optimizer settings) and "
                  "differ only in its trainer id; check the script's per-rank branches and arguments")


def _follow(host: str, port: int, trainer_id: int, deadline: float, digest: bytes, eps: tuple[str, ...],
            program: bytes) -> None:
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise CollectiveError(f"trainer 0 ({eps[0]}) did not come up within {TIMEOUT_ENV}="
                                      f"{_seconds(TIMEOUT_ENV, 120.0):g} s",
                                      hint="start trainer 0 (flotilla launch --nproc_per_node N does), and check "
                                           "PADDLE_TRAINER_ENDPOINTS") from None
            time.sleep(0.1)
    with conn:
        conn.settimeout(max(0.1, deadline - time.monotonic()) + 5.0)
        try:
            conn.sendall(_MAGIC + struct.pack("!I", trainer_id) + digest + struct.pack("!I", len(program)) + program)
            answer = _recv_exact(conn, 5)
            count = struct.unpack("!I", answer[1:5])[0]
            if answer[:1] == _MISMATCH:
                text = _recv_exact(conn, count).decode("utf-8", "replace")
                raise CollectiveError(text, hint=_MISMATCH_HINT)
            missing = list(struct.unpack(f"!{count}I", _recv_exact(conn, 4 * count))) if count else []
        except OSError as e:
            raise CollectiveError(f"the rendezvous with trainer 0 ({eps[0]}) broke off: {e}",
                                  hint="trainer 0 failed or refused this trainer (a different job token?)") from None
    if answer[:1] != _GO:
        raise CollectiveError(f"trainer(s) {missing} ({', '.join(eps[r] for r in missing)}) did not join the group",
                              hint="start every trainer with the same PADDLE_TRAINER_ENDPOINTS and job token")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


# --- the data-parallel mesh ------------------------------------------------------------------------


class DataParallel:
    """A 1-D mesh (axis ``dp``) of one device a rank, and the conversions to and from it."""

    def __init__(self, devices: Sequence[jax.Device]) -> None:
        self.devices = tuple(devices)
        self.mesh = Mesh(np.array(self.devices, dtype=object), (AXIS,))
        self.replicated = NamedSharding(self.mesh, P())
        self.batched = NamedSharding(self.mesh, P(AXIS))
        me = jax.process_index()
        self.local_devices = tuple(d for d in self.devices if d.process_index == me)
        self._zero: Any = None
        if not self.local_devices:
            raise CollectiveError("this process has no device in the data-parallel mesh")

    @property
    def nranks(self) -> int:
        return len(self.devices)

    def counter(self, value: int) -> Any:
        """``value`` as a replicated uint32 scalar of the mesh (0, the common case, is made once)."""
        if value == 0:
            if self._zero is None:
                self._zero = self.to_global(np.uint32(0), False)
            return self._zero
        return self.to_global(np.uint32(value), False)

    def spec(self, batch: bool) -> P:
        return P(AXIS) if batch else P()

    def to_global(self, value: Any, batch: bool) -> Any:
        """``value`` (this process's own) as a global array of the mesh; SelectedRows leaf by leaf."""
        if isinstance(value, SelectedRows):
            return SelectedRows(self.to_global(value.rows, False), self.to_global(value.values, False), value.height)
        sharding = self.batched if batch else self.replicated
        if isinstance(value, jax.Array) and value.sharding == sharding:
            return value
        if isinstance(value, jax.Array) and len(value.sharding.device_set) > 1:
            value = local_value(value, batch=batch)
        if not batch and len(self.local_devices) == 1 and isinstance(value, jax.Array):
            local = jax.device_put(value, self.local_devices[0])
            return jax.make_array_from_single_device_arrays(local.shape, sharding, [local])
        local = np.asarray(value)
        if len(self.local_devices) == 1:  # one device a process (nccl2): skip the general path's checks
            shard = jax.device_put(local, self.local_devices[0])
            shape = ((local.shape[0] * self.nranks,) + local.shape[1:]) if batch and local.ndim else local.shape
            return jax.make_array_from_single_device_arrays(shape, sharding, [shard])
        if batch and local.ndim and local.shape[0] % len(self.local_devices):
            raise ExecutionError(f"a batch of {local.shape[0]} rows does not split over this process's "
                                 f"{len(self.local_devices)} devices",
                                 hint=f"feed a multiple of {len(self.local_devices)} rows a step")
        return jax.make_array_from_process_local_data(sharding, local)


def local_value(value: Any, *, batch: bool = False, merge: bool = False) -> Any:
    """This process's own value of ``value``: its batch rows (``batch``), its devices' copies
    concatenated along dim 0 (``merge``, Fluid's ParallelExecutor fetch), or its first device's copy."""
    if isinstance(value, SelectedRows):
        return SelectedRows(local_value(value.rows), local_value(value.values), value.height)
    if not isinstance(value, jax.Array) or len(value.sharding.device_set) <= 1:
        return value
    shards = sorted(value.addressable_shards, key=lambda s: (s.index[0].start or 0) if s.index else 0)
    if batch and not value.sharding.is_fully_replicated:
        seen: dict[Any, Any] = {}
        for s in shards:
            seen.setdefault(s.index[0].start if s.index else 0, s.data)
        return jax.numpy.concatenate(list(seen.values())) if len(seen) > 1 else next(iter(seen.values()))
    if merge and len(shards) > 1:
        datas = [np.asarray(s.data) for s in sorted(value.addressable_shards, key=lambda s: s.device.id)]
        return np.concatenate([d.reshape((1,) if d.ndim == 0 else d.shape) for d in datas])
    return shards[0].data


_meshes: dict[tuple[jax.Device, ...], DataParallel] = {}  # one object a device set: compiled runs key on it


def _mesh_of(devices: Sequence[jax.Device]) -> DataParallel:
    key = tuple(devices)
    mesh = _meshes.get(key)
    if mesh is None:
        mesh = _meshes[key] = DataParallel(key)
    return mesh


def process_mesh() -> DataParallel:
    """One device a trainer process (its first local device), in rank order."""
    by_process: dict[int, jax.Device] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, d)
    return _mesh_of([by_process[p] for p in sorted(by_process)])


def device_mesh() -> DataParallel:
    """Every device of every trainer process (Fluid's ParallelExecutor over all local devices)."""
    return _mesh_of(jax.devices())


def describe_failure(error: BaseException) -> CollectiveError:
    """A collective step failed (a peer died or hung up): say which trainers are gone, when the group's
    key-value store can tell within a couple of seconds (the survivors report in; the rest are gone). The
    group is broken from then on: the process exits with status 1 without shutting it down."""
    global _failed
    _failed = True
    arena_failure = _arena.failure if _arena is not None else None
    if arena_failure is not None and not _arena.gone:
        return CollectiveError(f"a collective step failed: {arena_failure}",
                               hint="see every trainer's log; the job cannot continue")
    missing = _arena.gone if arena_failure is not None else _missing_ranks()
    lost = f" ({', '.join(_group.endpoints[r] for r in missing)})" if missing and _group is not None else ""
    who = f"trainer(s) {missing}{lost} left the group" if missing else "a peer trainer left the group"
    size = f" of {_group.nranks} trainers" if _group is not None else ""
    detail = "its process is gone; seen by the shared-memory allreduce" if arena_failure else str(error).splitlines()[0]
    return CollectiveError(f"a collective step{size} failed: {who} ({detail})",
                           hint="see the failed trainer's log; the job cannot continue without it")


def _missing_ranks(wait_s: float = 2.0) -> list[int]:
    group = _group
    if group is None or group.nranks == 1:
        return []
    try:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            return []
        key = "flotilla/alive"  # a failed group is never used again: one key serves
        client.key_value_set(f"{key}/{group.trainer_id}", "1", allow_overwrite=True)
        time.sleep(wait_s)
        alive = {int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(key)}
    except Exception:  # noqa: BLE001 - best effort: the store may be gone with the failed peer
        return []
    return [r for r in range(group.nranks) if r not in alive]


__all__ = ["AXIS", "CollectiveError", "DataParallel", "Group", "check_program", "current_group",
           "describe_failure", "device_mesh", "join_group", "local_value", "process_mesh", "shared_arena",
           "threads_per_trainer"]
