"""Generated query/title pairs for the SimNet-BOW example.

The vocabulary is split into ``topics`` groups of words. A sample is a triple of variable-length word-id
sequences: a query drawn from one topic, a positive title from the same topic and a negative title from
another (each word is from the sample's topic with probability ``purity``, otherwise uniform), so a bag of
words model can learn to rank the positive title above the negative one. Id 0 is never drawn (it is the
conventional padding id). The same ``seed`` and ``draw`` give the same samples, in the same order.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

Sample = tuple[list[int], list[int], list[int]]  # (query, positive title, negative title)


def generate(num_samples: int, vocab_size: int = 1000, topics: int = 20, min_len: int = 2, max_len: int = 12,
             purity: float = 0.8, seed: int = 0, draw: int = 0) -> list[Sample]:
    """``num_samples`` (query, pos title, neg title) triples of word ids in [1, vocab_size)."""
    rng = np.random.default_rng([seed, draw])
    words = np.arange(1, vocab_size)
    groups = np.array_split(np.random.default_rng(seed).permutation(words), topics)

    def sentence(topic: int) -> list[int]:
        n = int(rng.integers(min_len, max_len + 1))
        own = rng.random(n) < purity
        return [int(rng.choice(groups[topic])) if o else int(rng.choice(words)) for o in own]

    samples = []
    for _ in range(num_samples):
        topic = int(rng.integers(topics))
        other = int((topic + rng.integers(1, topics)) % topics)
        samples.append((sentence(topic), sentence(topic), sentence(other)))
    return samples


def batches(samples: list[Sample], batch_size: int, seed: int = 0) -> Iterator[list[Sample]]:
    """Full batches of samples in a seeded random order (the remainder is dropped)."""
    order = np.random.default_rng(seed).permutation(len(samples))
    for start in range(0, len(samples) - batch_size + 1, batch_size):
        yield [samples[i] for i in order[start:start + batch_size]]
