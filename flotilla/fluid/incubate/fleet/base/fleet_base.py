"""Paddle 1.5's ``fluid.incubate.fleet.base.fleet_base``: the ``Fleet`` and ``DistributedOptimizer`` bases of
``flotilla.fleet``."""
from __future__ import annotations

from flotilla.fleet.base import DistributedOptimizer, Fleet

__all__ = ["DistributedOptimizer", "Fleet"]
