"""Pass ``geo_sgd_startup``: initialise a Geo-SGD trainer's sync state in its startup program.

Needs: a placed plan with ``geo_sgd`` set, and the trainer role after ``trainer_send_recv`` (which
declares the state in the main program) and ``trainer_startup`` (which fetches the initial parameters).
Guarantees: the trainer startup program declares the step counter ``@GEO_SGD_STEP@`` and one snapshot
``<param>@GEO_SNAPSHOT`` per planned parameter (as the main program does), and ends with a
``fill_constant`` 0 of the counter and, per parameter in plan order, an ``assign`` of the parameter (as
received from the pservers) to its snapshot: the first sync's deltas are measured from there. With a
distributed table, the table's own init op is dropped (its values come from the pservers), the table's
snapshot and touched mask are declared, and a last ``geo_table_init`` fetches every shard into the table
and its snapshot and clears the mask.
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.names import GEO_STEP_VAR
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OP_ROLE_ATTR, OpRole

from passes.pass_base import Pass, PassContext, PassError
from passes.rpc_builders import geo_state_vars, geo_table_state_vars, rpc_attrs


@dataclass(frozen=True)
class GeoSgdStartup(Pass):
    """See the module docstring."""

    name = "geo_sgd_startup"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.require_placed(self.name)
        if not plan.geo_sgd:
            raise PassError(f"pass {self.name!r} needs a Geo-SGD plan (geo_sgd_mode)",
                            hint="run it only with DistributeTranspilerConfig(geo_sgd_mode=True)")
        table = plan.table
        if not plan.params and table is None:
            return False
        block = programs[ProgramRole.trainer(plan.trainer_id)].startup.global_block()
        state = geo_state_vars(block, plan)
        attrs = {OP_ROLE_ATTR: int(OpRole.FORWARD)}
        block.append_op("fill_constant", {}, {"Out": [GEO_STEP_VAR]},
                        {"shape": [1], "dtype": "int64", "value": 0.0, **attrs})
        for pp, snapshot in zip(plan.params, state[1:]):
            block.append_op("assign", {"X": [pp.param]}, {"Out": [snapshot.name]}, attrs)
        if table is not None:
            for index in reversed([i for i, op in enumerate(block.ops) if op.output_arg_names == [table.table]]):
                block.remove_op(index)
            snapshot, touched = geo_table_state_vars(block, table)
            block.append_op("geo_table_init", {}, {"Table": [table.table], "TableSnapshot": [snapshot.name],
                                                   "Touched": [touched.name]},
                            rpc_attrs(epmap=list(table.endpoints), table_name=table.table, rows=table.shape[0],
                                      width=table.shape[1], dtype=block.var(table.table).dtype,
                                      trainer_id=plan.trainer_id))
        return True


__all__ = ["GeoSgdStartup"]
