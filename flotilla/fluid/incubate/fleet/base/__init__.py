"""Paddle 1.5's ``fluid.incubate.fleet.base``: ``role_maker`` and ``fleet_base``."""
