"""A generated corpus with topic structure, and skip-gram batches with negative samples.

The vocabulary of ``vocab_size`` words is split into ``num_topics`` equal topics (word ``w`` belongs to
topic ``w // (vocab_size // num_topics)``). Each sentence has one topic: a word is drawn from that
topic with probability ``topic_prob`` and otherwise from the whole vocabulary, uniformly in both cases.
So words of one topic co-occur far more often than words of different topics, and a skip-gram model's
vectors should cluster by topic.

Skip-gram pairs are (center, context) for every context word within ``window`` of the center. Each
batch adds ``num_neg`` negatives a pair, drawn from the unigram distribution raised to 0.75 (as
word2vec); labels are 1 for the true context and 0 for the negatives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ir.errors import FlotillaError


@dataclass(frozen=True)
class Corpus:
    """Sentences [num_sentences, sentence_len] of word ids, each sentence's topic, and the topic size."""

    sentences: np.ndarray
    topics: np.ndarray
    vocab_size: int
    num_topics: int

    @property
    def topic_size(self) -> int:
        return self.vocab_size // self.num_topics

    def topic_of(self, words: np.ndarray) -> np.ndarray:
        return np.asarray(words) // self.topic_size


def generate_corpus(num_sentences: int, vocab_size: int = 500, num_topics: int = 10, sentence_len: int = 12,
                    topic_prob: float = 0.8, seed: int = 0) -> Corpus:
    """A corpus of ``num_sentences`` sentences (see the module docstring)."""
    if vocab_size % num_topics:
        raise FlotillaError(f"vocab_size {vocab_size} must be a multiple of num_topics {num_topics}",
                            hint="pick a vocabulary size that the topics divide evenly")
    rng = np.random.default_rng(seed)
    topic_size = vocab_size // num_topics
    topics = rng.integers(0, num_topics, size=num_sentences)
    in_topic = topics[:, None] * topic_size + rng.integers(0, topic_size, size=(num_sentences, sentence_len))
    background = rng.integers(0, vocab_size, size=(num_sentences, sentence_len))
    sentences = np.where(rng.random((num_sentences, sentence_len)) < topic_prob, in_topic, background)
    return Corpus(sentences.astype(np.int64), topics, vocab_size, num_topics)


def skipgram_pairs(corpus: Corpus, window: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(center int64 [P], context int64 [P]) for every pair within ``window`` in a sentence."""
    s = corpus.sentences
    centers, contexts = [], []
    for offset in range(1, window + 1):
        centers += [s[:, :-offset].ravel(), s[:, offset:].ravel()]
        contexts += [s[:, offset:].ravel(), s[:, :-offset].ravel()]
    return np.concatenate(centers), np.concatenate(contexts)


def batches(corpus: Corpus, batch_size: int, num_neg: int = 5, window: int = 2,
            seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Shuffled full batches ``{"center" int64 [B, 1], "context" int64 [B, 1 + num_neg],
    "label" float32 [B, 1 + num_neg]}`` (column 0 is the true context)."""
    rng = np.random.default_rng(seed)
    centers, contexts = skipgram_pairs(corpus, window)
    counts = np.bincount(corpus.sentences.ravel(), minlength=corpus.vocab_size).astype(np.float64)
    noise = counts**0.75
    noise /= noise.sum()
    label = np.zeros((batch_size, 1 + num_neg), np.float32)
    label[:, 0] = 1.0
    order = rng.permutation(len(centers))
    for start in range(0, len(order) - batch_size + 1, batch_size):
        idx = order[start:start + batch_size]
        negatives = rng.choice(corpus.vocab_size, size=(batch_size, num_neg), p=noise)
        yield {"center": centers[idx].reshape(-1, 1),
               "context": np.concatenate([contexts[idx, None], negatives], axis=1).astype(np.int64),
               "label": label.copy()}
