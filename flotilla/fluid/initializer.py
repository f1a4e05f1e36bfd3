"""``fluid.initializer``: ``Constant``, ``Uniform``, ``Normal``, ``TruncatedNormal``, ``Xavier``, ``MSRA`` and
their ``*Initializer`` aliases, from ``ir.initializer``."""
from __future__ import annotations

from ir import initializer as _initializer
from ir.initializer import *  # noqa: F401,F403

__all__ = list(_initializer.__all__)
