"""Flotilla's user-facing façades: ``flotilla.fluid`` (Fluid 1.5's names in one namespace),
``flotilla.fleet`` (the Fleet API: single-machine code to distributed in a few lines) and
``flotilla.cluster`` (a process's role from Paddle's environment variables, its programs, its data shard).

It is also the home of what only a user calls: ``flotilla.jax`` (the JAX capture front end) and
``flotilla.cli`` (the ``flotilla`` command-line tool). Nothing here is written twice: the façades re-export
``ir``, ``runtime`` and ``transpiler``, which stay where they are. Unlike those three, this package may import everything (jax and grpc included); the
subpackages import lazily, so ``import flotilla`` alone is cheap.
"""
from __future__ import annotations
