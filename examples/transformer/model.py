"""The Transformer example's model: a Transformer-encoder classifier of token sequences.

Token ``embedding`` plus a learned position embedding (a ``[seq_len, d_model]`` parameter added with
``elementwise_add`` on axis 1); ``num_layers`` post-norm encoder layers, each multi-head self-attention
(``fc`` projections, ``reshape``/``transpose`` into heads, ``matmul`` with ``transpose_y`` and
``alpha = 1/sqrt(d_head)``, ``softmax``, ``dropout``, ``matmul``, heads merged back, ``fc``) and a
``gelu`` feed-forward block, each with dropout, a residual add and ``layer_norm``; mean pooling over
the sequence (``reduce_mean``); ``fc`` to the classes; ``softmax_with_cross_entropy``; Adam. Dropout is
``upscale_in_train``, so the test program (``is_test`` set) passes activations through unscaled.

``build_model`` builds fresh (main, startup, test) programs under a fresh unique-name generator, so the
parameter names are the same in every build and every process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ir
from flotilla.fluid import layers, optimizer
from flotilla.fluid.initializer import Normal
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr


@dataclass(frozen=True)
class TransformerModel:
    """The built programs and the variables a training loop feeds and fetches."""

    main: ir.Program
    startup: ir.Program
    test: ir.Program
    feeds: tuple[str, ...]
    loss: ir.Variable
    accuracy: ir.Variable
    predict: ir.Variable


def _dropout(x: ir.Variable, prob: float) -> ir.Variable:
    if prob == 0.0:
        return x
    return layers.dropout(x, prob, dropout_implementation="upscale_in_train")


def multi_head_attention(x: ir.Variable, d_model: int, num_heads: int, dropout: float) -> ir.Variable:
    """Self-attention of ``x`` [N, T, d_model] with ``num_heads`` heads of ``d_model / num_heads``."""
    d_head = d_model // num_heads

    def heads(t: ir.Variable) -> ir.Variable:  # [N, T, d_model] -> [N, H, T, d_head]
        return layers.transpose(layers.reshape(t, [0, 0, num_heads, d_head]), [0, 2, 1, 3])

    q, k, v = (heads(layers.fc(x, d_model, num_flatten_dims=2)) for _ in range(3))
    scores = layers.matmul(q, k, transpose_y=True, alpha=d_head ** -0.5)  # [N, H, T, T]
    weights = _dropout(layers.softmax(scores), dropout)
    context = layers.matmul(weights, v)  # [N, H, T, d_head]
    merged = layers.reshape(layers.transpose(context, [0, 2, 1, 3]), [0, 0, d_model])
    return layers.fc(merged, d_model, num_flatten_dims=2)


def encoder_layer(x: ir.Variable, d_model: int, num_heads: int, d_ff: int, dropout: float) -> ir.Variable:
    """Post-norm encoder layer: x = LN(x + drop(MHA(x))); x = LN(x + drop(FFN(x))), FFN with gelu."""
    attn = _dropout(multi_head_attention(x, d_model, num_heads, dropout), dropout)
    x = layers.layer_norm(layers.elementwise_add(x, attn), begin_norm_axis=2)
    hidden = layers.fc(x, d_ff, num_flatten_dims=2, act="gelu")
    ffn = _dropout(layers.fc(hidden, d_model, num_flatten_dims=2), dropout)
    return layers.layer_norm(layers.elementwise_add(x, ffn), begin_norm_axis=2)


def build_model(vocab_size: int, seq_len: int, num_classes: int = 2, d_model: int = 64, num_heads: int = 4,
                num_layers: int = 2, d_ff: int = 256, dropout: float = 0.1,
                learning_rate: float = 0.002, make_optimizer: Any = None) -> TransformerModel:
    """The classifier of ``tokens`` int64 [N, seq_len] into ``num_classes`` classes (``label`` int64
    [N, 1]), trained by ``Adam(learning_rate)``, or by ``make_optimizer()`` when given (a benchmark's
    momentum / DGC)."""
    if d_model % num_heads:
        raise ValueError(f"d_model {d_model} must be divisible by num_heads {num_heads}")
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup), unique_name.guard():
        tokens = layers.data("tokens", [seq_len], dtype="int64")
        label = layers.data("label", [1], dtype="int64")
        emb = layers.embedding(tokens, [vocab_size, d_model],
                               param_attr=ParamAttr(name="word_emb", initializer=Normal(0.0, 0.02)))
        pos = layers.create_parameter([seq_len, d_model], "float32", name="pos_emb",
                                      default_initializer=Normal(0.0, 0.02))
        h = _dropout(layers.elementwise_add(emb, pos, axis=1), dropout)
        for _ in range(num_layers):
            h = encoder_layer(h, d_model, num_heads, d_ff, dropout)
        pooled = layers.reduce_mean(h, dim=[1])  # [N, d_model]
        logits = layers.fc(pooled, num_classes)
        loss_per_example, predict = layers.softmax_with_cross_entropy(logits, label, return_softmax=True)
        loss = layers.mean(loss_per_example)
        accuracy = layers.accuracy(predict, label)
        test = main.clone(for_test=True)  # is_test set on batch norm and dropout
        opt = make_optimizer() if make_optimizer is not None else optimizer.Adam(learning_rate=learning_rate)
        opt.minimize(loss)
    return TransformerModel(main, startup, test, ("tokens", "label"), loss, accuracy, predict)
