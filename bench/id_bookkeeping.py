"""Where a step's sparse id bookkeeping is cheapest: in numpy on the host, or inside the compiled step.

The issue asked for ``split_ids``' sort-and-dedupe inside the compiled step (a fixed-size unique with
padding). This measures the one operation both ways on the CTR job's ids (a batch of 512 x 26 slots,
zipf over a 1M-row table, as ``bench/ps_bench.py`` draws them): ``jnp.unique(size=n, return_inverse=True)``
under ``jax.jit`` on the default backend, against ``runtime.rows.IdSorter`` (what the trainer runs) and
``np.unique`` with its inverse. Medians of ``--reps`` calls, milliseconds.

``python bench/id_bookkeeping.py [--ids 13312] [--rows 1000000] [--reps 200]``
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from runtime.rows import IdSorter


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", type=int, default=512 * 26)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ids = (rng.zipf(1.2, args.ids) % args.rows).astype(np.int64)
    n = ids.size

    @jax.jit
    def compiled_unique(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.unique(x, size=n, fill_value=-1, return_inverse=True)

    def on_device() -> object:
        return jax.block_until_ready(compiled_unique(jnp.asarray(ids.astype(np.int32))))

    sorter = IdSorter()
    on_device()
    sorter(ids)
    figures = {
        f"jnp.unique(size={n}) under jit ({jax.default_backend()}), ids copied in": median_ms(on_device, args.reps),
        "runtime.rows.IdSorter (numpy, what the trainer runs)": median_ms(lambda: sorter(ids), args.reps),
        "np.unique(return_inverse=True)": median_ms(lambda: np.unique(ids, return_inverse=True), args.reps),
    }
    print(f"{n:,} ids over {args.rows:,} rows, {len(np.unique(ids)):,} unique; median of {args.reps} calls")
    for what, ms in figures.items():
        print(f"  {ms:8.3f} ms  {what}")
    base = figures["runtime.rows.IdSorter (numpy, what the trainer runs)"]
    print(f"compiled unique / IdSorter = {next(iter(figures.values())) / base:.1f}x")


if __name__ == "__main__":
    main()
