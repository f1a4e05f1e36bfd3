"""Operator roles, as in Paddle Fluid's ``OpRole``.

Roles are bit flags and combine: the loss-gradient ``fill_constant`` is ``BACKWARD | LOSS`` (257),
a learning-rate op that is also an optimizer op is ``OPTIMIZE | LRSCHED`` (18). Passes classify ops by
their role and ``op_role_var`` attribute, never by variable names.
"""
from __future__ import annotations

import enum

OP_ROLE_ATTR = "op_role"
OP_ROLE_VAR_ATTR = "op_role_var"


class OpRole(enum.IntFlag):
    FORWARD = 0
    BACKWARD = 1
    OPTIMIZE = 2
    RPC = 4
    DIST = 8
    LRSCHED = 16
    COLLECTIVE = 32
    LOSS = 256


ALL_ROLE_BITS = int(
    OpRole.BACKWARD | OpRole.OPTIMIZE | OpRole.RPC | OpRole.DIST | OpRole.LRSCHED | OpRole.COLLECTIVE | OpRole.LOSS
)


def is_valid_role(value: int) -> bool:
    """True when ``value`` is a combination of known role bits."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (value & ~ALL_ROLE_BITS) == 0


def role_name(value: int) -> str:
    """A readable name such as ``backward|loss`` for a role value."""
    if value == 0:
        return "forward"
    names = [r.name.lower() for r in OpRole if r.value and value & r.value]
    return "|".join(names) if names else str(value)
