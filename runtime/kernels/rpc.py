"""Kernels of the parameter-server ops: the trainer's network ops, the split/merge helpers around
them, and the pserver's ``listen_and_serv`` and ``lookup_sparse_table``.

Network kernels talk through the executor's ``RPCClient`` for the op's ``trainer_id`` and remember
what batches across ops in its ``TrainerKernelState`` (both in ``Executor.rpc_session``). ``split_byref`` is an ordinary JAX kernel; the other helpers run on
the host because their output sizes depend on the data (ids, rows).

Distributed lookup tables shard ids by ``id % n`` over the ``n`` pservers: ``split_ids`` de-duplicates
and sorts the ids (or buckets a selected-rows gradient's rows, keeping global ids and the height; like
``split_selected_rows`` it first merges duplicate rows, so only touched rows travel, each once),
``prefetch`` asks each pserver for its shard's rows, ``merge_ids`` puts them back in the ids' order.
The ids are sorted once a step (``runtime.rows.UniqueIds``, kept in the executor's RPC session): the
inverse of that sort places the fetched rows and merges the table gradient's duplicate rows.

Geo-SGD's ``geo_sync`` keeps its state in the program (the step counter, the snapshots and the table's
touched-rows mask are persistable variables), so the kernel holds none; ``geo_table_init`` fills the
table's state at startup.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from ir.core import Operator, Program
from ir.dist_info import distributed_role
from runtime.flags import flag
from runtime.kernels.registry import host_kernel, kernel, one
from runtime.rows import UniqueIds, gather_rows, set_rows, sum_rows
from runtime.rpc.session import TrainerKernelState
from runtime.scope import ExecutionError, SelectedRows


def _client(ctx: Any, op: Operator) -> Any:
    """The executor's client for the op's trainer, announced to every pserver ``ctx.program`` talks to
    (all at once, so a restarted trainer joins every pserver at the same step)."""
    trainer_id = int(op.attr("trainer_id"))
    client = ctx.executor.rpc_session.client(trainer_id)
    announced = _state(ctx, op).announced_programs
    key = (id(ctx.program), ctx.program.version)
    if key not in announced:
        dist = distributed_role(ctx.program)
        client.announce(dist.endpoints if dist is not None and dist.kind == "trainer" else [])
        announced.add(key)
    return client


def _state(ctx: Any, op: Operator) -> TrainerKernelState:
    """What these kernels remember between ops for the op's trainer (its executor's session holds it)."""
    return ctx.executor.rpc_session.kernel_state(int(op.attr("trainer_id")))


def _value(ctx: Any, name: str, op: Operator) -> Any:
    value = ctx.scope.find_var(name)
    if value is None:
        raise ExecutionError(f"{op.type}: input {name!r} has no value", hint="the op producing it did not run")
    return value


def _ids(value: Any) -> np.ndarray:
    return np.asarray(value).astype(np.int64, copy=False).reshape(-1)


# --- trainer network ops
@host_kernel("send")
def send(ctx: Any, op: Operator) -> None:
    """Queue the op's gradients; the last ``send`` of a run of consecutive ones puts the run's
    gradients on the wire, one request per pserver."""
    if op.attr("send_varnames"):
        raise ExecutionError("send with send_varnames (runtime splitting) is not supported",
                             hint="transpile with flotilla's DistributeTranspiler, which splits with split_byref")
    client = _client(ctx, op)
    for name, endpoint in zip(op.input("X"), op.attr("epmap")):
        client.send(endpoint, name, _value(ctx, name, op))
    if _runs(ctx, op).run_of(op)[-1] is op:
        client.flush()


@host_kernel("recv")
def recv(ctx: Any, op: Operator) -> None:
    """Fetch the op's parameter blocks. The first ``recv`` of a run of consecutive ``recv`` ops (the
    trainer rewrite appends one per parameter) fetches the blocks of the whole run at once, one request
    per pserver, every pserver in flight together; the others then find their blocks already in the
    scope. Nothing runs between them, so fetching early is the same as fetching in turn.

    In an async trainer program (sends, no barriers) the fetch is the client's background ``pull``:
    the values are at most ``FLAGS_communicator_max_staleness`` steps behind this trainer's sends."""
    client, state = _client(ctx, op), _state(ctx, op)
    if id(op) in state.recv_ahead:
        state.recv_ahead.discard(id(op))
        return
    runs = _runs(ctx, op)
    group = runs.run_of(op) if runs.run_of(op)[0] is op else [op]
    for r in group:
        if r.attr("recv_varnames"):
            raise ExecutionError("recv with recv_varnames (runtime merging) is not supported",
                                 hint="transpile with flotilla's DistributeTranspiler, which merges with concat")
    pairs = [(ep, name) for r in group for ep, name in zip(r.attr("epmap"), r.output("Out"))]
    if runs.async_trainer:
        held = all(ctx.scope.find_var(name) is not None for _, name in pairs)
        values = client.pull((id(ctx.program), ctx.block.idx, id(op)), pairs, runs.max_staleness, held)
    else:
        values = client.get(pairs)
    if values is not None:
        for (_, name), value in zip(pairs, values):
            ctx.scope.set_var(name, value)
    state.recv_ahead = {id(r) for r in group[1:]}


class _BlockRuns:
    """A block's runs of consecutive network ops of one type and trainer, and whether the block is an
    async trainer program (it sends and has no barriers)."""

    def __init__(self, ops: list[Operator]) -> None:
        self._runs: dict[int, list[Operator]] = {}
        i = 0
        while i < len(ops):
            j = i + 1
            if ops[i].type in ("send", "recv"):
                while (j < len(ops) and ops[j].type == ops[i].type
                       and ops[j].attr("trainer_id") == ops[i].attr("trainer_id")):
                    j += 1
                for o in ops[i:j]:
                    self._runs[id(o)] = ops[i:j]
            i = j
        types = {o.type for o in ops}
        self.async_trainer = "send" in types and not types & {"send_barrier", "fetch_barrier"}
        self.max_staleness = flag("FLAGS_communicator_max_staleness")

    def run_of(self, op: Operator) -> list[Operator]:
        return self._runs.get(id(op)) or [op]


def _runs(ctx: Any, op: Operator) -> _BlockRuns:
    """The runs of ``ctx.block``, cached in the op's trainer state per program version and block."""
    per_program = _state(ctx, op).op_runs.setdefault(ctx.program, {})
    key = (ctx.program.version, ctx.block.idx)
    runs = per_program.get(key)
    if runs is None:
        for stale in [k for k in per_program if k[0] != key[0]]:
            del per_program[stale]  # an older version's runs are dead
        runs = per_program[key] = _BlockRuns(ctx.block.ops)
    return runs


@host_kernel("geo_sync")
def geo_sync(ctx: Any, op: Operator) -> None:
    """Geo-SGD. Count the step and mark the table rows looked up; every ``push_nums``-th step: send each
    parameter block's change since the last sync (``X - Snapshot``, in the parameter's dtype) as its
    delta name, and the touched table rows' change (``Table - TableSnapshot``, selected rows with global
    ids, one shard per pserver); then fetch the merged blocks and the table rows any trainer changed since
    this one's last sync (the client's ``get`` waits for the sends first), and make them the parameters'
    and the table's values and snapshots. Parameters and snapshots are numpy arrays (the next compiled
    step reads them from the scope); the table stays a device array, updated in place."""
    step = int(np.asarray(_value(ctx, op.input("Step")[0], op)).reshape(-1)[0]) + 1
    ctx.scope.set_var(op.output("StepOut")[0], np.array([step], np.int64))
    table = op.input("Table")[0] if op.input("Table") else None
    if table is not None:
        touched = _owned(ctx, op.input("Touched")[0], op)
        for name in op.input("TableIds"):
            ids = _ids(_value(ctx, name, op))
            if len(ids) and (ids.min() < 0 or ids.max() >= len(touched)):
                bad = ids[(ids < 0) | (ids >= len(touched))][:5].tolist()
                raise ExecutionError(f"geo_sync: ids {bad} of {name!r} are outside the {len(touched)} rows of "
                                     f"table {table!r}", hint="feed ids in [0, rows) of the embedding")
            touched[ids] = True
        ctx.scope.set_var(op.output("TouchedOut")[0], touched)
    if step % int(op.attr("push_nums")):
        return
    client = _client(ctx, op)
    counts, sections = list(op.attr("block_counts")), list(op.attr("sections"))
    epmap, blocks, deltas = list(op.attr("epmap")), list(op.attr("block_names")), list(op.attr("delta_names"))
    start = 0
    for param, snapshot, count in zip(op.input("X"), op.input("Snapshot"), counts):
        now = np.asarray(_value(ctx, param, op))
        delta = now - np.asarray(_value(ctx, snapshot, op), dtype=now.dtype)
        bounds = np.cumsum(sections[start:start + count])[:-1].tolist()
        for piece, endpoint, name in zip(np.split(delta, bounds, axis=0), epmap[start:start + count],
                                         deltas[start:start + count]):
            client.send(endpoint, name, np.ascontiguousarray(piece))
        start += count
    fetch = list(zip(epmap, blocks))
    if table is not None:
        table_eps = list(op.attr("table_epmap"))
        _send_table_delta(ctx, op, client, table, table_eps)
        fetch += [(ep, op.attr("table_updates_name")) for ep in table_eps]
    merged = client.get(fetch)
    start = 0
    for param, snapshot, count in zip(op.output("Out"), op.output("SnapshotOut"), counts):
        pieces = [np.asarray(v) for v in merged[start:start + count]]
        value = np.concatenate(pieces, axis=0) if count > 1 else np.array(pieces[0], copy=True)
        ctx.scope.set_var(param, value)
        ctx.scope.set_var(snapshot, value.copy())  # never aliased with the parameter (donated next step)
        start += count
    if table is not None:
        _apply_table_updates(ctx, op, table, merged[len(blocks):])


def _owned(ctx: Any, name: str, op: Operator) -> np.ndarray:
    """The host array of ``name``, writable (Geo-SGD's snapshots and masks are updated in place)."""
    value = np.asarray(_value(ctx, name, op))
    return value if value.flags.writeable else value.copy()


def _send_table_delta(ctx: Any, op: Operator, client: Any, table: str, endpoints: list[str]) -> None:
    """Queue the change of every table row touched since the last sync, one shard per pserver (rows
    ``r % n == i`` to ``endpoints[i]``), and clear the touched mask."""
    touched = _owned(ctx, op.input("Touched")[0], op)
    rows = np.flatnonzero(touched)
    touched[rows] = False
    ctx.scope.set_var(op.output("TouchedOut")[0], touched)
    delta = gather_rows(_value(ctx, table, op), rows) - _owned(ctx, op.input("TableSnapshot")[0], op)[rows]
    shard = rows % len(endpoints)
    for i, endpoint in enumerate(endpoints):
        mine = shard == i
        if mine.any():
            client.send(endpoint, op.attr("table_delta_name"), SelectedRows(rows[mine], delta[mine], len(touched)))


def _apply_table_updates(ctx: Any, op: Operator, table: str, updates: list[Any]) -> None:
    """Write the table rows the pservers answered (selected rows, global ids) into the table and its
    snapshot."""
    snapshot = _owned(ctx, op.input("TableSnapshot")[0], op)
    for update in updates:
        if not isinstance(update, SelectedRows):
            raise ExecutionError(f"geo_sync: the pserver answered {op.attr('table_updates_name')!r} with a dense "
                                 "tensor; expected selected rows", hint="the pserver runs a different program")
    rows = np.concatenate([np.asarray(u.rows, np.int64) for u in updates])
    values = np.concatenate([np.asarray(u.values) for u in updates]).astype(snapshot.dtype, copy=False)
    if len(rows) and (rows.min() < 0 or rows.max() >= len(snapshot) or values.shape[1:] != snapshot.shape[1:]):
        raise ExecutionError(f"geo_sync: the pservers answered rows outside table {table!r} "
                             f"{list(snapshot.shape)} (or rows of another width)",
                             hint="the pservers run a different program")
    snapshot[rows] = values
    ctx.scope.set_var(op.output("TableSnapshotOut")[0], snapshot)
    ctx.scope.set_var(op.output("TableOut")[0], set_rows(_value(ctx, table, op), rows, values))


@host_kernel("geo_table_init")
def geo_table_init(ctx: Any, op: Operator) -> None:
    """Fetch every shard of the distributed table (shard ``i`` of ``n`` holds rows ``i, i + n, ...``), put
    them together into the table, copy it into the snapshot and clear the touched mask."""
    epmap, name = list(op.attr("epmap")), op.attr("table_name")
    rows, width, dtype = int(op.attr("rows")), int(op.attr("width")), np.dtype(op.attr("dtype"))
    n = len(epmap)
    table = np.empty((rows, width), dtype)
    for i, (endpoint, shard) in enumerate(zip(epmap, _client(ctx, op).get([(ep, name) for ep in epmap]))):
        shard = np.asarray(shard)
        mine = len(range(i, rows, n))
        if shard.ndim != 2 or shard.shape[0] < mine or shard.shape[1] != width or shard.dtype != dtype:
            raise ExecutionError(f"geo_table_init: pserver {endpoint} holds {name!r} as {shard.dtype}"
                                 f"{list(shard.shape)}; expected {dtype}[{-(-rows // n)}, {width}] (shard {i} of {n})",
                                 hint="the pservers run a different program; transpile them together")
        table[i::n] = shard[:mine]
    ctx.scope.set_var(op.output("Table")[0], table)
    ctx.scope.set_var(op.output("TableSnapshot")[0], table.copy())
    ctx.scope.set_var(op.output("Touched")[0], np.zeros(rows, bool))


@host_kernel("send_barrier")
def send_barrier(ctx: Any, op: Operator) -> None:
    _client(ctx, op).barrier(op.attr("endpoints"), send=True)


@host_kernel("fetch_barrier")
def fetch_barrier(ctx: Any, op: Operator) -> None:
    _client(ctx, op).barrier(op.attr("endpoints"), send=False)


@host_kernel("checkpoint_notify")
def checkpoint_notify(ctx: Any, op: Operator) -> None:
    _client(ctx, op).checkpoint(op.attr("epmap"), op.attr("dir"))


@host_kernel("prefetch")
def prefetch(ctx: Any, op: Operator) -> None:
    names = op.input("X")
    requests = [(ep, name, _ids(_value(ctx, name, op)).reshape(-1, 1), table)
                for name, ep, table in zip(names, op.attr("epmap"), op.attr("table_names") or [""] * len(names))]
    for out, rows in zip(op.output("Out"), _client(ctx, op).prefetch(requests)):
        ctx.scope.set_var(out, rows)


# --- splitting and merging
@kernel("split_byref")
def split_byref(ins: dict[str, list[Any]], attrs: dict[str, Any]) -> dict[str, list[Any]]:
    x = one(ins, "X")
    sections = list(attrs.get("sections") or [])
    bounds = np.cumsum(sections)[:-1].tolist()
    return {"Out": list(jnp.split(x, bounds, axis=0))}


@host_kernel("split_selected_rows")
def split_selected_rows(ctx: Any, op: Operator) -> None:
    x = _value(ctx, op.input("X")[0], op)
    if not isinstance(x, SelectedRows):
        raise ExecutionError(f"split_selected_rows: X {op.input('X')[0]!r} is dense; expected selected rows")
    rows, values = _merged_rows(ctx, op, x)
    start = 0
    for name, height in zip(op.output("Out"), op.attr("height_sections")):
        mask = (rows >= start) & (rows < start + height)
        ctx.scope.set_var(name, SelectedRows(rows[mask] - start, values[mask], int(height)))
        start += height


@dataclass(frozen=True)
class _SplitIds:
    """What a dense ``split_ids`` run of this step made, for ``merge_ids`` and the gradient's merge: the
    ids sorted once, the Ids values it read and the shard arrays it wrote (the very objects: a later op
    uses the bookkeeping only when it reads these same objects)."""

    ids: UniqueIds
    sources: tuple[Any, ...]
    shards: tuple[np.ndarray, ...]

    def index(self) -> np.ndarray:
        """For each id (all Ids inputs end to end), its row in the shards' rows laid end to end."""
        if len(self.shards) == 1:
            return self.ids.inverse
        return self.ids.shard_positions(len(self.shards))[self.ids.inverse]


@host_kernel("split_ids")
def split_ids(ctx: Any, op: Operator) -> None:
    """Dense ids: sorted unique ids, shard ``k`` of ``n`` taking ``id % n == k``; the sort (with its
    inverse) is remembered for ``merge_ids`` and the gradient (``runtime.rows.UniqueIds``). Selected rows
    (a gradient): duplicate rows merged, bucketed by the same rule, global ids and height kept."""
    outs = op.output("Out")
    n = len(outs)
    first = _value(ctx, op.input("Ids")[0], op)
    if isinstance(first, SelectedRows):
        rows, values = _merged_rows(ctx, op, first)
        if n == 1:
            ctx.scope.set_var(outs[0], SelectedRows(rows, values, first.height))
            return
        shard = rows % n
        for i, name in enumerate(outs):
            mask = shard == i
            ctx.scope.set_var(name, SelectedRows(rows[mask], values[mask], first.height))
        return
    sources = tuple(_value(ctx, name, op) for name in op.input("Ids"))
    flat = [_ids(v) for v in sources]
    ids = ctx.executor.rpc_session.id_sorter(np.concatenate(flat) if len(flat) > 1 else flat[0])
    shards = tuple(ids.unique.reshape(-1, 1) if n == 1 else ids.unique[ids.unique % n == i].reshape(-1, 1)
                   for i in range(n))
    for name, shard in zip(outs, shards):
        ctx.scope.set_var(name, shard)
    ctx.executor.rpc_session.split_ids[tuple(outs)] = _SplitIds(ids, sources, shards)


def _merged_rows(ctx: Any, op: Operator, x: SelectedRows) -> tuple[np.ndarray, Any]:
    """``x``'s rows merged (sorted unique rows, the values of each summed). When the rows are the ids a
    ``split_ids`` of this executor sorted (a distributed table's gradient: one row per id looked up), that
    sort is reused and the sum is compiled (``runtime.rows.sum_rows``); otherwise numpy merges them."""
    rows = np.asarray(x.rows).reshape(-1)
    for split in ctx.executor.rpc_session.split_ids.values():
        if len(split.ids.ids) == len(rows) and np.array_equal(split.ids.ids, rows):
            return split.ids.unique, sum_rows(x.values, split.ids.inverse, len(split.ids.unique))
    return merge_duplicate_rows(rows, np.asarray(x.values))


def merge_duplicate_rows(rows: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique rows and the summed values of each: only touched rows travel, each once. One
    stable sort and one segmented sum (``np.add.reduceat``): about half the time of ``np.unique`` plus
    ``np.add.at`` on a CTR step's 13k rows."""
    order = np.argsort(rows, kind="stable")
    ordered = rows[order]
    starts = _run_starts(ordered)
    if len(starts) == len(ordered):
        return ordered, values[order]
    return ordered[starts], np.add.reduceat(values[order], starts, axis=0)


def _run_starts(ordered: np.ndarray) -> np.ndarray:
    """Indices where a new value starts in the sorted array ``ordered``."""
    if not len(ordered):
        return np.zeros((0,), np.intp)
    return np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))


@host_kernel("merge_ids")
def merge_ids(ctx: Any, op: Operator) -> None:
    """Each Ids input's rows, in its order, from the shards' rows (``X``) of the shards' ids (``Rows``).
    When ``Rows`` are the shards a ``split_ids`` of this step cut from these very Ids, its sort gives each
    id's row (one numpy gather: in the trainer it took 0.17 ms of the main thread a CTR step, against
    0.48 ms for a compiled gather, which also needs a host-to-device copy of the rows); otherwise the ids
    are looked up by binary search."""
    split = ctx.executor.rpc_session.split_ids.get(tuple(op.input("Rows")))
    ids_values = [_value(ctx, name, op) for name in op.input("Ids")]
    if (split is not None and len(split.sources) == len(ids_values)
            and all(a is b for a, b in zip(split.sources, ids_values))
            and all(a is _value(ctx, name, op) for a, name in zip(split.shards, op.input("Rows")))):
        _merge_split(ctx, op, split, ids_values)
        return
    shard_ids = [_ids(_value(ctx, name, op)) for name in op.input("Rows")]
    shard_rows = [np.asarray(_value(ctx, name, op)) for name in op.input("X")]
    all_ids = np.concatenate(shard_ids)
    all_rows = np.concatenate([r.reshape((len(i),) + tuple(np.shape(r)[1:])) for i, r in zip(shard_ids, shard_rows)]) if len(all_ids) else None
    width = shard_rows[0].shape[1:] if shard_rows else ()
    order = np.argsort(all_ids, kind="stable")
    sorted_ids = all_ids[order]
    for ids_name, out, ids_value in zip(op.input("Ids"), op.output("Out"), ids_values):
        ids_value = np.asarray(ids_value)
        flat = _ids(ids_value)
        pos = np.searchsorted(sorted_ids, flat)
        if len(flat) and (np.any(pos >= len(sorted_ids)) or np.any(sorted_ids[np.minimum(pos, len(sorted_ids) - 1)]
                                                                    != flat)):
            raise ExecutionError(f"merge_ids: some ids of {ids_name!r} were not fetched from any shard")
        lead = _lead_shape(ids_value.shape)
        dtype = shard_rows[0].dtype if shard_rows else np.float32
        merged = all_rows[order[pos]] if len(flat) else np.zeros((0,) + tuple(width), dtype)
        ctx.scope.set_var(out, merged.reshape(tuple(lead) + tuple(width)))


def _merge_split(ctx: Any, op: Operator, split: _SplitIds, ids_values: list[Any]) -> None:
    """``merge_ids`` by ``split``'s sort: every id's row is known without a search."""
    xs = []
    for name, shard in zip(op.input("X"), split.shards):
        x = np.asarray(_value(ctx, name, op))
        if not x.ndim or x.shape[0] != len(shard):
            raise ExecutionError(f"merge_ids: {name!r} holds {x.shape[0] if x.ndim else 0} rows for the "
                                 f"{len(shard)} ids of its shard", hint="the pserver answered another prefetch")
        xs.append(x)
    rows = np.concatenate(xs) if len(xs) > 1 else xs[0]
    index = split.index()
    start = 0
    for out, ids_value in zip(op.output("Out"), ids_values):
        count = int(np.size(ids_value))
        merged = _aligned_empty(ctx, (count,) + tuple(rows.shape[1:]), rows.dtype)
        # In range by construction (the shapes were checked above); mode 'raise' would buffer the whole
        # output first (0.10 ms against 0.035 ms for a CTR step's rows).
        np.take(rows, index[start:start + count], axis=0, out=merged, mode="clip")
        merged.flags.writeable = False
        ctx.scope.set_var(out, merged.reshape(_lead_shape(np.shape(ids_value)) + tuple(rows.shape[1:])))
        start += count


def _aligned_empty(ctx: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An array of ``shape`` in pooled, page-aligned memory (``runtime.rpc.stream.ReceiveBuffers``: handed
    out again only once nothing refers to it): the compiled step reading it uses it in place, where numpy's
    16-byte-aligned memory would be copied into every call (~0.1 ms a CTR step's 850 KB of rows)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = ctx.executor.rpc_session.host_buffers.take(nbytes)
    return buf[:nbytes].view(dtype).reshape(shape)


def _lead_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The lookup's lead shape of ids of ``shape``: a trailing 1 dropped."""
    return shape[:-1] if shape and shape[-1] == 1 else shape


# --- pserver ops
@host_kernel("lookup_sparse_table")
def lookup_sparse_table(ctx: Any, op: Operator) -> None:
    table = np.asarray(_value(ctx, op.input("W")[0], op))
    ids_value = np.asarray(_value(ctx, op.input("Ids")[0], op))
    flat = _ids(ids_value)
    if len(flat) and (flat.min() < 0 or flat.max() >= table.shape[0]):
        raise ExecutionError(f"lookup_sparse_table: ids outside the {table.shape[0]} rows of {op.input('W')[0]!r}")
    rows = np.take(table, flat, axis=0, mode="clip")  # in range (checked above); half the time of table[flat]
    padding = int(op.attr("padding_idx"))
    if padding >= 0:
        rows = np.where((flat == padding)[:, None], 0, rows)
    lead = ids_value.shape[:-1] if ids_value.ndim and ids_value.shape[-1] == 1 else ids_value.shape
    ctx.scope.set_var(op.output("Out")[0], rows.reshape(tuple(lead) + table.shape[1:]))


@host_kernel("ref_by_trainer_id")
def ref_by_trainer_id(ctx: Any, op: Operator) -> None:
    t = int(_ids(_value(ctx, op.input("TrainerId")[0], op))[0])
    names = op.input("X")
    if not 0 <= t < len(names):
        raise ExecutionError(f"ref_by_trainer_id: trainer id {t} is out of range for {len(names)} inputs")
    ctx.scope.set_var(op.output("Out")[0], _value(ctx, names[t], op))


def max_message_bytes(program: Program) -> int:
    """Bytes of the largest variable of ``program``'s global block (-1 extents count as 1; selected rows
    with their row ids) plus headroom."""
    largest = 0
    for var in program.global_block().vars.values():
        if var.type == "raw":
            continue
        numel = int(np.prod([max(d, 1) for d in var.shape], dtype=np.int64))
        ids = max(var.shape[0], 1) * 8 if var.type == "selected_rows" else 0  # the int64 row ids
        largest = max(largest, numel * np.dtype(var.dtype).itemsize + ids)
    return largest + (1 << 20)


@host_kernel("listen_and_serv")
def listen_and_serv(ctx: Any, op: Operator) -> None:
    """Serve until every trainer has completed (then return) or the pserver fails (then raise)."""
    from runtime import io
    from runtime.flags import bool_flag, checkpoint_root, data_plane_mode, rpc_security
    from runtime.rpc.pserver import PServer, PServerError
    from runtime.rpc.server import start_server

    def run_block(idx: int, scope: Any) -> None:
        ctx.executor.run_block(ctx.program, idx, scope)

    def run_blocks(ids: tuple[int, ...], scope: Any, **kw: Any) -> list[str]:
        return ctx.executor.run_blocks(ctx.program, ids, scope, **kw)

    def save(path: str) -> None:
        io.save_checkpoint_part(ctx.executor, path, ctx.program, vars=io.pserver_checkpoint_vars(ctx.program),
                                scope=ctx.scope)

    # Every setting is read here, once, at the edge.
    security = rpc_security()
    pserver = PServer(ctx.program, ctx.scope, op, run_block, run_blocks=run_blocks, save_persistables=save,
                      barrier_timeout=flag("FLAGS_pserver_timeout_ms") / 1000.0,
                      checkpoint_root=checkpoint_root(), allow_rejoin=bool_flag("FLAGS_pserver_allow_rejoin"),
                      check_finite=bool_flag("FLAGS_pserver_check_finite"),
                      authenticated=security.authenticates_clients)
    endpoint = op.attr("endpoint")
    server = start_server(pserver, endpoint, max_message_bytes(ctx.program), security, data_plane_mode())
    mode = "sync" if pserver.config.sync_mode else "async"
    trust = ("token" if security.token else "no token") + (", TLS" if security.server_tls else "") + \
        (" (mutual)" if security.server_tls and security.ca else "")
    print(f"pserver {pserver.config.pserver_id} serving {endpoint} ({mode}, {pserver.config.trainers} trainers, "
          f"{trust})", file=sys.stderr, flush=True)
    try:
        pserver.wait()
    except PServerError as e:
        raise ExecutionError(str(e.message), hint=e.hint) from None
    finally:
        server.stop(grace=1.0).wait(5.0)
        pserver.close()
    print(f"pserver {pserver.config.pserver_id}: every trainer completed after {pserver.steps_run} updates; exiting",
          file=sys.stderr, flush=True)

