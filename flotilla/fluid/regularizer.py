"""Weight-decay regularizers (Fluid 1.5's ``fluid.regularizer``) that append ops to a program.

``append_regularization_ops(params_grads, regularization)`` adds, for every (parameter, gradient)
pair, the decay term to the gradient:

- ``L2Decay(c)``: ``scale(param, scale=c) -> decay``, then ``sum([grad, decay]) -> grad``;
- ``L1Decay(c)``: ``sign(param) -> decay``, ``scale(decay, scale=c) -> decay``, then the same ``sum``.

Invariants:
- The parameter's own regularizer (``Parameter.regularizer``, a canonical spec string) wins over the
  optimizer's ``regularization``; a parameter with neither is left alone. The user's object from the
  layer helper's side table (``layer_helper.param_regularizer``) is used when its spec matches.
- As in Fluid 1.5, the ``sum`` writes the gradient **in place** (the gradient keeps its name, so the
  distributed transpiler still finds it by its ``op_role_var``); every op has role Optimize and
  ``op_role_var = [param, grad]``.
- A ``selected_rows`` (sparse) gradient cannot be regularized: Fluid densifies it through a
  ``lookup_table`` on the gradient's rows; Flotilla raises an ``IRError`` saying so instead of
  silently turning a sparse gradient dense.
- Canonical spec strings are ``L2Decay(0.001)`` and ``L1Decay(0.5)`` (the coefficient as Python's
  shortest float repr); ``regularizer_from_spec`` parses them back (``L2DecayRegularizer(...)`` and
  ``regularization_coeff=`` keyword forms are accepted too).
"""
from __future__ import annotations

from typing import Any, Sequence

from flotilla.fluid.layer_helper import param_regularizer
from flotilla.fluid.spec import SpecObject, number, object_from_spec, optimize_attrs
from flotilla.fluid.spec import parse_spec  # noqa: F401  (fluid.regularizer.parse_spec stays public)
from ir.core import Block, Parameter, Program, Variable, default_main_program
from ir.errors import IRError
from ir.ops.registry import has_op

__all__ = [
    "WeightDecayRegularizer", "L1Decay", "L2Decay", "L1DecayRegularizer", "L2DecayRegularizer",
    "append_regularization_ops", "regularizer_from_spec", "parse_spec",
]


class WeightDecayRegularizer(SpecObject):
    """Base class: ``append_decay`` adds the ops computing the decay term and returns its variable."""

    name: str = ""

    def __init__(self, regularization_coeff: float = 0.0) -> None:
        self.regularization_coeff = number(regularization_coeff, f"{type(self).__name__}: regularization_coeff")

    @property
    def spec(self) -> str:
        """The canonical spec string stored on ``Parameter.regularizer``."""
        return f"{self.name}({self.regularization_coeff!r})"

    @staticmethod
    def from_spec(spec: str) -> "WeightDecayRegularizer":
        return regularizer_from_spec(spec)

    def append_decay(self, param: Parameter, grad: Variable, block: Block) -> Variable:
        raise NotImplementedError


class L2Decay(WeightDecayRegularizer):
    """L2 weight decay: adds ``regularization_coeff * param`` to the gradient."""

    name = "L2Decay"

    def append_decay(self, param: Parameter, grad: Variable, block: Block) -> Variable:
        decay = block.create_var(None, shape=param.shape, dtype=param.dtype)
        block.append_op("scale", {"X": [param.name]}, {"Out": [decay.name]},
                        {"scale": self.regularization_coeff, **optimize_attrs(param.name, grad.name)})
        return block.var(decay.name)


class L1Decay(WeightDecayRegularizer):
    """L1 weight decay: adds ``regularization_coeff * sign(param)`` to the gradient."""

    name = "L1Decay"

    def append_decay(self, param: Parameter, grad: Variable, block: Block) -> Variable:
        attrs = optimize_attrs(param.name, grad.name)
        decay = block.create_var(None, shape=param.shape, dtype=param.dtype)
        if has_op("sign"):
            block.append_op("sign", {"X": [param.name]}, {"Out": [decay.name]}, dict(attrs))
        else:
            _append_sign_decomposition(block, param, decay, attrs)
        block.append_op("scale", {"X": [decay.name]}, {"Out": [decay.name]},
                        {"scale": self.regularization_coeff, **attrs})
        return block.var(decay.name)


def _append_sign_decomposition(block: Block, param: Parameter, out: Variable, attrs: dict[str, Any]) -> None:
    """sign(p) = cast(0 < p) - cast(p < 0), exact, for when no ``sign`` op is registered."""
    zero = block.create_var(None, shape=param.shape, dtype=param.dtype)
    block.append_op("fill_constant", None, {"Out": [zero.name]},
                    {"shape": list(param.shape), "dtype": param.dtype, "value": 0.0, **attrs})
    parts = []
    for x, y in ((zero.name, param.name), (param.name, zero.name)):
        mask = block.create_var(None, shape=param.shape, dtype="bool")
        block.append_op("less_than", {"X": [x], "Y": [y]}, {"Out": [mask.name]}, dict(attrs))
        as_float = block.create_var(None, shape=param.shape, dtype=param.dtype)
        block.append_op("cast", {"X": [mask.name]}, {"Out": [as_float.name]},
                        {"in_dtype": "bool", "out_dtype": param.dtype, **attrs})
        parts.append(as_float.name)
    block.append_op("elementwise_sub", {"X": [parts[0]], "Y": [parts[1]]}, {"Out": [out.name]}, dict(attrs))


# Fluid's long names.
L1DecayRegularizer = L1Decay
L2DecayRegularizer = L2Decay

_BY_NAME: dict[str, type[WeightDecayRegularizer]] = {
    "L2Decay": L2Decay, "L2DecayRegularizer": L2Decay, "L1Decay": L1Decay, "L1DecayRegularizer": L1Decay,
}


def regularizer_from_spec(spec: str) -> WeightDecayRegularizer:
    """Rebuild a regularizer from its canonical spec string (``L2Decay(0.001)``)."""
    return object_from_spec(spec, "regularizer", _BY_NAME, usage="expected {name}(regularization_coeff)")


def as_regularizer(value: WeightDecayRegularizer | str | None) -> WeightDecayRegularizer | None:
    """A regularizer object from an object, a spec string or None."""
    if value is None or isinstance(value, WeightDecayRegularizer):
        return value
    if isinstance(value, str):
        return regularizer_from_spec(value)
    raise IRError(f"expected a regularizer (L1Decay/L2Decay) or its spec string, got {type(value).__name__} {value!r}")


def _param_regularizer(program: Program, param: Parameter) -> WeightDecayRegularizer | None:
    """The parameter's own regularizer: the user's object from the layer helper's side table when it
    still matches the spec recorded on the Parameter (the truth), else one rebuilt from that spec."""
    spec = param.regularizer if isinstance(param, Parameter) else None
    if spec is None:
        return None
    obj = param_regularizer(program, param.name)
    if isinstance(obj, WeightDecayRegularizer) and obj.spec == spec:
        return obj
    return regularizer_from_spec(spec)


def append_regularization_ops(params_grads: Sequence[tuple[Parameter, Variable | None]],
                              regularization: WeightDecayRegularizer | str | None = None,
                              program: Program | None = None) -> list[tuple[Parameter, Variable | None]]:
    """Add each parameter's decay term to its gradient; returns the (param, grad) pairs to optimize.

    The parameter's own regularizer wins over ``regularization``. Ops go to the global block of
    ``program`` (the default main program when None). Pairs whose gradient is None pass through.
    """
    default = as_regularizer(regularization)
    block = (program or default_main_program()).global_block()
    result: list[tuple[Parameter, Variable | None]] = []
    for param, grad in params_grads:
        if grad is None:
            result.append((param, grad))
            continue
        reg = _param_regularizer(block.program, param)
        reg = reg if reg is not None else default
        if reg is None:
            result.append((param, grad))
            continue
        if grad.type == "selected_rows":
            raise IRError(
                f"cannot apply {reg.spec} to parameter {param.name!r}: its gradient {grad.name!r} is selected_rows"
                " (sparse), and regularizing it would make it dense",
                hint="give the regularizer through the ParamAttr of the dense parameters instead of the "
                     "optimizer's regularization, or build this layer with is_sparse=False")
        decay = reg.append_decay(param, grad, block)
        block.append_op("sum", {"X": [grad.name, decay.name]}, {"Out": [grad.name]},
                        optimize_attrs(param.name, grad.name))
        result.append((param, block.var_recursive(grad.name)))
    return result
