"""Memory benchmark of the memory rewrites: estimated and measured peak bytes, and step times.

Models (``--model``): a deep MLP (``--layers`` hidden fc layers of ``--width`` with relu, same width
throughout, input ``--width``, one output, mean square error, Adam) at batch ``--batch``; the issue's
size is 16 layers of 2048 at batch 256 (``--layers 16 --width 2048``), the default is scaled down to 8
layers of 1024 so that a run takes about a minute on a shared 2-core machine. Or the Transformer example
(``examples/transformer``: ``--layers`` encoder layers, d_model ``--width``, 4 heads, d_ff 4 x width,
dropout ops with probability 0, Adam; default 4 layers of 256 at batch 64).

Variants: ``plain``, ``level0`` / ``level1`` (``memory_optimize``), ``release`` (``release_memory``) and
``level0+release``. Each runs in its own process (so peak RSS is its own), from the same initial
parameters over the same batches, and reports:

- ``estimate``: the liveness estimate of peak bytes of temporaries (``passes.liveness.peak_bytes``: a
  value holds its buffer from its first write until its ``delete_var`` or the end of the step, as
  Fluid's scopes did), at the benchmark's batch size;
- ``held``: **measured** bytes held by the scope of an op-by-op (interpreted, Fluid-style) run of the
  same program: every op's kernel runs eagerly over a dict scope, ``delete_var`` pops, a renamed variable
  overwrites (freeing) the dead value; the peak over ops of the bytes of the distinct temporaries the
  scope holds (feeds included; parameters and optimizer state, the same in every variant, not);
- ``xla temp`` / ``xla peak``: **measured** from XLA's ``compiled.memory_analysis()`` of each compiled run
  of the Executor's plan: temp bytes (intermediates), and arguments + temps + outputs − aliased (donated)
  bytes, plus what the Executor keeps between runs (non-persistable values one run returns for a later
  one); the largest over the runs;
- ``same HLO``: whether the compiled runs lower to the same StableHLO text as plain's (renaming and
  folded deletions should not change the computation XLA sees);
- ``rss``: the process's peak RSS (MiB), a cross-check that includes jax and the interpreter;
- step times (median ms) of the compiled Executor and of the interpreted run, as ratios to ``plain``
  (each variant runs in its own process, one after the other: on a loaded machine the ratios carry
  that noise; the compiled variants run the very same XLA computation).
The losses of every variant must equal plain's bit for bit (checked).

``python bench/memory_bench.py [--model mlp|transformer] [--layers N] [--width W] [--batch B] [--steps S]``
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

VARIANTS = ("plain", "level0", "level1", "release", "level0+release", "recompute", "recompute+release")
MIB = 1024.0 * 1024.0
INTERPRETED_STEPS = 3  # timed op-by-op steps (at most --steps)


def build(model: str, layers: int, width: int, recompute: bool = False) -> tuple[Any, Any, Any]:
    """(main, startup, loss) of the benchmark's model; ``recompute``: ``RecomputeOptimizer`` with a checkpoint
    every ~sqrt(layers) layers (the MLP only)."""
    if model == "transformer":
        if recompute:
            raise SystemExit("the recompute variant is measured on the MLP (--model mlp)")
        from examples.transformer import data as tdata
        from examples.transformer import model as tmodel

        # Dropout 0: the Executor keys a random op's draws on its op index, which release_memory's
        # delete_var ops shift, so with dropout the release variants would draw other masks.
        built = tmodel.build_model(tdata.VOCAB_SIZE, tdata.SEQ_LEN, d_model=width, num_heads=4, num_layers=layers,
                                   d_ff=4 * width, dropout=0.0)
        return built.main, built.startup, built.loss
    from flotilla.fluid import layers as L
    from flotilla.fluid import optimizer
    from ir.core import Program, program_guard
    from flotilla.fluid.initializer import Uniform
    from ir.names import unique_name
    from flotilla.fluid.param_attr import ParamAttr

    main, startup = Program(), Program()
    scale = (6.0 / (2 * width)) ** 0.5
    every = max(1, round(layers ** 0.5))
    checkpoints = []
    with unique_name.guard(), program_guard(main, startup):
        h = L.data("x", [width])
        for i in range(layers):
            w = ParamAttr(name=f"w{i}", initializer=Uniform(-scale, scale, seed=i + 1))
            h = L.fc(h, width, act="relu", param_attr=w, bias_attr=ParamAttr(name=f"b{i}"))
            if i % every == 0:
                checkpoints.append(h)
        pred = L.fc(h, 1, param_attr=ParamAttr(name="wo", initializer=Uniform(-scale, scale, seed=999)),
                    bias_attr=ParamAttr(name="bo"))
        y = L.data("y", [1])
        loss = L.mean(L.square_error_cost(pred, y))
        if recompute:
            optimizer.RecomputeOptimizer(optimizer.Adam(1e-4), checkpoints=checkpoints).minimize(loss)
        else:
            optimizer.Adam(1e-4).minimize(loss)
    return main, startup, loss


def rewrite(main: Any, variant: str, batch: int) -> Any:
    from passes.liveness import program_peak_bytes
    from transpiler import memory_optimize, release_memory

    estimate = program_peak_bytes(main, batch_size=batch)
    if variant.startswith("level"):
        estimate = memory_optimize(main, level=int(variant[5]), batch_size=batch).bytes_after
    if variant.endswith("release"):
        estimate = release_memory(main, batch_size=batch).bytes_after
    return estimate


def batches(model: str, width: int, batch: int, n: int) -> list[dict[str, np.ndarray]]:
    if model == "transformer":
        from examples.transformer import data as tdata

        return list(tdata.batches(batch, n, seed=2024))
    rng = np.random.default_rng(2024)
    return [{"x": rng.normal(size=(batch, width)).astype("float32"),
             "y": rng.normal(size=(batch, 1)).astype("float32")} for _ in range(n)]


def _nbytes(value: Any) -> int:
    return int(getattr(value, "nbytes", 0) or 0)


def _is_random(op: Any) -> bool:
    from ir.ops.registry import find_op_def

    op_def = find_op_def(op.type)
    if op_def is None:
        return False
    forward = find_op_def(op_def.forward_type) if op_def.forward_type else None
    return "random" in op_def.traits or (forward is not None and "random" in forward.traits)


def interpreted_step(block: Any, scope: dict[str, Any], feed: dict[str, np.ndarray]) -> tuple[int, float]:
    """One op-by-op step over a dict scope (values of non-persistables die with the step); returns the
    peak bytes of the distinct temporaries (feeds included, parameters and optimizer state not) the scope
    held after any op, and the step's loss."""
    import jax
    import jax.numpy as jnp

    from ir.names import EMPTY_VAR_NAME
    from runtime.kernels.registry import RNG_SLOT, get_kernel

    persistable = {n for n, v in block.vars.items() if v.persistable}
    env = dict(scope)
    env.update({k: jnp.asarray(v) for k, v in feed.items()})
    peak = 0
    loss_name = next(op.output("Out")[0] for op in block.ops if op.role == 256)
    for index, op in enumerate(block.ops):
        if op.type == "delete_var":
            for n in op.input("X"):
                env.pop(n, None)
            continue
        ins = {slot: [env[n] for n in names if n != EMPTY_VAR_NAME] for slot, names in op.inputs.items()}
        if _is_random(op):  # the same key per op index in every variant
            ins[RNG_SLOT] = [jax.random.PRNGKey(index)]
        outs = get_kernel(op.type)(ins, dict(op.attrs))
        for slot, names in op.outputs.items():
            for n, v in zip(names, outs.get(slot, [])):
                if n != EMPTY_VAR_NAME:
                    env[n] = v
        jax.block_until_ready([v for v in env.values() if hasattr(v, "block_until_ready")])
        held = {id(v): _nbytes(v) for n, v in env.items() if n not in persistable}
        peak = max(peak, sum(held.values()))
    loss = float(np.asarray(env[loss_name]).reshape(-1)[0])
    for n in persistable:
        scope[n] = env[n]
    return peak, loss


def compiled_memory(exe: Any, main: Any, scope: Any, feed: dict[str, np.ndarray]) -> tuple[int, int, str]:
    """(largest temp bytes, largest peak bytes, digest of the compiled runs' HLO) over the compiled runs of
    the Executor's plan for ``main``, from XLA's memory_analysis, plus the non-persistable values earlier
    runs keep for later ones."""
    import jax

    def struct(name: str) -> Any:
        value = feed.get(name)
        if value is None:
            value = scope.find_var(name)
        return jax.ShapeDtypeStruct(np.shape(value), np.asarray(value).dtype if isinstance(value, np.ndarray)
                                    else value.dtype)

    plans = list(exe._plans[main].values())
    temp_max, peak_max, kept_between = 0, 0, 0
    digest = hashlib.sha256()
    for step in plans[-1].steps:
        if type(step).__name__ != "_PureRun":
            continue
        lowered = step.fn.lower(tuple(struct(n) for n in step.donated), tuple(struct(n) for n in step.kept),
                                np.uint32(0))
        digest.update(lowered.as_text().encode())  # the traced computation (XLA's own output is not stable)
        ma = lowered.compile().memory_analysis()
        temp = int(ma.temp_size_in_bytes)
        peak = int(ma.argument_size_in_bytes + temp + ma.output_size_in_bytes - ma.alias_size_in_bytes)
        temp_max = max(temp_max, temp)
        peak_max = max(peak_max, peak + kept_between)
        # What this run returns that is not state stays in the step's scope for the runs after it.
        persistable = {n for n, v in main.global_block().vars.items() if v.persistable}
        kept_between += sum(int(np.prod(info.shape)) * np.dtype(info.dtype).itemsize
                            for n, info in zip(step.outputs, jax.tree_util.tree_leaves(lowered.out_info))
                            if n not in persistable)
    return temp_max, peak_max, digest.hexdigest()[:12]


def run_variant(variant: str, model: str, layers: int, width: int, batch: int, steps: int) -> dict[str, Any]:
    import runtime

    main, startup, loss = build(model, layers, width, recompute=variant.startswith("recompute"))
    estimate = rewrite(main, variant, batch)
    data = batches(model, width, batch, steps + 1)
    scope, exe = runtime.Scope(), runtime.Executor()
    exe.run(startup, scope=scope)
    init = {n: np.array(scope.numpy(n)) for n, v in main.global_block().vars.items()
            if v.persistable and scope.find_var(n) is not None}
    losses = [float(exe.run(main, feed=data[0], fetch_list=[loss], scope=scope)[0].reshape(-1)[0])]  # compiles
    times = []
    for feed in data[1:]:
        t0 = time.perf_counter()
        losses.append(float(exe.run(main, feed=feed, fetch_list=[loss], scope=scope)[0].reshape(-1)[0]))
        times.append(time.perf_counter() - t0)
    compiled_ms = 1e3 * statistics.median(times)
    temp, xla_peak, hlo = compiled_memory(exe, main, scope, data[0])
    # Interpreted, Fluid-style, from the same initial state.
    import jax.numpy as jnp

    state = {n: jnp.asarray(v) for n, v in init.items()}
    held, ilosses, itimes = 0, [], []
    for i, feed in enumerate(data[:1 + min(steps, INTERPRETED_STEPS)]):
        t0 = time.perf_counter()
        peak, value = interpreted_step(main.global_block(), state, feed)
        if i:  # the first step warms jax's per-op caches
            itimes.append(time.perf_counter() - t0)
        held = max(held, peak)
        ilosses.append(value)
    return {"variant": variant, "estimate": estimate, "held": held, "xla_temp": temp, "xla_peak": xla_peak,
            "hlo": hlo, "compiled_ms": compiled_ms, "interp_ms": 1e3 * statistics.median(itimes),
            "losses": losses, "interp_losses": ilosses,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    ap.add_argument("--layers", type=int, default=None, help="hidden layers (default: mlp 8, transformer 4)")
    ap.add_argument("--width", type=int, default=None,
                    help="layer width / d_model (default: mlp 1024, transformer 256)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: mlp 256, transformer 64)")
    ap.add_argument("--steps", type=int, default=3,
                    help="timed compiled steps per variant (after one to compile); at least 1")
    ap.add_argument("--variant", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = {"mlp": (8, 1024, 256), "transformer": (4, 256, 64)}[args.model]
    args.layers = args.layers or defaults[0]
    args.width = args.width or defaults[1]
    args.batch = args.batch or defaults[2]
    if min(args.layers, args.width, args.batch, args.steps) < 1:
        ap.error("--layers, --width, --batch and --steps must be at least 1")
    if args.variant is not None:
        from runtime.x64 import x64

        with x64():  # the interpreted steps and the lowered runs get the 64-bit types of the Executor's runs
            print(json.dumps(run_variant(args.variant, args.model, args.layers, args.width, args.batch, args.steps)))
        return []
    rows = []
    for variant in VARIANTS if args.model == "mlp" else [v for v in VARIANTS if not v.startswith("recompute")]:
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--variant", variant, "--model", args.model,
               "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
               "--steps", str(args.steps)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            sys.stderr.write(done.stderr)
            raise SystemExit(f"variant {variant} failed with status {done.returncode}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    plain = rows[0]
    for row in rows[1:]:
        if row["variant"].startswith("recompute"):  # the same math, another order of XLA's choosing: rtol 1e-6
            if not np.allclose(row["losses"], plain["losses"], rtol=1e-6, atol=0):
                raise SystemExit(f"{row['variant']}: losses differ from plain: {row['losses']} vs {plain['losses']}")
            continue
        if row["losses"] != plain["losses"] or row["interp_losses"] != plain["interp_losses"]:
            raise SystemExit(f"variant {row['variant']}: losses differ from plain: {row['losses']} vs "
                             f"{plain['losses']}")
    what = (f"deep MLP: {args.layers} x fc {args.width} (relu)" if args.model == "mlp" else
            f"Transformer example: {args.layers} encoder layers, d_model {args.width}, 4 heads, "
            f"d_ff {4 * args.width}, dropout 0")
    print(f"{what}, batch {args.batch}, Adam; {args.steps} timed steps; losses identical across variants "
          "(recompute: within rtol 1e-6)")
    head = ("variant", "estimate MiB", "held MiB", "xla temp MiB", "xla peak MiB", "same HLO", "rss MiB",
            "compiled ms", "ratio", "interp ms", "ratio")
    body = [(r["variant"], f"{r['estimate'] / MIB:.1f}", f"{r['held'] / MIB:.1f}", f"{r['xla_temp'] / MIB:.1f}",
             f"{r['xla_peak'] / MIB:.1f}", "yes" if r["hlo"] == plain["hlo"] else "no", f"{r['rss_mib']:.0f}",
             f"{r['compiled_ms']:.1f}",
             f"{r['compiled_ms'] / plain['compiled_ms']:.2f}", f"{r['interp_ms']:.1f}",
             f"{r['interp_ms'] / plain['interp_ms']:.2f}") for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    for line in [head, *body]:
        print("  ".join(str(c).rjust(w) for c, w in zip(line, widths)))
    return rows


if __name__ == "__main__":
    main()
