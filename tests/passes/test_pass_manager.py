"""PassManager: verifies after changing passes, names the failing pass, runs instruments."""
from __future__ import annotations

import io
from dataclasses import dataclass

import pytest

from ir.core import Program
from ir.program_set import ProgramSet
from passes.dist_plan import DistPlan
from passes.pass_base import Pass, PassContext, PassError, PassManager, PrintIRAfter, Timing


@dataclass(frozen=True)
class AddOp(Pass):
    name = "add_op"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        programs["trainer.0"].main.global_block()._append_raw_op("mean", {"X": ["nope"]}, {"Out": ["nope2"]}, {})
        return True


@dataclass(frozen=True)
class Noop(Pass):
    name = "noop"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        return False


def _setup() -> tuple[ProgramSet, PassContext]:
    ps = ProgramSet()
    ps.add("trainer.0", Program(), Program())
    ctx = PassContext(origin_main=Program(), origin_startup=Program(),
                      plan=DistPlan(trainer_id=0, trainers=1, sync_mode=True, pservers=("127.0.0.1:6174",)))
    return ps, ctx


def test_failing_pass_is_named_with_its_predecessors() -> None:
    ps, ctx = _setup()
    with pytest.raises(PassError, match=r"after pass 'add_op' \(passes before it: \['noop'\]\)"):
        PassManager([Noop(), AddOp()]).run(ps, ctx)


def test_instruments() -> None:
    ps, ctx = _setup()
    out = io.StringIO()
    assert PassManager([Noop()], [Timing(), PrintIRAfter("noop", out)]).run(ps, ctx) is False
    assert "IR after pass noop" in out.getvalue() and "noop" in ctx.timings


def test_rejects_non_pass() -> None:
    with pytest.raises(PassError, match="not a Pass"):
        PassManager([object()])  # type: ignore[list-item]
