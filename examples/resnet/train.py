"""Train the ResNet example: ``python examples/resnet/train.py [--steps S] [--batch-size B] [--depth D]
[--width W] [--lr LR] [--seed SEED]``.

Draws CIFAR-sized generated images batch by batch (``examples/resnet/data.py``), trains a small ResNet
(``examples/resnet/model.py``) with Momentum through ``runtime.Executor``, prints a progress line every
``--log-every`` steps (step, loss, batch accuracy, examples/s) and, at the end, the accuracy of the
forward-only test program on a held-out draw: ``test accuracy: 0.xxx``. ``main(argv)`` returns the
figures as a dict (the tests call it); ``build(args)`` and ``batches(args, ...)`` are what a benchmark
needs to time a training step (``bench/collective_bench.py``).

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
from examples.resnet import data  # noqa: E402
from examples.resnet.model import ResNetModel, build_model  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = classifier_loop.argument_parser("Train a small ResNet on generated CIFAR-sized images.")
    ap.add_argument("--depth", type=int, default=8, help="ResNet depth, 6n + 2 (8, 14, 20, ...)")
    ap.add_argument("--width", type=int, default=16, help="channels of the first stage (doubled twice)")
    ap.add_argument("--lr", type=float, default=0.05, help="Momentum learning rate")
    ap.add_argument("--momentum", type=float, default=0.9)
    args = classifier_loop.parse_args(ap, argv, positive=("width",))
    if args.depth < 8 or (args.depth - 2) % 6:
        ap.error(f"--depth must be 6n + 2 with n >= 1 (8, 14, 20, ...), got {args.depth}")
    return args


def build_resnet(args: argparse.Namespace) -> ResNetModel:
    """The model ``args`` describe."""
    return build_model(depth=args.depth, width=args.width, num_classes=data.NUM_CLASSES,
                       image_shape=data.SHAPE, learning_rate=args.lr, momentum=args.momentum)


def build(args: argparse.Namespace) -> tuple[ir.Program, ir.Program, ir.Variable, tuple[str, ...]]:
    """``(main, startup, loss, feed names)`` of the single-machine training programs (for a benchmark)."""
    model = build_resnet(args)
    return model.main, model.startup, model.loss, model.feeds


def batches(args: argparse.Namespace, num_batches: int, draw: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """``num_batches`` training feed dicts of ``args.batch_size`` examples, the same in every process."""
    return data.batches(args.batch_size, num_batches, seed=args.seed, draw=draw)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train and evaluate; returns ``{"steps", "first_loss", "final_loss", "train_accuracy",
    "test_accuracy", "examples_per_s"}`` (examples/s over the steps after the first, which compiles;
    a pserver returns ``{}``)."""
    args = parse_args(argv)
    model = build_resnet(args)

    def test_accuracy(exe: runtime.Executor, scope: runtime.Scope) -> float:
        tx, ty = data.generate(args.test_size, seed=args.seed, draw=1)
        correct = 0
        for lo in range(0, len(tx), args.batch_size):
            bx, by = tx[lo:lo + args.batch_size], ty[lo:lo + args.batch_size]
            (predict,) = exe.run(model.test, feed={"image": bx, "label": by}, fetch_list=[model.predict],
                                 scope=scope)
            correct += int(np.sum(np.argmax(predict, axis=1) == by[:, 0]))
        return correct / len(tx)

    return classifier_loop.train(args, model, lambda total: batches(args, total), test_accuracy)


if __name__ == "__main__":
    main()
