"""``fluid.optimizer``: ``ir.optimizer``'s optimizers and their Fluid ``*Optimizer`` aliases (``SGDOptimizer``,
``MomentumOptimizer``, ``AdamOptimizer``...). Re-exports only."""
from __future__ import annotations

from ir import optimizer as _optimizer
from ir.optimizer import *  # noqa: F401,F403

__all__ = list(_optimizer.__all__)
