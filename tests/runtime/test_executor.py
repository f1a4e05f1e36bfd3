"""Executor behaviour: user errors raise ``runtime.ExecutionError`` naming the variable or op and what was
expected (and leave the parameters untouched); compiled plans are reused across runs and rebuilt after the
program mutates; parameters are updated in place (donated buffers); fetch results are copies that later
runs do not invalidate; and Fluid's TestBasicModel network trains.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ir
import runtime
import runtime.executor as executor_module
from flotilla.fluid import layers, optimizer
from flotilla.fluid.param_attr import ParamAttr
from flotilla.fluid.initializer import Uniform
from runtime import ExecutionError

BATCH = 3


def build(lr: float = 0.1) -> tuple[ir.Program, ir.Program, ir.Variable]:
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup):
        x = layers.data("x", [8])
        y = layers.data("y", [4])
        pred = layers.fc(x, 4, param_attr=ParamAttr(name="w", initializer=Uniform(-0.5, 0.5, seed=1)),
                         bias_attr=ParamAttr(name="b"))
        loss = layers.mean(layers.square_error_cost(pred, y))
        optimizer.SGD(lr).minimize(loss)
    return main, startup, loss


def batch(n: int = BATCH, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 8)).astype(np.float32),
            "y": rng.standard_normal((n, 4)).astype(np.float32)}


@pytest.fixture
def ready() -> tuple[ir.Program, ir.Program, ir.Variable, runtime.Executor, runtime.Scope]:
    main, startup, loss = build()
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    return main, startup, loss, exe, scope


# --- errors ---------------------------------------------------------------------------------------------
def _message(err: pytest.ExceptionInfo[ExecutionError]) -> str:
    return str(err.value)


def test_missing_feed(ready: Any) -> None:
    main, _, loss, exe, scope = ready
    w = np.array(scope.numpy("w"))
    with pytest.raises(ExecutionError) as err:
        exe.run(main, feed={"x": batch()["x"]}, fetch_list=[loss], scope=scope)
    msg = _message(err)
    assert "feed variable 'y' is missing" in msg
    assert "elementwise_sub" in msg  # the op that reads it
    assert "feed={'y'" in msg  # the hint says how to fix it
    np.testing.assert_array_equal(scope.numpy("w"), w)


def test_feed_omitted_on_a_later_run_is_missing(ready: Any) -> None:
    """A feed from an earlier run must not be silently reused by a later run that omits it."""
    main, _, loss, exe, scope = ready
    exe.run(main, feed=batch(), fetch_list=[loss], scope=scope)
    assert scope.find_var("y") is None  # feeds live in the run's own scope
    with pytest.raises(ExecutionError) as err:
        exe.run(main, feed={"x": batch()["x"]}, fetch_list=[loss], scope=scope)
    assert "feed variable 'y' is missing" in _message(err)


def test_feed_of_wrong_shape(ready: Any) -> None:
    main, _, loss, exe, scope = ready
    feed = batch()
    feed["x"] = np.zeros((BATCH, 7), np.float32)
    with pytest.raises(ExecutionError) as err:
        exe.run(main, feed=feed, fetch_list=[loss], scope=scope)
    msg = _message(err)
    assert "'x'" in msg and "[3, 7]" in msg and "expected [-1, 8]" in msg


def test_feed_of_wrong_rank(ready: Any) -> None:
    main, _, loss, exe, scope = ready
    feed = batch()
    feed["y"] = np.zeros((BATCH, 4, 1), np.float32)
    with pytest.raises(ExecutionError, match=r"feed 'y' has shape \[3, 4, 1\], expected \[-1, 4\]"):
        exe.run(main, feed=feed, fetch_list=[loss], scope=scope)


def test_feed_of_wrong_dtype(ready: Any) -> None:
    main, _, loss, exe, scope = ready
    feed = batch()
    feed["x"] = feed["x"].astype(np.float64)
    with pytest.raises(ExecutionError) as err:
        exe.run(main, feed=feed, fetch_list=[loss], scope=scope)
    msg = _message(err)
    assert "'x'" in msg and "float64" in msg and "expected float32" in msg
    assert "astype('float32')" in msg


def test_feed_of_unknown_variable(ready: Any) -> None:
    main, _, loss, exe, scope = ready
    feed = batch()
    feed["xx"] = feed.pop("x")
    with pytest.raises(ExecutionError, match=r"(?s)'xx' is not a variable of the program.*did you mean 'x'"):
        exe.run(main, feed=feed, fetch_list=[loss], scope=scope)


def test_fetch_of_unknown_variable(ready: Any) -> None:
    main, _, _, exe, scope = ready
    w = np.array(scope.numpy("w"))
    with pytest.raises(ExecutionError) as err:
        exe.run(main, feed=batch(), fetch_list=["w@GRADD"], scope=scope)
    msg = _message(err)
    assert "fetch variable 'w@GRADD' is not a variable of the program" in msg
    assert "did you mean 'w@GRAD'" in msg
    np.testing.assert_array_equal(scope.numpy("w"), w)  # nothing ran


def test_op_without_kernel(ready: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    main, _, _, exe, scope = ready
    program = main.clone()
    block = program.global_block()
    op_type = "c_allreduce_sum"  # every registered op has a kernel now: take this one's away for the test
    import runtime.executor

    has = runtime.executor.has_kernel
    monkeypatch.setattr(runtime.executor, "has_kernel", lambda t: t != op_type and has(t))
    block.append_op(op_type, {"X": ["w@GRAD"]}, {"Out": ["w@GRAD"]}, {})
    index = len(block.ops) - 1
    w = np.array(scope.numpy("w"))
    with pytest.raises(ExecutionError) as err:
        exe.run(program, feed=batch(), scope=scope)
    msg = _message(err)
    assert f"block 0/op {index} ({op_type}) has no kernel" in msg
    assert "cannot run on this runtime yet" in msg  # a registered op, not a typo
    np.testing.assert_array_equal(scope.numpy("w"), w)  # rejected at planning, before running anything


def test_persistable_not_initialised() -> None:
    main, _, loss = build()
    exe, scope = runtime.Executor(), runtime.Scope()
    with pytest.raises(ExecutionError) as err:
        exe.run(main, feed=batch(), fetch_list=[loss], scope=scope)
    msg = _message(err)
    assert "persistable variable 'w' is not initialised" in msg
    assert "(mul)" in msg
    assert "run the startup program first" in msg


def test_errors_are_flotilla_errors() -> None:
    assert issubclass(ExecutionError, ir.FlotillaError)


# --- plan caching ---------------------------------------------------------------------------------------
class TraceCounter:
    """Wraps ``runtime.executor._trace_run`` so every trace of a pure run (a call of the Python function
    ``jax.jit`` compiles) is counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.traces = 0
        original = executor_module._trace_run

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            fn = original(*args, **kwargs)

            def counted(*a: Any, **k: Any) -> Any:
                self.traces += 1
                return fn(*a, **k)

            return counted

        monkeypatch.setattr(executor_module, "_trace_run", wrapped)


def _plans(exe: runtime.Executor, program: ir.Program) -> dict[Any, Any]:
    return dict(exe._plans.get(program, {}))


def test_plan_is_reused_across_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = TraceCounter(monkeypatch)
    main, startup, loss = build()
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    exe.run(main, feed=batch(seed=1), fetch_list=[loss], scope=scope)
    traced = counter.traces
    assert traced >= 1
    plan = next(iter(_plans(exe, main).values()))
    for seed in range(2, 6):
        exe.run(main, feed=batch(seed=seed), fetch_list=[loss], scope=scope)
    assert counter.traces == traced, "same program version and feed shapes must not retrace"
    assert list(_plans(exe, main).values()) == [plan]
    # A new batch size retraces (jax keys compilations on shapes) but keeps the plan; the old size is cached.
    exe.run(main, feed=batch(n=5), fetch_list=[loss], scope=scope)
    assert counter.traces == traced + 1
    exe.run(main, feed=batch(n=BATCH), fetch_list=[loss], scope=scope)
    assert counter.traces == traced + 1
    assert list(_plans(exe, main).values()) == [plan]


def test_plan_is_rebuilt_after_the_program_mutates(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = TraceCounter(monkeypatch)
    main, startup, loss = build()
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    exe.run(main, feed=batch(), fetch_list=[loss], scope=scope)
    before, version = counter.traces, main.version
    (old_plan,) = _plans(exe, main).values()

    with ir.program_guard(main, startup):
        doubled = layers.scale(loss, scale=2.0)
    assert main.version > version

    w = np.array(scope.numpy("w"))
    loss_value, doubled_value = exe.run(main, feed=batch(), fetch_list=[loss, doubled], scope=scope)
    assert counter.traces > before
    (new_plan,) = _plans(exe, main).values()
    assert new_plan is not old_plan
    np.testing.assert_allclose(doubled_value, 2.0 * loss_value, rtol=1e-6)
    assert not np.array_equal(scope.numpy("w"), w)  # the rebuilt plan still trains
    after = counter.traces
    exe.run(main, feed=batch(), fetch_list=[loss, doubled], scope=scope)
    assert counter.traces == after


# --- state across runs ----------------------------------------------------------------------------------
def test_parameters_are_updated_in_place(ready: Any) -> None:
    main, _, loss, exe, scope = ready
    feed = batch()
    for _ in range(3):
        w_buffer = scope.find_var("w")
        w = np.array(w_buffer)
        b = np.array(scope.numpy("b"))
        exe.run(main, feed=feed, fetch_list=[loss], scope=scope)
        # SGD's update, computed here: the scope holds the new value under the same name ...
        d = feed["x"] @ w + b - feed["y"]
        g = 2.0 * d / d.size
        np.testing.assert_allclose(scope.numpy("w"), w - 0.1 * feed["x"].T @ g, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(scope.numpy("b"), b - 0.1 * g.sum(axis=0), rtol=1e-5, atol=1e-7)
        # ... and the old buffer was donated to the compiled step, not kept alongside.
        assert w_buffer.is_deleted()
    assert scope.numpy("w").dtype == np.float32


def test_a_training_step_reuses_its_parameters_until_someone_else_writes_the_scope(
        ready: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    main, startup, loss, exe, scope = ready
    reads: list[str] = []
    real = executor_module.Executor._read
    monkeypatch.setattr(executor_module.Executor, "_read",
                        lambda self, sc, block, run, name, **kw: reads.append(name) or real(self, sc, block, run,
                                                                                               name, **kw))
    exe.run(main, feed=batch(seed=1), fetch_list=[loss], scope=scope)
    assert {"w", "b"} <= set(reads)
    reads.clear()
    exe.run(main, feed=batch(seed=2), fetch_list=[loss], scope=scope)
    assert set(reads) == {"x", "y"}  # only the feeds: the parameters are the ones the last step wrote
    # A write to the scope (the user's, another program's) is seen by the next step, and trains from there.
    w = np.full((8, 4), 0.25, np.float32)
    scope.set_var("w", w.copy())
    feed = batch(seed=3)
    b = np.array(scope.numpy("b"))
    exe.run(main, feed=feed, fetch_list=[loss], scope=scope)
    assert "w" in reads
    d = feed["x"] @ w + b - feed["y"]
    np.testing.assert_allclose(scope.numpy("w"), w - 0.1 * feed["x"].T @ (2.0 * d / d.size), rtol=1e-5, atol=1e-7)
    # So is a parent scope's write that a child scope sees, and another scope with the same program.
    child = scope.new_scope()
    exe.run(main, feed=batch(seed=4), fetch_list=[loss], scope=child)
    reads.clear()
    scope.set_var("b", np.zeros(4, np.float32))
    exe.run(main, feed=batch(seed=5), fetch_list=[loss], scope=child)
    assert "b" in reads
    other = runtime.Scope()
    exe.run(startup, scope=other)
    reads.clear()
    exe.run(main, feed=batch(seed=6), fetch_list=[loss], scope=other)
    assert {"w", "b"} <= set(reads)


def test_fetch_results_are_copies(ready: Any) -> None:
    main, _, loss, exe, scope = ready
    first = exe.run(main, feed=batch(seed=1), fetch_list=[loss, "w", "b"], scope=scope)
    kept = [a.copy() for a in first]
    assert all(isinstance(a, np.ndarray) for a in first)
    for seed in range(2, 5):
        later = exe.run(main, feed=batch(seed=seed), fetch_list=[loss, "w", "b"], scope=scope)
    for a, k in zip(first, kept):
        np.testing.assert_array_equal(a, k)  # still readable, still the value of the first run
    assert not np.array_equal(later[1], first[1])
    first[1][...] = 0.0  # writing into a result does not touch the scope
    assert not np.array_equal(scope.numpy("w"), first[1])


# --- Fluid's TestBasicModel -----------------------------------------------------------------------------
def test_basic_model_trains() -> None:
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup):
        x = layers.data("x", [1000])
        y = layers.data("y", [1000])
        pred = layers.fc(x, 1000, param_attr=ParamAttr(name="fc_w"), bias_attr=ParamAttr(name="fc_b"))
        loss = layers.mean(layers.square_error_cost(pred, y))
        optimizer.SGD(0.1).minimize(loss)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    assert scope.numpy("fc_w").shape == (1000, 1000) and scope.numpy("fc_b").shape == (1000,)
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((16, 1000)).astype(np.float32),
            "y": rng.standard_normal((16, 1000)).astype(np.float32)}
    losses = [float(exe.run(main, feed=feed, fetch_list=[loss], scope=scope)[0][0]) for _ in range(10)]
    assert all(np.isfinite(losses))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.8 * losses[0], losses


def test_fetch_of_a_gradient_renamed_for_the_trainer_finds_its_copy() -> None:
    # A sync pserver trainer sends fc_b@GRAD as fc_b@GRAD.trainer_0 (recorded as copy_of/trainer_id);
    # a user fetching the name they wrote gets that copy.
    from runtime.executor import _trainer_copy_of
    from tests.transpiler.test_distribute_transpiler import build_fc, transpile

    block = transpile(*build_fc()).get_trainer_program().global_block()
    assert not block.has_var("fc_b@GRAD")
    assert _trainer_copy_of(block, "fc_b@GRAD") == "fc_b@GRAD.trainer_0"
    assert _trainer_copy_of(block, "fc_w@GRAD") == "fc_w@GRAD"  # declared itself: unchanged
    assert _trainer_copy_of(block, "nope") == "nope"
