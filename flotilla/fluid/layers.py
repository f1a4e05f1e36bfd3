"""The layers API (Fluid 1.5's ``fluid.layers``): functions that append ops to the default main program.

Every layer returns ``ir.core.Variable`` values as recorded in the block *after* shape inference of
the ops it appended (Variables are frozen: a layer re-reads ``block.var(name)``). Layers decompose
into the same ops, slots and attrs as Fluid 1.5 (``fc`` → ``mul`` [+ ``sum``] + ``elementwise_add``
[+ activation]; ``square_error_cost`` → ``elementwise_sub`` + ``square``; ``accuracy`` → ``top_k`` +
``accuracy``), so program dumps read like Fluid's. Parameters go to the main and startup programs
through ``LayerHelper``. A bad argument raises ``IRError`` naming the argument.

The learning-rate schedules of ``learning_rate`` (``exponential_decay``, ``natural_exp_decay``,
``inverse_time_decay``, ``polynomial_decay``, ``piecewise_decay``, ``noam_decay``) are layers too, as
in Fluid 1.5.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from flotilla.fluid.initializer import Constant, Initializer, Normal
from flotilla.fluid.layer_helper import LayerHelper, normalize_dtype
from flotilla.fluid.learning_rate import (exponential_decay, inverse_time_decay, natural_exp_decay, noam_decay,
                                          piecewise_decay, polynomial_decay)
from flotilla.fluid.param_attr import ParamAttr
from ir.core import Parameter, Variable, default_main_program
from ir.errors import IRError
from ir.names import seq_len_name

__all__ = [
    "abs", "accuracy", "auc", "batch_norm", "cast", "concat", "conv2d", "cos_sim", "create_global_var",
    "create_parameter", "cross_entropy", "data", "dropout", "elementwise_add", "elementwise_div", "elementwise_max",
    "elementwise_min", "elementwise_mul", "elementwise_pow", "elementwise_sub", "embedding", "equal", "exp", "fc",
    "fill_constant", "fill_constant_batch_size_like", "gelu", "greater_equal", "greater_than", "increment",
    "layer_norm", "less_equal", "less_than", "log", "log_loss", "logical_and", "logical_not", "logical_or",
    "matmul", "mean", "not_equal", "pool2d", "reduce_max", "reduce_mean", "reduce_sum", "relu", "reshape", "scale",
    "seq_len_name", "sequence_conv", "sequence_pool", "sequence_softmax", "sigmoid",
    "sigmoid_cross_entropy_with_logits", "softmax", "softmax_with_cross_entropy",
    "softsign", "sqrt", "square", "square_error_cost", "sums", "tanh", "transpose",
    # the learning-rate schedules, which Fluid 1.5 exposes here (fluid.layers.learning_rate_scheduler)
    "exponential_decay", "inverse_time_decay", "natural_exp_decay", "noam_decay", "piecewise_decay",
    "polynomial_decay",
]


# --- argument checks -------------------------------------------------------------------------------
def _var(layer: str, arg: str, value: Any) -> Variable:
    if not isinstance(value, Variable):
        raise IRError(f"{layer}: {arg} must be a Variable, got {type(value).__name__} {value!r}",
                      hint="pass the result of another layer or of layers.data")
    return value


def _vars(layer: str, arg: str, value: Any) -> list[Variable]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise IRError(f"{layer}: {arg} is an empty list", hint="pass at least one Variable")
    for i, v in enumerate(values):
        _var(layer, f"{arg}[{i}]" if isinstance(value, (list, tuple)) else arg, v)
    return values


def _int(layer: str, arg: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise IRError(f"{layer}: {arg} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise IRError(f"{layer}: {arg} must be >= {minimum}, got {value}")
    return value


def _float(layer: str, arg: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise IRError(f"{layer}: {arg} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _bool(layer: str, arg: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise IRError(f"{layer}: {arg} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _ints(layer: str, arg: str, value: Any, n: int | None = None) -> list[int]:
    """An int or list of ints; with ``n``, a single int is repeated n times."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * (n or 1)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise IRError(f"{layer}: {arg} must be an int or a list of ints, got {value!r}")
    if n is not None and len(value) != n:
        raise IRError(f"{layer}: {arg} must have {n} entries, got {list(value)}")
    return list(value)


def _dtype(layer: str, value: Any) -> str:
    try:
        return normalize_dtype(value)
    except IRError as e:
        raise IRError(f"{layer}: {e.message}") from None


def _choice(layer: str, arg: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise IRError(f"{layer}: {arg} must be one of {list(choices)}, got {value!r}")
    return value


def _unary(layer: str, op_type: str, x: Any, name: str | None, attrs: dict[str, Any] | None = None,
           out_dtype: str | None = None, arg: str = "x") -> Variable:
    x = _var(layer, arg, x)
    helper = LayerHelper(layer, name=name)
    out = helper.create_variable_for_type_inference(out_dtype or x.dtype)
    helper.append_op(op_type, inputs={"X": [x]}, outputs={"Out": [out]}, attrs=attrs or {})
    return helper.var(out.name)


# --- inputs and parameters -------------------------------------------------------------------------
def data(name: str, shape: Sequence[int], append_batch_size: bool = True, dtype: Any = "float32",
         lod_level: int = 0, type: str = "lod_tensor", stop_gradient: bool = True) -> Variable:
    """A fed input in the main program's global block; ``[-1] + shape`` unless ``append_batch_size``
    is False or ``shape`` already has an unknown (-1/None) extent."""
    if not isinstance(name, str) or not name:
        raise IRError(f"data: name must be a non-empty string, got {name!r}")
    if not isinstance(shape, (list, tuple)):
        raise IRError(f"data: shape must be a list of ints, got {shape!r}")
    dims: list[int] = []
    for d in shape:
        if d is None:
            dims.append(-1)
        elif isinstance(d, int) and not isinstance(d, bool) and (d > 0 or d == -1):
            dims.append(d)
        else:
            raise IRError(f"data: shape entries must be positive ints, -1 or None, got {list(shape)}")
    if _bool("data", "append_batch_size", append_batch_size) and -1 not in dims:
        dims = [-1] + dims
    if _int("data", "lod_level", lod_level, 0) > 1:
        raise IRError(f"data: lod_level {lod_level} is not supported (nested sequences)",
                      hint="use lod_level=1: one level of variable-length sequences")
    if type not in ("lod_tensor", "selected_rows"):
        raise IRError(f"data: type must be 'lod_tensor' or 'selected_rows', got {type!r}")
    block = default_main_program().global_block()
    var = block.create_var(name=name, shape=dims, dtype=_dtype("data", dtype), type=type,
                           stop_gradient=_bool("data", "stop_gradient", stop_gradient), is_data=True)
    if lod_level == 1:
        if dims[0] != -1:
            raise IRError(f"data: a lod_level=1 variable's first dim counts rows of all sequences and must be -1, "
                          f"got shape {dims}", hint="leave append_batch_size=True")
        # The sequence lengths travel beside the rows as a fed variable of their own (runtime/lod.py).
        block.create_var(name=seq_len_name(name), shape=[-1], dtype="int64", stop_gradient=True, is_data=True)
    return var


def create_parameter(shape: Sequence[int], dtype: Any, name: str | None = None, attr: Any = None,
                     is_bias: bool = False, default_initializer: Initializer | None = None) -> Parameter:
    helper = LayerHelper("create_parameter")
    pattr = ParamAttr.to_attr(attr, "attr")
    if pattr is False:
        raise IRError("create_parameter: attr cannot be False")
    if name is not None:
        pattr = pattr.with_name(name)
    return helper.create_parameter(pattr, _ints("create_parameter", "shape", list(shape)), _dtype("create_parameter", dtype),
                                   is_bias=is_bias, default_initializer=default_initializer)


def create_global_var(shape: Sequence[int], value: float, dtype: Any, persistable: bool = False,
                      force_cpu: bool = False, name: str | None = None) -> Variable:
    """A global variable (stop_gradient) initialised to ``value`` in the startup program."""
    helper = LayerHelper("global_var", name=name)
    var = helper.create_global_variable(_ints("create_global_var", "shape", list(shape)),
                                        _dtype("create_global_var", dtype), persistable=persistable,
                                        name=name or None, stop_gradient=True)
    helper.set_variable_initializer(var, Constant(_float("create_global_var", "value", value), force_cpu))
    return var


# --- fully connected and embeddings ----------------------------------------------------------------
def fc(input: Any, size: int, num_flatten_dims: int = 1, param_attr: Any = None, bias_attr: Any = None,
       act: Any = None, is_test: bool = False, name: str | None = None) -> Variable:
    """``mul`` per input (summed with ``sum`` when several), then bias ``elementwise_add`` and ``act``."""
    _vars("fc", "input", input)
    _int("fc", "size", size, 1)
    helper = LayerHelper("fc", input=input, param_attr=param_attr, bias_attr=bias_attr, act=act, name=name)
    dtype = helper.input_dtype()
    mul_results = []
    for x, pattr in helper.iter_inputs_and_params():
        _int("fc", "num_flatten_dims", num_flatten_dims, 1)
        if num_flatten_dims >= len(x.shape):
            raise IRError(f"fc: num_flatten_dims {num_flatten_dims} must be less than the rank of input "
                          f"{x.name}{list(x.shape)}")
        width = math.prod(x.shape[num_flatten_dims:])
        if width <= 0:
            raise IRError(f"fc: input {x.name}{list(x.shape)} has an unknown extent after num_flatten_dims "
                          f"{num_flatten_dims}", hint="only dims before num_flatten_dims may be -1")
        w = helper.create_parameter(pattr, [width, size], dtype)
        tmp = helper.create_variable_for_type_inference(dtype)
        helper.append_op("mul", inputs={"X": [x], "Y": [w]}, outputs={"Out": [tmp]},
                         attrs={"x_num_col_dims": num_flatten_dims, "y_num_col_dims": 1})
        mul_results.append(helper.var(tmp.name))
    if len(mul_results) == 1:
        pre_bias = mul_results[0]
    else:
        out = helper.create_variable_for_type_inference(dtype)
        helper.append_op("sum", inputs={"X": mul_results}, outputs={"Out": [out]})
        pre_bias = helper.var(out.name)
    pre_act = helper.append_bias_op(pre_bias, dim_start=num_flatten_dims)
    return helper.append_activation(pre_act)


def embedding(input: Any, size: Sequence[int], is_sparse: bool = False, is_distributed: bool = False,
              padding_idx: int | None = None, param_attr: Any = None, dtype: Any = "float32") -> Variable:
    """``lookup_table`` of int64 ids into a [size[0], size[1]] table; ``is_sparse`` makes W@GRAD
    selected rows; ``padding_idx`` (negative counts from the end) looks up zeros."""
    ids = _var("embedding", "input", input)
    size = _ints("embedding", "size", size)
    if len(size) != 2 or size[0] <= 0 or size[1] <= 0:
        raise IRError(f"embedding: size must be [rows, width] with positive entries, got {size}")
    _bool("embedding", "is_sparse", is_sparse)
    _bool("embedding", "is_distributed", is_distributed)
    if padding_idx is None:
        pad = -1
    else:
        pad = _int("embedding", "padding_idx", padding_idx)
        if not -size[0] <= pad < size[0]:
            raise IRError(f"embedding: padding_idx {pad} is out of range for {size[0]} rows")
        pad = pad if pad >= 0 else size[0] + pad
    helper = LayerHelper("embedding", param_attr=param_attr)
    pattr = helper.param_attr
    if pattr is False:
        raise IRError("embedding: param_attr cannot be False")
    dtype = _dtype("embedding", dtype)
    w = helper.create_parameter(pattr, size, dtype, is_distributed=is_distributed)
    out = helper.create_variable_for_type_inference(dtype)
    # Fluid 1.5 marks every sparse, non-distributed table for remote prefetch.
    remote_prefetch = is_sparse and not is_distributed
    helper.append_op("lookup_table", inputs={"Ids": [ids], "W": [w]}, outputs={"Out": [out]},
                     attrs={"is_sparse": is_sparse, "is_distributed": is_distributed,
                            "remote_prefetch": remote_prefetch, "padding_idx": pad})
    return helper.var(out.name)


# --- tensor manipulation ---------------------------------------------------------------------------
def concat(input: Any, axis: int = 0, name: str | None = None) -> Variable:
    xs = _vars("concat", "input", input)
    helper = LayerHelper("concat", name=name)
    out = helper.create_variable_for_type_inference(_same_dtype("concat", xs))
    helper.append_op("concat", inputs={"X": xs}, outputs={"Out": [out]}, attrs={"axis": _int("concat", "axis", axis)})
    return helper.var(out.name)


def _same_dtype(layer: str, xs: Sequence[Variable]) -> str:
    for v in xs[1:]:
        if v.dtype != xs[0].dtype:
            raise IRError(f"{layer}: inputs have different dtypes ({xs[0].name}: {xs[0].dtype}, {v.name}: {v.dtype})")
    return xs[0].dtype


def reshape(x: Any, shape: Sequence[int], actual_shape: Any = None, act: Any = None, inplace: bool = False,
            name: str | None = None) -> Variable:
    """``reshape`` (0 copies the input extent, one -1 is inferred)."""
    x = _var("reshape", "x", x)
    shape = _ints("reshape", "shape", shape)
    if shape.count(-1) > 1 or any(d < -1 for d in shape):
        raise IRError(f"reshape: shape {shape} may hold at most one -1 and no other negative extent")
    if actual_shape is not None:
        raise IRError("reshape: actual_shape is not supported", hint="pass the target shape in `shape`")
    helper = LayerHelper("reshape", act=act, name=name)
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("reshape", inputs={"X": [x]}, outputs={"Out": [out]}, attrs={"shape": shape})
    return helper.append_activation(helper.var(out.name))


def transpose(x: Any, perm: Sequence[int], name: str | None = None) -> Variable:
    x = _var("transpose", "x", x)
    perm = _ints("transpose", "perm", perm)
    if sorted(perm) != list(range(len(x.shape))):
        raise IRError(f"transpose: perm {perm} is not a permutation of the {len(x.shape)} dims of {x.name}")
    return _unary("transpose", "transpose", x, name, {"axis": perm})


def cast(x: Any, dtype: Any) -> Variable:
    x = _var("cast", "x", x)
    dtype = _dtype("cast", dtype)
    return _unary("cast", "cast", x, None, {"in_dtype": x.dtype, "out_dtype": dtype}, out_dtype=dtype)


def fill_constant(shape: Sequence[int], dtype: Any, value: float, force_cpu: bool = False,
                  out: Variable | None = None) -> Variable:
    shape = _ints("fill_constant", "shape", shape)
    dtype = _dtype("fill_constant", dtype)
    helper = LayerHelper("fill_constant")
    target = out if out is not None else helper.create_variable_for_type_inference(dtype, stop_gradient=True)
    _var("fill_constant", "out", target)
    helper.append_op("fill_constant", outputs={"Out": [target]},
                     attrs={"shape": shape, "dtype": dtype, "value": _float("fill_constant", "value", value),
                            "force_cpu": _bool("fill_constant", "force_cpu", force_cpu)})
    return helper.var(target.name)


def fill_constant_batch_size_like(input: Any, shape: Sequence[int], dtype: Any, value: float,
                                  input_dim_idx: int = 0, output_dim_idx: int = 0) -> Variable:
    x = _var("fill_constant_batch_size_like", "input", input)
    dtype = _dtype("fill_constant_batch_size_like", dtype)
    helper = LayerHelper("fill_constant_batch_size_like")
    out = helper.create_variable_for_type_inference(dtype, stop_gradient=True)
    helper.append_op("fill_constant_batch_size_like", inputs={"Input": [x]}, outputs={"Out": [out]},
                     attrs={"shape": _ints("fill_constant_batch_size_like", "shape", shape), "dtype": dtype,
                            "value": _float("fill_constant_batch_size_like", "value", value),
                            "input_dim_idx": _int("fill_constant_batch_size_like", "input_dim_idx", input_dim_idx),
                            "output_dim_idx": _int("fill_constant_batch_size_like", "output_dim_idx", output_dim_idx)})
    return helper.var(out.name)


def increment(x: Any, value: float = 1.0, in_place: bool = True) -> Variable:
    x = _var("increment", "x", x)
    helper = LayerHelper("increment")
    out = x if in_place else helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("increment", inputs={"X": [x]}, outputs={"Out": [out]},
                     attrs={"step": _float("increment", "value", value)})
    return helper.var(out.name)


# --- math ------------------------------------------------------------------------------------------
def matmul(x: Any, y: Any, transpose_x: bool = False, transpose_y: bool = False, alpha: float = 1.0,
           name: str | None = None) -> Variable:
    x, y = _var("matmul", "x", x), _var("matmul", "y", y)
    helper = LayerHelper("matmul", name=name)
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("matmul", inputs={"X": [x], "Y": [y]}, outputs={"Out": [out]},
                     attrs={"transpose_X": _bool("matmul", "transpose_x", transpose_x),
                            "transpose_Y": _bool("matmul", "transpose_y", transpose_y),
                            "alpha": _float("matmul", "alpha", alpha)})
    return helper.var(out.name)


def _elementwise(kind: str, x: Any, y: Any, axis: int, act: Any, name: str | None) -> Variable:
    layer = f"elementwise_{kind}"
    x, y = _var(layer, "x", x), _var(layer, "y", y)
    helper = LayerHelper(layer, act=act, name=name)
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(layer, inputs={"X": [x], "Y": [y]}, outputs={"Out": [out]},
                     attrs={"axis": _int(layer, "axis", axis)})
    return helper.append_activation(helper.var(out.name))


def elementwise_add(x: Any, y: Any, axis: int = -1, act: Any = None, name: str | None = None) -> Variable:
    return _elementwise("add", x, y, axis, act, name)


def elementwise_sub(x: Any, y: Any, axis: int = -1, act: Any = None, name: str | None = None) -> Variable:
    return _elementwise("sub", x, y, axis, act, name)


def elementwise_mul(x: Any, y: Any, axis: int = -1, act: Any = None, name: str | None = None) -> Variable:
    return _elementwise("mul", x, y, axis, act, name)


def elementwise_div(x: Any, y: Any, axis: int = -1, act: Any = None, name: str | None = None) -> Variable:
    return _elementwise("div", x, y, axis, act, name)


def elementwise_max(x: Any, y: Any, axis: int = -1, act: Any = None, name: str | None = None) -> Variable:
    return _elementwise("max", x, y, axis, act, name)


def elementwise_min(x: Any, y: Any, axis: int = -1, act: Any = None, name: str | None = None) -> Variable:
    return _elementwise("min", x, y, axis, act, name)


def elementwise_pow(x: Any, y: Any, axis: int = -1, act: Any = None, name: str | None = None) -> Variable:
    return _elementwise("pow", x, y, axis, act, name)


def scale(x: Any, scale: float = 1.0, bias: float = 0.0, bias_after_scale: bool = True, act: Any = None,
          name: str | None = None) -> Variable:
    x = _var("scale", "x", x)
    helper = LayerHelper("scale", act=act, name=name)
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("scale", inputs={"X": [x]}, outputs={"Out": [out]},
                     attrs={"scale": _float("scale", "scale", scale), "bias": _float("scale", "bias", bias),
                            "bias_after_scale": _bool("scale", "bias_after_scale", bias_after_scale)})
    return helper.append_activation(helper.var(out.name))


def sums(input: Any, out: Variable | None = None) -> Variable:
    xs = _vars("sums", "input", input)
    helper = LayerHelper("sum")
    target = out if out is not None else helper.create_variable_for_type_inference(_same_dtype("sums", xs))
    _var("sums", "out", target)
    helper.append_op("sum", inputs={"X": xs}, outputs={"Out": [target]})
    return helper.var(target.name)


def mean(x: Any, name: str | None = None) -> Variable:
    return _unary("mean", "mean", x, name)


def _reduce(op_type: str, input: Any, dim: Any, keep_dim: bool, name: str | None) -> Variable:
    x = _var(op_type, "input", input)
    dims = [0] if dim is None else _ints(op_type, "dim", dim)
    rank = len(x.shape)
    for d in dims:
        if not -rank <= d < max(rank, 1):
            raise IRError(f"{op_type}: dim {d} is out of range for {x.name}{list(x.shape)}")
    return _unary(op_type, op_type, x, name, {"dim": dims, "keep_dim": _bool(op_type, "keep_dim", keep_dim),
                                             "reduce_all": dim is None}, arg="input")


def reduce_sum(input: Any, dim: Any = None, keep_dim: bool = False, name: str | None = None) -> Variable:
    return _reduce("reduce_sum", input, dim, keep_dim, name)


def reduce_mean(input: Any, dim: Any = None, keep_dim: bool = False, name: str | None = None) -> Variable:
    return _reduce("reduce_mean", input, dim, keep_dim, name)


def reduce_max(input: Any, dim: Any = None, keep_dim: bool = False, name: str | None = None) -> Variable:
    return _reduce("reduce_max", input, dim, keep_dim, name)


def relu(x: Any, name: str | None = None) -> Variable:
    return _unary("relu", "relu", x, name)


def sigmoid(x: Any, name: str | None = None) -> Variable:
    return _unary("sigmoid", "sigmoid", x, name)


def tanh(x: Any, name: str | None = None) -> Variable:
    return _unary("tanh", "tanh", x, name)


def softsign(x: Any, name: str | None = None) -> Variable:
    return _unary("softsign", "softsign", x, name)


def gelu(x: Any, name: str | None = None) -> Variable:
    """``gelu``: 0.5 * x * (1 + erf(x / sqrt(2))) (the exact form); also usable as ``act="gelu"``."""
    return _unary("gelu", "gelu", x, name)


def sqrt(x: Any, name: str | None = None) -> Variable:
    return _unary("sqrt", "sqrt", x, name)


def exp(x: Any, name: str | None = None) -> Variable:
    return _unary("exp", "exp", x, name)


def log(x: Any, name: str | None = None) -> Variable:
    return _unary("log", "log", x, name)


def abs(x: Any, name: str | None = None) -> Variable:  # noqa: A001  (Fluid's name)
    return _unary("abs", "abs", x, name)


def square(x: Any, name: str | None = None) -> Variable:
    return _unary("square", "square", x, name)


def softmax(input: Any, use_cudnn: bool = False, name: str | None = None, axis: int = -1) -> Variable:
    return _unary("softmax", "softmax", input, name,
                  {"axis": _int("softmax", "axis", axis), "use_cudnn": _bool("softmax", "use_cudnn", use_cudnn)},
                  arg="input")


# --- losses ----------------------------------------------------------------------------------------
def cross_entropy(input: Any, label: Any, soft_label: bool = False, ignore_index: int = -100) -> Variable:
    x, lab = _var("cross_entropy", "input", input), _var("cross_entropy", "label", label)
    helper = LayerHelper("cross_entropy")
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("cross_entropy", inputs={"X": [x], "Label": [lab]}, outputs={"Y": [out]},
                     attrs={"soft_label": _bool("cross_entropy", "soft_label", soft_label),
                            "ignore_index": _int("cross_entropy", "ignore_index", ignore_index)})
    return helper.var(out.name)


def softmax_with_cross_entropy(logits: Any, label: Any, soft_label: bool = False, ignore_index: int = -100,
                               numeric_stable_mode: bool = True, return_softmax: bool = False,
                               axis: int = -1) -> Variable | tuple[Variable, Variable]:
    layer = "softmax_with_cross_entropy"
    x, lab = _var(layer, "logits", logits), _var(layer, "label", label)
    helper = LayerHelper(layer)
    softmax_out = helper.create_variable_for_type_inference(x.dtype)
    loss = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(layer, inputs={"Logits": [x], "Label": [lab]},
                     outputs={"Softmax": [softmax_out], "Loss": [loss]},
                     attrs={"soft_label": _bool(layer, "soft_label", soft_label),
                            "ignore_index": _int(layer, "ignore_index", ignore_index),
                            "numeric_stable_mode": _bool(layer, "numeric_stable_mode", numeric_stable_mode),
                            "axis": _int(layer, "axis", axis)})
    if _bool(layer, "return_softmax", return_softmax):
        return helper.var(loss.name), helper.var(softmax_out.name)
    return helper.var(loss.name)


def sigmoid_cross_entropy_with_logits(x: Any, label: Any, ignore_index: int = -100, name: str | None = None,
                                      normalize: bool = False) -> Variable:
    layer = "sigmoid_cross_entropy_with_logits"
    x, lab = _var(layer, "x", x), _var(layer, "label", label)
    helper = LayerHelper(layer, name=name)
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(layer, inputs={"X": [x], "Label": [lab]}, outputs={"Out": [out]},
                     attrs={"ignore_index": _int(layer, "ignore_index", ignore_index),
                            "normalize": _bool(layer, "normalize", normalize)})
    return helper.var(out.name)


def log_loss(input: Any, label: Any, epsilon: float = 1e-4, name: str | None = None) -> Variable:
    x, lab = _var("log_loss", "input", input), _var("log_loss", "label", label)
    helper = LayerHelper("log_loss", name=name)
    loss = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("log_loss", inputs={"Predicted": [x], "Labels": [lab]}, outputs={"Loss": [loss]},
                     attrs={"epsilon": _float("log_loss", "epsilon", epsilon)})
    return helper.var(loss.name)


def square_error_cost(input: Any, label: Any) -> Variable:
    """``(input - label)^2`` as ``elementwise_sub`` then ``square``."""
    x, lab = _var("square_error_cost", "input", input), _var("square_error_cost", "label", label)
    helper = LayerHelper("square_error_cost")
    minus = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("elementwise_sub", inputs={"X": [x], "Y": [lab]}, outputs={"Out": [minus]})
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("square", inputs={"X": [minus]}, outputs={"Out": [out]})
    return helper.var(out.name)


def cos_sim(X: Any, Y: Any) -> Variable:
    x, y = _var("cos_sim", "X", X), _var("cos_sim", "Y", Y)
    helper = LayerHelper("cos_sim")
    out = helper.create_variable_for_type_inference(x.dtype)
    xnorm = helper.create_variable_for_type_inference(x.dtype)
    ynorm = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("cos_sim", inputs={"X": [x], "Y": [y]},
                     outputs={"Out": [out], "XNorm": [xnorm], "YNorm": [ynorm]})
    return helper.var(out.name)


# --- sequences, convolution, normalisation ---------------------------------------------------------
_POOL_TYPES = ("average", "sum", "sqrt", "max", "first", "last")


# Ops whose output rows are their input's rows (one row out per row in), through the slot given: a LoD
# tensor keeps its sequence lengths through them, as in Fluid.
_ROW_WISE = {"lookup_table": "Ids", "mul": "X", "sum": "X", "elementwise_add": "X", "elementwise_sub": "X",
             "elementwise_mul": "X", "elementwise_div": "X", "elementwise_max": "X", "elementwise_min": "X",
             "elementwise_pow": "X", "scale": "X", "cast": "X", "dropout": "X", "softmax": "X",
             "sequence_softmax": "X", "sequence_conv": "X", "layer_norm": "X", "batch_norm": "X"}


def _seq_lengths(x: Variable) -> Variable | None:
    """The lengths variable of LoD tensor ``x``: follow ``x`` back through row-wise ops (embedding, fc,
    activations, ...) to a ``lod_level=1`` data variable; None if it does not come from one."""
    block = default_main_program().global_block()
    ops = block.ops
    name, end = x.name, len(ops)
    while True:
        var = block.vars.get(name)
        if var is not None and var.is_data and seq_len_name(name) in block.vars:
            return block.vars[seq_len_name(name)]
        producer = next((i for i in range(end - 1, -1, -1) if name in ops[i].output_arg_names), None)
        if producer is None:
            return None
        op = ops[producer]
        slot = "X" if op.type in _ACTIVATION_OPS else _ROW_WISE.get(op.type)
        if slot is None or not op.input(slot):
            return None
        name, end = op.input(slot)[0], producer


_ACTIVATION_OPS = frozenset({"relu", "sigmoid", "tanh", "softsign", "exp", "log", "sqrt", "square", "abs",
                             "gelu", "leaky_relu", "softplus", "brelu", "relu6", "elu", "swish", "hard_sigmoid"})


def _require_lod(layer: str, x: Variable) -> Variable:
    lengths = _seq_lengths(x)
    if lengths is None:
        raise IRError(f"{layer}: input {x.name}{list(x.shape)} has no LoD (sequence lengths)",
                      hint="declare the ids it comes from with layers.data(..., lod_level=1) and feed sequences "
                           "(a list of lists, create_lod_tensor or a LoDTensor)")
    return lengths


def sequence_pool(input: Any, pool_type: str, is_test: bool = False, pad_value: float = 0.0,
                  ids: Any = None, padding_idx: int | None = None) -> Variable:
    """Pool each sequence of ``input`` to one row, as Fluid: ``input`` is a LoD tensor [R, D] (coming from a
    ``layers.data(..., lod_level=1)`` through row-wise layers such as ``embedding`` and ``fc``), giving [N, D];
    a sequence with no rows pools to ``pad_value``. A padded batch [N, T, D] is pooled over T too; there,
    ``ids`` ([N, T] or [N, T, 1] int64) and ``padding_idx`` mark the time steps to skip."""
    x = _var("sequence_pool", "input", input)
    if not isinstance(pool_type, str) or pool_type.lower() not in _POOL_TYPES:
        raise IRError(f"sequence_pool: pool_type must be one of {list(_POOL_TYPES)}, got {pool_type!r}")
    inputs: dict[str, list[Variable]] = {"X": [x]}
    if ids is not None:
        inputs["Ids"] = [_var("sequence_pool", "ids", ids)]
    if padding_idx is not None and ids is None:
        raise IRError("sequence_pool: padding_idx needs ids", hint="pass the ids the input was looked up from")
    if ids is None and len(x.shape) < 3:
        inputs["Length"] = [_require_lod("sequence_pool", x)]
    helper = LayerHelper("sequence_pool")
    out = helper.create_variable_for_type_inference(x.dtype)
    outputs: dict[str, list[Variable]] = {"Out": [out]}
    if pool_type.lower() == "max":
        outputs["MaxIndex"] = [helper.create_variable_for_type_inference("int32", stop_gradient=True)]
    helper.append_op("sequence_pool", inputs=inputs, outputs=outputs,
                     attrs={"pooltype": pool_type.upper(), "is_test": _bool("sequence_pool", "is_test", is_test),
                            "pad_value": _float("sequence_pool", "pad_value", pad_value),
                            "padding_idx": -1 if padding_idx is None else _int("sequence_pool", "padding_idx",
                                                                               padding_idx)})
    return helper.var(out.name)


def sequence_softmax(input: Any, use_cudnn: bool = False, name: str | None = None) -> Variable:
    """Softmax of the scores ``input`` [R, 1] within each sequence of a LoD tensor."""
    x = _var("sequence_softmax", "input", input)
    lengths = _require_lod("sequence_softmax", x)
    helper = LayerHelper("sequence_softmax", name=name)
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("sequence_softmax", inputs={"X": [x], "Length": [lengths]}, outputs={"Out": [out]},
                     attrs={"use_cudnn": _bool("sequence_softmax", "use_cudnn", use_cudnn)})
    return helper.var(out.name)


def sequence_conv(input: Any, num_filters: int, filter_size: int = 3, filter_stride: int = 1, padding: Any = None,
                  bias_attr: Any = None, param_attr: Any = None, act: Any = None, name: str | None = None) -> Variable:
    """Fluid's ``sequence_conv``: each row of the LoD tensor ``input`` [R, D] sees a window of
    ``filter_size`` rows centred on it (``contextStart = -(filter_size // 2)``, zeros past its sequence's
    ends), times a [filter_size * D, num_filters] filter, plus bias, then ``act``."""
    x = _var("sequence_conv", "input", input)
    lengths = _require_lod("sequence_conv", x)
    _int("sequence_conv", "num_filters", num_filters, 1)
    _int("sequence_conv", "filter_size", filter_size, 1)
    if _int("sequence_conv", "filter_stride", filter_stride, 1) != 1:
        raise IRError(f"sequence_conv: filter_stride {filter_stride} is not supported", hint="use 1, as Fluid")
    if len(x.shape) != 2 or x.shape[1] <= 0:
        raise IRError(f"sequence_conv: input {x.name}{list(x.shape)} must be LoD rows [-1, D] with D known")
    helper = LayerHelper("sequence_conv", param_attr=param_attr, bias_attr=bias_attr, act=act, name=name)
    if helper.param_attr is False:
        raise IRError("sequence_conv: param_attr cannot be False")
    w = helper.create_parameter(helper.param_attr, [filter_size * x.shape[1], num_filters], x.dtype)
    pre_bias = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("sequence_conv", inputs={"X": [x], "Filter": [w], "Length": [lengths]},
                     outputs={"Out": [pre_bias]},
                     attrs={"contextLength": filter_size, "contextStart": -(filter_size // 2), "contextStride": 1,
                            "paddingTrainable": False})
    pre_act = helper.append_bias_op(helper.var(pre_bias.name), dim_start=1)
    return helper.append_activation(pre_act)


def conv2d(input: Any, num_filters: int, filter_size: Any, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
           groups: int | None = None, param_attr: Any = None, bias_attr: Any = None, use_cudnn: bool = True,
           act: Any = None, name: str | None = None) -> Variable:
    """``conv2d`` on NCHW input with a [num_filters, C/groups, fh, fw] filter (default initializer
    Normal(0, sqrt(2 / (fh·fw·C))) as Fluid), bias added on axis 1, then ``act``."""
    x = _var("conv2d", "input", input)
    if len(x.shape) != 4:
        raise IRError(f"conv2d: input {x.name}{list(x.shape)} must be 4-D NCHW")
    _int("conv2d", "num_filters", num_filters, 1)
    groups = 1 if groups is None else _int("conv2d", "groups", groups, 1)
    channels = x.shape[1]
    if channels <= 0 or channels % groups:
        raise IRError(f"conv2d: input channels {channels} must be known and divisible by groups {groups}")
    fsize = _ints("conv2d", "filter_size", filter_size, 2)
    helper = LayerHelper("conv2d", param_attr=param_attr, bias_attr=bias_attr, act=act, name=name)
    pattr = helper.param_attr
    if pattr is False:
        raise IRError("conv2d: param_attr cannot be False")
    std = (2.0 / (fsize[0] * fsize[1] * channels)) ** 0.5
    w = helper.create_parameter(pattr, [num_filters, channels // groups] + fsize, x.dtype,
                                default_initializer=Normal(0.0, std, 0))
    pre_bias = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("conv2d", inputs={"Input": [x], "Filter": [w]}, outputs={"Output": [pre_bias]},
                     attrs={"strides": _ints("conv2d", "stride", stride, 2),
                            "paddings": _ints("conv2d", "padding", padding, 2),
                            "dilations": _ints("conv2d", "dilation", dilation, 2), "groups": groups,
                            "use_cudnn": _bool("conv2d", "use_cudnn", use_cudnn)})
    pre_act = helper.append_bias_op(helper.var(pre_bias.name), dim_start=1, dim_end=2)
    return helper.append_activation(pre_act)


def pool2d(input: Any, pool_size: Any = -1, pool_type: str = "max", pool_stride: Any = 1, pool_padding: Any = 0,
           global_pooling: bool = False, use_cudnn: bool = True, ceil_mode: bool = False, name: str | None = None,
           exclusive: bool = True) -> Variable:
    x = _var("pool2d", "input", input)
    _choice("pool2d", "pool_type", pool_type, ("max", "avg"))
    _bool("pool2d", "global_pooling", global_pooling)
    if pool_size == -1 and not global_pooling:
        raise IRError("pool2d: pool_size must be set when global_pooling is False")
    return _unary("pool2d", "pool2d", x, name, {
        "pooling_type": pool_type, "ksize": _ints("pool2d", "pool_size", pool_size, 2),
        "global_pooling": global_pooling, "strides": _ints("pool2d", "pool_stride", pool_stride, 2),
        "paddings": _ints("pool2d", "pool_padding", pool_padding, 2),
        "use_cudnn": _bool("pool2d", "use_cudnn", use_cudnn), "ceil_mode": _bool("pool2d", "ceil_mode", ceil_mode),
        "exclusive": _bool("pool2d", "exclusive", exclusive)}, arg="input")


def batch_norm(input: Any, act: Any = None, is_test: bool = False, momentum: float = 0.9, epsilon: float = 1e-05,
               param_attr: Any = None, bias_attr: Any = None, data_layout: str = "NCHW", in_place: bool = False,
               name: str | None = None, moving_mean_name: str | None = None,
               moving_variance_name: str | None = None, do_model_average_for_mean_and_var: bool = False,
               use_global_stats: bool = False) -> Variable:
    """``batch_norm`` with Scale (init 1) and Bias (init 0) parameters and persistable, non-trainable
    moving Mean (init 0) and Variance (init 1) updated in place (MeanOut/VarianceOut alias them)."""
    x = _var("batch_norm", "input", input)
    _choice("batch_norm", "data_layout", data_layout, ("NCHW", "NHWC"))
    if len(x.shape) < 2:
        raise IRError(f"batch_norm: input {x.name}{list(x.shape)} must have rank >= 2")
    channels = x.shape[1] if data_layout == "NCHW" else x.shape[-1]
    if channels <= 0:
        raise IRError(f"batch_norm: the channel extent of {x.name}{list(x.shape)} must be known")
    helper = LayerHelper("batch_norm", param_attr=param_attr, bias_attr=bias_attr, act=act, name=name)
    scale_attr, bias_pattr = helper.param_attr, helper.bias_attr
    if scale_attr is False or bias_pattr is False:
        raise IRError("batch_norm: param_attr and bias_attr cannot be False")
    dtype = x.dtype
    scale_p = helper.create_parameter(scale_attr, [channels], dtype, default_initializer=Constant(1.0))
    bias_p = helper.create_parameter(bias_pattr, [channels], dtype, is_bias=True)
    mean_p = helper.create_parameter(
        ParamAttr(name=moving_mean_name, initializer=Constant(0.0), trainable=False,
                  do_model_average=do_model_average_for_mean_and_var), [channels], dtype)
    var_p = helper.create_parameter(
        ParamAttr(name=moving_variance_name, initializer=Constant(1.0), trainable=False,
                  do_model_average=do_model_average_for_mean_and_var), [channels], dtype)
    saved_mean = helper.create_variable_for_type_inference(dtype, stop_gradient=True)
    saved_var = helper.create_variable_for_type_inference(dtype, stop_gradient=True)
    y = x if in_place else helper.create_variable_for_type_inference(dtype)
    helper.append_op("batch_norm",
                     inputs={"X": [x], "Scale": [scale_p], "Bias": [bias_p], "Mean": [mean_p], "Variance": [var_p]},
                     outputs={"Y": [y], "MeanOut": [mean_p], "VarianceOut": [var_p], "SavedMean": [saved_mean],
                              "SavedVariance": [saved_var]},
                     attrs={"momentum": _float("batch_norm", "momentum", momentum),
                            "epsilon": _float("batch_norm", "epsilon", epsilon),
                            "is_test": _bool("batch_norm", "is_test", is_test), "data_layout": data_layout,
                            "use_global_stats": _bool("batch_norm", "use_global_stats", use_global_stats)})
    return helper.append_activation(helper.var(y.name))


def layer_norm(input: Any, scale: bool = True, shift: bool = True, begin_norm_axis: int = 1,
               epsilon: float = 1e-05, param_attr: Any = None, bias_attr: Any = None, act: Any = None,
               name: str | None = None) -> Variable:
    """``layer_norm`` over the dims of ``input`` from ``begin_norm_axis`` on, with a Scale (init 1,
    when ``scale``) and a Bias (init 0, when ``shift``) parameter of that many features, then ``act``."""
    x = _var("layer_norm", "input", input)
    _bool("layer_norm", "scale", scale)
    _bool("layer_norm", "shift", shift)
    axis = _int("layer_norm", "begin_norm_axis", begin_norm_axis)
    if not 1 <= axis < len(x.shape):
        raise IRError(f"layer_norm: begin_norm_axis {axis} must be in [1, {len(x.shape)}) for "
                      f"{x.name}{list(x.shape)}")
    features = math.prod(x.shape[axis:])
    if features <= 0:
        raise IRError(f"layer_norm: the dims of {x.name}{list(x.shape)} from begin_norm_axis {axis} on must be "
                      "known", hint="only dims before begin_norm_axis may be -1")
    helper = LayerHelper("layer_norm", param_attr=param_attr, bias_attr=bias_attr, act=act, name=name)
    dtype = x.dtype
    inputs: dict[str, list[Variable]] = {"X": [x]}
    if scale:
        if helper.param_attr is False:
            raise IRError("layer_norm: param_attr cannot be False when scale is True", hint="pass scale=False")
        inputs["Scale"] = [helper.create_parameter(helper.param_attr, [features], dtype,
                                                   default_initializer=Constant(1.0))]
    if shift:
        if helper.bias_attr is False:
            raise IRError("layer_norm: bias_attr cannot be False when shift is True", hint="pass shift=False")
        inputs["Bias"] = [helper.create_parameter(helper.bias_attr, [features], dtype, is_bias=True)]
    mean_out = helper.create_variable_for_type_inference(dtype, stop_gradient=True)
    variance_out = helper.create_variable_for_type_inference(dtype, stop_gradient=True)
    y = helper.create_variable_for_type_inference(dtype)
    helper.append_op("layer_norm", inputs=inputs,
                     outputs={"Y": [y], "Mean": [mean_out], "Variance": [variance_out]},
                     attrs={"epsilon": _float("layer_norm", "epsilon", epsilon), "begin_norm_axis": axis})
    return helper.append_activation(helper.var(y.name))


def dropout(x: Any, dropout_prob: float, is_test: bool = False, seed: int | None = None, name: str | None = None,
            dropout_implementation: str = "downgrade_in_infer") -> Variable:
    x = _var("dropout", "x", x)
    prob = _float("dropout", "dropout_prob", dropout_prob)
    if not 0.0 <= prob <= 1.0:
        raise IRError(f"dropout: dropout_prob must be in [0, 1], got {prob}")
    _choice("dropout", "dropout_implementation", dropout_implementation, ("downgrade_in_infer", "upscale_in_train"))
    helper = LayerHelper("dropout", name=name)
    out = helper.create_variable_for_type_inference(x.dtype)
    mask = helper.create_variable_for_type_inference("uint8", stop_gradient=True)
    helper.append_op("dropout", inputs={"X": [x]}, outputs={"Out": [out], "Mask": [mask]},
                     attrs={"dropout_prob": prob, "is_test": _bool("dropout", "is_test", is_test),
                            "fix_seed": seed is not None,
                            "seed": 0 if seed is None else _int("dropout", "seed", seed, 0),
                            "dropout_implementation": dropout_implementation})
    return helper.var(out.name)


# --- metrics ---------------------------------------------------------------------------------------
def accuracy(input: Any, label: Any, k: int = 1, correct: Variable | None = None,
             total: Variable | None = None) -> Variable:
    """``top_k`` then ``accuracy``; returns the accuracy (float32 [1])."""
    x, lab = _var("accuracy", "input", input), _var("accuracy", "label", label)
    helper = LayerHelper("accuracy")
    topk_out = helper.create_variable_for_type_inference(x.dtype, stop_gradient=True)
    topk_indices = helper.create_variable_for_type_inference("int64", stop_gradient=True)
    helper.append_op("top_k", inputs={"X": [x]}, outputs={"Out": [topk_out], "Indices": [topk_indices]},
                     attrs={"k": _int("accuracy", "k", k, 1)})
    acc = helper.create_variable_for_type_inference("float32", stop_gradient=True)
    correct = correct if correct is not None else helper.create_variable_for_type_inference("int32", True)
    total = total if total is not None else helper.create_variable_for_type_inference("int32", True)
    helper.append_op("accuracy", inputs={"Out": [topk_out], "Indices": [topk_indices], "Label": [lab]},
                     outputs={"Accuracy": [acc], "Correct": [_var("accuracy", "correct", correct)],
                              "Total": [_var("accuracy", "total", total)]})
    return helper.var(acc.name)


def auc(input: Any, label: Any, curve: str = "ROC", num_thresholds: int = 2**12 - 1, topk: int = 1,
        slide_steps: int = 1) -> tuple[Variable, Variable, list[Variable]]:
    """Global and sliding-window batch AUC, as Fluid: returns (auc, batch_auc,
    [batch_stat_pos, batch_stat_neg, stat_pos, stat_neg]); the int64 stat variables are persistable
    and initialised to 0 in the startup program."""
    x, lab = _var("auc", "input", input), _var("auc", "label", label)
    _choice("auc", "curve", curve, ("ROC", "PR"))
    _int("auc", "num_thresholds", num_thresholds, 1)
    _int("auc", "slide_steps", slide_steps, 0)
    helper = LayerHelper("auc")
    auc_out = helper.create_variable_for_type_inference("float64", stop_gradient=True)
    batch_auc_out = helper.create_variable_for_type_inference("float64", stop_gradient=True)
    stats = [helper.create_global_variable([rows, num_thresholds + 1], "int64", persistable=True, stop_gradient=True)
             for rows in (slide_steps, slide_steps, 1, 1)]
    for var in stats:
        helper.set_variable_initializer(var, Constant(0.0, force_cpu=True))
    batch_pos, batch_neg, pos, neg = stats
    for out, sp, sn, steps in ((batch_auc_out, batch_pos, batch_neg, slide_steps), (auc_out, pos, neg, 0)):
        helper.append_op("auc", inputs={"Predict": [x], "Label": [lab], "StatPos": [sp], "StatNeg": [sn]},
                         outputs={"AUC": [out], "StatPosOut": [sp], "StatNegOut": [sn]},
                         attrs={"curve": curve, "num_thresholds": num_thresholds, "slide_steps": steps})
    return helper.var(auc_out.name), helper.var(batch_auc_out.name), [helper.var(v.name) for v in stats]


# --- comparisons and logic -------------------------------------------------------------------------
def _compare(op_type: str, x: Any, y: Any, cond: Variable | None, force_cpu: bool | None) -> Variable:
    x, y = _var(op_type, "x", x), _var(op_type, "y", y)
    helper = LayerHelper(op_type)
    out = cond if cond is not None else helper.create_variable_for_type_inference("bool", stop_gradient=True)
    _var(op_type, "cond", out)
    attrs = {} if force_cpu is None else {"force_cpu": _bool(op_type, "force_cpu", force_cpu)}
    helper.append_op(op_type, inputs={"X": [x], "Y": [y]}, outputs={"Out": [out]}, attrs=attrs)
    return helper.var(out.name)


def less_than(x: Any, y: Any, force_cpu: bool | None = None, cond: Variable | None = None) -> Variable:
    return _compare("less_than", x, y, cond, force_cpu)


def less_equal(x: Any, y: Any, cond: Variable | None = None) -> Variable:
    return _compare("less_equal", x, y, cond, None)


def greater_than(x: Any, y: Any, cond: Variable | None = None) -> Variable:
    return _compare("greater_than", x, y, cond, None)


def greater_equal(x: Any, y: Any, cond: Variable | None = None) -> Variable:
    return _compare("greater_equal", x, y, cond, None)


def equal(x: Any, y: Any, cond: Variable | None = None) -> Variable:
    return _compare("equal", x, y, cond, None)


def not_equal(x: Any, y: Any, cond: Variable | None = None) -> Variable:
    return _compare("not_equal", x, y, cond, None)


def _logical(op_type: str, x: Any, y: Any, out: Variable | None, name: str | None) -> Variable:
    x = _var(op_type, "x", x)
    inputs = {"X": [x]}
    if y is not None:
        inputs["Y"] = [_var(op_type, "y", y)]
    helper = LayerHelper(op_type, name=name)
    target = out if out is not None else helper.create_variable_for_type_inference("bool", stop_gradient=True)
    _var(op_type, "out", target)
    helper.append_op(op_type, inputs=inputs, outputs={"Out": [target]})
    return helper.var(target.name)


def logical_and(x: Any, y: Any, out: Variable | None = None, name: str | None = None) -> Variable:
    return _logical("logical_and", x, _var("logical_and", "y", y), out, name)


def logical_or(x: Any, y: Any, out: Variable | None = None, name: str | None = None) -> Variable:
    return _logical("logical_or", x, _var("logical_or", "y", y), out, name)


def logical_not(x: Any, out: Variable | None = None, name: str | None = None) -> Variable:
    return _logical("logical_not", x, None, out, name)
