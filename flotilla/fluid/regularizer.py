"""``fluid.regularizer``: ``L1Decay``, ``L2Decay`` and their ``*Regularizer`` aliases, from ``ir.regularizer``."""
from __future__ import annotations

from ir import regularizer as _regularizer
from ir.regularizer import *  # noqa: F401,F403

__all__ = list(_regularizer.__all__)
