"""JAX kernels, one family a module; importing this package registers them all."""
from __future__ import annotations

from runtime.kernels import registry  # noqa: F401
from runtime.kernels import math  # noqa: F401
from runtime.kernels import nn  # noqa: F401
from runtime.kernels import optimizer  # noqa: F401
from runtime.kernels import io  # noqa: F401
from runtime.kernels import rpc  # noqa: F401
from runtime.kernels import collective  # noqa: F401
from runtime.kernels import dgc  # noqa: F401
from runtime.kernels import jax_function  # noqa: F401
