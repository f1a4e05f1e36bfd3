"""Train the Transformer example: ``python examples/transformer/train.py [--steps S] [--batch-size B]
[--layers L] [--d-model D] [--heads H] [--d-ff F] [--dropout P] [--lr LR] [--seed SEED]``.

Draws generated token sequences batch by batch (``examples/transformer/data.py``), trains a small
Transformer-encoder classifier (``examples/transformer/model.py``) with Adam through
``runtime.Executor``, prints a progress line every ``--log-every`` steps (step, loss, batch accuracy,
examples/s) and, at the end, the accuracy of the forward-only test program on a held-out draw:
``test accuracy: 0.xxx``. ``main(argv)`` returns the figures as a dict (the tests call it);
``build(args)`` and ``batches(args, ...)`` are what a benchmark needs to time a training step
(``bench/collective_bench.py``).

Distributed like every example: see ``examples/classifier_loop.py``.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Iterator, Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import ir  # noqa: E402
import runtime  # noqa: E402
from examples import classifier_loop  # noqa: E402
from examples.transformer import data  # noqa: E402
from examples.transformer.model import TransformerModel, build_model  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = classifier_loop.argument_parser("Train a Transformer-encoder classifier on generated token sequences.")
    ap.add_argument("--layers", type=int, default=2, help="encoder layers")
    ap.add_argument("--d-model", type=int, default=64, help="model width")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (must divide --d-model)")
    ap.add_argument("--d-ff", type=int, default=256, help="feed-forward width")
    ap.add_argument("--dropout", type=float, default=0.1, help="dropout probability (0 disables dropout)")
    ap.add_argument("--lr", type=float, default=0.002, help="Adam learning rate")
    args = classifier_loop.parse_args(ap, argv, positive=("layers", "d_model", "heads", "d_ff"))
    if args.d_model % args.heads:
        ap.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    if not 0.0 <= args.dropout < 1.0:
        ap.error(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


def build_transformer(args: argparse.Namespace) -> TransformerModel:
    """The model ``args`` describe."""
    return build_model(data.VOCAB_SIZE, data.SEQ_LEN, num_classes=data.NUM_CLASSES, d_model=args.d_model,
                       num_heads=args.heads, num_layers=args.layers, d_ff=args.d_ff, dropout=args.dropout,
                       learning_rate=args.lr)


def build(args: argparse.Namespace) -> tuple[ir.Program, ir.Program, ir.Variable, tuple[str, ...]]:
    """``(main, startup, loss, feed names)`` of the single-machine training programs (for a benchmark)."""
    model = build_transformer(args)
    return model.main, model.startup, model.loss, model.feeds


def batches(args: argparse.Namespace, num_batches: int, draw: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """``num_batches`` training feed dicts of ``args.batch_size`` examples, the same in every process."""
    return data.batches(args.batch_size, num_batches, seed=args.seed, draw=draw)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train and evaluate; returns ``{"steps", "first_loss", "final_loss", "train_accuracy",
    "test_accuracy", "examples_per_s"}`` (examples/s over the steps after the first, which compiles;
    a pserver returns ``{}``)."""
    args = parse_args(argv)
    model = build_transformer(args)

    def test_accuracy(exe: runtime.Executor, scope: runtime.Scope) -> float:
        tx, ty = data.generate(args.test_size, seed=args.seed, draw=1)
        (predict,) = exe.run(model.test, feed={"tokens": tx, "label": ty}, fetch_list=[model.predict], scope=scope)
        return float(np.mean(np.argmax(predict, axis=1) == ty[:, 0]))

    return classifier_loop.train(args, model, lambda total: batches(args, total), test_accuracy)


if __name__ == "__main__":
    main()
