"""The JSON form (exact round trip, strict JSON, byte-stable) and the DOT forms: a block (role clusters,
parameters once at the side, in-place writes as versions with no cycles, listen_and_serv linked to its
optimize blocks, filters, escaping) and a transpiled job (every send linked to the pserver block applying it)."""
from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from ir.core import Program
from ir.errors import FlotillaError, IRError, SerializationError
from ir.export import JSON_FORMAT, JSON_VERSION, job_to_dot, program_from_json, program_to_dot, program_to_json
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
_EDGE = re.compile(r"^\s*(\w+) -> (\w+)(?: \[(.*)\])?;$")


def _dot_lines(dot: str) -> list[str]:
    lines = dot.splitlines()
    assert lines[-1] == "}"
    return lines


def _nodes(dot: str) -> dict[str, str]:
    """Node id → its attribute text, for every node statement."""
    out = {}
    for line in dot.splitlines():
        m = re.match(r"^\s*(\w+) \[(.*)\];$", line)
        if m and m.group(1) not in ("node", "edge"):
            out[m.group(1)] = m.group(2)
    return out


def _edges(dot: str, visible_only: bool = True) -> list[tuple[str, str, str]]:
    edges = []
    for line in dot.splitlines():
        m = _EDGE.match(line)
        if m and not (visible_only and "style=invis" in (m.group(3) or "")):
            edges.append((m.group(1), m.group(2), m.group(3) or ""))
    return edges


def _cluster_members(dot: str) -> dict[str, list[str]]:
    """Cluster key → the node ids declared inside it."""
    members: dict[str, list[str]] = {}
    current = None
    for line in dot.splitlines():
        m = re.match(r'^  subgraph "cluster_(.*)" \{$', line)
        if m:
            current = m.group(1)
            members[current] = []
        elif line == "  }":
            current = None
        elif current is not None:
            n = re.match(r"^\s+(\w+) \[", line)
            if n:
                members[current].append(n.group(1))
    return members


def _label(attrs: str) -> str:
    m = re.search(r'label=("(?:[^"\\]|\\.)*")', attrs)
    return m.group(1) if m else ""


def _is_acyclic(edges: list[tuple[str, str, str]]) -> bool:
    import networkx as nx

    return nx.is_directed_acyclic_graph(nx.DiGraph([(a, b) for a, b, _ in edges]))


def test_dot_clusters_ops_by_role_and_draws_parameters_once_at_the_side() -> None:
    p = sample_program()
    dot = program_to_dot(p)
    assert _dot_lines(dot)[0] == 'digraph "block0" {'
    nodes, clusters = _nodes(dot), _cluster_members(dot)
    ops = {n: a for n, a in nodes.items() if "shape=box" in a and n.startswith("op")}
    assert len(ops) == len(p.global_block().ops) + 1  # and block 1's sgd, in its own cluster
    assert sorted(clusters) == ["backward", "block1", "forward", "state"]
    labels = {_label(ops[n]).split("\\n")[0].strip('"'): k for k, ns in clusters.items() for n in ns if n in ops}
    assert labels == {"mul": "forward", "elementwise_add": "forward", "scale": "backward", "custom_op": "forward",
                      "listen_and_serv": "forward", "sgd": "block1"}  # this listen_and_serv has no op_role
    assert 'label="sgd\\nParamOut: fc_0.w_0 (updated)\\nGrad <- local\\nLearningRate <- x"' in dot
    # Parameters: one line each in the side table, named in the labels of the ops that use them, no node.
    assert not any("fc_0.w_0\\n" in a for a in nodes.values())
    state = [a for n, a in nodes.items() if n in clusters["state"]]
    assert sum("fc_0.w_0  float32[4, 2]" in a for a in state) == 1
    assert 'label="mul\\nY: fc_0.w_0"' in dot
    assert "ParamOut: fc_0.w_0 (updated)" in dot
    persistable = {n for n, a in nodes.items() if "fc_0.w_0" in a and "shape=ellipse" in a}
    assert not persistable
    assert program_to_dot(p) == dot  # deterministic


def test_dot_in_place_writes_are_versions_in_execution_order() -> None:
    """fc_0.tmp_0 is written by mul, then in place by elementwise_add, scale and custom_op: four nodes
    (#2, #3, #4), each read by the next writer, and no cycles."""
    dot = program_to_dot(sample_program())
    nodes = _nodes(dot)
    versions = sorted(_label(a) for a in nodes.values() if "fc_0.tmp_0" in _label(a) and "ellipse" in a)
    assert versions == ['"fc_0.tmp_0 #2\\nfloat32[-1, 2]"', '"fc_0.tmp_0 #3\\nfloat32[-1, 2]"',
                        '"fc_0.tmp_0 #4\\nfloat32[-1, 2]"', '"fc_0.tmp_0\\nfloat32[-1, 2]"']
    edges = _edges(dot)
    assert _is_acyclic(edges)
    assert not any((b, a, _) in edges for a, b, _ in edges)  # no 2-cycles
    # A value read from another role's cluster is named in the reader's label, not drawn across the page.
    assert "X <- fc_0.tmp_0 (forward)" in dot


def test_dot_links_listen_and_serv_to_its_optimize_blocks() -> None:
    dot = program_to_dot(sample_program())
    nodes = _nodes(dot)
    (listen,) = [n for n, a in nodes.items() if _label(a) == '"listen_and_serv"']
    (sgd,) = [n for n, a in nodes.items() if _label(a).startswith('"sgd')]
    links = [(a, b, attrs) for a, b, attrs in _edges(dot) if a == listen]
    assert [(b, 'lhead="cluster_block1"' in attrs, 'label="fc_0.w_0@GRAD"' in attrs) for _, b, attrs in links] \
        == [(sgd, True, True)]
    assert sum(b == sgd for _, b, _ in _edges(dot)) == 2  # custom_op's block attrs link there too


def test_dot_filters_by_role_and_ops_only() -> None:
    p = sample_program()
    backward = program_to_dot(p, roles=["backward"])
    assert [_label(a) for n, a in _nodes(backward).items() if n.startswith("op")] == [
        '"scale\\nX <- fc_0.tmp_0 (forward, not drawn)"']
    ops_only = program_to_dot(p, ops_only=True)
    assert not [a for a in _nodes(ops_only).values() if "shape=ellipse" in a]
    edges = _edges(ops_only)
    assert edges and all(a.startswith("op") and b.startswith("op") for a, b, _ in edges)
    assert _is_acyclic(edges)
    with pytest.raises(FlotillaError, match="unknown op role group"):
        program_to_dot(p, roles=["fwd"])


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
        assert re.fullmatch(r"\s*[\w\s\[\]=,;\->{}]*", outside), line
    assert len(_edges(dot)) == 2


def test_dot_sub_block_marks_parent_variables() -> None:
    p = sample_program()
    dot = program_to_dot(p, block_idx=1)
    lines = _dot_lines(dot)
    assert lines[0] == 'digraph "block1" {'
    nodes = _nodes(dot)
    (local,) = [a for a in nodes.values() if _label(a) == '"local"' or "local\\n" in _label(a)]
    assert "shape=ellipse" in local  # declared in block 1, read before any write: an input
    (x,) = [a for a in nodes.values() if _label(a).startswith('"x\\n')]
    assert 'style="dashed"' in x  # a variable of block 0
    assert "Param" not in "".join(a for a in nodes.values() if "ellipse" in a)


def test_dot_bad_block_index() -> None:
    with pytest.raises(IRError, match="program has no block 7"):
        program_to_dot(sample_program(), block_idx=7)


def _job() -> dict[str, Program]:
    from tests.transpiler.test_distribute_transpiler import EPS2, build_fc, transpile

    main, startup = build_fc(sparse_emb=True)
    programs = {}
    for tid in range(2):
        t = transpile(main, startup, trainer_id=tid)
        programs[f"trainer.{tid}"] = t.get_trainer_program()
    for ep in EPS2.split(","):
        programs[f"pserver@{ep}"] = t.get_pserver_program(ep)
    return programs


def test_job_links_every_sent_block_to_the_pserver_block_that_applies_it() -> None:
    programs = _job()
    dot = job_to_dot(programs)
    nodes, clusters = _nodes(dot), _cluster_members(dot)
    assert sorted(clusters) == ["ps:127.0.0.1:6174", "ps:127.0.0.1:6175", "tr:trainer.0", "tr:trainer.1"]
    assert not [n for n in nodes if n.startswith("missing")]
    sent = 0
    for role in ("trainer.0", "trainer.1"):
        block = programs[role].global_block()
        sends = [op for op in block.ops if op.type == "send"]
        sent += sum(len(op.input("X")) for op in sends)
        assert len([n for n in clusters[f"tr:{role}"] if n.startswith("send")]) == len(sends)
    edges = _edges(dot)
    assert len(edges) == sent
    for a, b, _ in edges:
        home = next(k for k, ns in clusters.items() if b in ns)
        assert home.startswith("ps:") and "block " in _label(nodes[b])
    # fc_w is sliced in two: its two gradient blocks reach blocks on both pservers.
    fc_w = [b for a, b, attrs in edges if "fc_w@GRAD.block" in attrs and a in clusters["tr:trainer.0"]]
    assert {next(k for k, ns in clusters.items() if b in ns) for b in fc_w} == {"ps:127.0.0.1:6174",
                                                                              "ps:127.0.0.1:6175"}
    assert job_to_dot(programs) == dot


def test_job_marks_a_send_no_pserver_applies() -> None:
    programs = _job()
    del programs["pserver@127.0.0.1:6175"]
    dot = job_to_dot(programs)
    assert "no block applies" in dot and "on 127.0.0.1:6175" in dot


def test_pserver_block_links_every_optimize_block_in_rows() -> None:
    pserver = _job()["pserver@127.0.0.1:6174"]
    listen = pserver.global_block().ops[0]
    blocks = [ref.idx for ref in listen.attr("optimize_blocks")]
    dot = program_to_dot(pserver)
    clusters = _cluster_members(dot)
    (listen_node,) = clusters["rpc"]
    assert sorted(k for k in clusters if k.startswith("block")) == sorted(f"block{i}" for i in blocks)
    links = [attrs for a, _, attrs in _edges(dot) if a == listen_node]
    assert len(links) == len(blocks) and all("lhead=" in attrs and "label=" in attrs for attrs in links)
    # Received gradients: one list node, not one node each fanning into listen_and_serv.
    assert sum("shape=note" in a for a in _nodes(dot).values()) == 1
