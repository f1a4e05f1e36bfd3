"""Queries on a program's optimizer ops, shared by the passes that split optimization between the trainer
and the pservers (``collect_params``, ``trainer_send_recv``, ``pserver_program``, ``distributed_table``).

Fluid marks these ops by role (``op_role``) and by slots, not by a list of types; these are the tests
every pass must apply the same way.
"""
from __future__ import annotations

from ir.core import Operator, Program
from ir.roles import OpRole

# Inputs of each optimizer op that follow the parameter's shape (sliced with it); other inputs
# (beta powers, the learning rate) stay whole. Fluid's _get_optimizer_input_shape.
ACCUMULATOR_SLOTS: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "momentum": ("Velocity",),
    "lars_momentum": ("Velocity",),
    "adagrad": ("Moment",),
    "adam": ("Moment1", "Moment2"),
    "adamax": ("Moment", "InfNorm"),
    "rmsprop": ("Moment", "MeanSquare", "MeanGrad"),
    "decayed_adagrad": ("Moment",),
    "ftrl": ("SquaredAccumulator", "LinearAccumulator"),
}


def is_optimizer_op(op: Operator) -> bool:
    """An op that updates a parameter: it has ``Param`` and ``LearningRate`` inputs (Fluid's test)."""
    return "Param" in op.inputs and "LearningRate" in op.inputs


def optimize_ops(program: Program) -> list[Operator]:
    """Ops of the global block whose role is exactly Optimize, in program order."""
    return [op for op in program.global_block().ops if op.role == int(OpRole.OPTIMIZE)]


def param_optimize_ops(program: Program, param: str) -> list[Operator]:
    """The optimize ops of ``param`` (``op_role_var`` naming it first: regularizer, clip, the optimizer, e.g.
    Adam's beta-power scales), in program order."""
    return [op for op in optimize_ops(program) if op.role_var[:1] == [param]]


def lr_ops(program: Program) -> list[Operator]:
    """Learning-rate ops: role exactly LRSched, or LRSched|Optimize."""
    wanted = (int(OpRole.LRSCHED), int(OpRole.LRSCHED | OpRole.OPTIMIZE))
    return [op for op in program.global_block().ops if op.role in wanted]
