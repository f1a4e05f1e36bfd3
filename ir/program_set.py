"""ProgramSet: what the distributed passes produce, an ordered map role → (main, startup) programs.

Roles are strings such as ``trainer.0`` or ``pserver@127.0.0.1:6174``; iteration follows insertion
order, so printing a ProgramSet is deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ir.core import Program
from ir.errors import IRError
from ir.ops.registry import suggest


@dataclass
class RolePrograms:
    main: Program
    startup: Program


class ProgramSet:
    def __init__(self) -> None:
        self._roles: dict[str, RolePrograms] = {}

    def add(self, role: str, main: Program, startup: Program) -> None:
        if not isinstance(role, str) or not role:
            raise IRError(f"a ProgramSet role must be a non-empty string, got {role!r}")
        if role in self._roles:
            raise IRError(f"ProgramSet already has role {role!r}")
        self._roles[role] = RolePrograms(main, startup)

    def __getitem__(self, role: str) -> RolePrograms:
        try:
            return self._roles[role]
        except KeyError:
            raise IRError(f"ProgramSet has no role {role!r}", hint=suggest(role, self._roles)) from None

    def __contains__(self, role: str) -> bool:
        return role in self._roles

    def __iter__(self) -> Iterator[str]:
        return iter(self._roles)

    def __len__(self) -> int:
        return len(self._roles)

    def items(self) -> Iterator[tuple[str, RolePrograms]]:
        return iter(self._roles.items())

    @property
    def roles(self) -> list[str]:
        return list(self._roles)

    def to_string(self) -> str:
        """Every role's programs, each under a ``# role ROLE main|startup`` header line."""
        parts = []
        for role, progs in self._roles.items():
            parts.append(f"# role {role} main\n{progs.main.to_string()}")
            parts.append(f"# role {role} startup\n{progs.startup.to_string()}")
        return "".join(parts)

    def __str__(self) -> str:
        return self.to_string()
