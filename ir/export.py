"""The JSON form of a Program (for tools; read back exactly) and the DOT form of a block (pictures).

JSON document (``program_to_json``), printed with ``sort_keys=True``, ``indent=2``, ASCII only and a
final newline, so the same program always gives the same bytes::

    {"format": "flotilla.program", "version": 1, "random_seed": 0,
     "blocks": [{"idx": 0, "parent_idx": -1,
                 "vars": [{"name": "w", "is_parameter": true, "shape": [4, 2], "dtype": "float32",
                           "type": "lod_tensor", "persistable": true, "stop_gradient": false,
                           "is_data": false, "slice_of": null, "slice_index": null,
                           "slice_offset": null, "copy_of": null, "trainer_id": null,
                           "trainable": true, "learning_rate": 1.0, "regularizer": null,
                           "gradient_clip": null, "is_distributed": false}],
                 "ops": [{"type": "mul",
                          "inputs": [{"slot": "X", "arguments": ["x"]}, {"slot": "Y", "arguments": ["w"]}],
                          "outputs": [{"slot": "Out", "arguments": ["y"]}],
                          "attrs": [{"name": "op_role", "type": "int", "value": 0}, ...]}]}]}

- Every field of ``Variable`` (and of ``Parameter`` when ``is_parameter``) is present; None is null.
- Lists keep the program's order (variables, ops, slots, attributes): JSON objects are only used
  where the keys are fixed field names, since ``sort_keys`` would reorder anything else.
- An attribute carries its kind (``AttrKind.value``: bool, int, float, string, bools, ints, floats,
  strings, block, blocks), chosen as the protobuf form chooses it (``ir.serialize.attr_kind_for``).
- A block reference is ``{"block": N}``. A float that JSON cannot hold is the string ``"nan"``,
  ``"inf"`` or ``"-inf"`` (unambiguous, since every value's kind is known), so the document is
  strict JSON.

DOT (``program_to_dot``): one ``digraph`` of one block, laid out for reading:

- Ops are boxes in one cluster per role group (``forward``, ``backward``, ``optimize`` with lr-schedule
  ops, ``rpc`` with dist and collective ops), each cluster a column in execution order: edges between
  clusters do not constrain the layout (drawn grey), so the backward pass sits beside the forward pass
  instead of below it.
- Persistable variables (parameters, the learning rate, optimizer state) are drawn once, in a table at
  the side, never as nodes with edges: an op lists the ones it reads or updates in its label (``Param:
  fc_w``, ``ParamOut: fc_w (updated)``).
- Other variables are ellipses (name, dtype, shape; dashed when they belong to a parent block) in the
  cluster of the op that writes them. A variable written again (in place, or reused by memory
  optimisation) gets a new node per write, labelled ``#2``, ``#3``...: each read links to the version
  it sees in execution order, so the graph has no 2-cycles.
- ``listen_and_serv`` links to each optimize (and prefetch) block it runs, each drawn as a cluster of its
  ops in order, the edge labelled with the gradients (or ids) that trigger it.
- ``roles`` keeps only the ops of the given role groups (and the variables they touch); ``ops_only``
  drops variable nodes and links each op to the ops whose results it reads.

``job_to_dot`` draws a transpiled job: one cluster per trainer (its ``send`` ops, each listing the
gradient blocks it sends) and per pserver (the optimize blocks of its ``listen_and_serv``, each
labelled with the parameter block it updates and its ops), and an edge from every sent gradient block
to the pserver block that applies it; a sent block no pserver block applies is a red node.

Node ids are generated (``op0``, ``var0``), so names only appear inside escaped labels; the output is
deterministic.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

from ir.core import Block, Parameter, Program, Variable
from ir.errors import FlotillaError, SerializationError
from ir.names import EMPTY_VAR_NAME
from ir.ops.registry import AttrKind, BlockRef
from ir.roles import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OpRole
from ir.serialize import attr_kind_for

__all__ = ["JSON_FORMAT", "JSON_VERSION", "ROLE_GROUPS", "job_to_dot", "program_from_json", "program_to_dot",
           "program_to_json", "role_group"]

JSON_FORMAT = "flotilla.program"
JSON_VERSION = 1

_VAR_FIELDS = tuple(f.name for f in dataclasses.fields(Variable))
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(Parameter))
_FLOAT_FIELDS = frozenset(f.name for f in dataclasses.fields(Parameter) if f.type == "float")
_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# --- JSON writing --------------------------------------------------------------------------------
def _float_to_json(value: float) -> float | str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return float(value)


def _scalar_to_json(kind: AttrKind, value: Any) -> Any:
    if kind is AttrKind.FLOAT:
        return _float_to_json(value)
    if kind is AttrKind.BLOCK:
        return {"block": value.idx}
    if kind is AttrKind.INT:
        return int(value)
    return value


def _var_to_json(var: Variable) -> dict[str, Any]:
    fields = _PARAM_FIELDS if isinstance(var, Parameter) else _VAR_FIELDS
    out: dict[str, Any] = {"is_parameter": isinstance(var, Parameter)}
    for name in fields:
        value = getattr(var, name)
        if name in _FLOAT_FIELDS:
            value = _float_to_json(value)
        elif name == "shape":
            value = list(value)
        out[name] = value
    return out


def _slots_to_json(slots: Any) -> list[dict[str, Any]]:
    return [{"slot": slot, "arguments": list(names)} for slot, names in slots.items()]


def _program_to_obj(program: Program) -> dict[str, Any]:
    blocks = []
    for block in program.blocks:
        ops = []
        for i, op in enumerate(block.ops):
            attrs = []
            for name, value in op.attrs.items():
                try:
                    kind = attr_kind_for(op.type, name, value)
                except SerializationError as exc:
                    raise SerializationError(f"block {block.idx} op #{i}: {exc.message}", hint=exc.hint) from None
                element = kind.element
                json_value = [_scalar_to_json(element, v) for v in value] if kind.is_list \
                    else _scalar_to_json(kind, value)
                attrs.append({"name": name, "type": kind.value, "value": json_value})
            ops.append({"type": op.type, "inputs": _slots_to_json(op.inputs), "outputs": _slots_to_json(op.outputs),
                        "attrs": attrs})
        blocks.append({"idx": block.idx, "parent_idx": block.parent_idx,
                       "vars": [_var_to_json(v) for v in block.vars.values()], "ops": ops})
    return {"format": JSON_FORMAT, "version": JSON_VERSION, "random_seed": program.random_seed, "blocks": blocks}


def program_to_json(program: Program) -> str:
    """The JSON document of ``program`` (see the module docstring); byte-stable."""
    return json.dumps(_program_to_obj(program), sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n"


# --- JSON reading --------------------------------------------------------------------------------
class _Bad(Exception):
    """A structural problem at a JSON path; turned into a SerializationError naming the source."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")


def _describe(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."


def _get(obj: Any, key: str, path: str, check: Callable[[Any], bool], expected: str) -> Any:
    if not isinstance(obj, dict):
        raise _Bad(path, f"expected an object, got {_describe(obj)}")
    if key not in obj:
        raise _Bad(path, f"missing key {key!r}")
    value = obj[key]
    if not check(value):
        raise _Bad(f"{path}.{key}", f"expected {expected}, got {_describe(value)}")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_list(v: Any) -> bool:
    return isinstance(v, list)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _float_from_json(value: Any, path: str) -> float:
    if isinstance(value, float):
        return value
    if isinstance(value, str) and value in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[value]
    raise _Bad(path, "expected a float (a number with '.' or 'e', or \"nan\"/\"inf\"/\"-inf\"), "
                     f"got {_describe(value)}")


_SCALAR_READERS: dict[AttrKind, Callable[[Any, str], Any]] = {}


def _read_bool(v: Any, path: str) -> bool:
    if not _is_bool(v):
        raise _Bad(path, f"expected true or false, got {_describe(v)}")
    return bool(v)


def _read_int(v: Any, path: str) -> int:
    if not _is_int(v):
        raise _Bad(path, f"expected an integer, got {_describe(v)}")
    return int(v)


def _read_str(v: Any, path: str) -> str:
    if not _is_str(v):
        raise _Bad(path, f"expected a string, got {_describe(v)}")
    return str(v)


def _read_block(v: Any, path: str) -> BlockRef:
    if not (isinstance(v, dict) and set(v) == {"block"} and _is_int(v["block"])):
        raise _Bad(path, f'expected a block reference {{"block": N}}, got {_describe(v)}')
    return BlockRef(v["block"])


_SCALAR_READERS.update({
    AttrKind.BOOL: _read_bool, AttrKind.INT: _read_int, AttrKind.FLOAT: _float_from_json,
    AttrKind.STRING: _read_str, AttrKind.BLOCK: _read_block,
})
_KINDS = {k.value: k for k in AttrKind}


def _attr_from_json(obj: Any, path: str) -> tuple[str, Any]:
    name = _get(obj, "name", path, _is_str, "a string")
    kind_name = _get(obj, "type", path, lambda v: v in _KINDS, f"one of {sorted(_KINDS)}")
    kind = _KINDS[kind_name]
    if "value" not in obj:
        raise _Bad(path, "missing key 'value'")
    value = obj["value"]
    reader = _SCALAR_READERS[kind.element]
    if kind.is_list:
        if not isinstance(value, list):
            raise _Bad(f"{path}.value", f"expected a list of {kind.element.value}, got {_describe(value)}")
        return name, [reader(v, f"{path}.value[{i}]") for i, v in enumerate(value)]
    return name, reader(value, f"{path}.value")


def _var_from_json(obj: Any, path: str) -> Variable:
    is_param = _get(obj, "is_parameter", path, _is_bool, "true or false")
    fields = _PARAM_FIELDS if is_param else _VAR_FIELDS
    extra = sorted(set(obj) - set(fields) - {"is_parameter"})
    if extra:
        raise _Bad(path, f"unknown keys {extra} for a {'parameter' if is_param else 'variable'}")
    values: dict[str, Any] = {}
    for name in fields:
        if name not in obj:
            raise _Bad(path, f"missing key {name!r}")
        value = obj[name]
        if name in _FLOAT_FIELDS:
            value = _float_from_json(value, f"{path}.{name}")
        elif name == "shape":
            if not (isinstance(value, list) and all(_is_int(d) for d in value)):
                raise _Bad(f"{path}.shape", f"expected a list of integers, got {_describe(value)}")
            value = tuple(value)
        values[name] = value
    cls = Parameter if is_param else Variable
    return cls(**values)


def _slots_from_json(value: Any, path: str) -> dict[str, list[str]]:
    if not isinstance(value, list):
        raise _Bad(path, f"expected a list of slots, got {_describe(value)}")
    out: dict[str, list[str]] = {}
    for i, s in enumerate(value):
        where = f"{path}[{i}]"
        slot = _get(s, "slot", where, _is_str, "a string")
        args = _get(s, "arguments", where, lambda v: isinstance(v, list) and all(map(_is_str, v)),
                    "a list of variable names")
        if slot in out:
            raise _Bad(where, f"slot {slot!r} appears twice")
        out[slot] = list(args)
    return out


def _program_from_obj(doc: Any) -> Program:
    fmt = _get(doc, "format", "$", _is_str, "a string")
    if fmt != JSON_FORMAT:
        raise _Bad("$.format", f"expected {JSON_FORMAT!r}, got {fmt!r}")
    version = _get(doc, "version", "$", _is_int, "an integer")
    if version != JSON_VERSION:
        raise _Bad("$.version", f"unsupported version {version}; this Flotilla reads version {JSON_VERSION}")
    program = Program()
    program.random_seed = _get(doc, "random_seed", "$", _is_int, "an integer")
    blocks = _get(doc, "blocks", "$", lambda v: isinstance(v, list) and bool(v), "a non-empty list of blocks")
    program.blocks = []
    for i, b in enumerate(blocks):
        path = f"$.blocks[{i}]"
        idx = _get(b, "idx", path, _is_int, "an integer")
        if idx != i:
            raise _Bad(f"{path}.idx", f"is {idx}; blocks must be listed in index order")
        parent = _get(b, "parent_idx", path, _is_int, "an integer")
        if (i == 0 and parent != -1) or not -1 <= parent < max(i, 1):
            raise _Bad(f"{path}.parent_idx", f"is {parent}; expected {'-1' if i == 0 else f'-1..{i - 1}'}")
        block = Block(program, i, parent)
        program.blocks.append(block)
        for j, v in enumerate(_get(b, "vars", path, _is_list, "a list")):
            where = f"{path}.vars[{j}]"
            try:
                block.add_var(_var_from_json(v, where))
            except FlotillaError as exc:
                raise _Bad(where, exc.message) from None
            except TypeError as exc:
                raise _Bad(where, str(exc)) from None
        for j, o in enumerate(_get(b, "ops", path, _is_list, "a list")):
            where = f"{path}.ops[{j}]"
            op_type = _get(o, "type", where, _is_str, "a string")
            inputs = _slots_from_json(_get(o, "inputs", where, _is_list, "a list"), f"{where}.inputs")
            outputs = _slots_from_json(_get(o, "outputs", where, _is_list, "a list"), f"{where}.outputs")
            attrs: dict[str, Any] = {}
            for k, a in enumerate(_get(o, "attrs", where, _is_list, "a list")):
                name, value = _attr_from_json(a, f"{where}.attrs[{k}]")
                if name in attrs:
                    raise _Bad(f"{where}.attrs[{k}]", f"attribute {name!r} appears twice")
                attrs[name] = value
            block._append_raw_op(op_type, inputs, outputs, attrs)
    return program


def program_from_json(text: str, source: str = "<json>") -> Program:
    """The Program of a document written by ``program_to_json`` (exactly; nothing is re-inferred).
    Raises SerializationError naming ``source`` and the JSON path of what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise SerializationError(f"cannot load {source}: not valid JSON: {exc.msg} at {where}",
                                 hint="program_from_json reads what program_to_json writes") from None
    try:
        return _program_from_obj(doc)
    except _Bad as exc:
        raise SerializationError(f"cannot load {source}: {exc}",
                                 hint="program_from_json reads what program_to_json writes") from None


# --- DOT -----------------------------------------------------------------------------------------
ROLE_GROUPS = ("forward", "backward", "optimize", "rpc")
_GROUP_FILL = {"forward": "#eef3fb", "backward": "#fbeeee", "optimize": "#eef7ee", "rpc": "#fdf6e3"}
_QUIET_SLOTS = frozenset({"X", "Out"})  # the obvious slots: their edges go unlabelled
_MAX_LABEL_LINES = 6
_SUB_BLOCKS_PER_ROW = 4
_MAX_OUTER_NODES = 4  # more fed/outer values than this in one slot are listed in one node


def role_group(op: Any) -> str:
    """The role group an op is drawn in: ``rpc`` (rpc, dist and collective ops), ``optimize`` (optimize
    and lr-schedule ops), ``backward``, else ``forward`` (the loss op included)."""
    role = op.attrs.get(OP_ROLE_ATTR, 0)
    role = role if isinstance(role, int) and not isinstance(role, bool) else 0
    if role & (OpRole.RPC | OpRole.DIST | OpRole.COLLECTIVE):
        return "rpc"
    if role & (OpRole.OPTIMIZE | OpRole.LRSCHED):
        return "optimize"
    if role & OpRole.BACKWARD:
        return "backward"
    return "forward"


def _dot_string(text: str) -> str:
    """``text`` as a DOT quoted string (an escString for labels): backslashes, quotes and line
    breaks escaped, so a name can never end the string or inject attributes."""
    out = text.replace("\\", "\\\\").replace('"', '\\"')
    for brk in ("\r\n", "\r", "\n", "\u2028", "\u2029", "\x85"):
        out = out.replace(brk, "\\n")
    return '"' + out + '"'


def _dot_left(lines: list[str]) -> str:
    """Lines as one DOT label, each line left-justified (``\\l``), every line escaped on its own."""
    return '"' + "".join(_dot_string(line)[1:-1] + "\\l" for line in lines) + '"'


def _dims(var: Variable | None) -> str:
    return "" if var is None else f"{var.dtype}[{', '.join(str(d) for d in var.shape)}]"


def _var_label(var: Variable | None, name: str, version: int = 1) -> str:
    title = name if version == 1 else f"{name} #{version}"
    return title if var is None else f"{title}\n{_dims(var)}"


def _block_refs(value: Any) -> list[int]:
    if isinstance(value, BlockRef):
        return [value.idx]
    if isinstance(value, list) and value and all(isinstance(v, BlockRef) for v in value):
        return [v.idx for v in value]
    return []


def _keyed_blocks(entries: Any) -> dict[int, list[str]]:
    """``['name:idx', ...]`` (grad_to_block_id, prefetch_var_name_to_block_id) as idx → names."""
    out: dict[int, list[str]] = {}
    for entry in entries if isinstance(entries, list) else []:
        name, sep, idx = str(entry).rpartition(":")
        if sep and idx.isdigit():
            out.setdefault(int(idx), []).append(name)
    return out


def _check_roles(roles: Any) -> tuple[str, ...]:
    if roles is None:
        return ROLE_GROUPS
    chosen = tuple(roles)
    bad = [r for r in chosen if r not in ROLE_GROUPS]
    if bad or not chosen:
        raise FlotillaError(f"unknown op role group(s) {bad or chosen!r}", hint=f"choose from {list(ROLE_GROUPS)}")
    return tuple(r for r in ROLE_GROUPS if r in chosen)


@dataclasses.dataclass
class _Version:
    """One write of a non-persistable variable: its node (drawn lazily), and the op that wrote it."""

    name: str
    number: int
    node: str | None = None
    op_node: str | None = None  # None: written by an op that is not drawn, or not written in this block
    group: str | None = None
    key: str | None = None  # the cluster of the op that wrote it


class _DotWriter:
    """Collects the statements of one digraph: top-level lines and per-cluster lines, then joins them."""

    def __init__(self, name: str, rankdir: str = "TB") -> None:
        self.head = [f"digraph {_dot_string(name)} {{", f"  rankdir={rankdir};", "  newrank=true;",
                     "  compound=true;", '  node [fontname="monospace", fontsize=10];',
                     '  edge [fontname="monospace", fontsize=9];']
        self.clusters: dict[str, tuple[str, list[str]]] = {}  # id → (attributes, statements)
        self.top: list[str] = []
        self.edges: list[str] = []
        self._seen_edges: set[tuple[str, str, str]] = set()
        self._count = 0

    def new_id(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def cluster(self, key: str, label: str, fill: str) -> list[str]:
        if key not in self.clusters:
            attrs = f'    label={_dot_string(label)}; style="filled,rounded"; fillcolor="{fill}"; color="grey70";'
            self.clusters[key] = (attrs, [])
        return self.clusters[key][1]

    def edge(self, src: str, dst: str, attrs: str = "") -> None:
        key = (src, dst, attrs)
        if key not in self._seen_edges:
            self._seen_edges.add(key)
            self.edges.append(f"  {src} -> {dst}" + (f" [{attrs}];" if attrs else ";"))

    def text(self) -> str:
        lines = list(self.head)
        for key, (attrs, body) in self.clusters.items():
            lines.append(f"  subgraph {_dot_string('cluster_' + key)} {{")
            lines.append(attrs)
            lines += ["  " + b for b in body]
            lines.append("  }")
        lines += self.top + self.edges
        lines.append("}")
        return "\n".join(lines) + "\n"


def _state_lines(op: Any, is_state: Callable[[str], bool], state: dict[str, str]) -> list[str]:
    """The persistable variables ``op`` reads and writes, one label line each (recorded in ``state``
    with the slot that first uses them, for the side table)."""
    lines = []
    reads = {n for names in op.inputs.values() for n in names}
    writes = {n for names in op.outputs.values() for n in names}
    for slot, names in op.inputs.items():
        for n in names:
            if is_state(n):
                state.setdefault(n, slot)
                if n not in writes:
                    lines.append(f"{slot}: {n}")
    for slot, names in op.outputs.items():
        for n in names:
            if is_state(n):
                state.setdefault(n, slot)
                lines.append(f"{slot}: {n}" + (" (updated)" if n in reads else ""))
    return lines


def _label(op_type: str, lines: list[str]) -> str:
    if len(lines) > _MAX_LABEL_LINES:
        lines = lines[:_MAX_LABEL_LINES - 1] + [f"... {len(lines) - _MAX_LABEL_LINES + 1} more"]
    return "\n".join([op_type] + lines)


def _draw_ops(w: _DotWriter, block: Block, groups: tuple[str, ...], ops_only: bool, state: dict[str, str],
              cluster_of: Callable[[Any], tuple[str, str, str]]) -> dict[int, str]:
    """Draw the ops of ``block`` in the chosen role groups, each in the cluster ``cluster_of(op)`` gives
    (key, label, fill), with the data flow inside each cluster; a value read from another cluster is
    named in the reading op's label (``X <- name (forward)``) instead of drawn as an edge across the page.
    Returns op index → node id."""
    def is_state(name: str) -> bool:
        var = block.find_var_recursive(name)
        return var is not None and var.persistable

    latest: dict[str, _Version] = {}
    op_nodes: dict[int, str] = {}
    last_in_cluster: dict[str, str] = {}  # cluster key → its last op node: a cluster reads top-down in order

    def version_node(v: _Version) -> str:
        if v.node is None:  # a feed or a parent block's variable
            v.node = w.new_id("var")
            local = block.vars.get(v.name)
            var = local if local is not None else block.find_var_recursive(v.name)
            style = "solid" if local is not None else "dashed"
            w.top.append(f"  {v.node} [label={_dot_string(_var_label(var, v.name, max(v.number, 1)))}, "
                         f"shape=ellipse, style={_dot_string(style)}];")
        return v.node

    for i, op in enumerate(block.ops):
        group = role_group(op)
        drawn = group in groups
        op_id = w.new_id("op") if drawn else ""
        key = ""
        if drawn:
            key, label, fill = cluster_of(op)
            lines = _state_lines(op, is_state, state)
            for slot, names in op.inputs.items():
                outer = [n for n in names if n != EMPTY_VAR_NAME and not is_state(n) and n not in latest]
                if not ops_only and len(outer) > _MAX_OUTER_NODES:
                    # Many fed or outer values in one slot (a pserver's received gradients): one list node.
                    group_node = w.new_id("vars")
                    listing = _dot_left([f"{slot}: {len(outer)} values"] + outer)
                    w.top.append(f"  {group_node} [shape=note, label={listing}];")
                    w.edge(group_node, op_id, f"label={_dot_string(slot)}")
                    for n in outer:
                        latest[n] = _Version(n, 0, node=group_node)
                    names = [n for n in names if n not in outer]
                for name in names:
                    if name == EMPTY_VAR_NAME or is_state(name):
                        continue
                    v = latest.setdefault(name, _Version(name, 0))
                    if v.op_node is None and v.number > 0 or v.key is not None and v.key != key:
                        where = v.group if v.op_node is not None else f"{v.group}, not drawn"
                        lines.append(f"{slot} <- {name} ({where})")
                    elif ops_only:
                        if v.op_node is not None and v.op_node != op_id:
                            w.edge(v.op_node, op_id)
                        elif v.number == 0:  # fed, or from an outer block (a pserver's received gradients)
                            lines.append(f"{slot} <- {name}")
                    else:
                        w.edge(version_node(v), op_id, "" if slot in _QUIET_SLOTS else f"label={_dot_string(slot)}")
            w.cluster(key, label, fill).append(
                f"  {op_id} [label={_dot_string(_label(op.type, lines))}, shape=box, "
                'style="filled,bold", fillcolor="white"];')
            op_nodes[i] = op_id
            if key in last_in_cluster:
                w.edge(last_in_cluster[key], op_id, "style=invis")
            last_in_cluster[key] = op_id
        for slot, names in op.outputs.items():
            for name in names:
                if name == EMPTY_VAR_NAME or is_state(name):
                    continue
                prev = latest.get(name)
                v = _Version(name, (prev.number if prev else 0) + 1)
                latest[name] = v
                v.group = group
                if not drawn:
                    continue
                v.op_node, v.key = op_id, key
                if ops_only:
                    continue
                v.node = w.new_id("var")
                local = block.vars.get(name)
                var = local if local is not None else block.find_var_recursive(name)
                style = "solid" if local is not None else "dashed"
                w.cluster(*cluster_of(op)).append(
                    f"  {v.node} [label={_dot_string(_var_label(var, name, v.number))}, shape=ellipse, "
                    f'style="filled,{style}", fillcolor="white"];')
                w.edge(op_id, v.node, "" if slot in _QUIET_SLOTS else f"label={_dot_string(slot)}")
    return op_nodes


def _draw_state_table(w: _DotWriter, program: Program, block: Block, state: dict[str, str]) -> None:
    """The persistable variables the drawn ops use, once each, at the side: parameters, then the
    learning rate and the other state (optimizer accumulators, counters)."""
    if not state:
        return
    params, others = [], []
    for name, slot in state.items():
        var = block.find_var_recursive(name)
        if var is None:
            var = next((b.vars[name] for b in program.blocks if name in b.vars), None)
        line = f"{name}  {_dims(var)}"
        if isinstance(var, Parameter):
            params.append(line)
        else:
            others.append(line + ("  (learning rate)" if slot == "LearningRate" else ""))
    body = w.cluster("state", "persistable variables (drawn once; ops name them)", "#f4f4f4")
    if params:
        body.append(f"  {w.new_id('state')} [shape=box, style=\"filled\", fillcolor=\"lightblue\", "
                    f"label={_dot_left(['parameters'] + params)}];")
    if others:
        body.append(f"  {w.new_id('state')} [shape=box, style=\"filled\", fillcolor=\"lightyellow\", "
                    f"label={_dot_left(['learning rate and optimizer state'] + others)}];")


def _draw_sub_block(w: _DotWriter, sub: Block, label: str, groups: tuple[str, ...], state: dict[str, str],
                    chain: list[tuple[str, str]]) -> str:
    """Draw ``sub`` (a block an op runs) as one cluster of its ops in order; returns the node to link to.
    Such clusters are laid out in rows of ``_SUB_BLOCKS_PER_ROW``, not one strip across the page."""
    key = f"block{sub.idx}"

    def in_sub(o: Any) -> tuple[str, str, str]:
        return key, label, _GROUP_FILL[role_group(o)]

    nodes = list(_draw_ops(w, sub, groups, True, state, in_sub).values())
    if not nodes:
        empty = w.new_id("empty")
        w.cluster(key, label, "#f4f4f4").append(f'  {empty} [label="(no ops drawn)", shape=plain];')
        return empty
    if len(chain) >= _SUB_BLOCKS_PER_ROW:
        w.edge(chain[-_SUB_BLOCKS_PER_ROW][1], nodes[0], "style=invis")
    chain.append((nodes[0], nodes[-1]))
    return nodes[0]


def program_to_dot(program: Program, block_idx: int = 0, *, roles: Any = None, ops_only: bool = False) -> str:
    """Graphviz DOT of block ``block_idx`` of ``program`` (see the module docstring). ``roles``: the
    role groups to draw (a subset of ``ROLE_GROUPS``; default all); ``ops_only``: no variable nodes."""
    groups = _check_roles(roles)
    block = program.block(block_idx)
    w = _DotWriter(f"block{block.idx}")
    state: dict[str, str] = {}

    def by_role(op: Any) -> tuple[str, str, str]:
        group = role_group(op)
        return group, group, _GROUP_FILL[group]

    op_nodes = _draw_ops(w, block, groups, ops_only, state, by_role)
    # The role columns side by side, left to right: an invisible header per column in one rank, each
    # pulling its column's first op under it (Graphviz keeps the order of a rank of plain nodes; it does
    # not keep an order between clusters).
    firsts: dict[str, str] = {}
    for i, op_id in op_nodes.items():
        firsts.setdefault(role_group(block.ops[i]), op_id)
    heads = [g for g in ROLE_GROUPS if g in firsts]
    if len(heads) > 1:
        ids = [w.new_id("column") for _ in heads]
        w.top += [f"  {h} [shape=point, style=invis];" for h in ids]
        w.top.append(f"  {{rank=same; {' -> '.join(ids)} [style=invis];}}")
        for h, g in zip(ids, heads):
            w.edge(h, firsts[g], "style=invis, weight=100")
    sub_first: dict[int, str] = {}  # sub-block → the node an op referring to it links to
    sub_chain: list[tuple[str, str]] = []  # (first, last) op node of each sub-block drawn with ops
    for i, op_id in op_nodes.items():
        op = block.ops[i]
        triggers = {**_keyed_blocks(op.attrs.get("grad_to_block_id")),
                    **_keyed_blocks(op.attrs.get("prefetch_var_name_to_block_id"))}
        for attr, value in op.attrs.items():
            for idx in _block_refs(value):
                if not 0 <= idx < len(program.blocks) or idx == block.idx:
                    continue
                if idx not in sub_first:
                    sub_first[idx] = _draw_sub_block(w, program.block(idx), f"block {idx} ({attr})", groups, state,
                                                     sub_chain)
                names = triggers.get(idx, [])
                attrs = [f"lhead={_dot_string(f'cluster_block{idx}')}", 'style="dashed"', 'color="darkorange3"']
                if names:
                    shown = names[:3] + ([f"... {len(names) - 3} more"] if len(names) > 3 else [])
                    attrs.append(f"label={_dot_string(chr(10).join(shown))}")
                w.edge(op_id, sub_first[idx], ", ".join(attrs))
    _draw_state_table(w, program, block, state)
    return w.text()


# --- the job: which trainer send reaches which pserver block ---------------------------------------------
def _updated_param(block: Block) -> str | None:
    """The parameter (block) an optimize block updates, from its optimizer op's ``op_role_var``."""
    for op in block.ops:
        role_var = op.attrs.get(OP_ROLE_VAR_ATTR)
        if role_group(op) == "optimize" and isinstance(role_var, list) and role_var:
            return str(role_var[0])
    return None


def job_to_dot(programs: Any) -> str:
    """Graphviz DOT of a transpiled job: ``programs`` maps each role (``trainer.0``,
    ``pserver@127.0.0.1:6174``...) to its main program, in order. See the module docstring."""
    w = _DotWriter("job", rankdir="LR")
    # endpoint → (grad name → pserver block node, param name → pserver block node)
    served: dict[str, tuple[dict[str, str], dict[str, str]]] = {}
    trainers: list[tuple[str, Program]] = []
    for role, program in programs.items():
        block = program.global_block()
        listen = [op for op in block.ops if op.type == "listen_and_serv"]
        if not listen:
            trainers.append((role, program))
            continue
        for op in listen:
            endpoint = str(op.attrs.get("endpoint", role))
            grads_of = _keyed_blocks(op.attrs.get("grad_to_block_id"))
            ids_of = _keyed_blocks(op.attrs.get("prefetch_var_name_to_block_id"))
            by_grad, by_param = served.setdefault(endpoint, ({}, {}))
            body = w.cluster(f"ps:{endpoint}", f"pserver {endpoint}", _GROUP_FILL["optimize"])
            for attr, value in op.attrs.items():
                for idx in _block_refs(value):
                    if not 0 < idx < len(program.blocks):
                        continue
                    sub = program.block(idx)
                    node = w.new_id("psblock")
                    param = _updated_param(sub)
                    lines = [f"block {idx}" + (f": {param}" if param else f" ({attr})")]
                    lines.append(" > ".join(o.type for o in sub.ops) or "(no ops)")
                    lines += [f"ids: {n}" for n in ids_of.get(idx, [])]
                    body.append(f"  {node} [shape=box, style=\"filled\", fillcolor=\"white\", "
                                f"label={_dot_left(lines)}];")
                    for g in grads_of.get(idx, []):
                        by_grad[g] = node
                    if param:
                        by_param[param] = node
    for role, program in trainers:
        block = program.global_block()
        body = w.cluster(f"tr:{role}", role, _GROUP_FILL["forward"])
        for op in block.ops:
            if op.type != "send":
                continue
            epmap = [str(e) for e in op.attrs.get("epmap", [])]
            names = op.inputs.get("X", [])
            keys = [block.vars[n].copy_of if n in block.vars and block.vars[n].copy_of else n for n in names]
            node = w.new_id("send")
            body.append(f"  {node} [shape=box, style=\"filled\", fillcolor=\"white\", "
                        f"label={_dot_left(['send'] + keys)}];")
            for j, key in enumerate(keys):
                endpoint = epmap[j] if j < len(epmap) else (epmap[0] if epmap else "")
                target = served.get(endpoint, ({}, {}))[0].get(key)
                if target is None:
                    target = w.new_id("missing")
                    missing = f"no block applies {key} on {endpoint or '?'}"
                    w.top.append(f"  {target} [shape=octagon, color=\"red\", label={_dot_string(missing)}];")
                w.edge(node, target, f"label={_dot_string(key)}" if len(keys) > 1 else "")
    return w.text()
