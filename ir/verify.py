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
- across a ProgramSet (``cross_program_problems``, run by ``verify_program_set``): every ``send``
  (and every delta of a Geo-SGD ``geo_sync``) is received by the listen_and_serv of each endpoint of
  its ``epmap``; every trainable parameter
  the trainers exchange is optimized on exactly one pserver per slice; the slices of every variable
  the pservers hold tile it exactly once; every dense block on the wire fits ``MAX_MESSAGE_BYTES``.
  In a hybrid job (a trainer whose startup program joins a collective group, ``gen_nccl_id``, in a set
  with pservers): every dense gradient the trainer applies itself is allreduced (``c_allreduce_sum`` after
  its last other writer, then ``scale`` 1/nranks) before its optimizer reads it, and the gradient of
  every table the trainer prefetches is sent to every pserver it prefetches from.
  These checks read the recorded relations (``slice_of``/``slice_index``/``slice_offset``,
  ``copy_of``, op attributes), never variable names.

Invariants: the verifier never mutates the program, never raises on a malformed program (it reports),
and runs in time linear in the number of ops and arguments. Variable names are unique per block by
construction (a dict), so that is not checked.
"""
from __future__ import annotations

from ir.names import EMPTY_VAR_NAME

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ir.core import Block, Operator, Parameter, Program, Variable, block_refs, infer_op
from ir.errors import FlotillaError, RegistryError, VerifyError
from ir.ops.registry import (AttrKind, BlockRef, OpDef, attr_value_ok, check_attr_value, find_op_def, get_op_def,
                              suggest)
from ir.printer import format_op, format_var
from ir.program_set import ProgramSet
from ir.roles import ALL_ROLE_BITS, OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, is_valid_role, role_name

__all__ = [
    "Code", "MAX_MESSAGE_BYTES", "Problem", "VerifyCache", "collect_problems", "cross_program_problems",
    "format_context", "verify", "verify_program_set",
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
    # across the programs of a ProgramSet
    SEND_NO_PSERVER = "V501"
    SEND_NOT_RECEIVED = "V502"
    SEND_SHAPE = "V503"
    PSERVER_SERV = "V504"
    PARAM_NOT_OPTIMIZED = "V511"
    PARAM_OPTIMIZED_TWICE = "V512"
    SLICE_GAP = "V521"
    SLICE_OVERLAP = "V522"
    SLICE_SHAPE = "V523"
    SLICE_INDEX = "V524"
    MESSAGE_TOO_LARGE = "V531"
    DENSE_GRAD_NOT_REDUCED = "V541"
    TABLE_GRAD_NOT_SENT = "V542"


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


def _reads(op: Operator, chain: Sequence[Mapping[str, Variable]], read: tuple[Variable, ...]) -> bool:
    """Whether ``op``'s inputs, in slot order, are the variables ``read`` (the same values)."""
    k, own = 0, chain[0]
    for names in op._inputs.values():
        for name in names:
            if k >= len(read):
                return False
            var = own.get(name)
            if (var if var is not None else _find(chain, name)) is not read[k]:
                return False
            k += 1
    return k == len(read)


def _slots_ok(given: Mapping[str, list[str]], known: frozenset[str],
              rules: tuple[tuple[str, bool, bool], ...]) -> bool:
    """No unknown slot, every slot that is not dispensable given, one name in each slot that is not
    duplicable: what ``_ProgramChecker._check_slots`` would find nothing wrong with."""
    for slot_name in given:
        if slot_name not in known:
            return False
    for name, dispensable, duplicable in rules:
        names = given.get(name)
        if not names:
            if not dispensable:
                return False
        elif not duplicable and len(names) != 1:
            return False
    return True


def _where(pos: int, i: int, op: Operator) -> str:
    return f"block {pos}/op {i} ({op.type})"


def _find(chain: Sequence[Mapping[str, Variable]], name: str) -> Variable | None:
    """The variable ``name`` in the first of ``chain`` (a block's variables, then its ancestors') declaring it."""
    for declared in chain:
        var = declared.get(name)
        if var is not None:
            return var
    return None


def _receives_inputs(op_def: OpDef | None) -> bool:
    """A server op (rpc trait and block attributes, i.e. ``listen_and_serv``) is given its inputs by
    the trainers over the network rather than by an earlier op."""
    if op_def is None or not op_def.has_trait("rpc"):
        return False
    return bool(op_def._block_attrs)  # the attributes of kind block or blocks


# id(op) -> (op, the op's inputs whose read-before-write check depends on the ops before it), for every
# op in which a check found nothing wrong.
_CleanOps = dict[int, tuple[Operator, list[str]]]


@dataclass(frozen=True)
class _Seen:
    """What an earlier check of the same program (same blocks, same role) found clean, at ``version``."""

    version: int
    clean: _CleanOps


class _ProgramChecker:
    """Checks one program; problems accumulate in ``self.problems`` in block, then op, order.

    Given ``seen`` (an earlier check of this program with the same block structure and role), an op
    found clean then is not checked again when neither it (``Operator._changed_at``) nor any variable
    it names (``Program._vars_changed_since``) changed since: each of its checks would give the same
    answer, except read-before-write, which depends on the ops before it and is re-tested on the
    inputs it applies to. The problems are those a check from scratch finds, in the same order."""

    def __init__(self, program: Program, role: str | None, seen: _Seen | None = None, *,
                 trust_versions: bool = False) -> None:
        self.program = program
        # Whether the program changes only through the IR's methods (a VerifyCache's contract), so that
        # an op's recorded shape inference holds while the op and the variables it read are unchanged.
        self.trust_versions = trust_versions
        self.prefix = f"{role}/" if role else ""
        self.problems: list[Problem] = []
        self.seen = seen
        self.changed: set[str] = program._vars_changed_since(seen.version) if seen is not None else set()
        self.clean: _CleanOps = {}
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
            v = self.blocks[p]._vars.get(name)
            if v is not None:
                return v, p
        return None, -1

    # --- ops
    def check_block_ops(self, pos: int) -> None:
        block = self.blocks[pos]
        written: set[str] = set()
        reported: set[str] = set()
        chain = [self.blocks[p]._vars for p in self.chains[pos]]
        clean = self.clean
        seen = self.seen.clean if self.seen is not None else None
        for i, op in enumerate(block.ops):
            if seen is not None:
                entry = seen.get(id(op))
                if entry is not None and self._unchanged(op, entry, written, reported):
                    for names in op._outputs.values():
                        written.update(names)
                    clean[id(op)] = entry
                    continue
            op_def = find_op_def(op.type)
            rbw_inputs = self._clean(op, op_def, pos, chain, written, reported) if op_def is not None else None
            if rbw_inputs is not None:
                for names in op._outputs.values():
                    written.update(names)
                found = len(self.problems)
                if self.structure_ok[pos]:
                    self._check_shapes(op, pos, i, chain)
                if len(self.problems) == found:
                    clean[id(op)] = (op, rbw_inputs)
                continue
            where = _where(pos, i, op)
            loc = {"block": pos, "op": i}
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
                self._check_shapes(op, pos, i, chain)

    def _unchanged(self, op: Operator, entry: tuple[Operator, list[str]], written: set[str],
                   reported: set[str]) -> bool:
        """Whether ``op``, clean at the earlier check (``entry``), is clean now without checking it again."""
        seen, changed = self.seen, self.changed
        if entry[0] is not op or seen is None or op._changed_at > seen.version:
            return False
        if changed:
            for table in (op._inputs, op._outputs):
                for names in table.values():
                    if not changed.isdisjoint(names):
                        return False
            if not changed.isdisjoint(op._attrs.get(OP_ROLE_VAR_ATTR, ())):
                return False
        for name in entry[1]:
            if name not in written and name not in reported:
                return False
        return True

    def _clean(self, op: Operator, op_def: OpDef, pos: int, chain: list[Mapping[str, Variable]],
               written: set[str], reported: set[str]) -> list[str] | None:
        """The inputs of ``op`` that the read-before-write check applies to (declared in its block, not
        persistable, not fed, not received), when the slot, attribute, block reference, role and
        variable checks find nothing wrong with ``op`` (and leave ``reported`` as it is): the common
        case, decided without building any message. None sends the op through those checks, which say
        what is wrong."""
        ins, outs, attrs = op._inputs, op._outputs, op._attrs
        if not (_slots_ok(ins, op_def._input_names, op_def._input_rules)
                and _slots_ok(outs, op_def._output_names, op_def._output_rules)):
            return None
        if attrs.keys() != op_def._attr_map.keys():
            return None
        for name, kind, exact, fast_ok in op_def._attr_checks:
            value = attrs[name]
            if (type(value) in exact) if exact is not None else fast_ok(value):
                continue
            if not attr_value_ok(kind, value):
                return None
        # A well-formed op holds block references only in its block-kind attributes.
        for name in op_def._block_attrs:
            for ref in block_refs(attrs[name]):
                if not isinstance(ref, int) or not 0 < ref < len(self.blocks) or ref == pos \
                        or pos not in self.chains[ref]:
                    return None
        role = attrs.get(OP_ROLE_ATTR)
        if isinstance(role, int) and not is_valid_role(role):
            return None
        role_var = attrs.get(OP_ROLE_VAR_ATTR)
        if isinstance(role_var, (list, tuple)) and role_var:
            if len(role_var) % 2:
                return None
            own = chain[0]
            for name in role_var:
                if isinstance(name, str) and own.get(name) is None and _find(chain, name) is None:
                    return None
        received = "rpc" in op_def.traits and _receives_inputs(op_def)
        own = chain[0]
        rbw_inputs = []
        for names in ins.values():
            for name in names:
                var = own.get(name)
                if var is None:
                    if _find(chain, name) is None:
                        return None
                elif not (received or var.persistable or var.is_data):
                    if name not in written and name not in reported:
                        return None
                    rbw_inputs.append(name)
        for names in outs.values():
            for name in names:
                if name != EMPTY_VAR_NAME and own.get(name) is None and _find(chain, name) is None:
                    return None
        return rbw_inputs

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
        declared_map = op_def._attr_map
        for name in attrs:
            if name not in declared_map:
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
            if not isinstance(value, (BlockRef, list)):
                continue  # no block reference (what block_refs would find), without a call per attribute
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

    def _check_shapes(self, op: Operator, pos: int, i: int, chain: list[Mapping[str, Variable]]) -> None:
        inference = op._inference if self.trust_versions else None
        try:
            if inference is not None and op._changed_at <= inference.version and _reads(op, chain, inference.read):
                results = inference.results
            else:
                results = infer_op(op)
        except FlotillaError as err:
            self._add(Code.INFER_FAILED, _where(pos, i, op), f"shape inference failing: {err.message}",
                      "inputs that the op's shape inference accepts", err.hint, block=pos, op=i)
            return
        # Inference functions are per-op code; a bug in one must become a report naming the op,
        # not a crash of the verifier.
        except Exception as err:  # noqa: BLE001
            self._add(Code.INFER_FAILED, _where(pos, i, op), f"shape inference raising {type(err).__name__}: {err}",
                      "inputs that the op's shape inference accepts", "this is likely a bug in the op's "
                      "shape inference in ir/ops", block=pos, op=i)
            return
        if not results:
            return
        outputs, own = op._outputs, chain[0]
        for slot, infos in results.items():
            for name, info in zip(outputs.get(slot, ()), infos):
                var = own.get(name)
                if var is None:
                    var = _find(chain, name)
                if var is None or (var.shape == info.shape and var.dtype == info.dtype and var.type == info.type):
                    continue
                where, loc = _where(pos, i, op), {"block": pos, "op": i}
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


@dataclass(frozen=True)
class _Verified:
    program: Program
    structure: tuple[tuple[int, int, int], ...]
    role: str | None
    seen: _Seen
    problems: list[Problem]


class VerifyCache:
    """The problems of programs already verified, reused while a program is unchanged, and what was
    clean in them, re-checked only where it changed.

    A pipeline re-verifies every program of its set after each pass, but a pass changes a few of them,
    and those often only in part (a pass appends ops, renames some variables); checking what did not
    change again would find the same problems. ``Program.version`` grows on every change made through
    the IR's methods, each op records the version of its last change and the program the version of
    each variable's (see ``ir.core``); the block list, which readers of the text and protobuf forms
    build directly, is part of the key as well (a different one, or another role, means checking from
    scratch). For the same reason the shape check takes the inference ``Block.infer_op_shapes`` recorded
    on an op (``append_op`` runs it) while the op is unchanged and reads the same variables, instead of
    inferring again. Only for programs changed through those methods (a pipeline of passes), not for
    tests that edit private fields: ``collect_problems`` and ``verify`` take nothing on trust."""

    def __init__(self) -> None:
        self._entries: dict[int, _Verified] = {}

    def problems(self, program: Program, *, role: str | None = None) -> list[Problem]:
        """``collect_problems(program, role=role)``: from the cache when ``program`` is unchanged, checking
        only what changed when it was verified before."""
        structure = tuple((id(b), b.idx, b.parent_idx) for b in program.blocks)
        entry = self._entries.get(id(program))
        seen = None
        if entry is not None and entry.program is program and entry.structure == structure and entry.role == role:
            if entry.seen.version == program.version:
                return list(entry.problems)
            seen = entry.seen
        version = program.version
        checker = _ProgramChecker(program, role, seen, trust_versions=True)
        found = checker.run()
        self._entries[id(program)] = _Verified(program, structure, role, _Seen(version, checker.clean), list(found))
        return found


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


# --- cross-program checks (ProgramSet) -----------------------------------------------------------------

#: The largest message a gRPC channel carries: the length prefix of a gRPC message is a signed 32-bit
#: integer, so no message may exceed 2 GiB - 1 bytes. Every block that travels between a trainer and a
#: pserver (a gradient slice sent, a parameter slice fetched) must fit in one message.
MAX_MESSAGE_BYTES = 2**31 - 1

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
            "int32": 4, "int64": 8, "bool": 1}

_LISTED = 8  # names shown when a message lists what a program has


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    return f"[{shown}{', ...' if len(names) > _LISTED else ''}]"


def _numel(shape: Sequence[int]) -> int | None:
    """Elements of a fully known shape; None when a dimension is unknown (-1)."""
    n = 1
    for d in shape:
        if d < 0:
            return None
        n *= d
    return n


def _rows(var: Variable) -> int:
    return var.shape[0] if var.shape else 1


@dataclass
class _Pserver:
    """What the cross-program checks need of one pserver role."""

    role: str
    endpoint: str
    program: Program
    serv: Operator | None = None
    serv_index: int = -1
    # received name → the grad_to_block_id entry that applies it (per-trainer copies resolve to the
    # variable they are a copy of, through ``Variable.copy_of``)
    received: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class _Held:
    """A variable of a pserver that is (a slice of) ``origin``."""

    role: str
    endpoint: str
    block: int
    var: Variable
    op: int | None = None  # the optimizer op updating it, for optimized parameters


def _grad_entries(serv: Operator) -> list[str]:
    entries = serv.attrs.get("grad_to_block_id", [])
    names = []
    for entry in entries if isinstance(entries, (list, tuple)) else ():
        if isinstance(entry, str):
            name, sep, _ = entry.rpartition(":")
            if sep and name:
                names.append(name)
    return names


def _sent(op: Operator) -> list[tuple[str, str]]:
    """``(variable, endpoint)`` of everything a trainer op puts on the wire: a ``send``'s X (or
    ``send_varnames``); Geo-SGD's ``geo_sync``: each block's delta and each shard of the table's delta."""
    if op.type == "geo_sync":
        pairs = list(zip(op.attrs.get("delta_names") or [], op.attrs.get("epmap") or []))
        table_delta = op.attrs.get("table_delta_name")
        return pairs + [(table_delta, ep) for ep in op.attrs.get("table_epmap") or []] if table_delta else pairs
    return list(zip(op.attrs.get("send_varnames") or op.input("X"), op.attrs.get("epmap") or []))


class _SetChecker:
    """Checks a whole ProgramSet; problems accumulate as (program, role, Problem) in ``self.located``."""

    def __init__(self, program_set: ProgramSet) -> None:
        self.program_set = program_set
        self.located: list[tuple[Program, str | None, Problem]] = []
        self.trainers: list[tuple[str, Program, Program]] = []
        self.pservers: dict[str, _Pserver] = {}
        self.params: dict[str, tuple[str, Program, Variable]] = {}
        self.tables: set[str] = set()
        for progs in program_set.trainers():
            self.trainers.append((progs.role.key, progs.main, progs.startup))
        for progs in program_set.pservers():
            ep = progs.role.endpoint
            self.pservers[ep] = _Pserver(progs.role.key, ep, progs.main)

    def _add(self, program: Program, role: str, code: str, where: str, found: str, expected: str,
             hint: str | None, *, block: int | None = None, op: int | None = None, var: str | None = None) -> None:
        problem = Problem(where=f"{role}/{where}", found=found, expected=expected, hint=hint, code=code,
                          block=block, op=op, var=var)
        self.located.append((program, role, problem))

    # --- pservers: their listen_and_serv and what it receives
    def scan_pservers(self) -> None:
        for ps in self.pservers.values():
            block0 = ps.program.global_block()
            servs = [(i, op) for i, op in enumerate(block0.ops) if op.type == "listen_and_serv"]
            # None at all is reported by the sends that target this pserver (if any do).
            if len(servs) > 1:
                self._add(ps.program, ps.role, Code.PSERVER_SERV, f"block 0/op {servs[1][0]} (listen_and_serv)",
                          f"{len(servs)} listen_and_serv ops", "exactly one listen_and_serv op in block 0",
                          "a pserver program serves through one listen_and_serv op", block=0, op=servs[1][0])
            if not servs:
                continue
            ps.serv_index, ps.serv = servs[0]
            endpoint = ps.serv.attrs.get("endpoint")
            if endpoint != ps.endpoint:
                self._add(ps.program, ps.role, Code.PSERVER_SERV, f"block 0/op {ps.serv_index} (listen_and_serv)",
                          f"endpoint={endpoint!r}", f"endpoint={ps.endpoint!r} (the role's endpoint)",
                          "the role pserver@EP must listen on EP", block=0, op=ps.serv_index)
            grads = _grad_entries(ps.serv)
            ps.received = {g: g for g in grads}
            wanted = set(grads)
            for block in ps.program.blocks:
                for name, var in block.vars.items():
                    if var.copy_of is not None and var.copy_of in wanted and name not in ps.received:
                        ps.received[name] = var.copy_of

    # --- every send is received on each endpoint of its epmap
    def check_sends(self) -> None:
        for role, main, _ in self.trainers:
            for block in main.blocks:
                for i, op in enumerate(block.ops):
                    if op.type in ("send", "geo_sync"):
                        self._check_send(role, main, block, i, op)

    def _check_send(self, role: str, main: Program, block: Block, i: int, op: Operator) -> None:
        where = f"block {block.idx}/op {i} ({op.type})"
        loc = {"block": block.idx, "op": i}
        for name, ep in _sent(op):
            ps = self.pservers.get(ep)
            if ps is None:
                self._add(main, role, Code.SEND_NO_PSERVER, where, f"{name!r} sent to {ep!r}, which has no pserver "
                          "program in the set", f"one of the pserver endpoints {_listing(list(self.pservers))}",
                          "every endpoint of a send's epmap needs a pserver@EP role", **loc)
                continue
            if ps.serv is None:
                self._add(main, role, Code.SEND_NOT_RECEIVED, where,
                          f"{name!r} sent to {ep}, whose program has no listen_and_serv op",
                          f"a listen_and_serv op in block 0 of {ps.role} receiving it",
                          "a pserver program serves through one listen_and_serv op", **loc)
                continue
            if name not in ps.received:
                sent = block.find_var_recursive(name)
                what = repr(name) if sent is None or sent.copy_of is None else \
                    f"{name!r} (a copy of {sent.copy_of!r})"
                self._add(main, role, Code.SEND_NOT_RECEIVED, where,
                          f"{what} sent to {ep}, whose listen_and_serv does not receive it "
                          f"(grad_to_block_id names {_listing(_grad_entries(ps.serv))})",
                          f"a grad_to_block_id entry on {ps.role} for it (or for the variable it is a copy of)",
                          "the pserver lacks the optimize block for this gradient, or the send's epmap points "
                          "at the wrong endpoint", **loc)
                continue
            self._check_sent_shape(role, main, block, i, op, name, ps)

    def _check_sent_shape(self, role: str, main: Program, block: Block, i: int, op: Operator, name: str,
                          ps: _Pserver) -> None:
        sent = block.find_var_recursive(name)
        held = ps.program.global_block().vars.get(name)
        if held is None:
            held = ps.program.global_block().vars.get(ps.received[name])
        if sent is None or held is None or sent.type == "raw":
            return
        if not _shapes_agree(sent.shape, held.shape) or sent.dtype != held.dtype:
            self._add(main, role, Code.SEND_SHAPE, f"block {block.idx}/op {i} ({op.type})",
                      f"{name!r} sent as {sent.dtype}{_fmt_shape(sent.shape)}",
                      f"{held.dtype}{_fmt_shape(held.shape)}, as {ps.role} declares {held.name!r}",
                      "the trainer's slice and the pserver's block must have the same rows", block=block.idx, op=i)

    # --- every trainable parameter optimized exactly once per slice; slices tile their variable
    def _distributed_params(self) -> tuple[dict[str, tuple[str, Program, Variable]], set[str]]:
        """Trainable parameters the trainers exchange with the pservers (named by a send's ``op_role_var``
        or fetched by a recv, possibly as slices), each with a trainer that declares it; and the names of
        distributed lookup tables and their gradients (sharded by id, not tiled by rows)."""
        params: dict[str, tuple[str, Program, Variable]] = {}
        tables: set[str] = set()
        for role, main, _ in self.trainers:
            gblock = main.global_block()

            def consider(name: str) -> None:
                var = gblock.find_var_recursive(name)
                if var is not None and var.slice_of is not None:
                    name, var = var.slice_of, gblock.find_var_recursive(var.slice_of)
                if isinstance(var, Parameter) and var.trainable and name not in params:
                    params[name] = (role, main, var)

            distributed = {name for name, var in gblock.vars.items()
                           if isinstance(var, Parameter) and var.is_distributed}
            for block in main.blocks:
                for op in block.ops:
                    if op.type == "send":
                        for name in op.role_var[0::2]:
                            consider(name)
                    elif op.type == "recv":
                        for name in list(op.attrs.get("recv_varnames") or op.output("Out")):
                            consider(name)
                    if distributed:  # a table's gradient is named beside it, by the ops working on both
                        role_var = op.role_var
                        for p, g in zip(role_var[0::2], role_var[1::2]):
                            if p in distributed:
                                tables.update((p, g))
            tables |= distributed
        return params, tables

    def _optimized(self) -> dict[str, list[_Held]]:
        """Per original parameter name, every (slice) variable an optimizer op updates on a pserver."""
        out: dict[str, list[_Held]] = {}
        for ps in self.pservers.values():
            for block in ps.program.blocks:
                for i, op in enumerate(block.ops):
                    op_def = find_op_def(op.type)
                    if op_def is None or not op_def.has_trait("optimizer"):
                        continue
                    for name in op.input("Param"):
                        var = block.find_var_recursive(name)
                        if var is None:
                            continue  # an undeclared variable, reported by the per-program checks
                        origin = var.slice_of if var.slice_of is not None else var.name
                        out.setdefault(origin, []).append(_Held(ps.role, ps.endpoint, block.idx, var, i))
        return out

    def _declared_blocks(self) -> dict[str, dict[str, list[_Held]]]:
        """Per original variable, per block name, the pservers whose block 0 declares that block:
        variables with ``slice_of`` set, or a variable held whole under its own name; per-trainer
        copies excluded. (Built once: one pass over every pserver's variables.)"""
        out: dict[str, dict[str, list[_Held]]] = {}
        for ps in self.pservers.values():
            for name, var in ps.program.global_block().vars.items():
                if var.copy_of is None:
                    origin = var.slice_of if var.slice_of is not None else name
                    out.setdefault(origin, {}).setdefault(name, []).append(_Held(ps.role, ps.endpoint, 0, var))
        return out

    def check_params(self) -> None:
        params, tables = self.params, self.tables
        optimized = self._optimized()
        declared_all = self._declared_blocks()
        for name, (role, main, param) in params.items():
            held = optimized.get(name, [])
            declared = declared_all.get(name, {})
            if not held and not declared:
                self._add(main, role, Code.PARAM_NOT_OPTIMIZED, "block 0",
                          f"trainable parameter {name!r} held and optimized on no pserver",
                          f"an optimize block for (each slice of) {name!r} on exactly one pserver",
                          "every parameter the trainer sends gradients for, or receives, must be updated "
                          "by some pserver", block=0, var=name)
                continue
            # A distributed table has one shard per pserver, each under the table's name.
            per_role = name in tables
            by_slice: dict[tuple[str, str], list[_Held]] = {}
            for h in held:
                by_slice.setdefault((h.role if per_role else "", h.var.name), []).append(h)
            for slice_name, where_declared in declared.items():
                for d in where_declared:
                    key = (d.role if per_role else "", slice_name)
                    if key not in by_slice:
                        by_slice[key] = []
                        self._add(self.pservers[d.endpoint].program, d.role, Code.PARAM_NOT_OPTIMIZED, "block 0",
                                  f"{slice_name!r} (of parameter {name!r}) held but updated by no optimizer op",
                                  f"one optimize block on {d.role} updating {slice_name!r}",
                                  "the pserver lost the optimize block of this slice, or holds a slice it "
                                  "should not", block=0, var=slice_name)
            for (_, slice_name), where_held in by_slice.items():
                if len(where_held) > 1:
                    first, second = where_held[0], where_held[1]
                    places = ", ".join(f"{h.role} block {h.block}" for h in where_held)
                    self._add(self.pservers[second.endpoint].program, second.role, Code.PARAM_OPTIMIZED_TWICE,
                              f"block {second.block}/op {second.op} (optimizer)",
                              f"{slice_name!r} (of parameter {name!r}) optimized {len(where_held)} times: {places}",
                              "exactly one optimizer op per parameter slice, on one pserver",
                              f"remove the extra optimize block; {first.role} already updates it",
                              block=second.block, op=second.op)

    def check_tiling(self) -> None:
        """The slices of every sliced variable held by the pservers (params, grads, accumulators)
        tile it along dim 0 exactly once."""
        tables = self.tables
        pieces: dict[str, list[_Held]] = {}
        for ps in self.pservers.values():
            for name, var in ps.program.global_block().vars.items():
                if var.copy_of is not None:
                    continue  # a trainer's copy of a block is not a block of its own
                if var.slice_of is not None:
                    pieces.setdefault(var.slice_of, []).append(_Held(ps.role, ps.endpoint, 0, var))
        # A variable held whole (its own name, no slice) is one block covering all of it.
        for origin in list(pieces):
            for ps in self.pservers.values():
                whole = ps.program.global_block().vars.get(origin)
                if whole is not None and whole.slice_of is None and whole.copy_of is None:
                    pieces[origin].append(_Held(ps.role, ps.endpoint, 0, whole))
        for origin, held in pieces.items():
            if origin not in tables:
                self._tile(origin, held)

    def _full_var(self, origin: str) -> Variable | None:
        for _, main, _ in self.trainers:
            var = main.global_block().vars.get(origin)
            if var is not None:
                return var
        return None

    def _tile(self, origin: str, held: list[_Held]) -> None:
        full = self._full_var(origin)
        spans: list[tuple[int, int, _Held]] = []
        for h in held:
            var = h.var
            program = self.pservers[h.endpoint].program
            is_slice = var.slice_of is not None
            if is_slice and (var.slice_offset is None or var.slice_index is None):
                self._add(program, h.role, Code.SLICE_SHAPE, "block 0", f"slice {var.name!r} of {origin!r} with "
                          f"slice_index={var.slice_index!r}, slice_offset={var.slice_offset!r}",
                          "both slice_index and slice_offset recorded on a slice",
                          "create slices through the slicing pass, which records the relation", block=0,
                          var=var.name)
                continue
            if full is not None and (tuple(var.shape[1:]) != tuple(full.shape[1:]) or var.dtype != full.dtype
                                     or len(var.shape) != len(full.shape)):
                self._add(program, h.role, Code.SLICE_SHAPE, "block 0",
                          f"{'slice' if is_slice else 'block'} {var.name!r} of {origin!r} shaped "
                          f"{var.dtype}{_fmt_shape(var.shape)}",
                          f"{full.dtype}[rows{''.join(', ' + str(d) for d in full.shape[1:])}] "
                          f"(rows of {origin!r}, {full.dtype}{_fmt_shape(full.shape)})",
                          "a slice splits dim 0 only and keeps the other dimensions and the dtype",
                          block=0, var=var.name)
                continue
            spans.append((var.slice_offset if is_slice else 0, _rows(var), h))
        spans.sort(key=lambda s: (s[0], s[2].var.slice_index or 0, s[2].role))
        covered = 0
        prev: _Held | None = None
        for index, (offset, rows, h) in enumerate(spans):
            program = self.pservers[h.endpoint].program
            label = f"{h.var.name!r} rows [{offset}, {offset + rows})"
            if offset > covered:
                self._add(program, h.role, Code.SLICE_GAP, "block 0",
                          f"{label}: rows [{covered}, {offset}) of {origin!r} are in no slice",
                          f"the next slice of {origin!r} to start at row {covered}",
                          "slices must tile the variable: each starts where the previous ends", block=0,
                          var=h.var.name)
            elif offset < covered and prev is not None:
                self._add(program, h.role, Code.SLICE_OVERLAP, "block 0",
                          f"{label} on {h.role} overlaps {prev.var.name!r} on {prev.role} "
                          f"(rows [{offset}, {min(covered, offset + rows)}) of {origin!r} held twice)",
                          f"the next slice of {origin!r} to start at row {covered}",
                          "each row of a variable lives in exactly one slice on exactly one pserver", block=0,
                          var=h.var.name)
            if h.var.slice_of is not None and h.var.slice_index != index and offset >= covered:
                self._add(program, h.role, Code.SLICE_INDEX, "block 0",
                          f"slice {h.var.name!r} of {origin!r} with slice_index {h.var.slice_index}",
                          f"slice_index {index} (its position by offset)",
                          "slice indices number the slices in row order from 0", block=0, var=h.var.name)
            covered = max(covered, offset + rows)
            prev = h
        if full is not None and full.shape and full.shape[0] >= 0 and spans and covered != full.shape[0]:
            last = spans[-1][2]
            program = self.pservers[last.endpoint].program
            if covered < full.shape[0]:
                found = f"rows [{covered}, {full.shape[0]}) of {origin!r} are in no slice"
            else:
                found = f"slices of {origin!r} covering {covered} rows"
            self._add(program, last.role, Code.SLICE_GAP if covered < full.shape[0] else Code.SLICE_OVERLAP,
                      "block 0", found, f"slices covering exactly the {full.shape[0]} rows of {origin!r}",
                      "slices must tile the variable: the last one ends at its last row", block=0, var=last.var.name)

    # --- message sizes
    def check_message_sizes(self) -> None:
        seen: set[tuple[str, str]] = set()
        for role, main, startup in self.trainers:
            for program in (main, startup):
                for block in program.blocks:
                    for i, op in enumerate(block.ops):
                        if op.type == "send":
                            names = list(op.attrs.get("send_varnames") or op.input("X"))
                        elif op.type == "recv":
                            names = list(op.attrs.get("recv_varnames") or op.output("Out"))
                        else:
                            continue
                        for name in names:
                            var = block.find_var_recursive(name)
                            if var is not None and (role, name) not in seen:
                                seen.add((role, name))
                                self._check_size(program, role, var, f"block {block.idx}/op {i} ({op.type})",
                                                 block.idx, i)
        for ps in self.pservers.values():
            for name, var in ps.program.global_block().vars.items():
                if (var.slice_of is not None or name in ps.received) and (ps.role, name) not in seen:
                    seen.add((ps.role, name))
                    self._check_size(ps.program, ps.role, var, "block 0", 0, None)

    def _check_size(self, program: Program, role: str, var: Variable, where: str, block: int, op: int | None) -> None:
        # selected_rows messages carry only the rows a batch touched; their size is known at run time.
        if var.type != "lod_tensor":
            return
        numel = _numel(var.shape)
        if numel is None:
            return
        size = numel * ITEMSIZE.get(var.dtype, 8)
        if size > MAX_MESSAGE_BYTES:
            self._add(program, role, Code.MESSAGE_TOO_LARGE, where,
                      f"{var.name!r} ({var.dtype}{_fmt_shape(var.shape)}) of {size} bytes",
                      f"at most {MAX_MESSAGE_BYTES} bytes (the gRPC message limit)",
                      "use more pservers or keep slicing on (slice_var_up=True) so that every block fits one "
                      "message", block=block, op=op, var=var.name if op is None else None)

    # --- hybrid jobs: dense gradients allreduced, table gradients sent
    def check_hybrid(self) -> None:
        if not self.pservers:
            return
        for role, main, startup in self.trainers:
            if any(op.type == "gen_nccl_id" for op in startup.global_block().ops):
                block = main.global_block()
                self._check_dense_reduced(role, main, block)
                self._check_table_grads_sent(role, main, block)

    def _check_dense_reduced(self, role: str, main: Program, block: Block) -> None:
        """Every trainable parameter an optimizer op of ``block`` updates (its gradient named by the op's
        ``op_role_var``) has its gradient summed by a ``c_allreduce_sum`` placed after every other op that
        writes it, then scaled by 1/nranks, before that optimizer op, or exchanged by a ``dgc_allreduce`` (DGC's mean)
        after which nothing writes it."""
        ops = block.ops
        for i, op in enumerate(ops):
            op_def = find_op_def(op.type)
            if op_def is None or not op_def.has_trait("optimizer") or op_def.has_trait("collective"):
                continue
            rv = op.role_var
            param, grad = (rv[0], rv[1]) if len(rv) >= 2 else ((op.input("Param") or [""])[0],
                                                                (op.input("Grad") or [""])[0])
            var = block.find_var_recursive(param)
            if not isinstance(var, Parameter) or not var.trainable or not grad:
                continue
            problem = _reduction_problem(ops[:i], grad)
            if problem is not None:
                self._add(main, role, Code.DENSE_GRAD_NOT_REDUCED, f"block {block.idx}/op {i} ({op.type})",
                          f"gradient {grad!r} of {param!r} {problem}",
                          f"a c_allreduce_sum of {grad!r} after its last writer, then scale 1/nranks, before "
                          "the optimizer reads it (every trainer of a hybrid job applies the same mean gradient)",
                          "transpile with config.mode = 'hybrid' (grad_allreduce reduces every dense gradient); "
                          "a parameter updated without it drifts apart on each trainer", block=block.idx, op=i)

    def _check_table_grads_sent(self, role: str, main: Program, block: Block) -> None:
        """Every table ``block`` prefetches has its gradient sent (a ``send`` whose ``op_role_var`` names the
        table) to each endpoint it prefetches from."""
        sent_to: dict[str, set[str]] = {}
        for op in block.ops:
            if op.type == "send" and op.role_var:
                sent_to.setdefault(op.role_var[0], set()).update(op.attrs.get("epmap") or [])
        for i, op in enumerate(block.ops):
            if op.type != "prefetch":
                continue
            for table in dict.fromkeys(op.attrs.get("table_names") or []):
                missing = [ep for ep in dict.fromkeys(op.attrs.get("epmap") or []) if ep not in sent_to.get(table, ())]
                if missing:
                    self._add(main, role, Code.TABLE_GRAD_NOT_SENT, f"block {block.idx}/op {i} (prefetch)",
                              f"table {table!r} prefetched from {_listing(missing)}, but no send carries its "
                              "gradient there", f"a send (op_role_var naming {table!r}) of the gradient's shard "
                              "to every pserver the table is prefetched from",
                              "the distributed_table pass sends each shard of the table's gradient to its "
                              "pserver; without it the table never trains", block=block.idx, op=i)

    def run(self) -> list[tuple[Program, str | None, Problem]]:
        self.params, self.tables = self._distributed_params()
        self.scan_pservers()
        self.check_sends()
        self.check_params()
        self.check_tiling()
        self.check_message_sizes()
        self.check_hybrid()
        return self.located


def _reduction_problem(before: Sequence[Operator], grad: str) -> str | None:
    """What is wrong with how ``grad`` is reduced by the ops ``before`` its optimizer, in words; None if it
    is allreduced after its last other writer and then scaled by 1/nranks."""
    reduce_at, nranks = -1, 0
    for k, op in enumerate(before):
        if op.type == "c_allreduce_sum" and grad in op.input("X"):
            reduce_at, nranks = k, int(op.attrs.get("nranks", 0) or 0)
        if op.type == "dgc_allreduce" and grad in op.input("Grad"):
            reduce_at = k  # DGC's exchange averages itself (ir.ops.dgc); nothing may write the mean after it
    if reduce_at < 0:
        return "is never allreduced among the trainers"
    if before[reduce_at].type == "dgc_allreduce":
        later = [k for k in range(reduce_at + 1, len(before)) if grad in before[k].output_arg_names]
        return f"is written by op {later[0]} ({before[later[0]].type}) after its dgc_allreduce" if later else None
    averaged = False
    for k, op in enumerate(before):
        if grad not in op.output_arg_names or k == reduce_at:
            continue
        in_place_scale = op.type == "scale" and op.input("X") == [grad]
        if k < reduce_at and not in_place_scale:
            continue
        if k > reduce_at and in_place_scale:
            factor = float(op.attrs.get("scale", 1.0))
            averaged = averaged or (nranks > 0 and abs(factor * nranks - 1.0) < 1e-9)
            continue
        if k > reduce_at:
            return f"is written by op {k} ({op.type}) after its c_allreduce_sum (op {reduce_at})"
    if not averaged:
        return (f"is summed by its c_allreduce_sum (op {reduce_at}) but never scaled by 1/{nranks or 'nranks'}: "
                "the update would apply the sum of the trainers' gradients")
    return None


def _cross_located(program_set: ProgramSet) -> list[tuple[Program, str | None, Problem]]:
    return _SetChecker(program_set).run()


def cross_program_problems(program_set: ProgramSet) -> list[Problem]:
    """Problems that only show across the programs of a ProgramSet (roles ``trainer.<id>`` and
    ``pserver@<endpoint>``):

    - every ``send`` of a trainer has, on each endpoint of its ``epmap``, a pserver program whose
      ``listen_and_serv`` receives the variable: its ``grad_to_block_id`` names it, or names the variable
      it is a per-trainer copy of (``Variable.copy_of`` on the pserver's variable); shapes agree;
    - every trainable parameter a trainer exchanges with the pservers (named by a send's
      ``op_role_var`` or fetched by a recv) is updated by an optimizer op on some pserver, and each of
      its slices by exactly one;
    - the slices of each variable the pservers hold (``Variable.slice_of``/``slice_index``/
      ``slice_offset``; a variable held whole is one block) tile it along dim 0 exactly once: no gap,
      no overlap, dims 1.. and dtype as the trainer declares the variable, indices in row order.
      Distributed lookup tables are sharded by id, not by rows, and are not tiled;
    - every dense block that travels (sent, fetched, held as a slice or a received gradient) fits
      ``MAX_MESSAGE_BYTES``;
    - hybrid jobs (a trainer whose startup program has ``gen_nccl_id``, in a set with pservers): every
      trainable parameter the trainer updates itself has its gradient (``op_role_var``) allreduced by a
      ``c_allreduce_sum`` after its last other writer and scaled by 1/nranks before the update (V541), and
      every table the trainer prefetches has its gradient sent to each endpoint it prefetches from (V542).
    """
    return [p for _, _, p in _cross_located(program_set)]


def verify_program_set(program_set: ProgramSet, *, cache: VerifyCache | None = None) -> None:
    """Verify each role's main program (``where`` prefixed ``ROLE/``) and startup program
    (``ROLE/startup/``), then the cross-program checks; raise ``VerifyError`` listing every problem,
    with an IR window around the first located one (per-program problems first). ``cache`` reuses
    the per-program results of programs unchanged since it last verified them."""
    cache = cache if cache is not None else VerifyCache()
    located: list[tuple[Program, str | None, Problem]] = []
    for role, progs in program_set.items():
        for prefix, program in ((role, progs.main), (f"{role}/startup", progs.startup)):
            located += [(program, prefix, p) for p in cache.problems(program, role=prefix)]
    located += _cross_located(program_set)
    if located:
        _raise(located, [p for _, _, p in located])
