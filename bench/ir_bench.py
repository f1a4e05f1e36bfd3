"""IR scaling benchmark: build, verify, print, parse, save and load programs of growing size.

For each size (1k, 10k and 100k ops by default) it generates a chain of realistic layers
(``mul`` by a weight parameter, ``elementwise_add`` of a bias parameter, then ``relu``), built with
``Block.append_op`` (shape inference included), and times each stage (the best of ``--repeat`` runs;
``--no-gc`` turns Python's cyclic garbage collector off while timing, to tell the IR's own scaling from
the collector's, which traverses the whole growing heap). It prints a table of
seconds, microseconds per op, and for each stage the ratio of the largest size's time to the second
largest's: with a 10x size step that ratio should stay near 10; far above it means something is
quadratic. ``python bench/ir_bench.py [--sizes 1000,10000,100000] [--repeat N] [--no-gc]``.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from typing import Callable

from ir.core import Program
from ir.parser import parse_program
from ir.printer import format_program
from ir.serialize import load_program, save_program
from ir.verify import verify

WIDTH = 16
OPS_PER_LAYER = 3
STAGES = ("build", "verify", "print", "parse", "save", "load")


def build_chain(num_ops: int) -> Program:
    """A program of about ``num_ops`` ops: fc layers ``relu(h @ w_i + b_i)`` chained one after another."""
    program = Program()
    block = program.global_block()
    block.create_var("x", shape=(-1, WIDTH), is_data=True, stop_gradient=True)
    h = "x"
    for i in range(max(1, num_ops // OPS_PER_LAYER)):
        w, b = f"fc_{i}.w_0", f"fc_{i}.b_0"
        block.create_parameter(w, shape=(WIDTH, WIDTH))
        block.create_parameter(b, shape=(WIDTH,))
        mul_out, add_out, relu_out = (block.create_var(f"fc_{i}.tmp_{k}").name for k in range(3))
        block.append_op("mul", {"X": h, "Y": w}, {"Out": mul_out}, {"x_num_col_dims": 1, "y_num_col_dims": 1})
        block.append_op("elementwise_add", {"X": mul_out, "Y": b}, {"Out": add_out}, {"axis": 1})
        block.append_op("relu", {"X": add_out}, {"Out": relu_out})
        h = relu_out
    return program


def _best_of(repeat: int, use_gc: bool) -> Callable[[Callable[[], object]], tuple[float, object]]:
    def timed(fn: Callable[[], object]) -> tuple[float, object]:
        best, result = float("inf"), None
        for _ in range(repeat):
            result = None  # drop the previous run's result before the next run
            gc.collect()
            if not use_gc:
                gc.disable()
            try:
                start = time.perf_counter()
                result = fn()
                best = min(best, time.perf_counter() - start)
            finally:
                gc.enable()
        return best, result

    return timed


def bench_size(num_ops: int, folder: str, repeat: int = 1, use_gc: bool = True) -> dict[str, float]:
    """Seconds per stage for one program size (the best of ``repeat`` runs)."""
    _timed = _best_of(repeat, use_gc)
    times: dict[str, float] = {}
    times["build"], program = _timed(lambda: build_chain(num_ops))
    times["verify"], _ = _timed(lambda: verify(program))
    times["print"], text = _timed(lambda: format_program(program))
    times["parse"], parsed = _timed(lambda: parse_program(text, filename="<bench>"))
    path = os.path.join(folder, f"chain_{num_ops}.pb")
    times["save"], _ = _timed(lambda: save_program(program, path))
    times["load"], loaded = _timed(lambda: load_program(path))
    # A benchmark of the wrong thing is worse than none: the forms must round-trip.
    if format_program(parsed) != text or format_program(loaded) != text:
        raise SystemExit(f"round trip failed at {num_ops} ops: parse or load changed the program")
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="comma-separated op counts")
    parser.add_argument("--repeat", type=int, default=1, help="runs per stage; the best is kept")
    parser.add_argument("--no-gc", action="store_true", help="turn the cyclic garbage collector off while timing")
    args = parser.parse_args(argv)
    try:
        sizes = sorted(int(s) for s in args.sizes.split(",") if s.strip())
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < OPS_PER_LAYER:
        parser.error(f"--sizes needs at least one size of {OPS_PER_LAYER} ops or more")
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")

    results: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="ir_bench_") as folder:
        for n in sizes:
            results[n] = bench_size(n, folder, args.repeat, use_gc=not args.no_gc)
            print(f"  measured {n} ops", file=sys.stderr)

    header = f"{'ops':>8} | " + " | ".join(f"{s:>8}" for s in STAGES)
    print(f"seconds per stage (best of {args.repeat}, garbage collector {'off' if args.no_gc else 'on'})")
    print(header)
    print("-" * len(header))
    for n in sizes:
        print(f"{n:>8} | " + " | ".join(f"{results[n][s]:8.3f}" for s in STAGES))
    print()
    print("microseconds per op")
    print(header)
    print("-" * len(header))
    for n in sizes:
        print(f"{n:>8} | " + " | ".join(f"{results[n][s] / n * 1e6:8.2f}" for s in STAGES))
    if len(sizes) >= 2:
        big, small = sizes[-1], sizes[-2]
        print()
        print(f"time ratio {big}/{small} (size ratio {big / small:g}; near it = linear)")
        print(f"{'':>8} | " + " | ".join(f"{results[big][s] / results[small][s]:8.1f}" for s in STAGES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
