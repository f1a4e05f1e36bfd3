"""Op schemas: the rpc family (Fluid 1.5 names, slots and attributes) and the split/merge helpers
the parameter-server transpiler puts around them.

Invariants:
- Network ops (``send``, ``recv``, the barriers, ``prefetch``, ``listen_and_serv``, ``checkpoint_notify``,
  Geo-SGD's ``geo_sync`` and ``geo_table_init``) have the traits ``rpc``, ``host`` and ``side_effect``:
  they run on the host between compiled runs and are never removed or reordered. Those a trainer makes to
  its pservers with its ``trainer_id`` (all but ``listen_and_serv`` and ``checkpoint_notify``) are also
  ``trainer_rpc``: a program holding one is a transpiled trainer program. ``split_selected_rows``, ``split_ids``
  and ``merge_ids`` run on the host (``host`` only); ``split_byref`` is pure computation.
  ``lookup_sparse_table`` may grow its table (``auto_grown_table``), so it is ``host`` and
  ``side_effect``. No op here is differentiated (``NO_GRAD``).
- **Control dependencies.** Fluid orders the rpc ops through dummy variables: ``send`` writes
  ``Out``, ``send_barrier`` reads it, ``recv`` reads the barrier's output, and so on. Such a variable
  holds no tensor: it is declared with type ``raw``, shape ``[]`` and dtype ``float32``
  (``ir.ops.shapes.RAW_INFO``), and shape inference sets exactly that on every control-dependency
  output.
- Endpoint lists are checked where their length is fixed: ``send``'s ``epmap`` has one endpoint per
  ``X`` (per ``send_varnames`` entry when the runtime splits), ``recv``'s one per ``Out`` (per
  ``recv_varnames`` entry), ``prefetch``'s one per ``X`` and ``Out``; ``listen_and_serv``'s
  ``grad_to_block_id`` entries read ``"grad_name:block_idx"`` with a block of ``optimize_blocks``.
"""
from __future__ import annotations

from typing import NoReturn

from ir.errors import IRError
from ir.ops.registry import A, AttrKind as K, InferContext, NO_GRAD, VarInfo, defop
from ir.ops.shapes import set_raw

NETWORK_TRAITS = ("rpc", "host", "side_effect")
TRAINER_NETWORK_TRAITS = NETWORK_TRAITS + ("trainer_rpc",)
DEFAULT_ENDPOINT = "127.0.0.1:6164"


def _fail(ctx: InferContext, message: str, hint: str) -> NoReturn:
    raise IRError(f"{ctx.op_type}: {message}", hint=hint)


def _check_count(ctx: InferContext, attr: str, expected: int, what: str) -> None:
    """``attr`` (a list) has ``expected`` entries, one for each of ``what``."""
    got = len(ctx.attr(attr))
    if got != expected:
        _fail(ctx, f"attr {attr} has {got} entries but there are {expected} {what}; expected one entry each",
              f"give {attr} exactly one entry for each of the {what}")


def _infer_send(ctx: InferContext) -> None:
    names = ctx.attr("send_varnames")
    if names:
        _check_count(ctx, "epmap", len(names), "send_varnames entries")
        if ctx.attr("sections"):
            _check_count(ctx, "sections", len(names), "send_varnames entries")
    else:
        _check_count(ctx, "epmap", len(ctx.inputs("X")), "X variables")
    set_raw(ctx, "Out")


defop(
    "send",
    inputs=["X*"],
    outputs=["Out*?"],
    attrs=[
        A("epmap", K.STRINGS, [], "endpoint each X (or each send_varnames entry) is sent to"),
        A("sections", K.INTS, [], "rows of each piece when the runtime splits X (send_varnames given)"),
        A("send_varnames", K.STRINGS, [], "names of the pieces when the runtime splits X; empty: send X as is"),
        A("sync_mode", K.BOOL, False, "wait until every send completed (Fluid sets it in async training)"),
        A("trainer_id", K.INT, 0, "id of the sending trainer"),
    ],
    infer=_infer_send,
    grad=NO_GRAD,
    traits=TRAINER_NETWORK_TRAITS,
    doc="send each X to its pserver; Out are control-dependency (raw) variables",
)


def _infer_recv(ctx: InferContext) -> None:
    names = ctx.attr("recv_varnames")
    if names:
        _check_count(ctx, "epmap", len(names), "recv_varnames entries")
    else:
        _check_count(ctx, "epmap", ctx.num_outputs("Out"), "Out variables")


defop(
    "recv",
    inputs=["X*?"],
    outputs=["Out*"],
    attrs=[
        A("epmap", K.STRINGS, [], "endpoint each Out (or each recv_varnames entry) is fetched from"),
        A("recv_varnames", K.STRINGS, [], "names of the pieces when the runtime merges Out; empty: fetch Out as is"),
        A("sync_mode", K.BOOL, False, "wait until every fetch completed"),
        A("trainer_id", K.INT, 0, "id of the receiving trainer"),
    ],
    infer=_infer_recv,
    grad=NO_GRAD,
    traits=TRAINER_NETWORK_TRAITS,
    doc="fetch each Out from its pserver; X are control-dependency (raw) variables; Out keep their declared shapes",
)

defop(
    "send_barrier",
    inputs=["X*?"],
    outputs=["Out*?"],
    attrs=[
        A("endpoints", K.STRINGS, [], "every pserver endpoint"),
        A("trainer_id", K.INT, 0, "id of the trainer"),
        A("sync_mode", K.BOOL, True, "work in synchronous training"),
    ],
    infer=lambda ctx: set_raw(ctx, "Out"),
    grad=NO_GRAD,
    traits=TRAINER_NETWORK_TRAITS,
    doc="tell every pserver this trainer sent all its gradients of the step",
)

defop(
    "fetch_barrier",
    inputs=["X*?"],
    outputs=["Out*?"],
    attrs=[
        A("endpoints", K.STRINGS, [], "every pserver endpoint"),
        A("trainer_id", K.INT, 0, "id of the trainer"),
    ],
    infer=lambda ctx: set_raw(ctx, "Out"),
    grad=NO_GRAD,
    traits=TRAINER_NETWORK_TRAITS,
    doc="tell every pserver this trainer fetched all its parameters of the step",
)


def _infer_split_byref(ctx: InferContext) -> None:
    x = ctx.input("X")
    n = ctx.num_outputs("Out")
    if not x.shape:
        _fail(ctx, "X is a scalar (shape []); expected at least one dimension to split", "split a tensor by rows")
    sections = list(ctx.attr("sections"))
    rows = x.shape[0]
    if not sections:
        _fail(ctx, "sections is empty", "give sections: the rows of each output, one entry per Out")
    if len(sections) != n:
        _fail(ctx, f"sections {sections} has {len(sections)} entries but there are {n} outputs; expected one per Out",
              "give one row count per output")
    if any(s < 0 for s in sections) or (rows >= 0 and sum(sections) != rows):
        _fail(ctx, f"sections {sections} (sum {sum(sections)}) do not tile X's {rows} rows",
              "the row counts must be non-negative and add up to X's first dimension")
    ctx.set_output("Out", [VarInfo((s,) + tuple(x.shape[1:]), x.dtype, x.type) for s in sections])


defop(
    "split_byref",
    inputs=["X"],
    outputs=["Out*"],
    attrs=[A("sections", K.INTS, [], "rows of each output, one entry per Out (required)")],
    infer=_infer_split_byref,
    grad=NO_GRAD,
    doc="split X by rows into Out (views of X, no copy)",
)


def _infer_split_selected_rows(ctx: InferContext) -> None:
    x = ctx.input("X")
    sections = list(ctx.attr("height_sections"))
    n = ctx.num_outputs("Out")
    if len(sections) != n:
        _fail(ctx, f"height_sections {sections} has {len(sections)} entries but there are {n} outputs",
              "give one height per output")
    if x.shape and x.shape[0] >= 0 and sum(sections) != x.shape[0]:
        _fail(ctx, f"height_sections {sections} (sum {sum(sections)}) do not tile X's height {x.shape[0]}",
              "the heights must add up to X's first dimension")
    tail = tuple(x.shape[1:])
    ctx.set_output("Out", [VarInfo((h,) + tail, x.dtype, "selected_rows") for h in sections])


defop(
    "split_selected_rows",
    inputs=["X"],
    outputs=["Out*"],
    attrs=[A("height_sections", K.INTS, [], "height of each output; rows become section-relative")],
    infer=_infer_split_selected_rows,
    grad=NO_GRAD,
    traits=("host",),
    doc="split a selected_rows X into Out by height sections",
)


def _infer_split_ids(ctx: InferContext) -> None:
    ids = ctx.inputs("Ids")
    if not ids:
        _fail(ctx, "no Ids given", "give at least one ids variable")
    first = ids[0]
    if first.type == "selected_rows":
        ctx.set_output("Out", VarInfo(first.shape, first.dtype, "selected_rows"))
    else:
        ctx.set_output("Out", VarInfo((-1, 1), first.dtype))


defop(
    "split_ids",
    inputs=["Ids*"],
    outputs=["Out*"],
    infer=_infer_split_ids,
    grad=NO_GRAD,
    traits=("host",),
    doc="shard the de-duplicated, sorted ids (or a selected_rows' rows) by id % len(Out)",
)


def _lookup_shape(ids: tuple[int, ...], table: tuple[int, ...]) -> tuple[int, ...]:
    """Rows looked up for ``ids`` (a trailing 1 of ids is dropped, as in lookup_table)."""
    lead = ids[:-1] if ids and ids[-1] == 1 else ids
    return tuple(lead) + tuple(table[1:])


def _infer_merge_ids(ctx: InferContext) -> None:
    ids, xs = ctx.inputs("Ids"), ctx.inputs("X")
    if ctx.num_outputs("Out") != len(ids):
        _fail(ctx, f"{ctx.num_outputs('Out')} outputs for {len(ids)} Ids variables; expected one Out per Ids",
              "merge_ids writes one embedding output for each ids input")
    if len(ctx.inputs("Rows")) != len(xs):
        _fail(ctx, f"{len(ctx.inputs('Rows'))} Rows for {len(xs)} X; expected one Rows per X (shard)",
              "Rows are split_ids' outputs and X the rows fetched for each shard")
    if not xs:
        return
    ctx.set_output("Out", [VarInfo(_lookup_shape(i.shape, xs[0].shape), xs[0].dtype) for i in ids])


defop(
    "merge_ids",
    inputs=["Ids*", "Rows*", "X*"],
    outputs=["Out*"],
    infer=_infer_merge_ids,
    grad=NO_GRAD,
    traits=("host",),
    doc="gather, for every original id, its row from the shard X that holds it (Rows: each shard's ids)",
)


def _infer_prefetch(ctx: InferContext) -> None:
    n = len(ctx.inputs("X"))
    if ctx.num_outputs("Out") != n:
        _fail(ctx, f"{ctx.num_outputs('Out')} outputs for {n} X; expected one Out per X (id shard)",
              "each id shard is answered by one output")
    _check_count(ctx, "epmap", n, "X variables")


defop(
    "prefetch",
    inputs=["X*"],
    outputs=["Out*"],
    attrs=[
        A("epmap", K.STRINGS, [], "pserver each id shard X is sent to"),
        A("table_names", K.STRINGS, [], "name of the table slice on each pserver"),
        A("height_sections", K.INTS, [], "rows of each table slice"),
        A("trainer_id", K.INT, 0, "id of the trainer"),
    ],
    infer=_infer_prefetch,
    grad=NO_GRAD,
    traits=TRAINER_NETWORK_TRAITS,
    doc="fetch the rows of a distributed table for each id shard X into Out",
)


def _block_entries(ctx: InferContext, attr: str) -> list[tuple[str, int]]:
    entries = []
    for entry in ctx.attr(attr):
        name, sep, idx = entry.rpartition(":")
        if not sep or not name or not idx.lstrip("-").isdigit():
            _fail(ctx, f"attr {attr} entry {entry!r} is not of the form 'name:block_idx'",
                  "write each entry as '<variable name>:<block index>', e.g. 'fc_w@GRAD.block0:1'")
        entries.append((name, int(idx)))
    return entries


def _infer_listen_and_serv(ctx: InferContext) -> None:
    blocks = {b.idx for b in ctx.attr("optimize_blocks")}
    for name, idx in _block_entries(ctx, "grad_to_block_id"):
        if idx not in blocks:
            _fail(ctx, f"grad_to_block_id maps {name!r} to block {idx}, which is not in optimize_blocks {sorted(blocks)}",
                  "every gradient is applied by one of the optimize blocks")
    _block_entries(ctx, "prefetch_var_name_to_block_id")


defop(
    "listen_and_serv",
    inputs=["X*?"],
    attrs=[
        A("endpoint", K.STRING, DEFAULT_ENDPOINT, "ip:port this pserver listens on"),
        A("Fanin", K.INT, 1, "number of trainers"),
        A("optimize_blocks", K.BLOCKS, [], "blocks that apply the optimizer (the lr-decay block first, if any)"),
        A("grad_to_block_id", K.STRINGS, [], "'grad_name:block_idx': the block that applies each gradient"),
        A("sparse_grad_to_param", K.STRINGS, [], "'grad_name:param_name' for sparse gradients"),
        A("sync_mode", K.BOOL, True, "apply a step's gradients once every trainer's arrived"),
        A("pserver_id", K.INT, -1, "index of this endpoint among the pservers"),
        A("lr_decay_block_id", K.INT, -1, "block run once per step for learning-rate decay; -1: none"),
        A("prefetch_var_name_to_block_id", K.STRINGS, [], "'ids_var:block_idx': the block answering each prefetch"),
        A("checkpoint_block_id", K.INT, -1, "block that saves the distributed table; -1: none"),
        A("distributed_mode", K.INT, 0, "0 sync, 1 async, 2 half-async, 3 geo"),
        A("dc_asgd", K.BOOL, False, "delay-compensated async SGD"),
        A("pservers", K.INT, 1, "number of pservers; the stride of a distributed lookup table's row sharding "
          "(shard i holds global rows r with r % pservers == i)"),
    ],
    infer=_infer_listen_and_serv,
    grad=NO_GRAD,
    traits=NETWORK_TRAITS,
    doc="serve the trainers: receive gradients X, run the optimize blocks, answer fetches and prefetches",
)


def _infer_lookup_sparse_table(ctx: InferContext) -> None:
    w, ids = ctx.input("W"), ctx.input("Ids")
    ctx.set_output("Out", VarInfo(_lookup_shape(ids.shape, w.shape), w.dtype))


defop(
    "lookup_sparse_table",
    inputs=["W", "Ids"],
    outputs=["Out"],
    attrs=[
        A("padding_idx", K.INT, -1, "id whose row reads as zeros; -1: none"),
        A("is_test", K.BOOL, False, "do not grow the table (missing ids read as zeros)"),
        A("auto_grown_table", K.BOOL, True, "add a freshly initialised row for an id not in the table"),
        A("is_sparse", K.BOOL, True, "kept for Fluid compatibility (the transpiler sets it)"),
        A("is_distributed", K.BOOL, True, "kept for Fluid compatibility (the transpiler sets it)"),
    ],
    infer=_infer_lookup_sparse_table,
    grad=NO_GRAD,
    traits=("host", "side_effect"),
    doc="rows of the pserver's table slice W for Ids (the prefetch block's op)",
)

defop(
    "checkpoint_notify",
    inputs=["X*?"],
    attrs=[
        A("epmap", K.STRINGS, [], "every pserver endpoint"),
        A("dir", K.STRING, "", "directory the pservers save into"),
        A("lookup_table", K.STRING, "", "name of the distributed lookup table"),
    ],
    grad=NO_GRAD,
    traits=NETWORK_TRAITS,
    doc="ask every pserver to save its part of the distributed lookup table under dir",
)


def _infer_ref_by_trainer_id(ctx: InferContext) -> None:
    xs = ctx.inputs("X")
    if not xs:
        _fail(ctx, "no X given", "give one variable per trainer (the DC-ASGD backups of a parameter)")
    ctx.set_output("Out", VarInfo(xs[0].shape, xs[0].dtype, xs[0].type))


defop(
    "ref_by_trainer_id",
    inputs=["X*", "TrainerId"],
    outputs=["Out"],
    infer=_infer_ref_by_trainer_id,
    grad=NO_GRAD,
    traits=("host",),
    doc="Out = X[TrainerId]: the variable of the trainer whose request is served (DC-ASGD's backup)",
)



def _infer_geo_sync(ctx: InferContext) -> None:
    xs = ctx.inputs("X")
    for slot in ("Out", "SnapshotOut"):
        if ctx.num_outputs(slot) != len(xs):
            _fail(ctx, f"{ctx.num_outputs(slot)} {slot} for {len(xs)} X; expected one each (updated in place)",
                  "list the parameters in X and Out, their snapshots in Snapshot and SnapshotOut")
    if len(ctx.inputs("Snapshot")) != len(xs):
        _fail(ctx, f"{len(ctx.inputs('Snapshot'))} Snapshot for {len(xs)} X; expected one snapshot per parameter",
              "give each parameter's snapshot (its value at the last sync)")
    counts = list(ctx.attr("block_counts"))
    if len(counts) != len(xs) or any(c < 1 for c in counts):
        _fail(ctx, f"block_counts {counts} must have one entry >= 1 per X ({len(xs)} X)",
              "give the number of pserver blocks of each parameter")
    for attr in ("sections", "epmap", "block_names", "delta_names"):
        _check_count(ctx, attr, sum(counts), "parameter blocks")
    if ctx.attr("push_nums") < 1:
        _fail(ctx, f"push_nums is {ctx.attr('push_nums')}; expected >= 1", "sync every k >= 1 runs")
    sections = list(ctx.attr("sections"))
    start = 0
    for x, c in zip(xs, counts):
        rows = sections[start:start + c]
        start += c
        if not x.shape or (x.shape[0] >= 0 and sum(rows) != x.shape[0]):
            _fail(ctx, f"sections {rows} do not tile a parameter of shape {list(x.shape)}",
                  "the rows of a parameter's blocks must add up to its first dimension")
    ctx.set_output("Out", [VarInfo(x.shape, x.dtype, x.type) for x in xs])
    ctx.set_output("SnapshotOut", [VarInfo(x.shape, x.dtype, x.type) for x in xs])
    step = ctx.input("Step")
    ctx.set_output("StepOut", VarInfo(step.shape, step.dtype, step.type))
    if ctx.has_input("Table"):
        _infer_geo_table(ctx)


def _infer_geo_table(ctx: InferContext) -> None:
    """The distributed-table slots of ``geo_sync``: every one given, shapes agreeing with the table's."""
    for slot in ("TableSnapshot", "Touched"):
        if not ctx.has_input(slot):
            _fail(ctx, f"Table given without {slot}", "give the table's snapshot and touched-rows mask too")
    if not ctx.inputs("TableIds"):
        _fail(ctx, "Table given without TableIds", "give the ids of every lookup of the table")
    table, snapshot, touched = ctx.input("Table"), ctx.input("TableSnapshot"), ctx.input("Touched")
    if len(table.shape) != 2 or tuple(snapshot.shape) != tuple(table.shape):
        _fail(ctx, f"Table {list(table.shape)} and TableSnapshot {list(snapshot.shape)} must be one [rows, width] "
                   "shape", "the snapshot is a copy of the table")
    if tuple(touched.shape) != tuple(table.shape[:1]) or touched.dtype != "bool":
        _fail(ctx, f"Touched is {touched.dtype}{list(touched.shape)}; expected bool[{table.shape[0]}]",
              "the touched mask has one flag per table row")
    if not ctx.attr("table_epmap") or not ctx.attr("table_delta_name") or not ctx.attr("table_updates_name"):
        _fail(ctx, "Table given without table_epmap, table_delta_name and table_updates_name",
              "name the pserver of each shard, the delta's name and the updates' name")
    ctx.set_output("TableOut", VarInfo(table.shape, table.dtype, table.type))
    ctx.set_output("TableSnapshotOut", VarInfo(snapshot.shape, snapshot.dtype, snapshot.type))
    ctx.set_output("TouchedOut", VarInfo(touched.shape, touched.dtype, touched.type))


defop(
    "geo_sync",
    inputs=["X*?", "Snapshot*?", "Step", "Table?", "TableSnapshot?", "TableIds*?", "Touched?"],
    outputs=["Out*?", "SnapshotOut*?", "StepOut", "TableOut?", "TableSnapshotOut?", "TouchedOut?"],
    attrs=[
        A("block_counts", K.INTS, [], "number of pserver blocks of each X"),
        A("sections", K.INTS, [], "rows of each block (the blocks of X[0] first, in row order)"),
        A("epmap", K.STRINGS, [], "pserver holding each block"),
        A("block_names", K.STRINGS, [], "the pserver variable holding each block (fetched after the sync)"),
        A("delta_names", K.STRINGS, [], "the name each block's delta is sent as"),
        A("push_nums", K.INT, 100, "sync every push_nums-th step (Geo-SGD's k)"),
        A("trainer_id", K.INT, 0, "id of the trainer"),
        A("table_epmap", K.STRINGS, [], "distributed table: the pserver of each shard (shard i: rows r % n == i)"),
        A("table_delta_name", K.STRING, "", "distributed table: the name its rows' delta is sent as"),
        A("table_updates_name", K.STRING, "", "distributed table: the name its changed rows are fetched as"),
    ],
    infer=_infer_geo_sync,
    grad=NO_GRAD,
    traits=TRAINER_NETWORK_TRAITS,
    doc="Geo-SGD: count the step (Step) and mark the table rows looked up (TableIds into Touched); every "
        "push_nums-th step, send each block's change since the last sync (X - Snapshot) and the touched table "
        "rows' change (Table - TableSnapshot) to their pservers, then fetch the merged blocks into Out (= X) and "
        "SnapshotOut, and the table rows any trainer changed since this one's last sync into TableOut (= Table) "
        "and TableSnapshotOut",
)


def _infer_geo_table_init(ctx: InferContext) -> None:
    if not ctx.attr("epmap"):
        _fail(ctx, "epmap is empty", "name the pserver of each shard of the table")
    rows, width = ctx.attr("rows"), ctx.attr("width")
    if rows < 1 or width < 1:
        _fail(ctx, f"rows {rows} and width {width} must be >= 1", "give the distributed table's shape")
    dtype = ctx.attr("dtype")
    ctx.set_output("Table", VarInfo((rows, width), dtype, "lod_tensor"))
    ctx.set_output("TableSnapshot", VarInfo((rows, width), dtype, "lod_tensor"))
    ctx.set_output("Touched", VarInfo((rows,), "bool", "lod_tensor"))


defop(
    "geo_table_init",
    inputs=[],
    outputs=["Table", "TableSnapshot", "Touched"],
    attrs=[
        A("epmap", K.STRINGS, [], "the pserver of each shard (of n, shard i holds the rows r with r % n == i)"),
        A("table_name", K.STRING, "", "the shard's name on every pserver"),
        A("rows", K.INT, 0, "rows of the whole table"),
        A("width", K.INT, 0, "columns of the table"),
        A("dtype", K.STRING, "float32", "the table's dtype"),
        A("trainer_id", K.INT, 0, "id of the trainer"),
    ],
    infer=_infer_geo_table_init,
    grad=NO_GRAD,
    traits=TRAINER_NETWORK_TRAITS,
    doc="Geo-SGD trainer startup: fetch every shard of the distributed table, interleave them into Table, copy "
        "it into TableSnapshot and clear Touched",
)
