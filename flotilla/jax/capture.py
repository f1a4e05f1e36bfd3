"""Capture a plain JAX training function as a Program: ``capture(loss_fn, params, example_batch, optimizer)``.

``loss_fn(params, batch)`` is any JAX function of two pytrees of arrays returning a scalar loss. It is
traced once with ``jax.make_jaxpr``, the batch leaves given a symbolic leading dimension (so the
program runs with any batch size, as Fluid's ``-1``), and its equations become ops of an ordinary
main Program:

- parameters become persistable ``Parameter``s named by their pytree path (``w1``,
  ``blocks.0.attn.wq``), initialised in the startup Program by ``load_value`` ops from an archive of
  the given values (``runtime.io`` format, content-addressed under ``param_dir``);
- batch leaves become ``data`` variables of shape ``[-1, ...]``;
- equations with a Fluid counterpart become that op (see ``MAPPED``); a gather of rows from a 2-D
  parameter becomes a sparse ``lookup_table`` (a distributed table when named in ``distributed``);
- every maximal run of the other equations becomes ONE ``jax_function`` op carrying the serialized
  ``jax.export`` of the sub-function (vjp order 1), with its primitive list for readers.

Then ``optimizer.minimize(loss)`` runs on the built program, so autodiff, the optimizers, the
transpiler and the runtime treat it as any other program. A function that cannot be captured (Python
control flow on traced values, side effects, unsupported dtypes) raises ``CaptureError`` naming the
construct and the line of the user's function.

Invariants: the captured program computes what ``loss_fn`` computes (the mapped ops are the same
JAX computations up to rounding order); every batch leaf shares the leading (batch) dimension;
recognised patterns (mean = sum / count, softmax, index normalisation before a table gather) only
fire when their intermediate values have no other use.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ir.core import Program, Variable, program_guard
from ir.errors import FlotillaError
from ir.ops.jax_function import format_shape
from ir.ops.registry import DTYPES, FLOAT_DTYPES
from ir.roles import OP_ROLE_ATTR
from runtime.io import write_archive
from runtime.x64 import x64
import runtime.kernels.jax_function  # noqa: F401  (registers the jax_function and load_value kernels)

__all__ = ["CaptureError", "capture", "leaf_names", "MAPPED"]

BATCH_SYMBOL = "batch"

# primitive → the Fluid op it becomes (when its operands fit the op's semantics; otherwise it joins an
# opaque jax_function op).
MAPPED: dict[str, str] = {
    "dot_general": "mul (x[..., k] @ w[k, n]) | matmul (batched, transposes)",
    "add": "elementwise_add | scale (bias)", "sub": "elementwise_sub | scale (bias)",
    "mul": "elementwise_mul | scale", "div": "elementwise_div", "max": "elementwise_max",
    "min": "elementwise_min", "pow": "elementwise_pow", "neg": "scale(-1)",
    "reduce_sum": "reduce_sum", "reduce_sum / count": "mean | reduce_mean",
    "mean(keepdims) pattern": "reduce_mean(keep_dim)", "reduce_max": "reduce_max",
    "integer_pow[y=2]": "square", "exp": "exp", "log": "log", "tanh": "tanh", "logistic": "sigmoid",
    "sqrt": "sqrt", "abs": "abs", "custom_jvp_call[relu]": "relu", "softmax pattern": "softmax",
    "gather of parameter rows": "lookup_table (is_sparse; is_distributed when named in distributed=)",
    "transpose": "transpose", "reshape / squeeze / expand_dims": "reshape", "convert_element_type": "cast",
    "concatenate": "concat", "broadcast_in_dim": "folded into the elementwise op's broadcast (axis)",
    "jit / pjit": "inlined (log_softmax kept whole, as one opaque op)",
}

_UNARY = {"exp": "exp", "log": "log", "tanh": "tanh", "logistic": "sigmoid", "sqrt": "sqrt", "abs": "abs"}
_BINARY = {"add": "elementwise_add", "sub": "elementwise_sub", "mul": "elementwise_mul",
           "div": "elementwise_div", "max": "elementwise_max", "min": "elementwise_min", "pow": "elementwise_pow"}
_COMMUTATIVE = {"add", "mul", "max", "min"}
_KEEP_WHOLE_JIT = {"log_softmax"}
_CONTROL_FLOW = {"cond", "while", "scan"}



class _NoMatch(Exception):
    """A pattern does not match (control flow of the pattern matchers, never seen by users)."""


def _need(condition: bool) -> None:
    if not condition:
        raise _NoMatch

class CaptureError(FlotillaError):
    """A function the capture front end cannot turn into a Program."""

    code = "E740"


# --- flat equations ----------------------------------------------------------------------------------
@dataclass(eq=False)
class _Atom:
    """A value of the flattened jaxpr (identity-hashed: inlined sub-jaxprs get fresh atoms)."""

    aval: Any
    literal: Any = None
    is_literal: bool = False


@dataclass(eq=False)
class _Eqn:
    eqn: Any  # the jax equation (primitive, params, source_info)
    ins: list[_Atom]
    outs: list[_Atom]
    pos: int = 0  # index in the flat list
    skip: bool = False  # folded into a pattern
    note: dict[str, Any] = field(default_factory=dict)

    @property
    def prim(self) -> str:
        return self.eqn.primitive.name


def _flatten(jaxpr: Any, ins: list[_Atom], consts: Sequence[Any], out: list[_Eqn]) -> list[_Atom]:
    """Append the equations of ``jaxpr`` (sub-jaxprs of ``jit`` inlined) to ``out``; its result atoms."""
    env: dict[Any, _Atom] = {}
    for v, a in zip(jaxpr.invars, ins):
        env[v] = a
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c if isinstance(c, _Atom) else _Atom(v.aval, c, True)

    def read(v: Any) -> _Atom:
        if type(v).__name__ == "Literal":
            return _Atom(v.aval, v.val, True)
        return env[v]

    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") not in _KEEP_WHOLE_JIT:
            closed = eqn.params["jaxpr"]
            results = _flatten(closed.jaxpr, args, closed.consts, out)
        else:
            results = [_Atom(v.aval) for v in eqn.outvars]
            out.append(_Eqn(eqn, args, results, pos=len(out)))
        for v, a in zip(eqn.outvars, results):
            env[v] = a
    return [read(v) for v in jaxpr.outvars]


# --- values during conversion -----------------------------------------------------------------------
@dataclass
class _Var:
    name: str  # a Fluid variable


@dataclass
class _Lazy:
    """A value not emitted yet: a pattern consumer may read ``kind``/``src`` instead."""

    kind: str  # "broadcast" | "reduce_sum" | "dim"
    fe: _Eqn
    src: _Atom | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _is_symbolic(shape: Sequence[Any]) -> bool:
    return any(not isinstance(d, (int, np.integer)) for d in shape)


def _fluid_shape(shape: Sequence[Any]) -> tuple[int, ...]:
    return tuple(int(d) if isinstance(d, (int, np.integer)) else -1 for d in shape)


def _dtype(aval: Any) -> str:
    return np.dtype(aval.dtype).name


def _user_frame(fn: Callable[..., Any], frames: Sequence[Any]) -> str | None:
    """``file:line: source`` of the innermost of ``frames`` (outermost first) in the file defining ``fn``,
    else of the innermost one outside jax, installed packages and this module."""
    user_file = getattr(getattr(fn, "__code__", None), "co_filename", None)
    mine = [f for f in frames if user_file is not None and f[0] == user_file]
    other = [f for f in frames if "/jax/" not in f[0] and "site-packages" not in f[0] and f[0] != __file__
             and not f[0].startswith("<frozen")]
    best = (mine or other or [None])[-1]
    if best is None:
        return None
    import linecache

    text = linecache.getline(best[0], best[1]).strip()
    return f"{best[0]}:{best[1]}" + (f": {text}" if text else "")


def _eqn_location(fn: Callable[..., Any], eqn: Any) -> str | None:
    tb = getattr(eqn.source_info, "traceback", None)
    if tb is None:
        return None
    frames = [(f.file_name, f.line_num) for f in tb.frames]
    return _user_frame(fn, list(reversed(frames)))


# --- the converter ------------------------------------------------------------------------------------
class _Converter:
    def __init__(self, fn: Callable[..., Any], main: Program, eqns: list[_Eqn], outs: list[_Atom],
                 batch_vars: list[tuple[_Atom, str]], platforms: tuple[str, ...] | None,
                 distributed: frozenset[str]) -> None:
        self.fn, self.main, self.block = fn, main, main.global_block()
        self.eqns, self.final = eqns, outs
        self.batch_vars = batch_vars
        self.platforms = platforms
        self.distributed = distributed
        self.val: dict[_Atom, Any] = {}
        self.pending: list[_Eqn] = []
        self.pending_defs: set[_Atom] = set()
        self.count = 0
        self.consts: dict[tuple[float, str], str] = {}
        self.uses: dict[_Atom, list[int]] = {}
        self.last_use: dict[_Atom, int] = {}
        self.pos = 0
        self.param_atoms: dict[_Atom, str] = {}
        self._producers: dict[_Atom, _Eqn] = {}
        for i, fe in enumerate(eqns):
            for a in fe.ins:
                self.uses.setdefault(a, []).append(i)
        for a in outs:
            self.uses.setdefault(a, []).append(len(eqns))

    def _compute_last_use(self) -> None:
        end = len(self.eqns)
        last: dict[_Atom, int] = {a: end for a in self.final}
        # Lazy values are consumed where their consumers are: an input of a lazily emitted equation
        # lives as long as that equation's results.
        for i in range(len(self.eqns) - 1, -1, -1):
            fe = self.eqns[i]
            if fe.skip:
                continue
            lazy_like = fe.prim in ("broadcast_in_dim", "reduce_sum", "dim_as_value", "convert_element_type")
            reach = max([i] + [last.get(o, -1) for o in fe.outs]) if lazy_like else i
            for a in fe.ins + [fe.note[k] for k in ("softmax_x", "table_ids") if k in fe.note]:
                last[a] = max(last.get(a, -1), reach)
        self.last_use = last

    # names and helpers
    def fresh(self, prefix: str) -> str:
        self.count += 1
        name = f"{prefix}_{self.count}.tmp"
        while self.block.has_var(name):
            self.count += 1
            name = f"{prefix}_{self.count}.tmp"
        return name

    def out_var(self, prefix: str, aval: Any) -> str:
        name = self.fresh(prefix)
        self.block.create_var(name=name, shape=_fluid_shape(aval.shape), dtype=_dtype(aval))
        return name

    def fshape(self, name: str) -> tuple[int, ...]:
        return self.block.var(name).shape

    def emit(self, op_type: str, inputs: dict[str, list[str]], outputs: dict[str, list[str]],
             attrs: dict[str, Any] | None = None) -> None:
        self.flush()
        self.block.append_op(op_type, inputs, outputs, {OP_ROLE_ATTR: 0, **(attrs or {})})

    def const(self, value: Any, dtype: str) -> str:
        key = (float(value), dtype)
        if key not in self.consts:
            name = self.fresh("const")
            self.block.create_var(name=name, shape=(1,), dtype=dtype, stop_gradient=True)
            self.emit("fill_constant", {}, {"Out": [name]}, {"shape": [1], "value": float(value), "dtype": dtype})
            self.consts[key] = name
        return self.consts[key]

    def single_use(self, a: _Atom) -> bool:
        return len(self.uses.get(a, [])) == 1

    def producer(self, a: _Atom) -> _Eqn | None:
        return self._producers.get(a)

    # values
    def var(self, a: _Atom) -> str:
        """The Fluid variable holding atom ``a`` (emitting a lazy value or a constant first)."""
        if a.is_literal:
            value = np.asarray(a.literal)
            if value.size == 1 and _dtype(a.aval) in FLOAT_DTYPES:
                return self.const(value.reshape(()).item(), _dtype(a.aval))
            raise CaptureError(f"a constant array of shape {list(value.shape)} reached a Fluid op",
                               hint="this is a bug of the capture front end; please report it")
        v = self.val.get(a)
        if isinstance(v, _Var):
            return v.name
        if a in self.pending_defs:
            self.flush()
            return self.val[a].name
        if isinstance(v, _Lazy):
            self.materialize(a, v)
            return self.var(a)
        raise CaptureError(f"internal error: a value ({a.aval.str_short()}, made by "
                           f"{getattr(self._producers.get(a), 'prim', '?')}) was used before it was defined "
                           f"(by equation {self.pos}: {self.eqns[self.pos].prim})")

    def materialize(self, a: _Atom, lazy: _Lazy) -> None:
        """Emit a lazy value where a consumer needs it as a variable."""
        del self.val[a]
        fe = lazy.fe
        if lazy.kind == "reduce_sum" and self.reduce("reduce_sum", fe):
            return
        if lazy.kind == "broadcast" and _same_numel(fe.ins[0].aval.shape, a.aval.shape) and \
                self.reshape_to(a, fe.ins[0], fe):
            return
        self.opaque_now(fe)

    def opaque_now(self, fe: _Eqn) -> None:
        """Emit ``fe`` as its own jax_function op (its lazy inputs first)."""
        for x in fe.ins:
            if not x.is_literal and isinstance(self.val.get(x), _Lazy):
                self.var(x)
        self.flush()
        self.add_pending(fe)
        self.flush()

    def add_pending(self, fe: _Eqn) -> None:
        for x in fe.ins:
            lazy = None if x.is_literal else self.val.get(x)
            if isinstance(lazy, _Lazy) and lazy.kind == "reduce_sum" and self.reduce("reduce_sum", lazy.fe):
                continue  # a Fluid reduce_sum: the run reads its output
            if isinstance(lazy, _Lazy):
                self.val.pop(x)
                self.add_pending(lazy.fe)  # computed inside the same opaque run
        self.pending.append(fe)
        for o in fe.outs:
            self.pending_defs.add(o)
            self.val.pop(o, None)

    def flush(self) -> None:
        """Emit the pending run of unmapped equations as one jax_function op."""
        if not self.pending:
            return
        run, self.pending = self.pending, []
        defs = set(self.pending_defs)
        self.pending_defs = set()
        inputs: list[_Atom] = []
        for fe in run:
            for x in fe.ins:
                if not x.is_literal and x not in defs and x not in inputs:
                    inputs.append(x)
        last_pos = max(fe.pos for fe in run)
        outputs = [o for fe in run for o in fe.outs
                   if self.last_use.get(o, -1) > last_pos or o in self.final]
        if not outputs:
            return
        for o in outputs:  # values inside an opaque op may have any dtype; variables may not
            if np.dtype(o.aval.dtype).name not in DTYPES:
                fe = self._producers[o]
                where = _eqn_location(self.fn, fe.eqn)
                raise CaptureError(f"unsupported dtype {o.aval.dtype} of a value that {_describe(fe)!r} makes"
                                   + (f" at {where}" if where else "") + " and later code reads",
                                   hint=f"Flotilla variables hold one of {list(DTYPES)}; convert it back "
                                        "before other operations read it")
        in_names = [self.var(x) for x in inputs]
        in_avals = [x.aval for x in inputs]
        symbolic_inside = any(_is_symbolic(o.aval.shape) for fe in run for o in fe.outs) or \
            any(fe.prim == "dim_as_value" for fe in run)
        if symbolic_inside and not any(_is_symbolic(av.shape) for av in in_avals):
            atom, name = self.batch_vars[0]  # brings the batch symbol into the sub-function's scope
            inputs.append(atom)
            in_names.append(name)
            in_avals.append(atom.aval)

        def sub(*args: Any) -> tuple[Any, ...]:
            env: dict[_Atom, Any] = dict(zip(inputs, args))

            def read(x: _Atom) -> Any:
                return x.literal if x.is_literal else env[x]

            for fe in run:
                params = fe.eqn.primitive.get_bind_params(fe.eqn.params)
                res = fe.eqn.primitive.bind(*[read(x) for x in fe.ins], **params)
                res = res if fe.eqn.primitive.multiple_results else [res]
                env.update(zip(fe.outs, res))
            return tuple(env[o] for o in outputs)

        specs = [jax.ShapeDtypeStruct(av.shape, av.dtype) for av in in_avals]
        try:
            exp = _export(sub, specs, self.platforms)
        except Exception as e:  # noqa: BLE001 - re-raised naming the user's code
            where = _eqn_location(self.fn, run[0].eqn) or "?"
            raise CaptureError(f"cannot export the equations {[_describe(fe) for fe in run]} at {where}: "
                               f"{type(e).__name__}: {e}") from e
        try:
            blob = base64.b64encode(bytes(exp.serialize(vjp_order=1))).decode("ascii")
        except ImportError as e:  # jax serializes exports with flatbuffers, an optional dependency of jax
            raise CaptureError(f"cannot serialize an opaque op: {e}", hint="pip install flatbuffers") from None
        out_names = [self.fresh("jax_function") for _ in outputs]
        for n, av in zip(out_names, exp.out_avals):
            self.block.create_var(name=n, shape=_fluid_shape(av.shape), dtype=_dtype(av))
        where = _eqn_location(self.fn, run[0].eqn) or ""
        self.block.append_op("jax_function", {"X": in_names}, {"Out": out_names}, {
            OP_ROLE_ATTR: 0, "exported": blob, "primitives": [_describe(fe) for fe in run],
            "out_dtypes": [_dtype(av) for av in exp.out_avals],
            "out_shapes": [format_shape(_fluid_shape(av.shape)) for av in exp.out_avals],
            "location": where.split(": ")[0]})
        for o, n in zip(outputs, out_names):
            self.val[o] = _Var(n)

    # conversion
    def run(self) -> str:
        self._producers = {o: fe for fe in self.eqns for o in fe.outs}
        self._find_patterns()
        self._compute_last_use()
        for i, fe in enumerate(self.eqns):
            self.pos = i
            if fe.skip:
                continue
            self.check(fe)
            if not self.convert(fe):
                self.add_pending(fe)
        self.flush()
        (loss,) = self.final
        return self.var(loss)

    def check(self, fe: _Eqn) -> None:
        where = _eqn_location(self.fn, fe.eqn)
        at = f" at {where}" if where else ""
        if fe.prim in _CONTROL_FLOW:
            return  # lax control flow is fine: it runs inside an opaque op
        if fe.eqn.effects:
            raise CaptureError(f"side effect in the captured function: primitive {fe.prim!r}{at}",
                               hint="remove prints, callbacks and other effects (jax.debug.*, io_callback) "
                                    "from the loss function")

    def convert(self, fe: _Eqn) -> bool:
        p = fe.prim
        if "softmax_axis" in fe.note:
            return self.softmax(fe)
        if p in _BINARY:
            return self.binary(fe)
        if p == "dot_general":
            return self.dot(fe)
        if p in _UNARY:
            return self.unary(_UNARY[p], fe)
        if p == "neg" and self._float(fe.ins[0]):
            x = self.var(fe.ins[0])
            out = self.out_var("scale", fe.outs[0].aval)
            self.emit("scale", {"X": [x]}, {"Out": [out]}, {"scale": -1.0, "bias": 0.0, "bias_after_scale": True})
            self.val[fe.outs[0]] = _Var(out)
            return True
        if p == "integer_pow" and fe.eqn.params["y"] == 2:
            return self.unary("square", fe)
        if p == "custom_jvp_call" and _call_name(fe) == "relu":
            return self.unary("relu", fe)
        if p == "broadcast_in_dim" and not fe.ins[0].is_literal:
            self.val[fe.outs[0]] = _Lazy("broadcast", fe, fe.ins[0])
            return True
        if p == "reduce_sum" and self._float(fe.ins[0]):
            self.val[fe.outs[0]] = _Lazy("reduce_sum", fe, fe.ins[0])
            return True
        if p == "reduce_max" and self._float(fe.ins[0]):
            return self.reduce("reduce_max", fe)
        if p == "dim_as_value":
            self.val[fe.outs[0]] = _Lazy("dim", fe, info={"dim": fe.eqn.params["dim"]})
            return True
        if p == "convert_element_type":
            src = fe.ins[0]
            lazy = self.val.get(src) if not src.is_literal else None
            if isinstance(lazy, _Lazy) and lazy.kind == "dim":
                self.val[fe.outs[0]] = _Lazy("dim", fe, info=dict(lazy.info))
                return True
            if not src.is_literal and _dtype(src.aval) in DTYPES and _dtype(fe.outs[0].aval) in DTYPES:
                if _dtype(src.aval) == _dtype(fe.outs[0].aval):
                    self.val[fe.outs[0]] = _Var(self.var(src))
                    return True
                return self.cast(fe)
            return False
        if p == "transpose" and not fe.ins[0].is_literal:
            x = self.var(fe.ins[0])
            if len(self.fshape(x)) != len(fe.ins[0].aval.shape):
                return False
            out = self.out_var("transpose", fe.outs[0].aval)
            self.emit("transpose", {"X": [x]}, {"Out": [out]}, {"axis": [int(d) for d in fe.eqn.params["permutation"]]})
            self.val[fe.outs[0]] = _Var(out)
            return True
        if p in ("reshape", "squeeze", "expand_dims") and not fe.ins[0].is_literal:
            return self.reshape_to(fe.outs[0], fe.ins[0], fe)
        if p == "concatenate" and all(not x.is_literal for x in fe.ins):
            names = [self.var(x) for x in fe.ins]
            if any(len(self.fshape(n)) != len(fe.outs[0].aval.shape) for n in names):
                return False
            out = self.out_var("concat", fe.outs[0].aval)
            self.emit("concat", {"X": names}, {"Out": [out]}, {"axis": int(fe.eqn.params["dimension"])})
            self.val[fe.outs[0]] = _Var(out)
            return True
        if p == "gather" and "table_ids" in fe.note:
            return self.lookup(fe)
        return False

    def _float(self, a: _Atom) -> bool:
        return not a.is_literal and _dtype(a.aval) in FLOAT_DTYPES

    def unary(self, op_type: str, fe: _Eqn) -> bool:
        if not self._float(fe.ins[0]):
            return False
        x = self.var(fe.ins[0])
        out = self.out_var(op_type, fe.outs[0].aval)
        self.emit(op_type, {"X": [x]}, {"Out": [out]})
        self.val[fe.outs[0]] = _Var(out)
        return True

    def cast(self, fe: _Eqn) -> bool:
        x = self.var(fe.ins[0])
        out = self.out_var("cast", fe.outs[0].aval)
        self.emit("cast", {"X": [x]}, {"Out": [out]},
                  {"in_dtype": self.block.var(x).dtype, "out_dtype": _dtype(fe.outs[0].aval)})
        self.val[fe.outs[0]] = _Var(out)
        return True

    def reshape_to(self, out_atom: _Atom, src: _Atom, fe: _Eqn) -> bool:
        shape = _fluid_shape(out_atom.aval.shape)
        if sum(1 for d in shape if d < 0) > 1 or 0 in shape:
            return False
        x = self.var(src)
        out = self.out_var("reshape", out_atom.aval)
        self.emit("reshape", {"X": [x]}, {"Out": [out]}, {"shape": list(shape)})
        self.val[out_atom] = _Var(out)
        return True

    def reduce(self, op_type: str, fe: _Eqn) -> bool:
        src = fe.ins[0]
        axes = [int(d) for d in fe.eqn.params["axes"]]
        rank = len(src.aval.shape)
        x = self.var(src)
        if len(self.fshape(x)) != rank or not axes:
            return False
        every = sorted(axes) == list(range(rank))
        out = self.out_var(op_type, fe.outs[0].aval)
        self.emit(op_type, {"X": [x]}, {"Out": [out]},
                  {"dim": axes, "keep_dim": False, "reduce_all": every})
        self.val[fe.outs[0]] = _Var(out)
        return True

    def binary(self, fe: _Eqn) -> bool:
        p = fe.prim
        a, b = fe.ins
        out_aval = fe.outs[0].aval
        dtype = _dtype(out_aval)
        if dtype not in FLOAT_DTYPES:
            return False
        # mean / reduce_mean: reduce_sum(x) / count
        if p == "div" and not a.is_literal and isinstance(self.val.get(a), _Lazy) and \
                self.val[a].kind == "reduce_sum" and self.single_use(a):
            lazy = self.val[a]
            count = _count(lazy.src.aval.shape, lazy.fe.eqn.params["axes"])
            bl = self.val.get(b) if not b.is_literal else None
            if (b.is_literal and count is not None and not _is_symbolic([count]) and
                    float(np.asarray(b.literal)) == float(count)) or \
                    (isinstance(bl, _Lazy) and bl.kind == "dim" and _dim_equal(bl.info["dim"], count)):
                del self.val[a]
                axes = [int(d) for d in lazy.fe.eqn.params["axes"]]
                x = self.var(lazy.src)
                if len(self.fshape(x)) == len(lazy.src.aval.shape):
                    if sorted(axes) == list(range(len(lazy.src.aval.shape))):
                        out = self.out_var("mean", out_aval)
                        self.emit("mean", {"X": [x]}, {"Out": [out]})
                    else:
                        out = self.out_var("reduce_mean", out_aval)
                        self.emit("reduce_mean", {"X": [x]}, {"Out": [out]},
                                  {"dim": axes, "keep_dim": False, "reduce_all": False})
                    self.val[fe.outs[0]] = _Var(out)
                    return True
                self.val[a] = lazy
        if p == "div" and self._keepdims_mean(fe):
            return True
        if a.is_literal and b.is_literal:
            return False
        # scalar literal operand
        for lit, other, left in ((b, a, False), (a, b, True)):
            if lit.is_literal and np.asarray(lit.literal).size == 1:
                v = float(np.asarray(lit.literal).reshape(()))
                x = self.var(other)
                if tuple(self.fshape(x)) != _fluid_shape(out_aval.shape) and \
                        not (out_aval.shape == () and self.fshape(x) in ((), (1,))):
                    return False
                attrs = None
                if p == "add":
                    attrs = {"scale": 1.0, "bias": v}
                elif p == "sub":
                    attrs = {"scale": -1.0, "bias": v} if left else {"scale": 1.0, "bias": -v}
                elif p == "mul":
                    attrs = {"scale": v, "bias": 0.0}
                if attrs is not None:
                    out = self.out_var("scale", out_aval)
                    self.emit("scale", {"X": [x]}, {"Out": [out]}, {**attrs, "bias_after_scale": True})
                    self.val[fe.outs[0]] = _Var(out)
                    return True
                if left:
                    return False  # c / x, max(c, x) as Fluid ops would put the constant first
                c = self.const(v, dtype)
                out = self.out_var(_BINARY[p], out_aval)
                self.emit(_BINARY[p], {"X": [x], "Y": [c]}, {"Out": [out]}, {"axis": -1})
                self.val[fe.outs[0]] = _Var(out)
                return True
        if a.is_literal or b.is_literal:
            return False
        out_shape = tuple(out_aval.shape)
        order = [(a, b)] + ([(b, a)] if p in _COMMUTATIVE else [])
        for x_atom, y_atom in order:
            if tuple(x_atom.aval.shape) != out_shape or isinstance(self.val.get(x_atom), _Lazy):
                continue
            yl = self.val.get(y_atom)
            if isinstance(yl, _Lazy) and yl.kind == "broadcast":
                bdims = [int(d) for d in yl.fe.eqn.params["broadcast_dimensions"]]
                src = yl.src
                if bdims == list(range(bdims[0], bdims[0] + len(bdims))) if bdims else True:
                    y_name = self.var(src)
                    x_name = self.var(x_atom)
                    ys = self.fshape(y_name)
                    if len(self.fshape(x_name)) == len(out_shape) and (len(ys) == len(bdims) or
                                                                       (not bdims and ys in ((), (1,)))):
                        axis = bdims[0] if bdims else -1
                        return self._emit_binary(fe, x_name, y_name, axis)
                continue
            x_name, y_name = self.var(x_atom), self.var(y_atom)
            xs, ys = self.fshape(x_name), self.fshape(y_name)
            if len(xs) == len(out_shape) and len(ys) <= len(xs) and _fluid_bcast_ok(xs, ys):
                return self._emit_binary(fe, x_name, y_name, -1)
            if out_shape == () and xs in ((), (1,)) and ys in ((), (1,)):
                return self._emit_binary(fe, x_name, y_name, -1)
        return False

    def _keepdims_mean(self, fe: _Eqn) -> bool:
        """``broadcast_in_dim(reduce_sum(x, axes)) / count`` (``jnp.mean(..., keepdims=True)``) →
        ``reduce_mean`` with ``keep_dim``."""
        a, b = fe.ins
        bc = None if a.is_literal else self.val.get(a)
        if not (isinstance(bc, _Lazy) and bc.kind == "broadcast" and self.single_use(a) and b.is_literal):
            return False
        red = None if bc.src.is_literal else self.val.get(bc.src)
        if not (isinstance(red, _Lazy) and red.kind == "reduce_sum" and self.single_use(bc.src)):
            return False
        src, axes = red.src, [int(d) for d in red.fe.eqn.params["axes"]]
        count = _count(src.aval.shape, axes)
        kept = tuple(1 if i in axes else d for i, d in enumerate(src.aval.shape))
        if _is_symbolic([count]) or float(np.asarray(b.literal)) != float(count) or \
                tuple(a.aval.shape) != kept or len(axes) == len(src.aval.shape):
            return False
        x = self.var(src)
        if len(self.fshape(x)) != len(src.aval.shape):
            return False
        del self.val[a], self.val[bc.src]
        out = self.out_var("reduce_mean", fe.outs[0].aval)
        self.emit("reduce_mean", {"X": [x]}, {"Out": [out]}, {"dim": axes, "keep_dim": True, "reduce_all": False})
        self.val[fe.outs[0]] = _Var(out)
        return True

    def _emit_binary(self, fe: _Eqn, x: str, y: str, axis: int) -> bool:
        op_type = _BINARY[fe.prim]
        out = self.out_var(op_type, fe.outs[0].aval)
        self.emit(op_type, {"X": [x], "Y": [y]}, {"Out": [out]}, {"axis": axis})
        self.val[fe.outs[0]] = _Var(out)
        return True

    def dot(self, fe: _Eqn) -> bool:
        a, b = fe.ins
        if not (self._float(a) and self._float(b)):
            return False
        pet = fe.eqn.params.get("preferred_element_type")
        if pet is not None and np.dtype(pet) != np.dtype(a.aval.dtype):
            return False
        if np.dtype(a.aval.dtype) != np.dtype(b.aval.dtype):
            return False
        (lc, rc), (lb, rb) = fe.eqn.params["dimension_numbers"]
        lc, rc, lb, rb = (tuple(int(d) for d in t) for t in (lc, rc, lb, rb))
        n, m = len(a.aval.shape), len(b.aval.shape)
        x, y = self.var(a), self.var(b)
        if len(self.fshape(x)) != n or len(self.fshape(y)) != m:
            return False
        if not lb and not rb and lc == (n - 1,) and rc == (0,) and m == 2:
            out = self.out_var("mul", fe.outs[0].aval)
            self.emit("mul", {"X": [x], "Y": [y]}, {"Out": [out]}, {"x_num_col_dims": n - 1, "y_num_col_dims": 1})
        elif lb == rb == tuple(range(n - 2)) and n == m and n >= 2 and lc in ((n - 1,), (n - 2,)) \
                and rc in ((m - 2,), (m - 1,)):
            out = self.out_var("matmul", fe.outs[0].aval)
            self.emit("matmul", {"X": [x], "Y": [y]}, {"Out": [out]},
                      {"transpose_X": lc == (n - 2,), "transpose_Y": rc == (m - 1,), "alpha": 1.0})
        else:
            return False
        self.val[fe.outs[0]] = _Var(out)
        return True

    def lookup(self, fe: _Eqn) -> bool:
        table = self.var(fe.ins[0])
        ids_atom = fe.note["table_ids"]
        ids = self.var(ids_atom)
        if self.block.var(ids).dtype != "int64":
            cast = self.fresh("cast")
            self.block.create_var(name=cast, shape=self.fshape(ids), dtype="int64", stop_gradient=True)
            self.emit("cast", {"X": [ids]}, {"Out": [cast]},
                      {"in_dtype": self.block.var(ids).dtype, "out_dtype": "int64"})
            ids = cast
        shape = self.fshape(ids)
        if fe.note.get("append_unit") or (len(shape) > 1 and shape[-1] == 1):
            # lookup_table drops a trailing unit dim of Ids: give it one to drop
            unit = self.fresh("reshape")
            self.block.create_var(name=unit, shape=tuple(shape) + (1,), dtype="int64", stop_gradient=True)
            self.emit("reshape", {"X": [ids]}, {"Out": [unit]}, {"shape": [d if d >= 0 else -1 for d in shape] + [1]})
            ids = unit
        out = self.out_var("lookup_table", fe.outs[0].aval)
        dist = table in self.distributed
        self.emit("lookup_table", {"W": [table], "Ids": [ids]}, {"Out": [out]},
                  {"is_sparse": True, "is_distributed": dist, "padding_idx": -1})
        self.val[fe.outs[0]] = _Var(out)
        return True

    def softmax(self, fe: _Eqn) -> bool:
        x = self.var(fe.note["softmax_x"])
        out = self.out_var("softmax", fe.outs[0].aval)
        self.emit("softmax", {"X": [x]}, {"Out": [out]}, {"axis": fe.note["softmax_axis"]})
        self.val[fe.outs[0]] = _Var(out)
        return True

    # patterns found before conversion
    def _find_patterns(self) -> None:
        params = {a for a, name in self.param_atoms.items()}
        for fe in self.eqns:
            if fe.prim == "gather":
                self._table_gather(fe, params)
            elif fe.prim == "div":
                self._softmax_pattern(fe)

    def _table_gather(self, fe: _Eqn, params: set[_Atom]) -> None:
        operand, idx = fe.ins
        if operand not in params or len(operand.aval.shape) != 2 or idx.is_literal:
            return
        dn = fe.eqn.params["dimension_numbers"]
        rank = len(idx.aval.shape)
        if tuple(dn.offset_dims) != (rank - 1,) or tuple(dn.collapsed_slice_dims) != (0,) or \
                tuple(dn.start_index_map) != (0,) or tuple(dn.operand_batching_dims) or \
                tuple(fe.eqn.params["slice_sizes"]) != (1, operand.aval.shape[1]) or idx.aval.shape[-1] != 1:
            return
        ids, doomed = idx, []
        bc = self.producer(idx)
        if bc is not None and bc.prim == "broadcast_in_dim" and self.single_use(idx) and \
                _same_numel(bc.ins[0].aval.shape, idx.aval.shape) and not bc.ins[0].is_literal:
            ids, doomed = bc.ins[0], [bc]
            sel = self.producer(ids)
            # jnp's index normalisation: select_n(ids < 0, ids, ids + rows)
            if sel is not None and sel.prim == "select_n" and self.single_use(ids) and len(sel.ins) == 3:
                pred, raw, wrapped = sel.ins
                lt, add = self.producer(pred), self.producer(wrapped)
                if lt is not None and add is not None and lt.prim == "lt" and add.prim == "add" and \
                        lt.ins[0] is raw and add.ins[0] is raw and self.single_use(pred) and self.single_use(wrapped):
                    ids, doomed = raw, doomed + [sel, lt, add]
        for d in doomed:
            d.skip = True
        fe.note["table_ids"] = ids
        fe.note["append_unit"] = ids is not idx and len(ids.aval.shape) > 0 and ids.aval.shape[-1] == 1

    def _softmax_pattern(self, fe: _Eqn) -> None:
        e, rb = fe.ins
        get = self.producer
        try:
            ex, rbe = get(e), get(rb)
            _need(ex.prim == "exp" and rbe.prim == "broadcast_in_dim")
            r = get(rbe.ins[0])
            _need(r.prim == "reduce_sum" and r.ins[0] is e)
            s = get(ex.ins[0])
            _need(s.prim == "sub")
            x, sg_atom = s.ins
            sg = get(sg_atom)
            _need(sg.prim == "stop_gradient")
            bc = get(sg.ins[0])
            _need(bc.prim == "broadcast_in_dim")
            m2 = get(bc.ins[0])
            _need(m2.prim == "max")
            m = get(m2.ins[1]) if m2.ins[0].is_literal else get(m2.ins[0])
            _need(m.prim == "reduce_max" and m.ins[0] is x)
            axes = tuple(m.eqn.params["axes"])
            _need(len(axes) == 1 and tuple(r.eqn.params["axes"]) == axes)
            chain = [rbe, r, ex, s, sg, bc, m2, m]
            _need(len(self.uses.get(e, [])) == 2 and all(
                self.single_use(o) for c in chain if c is not ex for o in c.outs))
            _need(self._float(x))
        except (_NoMatch, AttributeError, KeyError, TypeError, ValueError):
            return
        for c in chain:
            c.skip = True
        fe.note["softmax_x"] = x
        fe.note["softmax_axis"] = int(axes[0])

    param_atoms: dict[_Atom, str] = {}


def _call_name(fe: _Eqn) -> str | None:
    """The function name of a call-like equation (jit, custom_jvp_call, custom_vjp_call), or None."""
    if "name" in fe.eqn.params:
        return str(fe.eqn.params["name"])
    for key in ("call_jaxpr", "fun_jaxpr", "jaxpr"):
        sub = fe.eqn.params.get(key)
        info = getattr(getattr(sub, "jaxpr", sub), "debug_info", None)
        src = getattr(info, "func_src_info", None)
        if src:
            return str(src).split(" ")[0]
    return None


def _describe(fe: _Eqn) -> str:
    name = _call_name(fe) if fe.prim in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call") else None
    return f"{fe.prim}[{name}]" if name else fe.prim


def _same_numel(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Equal element counts, treating shapes as multisets of extents besides unit dims."""
    return sorted([str(d) for d in a if not (isinstance(d, int) and d == 1)]) == \
        sorted([str(d) for d in b if not (isinstance(d, int) and d == 1)])


def _count(shape: Sequence[Any], axes: Sequence[int]) -> Any:
    c: Any = 1
    for ax in axes:
        c = c * shape[ax]
    return c


def _dim_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - symbolic comparison may be inconclusive
        return False


def _fluid_bcast_ok(x: Sequence[int], y: Sequence[int]) -> bool:
    start = len(x) - len(y)
    return all(d == 1 or d == x[start + i] for i, d in enumerate(y))


def _export(fn: Callable[..., Any], specs: list[Any], platforms: tuple[str, ...] | None) -> Any:
    if platforms:
        return jax.export.export(jax.jit(fn), platforms=platforms)(*specs)
    return jax.export.export(jax.jit(fn))(*specs)


# --- naming and values --------------------------------------------------------------------------------
def _path_name(path: Sequence[Any], default: str) -> str:
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts) or default


def leaf_names(tree: Any, default: str = "param") -> list[tuple[str, Any]]:
    """``(name, leaf)`` for every leaf of ``tree``, named by pytree path as capture names parameters."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(_path_name(path, default), leaf) for path, leaf in flat]


def _leaves(tree: Any, what: str, default: str) -> list[tuple[str, np.ndarray]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, leaf in flat:
        name = _path_name(path, default)
        arr = np.asarray(leaf)
        if arr.dtype.name not in DTYPES:
            raise CaptureError(f"{what} leaf {name!r} has unsupported dtype {arr.dtype}",
                               hint=f"Flotilla variables hold one of {list(DTYPES)}")
        out.append((name, arr))
    names = [n for n, _ in out]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise CaptureError(f"two {what} leaves are both named {dup!r} by their pytree paths")
    return out


def _archive(items: list[tuple[str, np.ndarray]], param_dir: str | None) -> str:
    """Write the initial values into a content-addressed archive and return its path (the same values
    give the same path, so every process of a job and every capture of the same model share it)."""
    digest = hashlib.sha256()
    for name, value in items:
        digest.update(name.encode() + b"\0" + value.dtype.name.encode() + str(value.shape).encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    directory = param_dir or os.path.join(tempfile.gettempdir(), "flotilla_capture")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"params-{digest.hexdigest()[:24]}.flt")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        write_archive(tmp, items)
        os.replace(tmp, path)  # atomic: concurrent captures never see half a file
    return path


# --- the entry point ----------------------------------------------------------------------------------
def capture(fn: Callable[[Any, Any], Any], params: Any, example_batch: Any, optimizer: Any = None, *,
            distributed: Sequence[str] = (), param_dir: str | None = None,
            platforms: Sequence[str] | None = None,
            main_program: Program | None = None, startup_program: Program | None = None,
            ) -> tuple[Program, Program, Variable]:
    """Capture ``fn(params, batch) -> scalar loss`` as ``(main, startup, loss)``; see the module docstring.

    ``distributed`` names embedding parameters (pytree paths) to declare as distributed lookup tables;
    ``param_dir`` is where the initial values are written (default: the system temp dir);
    ``platforms`` are the jax.export platforms of opaque ops (default: this process's backend).
    ``optimizer.minimize(loss)`` is called on the built program when an optimizer is given.

    ``fn`` is traced in the caller's JAX configuration, which Flotilla leaves alone (so a float32 model
    computes in float32, as when the user calls it), or with 64-bit types when a parameter or batch leaf
    is 64-bit (its variable is declared 64-bit, and the program honours that).

    Exporting opaque ops starts JAX's backend; a collective (nccl2) trainer must therefore join its
    group first (``runtime.collective.join_group(rank, endpoints)``; the startup program's
    ``gen_nccl_id`` then finds that group), as before anything else that runs JAX.
    """
    param_leaves = _leaves(params, "parameter", "param")
    batch_leaves = _leaves(example_batch, "batch", "batch")
    clash = {n for n, _ in param_leaves} & {n for n, _ in batch_leaves}
    if clash:
        raise CaptureError(f"parameter and batch leaves share the names {sorted(clash)}",
                           hint="rename a key of params or of the batch")
    if not batch_leaves or any(a.ndim == 0 for _, a in batch_leaves):
        raise CaptureError("every batch leaf needs a leading batch dimension",
                           hint="pass example arrays of shape [batch, ...]")
    unknown = set(distributed) - {n for n, _ in param_leaves}
    if unknown:
        raise CaptureError(f"distributed names unknown parameters {sorted(unknown)}")
    (sym,) = jax.export.symbolic_shape(BATCH_SYMBOL)
    p_specs = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), params)
    b_specs = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((sym,) + np.shape(x)[1:], np.asarray(x).dtype), example_batch)
    # A 64-bit leaf declares a 64-bit variable: trace and export under JAX's 64-bit types (runtime.x64) so
    # the declared dtypes hold. Otherwise trace in the caller's configuration: the program then computes
    # what ``fn`` computes when the user calls it (float32 for an untyped jnp.zeros, unless they enabled x64).
    precision = x64 if any(a.dtype.itemsize == 8 for _, a in param_leaves + batch_leaves) else contextlib.nullcontext
    with precision():
        closed = _trace(fn, p_specs, b_specs)
    if len(closed.out_avals) != 1:
        raise CaptureError(f"the function returns {len(closed.out_avals)} values; expected one scalar loss",
                           hint="return only the loss (auxiliary outputs are not captured)")
    out_aval = closed.out_avals[0]
    if _is_symbolic(out_aval.shape) or int(np.prod(out_aval.shape)) != 1 or \
            _dtype(out_aval) not in FLOAT_DTYPES:
        raise CaptureError(f"the function returns a {out_aval.str_short()}; expected a scalar float loss",
                           hint="reduce the loss to a scalar, e.g. with jnp.mean")

    main = main_program or Program()
    startup = startup_program or Program()
    block, sblock = main.global_block(), startup.global_block()
    in_atoms = [_Atom(v.aval) for v in closed.jaxpr.invars]
    n_params = len(param_leaves)
    path = _archive(param_leaves, param_dir)
    for (name, value), atom in zip(param_leaves, in_atoms[:n_params]):
        for blk in (block, sblock):
            blk.create_parameter(name, value.shape, value.dtype.name, is_distributed=name in distributed,
                                 trainable=value.dtype.name in FLOAT_DTYPES)
        sblock.append_op("load_value", {}, {"Out": [name]}, {"file_path": path, "var_name": name, OP_ROLE_ATTR: 0})
    batch_vars = []
    for (name, value), atom in zip(batch_leaves, in_atoms[n_params:]):
        block.create_var(name=name, shape=(-1,) + value.shape[1:], dtype=value.dtype.name,
                         stop_gradient=True, is_data=True)
        batch_vars.append((atom, name))
    eqns: list[_Eqn] = []
    const_atoms = [_Atom(v.aval) for v in closed.jaxpr.constvars]
    outs = _flatten(closed.jaxpr, in_atoms, const_atoms, eqns)
    conv = _Converter(fn, main, eqns, outs, batch_vars, tuple(platforms) if platforms else None,
                      frozenset(distributed))
    conv.param_atoms = {a: n for (n, _), a in zip(param_leaves, in_atoms)}
    for (name, _), atom in zip(param_leaves, in_atoms):
        conv.val[atom] = _Var(name)
    for atom, name in batch_vars:
        conv.val[atom] = _Var(name)
    if const_atoms:
        consts = [(f"capture_const_{i}", np.asarray(c)) for i, c in enumerate(closed.consts)]
        cpath = _archive(consts, param_dir)
        for (name, value), atom in zip(consts, const_atoms):
            for blk in (block, sblock):
                blk.create_var(name=name, shape=value.shape, dtype=value.dtype.name, persistable=True,
                               stop_gradient=True)
            sblock.append_op("load_value", {}, {"Out": [name]}, {"file_path": cpath, "var_name": name, OP_ROLE_ATTR: 0})
            conv.val[atom] = _Var(name)
    with precision():
        loss_name = conv.run()  # exports opaque sub-functions: in the trace's precision
    loss = block.var(loss_name)
    tables = {n for op in block.ops if op.type == "lookup_table" for n in op.input("W")}
    if set(distributed) - tables:
        raise CaptureError(f"distributed names {sorted(set(distributed) - tables)}, which no row gather "
                           f"(params[name][ids]) reads", hint="a distributed table must be read only by gathering "
                                                             "its rows")
    dense = sorted({n for op in block.ops if op.type != "lookup_table" for n in op.input_arg_names} & set(distributed))
    if dense:
        raise CaptureError(f"distributed table(s) {dense} are also read whole (not only by row gathers)",
                           hint="a distributed table lives split over the pservers: read it only as params[name][ids]")
    if optimizer is not None:
        with program_guard(main, startup):
            optimizer.minimize(loss, startup_program=startup)
    return main, startup, loss


_TRACER_ERRORS = {
    "TracerBoolConversionError": "Python control flow on a traced value (if/while/and/or/bool())",
    "ConcretizationTypeError": "a traced value used where a concrete Python value is needed",
    "TracerIntegerConversionError": "a traced value converted to a Python int (indexing, range())",
    "TracerArrayConversionError": "a traced value converted to a NumPy array",
    "UnexpectedTracerError": "a side effect: a traced value escaped the function",
}


def _trace(fn: Callable[..., Any], p_specs: Any, b_specs: Any) -> Any:
    try:
        return jax.make_jaxpr(fn)(p_specs, b_specs)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - every tracing failure becomes one clear CaptureError
        kind = type(e).__name__
        construct = _TRACER_ERRORS.get(kind)
        frames = [(f.filename, f.lineno) for f in traceback.extract_tb(e.__traceback__)]
        where = _user_frame(fn, frames)
        name = getattr(fn, "__qualname__", repr(fn))
        if construct is None:
            construct = f"{kind}: {str(e).splitlines()[0] if str(e) else ''}"
        raise CaptureError(f"cannot capture {name}: {construct}" + (f" at {where}" if where else ""),
                           hint="use jax.lax.cond / jnp.where / lax.fori_loop instead of Python control flow on "
                                "traced values; keep the loss function pure") from None
