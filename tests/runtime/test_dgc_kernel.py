"""DGC's kernels (``dgc``, ``dgc_allreduce``, ``dgc_momentum``; ``runtime.kernels.dgc``) chained as
``DGCMomentumOptimizer`` appends them, against the numpy reference (``tests.runtime.dgc_reference``), with a
group of one and with two trainers (``jax.vmap`` with a named axis stands for the shard_map'd step: the
exchange's ``psum``/``all_gather`` run over it), through the rampup and past it, float64 (tolerance 1e-12).
Also: top-k selection (exact and sampled) keeps the largest entries (sampled: also when more than k
entries pass the sample's threshold, and with ties), the residual keeps exactly what was
not sent, the schedule's arithmetic, the local clip, ``c_allgather``, and the schemas' checks."""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ir.core import Program
from ir.errors import FlotillaError
from ir.ops.dgc import dgc_k, dgc_stage
from runtime.kernels import dgc as dgc_kernels
from runtime.kernels.collective import collective_axis
from runtime.kernels.registry import get_kernel
from tests.runtime.dgc_reference import dgc_step

pytestmark = pytest.mark.usefixtures("x64")
SHAPES = [(5, 8), (3,)]
LR = 0.1


def _attrs(**kw: Any) -> dict[str, Any]:
    return {"mu": 0.9, "use_nesterov": False, "rampup_begin_step": 2, "rampup_step": 4,
            "sparsity": [0.5, 0.75, 0.9, 0.975], "local_grad_clip_norm": -1.0, "num_trainers": 0, **kw}


def _one_rank(attrs: dict[str, Any]) -> Any:
    """One trainer's step over every parameter: dgc each, one dgc_allreduce, dgc_momentum each."""
    enc, ex, upd = get_kernel("dgc"), get_kernel("dgc_allreduce"), get_kernel("dgc_momentum")
    enc_attrs = {**attrs, "m": attrs["mu"]}

    def step(ps: Any, us: Any, vs: Any, gs: Any, s: Any) -> Any:
        outs = [enc({"U": [u], "V": [v], "Grad": [g], "Step": [s]}, enc_attrs) for u, v, g in zip(us, vs, gs)]
        means = ex({"Grad": list(gs), "EncodeIndex": [o["EncodeIndex"][0] for o in outs],
                    "EncodeValue": [o["EncodeValue"][0] for o in outs], "Step": [s]}, attrs)["Out"]
        new_p, new_u = [], []
        for p, o, g in zip(ps, outs, means):
            r = upd({"Param": [p], "Grad": [g], "U": [o["UOut"][0]], "LearningRate": [jnp.full((1,), LR)],
                     "Step": [s]}, attrs)
            new_p.append(r["ParamOut"][0])
            new_u.append(r["UOut"][0])
        return new_p, new_u, [o["VOut"][0] for o in outs], s + 1

    return step


def _run(attrs: dict[str, Any], nranks: int, steps: int = 9) -> None:
    rng = np.random.default_rng(7)
    params = [rng.normal(size=s) for s in SHAPES]
    us = [[np.zeros(s) for _ in range(nranks)] for s in SHAPES]
    vs = [[np.zeros(s) for _ in range(nranks)] for s in SHAPES]
    one_rank = _one_rank(attrs)

    def all_ranks(p: Any, u: Any, v: Any, g: Any, s: Any) -> Any:
        with collective_axis("r" if nranks > 1 else None):
            if nranks == 1:
                return jax.tree_util.tree_map(lambda x: x[None], one_rank(*jax.tree_util.tree_map(
                    lambda x: x[0], (p, u, v, g, s))))
            return jax.vmap(one_rank, axis_name="r")(p, u, v, g, s)

    step_fn = jax.jit(all_ranks)
    jp = [jnp.asarray(np.stack([p] * nranks)) for p in params]
    ju = [jnp.asarray(np.stack(u)) for u in us]
    jv = [jnp.asarray(np.stack(v)) for v in vs]
    js = jnp.zeros((nranks, 1), jnp.float32)
    for t in range(steps):
        grads = [[rng.normal(size=s) * (1 + r) for r in range(nranks)] for s in SHAPES]
        for i in range(len(SHAPES)):
            params[i], us[i], vs[i] = dgc_step(params[i], us[i], vs[i], grads[i], t, LR, attrs)
        jp, ju, jv, js = step_fn(jp, ju, jv, [jnp.asarray(np.stack(g)) for g in grads], js)
        for i in range(len(SHAPES)):
            for r in range(nranks):
                np.testing.assert_allclose(np.asarray(jp[i][r]), params[i], rtol=1e-12, atol=1e-12,
                                           err_msg=f"param {i} step {t}")
                np.testing.assert_allclose(np.asarray(ju[i][r]), us[i][r], rtol=1e-12, atol=1e-12,
                                           err_msg=f"U {i} step {t}")
                np.testing.assert_allclose(np.asarray(jv[i][r]), vs[i][r], rtol=1e-12, atol=1e-12,
                                           err_msg=f"V {i} step {t}")
        assert np.all(np.asarray(js) == t + 1)


@pytest.mark.parametrize("nranks", [1, 2])
@pytest.mark.parametrize("extra", [{}, {"use_nesterov": True}, {"local_grad_clip_norm": 1.5},
                                   {"local_grad_clip_norm": 1.5, "num_trainers": 4},
                                   {"rampup_begin_step": 0, "sparsity": [0.9]}])
def test_ops_equal_numpy_reference(nranks: int, extra: dict[str, Any]) -> None:
    _run(_attrs(**extra), nranks)


def test_the_reference_itself_sends_k_entries_and_keeps_the_rest() -> None:
    # 40 entries at sparsity 0.9: 4 sent (zeroed in V), 36 kept; mass is conserved between V and the update.
    rng = np.random.default_rng(1)
    g = rng.normal(size=(5, 8))
    attrs = _attrs(rampup_begin_step=0, sparsity=[0.9], mu=0.0)
    p, _, vs = dgc_step(np.zeros((5, 8)), [np.zeros((5, 8))], [np.zeros((5, 8))], [g], 0, 1.0, attrs)
    assert np.count_nonzero(p) == 4 and np.count_nonzero(vs[0]) == 36
    np.testing.assert_allclose(-p + vs[0], g)
    assert np.min(np.abs(p[p != 0])) >= np.max(np.abs(vs[0]))


def _encode(v: np.ndarray, u: np.ndarray, g: np.ndarray, sparsity: float, mu: float = 0.5) -> dict[str, Any]:
    attrs = {"m": mu, "sparsity": [sparsity], "rampup_begin_step": 0, "rampup_step": 1}
    out = get_kernel("dgc")({"U": [jnp.asarray(u)], "V": [jnp.asarray(v)], "Grad": [jnp.asarray(g)],
                             "Step": [jnp.zeros((1,), jnp.float32)]}, attrs)
    return {k: np.asarray(x[0]) for k, x in out.items()}


@pytest.mark.parametrize("n, sparsity", [(400, 0.95), (200_000, 0.98)])  # exact top_k, then sampled (k > 2048)
def test_sent_plus_residual_is_the_accumulation_exactly(n: int, sparsity: float) -> None:
    rng = np.random.default_rng(3)
    u, v, g = (rng.normal(size=n) for _ in range(3))
    out = _encode(v, u, g, sparsity)
    accumulated = v + (0.5 * u + g)
    k = dgc_k(n, sparsity)
    sent = np.zeros(n)
    np.add.at(sent, out["EncodeIndex"], out["EncodeValue"])
    np.testing.assert_array_equal(sent + out["VOut"], accumulated)
    mask = sent != 0
    np.testing.assert_array_equal(out["UOut"][mask], 0.0)
    np.testing.assert_array_equal(out["UOut"][~mask], (0.5 * u + g)[~mask])
    assert out["EncodeIndex"].shape == (k,)
    assert (k > dgc_kernels.EXACT_K_MAX) == (n > 1000)  # the second case takes the sampled path
    order = np.sort(np.abs(accumulated))[::-1]
    if k <= dgc_kernels.EXACT_K_MAX:  # exact: precisely the k largest |V|
        assert np.count_nonzero(mask) == k
        assert np.min(np.abs(accumulated[mask])) >= np.max(np.abs(out["VOut"]))
    else:  # sampled threshold: close to k entries, all of them among the largest
        assert 0.7 * k <= np.count_nonzero(mask) <= k
        assert np.min(np.abs(accumulated[mask])) >= order[int(1.5 * k)]


def test_select_top_k_keeps_the_largest() -> None:
    a = jnp.asarray(np.random.default_rng(5).permutation(1000).astype(np.float64))
    idx, valid = dgc_kernels.select_top_k(a, 10)
    assert sorted(np.asarray(idx).tolist()) == sorted(np.argsort(-np.asarray(a))[:10].tolist())
    assert bool(np.all(np.asarray(valid)))
    idx, valid = dgc_kernels.select_top_k(a, 1000)  # k = numel: everything, in order
    assert np.asarray(idx).tolist() == list(range(1000)) and bool(np.all(np.asarray(valid)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("passing", [6000, 50_000])  # <= 2k: among the compacted candidates; more: all of a
def test_sampled_selection_keeps_the_largest_when_too_many_pass(dtype: Any, passing: int) -> None:
    """k above EXACT_K_MAX: the sample's threshold (1.0, by construction) lets ``passing`` > k entries
    through, increasing in index order (the first k in index order would be the smallest); the kept
    entries (k - k/RESELECT_SLACK to k of them) are the largest."""
    n, k = 100_000, 4096
    assert k > dgc_kernels.EXACT_K_MAX and k < passing
    samples = max(dgc_kernels.SAMPLE_MIN, int(n * dgc_kernels.SAMPLE_FRACTION))
    sampled = np.arange(0, n, n // samples)[:samples]
    ks = math.ceil(k * samples / n)
    a = np.zeros(n, dtype)
    a[sampled[:ks]] = 1.0  # the sample's top ks: threshold 1.0
    free = np.setdiff1d(np.arange(n), sampled)
    chosen = np.sort(np.random.default_rng(11).choice(free, passing - ks, replace=False))
    a[chosen] = 1.0 + np.arange(1, len(chosen) + 1) / len(chosen)  # distinct, the largest last
    idx, valid = dgc_kernels.select_top_k(jnp.asarray(a), k)
    kept = np.asarray(idx)[np.asarray(valid)]
    assert k - k // dgc_kernels.RESELECT_SLACK <= len(kept) <= k and len(set(kept.tolist())) == len(kept)
    assert sorted(kept.tolist()) == sorted(np.argsort(-a)[:len(kept)].tolist())


def test_sampled_selection_with_ties_keeps_exactly_k() -> None:
    n, k = 50_000, 3000
    a = np.ones(n, np.float32)
    a[-10:] = 2.0
    idx, valid = dgc_kernels.select_top_k(jnp.asarray(a), k)
    idx = np.asarray(idx)[np.asarray(valid)]
    assert len(idx) == k and len(set(idx.tolist())) == k
    assert set(range(n - 10, n)) <= set(idx.tolist())  # the 10 largest, then ties in index order
    assert sorted(idx.tolist())[:k - 10] == list(range(k - 10))


def test_k_and_schedule() -> None:
    assert [dgc_k(1000, s) for s in (0.75, 0.9375, 0.984375, 0.996, 0.999)] == [250, 62, 15, 4, 1]
    assert dgc_k(10, 0.999) == 1
    stages = [dgc_stage(t, 3, 10, 5) for t in range(3, 16)]
    assert stages == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4]
    uniq, table = dgc_kernels.unique_ks([250, 62, 1, 1, 1])
    assert uniq == [250, 62, 1] and table == [0, 1, 2, 2, 2]
    branches = [int(dgc_kernels.stage_branch(jnp.asarray(t), 3, 10, table)) for t in range(0, 16)]
    # before step 3: the dense branch 0; then 1 + the stage's distinct k
    assert branches == [0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3]


@pytest.mark.parametrize("num_trainers, expected_norm", [(4, 0.5), (1, 1.0)])
def test_local_clip_is_scaled_by_one_over_sqrt_n(num_trainers: int, expected_norm: float) -> None:
    g = np.full((16,), 3.0)  # norm 12
    attrs = {"m": 0.0, "sparsity": [0.5], "rampup_begin_step": 0, "rampup_step": 1, "local_grad_clip_norm": 1.0,
             "num_trainers": num_trainers}
    out = get_kernel("dgc")({"U": [jnp.zeros(16)], "V": [jnp.zeros(16)], "Grad": [jnp.asarray(g)],
                             "Step": [jnp.zeros((1,), jnp.float32)]}, attrs)
    total = np.asarray(out["VOut"][0]).copy()
    np.add.at(total, np.asarray(out["EncodeIndex"][0]), np.asarray(out["EncodeValue"][0]))
    np.testing.assert_allclose(np.linalg.norm(total), expected_norm, rtol=1e-12)


def test_c_allgather_concatenates_in_rank_order() -> None:
    kern = get_kernel("c_allgather")
    with collective_axis("r"):
        out = jax.vmap(lambda x: kern({"X": [x]}, {})["Out"][0], axis_name="r")(jnp.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(np.asarray(out), [[0, 1, 2, 3, 4, 5]] * 2)
    with collective_axis(None):
        np.testing.assert_array_equal(np.asarray(kern({"X": [jnp.arange(3.0)]}, {})["Out"][0]), [0, 1, 2])


def _block() -> Any:
    block = Program().global_block()
    for name, shape, dtype in (("g", [40], "float32"), ("u", [40], "float32"), ("v", [40], "float32"),
                               ("s", [1], "float32"), ("i", [], "int32"), ("x", [], "float32"),
                               ("xs", [3, 2], "float32"), ("ys", [], "float32")):
        block.create_var(name, shape=shape, dtype=dtype)
    return block


def test_shape_inference_of_the_encoded_pairs_and_allgather() -> None:
    block = _block()
    block.append_op("dgc", {"U": ["u"], "V": ["v"], "Grad": ["g"], "Step": ["s"]},
                    {"UOut": ["u"], "VOut": ["v"], "EncodeIndex": ["i"], "EncodeValue": ["x"]},
                    {"m": 0.9, "sparsity": [0.75, 0.9]})
    assert block.var("i").shape == (10,) and block.var("i").dtype == "int32"  # k of the first stage
    assert block.var("x").shape == (10,) and block.var("x").dtype == "float32"
    block.append_op("c_allgather", {"X": ["xs"]}, {"Out": ["ys"]}, {"nranks": 4})
    assert block.var("ys").shape == (12, 2)


def test_schemas_refuse_bad_sparsity_and_mismatched_pairs() -> None:
    block = _block()
    with pytest.raises(FlotillaError, match=r"sparsity \[1.0\] must be a non-empty list of values inside \(0, 1\)"):
        block.append_op("dgc", {"U": ["u"], "V": ["v"], "Grad": ["g"], "Step": ["s"]},
                        {"UOut": ["u"], "VOut": ["v"], "EncodeIndex": ["i"], "EncodeValue": ["x"]},
                        {"m": 0.9, "sparsity": [1.0]})
    block.create_var("i5", shape=[5], dtype="int32")
    block.create_var("x5", shape=[5], dtype="float32")
    with pytest.raises(FlotillaError, match=r"EncodeIndex\[0\] has shape \[5\]; expected \[4\]"):
        block.append_op("dgc_allreduce", {"Grad": ["g"], "EncodeIndex": ["i5"], "EncodeValue": ["x5"], "Step": ["s"]},
                        {"Out": ["g"]}, {"sparsity": [0.9]})
