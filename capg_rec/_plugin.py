"""The paper's plug-in inclusion probability of the PL(-MoE) ESR (private).

Position k's hazard is evaluated at the greedy prefix of k - 1 items *that excludes the target*: each
block's expert takes its best items still free. Every such prefix lies in the pool of each block's
expert's top-K items, so the catalog is read once, for the pool's and the targets' scores and the mass
outside the pool; the rest works on ``[B, L, K]``- and ``[B, L, R, P]``-sized tensors (R blocks, pool
size P = R·K). Denominators are summed directly, never subtracted.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from capg_rec._head_tail import read_whole
from capg_rec._numerics import Runs, bound_once, eager_cpu, filled_logsumexp, log1mexp, position_index, \
    reverse_logcumsumexp, safe_logaddexp, safe_logsumexp, select_experts
from capg_rec.catalog import CatalogScores, DenseCatalog

__all__ = ["plugin_log_inclusion"]

def plugin_log_inclusion(catalog: CatalogScores, items: Tensor, runs: Runs) -> Tensor:
    """The paper's plug-in: ``1 - Π_k (1 - h_k)`` with each hazard at the greedy prefix that
    excludes the target → ``[B, L]``. Denominators are summed directly, never subtracted.

    Every prefix lies in the pool of each block's expert's top-K items, so the catalog is read once,
    in one node, for the pool's and the targets' scores and the mass outside the pool; the rest works
    on ``[B, L, K]``-sized tensors."""
    num_candidates = sum(n for _, n in runs)
    experts = [e for e, _ in runs]
    if read_whole(catalog):  # a small catalog whose sums are estimated: read it whole, exactly
        everything = torch.arange(catalog.num_items, device=catalog.device).expand(catalog.batch_size, -1)
        catalog = DenseCatalog(catalog.gather(everything), validate_args=False)
    if isinstance(catalog, DenseCatalog):  # relative to each expert's best (a constant): shift-invariant in any dtype
        scores = catalog.scores
        top = scores.detach().amax(dim=2, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
        catalog = DenseCatalog(scores - top, validate_args=False)
    pool = catalog.top_items(num_candidates, experts=experts).flatten(1)  # [B, P], P = len(runs)·K
    # The pool's and the targets' scores [B, M, P + L], and the mass outside the pool [B, M].
    named, rest = catalog.gather_with_rest(pool, also=items)
    size = pool.shape[1]
    if len(runs) == 1:
        (expert, _), = runs
        scores = named[:, expert]
        return _plugin_one_block(scores[:, :size], rest[:, expert], scores[:, size:], _left_out(pool, items))
    denom = _plugin_denominators(select_experts(named, experts)[..., :size], select_experts(rest, experts), pool,
                                 items, runs, catalog.num_items)  # views when the blocks' experts are consecutive
    position_expert = position_index(tuple(runs), catalog.device, False)
    return _log_first_hit(named[..., size:].index_select(1, position_expert).transpose(1, 2) - denom)


def _log_first_hit(log_hazard: Tensor) -> Tensor:
    """``log π = log Σ_k h_k Π_{j<k} (1 - h_j)`` (first drawn at position k) from ``log h [B, L, K]`` →
    ``[B, L]``."""
    log_hazard = log_hazard.clamp(max=-torch.finfo(log_hazard.dtype).tiny)
    # π = Σ_k h_k Π_{j<k} (1 - h_j): first drawn at position k. Summed in log-space, this stays
    # exact where 1 - Π (1 - h) would round to 0 (tiny probabilities).
    log_miss = log1mexp(log_hazard)
    log_miss_before = torch.nn.functional.pad(torch.cumsum(log_miss, dim=2)[..., :-1], (1, 0))
    return safe_logsumexp(log_hazard + log_miss_before, dim=2)


def _left_out(pool: Tensor, items: Tensor) -> Tensor:
    """The slot of each target ``items [B, L]`` in a one-block ``pool [B, K]`` (distinct ids), ``K - 1`` for
    a target outside it: the pool slot left out of its greedy prefix → ``[B, L]``."""
    k = pool.shape[1]
    with torch.no_grad():
        slot = torch.arange(k - 1, -1, -1, device=pool.device)  # K - 1 - j at slot j
        return (k - 1) - torch.where(pool.unsqueeze(1) == items.unsqueeze(2), slot, 0).amax(2)


def _plugin_one_block(scores: Tensor, rest: Tensor, target: Tensor, left_out: Tensor) -> Tensor:
    """The plug-in for one expert: its top-K ``scores [B, K]`` (best first), the mass outside them
    ``rest [B]`` (log), the targets' ``target [B, L]`` and the slot each leaves out of its prefix ``left_out
    [B, L]`` → ``[B, L]``.

    On CPU tensors whose scores span less than :data:`_LINEAR_SPREAD` (read on the host), outside
    ``torch.compile`` and ``torch.func``, this is one node computed in float64 sums of ``exp(s - max)``
    (:class:`_OneBlockPlugIn`); otherwise log-space ops (:func:`_plugin_one_block_log_space`)."""
    if target.numel() and eager_cpu(scores):
        with torch.no_grad():
            shift = torch.maximum(scores[:, :1], rest.unsqueeze(1))  # [B, 1]: the largest mass of a term
            # The smallest pool score, the rest and the targets, relative to it (-inf ones: nothing to lose).
            low = torch.cat([scores[:, -1:], rest.unsqueeze(1), target], 1) - shift
            linear = float(low.nan_to_num(neginf=0.0).amin()) > -_LINEAR_SPREAD
        if linear:
            return _OneBlockPlugIn.apply(scores, rest, target, left_out, shift)[0]
    return _plugin_one_block_log_space(scores, rest, target, left_out)


_LINEAR_SPREAD = 600.0
"""Scores within this of their row's largest term have float64 exps far from underflow (e^-600 ~ 1e-261)."""


def _plugin_one_block_log_space(scores: Tensor, rest: Tensor, target: Tensor, left_out: Tensor) -> Tensor:
    """:func:`_plugin_one_block` in log-space ops. With ``p`` the slot left out, the mass before position k
    is ``rest + Σ_{j ≥ k} w_j`` for ``k ≤ p`` and ``rest + w_p + Σ_{j > k} w_j`` after."""
    k = scores.shape[1]
    slot = torch.arange(k, device=scores.device)
    before = reverse_logcumsumexp(torch.cat([scores, rest.unsqueeze(1)], 1), dim=1)  # [B, K+1]: rest + Σ_{j≥k} w_j
    after = safe_logaddexp(before[:, 1:].unsqueeze(1), scores.gather(1, left_out).unsqueeze(2))  # [B, L, K]
    head = before[:, :k].unsqueeze(1).expand(-1, target.shape[1], -1)
    denom = torch.where(slot.view(1, 1, -1) <= left_out.unsqueeze(2), head, after)
    return _log_first_hit(target.unsqueeze(2) - denom)


@bound_once
class _OneBlockPlugIn(torch.autograd.Function):
    """:func:`_plugin_one_block` as one node, in float64 sums of ``w = exp(s - shift)`` (``shift [B, 1]``
    detached; every finite score within :data:`_LINEAR_SPREAD` of it): ``π = Σ_k h_k Π_{j<k} (1 - h_j)``,
    ``h_k = w_a / D_k``, whose gradient ``∂π/∂h_k = Π_{j≠k} (1 - h_j)`` is a product of two cumulative
    products. A recorded backward (higher-order gradients) differentiates the log-space ops instead."""

    generate_vmap_rule = True

    @staticmethod
    def forward(scores: Tensor, rest: Tensor, target: Tensor, left_out: Tensor, shift: Tensor) -> Tensor:
        shift = shift.double()
        w = torch.exp(scores.double() - shift)  # [B, K]
        w_rest = torch.exp(rest.double().unsqueeze(1) - shift)  # [B, 1]
        suffix = w.flip(1).cumsum(1).flip(1)  # Σ_{j≥k} w_j
        w_left = w.gather(1, left_out)  # [B, L]
        head = (suffix + w_rest).unsqueeze(1)  # [B, 1, K]
        after = torch.nn.functional.pad(suffix[:, 1:], (0, 1)).unsqueeze(1) + (w_rest + w_left).unsqueeze(2)
        is_head = torch.arange(w.shape[1], device=w.device) <= left_out.unsqueeze(2)  # [B, L, K]
        denom = torch.where(is_head, head, after)
        w_target = torch.exp(target.double() - shift)  # [B, L]
        hazard = (w_target.unsqueeze(2) / denom).clamp_(max=1.0)
        miss = 1.0 - hazard
        miss_before = torch.nn.functional.pad(miss[..., :-1], (1, 0), value=1.0).cumprod(2)  # Π_{j<k} (1 - h_j)
        prob = (hazard * miss_before).sum(2)  # [B, L]
        return prob.log().to(target.dtype), w, w_rest, w_target, denom, hazard, miss, miss_before, prob, is_head

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        scores, rest, target, left_out, _ = inputs
        _, *kept = output
        ctx.mark_non_differentiable(*kept)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(scores, rest, target, left_out, *kept)

    @staticmethod
    def backward(ctx, grad: Tensor | None, *_) -> tuple[Tensor | None, ...]:
        if grad is None:
            return None, None, None, None, None
        scores, rest, target, left_out, w, w_rest, w_target, denom, hazard, miss, miss_before, prob, is_head = \
            ctx.saved_tensors
        if torch.is_grad_enabled():  # a recorded backward: differentiate the log-space ops
            with torch.enable_grad():
                out = _plugin_one_block_log_space(scores, rest, target, left_out)
            return (*torch.autograd.grad(out, (scores, rest, target), grad, create_graph=True), None, None)
        coef = torch.where(prob > 0, grad.double() / prob, 0.0)  # [B, L]: ∂ log π / ∂π, 0 for masked targets
        miss_after = torch.nn.functional.pad(miss[..., 1:], (0, 1), value=1.0).flip(2).cumprod(2).flip(2)
        grad_hazard = coef.unsqueeze(2) * miss_before * miss_after  # Π_{j≠k} (1 - h_j) / π
        grad_hazard.masked_fill_(hazard >= 1.0, 0.0)  # clamped (or a last item left: h = 1 whatever the scores)
        grad_w_target = grad_hazard / denom  # [B, L, K]
        grad_denom = -grad_w_target * hazard
        grad_head = torch.where(is_head, grad_denom, 0.0)
        grad_after = grad_denom - grad_head
        grad_suffix = grad_head.sum(1)  # [B, K]
        grad_suffix[:, 1:] += grad_after.sum(1)[:, :-1]  # after_k holds Σ_{j>k} w_j
        grad_w = grad_suffix.cumsum(1).scatter_add_(1, left_out, grad_after.sum(2))
        grad_target = grad_w_target.sum(2) * w_target
        grad_rest = grad_denom.sum((1, 2)) * w_rest.squeeze(1)
        return (grad_w.mul_(w).to(scores.dtype), grad_rest.to(rest.dtype), grad_target.to(target.dtype), None, None)


def _pool_first_copy(pool: Tensor, num_items: int) -> Tensor:
    """For each entry of ``pool [B, P]`` (ids, may repeat) the slot of its id's first entry → ``[B, P]``.

    A scatter into a ``[B, N]`` table when N is at most a few times P, else a stable sort. No gradient."""
    batch, size = pool.shape
    slot = torch.arange(size, device=pool.device).expand(batch, -1)
    if num_items <= 8 * size:
        table = pool.new_full((batch, num_items), size).scatter_reduce(1, pool, slot, "amin")
        return table.gather(1, pool)
    ids, order = pool.sort(dim=1, stable=True)
    new = torch.nn.functional.pad(ids[:, 1:] != ids[:, :-1], (1, 0), value=True)
    start = torch.where(new, slot, torch.zeros_like(slot)).cummax(dim=1).values  # each run of equal ids' start
    return torch.empty_like(order).scatter(1, order, order.gather(1, start))


def _plugin_denominators(scores: Tensor, rest: Tensor, pool: Tensor, items: Tensor, runs: Runs,
                         num_items: int) -> Tensor:
    """Several blocks: ``scores [B, M', P]`` and ``rest [B, M']`` under the blocks' experts, of the
    ``pool [B, P]`` (block i's expert's top-K, best first, at ``[iK, (i+1)K)``; ids may repeat) and
    outside it → log mass before each position ``[B, L, K]`` under the position's expert, at the
    greedy prefix that excludes each target ``items [B, L]``."""
    num_candidates = sum(n for _, n in runs)
    batch, num_targets = items.shape
    with torch.no_grad():
        first = _pool_first_copy(pool, num_items)  # every entry names its id by its first copy's slot
        taken = pool.unsqueeze(1) == items.unsqueeze(2)  # [B, L, P]: first copies drawn (or the target)
        prefix, left = [], num_candidates - 1
        for block, (_, count) in enumerate(runs):
            take = min(count, left)
            if take == 0:
                break
            # The block's expert takes its best items still free: the first `take` free ones of its list.
            own = first[:, block * num_candidates:(block + 1) * num_candidates].unsqueeze(1)
            own = own.expand(-1, num_targets, -1)  # [B, L, K]
            free = ~taken.gather(2, own)
            rank = free.cumsum(2)
            dest = torch.where(free & (rank <= take), rank - 1, take)
            picked = own.new_zeros(batch, num_targets, take + 1).scatter(2, dest, own)[..., :take]
            taken = taken.scatter(2, picked, True)
            prefix.append(picked)
            left -= take
        prefix = torch.cat(prefix, 2)  # [B, L, K-1]: pool slots
        copies = first != torch.arange(first.shape[1], device=pool.device)
        # -inf at the entries that do not count (the prefix and second copies), 0 elsewhere: an added mask
        # (a CPU masked_fill of [B, L, M', P] is 10x slower).
        drop = torch.where(copies, -math.inf, 0.0).to(scores.dtype).unsqueeze(1).repeat(1, num_targets, 1)
        drop = drop.scatter(2, prefix, -math.inf).unsqueeze(2)  # [B, L, 1, P]
    s = scores.unsqueeze(1)  # [B, 1, M', P]
    # Mass once the whole prefix is drawn: the pool outside it (the target among them) and the rest.
    base = safe_logaddexp(rest.unsqueeze(1), filled_logsumexp(s + drop, dim=3))  # [B, L, M']
    pre = s.expand(-1, num_targets, -1, -1).gather(3, prefix.unsqueeze(2).expand(-1, -1, len(runs), -1))
    later = reverse_logcumsumexp(pre, dim=3)  # [B, L, M', K-1]: the prefix from position k on
    later = torch.cat([later, later.new_full((*later.shape[:3], 1), -torch.inf)], dim=3)
    denom = safe_logaddexp(base.unsqueeze(3), later)  # [B, L, M', K]
    block = position_index(tuple(runs), pool.device, True)
    return denom.gather(2, block.view(1, 1, 1, -1).expand(batch, num_targets, 1, -1)).squeeze(2)
