"""The policy-gradient losses as functions (the modules in :mod:`capg_rec.losses` call these).

Both take one forward signature::

    loss = capg_loss(logits, candidates, chosen, rewards)      # or vpg_loss(...)

``loss = -Σ_l α_l (r_l - b) · score`` per row, reduced over the batch, where the score is
``log π(A^K | x)`` for V-PG and ``log π(a_l ∈ A^K | x)`` for CA-PG; rewards, baselines and
position weights are constants. Sampling with replacement is ``vpg_loss(..., with_replacement=True)``
(V-PG-SwR) and ``capg_loss(..., method="with_replacement")`` (CA-PG-SwR, TOP1-PG).

Shapes: ``logits [B, N] | [B, M, N] | CatalogScores`` (``-inf`` masks an item), ``candidates
[B, K]`` (the ESR's draw, in draw order), ``chosen [B, L]`` (what the later stage showed, a subset
of the candidates), ``rewards [B, L]``, ``position_weights [L]``, ``baseline [B] | [B, L]``.
Output: a scalar, or ``[B]`` with ``reduction="none"``. An empty batch gives 0 (``"mean"`` and
``"sum"``) or ``[0]``. Half-precision logits are computed in float32 and give a float32 loss.

``validate_args`` (``None``: :func:`capg_rec.set_default_validate_args`) checks every value
(finite rewards, logits without NaN or ``+inf``, ids in range, distinct unmasked candidates,
chosen ⊆ candidates) in one host sync; with ``False`` there is none, and invalid inputs give
undefined results.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from capg_rec._checks import DeferredChecks, check_choice, check_count, check_flag, check_id_tensor, \
    resolve_validate_args
from capg_rec.catalog import CatalogScores, DenseCatalog, as_catalog
from capg_rec.marginals import DEFAULT_METHOD, InclusionMethod, _inclusion_log_prob, inclusion_method
from capg_rec.plackett_luce import _candidate_log_prob

__all__ = ["vpg_loss", "capg_loss"]

REDUCTIONS = ("mean", "sum", "none")


def vpg_loss(logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor, *,
             with_replacement: bool = False, position_weights: Tensor | None = None,
             baseline: Tensor | None = None, temperature: float = 1.0, reduction: str = "mean",
             validate_args: bool | None = None) -> Tensor:
    """Vanilla policy gradient: the score is ``log π(A^K | x)`` of the whole ordered draw; with
    ``with_replacement=True`` every position is normalised over the whole catalog (V-PG-SwR)."""
    check_flag("with_replacement", with_replacement)
    catalog, candidates, chosen, advantage = _prepare(logits, candidates, chosen, rewards, position_weights,
                                                      baseline, temperature, reduction, validate_args,
                                                      distinct=not with_replacement)
    score = _candidate_log_prob(catalog, candidates, with_replacement)  # [B]
    return _reduce(-(advantage.sum(1) * score), reduction)


def capg_loss(logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor, *,
              method: str | InclusionMethod = DEFAULT_METHOD, position_weights: Tensor | None = None,
              baseline: Tensor | None = None, temperature: float = 1.0, reduction: str = "mean",
              validate_args: bool | None = None) -> Tensor:
    """Credit-assigned policy gradient: the score of shown item ``a_l`` is ``log π(a_l ∈ A^K | x)``
    by ``method`` (an :class:`~capg_rec.marginals.InclusionMethod` or a registered name); K is
    ``candidates.shape[1]``."""
    method = inclusion_method(method)
    catalog, candidates, chosen, advantage = _prepare(logits, candidates, chosen, rewards, position_weights,
                                                      baseline, temperature, reduction, validate_args,
                                                      distinct=True)
    score = _inclusion_log_prob(catalog, chosen, candidates.shape[1], method)  # [B, L]
    return _reduce(-(advantage * score).sum(1), reduction)


def _prepare(logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor,
             position_weights: Tensor | None, baseline: Tensor | None, temperature: float, reduction: str,
             validate_args: bool | None, *, distinct: bool) -> tuple[CatalogScores, Tensor, Tensor, Tensor]:
    """Checks (structure always, values when validating, in one sync) → catalog, ids, advantage ``[B, L]``."""
    check_choice("reduction", reduction, REDUCTIONS)
    validate = resolve_validate_args(validate_args)
    catalog = as_catalog(logits, temperature, validate_args=False)
    batch, num_items = catalog.batch_size, catalog.num_items
    candidates = check_id_tensor("candidates", candidates, batch_size=batch)
    check_count("num_candidates (candidates.shape[1])", candidates.shape[1], high=num_items)
    chosen = check_id_tensor("chosen", chosen, batch_size=batch)
    length = chosen.shape[1]
    rewards = _float("rewards", rewards, ((batch, length),))
    advantage = rewards.detach()
    if baseline is not None:
        baseline = _float("baseline", baseline, ((batch,), (batch, length))).detach()
        advantage = advantage - (baseline.unsqueeze(1) if baseline.dim() == 1 else baseline)
    if position_weights is not None:
        advantage = advantage * _float("position_weights", position_weights, ((length,),)).detach()
    if validate:
        checks = DeferredChecks()
        if isinstance(catalog, DenseCatalog):
            checks.no_nan_or_inf("logits", catalog.scores, allow_masked=True)
        inside = checks.ids_in_range("candidates", candidates, num_items)  # chosen ⊆ candidates covers chosen
        if distinct:
            checks.distinct("candidates", candidates)
        checks.distinct("chosen", chosen)
        checks.require((chosen.unsqueeze(2) == candidates.unsqueeze(1)).any(2).all(),
                       "chosen must be a subset of candidates in every row (the LSR picks among them)")
        with torch.no_grad():  # a catalog call on every process, empty batches included (it may be collective)
            checks.require((catalog.gather(inside) > -math.inf).all(),
                           "candidates must not hold masked items (scored -inf): the ESR cannot draw them")
        for name, x in (("rewards", rewards), ("baseline", baseline), ("position_weights", position_weights)):
            if x is not None:
                checks.no_nan_or_inf(name, x)
        checks.run(catalog.agree)
    return catalog, candidates, chosen, advantage.to(catalog.dtype)


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
    total = per_row.sum()
    return total / max(per_row.shape[0], 1) if reduction == "mean" else total
