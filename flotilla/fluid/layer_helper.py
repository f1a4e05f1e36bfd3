"""``LayerHelper``: what every layer uses to create parameters, temporaries and ops (Fluid 1.5).

Naming (as Fluid): a helper for layer type ``fc`` is named ``fc_N`` (or the layer's ``name=``);
its parameters are ``fc_N.w_i`` / ``fc_N.b_i`` unless a ParamAttr names them, its temporaries
``fc_N.tmp_i``. All names come from ``ir.names.unique_name``.

A parameter lives twice: as a Parameter in the main program's global block (what ops read) and as a
Parameter in the startup program's global block, where its initializer's op is prepended. Creating a
parameter whose name already exists with the same shape and dtype shares it (Fluid's parameter sharing
by name) and emits no second init op; a different shape or dtype is an error.

The Parameter records its regularizer and gradient clip as canonical spec strings. The user's objects
are also kept in a side table keyed by (program, parameter name) — ``param_regularizer`` /
``param_gradient_clip`` return them (None when unknown, e.g. in a clone: rebuild from the spec then).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from flotilla.fluid.initializer import Constant, Initializer, Xavier
from flotilla.fluid.param_attr import ParamAttr, spec_of
from ir.core import Block, Operator, Parameter, Program, Variable, default_main_program, default_startup_program
from ir.errors import IRError
from ir.names import unique_name
from ir.ops.registry import DTYPES, find_op_def


@dataclass(frozen=True)
class _ParamExtras:
    regularizer: Any
    gradient_clip: Any
    do_model_average: bool


_EXTRAS: "weakref.WeakKeyDictionary[Program, dict[str, _ParamExtras]]" = weakref.WeakKeyDictionary()


def param_regularizer(program: Program, name: str) -> Any:
    """The regularizer object given in the ParamAttr of parameter ``name`` of ``program`` (or None)."""
    extras = _EXTRAS.get(program, {}).get(name)
    return extras.regularizer if extras else None


def param_gradient_clip(program: Program, name: str) -> Any:
    """The gradient clip object given in the ParamAttr of parameter ``name`` of ``program`` (or None)."""
    extras = _EXTRAS.get(program, {}).get(name)
    return extras.gradient_clip if extras else None


def param_do_model_average(program: Program, name: str) -> bool:
    extras = _EXTRAS.get(program, {}).get(name)
    return bool(extras and extras.do_model_average)


def normalize_dtype(value: Any, arg_name: str = "dtype") -> str:
    """A dtype argument (numpy name, numpy dtype or type) as a numpy dtype name."""
    if isinstance(value, str):
        name = value
    else:
        name = getattr(value, "name", None) or getattr(value, "__name__", None) or ""
        if not isinstance(name, str):
            name = ""
    if name not in DTYPES:
        raise IRError(f"{arg_name} must be one of {list(DTYPES)}, got {value!r}")
    return name


class LayerHelper:
    """Builds one layer. ``kwargs`` are the layer's arguments (``name``, ``param_attr``, ``bias_attr``,
    ``act`` are read here)."""

    def __init__(self, layer_type: str, **kwargs: Any) -> None:
        self.layer_type = layer_type
        self.kwargs = kwargs
        name = kwargs.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise IRError(f"{layer_type}: name must be a non-empty string or None, got {name!r}")
        self.name: str = name if name is not None else unique_name(layer_type)

    # --- programs
    @property
    def main_program(self) -> Program:
        return default_main_program()

    @property
    def startup_program(self) -> Program:
        return default_startup_program()

    @property
    def block(self) -> Block:
        """Where the layer's ops go: the main program's current block."""
        return self.main_program.current_block()

    # --- arguments
    @property
    def param_attr(self) -> ParamAttr | bool:
        return ParamAttr.to_attr(self.kwargs.get("param_attr"), "param_attr")

    @property
    def bias_attr(self) -> ParamAttr | bool:
        return ParamAttr.to_attr(self.kwargs.get("bias_attr"), "bias_attr")

    def multiple_input(self, arg_name: str = "input") -> list[Variable]:
        value = self.kwargs.get(arg_name)
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values:
            raise IRError(f"{self.layer_type}: {arg_name} is an empty list", hint="pass at least one Variable")
        for i, v in enumerate(values):
            if not isinstance(v, Variable):
                where = f"{arg_name}[{i}]" if isinstance(value, (list, tuple)) else arg_name
                raise IRError(f"{self.layer_type}: {where} must be a Variable, got {type(v).__name__} {v!r}")
        return values

    def input(self, arg_name: str = "input") -> Variable:
        values = self.multiple_input(arg_name)
        if len(values) != 1:
            raise IRError(f"{self.layer_type}: {arg_name} must be one Variable, got a list of {len(values)}")
        return values[0]

    def multiple_param_attr(self, length: int) -> list[ParamAttr]:
        attr = self.kwargs.get("param_attr")
        attrs = list(attr) if isinstance(attr, (list, tuple)) else [attr] * length
        if len(attrs) != length:
            raise IRError(f"{self.layer_type}: param_attr has {len(attrs)} entries for {length} inputs")
        out = []
        for a in attrs:
            pa = ParamAttr.to_attr(a, "param_attr")
            if pa is False:
                raise IRError(f"{self.layer_type}: param_attr cannot be False", hint="only bias_attr may be False")
            out.append(pa)
        return out

    def iter_inputs_and_params(self, arg_name: str = "input") -> Iterator[tuple[Variable, ParamAttr]]:
        inputs = self.multiple_input(arg_name)
        yield from zip(inputs, self.multiple_param_attr(len(inputs)))

    def input_dtype(self, arg_name: str = "input") -> str:
        inputs = self.multiple_input(arg_name)
        dtype = inputs[0].dtype
        for v in inputs[1:]:
            if v.dtype != dtype:
                raise IRError(f"{self.layer_type}: the variables of {arg_name} have different dtypes "
                              f"({inputs[0].name}: {dtype}, {v.name}: {v.dtype})", hint="cast them to one dtype")
        return dtype

    # --- variables
    def create_parameter(self, attr: ParamAttr, shape: Sequence[int], dtype: str = "float32", is_bias: bool = False,
                         default_initializer: Initializer | None = None, is_distributed: bool = False) -> Parameter:
        """A parameter in the main and startup global blocks, initialised in the startup program."""
        if not isinstance(attr, ParamAttr):
            raise IRError(f"{self.layer_type}: create_parameter needs a ParamAttr, got {attr!r}")
        shape = tuple(int(d) for d in shape)
        if any(d <= 0 for d in shape):
            raise IRError(f"{self.layer_type}: parameter shape {list(shape)} must have positive extents",
                          hint="a parameter cannot depend on the batch size")
        dtype = normalize_dtype(dtype)
        if default_initializer is None:
            default_initializer = Constant(0.0) if is_bias else Xavier()
        attr = attr.with_default_initializer(default_initializer)
        name = attr.name or unique_name(f"{self.name}.{'b' if is_bias else 'w'}")
        main_block = self.main_program.global_block()
        existing = main_block.vars.get(name)
        if existing is not None:
            if not isinstance(existing, Parameter) or existing.shape != shape or existing.dtype != dtype:
                raise IRError(f"{self.layer_type}: parameter {name!r} already exists as {existing.shape} "
                              f"{existing.dtype}, cannot create it as {list(shape)} {dtype}",
                              hint="give the ParamAttr another name, or share with the same shape")
            return existing
        fields = dict(
            trainable=attr.trainable,
            stop_gradient=not attr.trainable,
            learning_rate=attr.learning_rate,
            regularizer=spec_of(attr.regularizer, "regularizer"),
            gradient_clip=spec_of(attr.gradient_clip, "gradient_clip"),
            is_distributed=is_distributed,
        )
        startup_block = self.startup_program.global_block()
        if not startup_block.has_var(name):
            startup_block.create_parameter(name, shape, dtype, **fields)
            attr.initializer(startup_block.var(name), startup_block)  # type: ignore[misc]
        param = main_block.create_parameter(name, shape, dtype, **fields)
        _EXTRAS.setdefault(self.main_program, {})[name] = _ParamExtras(
            attr.regularizer, attr.gradient_clip, attr.do_model_average)
        return param

    def create_variable_for_type_inference(self, dtype: str = "float32", stop_gradient: bool = False) -> Variable:
        """A fresh temporary ``<layer>.tmp_N`` in the current block; its shape is set when the op
        producing it is appended."""
        return self.block.create_var(name=unique_name(f"{self.name}.tmp"), dtype=normalize_dtype(dtype),
                                     stop_gradient=stop_gradient)

    def create_global_variable(self, shape: Sequence[int], dtype: str = "float32", persistable: bool = False,
                               name: str | None = None, stop_gradient: bool = False, **fields: Any) -> Variable:
        """A variable of the main program's global block (a fresh ``<layer>.tmp_N`` name by default)."""
        name = name if name is not None else unique_name(f"{self.name}.tmp")
        return self.main_program.global_block().create_var(
            name=name, shape=tuple(shape), dtype=normalize_dtype(dtype), persistable=persistable,
            stop_gradient=stop_gradient, **fields)

    def set_variable_initializer(self, var: Variable, initializer: Initializer) -> Operator:
        """Create ``var`` (persistable) in the startup program and prepend its init op there."""
        startup_block = self.startup_program.global_block()
        if not startup_block.has_var(var.name):
            startup_block.create_var(name=var.name, shape=var.shape, dtype=var.dtype, type=var.type,
                                     persistable=True)
        return initializer(startup_block.var(var.name), startup_block)

    # --- ops
    def append_op(self, type: str, inputs: dict[str, Any] | None = None, outputs: dict[str, Any] | None = None,
                  attrs: dict[str, Any] | None = None) -> Operator:
        """Append to the current block; attrs the schema does not declare among the backend hints
        ``use_cudnn``/``use_mkldnn`` are dropped (they select kernels, not semantics)."""
        attrs = dict(attrs or {})
        op_def = find_op_def(type)
        if op_def is not None:
            for hint in ("use_cudnn", "use_mkldnn"):
                if hint in attrs and op_def.attr_def(hint) is None:
                    del attrs[hint]
        return self.block.append_op(type, inputs=inputs, outputs=outputs, attrs=attrs)

    def var(self, name: str) -> Variable:
        """The variable ``name`` as currently recorded (after shape inference)."""
        return self.block.var_recursive(name)

    def append_bias_op(self, input_var: Variable, dim_start: int = 1, dim_end: int | None = None) -> Variable:
        """``input + b`` with b of shape input.shape[dim_start:dim_end] (no-op when bias_attr is False)."""
        bias_attr = self.bias_attr
        if bias_attr is False:
            return input_var
        size = list(input_var.shape[dim_start:dim_end])
        b = self.create_parameter(bias_attr, size, input_var.dtype, is_bias=True)  # type: ignore[arg-type]
        tmp = self.create_variable_for_type_inference(input_var.dtype)
        self.append_op("elementwise_add", inputs={"X": [input_var], "Y": [b]}, outputs={"Out": [tmp]},
                       attrs={"axis": dim_start})
        return self.var(tmp.name)

    def append_activation(self, input_var: Variable) -> Variable:
        """Apply ``act`` (an op type, or a dict with ``type`` and the op's attrs) if the layer has one."""
        act = self.kwargs.get("act")
        if act is None:
            return input_var
        if isinstance(act, str):
            act = {"type": act}
        if not isinstance(act, dict) or not isinstance(act.get("type"), str):
            raise IRError(f"{self.layer_type}: act must be an op type name such as 'relu' or a dict with 'type', "
                          f"got {act!r}")
        attrs = {k: v for k, v in act.items() if k != "type"}
        op_def = find_op_def(act["type"])
        if op_def is None or [s.name for s in op_def.inputs] != ["X"] or [s.name for s in op_def.outputs] != ["Out"]:
            raise IRError(f"{self.layer_type}: act {act['type']!r} is not an activation op (X -> Out)",
                          hint="e.g. 'relu', 'sigmoid', 'tanh', 'softmax'")
        if "use_cudnn" in self.kwargs:
            attrs.setdefault("use_cudnn", bool(self.kwargs["use_cudnn"]))
        tmp = self.create_variable_for_type_inference(input_var.dtype)
        self.append_op(act["type"], inputs={"X": [input_var]}, outputs={"Out": [tmp]}, attrs=attrs)
        return self.var(tmp.name)
