"""What a porter hits: ``DistributeTranspilerConfig`` (and Fleet's ``DistributedStrategy``) reject a
misspelt field naming the closest one; the runtime's errors are distinct classes under ``ExecutionError``."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flotilla import fluid
from flotilla.fleet import DistributedStrategy, FleetError
from runtime import scope as runtime_scope
from runtime.scope import (ExecutionError, FeedError, FetchError, ShapeDtypeError, UninitializedVariableError,
                           UntranspiledProgramError)
from transpiler import DistributeTranspilerConfig, TranspilerError


def test_config_rejects_a_misspelt_field() -> None:
    config = DistributeTranspilerConfig()
    config.slice_var_up = False  # a real field: fine
    with pytest.raises(TranspilerError, match=r"\[E715\] DistributeTranspilerConfig has no field 'slice_var_upp'"
                                              r"\n  hint: did you mean 'slice_var_up'\?"):
        config.slice_var_upp = True
    with pytest.raises(TranspilerError, match=r"has no field 'no_such_thing'\n  hint: the fields are slice_var_up, "):
        config.no_such_thing = 1
    assert not config.slice_var_up and dataclasses.replace(config, mode="nccl2").mode == "nccl2"
    assert config.validated().split_method is fluid.transpiler.RoundRobin


def test_strategy_rejects_a_misspelt_field() -> None:
    strategy = DistributedStrategy()
    strategy.sync_mode = False
    with pytest.raises(FleetError, match=r"no field 'sync_mod'\n  hint: did you mean 'sync_mode'"):
        strategy.sync_mod = True


def test_runtime_errors_are_distinct_classes_under_one_base() -> None:
    classes = (FeedError, FetchError, ShapeDtypeError, UninitializedVariableError, UntranspiledProgramError)
    assert all(issubclass(c, ExecutionError) for c in classes)
    assert len({c.code for c in classes} | {ExecutionError.code}) == len(classes) + 1
    assert not any(name.endswith("_") for name in vars(runtime_scope) if name[0].isupper())

    main, startup = fluid.Program(), fluid.Program()
    with fluid.program_guard(main, startup), fluid.unique_name.guard():
        x = fluid.layers.data(name="x", shape=[3], dtype="float32")
        out = fluid.layers.fc(input=x, size=2)
    exe, scope = fluid.Executor(fluid.CPUPlace()), fluid.Scope()
    batch = np.zeros((2, 3), "float32")
    with pytest.raises(UninitializedVariableError, match="not initialised"):
        exe.run(main, feed={"x": batch}, fetch_list=[out], scope=scope)
    exe.run(startup, scope=scope)
    with pytest.raises(FeedError, match="feed variable 'x' is missing"):
        exe.run(main, fetch_list=[out], scope=scope)
    with pytest.raises(FeedError, match="'xx' is not a variable.*\n  hint: did you mean 'x'"):
        exe.run(main, feed={"xx": batch}, scope=scope)
    with pytest.raises(ShapeDtypeError, match=r"feed 'x' has shape \[2, 4\], expected \[-1, 3\]"):
        exe.run(main, feed={"x": np.zeros((2, 4), "float32")}, scope=scope)
    with pytest.raises(ShapeDtypeError, match="feed 'x' has dtype float64, expected float32"):
        exe.run(main, feed={"x": batch.astype("float64")}, scope=scope)
    with pytest.raises(FetchError, match="fetch variable 'nope' is not a variable"):
        exe.run(main, feed={"x": batch}, fetch_list=["nope"], scope=scope)
    with pytest.raises(UninitializedVariableError, match="'nope' is not in the scope"):
        runtime_scope.Scope.var(scope, "nope")
    with pytest.raises(UninitializedVariableError, match="'nope' has no value in the scope"):
        np.array(scope.var("nope").get_tensor())  # Fluid's var(name) creates it, without a value
