"""Generated token sequences for the Transformer example: ``SEQ_LEN`` int64 ids from a ``VOCAB_SIZE``
vocabulary, ``NUM_CLASSES`` = 2 classes.

Two disjoint sets of ``MARKERS`` "marker" tokens stand for the two classes; every other id is filler.
A sequence of class ``c`` holds ``strong`` (3 to 6) markers of class ``c`` and ``weak`` (0 to
``strong - 2``) markers of the other class at random positions, the rest uniform filler: the label is the
class whose markers are in the majority, which attention (or pooling) over learned embeddings finds.
The marker sets depend on ``seed`` only; the sequences on ``seed`` and ``draw``. Batches are drawn one
at a time (``batches``).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

VOCAB_SIZE = 1000
SEQ_LEN = 32
NUM_CLASSES = 2
MARKERS = 40  # marker tokens per class


def marker_sets(seed: int = 0, vocab_size: int = VOCAB_SIZE) -> np.ndarray:
    """``[2, MARKERS]`` int64: the marker ids of each class (disjoint, never id 0)."""
    ids = np.random.default_rng([seed, 0x7F]).permutation(np.arange(1, vocab_size))[:2 * MARKERS]
    return ids.reshape(2, MARKERS).astype(np.int64)


def generate(num_examples: int, seed: int = 0, draw: int = 0, seq_len: int = SEQ_LEN,
             vocab_size: int = VOCAB_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int64 [n, seq_len], labels int64 [n, 1])``, deterministic from ``(seed, draw)``."""
    markers = marker_sets(seed, vocab_size)
    is_marker = np.zeros(vocab_size, bool)
    is_marker[markers.reshape(-1)] = True
    filler = np.flatnonzero(~is_marker)
    rng = np.random.default_rng([seed, draw + 1])
    y = rng.integers(0, NUM_CLASSES, size=num_examples)
    ids = filler[rng.integers(0, len(filler), size=(num_examples, seq_len))]
    for n in range(num_examples):
        strong = int(rng.integers(3, 7))
        weak = int(rng.integers(0, strong - 1))
        positions = rng.permutation(seq_len)[:strong + weak]
        ids[n, positions[:strong]] = rng.choice(markers[y[n]], size=strong)
        ids[n, positions[strong:]] = rng.choice(markers[1 - y[n]], size=weak)
    return ids.astype(np.int64), y.astype(np.int64).reshape(-1, 1)


def batches(batch_size: int, num_batches: int, seed: int = 0, draw: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """``num_batches`` feed dicts ``{"tokens", "label"}``; batch ``i`` is a ``generate`` draw of its
    own, so every process sees the same stream and each batch is made only when it is reached."""
    for i in range(num_batches):
        x, y = generate(batch_size, seed=seed, draw=1_000_003 * (draw + 1) + i)
        yield {"tokens": x, "label": y}
