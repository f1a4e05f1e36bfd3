"""Parameter initializers (Fluid 1.5's ``fluid.initializer``).

An initializer is a frozen value; calling it as ``init(var, block)`` emits the op that fills ``var``
into ``block`` (the startup program's global block, where ``var`` must already exist) and returns it.

Invariants, as in Fluid 1.x:
- Init ops are *prepended* to the block, so a startup program lists them in reverse creation order.
- ``seed=0`` means "no seed of my own": the op's ``seed`` attr is then the program's ``random_seed``
  (itself 0 unless set, which leaves the runtime to draw a seed). A non-zero seed is used as is.
- Fan-in/fan-out (Xavier, MSRA) follow Fluid: a 2-D ``[in, out]`` weight has fan_in = shape[0] and
  fan_out = shape[1]; a conv filter ``[out_c, in_c, k...]`` has fan_in = in_c·prod(k),
  fan_out = out_c·prod(k); 1-D: both shape[0]; 0-D: both 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ir.core import Block, Operator, Variable
from ir.errors import IRError


def _check_number(cls: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise IRError(f"{cls}: {name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _check_seed(cls: str, seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise IRError(f"{cls}: seed must be a non-negative int, got {seed!r}", hint="0 uses the program's random_seed")
    return seed


def compute_fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) of a parameter shape, as Fluid computes them."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


class Initializer:
    """Base class: subclasses implement ``_op(var, block)`` returning (op type, attrs)."""

    def __call__(self, var: Variable, block: Block) -> Operator:
        if not isinstance(var, Variable):
            raise IRError(f"{type(self).__name__} needs a Variable to initialise, got {type(var).__name__}")
        if block.find_var_recursive(var.name) is None:
            raise IRError(f"{type(self).__name__}: variable {var.name!r} is not in block {block.idx} of the startup "
                          "program", hint="create the variable in the startup block before initialising it")
        if any(d < 0 for d in var.shape):
            raise IRError(f"{type(self).__name__}: cannot initialise {var.name!r} of shape {list(var.shape)} "
                          "with an unknown extent", hint="parameters and global variables need a full shape")
        op_type, attrs = self._op(var, block)
        attrs = {"shape": list(var.shape), "dtype": var.dtype, **attrs}
        return block.insert_op(0, op_type, outputs={"Out": [var.name]}, attrs=attrs)

    def _op(self, var: Variable, block: Block) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    @staticmethod
    def _seed(seed: int, block: Block) -> int:
        return seed if seed != 0 else int(block.program.random_seed)


@dataclass(frozen=True)
class Constant(Initializer):
    """``fill_constant`` with ``value``."""

    value: float = 0.0
    force_cpu: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _check_number("Constant", "value", self.value))

    def _op(self, var: Variable, block: Block) -> tuple[str, dict[str, Any]]:
        return "fill_constant", {"value": self.value, "force_cpu": bool(self.force_cpu)}


@dataclass(frozen=True)
class Uniform(Initializer):
    """``uniform_random`` in [low, high)."""

    low: float = -1.0
    high: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "low", _check_number("Uniform", "low", self.low))
        object.__setattr__(self, "high", _check_number("Uniform", "high", self.high))
        _check_seed("Uniform", self.seed)
        if self.low > self.high:
            raise IRError(f"Uniform: low {self.low} is greater than high {self.high}")

    def _op(self, var: Variable, block: Block) -> tuple[str, dict[str, Any]]:
        return "uniform_random", {"min": self.low, "max": self.high, "seed": self._seed(self.seed, block)}


@dataclass(frozen=True)
class Normal(Initializer):
    """``gaussian_random`` with mean ``loc`` and standard deviation ``scale``."""

    loc: float = 0.0
    scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "loc", _check_number("Normal", "loc", self.loc))
        object.__setattr__(self, "scale", _check_number("Normal", "scale", self.scale))
        _check_seed("Normal", self.seed)

    def _op(self, var: Variable, block: Block) -> tuple[str, dict[str, Any]]:
        return "gaussian_random", {"mean": self.loc, "std": self.scale, "seed": self._seed(self.seed, block)}


@dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """``truncated_gaussian_random``: a normal cut at two standard deviations."""

    loc: float = 0.0
    scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "loc", _check_number("TruncatedNormal", "loc", self.loc))
        object.__setattr__(self, "scale", _check_number("TruncatedNormal", "scale", self.scale))
        _check_seed("TruncatedNormal", self.seed)

    def _op(self, var: Variable, block: Block) -> tuple[str, dict[str, Any]]:
        return "truncated_gaussian_random", {"mean": self.loc, "std": self.scale,
                                             "seed": self._seed(self.seed, block)}


@dataclass(frozen=True)
class Xavier(Initializer):
    """Glorot: uniform in ±sqrt(6 / (fan_in + fan_out)), or normal with std sqrt(2 / (fan_in + fan_out))."""

    uniform: bool = True
    fan_in: int | None = None
    fan_out: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check_seed("Xavier", self.seed)

    def _op(self, var: Variable, block: Block) -> tuple[str, dict[str, Any]]:
        f_in, f_out = compute_fans(var.shape)
        f_in = f_in if self.fan_in is None else self.fan_in
        f_out = f_out if self.fan_out is None else self.fan_out
        seed = self._seed(self.seed, block)
        if self.uniform:
            limit = math.sqrt(6.0 / float(f_in + f_out))
            return "uniform_random", {"min": -limit, "max": limit, "seed": seed}
        return "gaussian_random", {"mean": 0.0, "std": math.sqrt(2.0 / float(f_in + f_out)), "seed": seed}


@dataclass(frozen=True)
class MSRA(Initializer):
    """He: uniform in ±sqrt(6 / fan_in), or normal with std sqrt(2 / fan_in)."""

    uniform: bool = True
    fan_in: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check_seed("MSRA", self.seed)

    def _op(self, var: Variable, block: Block) -> tuple[str, dict[str, Any]]:
        f_in = compute_fans(var.shape)[0] if self.fan_in is None else self.fan_in
        seed = self._seed(self.seed, block)
        if self.uniform:
            limit = math.sqrt(6.0 / float(f_in))
            return "uniform_random", {"min": -limit, "max": limit, "seed": seed}
        return "gaussian_random", {"mean": 0.0, "std": math.sqrt(2.0 / float(f_in)), "seed": seed}


# Fluid's long names.
ConstantInitializer = Constant
UniformInitializer = Uniform
NormalInitializer = Normal
TruncatedNormalInitializer = TruncatedNormal
XavierInitializer = Xavier
MSRAInitializer = MSRA

__all__ = [
    "Constant", "ConstantInitializer", "Initializer", "MSRA", "MSRAInitializer", "Normal", "NormalInitializer",
    "TruncatedNormal", "TruncatedNormalInitializer", "Uniform", "UniformInitializer", "Xavier",
    "XavierInitializer", "compute_fans",
]
