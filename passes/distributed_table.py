"""Pass ``distributed_table``: rewrite the programs for a distributed lookup table.

Needs: the trainer and pserver roles. With no distributed table in the plan it changes nothing.
The table rewrite (split_ids → prefetch → merge_ids on the trainer, table-optimize, prefetch and
checkpoint blocks on the pservers) is not implemented yet: a plan with a table raises ``PassError``
(E650) rather than producing programs that silently miss the table. TODO(#4).
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.program_set import ProgramSet

from passes.pass_base import Pass, PassContext, PassError


@dataclass(frozen=True)
class DistributedTable(Pass):
    """See the module docstring."""

    name = "distributed_table"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        table = ctx.plan.table
        if table is None:
            return False
        raise PassError(f"the distributed lookup table {table.table!r} cannot be transpiled yet",
                        hint="use embedding(is_sparse=True) without is_distributed for now", code="E650")
