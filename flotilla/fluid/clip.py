"""Gradient clipping (Fluid 1.5's ``fluid.clip``) that appends ops to a program.

- ``GradientClipByValue(max, min=None)``: ``clip(grad, min, max) -> new grad`` (``min`` defaults to -max);
- ``GradientClipByNorm(clip_norm)``: ``clip_by_norm(grad, max_norm) -> new grad``;
- ``GradientClipByGlobalNorm(clip_norm, group_name)``: per group, Fluid's decomposition
  ``fill_constant(clip_norm)``, per gradient ``square -> reduce_sum``, then once ``sum -> sqrt``,
  ``elementwise_max(clip, norm)``, ``elementwise_div(clip, max) -> scale``, and per gradient
  ``elementwise_mul(grad, scale) -> new grad``.

Invariants:
- Which clip applies to a parameter: its own ``Parameter.gradient_clip`` (a canonical spec string,
  set by ``ParamAttr(gradient_clip=...)`` or ``set_gradient_clip``), else the ``grad_clip`` given to
  ``Optimizer.minimize``, else none.
- Every op has role Optimize and ``op_role_var = [param, grad]`` of the pair it works for (the group
  ops of a global norm carry the pair that first needs them), as Fluid's ``_optimized_guard`` does.
- Clipping writes a new gradient variable (Fluid's ``layers.clip`` output); the returned pairs name it.
- Canonical spec strings (what ``Parameter.gradient_clip`` stores, parsed back by ``clip_from_spec``):
  ``GradientClipByValue(max=1.0, min=-1.0)``, ``GradientClipByNorm(clip_norm=1.0)``,
  ``GradientClipByGlobalNorm(clip_norm=1.0, group_name="default_group")``; positional forms parse too.
- Global-norm clipping of a ``selected_rows`` gradient raises an ``IRError`` (Fluid merges the rows
  into a dense tensor first, which Flotilla does not do); by-value and by-norm clipping pass sparse
  gradients straight to their op.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from flotilla.fluid.layer_helper import param_gradient_clip
from flotilla.fluid.spec import SpecObject, number, object_from_spec, optimize_attrs
from ir.core import Block, Parameter, Program, Variable, default_main_program
from ir.errors import IRError

__all__ = [
    "BaseGradientClipAttr", "GradientClipByValue", "GradientClipByNorm", "GradientClipByGlobalNorm",
    "set_gradient_clip", "append_gradient_clip_ops", "clip_from_spec",
]


class BaseGradientClipAttr(SpecObject):
    """A clipping rule. ``process_context`` runs for every pair first (global norms collect their
    per-gradient terms), then ``create_operators`` makes each clipped gradient."""

    @staticmethod
    def from_spec(spec: str) -> "BaseGradientClipAttr":
        return clip_from_spec(spec)

    def process_context(self, context: dict[str, Any], param: Parameter, grad: Variable, block: Block) -> None:
        """Record what this pair contributes to shared state (nothing for per-gradient clips)."""

    def create_operators(self, context: dict[str, Any], param: Parameter, grad: Variable,
                         block: Block) -> Variable:
        """Append the clipping ops for one pair; returns the clipped gradient."""
        raise NotImplementedError


def _new_grad(block: Block, grad: Variable) -> Variable:
    return block.create_var(None, shape=grad.shape, dtype=grad.dtype, type=grad.type)


class GradientClipByValue(BaseGradientClipAttr):
    """Clip every gradient element into [min, max]; ``min`` defaults to ``-max``."""

    def __init__(self, max: float, min: float | None = None) -> None:
        self.max = number(max, "GradientClipByValue max")
        self.min = -self.max if min is None else number(min, "GradientClipByValue min")
        if self.min > self.max:
            raise IRError(f"GradientClipByValue: min {self.min} is greater than max {self.max}",
                          hint="pass max first: GradientClipByValue(max, min)")

    @property
    def spec(self) -> str:
        return f"GradientClipByValue(max={self.max!r}, min={self.min!r})"

    def create_operators(self, context: dict[str, Any], param: Parameter, grad: Variable,
                         block: Block) -> Variable:
        out = _new_grad(block, grad)
        block.append_op("clip", {"X": [grad.name]}, {"Out": [out.name]},
                        {"min": self.min, "max": self.max, **optimize_attrs(param.name, grad.name)})
        return block.var(out.name)


class GradientClipByNorm(BaseGradientClipAttr):
    """Scale each gradient down so that its L2 norm is at most ``clip_norm``."""

    def __init__(self, clip_norm: float) -> None:
        self.clip_norm = number(clip_norm, "GradientClipByNorm clip_norm")
        if self.clip_norm <= 0:
            raise IRError(f"GradientClipByNorm: clip_norm must be positive, got {self.clip_norm}")

    @property
    def spec(self) -> str:
        return f"GradientClipByNorm(clip_norm={self.clip_norm!r})"

    def create_operators(self, context: dict[str, Any], param: Parameter, grad: Variable,
                         block: Block) -> Variable:
        out = _new_grad(block, grad)
        block.append_op("clip_by_norm", {"X": [grad.name]}, {"Out": [out.name]},
                        {"max_norm": self.clip_norm, **optimize_attrs(param.name, grad.name)})
        return block.var(out.name)


class GradientClipByGlobalNorm(BaseGradientClipAttr):
    """Scale every gradient of a group by ``clip_norm / max(clip_norm, global_norm)``, where the
    global norm is over all gradients of the group; one group shares a single ``clip_norm``."""

    def __init__(self, clip_norm: float, group_name: str = "default_group") -> None:
        self.clip_norm = number(clip_norm, "GradientClipByGlobalNorm clip_norm")
        if self.clip_norm <= 0:
            raise IRError(f"GradientClipByGlobalNorm: clip_norm must be positive, got {self.clip_norm}")
        if not isinstance(group_name, str) or not group_name:
            raise IRError(f"GradientClipByGlobalNorm: group_name must be a non-empty string, got {group_name!r}")
        self.group_name = group_name

    @property
    def spec(self) -> str:
        return (f"GradientClipByGlobalNorm(clip_norm={self.clip_norm!r}, "
                f"group_name={json.dumps(self.group_name)})")

    def _key(self) -> str:
        return f"global_norm:{self.group_name}"

    def process_context(self, context: dict[str, Any], param: Parameter, grad: Variable, block: Block) -> None:
        if grad.type == "selected_rows":
            raise IRError(
                f"GradientClipByGlobalNorm cannot clip {grad.name!r} of parameter {param.name!r}: it is a"
                " selected_rows (sparse) gradient",
                hint="use GradientClipByValue or GradientClipByNorm for sparse parameters")
        attrs = optimize_attrs(param.name, grad.name)
        group = context.get(self._key())
        if group is None:
            clip_var = block.create_var(None, shape=(1,), dtype=grad.dtype)
            block.append_op("fill_constant", None, {"Out": [clip_var.name]},
                            {"shape": [1], "dtype": grad.dtype, "value": self.clip_norm, **attrs})
            group = {"clip_norm": self.clip_norm, "clip_var": clip_var.name, "norms": [], "scale": None}
            context[self._key()] = group
        elif group["clip_norm"] != self.clip_norm:
            raise IRError(
                f"GradientClipByGlobalNorm group {self.group_name!r}: parameter {param.name!r} has clip_norm"
                f" {self.clip_norm} but the group already uses {group['clip_norm']}",
                hint="all parameters of one group must share the same clip_norm; use another group_name")
        square = block.create_var(None, shape=grad.shape, dtype=grad.dtype)
        block.append_op("square", {"X": [grad.name]}, {"Out": [square.name]}, dict(attrs))
        local_norm = block.create_var(None, shape=(1,), dtype=grad.dtype)
        block.append_op("reduce_sum", {"X": [square.name]}, {"Out": [local_norm.name]},
                        {"reduce_all": True, **attrs})
        group["norms"].append(local_norm.name)

    def create_operators(self, context: dict[str, Any], param: Parameter, grad: Variable,
                         block: Block) -> Variable:
        group = context[self._key()]
        attrs = optimize_attrs(param.name, grad.name)
        if group["scale"] is None:
            dtype = grad.dtype
            total = block.create_var(None, shape=(1,), dtype=dtype)
            block.append_op("sum", {"X": list(group["norms"])}, {"Out": [total.name]}, dict(attrs))
            norm = block.create_var(None, shape=(1,), dtype=dtype)
            block.append_op("sqrt", {"X": [total.name]}, {"Out": [norm.name]}, dict(attrs))
            bigger = block.create_var(None, shape=(1,), dtype=dtype)
            block.append_op("elementwise_max", {"X": [group["clip_var"]], "Y": [norm.name]},
                            {"Out": [bigger.name]}, dict(attrs))
            scale = block.create_var(None, shape=(1,), dtype=dtype)
            block.append_op("elementwise_div", {"X": [group["clip_var"]], "Y": [bigger.name]},
                            {"Out": [scale.name]}, dict(attrs))
            group["scale"] = scale.name
        out = _new_grad(block, grad)
        block.append_op("elementwise_mul", {"X": [grad.name], "Y": [group["scale"]]}, {"Out": [out.name]},
                        dict(attrs))
        return block.var(out.name)


_BY_NAME: dict[str, type[BaseGradientClipAttr]] = {
    "GradientClipByValue": GradientClipByValue,
    "GradientClipByNorm": GradientClipByNorm,
    "GradientClipByGlobalNorm": GradientClipByGlobalNorm,
}


def clip_from_spec(spec: str) -> BaseGradientClipAttr:
    """Rebuild a clip object from its canonical spec string."""
    return object_from_spec(spec, "gradient clip", _BY_NAME)


def as_clip(value: BaseGradientClipAttr | str | None) -> BaseGradientClipAttr | None:
    """A clip object from an object, a spec string or None."""
    if value is None or isinstance(value, BaseGradientClipAttr):
        return value
    if isinstance(value, str):
        return clip_from_spec(value)
    raise IRError(f"expected a gradient clip (GradientClipByValue/ByNorm/ByGlobalNorm) or its spec string,"
                  f" got {type(value).__name__} {value!r}")


def set_gradient_clip(clip: BaseGradientClipAttr, param_list: Sequence[Parameter | str] | None = None,
                      program: Program | None = None) -> None:
    """Record ``clip`` on the parameters of ``param_list`` (all parameters of ``program``'s global
    block by default); ``append_gradient_clip_ops`` applies it when the optimizer runs."""
    if not isinstance(clip, BaseGradientClipAttr):
        raise IRError(f"set_gradient_clip needs a gradient clip object, got {type(clip).__name__} {clip!r}",
                      hint="e.g. GradientClipByGlobalNorm(clip_norm=5.0)")
    block = (program or default_main_program()).global_block()
    names = [p.name for p in block.vars.values() if isinstance(p, Parameter)] if param_list is None else [
        p if isinstance(p, str) else p.name for p in param_list]
    for name in names:
        if not isinstance(block.var(name), Parameter):
            raise IRError(f"set_gradient_clip: {name!r} is not a parameter of the program's global block")
    for name in names:
        block.replace_var(name, gradient_clip=clip.spec)


def _param_clip(program: Program, param: Parameter) -> BaseGradientClipAttr | None:
    """The parameter's own clip: the user's object from the layer helper's side table when it still
    matches the spec recorded on the Parameter (the truth), else one rebuilt from that spec."""
    spec = param.gradient_clip if isinstance(param, Parameter) else None
    if spec is None:
        return None
    obj = param_gradient_clip(program, param.name)
    if isinstance(obj, BaseGradientClipAttr) and obj.spec == spec:
        return obj
    return clip_from_spec(spec)


def append_gradient_clip_ops(params_grads: Sequence[tuple[Parameter, Variable | None]],
                             grad_clip: BaseGradientClipAttr | str | None = None,
                             program: Program | None = None) -> list[tuple[Parameter, Variable | None]]:
    """Clip each gradient by its parameter's clip (else ``grad_clip``); returns the new pairs.

    Pairs without a clip, or without a gradient, pass through unchanged. Ops go to the global block
    of ``program`` (the default main program when None).
    """
    default = as_clip(grad_clip)
    block = (program or default_main_program()).global_block()
    context: dict[str, Any] = {}
    chosen: list[BaseGradientClipAttr | None] = []
    for param, grad in params_grads:
        clip = _param_clip(block.program, param)
        clip = clip if clip is not None else default
        chosen.append(clip if grad is not None else None)
        if clip is not None and grad is not None:
            clip.process_context(context, param, grad, block)
    result: list[tuple[Parameter, Variable | None]] = []
    for (param, grad), clip in zip(params_grads, chosen):
        if clip is None or grad is None:
            result.append((param, grad))
        else:
            result.append((param, clip.create_operators(context, param, grad, block)))
    return result
