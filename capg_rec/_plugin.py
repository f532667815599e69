"""The paper's plug-in inclusion probability of the PL(-MoE) ESR (private).

Position k's hazard is evaluated at the greedy prefix of k - 1 items *that excludes the target*: each
block's expert takes its best items still free. Every such prefix lies in the pool of each block's
expert's best items (at most K each), so the catalog is read once, for the pool's and the targets' scores
and the mass outside the pool; the rest works on ``[B, L, K]``- and ``[B, L, R, P]``-sized tensors (R
blocks, pool size P ≤ R·K). Denominators are summed directly, never subtracted.
"""

from __future__ import annotations

import itertools
import math
import warnings

import torch
from torch import Tensor

from capg_rec._head_tail import read_whole
from capg_rec._numerics import Runs, bound_once, cumsum, eager_cpu, exp_, filled_logsumexp, log1mexp, no_autocast, \
    position_index, reverse_logcumsumexp, safe_logaddexp, safe_logsumexp, select_experts
from capg_rec.catalog import CatalogScores, DenseCatalog, every_score

__all__ = ["plugin_log_inclusion"]


def plugin_log_inclusion(catalog: CatalogScores, items: Tensor, runs: Runs) -> Tensor:
    """The paper's plug-in: ``1 - Π_k (1 - h_k)`` with each hazard at the greedy prefix that
    excludes the target → ``[B, L]``. Denominators are summed directly, never subtracted.

    Every prefix lies in the pool of each block's expert's best items (:func:`_pool`), so the catalog is
    read once, in one node, for the pool's and the targets' scores and the mass outside the pool; the rest
    works on ``[B, L, K]``- and ``[B, L, R, P]``-sized tensors (R blocks, pool size P ≤ R·K)."""
    experts = [e for e, _ in runs]
    if read_whole(catalog):  # a small catalog whose sums are estimated, or cheap to score whole: read it whole
        catalog = DenseCatalog(every_score(catalog), validate_args=False)
    num_candidates = sum(n for _, n in runs)
    if catalog.exact_top < num_candidates < catalog.num_items:  # the greedy prefixes read through top_items
        warnings.warn(f"the plug-in takes each expert's best items (up to K = {num_candidates}) for its greedy "
                      f"prefixes, but this catalog names only its best {catalog.exact_top} exactly: its inclusion "
                      "probabilities are biased (on a SampledCatalog, raise head_size with an index)", stacklevel=3)
    if isinstance(catalog, DenseCatalog):  # relative to each expert's best (a constant): shift-invariant in any dtype
        scores = catalog.scores
        top = scores.detach().amax(dim=2, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
        catalog = DenseCatalog(scores - top, validate_args=False)
    pool = _pool(catalog, runs)  # [B, P]
    # The pool's and the targets' scores [B, M, P + L], and the mass outside the pool [B, M].
    named, rest = catalog.gather_with_rest(pool, also=items)
    size = pool.shape[1]
    if len(runs) == 1:
        (expert, _), = runs
        scores = named[:, expert]
        return _plugin_one_block(scores[:, :size], rest[:, expert], scores[:, size:], _left_out(pool, items))
    prefix, dropped = _greedy_prefixes(pool, items, runs, catalog.num_items)
    target = named[..., size:].index_select(1, position_index(tuple(runs), catalog.device)).transpose(1, 2)
    # Views when the blocks' experts are consecutive.
    return _plugin_many_blocks(select_experts(named, experts)[..., :size], select_experts(rest, experts), target,
                               prefix, dropped, position_index(tuple(runs), catalog.device, True))


def _pool(catalog: CatalogScores, runs: Runs) -> Tensor:
    """Each block's expert's best items, best first, one block after the other → ``[B, P]`` (ids; may repeat
    across blocks). Block i's greedy pick never reaches beyond its expert's best ``end_i + 1`` items (``end_i``:
    the candidates up to its block; K for the last): those taken before it and the target leave ``n_i`` free.
    A dense catalog selects each block's own number; others (which may stream the catalog) select K once."""
    sizes = _list_sizes(runs)
    if isinstance(catalog, DenseCatalog):
        return torch.cat([catalog.top_items(size, experts=[e])[:, 0] for (e, _), size in zip(runs, sizes)], 1)
    best = catalog.top_items(max(sizes), experts=[e for e, _ in runs])
    return torch.cat([best[:, i, :size] for i, size in enumerate(sizes)], 1)


def _list_sizes(runs: Runs) -> list[int]:
    """The length of each block's list in the pool: ``min(end_i + 1, K)``."""
    num_candidates = sum(n for _, n in runs)
    return [min(end + 1, num_candidates) for end in itertools.accumulate(n for _, n in runs)]


def _log_first_hit(log_hazard: Tensor) -> Tensor:
    """``log π = log Σ_k h_k Π_{j<k} (1 - h_j)`` (first drawn at position k) from ``log h [B, L, K]`` →
    ``[B, L]``."""
    log_hazard = log_hazard.clamp(max=-torch.finfo(log_hazard.dtype).tiny)
    # π = Σ_k h_k Π_{j<k} (1 - h_j): first drawn at position k. Summed in log-space, this stays
    # exact where 1 - Π (1 - h) would round to 0 (tiny probabilities).
    log_miss = log1mexp(log_hazard)
    log_miss_before = torch.nn.functional.pad(cumsum(log_miss, dim=2)[..., :-1], (1, 0))
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
        prob, miss, miss_before = _first_hit(hazard)  # [B, L]
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
        grad_w_target = _first_hit_grad(grad, prob, hazard, miss, miss_before) / denom  # [B, L, K]
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


def _greedy_prefixes(pool: Tensor, items: Tensor, runs: Runs, num_items: int) -> tuple[Tensor, Tensor]:
    """Several blocks: the greedy prefix that excludes each target ``items [B, L]``, as slots of the ``pool
    [B, P]`` (:func:`_pool`; ids may repeat) → ``prefix [B, L, K-1]``, and the entries that do not count in
    the mass outside the prefix ``dropped [B, L, P]`` (bool: the prefix, and every copy of an id after its
    first). No gradient."""
    num_candidates = sum(n for _, n in runs)
    batch, num_targets = items.shape
    with torch.no_grad():
        first = _pool_first_copy(pool, num_items)  # every entry names its id by its first copy's slot
        taken = pool.unsqueeze(1) == items.unsqueeze(2)  # [B, L, P]: first copies drawn (or the target)
        prefix, left, start = [], num_candidates - 1, 0
        for (_, count), size in zip(runs, _list_sizes(runs)):
            own, start = first[:, start:start + size], start + size  # the block's list
            take = min(count, left)
            if take == 0:
                break
            # The block's expert takes its best items still free: the first `take` free ones of its list.
            own = own.unsqueeze(1).expand(-1, num_targets, -1)  # [B, L, size]
            free = ~taken.gather(2, own)
            rank = free.cumsum(2)
            dest = torch.where(free & (rank <= take), rank - 1, take)
            picked = own.new_zeros(batch, num_targets, take + 1).scatter(2, dest, own)[..., :take]
            taken = taken.scatter(2, picked, True)
            prefix.append(picked)
            left -= take
        prefix = torch.cat(prefix, 2)  # [B, L, K-1]: pool slots
        copies = first != torch.arange(first.shape[1], device=pool.device)
        dropped = copies.unsqueeze(1).expand(-1, num_targets, -1).scatter(2, prefix, True)  # out of place: vmap
    return prefix, dropped


def _plugin_many_blocks(scores: Tensor, rest: Tensor, target: Tensor, prefix: Tensor, dropped: Tensor,
                        block: Tensor) -> Tensor:
    """The plug-in for several blocks: the pool's ``scores [B, R, P]`` and the mass outside it ``rest [B, R]``
    (log) under each block's expert, the targets' scores under each position's expert ``target [B, L, K]``,
    their greedy prefixes and dropped entries (:func:`_greedy_prefixes`) and the block of each position
    ``block [K]`` → ``[B, L]``.

    On CPU tensors outside ``torch.compile`` and ``torch.func`` this is one node (:class:`_ManyBlockPlugIn`)
    in linear sums of ``exp(s - shift)``: float32 ones for float32 (or narrower) scores that every finite entry
    keeps within :data:`_LINEAR_SPREAD_32` of its expert's largest, else float64 ones within
    :data:`_LINEAR_SPREAD` (read on the host); otherwise log-space ops (:func:`_plugin_many_blocks_log_space`)."""
    if target.numel() and eager_cpu(scores):
        with torch.no_grad():
            shift = torch.maximum(scores.amax(2), rest).clamp(min=torch.finfo(scores.dtype).min)  # [B, R]
            low = torch.stack([(scores - shift.unsqueeze(2)).nan_to_num(neginf=0.0).amin(),
                               (rest - shift).nan_to_num(neginf=0.0).amin(),
                               (target - shift.index_select(1, block).unsqueeze(1)).nan_to_num(neginf=0.0).amin()])
            low = float(low.amin())
        narrow = scores.dtype != torch.float64 and low > -_LINEAR_SPREAD_32
        if narrow or low > -_LINEAR_SPREAD:
            work = torch.float32 if narrow else torch.float64
            return _ManyBlockPlugIn.apply(scores, rest, target, prefix, dropped, block, shift, work)[0]
    return _plugin_many_blocks_log_space(scores, rest, target, prefix, dropped, block)


_LINEAR_SPREAD_32 = 80.0
"""Scores within this of their expert's largest have float32 exps in the normal range (e^-80 ~ 2e-35)."""


def _plugin_many_blocks_log_space(scores: Tensor, rest: Tensor, target: Tensor, prefix: Tensor, dropped: Tensor,
                                  block: Tensor) -> Tensor:
    """:func:`_plugin_many_blocks` in log-space ops: the mass before position k under its block's expert is
    that outside the whole prefix (the pool's entries not dropped and the rest) plus the prefix's from k on."""
    batch, num_targets, num_blocks = target.shape[0], target.shape[1], scores.shape[1]
    s = scores.unsqueeze(1)  # [B, 1, R, P]
    # An added mask, -inf at the dropped entries (a CPU masked_fill of [B, L, R, P] is 10x slower).
    drop = torch.where(dropped, -math.inf, 0.0).to(scores.dtype).unsqueeze(2)  # [B, L, 1, P]
    base = safe_logaddexp(rest.unsqueeze(1), filled_logsumexp(s + drop, dim=3))  # [B, L, R]
    pre = s.expand(-1, num_targets, -1, -1).gather(3, prefix.unsqueeze(2).expand(-1, -1, num_blocks, -1))
    later = reverse_logcumsumexp(pre, dim=3)  # [B, L, R, K-1]: the prefix from position k on
    later = torch.cat([later, later.new_full((*later.shape[:3], 1), -torch.inf)], dim=3)
    denom = safe_logaddexp(base.unsqueeze(3), later)  # [B, L, R, K]
    denom = denom.gather(2, block.view(1, 1, 1, -1).expand(batch, num_targets, 1, -1)).squeeze(2)
    return _log_first_hit(target - denom)


def _first_hit(hazard: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``π = Σ_k h_k Π_{j<k} (1 - h_j)`` from hazards ``[B, L, K]`` (in ``[0, 1]``) → ``π [B, L]``, ``1 - h``
    and ``Π_{j<k} (1 - h_j)`` (for :func:`_first_hit_grad`)."""
    miss = 1.0 - hazard
    miss_before = torch.nn.functional.pad(miss[..., :-1], (1, 0), value=1.0).cumprod(2)
    return (hazard * miss_before).sum(2), miss, miss_before


def _first_hit_grad(grad: Tensor, prob: Tensor, hazard: Tensor, miss: Tensor, miss_before: Tensor) -> Tensor:
    """``∂ log π / ∂h_k = Π_{j≠k} (1 - h_j) / π`` times ``grad [B, L]`` → ``[B, L, K]``; 0 for a target of
    probability 0 (masked) and at a clamped hazard (``h = 1``, e.g. a last item left: 1 whatever the scores)."""
    coef = torch.where(prob > 0, grad.double() / prob, 0.0)
    miss_after = torch.nn.functional.pad(miss[..., 1:], (0, 1), value=1.0).flip(2).cumprod(2).flip(2)
    return (coef.unsqueeze(2) * miss_before * miss_after).masked_fill_(hazard >= 1.0, 0.0)


@bound_once
class _ManyBlockPlugIn(torch.autograd.Function):
    """:func:`_plugin_many_blocks` as one node, in sums of ``w = exp(s - shift)`` in the ``work`` dtype
    (``shift [B, R]`` detached, every finite entry within range of it): the mass outside the prefix is one
    batched product ``[B, L, P] @ [B, P, R]``, the prefix's from each position on a suffix sum; the hazards
    and ``π`` are float64. A recorded backward (higher-order gradients) differentiates the log-space ops."""

    generate_vmap_rule = True

    @staticmethod
    def forward(scores: Tensor, rest: Tensor, target: Tensor, prefix: Tensor, dropped: Tensor, block: Tensor,
                shift: Tensor, work: torch.dtype) -> tuple[Tensor, ...]:
        batch, num_targets, k = target.shape
        num_blocks = scores.shape[1]
        w = exp_(scores.to(work) - shift.to(work).unsqueeze(2))  # [B, R, P]
        w_rest = torch.exp(rest.to(work) - shift.to(work))  # [B, R]
        keep = (~dropped).to(work)  # [B, L, P]
        with no_autocast(w.device):  # in the work dtype: an autocast region would run it in half precision
            base = torch.baddbmm(w_rest.unsqueeze(1), keep, w.transpose(1, 2))  # [B, L, R]
        pre = w.unsqueeze(1).expand(-1, num_targets, -1, -1).gather(
            3, prefix.unsqueeze(2).expand(-1, -1, num_blocks, -1))  # [B, L, R, K-1]
        later = torch.nn.functional.pad(pre.flip(3).cumsum(3).flip(3), (0, 1))  # Σ_{j ≥ k} of the prefix
        at = block.view(1, 1, 1, -1).expand(batch, num_targets, 1, -1)
        denom = (later.gather(2, at).squeeze(2) + base.index_select(2, block)).double()  # [B, L, K]
        w_target = torch.exp(target.double() - shift.double().index_select(1, block).unsqueeze(1))
        hazard = (w_target / denom.clamp(min=torch.finfo(torch.float64).tiny)).clamp_(max=1.0)
        prob, miss, miss_before = _first_hit(hazard)
        return prob.log().to(target.dtype), w, w_rest, keep, w_target, denom, hazard, miss, miss_before, prob

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        scores, rest, target, prefix, dropped, block = inputs[:6]
        _, *kept = output
        ctx.mark_non_differentiable(*kept)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(scores, rest, target, prefix, dropped, block, *kept)

    @staticmethod
    def backward(ctx, grad: Tensor | None, *_) -> tuple[Tensor | None, ...]:
        if grad is None:
            return (None,) * 8
        scores, rest, target, prefix, dropped, block, w, w_rest, keep, w_target, denom, hazard, miss, miss_before, \
            prob = ctx.saved_tensors
        if torch.is_grad_enabled():  # a recorded backward: differentiate the log-space ops
            with torch.enable_grad():
                out = _plugin_many_blocks_log_space(scores, rest, target, prefix, dropped, block)
            return (*torch.autograd.grad(out, (scores, rest, target), grad, create_graph=True),) + (None,) * 5
        batch, num_targets, k = target.shape
        num_blocks = scores.shape[1]
        grad_w_target = _first_hit_grad(grad, prob, hazard, miss, miss_before) / denom.clamp(
            min=torch.finfo(torch.float64).tiny)  # [B, L, K]
        grad_denom = -grad_w_target * hazard  # float64: up to grad / w, beyond float32 at 80 nats
        # Per row and block, relative to its largest (the sums in the work dtype stay within L·K of 1); the
        # scale comes back in float64 once the terms are multiplied by their w.
        largest = grad_denom.abs().amax(1)  # [B, K]
        scale = largest.new_zeros(batch, num_blocks).scatter_reduce_(1, block.expand(batch, -1), largest, "amax")
        scale = torch.where(scale > 0, scale, 1.0)  # [B, R]
        grad_denom = (grad_denom / scale.index_select(1, block).unsqueeze(1)).to(w.dtype)
        grad_base = grad_denom.new_zeros(batch, num_targets, num_blocks).index_add_(2, block, grad_denom)
        at = block.view(1, 1, 1, -1).expand(batch, num_targets, 1, -1)
        grad_later = grad_denom.new_zeros(batch, num_targets, num_blocks, k).scatter_(2, at, grad_denom.unsqueeze(2))
        grad_pre = grad_later[..., :-1].cumsum(3)  # pre_j counts in the suffix sums of positions k ≤ j
        with no_autocast(keep.device):
            grad_w = torch.bmm(grad_base.transpose(1, 2), keep)  # [B, R, P]
        grad_w.scatter_add_(2, prefix.reshape(batch, 1, -1).expand(-1, num_blocks, -1),
                            grad_pre.transpose(1, 2).reshape(batch, num_blocks, -1))
        grad_scores = grad_w.mul_(w).double().mul_(scale.unsqueeze(2))
        grad_rest = grad_base.sum(1).mul_(w_rest).double().mul_(scale)
        return (grad_scores.to(scores.dtype), grad_rest.to(rest.dtype), (grad_w_target * w_target).to(target.dtype),
                None, None, None, None, None)
