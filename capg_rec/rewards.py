"""Reward shaping for the policy-gradient losses: position weights and baselines."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from capg_rec._checks import check_count, check_device, check_float_tensor, check_positive, is_int, is_number, \
    resolve_validate_args

__all__ = ["dcg_weights", "group_normalize"]


def dcg_weights(length: int, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> Tensor:
    """DCG position weights ``α_l = 1 / log2(l + 1)`` for ``l = 1..L`` → ``[L]`` (a floating ``dtype``, on ``device``:
    the rewards' for a loss's ``position_weights``; None: the default device)."""
    check_count("length", length)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = None if device is None else check_device("device", device)
    return 1.0 / torch.log2(torch.arange(2, length + 2, dtype=dtype, device=device))


def group_normalize(rewards: Tensor, *, offset: float = 0.0, dim: int = 0, eps: float = 1e-8,
                    validate_args: bool | None = None) -> Tensor:
    """GRPO-style normalisation: ``(r - mean) / (std + eps)`` over ``dim`` (the group), plus ``offset``.

    CA-PG's variance argument asks for positive rewards (the paper's sufficient condition), hence the ``offset``,
    which shifts the normalised rewards up (the paper's choice, 1, leaves a group's lowest below 0 when it is far
    below the rest: it does not guarantee positivity). ``eps > 0``
    keeps a constant group finite, at ``offset`` (rewards are normalised in float64 and returned in their dtype: in
    float32, a constant group's mean is off by a rounding step, which ``eps`` then scaled up to ±10);
    with ``validate_args`` the rewards must be finite.
    """
    rewards = check_float_tensor("rewards", rewards, ndims=tuple(range(1, 9)),
                                 validate=resolve_validate_args(validate_args))
    if not is_int(dim):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -rewards.dim() <= dim < rewards.dim():
        raise ValueError(f"dim must be in [{-rewards.dim()}, {rewards.dim()}), got {dim}")
    dim = int(dim)
    eps = check_positive("eps", eps)
    if not is_number(offset):
        raise TypeError(f"offset must be a number, got {type(offset).__name__}")
    if not math.isfinite(offset):
        raise ValueError(f"offset must be finite, got {offset!r}")
    offset = float(offset)
    # In float64: eps = 1e-8 rounds to 0 in float16 (a constant group was 0/0), and in float32 a constant group's
    # mean is a rounding step off its value, whose distance over a std of that size (and eps) came out up to ±10;
    # in float64 the sum of a narrower dtype's equal values is exact, and so is their mean.
    x = rewards.double()
    mean = x.mean(dim=dim, keepdim=True)
    std = x.std(dim=dim, keepdim=True, unbiased=False)
    return ((x - mean) / (std + eps) + offset).to(rewards.dtype)
