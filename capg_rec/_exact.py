"""The "exact" inclusion probability of Plackett-Luce draws (private).

One expert block (a single logit vector, K draws) is the exponential race of Gumbel clocks
``G_b = s_b + Gumbel(0, 1)``: item a is drawn iff fewer than K other clocks beat it, so

    π_a = ∫ f_a(g) P(C_{-a}(g) ≤ K-1) dg,        f_a(g) = exp(s_a - g - e^{s_a - g}),

where ``C_{-a}(g)`` is Poisson-binomial with ``q_b(g) = P(G_b > g) = 1 - exp(-e^{s_b - g})``.

* Frame: every row and expert is shifted by a reference taken from its own scores (its K-th
  largest finite score, no gradient), so the result is shift-invariant by construction and the
  quadrature nodes sit where floating point resolves them. Scores more than ``finfo.max / 64``
  below the reference are masked (their probability underflows), those as far above are clamped
  (drawn for sure). A target far below the range keeps its score apart from the integral,
  ``log π_a = s_a + log ∫ e^{-g - e^{s_a - g}} F_{-a}(g) dg``, so the weights of the nodes keep
  their ``e^{-g}`` at any gap (a logit of -1e30 next to scores of order 1).
* Quadrature: composite Gauss–Legendre on ``[g_lo, g_hi]`` (Chernoff levels of the count of
  clocks past g, those surely rung counted exactly; found by at most 40 bisection steps in
  ``asinh g``), one Gauss–Legendre rule in ``e^{-g}`` per gap between far-apart scores, and
  ``P(G_a > g_hi)`` analytically above ``g_hi``. Each row's nodes depend on that row only.
* Head items: their truncated Poisson-binomial polynomial (degree < K) by a balanced tree of
  polynomial products in probability space (long factors by FFT in float64 when the block
  surely fills up). Every item's leave-one-out count is a derivative of the tree
  (``F_{-a} = -∂H/∂p_a``, ``H = E[(K - C)_+]``), taken with a graph so that it stays
  differentiable; with few targets, they are left out of the tree and multiplied back in one
  by one.
* Tail items (known only through ``Z_p = Σ_tail e^{p s}``): ``log Π_tail (1 - q + q z)`` is the
  power series ``-X_1 + Σ_m (-1)^{m+1} R_m z^m / m`` with ``X_j = e^{-jg} Z_j`` and
  ``R_m = Σ_tail (e^{x} - 1)^m = Σ_j m! S(j, m) X_j / j!``; truncating at ``j ≤ P`` errs by
  ``O(X_{P+1})``. Its coefficients come from a log-space recurrence.
* Several runs ("block-exact"): block m is the race above over the items still present, each
  present independently with its survival ``ρ_b`` (the product of ``1 - h`` over earlier
  blocks); ``π_a = Σ_m h_a^{(m)} Π_{m'<m} (1 - h_a^{(m')})``. Exact for one run; for several it
  treats survival across blocks as independent and ignores the depletion of the tail.
* Masks: a score of ``-inf`` is an item outside the row's catalog (for that expert): it never
  counts, and a target with ``-inf`` under every expert gets ``-inf`` with zero gradient.

Cost model. Per block with k draws over T head slots (T = N when the catalog fits the head) and
Q quadrature nodes per row, forward + backward cost ``B · Q · T · c(k)``: at every node the
product tree over the T slots has ~T·min(k, 12) multiply-adds in its direct levels (factors of up
to 12 coefficients) and FFT products of ~T·log k beyond, its derivative (all slots at once) about
as much again, and backward about twice the forward. Q is ``points × range / width + 8 × gaps``:
5 (float32) or 8 (float64) points per panel of width ``min(1, 2.5/√k)``, a range of
``O(log T + log 1/ε)`` in g (wider for small τ), a few gaps between far-apart scores: a few
dozen to a few hundred nodes, whatever the logit spread. ``benchmarks/exact_runtime.py``
measures c(k).

Memory. The work of a block is split into pieces (rows of the batch, and nodes when one row is
too large) of at most ``min(memory_budget, 64 MiB)`` of what they keep for backward. When all
pieces of a block would keep more than ``memory_budget`` bytes and a gradient is needed, each chunk of
rows runs without a graph and is made again in backward (:class:`_Recomputed`), where each of its pieces is
itself recomputed in the backward of that chunk: what a block keeps is then its inputs, its nodes and its
output, O(B · (T + Q)), whatever k and the number of pieces (at the price of two more forwards of each piece:
+32% at a 16 MiB budget for B = 8, N = 600, K = 40, M = 4 in one thread; inside ``torch.func``
transforms, which refuse that Function, and in forward-mode AD, the pieces are kept instead). A budget far
below 64 MiB costs more than that: the pieces get small (a few rows or nodes), and each one's fixed cost of
Python and small kernels adds up (a review measured 9x the unbounded time at 2^23 bytes and 30x at 2^20 for
B = 8, N = 300, K = 10, against 1.3–2.5x at 2^26–2^27).
Everything is differentiable to any order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch import Tensor

from capg_rec._checks import is_int
from capg_rec._head_tail import HeadTail
from capg_rec._numerics import cumsum, log1mexp, log1mexp_exp, safe_logsumexp, select_experts

__all__ = ["DEFAULT_MEMORY_BUDGET", "EXACT_NUM_POWERS", "exact_log_inclusion"]

EXACT_NUM_POWERS = 4
DEFAULT_MEMORY_BUDGET = 2**30  # bytes that the pieces of a block may keep for backward, all together

_SHIFT_MAX = 12  # polynomial factors up to this length are multiplied by shifted products
_SILENT = 140.0  # e^{s-g} ≥ _SILENT: the clock has rung for sure (1 - q ≤ e^{-140})
_QUIET = 3.0  # expected number of clocks past g ≤ e^{-_QUIET}: smooth in e^{-g}
_GAP_POINTS = 8  # Gauss–Legendre nodes in e^{-g} per gap
_MAX_EXP = 60.0  # exp arguments are clamped here: 1 - exp(-e^60) is exactly 1 in any float
_ROOT_TOLERANCE = 1e-3  # the range ends need no more accuracy than this
_RANGE_STEPS = 40  # at most this many bisection steps in asinh(g): 1e-12 of the widest bracket
_FAR = 64.0  # scores beyond finfo.max / _FAR from the reference are masked (below) or clamped (above)
_SEARCH_ENTRIES = 64  # entries per row and head slot that the node search keeps at once
_SLOT_ENTRIES = 16  # entries per row, node and head slot that a piece keeps outside the product tree
_PIECE_BYTES = 2**26  # a piece's size when the budget allows more: larger ones run slower (cache, page faults)


def _log_eps(dtype: torch.dtype) -> float:
    """Relative truncation level of the integration range."""
    return math.log(1e-13 if dtype == torch.float64 else 1e-8)


def _gl_points(dtype: torch.dtype) -> int:
    """Gauss–Legendre nodes per panel: 5 reach float32 rounding; float64 needs 8 for ~1e-13 (6 err by
    ~4e-10 against the softmax at K = 1, measured)."""
    return 8 if dtype == torch.float64 else 5


@functools.cache
def _chernoff_levels(k: int, log_eps: float) -> np.ndarray:
    """Mean levels for every remaining count ``k' = 0..k`` → ``[k+1, 3]``: ``(μ_lo > k', k', μ_hi < k')``.

    With ``μ ≥ μ_lo`` the Chernoff bound gives ``P(C ≤ k'-1) · μ/k' ≤ eps`` (the ``μ/k'`` keeps the
    neglected part relatively small for items far below the threshold, whose density grows as
    ``e^{-g}``); with ``μ ≤ μ_hi``, ``P(C ≥ k') ≤ eps``. Row 0 is ``-inf``: nothing left to draw.
    """
    kk = np.arange(1, k + 1, dtype=np.float64)

    def lower(r: np.ndarray) -> np.ndarray:  # log Chernoff bound of P(C ≤ k') · r at μ = r k', r > 1
        return kk * (1.0 + np.log(r) - r) + np.log(r) - log_eps

    def upper(r: np.ndarray) -> np.ndarray:  # log Chernoff bound of P(C ≥ k') at μ = r k', r < 1
        return kk * (1.0 + np.log(r) - r) - log_eps

    lo, hi = np.ones(k), np.full(k, 2.0)
    while (lower(hi) > 0).any():
        hi = np.where(lower(hi) > 0, 2.0 * hi, hi)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        above = lower(mid) > 0
        lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
    mu_lo = hi * kk
    lo_log, hi_log = np.full(k, -200.0), np.zeros(k)  # bisection on log r
    for _ in range(100):
        mid = 0.5 * (lo_log + hi_log)
        above = upper(np.exp(mid)) > 0
        lo_log, hi_log = np.where(above, lo_log, mid), np.where(above, mid, hi_log)
    levels = np.stack([mu_lo, kk, np.exp(lo_log) * kk], axis=1)
    return np.concatenate([np.full((1, 3), -np.inf), levels])


@functools.cache
def _tail_coefficients(num_powers: int) -> np.ndarray:
    """``log(m! S(j, m) / j!)`` → ``[P, P]`` (row m-1, column j-1; ``-inf`` for j < m)."""
    stirling = np.zeros((num_powers + 1, num_powers + 1))
    stirling[0, 0] = 1.0
    for j in range(1, num_powers + 1):
        for m in range(1, j + 1):
            stirling[j, m] = m * stirling[j - 1, m] + stirling[j - 1, m - 1]
    out = np.full((num_powers, num_powers), -np.inf)
    for m in range(1, num_powers + 1):
        for j in range(m, num_powers + 1):
            out[m - 1, j - 1] = math.log(math.factorial(m) * stirling[j, m] / math.factorial(j))
    return out


def _safe_log(x: Tensor) -> Tensor:
    """``log x`` for ``x ≥ 0``, ``-inf`` below the smallest normal number; finite gradients."""
    ok = x > torch.finfo(x.dtype).tiny * 16
    return torch.where(ok, torch.log(torch.where(ok, x, torch.ones_like(x))), torch.full_like(x, -math.inf))


def _reference(scores: Tensor, k: int) -> Tensor:
    """Each row's and expert's k-th largest finite score (the smallest one if fewer, 0 if none) of
    ``scores [B, M, T]`` → ``[B, M]``, without gradient: the frame the block is computed in."""
    with torch.no_grad():
        finite = torch.isfinite(scores)
        depth = min(k, scores.shape[2])
        top = scores.masked_fill(~finite, -math.inf).topk(depth, dim=2).values
        last = finite.sum(2, keepdim=True).clamp(min=1, max=depth) - 1
        ref = top.gather(2, last).squeeze(2)
        return torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref))


def _to_frame(scores: Tensor, tail: Tensor, ref: Tensor) -> tuple[Tensor, Tensor]:
    """``scores [B, M, T]`` and ``tail [B, M, P]`` (log power sums) relative to ``ref [B, M]``;
    what lies beyond ``finfo.max / _FAR`` below becomes ``-inf``, above is clamped there."""
    far = torch.finfo(scores.dtype).max / _FAR
    s = scores - ref.unsqueeze(2)
    s = torch.where(s < -far, torch.full_like(s, -math.inf), s.clamp(max=far))
    powers = torch.arange(1, tail.shape[2] + 1, dtype=tail.dtype, device=tail.device)
    t = tail - powers * ref.unsqueeze(2)
    t = torch.where(t < -far, torch.full_like(t, -math.inf), t.clamp(max=far))
    return s, t


def _count_above(s: Tensor, rho: Tensor, log_z1: Tensor, g: Tensor, log_delta: float) -> tuple[Tensor, Tensor]:
    """Clocks past ``g [B, R]``: how many surely (``1 - ρ_b q_b ≤ δ``) → ``[B, R]`` (long), and the
    expected number of the others ``Σ ρ_b q_b`` + tail ``e^{-g} Z_1`` → ``[B, R]``."""
    x = torch.exp((s.unsqueeze(1) - g.unsqueeze(2)).clamp(max=_MAX_EXP))  # [B, R, T]
    rho = rho.unsqueeze(1)
    p = rho * -torch.expm1(-x)
    sure = (1.0 - rho) + rho * torch.exp(-x) <= math.exp(log_delta)
    tail = torch.exp((log_z1.unsqueeze(1) - g).clamp(max=_MAX_EXP))
    return sure.sum(2), torch.where(sure, torch.zeros_like(p), p).sum(2) + tail


def _range(s: Tensor, rho: Tensor, valid: Tensor, log_z1: Tensor, k: int,
           plain: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Integration range ``(g_lo, g_hi)``, each ``[B]``, and where it stops at the flat part ``[B]``.

    The ends are Chernoff levels of the count C(g) of clocks past g: clocks that have rung
    surely by g are counted exactly and the rest by their mean, so a few items far above the
    others (a count that stays flat over a wide range of g) do not widen the range. The levels are
    bracketed by bisection in ``asinh g`` (a bounded number of steps whatever the spread; each
    row's range depends on that row only) and the ends are taken on their safe side. ``plain`` (every
    item present for sure) enables the top-(k+1) lower bound, which keeps the range short when the
    catalog is too small for the Chernoff level to be reached. Otherwise (items present with
    probability ρ < 1, whose count can stay below k all the way down) the range stops where every
    head clock but the lowest has rung for sure (if the level is not reached before: "flat"), and
    :func:`_bottom` covers what lies below.
    """
    log_eps = _log_eps(s.dtype)
    levels = torch.tensor(_chernoff_levels(k, log_eps), dtype=s.dtype, device=s.device).t()  # [3, k+1]
    log_delta = log_eps - math.log(4.0 * s.shape[1])  # "surely rung": all of them miss w.p. ≤ eps/4
    s_in = s.masked_fill(~valid, -math.inf)
    total = torch.logaddexp(torch.logsumexp(s_in + torch.log(rho), 1), log_z1)  # [B]
    empty = ~torch.isfinite(total)  # nothing to draw in this block
    hi = total.unsqueeze(1) - torch.log(levels[:, k]) + 1.0  # μ(hi) < level: nothing sure yet
    lowest = s.masked_fill(~valid, math.inf).neg().topk(min(2, s.shape[1]), dim=1).values.neg()  # [B, ≤2], ascending
    if plain or s.shape[1] < 2:
        lo_head = lowest[:, 0] - 50.0  # every head clock rang
    else:  # every head clock but the lowest rang: below, F_{-a} is flat (see _bottom)
        lo_head = torch.where(torch.isfinite(lowest[:, 1]), lowest[:, 1] - math.log(_SILENT), lowest[:, 0] - 50.0)
    lo_tail = log_z1 - math.log(float(levels[0, k])) - 1.0  # the tail alone passes the highest level
    lo = torch.minimum(lo_head, torch.where(torch.isfinite(lo_tail), lo_tail, torch.full_like(lo_tail, math.inf)))
    hi = torch.where(empty.unsqueeze(1), torch.zeros_like(hi), hi)
    lo = torch.minimum(torch.where(empty | torch.isinf(lo), hi[:, 0] - 1.0, lo).unsqueeze(1), hi - 1.0)
    a, b = torch.asinh(lo), torch.asinh(hi)  # [B, 3]
    start = a[:, 0]
    for step in range(_RANGE_STEPS):
        mid = 0.5 * (a + b)
        g = torch.sinh(mid)
        # A bracket stops once it is 1e-3 wide in g (1e-7 relative far out, or a few ulps of asinh g),
        # so a row's range does not depend on how many steps the others need.
        floor = torch.clamp(4.0 * torch.finfo(s.dtype).eps * (1.0 + mid.abs()), min=1e-7)
        done = b - a <= torch.maximum(_ROOT_TOLERANCE / (1.0 + g.abs()), floor)
        if step % 4 == 3 and bool(done.all()):
            break
        sure, mu = _count_above(s_in, rho, log_z1, g, log_delta)
        left = (k - sure).clamp(min=0)  # draws left for the uncertain clocks
        above = mu > levels.gather(1, left.t()).t()
        a, b = torch.where(above & ~done, mid, a), torch.where(above | done, b, mid)
    g_lo, kappa, g_hi = torch.sinh(a[:, 0]), torch.sinh(0.5 * (a[:, 1] + b[:, 1])), torch.sinh(b[:, 2])
    if plain and s.shape[1] > k:
        # P(C_{-a}(g) ≤ k-1) ≤ (k+1) exp(-e^{s_(k+1) - g}); relative to π ~ e^{-κ} this is
        # below eps once e^x - x ≥ log(k+1) + κ - s_(k+1) - log eps, x = s_(k+1) - g.
        s_k1 = s_in.topk(k + 1, dim=1).values[:, -1]
        enough = torch.isfinite(s_k1)  # at least k+1 head items
        s_k1 = torch.where(enough, s_k1, kappa)
        c = math.log(k + 1) - log_eps + (kappa - s_k1).clamp(min=0.0)
        x = torch.log(c)
        for _ in range(4):
            x = torch.log(c + x)
        g_lo = torch.where(enough, torch.maximum(g_lo, s_k1 - x), g_lo)
    flat = torch.zeros_like(valid[:, 0]) if plain else a[:, 0] == start  # the level was never reached
    return torch.minimum(g_lo, g_hi - 1e-3), g_hi, flat


def _gaps(s: Tensor, valid: Tensor, log_z1: Tensor, g_lo: Tensor, g_hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gaps ``(u, v)`` of ``[g_lo, g_hi]``, ascending, each ``[B, G]``, and which are real ``[B, G]``
    (the others are empty, at ``g_hi``).

    A gap between sorted scores i and i+1 runs from where the clocks up to i (and the tail) are
    quiet (expected number past g ≤ e^{-_QUIET}) to where clock i+1 has surely rung
    (``1 - q ≤ e^{-_SILENT}``).
    """
    srt = s.masked_fill(~valid, -math.inf).sort(1).values  # ascending, unused slots first
    below = torch.cat([torch.full_like(srt[:, :1], -math.inf), srt], 1)  # [B, T+1]
    above = torch.cat([srt, torch.full_like(srt[:, :1], math.inf)], 1)
    quiet = torch.logaddexp(torch.logcumsumexp(below, 1), log_z1.unsqueeze(1)) + _QUIET
    u = torch.maximum(quiet, g_lo.unsqueeze(1))
    v = torch.minimum(above - math.log(_SILENT), g_hi.unsqueeze(1))
    real = v > u
    order = torch.where(real, u, torch.full_like(u, math.inf)).argsort(1)[:, :int(real.sum(1).max())]
    real = real.gather(1, order)
    u = torch.where(real, u.gather(1, order), g_hi.unsqueeze(1))
    v = torch.where(real, v.gather(1, order), g_hi.unsqueeze(1))
    return u, v, real


def _nodes(s: Tensor, rho: Tensor, valid: Tensor, log_z1: Tensor, k: int,
           plain: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Quadrature nodes ``g [B, Q]``, log weights ``[B, Q]``, the upper end ``g_hi [B]`` and the lower
    end where the range stops at the flat part (:func:`_range`), ``-inf`` elsewhere ``[B]``.

    Panels of Gauss–Legendre nodes in g, of width ≤ ``min(1, 2.5/√k)``, cover the range
    (:func:`_range`) except its gaps (:func:`_gaps`). In a gap every clock has either surely rung
    or is quiet, so everything is smooth in ``y = e^{-g}`` (the integrand is
    ``e^{s_a} exp(-e^{s_a} y) F dy``) and one Gauss–Legendre rule in y covers it, whatever its
    length: logit gaps of 1e4 cost a few nodes. Each row has as many panels as it needs; rows
    that need fewer than the batch's most are padded with nodes of weight 0 at ``g_hi``.
    """
    g_lo, g_hi, flat = _range(s, rho, valid, log_z1, k, plain)
    u, v, real = _gaps(s, valid, log_z1, g_lo, g_hi)
    starts, ends = torch.cat([g_lo.unsqueeze(1), v], 1), torch.cat([u, g_hi.unsqueeze(1)], 1)  # [B, S]
    length = (ends - starts).clamp(min=0.0)
    count = torch.ceil(length / min(1.0, 2.5 / math.sqrt(k)))  # panels per segment
    cum = cumsum(count, 1)
    panels = max(1, int(cum[:, -1].max()))
    index = torch.arange(panels, dtype=s.dtype, device=s.device).expand(s.shape[0], -1).contiguous()
    seg = torch.searchsorted(cum, index, right=True).clamp(max=count.shape[1] - 1)  # [B, panels]
    n_seg = count.gather(1, seg)
    used = index < cum[:, -1:]
    step = torch.where(used, length.gather(1, seg) / n_seg.clamp(min=1.0), torch.zeros_like(index))
    start = torch.where(used, starts.gather(1, seg) + (index - (cum.gather(1, seg) - n_seg)) * step,
                        g_hi.unsqueeze(1).expand_as(index))
    xi, log_wi = _gauss_legendre(_gl_points(s.dtype), s)
    g = (start.unsqueeze(2) + step.unsqueeze(2) * xi).reshape(s.shape[0], -1)
    log_w = (_safe_log(step).unsqueeze(2) + log_wi).reshape(s.shape[0], -1)
    # Gaps: y = e^{-u} t, t ∈ [t0, 1], t0 = e^{u-v}; node g = u - log t, weight w_t (1 - t0) e^{-u} / y.
    xi, log_wi = _gauss_legendre(_GAP_POINTS, s)
    t0 = torch.exp(u - v).unsqueeze(2)
    t = t0 + (1.0 - t0) * xi  # [B, G, points]
    log_w_gap = torch.where(real.unsqueeze(2), torch.log1p(-t0) + log_wi - torch.log(t), torch.full_like(t, -math.inf))
    g = torch.cat([g, (u.unsqueeze(2) - torch.log(t)).reshape(s.shape[0], -1)], 1)
    g_flat = torch.where(flat, g_lo, torch.full_like(g_lo, -math.inf))
    return g, torch.cat([log_w, log_w_gap.reshape(s.shape[0], -1)], 1), g_hi, g_flat


@functools.cache
def _gauss_legendre_np(points: int) -> tuple[np.ndarray, np.ndarray]:
    xi, wi = np.polynomial.legendre.leggauss(points)
    return (xi + 1.0) / 2.0, np.log(wi / 2.0)


def _gauss_legendre(points: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """Gauss–Legendre nodes on [0, 1] and their log weights, as tensors like ``like``."""
    xi, log_wi = _gauss_legendre_np(points)
    return (torch.tensor(xi, dtype=like.dtype, device=like.device),
            torch.tensor(log_wi, dtype=like.dtype, device=like.device))


def _fft_mul(a: Tensor, b: Tensor, n: int, conj: bool = False) -> Tensor:
    """``Σ_i a_i b_{j-i}`` (``conj``: ``Σ_i a_{j+i} b_i``) for ``j < n``, by FFT in float64 (so a
    float32 result keeps float32 accuracy)."""
    size = 1 << (max(a.shape[-1], n) + b.shape[-1] - 2).bit_length()  # no wrap-around
    fa, fb = torch.fft.rfft(a.double(), size), torch.fft.rfft(b.double(), size)
    return torch.fft.irfft(fa * (fb.conj() if conj else fb), size)[..., :n].to(a.dtype)


class _FFTConv(torch.autograd.Function):
    """``_fft_mul`` with a backward made of ``_FFTConv`` again: differentiable to any order, and every
    level of differentiation saves only real inputs (not their float64 spectra)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, b: Tensor, n: int, conj: bool) -> Tensor:  # type: ignore[override]
        return _fft_mul(a, b, n, conj)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[override]
        a, b, _, conj = inputs
        ctx.save_for_backward(a, b)
        ctx.conj = conj

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[:2]
        if ctx.conj:  # out_i = Σ_j a_{i+j} b_j
            return (_FFTConv.apply(grad, b, a.shape[-1], False) if need_a else None,
                    _FFTConv.apply(a, grad, b.shape[-1], True) if need_b else None, None, None)
        return (_FFTConv.apply(grad, b, a.shape[-1], True) if need_a else None,
                _FFTConv.apply(grad, a, b.shape[-1], True) if need_b else None, None, None)


def _poly_mul(a: Tensor, b: Tensor, n: int, fft: bool) -> Tensor:
    """Product of polynomials ``a [..., la]``, ``b [..., lb]`` truncated to ``n`` coefficients.

    ``fft``: long factors by FFT, whose error is absolute (float64 rounding of probability vectors,
    ~1e-16), not relative to each coefficient as that of the direct products.
    """
    la, lb = a.shape[-1], b.shape[-1]
    if la <= _SHIFT_MAX:  # short factors: a few shifted products
        b = F.pad(b, (0, max(0, n - lb)))[..., :n]
        out = a[..., :1] * b
        for i in range(1, min(la, n)):
            out = out + F.pad(a[..., i:i + 1] * b[..., :n - i], (i, 0))
        return out
    if fft:
        return _FFTConv.apply(a, b, n, False)
    shape = a.shape[:-1]
    groups = a[..., 0].numel()
    y = F.conv1d(b.reshape(1, groups, lb), a.reshape(groups, 1, la).flip(-1), padding=la - 1, groups=groups)
    return y[0, :, :n].reshape(*shape, n)


def _pb_poly(p: Tensor, k: int, fft: bool) -> Tensor:
    """Poisson-binomial generating polynomial of ``p [..., T]`` truncated to degree < k → ``[..., ≤k]``."""
    size = 1 << max(0, (p.shape[-1] - 1).bit_length())
    p = F.pad(p, (0, size - p.shape[-1]))  # padding items never arrive: factor 1
    if size == 1:
        return torch.stack([1.0 - p, p], dim=-1)[..., 0, :k]
    p1, p2 = p[..., 0::2], p[..., 1::2]  # the first level directly: pairs of items
    q1, q2 = 1.0 - p1, 1.0 - p2
    poly = torch.stack([q1 * q2, p1 * q2 + q1 * p2, p1 * p2], dim=-1)[..., :k]
    while poly.shape[-2] > 1:
        n = min(2 * poly.shape[-1] - 1, k)
        poly = _poly_mul(poly[..., 0::2, :], poly[..., 1::2, :], n, fft)
    return poly[..., 0, :]


@functools.cache
def _tree_entries(slots: int, k: int) -> int:
    """Entries per row and node that the product tree of :func:`_pb_poly` keeps for backward (the
    factors of its shifted products, the inputs of its FFT products)."""
    size = 1 << max(0, (slots - 1).bit_length())
    total, length = 2 * size, min(3, k)
    size //= 2
    while size > 1:
        size //= 2
        n = min(2 * length - 1, k)
        total += size * (length * n if length <= _SHIFT_MAX else 2 * length + n)
        length = n
    return total


def _piece_entries(slots: int, k: int, targets: int | None) -> int:
    """Entries per row and node of a piece (:func:`_piece`): the product tree, its derivative (all
    slots) or the targets multiplied back in (``targets`` of them), and the per-slot tensors."""
    tree = _tree_entries(slots, k)
    extra = 2 * tree if targets is None else targets * (targets + 2) * k
    return tree + extra + _SLOT_ENTRIES * slots


def _tail_cdf(log_z: Tensor, g: Tensor, k: int) -> Tensor:
    """``P(tail count ≤ c)`` for ``c < k`` at every node → ``[B, Q, k]``; ``log_z [B, P]``.

    Coefficients of ``exp(-X_1 + Σ_m (-1)^{m+1} R_m z^m / m)`` via ``c t_c = Σ_m (-1)^{m+1} R_m
    t_{c-m}``, each in log-space (odd and even terms summed apart, then subtracted once).
    """
    num_powers = log_z.shape[1]
    empty = torch.isinf(log_z[:, 0]).view(-1, 1, 1)  # [B, 1, 1]
    powers = torch.arange(1, num_powers + 1, dtype=g.dtype, device=g.device)
    log_x = log_z.unsqueeze(1) - powers * g.unsqueeze(2)  # [B, Q, P]: log X_j
    log_x = torch.where(empty, torch.full_like(log_x, -60.0), log_x)
    coef = torch.tensor(_tail_coefficients(num_powers), dtype=g.dtype, device=g.device)  # [m, j]
    log_r = torch.logsumexp(log_x.unsqueeze(2) + coef, dim=3)  # [B, Q, P]: log R_m
    gap = -4.0 * torch.finfo(g.dtype).eps
    log_t = [-torch.exp(log_x[..., 0])]  # t_0 = e^{-X_1}
    for c in range(1, k):
        odd = [log_r[..., m - 1] + log_t[c - m] for m in range(1, min(c, num_powers) + 1, 2)]
        even = [log_r[..., m - 1] + log_t[c - m] for m in range(2, min(c, num_powers) + 1, 2)]
        pos = torch.logsumexp(torch.stack(odd), 0)
        if even:
            neg = torch.logsumexp(torch.stack(even), 0)
            pos = pos + log1mexp((neg - pos).clamp(max=gap))
        log_t.append(pos - math.log(c))
    cdf = cumsum(torch.exp(torch.stack(log_t, dim=2)), 2)
    return torch.where(empty, torch.ones_like(cdf), cdf)


def _log_cdf(s: Tensor, rho: Tensor, log_z: Tensor, k: int, targets: Tensor | None, g: Tensor,
             has_tail: bool, fft: bool) -> Tensor:
    """``log F_{-a}(g)`` at the nodes ``g [B, Q]`` → ``[B, Q, T]`` (or ``[B, Q, L]`` for ``targets``)."""
    x = torch.exp((s.unsqueeze(1) - g.unsqueeze(2)).clamp(max=_MAX_EXP))  # [B, Q, T]
    p = rho.unsqueeze(1) * -torch.expm1(-x)  # P(b present and past g)
    if has_tail:
        cdf = _tail_cdf(log_z, g, k)  # [B, Q, k]
    else:
        cdf = torch.ones(*g.shape, k, dtype=s.dtype, device=s.device)
    if targets is None:
        # F_{-a} = -∂H/∂p_a with H = E[(k - C)_+] = Σ_i R_i Σ_{c ≤ k-1-i} P(tail ≤ c). The derivative is
        # taken inside (create_graph where p needs a gradient, so this stays differentiable to any order).
        outer = p.requires_grad or cdf.requires_grad
        with torch.inference_mode(False), torch.enable_grad():
            if p.is_inference():  # made under torch.inference_mode: copies that autograd may record
                p, cdf = p.clone(), cdf.clone()
            p_in = p if p.requires_grad else p.detach().requires_grad_()
            poly = _pb_poly(p_in, k, fft)
            weight = cumsum(cdf, -1).flip(-1)[..., :poly.shape[-1]]
            (grad,) = torch.autograd.grad((poly * weight).sum(), p_in, create_graph=outer)
        return _safe_log(-grad)  # [B, Q, T]
    is_target = torch.zeros(s.shape, dtype=torch.bool, device=s.device).scatter(1, targets, True)
    poly = _pb_poly(torch.where(is_target.unsqueeze(1), torch.zeros_like(p), p), k, fft)
    poly = F.pad(poly, (0, k - poly.shape[-1]))  # [B, Q, k]
    same = targets.unsqueeze(2) == targets.unsqueeze(1)  # [B, L, L]
    first = ~(same & torch.ones_like(same).tril(-1)).any(2)  # first occurrence of each slot
    p_t = p.gather(2, targets.unsqueeze(1).expand(-1, g.shape[1], -1))  # [B, Q, L]
    poly = poly.unsqueeze(2).expand(-1, -1, targets.shape[1], -1)  # [B, Q, L, k]
    for t in range(targets.shape[1]):  # multiply in the other targets, once per slot
        take = (first[:, t:t + 1] & ~same[:, t]).view(-1, 1, targets.shape[1], 1)
        pt = p_t[:, :, t].view(-1, g.shape[1], 1, 1)
        grown = poly * (1.0 - pt) + F.pad(poly[..., :-1], (1, 0)) * pt
        poly = torch.where(take, grown, poly)
    return _safe_log((poly * cdf.flip(-1).unsqueeze(2)).sum(-1))  # [B, Q, L]


def _log_survival(s_a: Tensor, g_hi: Tensor, low: Tensor) -> Tensor:
    """``log P(G_a > g_hi)`` for ``s_a [B, A]``, ``g_hi [B]`` → ``[B, A]``, less ``s_a`` where ``low``."""
    y = (s_a - g_hi.unsqueeze(1)).clamp(max=_MAX_EXP)
    small = y < -10.0  # log P = y - e^y / 2 to rounding
    y_small = torch.where(small, y, torch.full_like(y, -20.0))
    y_big = torch.where(small, torch.zeros_like(y), y)
    direct = torch.where(small, y_small - 0.5 * torch.exp(y_small), log1mexp_exp(y_big))
    relative = torch.where(small, -0.5 * torch.exp(y_small), log1mexp_exp(y_big) - y_big) - g_hi.unsqueeze(1)
    return torch.where(low, relative, direct)


def _piece(s: Tensor, rho: Tensor, log_z: Tensor, s_a: Tensor, low: Tensor, g: Tensor, log_w: Tensor, *,
           k: int, targets: Tensor | None, has_tail: bool, fft: bool) -> Tensor:
    """``log Σ_q w_q f_a(g_q) F_{-a}(g_q)`` over the nodes ``g [b, q]`` → ``[b, A]`` (less ``s_a`` where
    ``low``: there ``log f_a = s_a - g - e^{s_a - g}`` loses g to rounding once ``s_a`` is added)."""
    z = (s_a.unsqueeze(1) - g.unsqueeze(2)).clamp(max=_MAX_EXP)  # [b, q, A]
    log_density = torch.where(low.unsqueeze(1), -g.unsqueeze(2), z) - torch.exp(z)
    log_f = _log_cdf(s, rho, log_z, k, targets, g, has_tail, fft)
    # Raised from -inf to a finite floor: a piece whose every term vanishes then has a zero gradient, not NaN.
    floor = torch.finfo(g.dtype).min / 4
    return torch.logsumexp((log_w.unsqueeze(2) + log_density + log_f).clamp(min=floor), dim=1)


def _bottom(s: Tensor, rho: Tensor, log_z: Tensor, s_a: Tensor, g_flat: Tensor, *, k: int,
            targets: Tensor | None, has_tail: bool, fft: bool) -> Tensor:
    """``log ∫_{-∞}^{g_flat} f_a F_{-a} dg = log F_{-a}(g_flat) + log P(G_a < g_flat)`` → ``[b, A]``
    (``-inf`` in rows whose range does not stop at a flat part, ``g_flat = -inf``).

    With items present with probability ρ < 1 the count may stay below k down to the lowest
    clock. The range then stops where every head clock but the lowest has surely rung
    (:func:`_range`): below, ``F_{-a}`` of the lowest item is flat, so this is exact for it (an
    item far below the others, which panels at its distance could not resolve), and for every
    other item it is below ``exp(-e^5) = 1e-64`` of its density's mass.
    """
    flat = torch.isfinite(g_flat).unsqueeze(1)
    g = torch.where(flat[:, 0], g_flat, torch.zeros_like(g_flat))
    log_f = _log_cdf(s, rho, log_z, k, targets, g.unsqueeze(1), has_tail, fft)[:, 0]  # [b, A]
    out = log_f - torch.exp((s_a - g.unsqueeze(1)).clamp(max=_MAX_EXP))
    return torch.where(flat, out, torch.full_like(out, -math.inf))


def _under_functorch(t: Tensor) -> bool:
    """Whether ``t`` is wrapped by a ``torch.func`` transform (which refuses :class:`_Recomputed`)."""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def _has_tangent(*tensors: Tensor) -> bool:
    """Whether any of ``tensors`` carries a ``torch.autograd.forward_ad`` tangent (:class:`_Recomputed` has no jvp)."""
    return any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


class _Recomputed(torch.autograd.Function):
    """``fn(*args)`` computed without a graph, and again in backward with one: what it keeps for
    backward is its inputs. Differentiable to any order (the backward is made of differentiable ops on
    the saved inputs).

    Unlike ``torch.utils.checkpoint`` (non-reentrant), it holds nothing when ``fn`` takes a derivative
    inside (the leave-one-out counts of :func:`_log_cdf`): there, unpacking a saved tensor during the
    forward makes checkpoint recompute the function at once and keep the result until backward, so a
    mixture's earlier blocks kept all their work (215 MiB after the forward at a 1 MiB budget, against
    114 MiB with no budget, at B = 8, N = 600, K = 40, M = 4).
    """

    @staticmethod
    def forward(ctx, fn, *args: Tensor) -> Tensor:  # type: ignore[override]
        ctx.fn = fn
        ctx.save_for_backward(*args)
        return fn(*args)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        args = ctx.saved_tensors
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
        create_graph = torch.is_grad_enabled()  # a backward with create_graph: keep this one differentiable
        with torch.enable_grad():
            out = ctx.fn(*args)
            if not out.requires_grad:  # what needs a gradient is not used here (a tail's sums, in rows without tail)
                return (None,) * (len(args) + 1)
            grads = torch.autograd.grad(out, [args[i] for i in wanted], grad, create_graph=create_graph,
                                        allow_unused=True)
        result: list[Tensor | None] = [None] * (len(args) + 1)
        for i, g in zip(wanted, grads):
            result[i + 1] = g
        return tuple(result)


def _block_log_hazard(s: Tensor, log_rho: Tensor | None, valid: Tensor, log_z: Tensor, k: int,
                      targets: Tensor | None, budget: int) -> Tensor:
    """``log P(a drawn in this block | a present)`` for ``targets [B, L]`` (or all slots if None).

    ``s [B, T]`` scores in the block's frame (finite where ``valid``), ``log_rho [B, T]`` log
    survival of earlier blocks (None: all present), ``log_z [B, P]`` tail log power sums, ``k``
    draws → ``[B, L]`` (or ``[B, T]``; ``-inf`` where the item is not valid). The work is split into
    pieces of rows (and of nodes when one row is too large) of at most ``min(budget, _PIECE_BYTES)``
    bytes; when a gradient is needed and all pieces together would keep more than ``budget`` bytes
    for backward, each piece is recomputed in backward (:class:`_Recomputed`).
    """
    batch, slots = s.shape
    s = torch.where(valid, s, torch.zeros_like(s))  # finite stand-in for empty slots
    rho = torch.ones_like(s) if log_rho is None else torch.exp(log_rho)
    rho = torch.where(valid, rho, torch.zeros_like(rho))
    s_a = s if targets is None else s.gather(1, targets)
    valid_a = valid if targets is None else valid.gather(1, targets)
    item = s.element_size()
    piece = min(budget, _PIECE_BYTES)
    search_rows = max(1, piece // (_SEARCH_ENTRIES * item * slots))
    per_node = item * _piece_entries(slots, k, None if targets is None else targets.shape[1])
    mu_lo = float(_chernoff_levels(k, _log_eps(s.dtype))[k, 0])
    grad = torch.is_grad_enabled() and (s.requires_grad or log_z.requires_grad or rho.requires_grad)
    out = []
    for r0 in range(0, batch, search_rows):
        rows = slice(r0, r0 + search_rows)
        s_r, rho_r, log_z_r, s_a_r = s[rows], rho[rows], log_z[rows], s_a[rows]
        t_r = None if targets is None else targets[rows]
        with torch.no_grad():
            g, log_w, g_hi, g_flat = _nodes(s_r.detach(), rho_r.detach(), valid[rows], log_z_r[:, 0].detach(), k,
                                            log_rho is None)
            low = s_a_r.detach() < g.min(1, keepdim=True).values  # below every node
            # Each row's own nodes first, so that a piece of rows leaves out the padding it does not need.
            order = torch.isinf(log_w).to(torch.int8).argsort(dim=1, stable=True)
            g, log_w = g.gather(1, order), log_w.gather(1, order)
            used = torch.isfinite(log_w).sum(1)
            has_tail = bool(torch.isfinite(log_z_r[:, 0]).any())
            # FFT products are accurate to ~1e-16 absolute only. That suffices when the block surely
            # fills up (the values of F_{-a} that matter are then not tiny); with few items present,
            # F_{-a} can be tiny where it matters and direct products are used.
            fft = log_rho is None or bool((rho_r.sum(1) >= mu_lo).all())
        n_rows = g.shape[0]
        row_step = max(1, min(n_rows, piece // (per_node * g.shape[1])))
        # What all pieces would keep, estimated from this chunk's nodes (the others are alike).
        split = (grad and int(used.sum()) * batch * per_node > budget * n_rows and not _under_functorch(s)
                 and not _has_tangent(s, rho, log_z))
        for i in range(0, n_rows, row_step):
            sub = slice(i, i + row_step)
            n_nodes = int(used[sub].max())
            rows_of = functools.partial(_rows, k=k, targets=None if t_r is None else t_r[sub], has_tail=has_tail,
                                        fft=fft, earlier=log_rho is not None, n_nodes=n_nodes,
                                        node_step=max(1, piece // (per_node * g[sub].shape[0])), split=split)
            args = (s_r[sub], rho_r[sub], log_z_r[sub], s_a_r[sub], low[sub], g[sub], log_w[sub], g_hi[sub],
                    g_flat[sub])
            # Split: the rows' pieces, and the [pieces, rows, A] of their outputs, are made again in backward, where
            # each piece is itself recomputed: a block keeps its inputs and output, whatever the number of pieces.
            out.append(_Recomputed.apply(rows_of, *args) if split else rows_of(*args))
    log_h = torch.cat(out, dim=0)
    return torch.where(valid_a, log_h, torch.full_like(log_h, -math.inf))


def _rows(s: Tensor, rho: Tensor, log_z: Tensor, s_a: Tensor, low: Tensor, g: Tensor, log_w: Tensor, g_hi: Tensor,
          g_flat: Tensor, *, k: int, targets: Tensor | None, has_tail: bool, fft: bool, earlier: bool, n_nodes: int,
          node_step: int, split: bool) -> Tensor:
    """:func:`_block_log_hazard` for some rows: the survival term, the nodes' pieces of ``node_step`` nodes and (with
    ``earlier`` blocks) the bottom term → ``[b, A]``. With ``split``, a piece recorded in a graph (when
    :class:`_Recomputed` makes these rows again in backward) is itself recomputed in backward."""
    def run(fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
        fn = functools.partial(fn, k=k, targets=targets, has_tail=has_tail, fft=fft)
        return _Recomputed.apply(fn, *args) if split and torch.is_grad_enabled() else fn(*args)

    terms = [_log_survival(s_a, g_hi, low)]
    for j in range(0, n_nodes, node_step):
        nodes = slice(j, j + node_step)
        terms.append(run(_piece, s, rho, log_z, s_a, low, g[:, nodes], log_w[:, nodes]))
    log_h = torch.logsumexp(torch.stack(terms), dim=0)  # the survival term is finite
    log_h = torch.where(low, s_a, torch.zeros_like(log_h)) + log_h
    if earlier:
        bottom = run(_bottom, s, rho, log_z, s_a, g_flat)
        log_h = torch.logsumexp(torch.stack([log_h, bottom]), dim=0)  # (logaddexp: NaN 2nd derivative at -inf)
    return log_h


def _check_runs(runs: Sequence[tuple[int, int]], num_experts: int) -> list[tuple[int, int]]:
    """Validate runs and merge neighbours that use the same expert."""
    if len(runs) == 0:
        raise ValueError("runs must hold at least one (expert, count) pair, got an empty sequence")
    merged: list[tuple[int, int]] = []
    for run in runs:
        if len(run) != 2:
            raise ValueError(f"runs must hold (expert, count) pairs, got {run!r}")
        expert, count = int(run[0]), int(run[1])
        if not 0 <= expert < num_experts or count < 1:
            raise ValueError(f"runs must hold experts in [0, {num_experts}) and counts >= 1, got {run!r}")
        if merged and merged[-1][0] == expert:
            merged[-1] = (expert, merged[-1][1] + count)
        else:
            merged.append((expert, count))
    return merged


def exact_log_inclusion(summary: HeadTail, runs: Sequence[tuple[int, int]], *,
                        memory_budget: int = DEFAULT_MEMORY_BUDGET) -> Tensor:
    """``log P(target ∈ the K PL(-MoE) draws)`` → ``[B, L]``.

    ``summary`` holds ``head_scores [B, M, T]`` (−inf in unused slots and for masked items),
    ``target_pos [B, L]`` and ``tail_log_power_sums [B, M, P]``; ``runs`` is the position → expert
    map as ``[(expert, count), ...]`` summing to K. One run is exact up to quadrature (and the
    tail's power-series truncation); several runs use the block-exact approximation. A target
    masked under every expert gets ``-inf`` (zero gradient). ``memory_budget`` (bytes) bounds what
    each expert block keeps for backward (beyond it, pieces are recomputed in backward) and the size
    of its pieces of work; the result does not depend on it beyond rounding.
    """
    scores, tail, targets = summary.head_scores, summary.tail_log_power_sums, summary.target_pos
    if scores.dim() != 3 or tail.dim() != 3 or tail.shape[:2] != scores.shape[:2]:
        raise ValueError(f"summary must have head_scores [B, M, T] and tail_log_power_sums [B, M, P], got "
                         f"{tuple(scores.shape)} and {tuple(tail.shape)}")
    if targets.dim() != 2 or targets.shape[0] != scores.shape[0]:
        raise ValueError(f"summary.target_pos must be [B={scores.shape[0]}, L], got {tuple(targets.shape)}")
    if not is_int(memory_budget):
        raise TypeError(f"memory_budget must be an int (bytes), got {type(memory_budget).__name__}")
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget}")
    memory_budget = int(memory_budget)
    runs = _check_runs(runs, scores.shape[1])
    if scores.shape[0] == 0 or targets.shape[1] == 0 or scores.shape[2] == 0:
        # zero, still a function of both inputs (finite parts only: -inf · 0 is NaN), so that the backward
        # reaches the catalog's sums as it does with rows (a sharded catalog's backward is collective)
        zero = sum(torch.where(x.isfinite(), x, 0.0).sum() for x in (scores, tail)) * 0.0
        return scores.new_zeros(targets.shape) + zero
    num_candidates = sum(count for _, count in runs)
    s_all, tail_all = _to_frame(scores, tail, _reference(scores, num_candidates))
    valid_all = torch.isfinite(s_all)  # [B, M, T]
    # Every item is drawn when the catalog has no more than K items that a drawing expert can take (an expert that
    # draws no position, M > K, takes none: found by review, its unmasked items turned this off).
    drawing = sorted({expert for expert, _ in runs})
    valid_any = select_experts(valid_all, drawing).any(1)  # [B, T]
    full = torch.isinf(select_experts(tail_all, drawing)[:, :, 0]).all(1) & (valid_any.sum(1) <= num_candidates)
    log_survival: Tensor | None = None
    terms = []
    for i, (expert, count) in enumerate(runs):
        last = i == len(runs) - 1
        # Few targets: each one's leave-one-out count directly; many: every slot's at once, through a recorded
        # derivative, which torch.func's forward mode cannot take (jvp: the direct way for any number).
        direct = last and (targets.shape[1] ** 2 <= scores.shape[2] or torch._C._are_functorch_transforms_active())
        log_h = _block_log_hazard(s_all[:, expert], log_survival, valid_all[:, expert], tail_all[:, expert], count,
                                  targets if direct else None, memory_budget)
        if last and not direct:
            log_h = log_h.gather(1, targets)
        if last:
            terms.append(log_h if log_survival is None else log_h + log_survival.gather(1, targets))
        else:
            before = torch.zeros_like(log_h) if log_survival is None else log_survival
            terms.append((log_h + before).gather(1, targets))
            # h is clamped below 1 so that log(1 - h) and its gradient stay finite.
            log_survival = before + log1mexp(log_h.clamp(max=-torch.finfo(log_h.dtype).eps))
    log_pi = safe_logsumexp(torch.stack(terms), dim=0).clamp(max=0.0)  # quadrature rounding
    drawn = torch.where(valid_any.gather(1, targets), torch.zeros_like(log_pi), torch.full_like(log_pi, -math.inf))
    return torch.where(full.unsqueeze(1), drawn, log_pi)
