"""The "exact" inclusion probability of Plackett-Luce draws (private).

One expert block (a single logit vector, K draws) is the exponential race of Gumbel clocks
``G_b = s_b + Gumbel(0, 1)``: item a is drawn iff fewer than K other clocks beat it, so

    π_a = ∫ f_a(g) P(C_{-a}(g) ≤ K-1) dg,        f_a(g) = exp(s_a - g - e^{s_a - g}),

where ``C_{-a}(g)`` is Poisson-binomial with ``q_b(g) = P(G_b > g) = 1 - exp(-e^{s_b - g})``.

* Quadrature: composite Gauss–Legendre on ``[g_lo, g_hi]`` (Chernoff levels of the count of
  clocks past g, those surely rung counted exactly), one Gauss–Legendre rule in ``e^{-g}`` per
  gap between far-apart scores, and ``P(G_a > g_hi)`` analytically above ``g_hi``. The cost does
  not grow with the logit spread; nodes are processed in chunks of bounded size.
* Head items: their truncated Poisson-binomial polynomial (degree < K) by a balanced tree of
  polynomial products in probability space (long factors by FFT in float64 when the block
  surely fills up). Targets are left out of the tree and multiplied back in one by one, which
  gives every target's leave-one-out count without division.
* Tail items (known only through ``Z_p = Σ_tail e^{p s}``): ``log Π_tail (1 - q + q z)`` is the
  power series ``-X_1 + Σ_m (-1)^{m+1} R_m z^m / m`` with ``X_j = e^{-jg} Z_j`` and
  ``R_m = Σ_tail (e^{x} - 1)^m = Σ_j m! S(j, m) X_j / j!``; truncating at ``j ≤ P`` errs by
  ``O(X_{P+1})``. Its coefficients come from a log-space recurrence.
* Several runs ("block-exact"): block m is the race above over the items still present, each
  present independently with its survival ``ρ_b`` (the product of ``1 - h`` over earlier
  blocks); ``π_a = Σ_m h_a^{(m)} Π_{m'<m} (1 - h_a^{(m')})``. Exact for one run; for several it
  treats survival across blocks as independent and ignores the depletion of the tail.

Everything is differentiable; logs are taken with the double-where pattern so float32 extremes
(gaps of 1e4, probabilities far below 1e-38) stay finite.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from capg_rec._head_tail import HeadTail
from capg_rec._numerics import log1mexp, log1mexp_exp

__all__ = ["EXACT_NUM_POWERS", "exact_log_inclusion"]

EXACT_NUM_POWERS = 4

_ROOT_TOLERANCE = 1e-3  # the range ends need no more accuracy than this
_SHIFT_MAX = 12  # polynomial factors up to this length are multiplied by shifted products
_SILENT = 140.0  # e^{s-g} ≥ _SILENT: the clock has rung for sure (1 - q ≤ e^{-140})
_QUIET = 3.0  # expected number of clocks past g ≤ e^{-_QUIET}: smooth in e^{-g}
_GAP_POINTS = 8  # Gauss–Legendre nodes in e^{-g} per gap
_CHUNK_ELEMENTS = 1 << 26  # nodes are processed in chunks of about this many B·T·k entries
_MAX_EXP = 60.0  # exp arguments are clamped here: 1 - exp(-e^60) is exactly 1 in any float


def _log_eps(dtype: torch.dtype) -> float:
    """Relative truncation level of the integration range."""
    return math.log(1e-13 if dtype == torch.float64 else 1e-8)


def _gl_points(dtype: torch.dtype) -> int:
    """Gauss–Legendre nodes per panel: 5 reach float32 rounding; float64 needs 8 for ~1e-13 (6 err by
    ~4e-10 against the softmax at K = 1, measured)."""
    return 8 if dtype == torch.float64 else 5


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
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


def _count_above(s: Tensor, rho: Tensor, log_z1: Tensor, g: Tensor, log_delta: float) -> tuple[Tensor, Tensor]:
    """Clocks past ``g [B, R]``: how many surely (``1 - ρ_b q_b ≤ δ``) → ``[B, R]`` (long), and the
    expected number of the others ``Σ ρ_b q_b`` + tail ``e^{-g} Z_1`` → ``[B, R]``."""
    x = torch.exp((s.unsqueeze(1) - g.unsqueeze(2)).clamp(max=_MAX_EXP))  # [B, R, T]
    rho = rho.unsqueeze(1)
    p = rho * -torch.expm1(-x)
    sure = (1.0 - rho) + rho * torch.exp(-x) <= math.exp(log_delta)
    tail = torch.exp((log_z1.unsqueeze(1) - g).clamp(max=_MAX_EXP))
    return sure.sum(2), torch.where(sure, torch.zeros_like(p), p).sum(2) + tail


def _range(s: Tensor, rho: Tensor, valid: Tensor, log_z1: Tensor, k: int, plain: bool) -> tuple[Tensor, Tensor]:
    """Integration range ``(g_lo, g_hi)``, each ``[B]``.

    The ends are Chernoff levels of the count C(g) of clocks past g: clocks that have rung
    surely by g are counted exactly and the rest by their mean, so a few items far above the
    others (a count that stays flat over a wide range of g) do not widen the range. ``plain``
    (every item present for sure) enables the top-(k+1) lower bound, which keeps the range short
    when the catalog is too small for the Chernoff level to be reached.
    """
    log_eps = _log_eps(s.dtype)
    levels = torch.tensor(_chernoff_levels(k, log_eps), dtype=s.dtype, device=s.device).t()  # [3, k+1]
    log_delta = log_eps - math.log(4.0 * s.shape[1])  # "surely rung": all of them miss w.p. ≤ eps/4
    s_in = s.masked_fill(~valid, -math.inf)
    total = torch.logaddexp(torch.logsumexp(s_in + torch.log(rho), 1), log_z1)  # [B]
    hi = total.unsqueeze(1) - torch.log(levels[:, k]) + 1.0  # μ(hi) < level: nothing sure yet
    lo = s.masked_fill(~valid, math.inf).min(1).values.unsqueeze(1) - 50.0  # every head clock rang
    lo = torch.minimum(lo, hi - 1.0).expand_as(hi)
    steps = max(1, math.ceil(math.log2(float((hi - lo).max()) / _ROOT_TOLERANCE)))
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        sure, mu = _count_above(s_in, rho, log_z1, mid, log_delta)
        left = (k - sure).clamp(min=0)  # draws left for the uncertain clocks
        above = mu > levels.gather(1, left.t()).t()
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    g_lo, kappa, g_hi = (0.5 * (lo + hi)).unbind(1)
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
    return torch.minimum(g_lo, g_hi - 1e-3), g_hi


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
           plain: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Quadrature nodes ``g [B, Q]``, log weights ``[B, Q]`` and the upper end ``g_hi [B]``.

    Panels of Gauss–Legendre nodes in g cover the range (:func:`_range`) except its gaps
    (:func:`_gaps`). In a gap every clock has either surely rung or is quiet, so everything is
    smooth in ``y = e^{-g}`` (the integrand is ``e^{s_a} exp(-e^{s_a} y) F dy``) and one
    Gauss–Legendre rule in y covers it, whatever its length: logit gaps of 1e4 cost a few nodes.
    """
    g_lo, g_hi = _range(s, rho, valid, log_z1, k, plain)
    u, v, real = _gaps(s, valid, log_z1, g_lo, g_hi)
    # Panels of width ≤ `width` on the segments between the gaps. The row that needs the most sets
    # their number; the others use them all with narrower panels (the rest are padding of weight 0).
    starts, ends = torch.cat([g_lo.unsqueeze(1), v], 1), torch.cat([u, g_hi.unsqueeze(1)], 1)  # [B, S]
    width = min(1.0, 2.5 / math.sqrt(k))
    length = (ends - starts).clamp(min=0.0)
    panels = max(1, int(torch.ceil(length / width).sum(1).max()))
    spare = panels - (length > 0).sum(1, keepdim=True)  # Σ ceil(len / w) ≤ Σ len / w + #segments
    row_width = (length.sum(1, keepdim=True) / spare.clamp(min=1)).clamp(max=width)
    count = torch.ceil(length / torch.where(spare > 0, row_width, torch.full_like(row_width, width))).long()
    cum = count.cumsum(1)
    index = torch.arange(panels, device=s.device).expand(s.shape[0], -1).contiguous()
    seg = torch.searchsorted(cum, index, right=True).clamp(max=count.shape[1] - 1)  # [B, panels]
    n_seg = count.gather(1, seg)
    step = torch.where(index < cum[:, -1:], length.gather(1, seg) / n_seg.clamp(min=1), torch.zeros_like(g_lo)[:, None])
    start = starts.gather(1, seg) + (index - (cum.gather(1, seg) - n_seg)) * step
    xi, log_wi = _gauss_legendre(_gl_points(s.dtype), s)
    g = (start.unsqueeze(2) + step.unsqueeze(2) * xi).reshape(s.shape[0], -1)
    log_w = (_safe_log(step).unsqueeze(2) + log_wi).reshape(s.shape[0], -1)
    # Gaps: y = e^{-u} t, t ∈ [t0, 1], t0 = e^{u-v}; node g = u - log t, weight w_t (1 - t0) e^{-u} / y.
    xi, log_wi = _gauss_legendre(_GAP_POINTS, s)
    t0 = torch.exp(u - v).unsqueeze(2)
    t = t0 + (1.0 - t0) * xi  # [B, G, points]
    log_w_gap = torch.where(real.unsqueeze(2), torch.log1p(-t0) + log_wi - torch.log(t), torch.full_like(t, -math.inf))
    g = torch.cat([g, (u.unsqueeze(2) - torch.log(t)).reshape(s.shape[0], -1)], 1)
    return g, torch.cat([log_w, log_w_gap.reshape(s.shape[0], -1)], 1), g_hi


@functools.lru_cache(maxsize=None)
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
    cdf = torch.cumsum(torch.exp(torch.stack(log_t, dim=2)), dim=2)
    return torch.where(empty, torch.ones_like(cdf), cdf)


def _log_survival(s: Tensor, g: Tensor) -> Tensor:
    """``log P(G_a > g)``: ``s [B, A]``, ``g [B, Q]`` → ``[B, Q, A]``."""
    return log1mexp_exp((s.unsqueeze(1) - g.unsqueeze(2)).clamp(max=_MAX_EXP))


def _log_density(s: Tensor, g: Tensor) -> Tensor:
    """``log f_a(g) = z - e^z``, ``z = s_a - g``: ``s [B, A]``, ``g [B, Q]`` → ``[B, Q, A]``."""
    z = (s.unsqueeze(1) - g.unsqueeze(2)).clamp(max=_MAX_EXP)
    return z - torch.exp(z)


def _log_cdf(s: Tensor, rho: Tensor, log_z: Tensor, k: int, targets: Tensor | None, g: Tensor,
             has_tail: bool, fft: bool) -> Tensor:
    """``log F_{-a}(g)`` at the nodes ``g [B, Q]`` → ``[B, Q, L]`` (or ``[B, Q, T]``)."""
    x = torch.exp((s.unsqueeze(1) - g.unsqueeze(2)).clamp(max=_MAX_EXP))  # [B, Q, T]
    p = rho.unsqueeze(1) * -torch.expm1(-x)  # P(b present and past g)
    if has_tail:
        cdf = _tail_cdf(log_z, g, k)  # [B, Q, k]
    else:
        cdf = torch.ones(*g.shape, k, dtype=s.dtype, device=s.device)
    if targets is None:
        # F_{-a} = -∂H/∂p_a with H = E[(k - C)_+] = Σ_i R_i Σ_{c ≤ k-1-i} P(tail ≤ c).
        outer = p.requires_grad or cdf.requires_grad
        with torch.enable_grad():
            p_in = p if p.requires_grad else p.detach().requires_grad_()
            poly = _pb_poly(p_in, k, fft)
            weight = torch.cumsum(cdf, dim=-1).flip(-1)[..., :poly.shape[-1]]
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


def _block_log_hazard(s: Tensor, log_rho: Tensor | None, valid: Tensor, log_z: Tensor, k: int,
                      targets: Tensor | None) -> Tensor:
    """``log P(a drawn in this block | a present)`` for ``targets [B, L]`` (or all slots if None).

    ``s [B, T]`` scores (finite where ``valid``), ``log_rho [B, T]`` log survival of earlier
    blocks (None: all present), ``log_z [B, P]`` tail log power sums, ``k`` draws → ``[B, L]``
    (or ``[B, T]``). The nodes are processed in chunks of at most ~``_CHUNK_ELEMENTS`` tree
    entries (this bounds the forward's temporaries; what backward keeps grows with the nodes).
    """
    s = torch.where(valid, s, torch.zeros_like(s))  # finite stand-in for empty slots
    rho = torch.ones_like(s) if log_rho is None else torch.exp(log_rho)
    rho = torch.where(valid, rho, torch.zeros_like(rho))
    with torch.no_grad():
        g, log_w, g_hi = _nodes(s.detach(), rho.detach(), valid, log_z[:, 0].detach(), k, log_rho is None)
        has_tail = bool(torch.isfinite(log_z[:, 0]).any())
        # FFT products are accurate to ~1e-16 absolute only. That suffices when the block surely
        # fills up (the values of F_{-a} that matter are then not tiny); with few items present,
        # F_{-a} can be tiny where it matters and direct products are used.
        mu_lo = float(_chernoff_levels(k, _log_eps(s.dtype))[k, 0])
        fft = log_rho is None or bool((rho.sum(1) >= mu_lo).all())
    s_a = s if targets is None else s.gather(1, targets)
    chunk = max(_gl_points(s.dtype), _CHUNK_ELEMENTS // (s.shape[0] * s.shape[1] * min(k, s.shape[1])))
    terms = [_log_survival(s_a, g_hi.unsqueeze(1))]  # above g_hi, F_{-a} = 1: finite, so no NaN gradient
    for i in range(0, g.shape[1], chunk):
        g_c = g[:, i:i + chunk]
        log_mass = log_w[:, i:i + chunk].unsqueeze(2) + _log_density(s_a, g_c)  # [B, Q, A]
        terms.append(log_mass + _log_cdf(s, rho, log_z, k, targets, g_c, has_tail, fft))
    return torch.logsumexp(torch.cat(terms, dim=1), dim=1)


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


def exact_log_inclusion(summary: HeadTail, runs: Sequence[tuple[int, int]]) -> Tensor:
    """``log P(target ∈ the K PL(-MoE) draws)`` → ``[B, L]``.

    ``summary`` holds ``head_scores [B, M, T]`` (−inf in unused slots), ``target_pos [B, L]`` and
    ``tail_log_power_sums [B, M, P]``; ``runs`` is the position → expert map as ``[(expert,
    count), ...]`` summing to K. One run is exact up to quadrature (and the tail's power-series
    truncation); several runs use the block-exact approximation.
    """
    scores, tail, targets = summary.head_scores, summary.tail_log_power_sums, summary.target_pos
    if scores.dim() != 3 or tail.dim() != 3 or tail.shape[:2] != scores.shape[:2]:
        raise ValueError(f"summary must have head_scores [B, M, T] and tail_log_power_sums [B, M, P], got "
                         f"{tuple(scores.shape)} and {tuple(tail.shape)}")
    if targets.dim() != 2 or targets.shape[0] != scores.shape[0]:
        raise ValueError(f"summary.target_pos must be [B={scores.shape[0]}, L], got {tuple(targets.shape)}")
    runs = _check_runs(runs, scores.shape[1])
    valid = torch.isfinite(scores[:, 0])  # [B, T]
    num_candidates = sum(count for _, count in runs)
    # Every item is drawn when the catalog has no more than K items.
    full = torch.isinf(tail[:, 0, 0]) & (valid.sum(1) <= num_candidates)  # [B]
    log_survival: Tensor | None = None
    terms = []
    for i, (expert, count) in enumerate(runs):
        last = i == len(runs) - 1
        # Few targets: each one's leave-one-out count directly; many: every slot's at once.
        direct = last and targets.shape[1] ** 2 <= scores.shape[2]
        log_h = _block_log_hazard(scores[:, expert], log_survival, valid, tail[:, expert], count,
                                  targets if direct else None)
        if last and not direct:
            log_h = log_h.gather(1, targets)
        if last:
            terms.append(log_h if log_survival is None else log_h + log_survival.gather(1, targets))
        else:
            before = torch.zeros_like(log_h) if log_survival is None else log_survival
            terms.append((log_h + before).gather(1, targets))
            # h is clamped below 1 so that log(1 - h) and its gradient stay finite.
            log_survival = before + log1mexp(log_h.clamp(max=-torch.finfo(log_h.dtype).eps))
    log_pi = torch.logsumexp(torch.stack(terms), dim=0).clamp(max=0.0)  # quadrature rounding
    return torch.where(full.unsqueeze(1), torch.zeros_like(log_pi), log_pi)
