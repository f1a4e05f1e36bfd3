"""Optimizers (Fluid 1.5's ``fluid.optimizer``) that append backward and optimize ops to a program.

``Optimizer.minimize(loss)`` = ``backward`` (``ir.backward.append_backward``) + ``apply_gradients``:
sort the (param, grad) pairs by parameter name, clip (``clip``), regularize (``regularizer``),
create the accumulators and the global learning rate, then append one optimizer op per trainable
parameter (and, for Adam, the ``scale`` ops updating the beta powers).

Invariants, as in Fluid 1.5:
- The learning rate is a persistable global ``learning_rate_N`` (shape [1]) that a ``fill_constant``
  initialises in the startup program, or the Variable a schedule (``learning_rate``) returned.
  A parameter's learning-rate multiplier other than 1.0 gives a ``scale`` op on it (role
  LRSched|Optimize = 18, empty ``op_role_var``).
- Accumulators are persistable variables named ``{param}_{acc}_N`` (``fc_w_velocity_0``,
  ``fc_w_beta1_pow_acc_0``) created in the main program's global block, of the parameter's shape
  (beta powers: [1], float32), and filled by ``fill_constant`` in the startup program (prepended, as
  every Fluid 1.x initializer does). Accumulators are created before the learning rate.
- Parameters are processed in name order; every optimizer op has role Optimize (2) and
  ``op_role_var = [param, grad]``; sparse (``selected_rows``) gradients go straight to the op.
- Programs are read from the defaults once, at the public entry points (``minimize``, ``backward``,
  ``apply_gradients``); the internals take them explicitly.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from flotilla.fluid.clip import BaseGradientClipAttr, append_gradient_clip_ops
from flotilla.fluid.learning_rate import create_global_var
from flotilla.fluid.regularizer import WeightDecayRegularizer, append_regularization_ops, as_regularizer
from flotilla.fluid.spec import number, optimize_attrs
from ir.backward import append_backward
from ir.core import Block, Operator, Parameter, Program, Variable, default_main_program, default_startup_program
from ir.errors import IRError
from ir.names import unique_name
from ir.roles import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OpRole

__all__ = [
    "Optimizer", "SGD", "Momentum", "Adagrad", "Adam", "RMSProp", "DecayedAdagrad", "Ftrl",
    "DGCMomentumOptimizer",
    "SGDOptimizer", "MomentumOptimizer", "AdagradOptimizer", "AdamOptimizer", "RMSPropOptimizer",
    "DecayedAdagradOptimizer", "FtrlOptimizer", "RecomputeOptimizer",
]

ParamsGrads = list[tuple[Parameter, Variable | None]]


class Optimizer:
    """Base class. Subclasses set ``type`` and implement ``_create_accumulators`` and
    ``_append_optimize_op`` (and ``_finish_update`` when they update state after all params)."""

    type: str = ""

    def __init__(self, learning_rate: float | Variable,
                 regularization: WeightDecayRegularizer | str | None = None, name: str | None = None) -> None:
        if isinstance(learning_rate, Variable):
            if learning_rate.shape not in ((1,), ()):
                raise IRError(f"{type(self).__name__}: a learning-rate Variable must have shape [1], "
                              f"{learning_rate.name!r} has {list(learning_rate.shape)}")
        else:
            learning_rate = number(learning_rate, f"{type(self).__name__} learning_rate")
        self._learning_rate: float | Variable = learning_rate
        self.regularization = as_regularizer(regularization)
        self._name = name
        self._learning_rate_map: dict[Program, Variable] = {}
        self._accumulators: dict[str, dict[str, Variable]] = {}

    # --- learning rate -------------------------------------------------------------------------
    def _create_global_learning_rate(self, main: Program, startup: Program) -> Variable:
        lr = self._learning_rate_map.get(main)
        if lr is not None:
            return lr
        if isinstance(self._learning_rate, Variable):
            lr = main.global_block().find_var_recursive(self._learning_rate.name)
            if lr is None:
                raise IRError(f"learning-rate variable {self._learning_rate.name!r} is not in the main program",
                              hint="build the schedule and minimize under the same program_guard")
        else:
            lr = create_global_var(main, startup, unique_name("learning_rate"), (1,), "float32",
                                   self._learning_rate)
        self._learning_rate_map[main] = lr
        return lr

    def _global_learning_rate(self, program: Program | None = None) -> Variable | None:
        """The learning-rate Variable of ``program`` (the default main program), once created."""
        return self._learning_rate_map.get(program or default_main_program())

    def _create_param_lr(self, block: Block, param: Parameter) -> str:
        lr = self._learning_rate_map[block.program]
        if param.learning_rate == 1.0:
            return lr.name
        scaled = block.create_var(None, shape=lr.shape, dtype=lr.dtype)
        block.append_op("scale", {"X": [lr.name]}, {"Out": [scaled.name]},
                        {"scale": param.learning_rate, OP_ROLE_ATTR: int(OpRole.LRSCHED | OpRole.OPTIMIZE),
                         OP_ROLE_VAR_ATTR: []})
        return scaled.name

    # --- accumulators --------------------------------------------------------------------------
    def _add_accumulator(self, main: Program, startup: Program, name: str, param: Parameter,
                         dtype: str | None = None, fill_value: float = 0.0,
                         shape: Sequence[int] | None = None) -> Variable:
        if self._name is not None:
            name = f"{self._name}_{name}"
        per_param = self._accumulators.setdefault(name, {})
        if param.name in per_param:
            raise IRError(f"{type(self).__name__}: accumulator {name!r} already exists for parameter {param.name!r}",
                          hint="use a new optimizer object for each minimize call on the same parameters")
        var = create_global_var(main, startup, unique_name(f"{param.name}_{name}"),
                                tuple(param.shape if shape is None else shape), dtype or param.dtype,
                                float(fill_value))
        per_param[param.name] = var
        return var

    def _get_accumulator(self, name: str, param: Parameter) -> Variable:
        if self._name is not None:
            name = f"{self._name}_{name}"
        try:
            return self._accumulators[name][param.name]
        except KeyError:
            raise IRError(f"{type(self).__name__}: no accumulator {name!r} for parameter {param.name!r}") from None

    def _create_accumulators(self, main: Program, startup: Program, parameters: list[Parameter]) -> None:
        """Create this optimizer's accumulators for ``parameters`` (none by default)."""

    def _append_optimize_op(self, block: Block, param: Parameter, grad: Variable) -> Operator:
        raise NotImplementedError

    def _finish_update(self, block: Block, params_grads: ParamsGrads) -> list[Operator]:
        """Ops appended after every parameter's optimizer op (none by default)."""
        return []

    def _append(self, block: Block, param: Parameter, grad: Variable, inputs: dict[str, Any],
                outputs: dict[str, Any], attrs: dict[str, Any]) -> Operator:
        """Append this optimizer's op for one pair, with the common slots, role and op_role_var."""
        ins = {"Param": [param.name], "Grad": [grad.name],
               "LearningRate": [self._create_param_lr(block, param)], **inputs}
        outs = {"ParamOut": [param.name], **outputs}
        return block.append_op(self.type, ins, outs, {**attrs, **optimize_attrs(param.name, grad.name)})

    # --- the passes ----------------------------------------------------------------------------
    def _create_optimization_pass(self, params_grads: ParamsGrads, main: Program,
                                  startup: Program) -> list[Operator]:
        block = main.global_block()
        start = len(block.ops)
        trainable = [(p, g) for p, g in params_grads if g is not None and p.trainable]
        self._create_accumulators(main, startup, [p for p, _ in trainable])
        self._create_global_learning_rate(main, startup)
        for param, grad in trainable:
            self._append_optimize_op(block, param, grad)
        self._finish_update(block, trainable)
        return list(block.ops[start:])

    def backward(self, loss: Variable, startup_program: Program | None = None,
                 parameter_list: Sequence[Parameter | str] | None = None,
                 no_grad_set: Any = None,
                 callbacks: Sequence[Callable[..., Any]] | None = None, *,
                 program: Program | None = None) -> ParamsGrads:
        """Append the backward ops of ``loss`` to ``program`` (the default main program) with
        ``ir.backward.append_backward``; returns the (param, grad) pairs."""
        return list(append_backward(loss, parameter_list=parameter_list, no_grad_set=no_grad_set,
                                    callbacks=callbacks, program=program or default_main_program()))

    def apply_gradients(self, params_grads: Sequence[tuple[Parameter, Variable | None]],
                        grad_clip: BaseGradientClipAttr | str | None = None,
                        program: Program | None = None,
                        startup_program: Program | None = None) -> list[Operator]:
        """Clip, regularize and append the optimizer ops for ``params_grads`` (sorted by name first);
        returns every op appended to the main program's global block by the optimizer proper
        (clip and regularization ops come before them)."""
        main = program or default_main_program()
        startup = startup_program or default_startup_program()
        pairs = sorted(_checked_pairs(params_grads), key=lambda pg: pg[0].name)
        pairs = append_gradient_clip_ops(pairs, grad_clip, program=main)
        pairs = append_regularization_ops(pairs, self.regularization, program=main)
        return self._create_optimization_pass(pairs, main, startup)

    def apply_optimize(self, loss: Variable, startup_program: Program | None,
                       params_grads: Sequence[tuple[Parameter, Variable | None]],
                       grad_clip: BaseGradientClipAttr | str | None = None) -> list[Operator]:
        return self.apply_gradients(params_grads, grad_clip=grad_clip, startup_program=startup_program)

    def minimize(self, loss: Variable, startup_program: Program | None = None,
                 parameter_list: Sequence[Parameter | str] | None = None, no_grad_set: Any = None,
                 grad_clip: BaseGradientClipAttr | str | None = None) -> tuple[list[Operator], ParamsGrads]:
        """Append backward and optimize ops for ``loss`` to the default main program; returns
        (optimize_ops, params_grads). ``grad_clip`` applies to parameters without a clip of their own."""
        main = default_main_program()
        params_grads = self.backward(loss, startup_program=startup_program, parameter_list=parameter_list,
                                     no_grad_set=no_grad_set, program=main)
        optimize_ops = self.apply_gradients(params_grads, grad_clip=grad_clip, program=main,
                                            startup_program=startup_program)
        return optimize_ops, params_grads


def _checked_pairs(params_grads: Sequence[tuple[Parameter, Variable | None]]) -> ParamsGrads:
    pairs: ParamsGrads = []
    for pair in params_grads:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise IRError(f"expected (Parameter, gradient Variable) pairs, got {pair!r}")
        param, grad = pair
        if not isinstance(param, Parameter):
            raise IRError(f"expected a Parameter, got {type(param).__name__} {param!r}",
                          hint="pass the pairs append_backward returned")
        if grad is not None and not isinstance(grad, Variable):
            raise IRError(f"gradient of {param.name!r} must be a Variable or None, got {type(grad).__name__}")
        pairs.append((param, grad))
    return pairs


class SGD(Optimizer):
    """``param -= lr * grad``."""

    type = "sgd"

    def __init__(self, learning_rate: float | Variable,
                 regularization: WeightDecayRegularizer | str | None = None, name: str | None = None) -> None:
        super().__init__(learning_rate, regularization, name)

    def _append_optimize_op(self, block: Block, param: Parameter, grad: Variable) -> Operator:
        return self._append(block, param, grad, {}, {}, {})


class Momentum(Optimizer):
    """Momentum SGD (optionally Nesterov): ``velocity = mu * velocity + grad``."""

    type = "momentum"
    _velocity_acc_str = "velocity"

    def __init__(self, learning_rate: float | Variable, momentum: float, use_nesterov: bool = False,
                 regularization: WeightDecayRegularizer | str | None = None, name: str | None = None) -> None:
        super().__init__(learning_rate, regularization, name)
        self._momentum = number(momentum, "Momentum momentum")
        self._use_nesterov = bool(use_nesterov)

    def _create_accumulators(self, main: Program, startup: Program, parameters: list[Parameter]) -> None:
        for p in parameters:
            self._add_accumulator(main, startup, self._velocity_acc_str, p)

    def _append_optimize_op(self, block: Block, param: Parameter, grad: Variable) -> Operator:
        velocity = self._get_accumulator(self._velocity_acc_str, param).name
        return self._append(block, param, grad, {"Velocity": [velocity]}, {"VelocityOut": [velocity]},
                            {"mu": self._momentum, "use_nesterov": self._use_nesterov})


class Adagrad(Optimizer):
    """Adagrad: ``moment += grad**2; param -= lr * grad / (sqrt(moment) + epsilon)``."""

    type = "adagrad"
    _moment_acc_str = "moment"

    def __init__(self, learning_rate: float | Variable, epsilon: float = 1.0e-6,
                 regularization: WeightDecayRegularizer | str | None = None, name: str | None = None,
                 initial_accumulator_value: float = 0.0) -> None:
        super().__init__(learning_rate, regularization, name)
        self._epsilon = number(epsilon, "Adagrad epsilon")
        self._initial_accumulator_value = number(initial_accumulator_value, "Adagrad initial_accumulator_value")

    def _create_accumulators(self, main: Program, startup: Program, parameters: list[Parameter]) -> None:
        for p in parameters:
            self._add_accumulator(main, startup, self._moment_acc_str, p, fill_value=self._initial_accumulator_value)

    def _append_optimize_op(self, block: Block, param: Parameter, grad: Variable) -> Operator:
        moment = self._get_accumulator(self._moment_acc_str, param).name
        return self._append(block, param, grad, {"Moment": [moment]}, {"MomentOut": [moment]},
                            {"epsilon": self._epsilon})


class Adam(Optimizer):
    """Adam; the beta powers are updated by ``scale`` ops after every parameter's ``adam`` op."""

    type = "adam"
    _moment1_acc_str = "moment1"
    _moment2_acc_str = "moment2"
    _beta1_pow_acc_str = "beta1_pow_acc"
    _beta2_pow_acc_str = "beta2_pow_acc"

    def __init__(self, learning_rate: float | Variable = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, regularization: WeightDecayRegularizer | str | None = None,
                 name: str | None = None, lazy_mode: bool = False) -> None:
        super().__init__(learning_rate, regularization, name)
        self._beta1 = number(beta1, "Adam beta1")
        self._beta2 = number(beta2, "Adam beta2")
        self._epsilon = number(epsilon, "Adam epsilon")
        self._lazy_mode = bool(lazy_mode)

    def _create_accumulators(self, main: Program, startup: Program, parameters: list[Parameter]) -> None:
        for p in parameters:
            self._add_accumulator(main, startup, self._moment1_acc_str, p)
            self._add_accumulator(main, startup, self._moment2_acc_str, p)
            self._add_accumulator(main, startup, self._beta1_pow_acc_str, p, dtype="float32",
                                  fill_value=self._beta1, shape=(1,))
            self._add_accumulator(main, startup, self._beta2_pow_acc_str, p, dtype="float32",
                                  fill_value=self._beta2, shape=(1,))

    def _append_optimize_op(self, block: Block, param: Parameter, grad: Variable) -> Operator:
        m1 = self._get_accumulator(self._moment1_acc_str, param).name
        m2 = self._get_accumulator(self._moment2_acc_str, param).name
        b1 = self._get_accumulator(self._beta1_pow_acc_str, param).name
        b2 = self._get_accumulator(self._beta2_pow_acc_str, param).name
        return self._append(block, param, grad,
                            {"Moment1": [m1], "Moment2": [m2], "Beta1Pow": [b1], "Beta2Pow": [b2]},
                            {"Moment1Out": [m1], "Moment2Out": [m2]},
                            {"beta1": self._beta1, "beta2": self._beta2, "epsilon": self._epsilon,
                             "lazy_mode": self._lazy_mode})

    def _finish_update(self, block: Block, params_grads: ParamsGrads) -> list[Operator]:
        ops = []
        for param, grad in params_grads:
            if grad is None:
                continue
            attrs = optimize_attrs(param.name, grad.name)
            for acc, beta in ((self._beta1_pow_acc_str, self._beta1), (self._beta2_pow_acc_str, self._beta2)):
                name = self._get_accumulator(acc, param).name
                ops.append(block.append_op("scale", {"X": [name]}, {"Out": [name]}, {"scale": beta, **attrs}))
        return ops


class RMSProp(Optimizer):
    """RMSProp (optionally centered, with momentum)."""

    type = "rmsprop"
    _momentum_acc_str = "momentum"
    _mean_square_acc_str = "mean_square"
    _mean_grad_acc_str = "mean_grad"

    def __init__(self, learning_rate: float | Variable, rho: float = 0.95, epsilon: float = 1.0e-6,
                 momentum: float = 0.0, centered: bool = False,
                 regularization: WeightDecayRegularizer | str | None = None, name: str | None = None) -> None:
        super().__init__(learning_rate, regularization, name)
        self._rho = number(rho, "RMSProp rho")
        self._epsilon = number(epsilon, "RMSProp epsilon")
        self._momentum = number(momentum, "RMSProp momentum")
        self._centered = bool(centered)

    def _create_accumulators(self, main: Program, startup: Program, parameters: list[Parameter]) -> None:
        for p in parameters:
            self._add_accumulator(main, startup, self._momentum_acc_str, p)
            self._add_accumulator(main, startup, self._mean_square_acc_str, p)
            self._add_accumulator(main, startup, self._mean_grad_acc_str, p)

    def _append_optimize_op(self, block: Block, param: Parameter, grad: Variable) -> Operator:
        moment = self._get_accumulator(self._momentum_acc_str, param).name
        mean_square = self._get_accumulator(self._mean_square_acc_str, param).name
        mean_grad = self._get_accumulator(self._mean_grad_acc_str, param).name
        return self._append(block, param, grad,
                            {"Moment": [moment], "MeanSquare": [mean_square], "MeanGrad": [mean_grad]},
                            {"MomentOut": [moment], "MeanSquareOut": [mean_square], "MeanGradOut": [mean_grad]},
                            {"epsilon": self._epsilon, "decay": self._rho, "momentum": self._momentum,
                             "centered": self._centered})


class DecayedAdagrad(Optimizer):
    """Adagrad with a decaying moment: ``moment = decay * moment + (1 - decay) * grad**2``."""

    type = "decayed_adagrad"
    _moment_acc_str = "moment"

    def __init__(self, learning_rate: float | Variable, decay: float = 0.95, epsilon: float = 1.0e-6,
                 regularization: WeightDecayRegularizer | str | None = None, name: str | None = None) -> None:
        super().__init__(learning_rate, regularization, name)
        self._decay = number(decay, "DecayedAdagrad decay")
        self._epsilon = number(epsilon, "DecayedAdagrad epsilon")

    def _create_accumulators(self, main: Program, startup: Program, parameters: list[Parameter]) -> None:
        for p in parameters:
            self._add_accumulator(main, startup, self._moment_acc_str, p)

    def _append_optimize_op(self, block: Block, param: Parameter, grad: Variable) -> Operator:
        moment = self._get_accumulator(self._moment_acc_str, param).name
        return self._append(block, param, grad, {"Moment": [moment]}, {"MomentOut": [moment]},
                            {"decay": self._decay, "epsilon": self._epsilon})


class Ftrl(Optimizer):
    """FTRL-Proximal with L1/L2 terms and a learning-rate power."""

    type = "ftrl"
    _squared_acc_str = "squared"
    _linear_acc_str = "linear"

    def __init__(self, learning_rate: float | Variable, l1: float = 0.0, l2: float = 0.0, lr_power: float = -0.5,
                 regularization: WeightDecayRegularizer | str | None = None, name: str | None = None) -> None:
        super().__init__(learning_rate, regularization, name)
        self._l1 = number(l1, "Ftrl l1")
        self._l2 = number(l2, "Ftrl l2")
        self._lr_power = number(lr_power, "Ftrl lr_power")

    def _create_accumulators(self, main: Program, startup: Program, parameters: list[Parameter]) -> None:
        for p in parameters:
            self._add_accumulator(main, startup, self._squared_acc_str, p)
            self._add_accumulator(main, startup, self._linear_acc_str, p)

    def _append_optimize_op(self, block: Block, param: Parameter, grad: Variable) -> Operator:
        squared = self._get_accumulator(self._squared_acc_str, param).name
        linear = self._get_accumulator(self._linear_acc_str, param).name
        return self._append(block, param, grad,
                            {"SquaredAccumulator": [squared], "LinearAccumulator": [linear]},
                            {"SquaredAccumOut": [squared], "LinearAccumOut": [linear]},
                            {"l1": self._l1, "l2": self._l2, "lr_power": self._lr_power})


class DGCMomentumOptimizer(Momentum):
    """Deep Gradient Compression (Lin et al., ICLR 2018) as Fluid 1.6's ``DGCMomentumOptimizer``.

    A parameter of at least ``min_compress_numel`` elements (Fluid's 16384: smaller ones cost more in
    per-op overhead than they save in bytes) is compressed: a ``dgc`` op per parameter (local clipping,
    momentum correction ``U = mu*U + g``, accumulation ``V += U``, top-k of ``|V|`` at the step's sparsity,
    momentum factor masking), then one ``dgc_allreduce`` for all of them (dense mean before
    ``rampup_begin_step``, an allgather of the (index, value) pairs after), then a ``dgc_momentum`` per
    parameter (momentum before ``rampup_begin_step``, SGD on the decoded mean after), then one
    ``increment`` of the shared step counter. The sparsity walks through ``sparsity`` over ``rampup_step``
    steps from ``rampup_begin_step``. Smaller parameters get plain ``momentum`` ops (dense allreduce under
    the collective transpiler). Only collective (``nccl2``) training supports it: the pserver transpiler
    refuses it (E772); the ``dgc`` pass records the group's size. Run on one process it is DGC with a
    group of one.
    """

    type = "momentum"
    MIN_COMPRESS_NUMEL = 16384

    def __init__(self, learning_rate: float | Variable, momentum: float, rampup_begin_step: int,
                 rampup_step: int = 1, sparsity: Sequence[float] = (0.999,), use_nesterov: bool = False,
                 local_grad_clip_norm: float | None = None, num_trainers: int | None = None,
                 regularization: WeightDecayRegularizer | str | None = None, name: str | None = None,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        super().__init__(learning_rate, momentum, use_nesterov, regularization, name)
        if isinstance(rampup_begin_step, bool) or not isinstance(rampup_begin_step, int) or rampup_begin_step < 0:
            raise IRError(f"DGCMomentumOptimizer: rampup_begin_step must be an int >= 0, got {rampup_begin_step!r}",
                          hint="the number of dense (uncompressed) steps before compression starts, e.g. 0",
                          code="E771")
        if isinstance(rampup_step, bool) or not isinstance(rampup_step, int) or rampup_step < 1:
            raise IRError(f"DGCMomentumOptimizer: rampup_step must be an int >= 1, got {rampup_step!r}",
                          hint="the number of steps over which the sparsity list is walked through", code="E771")
        values = list(sparsity) if isinstance(sparsity, (list, tuple)) else None
        if not values or any(isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 < s < 1.0
                             for s in values):
            raise IRError(f"DGCMomentumOptimizer: sparsity must be a non-empty list of numbers inside (0, 1), "
                          f"got {sparsity!r}", hint="e.g. sparsity=[0.75, 0.9375, 0.984375, 0.996, 0.999]",
                          code="E770")
        if local_grad_clip_norm is not None and not number(local_grad_clip_norm, "local_grad_clip_norm") > 0:
            raise IRError("DGCMomentumOptimizer: local_grad_clip_norm must be > 0 or None, "
                          f"got {local_grad_clip_norm!r}",
                          hint="pass None to disable local clipping", code="E770")
        for what, value in (("num_trainers", num_trainers), ("min_compress_numel", min_compress_numel)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise IRError(f"DGCMomentumOptimizer: {what} must be an int >= 1 or None, got {value!r}",
                              hint="num_trainers None uses the size of the trainer group; min_compress_numel is "
                                   "the smallest parameter compressed (default 16384, as Fluid)", code="E771")
        self._rampup_begin_step = rampup_begin_step
        self._rampup_step = rampup_step
        self._sparsity = [float(s) for s in values]
        self._clip = float(local_grad_clip_norm) if local_grad_clip_norm is not None else -1.0
        self._num_trainers = num_trainers or 0
        self._min_numel = min_compress_numel
        self._step: dict[Program, Variable] = {}
        self._encoded: list[tuple[Parameter, Variable, Operator]] = []

    def _compressed(self, param: Parameter) -> bool:
        numel = 1
        for d in param.shape:
            numel *= d
        return numel >= self._min_numel

    def _create_accumulators(self, main: Program, startup: Program, parameters: list[Parameter]) -> None:
        for p in parameters:
            if self._compressed(p):
                self._add_accumulator(main, startup, "dgc_u", p)
                self._add_accumulator(main, startup, "dgc_v", p)
            else:
                self._add_accumulator(main, startup, self._velocity_acc_str, p)
        if any(self._compressed(p) for p in parameters) and main not in self._step:
            self._step[main] = create_global_var(main, startup, unique_name("dgc_step"), (1,), "float32", 0.0)

    def _schedule(self) -> dict[str, Any]:
        return {"sparsity": self._sparsity, "rampup_begin_step": self._rampup_begin_step,
                "rampup_step": self._rampup_step}

    def _append_optimize_op(self, block: Block, param: Parameter, grad: Variable) -> Operator:
        if not self._compressed(param):
            return super()._append_optimize_op(block, param, grad)
        u = self._get_accumulator("dgc_u", param).name
        v = self._get_accumulator("dgc_v", param).name
        idx = block.create_var(unique_name(f"{param.name}_dgc_encode_index"), dtype="int32")
        vals = block.create_var(unique_name(f"{param.name}_dgc_encode_value"), dtype=param.dtype)
        op = block.append_op("dgc", {"U": [u], "V": [v], "Grad": [grad.name], "Step": [self._step[block.program].name]},
                             {"UOut": [u], "VOut": [v], "EncodeIndex": [idx.name], "EncodeValue": [vals.name]},
                             {"m": self._momentum, "use_nesterov": self._use_nesterov, **self._schedule(),
                              "local_grad_clip_norm": self._clip, "num_trainers": self._num_trainers,
                              **optimize_attrs(param.name, grad.name)})
        self._encoded.append((param, grad, op))
        return op

    def _finish_update(self, block: Block, params_grads: ParamsGrads) -> list[Operator]:
        encoded, self._encoded = self._encoded, []
        if not encoded:
            return []
        step = self._step[block.program].name
        grads = [g.name for _, g, _ in encoded]
        ops = [block.append_op(
            "dgc_allreduce", {"Grad": grads, "EncodeIndex": [op.output("EncodeIndex")[0] for *_, op in encoded],
                              "EncodeValue": [op.output("EncodeValue")[0] for *_, op in encoded], "Step": [step]},
            {"Out": grads}, {**self._schedule(), OP_ROLE_ATTR: int(OpRole.OPTIMIZE),
                             OP_ROLE_VAR_ATTR: [n for p, g, _ in encoded for n in (p.name, g.name)]})]
        for param, grad, _ in encoded:
            ops.append(block.append_op(
                "dgc_momentum", {"Param": [param.name], "Grad": [grad.name],
                                 "U": [self._get_accumulator("dgc_u", param).name],
                                 "LearningRate": [self._create_param_lr(block, param)], "Step": [step]},
                {"ParamOut": [param.name], "UOut": [self._get_accumulator("dgc_u", param).name]},
                {"mu": self._momentum, "use_nesterov": self._use_nesterov,
                 "rampup_begin_step": self._rampup_begin_step, **optimize_attrs(param.name, grad.name)}))
        ops.append(block.append_op("increment", {"X": [step]}, {"Out": [step]},
                                   {"step": 1.0, OP_ROLE_ATTR: int(OpRole.OPTIMIZE), OP_ROLE_VAR_ATTR: []}))
        return ops


# Fluid's long names.
SGDOptimizer = SGD
MomentumOptimizer = Momentum
AdagradOptimizer = Adagrad
AdamOptimizer = Adam
RMSPropOptimizer = RMSProp
DecayedAdagradOptimizer = DecayedAdagrad
FtrlOptimizer = Ftrl


class RecomputeOptimizer:
    """``RecomputeOptimizer(optimizer, checkpoints=[...])`` (Paddle's later name): ``minimize`` appends the
    backward, then recomputes the forward segments between the checkpoints inside the backward pass instead
    of keeping their activations (``ir.recompute.apply_recompute``), then lets ``optimizer`` append its
    update ops. The gradients are those of plain training; the activations between checkpoints are not
    kept from the forward to the backward pass."""

    def __init__(self, optimizer: Optimizer, checkpoints: Sequence[Any] | None = None) -> None:
        if not isinstance(optimizer, Optimizer):
            raise IRError(f"RecomputeOptimizer wraps an Optimizer, got {type(optimizer).__name__}",
                          hint="e.g. RecomputeOptimizer(optimizer.Adam(1e-3), checkpoints=[...])")
        self._optimizer = optimizer
        self._checkpoints: list[Any] = list(checkpoints or [])

    def _set_checkpoints(self, checkpoints: Sequence[Any]) -> None:
        """Paddle's setter: the activations to keep (the segment boundaries)."""
        self._checkpoints = list(checkpoints)

    def minimize(self, loss: Variable, startup_program: Program | None = None,
                 parameter_list: Sequence[Parameter | str] | None = None, no_grad_set: Any = None,
                 grad_clip: BaseGradientClipAttr | str | None = None) -> tuple[list[Operator], ParamsGrads]:
        from ir.recompute import apply_recompute

        if not self._checkpoints:
            raise IRError("RecomputeOptimizer has no checkpoints",
                          hint="pass checkpoints=[...] (layer outputs) or call _set_checkpoints first")
        main = default_main_program()
        params_grads = self._optimizer.backward(loss, startup_program=startup_program,
                                                parameter_list=parameter_list, no_grad_set=no_grad_set, program=main)
        apply_recompute(main.global_block(), self._checkpoints)
        optimize_ops = self._optimizer.apply_gradients(params_grads, grad_clip=grad_clip, program=main,
                                                       startup_program=startup_program)
        return optimize_ops, params_grads
