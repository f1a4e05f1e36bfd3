"""VerifyCache: a program unchanged since its last verification is not checked again; any change made
through the IR's methods (which bump ``Program.version``) is."""
from __future__ import annotations

import importlib
from typing import Any, Callable

import pytest

from ir.core import Program
from ir.verify import Code, VerifyCache, _ProgramChecker, collect_problems

from tests.ir.test_verify import make_program

verify_module = importlib.import_module("ir.verify")  # the package exports a function of the same name


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[Program]:
    """The programs the per-program checker actually ran on, in order."""
    seen: list[Program] = []
    original = _ProgramChecker.run

    def run(self: _ProgramChecker) -> list:
        seen.append(self.program)
        return original(self)

    monkeypatch.setattr(_ProgramChecker, "run", run)
    return seen


def test_unchanged_program_is_checked_once(runs: list[Program]) -> None:
    cache, p = VerifyCache(), make_program()
    assert cache.problems(p) == [] and cache.problems(p) == []
    assert runs == [p]


def test_a_change_through_the_ir_is_verified_again(runs: list[Program]) -> None:
    cache, p = VerifyCache(), make_program()
    assert cache.problems(p, role="trainer.0") == []
    p.global_block().ops[1].set_attr("op_role", 1024 | 1)  # an int (set_attr accepts it), unknown role bits
    found = cache.problems(p, role="trainer.0")
    assert [pr.code for pr in found] == [Code.OP_ROLE] and found == collect_problems(p, role="trainer.0")
    assert runs[-1] is p and len(runs) == 3


def test_role_and_block_list_are_part_of_the_key(runs: list[Program]) -> None:
    cache, p = VerifyCache(), make_program()
    cache.problems(p, role="a")
    assert cache.problems(p, role="b") == [] and len(runs) == 2
    p.create_block(0)
    cache.problems(p, role="b")
    assert len(runs) == 3


def test_cached_problems_are_a_copy() -> None:
    cache, p = VerifyCache(), make_program()
    p.global_block().ops[1].set_attr("op_role", 1024 | 1)
    cache.problems(p).clear()
    assert [pr.code for pr in cache.problems(p)] == [Code.OP_ROLE]


def test_infer_op_shapes_that_changes_a_variable_bumps_the_version() -> None:
    p = make_program()
    b = p.global_block()
    b.replace_var("h", shape=(7,))
    before = p.version
    b.infer_op_shapes(b.ops[0])
    assert b.var("h").shape == (-1, 3) and p.version > before
    unchanged = p.version
    b.infer_op_shapes(b.ops[0])
    assert p.version == unchanged


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The types of the ops the per-program checker actually checked, in order."""
    seen: list[str] = []
    original = _ProgramChecker._clean

    def clean(self: _ProgramChecker, op: Any, *args: Any) -> Any:
        seen.append(op.type)
        return original(self, op, *args)

    monkeypatch.setattr(_ProgramChecker, "_clean", clean)
    return seen


def test_after_a_change_only_what_changed_is_checked_again(checked: list[str]) -> None:
    cache, p = VerifyCache(), make_program()
    b = p.global_block()
    assert cache.problems(p) == [] and len(checked) == 5
    checked.clear()
    b.create_var("t")
    b.append_op("scale", {"X": "loss"}, {"Out": "t"})  # a new op
    b.ops[2].set_attr("op_role", 1)  # a changed op
    assert cache.problems(p) == [] and checked == ["square", "scale"]
    checked.clear()
    b.replace_var("z", shape=(-1, 3))  # ops naming a re-declared variable: add (writes z), square (reads z)
    assert cache.problems(p) == [] and checked == ["elementwise_add", "square"]


def _edits() -> list[Callable[[Program], Any]]:
    """Changes made through the IR's methods after which problems appear in ops that did not change."""
    def drop_writer(p: Program) -> None:
        p.global_block().remove_op(0)  # mul wrote h: elementwise_add now reads h before any write

    def reshape_input(p: Program) -> None:
        p.global_block().replace_var("bias", shape=(5,))  # elementwise_add's inference now disagrees

    def undeclare(p: Program) -> None:
        p.global_block().remove_var("s")  # square writes it, mean reads it

    return [drop_writer, reshape_input, undeclare]


@pytest.mark.parametrize("edit", _edits(), ids=lambda e: e.__name__)
def test_problems_in_unchanged_ops_are_found(edit: Callable[[Program], Any]) -> None:
    cache, p = VerifyCache(), make_program()
    assert cache.problems(p, role="trainer.0") == []
    edit(p)
    found = cache.problems(p, role="trainer.0")
    assert found and found == collect_problems(p, role="trainer.0")


def test_a_sub_block_op_is_checked_again_when_an_ancestor_variable_changes(checked: list[str]) -> None:
    cache, p = VerifyCache(), make_program()
    sub = p.create_block(0)
    p.rollback()
    sub.create_var("t")
    sub.append_op("scale", {"X": "loss"}, {"Out": "t"})
    assert cache.problems(p) == []
    checked.clear()
    p.global_block().replace_var("loss", shape=(2,))
    found = cache.problems(p)
    assert "scale" in checked and found == collect_problems(p)


@pytest.fixture
def inferred(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The types of the ops whose shapes the verifier inferred again."""
    seen: list[str] = []
    original = verify_module.infer_op

    def infer_op(op: Any) -> Any:
        seen.append(op.type)
        return original(op)

    monkeypatch.setattr(verify_module, "infer_op", infer_op)
    return seen


def test_the_inference_append_op_made_is_reused_while_op_and_inputs_are_unchanged(inferred: list[str]) -> None:
    p = make_program().clone()  # a clone keeps the inferences of the ops it copies
    assert VerifyCache().problems(p) == [] and inferred == []
    p.global_block().replace_var("bias", shape=(5,))  # elementwise_add reads it: inferred again, and refused
    found = VerifyCache().problems(p)
    assert inferred == ["elementwise_add"] and found == collect_problems(p) and found
    inferred.clear()
    collect_problems(p)  # without a cache, nothing is taken on trust: private edits are seen too
    assert len(inferred) == 5
