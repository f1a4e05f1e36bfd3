"""Reverse-mode autodiff on the IR: ``append_backward`` (Fluid 1.5's ``fluid.backward.append_backward``).

Given a loss variable of a program's global block, append the ops computing ``NAME@GRAD`` for every
parameter that reaches the loss:

1. The op path: the forward ops (up to the loss's last writer) an output of which leads to the loss,
   not following inputs in the no-grad set (the caller's ``no_grad_set``, every ``stop_gradient``
   variable — data layers, non-trainable parameters — and, with ``parameter_list``, every parameter
   not listed).
2. Which gradients are wanted: a float variable not in the no-grad set is *differentiable* when it is
   a leaf of the path or an output of a path op that has a gradient and a differentiable input.
   Integer and bool variables never get gradients; ops without a gradient (``NO_GRAD``) stop the flow.
3. ``loss@GRAD`` = ``fill_constant`` 1.0 of the loss's shape, role Backward|Loss (257); the loss's
   producer gets role Forward|Loss (256). Then the grad ops from each op's registered gradient maker
   (``get_op_def(t).make_grad(op)``), in reverse order of the path, role Backward (1), where:
   - grad outputs of non-differentiable inputs are left out (a slot dropped; inside a duplicable slot
     where some are wanted, the others become ``@EMPTY@``, Fluid's empty name);
   - grad inputs nobody produces are left out (their slots are dispensable); inside a duplicable
     slot where some exist, the missing ones are made by ``fill_zeros_like``;
   - a grad op that produces nothing wanted, or that receives no output gradient at all, is dropped.
4. A gradient written by several grad ops is accumulated as Fluid does: the writers write
   ``x@GRAD@RENAME@0``, ``x@GRAD@RENAME@1``… and a ``sum`` writes ``x@GRAD`` before its first reader
   (or at the end).
5. Gradient variables are created with the forward variable's shape and dtype, then the grad op's
   shape inference sets them (``selected_rows`` for a sparse ``lookup_table``'s W@GRAD).
6. The op that finally writes each parameter's gradient gets ``op_role_var = [param, param@GRAD]``
   (prepended to any pairs it already has).

``append_backward`` returns ``(Parameter, gradient Variable)`` pairs in the program order of the
parameters (block variable order, as Fluid's ``all_parameters``), for trainable parameters (or the
``parameter_list``) whose gradient was produced. Only the global block is differentiated.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ir.core import Block, Operator, Parameter, Program, Variable, default_main_program, infer_op
from ir.errors import IRError
from ir.names import EMPTY_VAR_NAME, grad_name
from ir.ops.registry import FLOAT_DTYPES, get_op_def
from ir.roles import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OpRole

RENAME_INFIX = "@RENAME@"

Callback = Callable[..., None]


@dataclass
class _GradOp:
    """A grad op being assembled (mutable until appended)."""

    type: str
    inputs: dict[str, list[str]]
    outputs: dict[str, list[str]]
    attrs: dict[str, Any]
    # grad name of a forward output → that output (what this op may read)
    grad_inputs: dict[str, str] = field(default_factory=dict)
    # grad name of a forward input → that input (what this op may write)
    grad_outputs: dict[str, str] = field(default_factory=dict)

    def rename(self, old: str, new: str) -> None:
        for table in (self.inputs, self.outputs):
            for slot, names in table.items():
                table[slot] = [new if n == old else n for n in names]


def _names(values: Iterable[Any] | None, what: str) -> set[str]:
    out: set[str] = set()
    for v in values or ():
        if isinstance(v, Variable):
            out.add(v.name)
        elif isinstance(v, str):
            out.add(v)
        else:
            raise IRError(f"append_backward: {what} must hold Variables or names, got {type(v).__name__} {v!r}")
    return out


def _is_float(block: Block, name: str) -> bool:
    var = block.find_var_recursive(name)
    return var is not None and var.dtype in FLOAT_DTYPES


def _op_path(ops: Sequence[Operator], loss: str, no_grad: set[str]) -> list[Operator]:
    """Ops an output of which leads to ``loss``, in program order."""
    wanted = {loss}
    keep: list[Operator] = []
    for op in reversed(ops):
        if any(n in wanted for n in op.output_arg_names):
            keep.append(op)
            wanted.update(n for n in op.input_arg_names if n not in no_grad)
    keep.reverse()
    return keep


def _differentiable(block: Block, path: Sequence[Operator], no_grad: set[str]) -> tuple[set[str], list[Operator]]:
    """The variables whose gradients are wanted, and the path ops that get grad ops."""
    produced: set[str] = set()
    diff: set[str] = set()
    active: list[Operator] = []
    for op in path:
        for n in op.input_arg_names:
            if n not in produced and n not in no_grad and _is_float(block, n):
                diff.add(n)
        if get_op_def(op.type).has_grad and any(n in diff for n in op.input_arg_names):
            active.append(op)
            diff.update(n for n in op.output_arg_names if n not in no_grad and _is_float(block, n))
        produced.update(op.output_arg_names)
    return diff, active


def _grad_ops_of(op: Operator) -> list[_GradOp]:
    grad_in = {grad_name(n): n for n in op.output_arg_names}
    grad_out = {grad_name(n): n for n in op.input_arg_names}
    out = []
    for spec in get_op_def(op.type).make_grad(op):
        attrs = dict(spec.attrs)
        attrs[OP_ROLE_ATTR] = int(OpRole.BACKWARD)
        attrs[OP_ROLE_VAR_ATTR] = []
        out.append(_GradOp(spec.type, {k: list(v) for k, v in spec.inputs.items()},
                           {k: list(v) for k, v in spec.outputs.items()}, attrs, grad_in, grad_out))
    return out


class _Builder:
    """Prunes, renames and accumulates the grad ops, in backward order."""

    def __init__(self, block: Block, diff: set[str], available: set[str]) -> None:
        self.block = block
        self.diff = diff
        self.available = set(available)  # gradients produced so far (original names)
        self.emitted: list[_GradOp] = []
        self.partials: dict[str, list[str]] = {}  # grad name → names written in the current generation
        self.rename_count: defaultdict[str, int] = defaultdict(int)
        self.grad_to_var: dict[str, str] = {}  # every grad (or partial) name → its forward variable

    def add(self, g: _GradOp) -> None:
        if not self._prune_outputs(g) or not self._prune_inputs(g):
            return
        self._accumulate_reads(g)
        self._rename_writes(g)
        self.emitted.append(g)

    def _prune_outputs(self, g: _GradOp) -> bool:
        """Keep only wanted gradients; False if none is left."""
        had_grad_output = any(n in g.grad_outputs for names in g.outputs.values() for n in names)
        for slot in list(g.outputs):
            names = g.outputs[slot]
            wanted = [n not in g.grad_outputs or g.grad_outputs[n] in self.diff for n in names]
            if not any(wanted):
                del g.outputs[slot]
            elif not all(wanted):
                g.outputs[slot] = [n if w else EMPTY_VAR_NAME for n, w in zip(names, wanted)]
        kept = [n for names in g.outputs.values() for n in names if n != EMPTY_VAR_NAME]
        for n in kept:
            if n in g.grad_outputs:
                self.grad_to_var[n] = g.grad_outputs[n]
        # An op that only makes temporaries for a later grad op of the same maker is kept.
        return bool(kept) and (had_grad_output is False or any(n in g.grad_outputs for n in kept))

    def _prune_inputs(self, g: _GradOp) -> bool:
        """Drop output gradients nobody produced; False if the op receives none at all."""
        had_grad_input = False
        for slot in list(g.inputs):
            names = g.inputs[slot]
            missing = [n in g.grad_inputs and n not in self.available for n in names]
            had_grad_input = had_grad_input or any(n in g.grad_inputs for n in names)
            if names and all(missing):
                del g.inputs[slot]
            elif any(missing):
                for n, m in zip(names, missing):
                    if m:
                        self._fill_zeros(n, g.grad_inputs[n])
        if had_grad_input and not any(n in g.grad_inputs for names in g.inputs.values() for n in names):
            return False
        return True

    def _fill_zeros(self, name: str, forward: str) -> None:
        zeros = _GradOp("fill_zeros_like", {"X": [forward]}, {"Out": [name]},
                        {OP_ROLE_ATTR: int(OpRole.BACKWARD)}, {}, {name: forward})
        self.grad_to_var[name] = forward
        self._rename_writes(zeros)
        self.emitted.append(zeros)

    def _accumulate_reads(self, g: _GradOp) -> None:
        for names in g.inputs.values():
            for n in names:
                if len(self.partials.get(n, ())) > 1:
                    self._emit_sum(n)

    def _emit_sum(self, name: str) -> None:
        parts = self.partials[name]
        self.emitted.append(_GradOp("sum", {"X": list(parts)}, {"Out": [name]},
                                    {OP_ROLE_ATTR: int(OpRole.BACKWARD)}))
        self.partials[name] = [name]

    def _fresh(self, name: str) -> str:
        new = f"{name}{RENAME_INFIX}{self.rename_count[name]}"
        self.rename_count[name] += 1
        self.grad_to_var[new] = self.grad_to_var.get(name, name)
        return new

    def _rename_writes(self, g: _GradOp) -> None:
        reads = {n for names in g.inputs.values() for n in names}
        for slot in list(g.outputs):
            for i, n in enumerate(list(g.outputs[slot])):
                if n == EMPTY_VAR_NAME or n in reads:  # nothing written, or an in-place grad op
                    continue
                parts = self.partials.get(n)
                if not parts:
                    self.partials[n] = [n]
                else:
                    if len(parts) == 1:
                        first = self._fresh(n)
                        # The first writer (and any reader since) move to a partial name; earlier
                        # positions of this very op that wrote n are among them.
                        for op in self.emitted:
                            op.rename(n, first)
                        for s2, names2 in g.outputs.items():
                            g.outputs[s2] = [first if (x == n and (s2, j) < (slot, i)) else x
                                             for j, x in enumerate(names2)]
                        parts[0] = first
                    new = self._fresh(n)
                    g.outputs[slot][i] = new
                    parts.append(new)
                self.available.add(n)

    def finish(self) -> list[_GradOp]:
        for name, parts in list(self.partials.items()):
            if len(parts) > 1:
                self._emit_sum(name)
        return self.emitted


def _append(block: Block, g: _GradOp, grad_to_var: dict[str, str]) -> Operator:
    for names in g.outputs.values():
        for n in names:
            if n == EMPTY_VAR_NAME or block.find_var_recursive(n) is not None:
                continue
            fwd = block.find_var_recursive(grad_to_var[n]) if n in grad_to_var else None
            if fwd is not None:
                block.create_var(name=n, shape=fwd.shape, dtype=fwd.dtype)
            else:
                block.create_var(name=n)
    op = block.append_op(g.type, inputs=g.inputs, outputs=g.outputs, attrs=g.attrs, infer_shape=False)
    results = infer_op(op)
    for slot, infos in (results or {}).items():
        for n, info in zip(op.output(slot), infos):
            if n == EMPTY_VAR_NAME:
                continue
            var = block.var_recursive(n)
            if not var.persistable and (var.shape, var.dtype, var.type) != (info.shape, info.dtype, info.type):
                owner = block
                while not owner.has_var(n):
                    owner = owner.parent  # type: ignore[assignment]
                owner.replace_var(n, shape=info.shape, dtype=info.dtype, type=info.type)
    return op


def append_backward(loss: Variable, parameter_list: Sequence[Any] | None = None,
                    no_grad_set: Iterable[Any] | None = None, callbacks: Sequence[Callback] | None = None,
                    *, program: Program | None = None) -> list[tuple[Parameter, Variable]]:
    """Append the backward ops of ``loss`` to ``program`` (the default main program) and return the
    (parameter, gradient) pairs. ``callbacks`` are called as ``cb(block=..., context=...)`` after each
    appended grad op, ``context`` mapping each gradient name to its forward variable's name."""
    if not isinstance(loss, Variable):
        raise IRError(f"append_backward: loss must be a Variable, got {type(loss).__name__} {loss!r}")
    program = program if program is not None else default_main_program()
    block = program.global_block()
    if not block.has_var(loss.name):
        raise IRError(f"append_backward: loss {loss.name!r} is not a variable of the program's global block",
                      hint="build under the same program_guard, or pass program=")
    loss = block.var(loss.name)
    if any(d < 0 for d in loss.shape):
        raise IRError(f"append_backward: loss {loss.name!r} has shape {list(loss.shape)} with an unknown extent",
                      hint="reduce it to one value first, e.g. layers.mean(cost)")
    if loss.dtype not in FLOAT_DTYPES:
        raise IRError(f"append_backward: loss {loss.name!r} has dtype {loss.dtype}, expected a float dtype")
    loss_grad = grad_name(loss.name)
    if block.has_var(loss_grad):
        raise IRError(f"append_backward: {loss_grad!r} already exists; backward was already appended for "
                      f"{loss.name!r}", hint="call append_backward (or minimize) once per loss")
    for cb in callbacks or ():
        if not callable(cb):
            raise IRError(f"append_backward: callbacks must be callables, got {cb!r}")

    params = [p for p in program.all_parameters()]
    if parameter_list is not None:
        wanted = _names(parameter_list, "parameter_list")
        names = {p.name for p in params}
        unknown = sorted(wanted - names)
        if unknown:
            raise IRError(f"append_backward: parameter_list names {unknown}, which are not parameters of the program",
                          hint="pass Parameters (or their names) from program.all_parameters()")
        chosen = [p for p in params if p.name in wanted]
    else:
        chosen = [p for p in params if p.trainable]
    no_grad = _names(no_grad_set, "no_grad_set")
    no_grad |= {v.name for v in block.vars.values() if v.stop_gradient}
    if parameter_list is not None:
        no_grad |= {p.name for p in params if p not in chosen}
    if loss.name in no_grad:
        raise IRError(f"append_backward: loss {loss.name!r} is stop_gradient or in no_grad_set")

    ops = list(block.ops)
    writers = [i for i, op in enumerate(ops) if loss.name in op.output_arg_names]
    if not writers:
        raise IRError(f"append_backward: no op of the global block produces loss {loss.name!r}")
    loss_op = ops[writers[-1]]
    path = _op_path(ops[: writers[-1] + 1], loss.name, no_grad)
    diff, active = _differentiable(block, path, no_grad)

    loss_op.set_attr(OP_ROLE_ATTR, int(OpRole.FORWARD | OpRole.LOSS))
    block.create_var(name=loss_grad, shape=loss.shape, dtype=loss.dtype)
    block.append_op("fill_constant", outputs={"Out": [loss_grad]},
                    attrs={"shape": list(loss.shape), "dtype": loss.dtype, "value": 1.0,
                           OP_ROLE_ATTR: int(OpRole.BACKWARD | OpRole.LOSS)})

    builder = _Builder(block, diff, {loss_grad})
    builder.grad_to_var[loss_grad] = loss.name
    for op in reversed(active):
        for g in _grad_ops_of(op):
            builder.add(g)
    for g in builder.finish():
        _append(block, g, builder.grad_to_var)
        for cb in callbacks or ():
            cb(block=block, context=dict(builder.grad_to_var))

    last_writer: dict[str, Operator] = {}  # one scan, not one per parameter: building stays linear
    for op in block.ops:
        for n in op.output_arg_names:
            last_writer[n] = op
    params_grads: list[tuple[Parameter, Variable]] = []
    for p in chosen:
        g = grad_name(p.name)
        if p.name not in diff or not block.has_var(g):
            continue
        last = last_writer.get(g)
        if last is None:
            continue
        last.set_attr(OP_ROLE_VAR_ATTR, [p.name, g] + list(last.attr(OP_ROLE_VAR_ATTR, [])))
        params_grads.append((block.var(p.name), block.var(g)))  # type: ignore[arg-type]
    return params_grads

