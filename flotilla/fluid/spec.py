"""What the builder's optimizer-side modules share: argument checks, the attrs of an optimize op, and
the spec objects (clips, regularizers) that a Parameter records as canonical spec strings.

Invariants:
- A spec object's identity is its canonical spec string (``L2Decay(0.001)``,
  ``GradientClipByNorm(clip_norm=1.0)``): two objects are equal, hash alike and print alike exactly
  when their specs are equal, so the string stored on the Parameter is the whole truth.
- ``parse_spec`` never evaluates code: only literal arguments parse.
- Every op an optimizer, a clip or a regularizer appends for a (param, grad) pair carries role
  Optimize and ``op_role_var = [param, grad]`` (``optimize_attrs``), as Fluid's ``_optimized_guard``.
"""
from __future__ import annotations

import ast
import math
from typing import Any, Mapping, TypeVar

from ir.errors import IRError
from ir.roles import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OpRole

__all__ = ["SpecObject", "number", "object_from_spec", "optimize_attrs", "parse_spec"]

T = TypeVar("T", bound="SpecObject")


def number(value: Any, what: str, *, finite: bool = False, positive: bool = False) -> float:
    """``value`` as a float, or an ``IRError`` naming ``what``; bools are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (finite and not math.isfinite(value)):
        kind = "a finite number" if finite else "a number"
        raise IRError(f"{what} must be {kind}, got {type(value).__name__} {value!r}")
    if positive and value <= 0:
        raise IRError(f"{what} must be positive, got {value!r}")
    return float(value)


def optimize_attrs(param: str, grad: str) -> dict[str, Any]:
    """The role attrs of an op that works for the pair (``param``, ``grad``)."""
    return {OP_ROLE_ATTR: int(OpRole.OPTIMIZE), OP_ROLE_VAR_ATTR: [param, grad]}


def parse_spec(spec: str, what: str) -> tuple[str, list[Any], dict[str, Any]]:
    """Split a canonical spec string ``Name(arg, key=value)`` into (name, args, kwargs).

    Only literal arguments (numbers, strings, ``None``, negative numbers) are accepted; this never
    evaluates code. ``what`` names the kind of spec for error messages.
    """
    if not isinstance(spec, str):
        raise IRError(f"a {what} spec must be a string, got {type(spec).__name__} {spec!r}")
    try:
        tree = ast.parse(spec.strip(), mode="eval")
    except SyntaxError:
        raise IRError(f"malformed {what} spec {spec!r}", hint="expected a call such as 'L2Decay(0.001)'") from None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise IRError(f"malformed {what} spec {spec!r}: expected Name(arguments)")
    try:
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}
    except ValueError:
        raise IRError(f"{what} spec {spec!r} has a non-literal argument",
                      hint="arguments must be numbers, strings or None") from None
    if len(kwargs) != len(call.keywords):
        raise IRError(f"{what} spec {spec!r} uses **kwargs, which is not allowed")
    return call.func.id, args, kwargs


def object_from_spec(spec: str, what: str, classes: Mapping[str, type[T]], usage: str | None = None) -> T:
    """Rebuild the spec object ``spec`` names, from ``classes`` (spec name → class). ``usage``, when
    given, is the hint for bad arguments, with ``{name}`` standing for the spec's name."""
    name, args, kwargs = parse_spec(spec, what)
    cls = classes.get(name)
    if cls is None:
        raise IRError(f"unknown {what} {name!r} in spec {spec!r}", hint=f"one of {sorted(classes)}")
    try:
        return cls(*args, **kwargs)
    except TypeError as e:
        hint = None if usage is None else usage.format(name=name)
        raise IRError(f"{what} spec {spec!r} has bad arguments: {e}", hint=hint) from None


class SpecObject:
    """A clip or regularizer: equal, hashed and printed by its canonical spec string."""

    @property
    def spec(self) -> str:
        """The canonical spec string the Parameter records."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.spec == self.spec  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return self.spec

    __str__ = __repr__
