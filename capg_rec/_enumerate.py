"""Exact enumeration of Plackett-Luce(-MoE) draws for tiny catalogs (reference for tests).

Every ordered draw of K distinct items out of N is listed, so this is for few draws (see ``Enumeration``).
All functions are differentiable, which makes them references for gradients too.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from capg_rec._numerics import safe_logsumexp


def all_draws(num_items: int, num_candidates: int, device: torch.device | None = None) -> Tensor:
    """Every ordered sequence of ``K`` distinct ids out of ``N`` → ``[S, K]``."""
    seqs = list(itertools.permutations(range(num_items), num_candidates))
    return torch.tensor(seqs, dtype=torch.long, device=device).reshape(len(seqs), num_candidates)


def draw_log_probs(scores: Tensor, draws: Tensor, experts: Tensor) -> Tensor:
    """Log-probability of each ordered draw under sequential PL-MoE.

    ``scores [B, M, N]`` (already divided by τ), ``draws [S, K]``, ``experts [K]`` (m(k)) → ``[B, S]``. Each
    expert's scores are taken relative to its best (a constant): shift-invariant in any dtype, as every method.
    """
    scores = scores - scores.detach().amax(dim=2, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
    batch, _, num_items = scores.shape
    num_draws, k_total = draws.shape
    log_prob = torch.zeros(batch, num_draws, dtype=scores.dtype, device=scores.device)
    removed = torch.zeros(num_draws, num_items, dtype=torch.bool, device=scores.device)
    for k in range(k_total):
        s = scores[:, int(experts[k])]  # [B, N]
        remaining = s.unsqueeze(1).masked_fill(removed.unsqueeze(0), -torch.inf)  # [B, S, N]
        picked = s[:, draws[:, k]]  # [B, S]; -inf for a masked item: the draw is impossible
        drawable = picked > -torch.inf
        rest = safe_logsumexp(remaining, dim=2)  # finite wherever the pick is drawable
        step = torch.where(drawable, picked, 0.0) - torch.where(drawable, rest, 0.0)
        log_prob = log_prob + torch.where(drawable, step, -torch.inf)
        removed = removed.clone()
        removed[torch.arange(num_draws), draws[:, k]] = True
    return log_prob


def inclusion_probs(scores: Tensor, experts: Tensor) -> Tensor:
    """Exact ``P(item n is among the K draws)`` → ``[B, N]`` for ``scores [B, M, N]``."""
    draws = all_draws(scores.shape[2], len(experts), scores.device)
    probs = draw_log_probs(scores, draws, experts).exp()  # [B, S]
    member = torch.zeros(draws.shape[0], scores.shape[2], dtype=scores.dtype, device=scores.device)
    member.scatter_(1, draws, 1.0)
    return probs @ member


def log_inclusion_probs(scores: Tensor, experts: Tensor) -> Tensor:
    """``log P(item n is among the K draws)`` → ``[B, N]`` for ``scores [B, M, N]``: a log-sum-exp over the draws
    that hold n (``-inf``, with zero gradient, for an item in none), so that its second derivatives stay finite
    where a probability is below ~1e-154 (the log of a linear sum divides by its square there)."""
    draws = all_draws(scores.shape[2], len(experts), scores.device)
    log_probs = draw_log_probs(scores, draws, experts)  # [B, S]
    member = torch.zeros(draws.shape[0], scores.shape[2], dtype=torch.bool, device=scores.device)
    member.scatter_(1, draws, True)
    return safe_logsumexp(log_probs.unsqueeze(2).masked_fill(~member, -torch.inf), dim=1)
