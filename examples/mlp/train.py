"""Train the MLP example: ``python examples/mlp/train.py [--train-size N] [--epochs E] [--batch-size B]
[--lr LR] [--sync|--async] [--no-slice]``.

Generates Gaussian-cluster data (``examples/mlp/data.py``), trains with SGD through ``runtime.Executor``,
prints a progress line every ``--log-every`` steps (step, loss, batch accuracy, examples/s) and, at the
end, the accuracy of the forward-only test program on a held-out draw: ``test accuracy: 0.xxx``.
``main(argv)`` returns the figures as a dict (the tests call it).

Distributed (``flotilla launch --server_num 2 --worker_num 2 examples/mlp/train.py``): the role comes
from the environment (``flotilla.cluster``); a pserver serves until every trainer has completed and
returns ``{}``; each trainer trains on its shard of the batches (batch ``i`` goes to trainer
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
from examples.mlp import data  # noqa: E402
from examples.mlp.model import build_model  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train an MLP classifier on generated Gaussian clusters.")
    ap.add_argument("--train-size", type=int, default=20_000, help="generated training examples")
    ap.add_argument("--test-size", type=int, default=4_000, help="generated test examples")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 64], help="hidden layer widths")
    ap.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    ap.add_argument("--seed", type=int, default=0)
    cluster.add_arguments(ap)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train and evaluate; returns ``{"steps", "final_loss", "train_accuracy", "test_accuracy",
    "examples_per_s"}`` (a pserver returns ``{}``)."""
    args = parse_args(argv)
    model = build_model(data.DIM, data.NUM_CLASSES, hidden=args.hidden, learning_rate=args.lr)
    job = cluster.distribute_from_args(model.main, model.startup, args)
    if job.is_pserver:
        return {}
    tag = job.tag
    x, y = data.generate(args.train_size, seed=args.seed, draw=0)
    tx, ty = data.generate(args.test_size, seed=args.seed, draw=1)
    scope = runtime.Scope()
    exe = runtime.Executor(runtime.CPUPlace())
    exe.run(job.startup, scope=scope)

    step, examples, loss, acc = 0, 0, float("nan"), float("nan")
    window_start, window_examples = time.perf_counter(), 0
    start = window_start
    for epoch in range(args.epochs):
        batches = data.batches(x, y, args.batch_size, seed=args.seed * 1000 + epoch)
        for bx, by in job.shard(batches, total=len(x) // args.batch_size):
            loss_v, acc_v = exe.run(job.main, feed={"x": bx, "label": by},
                                    fetch_list=[model.loss, model.accuracy], scope=scope)
            step += 1
            examples += len(bx)
            window_examples += len(bx)
            loss, acc = float(loss_v[0]), float(acc_v[0])
            if step % args.log_every == 0:
                now = time.perf_counter()
                print(f"{tag}epoch {epoch} step {step:5d}  loss {loss:.4f}  batch accuracy {acc:.3f}  "
                      f"{window_examples / (now - window_start):,.0f} examples/s", flush=True)
                window_start, window_examples = now, 0
    elapsed = time.perf_counter() - start

    (predict,) = exe.run(model.test, feed={"x": tx, "label": ty}, fetch_list=[model.predict], scope=scope)
    test_accuracy = float(np.mean(np.argmax(predict, axis=1) == ty[:, 0]))
    print(f"{tag}trained {step} steps ({examples} examples) in {elapsed:.1f}s, "
          f"{examples / elapsed:,.0f} examples/s")
    print(f"{tag}test accuracy: {test_accuracy:.3f}", flush=True)
    exe.close()
    return {"steps": step, "final_loss": loss, "train_accuracy": acc, "test_accuracy": test_accuracy,
            "examples_per_s": examples / elapsed}


if __name__ == "__main__":
    main()
