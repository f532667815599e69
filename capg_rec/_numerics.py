"""Small log-space helpers shared by the probability code (private)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

_LOG_HALF = -math.log(2.0)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate on the whole range (Maechler 2012).

    ``x = 0`` gives ``-inf``; values above 0 are clamped to 0 (rounding noise only).
    """
    x = x.clamp(max=0.0)
    near = x > _LOG_HALF
    # Double-where: each branch only sees inputs where it is finite, so gradients stay finite.
    safe_near = torch.where(near, x, torch.full_like(x, -1.0))
    safe_far = torch.where(near, torch.full_like(x, -1.0), x)
    return torch.where(near, torch.log(-torch.expm1(safe_near)), torch.log1p(-torch.exp(safe_far)))


def masked_logsumexp(x: Tensor, keep: Tensor, dim: int) -> Tensor:
    """``logsumexp`` over the entries where ``keep`` is True; ``-inf`` (with zero grad) where none are."""
    neg_inf = torch.finfo(x.dtype).min
    filled = torch.where(keep, x, torch.full_like(x, neg_inf))
    out = torch.logsumexp(filled, dim=dim)
    any_kept = keep.any(dim=dim)
    return torch.where(any_kept, out, torch.full_like(out, -math.inf))


def gumbel_like(shape: tuple[int, ...], *, generator: torch.Generator | None, dtype: torch.dtype,
                device: torch.device) -> Tensor:
    """Standard Gumbel(0, 1) noise drawn through an explicit generator."""
    u = torch.rand(shape, generator=generator, dtype=dtype, device=device)
    tiny = torch.finfo(dtype).tiny
    return -torch.log(-torch.log(u.clamp_min(tiny)))


def log1mexp_exp(y: Tensor) -> Tensor:
    """``log(1 - exp(-exp(y)))``: e.g. the log-probability that a Gumbel clock has rung.

    Stays accurate for very negative ``y`` (where the value is about ``y``) and for large ``y``
    (where it is about ``-exp(-exp(y))``).
    """
    small = y < -10.0
    y_small = torch.where(small, y, torch.full_like(y, -20.0))
    y_big = torch.where(small, torch.zeros_like(y), y).clamp(max=30.0)  # beyond 30 the value is 0
    return torch.where(small, y_small - 0.5 * torch.exp(y_small), log1mexp(-torch.exp(y_big)))
