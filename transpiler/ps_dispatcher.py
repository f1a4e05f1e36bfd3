"""Pserver dispatchers: which endpoint each variable block goes to (Fluid's ``ps_dispatcher``).

``RoundRobin`` cycles the endpoints with one counter that persists across ``dispatch`` calls until
``reset``; ``HashName`` uses ``zlib.crc32`` of the block name, identical in every process (Fluid's
used the salted built-in ``hash``). A user's ``PSDispatcher`` subclass plugs in by overriding
``dispatch``. Items passed to ``dispatch`` are anything with a ``name`` (a ``VarBlock``, a Variable).
"""
from __future__ import annotations

import zlib
from typing import Any, Sequence

from ir.errors import FlotillaError


class DispatchError(FlotillaError):
    code = "E719"


def _name(item: Any) -> str:
    name = getattr(item, "name", item)
    if callable(name):
        name = name()
    if not isinstance(name, str):
        raise DispatchError(f"cannot dispatch {item!r}: it has no string name", hint="dispatch VarBlocks or Variables")
    return name


class PSDispatcher:
    """Base class: holds the endpoints and a step counter; subclasses implement ``dispatch``."""

    def __init__(self, pserver_endpoints: Sequence[str]) -> None:
        self._eps = list(pserver_endpoints)
        self._step = 0

    @property
    def eps(self) -> list[str]:
        return list(self._eps)

    def reset(self) -> None:
        self._step = 0

    def dispatch(self, varlist: Sequence[Any]) -> list[str]:
        """One endpoint per item of ``varlist``."""
        raise NotImplementedError(f"{type(self).__name__} must implement dispatch(varlist)")


class RoundRobin(PSDispatcher):
    """Endpoints in turn; the counter carries over between calls."""

    def dispatch(self, varlist: Sequence[Any]) -> list[str]:
        out = []
        for _ in varlist:
            out.append(self._eps[self._step])
            self._step = (self._step + 1) % len(self._eps)
        return out


class HashName(PSDispatcher):
    """``eps[crc32(name) % len(eps)]``: stable across processes and runs."""

    def dispatch(self, varlist: Sequence[Any]) -> list[str]:
        return [self._eps[zlib.crc32(_name(v).encode("utf-8")) % len(self._eps)] for v in varlist]
