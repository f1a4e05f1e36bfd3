"""The op registry: one ``OpDef`` per op type, the single source of truth for every op.

The verifier, printer, autodiff and runtime all read this registry. An ``OpDef`` declares
its input/output slots (duplicable, dispensable), typed attributes with defaults and a one-line doc,
shape inference, its IR-level gradient maker (or the explicit ``NO_GRAD``) and traits.
Registering a duplicate type, or a definition that names an unknown trait or a malformed slot,
fails at import.

Gradient ops produced by ``DefaultGrad`` (``<type>_grad``) are registered automatically from the
forward definition, so each op is still declared once.

Traits (``TRAITS``, each explained there) are how the rest of the code finds a family of ops
(``op_has_trait``): a pass or the runtime never keeps its own list of op types, so a new op joins every
such place by declaring its traits. An op with ``trainer_rpc`` must declare ``trainer_id``.
"""
from __future__ import annotations

import difflib
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

from ir.errors import IRError, RegistryError
from ir.names import GRAD_SUFFIX, grad_name
from ir.roles import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR

VAR_TYPES = ("lod_tensor", "selected_rows", "raw")
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int8", "uint8", "int16", "int32", "int64")

TRAITS = frozenset(
    {
        "side_effect",  # must not be removed or reordered even if its outputs look unused
        "optimizer",  # updates a parameter in place (ParamOut aliases Param)
        "rpc",  # talks to other processes; runs on the host
        "trainer_rpc",  # an rpc a trainer makes to its pservers: declares ``trainer_id`` (whose call it is)
        "collective",  # a cross-process collective; without ``host`` it lowers to an XLA collective inside
        #                the compiled step and needs a replica group of ``nranks`` ranks to run
        "replica_reduce",  # combines every replica's values each step (sums gradients, averages parameters):
        #                    a main program holding one is already data parallel, not to be rewritten again
        "host",  # runs on the host between compiled runs (not traceable by jax.jit)
        "random",  # draws random numbers; takes a ``seed`` attribute
        "grad",  # a gradient op made by a gradient maker
    }
)


class AttrKind(enum.Enum):
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"
    STRING = "string"
    BOOLS = "bools"
    INTS = "ints"
    FLOATS = "floats"
    STRINGS = "strings"
    BLOCK = "block"
    BLOCKS = "blocks"

    # Members are singletons compared by identity, so identity hashing is consistent with equality;
    # Enum's own __hash__ is Python code, and the verifier looks kinds up millions of times.
    __hash__ = object.__hash__

    @property
    def is_list(self) -> bool:
        return self in _ELEMENT

    @property
    def element(self) -> "AttrKind":
        """The element kind of a list kind (the kind itself for scalars)."""
        return _ELEMENT.get(self, self)


_ELEMENT = {
    AttrKind.BOOLS: AttrKind.BOOL,
    AttrKind.INTS: AttrKind.INT,
    AttrKind.FLOATS: AttrKind.FLOAT,
    AttrKind.STRINGS: AttrKind.STRING,
    AttrKind.BLOCKS: AttrKind.BLOCK,
}


@dataclass(frozen=True, order=True)
class BlockRef:
    """An attribute value that refers to a block of the same program by index."""

    idx: int

    def __repr__(self) -> str:
        return f"^{self.idx}"


REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()


@dataclass(frozen=True)
class AttrDef:
    name: str
    kind: AttrKind
    default: Any = REQUIRED
    doc: str = ""


@dataclass(frozen=True)
class Slot:
    name: str
    duplicable: bool = False
    dispensable: bool = False

    @staticmethod
    def parse(spec: str) -> "Slot":
        """``"X"`` one variable, ``"X*"`` duplicable, ``"Bias?"`` dispensable, ``"X*?"`` both."""
        name = spec.rstrip("*?")
        flags = spec[len(name):]
        if not name or any(c not in "*?" for c in flags) or len(set(flags)) != len(flags):
            raise RegistryError(f"malformed slot spec {spec!r}", hint="use 'X', 'X*', 'X?' or 'X*?'")
        return Slot(name, duplicable="*" in flags, dispensable="?" in flags)


@dataclass(frozen=True)
class VarInfo:
    """What shape inference knows about a variable: shape (-1 = unknown extent), dtype and type."""

    shape: tuple[int, ...]
    dtype: str
    type: str = "lod_tensor"


class OpSpec(NamedTuple):
    """An op to be created: what a gradient maker returns."""

    type: str
    inputs: dict[str, list[str]]
    outputs: dict[str, list[str]]
    attrs: dict[str, Any]


COMMON_ATTRS = (
    AttrDef(OP_ROLE_ATTR, AttrKind.INT, 0, "role bits: forward 0, backward 1, optimize 2, rpc 4, dist 8, lrsched 16, loss 256"),
    AttrDef(OP_ROLE_VAR_ATTR, AttrKind.STRINGS, [], "[param, grad] pairs this op works on"),
)


class InferContext:
    """The view shape inference has of one op: its inputs' VarInfos, attrs, and where outputs go."""

    def __init__(self, op_type: str, inputs: Mapping[str, list[VarInfo]], attrs: Mapping[str, Any],
                 output_slots: Mapping[str, int]) -> None:
        self.op_type = op_type
        self._inputs = inputs
        self._attrs = attrs
        self._output_counts = output_slots
        self.outputs: dict[str, list[VarInfo]] = {}

    def has_input(self, slot: str) -> bool:
        return bool(self._inputs.get(slot))

    def inputs(self, slot: str) -> list[VarInfo]:
        return list(self._inputs.get(slot, []))

    def input(self, slot: str) -> VarInfo:
        infos = self._inputs.get(slot, [])
        if len(infos) != 1:
            raise IRError(f"{self.op_type}: slot {slot!r} needs exactly one variable, got {len(infos)}")
        return infos[0]

    def attr(self, name: str) -> Any:
        return self._attrs[name]

    def has_output(self, slot: str) -> bool:
        return self._output_counts.get(slot, 0) > 0

    def num_outputs(self, slot: str) -> int:
        return self._output_counts.get(slot, 0)

    def set_output(self, slot: str, infos: VarInfo | Sequence[VarInfo]) -> None:
        """Set the outputs of ``slot``; one VarInfo applies to every variable in the slot."""
        count = self._output_counts.get(slot, 0)
        if count <= 0:
            return
        if isinstance(infos, VarInfo):
            infos = [infos] * count
        self.outputs[slot] = list(infos)

    def fail(self, message: str) -> None:
        raise IRError(f"{self.op_type}: {message}")


InferFn = Callable[[InferContext], None]
GradMakerFn = Callable[["Any"], list[OpSpec]]


class _NoGrad:
    """The explicit marker for an op that has no gradient."""

    def __repr__(self) -> str:
        return "NO_GRAD"


NO_GRAD: Any = _NoGrad()


@dataclass(frozen=True)
class DefaultGrad:
    """Gradient maker that emits one ``<type>_grad`` op, and declares that op's schema.

    The grad op reads the forward inputs named in ``inputs`` (all by default), the forward outputs
    named in ``outputs`` (none by default) and the gradients ``<Out>@GRAD`` of ``out_grads``
    (all forward outputs by default); it writes ``<X>@GRAD`` for each forward input in ``wrt``
    (all by default). Every ``@GRAD`` slot is dispensable: autodiff leaves out what is not needed.
    ``sparse_grad`` names an input slot whose gradient is selected rows when the given bool attr is true.
    """

    inputs: tuple[str, ...] | None = None
    outputs: tuple[str, ...] = ()
    out_grads: tuple[str, ...] | None = None
    wrt: tuple[str, ...] | None = None
    sparse_grad: tuple[str, str] | None = None


@dataclass(frozen=True)
class OpDef:
    type: str
    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    attrs: tuple[AttrDef, ...]
    infer: InferFn | None
    grad: DefaultGrad | GradMakerFn | Any
    traits: frozenset[str] = frozenset()
    doc: str = ""
    forward_type: str | None = None  # set on generated grad ops
    _attr_map: dict[str, AttrDef] = field(default_factory=dict, compare=False, repr=False)
    # Derived once from the fields above, for the checks every op construction and verification
    # repeats (hundreds of thousands of times for a large program): the attribute names in sorted
    # (stored) order, the input and output slot names, and the attributes that hold block references.
    _sorted_attr_names: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    _input_names: frozenset[str] = field(default=frozenset(), init=False, compare=False, repr=False)
    _output_names: frozenset[str] = field(default=frozenset(), init=False, compare=False, repr=False)
    _block_attrs: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    # Every attribute in sorted order with its stored default (REQUIRED where it has none); the
    # attributes whose default is a list (a fresh copy per op); those without a default.
    _attr_defaults: dict[str, Any] = field(default_factory=dict, init=False, compare=False, repr=False)
    _list_defaults: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    _required_attrs: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    # (name, dispensable, duplicable) of each input and output slot; (name, kind, exact-type test of
    # the kind's common values) of each attribute.
    _input_rules: tuple[tuple[str, bool, bool], ...] = field(default=(), init=False, compare=False, repr=False)
    _output_rules: tuple[tuple[str, bool, bool], ...] = field(default=(), init=False, compare=False, repr=False)
    _attr_checks: tuple[tuple[str, AttrKind, frozenset[type] | None, Callable[[Any], bool]], ...] = field(
        default=(), init=False, compare=False, repr=False)
    # name -> (kind, its exact-type test, its normalizer or None where a valid value is stored as is)
    _attr_specs: dict[str, tuple[AttrKind, Callable[[Any], bool], Callable[[Any], Any] | None]] = field(
        default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._attr_map.update({a.name: a for a in self.attrs})
        defaults = {a.name: a.default if a.default is REQUIRED else normalize_attr_value(a.kind, a.default)
                    for a in sorted(self.attrs, key=lambda a: a.name)}
        self._attr_defaults.update(defaults)
        self._attr_specs.update({a.name: (a.kind, _FAST_OK[a.kind], _NORMALIZERS.get(a.kind)) for a in self.attrs})
        derived = {
            "_sorted_attr_names": tuple(sorted(self._attr_map)),
            "_input_names": frozenset(s.name for s in self.inputs),
            "_output_names": frozenset(s.name for s in self.outputs),
            "_block_attrs": tuple(a.name for a in self.attrs if a.kind in (AttrKind.BLOCK, AttrKind.BLOCKS)),
            "_list_defaults": tuple(n for n, v in defaults.items() if isinstance(v, list)),
            "_required_attrs": tuple(n for n, v in defaults.items() if v is REQUIRED),
            "_input_rules": tuple((s.name, s.dispensable, s.duplicable) for s in self.inputs),
            "_output_rules": tuple((s.name, s.dispensable, s.duplicable) for s in self.outputs),
            "_attr_checks": tuple((a.name, a.kind, _EXACT_TYPES.get(a.kind), _FAST_OK[a.kind]) for a in self.attrs),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def input_slot(self, name: str) -> Slot | None:
        return next((s for s in self.inputs if s.name == name), None)

    def output_slot(self, name: str) -> Slot | None:
        return next((s for s in self.outputs if s.name == name), None)

    def attr_def(self, name: str) -> AttrDef | None:
        return self._attr_map.get(name)

    @property
    def has_grad(self) -> bool:
        return self.grad is not NO_GRAD

    def has_trait(self, trait: str) -> bool:
        return trait in self.traits

    def make_grad(self, op: Any) -> list[OpSpec]:
        """The gradient ops of forward op ``op`` (an Operator), before autodiff's renaming."""
        if self.grad is NO_GRAD:
            raise RegistryError(f"op type {self.type!r} has no gradient")
        if isinstance(self.grad, DefaultGrad):
            return [_default_grad_spec(self, self.grad, op)]
        return list(self.grad(op))


_REGISTRY: dict[str, OpDef] = {}


def A(name: str, kind: AttrKind, default: Any = REQUIRED, doc: str = "") -> AttrDef:
    """Shorthand for an ``AttrDef``."""
    return AttrDef(name, kind, default, doc)


def register(op_def: OpDef) -> OpDef:
    if op_def.type in _REGISTRY:
        raise RegistryError(f"op type {op_def.type!r} is registered twice")
    _REGISTRY[op_def.type] = op_def
    return op_def


def defop(
    type: str,
    *,
    inputs: Iterable[str] = (),
    outputs: Iterable[str] = (),
    attrs: Iterable[AttrDef] = (),
    infer: InferFn | None = None,
    grad: Any,
    traits: Iterable[str] = (),
    doc: str = "",
    grad_infer: InferFn | None = None,
    grad_traits: Iterable[str] = (),
) -> OpDef:
    """Declare and register an op type (and, for ``DefaultGrad``, its ``<type>_grad`` op).

    ``grad`` is required: a ``DefaultGrad``, a custom maker ``(op) -> [OpSpec]`` whose grad ops are
    declared separately, or ``NO_GRAD``. ``grad_infer`` overrides the generated grad op's inference.
    """
    traits = frozenset(traits)
    unknown = traits - TRAITS
    if unknown:
        raise RegistryError(f"op {type!r} names unknown traits {sorted(unknown)}", hint=f"known: {sorted(TRAITS)}")
    in_slots = tuple(Slot.parse(s) for s in inputs)
    out_slots = tuple(Slot.parse(s) for s in outputs)
    for slots in (in_slots, out_slots):
        names = [s.name for s in slots]
        if len(set(names)) != len(names):
            raise RegistryError(f"op {type!r} declares a slot twice: {names}")
    attr_defs = COMMON_ATTRS + tuple(attrs)
    attr_names = [a.name for a in attr_defs]
    if len(set(attr_names)) != len(attr_names):
        raise RegistryError(f"op {type!r} declares an attribute twice: {attr_names}")
    if "trainer_rpc" in traits and "trainer_id" not in attr_names:
        raise RegistryError(f"op {type!r} has the trait trainer_rpc but no trainer_id attribute",
                            hint="a trainer's rpc says which trainer makes it: declare trainer_id")
    for a in attr_defs:
        if a.default is not REQUIRED:
            problem = check_attr_value(a.kind, a.default)
            if problem:
                raise RegistryError(f"op {type!r} attr {a.name!r} default: {problem}")
    op_def = register(OpDef(type, in_slots, out_slots, attr_defs, infer, grad, traits, doc))
    if isinstance(grad, DefaultGrad):
        _register_default_grad(op_def, grad, grad_infer, frozenset(grad_traits) | {"grad"})
    return op_def


def _grad_slot(slot: str) -> str:
    return slot + GRAD_SUFFIX


def _register_default_grad(fwd: OpDef, g: DefaultGrad, grad_infer: InferFn | None, traits: frozenset[str]) -> None:
    fwd_in = {s.name: s for s in fwd.inputs}
    fwd_out = {s.name: s for s in fwd.outputs}
    for name in (g.inputs or ()) + (g.wrt or ()):
        if name not in fwd_in:
            raise RegistryError(f"{fwd.type}: DefaultGrad names unknown input slot {name!r}")
    for name in g.outputs + (g.out_grads or ()):
        if name not in fwd_out:
            raise RegistryError(f"{fwd.type}: DefaultGrad names unknown output slot {name!r}")
    read_in = g.inputs if g.inputs is not None else tuple(fwd_in)
    out_grads = g.out_grads if g.out_grads is not None else tuple(fwd_out)
    wrt = g.wrt if g.wrt is not None else tuple(fwd_in)
    in_slots = [Slot(n, fwd_in[n].duplicable, fwd_in[n].dispensable) for n in read_in]
    in_slots += [Slot(n, fwd_out[n].duplicable, fwd_out[n].dispensable) for n in g.outputs]
    in_slots += [Slot(_grad_slot(n), fwd_out[n].duplicable, True) for n in out_grads]
    out_slots = [Slot(_grad_slot(n), fwd_in[n].duplicable, True) for n in wrt]
    register(
        OpDef(
            type=fwd.type + "_grad",
            inputs=tuple(in_slots),
            outputs=tuple(out_slots),
            attrs=fwd.attrs,
            infer=grad_infer or _make_grad_infer(wrt, g.sparse_grad),
            grad=NO_GRAD,
            traits=traits,
            doc=f"gradient of {fwd.type}",
            forward_type=fwd.type,
        )
    )


def _make_grad_infer(wrt: tuple[str, ...], sparse: tuple[str, str] | None) -> InferFn:
    def infer(ctx: InferContext) -> None:
        for slot in wrt:
            infos = ctx.inputs(slot)
            if sparse is not None and slot == sparse[0] and ctx.attr(sparse[1]):
                infos = [VarInfo(i.shape, i.dtype, "selected_rows") for i in infos]
            if ctx.num_outputs(_grad_slot(slot)) == len(infos):
                ctx.set_output(_grad_slot(slot), infos)

    return infer


def _default_grad_spec(fwd: OpDef, g: DefaultGrad, op: Any) -> OpSpec:
    read_in = g.inputs if g.inputs is not None else tuple(s.name for s in fwd.inputs)
    out_grads = g.out_grads if g.out_grads is not None else tuple(s.name for s in fwd.outputs)
    wrt = g.wrt if g.wrt is not None else tuple(s.name for s in fwd.inputs)
    inputs: dict[str, list[str]] = {}
    for slot in read_in:
        if op.input(slot):
            inputs[slot] = list(op.input(slot))
    for slot in g.outputs:
        if op.output(slot):
            inputs[slot] = list(op.output(slot))
    for slot in out_grads:
        if op.output(slot):
            inputs[_grad_slot(slot)] = [grad_name(v) for v in op.output(slot)]
    outputs = {_grad_slot(slot): [grad_name(v) for v in op.input(slot)] for slot in wrt if op.input(slot)}
    return OpSpec(fwd.type + "_grad", inputs, outputs, dict(op.attrs))


def get_op_def(op_type: str) -> OpDef:
    """The definition of ``op_type``; an unknown type raises with the closest known names."""
    try:
        return _REGISTRY[op_type]
    except KeyError:
        raise RegistryError(f"unknown op type {op_type!r}", hint=suggest(op_type, _REGISTRY)) from None


def find_op_def(op_type: str) -> OpDef | None:
    return _REGISTRY.get(op_type)


def op_has_trait(op_type: str, trait: str) -> bool:
    """Whether ``op_type`` is registered with ``trait`` (an unregistered type has none): what a pass or the
    runtime asks instead of keeping its own list of op types."""
    op_def = _REGISTRY.get(op_type)
    return op_def is not None and trait in op_def.traits


def has_op(op_type: str) -> bool:
    return op_type in _REGISTRY


def all_op_defs() -> list[OpDef]:
    """Every registered definition, sorted by type."""
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """``did you mean 'x'?`` for the closest candidate, or None."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else None


def check_attr_value(kind: AttrKind, value: Any) -> str | None:
    """None if ``value`` is a valid value of ``kind``, else what is wrong with it."""
    if _FAST_OK[kind](value):
        return None
    element = _ELEMENT.get(kind)
    if element is not None:
        if not isinstance(value, (list, tuple)):
            return f"expected a list of {element.value}, got {type(value).__name__} {value!r}"
        ok = _SCALAR_OK[element]
        for v in value:
            if not ok(v):
                return f"list element: expected {element.value}, got {type(v).__name__} {v!r}"
        return None
    return None if _SCALAR_OK[kind](value) else f"expected {kind.value}, got {type(value).__name__} {value!r}"


def attr_value_ok(kind: AttrKind, value: Any) -> bool:
    """``check_attr_value(kind, value) is None``, without building a message."""
    return _FAST_OK[kind](value) or check_attr_value(kind, value) is None


_INT_RANGE = (-(2**63), 2**63)

_SCALAR_OK: dict[AttrKind, Callable[[Any], bool]] = {
    AttrKind.BOOL: lambda v: isinstance(v, bool),
    AttrKind.INT: lambda v: isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63,
    AttrKind.FLOAT: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    AttrKind.STRING: lambda v: isinstance(v, str),
    AttrKind.BLOCK: lambda v: isinstance(v, BlockRef),
}


# The scalar kinds whose valid values are exactly the values of these types (ints have a range too).
_EXACT_TYPES: dict[AttrKind, frozenset[type]] = {
    AttrKind.BOOL: frozenset({bool}), AttrKind.FLOAT: frozenset({int, float}), AttrKind.STRING: frozenset({str}),
    AttrKind.BLOCK: frozenset({BlockRef}),
}


def _fast_checks() -> dict[AttrKind, Callable[[Any], bool]]:
    """Per kind, a test by exact type that accepts the common valid values (``int``, ``float``, ``str``,
    ``bool``, ``BlockRef`` and lists or tuples of them) and only valid ones; what it does not accept
    goes to the full check, which says what is wrong. (Subclasses such as ``IntEnum`` take that path.)"""
    lo, hi = _INT_RANGE
    exact = _EXACT_TYPES

    def scalar(types: frozenset[type]) -> Callable[[Any], bool]:
        return lambda v: type(v) in types

    def listed(types: frozenset[type]) -> Callable[[Any], bool]:
        def ok(value: Any) -> bool:
            if type(value) is not list and type(value) is not tuple:
                return False
            for v in value:
                if type(v) not in types:
                    return False
            return True
        return ok

    def ints(value: Any) -> bool:
        if type(value) is not list and type(value) is not tuple:
            return False
        for v in value:
            if type(v) is not int or not lo <= v < hi:
                return False
        return True

    checks: dict[AttrKind, Callable[[Any], bool]] = {kind: scalar(types) for kind, types in exact.items()}
    checks[AttrKind.INT] = lambda v: type(v) is int and lo <= v < hi
    checks.update({kind: listed(exact[element]) for kind, element in _ELEMENT.items() if element in exact})
    checks[AttrKind.INTS] = ints
    return checks


_FAST_OK = _fast_checks()


def normalize_attr_value(kind: AttrKind, value: Any) -> Any:
    """The canonical stored form of a valid value: lists as lists, floats as float."""
    element = _ELEMENT.get(kind)
    if element is AttrKind.FLOAT:
        return [float(v) for v in value]
    if element is not None:
        return list(value)
    if kind is AttrKind.FLOAT:
        return float(value)
    return value


# The kinds whose valid values ``normalize_attr_value`` changes (lists become lists, ints floats); the
# others are stored as given.
_NORMALIZERS: dict[AttrKind, Callable[[Any], Any]] = {
    kind: (lambda v, kind=kind: normalize_attr_value(kind, v)) for kind in AttrKind
    if kind.is_list or kind is AttrKind.FLOAT
}


def attr_kind_of_value(value: Any) -> AttrKind:
    """The kind a value has on its own (for attrs no schema declares); empty lists are strings."""
    if isinstance(value, bool):
        return AttrKind.BOOL
    if isinstance(value, int):
        return AttrKind.INT
    if isinstance(value, float):
        return AttrKind.FLOAT
    if isinstance(value, str):
        return AttrKind.STRING
    if isinstance(value, BlockRef):
        return AttrKind.BLOCK
    if isinstance(value, (list, tuple)):
        if not value:
            return AttrKind.STRINGS
        element = attr_kind_of_value(value[0])
        if element.is_list:
            raise IRError(f"nested list attribute values are not supported: {value!r}")
        return {AttrKind.BOOL: AttrKind.BOOLS, AttrKind.INT: AttrKind.INTS, AttrKind.FLOAT: AttrKind.FLOATS,
                AttrKind.STRING: AttrKind.STRINGS, AttrKind.BLOCK: AttrKind.BLOCKS}[element]
    raise IRError(f"unsupported attribute value {value!r} of type {type(value).__name__}")


def numel(shape: Sequence[int]) -> int:
    """Number of elements; -1 if any extent is unknown."""
    if any(d < 0 for d in shape):
        return -1
    return math.prod(shape)
