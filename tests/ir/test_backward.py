"""append_backward: Fluid's grad-op order, roles, op_role_var, accumulation, pruning, sparse grads."""
from __future__ import annotations

from typing import Iterator

import pytest

import ir
from flotilla.fluid import layers
from ir.backward import append_backward
from ir.core import Program, Variable
from ir.errors import IRError
from ir.names import EMPTY_VAR_NAME
from flotilla.fluid.param_attr import ParamAttr
from ir.verify import verify


@pytest.fixture
def progs() -> Iterator[tuple[Program, Program]]:
    main, startup = Program(), Program()
    with ir.program_guard(main, startup), ir.unique_name.guard():
        yield main, startup


def _basic_model() -> Variable:
    x = layers.data(name="x", shape=[1000], dtype="float32")
    y = layers.data(name="y", shape=[1], dtype="float32")
    y_predict = layers.fc(input=x, size=1000, act=None, param_attr=ParamAttr(name="fc_w"),
                          bias_attr=ParamAttr(name="fc_b"))
    cost = layers.square_error_cost(input=y_predict, label=y)
    return layers.mean(cost)


def _types(program: Program) -> list[str]:
    return [op.type for op in program.global_block().ops]


def _op(program: Program, op_type: str, nth: int = 0) -> ir.Operator:
    return [op for op in program.global_block().ops if op.type == op_type][nth]


def test_basic_model_backward_ops(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    avg_cost = _basic_model()
    params_grads = append_backward(avg_cost)
    assert _types(main) == ["mul", "elementwise_add", "elementwise_sub", "square", "mean", "fill_constant",
                            "mean_grad", "square_grad", "elementwise_sub_grad", "elementwise_add_grad", "mul_grad"]
    roles = [op.role for op in main.global_block().ops]
    assert roles == [0, 0, 0, 0, 256, 257, 1, 1, 1, 1, 1]
    fill = _op(main, "fill_constant")
    assert fill.output("Out") == ["mean_0.tmp_0@GRAD"]
    assert (fill.attr("shape"), fill.attr("value"), fill.attr("dtype")) == ([1], 1.0, "float32")
    # program order of parameters (fc_w created first), as Fluid's all_parameters()
    assert [(p.name, g.name) for p, g in params_grads] == [("fc_w", "fc_w@GRAD"), ("fc_b", "fc_b@GRAD")]
    assert params_grads[0][1].shape == (1000, 1000) and params_grads[1][1].shape == (1000,)
    assert _op(main, "mul_grad").role_var == ["fc_w", "fc_w@GRAD"]
    assert _op(main, "elementwise_add_grad").role_var == ["fc_b", "fc_b@GRAD"]
    # data layers are stop_gradient: no x@GRAD, no y@GRAD
    assert _op(main, "mul_grad").outputs == {"Y@GRAD": ["fc_w@GRAD"]}
    assert _op(main, "elementwise_sub_grad").outputs == {"X@GRAD": ["fc_0.tmp_1@GRAD"]}
    assert not main.global_block().has_var("x@GRAD") and not main.global_block().has_var("y@GRAD")
    assert main.global_block().var("fc_0.tmp_0@GRAD").shape == (-1, 1000)
    verify(main)


def test_basic_model_with_sgd_gives_fluid_op_list(progs: tuple[Program, Program]) -> None:
    from flotilla.fluid import optimizer

    main, startup = progs
    avg_cost = _basic_model()
    optimizer.SGD(learning_rate=0.1).minimize(avg_cost)
    assert _types(main) == ["mul", "elementwise_add", "elementwise_sub", "square", "mean", "fill_constant",
                            "mean_grad", "square_grad", "elementwise_sub_grad", "elementwise_add_grad", "mul_grad",
                            "sgd", "sgd"]
    assert _types(startup) == ["fill_constant", "fill_constant", "uniform_random"]
    verify(main)
    verify(startup)


def test_variable_used_twice_is_accumulated_with_sum(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [4])
    h = layers.fc(x, 4)
    s = layers.elementwise_add(layers.relu(h), layers.sigmoid(h))
    append_backward(layers.mean(s))
    types = _types(main)
    i = types.index("fill_constant")
    assert types[i:] == ["fill_constant", "mean_grad", "elementwise_add_grad", "sigmoid_grad", "relu_grad", "sum",
                         "elementwise_add_grad", "mul_grad"]
    h_grad = h.name + "@GRAD"
    assert _op(main, "sigmoid_grad").output("X@GRAD") == [h_grad + "@RENAME@0"]
    assert _op(main, "relu_grad").output("X@GRAD") == [h_grad + "@RENAME@1"]
    total = _op(main, "sum")
    assert total.input("X") == [h_grad + "@RENAME@0", h_grad + "@RENAME@1"] and total.output("Out") == [h_grad]
    assert total.role == 1
    assert _op(main, "elementwise_add_grad", 1).input("Out@GRAD") == [h_grad]
    block = main.global_block()
    assert block.var(h_grad + "@RENAME@0").shape == h.shape == block.var(h_grad).shape
    verify(main)


def test_same_variable_twice_in_one_op(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [3])
    h = layers.fc(x, 3)
    append_backward(layers.mean(layers.elementwise_mul(h, h)))
    g = _op(main, "elementwise_mul_grad")
    hg = h.name + "@GRAD"
    assert g.output("X@GRAD") == [hg + "@RENAME@0"] and g.output("Y@GRAD") == [hg + "@RENAME@1"]
    assert _op(main, "sum").input("X") == [hg + "@RENAME@0", hg + "@RENAME@1"]
    verify(main)


def test_shared_parameter_gradient_is_summed_and_tagged(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    a, b = layers.data("a", [5]), layers.data("b", [5])
    fa = layers.fc(a, 2, param_attr=ParamAttr(name="shared_w"), bias_attr=False)
    fb = layers.fc(b, 2, param_attr=ParamAttr(name="shared_w"), bias_attr=False)
    params_grads = append_backward(layers.mean(layers.elementwise_add(fa, fb)))
    assert [(p.name, g.name) for p, g in params_grads] == [("shared_w", "shared_w@GRAD")]
    muls = [op for op in main.global_block().ops if op.type == "mul_grad"]
    assert [m.output("Y@GRAD") for m in muls] == [["shared_w@GRAD@RENAME@0"], ["shared_w@GRAD@RENAME@1"]]
    assert all(m.role_var == [] for m in muls)
    last = main.global_block().ops[-1]
    assert last.type == "sum" and last.output("Out") == ["shared_w@GRAD"]
    assert last.role_var == ["shared_w", "shared_w@GRAD"]
    verify(main)


def test_no_grad_set_drops_gradients(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    avg_cost = _basic_model()
    params_grads = append_backward(avg_cost, no_grad_set={"fc_b"})
    assert [p.name for p, _ in params_grads] == ["fc_w"]
    assert _op(main, "elementwise_add_grad").outputs == {"X@GRAD": ["fc_0.tmp_0@GRAD"]}
    assert not main.global_block().has_var("fc_b@GRAD")


def test_no_grad_set_on_intermediate_cuts_the_path(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [4])
    h = layers.fc(x, 4, param_attr=ParamAttr(name="w1"), bias_attr=False)
    out = layers.fc(h, 1, param_attr=ParamAttr(name="w2"), bias_attr=False)
    params_grads = append_backward(layers.mean(out), no_grad_set=[h])
    assert [p.name for p, _ in params_grads] == ["w2"]
    assert _types(main)[-3:] == ["fill_constant", "mean_grad", "mul_grad"]
    assert _op(main, "mul_grad").outputs == {"Y@GRAD": ["w2@GRAD"]}


def test_stop_gradient_false_data_gets_a_gradient(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [4], stop_gradient=False)
    append_backward(layers.mean(layers.fc(x, 2)))
    assert _op(main, "mul_grad").output("X@GRAD") == ["x@GRAD"]
    assert main.global_block().var("x@GRAD").shape == (-1, 4)


def test_parameter_list_limits_gradients(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    avg_cost = _basic_model()
    params_grads = append_backward(avg_cost, parameter_list=["fc_b"])
    assert [p.name for p, _ in params_grads] == ["fc_b"]
    assert "mul_grad" not in _types(main)


def test_non_trainable_parameter_gets_no_gradient(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [4])
    out = layers.fc(x, 1, param_attr=ParamAttr(name="frozen", trainable=False), bias_attr=ParamAttr(name="b"))
    params_grads = append_backward(layers.mean(out))
    assert [p.name for p, _ in params_grads] == ["b"]
    assert "mul_grad" not in _types(main)


def test_sparse_embedding_gives_selected_rows_gradient(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    ids = layers.data("ids", [1], dtype="int64")
    sparse = layers.embedding(ids, size=[100, 8], is_sparse=True, param_attr="emb_sparse")
    dense = layers.embedding(ids, size=[50, 8], param_attr="emb_dense")
    loss = layers.mean(layers.fc(layers.elementwise_add(sparse, dense), 1))
    grads = dict((p.name, g) for p, g in append_backward(loss))
    assert grads["emb_sparse"].type == "selected_rows" and grads["emb_sparse"].shape == (100, 8)
    assert grads["emb_dense"].type == "lod_tensor" and grads["emb_dense"].shape == (50, 8)
    lookups = [op for op in main.global_block().ops if op.type == "lookup_table_grad"]
    assert [op.outputs for op in lookups] == [{"W@GRAD": ["emb_dense@GRAD"]}, {"W@GRAD": ["emb_sparse@GRAD"]}]
    assert not main.global_block().has_var("ids@GRAD")
    verify(main)


def test_unused_output_grads_are_left_out(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [4])
    lab = layers.data("lab", [1], dtype="int64")
    logits = layers.fc(x, 3)
    loss = layers.mean(layers.softmax_with_cross_entropy(logits, lab))
    append_backward(loss)
    g = _op(main, "softmax_with_cross_entropy_grad")
    assert list(g.inputs) == ["Logits", "Label", "Loss@GRAD"]
    assert g.outputs == {"Logits@GRAD": [logits.name + "@GRAD"]}
    verify(main)


def test_partially_used_duplicable_outputs_get_zero_grads(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [4])
    h = layers.fc(x, 4)
    block = main.global_block()
    parts = [block.create_var(name=f"part{i}") for i in range(2)]
    block.append_op("split", inputs={"X": [h]}, outputs={"Out": parts}, attrs={"num": 2, "axis": 1})
    append_backward(layers.mean(block.var("part0")))
    zeros = _op(main, "fill_zeros_like")
    assert zeros.input("X") == ["part1"] and zeros.output("Out") == ["part1@GRAD"]
    assert _op(main, "split_grad").input("Out@GRAD") == ["part0@GRAD", "part1@GRAD"]
    assert _types(main).index("fill_zeros_like") < _types(main).index("split_grad")


def test_partially_wanted_duplicable_grads_use_empty_name(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [4])
    h = layers.fc(x, 4)
    append_backward(layers.mean(layers.concat([x, h], axis=1)))
    assert _op(main, "concat_grad").output("X@GRAD") == [EMPTY_VAR_NAME, h.name + "@GRAD"]
    assert not main.global_block().has_var(EMPTY_VAR_NAME)


def test_no_grad_op_stops_the_flow(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [4])
    h = layers.fc(x, 4, bias_attr=False)
    zeros = layers.fill_constant_batch_size_like(h, [-1, 4], "float32", 0.0)
    params_grads = append_backward(layers.mean(layers.elementwise_add(zeros, x)))
    assert params_grads == []
    assert _types(main)[-1] == "fill_constant"


def test_grad_op_roles_and_callbacks(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    seen: list[str] = []

    def callback(block: ir.Block, context: dict[str, str]) -> None:
        seen.append(block.ops[-1].type)
        assert context["fc_w@GRAD"] == "fc_w"

    append_backward(_basic_model(), callbacks=[callback])
    assert seen == ["mean_grad", "square_grad", "elementwise_sub_grad", "elementwise_add_grad", "mul_grad"]


def test_errors(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [4])
    h = layers.fc(x, 1)
    with pytest.raises(IRError, match="unknown extent"):
        append_backward(h)
    with pytest.raises(IRError, match="loss must be a Variable"):
        append_backward("mean_0.tmp_0")  # type: ignore[arg-type]
    with pytest.raises(IRError, match="not a variable of the program"):
        append_backward(Variable("elsewhere", (1,)))
    loss = layers.mean(h)
    with pytest.raises(IRError, match="parameter_list"):
        append_backward(loss, parameter_list=["nope"])
    append_backward(loss)
    with pytest.raises(IRError, match="already"):
        append_backward(loss)
