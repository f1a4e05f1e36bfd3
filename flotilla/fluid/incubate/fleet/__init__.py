"""Paddle 1.5's ``fluid.incubate.fleet``: ``base.role_maker``, ``base.fleet_base``,
``parameter_server.distribute_transpiler`` and ``collective``, each re-exporting ``flotilla.fleet``."""
