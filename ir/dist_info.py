"""What part of a distributed job a program is, read from its ops: the checkpoint code (which part of
the state to save) and a trainer's first rpc (which pservers to announce itself to) both ask, so the
answer lives with the program, not with either of them.

Invariants: a program with a ``listen_and_serv`` op is a pserver program; one with an op of the
``trainer_rpc`` trait (``ir.ops.rpc``) a trainer program; any other is local. Nothing is parsed out of
names: the ids and endpoints are the ops' attributes.
"""
from __future__ import annotations

from typing import NamedTuple

from ir.core import Program
from ir.ops import get_op_def, op_has_trait


class DistRole(NamedTuple):
    """``kind`` is ``"pserver"`` or ``"trainer"``; ``id`` the pserver's or trainer's id; ``endpoints`` the
    pserver's own endpoint, or the pservers a trainer talks to (sorted)."""

    kind: str
    id: int
    endpoints: list[str]


def distributed_role(program: Program) -> DistRole | None:
    """The role of ``program`` in a transpiled job (its global block's rpc ops), None for a local program."""
    endpoints: dict[str, None] = {}
    trainer_id = None
    for op in program.global_block().ops:
        if op.type == "listen_and_serv":
            return DistRole("pserver", max(0, int(op.attr("pserver_id"))), [op.attr("endpoint")])
        if op_has_trait(op.type, "trainer_rpc"):
            trainer_id = int(op.attr("trainer_id"))
            # The barriers name every pserver (``endpoints``); the others one pserver per piece (``epmap``).
            for ep in op.attr("endpoints" if get_op_def(op.type).attr_def("endpoints") else "epmap"):
                endpoints[ep] = None
    return None if trainer_id is None else DistRole("trainer", trainer_id, sorted(endpoints))


__all__ = ["DistRole", "distributed_role"]
