"""Rosén's mean-field (successive-sampling) inclusion probabilities of the PL(-MoE) ESR (private).

Block r of the draw (expert m_r, n_r positions) is treated as independent Bernoulli draws: item b is
taken with probability ``ρ_b (1 - exp(-e^{s_b - κ_r}))``, where ``ρ_b`` is the chance that b survived
the earlier blocks and κ_r solves ``f(κ) = Σ_b ρ_b (1 - exp(-e^{s_b - κ})) = n_r``; an item's
inclusion probability is ``1 - exp(-Σ_r e^{s_{m_r}(b) - κ_r})``.

Everything is computed relative to each expert's best score (shift invariant by construction:
only differences of scores are ever formed), and κ is found per row by

1. Newton's method in ``t = e^{-κ}`` (f is concave in t) from one step on the series
   ``Σ ρ (x - x²/2 + x³/6)`` past the sampling-with-replacement solution ``logsumexp(s) - log n``,
   both below the root in t, on ``[B, T]`` buffers updated in place (one ``expm1`` per step; one
   step for typical scores; saturated items too, their ``x e^{-x}`` then from one exact pass);
   then, for rows where that arithmetic underflows (score gaps of hundreds) or has not converged,
2. a safeguarded solve on sums taken in log-space: Newton on ``log(n - Σ_sat ρ g) - log Σ_rest ρ g``
   (or on the logs of minus those logs, when both are tiny) inside a shrinking bracket, with
   bisection in ``asinh κ`` when Newton leaves the bracket or stalls.

Under ``torch.compile``, which cannot select rows, every row takes both, each a ``torch.while_loop`` that stops once
all rows are done.

κ is an implicit function of the scores; its derivative ``∂κ/∂s_b = ρ_b x_b e^{-x_b} / Σ_c ρ_c x_c
e^{-x_c}`` (``x = e^{s - κ}``) comes out of the solve, and is recomputed in differentiable
operations when a second derivative is asked for, so Hessians are exact too.

A dense logits tensor, or any catalog of at most 2048 items, is used whole. Larger catalogs are
summarised (:mod:`capg_rec._head_tail`): every expert's best items one by one, the rest through
three power sums (a series that is accurate because each tail item's chance within a block stays
below 1/8).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from capg_rec._checks import check_count, is_number
from capg_rec._head_tail import WHOLE_UP_TO, read_whole, summarize
from capg_rec._numerics import Runs, bound_once, exp_, expm1, expm1_, safe_logsumexp
from capg_rec.catalog import CatalogScores, DenseCatalog, every_score

__all__ = ["mean_field_log_inclusion"]


_MAX_ITER = 50
_FAST_ITER = 12  # Newton steps in t before the log-space solve takes over
_TAIL_COEF = (1.0, -0.5, 1.0 / 6.0)  # 1 - e^{-x} = x - x²/2 + x³/6 - …: the tail's power sums
_OMEGA = 0.5671432904097838  # ω e^ω = 1 (the omega constant)
_SATURATION = 40.0  # below κ = min(s) - 40 every item's clock has rung: 1 - exp(-e^{40}) = 1


def mean_field_log_inclusion(catalog: CatalogScores, items: Tensor, runs: Runs, *, max_iter: int = _MAX_ITER,
                             tol: float | None = None) -> Tensor:
    """``log π(b ∈ A^K)`` under Rosén's mean-field approximation for ``items [B, L]`` → ``[B, L]``.

    ``runs`` are the expert blocks ``((expert, count), ...)`` (:func:`~capg_rec.plackett_luce.expert_runs`),
    with ``K = Σ count`` below the number of items; ``items`` may repeat within a row. Scores of
    ``-inf`` are items outside a row's catalog (per expert); a target that is ``-inf`` under every
    expert gets ``-inf`` with zero gradient.

    ``max_iter`` bounds the root-solver steps of each block: typical scores take one or two,
    score gaps in the hundreds up to about 25 (under ``torch.compile`` too: each stage's loop stops once
    every row is done). ``tol`` is the relative accuracy of the rates ``e^{s - κ}`` at which the solve
    stops (default ``eps^(2/3)`` of the dtype; the derivatives get about the same).
    """
    max_iter = check_count("max_iter", max_iter)
    if tol is not None and not is_number(tol):
        raise TypeError(f"tol must be a float or None, got {type(tol).__name__}")
    if tol is not None and not 0 < tol < 1:
        raise ValueError(f"tol must be in (0, 1), got {tol}")
    tol = None if tol is None else float(tol)
    if items.shape[0] == 0 and isinstance(catalog, DenseCatalog):  # other catalogs may be collective: run them
        return catalog.gather(items)[:, 0] * 0.0
    if len(runs) == 1 and runs[0][1] == 1:  # one draw: its inclusion probability is the softmax itself, exactly
        (expert, _), = runs                  # (Rosén's equation would give 1 - exp(-e^{s - κ}), off by up to 10%)
        if read_whole(catalog):  # a small catalog that estimates its sums, or cheap to score whole: as for any K
            catalog = DenseCatalog(every_score(catalog), validate_args=False)
        return catalog.log_softmax(items)[:, expert]
    head = _head_size(catalog.num_items, runs)
    if catalog._best_items(head) < head < catalog.num_items:  # a head read through top_items, not the whole catalog
        warnings.warn(f"mean-field reads each expert's best {head} items one by one (8·n + K - n for the largest "
                      f"block n), but this catalog names only its best {catalog.exact_top} exactly: its inclusion "
                      "probabilities are biased (on a SampledCatalog, raise head_size with an index)", stacklevel=2)
    dense = isinstance(catalog, DenseCatalog) or head >= catalog.num_items
    tails = lowers = targets = log_tail_counts = None
    if isinstance(catalog, DenseCatalog):
        scores = catalog.scores  # [B, M, N]: the whole catalog is the head
    elif dense:
        scores = every_score(catalog)
    else:
        scores, tails, lowers, log_tail_counts = _summary(catalog, runs, head)
        targets = catalog.gather(items)  # [B, M, L]
    top = scores.detach().amax(dim=2).clamp(min=torch.finfo(scores.dtype).min)  # [B, M]: the reference
    # One view per expert; unbind's backward stacks their gradients into one [B, M, T] tensor.
    rows = (scores.squeeze(1),) if scores.shape[1] == 1 else scores.unbind(1)
    log_rho: Tensor | None = None
    tail_log_rho = top.new_zeros(top.shape[0])  # [B]: the tail's survival, log (see _summary)
    hazards = []
    for block, (expert, count) in enumerate(runs):
        s, ref = rows[expert], top[:, expert]
        tail = lower = None
        survive = block < len(runs) - 1  # later blocks need the survival after this one
        if tails is not None:
            powers = torch.arange(1, tails.shape[2] + 1, dtype=top.dtype, device=top.device)
            tail = tails[:, expert] - powers * ref.unsqueeze(1) + tail_log_rho.unsqueeze(1)
            lower = lowers[:, expert] - ref
        kappa, hazard, log_rho = _Root.apply(s, ref, log_rho, tail, lower, items if dense else None, count,
                                             survive, max_iter, tol)[:3]
        if not dense:
            hazard = (targets[:, expert] - ref.unsqueeze(1)) - kappa.unsqueeze(1)
            if survive:  # less the tail items' mean rate in this block: e^{log Σ_tail e^s - κ} / (tail items)
                mean_rate = torch.exp((tails[:, expert, 0] - ref - kappa - log_tail_counts[:, expert]).clamp(
                    max=_log_max(top.dtype)))
                tail_log_rho = tail_log_rho - mean_rate
        hazards.append(hazard)  # [B, L]: log of the target's rate e^{s - κ}
    return _LogHit.apply(hazards[0] if len(hazards) == 1 else safe_logsumexp(torch.stack(hazards, dim=2), dim=2))


def _head_size(num_items: int, runs: Runs) -> int:
    """Items per expert kept one by one: the whole catalog up to 2048 items, else the best
    ``8·n + (K - n)`` (n: the largest block), so that after any earlier blocks took their items a
    tail item's chance within its block stays below 1/8."""
    if num_items <= WHOLE_UP_TO:
        return num_items
    num_candidates = sum(n for _, n in runs)
    block = max(n for _, n in runs)
    return min(num_items, 8 * block + num_candidates - block)


def _summary(catalog: CatalogScores, runs: Runs, head: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Head scores ``[B, M, T]`` (−inf in unused slots; the union of every expert's best ``head``
    items), tail log power sums ``[B, M, 3]``, the lowest κ ``[B, M]`` at which the tail series
    stays accurate, and the log number of (unmasked) tail items ``[B, M]``.

    The tail items are not followed one by one through the blocks: their survival ρ is taken as the same
    for all of them, ``exp(-Σ_{earlier blocks} mean rate)``, exact when the tail's scores are equal
    (a tail item's rates stay below 1/8 per block, see :func:`_head_size`). Without it, every block took
    the tail whole and the probabilities summed to less than K (196.5 for K = 200 of 3,000 equal scores
    under three experts)."""
    num_candidates = sum(n for _, n in runs)
    block = max(n for _, n in runs)
    empty = torch.zeros(catalog.batch_size, 0, dtype=torch.long, device=catalog.device)
    ht = summarize(catalog, empty, head, len(_TAIL_COEF))
    # Below this κ even the expert's head-th item would be likely enough that the head alone
    # holds n items: the root is above it, and tail items keep a chance below n / head there.
    drawn = num_candidates - block
    share = block / max(head - drawn, block)
    lower = ht.head_floor - math.log(-math.log1p(-share)) if share < 1 else ht.head_floor - _SATURATION
    with torch.no_grad():
        in_tail = catalog.num_available() - (ht.head_scores > -math.inf).sum(2)
        log_tail_counts = torch.log(in_tail.clamp(min=1).to(ht.head_scores.dtype))
    return ht.head_scores, ht.tail_log_power_sums, lower, log_tail_counts


@bound_once
class _LogHit(torch.autograd.Function):
    """``log(1 - exp(-e^y))`` elementwise (the log-probability that a clock of rate ``e^y`` has rung),
    accurate on the whole line; ``y = -inf`` gives ``-inf`` with zero gradient."""

    generate_vmap_rule = True

    @staticmethod
    def forward(y: Tensor) -> Tensor:
        x = torch.exp(y.clamp(max=30.0))  # beyond 30 the value is 0
        near = torch.log(-expm1(-x))  # x ≤ log 2 (Maechler's two branches of log(1 - e^{-x}))
        far = torch.log1p(-torch.exp(-x))
        out = torch.where(x <= math.log(2.0), near, far)
        return torch.where(y < -10.0, y - 0.5 * x, out)  # x (1 - x/2 + …): exact where x underflows

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        # d/dy = x / (e^x - 1), 1 where x underflows; zero at y = -inf (an item outside the catalog). Written as
        # x e^{-x} / (1 - e^{-x}): e^x - 1 overflows beyond x ~ 89 (710 in float64), and a recorded backward's
        # derivative of the quotient was then 0·inf - inf/inf = NaN (a nearly certain target's Hessian).
        x = torch.exp(y.clamp(max=30.0))
        some = x > torch.finfo(y.dtype).tiny
        safe = torch.where(some, x, torch.ones_like(x))
        slope = torch.where(some, safe * torch.exp(-safe) / -expm1(-safe), (y > -math.inf).to(y.dtype))
        return grad * slope


def _log_max(dtype: torch.dtype) -> float:
    """Largest argument of ``exp`` with a finite result, less a margin."""
    return math.log(torch.finfo(dtype).max) - 1.0


@bound_once
class _Root(torch.autograd.Function):
    """One block: κ as an implicit function of the block's scores ``s [B, T]`` (relative to
    ``top [B]``, a constant), ``log ρ [B, T]`` and the tail's relative log power sums ``[B, P]``
    (both optional); the targets' hazard logits ``s[index] - top - κ`` ``[B, L]`` (``[B, 0]``
    without ``index``); and, if ``survive``, the log-survival after the block
    ``log ρ - e^{s - top - κ}`` ``[B, T]`` (else ``[B, 0]``). Also outputs, without gradient, the
    derivatives of κ as ``(∂κ/∂s, ∂κ/∂log ρ, ∂κ/∂tail) = scale [B] × (terms [B, T], [B, T], [B, P])``
    (the division left to the backward, which multiplies anyway).

    The backward takes the rates ``e^{s - top - κ}`` of the survival's derivative as
    ``log ρ - log ρ'``: where that difference loses digits, ρ' (which scales every later gradient)
    is smaller still, so the error stays at the rounding level of the gradient."""

    @staticmethod
    def forward(s, top, log_rho, tail, lower, index, count, survive, max_iter, tol):
        with torch.no_grad():
            kappa, share_s, share_rho, share_tail, scale, neg_rate = _solve(
                s, top, log_rho, tail, lower, count, survive, max_iter, tol)
            hazard = s[:, :0] if index is None else (s.gather(1, index) - top.unsqueeze(1)) - kappa.unsqueeze(1)
            after = s[:, :0] if not survive else neg_rate if log_rho is None else neg_rate.add_(log_rho)
            return kappa, hazard, after, share_s, share_rho, share_tail, scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        s, top, log_rho, tail, _, index, _, survive = inputs[:8]
        kappa, _, after, share_s, share_rho, share_tail, scale = output
        ctx.mark_non_differentiable(share_s, share_rho, share_tail, scale)
        ctx.set_materialize_grads(False)
        ctx.flags = (log_rho is not None, tail is not None, index is not None, survive)
        ctx.save_for_backward(s, top, log_rho, tail, index, kappa, share_s, share_rho, share_tail, scale, after)

    @staticmethod
    def backward(ctx, grad_kappa, grad_hazard, grad_after, *_):
        s, top, log_rho, tail, index, kappa, share_s, share_rho, share_tail, scale, after = ctx.saved_tensors
        has_rho, has_tail, has_index, survive = ctx.flags
        total = torch.zeros_like(kappa) if grad_kappa is None else grad_kappa
        if has_index and grad_hazard is not None:
            total = total - grad_hazard.sum(dim=1)
        chain = survive and grad_after is not None  # log ρ' = log ρ - x: ∂/∂s = -x, ∂/∂κ = x
        if torch.is_grad_enabled():  # a double backward: everything as functions of the inputs
            d = s - top.unsqueeze(1)
            share_s, share_rho, share_tail = _shares(d, log_rho, tail, kappa)
            scale = torch.ones_like(scale)
            if chain:
                neg_rate = -torch.exp((d - kappa.unsqueeze(1)).clamp(max=_log_max(d.dtype)))
        elif chain:
            # -x; where ρ' = 0 (log ρ' = -inf: log ρ was, or log ρ - x overflowed) that difference is
            # NaN or -inf, and the later blocks send no gradient back (0 × -inf would make a NaN)
            neg_rate = after if log_rho is None else torch.nan_to_num(after - log_rho, nan=0.0,
                                                                      neginf=torch.finfo(s.dtype).min)
        # Through the survival, derivatives can exceed the floating-point range (mixtures with
        # score gaps of 1e20 and more); they are kept finite, so that no inf - inf makes a NaN.
        limit = torch.finfo(s.dtype).max / (4 * max(s.shape[1], 1))
        if chain:
            chained = (neg_rate * grad_after).clamp_(min=-limit, max=limit)
            total = total - chained.sum(dim=1)
        g = (total * scale).clamp(min=-limit, max=limit).unsqueeze(1)
        grad_s = torch.addcmul(chained, g, share_s) if chain else g * share_s
        if has_index and grad_hazard is not None:
            grad_s = (grad_s.scatter_add(1, index, grad_hazard) if torch.is_grad_enabled()
                      else grad_s.scatter_add_(1, index, grad_hazard))
        grad_rho = None
        if has_rho:
            grad_rho = torch.addcmul(grad_after, g, share_rho) if chain else g * share_rho
            grad_rho.clamp_(min=-limit, max=limit)
        return (grad_s, None, grad_rho, g * share_tail if has_tail else None, None, None, None, None, None, None)

    @staticmethod
    def vmap(info, in_dims, s, top, log_rho, tail, lower, index, count, survive, max_iter, tol):
        """Fold the mapped dimension into the rows: every row is solved independently."""
        size = info.batch_size

        def rows(x: Tensor | None, dim: int | None) -> Tensor | None:
            if x is None:
                return None
            x = x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
            return x.reshape(size * x.shape[1], *x.shape[2:])

        args = [rows(x, dim) for x, dim in zip((s, top, log_rho, tail, lower, index), in_dims[:6])]
        out = _Root.apply(*args, count, survive, max_iter, tol)
        return tuple(o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in out), (0,) * len(out)


def _shares(d: Tensor, log_rho: Tensor | None, tail: Tensor | None, kappa: Tensor
            ) -> tuple[Tensor, Tensor, Tensor]:
    """``∂κ/∂d``, ``∂κ/∂log ρ``, ``∂κ/∂tail`` at κ in plain differentiable operations (the double
    backward's; the solve computes them more robustly)."""
    y = (d - kappa.unsqueeze(1)).clamp(max=_log_max(d.dtype))
    x = torch.exp(y)
    dens = torch.exp(y - x)  # x e^{-x}: ∂f/∂d per unit ρ
    hit = -expm1(-x)  # 1 - e^{-x}: ∂f/∂log ρ per unit ρ
    if log_rho is not None:
        rho = torch.exp(log_rho)
        dens, hit = rho * dens, rho * hit
    slope = dens.sum(dim=1)
    tail_terms = torch.zeros_like(d[:, :0])
    if tail is not None:
        coef, powers = _tail_coefficients(tail)
        tail_terms = coef * torch.exp((tail - powers * kappa.unsqueeze(1)).clamp(max=_log_max(d.dtype)))
        slope = slope + (powers * tail_terms).sum(dim=1)
    inv = 1.0 / slope.clamp(min=torch.finfo(d.dtype).tiny).unsqueeze(1)
    return dens * inv, hit * inv if log_rho is not None else hit[:, :0], tail_terms * inv


def _tail_coefficients(tail: Tensor) -> tuple[Tensor, Tensor]:
    """The series' coefficients ``(-1)^{p+1}/p!`` and powers p as ``[P]`` tensors."""
    num = tail.shape[1]
    coef = torch.tensor(_TAIL_COEF[:num], dtype=tail.dtype, device=tail.device)
    return coef, torch.arange(1, num + 1, dtype=tail.dtype, device=tail.device)


def _width(kappa: Tensor, tol: float) -> Tensor:
    """Step size below which κ counts as converged: ``tol`` (the rates ``e^{d - κ}`` then move by a
    relative ``tol``), or a few of κ's own rounding steps when those are coarser."""
    return (4 * torch.finfo(kappa.dtype).eps * kappa.abs()).clamp(min=tol)


def _solve(s: Tensor, top: Tensor, log_rho: Tensor | None, tail: Tensor | None, lower: Tensor | None,
           count: int, survive: bool, max_iter: int, tol: float | None
           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """κ ``[B]`` (relative to ``top``), the derivatives of κ (see :class:`_Root`) and the rates at κ,
    negated, ``-e^{s - top - κ}`` (``[B, 0]`` unless ``survive``), without autograd."""
    finfo = torch.finfo(s.dtype)
    tol = finfo.eps ** (2.0 / 3.0) if tol is None else tol
    rho = None if log_rho is None else exp_(log_rho.clone())
    compiling = torch.compiler.is_compiling()
    # Eager: each phase stops once converged, the log-space solve for the rows the fast one leaves. Compiled (a graph
    # selects no rows): each phase is a while_loop that stops once every row is done, and every row takes both.
    fast_iter = min(max_iter - 1 if compiling else max_iter, _FAST_ITER)
    if not fast_iter:
        kappa = torch.full_like(top, math.nan)  # the log-space solve starts from its own bound
    elif compiling:
        kappa = _FastSolve(s, top, rho, tail, lower, count).converge(fast_iter, tol)
    else:
        fast = _FastSolve(s, top, rho, tail, lower, count)
        kappa, done = fast.run(fast_iter, tol)
        all_done, some_done, large = torch.stack((done.all(), done.any(), (fast.large & done).any())).tolist()
        if all_done:
            return fast.finish(kappa, survive, large)
        if some_done:  # the log-space solve on the rows left alone (first: finish spends ρ's buffer)
            rows = (~done).nonzero().squeeze(1)
            part = [None if x is None else x.index_select(0, rows) for x in (s, top, rho, log_rho, tail, lower)]
            left = _robust_solve(*part, count, kappa.index_select(0, rows), max_iter, tol, False, survive)
            return tuple(o.index_copy_(0, rows, p) for o, p in zip(fast.finish(kappa, survive, large), left))
    return _robust_solve(s, top, rho, log_rho, tail, lower, count, kappa,
                         max_iter - fast_iter if compiling else max_iter, tol, compiling, survive)


def _robust_solve(s: Tensor, top: Tensor, rho: Tensor | None, log_rho: Tensor | None, tail: Tensor | None,
                  lower: Tensor | None, count: int, kappa: Tensor, iters: int, tol: float, compiling: bool,
                  survive: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`_solve`'s outputs from :class:`_RobustSolve` started at ``kappa`` (NaN: its own bound)."""
    d = s - top.unsqueeze(1)  # relative scores, max 0
    kappa, *shares = _RobustSolve(d, rho, log_rho, tail, lower, count).run(kappa, iters, tol, compiling)
    neg_rate = -torch.exp((d - kappa.unsqueeze(1)).clamp(max=_log_max(d.dtype))) if survive else s[:, :0]
    return kappa, *shares, torch.ones_like(kappa), neg_rate


class _FastSolve:
    """Newton's method in ``t = e^{-κ}`` on linear-space sums, in place on ``[B, T]`` buffers: one
    ``expm1`` per iteration, the rates ``x = e^{d - κ}`` updated by a multiplication.

    It starts one Newton step on the series ``Σ ρ (x - x²/2 + x³/6) = n`` past the
    sampling-with-replacement solution (the series bounds f from above and is concave there, so
    the start stays on the near side of the root), which is within a few 1e-4 of the root for
    typical scores: one evaluation then suffices, and the derivatives of κ are moved to the last
    Newton step to first order."""

    def __init__(self, s: Tensor, top: Tensor, rho: Tensor | None, tail: Tensor | None, lower: Tensor | None,
                 count: int) -> None:
        self.s, self.top, self.rho, self.tail, self.lower, self.count = s, top, rho, tail, lower, count
        self.finfo = finfo = torch.finfo(s.dtype)
        rate = exp_(s - top.unsqueeze(1))  # e^d ≤ 1, with max 1 unless the row is empty
        self.em1 = torch.empty_like(rate)
        mass = rate.sum(dim=1) if rho is None else torch.mul(rho, rate, out=self.em1).sum(dim=1)  # Σ ρ e^d
        if tail is not None:
            mass = mass + torch.exp(tail[:, 0].clamp(max=_log_max(s.dtype)))
        self.empty = mass <= 0  # no item (left): nothing to solve
        self.alive = (~self.empty).to(s.dtype)
        # Where ρ e^d underflowed (or is 0) everywhere this start is not trusted: the log-space
        # solve takes over.
        self.suspect = mass < finfo.tiny / finfo.eps if rho is not None else None
        mass = mass.clamp(min=finfo.tiny)
        self.swr_kappa = (torch.log(mass) - math.log(count)) * self.alive  # f ≤ n here; 0 for an empty row
        self.neg_rate = rate.mul_((self.alive * -count / mass).unsqueeze(1))  # -x at the start
        if rho is not None:  # Σ ρ e^d may be tiny (else it is at least e^0 = 1: x ≤ n)
            self.neg_rate.clamp_(min=-1e30)

    def _tail_terms(self, kappa: Tensor) -> tuple[Tensor, Tensor]:
        """The tail's series terms ``c_p e^{log Z_p - pκ}`` ``[B, P]`` and the powers p."""
        coef, powers = _tail_coefficients(self.tail)
        return coef * torch.exp((self.tail - powers * kappa.unsqueeze(1)).clamp(max=_log_max(kappa.dtype))), powers

    def _series_start(self) -> Tensor:
        """``v ≥ 1``: one Newton step on ``Σ ρ (x v - x² v²/2 + x³ v³/6) = n`` from v = 1 (the SwR
        rates x), kept where the series is concave, so that ``t v`` is still below the root."""
        neg_rate, buf = self.neg_rate, self.em1
        torch.mul(neg_rate, neg_rate, out=buf)
        if self.rho is not None:
            buf.mul_(self.rho)
        m2 = buf.sum(dim=1)  # Σ ρ x²
        m3 = -buf.mul_(neg_rate).sum(dim=1)  # Σ ρ x³
        if self.tail is not None:
            terms, _ = self._tail_terms(self.swr_kappa)
            m2, m3 = m2 - 2.0 * terms[:, 1], m3 + 6.0 * terms[:, 2]
        # Σ ρ x = n (tail included: the start's definition; 0 in an empty row, where m2 = m3 = 0)
        deficit = torch.sub(m2, m3, alpha=1.0 / 3.0).mul_(0.5)  # n - series = m2/2 - m3/6
        slope = torch.add(m3, m2, alpha=-2.0).mul_(0.5).add_(self.count * self.alive)  # n - m2 + m3/2
        step = deficit.div_(slope.clamp_(min=self.finfo.tiny))
        return torch.minimum(step.add_(1.0), m2.div_(m3.clamp(min=self.finfo.tiny))).clamp_(min=1.0)

    def start(self) -> Tensor:
        """κ where the steps start (see :meth:`_series_start`); the rates are moved there."""
        v = self._series_start()
        self.neg_rate.mul_(v.unsqueeze(1))
        return self.swr_kappa - torch.log(v)

    def _newton(self, kappa: Tensor, neg_rate: Tensor, em1: Tensor, dens: Tensor, tol: float
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """One Newton step from κ, whose rates, negated, are ``neg_rate`` (``em1`` and ``dens`` are written, and may
        be one buffer without ρ) → the next κ, ``r = t_next / t - 1``, whether converged, ∂f/∂κ, the tail's terms."""
        rho, finfo = self.rho, self.finfo
        expm1_(neg_rate, em1)  # -(1 - e^{-x})
        if rho is None:
            neg_hit = em1.sum(dim=1)
            torch.addcmul(neg_rate, neg_rate, em1, out=dens)  # -x e^{-x}
        else:
            neg_hit = torch.mul(rho, em1, out=dens).sum(dim=1)
            torch.addcmul(neg_rate, neg_rate, em1, out=dens).mul_(rho)  # -ρ x e^{-x}
        neg_slope = dens.sum(dim=1)  # ∂f/∂κ
        tail_terms = None
        if self.tail is not None:
            tail_terms, powers = self._tail_terms(kappa)
            neg_hit = neg_hit - tail_terms.sum(dim=1)
            neg_slope = neg_slope - (powers * tail_terms).sum(dim=1)
        # r = t_new / t - 1 = (n - f) / -∂f/∂κ; empty rows stay where they are
        ratio = (neg_hit + self.count).mul_(-self.alive).div_(neg_slope.clamp(max=-finfo.tiny))
        ratio = ratio.clamp_(min=-0.5, max=1e6)
        nxt = kappa - torch.log1p(ratio)
        if self.lower is not None:
            nxt = torch.maximum(nxt, self.lower)
            ratio = expm1(kappa - nxt)
        # The error of the corrected derivatives is about (r x)² where they matter (x ≲ 3).
        converged = 3.0 * ratio.abs() <= math.sqrt(tol) + 4 * finfo.eps * nxt.abs()
        return nxt, ratio, converged, neg_slope, tail_terms

    def converge(self, iters: int, tol: float) -> Tensor:
        """:meth:`run`'s κ under ``torch.compile``: its steps in a while_loop that stops once every row has
        converged (a Python loop would be unrolled into all of them); no derivatives."""
        def body(it: Tensor, kappa: Tensor, neg_rate: Tensor, _: Tensor) -> tuple[Tensor, ...]:
            nxt, ratio, converged, _, _ = self._newton(kappa, neg_rate, torch.empty_like(neg_rate),
                                                       torch.empty_like(neg_rate), tol)
            return it + 1, nxt, (neg_rate * (1.0 + ratio).unsqueeze(1)).clamp(min=-1e30), converged  # x ∝ t

        kappa = self.start()
        state = (torch.zeros((), dtype=torch.int64, device=kappa.device), kappa, self.neg_rate.clone(),
                 torch.zeros_like(kappa, dtype=torch.bool))
        return torch.while_loop(lambda it, kappa, rates, converged: (it < iters) & ~converged.all(), body, state)[1]

    def run(self, iters: int, tol: float) -> tuple[Tensor, Tensor]:
        """Iterate from :meth:`start` → κ and which rows are done: converged, with accurate sums."""
        neg_rate, finfo, em1 = self.neg_rate, self.finfo, self.em1
        self.dens = dens = em1 if self.rho is None else torch.empty_like(neg_rate)
        kappa = self.start()
        for it in range(iters):
            nxt, ratio, converged, neg_slope, self.tail_terms = self._newton(kappa, neg_rate, em1, dens, tol)
            kappa_eval, kappa = kappa, nxt
            if it == iters - 1 or bool(converged.all()):
                break
            neg_rate.mul_((1.0 + ratio).unsqueeze(1)).clamp_(min=-1e30)  # x ∝ t
        # A slope far above underflow. Rates beyond ``cap`` are fine for f (1 - e^{-x} is
        # -expm1(-x)), but 1 + expm1(-x) keeps no digits of their x e^{-x}: where any row has
        # one (the largest rate is that of the expert's best item, d = 0), :meth:`finish` takes
        # the derivatives from an exact pass.
        cap = 12.0 if finfo.bits <= 32 else 30.0
        done = self.empty | (converged & (neg_slope <= -1e-3))
        if self.suspect is not None:
            done = done & ~self.suspect
        self.large = kappa_eval < -math.log(cap)
        self.last = (ratio, kappa - kappa_eval, neg_slope)
        return kappa, done

    def finish(self, kappa: Tensor, survive: bool, exact: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The derivatives of κ (see :class:`_Root`) and the rates at κ, negated (``[B, 0]`` unless
        ``survive``), in place: the solver and ρ are spent.

        The summands of ∂f/∂d and ∂f/∂log ρ move from the last evaluation to κ after its Newton
        step (rates times ``1 + r``) to first order: ``x e^{-x}`` gains ``(1 + r)(1 - r x)``, ``1 - e^{-x}``
        gains ``r x e^{-x}``; with ``exact`` (some rate beyond the cap of :meth:`run`), that last step
        is taken to second order and ``x e^{-x}`` is computed anew at κ instead. → κ and the above."""
        ratio, step, neg_slope = self.last
        if exact and self.tail is None:
            # Newton's error ~ r² Q / S grows with the rates: the last step to second order instead,
            # f + S r - Q r²/2 = n (S = Σ ρ x e^{-x}, Q = Σ ρ x² e^{-x} at the last evaluation)
            kappa = kappa - step
            second = torch.linalg.vecdot(self.dens, self.neg_rate) / (2.0 * neg_slope.clamp(max=-self.finfo.tiny))
            ratio = ratio / (1.0 + ratio * second)
            kappa = kappa - torch.log1p(ratio)
        r = ratio.unsqueeze(1)
        if self.rho is not None:  # ρ (1 - e^{-x}) → ρ (1 - e^{-x}) + r ρ x e^{-x}, negated
            self.em1.mul_(self.rho).addcmul_(self.dens, r)
        if exact:  # -ρ x e^{-x} = -ρ e^{d - κ - x} at κ, one exp pass: accurate at any rate
            self.neg_rate.addcmul_(self.neg_rate, r)
            dens = torch.sub(self.s, self.top.unsqueeze(1), out=self.dens).sub_(kappa.unsqueeze(1))
            exp_(dens.add_(self.neg_rate))
            self.dens = dens.mul_(self.rho).neg_() if self.rho is not None else dens.neg_()
        elif survive:  # ρ is spent: its buffer holds the rates' increments
            moved = torch.mul(self.neg_rate, r, out=self.rho) if self.rho is not None else self.neg_rate * r
            self.dens.addcmul_(self.dens, moved)
            self.neg_rate.add_(moved)
        else:
            self.dens.addcmul_(self.dens, self.neg_rate.mul_(r))
        if not exact and (self.rho is not None or self.tail is not None):
            # x e^{-x} at rates x(1 + r) also gains the factor 1 + r. Where x e^{-x} are the only terms of
            # ∂f/∂κ it cancels in the derivatives; next to ∂f/∂log ρ or the tail's terms it does not.
            self.dens.mul_(1.0 + r)
        neg_slope = self.dens.sum(dim=1)
        if self.tail is not None:
            _, powers = _tail_coefficients(self.tail)
            self.tail_terms = self.tail_terms * torch.exp(powers * -step.unsqueeze(1))
            neg_slope = neg_slope - (powers * self.tail_terms).sum(dim=1)
        # The terms of ∂f/∂d, ∂f/∂log ρ and ∂f/∂tail, negated, times 1 / ∂f/∂κ: the derivatives of κ.
        scale = 1.0 / neg_slope.clamp(max=-self.finfo.tiny)
        share_rho = self.em1[:, :0] if self.rho is None else self.em1
        share_tail = self.dens[:, :0] if self.tail is None else -self.tail_terms
        return kappa, self.dens, share_rho, share_tail, scale, self.neg_rate if survive else self.dens[:, :0]


class _RobustSolve:
    """A bracketed solve on sums taken in log-space, for rows whose linear-space sums under- or
    overflow. Items are split at ``x = ω`` (``x e^x = 1``) into "saturated" ones, whose chance to be
    missed ``e^{-x}`` is the small number, and the rest, whose chance to be hit ``1 - e^{-x}`` is;
    then ``n - f = (n - S) + P - Q`` with ``S = Σ_sat ρ``, ``P = Σ_sat ρ e^{-x}``,
    ``Q = Σ_rest ρ (1 - e^{-x})``, each of P and Q summed relative to its own largest term."""

    def __init__(self, d: Tensor, rho: Tensor | None, log_rho: Tensor | None, tail: Tensor | None,
                 lower: Tensor | None, count: int) -> None:
        self.d, self.rho, self.log_rho, self.tail, self.count = d, rho, log_rho, tail, count
        self.finfo = torch.finfo(d.dtype)
        finite = torch.isfinite(d)
        present = finite.to(d.dtype)
        avail = present.sum(dim=1) if rho is None else torch.linalg.vecdot(rho, present)
        lowest = torch.where(finite, d, torch.zeros_like(d)).amin(dim=1)
        self.lo = (lowest - _SATURATION).clamp(min=self.finfo.min / 4)  # f(lo) = every available item
        if lower is not None:
            self.lo = torch.maximum(self.lo, lower)
        # The sampling-with-replacement solution is above the root (f ≤ Σ ρ x = n there).
        log_mass = torch.logsumexp(d if log_rho is None else d + log_rho, dim=1)
        if tail is not None:
            log_mass = torch.logaddexp(log_mass, tail[:, 0])
        self.hi = torch.maximum(torch.nan_to_num(log_mass - math.log(count), neginf=0.0), self.lo)
        # Fewer than n items can still be drawn (no root): all of them are certain.
        self.no_root = (avail <= count * (1.0 + 4 * self.finfo.eps) if tail is None
                        else torch.zeros_like(finite[:, 0]))

    def run(self, kappa: Tensor, iters: int, tol: float, compiling: bool
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Iterate from ``kappa`` → κ and its derivatives (see :class:`_Root`)."""
        kappa = torch.where(self.no_root | ~torch.isfinite(kappa), self.hi, kappa).clamp(min=self.lo, max=self.hi)
        kappa = torch.where(self.no_root, self.lo, kappa)
        inf = torch.full_like(kappa, math.inf)
        # (κ, the κ last evaluated, lo, hi, the last two step sizes (for the stall test), done)
        state = (kappa, kappa, self.lo, self.hi, inf, inf, self.no_root)
        if compiling:  # a while_loop stops once every row is done (a graph's Python loop would run all iters)
            def body(it: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
                nxt, evaluated, lo, hi, before, last, done = self._step(*state, tol)[0]
                return it + 1, nxt, evaluated.clone(), lo, hi, before.clone(), last, done  # no input as an output

            count = torch.zeros((), dtype=torch.int64, device=kappa.device)
            state = tuple(x.clone() for x in state)  # distinct tensors in, none of them out
            _, *state = torch.while_loop(lambda it, *state: (it < iters) & ~state[-1].all(), body, (count, *state))
            shares = self._terms(state[1])[1]  # the derivatives of κ as of the last evaluation
        else:
            for _ in range(iters):
                state, shares = self._step(*state, tol)
                if bool(state[-1].all()):
                    break
            else:
                self._warn_unsolved(state[0], state[-1], iters)
        keep = (~self.no_root).unsqueeze(1).to(kappa.dtype)
        return state[0], *(share * keep for share in shares)

    def _step(self, kappa: Tensor, _: Tensor, lo: Tensor, hi: Tensor, before: Tensor, last: Tensor, done: Tensor,
              tol: float) -> tuple[tuple[Tensor, ...], tuple[Tensor, Tensor, Tensor]]:
        """One step of :meth:`run` → its next state, and the derivatives of κ at this one's κ."""
        sums, shares = self._terms(kappa)
        width = _width(kappa, tol)
        nxt, lo, hi, close = self._next(kappa, sums, lo, hi, before, width)
        nxt = torch.where(done, kappa, nxt)
        return (nxt, kappa, lo, hi, last, (nxt - kappa).abs(), done | close | (hi - lo <= width)), shares

    def _warn_unsolved(self, kappa: Tensor, done: Tensor, iters: int) -> None:
        """Warn if, in a row the solve did not finish, the block's expected count ``f(κ)`` misses n by more than
        1e-3 relative (a row that only stalled at rounding, its count right, is not warned about)."""
        scale_p, scale_q, deficit, p, q = (t.double() for t in self._terms(kappa)[0][:5])
        miss = (deficit + p * scale_p.exp() - q * scale_q.exp()).abs() / self.count  # |n - f| / n = |A - Q| / n
        off = ~done & ~(miss <= 1e-3)  # NaN counts as off
        if bool(off.any()):
            warnings.warn(f"mean-field's root solve did not converge in max_iter={iters} steps: in {int(off.sum())} of "
                          f"{off.numel()} rows a block's expected count is off by up to {float(miss[off].max()):.2g} "
                          "of K; raise max_iter", RuntimeWarning, stacklevel=3)

    def _terms(self, kappa: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, Tensor, Tensor]]:
        """The scaled sums at κ, and the derivatives of κ that they give."""
        finfo, dtype = self.finfo, self.d.dtype
        y = (self.d - kappa.unsqueeze(1)).clamp(max=_log_max(dtype) - 8.0)  # x ≤ e^{-8} max
        x = torch.exp(y)
        arg = torch.minimum(y, -x)  # log of the small number: x (rest) or e^{-x} (saturated), per unit ρ
        if self.log_rho is not None:
            arg = arg + self.log_rho
        # x > ω ⟺ y > log ω = -ω: one comparison of y; arithmetic masks: no [B, T] where
        sat = (y > -_OMEGA).to(dtype)
        rest = 1.0 - sat
        shift = finfo.max / 4  # above any -x: masks the other group out of each maximum
        scale_p = (arg - shift * rest).amax(dim=1).clamp(min=finfo.min)  # P and Q each relative to its top
        scale_q = (arg - shift * sat).amax(dim=1)
        tail_terms = None
        if self.tail is not None:
            coef, powers = _tail_coefficients(self.tail)
            tail_log = self.tail - powers * kappa.unsqueeze(1)
            scale_q = torch.maximum(scale_q, tail_log[:, 0])
        # With no rest term (every live item saturated; the others masked) Q is 0 and its scale would be
        # the mask's: P's scale instead, so that the logs below stay comparable and nothing is absorbed.
        scale_q = torch.where(scale_q > finfo.min / 8, scale_q, scale_p)
        c = torch.exp(arg - torch.addcmul(rest * scale_q.unsqueeze(1), sat, scale_p.unsqueeze(1)))
        em1 = expm1_(x.neg())
        miss = em1 + 1.0
        hit_per_x = (finfo.tiny - em1) / (x + finfo.tiny)  # (1 - e^{-x}) / x, 1 where x underflows
        # n - S = (n - Σ_sat 1) + Σ_sat (1 - ρ): exact integers, and 1 - ρ from log ρ, which keeps the chance that an
        # earlier block took the item where ρ rounds to 1 (the rest of the saturated items' mass may be all there is)
        deficit = self.count - sat.sum(dim=1)
        if self.log_rho is not None:
            deficit = deficit + torch.linalg.vecdot(-expm1(self.log_rho), sat)
        p = torch.linalg.vecdot(c, sat)
        b_sat = torch.linalg.vecdot(c * x, sat)
        q = torch.linalg.vecdot(c * hit_per_x, rest)
        b_rest = torch.linalg.vecdot(c * miss, rest)
        if self.tail is not None:
            tail_terms = coef * torch.exp((tail_log - scale_q.unsqueeze(1)).clamp(max=_log_max(dtype)))
            q = q + tail_terms.sum(dim=1)
            b_rest = b_rest + (powers * tail_terms).sum(dim=1)
        # The slope -∂f/∂κ = Σ_sat ρ x e^{-x} + Σ_rest ρ x e^{-x}, as logs relative to Q's scale. At
        # the root P = Q - (n - S): where that takes no cancellation it is the accurate P (the
        # saturated items' e^{-x} are beyond the resolution of κ when x is large, and P's own
        # scale may not be comparable with Q's).
        log_q = torch.log(q)
        log_deficit = torch.log(deficit.abs()) - scale_q
        surplus = deficit <= 0
        balanced = surplus | (log_deficit <= log_q - math.log(2.0))
        log_p = torch.where(balanced, torch.where(surplus, torch.logaddexp(log_q, log_deficit),
                                                  log_q + torch.log1p(-torch.exp(log_deficit - log_q))),
                            torch.log(p) + (scale_p - scale_q))
        mean_x = b_sat / p.clamp(min=1.0)  # Σ_sat ρ x e^{-x} / Σ_sat ρ e^{-x}: p ≥ 1 if any item is saturated
        log_slope = torch.logaddexp(torch.log(mean_x) + log_p, torch.log(b_rest)).clamp(min=finfo.min)
        sat_coef = (torch.exp(log_p - log_slope) / p.clamp(min=1.0)).unsqueeze(1)
        rest_coef = torch.exp((-log_slope).clamp(max=_log_max(dtype))).unsqueeze(1)
        share_d = sat * (c * x) * sat_coef + rest * (c * miss) * rest_coef
        if self.rho is None:
            share_rho = share_d[:, :0]
        else:
            big = torch.exp((-log_slope - scale_q).clamp(max=_log_max(dtype))).unsqueeze(1)
            share_rho = sat * (self.rho * -em1) * big + rest * (c * hit_per_x) * rest_coef
        share_tail = share_d[:, :0] if tail_terms is None else tail_terms * rest_coef
        bound = math.sqrt(finfo.max) / max(self.d.shape[1], 1)  # times a clamped gradient: still finite
        return (scale_p, scale_q, deficit, p, q, b_sat, b_rest), (share_d, share_rho.clamp_(max=bound), share_tail)

    def _next(self, kappa: Tensor, sums: tuple[Tensor, ...], lo: Tensor, hi: Tensor, before: Tensor,
              width: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The next κ, the updated bracket ``[lo, hi]`` and whether the Newton step was below ``width``
        (then it is taken even if rounding put it just outside the bracket)."""
        scale_p, scale_q, deficit, p, q, b_sat, b_rest = sums
        tiny = self.finfo.tiny
        # log A, A = n - Σ_sat ρ (1 - e^{-x}) = (n - S) + P: -inf where A ≤ 0
        log_p = torch.log(p) + scale_p
        log_a = torch.where(deficit >= 0, torch.logaddexp(torch.log(deficit.clamp(min=0.0)), log_p),
                            log_p + torch.log1p((deficit * torch.exp(-log_p)).clamp(min=-1.0)))
        log_q = torch.log(q) + scale_q
        above = log_a > log_q  # n - f = A - Q > 0: f < n, κ is above the root
        hi = torch.where(above, torch.minimum(hi, kappa), hi)
        lo = torch.where(above, lo, torch.maximum(lo, kappa))
        da = b_sat * torch.exp(scale_p - log_a)  # d log A / dκ = Σ_sat ρ x e^{-x} / A
        dq = b_rest / q.clamp(min=tiny)  # -d log Q / dκ
        # Newton on log A - log Q, or on log(-log A) - log(-log Q) when both are tiny (then each
        # is nearly linear in κ across gaps of hundreds between scores).
        phi = (log_a - log_q) / (da + dq).clamp(min=tiny)
        both_tiny = (log_a < -1.0) & (log_q < -1.0)
        la, lq = log_a.clamp(max=-1.0), log_q.clamp(max=-1.0)
        psi = (torch.log(-la) - torch.log(-lq)) / (da / la + dq / lq).clamp(max=-tiny)
        newton = torch.where(both_tiny, psi, phi)
        cand = kappa - newton
        valid = (log_a > -math.inf) & (q > 0) & torch.isfinite(cand)
        close = valid & (newton.abs() <= width)
        inside = valid & (cand > lo) & (cand < hi)
        # a Newton step that does not halve the one before last (inf in the first two steps): bisect instead
        inside = inside & (newton.abs() <= 0.5 * before)
        mid = torch.sinh(0.5 * (torch.asinh(lo) + torch.asinh(hi)))
        return torch.where(inside | close, cand, mid), lo, hi, close
