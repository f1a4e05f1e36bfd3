"""``ParamAttr``: how a layer creates one of its parameters (Fluid 1.5's ``fluid.ParamAttr``).

A ParamAttr is a frozen value: a layer never edits the caller's attr, it derives a new one
(``with_name``, ``with_default_initializer``). ``to_attr`` turns the shorthands layers accept into a
ParamAttr: ``None``/``True`` → default, ``str`` → a name, an ``Initializer`` → that initializer,
``False`` → no parameter at all (``bias_attr=False`` means "no bias").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flotilla.fluid.initializer import Initializer
from ir.errors import IRError


@dataclass(frozen=True)
class ParamAttr:
    """Name, initializer, per-parameter learning-rate multiplier, regularizer, trainability and
    gradient clip of a parameter. ``regularizer`` and ``gradient_clip`` are the user's objects
    (from ``fluid.regularizer`` / ``fluid.clip``); the Parameter records their canonical spec strings."""

    name: str | None = None
    initializer: Initializer | None = None
    learning_rate: float = 1.0
    regularizer: Any = None
    trainable: bool = True
    gradient_clip: Any = None
    do_model_average: bool = False

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise IRError(f"ParamAttr name must be a non-empty string or None, got {self.name!r}")
        if self.initializer is not None and not isinstance(self.initializer, Initializer):
            raise IRError(f"ParamAttr initializer must be a fluid.initializer.Initializer, got "
                          f"{type(self.initializer).__name__}", hint="e.g. fluid.initializer.Constant(0.0)")
        if isinstance(self.learning_rate, bool) or not isinstance(self.learning_rate, (int, float)):
            raise IRError(f"ParamAttr learning_rate must be a number, got {self.learning_rate!r}")
        object.__setattr__(self, "learning_rate", float(self.learning_rate))
        if not isinstance(self.trainable, bool):
            raise IRError(f"ParamAttr trainable must be a bool, got {self.trainable!r}")

    def with_name(self, name: str) -> "ParamAttr":
        return dataclasses.replace(self, name=name)

    def with_default_initializer(self, initializer: Initializer) -> "ParamAttr":
        """This attr, with ``initializer`` if it names none."""
        if self.initializer is not None:
            return self
        return dataclasses.replace(self, initializer=initializer)

    @staticmethod
    def to_attr(arg: Any, arg_name: str = "param_attr") -> "ParamAttr | bool":
        """The ParamAttr a layer argument stands for; ``False`` means "create no parameter"."""
        if arg is None or arg is True:
            return ParamAttr()
        if arg is False:
            return False
        if isinstance(arg, ParamAttr):
            return arg
        if isinstance(arg, str):
            return ParamAttr(name=arg)
        if isinstance(arg, Initializer):
            return ParamAttr(initializer=arg)
        raise IRError(f"{arg_name} must be a ParamAttr, a name, an Initializer, None or False, "
                      f"got {type(arg).__name__} {arg!r}", hint="e.g. fluid.ParamAttr(name='fc_w')")


def spec_of(obj: Any, what: str) -> str | None:
    """The canonical spec string a Parameter records for a regularizer or gradient clip object:
    a string is taken as is; an object gives its ``spec`` (a property or a method); None gives None."""
    if obj is None:
        return None
    if isinstance(obj, str):
        return obj
    spec = getattr(obj, "spec", None)
    if callable(spec):
        spec = spec()
    if isinstance(spec, str):
        return spec
    raise IRError(f"{what} must be a string spec or an object with a string `spec`, got {type(obj).__name__}",
                  hint="use the classes of fluid.regularizer (L2Decay, L1Decay) or fluid.clip")
