"""Checkpoint and resume: training 10 steps straight and training 5, saving the persistables, then resuming
in a fresh Scope and a fresh Executor (startup, ``load_persistables``, 5 more steps) end bit-identical.

Bit-identical (``np.array_equal``, same dtype) covers every persistable of the main program: parameters,
optimizer accumulators (Adam's moments and beta powers), the learning-rate variable and the
``@LR_DECAY_COUNTER@`` of the schedule, and the losses of the resumed steps.
"""
from __future__ import annotations

import pathlib
from typing import Callable

import numpy as np
import pytest

import ir
import runtime
from flotilla.fluid import layers, learning_rate, optimizer
from flotilla.fluid.param_attr import ParamAttr
from flotilla.fluid.initializer import Uniform
from ir.serialize import load_program, save_program
from runtime import io as rio

STEPS, SAVE_AT = 10, 5

OPTIMIZERS: dict[str, Callable[[], optimizer.Optimizer]] = {
    "sgd": lambda: optimizer.SGD(0.1),
    "adam_exponential_decay": lambda: optimizer.Adam(learning_rate.exponential_decay(0.05, 2, 0.5)),
}


def build(make_optimizer: Callable[[], optimizer.Optimizer]) -> tuple[ir.Program, ir.Program, str]:
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup):
        x = layers.data("x", [8])
        y = layers.data("y", [4])
        pred = layers.fc(x, 4, param_attr=ParamAttr(name="w", initializer=Uniform(-0.5, 0.5, seed=1)),
                         bias_attr=ParamAttr(name="b", initializer=Uniform(-0.5, 0.5, seed=2)))
        loss = layers.mean(layers.square_error_cost(pred, y))
        make_optimizer().minimize(loss)
    return main, startup, loss.name


def feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{"x": rng.standard_normal((6, 8)).astype(np.float32),
             "y": rng.standard_normal((6, 4)).astype(np.float32)} for _ in range(STEPS)]


def persistables(main: ir.Program) -> list[str]:
    return [name for name, var in main.global_block().vars.items() if rio.is_persistable(var)]


def snapshot(scope: runtime.Scope, names: list[str]) -> dict[str, np.ndarray]:
    return {n: np.array(scope.numpy(n)) for n in names}


def run_steps(exe: runtime.Executor, main: ir.Program, scope: runtime.Scope, loss: str,
              batch: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    return [exe.run(main, feed=f, fetch_list=[loss], scope=scope)[0] for f in batch]


def assert_bit_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert np.array_equal(got[name], want[name]), f"{name} differs after resuming"


@pytest.mark.parametrize("filename", [None, "checkpoint"], ids=["one_file_per_var", "archive"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_resume_is_bit_identical(opt: str, filename: str | None, tmp_path: pathlib.Path) -> None:
    main, startup, loss = build(OPTIMIZERS[opt])
    names = persistables(main)
    if opt.startswith("adam"):
        assert "@LR_DECAY_COUNTER@" in names
        assert any("beta1_pow_acc" in n for n in names) and any("moment2" in n for n in names)
    data = feeds()

    # Uninterrupted: 10 steps, saving after the 5th.
    scope, exe = runtime.Scope(), runtime.Executor()
    exe.run(startup, scope=scope)
    initial = snapshot(scope, names)
    straight = run_steps(exe, main, scope, loss, data[:SAVE_AT])
    rio.save_persistables(exe, str(tmp_path), main, filename=filename, scope=scope)
    at_save = snapshot(scope, names)
    straight += run_steps(exe, main, scope, loss, data[SAVE_AT:])
    final = snapshot(scope, names)

    # Resumed: fresh scope and executor, startup, load, 5 more steps.
    scope2, exe2 = runtime.Scope(), runtime.Executor()
    exe2.run(startup, scope=scope2)
    assert_bit_identical(snapshot(scope2, names), initial)
    rio.load_persistables(exe2, str(tmp_path), main, filename=filename, scope=scope2)
    assert_bit_identical(snapshot(scope2, names), at_save)
    resumed = run_steps(exe2, main, scope2, loss, data[SAVE_AT:])

    assert_bit_identical(snapshot(scope2, names), final)
    for a, b in zip(resumed, straight[SAVE_AT:]):
        assert np.array_equal(a, b)
    # The checkpoint mattered: every persistable the optimizer updates moved since startup.
    moved = [n for n in names if not np.array_equal(at_save[n], initial[n])]
    assert "w" in moved and "b" in moved
    if opt.startswith("adam"):
        np.testing.assert_array_equal(at_save["@LR_DECAY_COUNTER@"], [SAVE_AT - 1])
        np.testing.assert_array_equal(final["@LR_DECAY_COUNTER@"], [STEPS - 1])
        assert all(n in moved for n in names if "moment" in n or "pow_acc" in n)


def test_resume_in_a_reloaded_program(tmp_path: pathlib.Path) -> None:
    """As a new process would: the programs come back from their protobuf files, then resume."""
    main, startup, loss = build(OPTIMIZERS["adam_exponential_decay"])
    names = persistables(main)
    data = feeds()
    scope, exe = runtime.Scope(), runtime.Executor()
    exe.run(startup, scope=scope)
    run_steps(exe, main, scope, loss, data[:SAVE_AT])
    ckpt = tmp_path / "ckpt"
    rio.save_persistables(exe, str(ckpt), main, scope=scope)
    save_program(main, tmp_path / "main.pb")
    save_program(startup, tmp_path / "startup.pb")
    run_steps(exe, main, scope, loss, data[SAVE_AT:])
    final = snapshot(scope, names)

    main2, startup2 = load_program(tmp_path / "main.pb"), load_program(tmp_path / "startup.pb")
    scope2, exe2 = runtime.Scope(), runtime.Executor()
    exe2.run(startup2, scope=scope2)
    rio.load_persistables(exe2, str(ckpt), main2, scope=scope2)
    run_steps(exe2, main2, scope2, loss, data[SAVE_AT:])
    assert_bit_identical(snapshot(scope2, names), final)
