"""The IR verifier: finds every structural problem of a Program (or of each program of a ProgramSet).

``collect_problems`` returns a list of ``Problem`` values; ``verify`` raises ``VerifyError`` listing
every one of them, with a window of the canonical text form around the first bad op, marked ``>>``.

Checks, each with its own stable ``code`` (see ``Code``):
- blocks: ``idx`` equals the block's position; block 0 has parent -1, every other block a parent
  before it;
- ops: the type is registered; slots are declared, non-dispensable slots are present and non-empty,
  non-duplicable slots hold one variable; attributes are declared, present and of their declared kind;
  block references point to a proper descendant block of the op's block (never block 0);
  ``op_role`` is a combination of known role bits and ``op_role_var`` lists [param, grad] pairs of
  variables;
- variables: every variable an op reads or writes is declared in its block or an ancestor; within a
  block, a variable declared in that block and read before any op of the block writes it must be
  persistable or fed (``is_data``). Variables of ancestor blocks are defined by the enclosing
  program (a pserver's optimize blocks read the gradients its block 0 receives), and an op that both
  serves sub-blocks and talks over RPC (``listen_and_serv``) receives its inputs from the network;
- shapes: the declared shape, dtype and variable type of each output agree with the op's shape
  inference (``ir.core.infer_op``; -1 matches any extent); an inference that raises is a problem.

Invariants: the verifier never mutates the program, never raises on a malformed program (it reports),
and runs in time linear in the number of ops and arguments. Variable names are unique per block by
construction (a dict), so that is not checked.
"""
from __future__ import annotations

from ir.names import EMPTY_VAR_NAME

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ir.core import Block, Operator, Program, Variable, block_refs, infer_op
from ir.errors import FlotillaError, RegistryError, VerifyError
from ir.ops.registry import AttrKind, OpDef, check_attr_value, find_op_def, get_op_def, suggest
from ir.printer import format_op, format_var
from ir.program_set import ProgramSet
from ir.roles import ALL_ROLE_BITS, OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, is_valid_role, role_name

__all__ = [
    "Code", "Problem", "collect_problems", "cross_program_problems", "format_context", "verify",
    "verify_program_set",
]


class Code:
    """Stable problem codes, one per check (tools and tests match on these)."""

    BLOCK_INDEX = "V101"
    BLOCK_PARENT = "V102"
    UNKNOWN_OP = "V201"
    UNKNOWN_SLOT = "V202"
    MISSING_SLOT = "V203"
    SLOT_ARITY = "V204"
    UNKNOWN_ATTR = "V211"
    MISSING_ATTR = "V212"
    ATTR_KIND = "V213"
    BLOCK_REF = "V214"
    OP_ROLE = "V221"
    OP_ROLE_VAR = "V222"
    UNDECLARED_VAR = "V301"
    READ_BEFORE_WRITE = "V302"
    SHAPE_MISMATCH = "V401"
    DTYPE_MISMATCH = "V402"
    VAR_TYPE_MISMATCH = "V403"
    INFER_FAILED = "V404"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a program: where, what was found, what was expected, how to fix it.

    ``block`` (the block's position), ``op`` (the op's index in it) and ``var`` locate the problem for
    the context window; ``where`` is the same location in words, e.g. ``trainer.0/block 0/op 12 (send)``.
    """

    where: str
    found: str
    expected: str
    hint: str | None
    code: str
    block: int | None = None
    op: int | None = None
    var: str | None = None

    def __str__(self) -> str:
        text = f"{self.where}: found {self.found}, expected {self.expected}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text


def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _shapes_agree(declared: Sequence[int], inferred: Sequence[int]) -> bool:
    if len(declared) != len(inferred):
        return False
    return all(a == b or a < 0 or b < 0 for a, b in zip(declared, inferred))


def _receives_inputs(op_def: OpDef | None) -> bool:
    """A server op (rpc trait and block attributes, i.e. ``listen_and_serv``) is given its inputs by
    the trainers over the network rather than by an earlier op."""
    if op_def is None or not op_def.has_trait("rpc"):
        return False
    return any(a.kind in (AttrKind.BLOCK, AttrKind.BLOCKS) for a in op_def.attrs)


class _ProgramChecker:
    """Checks one program; problems accumulate in ``self.problems`` in block, then op, order."""

    def __init__(self, program: Program, role: str | None) -> None:
        self.program = program
        self.prefix = f"{role}/" if role else ""
        self.problems: list[Problem] = []
        self.blocks: list[Block] = list(program.blocks)
        # chains[i]: block positions from block i up to the root, following valid parents only.
        self.chains: list[tuple[int, ...]] = []
        # structure_ok[i]: every block on chains[i] has a valid idx and parent (core lookups are safe).
        self.structure_ok: list[bool] = []

    # --- reporting
    def _add(self, code: str, where: str, found: str, expected: str, hint: str | None = None, *,
             block: int | None = None, op: int | None = None, var: str | None = None) -> None:
        self.problems.append(Problem(where=self.prefix + where, found=found, expected=expected, hint=hint,
                                     code=code, block=block, op=op, var=var))

    # --- blocks
    def check_blocks(self) -> None:
        n = len(self.blocks)
        for pos, block in enumerate(self.blocks):
            ok = True
            if block.idx != pos:
                ok = False
                self._add(Code.BLOCK_INDEX, f"block {pos}", f"idx {block.idx}", f"idx {pos} (its position)",
                          "blocks are numbered by position; create them with Program.create_block", block=pos)
            parent = block.parent_idx
            if pos == 0:
                valid_parent = parent == -1
                expected = "parent -1 (block 0 is the global block)"
            else:
                valid_parent = isinstance(parent, int) and 0 <= parent < pos
                expected = f"a parent in 0..{pos - 1} (a block before it)"
            if not valid_parent:
                ok = False
                self._add(Code.BLOCK_PARENT, f"block {pos}", f"parent {parent!r} (program has {n} blocks)",
                          expected, "sub-blocks are created after their parent", block=pos)
            if pos > 0 and valid_parent:
                self.chains.append((pos,) + self.chains[parent])
                self.structure_ok.append(ok and self.structure_ok[parent])
            else:
                self.chains.append((pos,))
                self.structure_ok.append(ok)

    def _lookup(self, pos: int, name: str) -> tuple[Variable | None, int]:
        """The variable ``name`` seen from block ``pos`` and the position of the block declaring it."""
        for p in self.chains[pos]:
            v = self.blocks[p].vars.get(name)
            if v is not None:
                return v, p
        return None, -1

    # --- ops
    def check_block_ops(self, pos: int) -> None:
        block = self.blocks[pos]
        written: set[str] = set()
        reported: set[str] = set()
        for i, op in enumerate(block.ops):
            where = f"block {pos}/op {i} ({op.type})"
            loc = {"block": pos, "op": i}
            op_def = find_op_def(op.type)
            well_formed = True
            if op_def is None:
                well_formed = False
                try:
                    get_op_def(op.type)
                    hint = None
                except RegistryError as err:
                    hint = err.hint
                self._add(Code.UNKNOWN_OP, where, f"unknown op type {op.type!r}", "a registered op type", hint, **loc)
            else:
                well_formed &= self._check_slots(op, op_def, where, loc)
                well_formed &= self._check_attrs(op, op_def, where, loc)
            self._check_block_refs(op, pos, where, loc)
            self._check_roles(op, pos, where, loc)
            declared = self._check_vars(op, op_def, pos, where, loc, written, reported)
            if op_def is not None and well_formed and declared and self.structure_ok[pos]:
                self._check_shapes(op, pos, where, loc)

    def _check_slots(self, op: Operator, op_def: OpDef, where: str, loc: Mapping[str, int]) -> bool:
        ok = True
        for kind, given, slots in (("input", op.inputs, op_def.inputs), ("output", op.outputs, op_def.outputs)):
            known = [s.name for s in slots]
            for slot_name in given:
                if slot_name not in known:
                    ok = False
                    self._add(Code.UNKNOWN_SLOT, where, f"{kind} slot {slot_name!r}",
                              f"one of the {kind} slots {known}", suggest(slot_name, known), **loc)
            for slot in slots:
                names = given.get(slot.name)
                if not names:
                    if not slot.dispensable:
                        ok = False
                        self._add(Code.MISSING_SLOT, where,
                                  f"{kind} slot {slot.name!r} {'empty' if names is not None else 'missing'}",
                                  f"at least one variable in {kind} slot {slot.name!r}",
                                  "the slot is not dispensable; give it a variable", **loc)
                elif not slot.duplicable and len(names) != 1:
                    ok = False
                    self._add(Code.SLOT_ARITY, where, f"{len(names)} variables in {kind} slot {slot.name!r}",
                              f"exactly one variable (slot {slot.name!r} is not duplicable)",
                              "use one op per variable, or a duplicable slot", **loc)
        return ok

    def _check_attrs(self, op: Operator, op_def: OpDef, where: str, loc: Mapping[str, int]) -> bool:
        ok = True
        attrs = op.attrs
        for name in attrs:
            if op_def.attr_def(name) is None:
                ok = False
                declared = [a.name for a in op_def.attrs]
                self._add(Code.UNKNOWN_ATTR, where, f"attribute {name!r}", f"one of {op.type}'s attributes",
                          suggest(name, declared) or f"declared: {declared}", **loc)
        for ad in op_def.attrs:
            if ad.name not in attrs:
                ok = False
                self._add(Code.MISSING_ATTR, where, f"no attribute {ad.name!r}",
                          f"attribute {ad.name!r} of kind {ad.kind.value}" + (f" ({ad.doc})" if ad.doc else ""),
                          "append ops through Block.append_op, which fills in defaults", **loc)
                continue
            value = attrs[ad.name]
            problem = check_attr_value(ad.kind, value)
            if problem:
                ok = False
                self._add(Code.ATTR_KIND, where, f"attribute {ad.name}={value!r} ({problem})",
                          f"a value of kind {ad.kind.value}", ad.doc or None, **loc)
        return ok

    def _check_block_refs(self, op: Operator, pos: int, where: str, loc: Mapping[str, int]) -> None:
        n = len(self.blocks)
        for name, value in op.attrs.items():
            for ref in block_refs(value):
                if not isinstance(ref, int) or not 0 < ref < n:
                    self._add(Code.BLOCK_REF, where, f"attribute {name} refers to block {ref!r}",
                              f"an existing sub-block (1..{n - 1})",
                              "block 0 is the global block and never a sub-block", **loc)
                elif ref == pos or pos not in self.chains[ref]:
                    self._add(Code.BLOCK_REF, where,
                              f"attribute {name} refers to block {ref} (parent chain {list(self.chains[ref])})",
                              f"a descendant of block {pos}, the op's block",
                              "create the sub-block with the op's block as its parent", **loc)

    def _check_roles(self, op: Operator, pos: int, where: str, loc: Mapping[str, int]) -> None:
        role = op.attrs.get(OP_ROLE_ATTR)
        if isinstance(role, int) and not isinstance(role, bool) and not is_valid_role(role):
            self._add(Code.OP_ROLE, where, f"op_role {role} (unknown bits {role & ~ALL_ROLE_BITS:#x})"
                      if role >= 0 else f"op_role {role}",
                      f"a combination of the role bits {ALL_ROLE_BITS:#x} (forward, backward, optimize, rpc, "
                      "dist, lrsched, collective, loss)", "use ir.roles.OpRole values", **loc)
        role_var = op.attrs.get(OP_ROLE_VAR_ATTR)
        if isinstance(role_var, (list, tuple)):
            if len(role_var) % 2:
                self._add(Code.OP_ROLE_VAR, where, f"op_role_var with {len(role_var)} names {list(role_var)}",
                          "[param, grad] pairs (an even number of names)",
                          f"op_role={role_name(role) if isinstance(role, int) else role!r}", **loc)
            for name in role_var:
                if isinstance(name, str) and self._lookup(pos, name)[0] is None:
                    self._add(Code.OP_ROLE_VAR, where, f"op_role_var names {name!r}, which is not declared",
                              f"variables declared in block {pos} or its parents",
                              suggest(name, self.blocks[pos].vars), **loc)

    def _check_vars(self, op: Operator, op_def: OpDef | None, pos: int, where: str, loc: Mapping[str, int],
                    written: set[str], reported: set[str]) -> bool:
        """Declaration and read-before-write checks; True when every argument is declared."""
        all_declared = True
        received = _receives_inputs(op_def)
        seen: set[tuple[str, str]] = set()
        for kind, table in (("input", op.inputs), ("output", op.outputs)):
            for slot, names in table.items():
                for name in names:
                    if kind == "output" and name == EMPTY_VAR_NAME:
                        continue  # Fluid's placeholder for a gradient nobody needs
                    var, owner = self._lookup(pos, name)
                    if var is None:
                        all_declared = False
                        if (kind, name) not in seen:
                            seen.add((kind, name))
                            self._add(Code.UNDECLARED_VAR, where,
                                      f"{kind} {slot}={name!r}, not declared in block {pos} or its parents",
                                      "a declared variable", suggest(name, self.blocks[pos].vars)
                                      or "create it with Block.create_var", **loc)
                        continue
                    if kind == "output":
                        continue
                    if (owner != pos or received or var.persistable or var.is_data or name in written
                            or name in reported):
                        continue
                    reported.add(name)
                    self._add(Code.READ_BEFORE_WRITE, where,
                              f"input {slot}={name!r} read before any op of block {pos} writes it",
                              "a persistable or fed (is_data) variable, a variable of an ancestor block, "
                              "or one written by an earlier op",
                              "insert the op that computes it before this op, or mark it is_data if it is fed",
                              **loc)
        for names in op.outputs.values():
            written.update(names)
        return all_declared

    def _check_shapes(self, op: Operator, pos: int, where: str, loc: Mapping[str, int]) -> None:
        try:
            results = infer_op(op)
        except FlotillaError as err:
            self._add(Code.INFER_FAILED, where, f"shape inference failing: {err.message}",
                      "inputs that the op's shape inference accepts", err.hint, **loc)
            return
        # Inference functions are per-op code; a bug in one must become a report naming the op,
        # not a crash of the verifier.
        except Exception as err:  # noqa: BLE001
            self._add(Code.INFER_FAILED, where, f"shape inference raising {type(err).__name__}: {err}",
                      "inputs that the op's shape inference accepts", "this is likely a bug in the op's "
                      "shape inference in ir/ops", **loc)
            return
        if not results:
            return
        for slot, infos in results.items():
            for name, info in zip(op.outputs.get(slot, ()), infos):
                var, _ = self._lookup(pos, name)
                if var is None:
                    continue
                if not _shapes_agree(var.shape, info.shape):
                    self._add(Code.SHAPE_MISMATCH, where,
                              f"output {slot}={name!r} declared with shape {_fmt_shape(var.shape)}",
                              f"shape {_fmt_shape(info.shape)} (from {op.type} shape inference; -1 matches any)",
                              "fix the inputs, or the declared shape (Block.infer_op_shapes recomputes "
                              "non-persistable outputs)", **loc)
                if var.dtype != info.dtype:
                    self._add(Code.DTYPE_MISMATCH, where, f"output {slot}={name!r} declared with dtype {var.dtype}",
                              f"dtype {info.dtype} (from {op.type} shape inference)",
                              "cast the inputs, or fix the declared dtype", **loc)
                if var.type != info.type:
                    self._add(Code.VAR_TYPE_MISMATCH, where, f"output {slot}={name!r} declared as {var.type}",
                              f"{info.type} (from {op.type} shape inference)",
                              "fix the variable's type (e.g. selected_rows for sparse gradients)", **loc)

    def run(self) -> list[Problem]:
        self.check_blocks()
        for pos in range(len(self.blocks)):
            self.check_block_ops(pos)
        return self.problems


def collect_problems(program: Program, *, role: str | None = None) -> list[Problem]:
    """Every problem of ``program``, in block then op order; ``role`` prefixes each ``where``."""
    return _ProgramChecker(program, role).run()


def _window(items: Sequence[Any], fmt: Any, center: int, radius: int) -> tuple[list[str], int, int]:
    lo, hi = max(0, center - radius), min(len(items), center + radius + 1)
    return [fmt(items[k]) for k in range(lo, hi)], lo, hi


def format_context(program: Program, problem: Problem, *, radius: int = 3, role: str | None = None) -> str:
    """A window of ``program``'s text form around the problem's op (or variable, or block header),
    the offending line marked ``>>`` in the margin. Empty when the problem has no block location."""
    if problem.block is None or not 0 <= problem.block < len(program.blocks):
        return ""
    block = program.blocks[problem.block]
    mark, plain = ">> ", "   "
    title = f"in {role + ' ' if role else ''}block {problem.block}:"
    lines = [title]
    # The same header line as ir.printer.format_block.
    header = f"block {block.idx}" + (f" parent {block.parent_idx}" if block.parent_idx >= 0 else "") + " {"
    if problem.op is not None and 0 <= problem.op < len(block.ops):
        ops = block.ops
        texts, lo, hi = _window(ops, format_op, problem.op, radius)
        lines.append(plain + header)
        elided = ([f"{len(block.vars)} vars"] if block.vars else []) + ([f"{lo} ops"] if lo else [])
        if elided:
            lines.append(plain + f"  ... ({', '.join(elided)})")
        lines += [(mark if lo + k == problem.op else plain) + "  " + t for k, t in enumerate(texts)]
        if hi < len(ops):
            lines.append(plain + f"  ... ({len(ops) - hi} ops)")
        lines.append(plain + "}")
    elif problem.var is not None and problem.var in block.vars:
        names = list(block.vars)
        center = names.index(problem.var)
        texts, lo, hi = _window(names, lambda n: format_var(block.vars[n]), center, radius)
        lines.append(plain + header)
        if lo > 0:
            lines.append(plain + f"  ... ({lo} vars)")
        lines += [(mark if lo + k == center else plain) + "  " + t for k, t in enumerate(texts)]
        lines.append(plain + f"  ... ({len(names) - hi} vars, {len(block.ops)} ops)")
        lines.append(plain + "}")
    else:
        lines.append(mark + header)
        lines.append(plain + f"  ... ({len(block.vars)} vars, {len(block.ops)} ops)")
        lines.append(plain + "}")
    return "\n".join(lines)


def _first_located(problems: Iterable[tuple[Program, str | None, Problem]]) -> tuple[Program, str | None, Problem] | None:
    """The first problem at an op, else the first at any block location."""
    fallback = None
    for item in problems:
        if item[2].op is not None:
            return item
        if fallback is None and item[2].block is not None:
            fallback = item
    return fallback


def _raise(located: list[tuple[Program, str | None, Problem]], problems: list[Problem]) -> None:
    first = _first_located(located)
    context = format_context(first[0], first[2], role=first[1]) if first is not None else None
    raise VerifyError(problems, context=context or None)


def verify(program: Program, *, role: str | None = None) -> None:
    """Raise ``VerifyError`` listing every problem of ``program`` (with an IR window around the first
    bad op); return None when there is none."""
    problems = collect_problems(program, role=role)
    if problems:
        _raise([(program, role, p) for p in problems], problems)


def cross_program_problems(program_set: ProgramSet) -> list[Problem]:
    """Problems that only show across the programs of a ProgramSet: every ``send`` has a receiving
    block on its endpoint, every trainable parameter is optimized on exactly one pserver, the slices
    of each parameter tile it exactly once, and every message fits the gRPC message size limit.

    TODO(#4): implement these checks; until then there are none.
    """
    return []


def verify_program_set(program_set: ProgramSet) -> None:
    """Verify each role's main program (``where`` prefixed ``ROLE/``) and startup program
    (``ROLE/startup/``), then the cross-program checks; raise ``VerifyError`` listing every problem."""
    located: list[tuple[Program, str | None, Problem]] = []
    for role, progs in program_set.items():
        for prefix, program in ((role, progs.main), (f"{role}/startup", progs.startup)):
            located += [(program, prefix, p) for p in collect_problems(program, role=prefix)]
    problems = [p for _, _, p in located] + cross_program_problems(program_set)
    if problems:
        _raise(located, problems)
