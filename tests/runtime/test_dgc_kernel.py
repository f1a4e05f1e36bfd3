"""The ``dgc_momentum`` kernel against the numpy reference (``tests.runtime.dgc_reference``), with a group
of one and with two trainers (``jax.vmap`` with a named axis stands for the shard_map'd step: the kernel's
``psum``/``all_gather`` run over it), through the rampup and past it, float64 (tolerance 1e-12).
Also: the static top-k size, the sparsity schedule, and the schema's checks."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ir.core import Program
from ir.errors import FlotillaError
from runtime.kernels.collective import collective_axis, dgc_k, dgc_stage
from runtime.kernels.registry import get_kernel
from tests.runtime.dgc_reference import dgc_step

pytestmark = pytest.mark.usefixtures("x64")
SHAPE = (5, 8)
LR = 0.1


def _attrs(**kw: Any) -> dict[str, Any]:
    return {"mu": 0.9, "use_nesterov": False, "rampup_begin_step": 2, "rampup_step": 4,
            "sparsity": [0.5, 0.75, 0.9, 0.975], "local_grad_clip_norm": -1.0, "num_trainers": 0, **kw}


def _run(attrs: dict[str, Any], nranks: int, steps: int = 9) -> None:
    rng = np.random.default_rng(7)
    param = rng.normal(size=SHAPE)
    us = [np.zeros(SHAPE) for _ in range(nranks)]
    vs = [np.zeros(SHAPE) for _ in range(nranks)]
    kern = get_kernel("dgc_momentum")

    def one_rank(p: Any, u: Any, v: Any, g: Any, s: Any) -> Any:
        out = kern({"Param": [p], "Grad": [g], "U": [u], "V": [v], "LearningRate": [jnp.full((1,), LR)],
                    "Step": [s]}, attrs)
        return out["ParamOut"][0], out["UOut"][0], out["VOut"][0], out["StepOut"][0]

    def all_ranks(p: Any, u: Any, v: Any, g: Any, s: Any) -> Any:
        if nranks == 1:
            r = one_rank(p[0], u[0], v[0], g[0], s[0])
            return tuple(x[None] for x in r)
        with collective_axis("r"):
            return jax.vmap(one_rank, axis_name="r")(p, u, v, g, s)

    step_fn = jax.jit(all_ranks)
    jp, ju, jv = (jnp.asarray(np.stack(x)) for x in ([param] * nranks, us, vs))
    js = jnp.zeros((nranks, 1), jnp.float32)
    for t in range(steps):
        grads = [rng.normal(size=SHAPE) * (1 + r) for r in range(nranks)]
        param, us, vs = dgc_step(param, us, vs, grads, t, LR, attrs)
        jp, ju, jv, js = step_fn(jp, ju, jv, jnp.asarray(np.stack(grads)), js)
        for r in range(nranks):
            np.testing.assert_allclose(np.asarray(jp[r]), param, rtol=1e-12, atol=1e-12, err_msg=f"param step {t}")
            np.testing.assert_allclose(np.asarray(ju[r]), us[r], rtol=1e-12, atol=1e-12, err_msg=f"U step {t}")
            np.testing.assert_allclose(np.asarray(jv[r]), vs[r], rtol=1e-12, atol=1e-12, err_msg=f"V step {t}")
        assert np.all(np.asarray(js) == t + 1)


@pytest.mark.parametrize("nranks", [1, 2])
@pytest.mark.parametrize("extra", [{}, {"use_nesterov": True}, {"local_grad_clip_norm": 1.5},
                                   {"local_grad_clip_norm": 1.5, "num_trainers": 4}, {"rampup_begin_step": 0,
                                                                                       "sparsity": [0.9]}])
def test_kernel_equals_numpy_reference(nranks: int, extra: dict[str, Any]) -> None:
    _run(_attrs(**extra), nranks)


def test_the_reference_itself_sends_k_entries_and_keeps_the_rest() -> None:
    # 40 entries at sparsity 0.9: 4 sent (zeroed in V), 36 kept; mass is conserved between V and the update.
    rng = np.random.default_rng(1)
    g = rng.normal(size=SHAPE)
    attrs = _attrs(rampup_begin_step=0, sparsity=[0.9], mu=0.0)
    p, _, vs = dgc_step(np.zeros(SHAPE), [np.zeros(SHAPE)], [np.zeros(SHAPE)], [g], 0, 1.0, attrs)
    assert np.count_nonzero(p) == 4 and np.count_nonzero(vs[0]) == 36
    np.testing.assert_allclose(-p + vs[0], g)
    assert np.min(np.abs(p[p != 0])) >= np.max(np.abs(vs[0]))


def test_k_and_schedule() -> None:
    assert [dgc_k(1000, s) for s in (0.75, 0.9375, 0.984375, 0.996, 0.999)] == [250, 62, 15, 4, 1]
    assert dgc_k(10, 0.999) == 1
    stages = [int(dgc_stage(jnp.asarray(t), 3, 10, 5)) for t in range(3, 16)]
    assert stages == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4]


def test_schema_refuses_sparsity_outside_0_1() -> None:
    prog = Program()
    block = prog.global_block()
    for name, shape in (("p", [4]), ("g", [4]), ("u", [4]), ("v", [4]), ("lr", [1]), ("s", [1])):
        block.create_var(name, shape=shape, dtype="float32")
    with pytest.raises(FlotillaError, match=r"sparsity \[1.0\] must be a non-empty list of values inside \(0, 1\)"):
        block.append_op("dgc_momentum", {"Param": ["p"], "Grad": ["g"], "U": ["u"], "V": ["v"],
                                         "LearningRate": ["lr"], "Step": ["s"]},
                        {"ParamOut": ["p"], "UOut": ["u"], "VOut": ["v"], "StepOut": ["s"]},
                        {"mu": 0.9, "sparsity": [1.0]})
