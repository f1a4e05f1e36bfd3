"""Kernels of Deep Gradient Compression (Lin et al., ICLR 2018): ``dgc``, ``dgc_allreduce``, ``dgc_momentum``
(schemas and the schedule in ``ir.ops.dgc``).

Invariants:
- Every shape is static. The step picks a branch (``lax.switch``) of a static k per sparsity stage, so a
  stage's compiled code selects, sends and decodes exactly its own k entries; the encoded buffers are
  padded to the first stage's ``k_max`` (padding: index 0, value 0, never masked).
- Exactness of the residual: an entry is either sent (its value in ``EncodeValue``, zeroed in U and V) or
  kept in V untouched, so ``decode(sent) + VOut == V + U_corrected`` holds exactly.
- Selection: ``lax.top_k`` of ``|V|`` when ``k <= EXACT_K_MAX`` (exact, largest first). Above it XLA's CPU
  top_k grows with k (1M floats: 2 ms at k = 1,024, 19 ms at 4,096, 195 ms at 262,144, measured here;
  ``lax.approx_max_k`` and a per-chunk top-k were no faster on CPU), so the paper's sampling is used
  (O(numel): 9-20 ms for 1M floats, under 1 ms for 64K, whatever k): a strided sample of ~1% of ``|V|`` (at least ``SAMPLE_MIN`` entries), its top ``k * sample/numel``
  give a threshold. When at most k entries are at or above it, they are all taken (in index order, padded to
  k; padding not sent): at most k sent, close to k. When more pass, the paper re-selects the top k among
  them; here the threshold is raised by bisection on the floats' bit patterns (a ``lax.while_loop`` in a
  ``lax.switch`` branch, so only such steps pay for it; one count per halving) until it keeps between
  ``k - k/RESELECT_SLACK`` (64) and k entries, or it reaches the k-th largest value (then ties there fill
  up to exactly k, the first in index order). The bisection runs over the candidates compacted into a
  buffer of ``CANDIDATES_PER_K * k`` (2), over all of ``|V|`` only when even more pass. Cost on 1M
  float32 (min of 24 calls, load ~9): 8-10 ms with or without it while count <= k; count in (k, 2k]:
  +1 ms at k = 4,096, +4 ms at 65,536, +10 ms at 262,144 (about 2x); count > 2k: +3, +6, +9 ms. The
  entries sent are the largest of ``|V|``: every entry sent is at least every entry kept back.
- All ranks take the same branch: the step counter is replicated (every rank increments it once a step).
- ``dgc_allreduce`` sends one collective a step whatever the number of gradients: before rampup one
  fused sum of every gradient, after it one gather of every gradient's (index, value) pairs. With the
  group's shared-memory arena both go through it (``switch_shared`` threads its token through the
  ``lax.switch``; the gather is two sums of per-rank slots: indices as int32, then values, so no float
  rounding can touch an index); without it they are XLA's ``psum`` and one ``all_gather``, the indices
  bitcast into the values' dtype when their widths match (float32: int32, float64: int64). When the
  schedule has a single branch (``rampup_begin_step`` 0 and one k per gradient) there is no ``lax.switch``.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax.numpy as jnp
from jax import lax

from ir.ops.dgc import dgc_k
from runtime.kernels.collective import allgather, allreduce_dense, current_axis, switch_shared
from runtime.kernels.registry import Ins, kernel, one

EXACT_K_MAX = 2048
SAMPLE_MIN = 2048
SAMPLE_FRACTION = 0.01
CANDIDATES_PER_K = 2
RESELECT_SLACK = 64


def stage_branch(step: Any, begin: int, rampup_step: int, table: list[int]) -> Any:
    """0 before ``begin``, else ``1 + table[stage]`` (``table``: the branch of each sparsity stage)."""
    stages = len(table)
    stage = jnp.clip((step - begin) * stages // max(1, rampup_step), 0, stages - 1)
    return jnp.where(step < begin, 0, 1 + jnp.asarray(table, jnp.int32)[stage])


def unique_ks(ks: list[Any]) -> tuple[list[Any], list[int]]:
    """The distinct values of ``ks`` in order, and each entry's index among them."""
    uniq: list[Any] = []
    for k in ks:
        if k not in uniq:
            uniq.append(k)
    return uniq, [uniq.index(k) for k in ks]


def _step(ins: Ins) -> Any:
    return jnp.reshape(one(ins, "Step"), (-1,))[0].astype(jnp.int32)


def select_top_k(a: Any, k: int) -> tuple[Any, Any]:
    """(indices int32 [k], valid bool [k]) of (about) the ``k`` largest entries of the flat ``a >= 0``;
    see the module docstring for when this is exact."""
    n = a.shape[0]
    if k >= n:
        return jnp.arange(n, dtype=jnp.int32), jnp.ones((n,), bool)
    if k <= EXACT_K_MAX:
        _, idx = lax.top_k(a, k)
        return idx.astype(jnp.int32), jnp.ones((k,), bool)
    samples = min(n, max(SAMPLE_MIN, int(n * SAMPLE_FRACTION)))
    stride = n // samples
    ks = max(1, math.ceil(k * samples / n))
    threshold = lax.top_k(a[::stride][:samples], ks)[0][-1]
    above = a >= threshold
    count = jnp.sum(above, dtype=jnp.int32)
    cap = min(n, CANDIDATES_PER_K * k)

    def all_above() -> tuple[Any, Any]:  # at most k: all of them
        return jnp.nonzero(above, size=k, fill_value=0)[0].astype(jnp.int32), jnp.arange(k) < count

    def among_candidates() -> tuple[Any, Any]:  # k < count <= cap: re-select among them, compacted
        cand = jnp.nonzero(above, size=cap, fill_value=0)[0]
        bits = jnp.where(jnp.arange(cap) < count, _bits(a)[cand], -1)  # padding: below every entry
        keep = _top_k_mask(bits, _bits(threshold), k)
        kept = jnp.arange(k) < jnp.sum(keep, dtype=jnp.int32)
        return cand[jnp.nonzero(keep, size=k, fill_value=0)[0]].astype(jnp.int32), kept

    def whole() -> tuple[Any, Any]:  # more than cap (a badly low sample): re-select over all of a
        keep = _top_k_mask(_bits(a), _bits(threshold), k)
        return jnp.nonzero(keep, size=k, fill_value=0)[0].astype(jnp.int32), jnp.arange(k) < jnp.sum(keep)

    branch = (count > k).astype(jnp.int32) + (count > cap).astype(jnp.int32)
    return lax.switch(branch, [all_above, among_candidates, whole])


def _bits(a: Any) -> Any:
    """The bit patterns of floats ``a >= 0`` as signed ints of their width: they order as the floats."""
    return lax.bitcast_convert_type(a, jnp.dtype(f"int{8 * a.dtype.itemsize}"))


def _top_k_mask(bits: Any, lo: Any, k: int) -> Any:
    """The mask of the largest of ``bits``, between ``k - k // RESELECT_SLACK`` and exactly ``k`` of them
    (ties at the k-th: the first in index order), given ``lo`` with more than ``k`` entries at or above it.
    Bisection: ``lo`` keeps more than ``k``, ``hi`` at most ``k``, until ``hi`` keeps enough or they are
    adjacent (then the ties at ``lo`` fill up to k); one pass over ``bits`` per halving, at most one per bit."""
    limit = jnp.asarray(k, jnp.int32)
    enough = jnp.asarray(k - k // RESELECT_SLACK, jnp.int32)

    def searching(s: tuple[Any, Any, Any]) -> Any:
        lo, hi, kept = s
        return (hi - lo > 1) & (kept < enough)

    def halve(s: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        lo, hi, kept = s
        mid = lo + (hi - lo) // 2
        count = jnp.sum(bits >= mid, dtype=jnp.int32)
        over = count > limit
        return jnp.where(over, mid, lo), jnp.where(over, hi, mid), jnp.where(over, kept, count)

    start = (lo.astype(bits.dtype), jnp.max(bits) + 1, jnp.zeros((), jnp.int32))
    lo, hi, kept = lax.while_loop(searching, halve, start)
    top = bits >= hi
    ties = (bits == lo) & (hi - lo == 1)  # adjacent: every entry in [lo, hi) is the k-th largest value
    return top | (ties & (jnp.cumsum(ties, dtype=jnp.int32) <= limit - kept))


def _clip(g: Any, attrs: dict[str, Any]) -> Any:
    """The paper's local clipping: to ``local_grad_clip_norm * N**-0.5`` (N: ``num_trainers``, else the
    group's size), so the sum of N clipped gradients stays within the global norm."""
    clip = float(attrs.get("local_grad_clip_norm", -1.0))
    if clip <= 0:
        return g
    axis = current_axis()
    trainers = int(attrs.get("num_trainers", 0)) or (1 if axis is None else lax.psum(1, axis))
    limit = jnp.asarray(clip, g.dtype) / jnp.sqrt(jnp.asarray(trainers, g.dtype))
    norm = jnp.sqrt(jnp.sum(g * g))
    return g * (limit / jnp.maximum(norm, limit))


def _compress(u: Any, v: Any, g: Any, k: int, k_max: int, attrs: dict[str, Any]) -> Callable[[], Any]:
    def run() -> Any:
        gc = _clip(g, attrs)
        mu = jnp.asarray(attrs["m"], u.dtype)
        if attrs.get("use_nesterov", False):
            u2 = (u + gc) * mu
            v2 = v + u2 + gc
        else:
            u2 = u * mu + gc
            v2 = v + u2
        flat = jnp.ravel(v2)
        idx, valid = select_top_k(jnp.abs(flat), k)
        vals = jnp.where(valid, flat[idx], jnp.zeros((), flat.dtype))
        sent = jnp.zeros(flat.shape, bool).at[idx].max(valid).reshape(v2.shape)
        zero = jnp.zeros((), v2.dtype)
        pad = k_max - idx.shape[0]
        return (jnp.where(sent, zero, u2), jnp.where(sent, zero, v2),
                jnp.pad(jnp.where(valid, idx, 0), (0, pad)), jnp.pad(vals, (0, pad)))

    return run


@kernel("dgc")
def dgc(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    u, v = one(ins, "U"), one(ins, "V")
    g = jnp.asarray(one(ins, "Grad"), v.dtype).reshape(v.shape)
    sparsity = list(attrs["sparsity"])
    ks = [dgc_k(v.size, s) for s in sparsity]
    k_max = max(ks)
    uniq, table = unique_ks(ks)

    def unchanged() -> Any:
        return u, v, jnp.zeros((k_max,), jnp.int32), jnp.zeros((k_max,), v.dtype)

    begin = int(attrs.get("rampup_begin_step", 0))
    if begin == 0 and len(uniq) == 1:  # one branch: no lax.switch
        u2, v2, idx, vals = _compress(u, v, g, uniq[0], k_max, attrs)()
        return {"UOut": [u2], "VOut": [v2], "EncodeIndex": [idx], "EncodeValue": [vals]}
    branch = stage_branch(_step(ins), begin, int(attrs.get("rampup_step", 1)), table)
    u2, v2, idx, vals = lax.switch(branch, [unchanged] + [_compress(u, v, g, k, k_max, attrs) for k in uniq])
    return {"UOut": [u2], "VOut": [v2], "EncodeIndex": [idx], "EncodeValue": [vals]}


def _gather_pairs(idx: list[Any], vals: list[Any], axis: str | None,
                  shared: bool) -> tuple[list[Any], list[Any]]:
    """Every rank's pairs, per gradient ``[nranks * k]``: one XLA collective for all gradients, or two
    sums through the shared-memory arena (``shared``: outside control flow, and the run has one)."""
    if axis is None:
        return idx, vals
    sizes = [i.shape[0] for i in idx]
    dtype = jnp.result_type(*vals)
    width = jnp.dtype(dtype).itemsize
    cat_v = jnp.concatenate([x.astype(dtype) for x in vals])
    cat_i = jnp.concatenate(idx)
    if shared:
        g_i = allgather(cat_i[None], axis, shared=True)
        g_v = allgather(cat_v[None], axis, shared=True)
    elif width in (4, 8) and jnp.issubdtype(dtype, jnp.floating):
        as_int = cat_i.astype(jnp.int32 if width == 4 else jnp.int64)
        both = allgather(jnp.stack([lax.bitcast_convert_type(as_int, dtype), cat_v])[None], axis)
        g_i = lax.bitcast_convert_type(both[:, 0], as_int.dtype).astype(jnp.int32)
        g_v = both[:, 1]
    else:
        g_i = allgather(cat_i[None], axis)
        g_v = allgather(cat_v[None], axis)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    return ([jnp.ravel(g_i[:, a:b]) for a, b in zip(offsets, offsets[1:])],
            [jnp.ravel(g_v[:, a:b]) for a, b in zip(offsets, offsets[1:])])


def _sparse_mean(grads: list[Any], idx: list[Any], vals: list[Any], ks: tuple[int, ...], axis: str | None,
                 n: Any, shared: bool = False) -> Callable[[], list[Any]]:
    def run() -> list[Any]:
        gi, gv = _gather_pairs([i[:k] for i, k in zip(idx, ks)], [v[:k] for v, k in zip(vals, ks)], axis, shared)
        out = []
        for g, i, v in zip(grads, gi, gv):
            dense = jnp.zeros((g.size,), g.dtype).at[i].add(v.astype(g.dtype))
            out.append((dense / jnp.asarray(n, g.dtype)).reshape(g.shape))
        return out

    return run


@kernel("dgc_allreduce")
def dgc_allreduce(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    grads, idx, vals = list(ins["Grad"]), list(ins["EncodeIndex"]), list(ins["EncodeValue"])
    axis = current_axis()
    n = 1 if axis is None else lax.psum(1, axis)
    sparsity = list(attrs["sparsity"])
    per_stage = [tuple(dgc_k(g.size, s) for g in grads) for s in sparsity]
    uniq, table = unique_ks(per_stage)

    def dense() -> list[Any]:
        if axis is None:
            return list(grads)
        return [s / jnp.asarray(n, s.dtype) for s in allreduce_dense(grads, axis, shared=True)]

    begin = int(attrs.get("rampup_begin_step", 0))
    if begin == 0 and len(uniq) == 1:  # one branch: straight-line code
        return {"Out": _sparse_mean(grads, idx, vals, uniq[0], axis, n, shared=True)()}
    branch = stage_branch(_step(ins), begin, int(attrs.get("rampup_step", 1)), table)
    out = switch_shared(branch, [dense] + [_sparse_mean(grads, idx, vals, ks, axis, n, shared=True) for ks in uniq])
    return {"Out": list(out)}


@kernel("dgc_momentum")
def dgc_momentum(ins: Ins, attrs: dict[str, Any]) -> dict[str, list[Any]]:
    p, u = one(ins, "Param"), one(ins, "U")
    g = jnp.asarray(one(ins, "Grad"), p.dtype).reshape(p.shape)
    lr = jnp.asarray(one(ins, "LearningRate"), p.dtype).reshape(())
    mu = jnp.asarray(attrs["mu"], p.dtype)
    dense = _step(ins) < int(attrs.get("rampup_begin_step", 0))
    u2 = u * mu + g
    momentum_step = g + u2 * mu if attrs.get("use_nesterov", False) else u2
    p2 = p - lr * jnp.where(dense, momentum_step, g)
    return {"ParamOut": [p2.astype(p.dtype)], "UOut": [jnp.where(dense, u2, u).astype(u.dtype)]}


__all__ = ["EXACT_K_MAX", "select_top_k", "stage_branch", "unique_ks"]
