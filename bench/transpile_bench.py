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
wall-clock seconds, CPU seconds of this process (steadier on a busy machine), microseconds per
parameter, and the ratio of the largest size's times to the second largest's:
with a 10x size step it should stay near 10; far above means something is quadratic. The per-pass times
of the largest size follow.

``python bench/transpile_bench.py [--sizes 100,1000,10000] [--pservers 8] [--repeat 3]``
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ir  # noqa: E402
from flotilla.fluid import layers, optimizer  # noqa: E402
from ir.core import Program  # noqa: E402
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


def time_transpile(main: Program, startup: Program, pservers: str,
                   repeat: int) -> tuple[float, float, DistributeTranspiler]:
    """Best wall-clock and best CPU seconds (this process) of ``repeat`` transpiles, and the last transpiler."""
    best_wall, best_cpu, last = float("inf"), float("inf"), None
    for _ in range(repeat):
        last = None
        gc.collect()
        t = DistributeTranspiler()
        start, start_cpu = time.perf_counter(), time.process_time()
        t.transpile(0, program=main, pservers=pservers, trainers=2, sync_mode=True, startup_program=startup)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
        best_wall = min(best_wall, time.perf_counter() - start)
        last = t
    if last is None:
        raise SystemExit("--repeat must be at least 1")
    return best_wall, best_cpu, last


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
    print(f"{'params':>8} {'ops':>8} {'blocks':>7} {'build s':>9} {'transpile s':>12} {'cpu s':>9} "
          f"{'us/param':>9}")
    results: list[tuple[int, float, float]] = []
    last_t = None
    for size in sizes:
        start = time.perf_counter()
        prog, startup = build(size)
        built = time.perf_counter() - start
        secs, cpu, last_t = time_transpile(prog, startup, pservers, args.repeat)
        n_params = count_params(prog)
        blocks = sum(len(p.param_blocks) for p in last_t.plan.params)
        results.append((n_params, secs, cpu))
        print(f"{n_params:>8} {count_ops(prog):>8} {blocks:>7} {built:>9.3f} {secs:>12.4f} {cpu:>9.4f} "
              f"{secs / n_params * 1e6:>9.1f}")
    if len(results) >= 2:
        (n_small, t_small, c_small), (n_big, t_big, c_big) = results[-2], results[-1]
        print(f"ratio {n_big}/{n_small} params: time x{t_big / t_small:.2f} (cpu x{c_big / c_small:.2f}) "
              f"for size x{n_big / n_small:.1f}")
    if last_t is not None:
        print(f"per pass, {results[-1][0]} params (last run):")
        for name, secs in last_t.timings.items():
            print(f"  {name:<20} {secs:>9.4f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
