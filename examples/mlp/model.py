"""The MLP example's model: ``fc`` hidden layers with relu, a softmax output, softmax cross entropy,
mean loss and accuracy, trained with SGD.

``build_model`` builds fresh (main, startup) programs under a fresh unique-name generator, so the
parameter names are the same in every build (``fc_0.w_0``, ``fc_0.b_0``, … in layer order). The programs
keep ``random_seed`` 0: the executor then draws each initializer from its own op-indexed key, so every
build initialises identically while parameters of equal shape still differ (a nonzero program seed
gives every initializer op that same seed, hence equal values for equal shapes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import ir
from flotilla.fluid import layers, optimizer
from ir.names import unique_name


@dataclass(frozen=True)
class MLPModel:
    """The built programs and the variables a training loop feeds and fetches."""

    main: ir.Program
    startup: ir.Program
    test: ir.Program
    feeds: tuple[str, ...]
    loss: ir.Variable
    accuracy: ir.Variable
    predict: ir.Variable


def build_model(dim: int, num_classes: int, hidden: Sequence[int] = (128, 64), learning_rate: float = 0.1) -> MLPModel:
    """The classifier of ``dim``-dimensional float inputs ``x`` [N, dim] into ``num_classes`` classes
    (``label`` int64 [N, 1]); ``test`` is the forward-only clone taken before the optimizer ops."""
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup), unique_name.guard():
        x = layers.data("x", [dim], dtype="float32")
        label = layers.data("label", [1], dtype="int64")
        h = x
        for width in hidden:
            h = layers.fc(h, width, act="relu")
        logits = layers.fc(h, num_classes)
        loss_per_example, predict = layers.softmax_with_cross_entropy(logits, label, return_softmax=True)
        loss = layers.mean(loss_per_example)
        accuracy = layers.accuracy(predict, label)
        test = main.clone(for_test=True)
        optimizer.SGD(learning_rate=learning_rate).minimize(loss)
    return MLPModel(main, startup, test, ("x", "label"), loss, accuracy, predict)
