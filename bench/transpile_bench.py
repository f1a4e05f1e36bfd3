"""Transpiler scaling benchmark: the time of ``DistributeTranspiler.transpile`` for programs with 100,
1,000 and 10,000 parameters on 8 pservers.

Each program is a bank of small fc layers reading the same input and summed into the loss
(``mean(sums(fc_i(x)))``), so the parameter count grows without deepening the network: layer ``i`` has a
weight ``[16, w_i]`` and a bias ``[w_i]``; every 10th layer is wide (``w_i = 2048``, 32768 elements,
sliced over 4 pservers at the default ``min_block_size``), the others narrow (``w_i = 4``). Built with
``flotilla.fluid.layers`` and ``optimizer.SGD(...).minimize`` (backward included) outside the timing.

The timed call is a whole ``transpile`` (sync mode, 2 trainers, RoundRobin): input validation, cloning,
every pass, the per-pass verification and the final cross-program verification. Each size is timed
``--repeat`` times (the best is kept), with a fresh ``DistributeTranspiler`` each time. The table gives
the build's wall-clock and CPU seconds (``build``: layers, backward and optimizer), the transpile's
wall-clock seconds, CPU seconds of this process (steadier on a busy machine), microseconds per
parameter, and the ratio of the largest size's times to the second largest's: with a 10x size step it
should stay near 10; far above means something is quadratic. Then where the time of the largest size's
best transpile went: the passes (each pass, from the transpiler's ``timings``), verification (the
per-program checks the pipeline runs around the passes, a program unchanged since its last check being
answered from the pipeline's ``VerifyCache`` and a changed one re-checked only in the ops that changed or
name a variable that changed, and the final cross-program checks), cloning
(``Program.clone`` outside the passes; the passes' own clones are in their times) and the rest. The
breakdown wraps the verifier's and ``Program.clone``'s entry points while the bench runs.

``python bench/transpile_bench.py [--sizes 100,1000,10000] [--pservers 8] [--repeat 3]``
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import pathlib
import sys
import time
from typing import Any, Callable, Iterator

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ir  # noqa: E402
import passes.pass_base  # noqa: E402
from flotilla.fluid import layers, optimizer  # noqa: E402
from ir.core import Program  # noqa: E402
from ir.verify import _ProgramChecker, _SetChecker  # noqa: E402
from transpiler import DistributeTranspiler  # noqa: E402

IN_DIM = 16
NARROW, WIDE = 4, 2048
WIDE_EVERY = 10


def build(num_params: int) -> tuple[Program, Program]:
    """A program with ``num_params`` trainable parameters (two per fc layer; rounded up to even)."""
    main, startup = Program(), Program()
    with ir.unique_name.guard(), ir.program_guard(main, startup):
        x = layers.data("x", [IN_DIM])
        outs = []
        for i in range(max(1, (num_params + 1) // 2)):
            width = WIDE if i % WIDE_EVERY == WIDE_EVERY - 1 else NARROW
            outs.append(layers.reduce_sum(layers.fc(x, width), dim=[1], keep_dim=True))
        loss = layers.mean(outs[0] if len(outs) == 1 else layers.sums(outs))
        optimizer.SGD(0.01).minimize(loss)
    return main, startup


def count_params(program: Program) -> int:
    return sum(1 for v in program.global_block().vars.values() if isinstance(v, ir.Parameter) and v.trainable)


def count_ops(program: Program) -> int:
    return sum(len(b.ops) for b in program.blocks)


class Breakdown:
    """Wall-clock seconds spent in the verifier and in ``Program.clone`` during one transpile: the
    entry points are wrapped (``patched``) and the Timing instrument's calls mark when a pass runs."""

    def __init__(self) -> None:
        self.verify_programs = 0.0  # per-program checks (actually run, not answered from the cache)
        self.verify_set = 0.0  # the cross-program checks of the finished ProgramSet
        self.clone = 0.0  # Program.clone outside the passes
        self.in_pass = False

    def _timed(self, fn: Callable[..., Any], field: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if field == "clone" and self.in_pass:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)
        return wrapper

    def _marking(self, fn: Callable[..., Any], in_pass: bool) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.in_pass = in_pass
            return fn(*args, **kwargs)
        return wrapper

    @contextlib.contextmanager
    def patched(self) -> Iterator["Breakdown"]:
        timing = passes.pass_base.Timing
        targets = [(_ProgramChecker, "run", self._timed(_ProgramChecker.run, "verify_programs")),
                   (_SetChecker, "run", self._timed(_SetChecker.run, "verify_set")),
                   (Program, "clone", self._timed(Program.clone, "clone")),
                   (timing, "before", self._marking(timing.before, True)),
                   (timing, "after", self._marking(timing.after, False))]
        saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in targets]
        try:
            for owner, name, wrapper in targets:
                setattr(owner, name, wrapper)
            yield self
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


def time_transpile(main: Program, startup: Program, pservers: str,
                   repeat: int) -> tuple[float, float, DistributeTranspiler, Breakdown]:
    """Best wall-clock and best CPU seconds (this process) of ``repeat`` transpiles, and the transpiler
    and breakdown of the fastest run."""
    best_wall, best_cpu, best, best_parts = float("inf"), float("inf"), None, Breakdown()
    for _ in range(repeat):
        gc.collect()
        t = DistributeTranspiler()
        with Breakdown().patched() as parts:
            start, start_cpu = time.perf_counter(), time.process_time()
            t.transpile(0, program=main, pservers=pservers, trainers=2, sync_mode=True, startup_program=startup)
            cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
        best_cpu = min(best_cpu, cpu)
        if wall < best_wall:
            best_wall, best, best_parts = wall, t, parts
    if best is None:
        raise SystemExit("--repeat must be at least 1")
    return best_wall, best_cpu, best, best_parts


def print_breakdown(n_params: int, wall: float, t: DistributeTranspiler, parts: Breakdown) -> None:
    in_passes = sum(t.timings.values())
    verify = parts.verify_programs + parts.verify_set
    rest = wall - in_passes - verify - parts.clone
    print(f"where the time went, {n_params} params (best run, wall-clock):")
    rows = [("passes", in_passes)] + [(f"  {name}", secs) for name, secs in t.timings.items()]
    rows += [("verification", verify), ("  per program", parts.verify_programs),
             ("  across programs", parts.verify_set), ("cloning", parts.clone), ("other", rest),
             ("total", wall)]
    for name, secs in rows:
        print(f"  {name:<20} {secs:>9.4f} s {secs / wall * 100 if wall else 0.0:>5.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="parameter counts, comma-separated")
    parser.add_argument("--pservers", type=int, default=8, help="number of pserver endpoints (default 8)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per size; the best is kept")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.pservers < 1 or args.repeat < 1 or not sizes or min(sizes) < 1:
        parser.error("--pservers, --repeat and every size must be at least 1")
    pservers = ",".join(f"127.0.0.1:{6170 + i}" for i in range(args.pservers))

    print(f"transpile: sync, 2 trainers, {args.pservers} pservers, best of {args.repeat}")
    print(f"{'params':>8} {'ops':>8} {'blocks':>7} {'build s':>9} {'build cpu':>10} {'transpile s':>12} "
          f"{'cpu s':>9} {'us/param':>9}")
    results: list[tuple[int, float, float]] = []
    last: tuple[int, float, DistributeTranspiler, Breakdown] | None = None
    for size in sizes:
        start, start_cpu = time.perf_counter(), time.process_time()
        prog, startup = build(size)
        built, built_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        secs, cpu, t, parts = time_transpile(prog, startup, pservers, args.repeat)
        n_params = count_params(prog)
        blocks = sum(len(p.param_blocks) for p in t.plan.params)
        results.append((n_params, secs, cpu))
        last = n_params, secs, t, parts
        print(f"{n_params:>8} {count_ops(prog):>8} {blocks:>7} {built:>9.3f} {built_cpu:>10.3f} {secs:>12.4f} "
              f"{cpu:>9.4f} {secs / n_params * 1e6:>9.1f}")
    if len(results) >= 2:
        (n_small, t_small, c_small), (n_big, t_big, c_big) = results[-2], results[-1]
        print(f"ratio {n_big}/{n_small} params: time x{t_big / t_small:.2f} (cpu x{c_big / c_small:.2f}) "
              f"for size x{n_big / n_small:.1f}")
    if last is not None:
        print_breakdown(*last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
