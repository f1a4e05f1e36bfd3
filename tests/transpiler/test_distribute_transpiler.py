"""DistributeTranspiler in pserver mode: TestBasicModel acceptance, purity, determinism, validation."""
from __future__ import annotations

from typing import Any

import pytest

from flotilla.fluid import layers, learning_rate, optimizer, regularizer, clip
from ir.core import Program, program_guard
from ir.errors import FlotillaError
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

EPS2 = "127.0.0.1:6174,127.0.0.1:6175"


def build_fc(opt: str = "sgd", lr: str = "const", l2_clip: bool = False, sparse_emb: bool = False,
             distributed: bool = False) -> tuple[Program, Program]:
    """TestBasicModel (x[1000] → fc 1000 → square_error_cost → mean) and variants."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data(name="x", shape=[1000], dtype="float32")
        if sparse_emb:
            ids = layers.data(name="ids", shape=[1], dtype="int64")
            emb = layers.embedding(ids, size=[1000, 64], is_sparse=True, is_distributed=distributed,
                                   param_attr=ParamAttr(name="emb"))
            x = layers.concat([x, emb], axis=1)
        wattr = ParamAttr(name="fc_w", regularizer=regularizer.L2Decay(1e-4),
                          gradient_clip=clip.GradientClipByValue(1.0)) if l2_clip else ParamAttr(name="fc_w")
        y_predict = layers.fc(input=x, size=1000, act=None, param_attr=wattr, bias_attr=ParamAttr(name="fc_b"))
        y = layers.data(name="y", shape=[1], dtype="float32")
        avg_cost = layers.mean(layers.square_error_cost(input=y_predict, label=y))
        rate: Any = 0.1
        if lr == "exp":
            rate = learning_rate.exponential_decay(0.1, 100, 0.9, staircase=True)
        elif lr == "piecewise":
            rate = learning_rate.piecewise_decay([10, 20], [1.0, 0.5, 0.1])
        {"sgd": lambda: optimizer.SGD(learning_rate=rate),
         "momentum": lambda: optimizer.Momentum(learning_rate=rate, momentum=0.9),
         "adam": lambda: optimizer.Adam(learning_rate=rate),
         "rmsprop": lambda: optimizer.RMSProp(learning_rate=rate),
         "ftrl": lambda: optimizer.Ftrl(learning_rate=rate)}[opt]().minimize(avg_cost)
    return main, startup


def transpile(main: Program, startup: Program, pservers: str = EPS2, trainers: int = 2, trainer_id: int = 0,
              sync_mode: bool = True, config: DistributeTranspilerConfig | None = None) -> DistributeTranspiler:
    t = DistributeTranspiler(config)
    t.transpile(trainer_id, program=main, pservers=pservers, trainers=trainers, sync_mode=sync_mode,
                startup_program=startup)
    return t


def op_types(program: Program, block: int = 0) -> list[str]:
    return [op.type for op in program.block(block).ops]


def test_basic_model_trainer_program() -> None:
    t = transpile(*build_fc())
    assert op_types(t.get_trainer_program(wait_port=False)) == [
        "mul", "elementwise_add", "elementwise_sub", "square", "mean", "fill_constant", "mean_grad", "square_grad",
        "elementwise_sub_grad", "elementwise_add_grad", "mul_grad", "split_byref", "send", "send", "send_barrier",
        "recv", "recv", "fetch_barrier", "concat"]
    assert op_types(t.get_trainer_startup_program())[-4:] == ["recv", "recv", "fetch_barrier", "concat"]


def test_basic_model_pservers() -> None:
    t = transpile(*build_fc())
    ps0, st0 = t.get_pserver_programs("127.0.0.1:6174")
    assert [op_types(ps0, i) for i in range(ps0.num_blocks)] == [
        ["listen_and_serv"], ["sum", "scale", "sgd"], ["sum", "scale", "sgd"]]
    assert ps0.block(1).ops[2].input("Param") == ["fc_b"]
    assert ps0.block(2).ops[2].input("Param") == ["fc_w.block1"]
    assert ps0.block(1).ops[1].attr("scale") == 0.5
    outs = [(op.type, op.output("Out")[0]) for op in st0.global_block().ops]
    assert outs == [("fill_constant", "learning_rate_0"), ("fill_constant", "fc_b"), ("uniform_random", "fc_w.block1")]
    assert st0.global_block().ops[2].attr("shape") == [500, 1000]
    ps1 = t.get_pserver_program("127.0.0.1:6175")
    assert ps1.block(1).ops[2].input("Param") == ["fc_w.block0"]
    assert ps1.global_block().var("fc_w.block0").shape == (500, 1000)


def test_async_has_no_barriers_or_copies() -> None:
    t = transpile(*build_fc(), sync_mode=False)
    types = op_types(t.get_trainer_program(wait_port=False))
    assert "send_barrier" not in types and "fetch_barrier" not in types
    ps0 = t.get_pserver_program("127.0.0.1:6174")
    assert op_types(ps0, 1) == ["sgd"]
    assert not any(".trainer_" in n for n in ps0.global_block().vars)


def test_inputs_not_mutated_and_repeatable() -> None:
    main, startup = build_fc()
    before = (main.to_string(), startup.to_string())
    t = transpile(main, startup)
    assert (main.to_string(), startup.to_string()) == before
    first = t.program_set.to_string()
    _ = t.get_pserver_program("127.0.0.1:6175"), t.get_trainer_program(wait_port=False)
    assert t.program_set.to_string() == first
    assert transpile(*build_fc()).program_set.to_string() == first


def test_accumulators_sliced_with_param() -> None:
    t = transpile(*build_fc("adam"))
    ps0 = t.get_pserver_program("127.0.0.1:6174")
    g = ps0.global_block()
    assert g.var("fc_w_moment1_0.block1").shape == (500, 1000)
    assert g.var("fc_w_beta1_pow_acc_0.block1").shape == (1,)
    assert g.var("fc_b_moment1_0").shape == (1000,)


def test_empty_pserver_warns() -> None:
    with pytest.warns(UserWarning, match="holds no parameter block"):
        t = transpile(*build_fc(), pservers="127.0.0.1:6174,127.0.0.1:6175,127.0.0.1:6176",
                      config=DistributeTranspilerConfig(slice_var_up=False))
    ps = t.get_pserver_program("127.0.0.1:6176")
    assert ps.num_blocks == 2 and op_types(ps, 1) == []


@pytest.mark.parametrize("kwargs,code", [
    ({"pservers": ""}, "E701"),
    ({"pservers": "127.0.0.1:6174,127.0.0.1:6174"}, "E701"),
    ({"pservers": "host"}, "E701"),
    ({"pservers": "host:0"}, "E701"),
    ({"pservers": "host:70000"}, "E701"),
    ({"pservers": ":1"}, "E701"),
    ({"trainers": 0}, "E702"),
    ({"trainers": "2"}, "E702"),
    ({"trainer_id": 2}, "E703"),
])
def test_invalid_inputs(kwargs: dict[str, Any], code: str) -> None:
    args = {"pservers": EPS2, "trainers": 2, "trainer_id": 0, **kwargs}
    main, startup = build_fc()
    with pytest.raises(FlotillaError) as err:
        transpile(main, startup, **args)
    assert err.value.code == code and err.value.hint


def test_other_invalid_inputs() -> None:
    with pytest.raises(FlotillaError) as err:
        DistributeTranspiler(DistributeTranspilerConfig(min_block_size=0))
    assert err.value.code == "E705"
    with pytest.raises(FlotillaError) as err:
        transpile(*build_fc(), config=DistributeTranspilerConfig(enable_dc_asgd=True))
    assert err.value.code == "E709"
    t = transpile(*build_fc())
    with pytest.raises(FlotillaError) as err:
        t.get_pserver_program("127.0.0.1:9999")
    assert err.value.code == "E706"
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        layers.mean(layers.data(name="x", shape=[4], dtype="float32"))
    with pytest.raises(FlotillaError) as err:
        transpile(main, startup)
    assert "E601" in str(err.value)
    # A distributed table under SGD is supported (the table tests cover the rewrite itself).
    assert transpile(*build_fc(sparse_emb=True, distributed=True)) is not None
