"""``fluid.layers``: every layer of ``ir.layers`` plus the learning-rate schedules of ``ir.learning_rate``
(``exponential_decay``, ``natural_exp_decay``, ``inverse_time_decay``, ``polynomial_decay``,
``piecewise_decay``, ``noam_decay``), which Fluid 1.5 exposes under ``fluid.layers``. Re-exports only."""
from __future__ import annotations

from ir import layers as _layers
from ir.layers import *  # noqa: F401,F403  (ir.layers.__all__: whatever layers ir defines)
from ir.learning_rate import (exponential_decay, inverse_time_decay, natural_exp_decay, noam_decay,
                              piecewise_decay, polynomial_decay)

__all__ = [*_layers.__all__, "exponential_decay", "inverse_time_decay", "natural_exp_decay", "noam_decay",
           "piecewise_decay", "polynomial_decay"]
