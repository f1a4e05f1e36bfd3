"""The word2vec example's model: skip-gram with negative sampling.

Inputs: ``center`` int64 [N, 1], ``context`` int64 [N, 1 + k] (the true context word, then k
negatives), ``label`` float32 [N, 1 + k] (1 then k zeros). Two sparse embedding tables, ``emb_in``
(center vectors) and ``emb_out`` (context vectors), [vocab_size, dim] each; the logits are the dot
products of the center's vector with each context vector (a batched ``matmul`` [N, 1+k, D] × [N, D, 1]),
the loss is ``sigmoid_cross_entropy_with_logits`` summed over the 1 + k columns and averaged over the
batch. Trained with SGD on selected-rows gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import ir
from flotilla.fluid import layers, optimizer
from flotilla.fluid.param_attr import ParamAttr
from flotilla.fluid.initializer import Constant, Uniform
from ir.names import unique_name


@dataclass(frozen=True)
class Word2VecModel:
    main: ir.Program
    startup: ir.Program
    feeds: tuple[str, ...]
    loss: ir.Variable
    in_table: str
    out_table: str


def build_model(vocab_size: int, dim: int = 32, num_neg: int = 5, learning_rate: float = 10.0) -> Word2VecModel:
    """The skip-gram programs; the input vectors start uniform in ±0.5/dim, the output vectors at zero
    (as word2vec)."""
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup), unique_name.guard():
        center = layers.data("center", [1], dtype="int64")
        context = layers.data("context", [1 + num_neg], dtype="int64")
        label = layers.data("label", [1 + num_neg], dtype="float32")
        center_vec = layers.embedding(
            center, size=[vocab_size, dim], is_sparse=True,
            param_attr=ParamAttr(name="emb_in", initializer=Uniform(-0.5 / dim, 0.5 / dim)))
        context_vecs = layers.embedding(
            context, size=[vocab_size, dim], is_sparse=True,
            param_attr=ParamAttr(name="emb_out", initializer=Constant(0.0)))
        logits = layers.matmul(context_vecs, layers.reshape(center_vec, [-1, dim, 1]))
        logits = layers.reshape(logits, [-1, 1 + num_neg])
        xent = layers.sigmoid_cross_entropy_with_logits(logits, label)
        loss = layers.mean(layers.reduce_sum(xent, dim=1))
        optimizer.SGD(learning_rate=learning_rate).minimize(loss)
    return Word2VecModel(main, startup, ("center", "context", "label"), loss, "emb_in", "emb_out")
