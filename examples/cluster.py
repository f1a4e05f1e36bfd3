"""The examples' cluster helper: a re-export of ``flotilla.cluster`` (role from Paddle's environment
variables, ``distribute`` for every role, ``shard``, ``forward_prefix``), kept so the examples and their
tests import it as before. See ``flotilla/cluster.py`` for the behaviour and its invariants."""
from __future__ import annotations

from flotilla.cluster import (Distributed, add_arguments, distribute, distribute_from_args, forward_prefix)

__all__ = ["Distributed", "add_arguments", "distribute", "distribute_from_args", "forward_prefix"]
