"""The parameter server's state machine, free of gRPC: what a ``listen_and_serv`` op serves.

``PServer`` holds the pserver program, its scope (parameter slices, accumulators, table shards) and an
Executor that runs the program's optimize blocks. The gRPC servicer (``runtime.rpc.server``) is a thin
layer that decodes requests, calls one method here and maps ``PServerError.status`` to a gRPC status
code; tests drive this class directly.

Protocol (sync mode, one step ``s``; every trainer is identified by its id):
1. each live trainer sends its gradients of ``s`` (stored, not applied), then a SEND barrier for ``s``;
   the SEND barrier of ``s`` waits until every live trainer's FETCH barrier of ``s - 1`` is in;
2. when every live trainer's SEND barrier of ``s`` is in, the optimize blocks run once, in
   ``optimize_blocks`` order (the learning-rate block first) as ONE compiled call (see One call), and
   every SEND barrier call returns;
3. trainers fetch parameters (``get``, answered at once: nothing changes them until step ``s + 1``'s
   barrier), then send a FETCH barrier; when every live trainer's is in, the step becomes ``s + 1``.
A FETCH barrier for a step whose SEND barrier the trainer did not send (the trainer startup program's)
changes nothing. A trainer's SEND barrier of ``s + 1`` (and its ``complete``) counts as its FETCH
barrier of ``s`` when that is not in yet: a trainer sends it only after its fetches of ``s`` were
answered, so RPCClient sends no FETCH barrier of its own (one gRPC call a step, not two, each costing
the job ~0.7 ms of CPU); an explicit one, as Fluid's clients send, is counted as before. So a trainer
that dies between its fetches and its next SEND barrier leaves the pserver at step ``s`` (optimized):
restarted, it joins at ``s + 1`` and loses no batch. ``complete(t)`` removes ``t`` from the live trainers (what it sent and had acknowledged
is still applied; copies it does not send again are zeroed at the next optimize, see Averaging) and may
thereby finish a barrier; once every trainer has completed, ``wait`` returns.

Trainer incarnations: before its first request a trainer's client announces itself (``announce``: trainer
id plus a random non-zero incarnation id). Sends, barriers, ``complete`` and ``checkpoint`` are accepted
only from the live incarnation of an announced id (FAILED_PRECONDITION otherwise, nothing changed): a
forged request that does not know the incarnation can neither finish nor corrupt the job. Sequence
numbers are per (incarnation, variable) and advance by one: a repeated or older seq is a retry
(acknowledged, dropped); a jump is FAILED_PRECONDITION. A restarted trainer (same id, new incarnation)
either rejoins (``allow_rejoin``, the default) or is refused with FAILED_PRECONDITION; it is refused too
when the pserver is not ``authenticated`` (no job token, no mutual TLS): anyone reaching the port could
claim a live trainer's id and then complete it. A rejoining
trainer is admitted at the next step boundary: the step in progress completes without it (whatever its
dead incarnation sent, every send that was acknowledged, is applied; if it had already sent gradients for
the next step, it joins one step later so those are applied too), ``announce`` returns once the pserver
has reached that step, with the trainer's sequence numbers reset; the rejoin is logged. In async mode a
new incarnation replaces the old one at once.

Averaging (sync mode): the program sums the trainers' gradient copies and scales by 1/trainers. A step
averages over the trainers that sent that gradient in that step: copies not sent this step are zeroed
(nothing stale is applied twice) and, when fewer than ``trainers`` sent, the sent copies are scaled by
``trainers / senders`` before the optimize blocks run. So after a trainer completes (uneven data) a step
is the mean over the batches actually present, exactly as single-process training on those batches.

One call: the optimize blocks a sync step or an async request needs run as one compiled call
(``run_blocks``, normally ``Executor.run_blocks``) when they are independent
(``runtime.block_sets.block_dependency``: only the learning-rate block's results, computed first, are
read by the others), else block by block; a pserver merges at most ``_MAX_MERGED_SETS`` distinct sets
(each is a plan and a compile). Without ``run_blocks`` every block runs on its own.

Non-finite gradients: with ``check_finite`` (the default) a floating gradient holding NaN or Inf is
refused (INVALID_ARGUMENT naming the variable, the trainer and the step), nothing is stored or applied,
and ``health()["rejected_nonfinite"]`` counts it. Finite gradients can still overflow once summed or
applied (two 3e38 sum to Inf), so the updated values are checked too, before they replace the old ones:
the blocks' call donates no buffer of a checked variable (without ``run_blocks``: they run on copies of
what they overwrite) and checks the new values in that same call (one fused check); the results are
committed only if every floating one is finite (one commit). A sync step that fails it fails the pserver
(every trainer is told the step and the variable; the parameters stay as before the step); an async
REQUEST that fails it is refused as a whole (INVALID_ARGUMENT naming the variable; none of its gradients
is applied, the learning-rate step it triggered included) and the pserver goes on. Tables updated by
selected rows (and their accumulators) are left out: copying and scanning a whole table per update of a
few rows would cost more than the update; they are updated in place, so a refused update still leaves
its rows of a table applied.

Checkpoints: ``checkpoint(name)`` saves under ``name/pserver_<id>``. An absolute ``name`` is taken as it
is, as Fluid did: a request that reached the pserver is authenticated (job token or mutual TLS) and so
comes from the job, or the pserver authenticates nobody, which it says once at start (loopback, or the
explicit opt-out). A relative ``name`` resolves under ``checkpoint_root`` (the pserver's own
configuration, ``FLOTILLA_CHECKPOINT_ROOT``) and must stay under it (no ``..``, no symlink leading out);
without a root a relative name is refused.

Async mode: the gradients of a request (of one trainer) run their optimize blocks on arrival, as one
call, under the locks of every block involved, taken in block order (as ``checkpoint`` takes them all: no
deadlock); the learning-rate block runs first in that call when the request holds the trigger gradient
(the first gradient's), under its lock too; with DC-ASGD the request's scope holds the sender's
``TRAINER_ID_VAR`` for every block. A ``get`` reads under the lock of the block that writes the
variable; there are no barriers.

Geo-SGD (``distributed_mode`` 3, async): the received entries are parameter deltas the blocks add
(``sum``). For a distributed table the pserver also records, per trainer, which shard rows any delta
changed since that trainer last fetched them; ``get`` of ``<table>@GEO_UPDATES``
(``ir.names.geo_updates_name``) answers those rows (selected rows with global ids, the table's height)
and clears the trainer's record. A trainer that fetches after its own delta was acknowledged thereby
holds every row the pservers changed, its own included.

Transports: ``incarnation_listeners`` are told whenever a trainer's live incarnation changes (a restart,
Complete), and ``close()`` runs the ``closers`` once the server stopped: the data plane (runtime.rpc.shm)
drops a trainer's shared-memory segments and removes them all at the end.

Invariants:
- Every request is validated completely before any state changes: a rejected request leaves the
  parameters and the protocol state exactly as they were.
- Retries are harmless: a send whose (trainer incarnation, variable, seq) was seen is acknowledged and
  dropped; barriers, ``announce`` and ``complete`` are idempotent.
- Nothing acknowledged is dropped: a stored send is applied in the step it was sent for (a later send of
  the same variable for the same step by the same incarnation replaces it; RPCClient never does that).
- No wait is unbounded: a sync step whose barrier is partly in for longer than ``barrier_timeout``
  seconds (or, in async mode, a live trainer silent that long) fails the pserver with an error naming
  the missing trainers and the step; every blocked call then returns ABORTED with that message.
- Received selected rows are padded to a power-of-two row count with rows ``height`` (zero values),
  which every sparse kernel drops: the optimize blocks compile for a few row counts, not every step.
- Distributed lookup table shards hold the global rows ``r`` with ``r % pservers == pserver_id`` at local
  row ``r // pservers``: received sparse table gradients and prefetched ids are mapped to local rows here.
"""
from __future__ import annotations

import enum
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ir.core import Operator, Program, Variable
from ir.errors import FlotillaError
from ir.names import TRAINER_ID_VAR, dc_asgd_backup_name, geo_updates_name
from ir.ops.registry import suggest
from runtime.block_sets import block_dependency
from runtime.rows import gather_rows, padded_size
from runtime.rpc.wire import Decoded, encode_variable
from runtime.scope import Scope, SelectedRows


class Status(enum.Enum):
    """The outcome classes of a request; the servicer maps them to gRPC status codes of the same name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    INTERNAL = "INTERNAL"


class PServerError(FlotillaError):
    """A request the pserver refuses (``status`` says why), or the pserver's own failure."""

    code = "E720"

    def __init__(self, status: Status, message: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status


class BarrierKind(enum.IntEnum):
    SEND = 0
    FETCH = 1


def _entries(op: Operator, attr: str) -> dict[str, int]:
    out = {}
    for entry in op.attr(attr):
        name, _, idx = entry.rpartition(":")
        out[name] = int(idx)
    return out


def _endpoints_of(trainer_ids: list[int]) -> str:
    """`` (lost endpoint(s): ...)`` for trainer ids when the launcher told this process every trainer's
    endpoint (``PADDLE_TRAINER_ENDPOINTS``), else ``""``: a job spanning hosts names where they ran."""
    eps = [e.strip() for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e.strip()]
    named = [eps[t] for t in trainer_ids if 0 <= t < len(eps)]
    return f" (lost endpoint(s): {', '.join(named)})" if named else ""


@dataclass(frozen=True)
class ServeConfig:
    """What ``listen_and_serv`` says about the service."""

    endpoint: str
    trainers: int
    sync_mode: bool
    pserver_id: int
    pservers: int
    optimize_blocks: tuple[int, ...]
    grad_to_block: dict[str, int]
    lr_block: int
    prefetch_to_block: dict[str, int]
    sparse_grad_to_param: dict[str, str]
    checkpoint_block: int
    dc_asgd: bool
    geo_sgd: bool = False  # distributed_mode 3: the dense entries are parameter deltas, pushed every k steps

    @classmethod
    def from_op(cls, op: Operator) -> "ServeConfig":
        sparse = {}
        for entry in op.attr("sparse_grad_to_param"):
            grad, _, param = entry.partition(":")
            sparse[grad] = param
        return cls(
            endpoint=op.attr("endpoint"), trainers=int(op.attr("Fanin")), sync_mode=bool(op.attr("sync_mode")),
            pserver_id=max(0, int(op.attr("pserver_id"))), pservers=int(op.attrs.get("pservers", 1)),
            optimize_blocks=tuple(b.idx for b in op.attr("optimize_blocks")),
            grad_to_block=_entries(op, "grad_to_block_id"), lr_block=int(op.attr("lr_decay_block_id")),
            prefetch_to_block=_entries(op, "prefetch_var_name_to_block_id"), sparse_grad_to_param=sparse,
            checkpoint_block=int(op.attr("checkpoint_block_id")), dc_asgd=bool(op.attr("dc_asgd")),
            geo_sgd=int(op.attrs.get("distributed_mode", 0)) == 3)


@dataclass
class _Incarnation:
    """The live incarnation of an announced trainer id."""

    incarnation: int
    joins_at: int  # the first sync step it takes part in
    seen_seq: dict[str, int] = field(default_factory=dict)  # variable -> last stored seq


@dataclass(frozen=True)
class _Send:
    """A validated received gradient, not yet checked against the protocol state."""

    trainer_id: int
    name: str
    var: Variable
    seq: int
    step: int
    incarnation: int
    value: Any


@dataclass
class _SyncState:
    step: int = 0
    sent: set[int] = field(default_factory=set)  # SEND barriers in for `step`
    fetched: set[int] = field(default_factory=set)  # FETCH barriers in for `step`
    optimized: bool = False
    started_at: float | None = None  # when the first barrier of the unfinished phase came in


class PServer:
    """Serve one pserver program (see the module docstring). ``run_block(block_idx, scope)`` runs a block
    of ``program`` against ``scope`` (normally ``Executor.run_block``); ``run_blocks(block_ids, scope)``,
    when given, runs an independent set of blocks as one compiled call (``Executor.run_blocks``), and a
    request's or a sync step's optimize blocks then run that way."""

    def __init__(self, program: Program, scope: Scope, op: Operator, run_block: Callable[[int, Scope], None], *,
                 run_blocks: Callable[..., list[str]] | None = None,
                 barrier_timeout: float = 120.0, save_persistables: Callable[[str], None] | None = None,
                 checkpoint_root: str | None = None, allow_rejoin: bool = True, check_finite: bool = True,
                 authenticated: bool = False, log: Callable[[str], None] | None = None) -> None:
        self.program, self.scope, self.config = program, scope, ServeConfig.from_op(op)
        self._run_block = run_block
        self._run_blocks = run_blocks
        self._merged: dict[tuple[int, ...], bool] = {}  # block set -> whether it runs as one call
        self._checked_cache: dict[tuple[int, ...], tuple[frozenset[str], frozenset[str]]] = {}
        self._merged_lock = threading.Lock()
        self._save = save_persistables
        self.barrier_timeout = barrier_timeout
        self.checkpoint_root = checkpoint_root
        self.allow_rejoin = allow_rejoin
        self.authenticated = authenticated
        self.check_finite = check_finite
        self._log = log or _log_stderr
        if save_persistables is not None and not authenticated:
            self._log(f"pserver {self.config.endpoint}: authenticates nobody (no FLOTILLA_JOB_TOKEN, no mutual TLS): "
                      "anyone who reaches its port may trigger checkpoints into any directory it can write")
        block = program.global_block()
        self._received: dict[str, Variable] = {n: block.var(n) for n in op.input("X")}
        self._grad_block = {}
        for name, var in self._received.items():
            base = var.copy_of if var.copy_of and var.copy_of in self.config.grad_to_block else name
            if base not in self.config.grad_to_block:
                raise PServerError(Status.INTERNAL, f"listen_and_serv receives {name!r} but no grad_to_block_id "
                                   "entry names it", hint="transpile the program again")
            self._grad_block[name] = self.config.grad_to_block[base]
        self._table_grads = {n for n, v in self._received.items()
                             if (v.copy_of or n) in self.config.sparse_grad_to_param
                             and getattr(block.var(self.config.sparse_grad_to_param[v.copy_of or n]), "is_distributed", False)}
        self._gettable = {n for n, v in block.vars.items() if v.persistable}
        self._reply_sizes: dict[str, int] = {}  # _reply_bytes, by name
        # Geo-SGD: per distributed table, which shard rows changed since each trainer last fetched them.
        self._geo_updates: dict[str, str] = {}  # updates name -> table
        self._geo_changed: dict[str, np.ndarray] = {}  # table -> bool [trainers, shard rows]
        self._delta_of_table: dict[str, str] = {}
        if self.config.geo_sgd:
            for name in self._table_grads:
                table = self.config.sparse_grad_to_param[name]
                self._geo_updates[geo_updates_name(table)] = table
                self._delta_of_table[table] = name
                self._geo_changed[table] = np.zeros((self.config.trainers, block.var(table).shape[0]), bool)
        # The lock of the block that writes each variable (async mode); the lr block has its own.
        self._block_locks = {idx: threading.Lock() for idx in range(program.num_blocks)}
        self._writer_lock: dict[str, threading.Lock] = {}
        for idx in self.config.optimize_blocks:
            for bop in program.block(idx).ops:
                for n in bop.output_arg_names:
                    self._writer_lock.setdefault(n, self._block_locks[idx])
        # What each optimize block overwrites (reads, then writes): the executor donates those buffers, so a
        # checked update runs on copies of them and commits only once its results are finite.
        self._overwritten = {idx: _overwritten(program, idx) for idx in range(program.num_blocks)}
        self._writes = {idx: frozenset(n for o in program.block(idx).ops for n in o.output_arg_names)
                        for idx in range(program.num_blocks)}
        # Selected rows update a few rows of a table in place: a copy and a check of the whole table (and its
        # accumulators) per update would cost more than the update, so those variables are left out.
        self._unchecked = frozenset(self._received) | frozenset(self.config.grad_to_block) | frozenset(
            n for g in self.config.sparse_grad_to_param if g in self.config.grad_to_block
            for n in self._overwritten[self.config.grad_to_block[g]])
        # What the learning-rate block writes is the pserver's own state even before the scope holds it (its
        # temporaries of block 0): an async request's update that runs the lr block writes it back.
        self._lr_outputs = frozenset(n for o in program.block(self.config.lr_block).ops
                                     for n in o.output_arg_names) if self.config.lr_block >= 0 else frozenset()
        self._cv = threading.Condition()
        self._live = set(range(self.config.trainers))
        self._trainers: dict[int, _Incarnation] = {}
        self._fresh: dict[int, set[str]] = {}  # sync step -> trainer copies stored for it
        self._copies: dict[str, list[str]] = {}  # summed gradient -> the trainers' copies of it
        for name, var in self._received.items():
            if var.copy_of and var.trainer_id is not None:
                self._copies.setdefault(var.copy_of, []).append(name)
        self.rejected_nonfinite = 0
        self._last_seen = {t: time.monotonic() for t in self._live}
        self._sync = _SyncState()
        self._lr_trigger = self._lr_trigger_block()
        self._failure: PServerError | None = None
        self.steps_run = 0
        # Told (trainer id, live incarnation or None once it completed) whenever that changes, with the state
        # lock held: the data plane drops a trainer's segments then (runtime.rpc.shm.PServerPlane).
        self.incarnation_listeners: list[Callable[[int, int | None], None]] = []
        self.closers: list[Callable[[], None]] = []  # run by close(), after the server stopped
        self.data_plane: Any = None  # the server's runtime.rpc.shm.PServerPlane, set by start_server

    def close(self) -> None:
        """Release what serving held beyond the scope (the data plane's segments); idempotent."""
        closers, self.closers = self.closers, []
        for close in closers:
            close()

    def live_incarnation(self, trainer_id: int) -> int | None:
        """The live incarnation of ``trainer_id``, or None (not announced, or completed). Reads without the
        state lock (one dict lookup): a snapshot, for the data plane's checks."""
        cur = self._trainers.get(trainer_id)
        return cur.incarnation if cur is not None and trainer_id in self._live else None

    def _tell_listeners(self, trainer_id: int, incarnation: int | None) -> None:
        for listener in self.incarnation_listeners:
            listener(trainer_id, incarnation)

    # --- checks shared by every request
    def _check_trainer(self, trainer_id: int, what: str) -> None:
        if not 0 <= trainer_id < self.config.trainers:
            raise PServerError(Status.INVALID_ARGUMENT,
                               f"{what}: trainer_id {trainer_id} is out of range; this pserver serves "
                               f"{self.config.trainers} trainers (ids 0..{self.config.trainers - 1})",
                               hint="set PADDLE_TRAINER_ID below PADDLE_TRAINERS_NUM, as transpiled")

    def _check_running(self) -> None:
        if self._failure is not None:
            raise PServerError(Status.ABORTED, str(self._failure.message))

    def _check_live(self, trainer_id: int, what: str) -> None:
        if trainer_id not in self._live:
            raise PServerError(Status.FAILED_PRECONDITION,
                               f"{what} from trainer {trainer_id}, which already sent Complete",
                               hint="a trainer sends nothing after Executor.close()")

    def _check_incarnation(self, trainer_id: int, incarnation: int, what: str) -> _Incarnation:
        """The live incarnation of ``trainer_id``, if ``incarnation`` is it (called with the lock held)."""
        cur = self._trainers.get(trainer_id)
        if cur is None:
            raise PServerError(Status.FAILED_PRECONDITION,
                               f"{what} from trainer {trainer_id}, which has not announced itself to this pserver",
                               hint="a trainer's RPCClient announces (trainer id, incarnation) before its first "
                                    "request; a request without it is not from this job's trainers")
        if cur.incarnation != incarnation:
            raise PServerError(Status.FAILED_PRECONDITION,
                               f"{what} from incarnation {incarnation:#x} of trainer {trainer_id}, but its live "
                               f"incarnation is {cur.incarnation:#x}",
                               hint="the trainer was restarted: only its newest process may talk to the pservers")
        self._last_seen[trainer_id] = time.monotonic()  # only the live incarnation keeps a trainer alive
        return cur

    def _required(self) -> set[int]:
        """The live trainers the current sync step waits for (a rejoining trainer joins at a later step)."""
        step = self._sync.step
        return {t for t in self._live if t not in self._trainers or self._trainers[t].joins_at <= step}

    # --- requests
    def announce(self, trainer_id: int, incarnation: int, join_at: int = 0) -> int:
        """Trainer ``trainer_id`` starts talking as ``incarnation``; returns the first step it takes part in.

        A first announcement joins at the current step. A new incarnation of an announced id (a restarted
        trainer) is refused unless ``allow_rejoin``; otherwise it replaces the old one, joins at the next
        step boundary (or ``join_at`` when later: the client aligns its pservers) with its sequence numbers
        reset, and this call returns once the pserver has reached that step."""
        self._check_trainer(trainer_id, "Announce")
        if incarnation <= 0:
            raise PServerError(Status.INVALID_ARGUMENT,
                               f"Announce of trainer {trainer_id}: incarnation {incarnation} must be a positive "
                               "random id", hint="RPCClient draws one per trainer process")
        if join_at < 0:
            raise PServerError(Status.INVALID_ARGUMENT, f"Announce of trainer {trainer_id}: join_at {join_at} < 0")
        with self._cv:
            self._check_running()
            cur = self._trainers.get(trainer_id)
            if cur is not None and cur.incarnation == incarnation:
                joins = cur.joins_at  # a retried announcement
            else:
                self._check_live(trainer_id, "Announce")
                sync = self.config.sync_mode
                if cur is None:
                    joins = max(self._sync.step, join_at) if sync else 0
                else:
                    if not self.allow_rejoin:
                        raise PServerError(
                            Status.FAILED_PRECONDITION,
                            f"trainer {trainer_id} restarted (incarnation {incarnation:#x} replaces "
                            f"{cur.incarnation:#x}), but this job forbids rejoining",
                            hint="restart the whole job from a checkpoint, or allow rejoin "
                                 "(FLAGS_pserver_allow_rejoin=1)")
                    if not self.authenticated:
                        raise PServerError(
                            Status.FAILED_PRECONDITION,
                            f"Announce of trainer {trainer_id} as incarnation {incarnation:#x}, but that trainer is "
                            f"live as {cur.incarnation:#x}; this pserver authenticates nobody, so it cannot tell a "
                            "restarted trainer from any process claiming its id, and refuses the second incarnation",
                            hint="run the job with FLOTILLA_JOB_TOKEN (flotilla launch sets it) or mutual TLS to let "
                                 "a restarted trainer rejoin; otherwise restart the whole job")
                    joins = self._sync.step + 1
                    mine = {n for n, v in self._received.items() if v.trainer_id == trainer_id}
                    if mine & self._fresh.get(joins, set()):
                        joins += 1  # the old incarnation already sent for the next step: that step keeps them
                    joins = max(joins, join_at) if sync else 0
                    self._log(f"pserver {self.config.endpoint}: trainer {trainer_id} rejoined as incarnation "
                              f"{incarnation:#x} (was {cur.incarnation:#x}); it takes part from step {joins}"
                              + ("" if sync else " (async)"))
                self._trainers[trainer_id] = _Incarnation(incarnation, joins)
                self._last_seen[trainer_id] = time.monotonic()
                self._tell_listeners(trainer_id, incarnation)
                if sync and self._failure is None:
                    self._maybe_optimize()
                    self._maybe_advance()
                self._cv.notify_all()
            if self.config.sync_mode:
                self._wait(lambda: self._sync.step >= joins, trainer_id, f"step {joins} to join at")
            return joins

    def send(self, msg: Decoded) -> None:
        """Store (sync) or apply (async) one received gradient."""
        self.send_batch([msg])

    def send_batch(self, msgs: list[Decoded]) -> None:
        """Store (sync) or apply (async) the gradients of one request, all or none: every message is
        validated, and every sequence number checked, before any is stored (sync mode stores them under
        one lock, so a step's barrier never sees half a batch). Async mode applies a request's gradients of
        one trainer together: their optimize blocks run as one compiled call, checked and committed as a
        whole (``_apply_async``)."""
        if len({m.name for m in msgs}) != len(msgs):
            names = [m.name for m in msgs]
            twice = sorted({n for n in names if names.count(n) > 1})
            raise PServerError(Status.INVALID_ARGUMENT, f"a send batch names {twice} more than once",
                               hint="a batch carries each variable once")
        prepared = [self._prepare_send(m) for m in msgs]
        with self._cv:
            self._check_running()
            accepted = [p for p in prepared if self._accept_send(p)]
            if self.config.sync_mode:
                for p in accepted:
                    self._store_send(p)
                return
            for p in accepted:
                self._trainers[p.trainer_id].seen_seq[p.name] = p.seq
        by_trainer: dict[int, list[_Send]] = {}
        for p in accepted:
            by_trainer.setdefault(p.trainer_id, []).append(p)
        for sends in by_trainer.values():
            self._apply_async(sends)

    def _prepare_send(self, msg: Decoded) -> "_Send":
        """Validate one received gradient (no state is read or changed): the value to store."""
        t, name = msg.header.trainer_id, msg.name
        self._check_trainer(t, f"send of {name!r}")
        var = self._received.get(name)
        if var is None:
            raise PServerError(Status.NOT_FOUND, f"send of {name!r}: this pserver receives no such variable",
                               hint=suggest(name, list(self._received)) or
                               "send each gradient to the endpoint its send op's epmap names")
        if var.trainer_id is not None and var.trainer_id != t:
            raise PServerError(Status.INVALID_ARGUMENT,
                               f"send of {name!r}: that is trainer {var.trainer_id}'s copy, but the request comes "
                               f"from trainer {t}", hint="each trainer sends only its own gradient copies")
        seq = msg.header.seq
        if seq <= 0:
            raise PServerError(Status.INVALID_ARGUMENT, f"send of {name!r} from trainer {t}: seq {seq} must be "
                               "at least 1", hint="RPCClient numbers each variable's sends 1, 2, 3, ...")
        value = self._checked_value(name, var, msg.value)
        if self.check_finite and not msg.finite:
            bad = _nonfinite_count(value)
            if bad:
                with self._cv:
                    self.rejected_nonfinite += 1
                raise PServerError(Status.INVALID_ARGUMENT,
                                   f"send of {name!r} from trainer {t} for step {msg.header.step}: the gradient "
                                   f"holds {bad} NaN or Inf value(s); refused, the parameter is unchanged",
                                   hint="lower the learning rate, clip gradients, or check the input data "
                                        "(FLAGS_pserver_check_finite=0 turns this check off)")
        if name in self._table_grads:
            value = self._local_rows(name, value)
        if isinstance(value, SelectedRows):
            value = _pad_rows(value)
        return _Send(t, name, var, seq, msg.header.step, msg.header.incarnation, value)

    def _accept_send(self, p: "_Send") -> bool:
        """Check a prepared send against the protocol state (lock held): False for a retry already
        stored, PServerError for one that must be refused; changes nothing."""
        what = f"send of {p.name!r}"
        me = self._check_incarnation(p.trainer_id, p.incarnation, what)
        self._check_live(p.trainer_id, what)
        last = me.seen_seq.get(p.name, 0)
        if p.seq <= last:
            return False  # a retry of a send already stored
        if self.config.sync_mode:
            self._check_send_step(p.trainer_id, p.name, p.step)
        if p.seq != last + 1:
            raise PServerError(Status.FAILED_PRECONDITION,
                               f"send of {p.name!r} from trainer {p.trainer_id}: seq {p.seq} skips ahead; the next "
                               f"is {last + 1} (a seq up to {last} is a retry)",
                               hint="sequence numbers of a trainer incarnation advance by one per variable")
        return True

    def _store_send(self, p: "_Send") -> None:
        """Keep an accepted sync-mode gradient for its step's optimize (lock held)."""
        self.scope.set_var(p.name, p.value)
        self._trainers[p.trainer_id].seen_seq[p.name] = p.seq
        if p.var.trainer_id is not None:
            self._fresh.setdefault(p.step, set()).add(p.name)

    def get(self, trainer_id: int, name: str) -> bytes:
        """The wire bytes of variable ``name`` (a parameter slice or any persistable of block 0)."""
        return self.get_many(trainer_id, [name])[0]

    def get_many(self, trainer_id: int, names: list[str], encode: Callable[[str, Any], Any] = encode_variable,
                 max_bytes: int | None = None) -> list[Any]:
        """The wire bytes (``encode(name, value)``) of each variable of ``names``, in order; every name is
        checked first, and with ``max_bytes`` the size of the reply too, before any value is encoded (a
        small request must not make the pserver build a huge reply)."""
        self._check_trainer(trainer_id, f"get of {names[0]!r}" if len(names) == 1 else f"get of {len(names)} "
                            "variables")
        for name in names:
            if name not in self._gettable and name not in self._geo_updates:
                known = sorted(self._gettable | set(self._geo_updates))
                raise PServerError(Status.NOT_FOUND, f"get of {name!r}: this pserver holds no such variable",
                                   hint=suggest(name, known) or
                                   "fetch each parameter from the endpoint its recv op's epmap names")
        if max_bytes is not None:
            asked = sum(self._reply_bytes(name) for name in names)
            if asked > max_bytes:
                raise PServerError(Status.RESOURCE_EXHAUSTED,
                                   f"get of {len(names)} variables asks for {asked} bytes, above this pserver's "
                                   f"reply limit of {max_bytes} bytes (its largest message); nothing was built",
                                   hint="fetch fewer variables per request (RPCClient streams large ones)")
        if self.config.sync_mode:
            # Nothing changes a parameter between a trainer's SEND barrier and its next one, so the
            # values are read under the state lock (never mid-optimize) and encoded outside it.
            with self._cv:
                self._check_running()
                values = [self._value_of(name) for name in names]
            return [encode(name, value) for name, value in zip(names, values)]
        # Async: the next update of a variable donates its buffer, so encode (copy) under its lock.
        out = []
        for name in names:
            if name in self._geo_updates:
                out.append(self._take_geo_updates(trainer_id, name, encode))
                continue
            with self._writer_lock.get(name) or _NO_LOCK:
                value = self._value_of(name)
                if self.config.dc_asgd:
                    self.scope.set_var(dc_asgd_backup_name(name, trainer_id), value)
                out.append(encode(name, value))
        return out

    def get_encoded(self, trainer_id: int, name: str, encode: Callable[[str, Any], Any]) -> Any:
        """``get`` of one variable with another encoder: ``encode(name, value)`` runs where ``get`` encodes,
        under the same locks, and must copy the value (e.g. ``runtime.rpc.stream.encode_chunks``)."""
        return self.get_many(trainer_id, [name], encode)[0]

    def _take_geo_updates(self, trainer_id: int, name: str, encode: Callable[[str, Any], Any]) -> Any:
        """Geo-SGD: ``encode`` of the rows of the table's shard that changed since trainer ``trainer_id`` last
        took them (``name`` is the table's updates name), as selected rows with global ids (the whole table's
        height). They count as taken only once encoded: an encoder that refuses (a data-plane slot too
        small: the trainer asks again with a larger one) loses no update."""
        table = self._geo_updates[name]
        n, me = self.config.pservers, self.config.pserver_id
        height = self.program.global_block().var(self._delta_of_table[table]).shape[0]
        with self._writer_lock.get(table) or _NO_LOCK:
            changed = self._geo_changed[table][trainer_id]
            rows = np.flatnonzero(changed)
            values = gather_rows(self._value_of(table), rows)  # a copy: the next update donates the shard
            encoded = encode(name, SelectedRows(rows.astype(np.int64) * n + me, values, height))
            changed[rows] = False
        return encoded

    def _reply_bytes(self, name: str) -> int:
        """The bytes ``name``'s value takes on the wire (a geo-SGD update: at most its whole table), worked
        out once a name (the program does not change while it is served)."""
        known = self._reply_sizes.get(name)
        if known is None:
            known = self._reply_sizes[name] = self._reply_bytes_of(name)
        return known

    def _reply_bytes_of(self, name: str) -> int:
        var = self.program.global_block().var(self._geo_updates.get(name, name))
        if var.type == "raw":
            return 0
        rows = max(var.shape[0], 1) * 8 if var.type == "selected_rows" or name in self._geo_updates else 0
        return int(np.prod([max(d, 1) for d in var.shape], dtype=np.int64)) * np.dtype(var.dtype).itemsize + rows

    def _value_of(self, name: str) -> Any:
        value = self.scope.find_var(name)
        if value is None:
            raise PServerError(Status.FAILED_PRECONDITION, f"get of {name!r}: the variable is not initialised",
                               hint="run the pserver startup program before listen_and_serv")
        return value

    def prefetch(self, msg: Decoded, encode: Callable[[str, Any], Any] = encode_variable) -> Any:
        """The rows of the table shard for the ids in ``msg`` (named by the trainer's ids variable), as
        ``encode(rows name, rows)`` gives them (called under the table's writer lock; the data plane writes
        them straight into the trainer's slot)."""
        t, name = msg.header.trainer_id, msg.name
        self._check_trainer(t, f"prefetch of {name!r}")
        block_idx = self.config.prefetch_to_block.get(name)
        if block_idx is None:
            raise PServerError(Status.NOT_FOUND, f"prefetch of {name!r}: this pserver answers no such ids variable",
                               hint=suggest(name, list(self.config.prefetch_to_block)) or
                               "prefetch from the endpoint the prefetch op's epmap names")
        ids = msg.value
        if isinstance(ids, SelectedRows) or ids.dtype != np.int64:
            raise PServerError(Status.INVALID_ARGUMENT, f"prefetch of {name!r}: ids must be a dense int64 tensor, "
                               f"got {type(ids).__name__} of {ids.dtype}")
        (lookup,) = [o for o in self.program.block(block_idx).ops if o.type == "lookup_sparse_table"]
        table = lookup.input("W")[0]
        local = self._local_ids(f"prefetch of {name!r}", ids.reshape(-1), table)
        out_name = lookup.output("Out")[0]
        with self._cv:
            self._check_running()
        scope = self.scope.new_scope()
        scope.set_var(lookup.input("Ids")[0], local.reshape(ids.shape))
        with self._writer_lock.get(table) or _NO_LOCK:
            self._run_block(block_idx, scope)
            return encode(out_name, scope.var(out_name))

    def barrier(self, trainer_id: int, step: int, kind: BarrierKind, incarnation: int) -> None:
        """A trainer's SEND or FETCH barrier of ``step`` (sync mode; a no-op in async mode)."""
        self._check_trainer(trainer_id, f"{kind.name} barrier")
        with self._cv:
            if not self.config.sync_mode:
                self._check_incarnation(trainer_id, incarnation, f"{kind.name} barrier of step {step}")
                return
            self._check_running()
            self._check_incarnation(trainer_id, incarnation, f"{kind.name} barrier of step {step}")
            self._check_live(trainer_id, f"{kind.name} barrier of step {step}")
            st = self._sync
            if kind is BarrierKind.FETCH:
                if step == st.step and trainer_id in st.sent and st.optimized:
                    st.fetched.add(trainer_id)
                    self._maybe_advance()
                elif step > st.step:
                    raise PServerError(Status.FAILED_PRECONDITION,
                                       f"FETCH barrier of step {step} from trainer {trainer_id}, but the pserver "
                                       f"is at step {st.step}", hint="a trainer sends its barriers in step order")
                return
            if step < st.step or (step == st.step and trainer_id in st.sent and st.optimized):
                return  # a retry of a barrier already counted
            if step > st.step + 1:
                raise PServerError(Status.FAILED_PRECONDITION,
                                   f"SEND barrier of step {step} from trainer {trainer_id}, but the pserver is at "
                                   f"step {st.step}", hint="a trainer sends its barriers in step order")
            if step == st.step + 1 and trainer_id in st.sent and st.optimized and trainer_id not in st.fetched:
                st.fetched.add(trainer_id)  # it fetched step `st.step` before sending this (module docstring)
                self._maybe_advance()
            self._wait(lambda: self._sync.step >= step, trainer_id, f"the FETCH barriers of step {step - 1}")
            st = self._sync
            if st.started_at is None:
                st.started_at = time.monotonic()
            st.sent.add(trainer_id)
            self._maybe_optimize()
            self._wait(lambda: self._sync.step > step or self._sync.optimized, trainer_id,
                       f"the SEND barriers of step {step}")

    def complete(self, trainer_id: int, incarnation: int) -> None:
        """Trainer ``trainer_id`` is done: it leaves every later barrier."""
        self._check_trainer(trainer_id, "Complete")
        with self._cv:
            self._check_incarnation(trainer_id, incarnation, "Complete")
            if trainer_id not in self._live:
                return
            self._live.discard(trainer_id)
            self._tell_listeners(trainer_id, None)
            if self.config.sync_mode and self._failure is None:
                self._maybe_optimize()
                self._maybe_advance()
            self._cv.notify_all()

    def checkpoint(self, trainer_id: int, dirname: str, incarnation: int) -> str:
        """Save every persistable variable of the pserver under ``dirname/pserver_<id>`` (a relative
        ``dirname`` under the checkpoint root); returns that path."""
        self._check_trainer(trainer_id, "CheckpointNotify")
        if self._save is None:
            raise PServerError(Status.FAILED_PRECONDITION, "this pserver was started without a way to save")
        if dirname and not os.path.isabs(dirname) and not self.checkpoint_root:
            raise PServerError(Status.FAILED_PRECONDITION,
                               f"CheckpointNotify of {dirname!r}: pserver {self.config.endpoint} has no checkpoint "
                               "root to resolve a relative name under",
                               hint="name the checkpoint by an absolute path, or start the pservers with "
                                    "FLOTILLA_CHECKPOINT_ROOT=DIR (flotilla launch passes it on)")
        path = resolve_checkpoint(self.checkpoint_root, dirname, self.config.pserver_id)
        with self._cv:
            self._check_running()
            self._check_incarnation(trainer_id, incarnation, "CheckpointNotify")
            with _all(self._block_locks.values()):
                try:
                    self._save(path)
                except FlotillaError as e:
                    raise PServerError(Status.FAILED_PRECONDITION, f"CheckpointNotify of {dirname!r}: {e.message}",
                                       hint=e.hint) from None
        return path

    def health(self) -> dict[str, Any]:
        with self._cv:
            return {"serving": self._failure is None and bool(self._live), "endpoint": self.config.endpoint,
                    "pserver_id": self.config.pserver_id, "sync_mode": self.config.sync_mode,
                    "step": self._sync.step, "live_trainers": sorted(self._live),
                    "rejected_nonfinite": self.rejected_nonfinite}

    # --- serving
    def wait(self, poll: float = 0.2) -> None:
        """Block until every trainer has completed; raise the pserver's failure if it failed."""
        with self._cv:
            while self._live and self._failure is None:
                self._cv.wait(poll)
                self._watchdog()
            if self._failure is not None:
                raise self._failure

    def fail(self, error: PServerError) -> None:
        with self._cv:
            if self._failure is None:
                self._failure = error
            self._cv.notify_all()

    # --- internals (called with self._cv held unless said otherwise)
    def _watchdog(self) -> None:
        now = time.monotonic()
        st = self._sync
        if self.config.sync_mode:
            if st.started_at is not None and now - st.started_at > self.barrier_timeout:
                if st.optimized:
                    missing = sorted(self._required() - st.fetched)
                    waited = (f"the FETCH barrier of step {st.step} (or the SEND barrier of step {st.step + 1}) "
                              f"of trainer(s) {missing}")
                else:
                    missing = sorted(self._required() - st.sent)
                    waited = f"the SEND barrier of step {st.step} of trainer(s) {missing}"
                self.fail(PServerError(
                    Status.ABORTED,
                    f"pserver {self.config.endpoint}: waited {self.barrier_timeout:g}s for {waited}"
                    f"{_endpoints_of(missing)}; giving up",
                    hint="a trainer died or hangs; see its log (FLAGS_pserver_timeout_ms sets this limit)"))
                return
            if st.started_at is not None:
                return
        # Async mode, or a sync step no trainer has reached a barrier of: trainers that went silent.
        silent = sorted(t for t in self._live if now - self._last_seen[t] > self.barrier_timeout)
        if silent:
            self.fail(PServerError(
                Status.ABORTED, f"pserver {self.config.endpoint}: trainer(s) {silent}{_endpoints_of(silent)} sent nothing for "
                f"{self.barrier_timeout:g}s and did not complete; giving up",
                hint="a trainer died or hangs; see its log (FLAGS_pserver_timeout_ms sets this limit)"))

    def _wait(self, ready: Callable[[], bool], trainer_id: int, what: str) -> None:
        deadline = time.monotonic() + self.barrier_timeout
        while not ready():
            self._check_running()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._watchdog()
                self._check_running()
                raise PServerError(Status.ABORTED, f"trainer {trainer_id} waited {self.barrier_timeout:g}s for {what}")
            self._cv.wait(min(remaining, 0.5))
        self._check_running()

    def _check_send_step(self, t: int, name: str, step: int) -> None:
        st = self._sync
        ok = step == st.step and t not in st.sent or step == st.step + 1 and t in st.sent and st.optimized
        if not ok:
            raise PServerError(Status.FAILED_PRECONDITION,
                               f"send of {name!r} from trainer {t} for step {step}, but the pserver is at step "
                               f"{st.step} ({'after' if t in st.sent else 'before'} that trainer's SEND barrier)",
                               hint="a trainer sends a step's gradients before that step's SEND barrier")

    def _maybe_optimize(self) -> None:
        st = self._sync
        required = self._required()
        if st.optimized or not required or not required <= st.sent:
            return
        self._average_over_senders(self._fresh.pop(st.step, set()))
        try:
            update = self._update(self.config.optimize_blocks)  # one call: the lr block first, then the rest
        except Exception as e:  # noqa: BLE001 - the pserver fails; every waiter learns why
            self.fail(PServerError(Status.INTERNAL, f"pserver {self.config.endpoint}: optimize blocks of step "
                                   f"{st.step} failed: {type(e).__name__}: {e}"))
            return
        if update is not None:
            bad = update.nonfinite()
            if bad is not None:
                update.commit(unchecked_only=True)  # tables are updated in place, outside the check
                self.rejected_nonfinite += 1
                self.fail(PServerError(
                    Status.ABORTED, f"pserver {self.config.endpoint}: step {st.step} refused: its update of "
                    f"{bad[0]!r} holds {bad[1]} NaN or Inf value(s) although every gradient was finite (their "
                    "sum or the optimizer overflowed); the parameters are unchanged", hint=_NONFINITE_HINT))
                return
            update.commit()
        self.steps_run += 1
        st.optimized = True
        st.started_at = time.monotonic()
        self._cv.notify_all()

    def _average_over_senders(self, fresh: set[str]) -> None:
        """Zero the copies not sent this step; scale the sent ones so the program's 1/trainers is 1/senders."""
        for copies in self._copies.values():
            sent = [c for c in copies if c in fresh]
            if len(sent) == len(copies):
                continue
            for c in copies:
                if c not in fresh:
                    self.scope.set_var(c, self._zeros_of(c, self._received[c]))
            if sent:
                factor = self.config.trainers / len(sent)
                for c in sent:
                    self.scope.set_var(c, _scaled(self.scope.find_var(c), factor))

    def _maybe_advance(self) -> None:
        st = self._sync
        if st.optimized and self._required() <= st.fetched:
            self._sync = _SyncState(step=st.step + 1)
            self._cv.notify_all()

    def _lr_trigger_block(self) -> int:
        """The optimize block whose every run first advances the learning-rate block (async mode): the
        first gradient's."""
        return next(iter(self.config.grad_to_block.values()), -1)

    def _run_set(self, blocks: tuple[int, ...], scope: Scope, checked: bool) -> list[str] | None:
        """Run the optimize blocks ``blocks`` in order on ``scope``. With ``run_blocks``: as one compiled call
        when the set is independent (``runtime.block_sets.block_dependency``), else a call a block; at most
        ``_MAX_MERGED_SETS`` distinct sets are merged (each is its own plan and compile), later new sets run
        block by block. A ``checked`` run donates no buffer of a checked variable and checks the new values
        in the same call: returns the written checked variables holding NaN/Inf. Without ``run_blocks``
        (``run_block`` alone) returns None: the ``_Update`` checks its copies itself."""
        if self._run_blocks is None:
            for idx in blocks:
                self._run_block(idx, scope)
            return None
        groups = [blocks] if len(blocks) == 1 or self._mergeable(blocks) else [(idx,) for idx in blocks]
        bad: list[str] = []
        for group in groups:
            if checked:
                keep, check = self._checked_args(group)
                bad += self._run_blocks(group, scope, keep=keep, check=check)
            else:
                self._run_blocks(group, scope)
        return bad

    def _mergeable(self, blocks: tuple[int, ...]) -> bool:
        merged = self._merged.get(blocks)
        if merged is None:
            with self._merged_lock:
                merged = self._merged.get(blocks)
                if merged is None:
                    many = sum(self._merged.values()) >= _MAX_MERGED_SETS
                    merged = not many and block_dependency(self.program, blocks) is None
                    self._merged[blocks] = merged
        return merged

    def _checked_args(self, blocks: tuple[int, ...]) -> tuple[frozenset[str], frozenset[str]]:
        """For a checked run of ``blocks``: what it must not donate (the checked variables it overwrites) and
        what it checks (the checked variables it writes); cached per set (they key the executor's plans)."""
        args = self._checked_cache.get(blocks)
        if args is None:
            keep = frozenset().union(*(self._overwritten[idx] for idx in blocks)) - self._unchecked
            check = frozenset().union(*(self._writes[idx] for idx in blocks)) - self._unchecked
            args = self._checked_cache[blocks] = (keep, check)
        return args

    def _update(self, blocks: tuple[int, ...], inputs: Scope | None = None) -> "_Update | None":
        """Run ``blocks`` (one call, see ``_run_set``) on the pserver's scope, or on ``inputs`` (a child of it
        holding a request's own values; then only the pserver's own variables are written back: those it
        holds and the learning-rate block's). With ``check_finite`` the results are held back in the returned
        ``_Update`` (commit them once checked: one fused check, one commit); without, they are written at
        once and None is returned."""
        own = None if inputs is None else self._lr_outputs
        if not self.check_finite:
            self._run_set(blocks, self.scope if inputs is None else _WriteThrough(inputs, self.scope, own), False)
            return None
        # With run_blocks the executor keeps the originals (no donation) and checks in the same call; without,
        # the update reads copies of what the blocks overwrite and checks the results itself.
        overwritten = set() if self._run_blocks is not None else \
            set().union(*(self._overwritten[idx] for idx in blocks))
        update = _Update(self.scope if inputs is None else inputs, self.scope, overwritten, self._unchecked, own)
        update.bad = self._run_set(blocks, update, True)
        return update

    def _apply_async(self, sends: list[_Send]) -> None:
        """Apply one trainer's accepted gradients of one request: their optimize blocks (and the learning-rate
        block first when the trigger gradient is among them) run as one call under the locks of every block
        involved, taken in block order; the merged update is checked and committed as a whole."""
        blocks: dict[int, None] = {}
        for p in sends:
            blocks.setdefault(self._grad_block[p.name], None)
        if len(blocks) < len(sends):  # two gradients of one block (a request never has them): one at a time
            for p in sends:
                self._apply_async([p])
            return
        ordered = tuple(sorted(blocks))  # canonical: one plan per set, whatever the request's order
        lr = self.config.lr_block
        if lr >= 0 and self._lr_trigger in blocks:
            ordered = (lr,) + tuple(b for b in ordered if b != lr)
        t = sends[0].trainer_id
        names = [p.name for p in sends]
        what = (f"send of {names[0]!r}" if len(sends) == 1 else f"send batch of {names}") + f" from trainer {t} for " \
            f"step {', '.join(str(s) for s in sorted({p.step for p in sends}))}"
        with _all(self._block_locks[idx] for idx in sorted(ordered)):
            scope = self.scope.new_scope()
            for p in sends:
                scope.set_var(p.name, p.value)
            if self.config.dc_asgd:
                scope.set_var(TRAINER_ID_VAR, np.array([t], np.int64))
            try:
                update = self._update(ordered, scope)
            except Exception as e:  # noqa: BLE001 - reported to the sender
                raise PServerError(Status.INTERNAL, f"applying the {what} failed: {type(e).__name__}: {e}") from e
            bad = update.nonfinite() if update is not None else None
            if bad is not None:
                update.commit(unchecked_only=True)  # tables are updated in place, outside the check
                with self._cv:
                    self.rejected_nonfinite += 1
                finite = "the gradient is finite; refused" if len(sends) == 1 else \
                    "every gradient is finite; the request is refused as a whole"
                raise PServerError(Status.INVALID_ARGUMENT,
                                   f"{what}: applying it makes {bad[0]!r} hold {bad[1]} NaN or Inf value(s) although "
                                   f"{finite}, the parameters are unchanged", hint=_NONFINITE_HINT)
            if update is not None:
                update.commit()
            for p in sends:
                if self._geo_changed and p.name in self._table_grads:
                    changed = self._geo_changed[self.config.sparse_grad_to_param[p.name]]
                    rows = np.asarray(p.value.rows)
                    changed[:, rows[rows < changed.shape[1]]] = True  # padding rows (== height) are not rows
        self.steps_run += len(sends)

    def _zeros_of(self, name: str, var: Variable) -> Any:
        """A zero value of received variable ``name`` (a completed trainer's gradient copy)."""
        if var.type != "selected_rows":
            return np.zeros(var.shape, var.dtype)
        height = var.shape[0]
        if name in self._table_grads:
            height = self.program.global_block().var(self.config.sparse_grad_to_param[var.copy_of or name]).shape[0]
        return SelectedRows(np.zeros((0,), np.int64), np.zeros((0,) + tuple(var.shape[1:]), var.dtype), height)

    def _checked_value(self, name: str, var: Variable, value: Any) -> Any:
        got_dtype = str(value.dtype)
        if got_dtype != var.dtype:
            raise PServerError(Status.INVALID_ARGUMENT,
                               f"send of {name!r}: dtype {got_dtype}, expected {var.dtype}")
        sparse = isinstance(value, SelectedRows)
        if sparse != (var.type == "selected_rows"):
            raise PServerError(Status.INVALID_ARGUMENT,
                               f"send of {name!r}: got a {'selected_rows' if sparse else 'dense'} value, "
                               f"expected {var.type}")
        shape = value.shape
        declared = tuple(var.shape)
        if len(shape) != len(declared) or any(d >= 0 and d != s for d, s in zip(declared, shape)):
            raise PServerError(Status.INVALID_ARGUMENT,
                               f"send of {name!r}: shape {list(shape)}, expected {list(declared)}"
                               + (" (height first)" if sparse else ""))
        return value

    def _local_ids(self, what: str, ids: np.ndarray, table: str) -> np.ndarray:
        n, me = self.config.pservers, self.config.pserver_id
        rows = self.program.global_block().var(table).shape[0]
        if n == 1:  # the whole table: its rows are the ids (two reductions, no integer division)
            ok = not ids.size or bool(ids.min() >= 0 and ids.max() < rows)
        else:
            ok = not ids.size or not (np.any(ids < 0) or np.any(ids % n != me) or np.any(ids // n >= rows))
        if not ok:
            bad = ids[(ids < 0) | (ids % n != me) | (ids // n >= rows)][:5].tolist()
            raise PServerError(Status.INVALID_ARGUMENT,
                               f"{what}: ids {bad} are not in shard {me} of {n} of table {table!r} "
                               f"(ids r with r % {n} == {me} and r // {n} < {rows})",
                               hint="shard ids with split_ids before sending them")
        return ids if n == 1 else ids // n

    def _local_rows(self, name: str, value: SelectedRows) -> SelectedRows:
        param = self.config.sparse_grad_to_param[self._received[name].copy_of or name]
        local = self._local_ids(f"send of {name!r}", np.asarray(value.rows), param)
        return SelectedRows(local, value.values, self.program.global_block().var(param).shape[0])


def checkpoint_dir(dirname: str, pserver_id: int) -> str:
    """Where pserver ``pserver_id`` saves and loads its part of a checkpoint under ``dirname``."""
    return os.path.join(dirname, f"pserver_{pserver_id}")


def resolve_checkpoint(root: str | None, name: str, pserver_id: int) -> str:
    """``name/pserver_<id>`` for an absolute ``name``; ``root/name/pserver_<id>`` for a relative one that
    stays under ``root`` once every symlink is resolved; PServerError INVALID_ARGUMENT otherwise."""
    what = f"CheckpointNotify of {name!r}"
    hint = ("name a checkpoint by an absolute path, or by a relative path under the pserver's checkpoint root "
            "(FLOTILLA_CHECKPOINT_ROOT)")
    if not name or "\0" in name:
        raise PServerError(Status.INVALID_ARGUMENT, f"{what}: the checkpoint name is empty or holds NUL", hint=hint)
    if os.path.isabs(name):
        return os.path.join(os.path.normpath(name), f"pserver_{pserver_id}")
    if root is None:
        raise PServerError(Status.INVALID_ARGUMENT, f"{what}: a relative name needs a checkpoint root", hint=hint)
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        raise PServerError(Status.INVALID_ARGUMENT, f"{what}: '..' is refused", hint=hint)
    real_root = os.path.realpath(root)
    path = os.path.join(real_root, name, f"pserver_{pserver_id}")
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root or real == real_root:
        raise PServerError(Status.INVALID_ARGUMENT, f"{what}: it leads out of the checkpoint root {real_root} "
                           f"(to {real}) through a symlink", hint=hint)
    return real


def _log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _nonfinite_count(value: Any) -> int:
    """How many NaN/Inf values a received floating value holds (0 for integer dtypes)."""
    values = value.values if isinstance(value, SelectedRows) else value
    arr = np.asarray(values)
    if arr.dtype.kind != "f" or not arr.size:
        return 0
    if _all_finite(arr.reshape(-1)):  # the common case: one pass, no large temporary
        return 0
    return int(arr.size - np.count_nonzero(np.isfinite(arr)))


_FINITE_CHUNK = 1 << 16  # elements per step of the check: its flags stay in the cache


def _all_finite(flat: np.ndarray) -> bool:
    """Whether every value of the 1-D floating ``flat`` is finite, checked a cache-sized chunk at a time
    (a whole-array ``isfinite`` writes and rereads a flag per element: 1.5x slower on 64 MiB here)."""
    flags = np.empty(min(flat.size, _FINITE_CHUNK), bool)
    for at in range(0, flat.size, _FINITE_CHUNK):
        piece = flat[at:at + _FINITE_CHUNK]
        out = flags[:piece.size]
        np.isfinite(piece, out=out)
        if not out.all():
            return False
    return True


def _scaled(value: Any, factor: float) -> Any:
    if isinstance(value, SelectedRows):
        values = np.asarray(value.values)
        return SelectedRows(value.rows, values * values.dtype.type(factor), value.height)
    arr = np.asarray(value)
    return arr * arr.dtype.type(factor)


#: How many distinct optimize-block sets a pserver runs merged (each is one plan, compiled per row count
#: of its selected rows); requests carrying other sets run block by block. Clients batch a step's sends
#: the same way every step, so a job uses a handful.
_MAX_MERGED_SETS = 16

_NONFINITE_HINT = ("lower the learning rate, clip gradients, or check the input data "
                   "(FLAGS_pserver_check_finite=0 turns this check off)")


def _overwritten(program: Program, idx: int) -> frozenset[str]:
    """The variables block ``idx`` reads and then writes (a parameter, an accumulator, a counter)."""
    reads: set[str] = set()
    writes: set[str] = set()
    for op in program.block(idx).ops:
        reads.update(op.input_arg_names)
        writes.update(op.output_arg_names)
    return frozenset(reads & writes)


def _copy(value: Any) -> Any:
    if isinstance(value, SelectedRows):
        return SelectedRows(value.rows, _copy(value.values), value.height)
    if isinstance(value, np.ndarray):
        return value.copy()
    return jnp.array(value, copy=True)


@jax.jit
def _finite_flags(values: tuple[Any, ...]) -> Any:
    return jnp.stack([jnp.isfinite(v).all() for v in values])


class _Update(Scope):
    """The scope of a checked update: reads fall through to the request's scope and the pserver's; the
    pserver's variables the blocks overwrite are read as copies (the executor donates what it
    overwrites, and a refused update must leave the originals intact); writes are held here until
    ``commit``. The ``unchecked`` variables are neither copied nor checked: gradients (this step's
    alone; the parameters they update are checked) and what selected rows update in place (tables)."""

    def __init__(self, inputs: Scope, shared: Scope, overwritten: set[str], unchecked: frozenset[str],
                 own: frozenset[str] | None) -> None:
        super().__init__(inputs)
        self._shared = shared
        self._own = own
        self._unchecked = unchecked
        self.written: dict[str, None] = {}
        self.bad: list[str] | None = None  # the checked variables the executor found NaN/Inf in (None: not checked)
        for name in sorted(overwritten - unchecked):
            value = shared.find_var(name)
            if value is not None:
                super().set_var(name, _copy(value))

    def set_var(self, name: str, value: Any) -> None:
        super().set_var(name, value)
        self.written[name] = None

    def nonfinite(self) -> tuple[str, int] | None:
        """The first written floating variable (a parameter, an accumulator, a learning rate; not an
        ``unchecked`` one) holding NaN or Inf and how many it holds, or None (one fused check over every
        such value, made by the executor in the blocks' own call when it set ``bad``)."""
        if self.bad is not None:
            return (self.bad[0], _nonfinite_count(self.find_var(self.bad[0]))) if self.bad else None
        names, values = [], []
        for name in self.written:
            if name in self._unchecked:
                continue
            value = self.find_var(name)
            arr = value.values if isinstance(value, SelectedRows) else value
            if getattr(arr, "dtype", None) is not None and jnp.issubdtype(arr.dtype, jnp.floating) and arr.size:
                names.append(name)
                values.append(arr)
        if not values:
            return None
        flags = np.asarray(_finite_flags(tuple(values)))
        if flags.all():
            return None
        first = int(np.flatnonzero(~flags)[0])
        return names[first], _nonfinite_count(values[first])

    def commit(self, unchecked_only: bool = False) -> None:
        """Write the results to the pserver's scope: every one (``own`` None), or (a request's update) those
        of the pserver's own variables (held by it, or in ``own``), as ``_WriteThrough`` would have. With
        ``unchecked_only`` (a refused update) just the unchecked ones: tables updated in place, whose old
        buffers the executor donated."""
        for name in self.written:
            if unchecked_only and name not in self._unchecked:
                continue
            if self._own is None or name in self._own or self._shared.find_var(name) is not None:
                self._shared.set_var(name, self.find_var(name))


class _WriteThrough(Scope):
    """A request's scope: reads fall through; writes of the pserver's own variables (held by it, or in
    ``own``) go to it."""

    def __init__(self, local: Scope, shared: Scope, own: frozenset[str] | None = None) -> None:
        super().__init__(local)
        self._shared = shared
        self._own = own or frozenset()

    def set_var(self, name: str, value: Any) -> None:
        if name in self._own or self._shared.find_var(name) is not None:
            self._shared.set_var(name, value)
        else:
            super().set_var(name, value)


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NO_LOCK = _NoLock()


class _all:
    """Hold every lock of ``locks`` (acquired in a fixed order)."""

    def __init__(self, locks: Any) -> None:
        self._locks = list(locks)

    def __enter__(self) -> None:
        for lock in self._locks:
            lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        for lock in reversed(self._locks):
            lock.release()


def _pad_rows(value: SelectedRows) -> SelectedRows:
    """``value`` with its rows padded to a power of two by rows ``height`` with zero values, which every
    sparse kernel ignores: the compiled optimize blocks then see a few row counts, not one per step."""
    n = len(value.rows)
    size = padded_size(n)
    if size == n:
        return value
    rows = np.concatenate([np.asarray(value.rows), np.full(size - n, value.height, np.int64)])
    values = np.asarray(value.values)
    values = np.concatenate([values, np.zeros((size - n,) + values.shape[1:], values.dtype)])
    return SelectedRows(rows, values, value.height)
