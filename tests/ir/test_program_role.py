"""ProgramRole: a role's kind, trainer id and endpoint are fields; its key is only how it prints."""
from __future__ import annotations

import pytest

from ir.core import Program
from ir.errors import IRError
from ir.program_set import ProgramRole, ProgramSet


def test_keys_round_trip() -> None:
    trainer, pserver = ProgramRole.trainer(3), ProgramRole.pserver("127.0.0.1:6174")
    assert (trainer.key, pserver.key) == ("trainer.3", "pserver@127.0.0.1:6174")
    assert ProgramRole.from_key(trainer.key) == trainer and ProgramRole.from_key(pserver.key) == pserver
    assert trainer.is_trainer and not trainer.is_pserver and pserver.endpoint == "127.0.0.1:6174"


@pytest.mark.parametrize("key", ["", "trainer.", "trainer.x", "pserver@", "worker.0"])
def test_from_key_rejects(key: str) -> None:
    with pytest.raises(IRError, match="not a role key"):
        ProgramRole.from_key(key)


def test_program_set_accessors() -> None:
    programs = ProgramSet()
    programs.add(ProgramRole.trainer(0), Program(), Program())
    programs.add("pserver@h:1", Program(), Program())
    assert programs.roles == ["trainer.0", "pserver@h:1"]
    assert [p.role.trainer_id for p in programs.trainers()] == [0]
    assert [p.role.endpoint for p in programs.pservers()] == ["h:1"]
    assert programs[ProgramRole.pserver("h:1")] is programs["pserver@h:1"]
    assert programs.role("trainer.0") == ProgramRole.trainer(0)
