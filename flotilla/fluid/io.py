"""``fluid.io``: saving and loading variables (``runtime.io``: ``save_vars``, ``load_vars``, ``save_params``,
``load_params``, ``save_persistables``, ``load_persistables``, Fluid's signatures) and inference models
(``runtime.inference_io``: ``save_inference_model``, ``load_inference_model``). Re-exports only."""
from __future__ import annotations

from runtime.inference_io import load_inference_model, save_inference_model
from runtime.io import (load_params, load_persistables, load_vars, save_params, save_persistables, save_vars,
                        is_parameter, is_persistable)

__all__ = ["is_parameter", "is_persistable", "load_inference_model", "load_params", "load_persistables",
           "load_vars", "save_inference_model", "save_params", "save_persistables", "save_vars"]
