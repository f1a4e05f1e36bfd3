"""Learning-rate schedules (Fluid 1.5's ``fluid.layers.learning_rate_scheduler``).

Each schedule appends ops to the default main program's global block and returns the learning-rate
Variable (shape [1], float32) that an optimizer then takes as its ``learning_rate``.

Invariants, as in Fluid 1.5:
- The step counter is the persistable int64 ``@LR_DECAY_COUNTER@`` (shape [1]), created once per
  program: the startup program fills it with ``begin - 1`` (``force_cpu``), and an ``increment``
  (step 1.0) is **prepended** to the main global block, so the first step sees ``begin``
  (0 for the decays, 1 for ``noam_decay``). Each schedule then ``cast``s it to float32.
- Every op a schedule adds has role LRSched (16) and an empty ``op_role_var``; Python-scalar
  arithmetic becomes ``scale`` ops and scalar operands of binary ops become ``fill_constant`` ops,
  as Fluid's operator overloading does.
- Fluid expresses two things with control flow; Flotilla keeps one straight-line block instead:
  ``piecewise_decay`` (a Switch in Fluid) computes ``lt_i = cast(step < boundary_i)``, the exact 0/1
  interval indicators ``lt_0, lt_i - lt_{i-1}, 1 - lt_{n-1}``, and ``sum(values_i * indicator_i)``
  into a persistable ``learning_rate_N`` (initialised to 0 in startup); ``polynomial_decay(cycle=True)``
  replaces the Switch that maps a zero ``ceil(step / decay_steps)`` to 1 by ``elementwise_max(·, 1)``.
  Where no ``ceil`` op is registered, ``ceil(x)`` is computed exactly as ``-floor(-x)``.
"""
from __future__ import annotations

from typing import Any, Sequence

from flotilla.fluid.initializer import Constant
from flotilla.fluid.spec import number
from ir.core import Block, Program, Variable, default_main_program, default_startup_program
from ir.errors import IRError
from ir.names import LR_DECAY_COUNTER, unique_name
from ir.ops.registry import has_op
from ir.roles import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OpRole

__all__ = [
    "exponential_decay", "natural_exp_decay", "inverse_time_decay", "polynomial_decay", "piecewise_decay",
    "noam_decay", "create_global_var",
]

_LR_DTYPE = "float32"


def create_global_var(main: Program, startup: Program, name: str, shape: Sequence[int], dtype: str,
                      value: float, force_cpu: bool = False) -> Variable:
    """A persistable variable of ``main``'s global block, filled with ``value`` by a ``fill_constant``
    in ``startup`` (Fluid's ``layers.create_global_var`` with ``persistable=True``)."""
    var = main.global_block().create_var(name, shape=tuple(shape), dtype=dtype, persistable=True,
                                         stop_gradient=True)
    sblock = startup.global_block()
    if sblock.find_var_recursive(name) is None:
        sblock.create_var(name, shape=tuple(shape), dtype=dtype, persistable=True, stop_gradient=True)
    Constant(value=value, force_cpu=force_cpu)(var, sblock)
    return var


class _LRBuilder:
    """Appends role-LRSched ops on float32 [1] temporaries to one block."""

    def __init__(self, main: Program, startup: Program) -> None:
        self.main = main
        self.startup = startup
        self.block: Block = main.global_block()

    def _attrs(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**(extra or {}), OP_ROLE_ATTR: int(OpRole.LRSCHED), OP_ROLE_VAR_ATTR: []}

    def op(self, type: str, inputs: dict[str, list[str]] | None, attrs: dict[str, Any] | None = None,
           dtype: str = _LR_DTYPE, out: str | None = None) -> str:
        if out is None:
            out = self.block.create_var(None, shape=(1,), dtype=dtype).name
        self.block.append_op(type, inputs, {"Out": [out]}, self._attrs(attrs))
        return out

    def const(self, value: float) -> str:
        return self.op("fill_constant", None, {"shape": [1], "dtype": _LR_DTYPE, "value": float(value)})

    def scale(self, x: str, scale: float, bias: float = 0.0) -> str:
        return self.op("scale", {"X": [x]}, {"scale": float(scale), "bias": float(bias)})

    def binary(self, kind: str, x: str, y: str) -> str:
        return self.op(f"elementwise_{kind}", {"X": [x], "Y": [y]})

    def unary(self, type: str, x: str) -> str:
        return self.op(type, {"X": [x]})

    def ceil(self, x: str) -> str:
        if has_op("ceil"):
            return self.unary("ceil", x)
        return self.scale(self.unary("floor", self.scale(x, -1.0)), -1.0)

    def step_counter(self, begin: int) -> str:
        """The float32 step (``@LR_DECAY_COUNTER@`` cast), creating the counter on first use."""
        if not self.block.has_var(LR_DECAY_COUNTER):
            create_global_var(self.main, self.startup, LR_DECAY_COUNTER, (1,), "int64", float(begin - 1),
                              force_cpu=True)
            self.block.insert_op(0, "increment", {"X": [LR_DECAY_COUNTER]}, {"Out": [LR_DECAY_COUNTER]},
                                 self._attrs({"step": 1.0}))
        return self.op("cast", {"X": [LR_DECAY_COUNTER]}, {"in_dtype": "int64", "out_dtype": _LR_DTYPE})

    def result(self, name: str) -> Variable:
        return self.block.var(name)


def _builder() -> _LRBuilder:
    return _LRBuilder(default_main_program(), default_startup_program())


def _decayed_steps(b: _LRBuilder, decay_steps: float, staircase: bool) -> str:
    div = b.scale(b.step_counter(0), 1.0 / decay_steps)
    return b.unary("floor", div) if staircase else div


def exponential_decay(learning_rate: float, decay_steps: float, decay_rate: float,
                      staircase: bool = False) -> Variable:
    """``learning_rate * decay_rate ** (step / decay_steps)`` (the exponent floored if ``staircase``)."""
    lr = number(learning_rate, "exponential_decay learning_rate", finite=True)
    steps = number(decay_steps, "exponential_decay decay_steps", finite=True, positive=True)
    rate = number(decay_rate, "exponential_decay decay_rate", finite=True)
    b = _builder()
    div = _decayed_steps(b, steps, bool(staircase))
    return b.result(b.scale(b.binary("pow", b.const(rate), div), lr))


def natural_exp_decay(learning_rate: float, decay_steps: float, decay_rate: float,
                      staircase: bool = False) -> Variable:
    """``learning_rate * exp(-decay_rate * step / decay_steps)`` (the ratio floored if ``staircase``)."""
    lr = number(learning_rate, "natural_exp_decay learning_rate", finite=True)
    steps = number(decay_steps, "natural_exp_decay decay_steps", finite=True, positive=True)
    rate = number(decay_rate, "natural_exp_decay decay_rate", finite=True)
    b = _builder()
    div = _decayed_steps(b, steps, bool(staircase))
    return b.result(b.scale(b.unary("exp", b.scale(div, -1.0 * rate)), lr))


def inverse_time_decay(learning_rate: float, decay_steps: float, decay_rate: float,
                       staircase: bool = False) -> Variable:
    """``learning_rate / (1 + decay_rate * step / decay_steps)`` (the ratio floored if ``staircase``)."""
    lr = number(learning_rate, "inverse_time_decay learning_rate", finite=True)
    steps = number(decay_steps, "inverse_time_decay decay_steps", finite=True, positive=True)
    rate = number(decay_rate, "inverse_time_decay decay_rate", finite=True)
    b = _builder()
    div = _decayed_steps(b, steps, bool(staircase))
    denominator = b.scale(b.scale(div, rate), 1.0, bias=1.0)
    return b.result(b.binary("div", b.const(lr), denominator))


def polynomial_decay(learning_rate: float, decay_steps: float, end_learning_rate: float = 0.0001,
                     power: float = 1.0, cycle: bool = False) -> Variable:
    """``(learning_rate - end) * (1 - step / decay_steps) ** power + end``; without ``cycle`` the step
    stops at ``decay_steps``, with it ``decay_steps`` grows to the next multiple above the step."""
    lr = number(learning_rate, "polynomial_decay learning_rate", finite=True)
    steps = number(decay_steps, "polynomial_decay decay_steps", finite=True, positive=True)
    end = number(end_learning_rate, "polynomial_decay end_learning_rate", finite=True)
    pw = number(power, "polynomial_decay power", finite=True)
    b = _builder()
    step = b.step_counter(0)
    if cycle:
        cycles = b.binary("max", b.ceil(b.scale(step, 1.0 / steps)), b.const(1.0))
        fraction = b.binary("div", step, b.scale(cycles, steps))
    else:
        fraction = b.scale(b.binary("min", step, b.const(steps)), 1.0 / steps)
    remaining = b.scale(fraction, -1.0, bias=1.0)
    return b.result(b.scale(b.binary("pow", remaining, b.const(pw)), lr - end, bias=end))


def piecewise_decay(boundaries: Sequence[float], values: Sequence[float]) -> Variable:
    """``values[i]`` while ``boundaries[i-1] <= step < boundaries[i]`` (``values[0]`` before the first
    boundary, ``values[-1]`` from the last one on). Straight-line ops, no Switch (see the module doc)."""
    if not isinstance(boundaries, (list, tuple)) or not isinstance(values, (list, tuple)):
        raise IRError("piecewise_decay needs lists of boundaries and values, got "
                      f"{type(boundaries).__name__} and {type(values).__name__}")
    bounds = [number(x, "piecewise_decay boundary", finite=True) for x in boundaries]
    vals = [number(x, "piecewise_decay value", finite=True) for x in values]
    if len(vals) - len(bounds) != 1:
        raise IRError(f"piecewise_decay: {len(bounds)} boundaries need {len(bounds) + 1} values, got {len(vals)}",
                      hint="len(values) - len(boundaries) must be 1")
    if any(a >= c for a, c in zip(bounds, bounds[1:])):
        raise IRError(f"piecewise_decay: boundaries {bounds} are not strictly increasing")
    b = _builder()
    step = b.step_counter(0)
    lr_var = create_global_var(b.main, b.startup, unique_name("learning_rate"), (1,), _LR_DTYPE, 0.0)
    below: list[str] = []
    for bound in bounds:
        bound_var = b.op("fill_constant", None, {"shape": [1], "dtype": _LR_DTYPE, "value": bound,
                                                 "force_cpu": True})
        mask = b.op("less_than", {"X": [step], "Y": [bound_var]}, {"force_cpu": True}, dtype="bool")
        below.append(b.op("cast", {"X": [mask]}, {"in_dtype": "bool", "out_dtype": _LR_DTYPE}))
    indicators: list[str] = []
    for i in range(len(vals)):
        if not bounds:
            indicators.append(b.const(1.0))
        elif i == 0:
            indicators.append(below[0])
        elif i == len(bounds):
            indicators.append(b.scale(below[-1], -1.0, bias=1.0))
        else:
            indicators.append(b.binary("sub", below[i], below[i - 1]))
    terms = [b.scale(ind, v) for ind, v in zip(indicators, vals)]
    b.op("sum", {"X": terms}, out=lr_var.name)
    return b.result(lr_var.name)


def noam_decay(d_model: float, warmup_steps: float) -> Variable:
    """The Transformer schedule ``d_model**-0.5 * min(step**-0.5, warmup_steps**-1.5 * step)``,
    counting steps from 1."""
    d = number(d_model, "noam_decay d_model", finite=True, positive=True)
    warmup = number(warmup_steps, "noam_decay warmup_steps", finite=True, positive=True)
    b = _builder()
    step = b.step_counter(1)
    a = b.binary("pow", step, b.const(-0.5))
    c = b.scale(step, warmup ** -1.5)
    return b.result(b.scale(b.binary("min", a, c), d ** -0.5))
