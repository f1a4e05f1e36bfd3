"""The protobuf form of a Program: ``save_program`` / ``load_program`` and their in-memory halves.

File format (all integers little-endian)::

    offset  size  field
    0       8     magic   b"\\x89FLOTPB\\n"  (MAGIC; the high first byte keeps it from reading as text,
                                              the newline catches text-mode line-ending rewrites)
    8       4     format version, uint32 (FORMAT_VERSION, currently 1)
    12      8     payload length in bytes, uint64
    20      4     crc32 of the payload, uint32 (zlib.crc32)
    24      n     payload: a ``flotilla.framework.ProgramDesc`` (ir/proto/framework.proto),
                  serialized with ``SerializeToString(deterministic=True)``

Invariants:
- Encoding is deterministic and lossless: program → bytes → program → bytes gives identical bytes,
  and the decoded program prints (``ir.printer.format_program``) exactly as the original.
- Decoding rebuilds variables with ``Block.add_var`` and ops with ``Block._append_raw_op``: nothing
  is re-inferred or re-defaulted, so what was saved is what is loaded (the verifier judges it).
- An attribute's stored kind comes from the op's schema (``find_op_def(type).attr_def(name)``) when
  the value has exactly that kind, else from the value itself (``attr_kind_of_value``); a value
  that no kind stores exactly is refused when saving rather than silently changed.
- Every failure to load (empty, truncated, corrupted, foreign or too new a file, or a payload that
  is not a valid program) raises ``SerializationError`` naming the file and what is wrong.
"""
from __future__ import annotations

import os
import pathlib
import struct
import tempfile
import zlib
from typing import Any, Iterable, Mapping

from google.protobuf.message import DecodeError

from ir.core import Block, Parameter, Program, Variable
from ir.errors import FlotillaError, SerializationError
from ir.ops.registry import AttrKind, BlockRef, attr_kind_of_value, find_op_def
from ir.proto import framework_pb2 as fw

__all__ = [
    "FORMAT_VERSION", "HEADER_SIZE", "MAGIC", "attr_kind_for", "is_program_bytes", "load_program",
    "program_from_bytes", "program_from_desc", "program_to_bytes", "program_to_desc", "save_program",
]

MAGIC = b"\x89FLOTPB\n"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQI")
HEADER_SIZE = _HEADER.size  # 24

# Variable fields that may be None, stored as proto3 ``optional`` fields.
_OPTIONAL_VAR_FIELDS = ("slice_of", "slice_index", "slice_offset", "copy_of", "trainer_id")
_OPTIONAL_PARAM_FIELDS = ("regularizer", "gradient_clip")
# VarDesc fields that only a Parameter may set.
_PARAM_ONLY_FIELDS = frozenset({"trainable", "learning_rate", "regularizer", "gradient_clip", "is_distributed"})

_INT64 = (-(2**63), 2**63)
_INT32 = (-(2**31), 2**31)


# --- attribute kinds -----------------------------------------------------------------------------
def _fits(kind: AttrKind, value: Any) -> bool:
    """True when ``value`` is stored exactly (same printed form after decoding) as ``kind``."""
    if kind.is_list:
        return isinstance(value, (list, tuple)) and all(_fits(kind.element, v) for v in value)
    if kind is AttrKind.BOOL:
        return isinstance(value, bool)
    if kind is AttrKind.INT:
        return isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value < _INT64[1]
    if kind is AttrKind.FLOAT:
        return isinstance(value, float)
    if kind is AttrKind.STRING:
        return isinstance(value, str)
    return isinstance(value, BlockRef) and isinstance(value.idx, int) and _INT32[0] <= value.idx < _INT32[1]


def _own_kind(value: Any) -> AttrKind | None:
    """``attr_kind_of_value``, or None where the value has no kind (None, a nested list)."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return None  # attr_kind_of_value has no list-of-lists kind
    try:
        return attr_kind_of_value(value)
    except FlotillaError:
        return None


def attr_kind_for(op_type: str, name: str, value: Any) -> AttrKind:
    """The kind attribute ``name`` = ``value`` of an ``op_type`` op is stored as.

    The schema's kind when the op declares the attribute and the value has exactly that kind, else
    the value's own kind. Raises SerializationError for a value no kind represents exactly (None,
    a mixed list, an integer beyond int64).
    """
    op_def = find_op_def(op_type)
    attr_def = op_def.attr_def(name) if op_def is not None else None
    if attr_def is not None and _fits(attr_def.kind, value):
        return attr_def.kind
    kind = _own_kind(value)
    if kind is None or not _fits(kind, value):
        expected = f"a {attr_def.kind.value} as its schema declares" if attr_def is not None else \
            "a bool, int64, float, string, block reference or a list of one of these"
        raise SerializationError(
            f"op {op_type!r} attribute {name!r}: cannot store {type(value).__name__} {value!r} exactly; "
            f"expected {expected}",
            hint="fix the attribute (the verifier reports bad attribute values)",
        )
    return kind


# --- encoding ------------------------------------------------------------------------------------
def _encode_attr(op_type: str, name: str, value: Any) -> fw.Attr:
    kind = attr_kind_for(op_type, name, value)
    a = fw.Attr(name=name, type=fw.AttrType.Value(kind.name))
    if kind is AttrKind.BOOL:
        a.b = value
    elif kind is AttrKind.INT:
        a.i = value
    elif kind is AttrKind.FLOAT:
        a.f = value
    elif kind is AttrKind.STRING:
        a.s = value
    elif kind is AttrKind.BLOCK:
        a.block_idx = value.idx
    elif kind is AttrKind.BOOLS:
        a.bools.extend(value)
    elif kind is AttrKind.INTS:
        a.ints.extend(value)
    elif kind is AttrKind.FLOATS:
        a.floats.extend(value)
    elif kind is AttrKind.STRINGS:
        a.strings.extend(value)
    else:
        a.blocks_idx.extend(v.idx for v in value)
    return a


def _encode_var(var: Variable) -> fw.VarDesc:
    d = fw.VarDesc(name=var.name, dtype=var.dtype, type=var.type, persistable=var.persistable,
                   stop_gradient=var.stop_gradient, is_data=var.is_data)
    d.shape.extend(var.shape)
    for field in _OPTIONAL_VAR_FIELDS:
        value = getattr(var, field)
        if value is not None:
            setattr(d, field, value)
    if isinstance(var, Parameter):
        d.is_parameter = True
        d.trainable = var.trainable
        d.learning_rate = var.learning_rate
        d.is_distributed = var.is_distributed
        for field in _OPTIONAL_PARAM_FIELDS:
            value = getattr(var, field)
            if value is not None:
                setattr(d, field, value)
    return d


def _encode_slots(target: Any, slots: Mapping[str, list[str]]) -> None:
    for slot, names in slots.items():
        target.add(slot=slot, arguments=list(names))


def program_to_desc(program: Program) -> fw.ProgramDesc:
    """The ProgramDesc message of ``program`` (raises SerializationError for an unstorable value)."""
    desc = fw.ProgramDesc(random_seed=program.random_seed)
    for block in program.blocks:
        bd = desc.blocks.add(idx=block.idx, parent_idx=block.parent_idx)
        for var in block.vars.values():
            try:
                bd.vars.append(_encode_var(var))
            except (TypeError, ValueError) as exc:
                raise SerializationError(f"block {block.idx} variable {var.name!r}: cannot store it: {exc}") from None
        for i, op in enumerate(block.ops):
            where = f"block {block.idx} op #{i} ({op.type!r})"
            try:
                od = bd.ops.add(type=op.type)
                _encode_slots(od.inputs, op.inputs)
                _encode_slots(od.outputs, op.outputs)
                od.attrs.extend(_encode_attr(op.type, name, value) for name, value in op.attrs.items())
            except SerializationError as exc:
                raise SerializationError(f"{where}: {exc.message}", hint=exc.hint) from None
            except (TypeError, ValueError) as exc:
                raise SerializationError(f"{where}: cannot store it: {exc}") from None
    return desc


def program_to_bytes(program: Program) -> bytes:
    """The file form of ``program``: header (magic, version, length, crc32) and the ProgramDesc."""
    payload = program_to_desc(program).SerializeToString(deterministic=True)
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), zlib.crc32(payload)) + payload


def save_program(program: Program, path: str | os.PathLike[str]) -> None:
    """Write ``program`` to ``path`` in the file form (atomically: a reader never sees half a file)."""
    data = program_to_bytes(program)
    target = pathlib.Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        raise SerializationError(f"cannot write program file {str(path)!r}: {exc.strerror or exc}") from None


# --- decoding ------------------------------------------------------------------------------------
def is_program_bytes(data: bytes) -> bool:
    """True when ``data`` starts with the program file magic (tells it apart from text or JSON)."""
    return bytes(data[: len(MAGIC)]) == MAGIC


def _foreign_hint(data: bytes) -> str:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "this is a PNG image, not a program"
    head = data[:4096].decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")
    if head.startswith(("program", "block", "#")):
        return "this looks like a text program; use ir.parse_program to read it"
    if head.startswith("{"):
        return "this looks like a JSON program; use ir.export.program_from_json to read it"
    return "save programs with ir.serialize.save_program (or write the text form and parse it)"


def _check_header(data: bytes, source: str) -> bytes:
    """The payload of ``data`` after checking its header, length and crc32."""
    def fail(what: str, hint: str | None = None) -> SerializationError:
        return SerializationError(f"cannot load {source}: {what}", hint=hint)

    if not data:
        raise fail("the file is empty; expected a Flotilla program file", hint="was it written completely?")
    if len(data) < len(MAGIC) and MAGIC.startswith(bytes(data)):
        raise fail(f"the file is truncated: {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header")
    if not is_program_bytes(data):
        raise fail(f"not a Flotilla program file: it starts with {bytes(data[:8])!r}, expected the magic {MAGIC!r}",
                   hint=_foreign_hint(bytes(data)))
    if len(data) < HEADER_SIZE:
        raise fail(f"the file is truncated: {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header")
    _, version, length, crc = _HEADER.unpack_from(data)
    if version != FORMAT_VERSION:
        newer = version > FORMAT_VERSION
        raise fail(f"unsupported format version {version}; this Flotilla reads version {FORMAT_VERSION}",
                   hint="the file was written by a newer Flotilla; upgrade to read it" if newer
                   else "the file header is corrupted")
    available = len(data) - HEADER_SIZE
    if available < length:
        raise fail(f"the file is truncated: the header announces a {length}-byte payload, "
                   f"only {available} bytes follow", hint="was it written completely?")
    if available > length:
        raise fail(f"{available - length} unexpected bytes after the {length}-byte payload",
                   hint="the file is corrupted, or two files were concatenated")
    payload = bytes(data[HEADER_SIZE:])
    actual = zlib.crc32(payload)
    if actual != crc:
        raise fail(f"the file is corrupted: payload crc32 is {actual:#010x}, the header says {crc:#010x}")
    return payload


def _decode_attr(a: fw.Attr) -> Any:
    t = a.type
    if t == fw.BOOL:
        return a.b
    if t == fw.INT:
        return a.i
    if t == fw.FLOAT:
        return a.f
    if t == fw.STRING:
        return a.s
    if t == fw.BLOCK:
        return BlockRef(a.block_idx)
    if t == fw.BOOLS:
        return list(a.bools)
    if t == fw.INTS:
        return list(a.ints)
    if t == fw.FLOATS:
        return list(a.floats)
    if t == fw.STRINGS:
        return list(a.strings)
    if t == fw.BLOCKS:
        return [BlockRef(i) for i in a.blocks_idx]
    raise ValueError(f"attribute {a.name!r} has unknown type {t}")


def _decode_var(d: fw.VarDesc) -> Variable:
    fields: dict[str, Any] = {
        "name": d.name, "shape": tuple(d.shape), "dtype": d.dtype, "type": d.type, "persistable": d.persistable,
        "stop_gradient": d.stop_gradient, "is_data": d.is_data,
    }
    for field in _OPTIONAL_VAR_FIELDS:
        fields[field] = getattr(d, field) if d.HasField(field) else None
    if not d.is_parameter:
        stray = sorted({f.name for f, _ in d.ListFields()} & _PARAM_ONLY_FIELDS)
        if stray:
            raise ValueError(f"variable {d.name!r} is not a parameter but sets parameter fields {stray}")
        return Variable(**fields)
    for field in _OPTIONAL_PARAM_FIELDS:
        fields[field] = getattr(d, field) if d.HasField(field) else None
    return Parameter(**fields, trainable=d.trainable, learning_rate=d.learning_rate, is_distributed=d.is_distributed)


def _decode_slots(slots: Iterable[fw.OpDesc.Var], what: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in slots:
        if s.slot in out:
            raise ValueError(f"{what} slot {s.slot!r} appears twice")
        out[s.slot] = list(s.arguments)
    return out


def program_from_desc(desc: fw.ProgramDesc, source: str = "<desc>") -> Program:
    """The Program a ProgramDesc describes (raises SerializationError naming ``source`` if invalid)."""
    if not desc.blocks:
        raise SerializationError(f"cannot load {source}: the program has no blocks; expected at least block 0")
    program = Program()
    program.random_seed = desc.random_seed
    program.blocks = []
    n = len(desc.blocks)
    for i, bd in enumerate(desc.blocks):
        where = f"block {i}"
        try:
            if bd.idx != i:
                raise ValueError(f"is stored with index {bd.idx}; blocks must be stored in index order")
            if (i == 0 and bd.parent_idx != -1) or not -1 <= bd.parent_idx < max(i, 1):
                expected = "-1" if i == 0 else f"-1..{i - 1}"
                raise ValueError(f"has parent {bd.parent_idx} (of {n} blocks); expected {expected}")
            block = Block(program, i, bd.parent_idx)
            program.blocks.append(block)
            for j, vd in enumerate(bd.vars):
                where = f"block {i} variable #{j} ({vd.name!r})"
                block.add_var(_decode_var(vd))
            for j, od in enumerate(bd.ops):
                where = f"block {i} op #{j} ({od.type!r})"
                attrs: dict[str, Any] = {}
                for a in od.attrs:
                    if a.name in attrs:
                        raise ValueError(f"attribute {a.name!r} appears twice")
                    attrs[a.name] = _decode_attr(a)
                block._append_raw_op(od.type, _decode_slots(od.inputs, "input"),
                                     _decode_slots(od.outputs, "output"), attrs)
        except FlotillaError as exc:
            raise SerializationError(f"cannot load {source}: invalid program: {where}: {exc.message}",
                                     hint=exc.hint) from None
        except (TypeError, ValueError) as exc:
            raise SerializationError(f"cannot load {source}: invalid program: {where}: {exc}") from None
    return program


def program_from_bytes(data: bytes, source: str = "<bytes>") -> Program:
    """Decode the file form written by ``program_to_bytes``; ``source`` names the data in errors."""
    payload = _check_header(data, source)
    desc = fw.ProgramDesc()
    try:
        desc.ParseFromString(payload)
    except DecodeError as exc:
        raise SerializationError(f"cannot load {source}: the payload is not a valid ProgramDesc: {exc}",
                                 hint="the file is corrupted or was written by an incompatible tool") from None
    return program_from_desc(desc, source)


def load_program(path: str | os.PathLike[str]) -> Program:
    """Read a program file written by ``save_program``."""
    source = str(path)
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise SerializationError(f"cannot read program file {source!r}: {exc.strerror or exc}") from None
    return program_from_bytes(data, source)
