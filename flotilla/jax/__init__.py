"""The JAX front end: ``capture`` turns a plain JAX loss function into main and startup Programs.

A home of its own beside ``flotilla.fluid`` (the other front end) because capture needs jax and the
runtime's archive format, which the jax-free packages (``ir``, ``passes``, ``transpiler``) must not.
Its name shadows jax for a script run from inside ``flotilla/`` (``python flotilla/cli.py``): run the
package's modules with ``-m`` (``python -m flotilla.cli``), as the console script does.
"""
from __future__ import annotations

from flotilla.jax.capture import MAPPED, CaptureError, capture, leaf_names

__all__ = ["CaptureError", "capture", "leaf_names", "MAPPED"]
