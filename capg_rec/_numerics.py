"""Small log-space helpers shared by the probability code (private)."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

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


def masked_logsumexp(x: Tensor, drop: Tensor, dim: int) -> Tensor:
    """``logsumexp`` over the entries where ``drop`` (broadcastable to ``x``) is False; ``-inf`` (with
    zero grad) where every entry is dropped."""
    return filled_logsumexp(x.masked_fill(drop, torch.finfo(x.dtype).min), dim)


def exp_floor(dtype: torch.dtype) -> float:
    """Lowest argument worth exponentiating: below it ``exp`` leaves the normal range, where libm
    takes a slow path (~100x) for values that are rounding noise next to the sums they enter."""
    if dtype == torch.float16:
        return -math.inf
    return math.log(torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).tiny) + 1.0


def exp_floored(x: Tensor) -> Tensor:
    """``exp(x)`` with ``x`` raised to :func:`exp_floor` first (for terms of sums dominated by ~1)."""
    return torch.exp(x.clamp(min=exp_floor(x.dtype)))


def _softmax_terms(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """``top = max(x)``, ``terms = exp_floored(x - top)`` and ``total = Σ terms`` along ``dim`` (kept)."""
    top = x.amax(dim=dim, keepdim=True)
    terms = (x - top).clamp_(min=exp_floor(x.dtype)).exp_()
    return top, terms, terms.sum(dim=dim, keepdim=True)


def scaled_terms(terms: Tensor, scale: Tensor) -> Tensor:
    """``terms * scale`` for ``0 <= terms <= 1`` (floored exps) and a broadcastable ``scale``,
    without subnormal numbers, here or downstream (an x86 slow path): products below
    ``2^p·tiny`` (p = mantissa bits; fp32: 2e-31) become exactly 0, and so do terms at the exp
    floor (``-inf`` entries) whatever the scale; the others move by less than that or by
    ``4·e^floor·|scale|`` (fp32: 1e-37 of the scale).

    Adding and subtracting ``C = max(2^2p·tiny / |scale|, 8·e^floor / eps)`` rounds ``terms`` to
    multiples of ``ulp(C)`` (Sterbenz: the subtraction is exact). float16 (no exp floor, and a normal
    range too narrow for the shift) gets the plain product.
    """
    if terms.dtype == torch.float16:
        return terms * scale
    low, tiny, top = _FLUSH[terms.dtype]
    shift = scale.abs().clamp(min=tiny, max=top).reciprocal_().mul_(low)
    return (terms + shift).sub_(shift).mul_(scale)


def _flush_constants(dtype: torch.dtype) -> tuple[float, float, float]:
    """:func:`scaled_terms`' constants: ``2^2p·tiny``, and the scales below and above which the shift
    stops growing or shrinking."""
    finfo = torch.finfo(dtype)
    low = (2 / finfo.eps) ** 2 * finfo.tiny
    return low, finfo.tiny, low * finfo.eps / (8 * math.exp(exp_floor(dtype)))


_FLUSH = {dtype: _flush_constants(dtype) for dtype in (torch.bfloat16, torch.float32, torch.float64)}


class _LogSumExp(torch.autograd.Function):
    """``logsumexp`` of finite ``x`` whose exps are floored (:func:`exp_floored`), so confident
    scores (spreads beyond ~87 in fp32) stay on the fast path; gradient = the (floored) softmax."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        top, terms, total = _softmax_terms(x, dim)
        ctx.save_for_backward(terms, total)  # all the backward needs: x itself is not kept
        ctx.dim = dim
        return (top + total.log()).squeeze(dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        terms, total = ctx.saved_tensors
        return scaled_terms(terms, grad.unsqueeze(ctx.dim) / total), None


class _LogSoftmaxAt(torch.autograd.Function):
    """``x.gather(dim, index) - logsumexp(x, dim)`` of finite ``x`` as one autograd node, with the
    exps floored as in :class:`_LogSumExp`: the backward is one scaled softmax plus a scatter-add."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, dim: int) -> Tensor:
        top, terms, total = _softmax_terms(x, dim)
        ctx.save_for_backward(terms, total, index)
        ctx.dim = dim
        return (x.gather(dim, index) - top).sub_(total.log())  # shifted first: exact near the top

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        terms, total, index = ctx.saved_tensors
        grad_x = scaled_terms(terms, grad.sum(dim=ctx.dim, keepdim=True).neg_() / total)
        return grad_x.scatter_add_(ctx.dim, index, grad), None, None


def log_softmax_at(x: Tensor, index: Tensor, dim: int) -> Tensor:
    """``log_softmax(x, dim).gather(dim, index)`` of finite ``x`` without the ``[..., N]`` output:
    e.g. ``x [B, M, N]``, ``index [B, M, L]`` → ``[B, M, L]``."""
    return _LogSoftmaxAt.apply(x, index, dim)


class _GatherWithRest(torch.autograd.Function):
    """``(x.gather(dim, index), logsumexp of x over the entries not in index)`` of finite ``x`` as
    one node, exps floored as in :class:`_LogSumExp`; the backward is one scaled softmax with the
    named entries overwritten (no ``[..., N]`` zeros, scatter copy or accumulation)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        lowest = torch.finfo(x.dtype).min
        top, terms, total = _softmax_terms(x.scatter(dim, index, lowest), dim)
        ctx.save_for_backward(terms, total, index)
        ctx.dim = dim
        return x.gather(dim, index), _empty_to_minus_inf((top + total.log()).squeeze(dim))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_named: Tensor | None, grad_rest: Tensor | None) -> tuple[Tensor, None, None]:
        terms, total, index = ctx.saved_tensors
        dim = ctx.dim
        grad_x = scaled_terms(terms, grad_rest.unsqueeze(dim) / total) if grad_rest is not None \
            else torch.zeros_like(terms)
        grad_x.scatter_(dim, index, 0.0)  # the named entries are not in the rest
        return (grad_x if grad_named is None else grad_x.scatter_add_(dim, index, grad_named)), None, None


def gather_with_rest(x: Tensor, index: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``x.gather(dim, index)`` and the ``logsumexp`` of ``x`` over every other entry (``-inf`` if
    none is left), for finite ``x``: e.g. ``x [B, M, N]``, ``index [B, M, K]`` → ``[B, M, K]``, ``[B, M]``."""
    return _GatherWithRest.apply(x, index, dim)


def filled_logsumexp(x: Tensor, dim: int) -> Tensor:
    """``logsumexp`` of finite ``x`` whose dropped entries hold the dtype's lowest finite value;
    ``-inf`` (with zero grad) where all were dropped."""
    return _empty_to_minus_inf(_LogSumExp.apply(x, dim))


def _empty_to_minus_inf(out: Tensor) -> Tensor:
    """A logsumexp over entries that all held the lowest finite value (nothing left) → ``-inf``."""
    return out.masked_fill(out < torch.finfo(out.dtype).min / 2, -math.inf)


def gumbel_like(shape: tuple[int, ...], *, generator: torch.Generator | None, dtype: torch.dtype,
                device: torch.device) -> Tensor:
    """Standard Gumbel(0, 1) noise drawn through an explicit generator."""
    u = torch.rand(shape, generator=generator, dtype=dtype, device=device)
    return u.clamp_min_(torch.finfo(dtype).tiny).log_().neg_().log_().neg_()


def gumbel_top_k(scores: Tensor, k: int, *, generator: torch.Generator | None,
                 group_size: int | None = None) -> Tensor:
    """Indices of the k largest ``scores + Gumbel(0, 1)`` along the last dim, best first → ``[..., k]``:
    an exact Plackett-Luce draw of k items without replacement (``-inf`` scores are never drawn
    while finite ones remain).

    Two-level ("top-down") Gumbel-max: the items are split into groups of ``group_size``
    (default ``√(N/k)``); a group's largest perturbed score is Gumbel(logsumexp of the group), so
    the k best groups are drawn first, and only their items get noise, conditioned on their
    group's maximum (a truncated Gumbel; Kool, van Hoof & Welling 2019, appendix B). The k best
    items always lie in the k best groups, so the draw is exact, with ``N/g + k·g`` random
    numbers per row instead of N (and top-k over as many values).
    """
    n = scores.shape[-1]
    size = int(math.sqrt(n / k)) if group_size is None else group_size
    if size < 2:
        return (scores + _gumbel(scores.shape, scores, generator)).topk(k, dim=-1).indices
    groups = -(-n // size)
    picked = min(k, groups)
    lead = scores.shape[:-1]
    finfo = torch.finfo(scores.dtype)
    noise = _gumbel((*lead, groups + size * picked), scores, generator)  # one draw: groups, then items
    # Item j·G + i belongs to group i, so group reductions run over a strided dim (vectorised).
    padded = scores if n == groups * size else \
        torch.nn.functional.pad(scores, (0, groups * size - n), value=-math.inf)
    members = padded.view(*lead, size, groups)  # [..., g, G]
    # In-place chains and clamps rather than masks: this is the sampler's hot path. An empty
    # group's key stays at the lowest finite value, below every group that has an item.
    peak = members.amax(dim=-2, keepdim=True).clamp_(min=finfo.min)
    group_max = (members - peak).clamp_(min=exp_floor(scores.dtype)).exp_().sum(dim=-2).log_().add_(peak.squeeze(-2))
    top, group = group_max.add_(noise[..., :groups]).topk(picked, dim=-1, sorted=False)  # [..., k']
    perturbed = members.gather(-1, group.unsqueeze(-2).expand(*lead, size, picked))  # [..., g, k']
    perturbed += noise[..., groups:].view(*lead, size, picked)
    peak = perturbed.amax(dim=-2, keepdim=True).clamp_(min=finfo.min)
    # Shift each group's perturbed scores so that their maximum is `top`:
    # -log(e^-top - e^-peak + e^-x) = top - softplus(top - x + log(1 - e^(x - peak))), in log-space
    # (absolute accuracy is what a comparison of sampled keys needs). The clamps keep expm1, log
    # and softplus off their slow paths (very negative arguments, zero): 1 - e^-40 rounds to 1 even
    # in fp64, and the others move keys by < e^-86. A -inf item stays -inf.
    top = top.unsqueeze(-2)
    gap = (perturbed - peak).clamp_(min=-40.0).expm1_().neg_().clamp_(min=finfo.tiny).log_()
    shift = gap.add_(top).sub_(perturbed).clamp_(min=exp_floor(scores.dtype))
    keys = top - torch.nn.functional.softplus(shift)
    ids = group.unsqueeze(-2) + groups * torch.arange(size, device=scores.device).unsqueeze(-1)  # [..., g, k']
    return ids.flatten(-2).gather(-1, keys.flatten(-2).topk(k, dim=-1).indices)


def _gumbel(shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    return gumbel_like(tuple(shape), generator=generator, dtype=like.dtype, device=like.device)


def log1mexp_exp(y: Tensor) -> Tensor:
    """``log(1 - exp(-exp(y)))``: e.g. the log-probability that a Gumbel clock has rung.

    Stays accurate for very negative ``y`` (where the value is about ``y``) and for large ``y``
    (where it is about ``-exp(-exp(y))``).
    """
    small = y < -10.0
    y_small = torch.where(small, y, torch.full_like(y, -20.0))
    y_big = torch.where(small, torch.zeros_like(y), y).clamp(max=30.0)  # beyond 30 the value is 0
    return torch.where(small, y_small - 0.5 * torch.exp(y_small), log1mexp(-torch.exp(y_big)))
