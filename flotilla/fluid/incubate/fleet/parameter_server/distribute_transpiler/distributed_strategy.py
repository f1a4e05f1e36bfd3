"""Paddle 1.6's ``...parameter_server.distribute_transpiler.distributed_strategy``: ``StrategyFactory`` and
``DistributedStrategy`` of ``flotilla.fleet``."""
from __future__ import annotations

from flotilla.fleet.base import DistributedStrategy, StrategyFactory

__all__ = ["DistributedStrategy", "StrategyFactory"]
