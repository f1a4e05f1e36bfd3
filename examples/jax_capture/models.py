"""Three models written in plain JAX (no Flotilla API): ``loss_fn(params, batch)`` over pytrees of arrays,
an ``init(seed)`` giving the parameters and ``batches(seed, steps, rows)`` giving example batches.

Invariants: everything is float32 except ids (int32, as JAX users write them); each loss is a mean
over the batch rows, so data-parallel training on shards of a batch equals training on the batch.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]
Batch = dict[str, np.ndarray]


# --- MLP: regression -------------------------------------------------------------------------------
def mlp_loss(params: Params, batch: Batch) -> Any:
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def mlp_init(seed: int = 0, d_in: int = 32, hidden: int = 64, d_out: int = 4) -> Params:
    rng = np.random.default_rng(seed)
    return {"w1": (rng.normal(size=(d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
            "b1": np.zeros(hidden, np.float32),
            "w2": (rng.normal(size=(hidden, d_out)) / np.sqrt(hidden)).astype(np.float32)}


def mlp_batches(seed: int = 1, steps: int = 10, rows: int = 16, d_in: int = 32, d_out: int = 4) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(rows, d_in)).astype(np.float32),
             "y": rng.normal(size=(rows, d_out)).astype(np.float32)} for _ in range(steps)]


# --- CTR: sparse ids → embedding → sum pooling, dense features → MLP → logistic loss --------------
CTR_ROWS, CTR_EMB, CTR_SLOTS, CTR_DENSE = 1000, 8, 4, 5


def ctr_loss(params: Params, batch: Batch) -> Any:
    emb = params["emb"][batch["ids"]]  # [b, slots, emb]: a row gather → lookup_table
    pooled = jnp.sum(emb, axis=1)
    h = jnp.concatenate([pooled, batch["dense"]], axis=1)
    h = jnp.tanh(h @ params["fc1"]["w"] + params["fc1"]["b"])
    logit = (h @ params["out"]["w"] + params["out"]["b"])[:, 0]
    y = batch["label"]
    return jnp.mean(jnp.logaddexp(0.0, logit) - y * logit)


def ctr_init(seed: int = 0) -> Params:
    rng = np.random.default_rng(seed)
    d = CTR_EMB + CTR_DENSE
    return {"emb": (0.1 * rng.normal(size=(CTR_ROWS, CTR_EMB))).astype(np.float32),
            "fc1": {"w": (rng.normal(size=(d, 16)) / np.sqrt(d)).astype(np.float32), "b": np.zeros(16, np.float32)},
            "out": {"w": (rng.normal(size=(16, 1)) / 4.0).astype(np.float32), "b": np.zeros(1, np.float32)}}


def ctr_batches(seed: int = 1, steps: int = 10, rows: int = 16) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [{"ids": rng.integers(0, CTR_ROWS, size=(rows, CTR_SLOTS)).astype(np.int32),
             "dense": rng.normal(size=(rows, CTR_DENSE)).astype(np.float32),
             "label": rng.integers(0, 2, size=(rows,)).astype(np.float32)} for _ in range(steps)]


# --- a 2-layer Transformer encoder classifying token sequences ---------------------------------------
TF_VOCAB, TF_SEQ, TF_D, TF_HEADS, TF_FF, TF_CLASSES, TF_LAYERS = 50, 8, 16, 2, 32, 3, 2


def _layer_norm(x: Any, g: Any, b: Any) -> Any:
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * g + b


def _attention(x: Any, p: Params) -> Any:
    b, s, d = x.shape
    dh = d // TF_HEADS

    def heads(t: Any) -> Any:
        return t.reshape(b, s, TF_HEADS, dh).transpose(0, 2, 1, 3)

    q, k, v = heads(x @ p["wq"]), heads(x @ p["wk"]), heads(x @ p["wv"])
    scores = (q @ k.transpose(0, 1, 3, 2)) * float(1.0 / np.sqrt(dh))
    att = jax.nn.softmax(scores, axis=-1)
    out = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
    return out @ p["wo"]


def transformer_loss(params: Params, batch: Batch) -> Any:
    x = params["tok"][batch["tokens"]] + params["pos"]
    for blk in params["blocks"]:
        x = _layer_norm(x + _attention(x, blk["attn"]), blk["ln1"]["g"], blk["ln1"]["b"])
        ff = jax.nn.relu(x @ blk["ff"]["w1"] + blk["ff"]["b1"]) @ blk["ff"]["w2"] + blk["ff"]["b2"]
        x = _layer_norm(x + ff, blk["ln2"]["g"], blk["ln2"]["b"])
    pooled = jnp.mean(x, axis=1)
    logp = jax.nn.log_softmax(pooled @ params["head"])
    return -jnp.mean(jnp.sum(batch["y"] * logp, axis=-1))


def transformer_init(seed: int = 0) -> Params:
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)

    def block() -> Params:
        return {"attn": {"wq": w(TF_D, TF_D), "wk": w(TF_D, TF_D), "wv": w(TF_D, TF_D), "wo": w(TF_D, TF_D)},
                "ln1": {"g": np.ones(TF_D, np.float32), "b": np.zeros(TF_D, np.float32)},
                "ff": {"w1": w(TF_D, TF_FF), "b1": np.zeros(TF_FF, np.float32), "w2": w(TF_FF, TF_D),
                       "b2": np.zeros(TF_D, np.float32)},
                "ln2": {"g": np.ones(TF_D, np.float32), "b": np.zeros(TF_D, np.float32)}}

    return {"tok": (0.1 * rng.normal(size=(TF_VOCAB, TF_D))).astype(np.float32),
            "pos": (0.1 * rng.normal(size=(TF_SEQ, TF_D))).astype(np.float32),
            "blocks": [block() for _ in range(TF_LAYERS)], "head": w(TF_D, TF_CLASSES)}


def transformer_batches(seed: int = 1, steps: int = 10, rows: int = 8) -> list[Batch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, TF_VOCAB, size=(rows, TF_SEQ)).astype(np.int32)
        y = np.eye(TF_CLASSES, dtype=np.float32)[tokens[:, 0] % TF_CLASSES]
        out.append({"tokens": tokens, "y": y})
    return out


MODELS: dict[str, tuple[Callable[..., Any], Callable[..., Params], Callable[..., list[Batch]]]] = {
    "mlp": (mlp_loss, mlp_init, mlp_batches),
    "ctr": (ctr_loss, ctr_init, ctr_batches),
    "transformer": (transformer_loss, transformer_init, transformer_batches),
}


# --- the hand-written reference: jax.value_and_grad and a plain update loop -------------------------
def reference_train(loss_fn: Callable[..., Any], params: Params, batches: list[Batch], opt: str,
                    lr: float) -> tuple[Params, list[float]]:
    """Train with ``jax.value_and_grad`` and the optimizer written out (Fluid's SGD or Adam formulas). The
    update is one jitted function over the whole pytree: run eagerly, its per-leaf operations dispatched
    (and compiled) one by one took longer than the training they check."""
    vg = jax.jit(jax.value_and_grad(loss_fn))
    p = jax.tree_util.tree_map(jnp.asarray, params)
    m = jax.tree_util.tree_map(jnp.zeros_like, p)
    v = jax.tree_util.tree_map(jnp.zeros_like, p)
    b1, b2, eps = np.float32(0.9), np.float32(0.999), np.float32(1e-8)

    @jax.jit
    def sgd(p: Params, g: Params) -> Params:
        return jax.tree_util.tree_map(lambda a, ga: a - lr * ga, p, g)

    @jax.jit
    def adam(p: Params, m: Params, v: Params, g: Params, lr_t: Any) -> tuple[Params, Params, Params]:
        m = jax.tree_util.tree_map(lambda a, ga: b1 * a + (1 - b1) * ga, m, g)
        v = jax.tree_util.tree_map(lambda a, ga: b2 * a + (1 - b2) * ga * ga, v, g)
        return jax.tree_util.tree_map(lambda a, ma, va: a - lr_t * (ma / (jnp.sqrt(va) + eps)), p, m, v), m, v

    losses = []
    for t, batch in enumerate(batches, start=1):
        loss, g = vg(p, batch)
        losses.append(float(loss))
        if opt == "sgd":
            p = sgd(p, g)
        else:
            p, m, v = adam(p, m, v, g, np.float32(lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)))
    return p, losses


def named(params: Params) -> dict[str, np.ndarray]:
    """Parameters by pytree path, as capture names them."""
    from flotilla.jax import leaf_names

    return {n: np.asarray(v) for n, v in leaf_names(params)}
