"""Schemas of the math and nn op families: shape inference, its failures, and gradient makers.

Each case builds a one-op Program through ``Block.create_var`` / ``append_op`` (which runs shape
inference), checks every output's shape, dtype and type, then corrupts one input or attribute and
checks the ``IRError`` names the problem. Differentiable ops also have their grad op built from
``make_grad``, appended (so the grad op's own inference runs) and checked against the forward inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ir import IRError, Program
from ir.core import Block, Operator
from ir.names import GRAD_SUFFIX
from ir.ops import all_op_defs, get_op_def, has_op

F, I32, I64, B = "float32", "int32", "int64", "bool"
VarSpec = tuple[str, tuple[int, ...], str, str]


def v(name: str, shape: list[int], dtype: str = F, type: str = "lod_tensor") -> VarSpec:
    return (name, tuple(shape), dtype, type)


@dataclass(frozen=True)
class Bad:
    """A corruption of a case: replaced input variables and attributes, and the expected message."""

    match: str
    vars: tuple[VarSpec, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    inputs: dict[str, list[VarSpec]]
    outputs: dict[str, list[VarSpec]]  # the expected inferred VarInfo of each output variable
    attrs: dict[str, Any] = field(default_factory=dict)
    bad: Bad | None = None


UNARY = ("square", "sqrt", "exp", "log", "abs", "floor", "relu", "sigmoid", "tanh", "softsign", "gelu")
ELEMENTWISE = tuple(f"elementwise_{k}" for k in ("add", "sub", "mul", "div", "max", "min", "pow"))
COMPARE = ("less_than", "less_equal", "greater_than", "greater_equal", "equal", "not_equal")
REDUCE = ("reduce_sum", "reduce_mean", "reduce_max")
RANDOM = ("uniform_random", "gaussian_random", "truncated_gaussian_random")

CASES: dict[str, Case] = {
    "mul": Case({"X": [v("x", [-1, 4])], "Y": [v("w", [4, 3])]}, {"Out": [v("o", [-1, 3])]},
                bad=Bad("has width 4 but Y\\[5, 3\\]", (v("w", [5, 3]),))),
    "matmul": Case({"X": [v("x", [-1, 3, 4])], "Y": [v("y", [5, 4])]}, {"Out": [v("o", [-1, 3, 5])]},
                   {"transpose_Y": True}, Bad("has height 6", (v("y", [5, 6]),))),
    "scale": Case({"X": [v("x", [10, 4], type="selected_rows")]},
                  {"Out": [v("o", [10, 4], type="selected_rows")]}, {"scale": 0.5}),
    "sum": Case({"X": [v("a", [-1, 4]), v("b", [-1, 4]), v("c", [-1, 4])]}, {"Out": [v("o", [-1, 4])]},
                bad=Bad("X\\[0\\]\\[-1, 4\\] and X\\[1\\]\\[-1, 5\\] must have the same shape", (v("b", [-1, 5]),))),
    "mean": Case({"X": [v("x", [-1, 4])]}, {"Out": [v("o", [1])]}),
    "softmax": Case({"X": [v("x", [-1, 5])]}, {"Out": [v("o", [-1, 5])]},
                    bad=Bad("axis=2 is out of range for rank 2", attrs={"axis": 2})),
    "cast": Case({"X": [v("x", [-1, 3])]}, {"Out": [v("o", [-1, 3], I64)]}, {"in_dtype": F, "out_dtype": I64},
                 Bad("in_dtype=int32 but X has dtype float32", attrs={"in_dtype": I32})),
    "fill_constant": Case({}, {"Out": [v("o", [2, 3], I64)]}, {"shape": [2, 3], "dtype": I64, "value": 1.0}),
    "fill_constant_batch_size_like": Case(
        {"Input": [v("x", [-1, 7])]}, {"Out": [v("o", [3, -1], I64)]},
        {"shape": [3, 5], "dtype": I64, "output_dim_idx": 1},
        Bad("input_dim_idx=2 is out of range", attrs={"input_dim_idx": 2})),
    "fill_zeros_like": Case({"X": [v("x", [-1, 3], I64)]}, {"Out": [v("o", [-1, 3], I64)]}),
    "uniform_random": Case({}, {"Out": [v("o", [4, 5])]}, {"shape": [4, 5], "min": -0.5, "max": 0.5},
                           Bad("min=1.0 must be less than max=0.0", attrs={"min": 1.0, "max": 0.0})),
    "gaussian_random": Case({}, {"Out": [v("o", [4, 5], "float64")]}, {"shape": [4, 5], "dtype": "float64"},
                            Bad("attr dtype has dtype int64", attrs={"dtype": I64})),
    "truncated_gaussian_random": Case({}, {"Out": [v("o", [6])]}, {"shape": [6], "std": 0.02},
                                      Bad("std=-1.0 must be >= 0", attrs={"std": -1.0})),
    "assign": Case({"X": [v("x", [10, 4], type="selected_rows")]}, {"Out": [v("o", [10, 4], type="selected_rows")]}),
    "increment": Case({"X": [v("x", [1], I64)]}, {"Out": [v("o", [1], I64)]}, {"step": 2.0},
                      Bad("X\\[3\\] must hold exactly one element", (v("x", [3], I64),))),
    "logical_and": Case({"X": [v("x", [-1, 3], B)], "Y": [v("y", [-1, 3], B)]}, {"Out": [v("o", [-1, 3], B)]},
                        bad=Bad("X has dtype float32; expected one of \\['bool'\\]", (v("x", [-1, 3]),))),
    "logical_or": Case({"X": [v("x", [-1, 3], B)], "Y": [v("y", [-1, 3], B)]}, {"Out": [v("o", [-1, 3], B)]},
                       bad=Bad("must have the same shape", (v("y", [-1, 4], B),))),
    "logical_not": Case({"X": [v("x", [-1, 3], B)]}, {"Out": [v("o", [-1, 3], B)]},
                        bad=Bad("X has dtype int64", (v("x", [-1, 3], I64),))),
    "where": Case({"Condition": [v("c", [-1, 3], B)], "X": [v("x", [-1, 3])], "Y": [v("y", [-1, 3])]},
                  {"Out": [v("o", [-1, 3])]},
                  bad=Bad("X\\[-1, 3\\] and Y\\[-1, 4\\] must have the same shape", (v("y", [-1, 4]),))),
    # --- nn
    "cross_entropy": Case({"X": [v("x", [-1, 10])], "Label": [v("l", [-1, 1], I64)]}, {"Y": [v("o", [-1, 1])]},
                          bad=Bad("hard Label\\[-1, 2\\] must have extent 1", (v("l", [-1, 2], I64),))),
    "softmax_with_cross_entropy": Case(
        {"Logits": [v("x", [-1, 10])], "Label": [v("l", [-1, 1], I64)]},
        {"Softmax": [v("s", [-1, 10])], "Loss": [v("o", [-1, 1])]},
        bad=Bad("hard Label has dtype float32", (v("l", [-1, 1]),))),
    "sigmoid_cross_entropy_with_logits": Case(
        {"X": [v("x", [-1, 5])], "Label": [v("l", [-1, 5])]}, {"Out": [v("o", [-1, 5])]},
        bad=Bad("X\\[-1, 5\\] and Label\\[-1, 4\\] must have the same shape", (v("l", [-1, 4]),))),
    "log_loss": Case({"Predicted": [v("p", [-1, 1])], "Labels": [v("l", [-1, 1])]}, {"Loss": [v("o", [-1, 1])]},
                     bad=Bad("must have shape \\[N, 1\\]", (v("p", [-1, 2]), v("l", [-1, 2])))),
    "cos_sim": Case({"X": [v("x", [-1, 8])], "Y": [v("y", [1, 8])]},
                    {"Out": [v("o", [-1, 1])], "XNorm": [v("xn", [-1, 1])], "YNorm": [v("yn", [1, 1])]},
                    bad=Bad("must have X's batch size 4 or 1 rows", (v("x", [4, 8]), v("y", [3, 8])))),
    "lookup_table": Case({"W": [v("w", [100, 16])], "Ids": [v("ids", [-1, 1], I64)]}, {"Out": [v("o", [-1, 16])]},
                         {"is_sparse": True}, Bad("Ids has dtype int32", (v("ids", [-1, 1], I32),))),
    "sequence_pool": Case({"X": [v("x", [-1, 7, 16])], "Ids": [v("ids", [-1, 7], I64)]},
                          {"Out": [v("o", [-1, 16])], "MaxIndex": [v("mi", [-1, 16], I32)]},
                          {"pooltype": "MAX", "padding_idx": 0},
                          Bad("pooltype 'MEDIAN' is unknown", attrs={"pooltype": "MEDIAN"})),
    "concat": Case({"X": [v("a", [-1, 3]), v("b", [-1, 5])]}, {"Out": [v("o", [-1, 8])]}, {"axis": 1},
                   Bad("X\\[1\\]\\[4, 5, 6\\] has rank 3", (v("b", [4, 5, 6]),))),
    "split": Case({"X": [v("x", [-1, 9])]}, {"Out": [v("a", [-1, 3]), v("b", [-1, 3]), v("c", [-1, 3])]},
                  {"num": 3, "axis": 1}, Bad("extent 10\\) does not divide into num=3", (v("x", [-1, 10]),))),
    "reshape": Case({"X": [v("x", [-1, 4, 6])]}, {"Out": [v("o", [-1, 2, 12])]}, {"shape": [0, 2, -1]},
                    Bad("may hold at most one -1", attrs={"shape": [-1, -1]})),
    "transpose": Case({"X": [v("x", [-1, 3, 5])]}, {"Out": [v("o", [5, -1, 3])]}, {"axis": [2, 0, 1]},
                      Bad("axis \\[0, 0, 1\\] is not a permutation", attrs={"axis": [0, 0, 1]})),
    "conv2d": Case({"Input": [v("x", [-1, 3, 32, 32])], "Filter": [v("f", [8, 3, 3, 3])]},
                   {"Output": [v("o", [-1, 8, 16, 16])]}, {"strides": [2, 2], "paddings": [1, 1]},
                   Bad("has 3 channels but Filter\\[8, 4, 3, 3\\] takes 4", (v("f", [8, 4, 3, 3]),))),
    "pool2d": Case({"X": [v("x", [-1, 8, 16, 16])]}, {"Out": [v("o", [-1, 8, 8, 8])]},
                   {"pooling_type": "avg", "ksize": [2, 2], "strides": [2, 2]},
                   Bad("pooling_type 'min' is unknown", attrs={"pooling_type": "min"})),
    "batch_norm": Case(
        {"X": [v("x", [-1, 8, 4, 4])], "Scale": [v("sc", [8])], "Bias": [v("bi", [8])], "Mean": [v("mu", [8])],
         "Variance": [v("va", [8])]},
        {"Y": [v("y", [-1, 8, 4, 4])], "MeanOut": [v("mo", [8])], "VarianceOut": [v("vo", [8])],
         "SavedMean": [v("sm", [8])], "SavedVariance": [v("sv", [8])]},
        bad=Bad("Scale\\[7\\] must be \\[C\\] with C=8", (v("sc", [7]),))),
    "layer_norm": Case(
        {"X": [v("x", [-1, 7, 16])], "Scale": [v("sc", [16])], "Bias": [v("bi", [16])]},
        {"Y": [v("y", [-1, 7, 16])], "Mean": [v("mu", [-1])], "Variance": [v("va", [-1])]},
        {"begin_norm_axis": 2},
        Bad("Scale\\[16\\] must be \\[112\\]", attrs={"begin_norm_axis": 1})),
    "dropout": Case({"X": [v("x", [-1, 10])]}, {"Out": [v("o", [-1, 10])], "Mask": [v("m", [-1, 10])]},
                    {"dropout_prob": 0.3, "dropout_implementation": "upscale_in_train"},
                    Bad("dropout_prob=1.5 must be in \\[0, 1\\]", attrs={"dropout_prob": 1.5})),
    "top_k": Case({"X": [v("x", [-1, 10])]}, {"Out": [v("o", [-1, 3])], "Indices": [v("i", [-1, 3], I64)]},
                  {"k": 3}, Bad("k=11 must be in \\[1, 10\\]", attrs={"k": 11})),
    "accuracy": Case(
        {"Out": [v("p", [-1, 3])], "Indices": [v("i", [-1, 3], I64)], "Label": [v("l", [-1, 1], I64)]},
        {"Accuracy": [v("acc", [1])], "Correct": [v("cor", [1], I32)], "Total": [v("tot", [1], I32)]},
        bad=Bad("Label\\[-1, 2\\] must be \\[N, 1\\]", (v("l", [-1, 2], I64),))),
    "auc": Case(
        {"Predict": [v("p", [-1, 2])], "Label": [v("l", [-1, 1], I64)], "StatPos": [v("sp", [4096], I64)],
         "StatNeg": [v("sn", [4096], I64)]},
        {"AUC": [v("a", [1], "float64")], "StatPosOut": [v("spo", [4096], I64)],
         "StatNegOut": [v("sno", [4096], I64)]},
        bad=Bad("StatPos\\[100\\] must end in num_thresholds \\+ 1 = 4096", (v("sp", [100], I64),))),
}
for _t in UNARY:
    CASES[_t] = Case({"X": [v("x", [-1, 3])]}, {"Out": [v("o", [-1, 3])]})
for _t in ELEMENTWISE:
    CASES[_t] = Case({"X": [v("x", [-1, 3, 4])], "Y": [v("y", [3, 1])]}, {"Out": [v("o", [-1, 3, 4])]}, {"axis": 1},
                     Bad("does not broadcast onto X", (v("y", [5]),), {"axis": -1}))
for _t in COMPARE:
    CASES[_t] = Case({"X": [v("x", [-1, 3])], "Y": [v("y", [-1, 3])]}, {"Out": [v("o", [-1, 3], B)]},
                     bad=Bad("X dtype float32 differs from Y dtype int64", (v("y", [-1, 3], I64),)))
for _t in REDUCE:
    CASES[_t] = Case({"X": [v("x", [-1, 3, 4])]}, {"Out": [v("o", [-1, 4])]}, {"dim": [-2]},
                     Bad("dim=3 is out of range for rank 3", attrs={"dim": [3]}))

MATH_OPS = ("mul", "matmul", *ELEMENTWISE, "scale", "sum", "mean", *REDUCE, *UNARY, "softmax", "cast",
            "fill_constant", "fill_constant_batch_size_like", "fill_zeros_like", *RANDOM, "assign", "increment",
            *COMPARE, "logical_and", "logical_or", "logical_not", "where")
NN_OPS = ("cross_entropy", "softmax_with_cross_entropy", "sigmoid_cross_entropy_with_logits", "log_loss", "cos_sim",
          "lookup_table", "sequence_pool", "concat", "split", "reshape", "transpose", "conv2d", "pool2d",
          "batch_norm", "layer_norm", "dropout", "top_k", "accuracy", "auc")
NO_GRAD_OPS = {"floor", "fill_constant", "fill_constant_batch_size_like", "fill_zeros_like", *RANDOM, "increment",
               *COMPARE, "logical_and", "logical_or", "logical_not", "top_k", "accuracy", "auc"}
ALL_OPS = MATH_OPS + NN_OPS


def build(op_type: str, case: Case, bad: Bad | None = None) -> tuple[Block, Operator]:
    """A program with the case's input variables (corrupted by ``bad``) and one op of ``op_type``."""
    block = Program().global_block()
    replaced = {spec[0]: spec for spec in (bad.vars if bad else ())}
    for specs in case.inputs.values():
        for name, shape, dtype, type in (replaced.get(s[0], s) for s in specs):
            block.create_var(name, shape, dtype, type)
    for specs in case.outputs.values():
        for spec in specs:
            block.create_var(spec[0])
    attrs = {**case.attrs, **(bad.attrs if bad else {})}
    op = block.append_op(op_type, {k: [s[0] for s in ss] for k, ss in case.inputs.items()},
                         {k: [s[0] for s in ss] for k, ss in case.outputs.items()}, attrs)
    return block, op


def test_every_op_has_a_case() -> None:
    assert sorted(CASES) == sorted(ALL_OPS)
    missing = [t for t in ALL_OPS if not has_op(t)]
    assert missing == []


@pytest.mark.parametrize("op_type", ALL_OPS)
def test_inferred_outputs(op_type: str) -> None:
    case = CASES[op_type]
    block, _ = build(op_type, case)
    got = {s[0]: block.var(s[0]) for specs in case.outputs.values() for s in specs}
    assert {n: (var.shape, var.dtype, var.type) for n, var in got.items()} == \
        {s[0]: s[1:] for specs in case.outputs.values() for s in specs}


@pytest.mark.parametrize("op_type", [t for t in ALL_OPS if CASES[t].bad is not None])
def test_bad_input_is_named(op_type: str) -> None:
    case = CASES[op_type]
    assert case.bad is not None
    with pytest.raises(IRError, match=case.bad.match) as info:
        build(op_type, case, case.bad)
    assert op_type in str(info.value)


@pytest.mark.parametrize("op_type", ALL_OPS)
def test_gradient_declaration(op_type: str) -> None:
    op_def = get_op_def(op_type)
    assert op_def.has_grad == (op_type not in NO_GRAD_OPS)
    if op_type in NO_GRAD_OPS:
        assert not has_op(op_type + "_grad")


@pytest.mark.parametrize("op_type", [t for t in ALL_OPS if t not in NO_GRAD_OPS])
def test_grad_op_specs_match_schema_and_infer(op_type: str) -> None:
    block, op = build(op_type, CASES[op_type])
    specs = get_op_def(op_type).make_grad(op)
    assert specs
    for spec in specs:
        grad_def = get_op_def(spec.type)
        assert grad_def.forward_type == op_type
        assert all(grad_def.input_slot(s) is not None for s in spec.inputs), (spec.inputs, grad_def.inputs)
        assert all(grad_def.output_slot(s) is not None for s in spec.outputs), (spec.outputs, grad_def.outputs)
        # Create the gradient variables: X@GRAD mirrors forward input X, Out@GRAD forward output Out.
        for slot, names in spec.inputs.items():
            if slot.endswith(GRAD_SUFFIX):
                for name, fwd in zip(names, op.output(slot[: -len(GRAD_SUFFIX)])):
                    var = block.var(fwd)
                    block.create_var(name, var.shape, var.dtype, var.type)
        for names in spec.outputs.values():
            for name in names:
                block.create_var(name)
        block.append_op(spec.type, spec.inputs, spec.outputs, spec.attrs)
        for slot, names in spec.outputs.items():
            fwd_names = op.input(slot[: -len(GRAD_SUFFIX)])
            assert len(names) == len(fwd_names)
            for name, fwd in zip(names, fwd_names):
                got, want = block.var(name), block.var(fwd)
                want_type = "selected_rows" if op_type == "lookup_table" else want.type
                assert (got.shape, got.dtype, got.type) == (want.shape, want.dtype, want_type)


@pytest.mark.parametrize(
    ("op_type", "reads", "writes"),
    [
        ("lookup_table", {"W", "Ids", "Out@GRAD"}, {"W@GRAD"}),
        ("cross_entropy", {"X", "Label", "Y@GRAD"}, {"X@GRAD"}),
        ("softmax_with_cross_entropy", {"Logits", "Label", "Loss@GRAD"}, {"Logits@GRAD"}),
        ("batch_norm", {"X", "Scale", "Bias", "Mean", "Variance", "Y@GRAD"}, {"X@GRAD", "Scale@GRAD", "Bias@GRAD"}),
        ("dropout", {"Mask", "Out@GRAD"}, {"X@GRAD"}),
        ("layer_norm", {"X", "Scale", "Bias", "Y@GRAD"}, {"X@GRAD", "Scale@GRAD", "Bias@GRAD"}),
        ("where", {"Condition", "X", "Y", "Out@GRAD"}, {"X@GRAD", "Y@GRAD"}),
        ("cos_sim", {"X", "Y", "Out@GRAD"}, {"X@GRAD", "Y@GRAD"}),
        ("sequence_pool", {"X", "Ids", "Out@GRAD"}, {"X@GRAD"}),
        ("mul", {"X", "Y", "Out@GRAD"}, {"X@GRAD", "Y@GRAD"}),
    ],
)
def test_grad_reads_and_writes(op_type: str, reads: set[str], writes: set[str]) -> None:
    _, op = build(op_type, CASES[op_type])
    (spec,) = get_op_def(op_type).make_grad(op)
    assert (set(spec.inputs), set(spec.outputs)) == (reads, writes)


def test_dense_lookup_table_grad_is_dense() -> None:
    case = CASES["lookup_table"]
    block, op = build("lookup_table", Case(case.inputs, case.outputs, {"is_sparse": False}))
    (spec,) = get_op_def("lookup_table").make_grad(op)
    block.create_var("o@GRAD", (-1, 16))
    block.create_var("w@GRAD")
    block.append_op(spec.type, spec.inputs, spec.outputs, spec.attrs)
    assert (block.var("w@GRAD").shape, block.var("w@GRAD").type) == ((100, 16), "lod_tensor")


def test_every_grad_op_has_its_forward() -> None:
    grads = [d for d in all_op_defs() if d.type.endswith("_grad")]
    assert len(grads) >= len(ALL_OPS) - len(NO_GRAD_OPS)
    orphans = [d.type for d in grads if not has_op(d.forward_type or d.type[: -len("_grad")])]
    assert orphans == []


@pytest.mark.parametrize("op_type", RANDOM + ("dropout",))
def test_random_ops_take_a_seed(op_type: str) -> None:
    op_def = get_op_def(op_type)
    seed = op_def.attr_def("seed")
    assert op_def.has_trait("random") and seed is not None
    assert (seed.kind.value, seed.default) == ("int", 0)


def infer(op_type: str, inputs: dict[str, list[VarSpec]], outputs: dict[str, int], **attrs: Any) -> dict[str, list[tuple]]:
    """Shapes and dtypes of the outputs of one op (``outputs``: slot → how many variables)."""
    out_specs = {slot: [v(f"{slot}_{i}", []) for i in range(n)] for slot, n in outputs.items()}
    block, op = build(op_type, Case(inputs, out_specs, attrs))
    return {slot: [(block.var(n).shape, block.var(n).dtype) for n in op.output(slot)] for slot in outputs}


@pytest.mark.parametrize(
    ("x", "y", "attrs", "out"),
    [
        ([4], [4], {}, (1,)),
        ([3, 4], [4], {}, (3,)),
        ([4], [4, 5], {}, (5,)),
        ([2, 3, 4], [2, 4, 5], {}, (2, 3, 5)),
        ([4, 3], [5, 4], {"transpose_X": True, "transpose_Y": True}, (3, 5)),
        ([-1, 3, 4], [-1, 4, 5], {}, (-1, 3, 5)),
    ],
)
def test_matmul_shapes(x: list[int], y: list[int], attrs: dict[str, Any], out: tuple[int, ...]) -> None:
    got = infer("matmul", {"X": [v("x", x)], "Y": [v("y", y)]}, {"Out": 1}, **attrs)
    assert got == {"Out": [(out, F)]}


def test_matmul_batch_mismatch_fails() -> None:
    with pytest.raises(IRError, match="batch dims of X"):
        infer("matmul", {"X": [v("x", [2, 3, 4])], "Y": [v("y", [3, 4, 5])]}, {"Out": 1})


@pytest.mark.parametrize(
    ("attrs", "out"),
    [
        ({"dim": [0, 2]}, (3,)),
        ({"dim": [1], "keep_dim": True}, (-1, 1, 4)),
        ({"reduce_all": True}, (1,)),
        ({"reduce_all": True, "keep_dim": True}, (1, 1, 1)),
        ({"dim": [0, 1, 2]}, (1,)),
    ],
)
def test_reduce_shapes(attrs: dict[str, Any], out: tuple[int, ...]) -> None:
    assert infer("reduce_sum", {"X": [v("x", [-1, 3, 4])]}, {"Out": 1}, **attrs) == {"Out": [(out, F)]}


@pytest.mark.parametrize(
    ("ids", "out"),
    [([-1, 1], (-1, 16)), ([-1], (-1, 16)), ([-1, 5, 1], (-1, 5, 16)), ([-1, 5], (-1, 5, 16))],
)
def test_lookup_table_id_shapes(ids: list[int], out: tuple[int, ...]) -> None:
    got = infer("lookup_table", {"W": [v("w", [100, 16])], "Ids": [v("ids", ids, I64)]}, {"Out": 1})
    assert got == {"Out": [(out, F)]}


def test_sum_of_selected_rows_is_selected_rows() -> None:
    case = Case({"X": [v("a", [10, 4], type="selected_rows"), v("b", [10, 4])]},
                {"Out": [v("o", [10, 4], type="selected_rows")]})
    block, _ = build("sum", case)
    assert block.var("o").type == "selected_rows"


@pytest.mark.parametrize(
    ("x", "shape", "out"),
    [([-1, 4, 6], [-1, 6], (-1, 6)), ([2, 3, 4], [-1], (24,)), ([2, 3, 4], [0, 12], (2, 12)),
     ([-1, 12], [0, 3, 4], (-1, 3, 4)), ([-1, 12], [-1, 3, 4], (-1, 3, 4))],
)
def test_reshape_shapes(x: list[int], shape: list[int], out: tuple[int, ...]) -> None:
    assert infer("reshape", {"X": [v("x", x)]}, {"Out": 1}, shape=shape) == {"Out": [(out, F)]}


@pytest.mark.parametrize(
    ("shape", "match"),
    [([5, 5], "6 elements against 25"), ([4, -1], "do not divide by 4"), ([0, 0, 0], "copies dim 2")],
)
def test_reshape_rejects(shape: list[int], match: str) -> None:
    with pytest.raises(IRError, match=match):
        infer("reshape", {"X": [v("x", [2, 3])]}, {"Out": 1}, shape=shape)


def test_split_by_sections() -> None:
    got = infer("split", {"X": [v("x", [10, -1])]}, {"Out": 3}, sections=[2, -1, 3])
    assert got == {"Out": [((2, -1), F), ((5, -1), F), ((3, -1), F)]}
    with pytest.raises(IRError, match="sum to 6, not"):
        infer("split", {"X": [v("x", [10, 4])]}, {"Out": 2}, sections=[2, 4])
    with pytest.raises(IRError, match="slot Out has 3 variables"):
        infer("split", {"X": [v("x", [10, 4])]}, {"Out": 3}, num=2)


@pytest.mark.parametrize(
    ("attrs", "out"),
    [
        ({"ksize": [2, 2], "strides": [2, 2]}, (-1, 4, 3, 3)),
        ({"ksize": [2, 2], "strides": [2, 2], "ceil_mode": True}, (-1, 4, 4, 4)),
        ({"ksize": [3, 3], "paddings": [1, 1]}, (-1, 4, 7, 7)),
        ({"ksize": [2, 2], "global_pooling": True}, (-1, 4, 1, 1)),
        ({"ksize": [2, 5], "adaptive": True}, (-1, 4, 2, 5)),
    ],
)
def test_pool2d_shapes(attrs: dict[str, Any], out: tuple[int, ...]) -> None:
    assert infer("pool2d", {"X": [v("x", [-1, 4, 7, 7])]}, {"Out": 1}, **attrs) == {"Out": [(out, F)]}


def test_conv2d_groups_dilation_and_nhwc() -> None:
    got = infer("conv2d", {"Input": [v("x", [-1, 4, 9, 9])], "Filter": [v("f", [6, 2, 3, 3])]}, {"Output": 1},
                groups=2, dilations=[2, 2])
    assert got == {"Output": [((-1, 6, 5, 5), F)]}
    got = infer("conv2d", {"Input": [v("x", [-1, 9, 9, 3])], "Filter": [v("f", [8, 3, 3, 3])]}, {"Output": 1},
                data_format="NHWC", paddings=[1, 1])
    assert got == {"Output": [((-1, 9, 9, 8), F)]}
    with pytest.raises(IRError, match="too small for Filter"):
        infer("conv2d", {"Input": [v("x", [1, 3, 2, 2])], "Filter": [v("f", [8, 3, 3, 3])]}, {"Output": 1})


def test_cross_entropy_soft_label() -> None:
    got = infer("cross_entropy", {"X": [v("x", [-1, 10])], "Label": [v("l", [-1, 10])]}, {"Y": 1}, soft_label=True)
    assert got == {"Y": [((-1, 1), F)]}


def test_softmax_with_cross_entropy_axis() -> None:
    got = infer("softmax_with_cross_entropy", {"Logits": [v("x", [-1, 5, 7])], "Label": [v("l", [-1, 1, 7], I64)]},
                {"Softmax": 1, "Loss": 1}, axis=1)
    assert got == {"Softmax": [((-1, 5, 7), F)], "Loss": [((-1, 1, 7), F)]}


def test_sequence_pool_without_ids_and_with_bad_ids() -> None:
    got = infer("sequence_pool", {"X": [v("x", [-1, 7, 16])]}, {"Out": 1}, pooltype="SQRT")
    assert got == {"Out": [((-1, 16), F)]}
    with pytest.raises(IRError, match="must be \\[N, T\\] or \\[N, T, 1\\]"):
        infer("sequence_pool", {"X": [v("x", [-1, 7, 16])], "Ids": [v("ids", [-1, 6], I64)]}, {"Out": 1})


def test_increment_and_compare_have_fluid_defaults() -> None:
    assert get_op_def("increment").attr_def("step").default == 1.0
    assert get_op_def("less_than").attr_def("axis").default == -1
    assert get_op_def("auc").attr_def("num_thresholds").default == 4095
    assert get_op_def("softmax_with_cross_entropy").attr_def("ignore_index").default == -100
    assert get_op_def("lookup_table").attr_def("padding_idx").default == -1
    assert get_op_def("sequence_pool").attr_def("pooltype").default == "AVERAGE"


@pytest.mark.parametrize(
    ("x", "attrs", "mean"),
    [
        ([-1, 4, 6], {}, (-1,)),
        ([2, 4, 6], {"begin_norm_axis": 2}, (8,)),
        ([3, 5], {"begin_norm_axis": 1}, (3,)),
    ],
)
def test_layer_norm_row_statistics_shapes(x: list[int], attrs: dict[str, Any], mean: tuple[int, ...]) -> None:
    got = infer("layer_norm", {"X": [v("x", x)]}, {"Y": 1, "Mean": 1, "Variance": 1}, **attrs)
    assert got == {"Y": [(tuple(x), F)], "Mean": [(mean, F)], "Variance": [(mean, F)]}


@pytest.mark.parametrize(
    ("x", "attrs", "match"),
    [
        ([-1, 6], {"begin_norm_axis": 2}, "begin_norm_axis=2 must be in \\[1, 2\\)"),
        ([-1, 6], {"begin_norm_axis": 0}, "begin_norm_axis=0 must be in"),
        ([6], {}, "must have rank >= 2"),
    ],
)
def test_layer_norm_rejects(x: list[int], attrs: dict[str, Any], match: str) -> None:
    with pytest.raises(IRError, match=match):
        infer("layer_norm", {"X": [v("x", x)]}, {"Y": 1}, **attrs)


def test_layer_norm_without_scale_and_bias_writes_only_y() -> None:
    got = infer("layer_norm", {"X": [v("x", [-1, 3, 4])]}, {"Y": 1}, begin_norm_axis=1)
    assert got == {"Y": [((-1, 3, 4), F)]}
