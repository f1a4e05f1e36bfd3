"""Random but well-formed Programs for round-trip tests (text, protobuf) and benchmarks.

``programs()`` is a hypothesis strategy; ``seeded_program(seed)`` builds the same kind of program
from a plain ``random.Random`` (no hypothesis), so benchmarks and other tests can use it.

Both share one builder that asks a ``_Chooser`` for every decision, so they cover the same ground:
- several blocks, each block ``i > 0`` with a parent drawn from the blocks before it;
- Variables and Parameters of every var type and dtype, with non-default fields (slices, trainer
  copies, learning rates, regularizer specs, ``persistable=False`` parameters);
- names that the printer must quote (spaces, quotes, backslashes, unicode, line separators,
  keywords, leading digits) mixed with Fluid-like names (``fc_0.w_0``, ``x@GRAD``, ``g.block0``);
- ops of the types registered when this module is imported, built with ``Block._append_raw_op``
  (no inference runs), inputs and outputs drawn from the variables the block can see, every declared
  attribute set to a value of its kind (awkward floats, int64 extremes, unicode strings, empty lists,
  ``BlockRef`` values), plus a few undeclared attributes of every single kind.

Invariants of every generated program: every block ``i > 0`` has a parent ``< i``; variable names are
unique per block; every slot name of a registered op comes from its schema, in schema order; every
attribute value is a valid value of one ``AttrKind`` (no ``None``, no nested or mixed lists), and
ints fit in int64.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Sequence, TypeVar

from hypothesis import strategies as st

from ir.core import Block, Parameter, Program, Variable
from ir.ops.registry import DTYPES, VAR_TYPES, AttrDef, AttrKind, BlockRef, OpDef, all_op_defs
from ir.roles import OpRole

T = TypeVar("T")

# Drawn from what is registered when this module is imported (other families may add more later).
OP_DEFS: tuple[OpDef, ...] = tuple(all_op_defs())

AWKWARD_FLOATS: tuple[float, ...] = (
    0.0, -0.0, 0.1, 1.0, -1.5, 1e-300, 5e-324, 1.7976931348623157e308, 1e16, 123456789.125,
    math.inf, -math.inf, math.nan, 3.0e-7,
)
AWKWARD_INTS: tuple[int, ...] = (0, 1, -1, 7, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 10**15)
AWKWARD_STRINGS: tuple[str, ...] = (
    "", "a", "hello world", 'quote"inside', "back\\slash", "new\nline", "tab\there", "naïve",
    "名字", "emoji😀", "line\u2028sep", "nel\x85", "ctrl\x01\x1f", "L2Decay(0.001)", "127.0.0.1:6174",
    "{[(,)]}", "#not a comment", "^1",
)
FLUID_NAMES: tuple[str, ...] = (
    "x", "y", "label", "fc_0.w_0", "fc_0.b_0", "fc_0.tmp_0", "x@GRAD", "fc_0.w_0@GRAD", "g.block0",
    "g.block0.trainer_3", "@EMPTY@", "@LR_DECAY_COUNTER@", "learning_rate_0", "mean_0.tmp_0", "a-b", "_",
)
AWKWARD_NAMES: tuple[str, ...] = (
    "a b", 'q"uote', "back\\slash", "naïve", "名字", "1abc", "op", "var", "param", "true", "false", "inf",
    "nan", "none", "program", "block", "parent", "-x", ".x", "tab\tname", "new\nline", "emoji😀",
    "line\u2028sep", "#hash", "a=b", "x,y", "[z]", "",
)
ROLES: tuple[int, ...] = (
    int(OpRole.FORWARD), int(OpRole.BACKWARD), int(OpRole.OPTIMIZE), int(OpRole.RPC),
    int(OpRole.OPTIMIZE | OpRole.LRSCHED), int(OpRole.BACKWARD | OpRole.LOSS), int(OpRole.DIST),
)
REGULARIZERS: tuple[str, ...] = ("L2Decay(0.001)", "L1Decay(0.5)", "L2Decay(1e-05)")
CLIPS: tuple[str, ...] = ("GradientClipByValue(-1.0, 1.0)", "GradientClipByNorm(5.0)")
_SCALAR_KINDS = (AttrKind.BOOL, AttrKind.INT, AttrKind.FLOAT, AttrKind.STRING, AttrKind.BLOCK)


class _Chooser:
    """Every random decision the builder makes; one implementation per source of randomness."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def text(self) -> str:
        raise NotImplementedError

    def float_(self) -> float:
        raise NotImplementedError

    def boolean(self, p_true: float = 0.5) -> bool:
        raise NotImplementedError

    def choice(self, items: Sequence[T]) -> T:
        return items[self.integer(0, len(items) - 1)]


class _RandomChooser(_Chooser):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def text(self) -> str:
        # Printable BMP characters plus a few that need escaping or look like line breaks.
        pool = "abcXYZ019 _-.@\"\\\t\n\u2028\x85é名😀{}[]=,#^"
        return "".join(self.rng.choice(pool) for _ in range(self.rng.randint(0, 8)))

    def float_(self) -> float:
        kind = self.rng.randint(0, 2)
        if kind == 0:
            return self.rng.choice(AWKWARD_FLOATS)
        if kind == 1:
            return self.rng.uniform(-1e6, 1e6)
        return math.ldexp(self.rng.random(), self.rng.randint(-1074, 1023)) * self.rng.choice((1, -1))

    def boolean(self, p_true: float = 0.5) -> bool:
        return self.rng.random() < p_true


class _DataChooser(_Chooser):
    """Draws through hypothesis, so failures shrink."""

    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any]) -> None:
        self.draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def text(self) -> str:
        return self.draw(st.text(max_size=8))

    def float_(self) -> float:
        return self.draw(st.one_of(st.sampled_from(AWKWARD_FLOATS), st.floats()))

    def boolean(self, p_true: float = 0.5) -> bool:
        return self.draw(st.booleans())


def _name(c: _Chooser) -> str:
    pick = c.integer(0, 5)
    if pick <= 2:
        name = c.choice(FLUID_NAMES)
    elif pick == 3:
        name = c.choice(AWKWARD_NAMES)
    elif pick == 4:
        name = c.text()
    else:
        name = f"{c.choice(FLUID_NAMES)}_{c.integer(0, 99)}"
    return name or "empty"


def _int(c: _Chooser) -> int:
    if c.boolean():
        return c.choice(AWKWARD_INTS)
    return c.integer(-(2**63), 2**63 - 1)


def _string(c: _Chooser) -> str:
    return c.choice(AWKWARD_STRINGS) if c.boolean() else c.text()


def _scalar(c: _Chooser, kind: AttrKind, num_blocks: int) -> Any:
    if kind is AttrKind.BOOL:
        return c.boolean()
    if kind is AttrKind.INT:
        return _int(c)
    if kind is AttrKind.FLOAT:
        return c.float_()
    if kind is AttrKind.STRING:
        return _string(c)
    return BlockRef(c.integer(0, num_blocks - 1))


def _attr_value(c: _Chooser, kind: AttrKind, num_blocks: int) -> Any:
    if kind.is_list:
        return [_scalar(c, kind.element, num_blocks) for _ in range(c.integer(0, 3))]
    return _scalar(c, kind, num_blocks)


def _declared_attr(c: _Chooser, ad: AttrDef, num_blocks: int, visible: list[str]) -> Any:
    if ad.name == "op_role":
        return c.choice(ROLES)
    if ad.name == "op_role_var":
        return [c.choice(visible) for _ in range(2 * c.integer(0, 1))]
    return _attr_value(c, ad.kind, num_blocks)


def _shape(c: _Chooser) -> tuple[int, ...]:
    dims = []
    for i in range(c.integer(0, 4)):
        dims.append(-1 if i == 0 and c.boolean() else c.choice((1, 2, 3, 10, 1000, 8192, 2**31 - 1, 0)))
    return tuple(dims)


def _variable(c: _Chooser, name: str, visible: list[str]) -> Variable:
    fields: dict[str, Any] = {
        "name": name,
        "shape": _shape(c),
        "dtype": c.choice(DTYPES),
        "type": c.choice(VAR_TYPES),
    }
    is_param = c.integer(0, 3) == 0
    if c.boolean():
        fields["persistable"] = c.boolean()
    if c.integer(0, 3) == 0:
        fields["stop_gradient"] = True
    if c.integer(0, 5) == 0:
        fields["is_data"] = True
    if visible and c.integer(0, 3) == 0:
        fields["slice_of"] = c.choice(visible)
        fields["slice_index"] = c.integer(0, 7)
        fields["slice_offset"] = c.choice((0, 8192, 2**40))
    if visible and c.integer(0, 4) == 0:
        fields["copy_of"] = c.choice(visible)
        fields["trainer_id"] = c.integer(0, 15)
    if not is_param:
        return Variable(**fields)
    if c.boolean():
        fields["trainable"] = c.boolean()
    if c.boolean():
        fields["learning_rate"] = c.float_()
    if c.integer(0, 2) == 0:
        fields["regularizer"] = c.choice(REGULARIZERS)
    if c.integer(0, 3) == 0:
        fields["gradient_clip"] = c.choice(CLIPS)
    if c.integer(0, 4) == 0:
        fields["is_distributed"] = True
    return Parameter(**fields)


def _visible(program: Program, block: Block) -> list[str]:
    names: list[str] = []
    b: Block | None = block
    while b is not None:
        names.extend(b.vars)
        b = program.blocks[b.parent_idx] if b.parent_idx >= 0 else None
    return names


def _append_op(c: _Chooser, program: Program, block: Block, visible: list[str]) -> None:
    op_def = c.choice(OP_DEFS)
    inputs: dict[str, list[str]] = {}
    outputs: dict[str, list[str]] = {}
    for slots, table in ((op_def.inputs, inputs), (op_def.outputs, outputs)):
        for slot in slots:
            if slot.dispensable and c.boolean():
                continue
            count = c.integer(0 if slot.dispensable else 1, 3) if slot.duplicable else 1
            table[slot.name] = [c.choice(visible) for _ in range(count)]
    attrs = {ad.name: _declared_attr(c, ad, len(program.blocks), visible) for ad in op_def.attrs}
    for _ in range(c.integer(0, 2) if c.integer(0, 3) == 0 else 0):
        kind = c.choice(tuple(AttrKind))
        attrs[f"extra_{kind.value}_{c.integer(0, 9)}"] = _attr_value(c, kind, len(program.blocks))
    block._append_raw_op(op_def.type, inputs, outputs, dict(sorted(attrs.items())))


def _build(c: _Chooser, max_blocks: int, max_vars: int, max_ops: int) -> Program:
    program = Program()
    program.random_seed = c.choice((0, 1, 90, 2**31 - 1))
    for _ in range(c.integer(0, max_blocks - 1)):
        program.create_block(parent_idx=c.integer(0, len(program.blocks) - 1))
    program.rollback()
    for block in program.blocks:
        target = c.integer(1 if block.idx == 0 else 0, max_vars)
        for _ in range(target):
            name = _name(c)
            if block.has_var(name):
                continue
            block.add_var(_variable(c, name, _visible(program, block)))
    for block in program.blocks:
        visible = _visible(program, block)
        if not OP_DEFS:
            break
        for _ in range(c.integer(0, max_ops)):
            _append_op(c, program, block, visible)
    return program


@st.composite
def _programs(draw: Callable[[st.SearchStrategy[Any]], Any], max_blocks: int, max_vars: int,
              max_ops: int) -> Program:
    return _build(_DataChooser(draw), max_blocks, max_vars, max_ops)


def programs(max_blocks: int = 4, max_vars: int = 6, max_ops: int = 6) -> st.SearchStrategy[Program]:
    """A hypothesis strategy of random well-formed Programs (see the module docstring)."""
    return _programs(max_blocks, max_vars, max_ops)


def seeded_program(seed: int, *, max_blocks: int = 4, max_vars: int = 8, max_ops: int = 8) -> Program:
    """The same kind of Program as ``programs()``, from ``random.Random(seed)``: equal seeds give
    programs that print identically. Raise the maxima for benchmark-sized programs."""
    return _build(_RandomChooser(random.Random(seed)), max_blocks, max_vars, max_ops)
