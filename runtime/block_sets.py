"""Which sub-blocks of a program may run as one plan (``Executor.run_blocks``): a static fact of the IR.

Kept apart from the executor so the pserver (``runtime.rpc.pserver``), which decides what to merge, needs
no import of the executor (that would close an import cycle through the RPC client).

Invariant: a set ``block_dependency`` accepts computes, run as its ops concatenated in order, exactly what
running its blocks one by one computes: no block reads or writes what another writes, except reads of
what the first one writes (a learning-rate block), which the concatenation computes first.
"""
from __future__ import annotations

from typing import Sequence

from ir.core import Program
from ir.names import EMPTY_VAR_NAME


def block_dependency(program: Program, block_ids: Sequence[int]) -> str | None:
    """Why ``Executor.run_blocks`` cannot run the blocks ``block_ids`` of ``program`` as one plan, or None
    when it can: the blocks are distinct sub-blocks, and no block reads or writes what another block of
    the set writes, except that every block may read what the first one writes (a learning-rate block).
    Then the concatenated ops compute exactly what running each block in turn does."""
    ids = list(block_ids)
    if len(set(ids)) != len(ids):
        return f"block(s) {sorted({i for i in ids if ids.count(i) > 1})} appear more than once"
    if any(not 0 < i < program.num_blocks for i in ids):
        return (f"blocks {ids} are not all sub-blocks of the program (ids 1..{program.num_blocks - 1}); "
                "block 0 runs through Executor.run")
    reads, writes = [], []
    for i in ids:
        r: set[str] = set()
        w: set[str] = set()
        for op in program.block(i).ops:
            r.update(op.input_arg_names)
            w.update(op.output_arg_names)
        r.discard(EMPTY_VAR_NAME)
        w.discard(EMPTY_VAR_NAME)
        reads.append(r)
        writes.append(w)
    for j, i in enumerate(ids):
        for k, other in enumerate(ids):
            if k == j:
                continue
            touched = writes[j] & (writes[k] if j == 0 else writes[k] | reads[k])
            if touched:
                how = "reads or writes" if j else "writes"
                return f"block {other} {how} {sorted(touched)[:3]}, which block {i} of the set writes"
    return None
