"""The JSON form (exact round trip, strict JSON, byte-stable) and the DOT form (structure, escaping)."""
from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from ir.core import Program
from ir.errors import IRError, SerializationError
from ir.export import JSON_FORMAT, JSON_VERSION, program_from_json, program_to_dot, program_to_json
from ir.ops.registry import BlockRef
from ir.printer import format_program
from tests.ir.strategies import programs, seeded_program
from tests.ir.test_serialize import sample_program


def _strict_loads(text: str) -> Any:
    """json.loads that refuses NaN/Infinity tokens (which strict JSON does not have)."""
    def refuse(token: str) -> Any:
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def _assert_json_round_trip(program: Program) -> None:
    text = program_to_json(program)
    _strict_loads(text)
    back = program_from_json(text)
    assert program_to_json(back) == text
    assert format_program(back) == format_program(program)


# --- JSON ----------------------------------------------------------------------------------------
def test_json_round_trip_of_sample_program() -> None:
    p = sample_program()
    text = program_to_json(p)
    back = program_from_json(text)
    assert program_to_json(back) == text
    assert format_program(back) == format_program(p)
    for block, orig in zip(back.blocks, p.blocks):
        for name, var in block.vars.items():
            assert type(var) is type(orig.vars[name]) and var == orig.vars[name]


def test_json_document_shape() -> None:
    doc = _strict_loads(program_to_json(sample_program()))
    assert (doc["format"], doc["version"], doc["random_seed"]) == (JSON_FORMAT, JSON_VERSION, 90)
    b0 = doc["blocks"][0]
    assert (b0["idx"], b0["parent_idx"], doc["blocks"][1]["parent_idx"]) == (0, -1, 0)
    w = b0["vars"][1]
    assert w == {
        "name": "fc_0.w_0", "is_parameter": True, "shape": [4, 2], "dtype": "float32", "type": "lod_tensor",
        "persistable": True, "stop_gradient": False, "is_data": False, "slice_of": None, "slice_index": None,
        "slice_offset": None, "copy_of": None, "trainer_id": None, "trainable": True, "learning_rate": 0.5,
        "regularizer": "L2Decay(0.001)", "gradient_clip": None, "is_distributed": False,
    }
    assert "trainable" not in b0["vars"][0]  # a plain variable has only Variable's fields
    mul = b0["ops"][0]
    assert mul["type"] == "mul"
    assert mul["inputs"] == [{"slot": "X", "arguments": ["x"]}, {"slot": "Y", "arguments": ["fc_0.w_0"]}]
    assert mul["outputs"] == [{"slot": "Out", "arguments": ["fc_0.tmp_0"]}]
    assert {"name": "x_num_col_dims", "type": "int", "value": 1} in mul["attrs"]
    ls_attrs = {a["name"]: a for a in b0["ops"][3]["attrs"]}
    assert ls_attrs["optimize_blocks"] == {"name": "optimize_blocks", "type": "blocks", "value": [{"block": 1}]}


def test_json_nan_and_inf_are_strings_and_strict_json() -> None:
    text = program_to_json(sample_program())
    assert "NaN" not in text and "Infinity" not in text
    doc = _strict_loads(text)
    custom = {a["name"]: a for a in doc["blocks"][0]["ops"][4]["attrs"]}
    assert custom["floats"] == {"name": "floats", "type": "floats", "value": ["inf", "-inf", 5e-324, "nan"]}
    assert custom["s"] == {"name": "s", "type": "string", "value": "nan"}  # a string "nan" stays a string
    assert custom["blk"]["value"] == {"block": 1}
    assert custom["f"]["value"] == -0.0 and math.copysign(1.0, custom["f"]["value"]) == -1.0
    back = program_from_json(text).global_block().ops[4]
    assert back.attr("s") == "nan" and back.attr("blk") == BlockRef(1)
    assert math.isnan(back.attr("floats")[3]) and back.attr("floats")[:2] == [math.inf, -math.inf]


def test_json_is_byte_stable() -> None:
    a, b = program_to_json(sample_program()), program_to_json(sample_program())
    assert a == b
    assert a.endswith("}\n") and a.isascii()
    assert a.startswith('{\n  "blocks": [\n')  # sorted keys, indent 2


def test_json_parameter_nan_learning_rate() -> None:
    p = Program()
    p.global_block().create_parameter("w", shape=(2,), learning_rate=math.inf)
    text = program_to_json(p)
    assert _strict_loads(text)["blocks"][0]["vars"][0]["learning_rate"] == "inf"
    assert program_from_json(text).global_block().var("w").learning_rate == math.inf


@pytest.mark.parametrize("seed", range(0, 300, 100))
def test_json_seeded_programs_round_trip(seed: int) -> None:
    for s in range(seed, seed + 100):
        p = seeded_program(s)
        text = program_to_json(p)
        back = program_from_json(text)
        assert program_to_json(back) == text, f"seed {s}"
        assert format_program(back) == format_program(p), f"seed {s}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_json_random_programs_round_trip(program: Program) -> None:
    _assert_json_round_trip(program)


def _json_error(doc: Any) -> str:
    with pytest.raises(SerializationError) as info:
        program_from_json(doc if isinstance(doc, str) else json.dumps(doc), source="p.json")
    assert "p.json" in str(info.value)
    return info.value.message


def test_json_errors_name_the_source_and_path() -> None:
    assert "not valid JSON" in _json_error("{")
    assert "$.format: expected 'flotilla.program'" in _json_error({"format": "other"})
    good = _strict_loads(program_to_json(sample_program()))

    doc = json.loads(json.dumps(good))
    doc["version"] = 9
    assert "unsupported version 9" in _json_error(doc)

    doc = json.loads(json.dumps(good))
    del doc["blocks"][0]["vars"][1]["learning_rate"]
    assert "$.blocks[0].vars[1]: missing key 'learning_rate'" in _json_error(doc)

    doc = json.loads(json.dumps(good))
    doc["blocks"][0]["vars"][0]["trainable"] = True
    assert "$.blocks[0].vars[0]: unknown keys ['trainable'] for a variable" in _json_error(doc)

    doc = json.loads(json.dumps(good))
    doc["blocks"][0]["ops"][0]["attrs"][0]["type"] = "complex"
    assert "$.blocks[0].ops[0].attrs[0].type: expected one of" in _json_error(doc)

    doc = json.loads(json.dumps(good))
    doc["blocks"][0]["ops"][4]["attrs"][6]["value"][0] = "infinity"
    assert "$.blocks[0].ops[4].attrs[6].value[0]: expected a float" in _json_error(doc)

    doc = json.loads(json.dumps(good))
    doc["blocks"][0]["vars"][0]["dtype"] = "float33"
    assert "$.blocks[0].vars[0]: variable 'x': unknown dtype 'float33'" in _json_error(doc)

    doc = json.loads(json.dumps(good))
    doc["blocks"][1]["parent_idx"] = 3
    assert "$.blocks[1].parent_idx: is 3; expected -1..0" in _json_error(doc)


# --- DOT -----------------------------------------------------------------------------------------
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def _dot_lines(dot: str) -> list[str]:
    lines = dot.splitlines()
    assert lines[-1] == "}"
    return lines


def test_dot_structure() -> None:
    p = sample_program()
    dot = program_to_dot(p)
    lines = _dot_lines(dot)
    assert lines[0] == 'digraph "block0" {'
    block = p.global_block()
    ops = [ln for ln in lines if "shape=box" in ln]
    var_nodes = [ln for ln in lines if "shape=ellipse" in ln]
    edges = [ln for ln in lines if "->" in ln]
    assert len(ops) == len(block.ops)
    assert len(var_nodes) == len(block.vars)  # every name used in block 0 is declared there
    n_in = sum(len(names) for op in block.ops for names in op.inputs.values())
    n_out = sum(len(names) for op in block.ops for names in op.outputs.values())
    assert len(edges) == n_in + n_out
    assert '  var0 -> op0 [label="X"];' in lines  # x -> mul
    assert '  var1 -> op0 [label="Y"];' in lines  # fc_0.w_0 -> mul
    assert '  op0 -> var3 [label="Out"];' in lines  # mul -> fc_0.tmp_0
    assert 'var1 [label="fc_0.w_0\\nfloat32[4, 2]", shape=ellipse, fillcolor="lightblue", style="filled"];' \
        in dot
    assert program_to_dot(p) == dot  # deterministic


def test_dot_escapes_names() -> None:
    p = Program()
    g = p.global_block()
    g.create_var('a "quoted" \\ name\nwith newline', shape=(2,))
    g.create_var("b];\nevil -> x", shape=(2,))
    g._append_raw_op('op"type', {'S"lot': ['a "quoted" \\ name\nwith newline']}, {"Out": ["b];\nevil -> x"]}, {})
    dot = program_to_dot(p)
    assert 'label="a \\"quoted\\" \\\\ name\\nwith newline\\nfloat32[2]"' in dot
    assert 'label="op\\"type"' in dot and 'label="S\\"lot"' in dot
    for line in _dot_lines(dot)[1:-1]:
        # Outside quoted strings a line holds only ids, punctuation and bare attribute words.
        outside = _QUOTED.sub("Q", line)
        assert re.fullmatch(r"\s*[\w\s\[\]=,;\->]*", outside), line
    assert sum("->" in _QUOTED.sub("Q", ln) for ln in dot.splitlines()) == 2


def test_dot_sub_block_marks_parent_variables() -> None:
    p = sample_program()
    dot = program_to_dot(p, block_idx=1)
    lines = _dot_lines(dot)
    assert lines[0] == 'digraph "block1" {'
    params = [ln for ln in lines if "fc_0.w_0\\n" in ln]
    assert len(params) == 1 and 'style="filled,dashed"' in params[0]  # a parameter of block 0
    assert any('label="local\\nfloat32[3]", shape=ellipse];' in ln for ln in lines)
    assert sum("->" in ln for ln in lines) == 4  # sgd: 3 inputs, 1 output


def test_dot_bad_block_index() -> None:
    with pytest.raises(IRError, match="program has no block 7"):
        program_to_dot(sample_program(), block_idx=7)
