"""Pass ``pserver_startup``: the startup program of every pserver (Fluid 1.5 §5.7).

Needs: the ``pserver@<endpoint>`` roles built by ``pserver_program``. For each, the startup program
declares every variable of the pserver's block 0 and keeps, in the input startup program's order,
only the init ops of what the endpoint holds: an init op whose output ``o`` is held under its own
name is copied as is; for each held variable recording ``slice_of == o`` or ``copy_of == o`` the op
is copied with its output redirected there and, for ops with a ``shape`` attribute, the shape set to
that variable's shape. Initializer attributes and seeds are kept. With DC-ASGD, each held slice is
then ``assign``-ed to its per-trainer backups. The input is never modified.
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.core import Operator, Program, copy_op
from ir.names import dc_asgd_backup_name
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OP_ROLE_ATTR, OpRole

from passes.dist_plan import DistPlan
from passes.pass_base import Pass, PassContext


def held_as_index(program: Program) -> dict[str, list[str]]:
    """For every origin name, the block-0 variables of ``program`` that hold it, in declaration order:
    the variable itself, its slices (``slice_of``) and its whole copies (``copy_of`` without a
    ``trainer_id``). Built in one pass over the variables."""
    index: dict[str, list[str]] = {}
    for v in program.global_block().vars.values():
        origins = [v.name, v.slice_of, v.copy_of if v.trainer_id is None else None]
        for origin in dict.fromkeys(o for o in origins if o is not None):
            index.setdefault(origin, []).append(v.name)
    return index


@dataclass(frozen=True)
class PserverStartup(Pass):
    """See the module docstring."""

    name = "pserver_startup"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.require_placed(self.name)
        for ep in plan.pservers:
            role = programs[ProgramRole.pserver(ep)]
            role.startup = self.build(ctx.origin_startup, role.main)
            if plan.enable_dc_asgd:
                _init_dc_asgd_backups(role.startup, plan, ep)
        return True

    @staticmethod
    def build(origin_startup: Program, main: Program) -> Program:
        prog = Program()
        prog.random_seed = main.random_seed
        g = prog.global_block()
        for v in main.global_block().vars.values():
            g.add_var(v)
        src = origin_startup.global_block()
        held = held_as_index(main)
        for op in src.ops:
            if op.type in ("recv", "fetch_barrier", "concat"):
                continue
            outs = op.output_arg_names
            if not outs:
                continue
            for target in held.get(outs[0], []):
                for n in op.input_arg_names:
                    if not g.has_var(n):
                        g.add_var(src.var_recursive(n))
                new = copy_op(g, op, {outs[0]: target}) if target != outs[0] else copy_op(g, op, {})
                _set_shape(new, g.var(target).shape)
        return prog


def _set_shape(op: Operator, shape: tuple[int, ...]) -> None:
    if op.has_attr("shape") and list(op.attr("shape")) != list(shape):
        op.set_attr("shape", list(shape))


def _init_dc_asgd_backups(startup: Program, plan: DistPlan, ep: str) -> None:
    """DC-ASGD: ``assign`` every held slice to each trainer's backup, after the slice's init (Fluid 1.5)."""
    g = startup.global_block()
    for pp, i in plan.blocks_on(ep):
        pb = pp.param_blocks[i]
        for t in range(plan.trainers):
            g.append_op("assign", {"X": [pb.name]}, {"Out": [dc_asgd_backup_name(pb.name, t)]},
                        {OP_ROLE_ATTR: int(OpRole.FORWARD)})
