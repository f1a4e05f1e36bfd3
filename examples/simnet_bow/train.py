"""Train the SimNet-BOW example: ``python examples/simnet_bow/train.py [--samples N] [--epochs E]
[--batch-size B] [--lr LR] [--sync|--async] [--no-slice]``.

Generates query/title triples (``examples/simnet_bow/data.py``), feeds them as LoD sequences (a list of
variable-length word-id lists per input, see ``runtime/lod.py``), trains the pairwise hinge loss with SGD
through ``runtime.Executor``, prints a progress line every ``--log-every`` steps (step, mean loss over the
window, examples/s), then ``loss A -> B`` (the mean loss of the first and of the last ``--log-every``
steps) and the pairwise accuracy of the forward-only test program on a held-out draw (how often the
positive title scores above the negative one): ``test pairwise accuracy: 0.xxx``. ``main(argv)`` returns
the figures as a dict.

Distributed (``flotilla launch --server_num 2 --worker_num 2 examples/simnet_bow/train.py``): the role
comes from the environment (``flotilla.cluster``); a pserver serves until every trainer has completed
and returns ``{}``; each trainer trains on its shard of the batches (batch ``i`` goes to trainer
``i % trainers``), tags its lines ``trainer <id>: ``, evaluates with the parameters it last received,
and closes its executor.
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
from examples.simnet_bow import data  # noqa: E402
from examples.simnet_bow.model import build_model  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train SimNet-BOW on generated query/title pairs (LoD inputs).")
    ap.add_argument("--samples", type=int, default=20_000, help="generated training triples")
    ap.add_argument("--test-samples", type=int, default=2_000, help="generated test triples")
    ap.add_argument("--vocab-size", type=int, default=1000)
    ap.add_argument("--topics", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    ap.add_argument("--emb-dim", type=int, default=64)
    ap.add_argument("--hid-dim", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    ap.add_argument("--seed", type=int, default=0)
    cluster.add_arguments(ap)
    return ap.parse_args(argv)


def _feed(batch: list[data.Sample]) -> dict[str, list[list[int]]]:
    """One list of variable-length sequences per LoD input: the executor pads and carries the lengths."""
    return {"query": [s[0] for s in batch], "pos_title": [s[1] for s in batch], "neg_title": [s[2] for s in batch]}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train and evaluate; returns ``{"steps", "first_loss", "final_loss", "test_accuracy",
    "examples_per_s"}`` (a pserver returns ``{}``)."""
    args = parse_args(argv)
    model = build_model(args.vocab_size, emb_dim=args.emb_dim, hid_dim=args.hid_dim, learning_rate=args.lr)
    job = cluster.distribute_from_args(model.main, model.startup, args)
    if job.is_pserver:
        return {}
    tag = job.tag
    train = data.generate(args.samples, args.vocab_size, args.topics, seed=args.seed, draw=0)
    test = data.generate(args.test_samples, args.vocab_size, args.topics, seed=args.seed, draw=1)
    scope = runtime.Scope()
    exe = runtime.Executor(runtime.CPUPlace())
    exe.run(job.startup, scope=scope)

    step, examples, losses = 0, 0, []
    window_start, window_examples = time.perf_counter(), 0
    start = window_start
    for epoch in range(args.epochs):
        for batch in job.shard(data.batches(train, args.batch_size, seed=args.seed * 1000 + epoch),
                               total=len(train) // args.batch_size):
            (loss_v,) = exe.run(job.main, feed=_feed(batch), fetch_list=[model.loss], scope=scope)
            step += 1
            examples += len(batch)
            window_examples += len(batch)
            losses.append(float(loss_v[0]))
            if step % args.log_every == 0:
                now = time.perf_counter()
                print(f"{tag}epoch {epoch} step {step:5d}  loss {np.mean(losses[-args.log_every:]):.4f}  "
                      f"{window_examples / (now - window_start):,.0f} examples/s", flush=True)
                window_start, window_examples = now, 0
    elapsed = time.perf_counter() - start
    span = max(1, min(args.log_every, len(losses) // 2))
    first_loss, last_loss = float(np.mean(losses[:span])), float(np.mean(losses[-span:]))

    cos_pos, cos_neg = exe.run(model.test, feed=_feed(test), fetch_list=[model.cos_pos, model.cos_neg], scope=scope)
    test_accuracy = float(np.mean(cos_pos[:, 0] > cos_neg[:, 0]))
    print(f"{tag}trained {step} steps ({examples} examples) in {elapsed:.1f}s, {examples / elapsed:,.0f} examples/s")
    print(f"{tag}loss {first_loss:.4f} -> {last_loss:.4f}")
    print(f"{tag}test pairwise accuracy: {test_accuracy:.3f}", flush=True)
    exe.close()
    return {"steps": step, "first_loss": first_loss, "final_loss": last_loss, "test_accuracy": test_accuracy,
            "examples_per_s": examples / elapsed}


if __name__ == "__main__":
    main()
