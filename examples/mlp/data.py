"""Gaussian-cluster classification data for the MLP example.

Each class has a centre drawn from N(0, separation²·I) in ``dim`` dimensions; an example is its class
centre plus N(0, I) noise. With the default separation (0.7) and 10 classes in 32 dimensions the classes
overlap only slightly, so a small MLP reaches well over 90% accuracy. The same seed gives the same
centres, so a train and a test split drawn with ``generate(..., seed)`` and different ``draw`` share
one distribution.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

NUM_CLASSES = 10
DIM = 32


def generate(num_examples: int, seed: int = 0, draw: int = 0, dim: int = DIM, num_classes: int = NUM_CLASSES,
             separation: float = 0.7) -> tuple[np.ndarray, np.ndarray]:
    """``(x float32 [n, dim], y int64 [n, 1])``; the centres depend on ``seed`` only, the examples on
    ``seed`` and ``draw``."""
    centres = np.random.default_rng(seed).normal(0.0, separation, size=(num_classes, dim))
    rng = np.random.default_rng([seed, draw + 1])
    y = rng.integers(0, num_classes, size=num_examples)
    x = centres[y] + rng.normal(0.0, 1.0, size=(num_examples, dim))
    return x.astype(np.float32), y.astype(np.int64).reshape(-1, 1)


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int = 0,
            shuffle: bool = True) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Full batches of ``(x, y)`` in a seeded random order (the remainder is dropped)."""
    order = np.random.default_rng(seed).permutation(len(x)) if shuffle else np.arange(len(x))
    for start in range(0, len(x) - batch_size + 1, batch_size):
        idx = order[start:start + batch_size]
        yield x[idx], y[idx]
