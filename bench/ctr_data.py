"""The CTR reference job's shape, its synthetic data and the trainers' start gate, with numpy alone: shared
by Flotilla's benchmark
worker (``bench/ps_bench_worker.py``) and Paddle's (``bench/paddle_ps_worker.py``, which runs in an
interpreter that has paddlepaddle and none of Flotilla's dependencies), so both train on the same batches.

The job: 26 int64 slots sharing ONE ``[table_rows, 16]`` sparse table, 13 dense features, concat → fc
400-400-400 relu → fc 2 softmax, mean cross entropy, SGD 0.01, batch 512.
"""
from __future__ import annotations

import pathlib
import time

import numpy as np

NUM_DENSE = 13
NUM_SLOTS = 26
EMB_DIM = 16
HIDDEN = (400, 400, 400)
TABLE = "shared_embedding"
LEARNING_RATE = 0.01
LABEL_SEED = 12345


def make_batches(seed: int, count: int, batch_size: int, table_rows: int, id_dist: str) -> list[dict[str, np.ndarray]]:
    """``count`` synthetic batches. Ids are uniform over the table or Zipf-skewed (``id_dist``); the label
    is 1 where a fixed random linear function of the dense features and of a per-id weight is positive."""
    rule = np.random.default_rng(LABEL_SEED)
    w_dense = rule.standard_normal(NUM_DENSE).astype(np.float32)
    w_id = rule.standard_normal(table_rows).astype(np.float32)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        dense = rng.random((batch_size, NUM_DENSE), dtype=np.float32)
        if id_dist == "uniform":
            ids = rng.integers(0, table_rows, size=(batch_size, NUM_SLOTS), dtype=np.int64)
        else:
            ids = (rng.zipf(1.2, size=(batch_size, NUM_SLOTS)) - 1).astype(np.int64) % table_rows
        logit = (dense - 0.5) @ w_dense + w_id[ids].sum(axis=1) / np.sqrt(NUM_SLOTS)
        out.append({"dense_input": dense, "sparse_input": ids,
                    "label": (logit > 0).astype(np.int64).reshape(-1, 1)})
    return out


class Gate:
    """Lines the trainers of a job up so their timed windows coincide: each writes ``ready.<tag>`` into
    ``directory`` after its warm-up and waits (at most ``timeout`` seconds) until ``count`` have, and
    writes ``done.<tag>`` after its timed steps (``ps_bench.py`` samples the job's CPU time between
    the two). No directory: no gate."""

    def __init__(self, directory: str, count: int, tag: str, timeout: float) -> None:
        self.dir = pathlib.Path(directory) if directory else None
        self.count, self.tag, self.timeout = count, tag, timeout

    def arrive(self) -> None:
        if self.dir is None:
            return
        (self.dir / f"ready.{self.tag}").touch()
        end = time.monotonic() + self.timeout
        while len(list(self.dir.glob("ready.*"))) < self.count:
            if time.monotonic() > end:
                raise TimeoutError(f"{self.tag}: the other trainers did not finish warming up within "
                                   f"{self.timeout:g}s")
            time.sleep(0.002)

    def leave(self) -> None:
        if self.dir is not None:
            (self.dir / f"done.{self.tag}").touch()
