"""The registry-wide kernel test, and the math/nn kernels' special cases.

Parametrised over the whole op registry:
(a) every op type with a kernel (registered, or a ``*_grad`` served by ``jax.vjp``) has a sample in
    ``op_samples.SAMPLES`` or is listed in ``TESTED_ELSEWHERE``; every op type without one is listed in
    ``NO_KERNEL_YET``;
(b) each sample's one-op Program runs through ``runtime.Executor`` and every output has the shape
    (-1 matches any extent), dtype and variable type shape inference declared;
(c) the outputs match the sample's numpy reference (or its property check, for random ops);
(d) each differentiable op's gradient ops (from ``get_op_def(t).make_grad``), run in float64, agree
    with central finite differences of the forward kernel (eps 1e-6).
"""
from __future__ import annotations

import pathlib
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime
from ir.core import Program
from ir.names import GRAD_SUFFIX
from ir.ops import all_op_defs, get_op_def
from ir.ops.registry import REQUIRED
from runtime.kernels.registry import RNG_SLOT, get_kernel, has_kernel, registered_kernel_types
from runtime.scope import Scope, SelectedRows
from tests.runtime.op_samples import SAMPLES, Built, auc_np, build, build_with_grad, run, sample_id

REPO = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("x64")  # kernels are called directly too, not only through Executor.run

TESTED_ELSEWHERE = {
    **{t: "tests/runtime/test_optimizer_kernels.py"
       for t in ("sgd", "momentum", "adagrad", "adam", "rmsprop", "decayed_adagrad", "ftrl")},
    **{t: "tests/runtime/test_io.py"
       for t in ("delete_var", "save", "load", "fake_init", "save_combine", "load_combine")},
    **{t: "tests/runtime/rpc/test_rpc_kernels.py"
       for t in ("split_byref", "split_selected_rows", "split_ids", "merge_ids", "lookup_sparse_table",
                 "ref_by_trainer_id")},
    **{t: "tests/runtime/rpc/test_ps_training.py"
       for t in ("send", "recv", "send_barrier", "fetch_barrier", "prefetch", "listen_and_serv", "checkpoint_notify")},
    "geo_sync": "tests/runtime/rpc/test_geo_sgd.py",
    "geo_table_init": "tests/runtime/rpc/test_geo_sgd.py",
    "recompute_barrier": "tests/ir/test_recompute.py",
    **{t: "tests/runtime/test_dgc_kernel.py" for t in ("dgc", "dgc_allreduce", "dgc_momentum", "c_allgather")},
    **{t: "tests/runtime/collective/test_collective_training.py"
       for t in ("gen_nccl_id", "c_allreduce_sum", "c_broadcast", "c_local_sgd")},
    **{t: "tests/flotilla/jax/test_capture.py" for t in ("jax_function", "jax_function_grad", "load_value")},
}

# Op types whose kernels come with a later issue (the number is that issue's).
NO_KERNEL_YET: dict[str, int] = {}

ALL_OP_TYPES = [d.type for d in all_op_defs()]
KERNEL_TYPES = sorted(set(registered_kernel_types()) | {t for t in ALL_OP_TYPES if has_kernel(t)})
SAMPLED = set(SAMPLES) | {f"{t}_grad" for t, samples in SAMPLES.items() if any(s.grad for s in samples)}
CASES = [(t, i) for t, samples in SAMPLES.items() for i in range(len(samples))]
CASE_IDS = [sample_id(t, i, SAMPLES[t][i]) for t, i in CASES]
GRAD_CASES = [(t, i) for t, i in CASES if SAMPLES[t][i].grad]
GRAD_IDS = [sample_id(t, i, SAMPLES[t][i]) for t, i in GRAD_CASES]


# --- (a) coverage -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op_type", KERNEL_TYPES)
def test_every_kernel_is_tested(op_type: str) -> None:
    if op_type in TESTED_ELSEWHERE:
        assert (REPO / TESTED_ELSEWHERE[op_type]).is_file(), f"{op_type}: {TESTED_ELSEWHERE[op_type]} is missing"
        return
    assert op_type in SAMPLED, f"kernel of {op_type!r} has no sample in tests/runtime/op_samples.py"


@pytest.mark.parametrize("op_type", ALL_OP_TYPES)
def test_every_op_has_a_kernel_or_an_issue(op_type: str) -> None:
    if op_type in NO_KERNEL_YET:
        assert not has_kernel(op_type), f"{op_type} has a kernel now: remove it from NO_KERNEL_YET and test it"
    else:
        assert has_kernel(op_type), f"op type {op_type!r} has no kernel"


def test_every_differentiable_sampled_op_checks_its_gradient() -> None:
    missing = [t for t in SAMPLES if get_op_def(t).has_grad and not any(s.grad for s in SAMPLES[t])]
    assert not missing, f"differentiable ops without a gradient-checked sample: {missing}"


def test_samples_name_registered_ops_and_have_a_reference() -> None:
    for t, samples in SAMPLES.items():
        get_op_def(t)
        for s in samples:
            assert s.ref is not None or s.check is not None, f"{t}: sample {s.label!r} checks nothing"


# --- (b) and (c) forward ----------------------------------------------------------------------------------------------
def _numpy(value: Any) -> np.ndarray:
    return np.asarray(value.to_dense() if isinstance(value, SelectedRows) else value)


def _check_declared(built: Built, names: list[str], values: list[Any]) -> None:
    block = built.program.global_block()
    for name, value in zip(names, values):
        var = block.var(name)
        if var.type == "selected_rows":
            assert isinstance(value, SelectedRows), f"{name}: declared selected_rows, got {type(value).__name__}"
            shape = value.shape
        else:
            assert not isinstance(value, SelectedRows), f"{name}: declared {var.type}, got SelectedRows"
            shape = tuple(value.shape)
        assert str(value.dtype) == var.dtype, f"{name}: kernel dtype {value.dtype}, inferred {var.dtype}"
        assert len(shape) == len(var.shape) and all(d in (-1, s) for d, s in zip(var.shape, shape)), \
            f"{name}: kernel shape {list(shape)}, inferred {list(var.shape)}"


@lru_cache(maxsize=None)
def _forward(op_type: str, i: int) -> tuple[Built, dict[str, list[Any]]]:
    built = build(op_type, SAMPLES[op_type][i])
    names = [n for names in built.outputs.values() for n in names]
    values = iter(run(built, names))
    return built, {slot: [next(values) for _ in names] for slot, names in built.outputs.items()}


@pytest.mark.parametrize("op_type,i", CASES, ids=CASE_IDS)
def test_shape_inference_matches_kernel(op_type: str, i: int) -> None:
    built, outs = _forward(op_type, i)
    for slot, names in built.outputs.items():
        _check_declared(built, names, outs[slot])


@pytest.mark.parametrize("op_type,i", CASES, ids=CASE_IDS)
def test_kernel_matches_reference(op_type: str, i: int) -> None:
    sample = SAMPLES[op_type][i]
    built, outs = _forward(op_type, i)
    attrs = dict(built.op.attrs)
    got = {slot: [_numpy(v) for v in values] for slot, values in outs.items()}
    if sample.check is not None:
        sample.check(got, sample.inputs, attrs)
    if sample.ref is not None:
        expected = sample.ref(sample.inputs, attrs)
        for slot, values in expected.items():
            assert len(got[slot]) == len(values), slot
            for g, e in zip(got[slot], values):
                e = np.asarray(e)
                if g.dtype.kind in "biu":
                    np.testing.assert_array_equal(g, e.astype(g.dtype), err_msg=slot)
                else:
                    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=slot)


# --- (d) gradients ----------------------------------------------------------------------------------------------------
EPS, RTOL, ATOL = 1e-6, 1e-5, 1e-8


def _finite_difference(op_type: str, built: Built) -> dict[str, np.ndarray]:
    """Central differences of sum(out * cotangent) over the forward kernel, per forward input with a
    gradient output, in float64."""
    attrs = dict(built.op.attrs)
    kern = get_kernel(op_type)
    random = "random" in get_op_def(op_type).traits
    assert not random or attrs["seed"], f"{op_type}: a gradient-checked random op needs a nonzero seed attr"
    cots = {slot: [built.feed[n + GRAD_SUFFIX] for n in names] for slot, names in built.outputs.items()
            if all(n + GRAD_SUFFIX in built.feed for n in names)}

    def loss(ins: dict[str, list[Any]]) -> Any:
        if random:  # the executor's key for an op with a nonzero seed
            ins = {**ins, RNG_SLOT: [jax.random.PRNGKey(attrs["seed"])]}
        outs = kern(ins, attrs)
        return sum(jnp.sum(o * c) for slot, cs in cots.items() for o, c in zip(outs[slot], cs))

    base = {slot: [built.feed[n] for n in names] for slot, names in built.inputs.items()}
    fd: dict[str, np.ndarray] = {}
    for slot, names in built.inputs.items():
        for j, name in enumerate(names):
            if name not in built.grads:
                continue
            x = np.asarray(base[slot][j])
            steps = np.eye(x.size).reshape((x.size,) + x.shape) * EPS
            perturbed = np.concatenate([x + steps, x - steps])  # every +eps, then every -eps, one call

            def at(xv: Any, slot: str = slot, j: int = j) -> Any:
                ins = {s: list(v) for s, v in base.items()}
                ins[slot][j] = xv
                return loss(ins)

            vals = np.asarray(jax.jit(jax.vmap(at))(perturbed))
            fd[name] = ((vals[:x.size] - vals[x.size:]) / (2 * EPS)).reshape(x.shape)
    return fd


@pytest.mark.parametrize("op_type,i", GRAD_CASES, ids=GRAD_IDS)
def test_gradient_matches_finite_differences(op_type: str, i: int) -> None:
    built = build_with_grad(op_type, SAMPLES[op_type][i])
    assert built.grads, f"{op_type}: make_grad produced no gradient outputs"
    grad_names = list(built.grads.values())
    values = run(built, grad_names)
    _check_declared(built, grad_names, values)
    fd = _finite_difference(op_type, built)
    assert set(fd) == set(built.grads), (sorted(fd), sorted(built.grads))
    for fwd_name, g_name in built.grads.items():
        got = _numpy(values[grad_names.index(g_name)])
        np.testing.assert_allclose(got, fd[fwd_name], rtol=RTOL, atol=ATOL, err_msg=f"{op_type}: d/d {fwd_name}")


# --- special cases ------------------------------------------------------------------------------------------------
def _run_kernel(op_type: str, ins: dict[str, list[Any]], **attrs: Any) -> dict[str, list[Any]]:
    full = {a.name: a.default for a in get_op_def(op_type).attrs if a.default is not REQUIRED}
    full.update(attrs)
    return jax.jit(lambda i: get_kernel(op_type)(i, full))(ins)


def test_sparse_lookup_table_grad_is_selected_rows_of_the_ids() -> None:
    w = jnp.arange(12.0).reshape(6, 2)
    ids = jnp.asarray([[3], [0], [3], [5]], jnp.int64)
    g = jnp.arange(8.0).reshape(4, 2) + 1
    out = _run_kernel("lookup_table_grad", {"W": [w], "Ids": [ids], "Out@GRAD": [g]}, is_sparse=True, padding_idx=0)
    sr = out["W@GRAD"][0]
    assert isinstance(sr, SelectedRows) and sr.height == 6
    np.testing.assert_array_equal(np.asarray(sr.rows), [3, 0, 3, 5])
    np.testing.assert_array_equal(np.asarray(sr.values), [[1, 2], [0, 0], [5, 6], [7, 8]])
    dense = _run_kernel("lookup_table_grad", {"W": [w], "Ids": [ids], "Out@GRAD": [g]}, padding_idx=0)["W@GRAD"][0]
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(sr.to_dense()))
    np.testing.assert_array_equal(np.asarray(dense)[3], [6, 8])


def test_sum_of_selected_rows_concatenates_rows_and_values() -> None:
    a = SelectedRows(jnp.asarray([1, 4], jnp.int64), jnp.ones((2, 3), jnp.float32), 5)
    b = SelectedRows(jnp.asarray([4], jnp.int64), jnp.full((1, 3), 2.0, jnp.float32), 5)
    out = _run_kernel("sum", {"X": [a, b]})["Out"][0]
    assert isinstance(out, SelectedRows) and out.height == 5
    np.testing.assert_array_equal(np.asarray(out.rows), [1, 4, 4])
    assert out.values.shape == (3, 3) and out.values.dtype == jnp.float32
    mixed = _run_kernel("sum", {"X": [jnp.ones((5, 3), jnp.float32), a]})["Out"][0]
    assert not isinstance(mixed, SelectedRows)
    np.testing.assert_array_equal(np.asarray(mixed)[[0, 1, 4]], [[1] * 3, [2] * 3, [2] * 3])


def test_sequence_pool_of_an_all_padding_row_is_pad_value_with_zero_gradient() -> None:
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 2)))
    ids = jnp.asarray([[1, 2, 0], [0, 0, 0]], jnp.int64)
    for pooltype in ("AVERAGE", "SUM", "MAX", "SQRT", "FIRST", "LAST"):
        attrs = {"pooltype": pooltype, "padding_idx": 0, "is_test": False, "pad_value": 0.0}

        def f(x: Any) -> Any:
            return jnp.sum(get_kernel("sequence_pool")({"X": [x], "Ids": [ids]}, attrs)["Out"][0])

        out = _run_kernel("sequence_pool", {"X": [x], "Ids": [ids]}, **attrs)["Out"][0]
        np.testing.assert_array_equal(np.asarray(out)[1], [0.0, 0.0])
        grad = np.asarray(jax.jit(jax.grad(f))(x))
        assert np.isfinite(grad).all(), pooltype
        np.testing.assert_array_equal(grad[1], np.zeros((3, 2)))


def test_batch_norm_running_stats_update_with_momentum() -> None:
    x = np.random.default_rng(1).normal(size=(8, 3)).astype(np.float32)
    mean, var = np.full(3, 0.5, np.float32), np.full(3, 2.0, np.float32)
    out = _run_kernel("batch_norm", {"X": [x], "Scale": [np.ones(3, np.float32)], "Bias": [np.zeros(3, np.float32)],
                                     "Mean": [mean], "Variance": [var]}, momentum=0.9)
    np.testing.assert_allclose(np.asarray(out["MeanOut"][0]), 0.9 * mean + 0.1 * x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out["VarianceOut"][0]), 0.9 * var + 0.1 * x.var(0), rtol=1e-5)
    assert out["Y"][0].dtype == jnp.float32 and out["MeanOut"][0].dtype == jnp.float32


def test_dropout_grad_reuses_the_mask() -> None:
    mask = jnp.asarray([1.0, 0.0, 1.0, 0.0])
    g = jnp.asarray([1.0, 2.0, 3.0, 4.0])
    down = _run_kernel("dropout_grad", {"Mask": [mask], "Out@GRAD": [g]}, dropout_prob=0.5)["X@GRAD"][0]
    np.testing.assert_allclose(np.asarray(down), [1.0, 0.0, 3.0, 0.0])
    up = _run_kernel("dropout_grad", {"Mask": [mask], "Out@GRAD": [g]}, dropout_prob=0.5,
                     dropout_implementation="upscale_in_train")["X@GRAD"][0]
    np.testing.assert_allclose(np.asarray(up), [2.0, 0.0, 6.0, 0.0])


def test_dropout_draws_a_new_mask_each_step_unless_seeded() -> None:
    program = Program()
    block = program.global_block()
    block.create_var("x", (64,), "float32", is_data=True)
    block.create_var("out")
    block.create_var("mask")
    block.append_op("dropout", {"X": ["x"]}, {"Out": ["out"], "Mask": ["mask"]}, {"dropout_prob": 0.5})
    exe, scope = runtime.Executor(), Scope()
    feed = {"x": np.ones(64, np.float32)}
    (m1,) = exe.run(program, feed=feed, fetch_list=["mask"], scope=scope)
    (m2,) = exe.run(program, feed=feed, fetch_list=["mask"], scope=scope)
    assert not np.array_equal(m1, m2)


def test_auc_accumulates_across_batches() -> None:
    rng = np.random.default_rng(2)
    nt = 20
    program = Program()
    block = program.global_block()
    block.create_var("p", (-1, 2), "float32", is_data=True)
    block.create_var("label", (-1, 1), "int64", is_data=True)
    for name in ("pos", "neg"):
        block.create_var(name, (1, nt + 1), "int64", persistable=True)
    block.create_var("auc")
    block.append_op("auc", {"Predict": ["p"], "Label": ["label"], "StatPos": ["pos"], "StatNeg": ["neg"]},
                    {"AUC": ["auc"], "StatPosOut": ["pos"], "StatNegOut": ["neg"]},
                    {"num_thresholds": nt, "slide_steps": 0})
    scope = Scope()
    scope.set_var("pos", np.zeros((1, nt + 1), np.int64))
    scope.set_var("neg", np.zeros((1, nt + 1), np.int64))
    exe = runtime.Executor()
    all_p, all_l = [], []
    for _ in range(3):
        p1 = rng.uniform(size=(16,)).astype(np.float32)
        label = (rng.uniform(size=(16, 1)) < p1[:, None]).astype(np.int64)
        (value,) = exe.run(program, feed={"p": np.stack([1 - p1, p1], 1), "label": label}, fetch_list=["auc"],
                           scope=scope)
        all_p.append(p1)
        all_l.append(label[:, 0])
    p, lab = np.concatenate(all_p), np.concatenate(all_l)
    buckets = (p * nt).astype(int)
    pos = np.bincount(buckets[lab == 1], minlength=nt + 1)
    neg = np.bincount(buckets[lab == 0], minlength=nt + 1)
    np.testing.assert_array_equal(scope.numpy("pos")[0], pos)
    assert value.dtype == np.float64
    np.testing.assert_allclose(value, [auc_np(pos, neg)], rtol=1e-12)
    assert 0.5 < value[0] <= 1.0


def test_float32_kernels_do_not_promote_under_x64() -> None:
    x = jnp.ones((2, 3), jnp.float32)
    for op_type, ins, attrs in (("scale", {"X": [x]}, {"scale": 0.1, "bias": 0.2}),
                                ("matmul", {"X": [x], "Y": [x.T]}, {"alpha": 0.3}),
                                ("sigmoid_cross_entropy_with_logits", {"X": [x], "Label": [x]}, {"normalize": True}),
                                ("pool2d", {"X": [x.reshape(1, 1, 2, 3)]}, {"pooling_type": "avg", "ksize": [2, 2],
                                                                            "exclusive": False})):
        outs = _run_kernel(op_type, ins, **attrs)
        for slot, values in outs.items():
            assert all(v.dtype == jnp.float32 for v in values), (op_type, slot)

