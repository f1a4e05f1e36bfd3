"""Paddle 1.5's ``fluid.incubate.fleet.parameter_server``: its ``distribute_transpiler`` holds the Fleet."""
