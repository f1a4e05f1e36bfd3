"""ProgramSet: what the distributed passes produce, an ordered map role → (main, startup) programs.

A role is a ``ProgramRole``: its kind (trainer or pserver) and its trainer id or endpoint, recorded as
fields. Its key (``trainer.0``, ``pserver@127.0.0.1:6174``) is only how the role is printed and looked
up; nothing reads meaning back out of a key except ``ProgramRole.from_key``, for a key a person typed or
a printed set read back. Iteration follows insertion order, so printing a ProgramSet is deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ir.core import Program
from ir.errors import IRError
from ir.ops.registry import suggest

TRAINER = "trainer"
PSERVER = "pserver"


@dataclass(frozen=True)
class ProgramRole:
    """One process's place in a job: a trainer with its id, or a pserver with its endpoint."""

    kind: str
    trainer_id: int | None = None
    endpoint: str | None = None

    @classmethod
    def trainer(cls, trainer_id: int) -> ProgramRole:
        return cls(TRAINER, trainer_id=trainer_id)

    @classmethod
    def pserver(cls, endpoint: str) -> ProgramRole:
        return cls(PSERVER, endpoint=endpoint)

    @classmethod
    def from_key(cls, key: str) -> ProgramRole:
        """The role a key names, for keys that arrive as text (typed by a person, or taken from a
        printed set); code that builds a role uses ``trainer``/``pserver`` instead."""
        if isinstance(key, str):
            if key.startswith(TRAINER + ".") and key[len(TRAINER) + 1:].isdigit():
                return cls.trainer(int(key[len(TRAINER) + 1:]))
            if key.startswith(PSERVER + "@") and len(key) > len(PSERVER) + 1:
                return cls.pserver(key[len(PSERVER) + 1:])
        raise IRError(f"{key!r} is not a role key", hint="a role key is trainer.<id> or pserver@<endpoint>")

    @property
    def key(self) -> str:
        return f"{TRAINER}.{self.trainer_id}" if self.kind == TRAINER else f"{PSERVER}@{self.endpoint}"

    @property
    def is_trainer(self) -> bool:
        return self.kind == TRAINER

    @property
    def is_pserver(self) -> bool:
        return self.kind == PSERVER

    def __str__(self) -> str:
        return self.key


@dataclass
class RolePrograms:
    main: Program
    startup: Program
    role: ProgramRole


class ProgramSet:
    def __init__(self) -> None:
        self._roles: dict[str, RolePrograms] = {}

    def add(self, role: ProgramRole | str, main: Program, startup: Program) -> None:
        """Add ``role``'s programs; a string role is a key, read with ``ProgramRole.from_key``."""
        if not isinstance(role, ProgramRole):
            if not isinstance(role, str) or not role:
                raise IRError(f"a ProgramSet role must be a ProgramRole or a role key, got {role!r}")
            role = ProgramRole.from_key(role)
        if role.key in self._roles:
            raise IRError(f"ProgramSet already has role {role.key!r}")
        self._roles[role.key] = RolePrograms(main, startup, role)

    def __getitem__(self, role: ProgramRole | str) -> RolePrograms:
        key = role.key if isinstance(role, ProgramRole) else role
        try:
            return self._roles[key]
        except KeyError:
            raise IRError(f"ProgramSet has no role {key!r}", hint=suggest(key, self._roles)) from None

    def __contains__(self, role: ProgramRole | str) -> bool:
        return (role.key if isinstance(role, ProgramRole) else role) in self._roles

    def __iter__(self) -> Iterator[str]:
        return iter(self._roles)

    def __len__(self) -> int:
        return len(self._roles)

    def items(self) -> Iterator[tuple[str, RolePrograms]]:
        return iter(self._roles.items())

    @property
    def roles(self) -> list[str]:
        """Every role's key, in order."""
        return list(self._roles)

    def role(self, key: str) -> ProgramRole:
        """The role stored under ``key``."""
        return self[key].role

    def trainers(self) -> list[RolePrograms]:
        """The trainer roles' programs, in order (``.role.trainer_id`` says whose)."""
        return [progs for progs in self._roles.values() if progs.role.is_trainer]

    def pservers(self) -> list[RolePrograms]:
        """The pserver roles' programs, in order (``.role.endpoint`` says where)."""
        return [progs for progs in self._roles.values() if progs.role.is_pserver]

    def to_string(self) -> str:
        """Every role's programs, each under a ``# role ROLE main|startup`` header line."""
        parts = []
        for role, progs in self._roles.items():
            parts.append(f"# role {role} main\n{progs.main.to_string()}")
            parts.append(f"# role {role} startup\n{progs.startup.to_string()}")
        return "".join(parts)

    def __str__(self) -> str:
        return self.to_string()
