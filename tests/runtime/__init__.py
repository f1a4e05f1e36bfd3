"""Tests of the runtime: kernels, Scope, Executor and io."""
