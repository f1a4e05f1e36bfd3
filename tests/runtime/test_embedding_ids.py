"""A fed id outside its embedding table is refused on the host, before the compiled step (issue 21): the
kernel reads such a row as NaN, so the mistake used to show only as a NaN loss. Fluid raised."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

import ir
import runtime
from flotilla.fluid import layers, optimizer
from ir.core import Program
from runtime import executor as executor_module
from runtime.scope import FeedError
from transpiler import DistributeTranspiler

ROWS = 10


@pytest.fixture(autouse=True)
def fresh_names() -> Iterator[None]:
    with ir.unique_name.guard():
        yield


def build(is_distributed: bool = False, padding_idx: int | None = None) -> tuple[Program, Program, str]:
    main, startup = Program(), Program()
    with ir.program_guard(main, startup):
        ids = layers.data("ids", [1], dtype="int64")
        emb = layers.embedding(ids, [ROWS, 4], is_sparse=is_distributed, is_distributed=is_distributed,
                               padding_idx=padding_idx)
        y = layers.data("y", [1])
        loss = layers.mean(layers.square_error_cost(layers.fc(emb, 1), y))
        optimizer.SGD(0.1).minimize(loss)
    return main, startup, loss.name


def _feed(ids: list[int]) -> dict[str, np.ndarray]:
    return {"ids": np.array(ids, dtype="int64").reshape(-1, 1), "y": np.zeros((len(ids), 1), "float32")}


@pytest.mark.parametrize("ids, bad", [([1, 2, ROWS], ROWS), ([0, -1, 3], -1), ([ROWS + 5, 0], ROWS + 5)])
def test_local_table_refuses_an_id_outside(ids: list[int], bad: int) -> None:
    main, startup, loss = build()
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    table = next(op.input("W")[0] for op in main.global_block().ops if op.type == "lookup_table")
    before = np.array(scope.find_var(table))
    with pytest.raises(FeedError) as info:
        exe.run(main, feed=_feed(ids), fetch_list=[loss], scope=scope)
    message = info.value.message
    assert f"feed 'ids' holds id {bad}" in message and f"table {table!r} of height {ROWS}" in message, message
    assert "0..9" in info.value.hint
    np.testing.assert_array_equal(np.array(scope.find_var(table)), before)  # the step never ran
    (value,) = exe.run(main, feed=_feed([0, ROWS - 1]), fetch_list=[loss], scope=scope)
    assert np.isfinite(value).all()


def test_padding_id_is_allowed() -> None:
    main, startup, loss = build(padding_idx=ROWS - 1)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    (value,) = exe.run(main, feed=_feed([ROWS - 1, 0]), fetch_list=[loss], scope=scope)
    assert np.isfinite(value).all()


def test_bounds_are_computed_once_per_program_version() -> None:
    main, startup, loss = build()
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    exe.run(main, feed=_feed([1]), fetch_list=[loss], scope=scope)
    first = executor_module._ID_BOUNDS[main]
    exe.run(main, feed=_feed([2]), fetch_list=[loss], scope=scope)
    assert executor_module._ID_BOUNDS[main] is first
    assert [b.height for b in first[1]["ids"]] == [ROWS]


def test_distributed_table_prefetch_is_checked_before_any_rpc() -> None:
    """The trainer of a distributed table splits the ids for a prefetch: a bad id fails on the host before
    the first op, so no pserver is needed to see it."""
    main, startup, loss = build(is_distributed=True)
    t = DistributeTranspiler()
    t.transpile(0, program=main, startup_program=startup, pservers="127.0.0.1:6174,127.0.0.1:6175", trainers=1)
    trainer = t.get_trainer_program()
    assert any(op.type == "prefetch" for op in trainer.global_block().ops)
    with pytest.raises(FeedError) as info:
        runtime.Executor().run(trainer, feed=_feed([3, ROWS]), scope=runtime.Scope())
    assert f"feed 'ids' holds id {ROWS}" in info.value.message and f"of height {ROWS}" in info.value.message
