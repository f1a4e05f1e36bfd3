"""Pass ``memory_optimize``: a later variable takes over the name (so the buffer) of a dead one (Fluid 1.5).

Per block, over the liveness of ``passes.liveness``, ops in order: when op ``i`` first writes an
eligible variable ``x`` (not read by op ``i`` itself: no in-place), ``x`` is renamed onto the first
variable ``c`` of the pool that fits, and ``c`` leaves the pool; after op ``i``, every eligible
variable (or shared buffer) that is dead for the rest of the block joins the pool, ordered as Fluid
orders it: batch-sized (dim 0 = -1) first, each group by ascending element count, so the smallest
buffer that fits is taken.

Fits: same dtype and type, and
- level 0: the same declared shape;
- level 1: the same rank, both or neither batch-sized, and at most as many elements (Fluid's
  ``|prod(shape)|``). The shared variable is re-declared with the extents that differ unknown (-1),
  which the verifier accepts; a merge is refused when shape inference of an op touching the buffer
  would fail or disagree with that declaration.

Never renamed or reused (``passes.liveness.reuse_exclusions``): persistables, feeds, fetch targets
(the loss, and results no op reads), ``skip_opt_set``, variables read across blocks, RPC and
collective operands, and with ``skip_grads`` every parameter gradient named by ``op_role_var``.

Guarantees: the program computes what it computed (the lifetimes of variables that share a name, as
the spans of program points where each is read, written or live, are disjoint: a block's control
flow is a chain, so a span from first to last point covers every point); it still verifies; renames go through
``Block.reuse_vars``, so ``op_role_var`` follows. Works in place (Fluid's documented exception to
"inputs are never modified") and returns a ``MemoryReport``. Bad arguments raise
``MemoryOptimizeError`` before anything is touched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ir.core import Block, Program
from ir.ops.registry import InferContext, VarInfo, find_op_def
from ir.program_set import ProgramSet

from passes.liveness import Liveness, block_liveness, program_peak_bytes, reuse_exclusions, var_nbytes
from passes.memory_report import MemoryReport, Reuse, check_arguments
from passes.pass_base import Pass, PassContext

__all__ = ["MemoryOptimize", "memory_optimize_program"]


@dataclass(eq=False)  # compared by identity: the pool holds each buffer once
class _Buffer:
    """A shared buffer while planning: its root name, members, and what fits into it."""

    root: str
    dtype: str
    shape: tuple[int, ...]  # the declaration all members agree with
    batch: bool
    elems: int  # Fluid's |prod(shape)|, the largest member's
    nbytes: int
    first: int  # the span of program points its members occupy
    last: int
    members: list[str]


def _elems(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return abs(n)


def _agree(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) == len(b) and all(x == y or x < 0 or y < 0 for x, y in zip(a, b))


def _infers_with(block: Block, ops: Iterable[int], override: dict[str, tuple[int, ...]]) -> bool:
    """Whether shape inference of ``ops`` still succeeds, and agrees with the declarations, when the
    variables in ``override`` are declared with those shapes."""
    for j in sorted(set(ops)):
        op = block.ops[j]
        op_def = find_op_def(op.type)
        if op_def is None or op_def.infer is None:
            continue

        def info(name: str) -> VarInfo:
            var = block.var_recursive(name)
            return VarInfo(override.get(name, var.shape), var.dtype, var.type)

        try:
            inputs = {slot: [info(n) for n in names] for slot, names in op.inputs.items()}
            ctx = InferContext(op.type, inputs, op.attrs, {slot: len(names) for slot, names in op.outputs.items()})
            op_def.infer(ctx)
        # Inference is per-op code that may raise anything on shapes it does not expect; any failure
        # means "do not merge", never a crash of the pass.
        except Exception:  # noqa: BLE001
            return False
        for slot, infos in ctx.outputs.items():
            for name, inferred in zip(op.outputs.get(slot, ()), infos):
                var = block.find_var_recursive(name)
                if var is not None and not _agree(override.get(name, var.shape), inferred.shape):
                    return False
    return True


def _plan_block(block: Block, excluded: dict[str, str], level: int, batch_size: int) -> list[_Buffer]:
    """The shared buffers of one block (each with at least two members), in the order they were formed."""
    ops = block.ops
    lv = block_liveness(block)
    first: dict[str, int] = {}  # each name's first and last program point (read, written or live)
    last: dict[str, int] = {}
    mentions: dict[str, set[int]] = {}
    for i in range(len(ops)):
        for v in lv.uses[i] | lv.defs[i]:
            mentions.setdefault(v, set()).add(i)
        for v in lv.uses[i] | lv.defs[i] | lv.live_in[i] | lv.live_out[i]:
            first.setdefault(v, i)
            last[v] = i
    eligible = {n for n in block.vars if n not in excluded and n in first}
    buffers: dict[str, _Buffer] = {}  # member name → its buffer
    pool: list[_Buffer] = []
    formed: list[_Buffer] = []

    def buffer_of(name: str) -> _Buffer:
        buf = buffers.get(name)
        if buf is None:
            var = block.vars[name]
            buf = _Buffer(name, var.dtype, var.shape, bool(var.shape) and var.shape[0] < 0, _elems(var.shape),
                          var_nbytes(var, batch_size), first[name], last[name], [name])
            buffers[name] = buf
        return buf

    for i, op in enumerate(ops):
        for x in dict.fromkeys(op.output_arg_names):
            if x not in eligible or x in buffers or x in lv.uses[i] or x in lv.live_in[i] or first[x] != i:
                continue
            var = block.vars[x]
            for buf in pool:
                if buf.dtype != var.dtype or buf.last >= i:
                    continue
                if level == 0:
                    if buf.shape != var.shape:
                        continue
                    shape = buf.shape
                else:
                    batch = bool(var.shape) and var.shape[0] < 0
                    if len(buf.shape) != len(var.shape) or buf.batch != batch or _elems(var.shape) > buf.elems:
                        continue
                    shape = tuple(a if a == b else -1 for a, b in zip(buf.shape, var.shape))
                    if shape != buf.shape or shape != var.shape:
                        group = buf.members + [x]
                        touched = set().union(*(mentions.get(n, set()) for n in group))
                        if not _infers_with(block, touched, {n: shape for n in group}):
                            continue
                pool.remove(buf)
                buf.shape = shape
                buf.nbytes = max(buf.nbytes, var_nbytes(var, batch_size))
                buf.last = max(buf.last, last[x])
                buf.members.append(x)
                buffers[x] = buf
                if len(buf.members) == 2:
                    formed.append(buf)
                break
        for v in sorted(lv.uses[i] | lv.defs[i]):
            if v not in eligible:
                continue
            buf = buffer_of(v)
            if buf.last == i and buf not in pool and _written_first(lv, buf.first, buf.members):
                pool.append(buf)
                pool.sort(key=lambda b: (not b.batch, b.elems))
    return formed


def _written_first(lv: Liveness, first: int, members: list[str]) -> bool:
    """The buffer's first point writes it (a value read before any write comes from outside the block)."""
    return any(m in lv.defs[first] for m in members) and not any(m in lv.live_in[first] for m in members)


def memory_optimize_program(program: Program, skip_opt_set: Any = None, level: int = 0, skip_grads: bool = False,
                            batch_size: int = 1) -> MemoryReport:
    """Rename later variables onto dead ones in every block of ``program``, in place (see the module
    docstring); returns what was reused and the liveness estimate of peak bytes before and after."""
    skip = check_arguments(program, skip_opt_set, level, batch_size)
    excluded = reuse_exclusions(program, skip, skip_grads)
    before = program_peak_bytes(program, batch_size=batch_size)
    plans = [_plan_block(block, excluded[block.idx], level, batch_size) for block in program.blocks]
    reused: list[Reuse] = []
    sizes: list[dict[str, int]] = [{} for _ in program.blocks]
    for block, buffers in zip(program.blocks, plans):
        first_write = {}
        for i, op in enumerate(block.ops):
            for n in op.output_arg_names:
                first_write.setdefault(n, i)
        for buf in buffers:
            for x in buf.members[1:]:
                var = block.vars[x]
                reused.append(Reuse(block.idx, first_write[x], x, buf.root, var.dtype, var.shape,
                                    var_nbytes(var, batch_size)))
        block.reuse_vars({x: buf.root for buf in buffers for x in buf.members[1:]},
                         {buf.root: buf.shape for buf in buffers if buf.shape != block.vars[buf.root].shape})
        for buf in buffers:
            sizes[block.idx][buf.root] = buf.nbytes
    reused.sort(key=lambda r: (r.block, r.op_index, r.var))
    after = program_peak_bytes(program, sizes, batch_size=batch_size)
    skipped = tuple((b, n, r) for b, names in enumerate(excluded) for n, r in names.items())
    return MemoryReport("memory_optimize", level, batch_size, before, after, tuple(reused), (), skipped)


@dataclass(frozen=True)
class MemoryOptimize(Pass):
    """The ``memory_optimize`` rewrite as a pipeline pass over every main program of a ProgramSet.

    Needs: nothing from the context. Guarantees: those of the module docstring, per program."""

    name = "memory_optimize"
    skip_opt_set: frozenset[str] = frozenset()
    level: int = 0
    skip_grads: bool = False

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        changed = False
        for _, progs in programs.items():
            report = memory_optimize_program(progs.main, self.skip_opt_set, self.level, self.skip_grads)
            changed |= bool(report.reused)
        return changed
