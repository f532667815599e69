"""Straightforward (slow, loop-based) reference implementations of the approximate methods,
written directly from their definitions, to test the vectorised library code against."""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq

from capg_rec import expert_of_position


def plugin_inclusion(scores: np.ndarray, k_total: int) -> np.ndarray:
    """The paper's arg-top-(k-1) plug-in for one context: ``scores [M, N]`` → ``[N]``."""
    num_experts, n = scores.shape
    experts = expert_of_position(k_total, num_experts).tolist()
    w = np.exp(scores - scores.max())
    out = np.zeros(n)
    for a in range(n):
        prefix: list[int] = []
        for k in range(k_total - 1):  # greedy draw with the target removed
            m = experts[k]
            rest = [b for b in np.argsort(-scores[m], kind="stable") if b != a and b not in prefix]
            prefix.append(int(rest[0]))
        survive = 1.0
        for k in range(k_total):
            m = experts[k]
            hazard = w[m, a] / (w[m].sum() - w[m, prefix[:k]].sum())
            survive *= 1.0 - hazard
        out[a] = 1.0 - survive
    return out


def mean_field_inclusion(scores: np.ndarray, k_total: int) -> np.ndarray:
    """Rosén's successive-sampling approximation, block by block: ``scores [M, N]`` → ``[N]``."""
    num_experts = scores.shape[0]
    experts = expert_of_position(k_total, num_experts).tolist()
    survive = np.ones(scores.shape[1])
    for m in sorted(set(experts)):
        count = experts.count(m)
        w = np.exp(scores[m] - scores[m].max())

        def excess(log_t: float, w=w, count=count) -> float:
            return float((survive * -np.expm1(-w * math.exp(log_t))).sum() - count)

        log_t = brentq(excess, -60.0, 80.0, xtol=1e-14, rtol=1e-14)
        survive = survive * np.exp(-w * math.exp(log_t))
    return 1.0 - survive


def swr_score(scores: np.ndarray, k_total: int) -> np.ndarray:
    """``Σ_k softmax_{m(k)}(a)`` for one context: ``scores [M, N]`` → ``[N]``."""
    experts = expert_of_position(k_total, scores.shape[0]).tolist()
    soft = np.exp(scores - scores.max(1, keepdims=True))
    soft /= soft.sum(1, keepdims=True)
    return sum(soft[m] for m in experts)
