"""The data model: Program, Block, Operator, Variable and Parameter (Fluid's ProgramDesc).

Invariants:
- Variables are frozen values; a Block replaces them (``replace_var``) rather than editing them.
- Operators and Blocks change only through their methods, and every change bumps the owning
  Program's ``version`` (analyses cache on it). Each op also records the version of its own last
  change, and the program the version at which each variable name was last declared, replaced or
  removed, so that a verifier that has seen the program before re-checks only what changed since;
  ``Block.infer_op_shapes`` records the inference on the op (with the variables it read), for the
  same verifier to reuse while neither changed (``clone`` keeps it).
- Ops name variables through slots (slot → list of names); ops of registered types have their slots
  in schema order and every declared attribute present (defaults filled in), so printing is canonical.
- Nothing here parses names: relations such as "slice of" or "trainer copy of" are fields.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

from ir.errors import IRError
from ir.names import EMPTY_VAR_NAME
from ir.ops.registry import (
    BlockRef,
    InferContext,
    VarInfo,
    VAR_TYPES,
    DTYPES,
    attr_value_ok,
    check_attr_value,
    find_op_def,
    normalize_attr_value,
    suggest,
    REQUIRED,
)
from ir.roles import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR


@dataclass(frozen=True)
class Variable:
    """A named tensor slot of a Block. ``shape`` uses -1 for the batch dimension."""

    name: str
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    type: str = "lod_tensor"
    persistable: bool = False
    stop_gradient: bool = False
    is_data: bool = False
    # Relations recorded by the passes that create derived variables (never parsed from names).
    slice_of: str | None = None
    slice_index: int | None = None
    slice_offset: int | None = None  # first row (dim 0) of the slice in the original variable
    copy_of: str | None = None
    trainer_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise IRError(f"variable name must be a non-empty string, got {self.name!r}")
        shape = self.shape
        if type(shape) is not tuple or not all(type(d) is int for d in shape):
            object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if self.dtype not in DTYPES:
            raise IRError(f"variable {self.name!r}: unknown dtype {self.dtype!r}", hint=suggest(self.dtype, DTYPES))
        if self.type not in VAR_TYPES:
            raise IRError(f"variable {self.name!r}: unknown type {self.type!r}", hint=f"one of {list(VAR_TYPES)}")

    @property
    def is_parameter(self) -> bool:
        return False

    def replace(self, **changes: Any) -> "Variable":
        return _replaced(self, changes)


@dataclass(frozen=True)
class Parameter(Variable):
    """A trainable, persistable Variable, with the attributes the optimizer reads."""

    persistable: bool = True
    trainable: bool = True
    learning_rate: float = 1.0  # Fluid's optimize_attr['learning_rate'], a multiplier
    regularizer: str | None = None  # canonical spec, e.g. "L2Decay(0.001)"
    gradient_clip: str | None = None  # canonical spec, e.g. "GradientClipByValue(-1.0, 1.0)"
    is_distributed: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "learning_rate", float(self.learning_rate))

    @property
    def is_parameter(self) -> bool:
        return True


_FIELDS: dict[type, frozenset[str]] = {cls: frozenset(f.name for f in dataclasses.fields(cls))
                                       for cls in (Variable, Parameter)}


def _replaced(var: Variable, changes: Mapping[str, Any]) -> Variable:
    """``dataclasses.replace(var, **changes)``, validated by ``__post_init__`` the same way, without the
    generic field-by-field rebuild (passes replace tens of thousands of variables)."""
    fields = _FIELDS.get(type(var))
    if fields is None or not fields.issuperset(changes):
        return dataclasses.replace(var, **changes)  # a subclass, or an unknown field (which it refuses)
    new = object.__new__(type(var))
    state = new.__dict__
    state.update(var.__dict__)
    state.update(changes)
    new.__post_init__()
    return new


VarLike = "str | Variable"


def _name_of(v: Any) -> str:
    if isinstance(v, Variable):
        return v.name
    if isinstance(v, str):
        return v
    raise IRError(f"expected a variable or variable name, got {type(v).__name__} {v!r}")


def _names(arg: Any) -> list[str]:
    if arg is None:
        return []
    if isinstance(arg, (list, tuple)):
        return [v if type(v) is str else _name_of(v) for v in arg]
    return [_name_of(arg)]


class Operator:
    """One op: ``type``, slot → variable names for inputs and outputs, and typed ``attrs``."""

    __slots__ = ("block", "type", "_inputs", "_outputs", "_attrs", "_changed_at", "_inference")

    def __init__(self, block: "Block", type: str, inputs: dict[str, list[str]],
                 outputs: dict[str, list[str]], attrs: dict[str, Any]) -> None:
        self.block = block
        self.type = type
        self._inputs = inputs
        self._outputs = outputs
        self._attrs = attrs
        self._changed_at = block.program._version  # the program's version after this op's last change
        self._inference: _Inference | None = None  # its last shape inference by Block.infer_op_shapes

    # --- reading
    @property
    def inputs(self) -> Mapping[str, list[str]]:
        return self._inputs

    @property
    def outputs(self) -> Mapping[str, list[str]]:
        return self._outputs

    @property
    def attrs(self) -> Mapping[str, Any]:
        return self._attrs

    def input(self, slot: str) -> list[str]:
        return list(self._inputs.get(slot, ()))

    def output(self, slot: str) -> list[str]:
        return list(self._outputs.get(slot, ()))

    @property
    def input_arg_names(self) -> list[str]:
        return [n for names in self._inputs.values() for n in names]

    @property
    def output_arg_names(self) -> list[str]:
        return [n for names in self._outputs.values() for n in names]

    def has_attr(self, name: str) -> bool:
        return name in self._attrs

    def attr(self, name: str, default: Any = REQUIRED) -> Any:
        if name in self._attrs:
            return self._attrs[name]
        if default is not REQUIRED:
            return default
        raise IRError(f"op {self.type!r} has no attribute {name!r}", hint=suggest(name, self._attrs))

    @property
    def role(self) -> int:
        return int(self._attrs.get(OP_ROLE_ATTR, 0))

    @property
    def role_var(self) -> list[str]:
        return list(self._attrs.get(OP_ROLE_VAR_ATTR, []))

    @property
    def idx(self) -> int:
        """Position of this op in its block."""
        return self.block.op_index(self)

    # --- mutation (bumps the program version)
    def set_attr(self, name: str, value: Any) -> None:
        op_def = find_op_def(self.type)
        if op_def is not None:
            ad = op_def.attr_def(name)
            if ad is None:
                raise IRError(f"op {self.type!r} has no attribute {name!r}",
                              hint=suggest(name, [a.name for a in op_def.attrs]))
            problem = check_attr_value(ad.kind, value)
            if problem:
                raise IRError(f"op {self.type!r} attribute {name!r}: {problem}")
            value = normalize_attr_value(ad.kind, value)
        self._attrs[name] = value
        self._touch()

    def set_input(self, slot: str, names: Any) -> None:
        self._inputs[slot] = _names(names)
        self._touch()

    def set_output(self, slot: str, names: Any) -> None:
        self._outputs[slot] = _names(names)
        self._touch()

    def rename_input(self, old: str, new: str) -> None:
        for slot, names in self._inputs.items():
            self._inputs[slot] = [new if n == old else n for n in names]
        self._touch()

    def rename_output(self, old: str, new: str) -> None:
        for slot, names in self._outputs.items():
            self._outputs[slot] = [new if n == old else n for n in names]
        self._touch()

    def _touch(self) -> None:
        self.block._touch()
        self._changed_at = self.block.program._version

    def _rename_many(self, mapping: Mapping[str, str]) -> bool:
        """Rename without touching (the calling Block method does); True when something was renamed."""
        changed = False
        renamed = mapping.keys()
        for table in (self._inputs, self._outputs):
            for slot, names in table.items():
                if not renamed.isdisjoint(names):
                    table[slot] = [mapping.get(n, n) for n in names]
                    changed = True
        rv = self._attrs.get(OP_ROLE_VAR_ATTR)
        if rv and not renamed.isdisjoint(rv):
            self._attrs[OP_ROLE_VAR_ATTR] = [mapping.get(n, n) for n in rv]
            changed = True
        return changed

    def to_string(self) -> str:
        from ir.printer import format_op

        return format_op(self)

    def __repr__(self) -> str:
        return self.to_string()


class Block:
    """An ordered set of variables (name → Variable) and a list of ops; ``parent_idx`` is -1 for block 0."""

    def __init__(self, program: "Program", idx: int, parent_idx: int = -1) -> None:
        self.program = program
        self.idx = idx
        self.parent_idx = parent_idx
        self._vars: dict[str, Variable] = {}
        self._ops: list[Operator] = []
        self._ops_snapshot: tuple[Operator, ...] | None = None

    def _touch(self) -> None:
        self._ops_snapshot = None
        self.program._version += 1

    def _touch_vars(self, names: Iterable[str]) -> None:
        """``_touch``, recording that the variables ``names`` were declared, replaced or removed."""
        self._touch()
        self.program._note_var_changes(names)

    def _touch_ops(self, ops: Iterable[Operator]) -> None:
        """``_touch``, recording that ``ops`` changed."""
        self._touch()
        version = self.program._version
        for op in ops:
            op._changed_at = version

    # --- variables
    @property
    def vars(self) -> Mapping[str, Variable]:
        return self._vars

    @property
    def ops(self) -> Sequence[Operator]:
        """An immutable snapshot of the ops, cached until the block changes (so indexing in a loop is O(1))."""
        if self._ops_snapshot is None:
            self._ops_snapshot = tuple(self._ops)
        return self._ops_snapshot

    @property
    def parent(self) -> "Block | None":
        return self.program.block(self.parent_idx) if self.parent_idx >= 0 else None

    def has_var(self, name: str) -> bool:
        return name in self._vars

    def var(self, name: str) -> Variable:
        try:
            return self._vars[name]
        except KeyError:
            raise IRError(f"block {self.idx} has no variable {name!r}", hint=suggest(name, self._vars)) from None

    def find_var_recursive(self, name: str) -> Variable | None:
        """The variable named ``name`` in this block or the nearest ancestor that has it."""
        v = self._vars.get(name)
        if v is not None or self.parent_idx < 0:
            return v
        program, idx = self.program, self.parent_idx
        blocks = program.blocks
        while idx >= 0:
            block = blocks[idx] if type(idx) is int and idx < len(blocks) else program.block(idx)
            v = block._vars.get(name)
            if v is not None:
                return v
            idx = block.parent_idx
        return None

    def var_recursive(self, name: str) -> Variable:
        v = self.find_var_recursive(name)
        if v is None:
            raise IRError(f"variable {name!r} is not defined in block {self.idx} or its parents",
                          hint=suggest(name, self._vars))
        return v

    def add_var(self, var: Variable) -> Variable:
        """Add a Variable value; its name must be new in this block."""
        if var.name in self._vars:
            raise IRError(f"block {self.idx} already has a variable named {var.name!r}",
                          hint="use replace_var to change it, or pick another name (ir.unique_name)")
        self._vars[var.name] = var
        self._touch_vars((var.name,))
        return var

    def create_var(self, name: str | None = None, shape: Sequence[int] = (), dtype: str = "float32",
                   type: str = "lod_tensor", **fields: Any) -> Variable:
        """Create a Variable (a fresh ``tmp`` name when ``name`` is None). Creating an existing
        name returns the existing variable if it is identical, as Fluid's create_var does."""
        if name is None:
            from ir.names import unique_name

            name = unique_name("tmp")
        var = Variable(name=name, shape=tuple(shape), dtype=dtype, type=type, **fields)
        existing = self._vars.get(name)
        if existing is not None and existing == var:
            return existing
        return self.add_var(var)

    def create_parameter(self, name: str, shape: Sequence[int], dtype: str = "float32", **fields: Any) -> Parameter:
        param = Parameter(name=name, shape=tuple(shape), dtype=dtype, **fields)
        self.add_var(param)
        return param

    def replace_var(self, name: str, **changes: Any) -> Variable:
        """Replace variable ``name`` by a copy with ``changes`` (its position is kept)."""
        new = _replaced(self.var(name), changes)
        if new.name != name:
            raise IRError("replace_var cannot change a name", hint="use rename_var")
        self._vars[name] = new
        self._touch_vars((name,))
        return new

    def set_var(self, var: Variable) -> Variable:
        """Put ``var`` in place of the variable of the same name, or add it."""
        self._vars[var.name] = var
        self._touch_vars((var.name,))
        return var

    def remove_var(self, name: str) -> None:
        self.var(name)
        del self._vars[name]
        self._touch_vars((name,))

    def rename_var(self, old: str, new: str) -> Variable:
        """Rename a variable of this block and every use of it in this block and its sub-blocks
        (slots and ``op_role_var``)."""
        self.rename_vars({old: new})
        return self._vars[new]

    def rename_vars(self, mapping: Mapping[str, str]) -> None:
        """Rename several variables of this block at once (one pass over the ops), with every use of
        them in this block and its sub-blocks; a sub-block's own variable of the same name shadows it."""
        for old, new in mapping.items():
            self.var(old)
            if new in self._vars and new not in mapping:
                raise IRError(f"cannot rename {old!r} to {new!r}: block {self.idx} already has {new!r}")
        if not mapping:
            return
        self._vars = {mapping.get(k, k): _replaced(v, {"name": mapping[k]}) if k in mapping else v
                      for k, v in self._vars.items()}
        self._touch_vars([*mapping, *mapping.values()])
        self._touch_ops(self._rename_uses(mapping))

    def _rename_uses(self, mapping: Mapping[str, str]) -> list[Operator]:
        """Rename the uses of this block's variables in it and its sub-blocks (where a sub-block's own
        variable of the same name does not shadow them); return the ops that changed."""
        changed = []
        for block in self.program.blocks:
            if block is self or self._is_ancestor_of(block):
                local = {o: n for o, n in mapping.items() if block is self or o not in block._vars}
                changed += [op for op in block._ops if op._rename_many(local)]
        return changed

    def reuse_vars(self, mapping: Mapping[str, str], shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        """Memory reuse: make every use of each variable ``old`` of ``mapping`` (slots and ``op_role_var``, in
        this block and its sub-blocks where not shadowed) use the existing variable ``mapping[old]`` instead,
        and remove ``old`` (one pass over the ops). Both must be variables of this block with the same
        dtype and type, and no target may itself be renamed; ``shapes`` re-declares targets (same rank),
        e.g. with the extents that differ unknown (-1). The caller guarantees that the lifetimes of the
        variables sharing a name do not overlap. Nothing changes when an argument is refused."""
        shapes = dict(shapes or {})
        for old, into in mapping.items():
            a, b = self.var(old), self.var(into)
            if old == into or into in mapping:
                raise IRError(f"cannot reuse {into!r} for {old!r}: " + ("a variable for itself" if old == into
                                                                        else f"{into!r} is renamed too"))
            if (a.dtype, a.type) != (b.dtype, b.type):
                raise IRError(f"cannot reuse {into!r} ({b.type} {b.dtype}) for {old!r} ({a.type} {a.dtype})",
                              hint="only a variable of the same dtype and type can share a buffer")
        for into, shape in shapes.items():
            if len(tuple(shape)) != len(self.var(into).shape):
                raise IRError(f"cannot re-declare {into!r} of rank {len(self.var(into).shape)} "
                              f"with shape {list(shape)}")
        if not mapping and not shapes:
            return
        for into, shape in shapes.items():
            self._vars[into] = _replaced(self._vars[into], {"shape": tuple(shape)})
        changed = self._rename_uses(mapping)
        for old in mapping:
            del self._vars[old]
        self._touch_vars([*mapping, *shapes])
        self._touch_ops(changed)

    def _is_ancestor_of(self, block: "Block") -> bool:
        p = block.parent
        while p is not None:
            if p is self:
                return True
            p = p.parent
        return False

    # --- ops
    def op_index(self, op: Operator) -> int:
        for i, o in enumerate(self._ops):
            if o is op:
                return i
        raise IRError(f"op {op.type!r} is not in block {self.idx}")

    def _make_op(self, type: str, inputs: Mapping[str, Any] | None, outputs: Mapping[str, Any] | None,
                 attrs: Mapping[str, Any] | None, check: bool) -> Operator:
        ins = {slot: _names(v) for slot, v in (inputs or {}).items()}
        outs = {slot: _names(v) for slot, v in (outputs or {}).items()}
        op_def = find_op_def(type)
        if op_def is not None and check:
            ins = _order_slots(type, "input", ins, op_def.inputs, op_def._input_names)
            outs = _order_slots(type, "output", outs, op_def.outputs, op_def._output_names)
            full = _valid_attrs(op_def, attrs or {})
            if full is not None:
                return Operator(self, type, ins, outs, full)
            at = dict(attrs or {})  # something is wrong with them: say what, below
            full = {}
            for ad in op_def.attrs:
                if ad.name in at:
                    value = at.pop(ad.name)
                    if not attr_value_ok(ad.kind, value):
                        raise IRError(f"op {type!r} attribute {ad.name!r}: {check_attr_value(ad.kind, value)}")
                elif ad.default is not REQUIRED:
                    value = ad.default  # checked when the op type was registered
                else:
                    raise IRError(f"op {type!r} needs attribute {ad.name!r} ({ad.doc or ad.kind.value})")
                full[ad.name] = normalize_attr_value(ad.kind, value)
            if at:
                bad = next(iter(at))
                raise IRError(f"op {type!r} has no attribute {bad!r}", hint=suggest(bad, [a.name for a in op_def.attrs]))
            at = {name: full[name] for name in op_def._sorted_attr_names}  # stored sorted by name
        else:
            at = dict(attrs or {})
            if check:
                from ir.ops.registry import get_op_def

                get_op_def(type)  # raises with a close match
        return Operator(self, type, ins, outs, at)

    def append_op(self, type: str, inputs: Mapping[str, Any] | None = None, outputs: Mapping[str, Any] | None = None,
                  attrs: Mapping[str, Any] | None = None, *, infer_shape: bool = True) -> Operator:
        """Append an op of a registered type; outputs' shapes and dtypes are inferred (as Fluid does)
        unless ``infer_shape`` is false. Persistable outputs keep their declared shape."""
        return self.insert_op(len(self._ops), type, inputs, outputs, attrs, infer_shape=infer_shape)

    def insert_op(self, index: int, type: str, inputs: Mapping[str, Any] | None = None,
                  outputs: Mapping[str, Any] | None = None, attrs: Mapping[str, Any] | None = None, *,
                  infer_shape: bool = True) -> Operator:
        if not 0 <= index <= len(self._ops):
            raise IRError(f"insert_op index {index} out of range for block {self.idx} with {len(self._ops)} ops")
        op = self._make_op(type, inputs, outputs, attrs, check=True)
        self._ops.insert(index, op)
        self._touch_ops((op,))
        if infer_shape:
            try:
                self.infer_op_shapes(op)
            except BaseException:
                self._ops.remove(op)  # a refused op leaves the block as it was
                self._touch()
                raise
        return op

    def _append_raw_op(self, type: str, inputs: dict[str, list[str]], outputs: dict[str, list[str]],
                       attrs: dict[str, Any]) -> Operator:
        """Append an op exactly as given, unchecked (for readers of the text and protobuf forms;
        the verifier reports what is wrong with it)."""
        op = Operator(self, type, inputs, outputs, attrs)
        self._ops.append(op)
        self._touch_ops((op,))
        return op

    def remove_op(self, index_or_op: int | Operator) -> None:
        index = index_or_op if isinstance(index_or_op, int) else self.op_index(index_or_op)
        if not 0 <= index < len(self._ops):
            raise IRError(f"remove_op index {index} out of range for block {self.idx} with {len(self._ops)} ops")
        del self._ops[index]
        self._touch()

    def infer_op_shapes(self, op: Operator) -> None:
        """Run ``op``'s shape inference and record the results on its non-persistable outputs (and on the
        op, for a verifier that trusts ``Operator._changed_at``: see ``ir.verify.VerifyCache``)."""
        inference = _inferred(op)
        op._inference = inference
        results = inference.results
        if results is None:
            return
        for slot, infos in results.items():
            for name, info in zip(op.output(slot), infos):
                if name == EMPTY_VAR_NAME:
                    continue
                owner = self._owner_of(name)
                if owner is None:
                    raise IRError(f"op {op.type!r} output {slot}={name!r} is not a variable of block {self.idx}"
                                  " or its parents", hint="create the variable (block.create_var) before the op")
                var = owner._vars[name]
                if var.persistable:
                    continue
                if (var.shape, var.dtype, var.type) != (info.shape, info.dtype, info.type):
                    owner._vars[name] = _replaced(var, {"shape": info.shape, "dtype": info.dtype, "type": info.type})
                    owner._touch_vars((name,))

    def _owner_of(self, name: str) -> "Block | None":
        if name in self._vars:
            return self
        block: Block | None = self.parent
        while block is not None:
            if name in block._vars:
                return block
            block = block.parent
        return None

    def __repr__(self) -> str:
        return f"<Block {self.idx} parent={self.parent_idx} vars={len(self._vars)} ops={len(self._ops)}>"


def _valid_attrs(op_def: Any, given: Mapping[str, Any]) -> dict[str, Any] | None:
    """Every attribute of an op of ``op_def``'s type as stored (sorted by name, defaults filled in,
    values normalized) when ``given`` names only declared attributes, each with a valid value, and
    every required one; None otherwise (``Block._make_op`` then says what is wrong)."""
    specs = op_def._attr_specs
    full = op_def._attr_defaults.copy()
    for name, value in given.items():
        spec = specs.get(name)
        if spec is None:
            return None
        kind, fast_ok, normalize = spec
        if not fast_ok(value) and not attr_value_ok(kind, value):
            return None
        full[name] = value if normalize is None else normalize(value)
    for name in op_def._required_attrs:
        if name not in given:
            return None
    for name in op_def._list_defaults:
        if name not in given:
            full[name] = list(full[name])  # each op its own list
    return full


def _order_slots(op_type: str, kind: str, given: dict[str, list[str]], slots: Sequence[Any],
                 known: frozenset[str]) -> dict[str, list[str]]:
    for slot in given:
        if slot not in known:
            raise IRError(f"op {op_type!r} has no {kind} slot {slot!r}", hint=suggest(slot, known) or f"slots: {sorted(known)}")
    if len(given) <= 1:
        return given  # in schema order already
    return {s.name: given[s.name] for s in slots if s.name in given}


def infer_op(op: Operator) -> dict[str, list[VarInfo]] | None:
    """Shape inference for ``op`` against its block's variables; None if the op declares none."""
    return _inferred(op).results


class _Inference(NamedTuple):
    """What shape inference of an op gave (``results``), from which input variables (``read``, in slot
    order), at which program version: while the op is unchanged since (``Operator._changed_at``) and its
    inputs are the same Variable values, inferring again gives the same results."""

    version: int
    read: tuple[Variable, ...]
    results: dict[str, list[VarInfo]] | None


def _inferred(op: Operator) -> _Inference:
    op_def = find_op_def(op.type)
    block = op.block
    if op_def is None or op_def.infer is None:
        return _Inference(block.program._version, (), None)
    own = block._vars
    inputs = {}
    read = []
    for slot, names in op._inputs.items():
        infos = []
        for n in names:
            var = own.get(n)
            if var is None:
                var = block.find_var_recursive(n)
                if var is None:
                    var = block.var_recursive(n)  # raises, naming the variable
            read.append(var)
            infos.append(_info(var.shape, var.dtype, var.type))
        inputs[slot] = infos
    ctx = InferContext(op.type, inputs, op._attrs, {slot: len(names) for slot, names in op._outputs.items()})
    op_def.infer(ctx)
    return _Inference(block.program._version, tuple(read), ctx.outputs)


@functools.lru_cache(maxsize=4096)
def _info(shape: tuple[int, ...], dtype: str, type: str) -> VarInfo:
    """VarInfos are frozen values, so one per (shape, dtype, type) serves every variable that has it."""
    return VarInfo(shape, dtype, type)


class Program:
    """A list of Blocks; block 0 is the global block. ``version`` increases on every mutation.

    ``superseded_by`` (None by default, never copied by ``clone``): set by ``DistributeTranspiler.transpile``
    on a program handed to it that it did not rewrite in place, naming the result to run instead
    (``"the result of DistributeTranspiler.get_trainer_program()"``). A distributed trainer that ran this
    program would train alone, unseen by the job, so ``runtime.Executor`` refuses it there and says what
    to run; a later in-place transpile of the same program clears it."""

    def __init__(self) -> None:
        self.blocks: list[Block] = [Block(self, 0, -1)]
        self.random_seed: int = 0
        self.superseded_by: str | None = None
        self._version = 0
        self._current_block_idx = 0
        # variable name -> the version after its last change (in any block), oldest change first
        self._var_changes: dict[str, int] = {}

    @property
    def version(self) -> int:
        return self._version

    def _note_var_changes(self, names: Iterable[str]) -> None:
        changes, version = self._var_changes, self._version
        for name in names:
            changes.pop(name, None)  # re-inserted last: the dict stays ordered by version
            changes[name] = version

    def _vars_changed_since(self, version: int) -> set[str]:
        """The variable names declared, replaced or removed (in any block) after ``version``."""
        changed = set()
        for name, at in reversed(self._var_changes.items()):
            if at <= version:
                break
            changed.add(name)
        return changed

    def global_block(self) -> Block:
        return self.blocks[0]

    def block(self, idx: int) -> Block:
        if not isinstance(idx, int) or not 0 <= idx < len(self.blocks):
            raise IRError(f"program has no block {idx!r} (it has {len(self.blocks)} blocks, 0..{len(self.blocks) - 1})")
        return self.blocks[idx]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def current_block(self) -> Block:
        return self.blocks[self._current_block_idx]

    def create_block(self, parent_idx: int | None = None) -> Block:
        """A new block whose parent is ``parent_idx`` (the current block by default); it becomes current."""
        parent = self._current_block_idx if parent_idx is None else parent_idx
        self.block(parent)
        block = Block(self, len(self.blocks), parent)
        self.blocks.append(block)
        self._current_block_idx = block.idx
        self._version += 1
        return block

    def rollback(self) -> None:
        """Make the current block's parent current again (after building a sub-block)."""
        self._current_block_idx = max(self.current_block().parent_idx, 0)

    def list_vars(self) -> Iterator[Variable]:
        for block in self.blocks:
            yield from block.vars.values()

    def all_parameters(self) -> list[Parameter]:
        return [v for v in self.global_block().vars.values() if isinstance(v, Parameter)]

    def clone(self, for_test: bool = False) -> "Program":
        """A deep copy (variables are immutable values and are shared). ``for_test`` keeps only
        forward ops and sets ``is_test`` on those that have it (batch norm, dropout), as Fluid's
        ``clone(for_test=True)`` does."""
        new = Program()
        new.random_seed = self.random_seed
        new.blocks = []
        for b in self.blocks:
            nb = Block(new, b.idx, b.parent_idx)
            nb._vars = dict(b._vars)
            nb._ops = [
                Operator(nb, op.type, {k: list(v) for k, v in op._inputs.items()},
                         {k: list(v) for k, v in op._outputs.items()}, _copy_attrs(op._attrs, for_test))
                for op in b._ops
                if not for_test or op.role in (0, 256)
            ]
            if not for_test:  # the same ops reading the same variables: their inferences still hold
                for op, copied in zip(b._ops, nb._ops):
                    inference = op._inference
                    if inference is not None and op._changed_at <= inference.version:
                        copied._inference = _Inference(new._version, inference.read, inference.results)
            new.blocks.append(nb)
        return new

    def to_string(self) -> str:
        from ir.printer import format_program

        return format_program(self)

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        return f"<Program blocks={len(self.blocks)} version={self._version}>"


def _copy_attrs(attrs: Mapping[str, Any], for_test: bool = False) -> dict[str, Any]:
    out = {k: list(v) if isinstance(v, list) else v for k, v in attrs.items()}
    if for_test and "is_test" in out:
        out["is_test"] = True
    return out


# --- default programs ---------------------------------------------------------------------------
_main_program = Program()
_startup_program = Program()


def default_main_program() -> Program:
    return _main_program


def default_startup_program() -> Program:
    return _startup_program


def switch_main_program(program: Program) -> Program:
    global _main_program
    old, _main_program = _main_program, program
    return old


def switch_startup_program(program: Program) -> Program:
    global _startup_program
    old, _startup_program = _startup_program, program
    return old


@contextlib.contextmanager
def program_guard(main_program: Program, startup_program: Program | None = None) -> Iterator[None]:
    """Make ``main_program`` (and ``startup_program`` if given) the defaults inside the block."""
    if not isinstance(main_program, Program):
        raise IRError(f"program_guard needs a Program as main_program, got {type(main_program).__name__}")
    if startup_program is not None and not isinstance(startup_program, Program):
        raise IRError(f"program_guard needs a Program as startup_program, got {type(startup_program).__name__}")
    old_main = switch_main_program(main_program)
    old_startup = switch_startup_program(startup_program) if startup_program is not None else None
    try:
        yield
    finally:
        switch_main_program(old_main)
        if old_startup is not None:
            switch_startup_program(old_startup)


def block_refs(value: Any) -> list[int]:
    """Block indices referenced by an attribute value."""
    if isinstance(value, BlockRef):
        return [value.idx]
    if isinstance(value, list):
        return [v.idx for v in value if isinstance(v, BlockRef)]
    return []


def copy_op(dst: Block, op: Operator, rename: dict[str, str], block_map: dict[int, int] | None = None) -> Operator:
    """Append a copy of ``op`` to ``dst`` with variables renamed and block references remapped (through
    ``block_map``, source block index → ``dst``'s program's), for building one program from another's ops."""
    def mapped(names: list[str]) -> list[str]:
        return [rename.get(n, n) for n in names]

    attrs = {}
    for k, v in op.attrs.items():
        if isinstance(v, BlockRef):
            v = BlockRef((block_map or {})[v.idx])
        elif isinstance(v, list) and v and isinstance(v[0], BlockRef):
            v = [BlockRef((block_map or {})[b.idx]) for b in v]
        elif k == OP_ROLE_VAR_ATTR:
            v = mapped(list(v))
        attrs[k] = v
    return dst.append_op(op.type, {s: mapped(list(n)) for s, n in op.inputs.items()},
                         {s: mapped(list(n)) for s, n in op.outputs.items()}, attrs)


def iter_ops(program: Program) -> Iterable[tuple[Block, int, Operator]]:
    for block in program.blocks:
        for i, op in enumerate(block.ops):
            yield block, i, op
