"""Policy-gradient losses for an ESR behind a fixed LSR, as drop-in ``torch.nn.Module`` losses.

All share one forward, so switching estimator is a one-line change::

    loss_fn = CAPGLoss(num_candidates=K)          # or VPGLoss(K), TOP1PGLoss(K), ...
    loss = loss_fn(logits, candidates, chosen, rewards)
    loss.backward()

``loss = -mean_B Σ_l α_l (r_l - b) · score``, where the score is ``log π(A^K | x)`` for V-PG and
``log π(a_l ∈ A^K | x)`` for CA-PG. Rewards and baselines are treated as constants.

Every input is checked (finite logits and rewards, ids in range, distinct candidates, chosen ⊆
candidates, shapes); as in ``torch.distributions``, ``validate_args=False`` skips the checks for
callers that build the inputs themselves (each costs a pass and a host sync), and invalid inputs
then give undefined results.
"""

from __future__ import annotations

import abc

import torch
from torch import Tensor, nn

from capg_rec._checks import all_finite, check_count, check_flag, check_items, check_positive
from capg_rec.catalog import CatalogScores, as_catalog
from capg_rec.marginals import DEFAULT_METHOD, METHODS, _inclusion_log_prob
from capg_rec.plackett_luce import _candidate_log_prob

__all__ = ["VPGLoss", "CAPGLoss", "TOP1PGLoss"]

_REDUCTIONS = ("mean", "sum", "none")


def _check_float(name: str, x: Tensor, shapes: tuple[tuple[int, ...], ...]) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point torch.Tensor, got "
                         f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
    if tuple(x.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, map(list, shapes)))}, "
                         f"got {list(x.shape)}")
    if not all_finite(x):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return x


class _PolicyGradientLoss(nn.Module, abc.ABC):
    """Shared forward: validation, advantages, reduction. Subclasses define ``score``."""

    def __init__(self, num_candidates: int, *, temperature: float = 1.0, reduction: str = "mean",
                 validate_args: bool = True) -> None:
        super().__init__()
        self.num_candidates = check_count("num_candidates", num_candidates)
        self.temperature = check_positive("temperature", temperature)
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction
        self.validate_args = check_flag("validate_args", validate_args)

    def forward(self, logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor, *,
                position_weights: Tensor | None = None, baseline: Tensor | None = None) -> Tensor:
        """``logits [B, N] | [B, M, N] | CatalogScores``, ``candidates [B, K]`` (the ESR draw, in
        draw order), ``chosen [B, L]`` (what the LSR showed), ``rewards [B, L]``,
        ``position_weights [L]`` (default ones), ``baseline [B] | [B, L]`` → scalar, or ``[B]``
        with ``reduction="none"``."""
        if self.validate_args:
            catalog, candidates, chosen = self._checked_items(logits, candidates, chosen)
            batch, length = chosen.shape
            rewards = _check_float("rewards", rewards, ((batch, length),))
            if baseline is not None:
                baseline = _check_float("baseline", baseline, ((batch,), (batch, length)))
            if position_weights is not None:
                position_weights = _check_float("position_weights", position_weights, ((length,),))
        else:
            catalog = as_catalog(logits, self.temperature, validate_args=False)
        advantage = rewards.detach()
        if baseline is not None:
            baseline = baseline.detach()
            advantage = advantage - (baseline.unsqueeze(1) if baseline.dim() == 1 else baseline)
        if position_weights is not None:
            advantage = advantage * position_weights.detach()
        per_row = -self._weighted_score(catalog, candidates, chosen, advantage.to(catalog.dtype))
        if self.reduction == "mean":
            return per_row.mean()
        if self.reduction == "sum":
            return per_row.sum()
        return per_row

    def _checked_items(self, logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor
                       ) -> tuple[CatalogScores, Tensor, Tensor]:
        catalog = as_catalog(logits, self.temperature)
        batch = catalog.batch_size
        check_count("num_candidates", self.num_candidates, high=catalog.num_items)
        candidates = check_items("candidates", candidates, batch_size=batch, num_items=catalog.num_items,
                                 width=self.num_candidates)
        chosen = check_items("chosen", chosen, batch_size=batch, num_items=catalog.num_items)
        if not bool((chosen.unsqueeze(2) == candidates.unsqueeze(1)).any(2).all()):
            raise ValueError("chosen must be a subset of candidates in every row (the LSR picks among them)")
        return catalog, candidates, chosen

    @abc.abstractmethod
    def _weighted_score(self, catalog: CatalogScores, candidates: Tensor, chosen: Tensor,
                        advantage: Tensor) -> Tensor:
        """``Σ_l advantage_l · score_l`` per row → ``[B]``."""

    def extra_repr(self) -> str:
        return (f"num_candidates={self.num_candidates}, temperature={self.temperature}, reduction={self.reduction!r}"
                + ("" if self.validate_args else ", validate_args=False"))


class VPGLoss(_PolicyGradientLoss):
    """Vanilla policy gradient: pushes up ``log π(A^K | x)`` of the whole ordered draw.

    With ``with_replacement=True`` the score normalises every position over the whole catalog
    (V-PG-SwR), which is cheaper and numerically gentler but biased.
    """

    def __init__(self, num_candidates: int, *, with_replacement: bool = False, temperature: float = 1.0,
                 reduction: str = "mean", validate_args: bool = True) -> None:
        super().__init__(num_candidates, temperature=temperature, reduction=reduction, validate_args=validate_args)
        self.with_replacement = bool(with_replacement)

    def _weighted_score(self, catalog: CatalogScores, candidates: Tensor, chosen: Tensor,
                        advantage: Tensor) -> Tensor:
        score = _candidate_log_prob(catalog, candidates, self.with_replacement)
        return advantage.sum(1) * score

    def extra_repr(self) -> str:
        return super().extra_repr() + f", with_replacement={self.with_replacement}"


class CAPGLoss(_PolicyGradientLoss):
    """Credit-assigned policy gradient: pushes up ``log π(a_l ∈ A^K | x)`` for each shown item.

    ``method`` picks how the inclusion probability is computed (see :mod:`capg_rec.marginals`):
    ``"exact"``, ``"mean_field"``, ``"plugin"`` (the paper's), or ``"swr"`` (= :class:`TOP1PGLoss`).
    """

    def __init__(self, num_candidates: int, *, method: str = DEFAULT_METHOD, temperature: float = 1.0,
                 reduction: str = "mean", validate_args: bool = True) -> None:
        super().__init__(num_candidates, temperature=temperature, reduction=reduction, validate_args=validate_args)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.method = method

    def _weighted_score(self, catalog: CatalogScores, candidates: Tensor, chosen: Tensor,
                        advantage: Tensor) -> Tensor:
        score = _inclusion_log_prob(catalog, chosen, self.num_candidates, self.method)
        return (advantage * score).sum(1)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", method={self.method!r}"


class TOP1PGLoss(CAPGLoss):
    """CA-PG-SwR (TOP1-PG when M = 1): ``log Σ_k π_{m(k)}(a_l)`` with full-catalog softmaxes."""

    def __init__(self, num_candidates: int, *, temperature: float = 1.0, reduction: str = "mean",
                 validate_args: bool = True) -> None:
        super().__init__(num_candidates, method="swr", temperature=temperature, reduction=reduction,
                         validate_args=validate_args)
