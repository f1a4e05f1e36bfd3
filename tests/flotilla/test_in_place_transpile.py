"""Fluid's in-place transpile and the guard against running the untranspiled program.

- Through ``fluid.DistributeTranspiler``, or the native one given no ``program``, ``transpile`` rewrites
  the main and startup programs (the same objects) into the trainer's; ``get_*`` still work, and a second
  ``transpile`` gives the same programs.
- The native API given ``program=`` leaves it untouched, and a distributed trainer process (by its role
  environment) that runs it, or its startup program, stops at once naming the program to run instead;
  a local process (no role environment) may still run it.
"""
from __future__ import annotations

import numpy as np
import pytest

import ir
import transpiler
from flotilla import fluid
from runtime.role import ROLE_ENV_VARS
from runtime.scope import ExecutionError, UntranspiledProgramError

EPS = "127.0.0.1:6174,127.0.0.1:6175"


def build() -> tuple[ir.Program, ir.Program]:
    main, startup = fluid.Program(), fluid.Program()
    with fluid.program_guard(main, startup), fluid.unique_name.guard():
        x = fluid.layers.data(name="x", shape=[4], dtype="float32")
        y = fluid.layers.data(name="y", shape=[1], dtype="float32")
        pred = fluid.layers.fc(input=x, size=1)
        loss = fluid.layers.mean(fluid.layers.square_error_cost(input=pred, label=y))
        fluid.optimizer.SGD(learning_rate=0.1).minimize(loss)
    return main, startup


@pytest.fixture
def trainer_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process looks like trainer 0 of a 2-pserver, 2-trainer job."""
    for name in ROLE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINING_ROLE", "TRAINER")
    monkeypatch.setenv("PADDLE_PSERVERS_IP_PORT_LIST", EPS)
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")


@pytest.fixture
def local_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ROLE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_fluid_transpile_rewrites_the_given_programs_in_place() -> None:
    main, startup = build()
    t = fluid.DistributeTranspiler()
    t.transpile(0, program=main, pservers=EPS, trainers=2, startup_program=startup)
    assert str(main) == str(t.get_trainer_program()) and str(startup) == str(t.get_trainer_startup_program())
    assert "send" in [op.type for op in main.global_block().ops]
    assert "sgd" not in [op.type for op in main.global_block().ops]
    assert "recv" in [op.type for op in startup.global_block().ops]
    ir.verify(main)
    pserver = t.get_pserver_program("127.0.0.1:6174")
    assert pserver.global_block().ops[0].type == "listen_and_serv"
    again = fluid.DistributeTranspiler()
    again.transpile(0, program=main, pservers=EPS, trainers=2, startup_program=startup)
    assert str(main) == str(t.get_trainer_program())  # from the stored origin: not a transpile of a transpile
    assert again.program_set.to_string() == t.program_set.to_string()


def test_native_transpile_without_program_rewrites_the_defaults() -> None:
    main, startup = build()
    with fluid.program_guard(main, startup):
        t = transpiler.DistributeTranspiler()
        t.transpile(1, pservers=EPS, trainers=2)
        assert fluid.default_main_program() is main and str(main) == str(t.get_trainer_program())
        assert str(startup) == str(t.get_trainer_startup_program())


def test_native_transpile_with_program_leaves_it_untouched() -> None:
    main, startup = build()
    before_main, before_startup = str(main), str(startup)
    t = transpiler.DistributeTranspiler()
    t.transpile(0, program=main, pservers=EPS, trainers=2, startup_program=startup)
    assert str(main) == before_main and str(startup) == before_startup
    assert str(t.get_trainer_program()) != before_main


def test_trainer_running_the_untranspiled_program_stops(trainer_env: None) -> None:
    main, startup = build()
    t = transpiler.DistributeTranspiler()
    t.transpile(0, program=main, pservers=EPS, trainers=2, startup_program=startup)
    exe = fluid.Executor(fluid.CPUPlace())
    with pytest.raises(UntranspiledProgramError, match=r"run the result of DistributeTranspiler\."
                                                       r"get_trainer_startup_program\(\) instead"):
        exe.run(startup, scope=fluid.Scope())
    with pytest.raises(ExecutionError, match=r"\[E685\].*run the result of DistributeTranspiler\."
                                             r"get_trainer_program\(\) instead"):
        exe.run(main, feed={"x": np.zeros((2, 4), "float32"), "y": np.zeros((2, 1), "float32")},
                scope=fluid.Scope())
    # A copy is a new program the user made on purpose (e.g. an evaluation clone): not refused.
    exe.run(startup.clone(), scope=fluid.Scope())


def test_local_process_may_run_the_untranspiled_program(local_env: None) -> None:
    main, startup = build()
    transpiler.DistributeTranspiler().transpile(0, program=main, pservers=EPS, trainers=2, startup_program=startup)
    exe, scope = fluid.Executor(fluid.CPUPlace()), fluid.Scope()
    exe.run(startup, scope=scope)
    loss_name = next(op.output("Out")[0] for op in main.global_block().ops if op.type == "mean")
    (loss,) = exe.run(main, feed={"x": np.ones((2, 4), "float32"), "y": np.ones((2, 1), "float32")},
                      fetch_list=[loss_name], scope=scope)
    assert np.isfinite(loss).all()


def test_in_place_programs_carry_no_mark() -> None:
    """The in-place programs are the transpiled ones: nothing refuses them (a native transpile's mark on
    the same program is dropped by a later in-place transpile)."""
    main, startup = build()
    transpiler.DistributeTranspiler().transpile(0, program=main, pservers=EPS, trainers=2, startup_program=startup)
    assert main.superseded_by is not None and startup.superseded_by is not None
    fluid.DistributeTranspiler().transpile(0, program=main, pservers=EPS, trainers=2, startup_program=startup)
    assert main.superseded_by is None and startup.superseded_by is None
