"""A numpy reference of Deep Gradient Compression (Lin et al., ICLR 2018) as Fluid 1.6's ``dgc_momentum``,
written from the paper and independent of the JAX kernel: one step of every trainer at once.

Per trainer ``r`` with local gradient ``g_r`` at (0-based) step ``t``:
- ``t < rampup_begin_step``: ``g = mean_r g_r``; ``U_r = mu*U_r + g``; ``Param -= lr*U_r`` (Nesterov:
  ``lr*(g + mu*U_r)``); ``V`` untouched.
- otherwise: ``g_r`` clipped to norm ``clip / sqrt(num_trainers)`` (when ``clip > 0``); ``U_r = mu*U_r + g_r``,
  ``V_r += U_r`` (Nesterov: ``U_r = mu*(U_r + g_r)``, ``V_r += U_r + g_r``); the ``k`` entries of largest
  ``|V_r|`` are sent, ``k = max(1, floor(numel*(1 - s)))`` with ``s = sparsity[min(len-1, (t - begin)*len //
  rampup_step)]``; sent entries are zeroed in ``U_r`` and ``V_r``; ``Param -= lr * (sum_r sparse_r) / n``.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def dgc_step(param: np.ndarray, us: list[np.ndarray], vs: list[np.ndarray], grads: list[np.ndarray], step: int,
             lr: float, attrs: dict[str, Any]) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """(new param, new U per trainer, new V per trainer); every array float64."""
    n, mu, nesterov = len(grads), attrs["mu"], attrs.get("use_nesterov", False)
    begin, rampup, sparsity = attrs["rampup_begin_step"], attrs["rampup_step"], list(attrs["sparsity"])
    if step < begin:
        g = sum(grads) / n
        new_us = [mu * u + g for u in us]
        update = g + mu * new_us[0] if nesterov else new_us[0]
        return param - lr * update, new_us, [v.copy() for v in vs]
    s = sparsity[min(len(sparsity) - 1, (step - begin) * len(sparsity) // rampup)]
    clip, trainers = attrs.get("local_grad_clip_norm", -1.0), attrs.get("num_trainers", 0) or n
    total = np.zeros(param.size)
    new_us, new_vs = [], []
    for u, v, g in zip(us, vs, grads):
        if clip > 0:
            limit = clip / np.sqrt(trainers)
            g = g * (limit / max(np.linalg.norm(g), limit))
        if nesterov:
            u = mu * (u + g)
            v = v + u + g
        else:
            u = mu * u + g
            v = v + u
        flat_v, flat_u = v.ravel().copy(), u.ravel().copy()
        k = max(1, min(flat_v.size, int(round(flat_v.size * (1.0 - s), 6))))
        sent = np.argsort(-np.abs(flat_v), kind="stable")[:k]
        total[sent] += flat_v[sent]
        flat_v[sent] = 0.0
        flat_u[sent] = 0.0
        new_us.append(flat_u.reshape(u.shape))
        new_vs.append(flat_v.reshape(v.shape))
    return param - lr * (total / n).reshape(param.shape), new_us, new_vs
