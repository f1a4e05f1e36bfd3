"""Paddle 1.5's ``fluid.incubate.fleet.parameter_server.distribute_transpiler``: ``fleet``, the
parameter-server Fleet of ``flotilla.fleet`` (and 1.6's ``distributed_strategy`` beside it)."""
from __future__ import annotations

from flotilla.fleet import ParameterServerFleet, fleet
from flotilla.fleet.base import DistributedStrategy, StrategyFactory

__all__ = ["DistributedStrategy", "ParameterServerFleet", "StrategyFactory", "fleet"]
