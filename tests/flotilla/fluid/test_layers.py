"""Layers, LayerHelper, ParamAttr and initializers: Fluid 1.5's op decomposition, names and shapes."""
from __future__ import annotations

import math
from typing import Iterator

import pytest

import ir
from flotilla.fluid import initializer, layers
from flotilla.fluid.layer_helper import param_gradient_clip, param_regularizer
from flotilla.fluid.param_attr import ParamAttr
from ir.core import Parameter, Program
from ir.errors import IRError
from ir.verify import verify


@pytest.fixture
def progs() -> Iterator[tuple[Program, Program]]:
    main, startup = Program(), Program()
    with ir.program_guard(main, startup), ir.unique_name.guard():
        yield main, startup


def _ops(program: Program) -> list[ir.Operator]:
    return list(program.global_block().ops)


def _types(program: Program) -> list[str]:
    return [op.type for op in _ops(program)]


def test_data_prepends_batch_dimension(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", shape=[1000])
    assert (x.shape, x.dtype, x.is_data, x.stop_gradient) == ((-1, 1000), "float32", True, True)
    assert layers.data("img", [3, 8, 8], append_batch_size=False).shape == (3, 8, 8)
    assert layers.data("seq", [-1, 5], dtype="int64").shape == (-1, 5)
    assert layers.data("n", [None, 2]).shape == (-1, 2)
    assert main.global_block().var("x") == x


def test_fc_decomposition_names_and_shapes(progs: tuple[Program, Program]) -> None:
    main, startup = progs
    x = layers.data("x", [1000])
    out = layers.fc(x, size=10, act="relu")
    assert _types(main) == ["mul", "elementwise_add", "relu"]
    mul, add, relu = _ops(main)
    assert (mul.input("X"), mul.input("Y"), mul.output("Out")) == (["x"], ["fc_0.w_0"], ["fc_0.tmp_0"])
    assert (mul.attr("x_num_col_dims"), mul.attr("y_num_col_dims")) == (1, 1)
    assert (add.input("Y"), add.attr("axis"), add.output("Out")) == (["fc_0.b_0"], 1, ["fc_0.tmp_1"])
    assert relu.output("Out") == ["fc_0.tmp_2"] == [out.name]
    assert out.shape == (-1, 10)
    block = main.global_block()
    w, b = block.var("fc_0.w_0"), block.var("fc_0.b_0")
    assert isinstance(w, Parameter) and w.shape == (1000, 10) and w.persistable and w.trainable
    assert isinstance(b, Parameter) and b.shape == (10,)
    # startup: init ops prepended (reverse creation order), Xavier-uniform weight, zero bias
    assert _types(startup) == ["fill_constant", "uniform_random"]
    fill, uni = _ops(startup)
    assert fill.output("Out") == ["fc_0.b_0"] and fill.attr("value") == 0.0 and fill.attr("shape") == [10]
    limit = math.sqrt(6.0 / (1000 + 10))
    assert uni.output("Out") == ["fc_0.w_0"] and uni.attr("shape") == [1000, 10]
    assert uni.attr("min") == pytest.approx(-limit) and uni.attr("max") == pytest.approx(limit)
    assert isinstance(startup.global_block().var("fc_0.w_0"), Parameter)
    verify(main)
    verify(startup)


def test_fc_multiple_inputs_flatten_and_no_bias(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    a = layers.data("a", [3, 4])
    b = layers.data("b", [3, 6])
    out = layers.fc([a, b], size=5, num_flatten_dims=2, bias_attr=False)
    assert _types(main) == ["mul", "mul", "sum"]
    assert out.shape == (-1, 3, 5)
    assert main.global_block().var("fc_0.w_0").shape == (4, 5)
    assert main.global_block().var("fc_0.w_1").shape == (6, 5)
    assert _ops(main)[2].input("X") == ["fc_0.tmp_0", "fc_0.tmp_1"]


def test_unique_names_count_per_layer(progs: tuple[Program, Program]) -> None:
    x = layers.data("x", [4])
    h1 = layers.fc(x, 4)
    h2 = layers.fc(h1, 4, name="head")
    assert h1.name == "fc_0.tmp_1" and h2.name == "head.tmp_1"
    assert layers.mean(h2).name == "mean_0.tmp_0"


def test_param_attr_fields_recorded_on_parameter(progs: tuple[Program, Program]) -> None:
    from flotilla.fluid.clip import GradientClipByValue
    from flotilla.fluid.regularizer import L2Decay

    main, startup = progs
    x = layers.data("x", [4])
    reg, clip = L2Decay(0.001), GradientClipByValue(1.0, -1.0)
    layers.fc(x, 2, param_attr=ParamAttr(name="w", learning_rate=0.5, regularizer=reg, gradient_clip=clip,
                                         initializer=initializer.Constant(0.25)),
              bias_attr=ParamAttr(name="b", trainable=False))
    w, b = main.global_block().var("w"), main.global_block().var("b")
    assert (w.learning_rate, w.regularizer, w.gradient_clip) == (0.5, reg.spec, clip.spec)
    assert param_regularizer(main, "w") is reg and param_gradient_clip(main, "w") is clip
    assert param_regularizer(main, "b") is None
    assert (b.trainable, b.stop_gradient) == (False, True)
    assert [(op.type, op.attr("value")) for op in _ops(startup)] == [("fill_constant", 0.0), ("fill_constant", 0.25)]


def test_parameter_shared_by_name(progs: tuple[Program, Program]) -> None:
    main, startup = progs
    a, b = layers.data("a", [5]), layers.data("b", [5])
    layers.fc(a, 2, param_attr="shared", bias_attr=False)
    layers.fc(b, 2, param_attr="shared", bias_attr=False)
    assert [op.input("Y") for op in _ops(main)] == [["shared"], ["shared"]]
    assert _types(startup) == ["uniform_random"]
    with pytest.raises(IRError, match="'shared' already exists"):
        layers.fc(b, 3, param_attr="shared")


def test_initializers_emit_fluid_ops() -> None:
    main, startup = Program(), Program()
    startup.random_seed = 7
    with ir.program_guard(main, startup):
        block = startup.global_block()
        cases = [
            (initializer.Constant(2.0), [4, 3], ("fill_constant", {"value": 2.0})),
            (initializer.Uniform(-0.5, 0.5, seed=3), [4, 3], ("uniform_random", {"min": -0.5, "max": 0.5, "seed": 3})),
            (initializer.Normal(1.0, 0.1), [4, 3], ("gaussian_random", {"mean": 1.0, "std": 0.1, "seed": 7})),
            (initializer.TruncatedNormal(0.0, 0.2, seed=5), [4, 3],
             ("truncated_gaussian_random", {"mean": 0.0, "std": 0.2, "seed": 5})),
            (initializer.Xavier(uniform=False), [4, 3], ("gaussian_random", {"std": math.sqrt(2.0 / 7)})),
            (initializer.Xavier(), [8, 2, 3, 3], ("uniform_random", {"max": math.sqrt(6.0 / (18 + 72))})),
            (initializer.MSRA(), [8, 2, 3, 3], ("uniform_random", {"max": math.sqrt(6.0 / 18)})),
            (initializer.MSRA(uniform=False, fan_in=50), [4, 3], ("gaussian_random", {"std": math.sqrt(2.0 / 50)})),
        ]
        for i, (init, shape, (op_type, attrs)) in enumerate(cases):
            var = block.create_var(name=f"v{i}", shape=shape, persistable=True)
            op = init(var, block)
            assert block.ops[0] is op and op.type == op_type and op.output("Out") == [f"v{i}"]
            assert op.attr("shape") == shape and op.attr("dtype") == "float32"
            for key, value in attrs.items():
                assert op.attr(key) == pytest.approx(value), (op_type, key)
    assert initializer.compute_fans((5,)) == (5, 5) and initializer.compute_fans(()) == (1, 1)
    with pytest.raises(IRError, match="low"):
        initializer.Uniform(1.0, 0.0)
    with pytest.raises(IRError, match="seed"):
        initializer.Normal(seed=-1)


def test_embedding(progs: tuple[Program, Program]) -> None:
    main, startup = progs
    ids = layers.data("ids", [1], dtype="int64")
    emb = layers.embedding(ids, size=[100, 16], is_sparse=True, padding_idx=-1)
    op = _ops(main)[0]
    assert op.type == "lookup_table" and op.input("Ids") == ["ids"] and op.input("W") == ["embedding_0.w_0"]
    assert (op.attr("is_sparse"), op.attr("is_distributed"), op.attr("remote_prefetch"), op.attr("padding_idx")) == \
        (True, False, True, 99)
    assert emb.shape == (-1, 16)
    dist = layers.embedding(ids, size=[10, 4], is_distributed=True, is_sparse=True, param_attr="table")
    assert main.global_block().var("table").is_distributed and dist.shape == (-1, 4)
    assert _types(startup) == ["uniform_random", "uniform_random"]


def test_square_error_cost_and_mean(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x, y = layers.data("x", [3]), layers.data("y", [3])
    cost = layers.square_error_cost(x, y)
    avg = layers.mean(cost)
    assert _types(main) == ["elementwise_sub", "square", "mean"]
    assert cost.shape == (-1, 3) and avg.shape == (1,)


def test_conv_pool_batch_norm(progs: tuple[Program, Program]) -> None:
    main, startup = progs
    img = layers.data("img", [3, 8, 8])
    conv = layers.conv2d(img, num_filters=4, filter_size=3, padding=1, act="relu")
    pool = layers.pool2d(conv, pool_size=2, pool_stride=2)
    bn = layers.batch_norm(pool)
    assert _types(main) == ["conv2d", "elementwise_add", "relu", "pool2d", "batch_norm"]
    assert conv.shape == (-1, 4, 8, 8) and pool.shape == (-1, 4, 4, 4) and bn.shape == (-1, 4, 4, 4)
    block = main.global_block()
    assert block.var("conv2d_0.w_0").shape == (4, 3, 3, 3)
    conv_init = [op for op in _ops(startup) if op.output("Out") == ["conv2d_0.w_0"]][0]
    assert conv_init.type == "gaussian_random" and conv_init.attr("std") == pytest.approx(math.sqrt(2.0 / 27))
    bn_op = _ops(main)[-1]
    mean, var = bn_op.input("Mean")[0], bn_op.input("Variance")[0]
    assert bn_op.output("MeanOut") == [mean] and bn_op.output("VarianceOut") == [var]
    for name in (mean, var):
        p = block.var(name)
        assert p.persistable and not p.trainable and p.stop_gradient
    inits = {op.output("Out")[0]: op.attr("value") for op in _ops(startup) if op.type == "fill_constant"}
    assert inits[mean] == 0.0 and inits[var] == 1.0 and inits[bn_op.input("Scale")[0]] == 1.0
    verify(main)
    verify(startup)


def test_classification_layers(progs: tuple[Program, Program]) -> None:
    main, startup = progs
    x = layers.data("x", [8])
    label = layers.data("label", [1], dtype="int64")
    logits = layers.fc(x, 2)
    prob = layers.softmax(logits)
    ce = layers.cross_entropy(prob, label)
    acc = layers.accuracy(prob, label, k=2)
    loss, sm = layers.softmax_with_cross_entropy(logits, label, return_softmax=True)
    auc_out, batch_auc, stats = layers.auc(prob, label)
    assert ce.shape == (-1, 1) and loss.shape == (-1, 1) and sm.shape == (-1, 2)
    assert acc.shape == (1,) and acc.dtype == "float32"
    types = _types(main)
    assert types[types.index("top_k"):types.index("top_k") + 2] == ["top_k", "accuracy"]
    assert [op.attr("k") for op in _ops(main) if op.type == "top_k"] == [2]
    aucs = [op for op in _ops(main) if op.type == "auc"]
    assert [op.attr("slide_steps") for op in aucs] == [1, 0]
    assert aucs[1].output("AUC") == [auc_out.name] and aucs[0].output("AUC") == [batch_auc.name]
    assert all(v.persistable and v.dtype == "int64" and v.shape == (1, 4096) for v in stats)
    zero_init = {op.output("Out")[0] for op in _ops(startup) if op.type == "fill_constant" and op.attr("value") == 0.0}
    assert {v.name for v in stats} <= zero_init
    verify(main)


def test_tensor_and_math_layers(progs: tuple[Program, Program]) -> None:
    main, _ = progs
    x = layers.data("x", [4, 6])
    y = layers.data("y", [6])
    assert layers.reshape(x, [-1, 24]).shape == (-1, 24)
    assert layers.transpose(x, [0, 2, 1]).shape == (-1, 6, 4)
    assert layers.concat([x, x], axis=1).shape == (-1, 8, 6)
    assert layers.matmul(x, x, transpose_y=True).shape == (-1, 4, 4)
    assert layers.elementwise_add(x, y).shape == (-1, 4, 6)
    assert layers.scale(x, scale=2.0, bias=1.0).shape == (-1, 4, 6)
    assert layers.sums([x, x]).shape == (-1, 4, 6)
    assert layers.reduce_sum(x, dim=1).shape == (-1, 6)
    assert layers.reduce_mean(x, dim=[1, 2], keep_dim=True).shape == (-1, 1, 1)
    rmax = layers.reduce_max(x)
    assert _ops(main)[-1].attr("reduce_all") is True and rmax.shape in ((1,), ())
    for fn in (layers.relu, layers.sigmoid, layers.tanh, layers.softsign, layers.sqrt, layers.exp, layers.log,
               layers.abs, layers.square):
        out = fn(x)
        assert _ops(main)[-1].type == fn.__name__ and out.shape == (-1, 4, 6)
    c = layers.cast(x, "float64")
    assert c.dtype == "float64" and _ops(main)[-1].attr("out_dtype") == "float64"
    d = layers.dropout(x, 0.3)
    assert d.shape == (-1, 4, 6) and _ops(main)[-1].attr("fix_seed") is False
    assert layers.cos_sim(layers.reshape(x, [-1, 24]), layers.reshape(x, [-1, 24])).shape == (-1, 1)
    emb = layers.data("e", [5, 3])
    ids = layers.data("ids", [5, 1], dtype="int64")
    pooled = layers.sequence_pool(emb, "average", ids=ids, padding_idx=0)
    assert pooled.shape == (-1, 3) and _ops(main)[-1].attr("pooltype") == "AVERAGE"
    verify(main)


def test_constants_counters_and_logic(progs: tuple[Program, Program]) -> None:
    main, startup = progs
    one = layers.fill_constant([1], "int64", 1)
    assert one.stop_gradient and one.dtype == "int64" and one.shape == (1,)
    counter = layers.create_global_var([1], 0.0, "int64", persistable=True, name="step")
    assert counter.persistable and [op.type for op in _ops(startup)] == ["fill_constant"]
    layers.increment(counter, 1.0)
    assert _ops(main)[-1].output("Out") == ["step"]
    cond = layers.less_than(counter, one)
    assert cond.dtype == "bool" and cond.stop_gradient
    for fn in (layers.less_equal, layers.greater_than, layers.equal, layers.not_equal):
        assert fn(counter, one).dtype == "bool"
    assert layers.logical_not(layers.logical_or(cond, layers.logical_and(cond, cond))).dtype == "bool"
    x = layers.data("x", [3])
    like = layers.fill_constant_batch_size_like(x, [-1, 2], "float32", 0.5)
    assert like.shape == (-1, 2)
    p = layers.create_parameter([3, 2], "float32", name="my_p")
    assert isinstance(p, Parameter) and startup.global_block().has_var("my_p")
    verify(main)
    verify(startup)


@pytest.mark.parametrize("call, match", [
    (lambda x: layers.fc("x", 3), "fc: input must be a Variable"),
    (lambda x: layers.fc(x, 0), "fc: size must be >= 1"),
    (lambda x: layers.fc(x, 2, param_attr=3), "param_attr must be a ParamAttr"),
    (lambda x: layers.fc(x, 2, act="nope"), "act 'nope' is not an activation"),
    (lambda x: layers.embedding(x, [10]), "embedding: size must be"),
    (lambda x: layers.embedding(x, [10, 2], padding_idx=10), "padding_idx 10 is out of range"),
    (lambda x: layers.data("", [1]), "data: name"),
    (lambda x: layers.data("d", [0]), "data: shape"),
    (lambda x: layers.cast(x, "float13"), "cast: dtype must be one of"),
    (lambda x: layers.concat([x, 1]), r"concat: input\[1\] must be a Variable"),
    (lambda x: layers.transpose(x, [0, 0]), "transpose: perm"),
    (lambda x: layers.dropout(x, 1.5), "dropout_prob"),
    (lambda x: layers.pool2d(x, pool_type="median"), "pool_type"),
    (lambda x: layers.sequence_pool(x, "median"), "pool_type"),
    (lambda x: layers.mean(None), "mean: x must be a Variable"),
])
def test_bad_arguments_name_the_argument(progs: tuple[Program, Program], call: object, match: str) -> None:
    x = layers.data("x", [4])
    with pytest.raises(IRError, match=match):
        call(x)  # type: ignore[operator]
