"""Program-building tests of the optimizers, regularizers, gradient clips and learning-rate schedules.

No runtime is involved: the tests check the ops each piece appends (types, slots, attrs, roles,
``op_role_var``), the accumulators and their startup initialisation, and that the programs verify.
The learning-rate schedules are also evaluated step by step by a tiny numpy interpreter of the ops
they use, against Fluid's formulas.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
import pytest

from flotilla.fluid.clip import (
    GradientClipByGlobalNorm,
    GradientClipByNorm,
    GradientClipByValue,
    append_gradient_clip_ops,
    clip_from_spec,
    set_gradient_clip,
)
from flotilla.fluid import layers
from flotilla.fluid import learning_rate as lrs
from flotilla.fluid.optimizer import SGD, Adagrad, Adam, DecayedAdagrad, Ftrl, Momentum, RMSProp
from flotilla.fluid.param_attr import ParamAttr
from flotilla.fluid.regularizer import L1Decay, L2Decay, append_regularization_ops, regularizer_from_spec
from ir.core import Operator, Parameter, Program, Variable, program_guard
from ir.errors import IRError
from ir.names import LR_DECAY_COUNTER, grad_name, unique_name
from ir.roles import OpRole
from ir.verify import collect_problems

OPT = int(OpRole.OPTIMIZE)
LRSCHED = int(OpRole.LRSCHED)


class Net:
    """A main/startup pair with parameters whose gradients a backward-role op produces."""

    def __init__(self) -> None:
        self.main, self.startup = Program(), Program()
        self.block = self.main.global_block()

    def param(self, name: str, shape: tuple[int, ...], grad_type: str = "lod_tensor",
              **fields: Any) -> tuple[Parameter, Variable]:
        p = self.block.create_parameter(name, shape, **fields)
        self.startup.global_block().create_parameter(name, shape, **fields)
        g = self.block.create_var(grad_name(name), shape=shape, type=grad_type)
        if grad_type == "lod_tensor":
            self.block.append_op("fill_constant", None, {"Out": [g.name]},
                                 {"shape": list(shape), "value": 1.0, "op_role": int(OpRole.BACKWARD)})
        else:
            # A sparse gradient stands for what lookup_table_grad produces; only its type matters here.
            self.block.replace_var(g.name, is_data=True)
        return p, self.block.var(g.name)

    def guard(self) -> Any:
        return program_guard(self.main, self.startup)

    def types(self, start: int = 0) -> list[str]:
        return [op.type for op in self.block.ops[start:]]

    def startup_init(self, name: str) -> Operator:
        ops = [op for op in self.startup.global_block().ops if name in op.output_arg_names]
        assert len(ops) == 1, f"{name} is initialised by {len(ops)} startup ops"
        return ops[0]

    def problems(self) -> list[Any]:
        return collect_problems(self.main) + collect_problems(self.startup)


@pytest.fixture(autouse=True)
def fresh_names() -> Iterator[None]:
    with unique_name.guard():
        yield


def _two_params(net: Net, **fields: Any) -> list[tuple[Parameter, Variable]]:
    # Created w before b (as fc does) so that name-order processing is visible.
    return [net.param("fc_w", (4, 3), **fields), net.param("fc_b", (3,), **fields)]


# --- optimizers -----------------------------------------------------------------------------------

def test_sgd_ops_roles_and_learning_rate() -> None:
    net = Net()
    pg = _two_params(net)
    with net.guard():
        ops = SGD(0.1).apply_gradients(pg)
    assert [op.type for op in ops] == ["sgd", "sgd"]
    assert [op.input("Param") for op in ops] == [["fc_b"], ["fc_w"]]
    for op, p in zip(ops, ["fc_b", "fc_w"]):
        assert op.role == OPT
        assert op.role_var == [p, grad_name(p)]
        assert op.input("Grad") == [grad_name(p)]
        assert op.output("ParamOut") == [p]
        assert op.input("LearningRate") == ["learning_rate_0"]
    lr = net.block.var("learning_rate_0")
    assert (lr.shape, lr.dtype, lr.persistable) == ((1,), "float32", True)
    init = net.startup_init("learning_rate_0")
    assert init.type == "fill_constant" and init.attr("value") == pytest.approx(0.1) and init.attr("shape") == [1]
    assert net.problems() == []


OPTIMIZER_CASES = [
    # (optimizer, op type, {accumulator: (slot, out slot, shape-or-None for the param's, fill)}, attrs)
    (Momentum(0.1, momentum=0.9, use_nesterov=True), "momentum",
     {"velocity": ("Velocity", "VelocityOut", None, 0.0)}, {"mu": 0.9, "use_nesterov": True}),
    (Adagrad(0.1, epsilon=1e-5), "adagrad", {"moment": ("Moment", "MomentOut", None, 0.0)}, {"epsilon": 1e-5}),
    (Adam(0.01, beta1=0.8, beta2=0.99, epsilon=1e-7, lazy_mode=True), "adam",
     {"moment1": ("Moment1", "Moment1Out", None, 0.0), "moment2": ("Moment2", "Moment2Out", None, 0.0),
      "beta1_pow_acc": ("Beta1Pow", None, (1,), 0.8), "beta2_pow_acc": ("Beta2Pow", None, (1,), 0.99)},
     {"beta1": 0.8, "beta2": 0.99, "epsilon": 1e-7, "lazy_mode": True}),
    (RMSProp(0.1, rho=0.9, epsilon=1e-5, momentum=0.5, centered=True), "rmsprop",
     {"momentum": ("Moment", "MomentOut", None, 0.0), "mean_square": ("MeanSquare", "MeanSquareOut", None, 0.0),
      "mean_grad": ("MeanGrad", "MeanGradOut", None, 0.0)},
     {"decay": 0.9, "epsilon": 1e-5, "momentum": 0.5, "centered": True}),
    (DecayedAdagrad(0.1, decay=0.9, epsilon=1e-5), "decayed_adagrad",
     {"moment": ("Moment", "MomentOut", None, 0.0)}, {"decay": 0.9, "epsilon": 1e-5}),
    (Ftrl(0.1, l1=0.1, l2=0.2, lr_power=-0.6), "ftrl",
     {"squared": ("SquaredAccumulator", "SquaredAccumOut", None, 0.0),
      "linear": ("LinearAccumulator", "LinearAccumOut", None, 0.0)},
     {"l1": 0.1, "l2": 0.2, "lr_power": -0.6}),
]


@pytest.mark.parametrize("opt,op_type,accs,attrs", OPTIMIZER_CASES, ids=[c[1] for c in OPTIMIZER_CASES])
def test_optimizer_ops_and_accumulators(opt: Any, op_type: str, accs: dict[str, Any], attrs: dict[str, Any]) -> None:
    net = Net()
    pg = _two_params(net)
    with net.guard():
        ops = [op for op in opt.apply_gradients(pg) if op.type == op_type]
    assert [op.input("Param") for op in ops] == [["fc_b"], ["fc_w"]]
    for op, (param, shape) in zip(ops, [("fc_b", (3,)), ("fc_w", (4, 3))]):
        assert op.role == OPT and op.role_var == [param, grad_name(param)]
        for key, value in attrs.items():
            assert op.attr(key) == pytest.approx(value), key
        for acc, (slot, out_slot, acc_shape, fill) in accs.items():
            name = f"{param}_{acc}_0"
            assert op.input(slot) == [name]
            if out_slot is not None:
                assert op.output(out_slot) == [name]
            var = net.block.var(name)
            assert var.persistable and var.shape == (acc_shape or shape)
            init = net.startup_init(name)
            assert init.type == "fill_constant" and init.attr("value") == pytest.approx(fill)
            assert tuple(init.attr("shape")) == (acc_shape or shape)
    # Accumulators are created (and their init ops prepended) before the learning rate.
    assert net.startup.global_block().ops[0].output("Out") == ["learning_rate_0"]
    assert net.problems() == []


def test_adam_updates_beta_pows_after_all_adam_ops() -> None:
    net = Net()
    pg = _two_params(net)
    with net.guard():
        ops = Adam(0.01, beta1=0.8, beta2=0.7).apply_gradients(pg)
    assert [op.type for op in ops] == ["adam", "adam", "scale", "scale", "scale", "scale"]
    scales = ops[2:]
    assert [(op.input("X"), op.output("Out"), op.attr("scale")) for op in scales] == [
        (["fc_b_beta1_pow_acc_0"], ["fc_b_beta1_pow_acc_0"], pytest.approx(0.8)),
        (["fc_b_beta2_pow_acc_0"], ["fc_b_beta2_pow_acc_0"], pytest.approx(0.7)),
        (["fc_w_beta1_pow_acc_0"], ["fc_w_beta1_pow_acc_0"], pytest.approx(0.8)),
        (["fc_w_beta2_pow_acc_0"], ["fc_w_beta2_pow_acc_0"], pytest.approx(0.7)),
    ]
    assert [op.role for op in scales] == [OPT] * 4
    assert [op.role_var[0] for op in scales] == ["fc_b", "fc_b", "fc_w", "fc_w"]


def test_parameters_are_processed_in_name_order() -> None:
    net = Net()
    pg = [net.param(n, (2,)) for n in ("zeta", "alpha", "mid")]
    with net.guard():
        ops = Momentum(0.1, 0.9).apply_gradients(pg)
    assert [op.input("Param")[0] for op in ops] == ["alpha", "mid", "zeta"]
    assert [v for v in net.block.vars if v.endswith("_velocity_0")] == [
        "alpha_velocity_0", "mid_velocity_0", "zeta_velocity_0"]


def test_param_learning_rate_multiplier_scales_the_lr() -> None:
    net = Net()
    pg = [net.param("fc_w", (4, 3), learning_rate=0.5), net.param("fc_b", (3,))]
    with net.guard():
        ops = SGD(0.1).apply_gradients(pg)
    assert [op.type for op in ops] == ["sgd", "scale", "sgd"]
    scale = ops[1]
    assert scale.input("X") == ["learning_rate_0"] and scale.attr("scale") == 0.5
    assert scale.role == int(OpRole.LRSCHED | OpRole.OPTIMIZE) and scale.role_var == []
    assert ops[2].input("LearningRate") == scale.output("Out")
    assert ops[0].input("LearningRate") == ["learning_rate_0"]
    assert net.problems() == []


def test_untrainable_params_and_missing_grads_are_skipped() -> None:
    net = Net()
    frozen = net.param("frozen", (2,), trainable=False)
    live = net.param("live", (2,))
    nograd = (net.block.create_parameter("nograd", (2,)), None)
    with net.guard():
        ops = Momentum(0.1, 0.9).apply_gradients([frozen, live, nograd])
    assert [op.input("Param") for op in ops] == [["live"]]
    assert not net.block.has_var("frozen_velocity_0") and not net.block.has_var("nograd_velocity_0")


def test_sparse_gradient_goes_straight_to_the_op() -> None:
    net = Net()
    pg = [net.param("emb", (100, 8), grad_type="selected_rows")]
    with net.guard():
        ops = Adam(0.01, lazy_mode=True).apply_gradients(pg)
    assert ops[0].type == "adam" and ops[0].input("Grad") == ["emb@GRAD"]
    assert net.block.var("emb@GRAD").type == "selected_rows"


def test_schedule_variable_is_the_learning_rate() -> None:
    net = Net()
    pg = _two_params(net)
    with net.guard():
        lr = lrs.exponential_decay(0.1, decay_steps=10, decay_rate=0.5)
        ops = SGD(lr).apply_gradients(pg)
    assert [op.input("LearningRate") for op in ops] == [[lr.name], [lr.name]]
    assert not net.block.has_var("learning_rate_0")
    assert net.problems() == []


def test_bad_arguments_raise() -> None:
    with pytest.raises(IRError, match="learning_rate must be a number"):
        SGD("0.1")  # type: ignore[arg-type]
    net = Net()
    pg = _two_params(net)
    with net.guard(), pytest.raises(IRError, match="expected a Parameter"):
        SGD(0.1).apply_gradients([(pg[0][1], pg[0][1])])  # type: ignore[list-item]
    opt = Momentum(0.1, 0.9)
    with net.guard():
        opt.apply_gradients(pg)
        with pytest.raises(IRError, match="already exists"):
            opt.apply_gradients(pg)


# --- regularizers ---------------------------------------------------------------------------------

def test_l2_decay_appends_scale_and_in_place_sum() -> None:
    net = Net()
    pg = _two_params(net)
    start = len(net.block.ops)
    with net.guard():
        ops = SGD(0.1, regularization=L2Decay(0.01)).apply_gradients(pg)
    assert net.types(start) == ["scale", "sum", "scale", "sum", "sgd", "sgd"]
    reg = net.block.ops[start:start + 4]
    assert reg[0].input("X") == ["fc_b"] and reg[0].attr("scale") == pytest.approx(0.01)
    assert reg[1].input("X") == ["fc_b@GRAD", reg[0].output("Out")[0]] and reg[1].output("Out") == ["fc_b@GRAD"]
    assert [(op.role, op.role_var) for op in reg] == [(OPT, ["fc_b", "fc_b@GRAD"])] * 2 + [(OPT, ["fc_w", "fc_w@GRAD"])] * 2
    assert ops[0].input("Grad") == ["fc_b@GRAD"]
    assert net.problems() == []


def test_param_regularizer_wins_over_optimizer_regularization() -> None:
    net = Net()
    pg = [net.param("fc_w", (4, 3), regularizer="L1Decay(0.5)"), net.param("fc_b", (3,))]
    start = len(net.block.ops)
    with net.guard():
        append_regularization_ops(sorted(pg, key=lambda x: x[0].name), L2Decay(0.01))
    ops = net.block.ops[start:]
    b_ops = [op for op in ops if op.role_var[0] == "fc_b"]
    w_ops = [op for op in ops if op.role_var[0] == "fc_w"]
    assert [op.type for op in b_ops] == ["scale", "sum"] and b_ops[0].attr("scale") == pytest.approx(0.01)
    # L1: sign(param) (exactly, as cast(0 < p) - cast(p < 0) where no sign op is registered), then scale.
    assert w_ops[-2].type == "scale" and w_ops[-2].attr("scale") == 0.5 and w_ops[-1].type == "sum"
    assert w_ops[-1].output("Out") == ["fc_w@GRAD"]
    assert all(op.role == OPT for op in ops)
    assert net.problems() == []


def test_regularizer_spec_round_trip() -> None:
    for reg in (L2Decay(0.001), L1Decay(0.25)):
        assert regularizer_from_spec(reg.spec) == reg
    assert L2Decay(0.001).spec == "L2Decay(0.001)"
    assert regularizer_from_spec("L2DecayRegularizer(regularization_coeff=0.5)") == L2Decay(0.5)
    with pytest.raises(IRError, match="unknown regularizer"):
        regularizer_from_spec("L3Decay(0.1)")
    with pytest.raises(IRError, match="non-literal"):
        regularizer_from_spec("L2Decay(__import__('os'))")


def test_regularizing_a_sparse_gradient_raises() -> None:
    net = Net()
    pg = [net.param("emb", (100, 8), grad_type="selected_rows")]
    with net.guard(), pytest.raises(IRError, match="selected_rows"):
        SGD(0.1, regularization=L2Decay(0.01)).apply_gradients(pg)


# --- gradient clipping ----------------------------------------------------------------------------

def test_clip_by_value_and_by_norm() -> None:
    net = Net()
    pg = [net.param("a", (3,), gradient_clip=GradientClipByValue(1.0).spec),
          net.param("b", (3,), gradient_clip=GradientClipByNorm(2.0).spec)]
    start = len(net.block.ops)
    with net.guard():
        ops = SGD(0.1).apply_gradients(pg)
    clip, by_norm = net.block.ops[start:start + 2]
    assert (clip.type, clip.attr("min"), clip.attr("max")) == ("clip", -1.0, 1.0)
    assert (by_norm.type, by_norm.attr("max_norm")) == ("clip_by_norm", 2.0)
    assert clip.role_var == ["a", "a@GRAD"] and by_norm.role_var == ["b", "b@GRAD"]
    assert [op.input("Grad") for op in ops] == [clip.output("Out"), by_norm.output("Out")]
    assert net.problems() == []


def test_global_norm_clip_decomposition() -> None:
    net = Net()
    pg = [net.param(n, (3,)) for n in ("a", "b")]
    start = len(net.block.ops)
    with net.guard():
        new = append_gradient_clip_ops(pg, GradientClipByGlobalNorm(5.0))
    ops = net.block.ops[start:]
    assert [op.type for op in ops] == ["fill_constant", "square", "reduce_sum", "square", "reduce_sum", "sum",
                                       "sqrt", "elementwise_max", "elementwise_div", "elementwise_mul",
                                       "elementwise_mul"]
    assert ops[0].attr("value") == 5.0
    assert ops[5].input("X") == [ops[2].output("Out")[0], ops[4].output("Out")[0]]
    scale = ops[8].output("Out")
    assert [op.input("Y") for op in ops[9:]] == [scale, scale]
    assert [g.name for _, g in new] == [ops[9].output("Out")[0], ops[10].output("Out")[0]]
    assert all(op.role == OPT for op in ops)
    assert [op.role_var[0] for op in ops] == ["a"] * 3 + ["b"] * 2 + ["a"] * 5 + ["b"]
    assert net.problems() == []


def test_global_norm_group_needs_one_clip_norm() -> None:
    net = Net()
    pg = [net.param("a", (3,), gradient_clip=GradientClipByGlobalNorm(1.0).spec),
          net.param("b", (3,), gradient_clip=GradientClipByGlobalNorm(2.0).spec)]
    with net.guard(), pytest.raises(IRError, match="same clip_norm"):
        append_gradient_clip_ops(pg)


def test_param_clip_wins_and_clip_runs_before_regularization() -> None:
    net = Net()
    pg = [net.param("a", (3,), gradient_clip=GradientClipByValue(0.5).spec, regularizer="L2Decay(0.1)"),
          net.param("b", (3,))]
    start = len(net.block.ops)
    with net.guard():
        SGD(0.1).apply_gradients(pg, grad_clip=GradientClipByNorm(3.0))
    assert net.types(start) == ["clip", "clip_by_norm", "scale", "sum", "sgd", "sgd"]
    assert net.block.ops[start].attr("max") == 0.5


def test_set_gradient_clip_records_the_spec() -> None:
    net = Net()
    _two_params(net)
    set_gradient_clip(GradientClipByGlobalNorm(1.5, group_name="g"), param_list=["fc_w"], program=net.main)
    assert net.block.var("fc_w").gradient_clip == 'GradientClipByGlobalNorm(clip_norm=1.5, group_name="g")'
    assert net.block.var("fc_b").gradient_clip is None
    with pytest.raises(IRError, match="not a parameter"):
        set_gradient_clip(GradientClipByValue(1.0), param_list=["fc_w@GRAD"], program=net.main)


def test_clip_spec_round_trip() -> None:
    for clip in (GradientClipByValue(1.0), GradientClipByValue(2.0, min=-0.5), GradientClipByNorm(3.0),
                 GradientClipByGlobalNorm(4.0, group_name="grp")):
        assert clip_from_spec(clip.spec) == clip
    assert clip_from_spec("GradientClipByValue(1.0, -1.0)") == GradientClipByValue(max=1.0, min=-1.0)
    with pytest.raises(IRError, match="greater than max"):
        GradientClipByValue(max=-1.0, min=1.0)


# --- learning-rate schedules ----------------------------------------------------------------------

def _run_lr(program: Program, startup: Program, lr: str, steps: int) -> list[float]:
    """Evaluate the LRSched ops of ``program`` for ``steps`` steps with numpy."""
    env: dict[str, np.ndarray] = {}
    dtypes = {"float32": np.float32, "int64": np.int64, "bool": np.bool_}

    def run(op: Operator) -> None:
        x = env.get(op.input("X")[0]) if op.input("X") else None
        y = env.get(op.input("Y")[0]) if op.input("Y") else None
        t = op.type
        if t == "fill_constant":
            out = np.full(op.attr("shape"), op.attr("value"), dtype=dtypes[op.attr("dtype")])
        elif t == "increment":
            out = x + np.asarray(op.attr("step")).astype(x.dtype)
        elif t == "cast":
            out = x.astype(dtypes[op.attr("out_dtype")])
        elif t == "scale":
            out = (x * op.attr("scale") + op.attr("bias")).astype(np.float32)
        elif t == "sum":
            out = np.sum([env[n] for n in op.input("X")], axis=0).astype(np.float32)
        elif t == "less_than":
            out = x < y
        elif t.startswith("elementwise_"):
            fn = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power,
                  "max": np.maximum, "min": np.minimum}[t[len("elementwise_"):]]
            out = fn(x, y).astype(np.float32)
        else:
            out = {"floor": np.floor, "ceil": np.ceil, "exp": np.exp}[t](x).astype(np.float32)
        env[op.output("Out")[0]] = out

    for op in startup.global_block().ops:
        run(op)
    values = []
    for _ in range(steps):
        for op in program.global_block().ops:
            run(op)
        values.append(float(env[lr][0]))
    return values


SCHEDULES = [
    ("exponential", lambda: lrs.exponential_decay(1.0, 4, 0.5),
     lambda s: 1.0 * 0.5 ** (s / 4)),
    ("exponential_staircase", lambda: lrs.exponential_decay(1.0, 4, 0.5, staircase=True),
     lambda s: 1.0 * 0.5 ** math.floor(s / 4)),
    ("natural_exp", lambda: lrs.natural_exp_decay(0.5, 3, 0.2, staircase=True),
     lambda s: 0.5 * math.exp(-0.2 * math.floor(s / 3))),
    ("inverse_time", lambda: lrs.inverse_time_decay(0.5, 2, 0.3),
     lambda s: 0.5 / (1 + 0.3 * s / 2)),
    ("polynomial", lambda: lrs.polynomial_decay(1.0, 5, end_learning_rate=0.1, power=2.0),
     lambda s: (1.0 - 0.1) * (1 - min(s, 5) / 5) ** 2 + 0.1),
    ("polynomial_cycle", lambda: lrs.polynomial_decay(1.0, 3, end_learning_rate=0.0, power=1.0, cycle=True),
     lambda s: (1 - s / (3 * max(math.ceil(s / 3), 1))) * 1.0),
    ("piecewise", lambda: lrs.piecewise_decay([2, 5], [1.0, 0.5, 0.1]),
     lambda s: 1.0 if s < 2 else 0.5 if s < 5 else 0.1),
    ("noam", lambda: lrs.noam_decay(64, 4),
     lambda s: 64 ** -0.5 * min((s + 1) ** -0.5, 4 ** -1.5 * (s + 1))),
]


@pytest.mark.parametrize("build,expected", [c[1:] for c in SCHEDULES], ids=[c[0] for c in SCHEDULES])
def test_lr_schedule_builds_lrsched_ops(build: Any, expected: Any) -> None:
    net = Net()
    with net.guard():
        lr = build()
    ops = net.block.ops
    assert ops and all(op.role == LRSCHED and op.role_var == [] for op in ops)
    assert ops[0].type == "increment" and ops[0].input("X") == [LR_DECAY_COUNTER] == ops[0].output("Out")
    counter = net.block.var(LR_DECAY_COUNTER)
    assert (counter.dtype, counter.shape, counter.persistable) == ("int64", (1,), True)
    init = net.startup_init(LR_DECAY_COUNTER)
    assert init.type == "fill_constant" and init.attr("force_cpu") is True and init.attr("dtype") == "int64"
    assert (lr.shape, lr.dtype) == ((1,), "float32")
    assert net.problems() == []
    got = _run_lr(net.main, net.startup, lr.name, 12)
    want = [expected(s) for s in range(12)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_piecewise_is_exact_and_persistable() -> None:
    net = Net()
    with net.guard():
        lr = lrs.piecewise_decay([1, 2, 3], [0.3, 0.1, 0.7, 1e-3])
    assert lr.persistable and lr.name == "learning_rate_0"
    assert net.startup_init(lr.name).attr("value") == 0.0
    got = _run_lr(net.main, net.startup, lr.name, 5)
    assert got == [float(np.float32(v)) for v in (0.3, 0.1, 0.7, 1e-3, 1e-3)]


def test_schedules_share_one_counter() -> None:
    net = Net()
    with net.guard():
        lrs.exponential_decay(0.1, 10, 0.5)
        lrs.inverse_time_decay(0.1, 10, 0.5)
    assert [op.type for op in net.block.ops].count("increment") == 1
    assert len([op for op in net.startup.global_block().ops if LR_DECAY_COUNTER in op.output_arg_names]) == 1


def test_schedule_argument_errors() -> None:
    net = Net()
    with net.guard():
        with pytest.raises(IRError, match="len\\(values\\) - len\\(boundaries\\)|need 3 values"):
            lrs.piecewise_decay([1, 2], [0.1, 0.2])
        with pytest.raises(IRError, match="strictly increasing"):
            lrs.piecewise_decay([2, 1], [0.1, 0.2, 0.3])
        with pytest.raises(IRError, match="decay_steps must be positive"):
            lrs.exponential_decay(0.1, 0, 0.5)


# --- the acceptance network -----------------------------------------------------------------------

def test_basic_model_minimize() -> None:
    """Fluid's TestBasicModel: fc(1000) on x[1000], square error cost, mean, SGD(0.1).minimize."""
    main, startup = Program(), Program()
    with program_guard(main, startup):
        x = layers.data(name="x", shape=[1000], dtype="float32")
        y = layers.data(name="y", shape=[1], dtype="float32")
        y_predict = layers.fc(input=x, size=1000, act=None, param_attr="fc_w", bias_attr="fc_b")
        cost = layers.square_error_cost(input=y_predict, label=y)
        avg_cost = layers.mean(cost)
        ops, params_grads = SGD(learning_rate=0.1).minimize(avg_cost)
    assert [op.type for op in main.global_block().ops] == [
        "mul", "elementwise_add", "elementwise_sub", "square", "mean", "fill_constant", "mean_grad",
        "square_grad", "elementwise_sub_grad", "elementwise_add_grad", "mul_grad", "sgd", "sgd"]
    assert [op.input("Param") for op in ops] == [["fc_b"], ["fc_w"]]
    assert sorted((p.name, g.name) for p, g in params_grads) == [("fc_b", "fc_b@GRAD"), ("fc_w", "fc_w@GRAD")]
    sops = startup.global_block().ops
    assert [(op.type, op.output("Out")) for op in sops] == [
        ("fill_constant", ["learning_rate_0"]), ("fill_constant", ["fc_b"]), ("uniform_random", ["fc_w"])]
    limit = math.sqrt(6.0 / 2000.0)
    assert sops[2].attr("min") == pytest.approx(-limit) and sops[2].attr("max") == pytest.approx(limit)
    assert sops[0].attr("value") == pytest.approx(0.1) and sops[1].attr("value") == 0.0
    assert collect_problems(main) == [] and collect_problems(startup) == []


def _fc_net(param_attr: Any, bias_attr: Any) -> tuple[Program, Program, Variable]:
    main, startup = Program(), Program()
    with program_guard(main, startup):
        x = layers.data(name="x", shape=[8], dtype="float32")
        y = layers.data(name="y", shape=[1], dtype="float32")
        pred = layers.fc(input=x, size=4, act=None, param_attr=param_attr, bias_attr=bias_attr)
        pred = layers.fc(input=pred, size=1, act=None, param_attr="out_w", bias_attr="out_b")
        loss = layers.mean(layers.square_error_cost(input=pred, label=y))
    return main, startup, loss


def test_minimize_with_param_attrs_schedule_clip_and_regularization(golden: Any) -> None:
    """ParamAttr regularizer/clip objects reach the optimizer through the Parameter's spec strings."""
    main, startup, loss = _fc_net(
        ParamAttr(name="fc_w", regularizer=L1Decay(0.01), gradient_clip=GradientClipByValue(0.5), learning_rate=2.0),
        ParamAttr(name="fc_b", gradient_clip=GradientClipByGlobalNorm(1.0)))
    with program_guard(main, startup):
        lr = lrs.exponential_decay(0.1, decay_steps=100, decay_rate=0.9, staircase=True)
        ops, params_grads = Adam(lr, regularization=L2Decay(1e-4)).minimize(
            loss, grad_clip=GradientClipByGlobalNorm(1.0))
    block = main.global_block()
    assert block.ops[0].type == "increment"
    adam = [op for op in ops if op.type == "adam"]
    assert [op.input("Param")[0] for op in adam] == ["fc_b", "fc_w", "out_b", "out_w"]
    # fc_w: its own clip (by value) and regularizer (L1, scaled by 0.01); the others: the global-norm clip
    # (fc_b's own, the optimizer's for out_*) in one group and the optimizer's L2 regularization.
    fc_w_ops = [op.type for op in block.ops if op.role == OPT and op.role_var[:1] == ["fc_w"]]
    assert fc_w_ops[0] == "clip" and fc_w_ops[-5:] == ["scale", "sum", "adam", "scale", "scale"]
    assert [op.type for op in block.ops].count("sqrt") == 1
    assert [op.type for op in block.ops].count("elementwise_mul") == 3
    first = {}
    for op in block.ops:
        if op.role == OPT and op.role_var:
            first.setdefault(op.role_var[0], op.role_var[1])
    # The first optimize op that mentions a parameter names its original gradient (the transpiler relies on it).
    assert first == {p: grad_name(p) for p in ("fc_b", "fc_w", "out_b", "out_w")}
    assert collect_problems(main) == [] and collect_problems(startup) == []
    golden.check("optimizer_build_full.txt", main.to_string() + "\n" + startup.to_string())


def test_sparse_embedding_with_momentum_and_regularized_dense_params() -> None:
    main, startup = Program(), Program()
    with program_guard(main, startup):
        ids = layers.data(name="ids", shape=[1], dtype="int64")
        emb = layers.embedding(input=ids, size=[50, 4], is_sparse=True, param_attr="emb")
        pred = layers.fc(input=emb, size=1, param_attr=ParamAttr(name="w", regularizer=L2Decay(0.1)), bias_attr="b")
        loss = layers.mean(pred)
        ops, params_grads = Momentum(0.1, 0.9).minimize(loss)
    grads = {p.name: g for p, g in params_grads}
    assert grads["emb"].type == "selected_rows"
    emb_op = next(op for op in ops if op.input("Param") == ["emb"])
    assert emb_op.input("Grad") == [grads["emb"].name]
    w_types = [op.type for op in main.global_block().ops if op.role == OPT and op.role_var[:1] == ["w"]]
    assert w_types == ["scale", "sum", "momentum"]
    assert collect_problems(main) == [] and collect_problems(startup) == []
    with program_guard(main, startup), pytest.raises(IRError, match="selected_rows"):
        SGD(0.1, regularization=L2Decay(0.1)).apply_gradients(params_grads)
