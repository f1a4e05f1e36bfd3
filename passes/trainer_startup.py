"""Pass ``trainer_startup``: make the trainer start from the pservers' initial parameters.

Needs: a placed plan and the role ``trainer.<id>`` whose startup program is a clone of the input's.
Guarantees (Fluid 1.5 ``_get_trainer_startup_program``): after the original init ops, one ``recv``
per parameter (its blocks from their endpoints), one ``fetch_barrier``, and a ``concat`` for every
sliced parameter, so the trainer's copy equals what the pservers initialised.
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.names import FETCH_BARRIER_OUT
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OP_ROLE_ATTR, OpRole

from passes.pass_base import Pass, PassContext
from passes.rpc_builders import control_var, param_block_vars, rpc_attrs


@dataclass(frozen=True)
class TrainerStartup(Pass):
    """See the module docstring."""

    name = "trainer_startup"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.require_placed(self.name)
        startup = programs[ProgramRole.trainer(plan.trainer_id)].startup
        block = startup.global_block()
        origin = ctx.origin_main.global_block()
        received: list[str] = []
        for pp in plan.params:
            if not block.has_var(pp.param):
                block.add_var(origin.var(pp.param))
            outs = param_block_vars(block, pp)
            received += outs
            block.append_op("recv", {"X": []}, {"Out": outs},
                            rpc_attrs(epmap=list(pp.endpoints), trainer_id=plan.trainer_id))
        control_var(block, FETCH_BARRIER_OUT)
        block.append_op("fetch_barrier", {"X": received}, {"Out": [FETCH_BARRIER_OUT]},
                        rpc_attrs(endpoints=list(plan.pservers), trainer_id=plan.trainer_id))
        for pp in plan.params:
            if pp.is_sliced:
                block.append_op("concat", {"X": [b.name for b in pp.param_blocks]}, {"Out": [pp.param]},
                                {"axis": 0, OP_ROLE_ATTR: int(OpRole.DIST)})
        return True


__all__ = ["TrainerStartup"]
