"""The SimNet-BOW model, as Paddle's ``dist_simnet_bow.py``: the query and both titles are LoD sequences
of word ids (``lod_level=1``); each is embedded through one shared table (``emb.w``), summed over its words
(``sequence_pool`` sum), squashed with ``softsign`` and projected by ``fc`` (query and titles have their
own fc); the scores are the cosine similarities of the query with each title, trained with the pairwise
hinge loss ``mean(max(0, margin - cos(q, pos) + cos(q, neg)))`` by SGD.

``build_model`` builds fresh programs under a fresh unique-name generator, so names are stable across
builds; ``test`` is the forward-only clone taken before the optimizer ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import ir
from flotilla.fluid import layers, optimizer
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr

FEEDS = ("query", "pos_title", "neg_title")


@dataclass(frozen=True)
class SimnetModel:
    """The built programs and the variables a training loop feeds and fetches."""

    main: ir.Program
    startup: ir.Program
    test: ir.Program
    feeds: tuple[str, ...]
    loss: ir.Variable
    cos_pos: ir.Variable
    cos_neg: ir.Variable


def _bow(ids: ir.Variable, vocab_size: int, emb_dim: int, hid_dim: int, fc_name: str, is_sparse: bool) -> ir.Variable:
    emb = layers.embedding(ids, size=[vocab_size, emb_dim], is_sparse=is_sparse, param_attr=ParamAttr(name="emb.w"))
    pooled = layers.softsign(layers.sequence_pool(emb, "sum"))
    return layers.fc(pooled, hid_dim, param_attr=ParamAttr(name=f"{fc_name}.w"),
                     bias_attr=ParamAttr(name=f"{fc_name}.b"))


def build_model(vocab_size: int, emb_dim: int = 64, hid_dim: int = 64, margin: float = 0.1,
                learning_rate: float = 0.2, is_sparse: bool = True) -> SimnetModel:
    """The pairwise model over ``query``, ``pos_title`` and ``neg_title`` (int64 LoD sequences)."""
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup), unique_name.guard():
        q, pt, nt = (layers.data(name, shape=[1], dtype="int64", lod_level=1) for name in FEEDS)
        q_fc = _bow(q, vocab_size, emb_dim, hid_dim, "q_fc", is_sparse)
        pt_fc = _bow(pt, vocab_size, emb_dim, hid_dim, "t_fc", is_sparse)
        nt_fc = _bow(nt, vocab_size, emb_dim, hid_dim, "t_fc", is_sparse)
        cos_pos = layers.cos_sim(q_fc, pt_fc)
        cos_neg = layers.cos_sim(q_fc, nt_fc)
        margin_v = layers.fill_constant_batch_size_like(cos_pos, [-1, 1], "float32", margin)
        hinge = layers.elementwise_add(layers.elementwise_sub(margin_v, cos_pos), cos_neg)
        zero = layers.fill_constant_batch_size_like(hinge, [-1, 1], "float32", 0.0)
        loss = layers.mean(layers.elementwise_max(zero, hinge))
        test = main.clone(for_test=True)
        optimizer.SGD(learning_rate=learning_rate).minimize(loss)
    return SimnetModel(main, startup, test, FEEDS, loss, cos_pos, cos_neg)
