"""The policy-gradient losses as functions (the modules in :mod:`capg_rec.losses` call these).

Both take one forward signature::

    loss = capg_loss(logits, candidates, chosen, rewards)      # or vpg_loss(...)

``loss = -Σ_l α_l (r_l - b) · score`` per row, reduced over the batch, where the score is
``log π(A^K | x)`` for V-PG and ``log π(a_l ∈ A^K | x)`` for CA-PG; rewards, baselines and
position weights are constants. A baseline ``b`` leaves V-PG's expected gradient unchanged, but moves CA-PG's by
``-b Σ_a ρ(a) ∇π(a ∈ A^K)`` (ρ(a): the chance that the later stage shows a retrieved ``a``; zero where it is the
same for every item, as at L = K). Sampling with replacement is ``vpg_loss(..., with_replacement=True)``
(V-PG-SwR) and ``capg_loss(..., method="with_replacement")`` (CA-PG-SwR, TOP1-PG).

The off-policy losses take the same arguments plus what the logging ESR π₀ stored for the row
(its log-propensities) and learn from logs that π₀ produced: ``offpolicy_capg_loss`` (marginal
importance weights), ``offpolicy_vpg_loss`` (whole-set weights) and ``topk_reinforce_loss``
(Chen et al. 2019). Their weights are computed in log space, detached (constants, like the
rewards) and capped, so that they are never ``inf`` or NaN.

Shapes: ``logits [B, N] | [B, M, N] | CatalogScores`` (``-inf`` masks an item), ``candidates
[B, K]`` (the ESR's draw, in draw order), ``chosen [B, L]`` (what the later stage showed, a subset
of the candidates), ``rewards [B, L]``, ``position_weights [L]``, ``baseline [B] | [B, 1] | [B, L]``.
Output: a scalar, or ``[B]`` with ``reduction="none"``. An empty batch gives 0 (``"mean"`` and
``"sum"``) or ``[0]``. Half-precision logits are computed in float32 and give a float32 loss.

``validate_args`` (``None``: :func:`capg_rec.set_default_validate_args`) checks every value
(finite rewards, logits without NaN or ``+inf``, ids in range, distinct unmasked candidates,
chosen ⊆ candidates): CPU tensors through numpy views, others in one host sync; with ``False``
there is none, and invalid inputs give undefined results.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from capg_rec._checks import DeferredChecks, check_choice, check_count, check_flag, check_id_tensor, is_number, \
    check_positive, check_readable, check_same_device, resolve_validate_args
from capg_rec.catalog import CatalogScores, DenseCatalog, agreement, as_catalog, check_scaled, narrowest
from capg_rec.marginals import DEFAULT_METHOD, LOG_PROB_TOLERANCE, InclusionMethod, WithReplacement, \
    _inclusion_log_prob, _known_lookups, inclusion_method
from capg_rec.plackett_luce import _candidate_log_prob, _expert_index, _unresolved_message, needed_per_block, \
    unmasked_needs, unresolved_draws

__all__ = ["vpg_loss", "capg_loss", "offpolicy_capg_loss", "offpolicy_vpg_loss", "topk_reinforce_loss",
           "importance_weights"]

REDUCTIONS = ("mean", "sum", "none")



def vpg_loss(logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor, *,
             with_replacement: bool = False, position_weights: Tensor | None = None,
             baseline: Tensor | float | None = None, temperature: float = 1.0, reduction: str = "mean",
             num_candidates: int | None = None, validate_args: bool | None = None) -> Tensor:
    """Vanilla policy gradient: the score is ``log π(A^K | x)`` of the whole ordered draw; with
    ``with_replacement=True`` every position is normalised over the whole catalog (V-PG-SwR).

    ``num_candidates``, in every loss of this module: the K that ``candidates [B, K]`` must have (``None``: any;
    the loss modules pass theirs). Like every input check, it fails in every process that shares a catalog."""
    with_replacement = check_flag("with_replacement", with_replacement)
    catalog, candidates, chosen, advantage, scoring = _prepare(logits, candidates, chosen, rewards, position_weights,
                                                               baseline, temperature, reduction, validate_args,
                                                               width=num_candidates, distinct=not with_replacement,
                                                               ordered=not with_replacement)
    with scoring:
        score = _candidate_log_prob(catalog, candidates, with_replacement)  # [B]
    return _reduce(-(advantage.sum(1) * score), reduction)


def capg_loss(logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor, *,
              method: str | InclusionMethod = DEFAULT_METHOD, position_weights: Tensor | None = None,
              baseline: Tensor | float | None = None, temperature: float = 1.0, reduction: str = "mean",
              num_candidates: int | None = None, validate_args: bool | None = None) -> Tensor:
    """Credit-assigned policy gradient: the score of shown item ``a_l`` is ``log π(a_l ∈ A^K | x)``
    by ``method`` (an :class:`~capg_rec.marginals.InclusionMethod` or a registered name); K is
    ``candidates.shape[1]``."""
    method = inclusion_method(method)
    catalog, candidates, chosen, advantage, scoring = _prepare(logits, candidates, chosen, rewards, position_weights,
                                                               baseline, temperature, reduction, validate_args,
                                                               width=num_candidates, distinct=True,
                                                               inclusion=method.is_probability,
                                                               trusted=_known_lookups(method))
    with scoring:
        score = _inclusion_log_prob(catalog, chosen, candidates.shape[1], method,
                                    resolve_validate_args(validate_args))  # [B, L]
    return _reduce(-(advantage * score).sum(1), reduction)


def offpolicy_capg_loss(logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor,
                        logged_log_inclusion: Tensor, *, method: str | InclusionMethod = DEFAULT_METHOD,
                        max_weight: float | None = None, self_normalize: bool = False,
                        position_weights: Tensor | None = None, baseline: Tensor | float | None = None,
                        temperature: float = 1.0, reduction: str = "mean", num_candidates: int | None = None,
                        validate_args: bool | None = None) -> Tensor:
    """Off-policy CA-PG from logs of a logging ESR π₀: ``-Σ_l w_l α_l (r_l - b) log π_θ(a_l ∈ A^K | x)``.

    ``logged_log_inclusion [B, L]`` is ``log π₀(a_l ∈ A^K | x)`` of each shown item, stored when the
    row was served. The weight ``w_l = π_θ(a_l ∈ A^K) / π₀(a_l ∈ A^K)`` is computed in log space
    from the detached score (a constant: the gradient is ``w_l ∇ log π_θ``), then capped at
    ``max_weight`` and, whatever it is, just below ``sqrt`` of the largest value of the dtype (that of the logits,
    if narrower: 256 for float16 logits), so that the weight and its products stay finite (a gradient, the
    weight times the advantage times ``∇ log π_θ``, may still overflow float16 for large rewards).
    Without cap, baseline or position weights, the expected negative gradient under π₀ is
    ``Σ_a r̄(a) ρ₀(a) ∇π_θ(a ∈ A^K)`` per context, ``r̄(a) = E[r | a]`` and
    ``ρ₀(a) = P_{A~π₀}(LSR shows a | a ∈ A)``: the paper's Lemma with the LSR's propensity taken under
    the logging ESR (with π₀ = π_θ it is on-policy CA-PG).

    ``self_normalize=True`` (SNIPS) divides every (capped) weight by the mean weight over the
    batch's ``B × L`` shown items, so that the weights of a batch average 1: the ``"mean"`` loss
    is then ``-L · Σ_{b,l} w α (r - b) score / Σ_{b,l} w``. Consistent, not unbiased. On a catalog
    sharded over ranks the mean is the global batch's (every rank's rows), as one process would take it.

    ``method="with_replacement"`` (off-policy CA-PG-SwR): the score is then the expected count
    ``Σ_k π_{m(k)}(a)``, and ``logged_log_inclusion`` must be the logging ESR's log expected count
    (at most ``log K``) on the same footing; the weight is the ratio of expected counts.
    """
    method = inclusion_method(method)
    width = candidates.shape[1] if isinstance(candidates, Tensor) and candidates.dim() == 2 else 1
    bound = 0.0 if method.is_probability else math.log(max(width, 1))
    max_weight, self_normalize = _weight_options(max_weight, self_normalize)
    catalog, candidates, chosen, advantage, scoring = _prepare(
        logits, candidates, chosen, rewards, position_weights, baseline, temperature, reduction, validate_args,
        width=num_candidates, distinct=True, inclusion=method.is_probability, trusted=_known_lookups(method),
        logged=("logged_log_inclusion", logged_log_inclusion, True, bound))
    with scoring:
        score = _inclusion_log_prob(catalog, chosen, candidates.shape[1], method,
                                    resolve_validate_args(validate_args))  # [B, L]
    weight = _weights(catalog, score - logged_log_inclusion.to(score.dtype), max_weight, self_normalize, reduction)
    return _reduce(-(weight * advantage * _weighed(weight, score)).sum(1), reduction)


def offpolicy_vpg_loss(logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor,
                       logged_log_prob: Tensor, *, max_weight: float | None = None, self_normalize: bool = False,
                       position_weights: Tensor | None = None, baseline: Tensor | float | None = None,
                       temperature: float = 1.0, reduction: str = "mean", num_candidates: int | None = None,
                       validate_args: bool | None = None) -> Tensor:
    """Off-policy V-PG with the whole-set weight ``w = π_θ(A^K) / π₀(A^K)`` of the ordered draw:
    ``-w Σ_l α_l (r_l - b) log π_θ(A^K | x)``.

    ``logged_log_prob [B]`` is ``log π₀(A^K | x)`` of the logged ordered draw. Without a cap its
    expectation under π₀ is the true policy gradient; its variance grows with K (the naive
    baseline). ``max_weight`` and ``self_normalize`` (over the global batch's B rows) as in
    :func:`offpolicy_capg_loss`.
    """
    max_weight, self_normalize = _weight_options(max_weight, self_normalize)
    catalog, candidates, chosen, advantage, scoring = _prepare(
        logits, candidates, chosen, rewards, position_weights, baseline, temperature, reduction, validate_args,
        width=num_candidates, distinct=True, ordered=True, logged=("logged_log_prob", logged_log_prob, False, 0.0))
    with scoring:
        score = _candidate_log_prob(catalog, candidates, False)  # [B]
    weight = _weights(catalog, score - logged_log_prob.to(score.dtype), max_weight, self_normalize, reduction)
    return _reduce(-(weight * advantage.sum(1) * _weighed(weight, score)), reduction)


def topk_reinforce_loss(logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor,
                        logged_log_item_prob: Tensor, *, max_weight: float | None = None,
                        self_normalize: bool = False, position_weights: Tensor | None = None,
                        baseline: Tensor | float | None = None, temperature: float = 1.0, reduction: str = "mean",
                        num_candidates: int | None = None, validate_args: bool | None = None) -> Tensor:
    """Top-K off-policy corrected REINFORCE (Chen et al., WSDM 2019):
    ``-Σ_l (π_θ(a_l) / β(a_l)) λ_K(a_l) α_l (r_l - b) log π_θ(a_l | x)``.

    Chen et al. model the policy as one softmax ``π_θ(a | x)`` from which the K items are drawn
    independently (with replacement); the probability that ``a`` is among them is
    ``α_θ(a) = 1 - (1 - π_θ(a))^K`` and ``∇α_θ(a) = λ_K(a) π_θ(a) ∇log π_θ(a)`` with the multiplier
    ``λ_K(a) = K (1 - π_θ(a))^{K-1}``; the off-policy correction is the single-draw ratio
    ``π_θ(a) / β(a)``, β the logging (behaviour) policy. Here ``π_θ(a)`` is the single-draw
    probability ``softmax(s)(a)``; for a mixture of M experts, the average over the K positions of
    ``softmax_{m(k)}(a)`` (the expected count over K). ``logged_log_item_prob [B, L]`` is
    ``log β(a_l | x)`` on the same definition. The ratio (only) is capped at ``max_weight`` and
    self-normalised as in :func:`offpolicy_capg_loss`; ``λ_K ≤ K`` is not. Both are constants.
    """
    max_weight, self_normalize = _weight_options(max_weight, self_normalize)
    catalog, candidates, chosen, advantage, scoring = _prepare(
        logits, candidates, chosen, rewards, position_weights, baseline, temperature, reduction, validate_args,
        width=num_candidates, distinct=True, logged=("logged_log_item_prob", logged_log_item_prob, True, 0.0))
    num_candidates = candidates.shape[1]
    with scoring:
        score = _inclusion_log_prob(catalog, chosen, num_candidates, WithReplacement()) - math.log(num_candidates)
    ratio = _weights(catalog, score - logged_log_item_prob.to(score.dtype), max_weight, self_normalize, reduction)
    multiplier = ratio
    if num_candidates > 1:  # λ_1 = 1 (0 · log 0 would be NaN at π_θ(a) = 1)
        single = score.detach().exp().clamp(max=1.0)  # λ_K → 0 as π → 1, so 1 - π's rounding there is harmless
        multiplier = ratio * (num_candidates * (1.0 - single) ** (num_candidates - 1))
    return _reduce(-(multiplier * advantage * _weighed(ratio, score)).sum(1), reduction)


def _weighed(weight: Tensor, score: Tensor) -> Tensor:
    """``score`` where its importance ``weight`` is positive, else 0 (with no gradient): a logged draw or item this
    ESR cannot make (``score = -inf``, weight 0) adds nothing, rather than ``0 · -inf``."""
    return torch.where(weight > 0, score, 0.0)


def importance_weights(log_ratio: Tensor, *, max_weight: float | None = None,
                       self_normalize: bool = False) -> Tensor:
    """``exp(log_ratio)``, detached and capped at ``max_weight`` (``None``: just below ``sqrt`` of the dtype's
    largest value) → the shape of ``log_ratio``; ``-inf`` gives 0. With ``self_normalize`` the weights, capped
    at ``max_weight`` only (the normalisation cancels their scale), are divided by their mean over all entries (a
    batch of zeros stays zero), then capped just below ``sqrt`` of the dtype's largest value. Values are not
    checked (NaN gives NaN): the losses that call it check their inputs."""
    if not isinstance(log_ratio, Tensor):
        raise TypeError(f"log_ratio must be a torch.Tensor, got {type(log_ratio).__name__}")
    if not log_ratio.is_floating_point():
        raise TypeError(f"log_ratio must have a floating dtype, got {log_ratio.dtype}")
    return _weights(None, log_ratio, *_weight_options(max_weight, self_normalize))


def _weights(catalog: CatalogScores | None, log_ratio: Tensor, max_weight: float | None, self_normalize: bool,
             reduction: str = "mean") -> Tensor:
    """:func:`importance_weights` of checked options, capped also for the ``catalog``'s gradient dtype if narrower
    (float16 logits: below √65504). Self-normalised ones are capped at ``max_weight`` only before the normalisation,
    which cancels their scale (a dtype's cap there would change their ratios: a float32 or float16 loss unlike a
    float64 one), and after it at the cap of their own dtype under the ``"mean"`` ``reduction`` (a weight is at most
    the number of weights, their mean being 1, and its gradient at most that over the number of rows: float16's cap
    of 256 there made a SNIPS loss of 2560 weights 10x smaller than float32's, found by review), or of the gradient
    dtype if narrower under ``"sum"`` and ``"none"`` (whose gradients, weights of up to the batch's size, would
    overflow float16)."""
    gradient_dtype = None if catalog is None else catalog._gradient_dtype
    if not self_normalize:
        weight = torch.exp(_capped_log_weights(log_ratio, max_weight, gradient_dtype))
        # exp of log(max_weight) may round a step above it (100.00000762939453 in float32)
        return weight if max_weight is None else weight.clamp(max=_at_most(max_weight, weight.dtype))
    log_weight = log_ratio.detach()
    if max_weight is not None:
        log_weight = log_weight.clamp(max=math.log(max_weight))
    weight = _relative_weights(log_weight)  # at most 1: no overflow in any dtype
    if catalog is None or type(catalog)._stack_batches is CatalogScores._stack_batches:  # one process: its mean
        mean = weight.mean() if weight.numel() else weight.new_ones(())
        weight = weight / torch.where(mean > 0, mean, 1.0)
    else:
        weight = (weight * _normalizer(log_weight, weight, catalog)).to(weight.dtype)  # in float64
    return weight.clamp(max=math.exp(_log_weight_cap(weight.dtype, None if reduction == "mean" else gradient_dtype)))


def _normalizer(log_weight: Tensor, relative: Tensor, catalog: CatalogScores) -> Tensor:
    """What turns ``relative`` (:func:`_relative_weights` of ``log_weight``) into weights of mean 1 over the global
    batch of the processes that share ``catalog`` (:meth:`CatalogScores._stack_batches`: a sharded catalog's ranks
    then normalise as one process over the whole batch would). A float64 scalar: this batch's largest weight over
    the global batch's (each batch's weights are relative to its own largest), over the global mean relative
    weight; 1 for a global batch of zeros or none. No host read."""
    top = log_weight.amax() if log_weight.numel() else log_weight.new_full((), -math.inf)
    stats = torch.stack([top.double(), relative.sum(dtype=torch.float64),
                         torch.tensor(float(log_weight.numel()), dtype=torch.float64, device=log_weight.device)])
    tops, sums, counts = catalog._stack_batches(stats).unbind(1)
    best = tops.amax()

    def scale(t: Tensor) -> Tensor:  # a batch's largest weight over the global batch's (+inf: an infinite weight)
        return torch.where(best == math.inf, (t == math.inf).double(), torch.where(best.isfinite(), (t - best).exp(),
                                                                                     0.0))

    mean = (scale(tops) * sums).sum() / counts.sum().clamp(min=1.0)
    return scale(top) / torch.where(mean > 0, mean, 1.0)


def _relative_weights(log_weight: Tensor) -> Tensor:
    """``exp(log_weight)`` over its largest: weights far below 1 do not underflow to all zeros (self-normalised
    estimates and effective sample sizes do not depend on the scale); all ``-inf`` (or none) gives zeros, and
    ``+inf`` entries, the limit: 1 each, every finite one 0."""
    top = log_weight.amax() if log_weight.numel() else log_weight.new_zeros(())
    relative = torch.exp(log_weight - torch.where(top.isfinite(), top, 0.0))
    return torch.where(top == math.inf, (log_weight == math.inf).to(relative.dtype), relative)


def _at_most(value: float, dtype: torch.dtype) -> float:
    """The largest number of ``dtype`` at most ``value > 0`` (its largest finite number, for a ``value`` beyond it), in
    Python's arithmetic (exact: powers of two; no tensor, which torch.compile would trace)."""
    finfo = torch.finfo(dtype)
    if value >= finfo.max:
        return finfo.max
    _, exponent = math.frexp(value)  # value in [2^(exponent - 1), 2^exponent)
    step = max(math.ldexp(finfo.eps, exponent - 1), finfo.tiny * finfo.eps)  # the dtype's spacing there
    return math.floor(value / step) * step


def _capped_log_weights(log_ratio: Tensor, max_weight: float | None, also: torch.dtype | None = None) -> Tensor:
    """``log_ratio`` detached and capped at ``log max_weight`` and at :func:`_largest_log_weight` of its dtype (or of
    ``also``, if narrower), so that a weight and its square stay finite."""
    log_ratio = log_ratio.detach()
    cap = _log_weight_cap(log_ratio.dtype, also)
    if max_weight is not None:
        cap = min(cap, math.log(check_positive("max_weight", max_weight)))
    return log_ratio.clamp(max=cap)


def _log_weight_cap(dtype: torch.dtype, also: torch.dtype | None) -> float:
    """:func:`_largest_log_weight` of ``dtype``, or of ``also`` if narrower."""
    dtype = dtype if also is None else narrowest(dtype, also)
    return _LARGEST_LOG_WEIGHT.get(dtype) or _largest_log_weight(dtype)


def _largest_log_weight(dtype: torch.dtype) -> float:
    """About half the log of the dtype's largest value: the largest log-weight (a value of ``dtype``) whose weight,
    exponentiated in ``dtype``, has a finite square there, less one rounding step (another device's ``exp`` may
    round the other way). Half the log itself is not it: its exponential rounds up, and the square overflows."""
    cap = torch.tensor(math.log(torch.finfo(dtype).max) / 2, dtype=dtype)
    while not torch.isfinite(torch.exp(cap) * torch.exp(cap)):
        cap = torch.nextafter(cap, torch.zeros_like(cap))
    return float(torch.nextafter(cap, torch.zeros_like(cap)))


_LARGEST_LOG_WEIGHT = {dtype: _largest_log_weight(dtype)
                       for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
"""The default cap of the log-weights, by dtype (made once: ``torch.compile`` does not trace its search)."""


def _weight_options(max_weight: float | None, self_normalize: bool) -> tuple[float | None, bool]:
    self_normalize = check_flag("self_normalize", self_normalize)
    return (None if max_weight is None else check_positive("max_weight", max_weight)), self_normalize


def _prepare(logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor,
             position_weights: Tensor | None, baseline: Tensor | None, temperature: float, reduction: str,
             validate_args: bool | None, *, width: int | None = None, distinct: bool, inclusion: bool = False,
             ordered: bool = False, trusted: bool = True, logged: tuple[str, Tensor, bool, float] | None = None
             ) -> tuple[CatalogScores, Tensor, Tensor, Tensor, contextlib.AbstractContextManager]:
    """Checks (structure always, values when validating, in one sync) → catalog, ids, advantage ``[B, L]`` and the
    context to score them in: once validated, the checks' agreement vouched for the candidates and chosen ids, so
    the catalog's own lookups of them skip their checks (:meth:`~capg_rec.CatalogScores._trusting`: no collective
    of their own). Only for ``trusted`` scoring, whose lookups are known: this module's and the library's inclusion
    methods (a method of your own may look up any id).

    ``inclusion``: the loss takes inclusion probabilities, whose methods assume that each expert block can draw
    its items whatever the earlier blocks took (:func:`~capg_rec.plackett_luce.check_enough_items`, as
    :func:`~capg_rec.marginals.inclusion_log_prob` does); with one expert, K distinct unmasked candidates imply
    it, unless they were logged (drawn by another ESR, they may hold items this one masks). (CA-PG-SwR's
    expected count needs no such assumption.) The inclusion methods and, with ``ordered``, the ordered-draw
    probability (V-PG's) also need no draw among scores beyond resolution
    (:func:`~capg_rec.plackett_luce.unresolved_draws`).

    ``logged = (name, tensor, per_item, bound)``: a logged log-propensity ``[B, L]`` (``per_item``)
    or ``[B]``, checked finite and ``<= bound + LOG_PROB_TOLERANCE``. Logged candidates were drawn by the
    logging ESR: they may hold items this ESR masks."""
    validate = resolve_validate_args(validate_args)
    catalog = as_catalog(logits, temperature, validate_args=False)
    batch, num_items = catalog.batch_size, catalog.num_items
    logged_name, log_propensity, per_item, bound = logged if logged is not None else (None, None, False, 0.0)
    agree = agreement(catalog) if validate else None
    failed = None
    try:
        check_choice("reduction", reduction, REDUCTIONS)
        if num_items == 0:
            raise ValueError("the catalog has no items (N = 0): a draw of K >= 1 candidates needs at least one")
        candidates = check_id_tensor("candidates", candidates, batch_size=batch, columns="K")
        if width is not None and candidates.shape[1] != check_count("num_candidates", width):  # the module's K
            raise ValueError(f"candidates must have num_candidates={width} columns, got {candidates.shape[1]}")
        check_count("num_candidates (candidates.shape[1])", candidates.shape[1], high=num_items)
        chosen = check_id_tensor("chosen", chosen, batch_size=batch)
        length = chosen.shape[1]
        if length > candidates.shape[1]:  # the later stage shows some of the K candidates
            raise ValueError(f"chosen must have at most K = {candidates.shape[1]} columns (the shown items are "
                             f"among the candidates), got {length}")
        rewards = _float("rewards", rewards, ((batch, length),))
        if baseline is not None:
            if is_number(baseline):  # one for every row (numpy's numbers too)
                baseline = torch.tensor(float(baseline), dtype=torch.promote_types(rewards.dtype, catalog.dtype),
                                        device=rewards.device)  # as wide as the advantage (below)
            if isinstance(baseline, Tensor) and baseline.dim() == 0:  # any device's, as torch broadcasts a scalar
                baseline = baseline.to(rewards.device).expand(batch)
            baseline = _float("baseline", baseline, ((batch,), (batch, 1), (batch, length))).detach()
        if position_weights is not None:
            position_weights = _float("position_weights", position_weights, ((length,),)).detach()
        if logged is not None:
            _float(logged_name, log_propensity, ((batch, length),) if per_item else ((batch,),))
            check_same_device(catalog.device, **{logged_name: log_propensity})
        check_same_device(catalog.device, candidates=candidates, chosen=chosen, rewards=rewards, baseline=baseline,
                          position_weights=position_weights)
    except (TypeError, ValueError) as err:
        if agree is None:  # one process, or no checks: raise here
            raise
        # Other processes go on to the checks' collectives: take part with inputs of the shapes they likely have,
        # fail the agreement (every process raises) and raise this error here.
        failed = err
        candidates, chosen = (_placeholder_ids(x, batch, catalog.device, w) for x, w in ((candidates, width),
                                                                                           (chosen, None)))
        length = chosen.shape[1]
        rewards = torch.zeros(batch, length, dtype=catalog.dtype, device=catalog.device)
        baseline = position_weights = None
        if logged is not None:
            logged = (logged_name, rewards if per_item else rewards[:, 0], per_item, bound)
    # In the wider of the rewards' dtype and the scores' (not the rewards' alone: half-precision rewards times
    # weights, or less a baseline, overflowed to inf, or rounded a float64 loss to their precision), then the scores'.
    wide = torch.promote_types(rewards.dtype, catalog.dtype)
    advantage = rewards.detach().to(wide)
    if baseline is not None:
        advantage = advantage - (baseline.unsqueeze(1) if baseline.dim() == 1 else baseline).to(wide)
    if position_weights is not None:
        advantage = advantage * position_weights.to(wide)
    if validate:
        if failed is None and isinstance(catalog, DenseCatalog):  # one process's
            check_readable("logits", catalog.scores)
        if isinstance(catalog, DenseCatalog) and temperature < 1.0 and catalog.scores.numel() and failed is None:
            check_scaled(logits, catalog.scores, temperature)  # a dense catalog is one process's: raise here
        try:
            _check_values(catalog, candidates, chosen, rewards, baseline, position_weights, logged, failed,
                          distinct=distinct, inclusion=inclusion, ordered=ordered)
        except ValueError:
            if failed is not None:  # the agreement failed with it: raise this process's own error
                raise failed from None
            raise
    advantage = advantage if advantage.dtype == catalog.dtype else advantage.to(catalog.dtype)
    return catalog, candidates, chosen, advantage, \
        catalog._trusting() if validate and trusted else contextlib.nullcontext()


@torch.compiler.disable
def _check_values(catalog: CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor, baseline: Tensor | None,
                  position_weights: Tensor | None, logged: tuple[str, Tensor, bool, float] | None,
                  failed: Exception | None, *, distinct: bool, inclusion: bool, ordered: bool) -> None:
    """:func:`_prepare`'s value checks, in one agreement of every process (``failed``: this process's inputs were
    malformed; they are placeholders here, and the agreement fails)."""
    num_items = catalog.num_items
    checks = DeferredChecks()
    # Every process takes this check first: when one failed on its inputs' types or shapes (and its placeholders take
    # as many checks as the others do), the checks still line up, and the others name that failure, not their own.
    checks.require(failed is None, _MALFORMED_ELSEWHERE if failed is None else str(failed))
    masked = far = True  # -inf scores, scores beyond resolution; other catalogs: a catalog call on every process
    if isinstance(catalog, DenseCatalog):
        masked, far = _check_logits(checks, catalog)
    inside = checks.draw_and_picks(candidates, chosen, num_items, distinct=distinct)
    for name, ids in (("candidates", candidates), ("chosen", chosen)):  # a placement holding only some rows:
        vouched = catalog._vouch(name, ids)  # the ids it can score, in the agreement below
        if vouched is not None:
            checks.require(*vouched)
    if masked and logged is None:  # only a masked (-inf) score fails this; logs were drawn by another ESR
        with torch.no_grad(), catalog._trusting():  # on every process, empty batches included; ids vouched for
            checks.all_above(_drawing_scores(catalog, inside), -math.inf,
                             "candidates must not hold masked items (scored -inf by the expert that drew them): "
                             "the ESR cannot draw them")
    if masked and inclusion and (catalog.num_experts > 1 or logged is not None):
        # one expert: K distinct candidates it can draw imply K unmasked items, but logged ones were drawn by another
        experts, needed, available = unmasked_needs(catalog, candidates.shape[1])
        counts = needed_per_block(candidates.shape[1], catalog.num_experts)  # on the host: no read-back of `needed`
        checks.all_above(available - needed, -1,
                         f"num_candidates={candidates.shape[1]} needs, under the experts {experts} "
                         f"of its blocks, {counts} unmasked items (as many as the positions up to the end of "
                         "each block), but a row has fewer (items scored -inf are masked): the inclusion "
                         "methods assume it (CA-PG-SwR does not)")
    if far and (inclusion or ordered) and isinstance(catalog, DenseCatalog):
        unresolved = unresolved_draws(catalog, candidates.shape[1], ordered=not inclusion).any()
        checks.require(not bool(unresolved) if unresolved.is_cpu else ~unresolved,
                       _unresolved_message(catalog, candidates.shape[1], "in a row"))
    for name, x in (("rewards", rewards), ("baseline", baseline), ("position_weights", position_weights)):
        if x is not None:
            checks.no_nan_or_inf(name, x)
    logged_name, log_propensity, _, bound = logged if logged is not None else (None, None, False, 0.0)
    if log_propensity is not None and log_propensity.numel():
        checks.no_nan_or_inf(logged_name, log_propensity)
        if torch.finfo(log_propensity.dtype).bits > torch.finfo(catalog.dtype).bits:  # the weights' dtype
            lowest = torch.finfo(catalog.dtype).min
            checks.all_above(log_propensity.detach().to(catalog.dtype), -math.inf,
                             f"{logged_name} must be finite in the scores' dtype {catalog.dtype} (below {lowest:.4g} "
                             f"it rounds to -inf there: a zero propensity)")
        checks.at_most(log_propensity, bound + LOG_PROB_TOLERANCE,
                       f"{logged_name} must be <= {bound:.6g} (a logged log-propensity: a probability is at "
                       f"most 1, an expected count at most K)")
    checks.run(agreement(catalog))


_MALFORMED_ELSEWHERE = "an input of the loss had the wrong type or shape"
"""What the other processes say (with " (in another process)") when one process's loss inputs were malformed."""


def _check_logits(checks: DeferredChecks, catalog: DenseCatalog) -> tuple[bool, bool]:
    """No NaN or ``+inf`` in a dense catalog's scores → whether a row may hold masked (``-inf``) scores, and unmasked
    ones beyond :func:`~capg_rec.catalog.resolution` below its best: in host memory, from the scores' range."""
    scores = catalog.scores.detach()
    host = checks._host(scores) if scores.numel() else None
    if host is None:
        masked = checks.no_nan_or_inf("logits", scores, allow_masked=True) or bool(scores.numel())
        return masked, masked
    low, high = float(host.min()), float(host.max())  # NaN propagates
    checks.require(high < math.inf, "logits must be finite or -inf (masked) (no NaN or +inf)")  # NaN fails too
    return low == -math.inf, not catalog._within_resolution(low, high)


def _placeholder_ids(ids: object, batch: int, device: torch.device, width: int | None = None) -> Tensor:
    """Zero ids ``[B, width]`` standing in for malformed ``ids`` (``width`` if given, else theirs where they have one,
    else 1)."""
    if width is None:
        width = ids.shape[1] if isinstance(ids, Tensor) and ids.dim() == 2 else 1
    return torch.zeros(batch, width, dtype=torch.long, device=device)


def _drawing_scores(catalog: CatalogScores, candidates: Tensor) -> Tensor:
    """``s_{m(k)}(a_k)``: each candidate's score under the expert that drew it → ``[B, K]`` (one
    ``[B, K]`` gather on a dense catalog rather than ``[B, M, K]``)."""
    if isinstance(catalog, DenseCatalog) and catalog.num_experts == 1:
        return catalog.scores[:, 0].gather(1, candidates)
    experts = _expert_index(candidates.shape[1], catalog.num_experts, candidates.device)
    if isinstance(catalog, DenseCatalog) and catalog.scores.is_contiguous():
        return catalog.scores.flatten(1).gather(1, experts * catalog.num_items + candidates)
    index = experts.view(1, 1, -1).expand(candidates.shape[0], 1, -1)
    return catalog.gather(candidates).gather(1, index)[:, 0]


def _float(name: str, x: object, shapes: tuple[tuple[int, ...], ...]) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if tuple(x.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, map(list, shapes)))}, got {list(x.shape)}")
    return x


def _reduce(per_row: Tensor, reduction: str) -> Tensor:
    """``[B]`` → the reduction; the mean of an empty batch is 0 (its gradient too), not NaN."""
    if reduction == "none":
        return per_row
    return per_row.mean() if reduction == "mean" and per_row.shape[0] else per_row.sum()
