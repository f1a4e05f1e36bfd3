"""End-to-end training through the whole stack (layers → append_backward → optimizer → Executor) against
references written directly in numpy.

Each case builds a small model with ``flotilla.fluid.layers``, runs the startup program, reads the initial parameters
back from the scope, trains 5 steps on fixed seeded batches and compares every parameter (and the loss of
every step) with a float64 numpy reference: the model's forward pass and analytic gradient, then Fluid
1.5's pipeline per step: gradient clip → weight decay → learning rate (schedule) → optimizer update.

Models:
- ``fc``: ``x[8] → fc 4 (w, b) → square_error_cost(y[4]) → mean``;
- ``emb``: ``ids[1] (int64) → embedding [10, 3] (table) → fc 4 (w, b) → square_error_cost → mean``, with
  duplicate ids in every batch, so the sparse (selected-rows) gradient has repeated rows.

Tolerance: float32 training against a float64 reference, rtol 1e-5 with a small atol.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

import ir
import runtime
from flotilla.fluid import clip, layers, learning_rate, optimizer, regularizer
from flotilla.fluid.param_attr import ParamAttr
from flotilla.fluid.initializer import Uniform

STEPS = 5
BATCH = 6
IN, OUT = 8, 4
VOCAB, EMB = 10, 3
RTOL, ATOL = 1e-5, 1e-6

Arrays = dict[str, np.ndarray]


# --- models ---------------------------------------------------------------------------------------------
@dataclass
class Built:
    main: ir.Program
    startup: ir.Program
    loss: ir.Variable
    params: list[str]


def _attr(name: str, seed: int, regularizer: Any = None, gradient_clip: Any = None) -> ParamAttr:
    # Non-zero biases too, so L1's sign() and every update formula see non-trivial values.
    return ParamAttr(name=name, initializer=Uniform(-0.5, 0.5, seed=seed), regularizer=regularizer,
                        gradient_clip=gradient_clip)


def build(model: str, make_optimizer: Callable[[], optimizer.Optimizer], *, w_reg: Any = None,
          w_clip: Any = None, grad_clip: Any = None, is_sparse: bool = True) -> Built:
    """Build ``model`` under a fresh program_guard; ``make_optimizer`` runs inside the guard (schedules
    append their ops to the guarded programs)."""
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup):
        if model == "fc":
            features = layers.data("x", [IN])
            params = ["b", "w"]
        else:
            ids = layers.data("ids", [1], dtype="int64")
            features = layers.embedding(ids, [VOCAB, EMB], is_sparse=is_sparse, param_attr=_attr("table", 3))
            params = ["b", "table", "w"]
        y = layers.data("y", [OUT])
        pred = layers.fc(features, OUT, param_attr=_attr("w", 1, w_reg, w_clip), bias_attr=_attr("b", 2))
        loss = layers.mean(layers.square_error_cost(pred, y))
        make_optimizer().minimize(loss, grad_clip=grad_clip)
    return Built(main, startup, loss, params)


def batches(model: str) -> list[Arrays]:
    rng = np.random.default_rng(1234)
    out = []
    for _ in range(STEPS):
        feed: Arrays = {"y": rng.standard_normal((BATCH, OUT)).astype(np.float32)}
        if model == "fc":
            feed["x"] = rng.standard_normal((BATCH, IN)).astype(np.float32)
        else:
            ids = rng.integers(0, VOCAB - 3, (BATCH, 1))  # rows 7..9 never used.astype(np.int64)
            ids[1] = ids[0]  # a repeated row in every batch
            feed["ids"] = ids
        out.append(feed)
    return out


def forward_backward(model: str, p: Arrays, feed: Arrays) -> tuple[float, Arrays]:
    """Loss and analytic gradients of the model (float64)."""
    if model == "fc":
        x = feed["x"].astype(np.float64)
    else:
        ids = feed["ids"].reshape(-1)
        x = p["table"][ids]
    d = x @ p["w"] + p["b"] - feed["y"]
    loss = float(np.mean(d * d))
    gpred = 2.0 * d / d.size
    grads = {"w": x.T @ gpred, "b": gpred.sum(axis=0)}
    if model != "fc":
        gtable = np.zeros_like(p["table"])
        np.add.at(gtable, ids, gpred @ p["w"].T)
        grads["table"] = gtable
    return loss, grads


# --- numpy references: clip, decay, schedules, optimizers (Fluid 1.5) -----------------------------------
def ref_clip(kind: tuple[str, float] | None, grads: Arrays) -> Arrays:
    if kind is None:
        return grads
    what, c = kind
    if what == "value":
        return {k: np.clip(g, -c, c) for k, g in grads.items()}
    if what == "norm":
        return {k: g * (c / np.linalg.norm(g) if np.linalg.norm(g) > c else 1.0) for k, g in grads.items()}
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    return {k: g * (c / max(c, norm)) for k, g in grads.items()}


def ref_decay(kind: tuple[str, float] | None, p: np.ndarray, g: np.ndarray) -> np.ndarray:
    if kind is None:
        return g
    what, c = kind
    return g + c * (np.sign(p) if what == "L1" else p)


@dataclass
class RefOptimizer:
    """A numpy optimizer: ``update(name, p, g, lr) -> new p`` with per-parameter state."""

    kind: str
    hp: dict[str, Any] = field(default_factory=dict)
    state: dict[str, dict[str, Any]] = field(default_factory=dict)

    def update(self, name: str, p: np.ndarray, g: np.ndarray, lr: float) -> np.ndarray:
        st = self.state.setdefault(name, self._init(p))
        h = self.hp
        if self.kind == "sgd":
            return p - lr * g
        if self.kind == "momentum":
            st["v"] = h["mu"] * st["v"] + g
            if h.get("nesterov"):
                return p - (g + h["mu"] * st["v"]) * lr
            return p - lr * st["v"]
        if self.kind == "adagrad":
            st["m"] = st["m"] + g * g
            return p - lr * g / (np.sqrt(st["m"]) + h["eps"])
        if self.kind == "decayed_adagrad":
            st["m"] = h["decay"] * st["m"] + (1 - h["decay"]) * g * g
            return p - lr * g / (np.sqrt(st["m"]) + h["eps"])
        if self.kind == "adam":
            b1, b2 = h["beta1"], h["beta2"]
            lr_t = lr * math.sqrt(1 - st["b2p"]) / (1 - st["b1p"])
            st["m1"] = b1 * st["m1"] + (1 - b1) * g
            st["m2"] = b2 * st["m2"] + (1 - b2) * g * g
            st["b1p"] *= b1
            st["b2p"] *= b2
            return p - lr_t * st["m1"] / (np.sqrt(st["m2"]) + h["eps"])
        if self.kind == "rmsprop":
            rho, eps = h["rho"], h["eps"]
            st["ms"] = rho * st["ms"] + (1 - rho) * g * g
            if h.get("centered"):
                st["mg"] = rho * st["mg"] + (1 - rho) * g
                denom = np.sqrt(st["ms"] - st["mg"] ** 2 + eps)
            else:
                denom = np.sqrt(st["ms"] + eps)
            st["mom"] = h["momentum"] * st["mom"] + lr * g / denom
            return p - st["mom"]
        if self.kind == "ftrl":
            l1, l2, power = h["l1"] + 1e-10, h["l2"] + 1e-10, h["lr_power"]
            new_sq = st["sq"] + g * g
            st["lin"] = st["lin"] + g - (new_sq ** -power - st["sq"] ** -power) / lr * p
            y = new_sq ** -power / lr + 2 * l2
            st["sq"] = new_sq
            lin = st["lin"]
            return np.where(np.abs(lin) > l1, (l1 * np.sign(lin) - lin) / y, 0.0)
        raise ValueError(self.kind)

    def _init(self, p: np.ndarray) -> dict[str, Any]:
        z = np.zeros_like(p)
        if self.kind == "adam":
            return {"m1": z, "m2": z.copy(), "b1p": self.hp["beta1"], "b2p": self.hp["beta2"]}
        if self.kind in ("adagrad",):
            return {"m": z + self.hp.get("init", 0.0)}
        return {"v": z, "m": z.copy(), "ms": z.copy(), "mg": z.copy(), "mom": z.copy(), "sq": z.copy(),
                "lin": z.copy()}


def reference(model: str, init: Arrays, feeds: list[Arrays], opt: RefOptimizer,
              lr: Callable[[int], float] = lambda step: 0.1, clip_kind: tuple[str, float] | None = None,
              decay: Callable[[str], tuple[str, float] | None] = lambda name: None,
              clip_of: Callable[[str], tuple[str, float] | None] | None = None) -> tuple[Arrays, list[float]]:
    """Parameters after training on ``feeds`` and the loss of each step. ``clip_of`` gives a per-parameter
    clip (None: ``clip_kind`` for all, as a group for the global norm)."""
    opt = RefOptimizer(opt.kind, dict(opt.hp))  # fresh state: the tables above are shared between tests
    p = {k: v.astype(np.float64) for k, v in init.items()}
    losses = []
    for step, feed in enumerate(feeds):
        loss, grads = forward_backward(model, p, feed)
        losses.append(loss)
        if clip_of is None:
            grads = ref_clip(clip_kind, grads)
        else:
            grads = {k: ref_clip(clip_of(k), {k: g})[k] for k, g in grads.items()}
        grads = {k: ref_decay(decay(k), p[k], g) for k, g in grads.items()}
        p = {k: opt.update(k, p[k], grads[k], lr(step)) for k in sorted(p)}
    return p, losses


# --- running the real thing -----------------------------------------------------------------------------
def train(built: Built, feeds: list[Arrays]) -> tuple[Arrays, Arrays, list[float]]:
    """(initial params, final params, losses) from the Executor."""
    scope, exe = runtime.Scope(), runtime.Executor()
    exe.run(built.startup, scope=scope)
    init = {n: np.array(scope.numpy(n)) for n in built.params}
    losses = []
    for feed in feeds:
        (loss,) = exe.run(built.main, feed=feed, fetch_list=[built.loss], scope=scope)
        losses.append(float(loss.reshape(-1)[0]))
    final = {n: np.array(scope.numpy(n)) for n in built.params}
    for n in built.params:
        assert final[n].dtype == np.float32, f"{n} changed dtype to {final[n].dtype}"
    return init, final, losses


def check(got: Arrays, want: Arrays, got_losses: list[float], want_losses: list[float], init: Arrays) -> None:
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=f"parameter {name}")
        assert not np.allclose(got[name], init[name]), f"parameter {name} did not train"
    np.testing.assert_allclose(got_losses, want_losses, rtol=RTOL, atol=ATOL, err_msg="losses")


# --- optimizers -----------------------------------------------------------------------------------------
OPTIMIZERS: dict[str, tuple[Callable[[], optimizer.Optimizer], RefOptimizer]] = {
    "sgd": (lambda: optimizer.SGD(0.1), RefOptimizer("sgd")),
    "momentum": (lambda: optimizer.Momentum(0.1, momentum=0.9), RefOptimizer("momentum", {"mu": 0.9})),
    "momentum_nesterov": (lambda: optimizer.Momentum(0.1, momentum=0.9, use_nesterov=True),
                          RefOptimizer("momentum", {"mu": 0.9, "nesterov": True})),
    "adagrad": (lambda: optimizer.Adagrad(0.1, epsilon=1e-6), RefOptimizer("adagrad", {"eps": 1e-6})),
    "adagrad_init_acc": (lambda: optimizer.Adagrad(0.1, epsilon=1e-6, initial_accumulator_value=0.1),
                         RefOptimizer("adagrad", {"eps": 1e-6, "init": 0.1})),
    "adam": (lambda: optimizer.Adam(0.01, beta1=0.9, beta2=0.999, epsilon=1e-8),
             RefOptimizer("adam", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8})),
    "rmsprop": (lambda: optimizer.RMSProp(0.01, rho=0.9, epsilon=1e-6, momentum=0.5),
                RefOptimizer("rmsprop", {"rho": 0.9, "eps": 1e-6, "momentum": 0.5})),
    "rmsprop_centered": (lambda: optimizer.RMSProp(0.01, rho=0.9, epsilon=1e-6, momentum=0.5, centered=True),
                         RefOptimizer("rmsprop", {"rho": 0.9, "eps": 1e-6, "momentum": 0.5, "centered": True})),
    "decayed_adagrad": (lambda: optimizer.DecayedAdagrad(0.1, decay=0.9, epsilon=1e-6),
                        RefOptimizer("decayed_adagrad", {"decay": 0.9, "eps": 1e-6})),
    "ftrl": (lambda: optimizer.Ftrl(0.1, l1=0.01, l2=0.01),
             RefOptimizer("ftrl", {"l1": 0.01, "l2": 0.01, "lr_power": -0.5})),
    "ftrl_lr_power": (lambda: optimizer.Ftrl(0.1, l1=0.0, l2=0.02, lr_power=-0.7),
                      RefOptimizer("ftrl", {"l1": 0.0, "l2": 0.02, "lr_power": -0.7})),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_numpy(name: str) -> None:
    make, ref = OPTIMIZERS[name]
    built = build("fc", make)
    feeds = batches("fc")
    lr = {"adam": 0.01, "rmsprop": 0.01, "rmsprop_centered": 0.01}.get(name, 0.1)
    init, got, losses = train(built, feeds)
    want, want_losses = reference("fc", init, feeds, ref, lr=lambda step: lr)
    check(got, want, losses, want_losses, init)


# --- regularizers ---------------------------------------------------------------------------------------
REGULARIZERS = {
    # case: (optimizer's regularization, w's ParamAttr regularizer, expected decay per parameter)
    "optimizer_l2": (regularizer.L2Decay(0.1), None, {"w": ("L2", 0.1), "b": ("L2", 0.1)}),
    "optimizer_l1": (regularizer.L1Decay(0.05), None, {"w": ("L1", 0.05), "b": ("L1", 0.05)}),
    "param_attr_l2": (None, regularizer.L2Decay(0.2), {"w": ("L2", 0.2)}),
    "param_attr_l1": (None, regularizer.L1Decay(0.03), {"w": ("L1", 0.03)}),
    "param_attr_wins_l1_over_l2": (regularizer.L2Decay(0.1), regularizer.L1Decay(0.03),
                                   {"w": ("L1", 0.03), "b": ("L2", 0.1)}),
    "param_attr_wins_l2_over_l1": (regularizer.L1Decay(0.05), regularizer.L2Decay(0.2),
                                   {"w": ("L2", 0.2), "b": ("L1", 0.05)}),
}


@pytest.mark.parametrize("case", list(REGULARIZERS))
def test_regularizer_matches_numpy(case: str) -> None:
    opt_reg, w_reg, expected = REGULARIZERS[case]
    built = build("fc", lambda: optimizer.Momentum(0.1, momentum=0.9, regularization=opt_reg), w_reg=w_reg)
    feeds = batches("fc")
    init, got, losses = train(built, feeds)
    want, want_losses = reference("fc", init, feeds, RefOptimizer("momentum", {"mu": 0.9}),
                                  decay=lambda name: expected.get(name))
    check(got, want, losses, want_losses, init)
    # The decay must matter: without it the result differs.
    plain, _ = reference("fc", init, feeds, RefOptimizer("momentum", {"mu": 0.9}))
    assert not np.allclose(plain["w"], got["w"], rtol=RTOL, atol=ATOL)


# --- gradient clipping ----------------------------------------------------------------------------------
CLIPS = {
    "by_value": (lambda: clip.GradientClipByValue(0.05), ("value", 0.05)),
    "by_norm": (lambda: clip.GradientClipByNorm(0.1), ("norm", 0.1)),
    "by_global_norm": (lambda: clip.GradientClipByGlobalNorm(0.2), ("global", 0.2)),
}


@pytest.mark.parametrize("case", list(CLIPS))
def test_clip_matches_numpy(case: str) -> None:
    make_clip, kind = CLIPS[case]
    built = build("fc", lambda: optimizer.SGD(0.5), grad_clip=make_clip())
    feeds = batches("fc")
    init, got, losses = train(built, feeds)
    # The clip is active on the first step (else this test could not tell it apart from no clip).
    _, g0 = forward_backward("fc", {k: v.astype(np.float64) for k, v in init.items()}, feeds[0])
    assert any(not np.allclose(ref_clip(kind, g0)[k], g0[k]) for k in g0)
    want, want_losses = reference("fc", init, feeds, RefOptimizer("sgd"), lr=lambda step: 0.5, clip_kind=kind)
    check(got, want, losses, want_losses, init)


def test_clip_on_param_attr_wins_over_minimize_grad_clip() -> None:
    built = build("fc", lambda: optimizer.SGD(0.5), w_clip=clip.GradientClipByValue(0.02),
                  grad_clip=clip.GradientClipByNorm(0.1))
    feeds = batches("fc")
    init, got, losses = train(built, feeds)
    kinds = {"w": ("value", 0.02), "b": ("norm", 0.1)}
    want, want_losses = reference("fc", init, feeds, RefOptimizer("sgd"), lr=lambda step: 0.5,
                                  clip_of=kinds.get)
    check(got, want, losses, want_losses, init)


def test_clip_then_decay_order() -> None:
    """Fluid 1.5 clips first and adds the weight decay to the clipped gradient."""
    built = build("fc", lambda: optimizer.SGD(0.5, regularization=regularizer.L2Decay(0.5)),
                  grad_clip=clip.GradientClipByValue(0.01))
    feeds = batches("fc")
    init, got, losses = train(built, feeds)
    want, want_losses = reference("fc", init, feeds, RefOptimizer("sgd"), lr=lambda step: 0.5,
                                  clip_kind=("value", 0.01), decay=lambda name: ("L2", 0.5))
    check(got, want, losses, want_losses, init)


# --- learning-rate schedules ----------------------------------------------------------------------------
def _poly(step: int, lr: float, decay_steps: float, end: float, power: float, cycle: bool) -> float:
    if cycle:
        decay_steps = decay_steps * max(math.ceil(step / decay_steps), 1)
    else:
        step = min(step, decay_steps)
    return (lr - end) * (1 - step / decay_steps) ** power + end


def _piecewise(step: int, boundaries: list[float], values: list[float]) -> float:
    for bound, value in zip(boundaries, values):
        if step < bound:
            return value
    return values[-1]


SCHEDULES: dict[str, tuple[Callable[[], ir.Variable], Callable[[int], float]]] = {
    "exponential_decay": (lambda: learning_rate.exponential_decay(0.2, 2, 0.5),
                          lambda s: 0.2 * 0.5 ** (s / 2)),
    "exponential_decay_staircase": (lambda: learning_rate.exponential_decay(0.2, 2, 0.5, staircase=True),
                                    lambda s: 0.2 * 0.5 ** math.floor(s / 2)),
    "natural_exp_decay": (lambda: learning_rate.natural_exp_decay(0.2, 2, 0.5),
                          lambda s: 0.2 * math.exp(-0.5 * s / 2)),
    "natural_exp_decay_staircase": (lambda: learning_rate.natural_exp_decay(0.2, 2, 0.5, staircase=True),
                                    lambda s: 0.2 * math.exp(-0.5 * math.floor(s / 2))),
    "inverse_time_decay": (lambda: learning_rate.inverse_time_decay(0.2, 2, 0.5),
                           lambda s: 0.2 / (1 + 0.5 * s / 2)),
    "inverse_time_decay_staircase": (lambda: learning_rate.inverse_time_decay(0.2, 2, 0.5, staircase=True),
                                     lambda s: 0.2 / (1 + 0.5 * math.floor(s / 2))),
    "polynomial_decay": (lambda: learning_rate.polynomial_decay(0.2, 3, end_learning_rate=0.01, power=2.0),
                         lambda s: _poly(s, 0.2, 3, 0.01, 2.0, False)),
    "polynomial_decay_cycle": (lambda: learning_rate.polynomial_decay(0.2, 2, end_learning_rate=0.01,
                                                                      power=1.5, cycle=True),
                               lambda s: _poly(s, 0.2, 2, 0.01, 1.5, True)),
    "piecewise_decay": (lambda: learning_rate.piecewise_decay([1, 3], [0.3, 0.1, 0.02]),
                        lambda s: _piecewise(s, [1, 3], [0.3, 0.1, 0.02])),
    "noam_decay": (lambda: learning_rate.noam_decay(16, 3),
                   lambda s: 16 ** -0.5 * min((s + 1) ** -0.5, 3 ** -1.5 * (s + 1))),
}


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_lr_schedule_matches_numpy(case: str) -> None:
    make_lr, lr = SCHEDULES[case]
    # The schedule varies over the 5 steps (else it could not be told apart from a constant).
    assert len({round(lr(s), 12) for s in range(STEPS)}) > 1
    built = build("fc", lambda: optimizer.SGD(make_lr()))
    feeds = batches("fc")
    init, got, losses = train(built, feeds)
    want, want_losses = reference("fc", init, feeds, RefOptimizer("sgd"), lr=lr)
    check(got, want, losses, want_losses, init)


def test_lr_schedule_with_adam() -> None:
    built = build("fc", lambda: optimizer.Adam(learning_rate.exponential_decay(0.05, 2, 0.5)))
    feeds = batches("fc")
    init, got, losses = train(built, feeds)
    want, want_losses = reference("fc", init, feeds,
                                  RefOptimizer("adam", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}),
                                  lr=lambda s: 0.05 * 0.5 ** (s / 2))
    check(got, want, losses, want_losses, init)


def test_lr_decay_counter_counts_steps() -> None:
    built = build("fc", lambda: optimizer.SGD(learning_rate.exponential_decay(0.2, 2, 0.5)))
    scope, exe = runtime.Scope(), runtime.Executor()
    exe.run(built.startup, scope=scope)
    for feed in batches("fc"):
        exe.run(built.main, feed=feed, scope=scope)
    counter = scope.numpy("@LR_DECAY_COUNTER@")
    assert counter.dtype == np.int64
    np.testing.assert_array_equal(counter, [STEPS - 1])


# --- sparse embedding -----------------------------------------------------------------------------------
SPARSE_OPTIMIZERS = {
    "sgd": (lambda: optimizer.SGD(0.2), RefOptimizer("sgd")),
    "adagrad": (lambda: optimizer.Adagrad(0.2, epsilon=1e-6), RefOptimizer("adagrad", {"eps": 1e-6})),
}


@pytest.mark.parametrize("is_sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("name", list(SPARSE_OPTIMIZERS))
def test_embedding_training_matches_dense_numpy(name: str, is_sparse: bool) -> None:
    make, ref = SPARSE_OPTIMIZERS[name]
    built = build("emb", make, is_sparse=is_sparse)
    grad_var = built.main.global_block().var("table@GRAD")
    assert grad_var.type == ("selected_rows" if is_sparse else "lod_tensor")
    feeds = batches("emb")
    init, got, losses = train(built, feeds)
    lr = 0.2
    want, want_losses = reference("emb", init, feeds, ref, lr=lambda step: lr)
    check(got, want, losses, want_losses, init)
    # Rows never looked up keep their initial values exactly.
    used = np.unique(np.concatenate([f["ids"].reshape(-1) for f in feeds]))
    unused = np.setdiff1d(np.arange(VOCAB), used)
    assert unused.size > 0
    np.testing.assert_array_equal(got["table"][unused], init["table"][unused])
