"""Saving and loading variables: the on-disk format and Fluid's ``save_vars`` / ``load_vars`` family.

On-disk format (version 1; every integer little-endian)
-------------------------------------------------------
A **variable record** holds one variable::

    offset 0   8 bytes   magic b"FLOTVAR\\0"
    offset 8   uint32    format version (1)
    offset 12  uint32    H, the length of the header
    offset 16  H bytes   header: UTF-8 JSON object with
                           "name"   the variable's name (informative: a load op fills its own Out),
                           "type"   "lod_tensor" or "selected_rows",
                           "dtype"  numpy dtype name, one of ir.ops.registry.DTYPES,
                           "shape"  the dense tensor's shape; for selected_rows the values' shape
                                    [nrows, *row_shape],
                           "height" (selected_rows only) rows of the dense tensor,
                           "nbytes" payload length, "crc32" zlib.crc32 of the payload
    offset 16+H          payload: for selected_rows the rows (int64, nrows of them), then the values;
                         else the tensor; raw C-order little-endian bytes

With ``save_vars(..., filename=...)`` (op ``save_combine``) every variable goes into one **archive**::

    offset 0   8 bytes   magic b"FLOTARC\\0"
    offset 8   uint32    format version (1)
    offset 12  uint32    I, the length of the index
    offset 16  I bytes   index: UTF-8 JSON {"vars": [{"name", "offset", "length"}, ...]}, offsets counted
                         from the end of the index
    offset 16+I          the variable records, one after the other

Without ``filename`` each variable is one file in ``dirname`` named ``var_filename(name)``: the name with
``%``, ``/`` and every character other than letters, digits, ``@ . _ -`` percent-encoded (and a leading
``.`` too), so the mapping is reversible (``name_from_filename``).

Checkpoint parts (``save_checkpoint_part`` / ``load_checkpoint_part``; what a pserver saves on
CheckpointNotify and loads on restart): the variable files are written into a temporary directory beside
the target, each fsynced; ``MANIFEST.json`` (format; per file its size and sha256; per variable its
file and, for a slice, table shard or per-slice copy, which part of which whole variable it is:
``slice_layouts``) is written last and fsynced; then the directory replaces the target by rename. A target that exists but is
not a checkpoint part (no manifest) is never overwritten. Loading verifies the manifest first and refuses
a torn checkpoint (no manifest, a file missing) or a tampered one (a size or checksum that differs).

Invariants:
- The round trip is bit-exact (raw bytes, NaN payloads included) for every dtype and for SelectedRows.
- Files are written to a temporary name, fsynced and renamed, so a crash never leaves a half-written
  file under the final name.
- Every failure is an ExecutionError naming the variable and the file and saying what was expected: a
  missing file, a variable missing from the scope on save, a type / dtype / shape that disagrees with
  the program's declaration on load (-1 matches any extent), a corrupt or truncated file.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import struct
import zlib
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import quote, unquote

import jax.numpy as jnp
import numpy as np

from ir.core import Program, Variable, default_main_program
from ir.dist_info import DistRole, distributed_role
from ir.ops.registry import DTYPES
from runtime.scope import ExecutionError, Scope, SelectedRows

FORMAT_VERSION = 1
VAR_MAGIC = b"FLOTVAR\0"
ARCHIVE_MAGIC = b"FLOTARC\0"
_PREFIX = struct.Struct("<8sII")  # magic, version, header/index length

__all__ = [
    "FORMAT_VERSION", "check_declared", "decode_var", "describe_checkpoint", "encode_var", "is_parameter",
    "is_persistable",
    "load_params", "load_persistables", "load_vars", "name_from_filename", "read_archive", "read_var_file",
    "save_params", "save_persistables", "save_vars", "var_filename", "write_archive", "write_var_file",
]


# --- file names
def var_filename(name: str) -> str:
    """The file name a variable is saved under: reversible and safe on every filesystem we target."""
    encoded = quote(name, safe="@._-")
    if encoded.startswith("."):
        encoded = "%2E" + encoded[1:]
    return encoded


def name_from_filename(filename: str) -> str:
    """The variable name ``var_filename`` encoded into ``filename``."""
    return unquote(filename)


# --- encoding
def _dtype(name: str) -> np.dtype:
    return np.dtype(jnp.dtype(name))  # jnp knows bfloat16 (ml_dtypes) where numpy does not


def _le_bytes(arr: np.ndarray) -> bytes:
    arr = np.ascontiguousarray(arr)
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(order="C")


def _host_array(value: Any, name: str, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if str(arr.dtype) not in DTYPES:
        raise ExecutionError(f"cannot save variable {name!r}: {what} has dtype {arr.dtype}, "
                             f"expected one of {list(DTYPES)}")
    return arr


def encode_var(name: str, value: Any) -> bytes:
    """One variable record (see the module docstring) for an array or SelectedRows ``value``."""
    if isinstance(value, SelectedRows):
        rows = np.asarray(value.rows).astype(np.int64).reshape(-1)
        values = _host_array(value.values, name, "the SelectedRows values")
        if values.ndim == 0 or values.shape[0] != rows.shape[0]:
            raise ExecutionError(f"cannot save variable {name!r}: SelectedRows has {rows.shape[0]} rows but "
                                 f"values of shape {list(values.shape)}; expected one value row per row")
        payload = _le_bytes(rows) + _le_bytes(values)
        header = {"name": name, "type": "selected_rows", "dtype": str(values.dtype),
                  "shape": list(values.shape), "height": int(value.height)}
    else:
        arr = _host_array(value, name, "the tensor")
        payload = _le_bytes(arr)
        header = {"name": name, "type": "lod_tensor", "dtype": str(arr.dtype), "shape": list(arr.shape)}
    header["nbytes"] = len(payload)
    header["crc32"] = zlib.crc32(payload)
    head = json.dumps(header, sort_keys=True).encode("utf-8")
    return _PREFIX.pack(VAR_MAGIC, FORMAT_VERSION, len(head)) + head + payload


def _corrupt(name: str, path: str, problem: str) -> ExecutionError:
    return ExecutionError(f"cannot load variable {name!r} from {path}: {problem}",
                          hint="the file is corrupt or truncated, or not written by runtime.io; save it again")


def _read_prefix(data: bytes | memoryview, magic: bytes, name: str, path: str, what: str) -> tuple[int, int]:
    """Check magic and version; return (length field, offset after the prefix)."""
    if len(data) < _PREFIX.size:
        raise _corrupt(name, path, f"the file has {len(data)} bytes, fewer than the {_PREFIX.size}-byte "
                                   f"{what} prefix")
    got_magic, version, length = _PREFIX.unpack_from(data, 0)
    if got_magic != magic:
        raise _corrupt(name, path, f"bad magic {bytes(got_magic)!r}, expected {magic!r} (a {what})")
    if version != FORMAT_VERSION:
        raise _corrupt(name, path, f"format version {version}, expected {FORMAT_VERSION}")
    if _PREFIX.size + length > len(data):
        raise _corrupt(name, path, f"the {what} header needs {length} bytes but only "
                                   f"{len(data) - _PREFIX.size} follow the prefix (truncated)")
    return length, _PREFIX.size


def _json(raw: bytes | memoryview, name: str, path: str, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _corrupt(name, path, f"the {what} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _corrupt(name, path, f"the {what} is a JSON {type(obj).__name__}, expected an object")
    return obj


def _field(header: dict[str, Any], key: str, kind: type | tuple[type, ...], name: str, path: str) -> Any:
    value = header.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise _corrupt(name, path, f"header field {key!r} is {value!r}, expected a {getattr(kind, '__name__', kind)}")
    return value


def decode_var(data: bytes | memoryview, *, name: str, path: str) -> Any:
    """The array (numpy, read-only) or SelectedRows of numpy arrays in one variable record.

    ``name`` and ``path`` are used in error messages only.
    """
    data = memoryview(data)
    head_len, start = _read_prefix(data, VAR_MAGIC, name, path, "variable record")
    header = _json(data[start:start + head_len], name, path, "header")
    var_type = _field(header, "type", str, name, path)
    dtype_name = _field(header, "dtype", str, name, path)
    shape = _field(header, "shape", list, name, path)
    nbytes = _field(header, "nbytes", int, name, path)
    crc = _field(header, "crc32", int, name, path)
    if dtype_name not in DTYPES:
        raise _corrupt(name, path, f"unknown dtype {dtype_name!r}, expected one of {list(DTYPES)}")
    if var_type not in ("lod_tensor", "selected_rows"):
        raise _corrupt(name, path, f"unknown variable type {var_type!r}, expected lod_tensor or selected_rows")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _corrupt(name, path, f"bad shape {shape!r}, expected non-negative integers")
    dtype = _dtype(dtype_name)
    numel = int(np.prod(shape, dtype=np.int64))
    sparse = var_type == "selected_rows"
    nrows = shape[0] if sparse and shape else 0
    if sparse and not shape:
        raise _corrupt(name, path, "a selected_rows record has a 0-d values shape, expected [nrows, ...]")
    expected = numel * dtype.itemsize + (nrows * 8 if sparse else 0)
    payload = data[start + head_len:]
    if nbytes != expected:
        raise _corrupt(name, path, f"header says {nbytes} payload bytes but dtype {dtype_name} and shape "
                                   f"{shape} need {expected}")
    if len(payload) != expected:
        state = "truncated" if len(payload) < expected else "has trailing bytes"
        raise _corrupt(name, path, f"the payload has {len(payload)} bytes, expected {expected} ({state})")
    if zlib.crc32(payload) != crc:
        raise _corrupt(name, path, "the payload checksum (crc32) does not match the header")
    le = dtype.newbyteorder("<")
    if sparse:
        height = _field(header, "height", int, name, path)
        rows = np.frombuffer(payload[: nrows * 8], dtype="<i8").astype(np.int64, copy=False)
        values = np.frombuffer(payload[nrows * 8:], dtype=le).astype(dtype, copy=False).reshape(shape)
        return SelectedRows(rows, values, height)
    return np.frombuffer(payload, dtype=le).astype(dtype, copy=False).reshape(shape)


# --- files
def _write_atomic(path: str, data: bytes, overwrite: bool, name: str) -> None:
    if not overwrite and os.path.exists(path):
        raise ExecutionError(f"cannot save variable {name!r}: {path} exists and overwrite is false",
                             hint="remove the file, or save with overwrite=True")
    folder = os.path.dirname(path)
    try:
        if folder:
            os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise ExecutionError(f"cannot save variable {name!r} to {path}: {e.strerror or e}") from None


def _read_file(path: str, name: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ExecutionError(f"cannot load variable {name!r}: {what} {path} does not exist",
                             hint="check dirname/filename, and that the variables were saved there") from None
    except OSError as e:
        raise ExecutionError(f"cannot load variable {name!r} from {path}: {e.strerror or e}") from None


def write_var_file(path: str, name: str, value: Any, overwrite: bool = True) -> None:
    """Write one variable record to ``path``."""
    _write_atomic(path, encode_var(name, value), overwrite, name)


def read_var_file(path: str, name: str) -> Any:
    """Read the variable record at ``path`` (``name``: for error messages)."""
    return decode_var(_read_file(path, name, "file"), name=name, path=path)


def write_archive(path: str, items: Sequence[tuple[str, Any]], overwrite: bool = True) -> None:
    """Write ``(name, value)`` pairs into one archive at ``path``."""
    names = [n for n, _ in items]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise ExecutionError(f"cannot save variable {dup!r} twice into the archive {path}",
                             hint="list each variable once")
    records = [encode_var(n, v) for n, v in items]
    entries, offset = [], 0
    for n, rec in zip(names, records):
        entries.append({"length": len(rec), "name": n, "offset": offset})
        offset += len(rec)
    index = json.dumps({"vars": entries}, sort_keys=True).encode("utf-8")
    data = b"".join([_PREFIX.pack(ARCHIVE_MAGIC, FORMAT_VERSION, len(index)), index, *records])
    _write_atomic(path, data, overwrite, names[0] if names else "<none>")


def read_archive(path: str, names: Sequence[str]) -> dict[str, Any]:
    """The variables ``names`` from the archive at ``path``, by name."""
    first = names[0] if names else "<none>"
    data = memoryview(_read_file(path, first, "archive"))
    index_len, start = _read_prefix(data, ARCHIVE_MAGIC, first, path, "archive")
    index = _json(data[start:start + index_len], first, path, "archive index")
    entries = index.get("vars")
    if not isinstance(entries, list):
        raise _corrupt(first, path, "the archive index has no 'vars' list")
    body = data[start + index_len:]
    where: dict[str, tuple[int, int]] = {}
    for e in entries:
        if not isinstance(e, dict):
            raise _corrupt(first, path, f"archive index entry {e!r} is not an object")
        n = _field(e, "name", str, first, path)
        off = _field(e, "offset", int, n, path)
        length = _field(e, "length", int, n, path)
        where[n] = (off, length)
    out: dict[str, Any] = {}
    for n in names:
        if n not in where:
            raise ExecutionError(f"cannot load variable {n!r}: the archive {path} does not hold it",
                                 hint=f"it holds {sorted(where)[:20]}")
        off, length = where[n]
        if off < 0 or length < 0 or off + length > len(body):
            raise _corrupt(n, path, f"its record spans bytes {off}..{off + length} of the archive body, "
                                    f"which has {len(body)} bytes (truncated)")
        out[n] = decode_var(body[off:off + length], name=n, path=path)
    return out


def check_declared(var: Variable, value: Any, path: str) -> None:
    """Raise unless a loaded ``value`` agrees with ``var``'s declared type, dtype and shape."""
    sparse = isinstance(value, SelectedRows)
    found_type = "selected_rows" if sparse else "lod_tensor"
    if var.type in ("lod_tensor", "selected_rows") and var.type != found_type:
        raise ExecutionError(f"cannot load variable {var.name!r} from {path}: the file holds a {found_type}, "
                             f"the program declares a {var.type}",
                             hint="load the file saved for this variable")
    dtype = str(value.dtype)
    if dtype != var.dtype:
        raise ExecutionError(f"cannot load variable {var.name!r} from {path}: the file holds dtype {dtype}, "
                             f"the program declares {var.dtype}",
                             hint="load the file saved for this variable, or fix its declared dtype")
    shape = tuple(value.shape)
    if len(shape) != len(var.shape) or any(d >= 0 and d != s for d, s in zip(var.shape, shape)):
        raise ExecutionError(f"cannot load variable {var.name!r} from {path}: the file holds shape {list(shape)}, "
                             f"the program declares {list(var.shape)} (-1: any)",
                             hint="load the file saved for this variable, or fix its declared shape")


# --- Fluid's API
def is_persistable(var: Variable) -> bool:
    """Fluid's predicate: persistable variables, except raw ones (RPC handles, readers)."""
    return var.persistable and var.type != "raw"


def is_parameter(var: Variable) -> bool:
    return var.is_parameter


def _select(program: Program, vars: Iterable[Any] | None, predicate: Callable[[Variable], bool] | None) -> list[Variable]:
    block = program.global_block()
    if vars is None:
        chosen: Iterable[Variable] = (v for v in program.list_vars() if predicate is None or predicate(v))
    else:
        chosen = (v if isinstance(v, Variable) else block.var_recursive(v) for v in vars)
    out: dict[str, Variable] = {}
    for v in chosen:
        out.setdefault(v.name, v)
    return list(out.values())


def _io_program(variables: list[Variable]) -> Program:
    prog = Program()
    block = prog.global_block()
    for v in variables:
        block.add_var(v)
    return prog


def _executor(executor: Any) -> Any:
    if executor is None:
        from runtime.executor import Executor

        return Executor()
    return executor


#: ``append_op``'s keyword -> the slot the save/load ops name their variables in.
_IO_SLOT_NAMES = {"inputs": "X", "outputs": "Out"}


def _run_io_ops(executor: Any, dirname: str, main_program: Program | None, vars: Iterable[Any] | None,
                predicate: Callable[[Variable], bool] | None, filename: str | None, scope: Scope | None,
                op: str, slot: str) -> None:
    """Run one ``op`` per selected variable (or one ``op + "_combine"`` for them all, into ``filename``),
    each naming its variables in ``slot``: what ``save_vars`` and ``load_vars`` share."""
    program = main_program if main_program is not None else default_main_program()
    variables = _select(program, vars, predicate)
    if not variables:
        return
    prog = _io_program(variables)
    block = prog.global_block()
    if filename is None:
        for v in variables:
            block.append_op(op, **{slot: {_IO_SLOT_NAMES[slot]: [v.name]}},
                            attrs={"file_path": os.path.join(dirname, var_filename(v.name))}, infer_shape=False)
    else:
        block.append_op(f"{op}_combine", **{slot: {_IO_SLOT_NAMES[slot]: [v.name for v in variables]}},
                        attrs={"file_path": os.path.join(dirname, filename)}, infer_shape=False)
    _executor(executor).run(prog, scope=scope)


def save_vars(executor: Any, dirname: str, main_program: Program | None = None, vars: Iterable[Any] | None = None,
              predicate: Callable[[Variable], bool] | None = None, filename: str | None = None, *,
              scope: Scope | None = None) -> None:
    """Save ``vars`` (Variables or names), or the variables of ``main_program`` that ``predicate`` accepts
    (all when None), from ``scope`` (default ``runtime.global_scope()``) into ``dirname``: one file each,
    or one archive ``filename``. Runs ``save`` / ``save_combine`` ops on ``executor``."""
    _run_io_ops(executor, dirname, main_program, vars, predicate, filename, scope, "save", "inputs")


def load_vars(executor: Any, dirname: str, main_program: Program | None = None, vars: Iterable[Any] | None = None,
              predicate: Callable[[Variable], bool] | None = None, filename: str | None = None, *,
              scope: Scope | None = None) -> None:
    """Load what ``save_vars`` with the same arguments saved into ``scope`` (default
    ``runtime.global_scope()``), checking each value against its declaration in ``main_program``."""
    if filename is None and is_distributed_checkpoint(dirname):
        program = main_program if main_program is not None else default_main_program()
        load_assembled(executor, dirname, _select(program, vars, predicate), scope=scope)
        return
    _run_io_ops(executor, dirname, main_program, vars, predicate, filename, scope, "load", "outputs")


def save_params(executor: Any, dirname: str, main_program: Program | None = None, filename: str | None = None,
                *, scope: Scope | None = None) -> None:
    """Save every parameter of ``main_program``."""
    save_vars(executor, dirname, main_program, predicate=is_parameter, filename=filename, scope=scope)


def load_params(executor: Any, dirname: str, main_program: Program | None = None, filename: str | None = None,
                *, scope: Scope | None = None) -> None:
    """Load every parameter of ``main_program``."""
    load_vars(executor, dirname, main_program, predicate=is_parameter, filename=filename, scope=scope)


def save_persistables(executor: Any, dirname: str, main_program: Program | None = None,
                      filename: str | None = None, *, scope: Scope | None = None) -> None:
    """Save every persistable variable of ``main_program`` (parameters, accumulators, learning rates).

    On a transpiled program the state is spread over processes: a **trainer** program asks every pserver
    it talks to (``CheckpointNotify``) to save its slices, accumulators and table shards under
    ``dirname/pserver_<id>``, then saves its own non-parameter persistables (e.g. metric states) under
    ``dirname/trainer_<id>``; a **pserver** program saves its state under ``dirname/pserver_<id>``."""
    program = main_program if main_program is not None else default_main_program()
    dist = distributed_role(program)
    if dist is None:
        save_vars(executor, dirname, program, predicate=is_persistable, filename=filename, scope=scope)
    elif dist.kind == "pserver":
        save_checkpoint_part(executor, _part_dir(dirname, dist), program, vars=pserver_checkpoint_vars(program),
                             filename=filename, scope=scope)
    else:
        from runtime.flags import checkpoint_root

        root = checkpoint_root()
        name = checkpoint_name(dirname, root)
        _executor(executor).rpc_session.client(dist.id).checkpoint(dist.endpoints, name)
        present = scope if scope is not None else _global_scope()
        local = [v for v in _trainer_local_vars(program) if present.find_var(v.name) is not None]
        base = name if os.path.isabs(name) else os.path.join(root or "", name)
        save_vars(executor, _part_dir(base, dist), program, vars=local, filename=filename, scope=scope)


def load_persistables(executor: Any, dirname: str, main_program: Program | None = None,
                      filename: str | None = None, *, scope: Scope | None = None) -> None:
    """Load every persistable variable of ``main_program``; on a transpiled program, this process's part
    of what ``save_persistables`` saved (a pserver's slices, a trainer's local state when saved). A
    pserver of a job with another number of pservers than saved the checkpoint cuts its slices out of the
    assembled variables (``load_resliced``); a program that is not transpiled, given a distributed
    checkpoint, loads every variable whole (``load_assembled``)."""
    program = main_program if main_program is not None else default_main_program()
    dist = distributed_role(program)
    if dist is None:
        load_vars(executor, dirname, program, predicate=is_persistable, filename=filename, scope=scope)
    elif dist.kind == "pserver":
        variables = pserver_checkpoint_vars(program)
        if filename is None and _pserver_count(dirname) not in (0, _pservers_of(program)):
            load_resliced(executor, dirname, program, variables, scope=scope)
            return
        load_checkpoint_part(executor, _part_dir(dirname, dist), program, vars=variables, filename=filename,
                             scope=scope)
    else:
        part = _part_dir(dirname, dist)
        local = [v for v in _trainer_local_vars(program)
                 if filename is None and os.path.exists(os.path.join(part, var_filename(v.name)))]
        load_vars(executor, part, program, vars=local, filename=filename, scope=scope)


def checkpoint_name(dirname: str, root: str | None) -> str:
    """The name a trainer sends in CheckpointNotify for ``dirname``: relative to the checkpoint root
    (``FLOTILLA_CHECKPOINT_ROOT``, which the pservers share) when it is set and ``dirname`` lies under it
    or is relative; otherwise the absolute path, which the pservers take as it is (as Fluid did)."""
    if not dirname:
        raise ExecutionError("save_persistables got an empty dirname", hint="name the checkpoint directory")
    if root is None:
        return os.path.abspath(dirname)
    if not os.path.isabs(dirname):
        return os.path.normpath(dirname)
    real_root, real = os.path.realpath(root), os.path.realpath(dirname)
    if os.path.commonpath([real_root, real]) != real_root or real == real_root:
        return os.path.normpath(dirname)
    return os.path.relpath(real, real_root)


MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "flotilla-checkpoint-part-1"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def save_checkpoint_part(executor: Any, path: str, main_program: Program, vars: Iterable[Any],
                         filename: str | None = None, *, scope: Scope | None = None) -> None:
    """Save ``vars`` as a checkpoint part at directory ``path``, atomically (see the module docstring)."""
    path = os.path.abspath(path)
    if os.path.lexists(path) and not (os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))):
        raise ExecutionError(f"cannot save a checkpoint at {path}: something that is not a checkpoint is there",
                             hint="remove it or choose another checkpoint name; nothing was overwritten")
    parent = os.path.dirname(path)
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
        chosen = _select(main_program, vars, None)
        save_vars(executor, tmp, main_program, vars=chosen, filename=filename, scope=scope)
        files = {}
        for entry in sorted(os.listdir(tmp)):
            size, sha = _digest(os.path.join(tmp, entry))
            files[entry] = {"sha256": sha, "size": size}
        where = {v.name: filename or var_filename(v.name) for v in chosen}
        layouts = slice_layouts(main_program, chosen)
        described = {n: {"file": where[n], **({"slice": layouts[n]} if n in layouts else {})} for n in where}
        manifest = json.dumps({"files": files, "format": MANIFEST_FORMAT, "vars": described}, indent=1,
                              sort_keys=True).encode()
        _write_atomic(os.path.join(tmp, MANIFEST), manifest, True, MANIFEST)
        _fsync_dir(tmp)
        old = None
        if os.path.lexists(path):
            old = f"{path}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        raise ExecutionError(f"cannot save a checkpoint at {path}: {e.strerror or e}") from None
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def verify_checkpoint_part(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint part at ``path`` once every file it lists has its size and sha256;
    ExecutionError for a torn or tampered part."""
    manifest_path = os.path.join(path, MANIFEST)
    hint = "the save did not finish or the files were changed since: load an intact checkpoint"
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ExecutionError(f"checkpoint {path} is torn or not a checkpoint: it has no {MANIFEST}",
                             hint=hint) from None
    except (OSError, ValueError) as e:
        raise ExecutionError(f"checkpoint {path}: {MANIFEST} cannot be read: {e}", hint=hint) from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise ExecutionError(f"checkpoint {path}: {MANIFEST} is not a {MANIFEST_FORMAT} manifest", hint=hint)
    for entry, want in sorted(files.items()):
        file = os.path.join(path, entry)
        if os.path.basename(entry) != entry or not isinstance(want, dict):
            raise ExecutionError(f"checkpoint {path}: {MANIFEST} lists a bad entry {entry!r}", hint=hint)
        if not os.path.isfile(file):
            raise ExecutionError(f"checkpoint {path} is torn: {entry} is missing", hint=hint)
        size, sha = _digest(file)
        if size != want.get("size") or sha != want.get("sha256"):
            raise ExecutionError(f"checkpoint {path} was tampered with or damaged: {entry} has {size} bytes "
                                 f"and sha256 {sha[:16]}..., the manifest says {want.get('size')} bytes and "
                                 f"{str(want.get('sha256'))[:16]}...", hint=hint)
    return manifest


def load_checkpoint_part(executor: Any, path: str, main_program: Program, vars: Iterable[Any],
                         filename: str | None = None, *, scope: Scope | None = None) -> None:
    """Verify the checkpoint part at ``path`` (``verify_checkpoint_part``), then load ``vars`` from it."""
    verify_checkpoint_part(path)
    load_vars(executor, path, main_program, vars=vars, filename=filename, scope=scope)


def slice_layouts(program: Program, variables: Iterable[Variable]) -> dict[str, dict[str, Any]]:
    """How each of ``variables`` of a pserver program relates to a whole variable of the job's original
    program, so that a checkpoint part says by itself what it holds (its manifest's ``"slice"``):

    - ``{"of": W, "how": "rows", "offset": k}``: rows ``k ..`` of ``W`` (a sliced parameter or accumulator);
    - ``{"of": W, "how": "mod", "index": i}``: shard ``i`` of ``n`` of the distributed table ``W`` (or of an
      accumulator shaped like it): local row ``j`` is global row ``j * n + i``, ``n`` being the number of
      shards the checkpoint holds;
    - ``{"of": W, "how": "copy"}``: a per-slice copy of the whole ``W`` (e.g. a sliced parameter's Adam
      beta powers).

    A variable not listed is whole, under its own name."""
    block = program.global_block()
    out: dict[str, dict[str, Any]] = {}
    tables = {}
    for v in variables:
        if v.slice_of and v.is_parameter and getattr(v, "is_distributed", False):
            out[v.name] = {"of": v.slice_of, "how": "mod", "index": int(v.slice_index or 0)}
            tables[v.name] = v
        elif v.slice_of:
            out[v.name] = {"of": v.slice_of, "how": "rows", "offset": int(v.slice_offset or 0)}
        elif v.copy_of and v.trainer_id is None:
            out[v.name] = {"of": v.copy_of, "how": "copy"}
    names = {v.name for v in variables}
    for blk in program.blocks:
        for op in blk.ops:
            params = op.input("Param")
            if len(params) != 1 or params[0] not in tables:
                continue
            table = tables[params[0]]
            for slot, args in op.inputs.items():
                for n in args:
                    if slot in ("Param", "Grad") or n not in names or n in out or not block.has_var(n):
                        continue
                    if tuple(block.var(n).shape) == tuple(table.shape):
                        out[n] = {"of": n, "how": "mod", "index": out[table.name]["index"]}
    return out


def _headers(path: str) -> list[dict[str, Any]]:
    """The record headers (name, type, dtype, shape, ...) of a variable file or archive, payloads unread
    beyond what the archive index needs."""
    data = memoryview(_read_file(path, os.path.basename(path), "file"))
    if bytes(data[:8]) == ARCHIVE_MAGIC:
        index_len, start = _read_prefix(data, ARCHIVE_MAGIC, "<archive>", path, "archive")
        body = data[start + index_len:]
        entries = _json(data[start:start + index_len], "<archive>", path, "archive index").get("vars") or []
        records = [body[e["offset"]:e["offset"] + e["length"]] for e in entries if isinstance(e, dict)]
    else:
        records = [data]
    out = []
    for rec in records:
        head_len, start = _read_prefix(rec, VAR_MAGIC, os.path.basename(path), path, "variable record")
        out.append(_json(rec[start:start + head_len], os.path.basename(path), path, "header"))
    return out


def _part_dirs(dirname: str) -> list[str]:
    """The parts of a distributed checkpoint (``pserver_<i>``, ``trainer_<i>``), pservers first, by id;
    empty for a single-machine checkpoint."""
    def key(entry: str) -> tuple[int, int]:
        kind, _, num = entry.partition("_")
        return (0 if kind == "pserver" else 1, int(num))

    found = [e for e in os.listdir(dirname) if os.path.isdir(os.path.join(dirname, e))
             and e.partition("_")[0] in ("pserver", "trainer") and e.partition("_")[2].isdigit()]
    return sorted(found, key=key)


def describe_checkpoint(dirname: str) -> list[dict[str, Any]]:
    """What the checkpoint at ``dirname`` holds, one entry per variable (``part``, ``file``, ``name``,
    ``type``, ``dtype``, ``shape``, ``slice``), after verifying every part that has a manifest
    (``verify_checkpoint_part``: ExecutionError naming the torn or tampered file). ``dirname`` is a whole
    distributed checkpoint (``pserver_<i>``/``trainer_<i>`` parts), one part, or a single-machine save."""
    if not os.path.isdir(dirname):
        raise ExecutionError(f"checkpoint {dirname} is not a directory",
                             hint="name the directory save_persistables wrote")
    parts = _part_dirs(dirname) or [""]
    rows = []
    for part in parts:
        path = os.path.join(dirname, part)
        manifest = verify_checkpoint_part(path) if os.path.isfile(os.path.join(path, MANIFEST)) else None
        described = (manifest or {}).get("vars") or {}
        for entry in sorted(os.listdir(path)):
            file = os.path.join(path, entry)
            if entry == MANIFEST or not os.path.isfile(file) or manifest is not None and entry not in manifest["files"]:
                continue
            for head in _headers(file):
                name = head.get("name")
                rows.append({"part": part, "file": entry, "name": name, "type": head.get("type"),
                             "dtype": head.get("dtype"), "shape": head.get("shape"),
                             "slice": (described.get(name) or {}).get("slice")})
    return rows


def is_distributed_checkpoint(dirname: str) -> bool:
    """Whether ``dirname`` holds the parts a distributed job saved (a ``pserver_<i>`` with a manifest)."""
    return os.path.isdir(dirname) and any(
        p.startswith("pserver_") and os.path.isfile(os.path.join(dirname, p, MANIFEST)) for p in _part_dirs(dirname))


def assemble_checkpoint(dirname: str) -> dict[str, tuple[Any, str]]:
    """Every variable of the distributed checkpoint at ``dirname`` made whole, by name, with the file it
    came from (for errors): slices joined by their row offsets, table shards interleaved (shard ``i`` of
    ``n`` holds global row ``j * n + i`` at local row ``j``; the result has ``n * shard rows`` rows, the
    caller trims it to the declared height), per-slice copies taken once, trainer state as saved. Every
    pserver part is verified first (``verify_checkpoint_part``)."""
    whole: dict[str, tuple[Any, str]] = {}
    rows: dict[str, list[tuple[int, Any, str]]] = {}
    shards: dict[str, list[tuple[int, Any, str]]] = {}
    for part in _part_dirs(dirname):
        path = os.path.join(dirname, part)
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            for entry in sorted(os.listdir(path)):
                file = os.path.join(path, entry)
                if os.path.isfile(file):
                    whole.setdefault(name_from_filename(entry), (read_var_file(file, name_from_filename(entry)), file))
            continue
        manifest = verify_checkpoint_part(path)
        described = manifest.get("vars")
        if not isinstance(described, dict):
            raise ExecutionError(f"checkpoint part {path} does not say what its files hold (its {MANIFEST} has no "
                                 "'vars'): it was saved by an older Flotilla",
                                 hint="load it into the job that saved it (same number of pservers)")
        for name, desc in sorted(described.items()):
            file = os.path.join(path, desc["file"])
            value = (read_var_file(file, name) if desc["file"] == var_filename(name)
                     else read_archive(file, [name])[name])
            layout = desc.get("slice") or {}
            how, of = layout.get("how"), layout.get("of", name)
            if how == "rows":
                rows.setdefault(of, []).append((int(layout["offset"]), value, file))
            elif how == "mod":
                shards.setdefault(of, []).append((int(layout["index"]), value, file))
            elif how == "copy":
                whole.setdefault(of, (value, file))
            else:
                whole.setdefault(name, (value, file))
    for of, pieces in rows.items():
        pieces.sort(key=lambda p: p[0])
        at = 0
        for offset, value, file in pieces:
            if offset != at:
                raise ExecutionError(f"checkpoint {dirname}: the slices of {of!r} do not join: {file} starts at row "
                                     f"{offset}, expected {at}", hint="a part of the checkpoint is missing")
            at += np.shape(value)[0]
        whole[of] = (np.concatenate([np.asarray(v) for _, v, _ in pieces]), dirname)
    for of, pieces in shards.items():
        pieces.sort(key=lambda p: p[0])
        n = len(pieces)
        if [i for i, _, _ in pieces] != list(range(n)):
            raise ExecutionError(f"checkpoint {dirname}: table {of!r} has shards {[i for i, _, _ in pieces]}, "
                                 f"expected 0..{n - 1}", hint="a pserver part of the checkpoint is missing")
        first = np.asarray(pieces[0][1])
        table = np.zeros((n * first.shape[0], *first.shape[1:]), dtype=first.dtype)
        for i, value, _ in pieces:
            table[i::n] = np.asarray(value)
        whole[of] = (table, dirname)
    return whole


def load_assembled(executor: Any, dirname: str, variables: Sequence[Variable], *, scope: Scope | None = None) -> None:
    """Load ``variables`` whole from the distributed checkpoint at ``dirname`` (``assemble_checkpoint``)
    into ``scope``, each checked against its declaration; a table keeps its declared rows."""
    held = assemble_checkpoint(dirname)
    values = []
    for var in variables:
        if var.name not in held:
            raise ExecutionError(f"cannot load variable {var.name!r}: the checkpoint {dirname} holds no part of it",
                                 hint=f"it holds {sorted(held)[:20]}; load a checkpoint of this model")
        value, path = held[var.name]
        if isinstance(value, np.ndarray) and value.ndim and var.shape and 0 <= var.shape[0] < value.shape[0]:
            value = value[: var.shape[0]]  # a table's shards pad it to a multiple of the pservers
        check_declared(var, value, path)
        values.append((var.name, value))
    _set_loaded(executor, scope, values)


def load_resliced(executor: Any, dirname: str, program: Program, variables: Sequence[Variable], *,
                  scope: Scope | None = None) -> None:
    """Load a pserver's ``variables`` from the distributed checkpoint at ``dirname`` saved by a job with
    another number of pservers: each variable is assembled whole (``assemble_checkpoint``), then this
    pserver's slice is cut out of it as ``program`` lays it out (``slice_layouts``)."""
    held = assemble_checkpoint(dirname)
    layouts = slice_layouts(program, variables)
    n = _pservers_of(program)
    values = []
    for var in variables:
        layout = layouts.get(var.name) or {}
        of = layout.get("of", var.name)
        if of not in held:
            raise ExecutionError(f"cannot load variable {var.name!r}: the checkpoint {dirname} holds no part of {of!r}",
                                 hint=f"it holds {sorted(held)[:20]}; load a checkpoint of this model")
        value, path = held[of]
        if layout.get("how") == "rows":
            start = int(layout["offset"])
            value = np.asarray(value)[start:start + var.shape[0]]
        elif layout.get("how") == "mod":
            table = np.asarray(value)
            rows = np.arange(var.shape[0]) * n + int(layout["index"])
            value = np.zeros((var.shape[0], *table.shape[1:]), dtype=table.dtype)
            present = rows < table.shape[0]
            value[present] = table[rows[present]]
        check_declared(var, value, path)
        values.append((var.name, value))
    _set_loaded(executor, scope, values)


def _set_loaded(executor: Any, scope: Scope | None, values: Sequence[tuple[str, Any]]) -> None:
    """Put loaded host values into ``scope`` on the executor's device (64-bit types kept)."""
    import jax

    from runtime.x64 import x64

    target = scope if scope is not None else _global_scope()
    device = getattr(_executor(executor), "device", None)
    with x64():
        for name, value in values:
            if isinstance(value, SelectedRows):
                target.set_var(name, SelectedRows(jax.device_put(value.rows, device),
                                                  jax.device_put(value.values, device), value.height))
            else:
                target.set_var(name, jax.device_put(np.asarray(value), device))


def pserver_checkpoint_vars(program: Program) -> list[Variable]:
    """The state of a pserver program: its persistable variables except received and merged gradients
    and per-trainer copies (DC-ASGD backups are refreshed by the trainers' first fetch)."""
    (serve,) = [op for op in program.global_block().ops if op.type == "listen_and_serv"]
    grads = set(serve.input("X")) | {e.rpartition(":")[0] for e in serve.attr("grad_to_block_id")}
    return [v for v in program.global_block().vars.values()
            if is_persistable(v) and v.name not in grads and v.trainer_id is None]


def _trainer_local_vars(program: Program) -> list[Variable]:
    """A trainer's own state: persistables that are not parameters (those live on the pservers), nor
    Geo-SGD snapshots of parameters (``copy_of`` a parameter) or touched-rows masks: a restarted Geo
    trainer fetches its parameters and snapshots them anew, and a restored older snapshot would push a
    wrong delta."""
    block = program.global_block()
    masks = {n for op in block.ops if op.type == "geo_sync" for n in op.input("Touched")}
    return [v for v in block.vars.values() if is_persistable(v) and not v.is_parameter and v.name not in masks
            and not (v.copy_of and block.has_var(v.copy_of) and block.var(v.copy_of).is_parameter)]


def _pserver_count(dirname: str) -> int:
    """How many pservers saved the distributed checkpoint at ``dirname`` (0: not one)."""
    return sum(p.startswith("pserver_") for p in _part_dirs(dirname)) if os.path.isdir(dirname) else 0


def _pservers_of(program: Program) -> int:
    (serve,) = [op for op in program.global_block().ops if op.type == "listen_and_serv"]
    return int(serve.attrs.get("pservers", 1))


def _part_dir(dirname: str, dist: DistRole) -> str:
    return os.path.join(dirname, f"{dist.kind}_{dist.id}")


def _global_scope() -> Scope:
    from runtime.scope import global_scope

    return global_scope()
