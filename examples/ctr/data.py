"""Criteo-format data for the CTR example: a synthetic generator with learnable structure, and a reader
that also reads the real Criteo text format.

Format (one example a line, tab separated): ``label  I1..I13  C1..C26`` where ``I`` are non-negative
integer counts (possibly empty) and ``C`` are 8-hex-digit categorical values (possibly empty).
The reader normalises dense features as Paddle's Criteo reader does ((x - min) / (max - min), clipped at
the 95th-percentile max) and hashes each categorical value with its slot index through crc32 into
``hash_dim`` buckets (stable in every process, unlike Python's ``hash``). Empty values become 0 (dense)
and the bucket of the empty string (categorical).
"""
from __future__ import annotations

import argparse
import pathlib
import zlib
from typing import Iterator

import numpy as np

from ir.errors import FlotillaError

NUM_DENSE = 13
NUM_SPARSE = 26
# Paddle's Criteo reader bounds for I1..I13 (min 0; max at the 95th percentile).
DENSE_MIN = np.zeros(NUM_DENSE, np.float32)
DENSE_MAX = np.array([20, 600, 100, 50, 64000, 500, 100, 50, 500, 10, 10, 10, 50], np.float32)


def generate(path: str | pathlib.Path, num_examples: int, seed: int = 0, vocab_per_slot: int = 1000) -> None:
    """Write ``num_examples`` synthetic Criteo lines to ``path``.

    Each slot's values follow a Zipf-like law over ``vocab_per_slot`` values; every (slot, value) has a
    hidden weight, the dense counts carry a linear signal, and the label is drawn from the logistic of
    their sum, so a model can learn it (the Bayes AUC, from the hidden logits, is about 0.91).
    """
    rng = np.random.default_rng(seed)
    weights = rng.normal(0.0, 0.6, size=(NUM_SPARSE, vocab_per_slot))
    codes = rng.integers(0, 2**32, size=(NUM_SPARSE, vocab_per_slot), dtype=np.uint64)
    dense_w = rng.normal(0.0, 0.5, size=NUM_DENSE)
    ranks = np.arange(1, vocab_per_slot + 1)
    probs = 1.0 / ranks**1.1
    probs /= probs.sum()
    with open(path, "w") as f:
        for start in range(0, num_examples, 4096):
            n = min(4096, num_examples - start)
            cats = rng.choice(vocab_per_slot, size=(n, NUM_SPARSE), p=probs)
            dense = rng.poisson(lam=DENSE_MAX / 8, size=(n, NUM_DENSE))
            dense_norm = np.minimum(dense, DENSE_MAX) / DENSE_MAX
            logit = weights[np.arange(NUM_SPARSE), cats].sum(axis=1) + (dense_norm - 0.125) @ dense_w * 4 - 0.5
            labels = rng.random(n) < 1.0 / (1.0 + np.exp(-logit))
            missing = rng.random((n, NUM_DENSE)) < 0.05
            for i in range(n):
                ints = ["" if missing[i, j] else str(dense[i, j]) for j in range(NUM_DENSE)]
                strs = [f"{int(codes[s, cats[i, s]]):08x}" for s in range(NUM_SPARSE)]
                f.write("\t".join([str(int(labels[i]))] + ints + strs) + "\n")


def hash_feature(slot: int, value: str, hash_dim: int) -> int:
    return zlib.crc32(f"{slot}:{value}".encode()) % hash_dim


def parse_line(line: str, hash_dim: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One Criteo line → (dense float32 [13], sparse ids int64 [26], label)."""
    fields = line.rstrip("\n").split("\t")
    if len(fields) != 1 + NUM_DENSE + NUM_SPARSE:
        raise FlotillaError(f"a Criteo line has {1 + NUM_DENSE + NUM_SPARSE} tab-separated fields, got {len(fields)}",
                            hint="label, I1..I13, C1..C26, tab separated")
    label = int(fields[0])
    dense = np.array([float(v) if v else 0.0 for v in fields[1:1 + NUM_DENSE]], np.float32)
    dense = (np.minimum(dense, DENSE_MAX) - DENSE_MIN) / (DENSE_MAX - DENSE_MIN)
    sparse = np.array([hash_feature(s, v, hash_dim) for s, v in enumerate(fields[1 + NUM_DENSE:])], np.int64)
    return dense, sparse, label


def read_batches(paths: list[str | pathlib.Path], batch_size: int, hash_dim: int, shard: int = 0,
                 num_shards: int = 1, drop_last: bool = True) -> Iterator[dict[str, np.ndarray]]:
    """Batches ``{"dense_input", "sparse_input", "label"}``; line i goes to shard ``i % num_shards``."""
    dense, sparse, labels = [], [], []
    index = 0
    for path in paths:
        with open(path) as f:
            for line in f:
                mine = index % num_shards == shard
                index += 1
                if not mine:
                    continue
                d, s, y = parse_line(line, hash_dim)
                dense.append(d)
                sparse.append(s)
                labels.append(y)
                if len(labels) == batch_size:
                    yield _batch(dense, sparse, labels)
                    dense, sparse, labels = [], [], []
    if labels and not drop_last:
        yield _batch(dense, sparse, labels)


def _batch(dense: list, sparse: list, labels: list) -> dict[str, np.ndarray]:
    return {
        "dense_input": np.stack(dense),
        "sparse_input": np.stack(sparse),
        "label": np.array(labels, np.int64).reshape(-1, 1),
    }


def load_arrays(path: str | pathlib.Path, hash_dim: int) -> dict[str, np.ndarray]:
    """A whole Criteo file as arrays ``{"dense_input" float32 [n, 13], "sparse_input" int64 [n, 26],
    "label" int64 [n, 1]}``, the same values ``parse_line`` gives line by line (each distinct
    (slot, value) is hashed once), ready for shuffled epochs with ``array_batches``."""
    with open(path) as f:
        rows = [line.rstrip("\n").split("\t") for line in f]
    width = 1 + NUM_DENSE + NUM_SPARSE
    for i, r in enumerate(rows):
        if len(r) != width:
            raise FlotillaError(f"{path}:{i + 1}: a Criteo line has {width} tab-separated fields, got {len(r)}",
                                hint="label, I1..I13, C1..C26, tab separated")
    n = len(rows)
    label = np.fromiter((int(r[0]) for r in rows), np.int64, n).reshape(n, 1)
    dense = np.array([[float(v) if v else 0.0 for v in r[1:1 + NUM_DENSE]] for r in rows], np.float32)
    dense = ((np.minimum(dense, DENSE_MAX) - DENSE_MIN) / (DENSE_MAX - DENSE_MIN)).reshape(n, NUM_DENSE)
    sparse = np.empty((n, NUM_SPARSE), np.int64)
    for s in range(NUM_SPARSE):
        column = [r[1 + NUM_DENSE + s] for r in rows]
        buckets = {v: hash_feature(s, v, hash_dim) for v in dict.fromkeys(column)}
        sparse[:, s] = np.fromiter((buckets[v] for v in column), np.int64, n)
    return {"dense_input": dense.astype(np.float32), "sparse_input": sparse, "label": label}


def array_batches(arrays: dict[str, np.ndarray], batch_size: int, seed: int | None = None,
                  drop_last: bool = True) -> Iterator[dict[str, np.ndarray]]:
    """Batches of ``load_arrays``' result, in file order or (with ``seed``) a seeded shuffle."""
    n = len(arrays["label"])
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    stop = n - batch_size + 1 if drop_last else n
    for start in range(0, max(stop, 0), batch_size):
        idx = order[start:start + batch_size]
        yield {k: v[idx] for k, v in arrays.items()}


def generate_split(out: str | pathlib.Path, train: int, test: int, seed: int = 0) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``train.txt`` and ``test.txt`` under ``out``, drawn from one hidden model (the same seed's
    weights, different draws); returns their paths."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    generate(out / "train.txt", train + test, seed=seed)
    lines = (out / "train.txt").read_text().splitlines(keepends=True)
    (out / "train.txt").write_text("".join(lines[:train]))
    (out / "test.txt").write_text("".join(lines[train:]))
    return out / "train.txt", out / "test.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description="Write synthetic Criteo-format CTR data.")
    ap.add_argument("--out", default="ctr_data", help="output directory")
    ap.add_argument("--train", type=int, default=100_000, help="training examples")
    ap.add_argument("--test", type=int, default=20_000, help="test examples")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    generate_split(out, args.train, args.test, seed=args.seed)
    print(f"wrote {args.train} training and {args.test} test examples to {out}/")


if __name__ == "__main__":
    main()
