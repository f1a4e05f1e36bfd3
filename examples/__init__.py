"""Runnable training programs built with ``flotilla.fluid.layers`` and run with ``runtime.Executor``; each example
generates its own data. Run one with ``python examples/<name>/train.py`` or ``python -m examples.<name>.train``."""
