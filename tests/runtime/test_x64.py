"""Flotilla leaves JAX's global configuration alone: after importing every Flotilla package and running a
program with int64 and float64 variables, a user's own JAX code still computes in JAX's defaults
(float32, int32), while the program's 64-bit values stay exact, on the main thread and on any other.

Run in a fresh interpreter: the test process has imported Flotilla long before, and JAX reads its
configuration once per process.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np

    before = jax.config.jax_enable_x64
    import flotilla, flotilla.cli, flotilla.cluster, flotilla.fleet, flotilla.fluid, flotilla.jax  # noqa: E401
    import ir, passes, runtime, transpiler  # noqa: E401
    from flotilla import fluid

    assert jax.config.jax_enable_x64 == before == False, "importing Flotilla changed jax_enable_x64"

    main, startup = fluid.Program(), fluid.Program()
    with fluid.program_guard(main, startup):
        ids = fluid.layers.data("ids", [1], dtype="int64")
        emb = fluid.layers.embedding(ids, size=[10, 4])
        big = fluid.layers.data("big", [1], dtype="int64")
        twice = fluid.layers.elementwise_add(big, big)
        fine = fluid.layers.data("fine", [1], dtype="float64")
        shifted = fluid.layers.scale(fine, scale=1.0, bias=1e-12)
    exe = fluid.Executor(fluid.CPUPlace())
    exe.run(startup)
    feed = {"ids": np.array([[3], [7]], np.int64), "big": np.array([[2 ** 40 + 1]], np.int64),
            "fine": np.array([[1.0]], np.float64)}

    def run_program():
        return exe.run(main, feed=feed, fetch_list=[emb, twice, shifted])

    def check_program(out):
        e, t, s = out
        assert e.shape == (2, 4) and e.dtype == np.float32, (e.shape, e.dtype)
        assert t.dtype == np.int64 and int(t[0, 0]) == 2 ** 41 + 2, (t.dtype, t)
        assert s.dtype == np.float64 and s[0, 0] == 1.0 + 1e-12, (s.dtype, s)

    def check_user_jax():
        assert not jax.config.jax_enable_x64
        assert jnp.ones(3).dtype == jnp.float32, jnp.ones(3).dtype
        assert jnp.array(1.5).dtype == jnp.float32, jnp.array(1.5).dtype
        assert jnp.arange(3).dtype == jnp.int32, jnp.arange(3).dtype
        assert jax.random.normal(jax.random.PRNGKey(0), (2,)).dtype == jnp.float32
        y = jax.jit(lambda x: x * 2.0)(np.ones(3, np.float64))  # numpy float64 in: float32 out, as JAX does
        assert y.dtype == jnp.float32, y.dtype

    check_program(run_program())
    check_user_jax()
    scope = runtime.Scope()  # selected rows made dense outside any run keep their dtype too
    scope.set_var("rows", runtime.SelectedRows(np.array([1, 3], np.int64), np.array([[1.0 + 1e-12], [2.0]]), 5))
    dense = scope.numpy("rows")
    assert dense.dtype == np.float64 and dense[1, 0] == 1.0 + 1e-12, (dense.dtype, dense)
    check_user_jax()

    # Another thread: the executor enters its 64-bit context there too, and leaves that thread's JAX alone.
    errors = []

    def in_thread():
        try:
            check_program(run_program())
            check_user_jax()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(60)
    assert not t.is_alive() and not errors, errors
    check_program(run_program())
    check_user_jax()
    assert jax.config.jax_enable_x64 == before
    print("OK")
''')


def test_plain_jax_stays_float32_after_importing_and_running_flotilla() -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
