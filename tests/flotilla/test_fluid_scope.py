"""Fluid's Variable/LoDTensor surface on what ``find_var`` returns: ``np.array(scope.find_var(n).get_tensor())``
reads a value, ``get_tensor().set(array, place)`` writes it back where the next ``Executor.run`` reads it."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import runtime
from flotilla import fluid
from runtime.scope import ShapeDtypeError, UninitializedVariableError


def _sgd_program() -> tuple[Any, Any, Any, Any]:
    main, startup = fluid.Program(), fluid.Program()
    with fluid.program_guard(main, startup):
        x = fluid.layers.data("x", shape=[3], dtype="float32")
        y = fluid.layers.data("y", shape=[1], dtype="float32")
        pred = fluid.layers.fc(x, size=1, param_attr=fluid.ParamAttr(name="w"), bias_attr=fluid.ParamAttr(name="b"))
        loss = fluid.layers.mean(fluid.layers.square_error_cost(input=pred, label=y))
        fluid.optimizer.SGD(0.1).minimize(loss)
    return main, startup, pred, loss


FEED = {"x": np.array([[1.0, 2.0, 3.0]], np.float32), "y": np.array([[0.0]], np.float32)}


def test_get_tensor_reads_and_set_writes_back_for_the_next_run() -> None:
    main, startup, pred, _ = _sgd_program()
    scope, place = fluid.Scope(), fluid.CPUPlace()
    exe = fluid.Executor(place)
    with fluid.scope_guard(scope):
        exe.run(startup)
        tensor = fluid.global_scope().find_var("w").get_tensor()
        assert tensor.shape() == [3, 1] and tensor.lod() == [] and tensor.recursive_sequence_lengths() == []
        np.testing.assert_array_equal(np.array(tensor), scope.numpy("w"))
        tensor.set(np.array([[1.0], [1.0], [1.0]], np.float32), place)
        scope.find_var("b").get_tensor().set(np.array([0.5], np.float32), place)
        out, = exe.run(main, feed=FEED, fetch_list=[pred])
    assert out.tolist() == [[6.5]]  # 1 + 2 + 3 + 0.5: the run read both values set through the tensors
    # SGD then updated w in the scope, and the same tensor object sees the update (a view, not a copy)
    g = 2.0 * 6.5 * FEED["x"].T
    np.testing.assert_allclose(np.array(scope.find_var("w").get_tensor()), 1.0 - 0.1 * g, rtol=1e-6)
    np.testing.assert_allclose(np.array(tensor), 1.0 - 0.1 * g, rtol=1e-6)
    assert np.array(scope.find_var("w")).shape == (3, 1)  # np.array(variable) reads it too
    assert scope.find_var("no_such_var") is None


def test_the_global_scope_answers_find_var_with_fluid_variables() -> None:
    main, startup, pred, _ = _sgd_program()
    exe = fluid.Executor(fluid.CPUPlace())
    exe.run(startup)
    w = fluid.global_scope().find_var("w")
    assert w is not None and w.is_initialized()
    w.get_tensor().set(np.zeros((3, 1), np.float32), fluid.CPUPlace())
    fluid.global_scope().find_var("b").get_tensor().set(np.array([2.0], np.float32), fluid.CPUPlace())
    out, = exe.run(main, feed=FEED, fetch_list=[pred])
    assert out.tolist() == [[2.0]]
    assert fluid.global_scope() is runtime.global_scope()


def test_set_refuses_another_shape_or_dtype_naming_the_fix() -> None:
    main, startup, _, _ = _sgd_program()
    scope = fluid.Scope()
    fluid.Executor(fluid.CPUPlace()).run(startup, scope=scope)
    tensor = scope.find_var("w").get_tensor()
    before = np.array(tensor)
    with pytest.raises(ShapeDtypeError, match=r"'w'.*shape \[2, 1\].*holds shape \[3, 1\]") as e:
        tensor.set(np.zeros((2, 1), np.float32), fluid.CPUPlace())
    assert "shape [3, 1]" in str(e.value.hint)
    with pytest.raises(ShapeDtypeError, match="float64 array: the scope holds float32") as e:
        tensor.set(np.zeros((3, 1)), fluid.CPUPlace())
    assert "astype('float32')" in str(e.value.hint)
    np.testing.assert_array_equal(np.array(tensor), before)  # refused: nothing changed


def test_var_creates_and_lod_round_trips() -> None:
    scope = fluid.Scope()
    child = scope.new_scope()
    assert isinstance(child, fluid.Scope)
    ids = child.var("ids").get_tensor()
    ids.set(np.arange(5, dtype=np.int64).reshape(5, 1), fluid.CPUPlace())
    ids.set_lod([[0, 2, 5]])
    assert ids.recursive_sequence_lengths() == [[2, 3]] and ids.lod() == [[0, 2, 5]]
    ids.set_recursive_sequence_lengths([[4, 1]])
    assert child.find_var("ids").get_tensor().lod() == [[0, 4, 5]]
    assert ids.has_valid_recursive_sequence_lengths()
    assert scope.find_var("ids") is None  # created in the child
    with pytest.raises(UninitializedVariableError, match="'fresh' has no value in the scope"):
        np.array(scope.var("fresh").get_tensor())
    # an int array whose values fit is narrowed to the held dtype; one that does not fit is refused
    child.set_var("small", np.zeros(2, np.int32))
    child.find_var("small").get_tensor().set(np.array([1, 2], np.int64), None)
    assert np.array(child.find_var("small").get_tensor()).dtype == np.int32
    with pytest.raises(ShapeDtypeError, match="int64 array: the scope holds int32"):
        child.find_var("small").get_tensor().set(np.array([1, 2**40], np.int64), None)


def test_the_runtime_scope_still_returns_values() -> None:
    scope = runtime.Scope()
    scope.set_var("v", np.ones(2, np.float32))
    assert isinstance(scope.find_var("v"), np.ndarray)
    child = fluid.Scope(scope)
    assert child.find_var("v").get_tensor().shape() == [2] and child.numpy("v").tolist() == [1.0, 1.0]
