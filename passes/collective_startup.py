"""Pass ``collective_startup``: join the trainer group and start every trainer from rank 0's parameters.

Needs: a ``CollectivePlan`` in the context and the role ``trainer.<id>`` whose startup program is a clone
of the input's. Guarantees (Fluid 1.5 nccl2 / 1.6 collective startup):
- the first op of the startup program is ``gen_nccl_id`` (its ``NCCLID`` variable declared, raw and
  persistable) with this trainer's ``trainer_id``, ``endpoint``, ``other_endpoints`` and
  ``nccl_comm_num``, so the group exists before anything is computed;
- after the original init ops, one ``c_broadcast`` from root 0 per parameter the startup program
  initialises (in declaration order, rings round-robin), so every trainer starts from trainer 0's
  values whatever its own random seed.
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.core import Parameter
from ir.names import NCCL_ID_VAR
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OP_ROLE_ATTR, OpRole

from passes.pass_base import Pass, PassContext


@dataclass(frozen=True)
class CollectiveStartup(Pass):
    """See the module docstring."""

    name = "collective_startup"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.require_collective(self.name)
        block = programs[ProgramRole.trainer(plan.trainer_id)].startup.global_block()
        block.create_var(NCCL_ID_VAR, shape=(), dtype="float32", type="raw", persistable=True)
        block.insert_op(0, "gen_nccl_id", {}, {"NCCLID": [NCCL_ID_VAR]},
                        {"trainer_id": plan.trainer_id, "endpoint": plan.current_endpoint,
                         "other_endpoints": plan.other_endpoints, "nccl_comm_num": plan.nccl_comm_num,
                         OP_ROLE_ATTR: int(OpRole.FORWARD)})
        params = [v.name for v in block.vars.values() if isinstance(v, Parameter)]
        for i, name in enumerate(params):
            block.append_op("c_broadcast", {"X": [name]}, {"Out": [name]},
                            {"root": 0, "ring_id": i % plan.nccl_comm_num, "nranks": plan.nranks,
                             OP_ROLE_ATTR: int(OpRole.FORWARD)})
        return True


__all__ = ["CollectiveStartup"]
