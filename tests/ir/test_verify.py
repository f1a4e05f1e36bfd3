"""Tests of the verifier: a valid program verifies clean; each check catches a corrupted copy."""
from __future__ import annotations

import time

import pytest

from ir.core import Program
from ir.errors import VerifyError
from ir.ops.registry import BlockRef
from ir.program_set import ProgramSet
from ir.verify import (
    Code,
    Problem,
    collect_problems,
    cross_program_problems,
    format_context,
    verify,
    verify_program_set,
)


def make_program() -> Program:
    """x·w + b → square → mean, and the loss gradient seed: ops 0..4 of block 0."""
    p = Program()
    b = p.global_block()
    b.create_var("x", (-1, 4), is_data=True, stop_gradient=True)
    b.create_parameter("w", (4, 3))
    b.create_parameter("bias", (3,))
    for name in ("h", "z", "s", "loss", "loss@GRAD"):
        b.create_var(name)
    b.append_op("mul", {"X": "x", "Y": "w"}, {"Out": "h"})
    b.append_op("elementwise_add", {"X": "h", "Y": "bias"}, {"Out": "z"})
    b.append_op("square", {"X": "z"}, {"Out": "s"})
    b.append_op("mean", {"X": "s"}, {"Out": "loss"})
    b.append_op("fill_constant", {}, {"Out": "loss@GRAD"}, {"shape": [1], "value": 1.0, "op_role": 257})
    return p


@pytest.fixture
def prog() -> Program:
    return make_program().clone()


def only(problems: list[Problem], code: str) -> Problem:
    """The single problem with ``code``; fails listing all problems otherwise."""
    hits = [p for p in problems if p.code == code]
    assert len(hits) == 1, [str(p) for p in problems]
    return hits[0]


def test_valid_program_verifies_clean() -> None:
    p = make_program()
    assert collect_problems(p) == []
    assert verify(p) is None
    assert p.global_block().var("h").shape == (-1, 3)


def test_problem_str_reads_where_found_expected_hint() -> None:
    p = Problem(where="trainer.0/block 0/op 12 (send)", found="a", expected="b", hint="c", code="V1")
    assert str(p) == "trainer.0/block 0/op 12 (send): found a, expected b (hint: c)"
    assert str(Problem(where="block 1/var x", found="a", expected="b", hint=None, code="V1")) == \
        "block 1/var x: found a, expected b"


# --- blocks ------------------------------------------------------------------------------------------
def test_block_index_must_equal_position(prog: Program) -> None:
    prog.create_block(0)
    prog.blocks[1].idx = 5
    p = only(collect_problems(prog), Code.BLOCK_INDEX)
    assert (p.where, p.found, p.expected) == ("block 1", "idx 5", "idx 1 (its position)")


def test_block_parent_must_come_before(prog: Program) -> None:
    prog.create_block(0)
    prog.create_block(0)
    prog.blocks[1].parent_idx = 2
    prog.blocks[0].parent_idx = 0
    problems = [p for p in collect_problems(prog) if p.code == Code.BLOCK_PARENT]
    assert [(p.where, p.found, p.expected) for p in problems] == [
        ("block 0", "parent 0 (program has 3 blocks)", "parent -1 (block 0 is the global block)"),
        ("block 1", "parent 2 (program has 3 blocks)", "a parent in 0..0 (a block before it)"),
    ]


# --- op types, slots, attributes ---------------------------------------------------------------------
def test_unknown_op_type_suggests_close_match(prog: Program) -> None:
    prog.global_block()._append_raw_op("squre", {"X": ["z"]}, {"Out": ["s"]}, {"op_role": 0})
    p = only(collect_problems(prog), Code.UNKNOWN_OP)
    assert p.where == "block 0/op 5 (squre)"
    assert (p.found, p.expected, p.hint) == ("unknown op type 'squre'", "a registered op type",
                                             "did you mean 'square'?")


def test_unknown_slot(prog: Program) -> None:
    prog.global_block().ops[0]._inputs["Z"] = ["x"]
    p = only(collect_problems(prog), Code.UNKNOWN_SLOT)
    assert (p.where, p.found, p.expected) == ("block 0/op 0 (mul)", "input slot 'Z'", "one of the input slots ['X', 'Y']")


def test_missing_and_empty_slots(prog: Program) -> None:
    ops = prog.global_block().ops
    del ops[0]._inputs["Y"]
    ops[2]._outputs["Out"] = []
    problems = [p for p in collect_problems(prog) if p.code == Code.MISSING_SLOT]
    assert [(p.where, p.found, p.expected) for p in problems] == [
        ("block 0/op 0 (mul)", "input slot 'Y' missing", "at least one variable in input slot 'Y'"),
        ("block 0/op 2 (square)", "output slot 'Out' empty", "at least one variable in output slot 'Out'"),
    ]


def test_non_duplicable_slot_holds_one_variable(prog: Program) -> None:
    prog.global_block().ops[2]._inputs["X"] = ["z", "h"]
    p = only(collect_problems(prog), Code.SLOT_ARITY)
    assert (p.where, p.found) == ("block 0/op 2 (square)", "2 variables in input slot 'X'")
    assert p.expected == "exactly one variable (slot 'X' is not duplicable)"


def test_unknown_attribute(prog: Program) -> None:
    prog.global_block().ops[0]._attrs["x_num_col_dim"] = 1
    p = only(collect_problems(prog), Code.UNKNOWN_ATTR)
    assert (p.where, p.found, p.expected) == ("block 0/op 0 (mul)", "attribute 'x_num_col_dim'", "one of mul's attributes")
    assert p.hint == "did you mean 'x_num_col_dims'?"


def test_missing_attribute(prog: Program) -> None:
    del prog.global_block().ops[4]._attrs["shape"]
    p = only(collect_problems(prog), Code.MISSING_ATTR)
    assert (p.where, p.found) == ("block 0/op 4 (fill_constant)", "no attribute 'shape'")
    assert p.expected.startswith("attribute 'shape' of kind ints")


def test_attribute_of_wrong_kind(prog: Program) -> None:
    prog.global_block().ops[0]._attrs["x_num_col_dims"] = "1"
    p = only(collect_problems(prog), Code.ATTR_KIND)
    assert p.where == "block 0/op 0 (mul)"
    assert p.found == "attribute x_num_col_dims='1' (expected int, got str '1')"
    assert p.expected == "a value of kind int"


def test_block_refs_point_to_descendant_sub_blocks(prog: Program) -> None:
    child = prog.create_block(0)  # block 1, parent 0
    grandchild = prog.create_block(1)  # block 2, parent 1
    assert (child.idx, grandchild.idx) == (1, 2)
    ops = prog.global_block().ops
    # The attribute is unknown to fill_constant (a separate problem); the reference is checked anyway.
    ops[4]._attrs["sub_blocks"] = [BlockRef(1), BlockRef(2)]
    assert [p for p in collect_problems(prog) if p.code == Code.BLOCK_REF] == []
    ops[4]._attrs["sub_blocks"] = [BlockRef(0), BlockRef(7)]
    child._append_raw_op("fill_constant", {}, {"Out": ["loss@GRAD"]}, dict(ops[4].attrs, sub_blocks=[BlockRef(1)]))
    problems = [p for p in collect_problems(prog) if p.code == Code.BLOCK_REF]
    assert [(p.where, p.found, p.expected) for p in problems] == [
        ("block 0/op 4 (fill_constant)", "attribute sub_blocks refers to block 0", "an existing sub-block (1..2)"),
        ("block 0/op 4 (fill_constant)", "attribute sub_blocks refers to block 7", "an existing sub-block (1..2)"),
        ("block 1/op 0 (fill_constant)", "attribute sub_blocks refers to block 1 (parent chain [1, 0])",
         "a descendant of block 1, the op's block"),
    ]


def test_block_ref_to_a_sibling_block(prog: Program) -> None:
    prog.create_block(0)
    prog.create_block(0)
    prog.blocks[1]._append_raw_op("mean", {"X": ["s"]}, {"Out": ["loss"]},
                                  {"op_role": 0, "op_role_var": [], "blk": BlockRef(2)})
    p = only(collect_problems(prog), Code.BLOCK_REF)
    assert (p.where, p.found) == ("block 1/op 0 (mean)", "attribute blk refers to block 2 (parent chain [2, 0])")


# --- roles -------------------------------------------------------------------------------------------
def test_op_role_must_be_known_bits(prog: Program) -> None:
    prog.global_block().ops[1]._attrs["op_role"] = 1024 | 1
    p = only(collect_problems(prog), Code.OP_ROLE)
    assert (p.where, p.found) == ("block 0/op 1 (elementwise_add)", "op_role 1025 (unknown bits 0x400)")
    assert p.expected.startswith("a combination of the role bits 0x13f")


def test_op_role_var_pairs_of_variables(prog: Program) -> None:
    ops = prog.global_block().ops
    ops[0]._attrs["op_role_var"] = ["w"]
    ops[1]._attrs["op_role_var"] = ["bias", "bias@GRAD"]
    problems = [p for p in collect_problems(prog) if p.code == Code.OP_ROLE_VAR]
    assert [(p.where, p.found) for p in problems] == [
        ("block 0/op 0 (mul)", "op_role_var with 1 names ['w']"),
        ("block 0/op 1 (elementwise_add)", "op_role_var names 'bias@GRAD', which is not declared"),
    ]
    assert problems[0].expected == "[param, grad] pairs (an even number of names)"


# --- variables ---------------------------------------------------------------------------------------
def test_undeclared_variables(prog: Program) -> None:
    ops = prog.global_block().ops
    ops[2]._inputs["X"] = ["zz"]
    ops[3]._outputs["Out"] = ["nowhere"]
    problems = [p for p in collect_problems(prog) if p.code == Code.UNDECLARED_VAR]
    assert [(p.where, p.found, p.hint) for p in problems] == [
        ("block 0/op 2 (square)", "input X='zz', not declared in block 0 or its parents", "did you mean 'z'?"),
        ("block 0/op 3 (mean)", "output Out='nowhere', not declared in block 0 or its parents",
         "create it with Block.create_var"),
    ]


def test_undefined_temporary_read_before_write(prog: Program) -> None:
    b = prog.global_block()
    b.create_var("t", (-1, 3))
    b.ops[2]._inputs["X"] = ["t"]
    b.ops[3]._inputs["X"] = ["t"]  # reported once, at the first read
    p = only(collect_problems(prog), Code.READ_BEFORE_WRITE)
    assert (p.where, p.found) == ("block 0/op 2 (square)", "input X='t' read before any op of block 0 writes it")
    assert p.expected.startswith("a persistable or fed (is_data) variable")


def test_reading_a_value_written_later_is_caught(prog: Program) -> None:
    b = prog.global_block()
    b.append_op("square", {"X": "loss@GRAD"}, {"Out": "h"})  # h rewritten at the end: still used before
    b.ops[0]._inputs["X"] = ["z"]  # mul reads z, which only op 1 writes
    problems = [p for p in collect_problems(prog) if p.code == Code.READ_BEFORE_WRITE]
    assert [p.where for p in problems] == ["block 0/op 0 (mul)"]


def test_legitimate_reads_before_writes() -> None:
    """Persistables, fed data, ancestor-block variables (a pserver's received gradients), values written
    by earlier ops (also in place) are all fine to read."""
    p = Program()
    b0 = p.global_block()
    b0.create_parameter("w", (4, 3))
    b0.create_var("g", (4, 3))  # a gradient received by the pserver, declared in block 0
    b0.create_var("x", (-1, 4), is_data=True)
    b0.create_var("lr", (1,), persistable=True)
    b0.create_var("y", (-1, 3))
    b0.append_op("mul", {"X": "x", "Y": "w"}, {"Out": "y"})
    b0.append_op("square", {"X": "y"}, {"Out": "y"})  # in place: reads the earlier write
    sub = p.create_block(0)
    sub.create_var("g2", (4, 3))
    sub.append_op("square", {"X": "g"}, {"Out": "g2"})
    sub.append_op("elementwise_add", {"X": "g2", "Y": "w"}, {"Out": "w"})
    sub.append_op("mean", {"X": "lr"}, {"Out": "lr"})
    p.rollback()
    assert collect_problems(p) == []
    sub.create_var("g3", (4, 3))
    sub._append_raw_op("square", {"X": ["g3"]}, {"Out": ["g2"]}, dict(sub.ops[0].attrs))
    only(collect_problems(p), Code.READ_BEFORE_WRITE)


# --- shapes ------------------------------------------------------------------------------------------
def test_declared_shape_disagrees_with_inference(prog: Program) -> None:
    b = prog.global_block()
    b.set_var(b.var("z").replace(shape=(-1, 5)))
    problems = [p for p in collect_problems(prog) if p.code == Code.SHAPE_MISMATCH]
    # Inference reads declared shapes, so square (which reads z) disagrees with its declared output too.
    assert [(p.where, p.found, p.expected) for p in problems] == [
        ("block 0/op 1 (elementwise_add)", "output Out='z' declared with shape [-1, 5]",
         "shape [-1, 3] (from elementwise_add shape inference; -1 matches any)"),
        ("block 0/op 2 (square)", "output Out='s' declared with shape [-1, 3]",
         "shape [-1, 5] (from square shape inference; -1 matches any)"),
    ]


def test_unknown_extent_matches_but_rank_must(prog: Program) -> None:
    b = prog.global_block()
    b.set_var(b.var("h").replace(shape=(16, -1)))
    assert collect_problems(prog) == []
    b.set_var(b.var("h").replace(shape=(-1, 3, 1)))
    assert only(collect_problems(prog), Code.SHAPE_MISMATCH).found == "output Out='h' declared with shape [-1, 3, 1]"


def test_dtype_and_var_type_mismatch(prog: Program) -> None:
    b = prog.global_block()
    b.set_var(b.var("loss").replace(dtype="float64"))
    b.set_var(b.var("s").replace(type="selected_rows"))
    problems = collect_problems(prog)
    d = only(problems, Code.DTYPE_MISMATCH)
    assert (d.where, d.found, d.expected) == ("block 0/op 3 (mean)", "output Out='loss' declared with dtype float64",
                                              "dtype float32 (from mean shape inference)")
    t = only(problems, Code.VAR_TYPE_MISMATCH)
    assert (t.where, t.found, t.expected) == ("block 0/op 2 (square)", "output Out='s' declared as selected_rows",
                                              "lod_tensor (from square shape inference)")


def test_failing_inference_names_the_op(prog: Program) -> None:
    b = prog.global_block()
    b.set_var(b.var("w").replace(shape=(5, 3)))
    p = only(collect_problems(prog), Code.INFER_FAILED)
    assert p.where == "block 0/op 0 (mul)"
    assert p.found == "shape inference failing: mul: X[-1, 4] flattened at 1 has width 4 but Y[5, 3] flattened at 1 has height 5"


# --- verify(), the context window, program sets ------------------------------------------------------
def test_verify_lists_every_problem_with_a_marked_window(prog: Program) -> None:
    b = prog.global_block()
    for _ in range(6):
        b.append_op("square", {"X": "z"}, {"Out": "s"})
    b.ops[6]._attrs["op_role"] = -1
    b.ops[8]._inputs["X"] = ["ghost"]
    with pytest.raises(VerifyError) as info:
        verify(prog, role="trainer.0")
    err = info.value
    assert [(p.code, p.where) for p in err.problems] == [
        (Code.OP_ROLE, "trainer.0/block 0/op 6 (square)"),
        (Code.UNDECLARED_VAR, "trainer.0/block 0/op 8 (square)"),
    ]
    text = str(err)
    assert text.startswith("[E500] 2 problem(s) found by the verifier:\n"
                           "  - trainer.0/block 0/op 6 (square): found op_role -1, expected a combination")
    window = text[text.index("in trainer.0 block 0:"):].splitlines()
    square = "op square(X=[z]) -> (Out=[s]) {op_role=0, op_role_var=[]}"
    assert window == [
        "in trainer.0 block 0:",
        "   block 0 {",
        "     ... (8 vars, 3 ops)",
        "     op mean(X=[s]) -> (Out=[loss]) {op_role=0, op_role_var=[]}",
        "     " + b.ops[4].to_string(),
        "     " + square,
        ">>   op square(X=[z]) -> (Out=[s]) {op_role=-1, op_role_var=[]}",
        "     " + square,
        "     op square(X=[ghost]) -> (Out=[s]) {op_role=0, op_role_var=[]}",
        "     " + square,
        "     ... (1 ops)",
        "   }",
    ]


def test_context_for_block_and_var_locations(prog: Program) -> None:
    block_problem = Problem(where="block 0", found="f", expected="e", hint=None, code="V", block=0)
    assert format_context(prog, block_problem).splitlines() == [
        "in block 0:", ">> block 0 {", "     ... (8 vars, 5 ops)", "   }"]
    var_problem = Problem(where="block 0/var x", found="f", expected="e", hint=None, code="V", block=0, var="w")
    lines = format_context(prog, var_problem).splitlines()
    assert lines[1:4] == ["   block 0 {", "     var x : lod_tensor<float32>[-1, 4] {stop_gradient=true, is_data=true}",
                          ">>   param w : lod_tensor<float32>[4, 3]"]
    assert format_context(prog, Problem(where="", found="", expected="", hint=None, code="V")) == ""


def test_verify_program_set_prefixes_roles() -> None:
    ps = ProgramSet()
    ps.add("trainer.0", make_program(), Program())
    bad_startup = Program()
    bad_startup.global_block()._append_raw_op("recvv", {}, {}, {})
    ps.add("pserver@127.0.0.1:6174", make_program(), bad_startup)
    assert cross_program_problems(ps) == []
    with pytest.raises(VerifyError) as info:
        verify_program_set(ps)
    assert [p.where for p in info.value.problems] == ["pserver@127.0.0.1:6174/startup/block 0/op 0 (recvv)"]
    assert "in pserver@127.0.0.1:6174/startup block 0:" in str(info.value)
    clean = ProgramSet()
    clean.add("trainer.0", make_program(), Program())
    assert verify_program_set(clean) is None


@pytest.mark.serial  # timed (< 2 s)
def test_verify_is_linear_time() -> None:
    p = Program()
    b = p.global_block()
    b.create_var("v0", (-1, 8), is_data=True)
    n = 20_000
    for i in range(n):
        b.create_var(f"v{i + 1}", (-1, 8))
        b.append_op("square", {"X": f"v{i}"}, {"Out": f"v{i + 1}"}, infer_shape=False)
    start = time.perf_counter()
    problems = collect_problems(p)
    elapsed = time.perf_counter() - start
    assert problems == []
    assert elapsed < 2.0, f"verifying {n} ops took {elapsed:.2f}s"


def test_pserver_receives_gradients_it_serves() -> None:
    """listen_and_serv's inputs arrive from the trainers; its optimize block reads them from block 0."""
    p = Program()
    b0 = p.global_block()
    b0.create_parameter("w", (4, 3))
    b0.create_var("g", (4, 3))
    opt = p.create_block(0)
    opt.append_op("elementwise_add", {"X": "w", "Y": "g"}, {"Out": "w"})
    p.rollback()
    b0.append_op("listen_and_serv", {"X": ["g"]}, {},
                 {"optimize_blocks": [BlockRef(1)], "grad_to_block_id": ["g:1"], "op_role": 4})
    assert collect_problems(p) == []
    b0.create_var("t", (4, 3))
    b0.append_op("square", {"X": "t"}, {"Out": "g"})  # an ordinary op still needs t defined first
    assert only(collect_problems(p), Code.READ_BEFORE_WRITE).where == "block 0/op 1 (square)"
