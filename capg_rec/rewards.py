"""Reward shaping for the policy-gradient losses: position weights and baselines."""

from __future__ import annotations

import torch
from torch import Tensor

from capg_rec._checks import check_count

__all__ = ["dcg_weights", "group_normalize"]


def dcg_weights(length: int, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """DCG position weights ``α_l = 1 / log2(l + 1)`` for ``l = 1..L`` → ``[L]``."""
    check_count("length", length)
    return 1.0 / torch.log2(torch.arange(2, length + 2, dtype=dtype))


def group_normalize(rewards: Tensor, *, offset: float = 0.0, dim: int = 0, eps: float = 1e-8) -> Tensor:
    """GRPO-style normalisation: ``(r - mean) / std`` over ``dim`` (the group), plus ``offset``.

    CA-PG needs positive rewards (the paper's sufficient condition), hence the ``offset``.
    """
    mean = rewards.mean(dim=dim, keepdim=True)
    std = rewards.std(dim=dim, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps) + offset
