"""Paddle 1.5's ``fluid.incubate.fleet.collective``: ``fleet``, the collective Fleet of
``flotilla.fleet.collective``, and ``DistributedStrategy``."""
from __future__ import annotations

from flotilla.fleet.collective import CollectiveFleet, DistributedOptimizer, DistributedStrategy, fleet

__all__ = ["CollectiveFleet", "DistributedOptimizer", "DistributedStrategy", "fleet"]
