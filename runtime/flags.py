"""Runtime flags from the environment, read once where a component is created (never in a hot path).

``FLAGS_rpc_deadline``        ms, deadline of every RPC and of the wait for pservers to come up (180000)
``FLAGS_rpc_retry_times``     attempts of an idempotent RPC that failed UNAVAILABLE (3)
``FLAGS_pserver_timeout_ms``  ms a pserver waits for a missing trainer before failing (120000); keep it
                              below FLAGS_rpc_deadline so the pserver names the missing trainer first
"""
from __future__ import annotations

import os
from typing import Mapping

from ir.errors import FlotillaError

DEFAULTS = {"FLAGS_rpc_deadline": 180_000, "FLAGS_rpc_retry_times": 3, "FLAGS_pserver_timeout_ms": 120_000}


class FlagError(FlotillaError):
    code = "E701"


def flag(name: str, environ: Mapping[str, str] | None = None) -> int:
    """The positive integer value of flag ``name`` (its default when unset)."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw == "":
        return DEFAULTS[name]
    try:
        value = int(raw)
    except ValueError:
        raise FlagError(f"{name}={raw!r} is not an integer", hint=f"unset it for the default {DEFAULTS[name]}") from None
    if value < 1:
        raise FlagError(f"{name}={value} must be at least 1", hint=f"unset it for the default {DEFAULTS[name]}")
    return value
