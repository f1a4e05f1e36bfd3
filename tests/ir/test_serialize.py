"""The protobuf form (ir.serialize): exact round trips, the file header, and every way a load fails."""
from __future__ import annotations

import dataclasses
import math
import pathlib
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings

from ir.core import Parameter, Program, Variable
from ir.errors import SerializationError
from ir.ops.registry import AttrKind, BlockRef
from ir.printer import format_program
from ir.proto import framework_pb2 as fw
from ir.serialize import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    attr_kind_for,
    is_program_bytes,
    load_program,
    program_from_bytes,
    program_from_desc,
    program_to_bytes,
    program_to_desc,
    save_program,
)
from tests.ir.strategies import programs, seeded_program


def sample_program() -> Program:
    """A small trainer-and-pserver-like program touching every Variable field and attribute kind."""
    p = Program()
    p.random_seed = 90
    g = p.global_block()
    x = g.create_var("x", shape=(-1, 4), is_data=True, stop_gradient=True)
    w = g.create_parameter("fc_0.w_0", shape=(4, 2), regularizer="L2Decay(0.001)", learning_rate=0.5)
    b = g.create_parameter("fc_0.b_0", shape=(2,), trainable=False, gradient_clip="GradientClipByNorm(5.0)",
                           is_distributed=True, learning_rate=-0.0)
    y = g.create_var("fc_0.tmp_0", shape=(-1, 2))
    g.create_var("fc_0.w_0.block0", shape=(2, 2), persistable=True, slice_of="fc_0.w_0", slice_index=0,
                 slice_offset=0)
    g.create_var("fc_0.w_0@GRAD.block0.trainer_1", shape=(2, 2), dtype="float64", type="selected_rows",
                 copy_of="fc_0.w_0@GRAD.block0", trainer_id=1)
    g.create_var("weird \"name\"\\ with\nnewline", shape=(), dtype="int64", type="raw")
    g.append_op("mul", {"X": x, "Y": w}, {"Out": y})
    g.append_op("elementwise_add", {"X": y, "Y": b}, {"Out": y}, {"axis": 1})
    g.append_op("scale", {"X": y}, {"Out": y}, {"scale": 0.1, "bias": math.nan, "op_role": 1})
    sub = p.create_block(0)
    p.rollback()
    sub.create_var("local", shape=(3,))
    g.append_op("listen_and_serv", {"X": []}, {},
                {"optimize_blocks": [BlockRef(1)], "grad_to_block_id": ["fc_0.w_0@GRAD:1"]}, infer_shape=False)
    g._append_raw_op("custom_op", {"In": ["x", "x"], "Empty": []}, {"Out": ["fc_0.tmp_0"]}, {
        "b": True, "i": -(2**63), "f": -0.0, "s": "nan", "bools": [True, False], "ints": [1, 2**63 - 1],
        "floats": [math.inf, -math.inf, 5e-324, math.nan], "strings": ["a\"b", "名字"], "blk": BlockRef(1),
        "blks": [BlockRef(0), BlockRef(1)], "empty": [],
    })
    sub._append_raw_op("sgd", {"Param": ["fc_0.w_0"], "Grad": ["local"], "LearningRate": ["x"]},
                       {"ParamOut": ["fc_0.w_0"]}, {"op_role": 2, "op_role_var": ["fc_0.w_0", "local"]})
    return p


def _frame(payload: bytes, version: int = FORMAT_VERSION) -> bytes:
    return struct.pack("<8sIQI", MAGIC, version, len(payload), zlib.crc32(payload)) + payload


def _assert_round_trip(program: Program) -> None:
    data = program_to_bytes(program)
    back = program_from_bytes(data)
    assert program_to_bytes(back) == data
    assert format_program(back) == format_program(program)


# --- round trips ---------------------------------------------------------------------------------
def test_sample_program_round_trips_exactly() -> None:
    p = sample_program()
    data = program_to_bytes(p)
    back = program_from_bytes(data)
    assert program_to_bytes(back) == data
    assert format_program(back) == format_program(p)
    assert back.random_seed == 90
    assert [(b.idx, b.parent_idx) for b in back.blocks] == [(0, -1), (1, 0)]
    # Variables come back as equal values of the same class (Parameter stays Parameter).
    for block, orig in zip(back.blocks, p.blocks):
        assert list(block.vars) == list(orig.vars)
        for name, var in block.vars.items():
            assert type(var) is type(orig.vars[name])
            assert var == orig.vars[name]
    assert math.copysign(1.0, back.global_block().var("fc_0.b_0").learning_rate) == -1.0


def test_attr_values_come_back_with_their_python_types() -> None:
    back = program_from_bytes(program_to_bytes(sample_program()))
    custom = back.global_block().ops[4]
    assert custom.type == "custom_op"
    attrs = dict(custom.attrs)
    assert math.isnan(attrs["floats"][3])
    attrs["floats"] = attrs["floats"][:3]
    assert attrs == {
        "b": True, "i": -(2**63), "f": -0.0, "s": "nan", "bools": [True, False], "ints": [1, 2**63 - 1],
        "floats": [math.inf, -math.inf, 5e-324], "strings": ["a\"b", "名字"], "blk": BlockRef(1),
        "blks": [BlockRef(0), BlockRef(1)], "empty": [],
    }
    assert math.copysign(1.0, attrs["f"]) == -1.0
    assert list(custom.attrs) == ["b", "i", "f", "s", "bools", "ints", "floats", "strings", "blk", "blks", "empty"]
    assert custom.inputs == {"In": ["x", "x"], "Empty": []}
    scale = back.global_block().ops[2]
    assert scale.attr("scale") == 0.1 and math.isnan(scale.attr("bias")) and scale.attr("op_role") == 1


def test_decoding_reinfers_nothing() -> None:
    # A shape that inference would overwrite is kept as saved.
    p = Program()
    g = p.global_block()
    g.create_var("a", shape=(3, 4))
    g.create_var("b", shape=(99,))
    g._append_raw_op("relu", {"X": ["a"]}, {"Out": ["b"]}, {"op_role": 0})
    back = program_from_bytes(program_to_bytes(p))
    assert back.global_block().var("b").shape == (99,)
    assert dict(back.global_block().ops[0].attrs) == {"op_role": 0}  # no defaults filled in


def test_empty_program_round_trips() -> None:
    _assert_round_trip(Program())


def test_encoding_is_deterministic() -> None:
    assert program_to_bytes(sample_program()) == program_to_bytes(sample_program())


def test_schema_kind_wins_when_value_fits() -> None:
    desc = program_to_desc(sample_program())
    scale = desc.blocks[0].ops[2]
    kinds = {a.name: a.type for a in scale.attrs}
    assert kinds["scale"] == fw.FLOAT and kinds["bias_after_scale"] == fw.BOOL and kinds["op_role"] == fw.INT
    ls = desc.blocks[0].ops[3]
    assert {a.name: a.type for a in ls.attrs}["optimize_blocks"] == fw.BLOCKS
    # An undeclared empty list has no element to go by: stored as strings, read back as [].
    custom = {a.name: a.type for a in desc.blocks[0].ops[4].attrs}
    assert custom["empty"] == fw.STRINGS and custom["blk"] == fw.BLOCK
    # A declared float attribute holding an int keeps the int (the printed form does not change).
    assert attr_kind_for("scale", "scale", 2) is AttrKind.INT
    assert attr_kind_for("scale", "scale", 2.0) is AttrKind.FLOAT
    assert attr_kind_for("listen_and_serv", "optimize_blocks", []) is AttrKind.BLOCKS


@pytest.mark.parametrize("value", [None, [1, 2.5], 2**63, [[1]], {"a": 1}])
def test_unstorable_attr_value_is_refused_on_save(value: object) -> None:
    p = Program()
    p.global_block()._append_raw_op("custom_op", {}, {}, {"bad": value})
    with pytest.raises(SerializationError, match=r"block 0 op #0 \('custom_op'\): op 'custom_op' attribute 'bad'"):
        program_to_bytes(p)


def test_vardesc_has_a_field_for_every_parameter_field() -> None:
    proto_fields = set(fw.VarDesc.DESCRIPTOR.fields_by_name)
    dataclass_fields = {f.name for f in dataclasses.fields(Parameter)}
    assert dataclass_fields <= proto_fields
    optional = {f for f in dataclass_fields if getattr(Parameter(name="p"), f) is None}
    for name in optional:
        assert fw.VarDesc.DESCRIPTOR.fields_by_name[name].has_presence, name


def test_none_relations_round_trip_as_none() -> None:
    p = Program()
    p.global_block().create_var("v", slice_index=0, slice_offset=0, trainer_id=0)
    back = program_from_bytes(program_to_bytes(p)).global_block().var("v")
    assert (back.slice_of, back.slice_index, back.slice_offset, back.copy_of, back.trainer_id) == (None, 0, 0, None, 0)


@pytest.mark.parametrize("seed", range(0, 300, 50))
def test_seeded_programs_round_trip(seed: int) -> None:
    for s in range(seed, seed + 50):
        p = seeded_program(s)
        data = program_to_bytes(p)
        back = program_from_bytes(data)
        assert program_to_bytes(back) == data, f"seed {s}: bytes differ"
        assert format_program(back) == format_program(p), f"seed {s}: text differs"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_round_trip(program: Program) -> None:
    _assert_round_trip(program)


# --- files ---------------------------------------------------------------------------------------
def test_save_and_load(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "main.flot"
    p = sample_program()
    save_program(p, path)
    data = path.read_bytes()
    assert data == program_to_bytes(p)
    assert data[:8] == MAGIC and is_program_bytes(data)
    assert struct.unpack_from("<IQI", data, 8) == (FORMAT_VERSION, len(data) - HEADER_SIZE, zlib.crc32(data[24:]))
    assert format_program(load_program(str(path))) == format_program(p)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_is_program_bytes() -> None:
    assert is_program_bytes(program_to_bytes(Program()))
    assert not is_program_bytes(b"program {random_seed=0}\n")
    assert not is_program_bytes(b"")
    assert not is_program_bytes(MAGIC[:5])


def _load_error(tmp_path: pathlib.Path, data: bytes, name: str = "bad.flot") -> SerializationError:
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(SerializationError) as info:
        load_program(path)
    assert str(path) in str(info.value), "the error must name the file"
    return info.value


def test_empty_file(tmp_path: pathlib.Path) -> None:
    assert "the file is empty" in str(_load_error(tmp_path, b""))


@pytest.mark.parametrize("keep", [3, 8, 20, HEADER_SIZE, -1])
def test_truncated_file(tmp_path: pathlib.Path, keep: int) -> None:
    data = program_to_bytes(sample_program())
    err = _load_error(tmp_path, data[:keep] if keep >= 0 else data[:-1])
    assert "truncated" in err.message


def test_trailing_bytes(tmp_path: pathlib.Path) -> None:
    err = _load_error(tmp_path, program_to_bytes(sample_program()) + b"\x00")
    assert "1 unexpected bytes after the" in err.message


def test_flipped_payload_byte_fails_the_crc(tmp_path: pathlib.Path) -> None:
    data = bytearray(program_to_bytes(sample_program()))
    data[HEADER_SIZE + 10] ^= 0x40
    err = _load_error(tmp_path, bytes(data))
    assert "corrupted" in err.message and "crc32" in err.message


def test_every_single_byte_flip_is_detected() -> None:
    data = program_to_bytes(sample_program())
    for i in range(len(data)):
        corrupt = bytearray(data)
        corrupt[i] ^= 0x01
        with pytest.raises(SerializationError, match="cannot load mem.flot"):
            program_from_bytes(bytes(corrupt), "mem.flot")


@pytest.mark.parametrize("content, hint", [
    (b"program {random_seed=0}\nblock 0 {\n}\n", "text program; use ir.parse_program"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "PNG image"),
    (b'{"format": "flotilla.program"}', "JSON program"),
    (b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09", "save_program"),
])
def test_foreign_file(tmp_path: pathlib.Path, content: bytes, hint: str) -> None:
    err = _load_error(tmp_path, content)
    assert "not a Flotilla program file" in err.message
    assert err.hint is not None and hint in err.hint


@pytest.mark.parametrize("version, hint", [(2, "newer Flotilla"), (0, "header is corrupted")])
def test_unsupported_version(tmp_path: pathlib.Path, version: int, hint: str) -> None:
    payload = program_to_desc(sample_program()).SerializeToString(deterministic=True)
    err = _load_error(tmp_path, _frame(payload, version))
    assert f"unsupported format version {version}" in err.message
    assert err.hint is not None and hint in err.hint


def test_missing_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "nope.flot"
    with pytest.raises(SerializationError, match="cannot read program file .*nope.flot"):
        load_program(path)


def test_save_to_missing_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SerializationError, match="cannot write program file"):
        save_program(Program(), tmp_path / "no" / "such" / "dir.flot")


# --- payloads that frame correctly but are not valid programs -----------------------------------
def test_garbage_payload_with_valid_crc(tmp_path: pathlib.Path) -> None:
    err = _load_error(tmp_path, _frame(b"\xff\xff\xff\xff"))
    assert "not a valid ProgramDesc" in err.message


def _desc_error(desc: fw.ProgramDesc) -> str:
    with pytest.raises(SerializationError) as info:
        program_from_bytes(_frame(desc.SerializeToString()), "d.flot")
    return info.value.message


def test_invalid_descs_are_rejected() -> None:
    assert "has no blocks" in _desc_error(fw.ProgramDesc())

    desc = program_to_desc(sample_program())
    desc.blocks[1].idx = 5
    assert "block 1: is stored with index 5" in _desc_error(desc)

    desc = program_to_desc(sample_program())
    desc.blocks[1].parent_idx = 1
    assert "block 1: has parent 1" in _desc_error(desc)

    desc = program_to_desc(sample_program())
    desc.blocks[0].vars[0].dtype = "float33"
    assert "block 0 variable #0 ('x'): variable 'x': unknown dtype 'float33'" in _desc_error(desc)

    desc = program_to_desc(sample_program())
    desc.blocks[0].vars.add().CopyFrom(desc.blocks[0].vars[0])
    assert "already has a variable named 'x'" in _desc_error(desc)

    desc = program_to_desc(sample_program())
    desc.blocks[0].vars[0].trainable = True
    assert "'x' is not a parameter but sets parameter fields ['trainable']" in _desc_error(desc)

    desc = program_to_desc(sample_program())
    desc.blocks[0].ops[0].attrs[0].type = fw.ATTR_TYPE_UNSPECIFIED
    assert "block 0 op #0 ('mul'): attribute 'op_role' has unknown type 0" in _desc_error(desc)

    desc = program_to_desc(sample_program())
    desc.blocks[0].ops[0].attrs.add().CopyFrom(desc.blocks[0].ops[0].attrs[0])
    assert "attribute 'op_role' appears twice" in _desc_error(desc)

    desc = program_to_desc(sample_program())
    desc.blocks[0].ops[0].inputs.add(slot="X", arguments=["x"])
    assert "input slot 'X' appears twice" in _desc_error(desc)


def test_program_from_desc_builds_the_same_program() -> None:
    p = sample_program()
    assert format_program(program_from_desc(program_to_desc(p))) == format_program(p)


def test_decoded_variables_are_plain_values() -> None:
    back = program_from_bytes(program_to_bytes(sample_program())).global_block()
    assert type(back.var("x")) is Variable
    assert isinstance(back.var("fc_0.w_0"), Parameter) and back.var("fc_0.w_0").regularizer == "L2Decay(0.001)"
