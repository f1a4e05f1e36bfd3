"""Pass ``local_sgd``: every trainer steps alone; every k steps the parameters are averaged.

Needs: a ``CollectivePlan`` of kind ``local_sgd`` and the role ``trainer.<id>``. Guarantees: a persistable
int64 step counter ``@LOCAL_SGD_STEP@`` (initialised to 0 by the startup program), and after the last
optimize op one ``c_local_sgd`` over every trained parameter: it counts the step and, every
``local_sgd_steps``-th step, replaces each parameter by its mean over the trainers in one collective
(other steps cost no communication). With k = 1 and plain SGD this equals gradient averaging.
Optimizer accumulators (momentum, Adam moments) stay local, as in Fluid's LocalSGD.
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.names import LOCAL_SGD_STEP_VAR
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OP_ROLE_ATTR, OpRole

from passes.collective_plan import LOCAL_SGD, trained_pairs
from passes.pass_base import Pass, PassContext, PassError


@dataclass(frozen=True)
class LocalSGD(Pass):
    """See the module docstring."""

    name = "local_sgd"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.require_collective(self.name)
        if plan.kind != LOCAL_SGD:
            raise PassError(f"pass {self.name!r} needs collective_mode 'local_sgd', got {plan.kind!r}")
        progs = programs[ProgramRole.trainer(plan.trainer_id)]
        block = progs.main.global_block()
        params = [p for p, _ in trained_pairs(progs.main)]
        optimize = int(OpRole.OPTIMIZE)
        last = max((i for i, op in enumerate(block.ops) if op.role & optimize), default=-1)
        if last < 0 or not params:
            raise PassError("local_sgd needs optimizer ops updating trainable parameters",
                            hint="call optimizer.minimize(loss) before transpiling", code="E622")
        for b in (block, progs.startup.global_block()):
            b.create_var(LOCAL_SGD_STEP_VAR, shape=(1,), dtype="int64", persistable=True, stop_gradient=True)
        progs.startup.global_block().append_op(
            "fill_constant", {}, {"Out": [LOCAL_SGD_STEP_VAR]},
            {"shape": [1], "dtype": "int64", "value": 0.0, OP_ROLE_ATTR: int(OpRole.FORWARD)})
        block.insert_op(last + 1, "c_local_sgd", {"Param": params, "Step": [LOCAL_SGD_STEP_VAR]},
                        {"ParamOut": params, "StepOut": [LOCAL_SGD_STEP_VAR]},
                        {"k_steps": plan.local_sgd_steps, "ring_id": 0, "nranks": plan.nranks,
                         OP_ROLE_ATTR: optimize})
        return True


__all__ = ["LocalSGD"]
