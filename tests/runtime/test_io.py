"""Saving and loading variables (runtime.io) and the io kernels: bit-exact round trips through files and
archives, and every error path (missing file, missing variable, declaration mismatch, corruption)."""
from __future__ import annotations

import os
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import runtime
from ir.core import Program
from runtime import io as rio
from runtime.scope import ExecutionError, Scope, SelectedRows, global_scope
from runtime.x64 import x64

NAN_PAYLOAD = np.array([0x7FC00001, 0xFFFFFFFF, 0x00000001, 0x3F800000], np.uint32).view(np.float32)


def _program(w_dtype: str = "float32", w_shape: tuple[int, ...] = (2, 4), table_type: str = "selected_rows") -> Program:
    prog = Program()
    b = prog.global_block()
    b.create_parameter("fc/w_0", list(w_shape), w_dtype)
    b.create_parameter("b", [3], "float64")
    b.create_var("step", [1], "int64", persistable=True)
    b.create_var("mask", [5], "bool", persistable=True)
    b.create_var("table", [10, 3], "float32", type=table_type, persistable=True)
    b.create_var("tmp", [-1, 4], "float32")  # not persistable: never saved
    return prog


def _values() -> dict[str, object]:
    rng = np.random.default_rng(0)
    return {
        "fc/w_0": np.concatenate([NAN_PAYLOAD, rng.standard_normal(4).astype(np.float32)]).reshape(2, 4),
        "b": rng.standard_normal(3),
        "step": np.array([2 ** 40 + 3], np.int64),
        "mask": np.array([True, False, True, True, False]),
        "table": SelectedRows(np.array([7, 2, 7], np.int64), rng.standard_normal((3, 3)).astype(np.float32), 10),
        "tmp": np.zeros((2, 4), np.float32),
    }


def _scope_with(values: dict[str, object]) -> Scope:
    scope = Scope()
    with x64():  # device arrays of the declared dtypes, as a run leaves them (int64, float64)
        for name, value in values.items():
            if isinstance(value, SelectedRows):
                value = SelectedRows(jnp.asarray(value.rows), jnp.asarray(value.values), value.height)
            else:
                value = jnp.asarray(value)
            scope.set_var(name, value)
    return scope


def _assert_bit_exact(got: object, want: object) -> None:
    if isinstance(want, SelectedRows):
        assert isinstance(got, SelectedRows)
        assert got.height == want.height
        _assert_bit_exact(got.rows, want.rows)
        _assert_bit_exact(got.values, want.values)
        return
    got_np, want_np = np.asarray(got), np.asarray(want)
    assert got_np.dtype == want_np.dtype and got_np.shape == want_np.shape
    assert got_np.tobytes() == want_np.tobytes()


@pytest.mark.parametrize("filename", [None, "__all__"])
def test_persistables_round_trip_bit_exact(tmp_path: pathlib.Path, filename: str | None) -> None:
    prog, values = _program(), _values()
    exe = runtime.Executor()
    rio.save_persistables(exe, str(tmp_path), prog, filename=filename, scope=_scope_with(values))
    if filename is None:
        assert sorted(os.listdir(tmp_path)) == sorted(rio.var_filename(n) for n in ["fc/w_0", "b", "step", "mask",
                                                                                      "table"])
        assert "fc%2Fw_0" in os.listdir(tmp_path)
    else:
        assert os.listdir(tmp_path) == [filename]
    fresh = Scope()
    rio.load_persistables(exe, str(tmp_path), prog, filename=filename, scope=fresh)
    assert sorted(fresh.local_var_names()) == ["b", "fc/w_0", "mask", "step", "table"]
    for name in fresh.local_var_names():
        _assert_bit_exact(fresh.var(name), values[name])


def test_params_only(tmp_path: pathlib.Path) -> None:
    prog = _program()
    exe = runtime.Executor()
    rio.save_params(exe, str(tmp_path), prog, scope=_scope_with(_values()))
    assert sorted(os.listdir(tmp_path)) == ["b", "fc%2Fw_0"]
    fresh = Scope()
    rio.load_params(exe, str(tmp_path), prog, scope=fresh)
    assert sorted(fresh.local_var_names()) == ["b", "fc/w_0"]


def test_save_vars_by_name_and_predicate(tmp_path: pathlib.Path) -> None:
    prog, values = _program(), _values()
    exe = runtime.Executor()
    scope = _scope_with(values)
    rio.save_vars(exe, str(tmp_path / "a"), prog, vars=["step", prog.global_block().var("b")], scope=scope)
    assert sorted(os.listdir(tmp_path / "a")) == ["b", "step"]
    rio.save_vars(exe, str(tmp_path / "p"), prog, predicate=lambda v: v.dtype == "bool", scope=scope)
    assert os.listdir(tmp_path / "p") == ["mask"]
    fresh = Scope()
    rio.load_vars(exe, str(tmp_path / "a"), prog, vars=["step"], scope=fresh)
    _assert_bit_exact(fresh.var("step"), values["step"])


def test_global_scope_is_the_default(tmp_path: pathlib.Path) -> None:
    prog = Program()
    prog.global_block().create_parameter("io_test_global_w", [2], "float32")
    global_scope().set_var("io_test_global_w", jnp.asarray([1.5, -2.0], jnp.float32))
    try:
        rio.save_params(runtime.Executor(), str(tmp_path), prog)
        global_scope().erase(["io_test_global_w"])
        rio.load_params(runtime.Executor(), str(tmp_path), prog)
        np.testing.assert_array_equal(global_scope().numpy("io_test_global_w"), [1.5, -2.0])
    finally:
        global_scope().erase(["io_test_global_w"])


def test_filenames_are_reversible() -> None:
    for name in ["w", "fc/w_0", "emb@GRAD.block0.trainer_1", "a%2Fb", ".hidden", "..", "x y:z"]:
        fname = rio.var_filename(name)
        assert "/" not in fname and not fname.startswith(".")
        assert rio.name_from_filename(fname) == name


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64",
                                   "bool"])
def test_record_round_trip_every_dtype(dtype: str) -> None:
    arr = np.asarray(jnp.arange(-3, 9).reshape(3, 4).astype(dtype))
    got = rio.decode_var(rio.encode_var("x", arr), name="x", path="<mem>")
    _assert_bit_exact(got, arr)


def test_declared_minus_one_matches_any_extent(tmp_path: pathlib.Path) -> None:
    exe = runtime.Executor()
    src = Program()
    src.global_block().create_var("act", [3, 4], "float32", persistable=True)
    rio.save_persistables(exe, str(tmp_path), src, scope=_scope_with({"act": np.ones((3, 4), np.float32)}))
    dst = Program()
    dst.global_block().create_var("act", [-1, 4], "float32", persistable=True)
    fresh = Scope()
    rio.load_persistables(exe, str(tmp_path), dst, scope=fresh)
    assert fresh.var("act").shape == (3, 4)


# --- error paths
def test_missing_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ExecutionError, match=r"cannot load variable 'fc/w_0': file .*fc%2Fw_0 does not exist"):
        rio.load_params(runtime.Executor(), str(tmp_path), _program(), scope=Scope())


def test_missing_archive(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ExecutionError, match=r"archive .*params does not exist"):
        rio.load_params(runtime.Executor(), str(tmp_path), _program(), filename="params", scope=Scope())


def test_variable_missing_from_scope_on_save(tmp_path: pathlib.Path) -> None:
    values = _values()
    del values["b"]
    for filename in [None, "all"]:
        with pytest.raises(ExecutionError, match=r"cannot save variable 'b' to .*: it is not in the scope"):
            rio.save_params(runtime.Executor(), str(tmp_path), _program(), filename=filename,
                            scope=_scope_with(values))


def test_variable_missing_from_archive(tmp_path: pathlib.Path) -> None:
    exe = runtime.Executor()
    rio.save_params(exe, str(tmp_path), _program(), filename="params", scope=_scope_with(_values()))
    with pytest.raises(ExecutionError, match=r"cannot load variable 'step': the archive .*params does not hold it"):
        rio.load_persistables(exe, str(tmp_path), _program(), filename="params", scope=Scope())


@pytest.mark.parametrize("filename", [None, "all"])
@pytest.mark.parametrize("declared, pattern", [
    (dict(w_dtype="float64"), r"'fc/w_0' from .*: the file holds dtype float32, the program declares float64"),
    (dict(w_shape=(4, 2)), r"'fc/w_0' from .*: the file holds shape \[2, 4\], the program declares \[4, 2\]"),
    (dict(w_shape=(2, 4, 1)), r"the file holds shape \[2, 4\], the program declares \[2, 4, 1\]"),
    (dict(table_type="lod_tensor"), r"'table' from .*: the file holds a selected_rows, the program declares a "
                                    r"lod_tensor"),
], ids=["dtype", "shape", "rank", "type"])
def test_declaration_mismatch_on_load(tmp_path: pathlib.Path, declared: dict, pattern: str,
                                      filename: str | None) -> None:
    exe = runtime.Executor()
    rio.save_persistables(exe, str(tmp_path), _program(), filename=filename, scope=_scope_with(_values()))
    fresh = Scope()
    with pytest.raises(ExecutionError, match=pattern):
        rio.load_persistables(exe, str(tmp_path), _program(**declared), filename=filename, scope=fresh)
    if filename is not None:
        assert fresh.local_var_names() == []  # load_combine checks everything before setting anything


def _saved_file(tmp_path: pathlib.Path) -> pathlib.Path:
    prog = Program()
    prog.global_block().create_parameter("w", [4, 4], "float32")
    rio.save_params(runtime.Executor(), str(tmp_path), prog,
                    scope=_scope_with({"w": np.arange(16, dtype=np.float32).reshape(4, 4)}))
    return tmp_path / "w"


def _load_w(tmp_path: pathlib.Path) -> None:
    prog = Program()
    prog.global_block().create_parameter("w", [4, 4], "float32")
    rio.load_params(runtime.Executor(), str(tmp_path), prog, scope=Scope())


@pytest.mark.parametrize("corrupt, pattern", [
    (lambda d: d[:-5], r"the payload has 59 bytes, expected 64 \(truncated\)"),
    (lambda d: d[:10], r"fewer than the 16-byte variable record prefix"),
    (lambda d: d[:30], r"header needs \d+ bytes but only 14 follow the prefix \(truncated\)"),
    (lambda d: d + b"xx", r"expected 64 \(has trailing bytes\)"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), r"checksum \(crc32\) does not match"),
    (lambda d: b"NOTAVAR\0" + d[8:], r"bad magic b'NOTAVAR\\x00'"),
    (lambda d: d[:8] + (7).to_bytes(4, "little") + d[12:], r"format version 7, expected 1"),
    (lambda d: d[:16] + b"[" + d[17:], r"header is not valid JSON"),
], ids=["truncated-payload", "truncated-prefix", "truncated-header", "trailing", "bitflip", "magic", "version",
        "header"])
def test_corrupt_file(tmp_path: pathlib.Path, corrupt: object, pattern: str) -> None:
    path = _saved_file(tmp_path)
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(ExecutionError, match=r"cannot load variable 'w' from .*w: .*" + pattern):
        _load_w(tmp_path)


def test_corrupt_header_fields(tmp_path: pathlib.Path) -> None:
    path = _saved_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"float32"', b'"float33"'))
    with pytest.raises(ExecutionError, match=r"unknown dtype 'float33'"):
        _load_w(tmp_path)
    path.write_bytes(data.replace(b'"shape": [4, 4]', b'"shape": [4, 5]'))
    with pytest.raises(ExecutionError, match=r"header says 64 payload bytes but dtype float32 and shape \[4, 5\] "
                                             r"need 80"):
        _load_w(tmp_path)


def test_truncated_archive(tmp_path: pathlib.Path) -> None:
    exe = runtime.Executor()
    rio.save_persistables(exe, str(tmp_path), _program(), filename="all", scope=_scope_with(_values()))
    path = tmp_path / "all"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ExecutionError, match=r"(spans bytes .* \(truncated\)|expected \d+ \(truncated\))"):
        rio.load_persistables(exe, str(tmp_path), _program(), filename="all", scope=Scope())


def test_archive_is_not_a_variable_record(tmp_path: pathlib.Path) -> None:
    exe = runtime.Executor()
    rio.save_params(exe, str(tmp_path), _program(), filename="b", scope=_scope_with(_values()))
    with pytest.raises(ExecutionError, match=r"cannot load variable 'b' from .*: bad magic b'FLOTARC\\x00'"):
        rio.load_vars(exe, str(tmp_path), _program(), vars=["b"], scope=Scope())


def test_save_refuses_to_overwrite_when_told(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "x")
    prog = Program()
    b = prog.global_block()
    b.create_var("x", [2], "float32", persistable=True)
    b.append_op("save", inputs={"X": ["x"]}, attrs={"file_path": path, "overwrite": False})
    scope = _scope_with({"x": np.ones(2, np.float32)})
    exe = runtime.Executor()
    exe.run(prog, scope=scope)
    with pytest.raises(ExecutionError, match=r"cannot save variable 'x': .*x exists and overwrite is false"):
        exe.run(prog, scope=scope)


# --- the kernels in whole programs
def test_save_after_compute_and_load_op(tmp_path: pathlib.Path) -> None:
    """fill_constant → save in one program (a pure run, then a host op); load in another."""
    path = str(tmp_path / "sub" / "c")
    prog = Program()
    b = prog.global_block()
    b.create_var("c", [2, 3], "float64")
    b.append_op("fill_constant", outputs={"Out": ["c"]}, attrs={"shape": [2, 3], "dtype": "float64", "value": 0.25})
    b.append_op("save", inputs={"X": ["c"]}, attrs={"file_path": path})
    exe = runtime.Executor()
    exe.run(prog, scope=Scope())
    np.testing.assert_array_equal(rio.read_var_file(path, "c"), np.full((2, 3), 0.25))
    loader = Program()
    lb = loader.global_block()
    lb.create_var("c", [2, 3], "float64")
    lb.append_op("load", outputs={"Out": ["c"]}, attrs={"file_path": path})
    scope = Scope()
    (c,) = exe.run(loader, fetch_list=["c"], scope=scope)
    np.testing.assert_array_equal(c, np.full((2, 3), 0.25))


def test_delete_var_and_fake_init() -> None:
    prog = Program()
    b = prog.global_block()
    b.create_var("gone", [2], "float32")
    b.create_var("table", [4, 2], "float32")
    b.append_op("delete_var", inputs={"X": ["gone"]})
    b.append_op("fake_init", outputs={"Out": ["table"]}, attrs={"shape": [4, 2]})
    scope = Scope()
    scope.set_var("gone", jnp.ones(2, jnp.float32))
    (table,) = runtime.Executor().run(prog, fetch_list=["table"], scope=scope)
    assert not scope.has_var("gone")
    assert table.dtype == np.float32
    np.testing.assert_array_equal(table, np.zeros((4, 2), np.float32))


# --- checkpoint parts (what a pserver saves on CheckpointNotify): atomic, with a verified manifest ---------------
PERSISTABLE = ["fc/w_0", "b", "step", "mask", "table"]


@pytest.mark.parametrize("filename", [None, "__all__"])
def test_checkpoint_part_round_trip_and_replace(tmp_path: pathlib.Path, filename: str | None) -> None:
    prog, exe = _program(), runtime.Executor()
    path = tmp_path / "ck" / "pserver_0"
    rio.save_checkpoint_part(exe, str(path), prog, vars=PERSISTABLE, filename=filename, scope=_scope_with(_values()))
    manifest = rio.verify_checkpoint_part(str(path))
    assert manifest["format"] == rio.MANIFEST_FORMAT
    assert set(manifest["files"]) == set(os.listdir(path)) - {rio.MANIFEST}
    # saving again replaces the whole part, leaving no temporary or old directory behind
    changed = {**_values(), "b": np.array([1.0, 2.0, 3.0])}
    rio.save_checkpoint_part(exe, str(path), prog, vars=PERSISTABLE, filename=filename, scope=_scope_with(changed))
    assert os.listdir(tmp_path / "ck") == ["pserver_0"]
    scope = Scope()
    rio.load_checkpoint_part(exe, str(path), prog, vars=PERSISTABLE, filename=filename, scope=scope)
    for name in PERSISTABLE:
        _assert_bit_exact(scope.find_var(name), changed[name])


def test_checkpoint_part_never_overwrites_what_is_not_a_checkpoint(tmp_path: pathlib.Path) -> None:
    prog, exe = _program(), runtime.Executor()
    victim = tmp_path / "pserver_0"
    victim.write_text("precious")
    with pytest.raises(ExecutionError, match="something that is not a checkpoint is there"):
        rio.save_checkpoint_part(exe, str(victim), prog, vars=PERSISTABLE, scope=_scope_with(_values()))
    assert victim.read_text() == "precious" and os.listdir(tmp_path) == ["pserver_0"]


def test_a_failed_checkpoint_save_leaves_the_previous_one_intact(tmp_path: pathlib.Path) -> None:
    prog, exe = _program(), runtime.Executor()
    path = tmp_path / "pserver_0"
    rio.save_checkpoint_part(exe, str(path), prog, vars=PERSISTABLE, scope=_scope_with(_values()))
    incomplete = _values()
    del incomplete["b"]
    with pytest.raises(ExecutionError):
        rio.save_checkpoint_part(exe, str(path), prog, vars=PERSISTABLE, scope=_scope_with(incomplete))
    assert os.listdir(tmp_path) == ["pserver_0"]  # the half-written temporary directory is gone
    scope = Scope()
    rio.load_checkpoint_part(exe, str(path), prog, vars=PERSISTABLE, scope=scope)
    _assert_bit_exact(scope.find_var("b"), _values()["b"])


@pytest.mark.parametrize("damage", ["flip", "truncate", "drop-file", "drop-manifest", "edit-manifest"])
def test_loading_a_damaged_checkpoint_part_is_refused(tmp_path: pathlib.Path, damage: str) -> None:
    prog, exe = _program(), runtime.Executor()
    path = tmp_path / "pserver_0"
    rio.save_checkpoint_part(exe, str(path), prog, vars=PERSISTABLE, scope=_scope_with(_values()))
    target = path / rio.var_filename("b")
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0x40
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-3])
    elif damage == "drop-file":
        target.unlink()
    elif damage == "drop-manifest":
        (path / rio.MANIFEST).unlink()
    else:
        (path / rio.MANIFEST).write_text('{"format": "something else", "files": {}}')
    scope = Scope()
    with pytest.raises(ExecutionError, match="torn|tampered|not a flotilla-checkpoint-part-1 manifest"):
        rio.load_checkpoint_part(exe, str(path), prog, vars=PERSISTABLE, scope=scope)
    assert scope.find_var("b") is None  # nothing was loaded
