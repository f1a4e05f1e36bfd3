"""Pass ``slice_variables``: cut every collected parameter and its gradient into row blocks.

``slice_variable(var_list, slice_count, min_block_size)`` is Fluid 1.5's algorithm exactly: per
variable, ``split_count = min(slice_count, max(1, numel // min_block_size))``, ``block_size =
ceil(numel / split_count)`` rounded up to whole rows, ``split_count = ceil(numel / block_size)``;
blocks split dim 0 and all but the last are equal.

Guarantees: every ParamPlan gets ``param_blocks`` and ``grad_blocks`` with the same row partition,
tiling the variable exactly; block names follow ``ir.names.block_name`` (a variable with one block
keeps its own name). With ``slice_var_up=False`` every variable is one block.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from ir.core import Variable
from ir.names import block_name
from ir.program_set import ProgramSet

from passes.dist_plan import ParamPlan, VarBlock
from passes.pass_base import Pass, PassContext, PassError


def _rows_blocks(name: str, shape: tuple[int, ...], slice_count: int, min_block_size: int) -> list[VarBlock]:
    if not shape or any(d < 0 for d in shape):
        raise PassError(f"cannot slice variable {name!r} of shape {list(shape)}: expected a fixed shape of rank >= 1",
                        hint="parameters and their gradients must have static shapes", code="E610")
    numel = math.prod(shape)
    split_count = slice_count
    max_pserver_count = max(1, numel // min_block_size)
    if max_pserver_count < slice_count:
        split_count = max_pserver_count
    block_size = math.ceil(numel / split_count)
    width = math.prod(shape[1:]) if len(shape) >= 2 else 1
    if block_size % width:
        block_size += width - block_size % width
    split_count = math.ceil(numel / block_size)
    rows_per_block = block_size // width
    blocks = []
    for i in range(split_count):
        size = min(block_size, numel - i * block_size)
        rows = size // width
        bname = name if split_count == 1 else block_name(name, i)
        blocks.append(VarBlock(origin=name, index=i, offset_rows=i * rows_per_block, rows=rows,
                               shape=(rows,) + tuple(shape[1:]), name=bname))
    return blocks


def slice_variable(var_list: Sequence[Variable], slice_count: int, min_block_size: int) -> list[VarBlock]:
    """The blocks of every variable of ``var_list``, in order (Fluid's ``slice_variable``; Fluid
    returned ``"name:index:size"`` strings, these are VarBlock values carrying the same facts)."""
    if isinstance(slice_count, bool) or not isinstance(slice_count, int) or slice_count < 1:
        raise PassError(f"slice_count must be an int >= 1, got {slice_count!r}", hint="pass the number of pservers",
                        code="E611")
    if isinstance(min_block_size, bool) or not isinstance(min_block_size, int) or min_block_size < 1:
        raise PassError(f"min_block_size must be an int >= 1, got {min_block_size!r}",
                        hint="the default is 8192 elements", code="E612")
    out: list[VarBlock] = []
    for var in var_list:
        out.extend(_rows_blocks(var.name, tuple(var.shape), slice_count, min_block_size))
    return out


@dataclass(frozen=True)
class SliceVariables(Pass):
    """Needs: collected params. Guarantees: blocks for every param and grad (see module doc)."""

    name = "slice_variables"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.plan
        block = ctx.origin_main.global_block()
        slice_count = len(plan.pservers) if plan.slice_var_up else 1
        params = []
        for pp in plan.params:
            pvar = block.var(pp.param)
            gvar = block.var(pp.grad)
            pblocks = slice_variable([pvar], slice_count, plan.min_block_size)
            gblocks = slice_variable([gvar.replace(shape=pvar.shape)], slice_count, plan.min_block_size)
            if [b.rows for b in pblocks] != [b.rows for b in gblocks]:
                raise PassError(f"parameter {pp.param!r} and gradient {pp.grad!r} slice differently",
                                hint="a gradient must have its parameter's shape", code="E613")
            params.append(dataclasses.replace(pp, param_blocks=tuple(pblocks), grad_blocks=tuple(gblocks)))
        ctx.plan = dataclasses.replace(plan, params=tuple(params))
        return True
