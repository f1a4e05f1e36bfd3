"""Pass ``release_memory``: a ``delete_var`` after each variable's last use (Fluid 1.5).

Per block, over the liveness of ``passes.liveness``: after every op ``i`` at which eligible variables
die (read or written there, not live after it), one ``delete_var(X=[those names, sorted])`` is
inserted, with op ``i``'s role (so a rewrite that drops a phase, e.g. the trainer's optimize ops,
drops its deletions too) and no ``op_role_var``. Eligible means what ``memory_optimize`` may touch
(``passes.liveness.reuse_exclusions``), written by an op of the block, and not already deleted by a
``delete_var`` of the block (so running it twice changes nothing).

The Executor folds a ``delete_var`` into the compiled run it ends (the value is dropped from what the
run returns and from the scope), so the deletions do not split compiled runs.

Guarantees: the program computes what it computed (a deleted value is never read again before it is
written again); it still verifies. Works in place and returns a ``MemoryReport``. One caveat: the
inserted ops shift op indices, and the Executor keys the draws of a random op without a fixed seed
(dropout) on its op index, so such ops draw other (equally distributed) numbers than before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ir.core import Program
from ir.program_set import ProgramSet
from ir.roles import OP_ROLE_ATTR

from passes.liveness import block_liveness, program_peak_bytes, reuse_exclusions
from passes.memory_report import Deletion, MemoryReport, check_arguments
from passes.pass_base import Pass, PassContext

__all__ = ["ReleaseMemory", "release_memory_program"]


def release_memory_program(program: Program, skip_opt_set: Any = None, batch_size: int = 1) -> MemoryReport:
    """Insert ``delete_var`` after last uses in every block of ``program``, in place (see the module docstring)."""
    skip = check_arguments(program, skip_opt_set, 0, batch_size, what="release_memory")
    excluded = reuse_exclusions(program, skip)
    before = program_peak_bytes(program, batch_size=batch_size)
    plans: list[list[Deletion]] = []
    for block in program.blocks:
        lv = block_liveness(block)
        written = {n for d in lv.defs for n in d}
        released = {n for op in block.ops if op.type == "delete_var" for n in op.input("X")}
        eligible = {n for n in block.vars if n not in excluded[block.idx] and n in written and n not in released}
        plan = []
        for i, op in enumerate(block.ops):
            if op.type == "delete_var":
                continue
            dying = tuple(n for n in lv.dying_at(i) if n in eligible)
            if dying:
                plan.append(Deletion(block.idx, i, dying))
        plans.append(plan)
    for block, plan in zip(program.blocks, plans):
        # From the last deletion back, so the indices of the ones still to insert stay valid.
        for d in reversed(plan):
            role = block.ops[d.after_op].role
            block.insert_op(d.after_op + 1, "delete_var", inputs={"X": list(d.names)},
                            attrs={OP_ROLE_ATTR: role}, infer_shape=False)
    after = program_peak_bytes(program, batch_size=batch_size)
    deleted = tuple(d for plan in plans for d in plan)
    skipped = tuple((b, n, r) for b, names in enumerate(excluded) for n, r in names.items())
    return MemoryReport("release_memory", None, batch_size, before, after, (), deleted, skipped)


@dataclass(frozen=True)
class ReleaseMemory(Pass):
    """The ``release_memory`` rewrite as a pipeline pass over every main program of a ProgramSet."""

    name = "release_memory"
    skip_opt_set: frozenset[str] = frozenset()

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        changed = False
        for _, progs in programs.items():
            changed |= bool(release_memory_program(progs.main, self.skip_opt_set).deleted)
        return changed
