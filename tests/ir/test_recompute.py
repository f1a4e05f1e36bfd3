"""Recompute (``RecomputeOptimizer``, ``ir.recompute``): the rewrite's structure, gradients equal to plain
training, the memory it frees once activations are released, and its errors."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import runtime
from flotilla.fluid import layers, optimizer
from ir.core import Program, program_guard
from ir.errors import IRError
from ir.names import unique_name
from ir.roles import OpRole
from passes.liveness import program_peak_bytes
from transpiler import release_memory


def build(recompute: bool, depth: int = 6, every: int = 2, dropout: bool = False,
          opt: str = "adam") -> tuple[Program, Program, Any, list[Any]]:
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        h = layers.data(name="x", shape=[16], dtype="float64")
        checkpoints = []
        for i in range(depth):
            h = layers.fc(input=h, size=16, act="tanh")
            if dropout and i == 1:
                h = layers.dropout(h, 0.1)
            if i % every == 0:
                checkpoints.append(h)
        loss = layers.mean(layers.square(h))
        inner = optimizer.Adam(0.01) if opt == "adam" else optimizer.SGD(0.1)
        if recompute:
            optimizer.RecomputeOptimizer(inner, checkpoints=checkpoints).minimize(loss)
        else:
            inner.minimize(loss)
    return main, startup, loss, checkpoints


def train(main: Program, startup: Program, loss: Any, steps: int = 4) -> tuple[list[float], dict[str, np.ndarray]]:
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    xs = np.random.default_rng(3).normal(size=(8, 16))
    losses = [float(exe.run(main, feed={"x": xs}, fetch_list=[loss], scope=scope)[0][0]) for _ in range(steps)]
    return losses, {p.name: np.asarray(scope.find_var(p.name)) for p in main.all_parameters()}


def test_gradients_and_training_equal_plain() -> None:
    plain_losses, plain = train(*build(False)[:3])
    rc_losses, rc = train(*build(True)[:3])
    np.testing.assert_allclose(rc_losses, plain_losses, rtol=1e-6)
    for name, value in plain.items():
        np.testing.assert_allclose(rc[name], value, rtol=1e-6, atol=1e-12, err_msg=name)


def test_backward_reads_only_checkpoints_and_recomputed_values() -> None:
    main, _, _, checkpoints = build(True)
    block = main.global_block()
    ops = block.ops
    first_backward = next(i for i, op in enumerate(ops) if op.role & OpRole.BACKWARD)
    barriers = [op for op in ops if op.type == "recompute_barrier"]
    assert len(barriers) == 2  # checkpoints after layers 0, 2, 4: segments (0, 2] and (2, 4]
    assert {op.input("X")[0] for op in barriers} == {checkpoints[0].name, checkpoints[1].name}
    assert all(op.input("Dep") and all(block.var(d).copy_of is None for d in op.input("Dep")) for op in barriers)
    # the forward ops of the two segments: no backward op reads their outputs any more
    segment_values = {v.copy_of for v in block.vars.values() if v.copy_of is not None}  # what was recomputed
    assert segment_values and segment_values <= {n for op in ops[:first_backward] for n in op.output_arg_names}
    readers = {n for op in ops[first_backward:] if op.type != "recompute_barrier" for n in op.input_arg_names}
    assert not (segment_values - {c.name for c in checkpoints}) & readers


def test_released_recompute_holds_less_than_release_alone() -> None:
    plain, _, _, _ = build(False, depth=8, every=3)
    rc, _, _, _ = build(True, depth=8, every=3)
    release_memory(plain)
    release_memory(rc)
    assert program_peak_bytes(rc, batch_size=256) < program_peak_bytes(plain, batch_size=256)


def test_errors() -> None:
    with pytest.raises(IRError, match="wraps an Optimizer"):
        optimizer.RecomputeOptimizer("sgd")  # type: ignore[arg-type]
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        h = layers.fc(input=layers.data(name="x", shape=[4], dtype="float32"), size=4)
        loss = layers.mean(h)
        with pytest.raises(IRError, match="no checkpoints"):
            optimizer.RecomputeOptimizer(optimizer.SGD(0.1)).minimize(loss)
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        h = layers.fc(input=layers.data(name="x", shape=[4], dtype="float32"), size=4)
        loss = layers.mean(h)
        with pytest.raises(IRError, match="at least 2 checkpoints"):
            optimizer.RecomputeOptimizer(optimizer.SGD(0.1), checkpoints=[h]).minimize(loss)
    with pytest.raises(IRError, match="without a fixed seed"):
        build(True, dropout=True)


def test_fixed_seed_dropout_recomputes_the_same_mask() -> None:
    def model(recompute: bool) -> tuple[Program, Program, Any]:
        m, s = Program(), Program()
        with unique_name.guard(), program_guard(m, s):
            h = layers.data(name="x", shape=[16], dtype="float64")
            cps = []
            for i in range(4):
                h = layers.fc(input=h, size=16, act="tanh")
                if i == 1:
                    h = layers.dropout(h, 0.3, seed=7)
                cps.append(h)
            loss = layers.mean(layers.square(h))
            inner = optimizer.SGD(0.1)
            (optimizer.RecomputeOptimizer(inner, checkpoints=cps[::2]) if recompute else inner).minimize(loss)
        return m, s, loss

    a, _ = train(*model(False), steps=2)
    b, _ = train(*model(True), steps=2)
    np.testing.assert_allclose(b, a, rtol=1e-9)
