"""``flotilla.fluid``: Fluid 1.5's names (the builder's own, the rest the same objects as the native ones), Paddle 1.5's
``test_dist_transpiler`` cases built through the namespace (learning-rate schedules from ``fluid.layers``,
``lod_level=1`` inputs with a distributed lookup table), ``scope_guard`` and the inference-model round
trip."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

import ir
import runtime
import transpiler
from flotilla import fluid
from flotilla.fluid import clip, initializer, layers, learning_rate, optimizer, param_attr, regularizer
from runtime import io as runtime_io
from runtime.scope import ExecutionError

EPS = "127.0.0.1:6174,127.0.0.1:6175"
EP1 = "127.0.0.1:6174"


def test_names_are_the_native_objects() -> None:
    assert fluid.Program is ir.Program and fluid.program_guard is ir.program_guard
    assert fluid.default_main_program is ir.default_main_program
    assert fluid.default_startup_program is ir.default_startup_program
    assert fluid.unique_name is ir.unique_name and fluid.ParamAttr is param_attr.ParamAttr
    assert fluid.Executor is runtime.Executor and fluid.CPUPlace is runtime.CPUPlace
    assert fluid.CUDAPlace is runtime.CUDAPlace and fluid.global_scope is runtime.global_scope
    assert fluid.DistributeTranspilerConfig is transpiler.DistributeTranspilerConfig
    assert issubclass(fluid.DistributeTranspiler, transpiler.DistributeTranspiler)
    assert fluid.DistributeTranspiler.in_place and not transpiler.DistributeTranspiler.in_place
    assert fluid.transpiler.RoundRobin is transpiler.RoundRobin and fluid.transpiler.HashName is transpiler.HashName
    assert fluid.memory_optimize is transpiler.memory_optimize and fluid.release_memory is transpiler.release_memory
    for name in ("CompiledProgram", "BuildStrategy", "ExecutionStrategy"):
        assert getattr(fluid, name) is getattr(transpiler, name)
    from flotilla import parallel_executor

    assert fluid.ParallelExecutor is parallel_executor.ParallelExecutor
    from runtime import lod

    assert fluid.LoDTensor is lod.LoDTensor and fluid.create_lod_tensor is lod.create_lod_tensor
    assert fluid.DataFeeder is lod.DataFeeder


def test_submodules_are_the_builder_and_export_everything() -> None:
    for module in (layers, optimizer, regularizer, clip, initializer):
        assert getattr(fluid, module.__name__.rsplit(".", 1)[1]) is module
        assert module.__all__ and all(hasattr(module, n) for n in module.__all__)
    for name in ("exponential_decay", "piecewise_decay", "natural_exp_decay", "inverse_time_decay",
                 "polynomial_decay", "noam_decay"):
        assert name in fluid.layers.__all__ and getattr(fluid.layers, name) is getattr(learning_rate, name)
    assert fluid.optimizer.SGDOptimizer is optimizer.SGD and fluid.optimizer.AdamOptimizer is optimizer.Adam
    assert fluid.optimizer.MomentumOptimizer is optimizer.Momentum
    for name in ("save_persistables", "load_persistables", "save_params", "load_params", "save_vars", "load_vars"):
        assert getattr(fluid.io, name) is getattr(runtime_io, name)
    from flotilla.fluid.layers import fc  # a real module: Fluid's "from paddle.fluid.layers import fc" works
    from flotilla.fluid.optimizer import SGD

    assert fc is layers.fc and SGD is optimizer.SGD
    assert set(fluid.__all__) <= set(dir(fluid))


def _fc_model(lr: object) -> None:
    x = fluid.layers.data(name="x", shape=[1000], dtype="float32")
    y_predict = fluid.layers.fc(input=x, size=1000, act=None, param_attr=fluid.ParamAttr(name="fc_w"),
                                bias_attr=fluid.ParamAttr(name="fc_b"))
    y = fluid.layers.data(name="y", shape=[1], dtype="float32")
    return fluid.layers.mean(fluid.layers.square_error_cost(input=y_predict, label=y))


def _transpile(trainer_id: int = 0) -> fluid.DistributeTranspiler:
    t = fluid.DistributeTranspiler()
    t.transpile(trainer_id, program=fluid.default_main_program(), pservers=EPS, trainers=2,
                startup_program=fluid.default_startup_program())
    return t


def op_types(program: ir.Program, block: int = 0) -> list[str]:
    return [op.type for op in program.block(block).ops]


def test_paddle_basic_model_with_lr_decay() -> None:
    """Paddle 1.5's TestBasicModelWithLRDecay: the decay runs once a step in its own pserver block."""
    with fluid.program_guard(fluid.Program(), fluid.Program()):
        avg_cost = _fc_model(None)
        lr = fluid.layers.exponential_decay(learning_rate=1.0, decay_steps=2100, decay_rate=0.1, staircase=True)
        fluid.optimizer.SGD(learning_rate=lr).minimize(avg_cost)
        t = _transpile(1)
        pserver = t.get_pserver_program(EP1)
        assert len(pserver.blocks) == 4
        assert op_types(pserver, 1)[:2] == ["increment", "cast"] and "elementwise_pow" in op_types(pserver, 1)
        assert op_types(pserver, 2)[-1] == op_types(pserver, 3)[-1] == "sgd"
        assert "sgd" not in op_types(t.get_trainer_program())


def test_paddle_l2_decay_with_piecewise() -> None:
    """Paddle 1.5's TestL2DecayWithPiecewise: piecewise_decay, Momentum and L2Decay through fluid. Flotilla's
    piecewise decay is branch-free (compare and select) instead of Fluid's conditional blocks."""
    with fluid.program_guard(fluid.Program(), fluid.Program()):
        avg_cost = _fc_model(None)
        bd = [1, 10, 20, 30]
        lr = [1.0 * (0.1 ** i) for i in range(len(bd) + 1)]
        fluid.optimizer.Momentum(learning_rate=fluid.layers.piecewise_decay(boundaries=bd, values=lr), momentum=0.9,
                                 regularization=fluid.regularizer.L2Decay(1e-4)).minimize(avg_cost)
        pserver = _transpile().get_pserver_program(EP1)
        assert len(pserver.blocks) == 4 and op_types(pserver, 1)[:2] == ["increment", "cast"]
        assert op_types(pserver, 2) == op_types(pserver, 3) == ["sum", "scale", "scale", "sum", "momentum"]


def test_paddle_dist_lookup_table_with_lod_inputs() -> None:
    """Paddle 1.5's TestDistLookupTable: lod_level=1 ids, a distributed table shared by two slots, Adam."""
    with fluid.program_guard(fluid.Program(), fluid.Program()):
        def emb_pool(ids: object, table_name: str, is_distributed: bool) -> object:
            emb = fluid.layers.embedding(input=ids, size=[1000, 64], dtype="float32", param_attr=table_name,
                                         is_sparse=True, is_distributed=is_distributed)
            return fluid.layers.sequence_pool(input=emb, pool_type="average")

        title_ids = fluid.layers.data(name="title_ids", shape=[1], dtype="int64", lod_level=1)
        brand_ids = fluid.layers.data(name="brand_ids", shape=[1], dtype="int64", lod_level=1)
        profile_ids = fluid.layers.data(name="brand_ids", shape=[1], dtype="int64", lod_level=1)
        fc0 = fluid.layers.concat(input=[emb_pool(title_ids, "shared_w", True), emb_pool(brand_ids, "shared_w", True),
                                         emb_pool(profile_ids, "profile_emb", False)], axis=1)
        predict = fluid.layers.fc(input=fc0, size=2, act=None, param_attr=fluid.ParamAttr(name="fc_w"),
                                  bias_attr=fluid.ParamAttr(name="fc_b"))
        label = fluid.layers.data(name="label", shape=[1], dtype="int64")
        avg_cost = fluid.layers.mean(fluid.layers.cross_entropy(input=predict, label=label))
        fluid.optimizer.Adam(learning_rate=0.003).minimize(avg_cost)
        t = _transpile()
        trainer_ops = op_types(t.get_trainer_program())
        assert trainer_ops[:32] == [
            "split_ids", "prefetch", "merge_ids", "sequence_pool", "sequence_pool", "lookup_table", "sequence_pool",
            "concat", "mul", "elementwise_add", "cross_entropy", "mean", "fill_constant", "mean_grad",
            "cross_entropy_grad", "elementwise_add_grad", "mul_grad", "concat_grad", "sequence_pool_grad",
            "lookup_table_grad", "sequence_pool_grad", "lookup_table_grad", "sequence_pool_grad",
            "lookup_table_grad", "sum", "split_ids", "send", "split_selected_rows", "send", "send", "send",
            "send_barrier"]
        pserver = t.get_pserver_program(EP1)
        assert len(pserver.blocks) == 6
        assert op_types(pserver, 1) == ["sum", "scale", "adam", "scale", "scale"]
        assert op_types(pserver, 4) == ["lookup_sparse_table"] and op_types(pserver, 5) == ["save"]


def _regression() -> tuple[object, object, object]:
    x = fluid.layers.data(name="x", shape=[3], dtype="float32")
    y = fluid.layers.data(name="y", shape=[1], dtype="float32")
    hidden = fluid.layers.dropout(fluid.layers.fc(input=x, size=4, act="relu"), dropout_prob=0.5)
    pred = fluid.layers.fc(input=hidden, size=1)
    loss = fluid.layers.mean(fluid.layers.square_error_cost(input=pred, label=y))
    fluid.optimizer.SGD(0.1).minimize(loss)
    return x, pred, loss


def test_scope_guard_swaps_the_global_scope() -> None:
    scope = fluid.Scope()
    before = fluid.global_scope()
    with fluid.program_guard(fluid.Program(), fluid.Program()), fluid.scope_guard(scope):
        assert fluid.global_scope() is scope
        _regression()
        fluid.Executor(fluid.CPUPlace()).run(fluid.default_startup_program())
        params = {p.name for p in fluid.default_main_program().all_parameters()}
    assert params and params <= set(scope.local_var_names())
    assert fluid.global_scope() is before and not params & set(before.local_var_names())
    with pytest.raises(ExecutionError, match="scope_guard needs a Scope"):
        with fluid.scope_guard("not a scope"):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize("params_filename", [None, "params"])
def test_inference_model_round_trip(tmp_path: pathlib.Path, params_filename: str | None) -> None:
    exe = fluid.Executor(fluid.CPUPlace())
    xs = np.random.RandomState(0).normal(size=(5, 3)).astype("float32")
    with fluid.program_guard(fluid.Program(), fluid.Program()), fluid.scope_guard(fluid.Scope()):
        x, pred, _ = _regression()
        exe.run(fluid.default_startup_program())
        test = fluid.default_main_program().clone(for_test=True)
        for op in test.global_block().ops:
            if op.has_attr("is_test"):
                op.set_attr("is_test", True)
        (expected,) = exe.run(test, feed={"x": xs, "y": xs[:, :1]}, fetch_list=[pred])
        names = fluid.io.save_inference_model(str(tmp_path), ["x"], [pred], exe, params_filename=params_filename)
        assert names == [pred.name]
    with fluid.scope_guard(fluid.Scope()):
        program, feeds, fetches = fluid.io.load_inference_model(str(tmp_path), exe, params_filename=params_filename)
        assert feeds == ["x"] and [v.name for v in fetches] == [pred.name]
        assert all(op.role == 0 for op in program.global_block().ops)  # forward only: no backward, no optimizer
        assert all(op.attr("is_test") for op in program.global_block().ops if op.type == "dropout")
        (got,) = exe.run(program, feed={"x": xs}, fetch_list=fetches)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_save_inference_model_names_a_missing_feed(tmp_path: pathlib.Path) -> None:
    with fluid.program_guard(fluid.Program(), fluid.Program()):
        _, pred, _ = _regression()
        with pytest.raises(ExecutionError, match=r"the targets need \['x'\].*\n  hint: add \['x'\] to feeded_var_names"):
            fluid.io.save_inference_model(str(tmp_path), [], [pred], None)
        with pytest.raises(ExecutionError, match="'nope' is not a variable of the program"):
            fluid.io.save_inference_model(str(tmp_path), ["nope"], [pred], None)
