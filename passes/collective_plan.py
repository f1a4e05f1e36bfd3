"""The plan the collective (nccl2) passes share: the trainer group and how gradients are reduced.

Invariants: ``endpoints`` lists every trainer once, in rank order, and ``endpoints[trainer_id]`` is this
trainer's own endpoint; ``nranks == len(endpoints)``; ``pairs`` lists every trained (parameter,
gradient) pair once, in the order the optimizer ops name them (``op_role_var``), never by guessing names.
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.core import Parameter, Program
from ir.roles import OpRole

GRAD_ALLREDUCE = "grad_allreduce"
LOCAL_SGD = "local_sgd"


@dataclass(frozen=True)
class CollectivePlan:
    """One trainer's view of a collective job."""

    trainer_id: int
    endpoints: tuple[str, ...]
    kind: str = GRAD_ALLREDUCE
    fuse_grad_size_mb: float = 32.0
    local_sgd_steps: int = 1
    nccl_comm_num: int = 1

    @property
    def nranks(self) -> int:
        return len(self.endpoints)

    @property
    def current_endpoint(self) -> str:
        return self.endpoints[self.trainer_id]

    @property
    def other_endpoints(self) -> list[str]:
        """Every endpoint but this trainer's, in rank order (Fluid 1.5's ``endpoint_list``)."""
        return [ep for i, ep in enumerate(self.endpoints) if i != self.trainer_id]


def trained_pairs(program: Program) -> list[tuple[str, str]]:
    """(parameter, gradient) of every trainable parameter an optimize op names, in program order."""
    block = program.global_block()
    pairs: dict[str, str] = {}
    for op in block.ops:
        if op.role != int(OpRole.OPTIMIZE):
            continue
        rv = op.role_var
        for i in range(0, len(rv) - 1, 2):
            param, grad = rv[i], rv[i + 1]
            var = block.find_var_recursive(param)
            if param not in pairs and isinstance(var, Parameter) and var.trainable:
                pairs[param] = grad
    return list(pairs.items())


__all__ = ["CollectivePlan", "GRAD_ALLREDUCE", "LOCAL_SGD", "trained_pairs"]
