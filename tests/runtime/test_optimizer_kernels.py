"""Optimizer and clipping kernels against independent numpy references (Fluid 1.5's formulas).

Each case runs 5 steps with a fresh gradient per step, dense and SelectedRows (with duplicate rows),
under ``jax.jit`` (the first step is also run eagerly and must agree), in float32 (rtol 1e-5) and float64
(rtol 1e-12). Sparse semantics per op are those documented in ``runtime.kernels.optimizer``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime
from ir.core import Program
from runtime.kernels.optimizer import merge_rows
from runtime.kernels.registry import get_kernel
from runtime.scope import Scope, SelectedRows

HEIGHT, WIDTH = 6, 3
SPARSE_ROWS = np.array([4, 1, 4, 2], dtype=np.int64)  # row 4 twice; rows 0, 3, 5 untouched
pytestmark = pytest.mark.usefixtures("x64")  # the kernels are called directly, not through Executor.run
TOL = {"float32": dict(rtol=1e-5, atol=1e-6), "float64": dict(rtol=1e-12, atol=1e-14)}


# --- numpy references (float64). ``g`` is dense [HEIGHT, WIDTH]; ``rows`` the touched rows or None (dense).
def merged_np(rows: np.ndarray, values: np.ndarray) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for r, v in zip(rows.tolist(), values):
        out[r] = out.get(r, 0.0) + v
    return out


def densify(rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    g = np.zeros((HEIGHT, WIDTH))
    np.add.at(g, rows, values)
    return g


def rowwise(update: Callable[..., tuple[np.ndarray, ...]], state: list[np.ndarray], grad: Any) -> list[np.ndarray]:
    """Apply ``update(*state_rows, g_row)`` to the merged touched rows only (sparse) or to everything."""
    if isinstance(grad, tuple):
        out = [s.copy() for s in state]
        for r, g in merged_np(*grad).items():
            new = update(*[s[r] for s in state], g)
            for o, n in zip(out, new):
                o[r] = n
        return out
    return list(update(*state, grad))


def ref_sgd(st: dict, grad: Any, lr: float, a: dict) -> dict:
    p = st["Param"].copy()
    if isinstance(grad, tuple):
        for r, v in zip(grad[0].tolist(), grad[1]):
            p[r] -= lr * v
        return {"Param": p}
    return {"Param": p - lr * grad}


def ref_momentum(st: dict, grad: Any, lr: float, a: dict) -> dict:
    g = densify(*grad) if isinstance(grad, tuple) else grad
    v = st["Velocity"] * a["mu"] + g
    p = st["Param"] - (g + v * a["mu"]) * lr if a["use_nesterov"] else st["Param"] - lr * v
    return {"Param": p, "Velocity": v}


def ref_adagrad(st: dict, grad: Any, lr: float, a: dict) -> dict:
    def upd(p: Any, m: Any, g: Any) -> tuple:
        m = m + g * g
        return p - lr * g / (np.sqrt(m) + a["epsilon"]), m

    p, m = rowwise(upd, [st["Param"], st["Moment"]], grad)
    return {"Param": p, "Moment": m}


def ref_decayed_adagrad(st: dict, grad: Any, lr: float, a: dict) -> dict:
    def upd(p: Any, m: Any, g: Any) -> tuple:
        m = a["decay"] * m + (1 - a["decay"]) * g * g
        return p - lr * g / (np.sqrt(m) + a["epsilon"]), m

    p, m = rowwise(upd, [st["Param"], st["Moment"]], grad)
    return {"Param": p, "Moment": m}


def ref_adam(st: dict, grad: Any, lr: float, a: dict) -> dict:
    lr_t = lr * np.sqrt(1 - st["Beta2Pow"][0]) / (1 - st["Beta1Pow"][0])

    def upd(p: Any, m1: Any, m2: Any, g: Any) -> tuple:
        m1 = a["beta1"] * m1 + (1 - a["beta1"]) * g
        m2 = a["beta2"] * m2 + (1 - a["beta2"]) * g * g
        return p - lr_t * m1 / (np.sqrt(m2) + a["epsilon"]), m1, m2

    if isinstance(grad, tuple) and not a["lazy_mode"]:
        grad = densify(*grad)
    p, m1, m2 = rowwise(upd, [st["Param"], st["Moment1"], st["Moment2"]], grad)
    # The op leaves the beta pows alone; the optimizer's scale ops advance them (done here by the test).
    return {"Param": p, "Moment1": m1, "Moment2": m2,
            "Beta1Pow": st["Beta1Pow"] * a["beta1"], "Beta2Pow": st["Beta2Pow"] * a["beta2"]}


def ref_rmsprop(st: dict, grad: Any, lr: float, a: dict) -> dict:
    g = densify(*grad) if isinstance(grad, tuple) else grad
    rho, eps = a["decay"], a["epsilon"]
    ms = rho * st["MeanSquare"] + (1 - rho) * g * g
    out = {"MeanSquare": ms}
    if a["centered"]:
        mg = rho * st["MeanGrad"] + (1 - rho) * g
        mom = a["momentum"] * st["Moment"] + lr * g / np.sqrt(ms - mg * mg + eps)
        out["MeanGrad"] = mg
    else:
        mom = a["momentum"] * st["Moment"] + lr * g / np.sqrt(ms + eps)
    out.update(Param=st["Param"] - mom, Moment=mom)
    return out


def ref_ftrl(st: dict, grad: Any, lr: float, a: dict) -> dict:
    l1, l2, power = a["l1"] + 1e-10, a["l2"] + 1e-10, a["lr_power"]

    def upd(p: Any, sq: Any, lin: Any, g: Any) -> tuple:
        new_sq = sq + g * g
        lin = lin + g - (new_sq ** -power - sq ** -power) / lr * p
        y = new_sq ** -power / lr + 2 * l2
        p = np.where(np.abs(lin) > l1, (l1 * np.sign(lin) - lin) / y, 0.0)
        return p, new_sq, lin

    p, sq, lin = rowwise(upd, [st["Param"], st["SquaredAccumulator"], st["LinearAccumulator"]], grad)
    return {"Param": p, "SquaredAccumulator": sq, "LinearAccumulator": lin}


@dataclass
class Case:
    op: str
    attrs: dict
    ref: Callable[..., dict]
    state: dict[str, Callable[[np.random.Generator], np.ndarray]]
    outs: dict[str, str]  # output slot -> the input slot it updates
    scalars: tuple[str, ...] = ()
    id: str = ""
    extra: dict = field(default_factory=dict)


def rand(lo: float, hi: float) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.uniform(lo, hi, (HEIGHT, WIDTH))


ZEROS = lambda rng: np.zeros((HEIGHT, WIDTH))  # noqa: E731
ONES = lambda rng: np.ones((HEIGHT, WIDTH))  # noqa: E731
PARAM = rand(-1.0, 1.0)

CASES = [
    Case("sgd", {}, ref_sgd, {"Param": PARAM}, {"ParamOut": "Param"}),
    Case("momentum", {"mu": 0.9, "use_nesterov": False}, ref_momentum,
         {"Param": PARAM, "Velocity": rand(-0.1, 0.1)}, {"ParamOut": "Param", "VelocityOut": "Velocity"}),
    Case("momentum", {"mu": 0.9, "use_nesterov": True}, ref_momentum,
         {"Param": PARAM, "Velocity": rand(-0.1, 0.1)}, {"ParamOut": "Param", "VelocityOut": "Velocity"},
         id="nesterov"),
    Case("adagrad", {"epsilon": 1e-6}, ref_adagrad, {"Param": PARAM, "Moment": rand(0.0, 0.5)},
         {"ParamOut": "Param", "MomentOut": "Moment"}),
    Case("decayed_adagrad", {"decay": 0.95, "epsilon": 1e-6}, ref_decayed_adagrad,
         {"Param": PARAM, "Moment": rand(0.0, 0.5)}, {"ParamOut": "Param", "MomentOut": "Moment"}),
    Case("adam", {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "lazy_mode": False}, ref_adam,
         {"Param": PARAM, "Moment1": ZEROS, "Moment2": ZEROS},
         {"ParamOut": "Param", "Moment1Out": "Moment1", "Moment2Out": "Moment2"},
         scalars=("Beta1Pow", "Beta2Pow")),
    Case("adam", {"beta1": 0.8, "beta2": 0.99, "epsilon": 1e-8, "lazy_mode": True}, ref_adam,
         {"Param": PARAM, "Moment1": rand(-0.1, 0.1), "Moment2": rand(0.0, 0.1)},
         {"ParamOut": "Param", "Moment1Out": "Moment1", "Moment2Out": "Moment2"},
         scalars=("Beta1Pow", "Beta2Pow"), id="lazy"),
    Case("rmsprop", {"decay": 0.9, "epsilon": 1e-6, "momentum": 0.0, "centered": False}, ref_rmsprop,
         {"Param": PARAM, "MeanSquare": ONES, "Moment": ZEROS},
         {"ParamOut": "Param", "MomentOut": "Moment", "MeanSquareOut": "MeanSquare"}),
    Case("rmsprop", {"decay": 0.9, "epsilon": 1e-6, "momentum": 0.5, "centered": True}, ref_rmsprop,
         {"Param": PARAM, "MeanSquare": ONES, "Moment": ZEROS, "MeanGrad": ZEROS},
         {"ParamOut": "Param", "MomentOut": "Moment", "MeanSquareOut": "MeanSquare", "MeanGradOut": "MeanGrad"},
         id="centered"),
    Case("ftrl", {"l1": 0.01, "l2": 0.02, "lr_power": -0.5}, ref_ftrl,
         {"Param": PARAM, "SquaredAccumulator": rand(0.1, 0.5), "LinearAccumulator": rand(-0.1, 0.1)},
         {"ParamOut": "Param", "SquaredAccumOut": "SquaredAccumulator", "LinearAccumOut": "LinearAccumulator"}),
    Case("ftrl", {"l1": 0.01, "l2": 0.02, "lr_power": -0.7}, ref_ftrl,
         {"Param": PARAM, "SquaredAccumulator": rand(0.1, 0.5), "LinearAccumulator": rand(-0.1, 0.1)},
         {"ParamOut": "Param", "SquaredAccumOut": "SquaredAccumulator", "LinearAccumOut": "LinearAccumulator"},
         id="power"),
]


def _grad(rng: np.random.Generator, sparse: bool) -> Any:
    if sparse:
        return SPARSE_ROWS.copy(), rng.uniform(-1.0, 1.0, (len(SPARSE_ROWS), WIDTH))
    return rng.uniform(-1.0, 1.0, (HEIGHT, WIDTH))


def _to_jax(grad: Any, dtype: str) -> Any:
    if isinstance(grad, tuple):
        return SelectedRows(jnp.asarray(grad[0]), jnp.asarray(grad[1], dtype), HEIGHT)
    return jnp.asarray(grad, dtype)


def _run_case(case: Case, dtype: str, sparse: bool) -> None:
    rng = np.random.default_rng(7)
    state = {k: make(rng) for k, make in case.state.items()}
    state.update({s: np.array([0.9 if s == "Beta1Pow" else 0.999]) for s in case.scalars})
    lr = 0.05
    kern = get_kernel(case.op)
    jitted = jax.jit(lambda ins: kern(ins, case.attrs))
    # Values stored in the kernel's dtype; the reference starts from the same (rounded) values.
    state = {k: v.astype(dtype).astype(np.float64) for k, v in state.items()}
    for step in range(5):
        grad = _grad(rng, sparse)
        grad = (grad[0], grad[1].astype(dtype).astype(np.float64)) if sparse else grad.astype(dtype).astype(np.float64)
        ins = {k: [jnp.asarray(v, dtype)] for k, v in state.items()}
        ins["Grad"] = [_to_jax(grad, dtype)]
        ins["LearningRate"] = [jnp.asarray([lr], dtype)]
        outs = jitted(ins)
        if step == 0:
            eager = kern(ins, case.attrs)
            for slot in case.outs:
                np.testing.assert_allclose(np.asarray(eager[slot][0]), np.asarray(outs[slot][0]), **TOL[dtype])
        expected = case.ref(state, grad, lr, case.attrs)
        assert set(outs) == set(case.outs), f"{case.op} produced slots {sorted(outs)}"
        for out_slot, in_slot in case.outs.items():
            got = outs[out_slot][0]
            assert got.dtype == jnp.dtype(dtype), f"{out_slot} has dtype {got.dtype}, expected {dtype}"
            assert got.shape == (HEIGHT, WIDTH)
            np.testing.assert_allclose(np.asarray(got, np.float64), expected[in_slot], **TOL[dtype],
                                       err_msg=f"{case.op} {out_slot} at step {step}")
        state.update({k: np.asarray(outs[o][0], np.float64) for o, k in case.outs.items()})
        for s in case.scalars:
            state[s] = expected[s].astype(dtype).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("case", CASES, ids=[c.op + (f"-{c.id}" if c.id else "") for c in CASES])
def test_optimizer_matches_numpy(case: Case, dtype: str, sparse: bool) -> None:
    _run_case(case, dtype, sparse)


def test_sparse_touched_only_semantics() -> None:
    """adagrad and lazy adam leave untouched rows exactly as they were; momentum moves every row."""
    param = jnp.arange(HEIGHT * WIDTH, dtype=jnp.float32).reshape(HEIGHT, WIDTH) / 10
    grad = SelectedRows(jnp.asarray([1, 1]), jnp.ones((2, WIDTH), jnp.float32), HEIGHT)
    lr = jnp.asarray([0.1], jnp.float32)
    ada = get_kernel("adagrad")({"Param": [param], "Grad": [grad], "Moment": [jnp.zeros_like(param)],
                                 "LearningRate": [lr]}, {"epsilon": 1e-6})
    untouched = np.array([0, 2, 3, 4, 5])
    np.testing.assert_array_equal(np.asarray(ada["ParamOut"][0])[untouched], np.asarray(param)[untouched])
    # merged gradient 2 on row 1: moment 4, step lr * 2 / (2 + eps)
    np.testing.assert_allclose(np.asarray(ada["MomentOut"][0])[1], 4.0)
    np.testing.assert_allclose(np.asarray(ada["ParamOut"][0])[1], np.asarray(param)[1] - 0.1, rtol=1e-5)
    mom = get_kernel("momentum")({"Param": [param], "Grad": [grad], "Velocity": [jnp.ones_like(param)],
                                  "LearningRate": [lr]}, {"mu": 0.5, "use_nesterov": False})
    np.testing.assert_allclose(np.asarray(mom["ParamOut"][0])[0], np.asarray(param)[0] - 0.05, rtol=1e-6)


def test_merge_rows_sums_duplicates_with_static_size() -> None:
    grad = SelectedRows(jnp.asarray([3, 1, 3, 0]), jnp.asarray([[1.0], [2.0], [4.0], [8.0]]), 5)
    merged = jax.jit(merge_rows)(grad)
    np.testing.assert_array_equal(np.asarray(merged.rows), [0, 1, 3, 5])  # 5 == height: padding
    np.testing.assert_array_equal(np.asarray(merged.values), [[8.0], [2.0], [5.0], [0.0]])
    np.testing.assert_array_equal(np.asarray(merged.to_dense()), np.asarray(grad.to_dense()))


def test_lr_and_accumulators_keep_param_dtype() -> None:
    """A float64 LearningRate does not promote a float32 parameter."""
    param = jnp.ones((2, 2), jnp.float32)
    out = get_kernel("sgd")({"Param": [param], "Grad": [param], "LearningRate": [jnp.asarray([0.5])]}, {})
    assert out["ParamOut"][0].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out["ParamOut"][0]), np.full((2, 2), 0.5, np.float32))


# --- clipping
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_clip(sparse: bool) -> None:
    rng = np.random.default_rng(1)
    attrs = {"min": -0.3, "max": 0.4}
    kern = jax.jit(lambda ins: get_kernel("clip")(ins, attrs))
    if sparse:
        values = rng.uniform(-0.3, 0.3, (4, WIDTH)).astype(np.float32)
        x = SelectedRows(jnp.asarray(SPARSE_ROWS), jnp.asarray(values), HEIGHT)
        out = kern({"X": [x]})["Out"][0]
        assert isinstance(out, SelectedRows)
        dense = densify(SPARSE_ROWS, values.astype(np.float64))
        expected = np.zeros_like(dense)
        touched = sorted(set(SPARSE_ROWS.tolist()))
        expected[touched] = np.clip(dense[touched], -0.3, 0.4)  # merged first: row 4 sums two values
        np.testing.assert_allclose(np.asarray(out.to_dense()), expected, rtol=1e-6)
    else:
        x = rng.uniform(-1, 1, (HEIGHT, WIDTH)).astype(np.float32)
        out = kern({"X": [jnp.asarray(x)]})["Out"][0]
        np.testing.assert_array_equal(np.asarray(out), np.clip(x, np.float32(-0.3), np.float32(0.4)))


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_clip_by_norm(sparse: bool, max_norm: float) -> None:
    rng = np.random.default_rng(2)
    kern = jax.jit(lambda ins: get_kernel("clip_by_norm")(ins, {"max_norm": max_norm}))
    if sparse:
        values = rng.uniform(-1, 1, (4, WIDTH))
        out = kern({"X": [SelectedRows(jnp.asarray(SPARSE_ROWS), jnp.asarray(values), HEIGHT)]})["Out"][0]
        x, got = densify(SPARSE_ROWS, values), np.asarray(out.to_dense())
    else:
        x = rng.uniform(-1, 1, (HEIGHT, WIDTH))
        got = np.asarray(kern({"X": [jnp.asarray(x)]})["Out"][0])
    norm = np.sqrt(np.sum(x * x))
    expected = x * max_norm / norm if norm > max_norm else x
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_clip_by_norm_of_zero_is_zero() -> None:
    out = get_kernel("clip_by_norm")({"X": [jnp.zeros((3,), jnp.float32)]}, {"max_norm": 1.0})["Out"][0]
    np.testing.assert_array_equal(np.asarray(out), np.zeros(3, np.float32))


# --- whole programs through the Executor
def test_adam_lazy_program_with_sparse_grad_feed() -> None:
    """An adam op with a fed SelectedRows gradient, run 3 times by the Executor (params donated)."""
    prog = Program()
    block = prog.global_block()
    block.create_parameter("w", [HEIGHT, WIDTH], "float32")
    for name, shape in [("m1", [HEIGHT, WIDTH]), ("m2", [HEIGHT, WIDTH]), ("b1p", [1]), ("b2p", [1]), ("lr", [1])]:
        block.create_var(name, shape, "float32", persistable=True)
    block.create_var("w@GRAD", [HEIGHT, WIDTH], "float32", type="selected_rows")
    attrs = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "lazy_mode": True}
    block.append_op("adam", inputs={"Param": "w", "Grad": "w@GRAD", "LearningRate": "lr", "Moment1": "m1",
                                    "Moment2": "m2", "Beta1Pow": "b1p", "Beta2Pow": "b2p"},
                    outputs={"ParamOut": "w", "Moment1Out": "m1", "Moment2Out": "m2"}, attrs=attrs)
    rng = np.random.default_rng(3)
    w0 = rng.uniform(-1, 1, (HEIGHT, WIDTH)).astype(np.float32)
    scope = Scope()
    for name, value in [("w", w0), ("m1", np.zeros_like(w0)), ("m2", np.zeros_like(w0)),
                        ("b1p", np.array([0.9], np.float32)), ("b2p", np.array([0.999], np.float32)),
                        ("lr", np.array([0.01], np.float32))]:
        scope.set_var(name, jnp.asarray(value))
    exe = runtime.Executor()
    st = {"Param": w0.astype(np.float64), "Moment1": np.zeros((HEIGHT, WIDTH)), "Moment2": np.zeros((HEIGHT, WIDTH)),
          "Beta1Pow": np.array([0.9]), "Beta2Pow": np.array([0.999])}
    for _ in range(3):
        grad = _grad(rng, True)
        grad = (grad[0], grad[1].astype(np.float32).astype(np.float64))
        feed = {"w@GRAD": SelectedRows(jnp.asarray(grad[0]), jnp.asarray(grad[1], jnp.float32), HEIGHT)}
        (w,) = exe.run(prog, feed=feed, fetch_list=["w"], scope=scope)
        st.update({k: v for k, v in ref_adam(st, grad, 0.01, attrs).items() if not k.startswith("Beta")})
        np.testing.assert_allclose(w, st["Param"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(w[[0, 3, 5]], w0[[0, 3, 5]])  # never touched
