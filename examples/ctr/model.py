"""The CTR example's model: wide and deep, as Paddle's ``dist_ctr`` test model.

Inputs: ``dense_input`` float32 [N, 13], ``sparse_input`` int64 [N, 26] (one hashed id a slot),
``label`` int64 [N, 1].

- deep: ONE embedding table ``deep_embedding`` [hash_dim, embedding_dim] (``is_sparse``) looked up for
  all 26 slots → reshape [N, 26·embedding_dim] → concat with the dense features → fc 400-400-400 relu;
- wide: a [hash_dim, 1] sparse table ``wide_embedding`` looked up for all slots and summed over them
  (``sequence_pool`` sum);
- predict = fc([deep, wide], 2, softmax); loss = mean(cross_entropy); ``auc`` over predict.

``is_distributed=True`` makes the deep table a distributed lookup table: the pserver transpiler keeps it
on the pservers, sharded by row, and the trainer prefetches the rows a batch needs (``split_ids →
prefetch → merge_ids``) instead of holding the table. The transpiler supports one distributed table a
program, so the wide table stays a normal sparse parameter (sliced over the pservers and received whole
by the trainer). The programs are built under a fresh unique-name generator, so the names are the
same in every build; ``test`` is the forward-only clone taken before backward and optimizer ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import ir
from flotilla.fluid import layers, optimizer
from flotilla.fluid.param_attr import ParamAttr
from ir.errors import IRError
from flotilla.fluid.initializer import Uniform
from ir.names import unique_name

NUM_DENSE = 13
NUM_SPARSE = 26
OPTIMIZERS = ("sgd", "adagrad", "adam")
DEFAULT_LR = {"sgd": 0.5, "adagrad": 0.01, "adam": 0.001}


@dataclass(frozen=True)
class CTRModel:
    """The built programs and the variables a training loop feeds and fetches."""

    main: ir.Program
    startup: ir.Program
    test: ir.Program
    feeds: tuple[str, ...]
    loss: ir.Variable
    predict: ir.Variable
    auc: ir.Variable
    batch_auc: ir.Variable
    auc_states: tuple[ir.Variable, ...]


def make_optimizer(name: str, learning_rate: float | None = None) -> optimizer.Optimizer:
    """``sgd``, ``adagrad`` or ``adam`` with ``learning_rate`` (its ``DEFAULT_LR`` when None)."""
    if name not in OPTIMIZERS:
        raise IRError(f"unknown optimizer {name!r}, expected one of {list(OPTIMIZERS)}")
    lr = DEFAULT_LR[name] if learning_rate is None else learning_rate
    if name == "sgd":
        return optimizer.SGD(learning_rate=lr)
    if name == "adagrad":
        return optimizer.Adagrad(learning_rate=lr)
    return optimizer.Adam(learning_rate=lr)


def build_model(hash_dim: int, embedding_dim: int = 16, hidden: Sequence[int] = (400, 400, 400),
                optimizer_name: str = "adagrad", learning_rate: float | None = None,
                is_distributed: bool = False) -> CTRModel:
    """The wide-and-deep CTR programs over ``hash_dim`` hash buckets, trained with ``optimizer_name``."""
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup), unique_name.guard():
        dense = layers.data("dense_input", [NUM_DENSE], dtype="float32")
        sparse = layers.data("sparse_input", [NUM_SPARSE], dtype="int64")
        label = layers.data("label", [1], dtype="int64")

        deep_emb = layers.embedding(
            sparse, size=[hash_dim, embedding_dim], is_sparse=True, is_distributed=is_distributed,
            param_attr=ParamAttr(name="deep_embedding", initializer=Uniform(-0.05, 0.05)))
        deep = layers.concat([layers.reshape(deep_emb, [-1, NUM_SPARSE * embedding_dim]), dense], axis=1)
        for width in hidden:
            deep = layers.fc(deep, width, act="relu")

        wide_emb = layers.embedding(
            sparse, size=[hash_dim, 1], is_sparse=True,
            param_attr=ParamAttr(name="wide_embedding", initializer=Uniform(-0.05, 0.05)))
        wide = layers.sequence_pool(wide_emb, "sum")

        predict = layers.fc([deep, wide], 2, act="softmax")
        loss = layers.mean(layers.cross_entropy(predict, label))
        auc, batch_auc, states = layers.auc(predict, label)
        test = main.clone(for_test=True)
        make_optimizer(optimizer_name, learning_rate).minimize(loss)
    return CTRModel(main, startup, test, ("dense_input", "sparse_input", "label"), loss, predict, auc, batch_auc,
                    tuple(states))
