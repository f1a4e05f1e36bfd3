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

DOT (``program_to_dot``): one ``digraph`` of one block; ops are boxes labelled with their type, variables
are ellipses labelled with name, dtype and shape (parameters filled, variables of parent blocks
dashed), edges run variable → op for inputs and op → variable for outputs, labelled with the slot.
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
from ir.ops.registry import AttrKind, BlockRef
from ir.serialize import attr_kind_for

__all__ = ["JSON_FORMAT", "JSON_VERSION", "program_from_json", "program_to_dot", "program_to_json"]

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
def _dot_string(text: str) -> str:
    """``text`` as a DOT quoted string (an escString for labels): backslashes, quotes and line
    breaks escaped, so a name can never end the string or inject attributes."""
    out = text.replace("\\", "\\\\").replace('"', '\\"')
    for brk in ("\r\n", "\r", "\n", "\u2028", "\u2029", "\x85"):
        out = out.replace(brk, "\\n")
    return '"' + out + '"'


def _var_label(var: Variable | None, name: str) -> str:
    if var is None:
        return name
    return f"{name}\n{var.dtype}[{', '.join(str(d) for d in var.shape)}]"


def program_to_dot(program: Program, block_idx: int = 0) -> str:
    """Graphviz DOT of block ``block_idx`` of ``program`` (see the module docstring)."""
    block = program.block(block_idx)
    var_ids: dict[str, str] = {}
    lines = [
        f"digraph {_dot_string(f'block{block.idx}')} {{",
        "  rankdir=TB;",
        '  node [fontname="monospace"];',
        '  edge [fontname="monospace", fontsize=10];',
    ]

    def var_node(name: str) -> str:
        if name in var_ids:
            return var_ids[name]
        node_id = f"var{len(var_ids)}"
        var_ids[name] = node_id
        local = block.vars.get(name)
        var = local if local is not None else block.find_var_recursive(name)
        attrs = [f"label={_dot_string(_var_label(var, name))}", "shape=ellipse"]
        styles = []
        if isinstance(var, Parameter):
            styles.append("filled")
            attrs.append('fillcolor="lightblue"')
        if local is None:
            styles.append("dashed")
        if styles:
            attrs.append(f"style={_dot_string(','.join(styles))}")
        lines.append(f"  {node_id} [{', '.join(attrs)}];")
        return node_id

    for name in block.vars:
        var_node(name)
    edges: list[str] = []
    for i, op in enumerate(block.ops):
        op_id = f"op{i}"
        lines.append(f"  {op_id} [label={_dot_string(op.type)}, shape=box, style=\"bold\"];")
        for slot, names in op.inputs.items():
            for name in names:
                edges.append(f"  {var_node(name)} -> {op_id} [label={_dot_string(slot)}];")
        for slot, names in op.outputs.items():
            for name in names:
                edges.append(f"  {op_id} -> {var_node(name)} [label={_dot_string(slot)}];")
    lines += edges
    lines.append("}")
    return "\n".join(lines) + "\n"
