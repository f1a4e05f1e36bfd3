"""VerifyCache: a program unchanged since its last verification is not checked again; any change made
through the IR's methods (which bump ``Program.version``) is."""
from __future__ import annotations

import pytest

from ir.core import Program
from ir.verify import Code, VerifyCache, _ProgramChecker, collect_problems

from tests.ir.test_verify import make_program


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
