"""Train the word2vec example: ``python examples/word2vec/train.py [--sentences N] [--epochs E]
[--batch-size B] [--lr LR] [--sync|--async] [--no-slice]``.

Generates a topic-structured corpus (``examples/word2vec/data.py``), trains skip-gram with negative
sampling through ``runtime.Executor``, prints a progress line every ``--log-every`` steps (step, mean
loss over the window, examples/s), then the mean cosine similarity of the input vectors of words of the
same topic and of different topics: training should pull the first well above the second.
``main(argv)`` returns the figures as a dict.

Distributed (``flotilla launch --server_num 2 --worker_num 2 examples/word2vec/train.py``): the role
comes from the environment (``flotilla.cluster``); a pserver serves until every trainer has completed
and returns ``{}``; each trainer trains on its shard of the batches (batch ``i`` goes to trainer
``i % trainers``), tags its lines ``trainer <id>: ``, measures the similarities on the vectors it last
received from the pservers, and closes its executor.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import runtime  # noqa: E402
from flotilla import cluster  # noqa: E402
from ir.errors import FlotillaError  # noqa: E402
from examples.word2vec import data  # noqa: E402
from examples.word2vec.model import build_model  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train skip-gram word vectors on a generated topic corpus.")
    ap.add_argument("--sentences", type=int, default=20_000, help="generated sentences")
    ap.add_argument("--vocab-size", type=int, default=500)
    ap.add_argument("--topics", type=int, default=10)
    ap.add_argument("--dim", type=int, default=32, help="vector width")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--num-neg", type=int, default=5, help="negatives a pair")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=10.0, help="SGD learning rate (the loss is a batch mean)")
    ap.add_argument("--log-every", type=int, default=100, help="steps between progress lines")
    ap.add_argument("--seed", type=int, default=0)
    cluster.add_arguments(ap)
    return ap.parse_args(argv)


def topic_similarity(vectors: np.ndarray, corpus: data.Corpus) -> tuple[float, float]:
    """(mean cosine similarity of distinct same-topic word pairs, mean over different-topic pairs)."""
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    sim = unit @ unit.T
    topic = corpus.topic_of(np.arange(corpus.vocab_size))
    same = topic[:, None] == topic[None, :]
    off_diagonal = ~np.eye(corpus.vocab_size, dtype=bool)
    return float(sim[same & off_diagonal].mean()), float(sim[~same].mean())


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train; returns ``{"steps", "first_loss", "final_loss", "same_topic", "other_topic",
    "examples_per_s"}`` (the losses are means over the first and the last logging window; a pserver
    returns ``{}``)."""
    args = parse_args(argv)
    model = build_model(args.vocab_size, dim=args.dim, num_neg=args.num_neg, learning_rate=args.lr)
    job = cluster.distribute_from_args(model.main, model.startup, args)
    if job.is_pserver:
        return {}
    tag = job.tag
    corpus = data.generate_corpus(args.sentences, vocab_size=args.vocab_size, num_topics=args.topics,
                                  seed=args.seed)
    num_batches = len(data.skipgram_pairs(corpus, args.window)[0]) // args.batch_size
    scope = runtime.Scope()
    exe = runtime.Executor(runtime.CPUPlace())
    exe.run(job.startup, scope=scope)
    before = topic_similarity(scope.numpy(model.in_table), corpus)

    step, examples, window_losses = 0, 0, []
    first_loss: float | None = None
    last_loss = float("nan")
    start = window_start = time.perf_counter()
    window_examples = 0
    for epoch in range(args.epochs):
        batches = data.batches(corpus, args.batch_size, num_neg=args.num_neg, window=args.window,
                               seed=args.seed * 1000 + epoch)
        for batch in job.shard(batches, total=num_batches):
            (loss_v,) = exe.run(job.main, feed=batch, fetch_list=[model.loss], scope=scope)
            step += 1
            examples += args.batch_size
            window_examples += args.batch_size
            window_losses.append(float(loss_v.ravel()[0]))
            if step % args.log_every == 0:
                now = time.perf_counter()
                last_loss = float(np.mean(window_losses))
                first_loss = last_loss if first_loss is None else first_loss
                print(f"{tag}epoch {epoch} step {step:5d}  loss {last_loss:.4f}  "
                      f"{window_examples / (now - window_start):,.0f} examples/s", flush=True)
                window_start, window_examples, window_losses = now, 0, []
    elapsed = time.perf_counter() - start
    if first_loss is None:
        raise FlotillaError(f"trained only {step} steps, fewer than one logging window of {args.log_every}",
                            hint="lower --log-every or generate more --sentences")
    same, other = topic_similarity(scope.numpy(model.in_table), corpus)
    print(f"{tag}trained {step} steps ({examples} pairs) in {elapsed:.1f}s, {examples / elapsed:,.0f} examples/s")
    print(f"{tag}loss {first_loss:.4f} -> {last_loss:.4f}")
    print(f"{tag}cosine similarity: same topic {same:.3f}, different topics {other:.3f} "
          f"(before training {before[0]:.3f} / {before[1]:.3f})", flush=True)
    exe.close()
    return {"steps": step, "first_loss": first_loss, "final_loss": last_loss, "same_topic": same,
            "other_topic": other, "examples_per_s": examples / elapsed}


if __name__ == "__main__":
    main()
