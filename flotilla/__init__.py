"""Flotilla's user-facing package: ``flotilla.fluid`` (the Fluid 1.5 front end: the program builder, and
Fluid 1.5's names in one namespace), ``flotilla.fleet`` (the Fleet API: single-machine code to distributed
in a few lines) and ``flotilla.cluster`` (a process's role from Paddle's environment variables, its
programs, its data shard).

It is also the home of what only a user calls: ``flotilla.jax`` (the JAX capture front end) and
``flotilla.cli`` (the ``flotilla`` command-line tool). The Fluid builder lives in ``flotilla.fluid`` and
imports only ``ir``; everything else here re-exports ``ir``, ``runtime`` and ``transpiler``, which stay
where they are. Unlike those three, this package may import everything (jax and grpc included); the
subpackages import lazily, so ``import flotilla`` alone is cheap and ``import flotilla.fluid`` stays jax-free.
"""
from __future__ import annotations
