"""``fluid.io``: saving and loading variables (``runtime.io``: ``save_vars``, ``load_vars``, ``save_params``,
``load_params``, ``save_persistables``, ``load_persistables``, Fluid's signatures) and inference models
(``runtime.inference_io``: ``save_inference_model``, ``load_inference_model``). Re-exports only, loaded on
first use (PEP 562), so importing this module loads neither the runtime nor JAX."""
from __future__ import annotations

import importlib
from typing import Any

_HOME = {**dict.fromkeys(("is_parameter", "is_persistable", "load_params", "load_persistables", "load_vars",
                          "save_params", "save_persistables", "save_vars"), "runtime.io"),
         **dict.fromkeys(("load_inference_model", "save_inference_model"), "runtime.inference_io")}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)  # lazy: the runtime loads on first use
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
