"""The canonical text form: golden printer output, text → parse → text identity, and parse errors.

Goldens live in ``tests/ir/goldens``; ``pytest --update-goldens`` rewrites them (review the diff).
"""
from __future__ import annotations

import math
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings

from ir.core import Parameter, Program, Variable
from ir.errors import ParseError
from ir.names import block_name, grad_name, trainer_copy_name
from ir.ops.registry import BlockRef
from ir.parser import parse_program, parse_program_file
from ir.printer import format_program
from ir.roles import OpRole
from tests.ir.strategies import programs, seeded_program

GOLDENS = pathlib.Path(__file__).parent / "goldens"
FWD, BWD, OPT = int(OpRole.FORWARD), int(OpRole.BACKWARD), int(OpRole.OPTIMIZE)
LOSS_GRAD = int(OpRole.BACKWARD | OpRole.LOSS)


# --- hand-built programs -------------------------------------------------------------------------
def fc_mean_sgd_program() -> Program:
    """y_pred = x @ w + b; loss = mean((y_pred - y)^2); one SGD step, built as a user would."""
    prog = Program()
    b = prog.global_block()
    x = b.create_var("x", shape=(-1, 13), is_data=True, stop_gradient=True)
    y = b.create_var("y", shape=(-1, 1), is_data=True, stop_gradient=True)
    w = b.create_parameter("fc_0.w_0", shape=(13, 1))
    bias = b.create_parameter("fc_0.b_0", shape=(1,))
    lr = b.create_var("learning_rate_0", shape=(1,), persistable=True)
    for name in ("fc_0.tmp_0", "fc_0.tmp_1", "sub_0.tmp_0", "square_0.tmp_0", "mean_0.tmp_0"):
        b.create_var(name)
    b.append_op("mul", {"X": x, "Y": w}, {"Out": "fc_0.tmp_0"}, {"x_num_col_dims": 1})
    b.append_op("elementwise_add", {"X": "fc_0.tmp_0", "Y": bias}, {"Out": "fc_0.tmp_1"}, {"axis": 1})
    b.append_op("elementwise_sub", {"X": "fc_0.tmp_1", "Y": y}, {"Out": "sub_0.tmp_0"})
    b.append_op("square", {"X": "sub_0.tmp_0"}, {"Out": "square_0.tmp_0"})
    b.append_op("mean", {"X": "square_0.tmp_0"}, {"Out": "mean_0.tmp_0"})
    for name in ("mean_0.tmp_0", "square_0.tmp_0", "sub_0.tmp_0", "fc_0.tmp_1", "fc_0.tmp_0", w.name, bias.name):
        b.create_var(grad_name(name))
    g = grad_name
    b.append_op("fill_constant", {}, {"Out": g("mean_0.tmp_0")},
                {"shape": [1], "value": 1.0, "op_role": LOSS_GRAD})
    b.append_op("mean_grad", {"X": "square_0.tmp_0", "Out@GRAD": g("mean_0.tmp_0")},
                {"X@GRAD": g("square_0.tmp_0")}, {"op_role": BWD})
    b.append_op("square_grad", {"X": "sub_0.tmp_0", "Out@GRAD": g("square_0.tmp_0")},
                {"X@GRAD": g("sub_0.tmp_0")}, {"op_role": BWD})
    b.append_op("elementwise_sub_grad", {"X": "fc_0.tmp_1", "Y": y, "Out@GRAD": g("sub_0.tmp_0")},
                {"X@GRAD": g("fc_0.tmp_1")}, {"op_role": BWD})
    b.append_op("elementwise_add_grad", {"X": "fc_0.tmp_0", "Y": bias, "Out@GRAD": g("fc_0.tmp_1")},
                {"X@GRAD": g("fc_0.tmp_0"), "Y@GRAD": g(bias.name)},
                {"axis": 1, "op_role": BWD, "op_role_var": [bias.name, g(bias.name)]})
    b.append_op("mul_grad", {"X": x, "Y": w, "Out@GRAD": g("fc_0.tmp_0")}, {"Y@GRAD": g(w.name)},
                {"op_role": BWD, "op_role_var": [w.name, g(w.name)]})
    for p in (w, bias):
        b.append_op("sgd", {"Param": p, "Grad": g(p.name), "LearningRate": lr}, {"ParamOut": p},
                    {"op_role": OPT, "op_role_var": [p.name, g(p.name)]})
    return prog


def pserver_program() -> Program:
    """A pserver-like main program: listen_and_serv in block 0 names its optimize sub-blocks by
    BlockRef; block 3 is nested in block 2 and shadows a name of block 0."""
    prog = Program()
    g0 = prog.global_block()
    w0 = g0.create_parameter(block_name("fc_w", 0), shape=(512, 10), slice_of="fc_w", slice_index=0, slice_offset=0)
    w1 = g0.create_parameter(block_name("fc_w", 1), shape=(488, 10), slice_of="fc_w", slice_index=1,
                             slice_offset=512)
    lr = g0.create_var("learning_rate_0", shape=(1,), persistable=True)
    for w in (w0, w1):
        g0.create_var(grad_name(w.name), shape=w.shape, persistable=True)
        for t in range(2):
            g0.create_var(trainer_copy_name(grad_name(w.name), t), shape=w.shape, persistable=True,
                          copy_of=grad_name(w.name), trainer_id=t)
    blocks = []
    for w in (w0, w1):
        blk = prog.create_block(parent_idx=0)
        copies = [trainer_copy_name(grad_name(w.name), t) for t in range(2)]
        blk.append_op("sum", {"X": copies}, {"Out": grad_name(w.name)}, {"op_role": OPT}, infer_shape=False)
        blk.append_op("scale", {"X": grad_name(w.name)}, {"Out": grad_name(w.name)},
                      {"scale": 0.5, "op_role": OPT}, infer_shape=False)
        blk.append_op("sgd", {"Param": w, "Grad": grad_name(w.name), "LearningRate": lr}, {"ParamOut": w},
                      {"op_role": OPT, "op_role_var": [w.name, grad_name(w.name)]}, infer_shape=False)
        blocks.append(blk)
        prog.rollback()
    nested = prog.create_block(parent_idx=2)
    nested.create_var("learning_rate_0", shape=(1,), dtype="float64")
    nested.append_op("increment", {"X": "learning_rate_0"}, {"Out": "learning_rate_0"}, {"step": 1.0},
                     infer_shape=False)
    prog.rollback()
    prog.rollback()
    grad_to_block = [f"{grad_name(w.name)}:{blk.idx}" for w, blk in zip((w0, w1), blocks)]
    g0.append_op("listen_and_serv", {"X": []}, {},
                 {"endpoint": "127.0.0.1:6174", "Fanin": 2, "optimize_blocks": [BlockRef(1), BlockRef(2)],
                  "grad_to_block_id": grad_to_block, "sync_mode": True, "op_role": int(OpRole.RPC)},
                 infer_shape=False)
    prog.random_seed = 90
    return prog


def parameters_program() -> Program:
    """Parameters with every optimizer field set, slices and trainer copies, awkward names and values."""
    prog = Program()
    b = prog.global_block()
    b.add_var(Parameter("emb", shape=(10000, 64), learning_rate=0.5, regularizer="L2Decay(0.001)",
                        gradient_clip="GradientClipByValue(-1.0, 1.0)", is_distributed=True))
    b.add_var(Parameter("frozen", shape=(64,), dtype="float64", trainable=False, persistable=False))
    b.add_var(Variable("ids", shape=(-1, 1), dtype="int64", is_data=True, stop_gradient=True))
    b.add_var(Variable(grad_name("emb"), shape=(10000, 64), type="selected_rows"))
    for i, offset in enumerate((0, 5000)):
        sliced = block_name(grad_name("emb"), i)
        b.add_var(Variable(sliced, shape=(5000, 64), type="selected_rows", slice_of=grad_name("emb"),
                           slice_index=i, slice_offset=offset))
        b.add_var(Variable(trainer_copy_name(sliced, 3), shape=(5000, 64), type="selected_rows",
                           persistable=True, copy_of=sliced, trainer_id=3))
    b.add_var(Variable("my var", shape=(2, 2), dtype="bfloat16", type="raw"))
    b.add_var(Variable("op", shape=(), dtype="bool"))
    b.add_var(Variable('say "hi"', shape=(1,), dtype="float16"))
    b._append_raw_op("fill_constant", {}, {"Out": ["my var"]},
                     {"dtype": "bfloat16", "force_cpu": False, "op_role": FWD, "op_role_var": [],
                      "shape": [2, 2], "value": -0.0})
    b._append_raw_op("scale", {"X": ["my var"]}, {"Out": ['say "hi"']},
                     {"bias": 1e-300, "bias_after_scale": True, "op_role": FWD, "op_role_var": [],
                      "scale": math.inf, "extra_note": "tab\there \\ \"q\" end", "extra_big": 2**63 - 1,
                      "extra_nan": math.nan, "extra_neg_inf": -math.inf, "extra_tenth": 0.1,
                      "extra_nested": [[1, 2], [], ["x"]], "extra_none": None})
    b._append_raw_op("split_selected_rows", {"X": [grad_name("emb")]},
                     {"Out": [block_name(grad_name("emb"), 0), block_name(grad_name("emb"), 1)]},
                     {"height_sections": [5000, 5000], "op_role": BWD, "op_role_var": ["emb", grad_name("emb")]})
    return prog


GOLDEN_PROGRAMS = {
    "fc_mean_sgd.txt": fc_mean_sgd_program,
    "pserver_sub_blocks.txt": pserver_program,
    "parameters_and_slices.txt": parameters_program,
}


@pytest.mark.parametrize("name", sorted(GOLDEN_PROGRAMS))
def test_golden_printer_output(name: str, golden) -> None:
    golden.check(name, format_program(GOLDEN_PROGRAMS[name]()))


@pytest.mark.parametrize("name", sorted(GOLDEN_PROGRAMS))
def test_golden_round_trips(name: str) -> None:
    text = (GOLDENS / name).read_text(encoding="utf-8")
    program = parse_program(text, name)
    assert format_program(program) == text
    assert format_program(program.clone()) == text


def test_golden_training_program_structure() -> None:
    """The parsed golden is the program, not just the same text: spot-check the objects."""
    program = parse_program_file(GOLDENS / "fc_mean_sgd.txt")
    b = program.global_block()
    w = b.var("fc_0.w_0")
    assert isinstance(w, Parameter) and w.shape == (13, 1) and w.persistable and w.trainable
    assert b.var("x") == Variable("x", shape=(-1, 13), is_data=True, stop_gradient=True)
    types = [op.type for op in b.ops]
    assert types[:5] == ["mul", "elementwise_add", "elementwise_sub", "square", "mean"]
    assert types[-2:] == ["sgd", "sgd"]
    sgd = b.ops[-2]
    assert dict(sgd.inputs) == {"Param": ["fc_0.w_0"], "Grad": ["fc_0.w_0@GRAD"], "LearningRate": ["learning_rate_0"]}
    assert sgd.role == OPT and sgd.role_var == ["fc_0.w_0", "fc_0.w_0@GRAD"]
    assert b.ops[5].attr("value") == 1.0 and b.ops[5].role == LOSS_GRAD


def test_golden_sub_blocks_structure() -> None:
    program = parse_program_file(GOLDENS / "pserver_sub_blocks.txt")
    assert [(blk.idx, blk.parent_idx) for blk in program.blocks] == [(0, -1), (1, 0), (2, 0), (3, 2)]
    assert program.random_seed == 90
    serv = program.global_block().ops[-1]
    assert serv.attr("optimize_blocks") == [BlockRef(1), BlockRef(2)]
    assert program.block(3).var("learning_rate_0").dtype == "float64"
    assert program.block(1).var_recursive("learning_rate_0").dtype == "float32"
    w1 = program.global_block().var("fc_w.block1")
    assert (w1.slice_of, w1.slice_index, w1.slice_offset) == ("fc_w", 1, 512)


def test_parsed_values_are_exact() -> None:
    program = parse_program_file(GOLDENS / "parameters_and_slices.txt")
    b = program.global_block()
    emb = b.var("emb")
    assert isinstance(emb, Parameter)
    assert (emb.learning_rate, emb.regularizer, emb.gradient_clip, emb.is_distributed) == (
        0.5, "L2Decay(0.001)", "GradientClipByValue(-1.0, 1.0)", True)
    frozen = b.var("frozen")
    assert isinstance(frozen, Parameter) and not frozen.trainable and not frozen.persistable
    copy = b.var("emb@GRAD.block1.trainer_3")
    assert (copy.copy_of, copy.trainer_id, copy.type) == ("emb@GRAD.block1", 3, "selected_rows")
    fill, scale = b.ops[0], b.ops[1]
    assert fill.outputs["Out"] == ["my var"]
    assert math.copysign(1.0, fill.attr("value")) == -1.0
    assert scale.outputs["Out"] == ['say "hi"']
    assert scale.attr("bias") == 1e-300 and scale.attr("scale") == math.inf
    assert scale.attr("extra_note") == "tab\there \\ \"q\" end"
    assert scale.attr("extra_big") == 2**63 - 1 and isinstance(scale.attr("extra_big"), int)
    assert math.isnan(scale.attr("extra_nan")) and scale.attr("extra_neg_inf") == -math.inf
    assert scale.attr("extra_tenth") == 0.1
    assert scale.attr("extra_nested") == [[1, 2], [], ["x"]]
    assert scale.attr("extra_none") is None


# --- round trip over random programs -------------------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_round_trip(program: Program) -> None:
    text = format_program(program)
    parsed = parse_program(text)
    assert format_program(parsed) == text
    assert format_program(program.clone()) == text
    assert [(b.idx, b.parent_idx, len(b.vars), len(b.ops)) for b in parsed.blocks] == [
        (b.idx, b.parent_idx, len(b.vars), len(b.ops)) for b in program.blocks]


@pytest.mark.parametrize("seed", range(0, 200, 7))
def test_seeded_programs_round_trip(seed: int) -> None:
    program = seeded_program(seed)
    text = format_program(program)
    assert format_program(seeded_program(seed)) == text, "seeded_program must be deterministic"
    assert format_program(parse_program(text)) == text


def test_comments_and_blank_lines_are_ignored() -> None:
    text = format_program(fc_mean_sgd_program())
    lines = text.split("\n")
    commented = "\n".join(["# leading comment", ""] + [line + "\n   # note" for line in lines[:-1]]) + "\n\n"
    assert format_program(parse_program(commented)) == text


def test_line_separators_inside_strings_are_not_line_breaks() -> None:
    prog = Program()
    prog.global_block().add_var(Variable("a\u2028b\x85c\x0cd", shape=(1,)))
    text = format_program(prog)
    assert "\u2028" in text
    assert format_program(parse_program(text)) == text


def test_parse_program_file_names_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("program {random_seed=0}\nblock 0 {\n  op sendd() -> ()\n}\n", encoding="utf-8")
    with pytest.raises(ParseError) as info:
        parse_program_file(path)
    assert info.value.message.startswith(f"{path}:3:6: error: unknown op type 'sendd'")
    with pytest.raises(ParseError, match="cannot read the program file"):
        parse_program_file(tmp_path / "missing.txt")


@pytest.mark.serial  # timed (< 3 s)
def test_large_program_parses_in_linear_time() -> None:
    """20k ops (about 2 MB) must parse well within a second or two on a slow machine."""
    import time

    prog = Program()
    b = prog.global_block()
    for i in range(50):
        b.create_var(f"v{i}", shape=(-1, 10))
    for i in range(20000):
        b._append_raw_op("mul", {"X": [f"v{i % 50}"], "Y": [f"v{(i + 1) % 50}"]}, {"Out": [f"v{(i + 2) % 50}"]},
                         {"op_role": 0, "op_role_var": [], "x_num_col_dims": 1, "y_num_col_dims": 1})
    text = format_program(prog)
    start = time.perf_counter()
    parsed = parse_program(text)
    elapsed = time.perf_counter() - start
    assert len(parsed.global_block().ops) == 20000
    assert elapsed < 3.0, f"parsing 20k ops took {elapsed:.2f}s"


# --- parse errors --------------------------------------------------------------------------------
BASE = """program {random_seed=0}
block 0 {
  var x : lod_tensor<float32>[-1, 4]
  param w : lod_tensor<float32>[4, 4] {learning_rate=0.5}
  op send(X=[x]) -> (Out=[]) {epmap=["a:1"], sync_mode=true}
}
block 1 parent 0 {
}
"""


def test_base_text_is_valid() -> None:
    assert format_program(parse_program(BASE)) == BASE


def _parse_error(text: str) -> ParseError:
    with pytest.raises(ParseError) as info:
        parse_program(text, "prog.txt")
    return info.value


def _check(err: ParseError, line: int, col: int, what: str) -> None:
    header, source, caret = err.message.split("\n")
    assert header == f"prog.txt:{line}:{col}: error: {what}"
    assert caret == " " * (col - 1) + "^"
    assert (err.line, err.col, err.filename) == (line, col, "prog.txt")
    assert err.code == "E300"


# (old, new, line, col, message): BASE with the first ``old`` replaced by ``new``.
ERROR_CASES = [
    ("op send(", "op sendd(", 5, 6, "unknown op type 'sendd' (did you mean 'send'?)"),
    ("lod_tensor<float32>[-1", "lod_tensr<float32>[-1", 3, 11,
     "unknown variable type 'lod_tensr' (did you mean 'lod_tensor'?); known: lod_tensor, selected_rows, raw"),
    ("float32>[-1", "float23>[-1", 3, 22, "unknown dtype 'float23' (did you mean 'float32'?); known: "
     "float16, bfloat16, float32, float64, int8, uint8, int16, int32, int64, bool"),
    ("[-1, 4]", "[-1, 4] {persistible=true}", 3, 39, "unknown variable property 'persistible' (did you mean 'persistable'?)"),
    ("[-1, 4]", "[-1, 4] {trainable=false}", 3, 39,
     "property 'trainable' belongs to parameters: declare the variable with 'param'"),
    ("{learning_rate=0.5}", "{learning_rate=true}", 4, 40, "variable property 'learning_rate' must be float, got bool True"),
    ("program {", "progam {", 1, 1, "expected a 'program {random_seed=N}' header, found 'progam' (did you mean 'program'?)"),
    ("{random_seed=0}", "{random_sed=0}", 1, 10,
     "unknown program property 'random_sed' (did you mean 'random_seed'?); known: random_seed"),
    ("block 0 {", "blok 0 {", 2, 1, "expected 'block 0 {', found 'blok' (did you mean 'block'?)"),
    ("  var x", "  vr x", 3, 3, "expected 'var', 'param', 'op' or '}', found 'vr' (did you mean 'var'?)"),
    ("parent 0 {", "parnt 0 {", 7, 9, "expected 'parent' or '{', found 'parnt' (did you mean 'parent'?)"),
    ("sync_mode=true", "sync_mode=ture", 5, 56,
     "expected a value (true, false, a number, a JSON string, ^N or a list), found 'ture' (did you mean 'true'?)"),
    ("block 1 parent 0", "block 2 parent 0", 7, 7, "expected block 1 here (blocks are numbered in order), found block 2"),
    ("block 1 parent 0", "block 1 parent 1", 7, 16, "parent 1 of block 1 must be an earlier block (0..0)"),
    ("block 1 parent 0", "block 1 parent -1", 7, 16, "parent -1 of block 1 must be an earlier block (0..0)"),
    ("block 0 {", "block 0 parent 0 {", 2, 16, "block 0 (the global block) cannot have a parent"),
    ("block 0 {", "block zero {", 2, 7, "expected a block index, found 'zero'"),
    ("block 0 {", "block 0.5 {", 2, 7, "expected a block index, found float 0.5"),
    ("  param w", "  param x", 4, 9, "duplicate variable 'x' in block 0 (first declared at line 3)"),
    ('["a:1"]', '["a:1]', 5, 38, "unterminated string: expected a closing '\"' on the same line"),
    ('["a:1"]', '["a\\q"]', 5, 40, "bad string escape: Invalid \\escape"),
    ("[-1, 4]", "[-1, 4x]", 3, 35,
     "bad number '4x': expected an integer such as -1, or a float such as 0.5, 1e-05, -inf"),
    ("sync_mode=true", "sync_mode=1.2.3", 5, 56,
     "bad number '1.2.3': expected an integer such as -1, or a float such as 0.5, 1e-05, -inf"),
    ("sync_mode=true", "sync_mode=1e", 5, 56,
     "bad number '1e': expected an integer such as -1, or a float such as 0.5, 1e-05, -inf"),
    ("sync_mode=true}", "sync_mode=true", 5, 60, "expected ',' or '}' after attribute 'sync_mode', found end of line"),
    ("block 1 parent 0 {", "block 1 parent 0", 7, 17, "expected '{' to open the block, found end of line"),
    ("block 0 {", "block 0", 2, 8, "expected 'parent' or '{', found end of line"),
    ("}\nblock 1", "block 1", 6, 1, "expected 'var', 'param', 'op' or '}', found 'block' (block 0, opened at line 2, is not closed)"),
    ("sync_mode=true}", "sync_mode=true} extra", 5, 62, "expected end of line after the op, found 'extra'"),
    ("sync_mode=true}", "sync_mode=true} # note", 5, 62,
     "expected end of line after the op, found character '#' (comments take a whole line that starts with '#')"),
    ("-> (Out=[])", "(Out=[])", 5, 18, "expected '->' between the input and output slots, found '('"),
    ("(X=[x])", "(X=[x], X=[x])", 5, 18, "duplicate input slot 'X'"),
    ("sync_mode=true", "sync_mode=true, epmap=[]", 5, 62, "duplicate attribute 'epmap'"),
    ("sync_mode=true", "sync_mode=^x", 5, 57, "expected a block index after '^', found 'x'"),
    ("(X=[x])", "(X=[x y])", 5, 16, "expected ',' or ']' in the slot's variable list, found 'y'"),
    ("  var x :", '  var "" :', 3, 7, "bad variable: variable name must be a non-empty string, got ''"),
    ("  var x :", "  var 1x :", 3, 7, "expected a variable name (a name, or a JSON string for other names), found number 1x"),
    ("block 0 {", "block 0 { }", 2, 11, "expected end of line after 'block 0 {', found '}'"),
    ("{random_seed=0}", "{random_seed=1.5}", 1, 10, "program property 'random_seed' must be an integer, got float"),
]


@pytest.mark.parametrize("old, new, line, col, what", ERROR_CASES, ids=[c[4][:40] for c in ERROR_CASES])
def test_parse_errors(old: str, new: str, line: int, col: int, what: str) -> None:
    assert old in BASE
    err = _parse_error(BASE.replace(old, new, 1))
    _check(err, line, col, what)


def test_error_message_shows_source_line_and_caret() -> None:
    err = _parse_error(BASE.replace("op send(", "op sendd("))
    assert err.message == (
        "prog.txt:5:6: error: unknown op type 'sendd' (did you mean 'send'?)\n"
        '  op sendd(X=[x]) -> (Out=[]) {epmap=["a:1"], sync_mode=true}\n'
        "     ^"
    )
    assert str(err).startswith("[E300] prog.txt:5:6: error: unknown op type 'sendd'")


def test_caret_keeps_tabs_for_alignment() -> None:
    err = _parse_error(BASE.replace("  op send(", "\top sendd("))
    assert err.message.split("\n")[1:] == ['\top sendd(X=[x]) -> (Out=[]) {epmap=["a:1"], sync_mode=true}', "\t   ^"]
    assert (err.line, err.col) == (5, 5)


def test_missing_closing_brace_at_end_of_file() -> None:
    err = _parse_error(BASE[: BASE.rindex("}")])
    _check(err, 8, 1, "end of file inside block 1 (opened at line 7): expected '}'")


def test_trailing_garbage_after_last_block() -> None:
    err = _parse_error(BASE + "garbage\n")
    _check(err, 9, 1, "expected 'block', found 'garbage'")


def test_empty_input_and_missing_blocks() -> None:
    _check(_parse_error(""), 1, 1, "empty input: expected a 'program {random_seed=N}' header")
    _check(_parse_error("# only a comment\n"), 2, 1, "empty input: expected a 'program {random_seed=N}' header")
    _check(_parse_error("program {random_seed=0}\n"), 2, 1,
           "expected 'block 0 {' after the program header, found end of file")


def test_unknown_name_without_close_match_has_no_suggestion() -> None:
    err = _parse_error(BASE.replace("op send(", "op zzzzzzzz("))
    _check(err, 5, 6, "unknown op type 'zzzzzzzz'")


def test_number_with_too_many_digits_is_a_parse_error() -> None:
    err = _parse_error(BASE.replace("sync_mode=true", "sync_mode=" + "9" * 5000))
    assert err.message.startswith("prog.txt:5:56: error: bad number '99999999999999999999...'")


def test_parse_program_rejects_bytes() -> None:
    with pytest.raises(ParseError, match="needs text"):
        parse_program(BASE.encode())  # type: ignore[arg-type]
