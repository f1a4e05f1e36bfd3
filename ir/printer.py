"""The canonical text form of a Program (``print(program)``), byte-stable and parsed back exactly
by ``ir.parser.parse_program``.

Grammar (one item a line; ``#`` starts a comment line)::

    program {random_seed=0}
    block 0 {
      var x : lod_tensor<float32>[-1, 1000] {is_data=true, stop_gradient=true}
      param fc_w : lod_tensor<float32>[1000, 1000] {learning_rate=1.0}
      op mul(X=[x], Y=[fc_w]) -> (Out=[fc_0.tmp_0]) {op_role=0, op_role_var=[], x_num_col_dims=1}
    }
    block 1 parent 0 {
    }

- Names matching ``[A-Za-z_@][A-Za-z0-9_@.\\-]*`` are bare, others are JSON-quoted strings.
- Variable properties are printed only where they differ from the defaults, in field order.
- Attribute values: ``true``/``false``, integers, floats (Python's shortest round-tripping repr, always
  with ``.``/``e``/``inf``/``nan``), JSON strings, block references ``^N``, and lists ``[a, b]``.
- Attributes are printed sorted by name; slots in the op's order (schema order for registered ops).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from ir.core import Block, Operator, Parameter, Program, Variable
from ir.ops.registry import BlockRef

_BARE_NAME = re.compile(r"[A-Za-z_@][A-Za-z0-9_@.\-]*\Z")
_KEYWORDS = frozenset({"true", "false", "inf", "nan", "program", "block", "var", "param", "op", "parent"})

_VAR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Variable)}
_PARAM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Parameter)}
# Fields printed in the header (name, type, dtype, shape) rather than among the properties.
_HEADER_FIELDS = ("name", "shape", "dtype", "type")


def format_name(name: str) -> str:
    if _BARE_NAME.match(name) and name not in _KEYWORDS:
        return name
    return json.dumps(name, ensure_ascii=False)


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".e") else text + ".0"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, BlockRef):
        return f"^{value.idx}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if value is None:
        return "none"
    raise TypeError(f"cannot print attribute value {value!r}")


def format_var(var: Variable) -> str:
    defaults = _PARAM_DEFAULTS if isinstance(var, Parameter) else _VAR_DEFAULTS
    props = []
    for f in dataclasses.fields(var):
        if f.name in _HEADER_FIELDS:
            continue
        value = getattr(var, f.name)
        if value != defaults[f.name]:
            props.append(f"{f.name}={format_value(value)}")
    kw = "param" if isinstance(var, Parameter) else "var"
    shape = "[" + ", ".join(str(d) for d in var.shape) + "]"
    text = f"{kw} {format_name(var.name)} : {var.type}<{var.dtype}>{shape}"
    if props:
        text += " {" + ", ".join(props) + "}"
    return text


def _format_slots(slots: Any) -> str:
    return ", ".join(
        f"{format_name(slot)}=[" + ", ".join(format_name(n) for n in names) + "]" for slot, names in slots.items()
    )


def format_op(op: Operator) -> str:
    text = f"op {format_name(op.type)}({_format_slots(op.inputs)}) -> ({_format_slots(op.outputs)})"
    if op.attrs:
        text += " {" + ", ".join(f"{format_name(k)}={format_value(op.attrs[k])}" for k in sorted(op.attrs)) + "}"
    return text


def format_block(block: Block, indent: str = "  ") -> str:
    header = f"block {block.idx}" + (f" parent {block.parent_idx}" if block.parent_idx >= 0 else "") + " {"
    lines = [header]
    lines += [indent + format_var(v) for v in block.vars.values()]
    lines += [indent + format_op(op) for op in block.ops]
    lines.append("}")
    return "\n".join(lines)


def format_program(program: Program) -> str:
    parts = [f"program {{random_seed={program.random_seed}}}"]
    parts += [format_block(b) for b in program.blocks]
    return "\n".join(parts) + "\n"
