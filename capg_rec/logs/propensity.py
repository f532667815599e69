"""Serving-time logging: what a serving ESR stores so that its impressions can train another ESR.

A serving ESR draws K candidates, the later stage shows L of them. For off-policy learning the log
must keep, for each shown item a, the logging policy's probability that a reached the later stage,
``π0(a ∈ A^K | x)``, its with-replacement counterpart ``Σ_k π0_{m(k)}(a)`` (CA-PG-SwR and Chen et al.'s
top-K correction), and the probability of the whole ordered draw ``π0(A^K | x)`` (V-PG's importance
weight). :func:`log_propensities` computes the three in log space; :func:`explore_candidates` is the
sampler they describe.

Exploration mixtures as serving runs them: the PL ESR at a softened ``temperature`` τ (the scores are
``logits / τ``), and an ε-mixture per request: with probability ε the K candidates are K distinct
items drawn uniformly among the row's unmasked items (in random order), else the PL draw. For an item
a and an ordered draw A, with ``N_avail`` the row's unmasked items (items scored ``-inf`` under any
expert are masked for the uniform draw)::

    π(a ∈ A)  = (1 - ε) · π_PL(a ∈ A)     + ε · K / N_avail
    E[count]  = (1 - ε) · Σ_k π_PL,m(k)(a) + ε · K / N_avail
    π(A)      = (1 - ε) · π_PL(A)          + ε · (N_avail - K)! / N_avail!

all combined with a log-add-exp, exact at ε = 0 and ε = 1.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from capg_rec._checks import check_count, check_id_tensor, DeferredChecks, is_number, raise_where_short, \
    resolve_validate_args
from capg_rec._numerics import safe_logaddexp
from capg_rec.catalog import CatalogScores, DenseCatalog, EmbeddingCatalog, _exclusion_mask, agreement, \
    as_catalog
from capg_rec.marginals import DEFAULT_METHOD, InclusionMethod, WithReplacement, _inclusion_log_prob, \
    inclusion_method
from capg_rec.plackett_luce import _candidate_log_prob, _checked, _draw, check_enough_items, expert_runs

__all__ = ["LoggedPropensities", "log_propensities", "explore_candidates"]

_UNIFORM_CHUNK = 8192  # items scored per step when the uniform draw streams over a non-dense catalog


class LoggedPropensities(NamedTuple):
    """The logging policy's log-propensities of one batch of requests (no gradient).

    Attributes:
        log_inclusion: ``[B, L]`` ``log π0(shown_l ∈ A^K | x)``, by the chosen inclusion method.
        log_expected_count: ``[B, L]`` ``log Σ_k π0_{m(k)}(shown_l)``: the expected number of draws of
            ``shown_l`` when every position draws with replacement (can exceed 0). Chen et al.'s
            per-draw item probability is ``exp(log_expected_count) / K``.
        log_candidate_prob: ``[B]`` ``log π0(A^K | x)`` of the ordered draw.

    The dtype is the catalog's compute dtype (float32 for float32/half logits, float64 for float64).

    Shape:
        log_inclusion, log_expected_count: ``[B, L]``; log_candidate_prob: ``[B]``.

    Example:
        >>> logits = torch.randn(4, 20, dtype=torch.float64)
        >>> candidates = explore_candidates(logits, 5, epsilon=0.1)
        >>> logged = log_propensities(logits, candidates, candidates[:, :2], epsilon=0.1)   # a LoggedPropensities
        >>> [tuple(x.shape) for x in logged], logged.log_candidate_prob.dtype
        ([(4, 2), (4, 2), (4,)], torch.float64)
    """

    log_inclusion: Tensor
    log_expected_count: Tensor
    log_candidate_prob: Tensor


def _check_epsilon(epsilon: float) -> float:
    if not is_number(epsilon):
        raise TypeError(f"epsilon must be a number in [0, 1], got {type(epsilon).__name__} {epsilon!r}")
    if not 0.0 <= epsilon <= 1.0:  # NaN fails too
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon!r}")
    return float(epsilon)


def _uniform_available(catalog: CatalogScores) -> Tensor:
    """``N_avail``: items unmasked under every expert, per row → ``LongTensor[B]``."""
    if isinstance(catalog, DenseCatalog):
        return (catalog.scores > -math.inf).all(1).sum(1)
    return catalog.num_available().amin(1)  # the other placements mask an item under all experts at once


def _masked_chunk(catalog: CatalogScores, start: int, stop: int) -> Tensor | None:
    """``[B, stop - start]`` bool: True where item ``start + j`` is masked (under any expert), or None."""
    if isinstance(catalog, DenseCatalog):
        return (catalog.scores[:, :, start:stop] == -math.inf).any(1)
    if isinstance(catalog, EmbeddingCatalog):
        return _exclusion_mask(catalog.masked_items, catalog.batch_size, start, stop, catalog.device)
    ids = torch.arange(start, stop, device=catalog.device).expand(catalog.batch_size, -1)
    with torch.no_grad():
        return (catalog.gather(ids) == -math.inf).any(1)


def _uniform_draw(catalog: CatalogScores, num_candidates: int, generator: torch.Generator | None) -> Tensor:
    """K distinct unmasked items per row, uniformly at random, in random order → ``LongTensor[B, K]``.

    The K largest of i.i.d. uniform keys (masked items keyed -1), streamed over the catalog in chunks:
    their set is uniform and their order by key a uniform permutation."""
    batch, n = catalog.batch_size, catalog.num_items
    chunk = n if isinstance(catalog, DenseCatalog) else _UNIFORM_CHUNK
    best_key = torch.empty(batch, 0, device=catalog.device)
    best_id = torch.empty(batch, 0, dtype=torch.long, device=catalog.device)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        keys = torch.rand(batch, stop - start, generator=generator, device=catalog.device)
        masked = _masked_chunk(catalog, start, stop)
        if masked is not None:
            keys = keys.masked_fill(masked, -1.0)
        ids = torch.arange(start, stop, device=catalog.device).expand(batch, -1)
        keys, ids = torch.cat([best_key, keys], 1), torch.cat([best_id, ids], 1)
        best_key, pos = keys.topk(min(num_candidates, keys.shape[1]), dim=1)
        best_id = ids.gather(1, pos)
    return best_id


def _check_uniform_possible(catalog: CatalogScores, num_candidates: int, failed: Exception | None = None) -> None:
    available = _uniform_available(catalog)
    raise_where_short(catalog.agree, available < num_candidates, lambda at: (
        f"epsilon > 0 draws num_candidates={num_candidates} items uniformly among a row's items unmasked under every "
        f"expert, but row {at[0]} has {int(available[at])}"),
        f"epsilon > 0 draws num_candidates={num_candidates} items uniformly among a row's items unmasked under every "
        "expert, but another process's rows have fewer", failed)


def explore_candidates(logits: Tensor | CatalogScores, num_candidates: int, *, temperature: float = 1.0,
                       epsilon: float = 0.0, generator: torch.Generator | None = None,
                       validate_args: bool | None = None) -> Tensor:
    """Draw K candidates from the exploration mixture that :func:`log_propensities` describes.

    Per row, with probability ``epsilon`` K distinct unmasked items uniformly at random (in random
    order), else an exact PL(-MoE) draw from ``logits / temperature``. Every row draws its coin, so
    the call is vectorised over the batch and takes the same generator steps whatever the coins say.

    Args:
        logits: ``[B, N]``, ``[B, M, N]`` or a :class:`~capg_rec.catalog.CatalogScores` (which carries
            its own temperature; ``temperature`` must then be 1).
        num_candidates: K.
        temperature: τ > 0 of the PL part.
        epsilon: the uniform share ε in ``[0, 1]``.
        generator: the source of randomness (on the catalog's device).
        validate_args: check the logits and that each row has enough unmasked items.

    Shape:
        Returns ``LongTensor[B, K]``, in draw order.

    Example (a sketch: the names it takes come from your loop)::

        candidates = explore_candidates(logits, 50, temperature=2.0, epsilon=0.05, generator=g)
    """
    epsilon = _check_epsilon(epsilon)
    catalog, validate, num_candidates, failed = _checked(logits, num_candidates, temperature, validate_args, generator)
    if validate and epsilon > 0.0:  # the draw's first check (a collective one fails everywhere if failed)
        _check_uniform_possible(catalog, num_candidates, failed)
    if epsilon == 0.0:
        return _draw(catalog, num_candidates, perturb=True, generator=generator, validate=validate, failed=failed)
    uniform = _uniform_draw(catalog, num_candidates, generator)
    if epsilon == 1.0:
        return uniform
    coin = torch.rand(catalog.batch_size, 1, generator=generator, device=catalog.device) < epsilon
    return torch.where(coin, uniform, _draw(catalog, num_candidates, perturb=True, generator=generator,
                                            validate=validate))


def _mix(log_policy: Tensor, log_uniform: Tensor, epsilon: float) -> Tensor:
    """``log((1 - ε) e^a + ε e^b)``, exact at ε ∈ {0, 1} and where a term is ``-inf``."""
    if epsilon == 0.0:
        return log_policy
    if epsilon == 1.0:
        return log_uniform.expand_as(log_policy)
    return safe_logaddexp(log_policy + math.log1p(-epsilon), log_uniform + math.log(epsilon))


def log_propensities(logits: Tensor | CatalogScores, candidates: Tensor, shown: Tensor, *,
                     method: str | InclusionMethod = DEFAULT_METHOD, temperature: float = 1.0,
                     epsilon: float = 0.0, validate_args: bool | None = None) -> LoggedPropensities:
    """The logging policy's log-propensities of the items a request showed (see the module docstring).

    Call it at serving time, after the ESR drew ``candidates`` (with :func:`explore_candidates`, or
    :func:`capg_rec.sample_candidates` when ε = 0) and the later stage picked ``shown`` among them.

    Args:
        logits: the logging ESR: ``[B, N]``, ``[B, M, N]`` or a
            :class:`~capg_rec.catalog.CatalogScores`; ``-inf`` masks an item.
        candidates: ``[B, K]`` the ordered draw, distinct ids.
        shown: ``[B, L]`` the items the later stage showed, each one of the row's candidates.
        method: the inclusion method of ``log_inclusion`` (an :class:`~capg_rec.InclusionMethod` or a
            registered name: ``"exact"`` where affordable, the default otherwise; for a mixture "exact" is block-exact,
            an approximation, and only ``"enumerate"`` is exact, on few draws). It must give a
            probability: the with-replacement count is ``log_expected_count`` already.
        temperature: τ > 0 of the PL part (1 when ``logits`` is a catalog object).
        epsilon: the uniform share ε in ``[0, 1]`` of the exploration mixture.
        validate_args: check the logits, the ids (in range, candidates distinct, ``shown ⊆
            candidates``) and that the logging policy can draw ``candidates`` at all.

    Shape:
        Returns :class:`LoggedPropensities` of ``[B, L]``, ``[B, L]`` and ``[B]`` tensors, in the logits'
        compute dtype: pass float64 logits to store ``log π0(A^K)`` (a sum of K terms that reaches
        hundreds of nats) to float64 accuracy.

    Example (a sketch: the names it takes come from your loop)::

        candidates = explore_candidates(logits, K, temperature=2.0, epsilon=0.05, generator=g)
        shown = candidates.gather(1, lsr_picks)                 # [B, L]
        logged = log_propensities(logits, candidates, shown, temperature=2.0, epsilon=0.05)
    """
    epsilon = _check_epsilon(epsilon)
    method = inclusion_method(method)
    if not method.is_probability:
        raise ValueError(f"method must give a probability, got {method!r}: its score is "
                         "LoggedPropensities.log_expected_count already")
    validate = resolve_validate_args(validate_args)
    catalog = as_catalog(logits, temperature, validate_args=validate)
    candidates = check_id_tensor("candidates", candidates, batch_size=catalog.batch_size, columns="K")
    num_candidates = check_count("num_candidates (candidates.shape[1])", candidates.shape[1],
                                 high=catalog.num_items)
    shown = check_id_tensor("shown", shown, batch_size=catalog.batch_size)
    if shown.shape[1] > num_candidates:
        raise ValueError(f"shown must have at most K={num_candidates} columns, got {shown.shape[1]}")
    if validate:  # on every process, empty batches included: the agreements are collective
        checks = DeferredChecks()  # ids in range, candidates distinct, shown distinct and among them
        checks.ids_in_range("shown", shown, catalog.num_items)
        checks.draw_and_picks(candidates, shown, catalog.num_items, distinct=True, picks="shown")
        checks.run(agreement(catalog))
        if epsilon < 1.0:
            check_enough_items(catalog, num_candidates, ordered=True)  # the draw's own probability too
        if epsilon > 0.0:
            _check_uniform_possible(catalog, num_candidates)
    with torch.no_grad():
        inclusion = _inclusion_log_prob(catalog, shown, num_candidates, method, validate)
        runs = expert_runs(num_candidates, catalog.num_experts)
        count = WithReplacement().log_inclusion(catalog, shown, runs)
        draw = _candidate_log_prob(catalog, candidates, False)
        if epsilon > 0.0:
            available = _uniform_available(catalog).to(catalog.dtype)  # [B]
            shown_ok = _uniform_ok(catalog, shown)  # [B, L]
            log_share = torch.log(num_candidates / available).unsqueeze(1)  # log K/N_avail
            log_share = torch.where(shown_ok, log_share, -math.inf)
            # log((N - K)! / N!): a difference of two large lgammas, taken in float64 (float32 lost 0.8 nats at 10^6)
            wide = _uniform_available(catalog).double()
            log_set = (torch.lgamma(wide - num_candidates + 1) - torch.lgamma(wide + 1)).to(catalog.dtype)
            log_set = torch.where(_uniform_ok(catalog, candidates).all(1), log_set, -math.inf)
            inclusion = _mix(inclusion, log_share, epsilon)
            count = _mix(count, log_share, epsilon)
            draw = _mix(draw, log_set, epsilon)
    if validate:
        drawable = DeferredChecks()
        drawable.all_above(draw, -math.inf, "candidates must be a draw the logging policy can make: "
                           "a row holds an item masked (scored -inf) for it")
        drawable.run(agreement(catalog))
    return LoggedPropensities(inclusion, count, draw)


def _uniform_ok(catalog: CatalogScores, items: Tensor) -> Tensor:
    """``items [B, L]`` → ``[B, L]`` bool: True where the uniform draw can return the item."""
    with torch.no_grad():
        return (catalog.gather(items) > -math.inf).all(1)
