"""Places: where an Executor runs (the host CPU or one GPU), mapped to a jax device."""
from __future__ import annotations

from dataclasses import dataclass

import jax

from runtime.scope import ExecutionError


@dataclass(frozen=True)
class CPUPlace:
    def device(self) -> jax.Device:
        # This process's own CPU: in a multi-process group jax.devices() lists every process's devices.
        return jax.local_devices(backend="cpu")[0]


@dataclass(frozen=True)
class CUDAPlace:
    device_id: int = 0

    def device(self) -> jax.Device:
        try:
            gpus = jax.local_devices(backend="gpu")
        except RuntimeError as e:
            raise ExecutionError(f"CUDAPlace({self.device_id}): no GPU backend is available ({e})",
                                 hint="use runtime.CPUPlace(), or install a CUDA build of jaxlib") from None
        if not 0 <= self.device_id < len(gpus):
            raise ExecutionError(f"CUDAPlace({self.device_id}): only {len(gpus)} GPU(s) are visible")
        return gpus[self.device_id]
