"""DistributeTranspiler in nccl2 / collective mode: Paddle 1.5's nccl2 case, goldens, purity, validation."""
from __future__ import annotations

from typing import Any

import pytest

from flotilla.fluid import clip, layers, optimizer, regularizer
from ir.core import Program, program_guard
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr
from ir.roles import OpRole
from tests.transpiler.test_distribute_transpiler import build_fc, op_types
from tests.transpiler.test_transpiler_inputs import expect_error
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

TRAINERS = "127.0.0.1:6170,127.0.0.1:6171"


def build_mlp(opt: str = "momentum", depth: int = 2, clip_norm: bool = False, sparse: bool = False) -> tuple[Program, Program]:
    """x[16] → depth × fc(8, relu) → fc(1) → mean square error (optionally a sparse embedding input)."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data(name="x", shape=[16], dtype="float32")
        h = x
        if sparse:
            ids = layers.data(name="ids", shape=[1], dtype="int64")
            emb = layers.embedding(ids, size=[100, 4], is_sparse=True, param_attr=ParamAttr(name="emb"))
            h = layers.concat([h, emb], axis=1)
        for i in range(depth):
            h = layers.fc(input=h, size=8, act="relu", param_attr=ParamAttr(name=f"w{i}"),
                          bias_attr=ParamAttr(name=f"b{i}"))
        pred = layers.fc(input=h, size=1, param_attr=ParamAttr(name="w_out"), bias_attr=ParamAttr(name="b_out"))
        y = layers.data(name="y", shape=[1], dtype="float32")
        loss = layers.mean(layers.square_error_cost(input=pred, label=y))
        if clip_norm:
            clip.set_gradient_clip(clip.GradientClipByGlobalNorm(1.0), program=main)
        {"sgd": lambda: optimizer.SGD(0.1), "momentum": lambda: optimizer.Momentum(0.1, 0.9),
         "adam": lambda: optimizer.Adam(0.01),
         "dgc": lambda: optimizer.DGCMomentumOptimizer(0.1, 0.9, rampup_begin_step=2, rampup_step=4,
                                                       sparsity=[0.75, 0.9375], local_grad_clip_norm=1.0,
                                                       min_compress_numel=1),
         }[opt]().minimize(loss)
    return main, startup


def collective(main: Program, startup: Program, trainer_id: int = 0, trainers: Any = TRAINERS, **cfg: Any) -> DistributeTranspiler:
    config = DistributeTranspilerConfig(mode=cfg.pop("mode", "nccl2"), **cfg)
    t = DistributeTranspiler(config)
    t.transpile(trainer_id, program=main, startup_program=startup, trainers=trainers)
    return t


def test_paddle_nccl2_case_gen_nccl_id_in_startup() -> None:
    # Paddle 1.5 test_dist_transpiler TestNCCL2Transpile: gen_nccl_id with its NCCLID variable.
    startup = collective(*build_fc()).get_trainer_startup_program()
    block = startup.global_block()
    assert block.has_var("NCCLID") and block.var("NCCLID").type == "raw"
    gen = [op for op in block.ops if op.type == "gen_nccl_id"]
    assert len(gen) == 1 and block.ops[0] is gen[0]
    assert gen[0].attr("endpoint") == "127.0.0.1:6170"
    assert gen[0].attr("other_endpoints") == ["127.0.0.1:6171"]
    assert gen[0].attr("trainer_id") == 0


@pytest.mark.parametrize("case,cfg", [("mlp_nccl2_unfused", {"fuse_grad_size_in_MB": 0}),
                                      ("mlp_nccl2_fused", {}),
                                      ("mlp_local_sgd_k4", {"mode": "collective", "collective_mode": "local_sgd",
                                                            "local_sgd_steps": 4})])
def test_golden(case: str, cfg: dict[str, Any], golden: Any) -> None:
    t = collective(*build_mlp(), trainer_id=1, **dict(cfg))
    golden.check(f"{case}.txt", t.program_set.to_string())


def _allreduced_before_update(main: Program) -> None:
    """Every trained gradient is allreduced once, after its last backward writer and before any
    optimize-role reader."""
    ops = main.global_block().ops
    reduced: dict[str, int] = {}
    for i, op in enumerate(ops):
        if op.type == "c_allreduce_sum":
            for g in op.input("X"):
                assert g not in reduced, f"{g} reduced twice"
                reduced[g] = i
    optimize = [(i, op) for i, op in enumerate(ops) if op.role & OpRole.OPTIMIZE]
    first: dict[str, str] = {}  # a parameter's gradient is the one its first optimize-role op names
    for _, op in optimize:
        for k in range(0, len(op.role_var), 2):
            first.setdefault(op.role_var[k], op.role_var[k + 1])
    grads = set(first.values())
    assert grads and grads <= set(reduced), grads - set(reduced)
    for g, at in reduced.items():
        assert all(at < i for i, op in optimize if g in op.input_arg_names), g
        assert all(g not in op.output_arg_names for op in ops[at + 1:] if not op.role & OpRole.OPTIMIZE
                   and op.type != "scale"), f"{g} written after its allreduce"


@pytest.mark.parametrize("fuse", [0, 0.0001, 32])
@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
def test_every_gradient_reduced_before_its_update(fuse: float, opt: str) -> None:
    main = collective(*build_mlp(opt=opt, depth=4), fuse_grad_size_in_MB=fuse).get_trainer_program()
    _allreduced_before_update(main)
    n_buckets = op_types(main).count("c_allreduce_sum")
    if fuse == 0:
        assert n_buckets == 10  # one a gradient
    elif fuse == 32:
        assert n_buckets == 1  # the whole model fits one bucket
    else:
        assert 1 < n_buckets < 10  # 104-byte buckets: the small biases share, the weights do not


def test_global_norm_clip_sees_the_reduced_gradient() -> None:
    main = collective(*build_mlp(clip_norm=True)).get_trainer_program()
    _allreduced_before_update(main)
    types = op_types(main)
    assert types.index("c_allreduce_sum") < min(i for i, op in enumerate(main.global_block().ops)
                                                if op.role & OpRole.OPTIMIZE)


def test_sparse_gradient_gets_its_own_collective() -> None:
    main = collective(*build_mlp(sparse=True)).get_trainer_program()
    ars = [op for op in main.global_block().ops if op.type == "c_allreduce_sum"]
    sparse = [op for op in ars if op.input("X") == ["emb@GRAD"]]
    assert len(sparse) == 1 and len(ars) == 2
    _allreduced_before_update(main)


def test_scale_is_one_over_nranks() -> None:
    eps = ",".join(f"127.0.0.1:{6170 + i}" for i in range(4))
    main = collective(*build_mlp(), trainers=eps, trainer_id=3).get_trainer_program()
    scales = [op.attr("scale") for op in main.global_block().ops if op.type == "scale" and op.role == OpRole.BACKWARD]
    assert scales and all(s == 0.25 for s in scales)


def test_inputs_untouched_and_output_deterministic() -> None:
    main, startup = build_mlp()
    before = (main.to_string(), startup.to_string())
    a = collective(main, startup).program_set.to_string()
    b = collective(main, startup).program_set.to_string()
    assert a == b
    assert (main.to_string(), startup.to_string()) == before


def test_startup_broadcasts_every_parameter_from_rank0() -> None:
    startup = collective(*build_mlp()).get_trainer_startup_program()
    bcast = [op.input("X")[0] for op in startup.global_block().ops if op.type == "c_broadcast"]
    assert bcast == ["w0", "b0", "w1", "b1", "w_out", "b_out"] or sorted(bcast) == sorted(
        ["w0", "b0", "w1", "b1", "w_out", "b_out"])
    assert all(op.attr("root") == 0 for op in startup.global_block().ops if op.type == "c_broadcast")


def test_errors() -> None:
    main, startup = build_mlp()
    expect_error(lambda: collective(main, startup, trainers=2), "E702", "needs every trainer's endpoint")
    expect_error(lambda: collective(main, startup, trainer_id=2), "E703", "out of range")
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2"))
    expect_error(lambda: t.transpile(0, program=main, startup_program=startup, trainers=TRAINERS,
                                     current_endpoint="127.0.0.1:6171"), "E703", "is not entry 0")
    expect_error(lambda: collective(main, startup, trainers="127.0.0.1:6170,127.0.0.1:6170"), "E701", "more than once")
    expect_error(lambda: DistributeTranspiler(DistributeTranspilerConfig(mode="ring")), "E711", "not a transpiler mode")
    expect_error(lambda: DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2", collective_mode="boxps")),
                 "E711", "collective_mode")
    expect_error(lambda: DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2", fuse_grad_size_in_MB=-1)),
                 "E711", "fuse_grad_size_in_MB")
    expect_error(lambda: DistributeTranspiler(DistributeTranspilerConfig(collective_mode="local_sgd")),
                 "E711", "needs mode 'nccl2' or 'collective'")
    t = collective(main, startup)
    expect_error(lambda: t.get_pserver_program("127.0.0.1:6170"), "E714", "no parameter servers")
    empty_main, empty_startup = Program(), Program()
    with program_guard(empty_main, empty_startup):
        layers.data(name="x", shape=[1], dtype="float32")
    expect_error(lambda: collective(empty_main, empty_startup, mode="collective", collective_mode="local_sgd"),
                 "E622", "optimizer ops")


def test_dgc_golden_grads_exchanged_by_dgc_ops_only(golden: Any) -> None:
    # DGC gradients get no c_allreduce_sum/scale: one dgc_allreduce exchanges them all; the dgc pass
    # records the group's size on it and on every dgc op.
    t = collective(*build_mlp(opt="dgc"), trainer_id=1)
    golden.check("mlp_nccl2_dgc.txt", t.program_set.to_string())
    main = t.get_trainer_program()
    types = op_types(main)
    assert "c_allreduce_sum" not in types
    assert types.count("dgc") == types.count("dgc_momentum") == 6 and types.count("dgc_allreduce") == 1
    assert all(op.attr("nranks") == 2 for op in main.global_block().ops if op.type in ("dgc", "dgc_allreduce"))


def test_dgc_leaves_small_parameters_to_dense_allreduce() -> None:
    # Fluid's rule: parameters under 16384 elements are not compressed (momentum + c_allreduce_sum).
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data(name="x", shape=[256], dtype="float32")
        h = layers.fc(input=x, size=64, param_attr=ParamAttr(name="big"), bias_attr=ParamAttr(name="small"))
        loss = layers.mean(h)
        optimizer.DGCMomentumOptimizer(0.1, 0.9, rampup_begin_step=0).minimize(loss)
    trainer = collective(main, startup).get_trainer_program()
    by_type = {t: [op for op in trainer.global_block().ops if op.type == t]
               for t in ("dgc", "momentum", "c_allreduce_sum")}
    assert [op.input("Grad") for op in by_type["dgc"]] == [["big@GRAD"]]
    assert [op.input("Param") for op in by_type["momentum"]] == [["small"]]
    assert [op.input("X") for op in by_type["c_allreduce_sum"]] == [["small@GRAD"]]


def test_dgc_refused_with_local_sgd() -> None:
    expect_error(lambda: collective(*build_mlp(opt="dgc"), mode="collective", collective_mode="local_sgd"),
                 "E774", "DGCMomentumOptimizer needs collective_mode 'grad_allreduce'")


def test_dgc_pass_refuses_broken_wiring() -> None:
    main, startup = build_mlp(opt="dgc")
    block = main.global_block()
    block.remove_op(next(i for i, op in enumerate(block.ops) if op.type == "dgc_allreduce"))
    expect_error(lambda: collective(main, startup), "E773", "is encoded by dgc (op")


@pytest.mark.parametrize("extra", ["clip", "regularization"])
def test_dgc_refuses_a_gradient_changed_after_the_backward_pass(extra: str) -> None:
    # A clipped or regularized gradient in front of dgc would leave the raw one to the dense allreduce.
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data(name="x", shape=[256], dtype="float32")
        loss = layers.mean(layers.fc(input=x, size=64, param_attr=ParamAttr(name="big")))
        if extra == "clip":
            clip.set_gradient_clip(clip.GradientClipByGlobalNorm(1.0))
        optimizer.DGCMomentumOptimizer(0.1, 0.9, rampup_begin_step=0,
                                       regularization=regularizer.L2Decay(0.01) if extra == "regularization"
                                       else None).minimize(loss)
    expect_error(lambda: collective(main, startup), "E776", "dgc (op")


def test_dgc_refused_in_pserver_mode() -> None:
    main, startup = build_mlp(opt="dgc")
    t = DistributeTranspiler(DistributeTranspilerConfig())
    expect_error(lambda: t.transpile(0, program=main, startup_program=startup, pservers="127.0.0.1:6174",
                                     trainers=2), "E772", "only supported in collective training")


@pytest.mark.parametrize("kw,code,fragment", [
    ({"sparsity": [0.9, 1.0]}, "E770", "sparsity must be a non-empty list of numbers inside (0, 1)"),
    ({"sparsity": [0.0]}, "E770", "inside (0, 1)"),
    ({"sparsity": []}, "E770", "non-empty"),
    ({"local_grad_clip_norm": -1.0}, "E770", "local_grad_clip_norm must be > 0 or None"),
    ({"rampup_begin_step": -1}, "E771", "rampup_begin_step must be an int >= 0"),
    ({"rampup_step": 0}, "E771", "rampup_step must be an int >= 1"),
    ({"num_trainers": 0}, "E771", "num_trainers must be an int >= 1 or None"),
    ({"min_compress_numel": 0}, "E771", "min_compress_numel must be an int >= 1 or None"),
])
def test_dgc_arguments_are_checked(kw: dict[str, Any], code: str, fragment: str) -> None:
    args = {"learning_rate": 0.1, "momentum": 0.9, "rampup_begin_step": 0, **kw}
    expect_error(lambda: optimizer.DGCMomentumOptimizer(**args), code, fragment)


def test_dgc_refused_over_devices_of_one_process() -> None:
    from transpiler.compiled_program import data_parallel_program

    main, _ = build_mlp(opt="dgc")
    expect_error(lambda: data_parallel_program(main, 2), "E775", "cannot run data parallel over 2 devices")
    assert data_parallel_program(main, 1).to_string() != ""  # a group of one is DGC as it is
