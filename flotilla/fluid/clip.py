"""``fluid.clip``: gradient clipping (``GradientClipByValue``, ``GradientClipByNorm``,
``GradientClipByGlobalNorm``, ``set_gradient_clip``), from ``ir.clip``."""
from __future__ import annotations

from ir import clip as _clip
from ir.clip import *  # noqa: F401,F403

__all__ = list(_clip.__all__)
