"""Policy-gradient losses for an ESR behind a fixed LSR, as drop-in ``torch.nn.Module`` losses.

Each module holds its options and calls its function in :mod:`capg_rec.functional`, as
``torch.nn.NLLLoss`` calls ``torch.nn.functional.nll_loss``. All share one forward, so switching
estimator is a one-line change::

    loss_fn = CAPGLoss(num_candidates=K)          # or VPGLoss(K), CAPGLoss(K, method="plugin"), ...
    loss = loss_fn(logits, candidates, chosen, rewards)
    loss.backward()

The off-policy losses (training from logs of another ESR) take the logged propensities as one
more argument::

    loss_fn = OffPolicyCAPGLoss(num_candidates=K, max_weight=100.0)
    loss = loss_fn(logits, candidates, chosen, rewards, logged_log_inclusion)
"""

from __future__ import annotations

import warnings

from torch import Tensor, nn

from capg_rec import functional as F
from capg_rec._checks import check_choice, check_count, check_flag, check_positive
from capg_rec.catalog import CatalogScores
from capg_rec.marginals import DEFAULT_METHOD, InclusionMethod, inclusion_method

__all__ = ["VPGLoss", "CAPGLoss", "OffPolicyCAPGLoss", "OffPolicyVPGLoss", "TopKReinforceLoss"]


class _PolicyGradientLoss(nn.Module):
    """Options shared by the losses; subclasses call their function in :mod:`capg_rec.functional`."""

    def __init__(self, num_candidates: int, *, temperature: float, reduction: str,
                 validate_args: bool | None) -> None:
        super().__init__()
        self.num_candidates = check_count("num_candidates", num_candidates)
        self.temperature = check_positive("temperature", temperature)
        self.reduction = check_choice("reduction", reduction, F.REDUCTIONS)
        self.validate_args = None if validate_args is None else check_flag("validate_args", validate_args)

    def extra_repr(self) -> str:
        return (f"num_candidates={self.num_candidates}, temperature={self.temperature}, reduction={self.reduction!r}"
                + ("" if self.validate_args is None else f", validate_args={self.validate_args}"))


class VPGLoss(_PolicyGradientLoss):
    """Vanilla policy gradient: pushes up ``log π(A^K | x)`` of the whole ordered draw.

    Args:
        num_candidates: K, the ESR's draw size.
        with_replacement: normalise every position over the whole catalog (V-PG-SwR): cheaper
            and numerically gentler, but biased.
        temperature: τ of the ESR's softmax (logits are divided by it).
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` over the batch.
        validate_args: check input values (one host sync); ``None``: the module default
            (:func:`capg_rec.set_default_validate_args`).

    Shape:
        - logits: ``[B, N]``, ``[B, M, N]`` (``-inf`` masks an item) or a :class:`~capg_rec.CatalogScores`
        - candidates: ``[B, K]`` in draw order; chosen: ``[B, L]`` ⊆ candidates; rewards: ``[B, L]``
        - position_weights: ``[L]``; baseline: ``[B]``, ``[B, 1]``, ``[B, L]`` or one for every row (a
          0-dim tensor or a Python number)
        - output: scalar, or ``[B]`` with ``reduction="none"``

    Example:
        >>> loss_fn = VPGLoss(num_candidates=10)
        >>> logits = torch.randn(4, 100, requires_grad=True)
        >>> candidates = capg_rec.sample_candidates(logits.detach(), 10)
        >>> loss = loss_fn(logits, candidates, candidates[:, :2], torch.rand(4, 2))
        >>> loss.backward()
    """

    def __init__(self, num_candidates: int, *, with_replacement: bool = False, temperature: float = 1.0,
                 reduction: str = "mean", validate_args: bool | None = None) -> None:
        super().__init__(num_candidates, temperature=temperature, reduction=reduction, validate_args=validate_args)
        self.with_replacement = check_flag("with_replacement", with_replacement)

    def forward(self, logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor, *,
                position_weights: Tensor | None = None, baseline: Tensor | float | None = None) -> Tensor:
        return F.vpg_loss(logits, candidates, chosen, rewards, with_replacement=self.with_replacement,
                          position_weights=position_weights, baseline=baseline, temperature=self.temperature,
                          reduction=self.reduction, num_candidates=self.num_candidates,
                          validate_args=self.validate_args)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", with_replacement={self.with_replacement}"


class CAPGLoss(_PolicyGradientLoss):
    """Credit-assigned policy gradient: pushes up ``log π(a_l ∈ A^K | x)`` for each shown item.

    Args:
        num_candidates: K, the ESR's draw size.
        method: how the inclusion probability is computed: an
            :class:`~capg_rec.marginals.InclusionMethod` (``MeanField()``, ``PlugIn()``, ``Exact()``,
            ``WithReplacement()`` for CA-PG-SwR / TOP1-PG, or your own) or a registered name
            (``"mean_field"``, the default; ``"plugin"``, ``"exact"``, ``"with_replacement"``).
        temperature, reduction, validate_args: as in :class:`VPGLoss`.

    Shape:
        As :class:`VPGLoss`.

    Example:
        >>> loss_fn = CAPGLoss(num_candidates=10)                 # or method="with_replacement"
        >>> logits = torch.randn(4, 100, requires_grad=True)
        >>> candidates = capg_rec.sample_candidates(logits.detach(), 10)
        >>> loss = loss_fn(logits, candidates, candidates[:, :2], torch.rand(4, 2))
        >>> loss.backward()
    """

    def __init__(self, num_candidates: int, *, method: str | InclusionMethod = DEFAULT_METHOD,
                 temperature: float = 1.0, reduction: str = "mean", validate_args: bool | None = None) -> None:
        super().__init__(num_candidates, temperature=temperature, reduction=reduction, validate_args=validate_args)
        self.method = inclusion_method(method)

    def forward(self, logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor, *,
                position_weights: Tensor | None = None, baseline: Tensor | float | None = None) -> Tensor:
        return F.capg_loss(logits, candidates, chosen, rewards, method=self.method,
                           position_weights=position_weights, baseline=baseline, temperature=self.temperature,
                           reduction=self.reduction, num_candidates=self.num_candidates,
                          validate_args=self.validate_args)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", method={self.method!r}"


class _OffPolicyLoss(_PolicyGradientLoss):
    """Options shared by the off-policy losses: the weight cap and self-normalisation."""

    def __init__(self, num_candidates: int, *, max_weight: float | None = None, self_normalize: bool = False,
                 temperature: float = 1.0, reduction: str = "mean", validate_args: bool | None = None) -> None:
        super().__init__(num_candidates, temperature=temperature, reduction=reduction, validate_args=validate_args)
        self.max_weight = None if max_weight is None else check_positive("max_weight", max_weight)
        self.self_normalize = check_flag("self_normalize", self_normalize)

    def _options(self) -> dict:
        return dict(max_weight=self.max_weight, self_normalize=self.self_normalize, temperature=self.temperature,
                    reduction=self.reduction, num_candidates=self.num_candidates, validate_args=self.validate_args)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", max_weight={self.max_weight}, self_normalize={self.self_normalize}"


class OffPolicyCAPGLoss(_OffPolicyLoss):
    """Off-policy CA-PG: CA-PG on rows logged by another ESR π₀, each shown item weighted by
    ``π_θ(a_l ∈ A^K) / π₀(a_l ∈ A^K)`` (see :func:`capg_rec.functional.offpolicy_capg_loss`).

    Args:
        num_candidates: K, the logging ESR's draw size.
        method: the inclusion method of π_θ's score and weight, as in :class:`CAPGLoss`. With
            ``"with_replacement"`` the logged value must be π₀'s log expected count.
        max_weight: cap of the weights (``None``: only the overflow cap).
        self_normalize: divide the weights by their mean over the batch's shown items (SNIPS; every rank's
            rows on a sharded catalog).
        temperature, reduction, validate_args: as in :class:`VPGLoss`.

    Shape:
        As :class:`VPGLoss`, plus ``logged_log_inclusion [B, L]``: ``log π₀(a_l ∈ A^K | x)``.

    Example:
        >>> loss_fn = OffPolicyCAPGLoss(num_candidates=10, max_weight=100.0)
        >>> logits = torch.randn(4, 100, requires_grad=True)
        >>> logged = torch.randn(4, 100)                       # the logging ESR's logits
        >>> candidates = capg_rec.sample_candidates(logged, 10)
        >>> chosen = candidates[:, :2]
        >>> logged_incl = capg_rec.inclusion_log_prob(logged, chosen, 10)
        >>> loss = loss_fn(logits, candidates, chosen, torch.rand(4, 2), logged_incl)
        >>> loss.backward()
    """

    def __init__(self, num_candidates: int, *, method: str | InclusionMethod = DEFAULT_METHOD,
                 max_weight: float | None = None, self_normalize: bool = False, temperature: float = 1.0,
                 reduction: str = "mean", validate_args: bool | None = None) -> None:
        super().__init__(num_candidates, max_weight=max_weight, self_normalize=self_normalize,
                         temperature=temperature, reduction=reduction, validate_args=validate_args)
        self.method = inclusion_method(method)

    def forward(self, logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor,
                logged_log_inclusion: Tensor | None = None, *, position_weights: Tensor | None = None,
                baseline: Tensor | float | None = None, logged_log_propensity: Tensor | None = None) -> Tensor:
        if logged_log_propensity is not None:  # the earlier name of this argument
            if logged_log_inclusion is not None:
                raise TypeError("pass logged_log_inclusion only (logged_log_propensity is its deprecated name)")
            warnings.warn("logged_log_propensity is deprecated: pass logged_log_inclusion", DeprecationWarning,
                          stacklevel=2)
            logged_log_inclusion = logged_log_propensity
        if logged_log_inclusion is None:
            raise TypeError("OffPolicyCAPGLoss.forward() missing its argument logged_log_inclusion")
        return F.offpolicy_capg_loss(logits, candidates, chosen, rewards, logged_log_inclusion, method=self.method,
                                     position_weights=position_weights, baseline=baseline, **self._options())

    def extra_repr(self) -> str:
        return super().extra_repr() + f", method={self.method!r}"


class OffPolicyVPGLoss(_OffPolicyLoss):
    """Off-policy V-PG with the whole-set weight ``π_θ(A^K) / π₀(A^K)`` of the ordered draw
    (see :func:`capg_rec.functional.offpolicy_vpg_loss`); unbiased, with a variance that grows
    with K.

    Args:
        num_candidates, max_weight, self_normalize: as in :class:`OffPolicyCAPGLoss` (no method;
            self-normalisation is over the B rows).
        temperature, reduction, validate_args: as in :class:`VPGLoss`.

    Shape:
        As :class:`VPGLoss`, plus ``logged_log_prob [B]``: ``log π₀(A^K | x)``.

    Example:
        >>> loss_fn = OffPolicyVPGLoss(num_candidates=10, max_weight=100.0)
        >>> logits = torch.randn(4, 100, requires_grad=True)
        >>> logged = torch.randn(4, 100)                       # the logging ESR's logits
        >>> candidates = capg_rec.sample_candidates(logged, 10)
        >>> logged_prob = capg_rec.candidate_log_prob(logged, candidates)
        >>> loss = loss_fn(logits, candidates, candidates[:, :2], torch.rand(4, 2), logged_prob)
        >>> loss.backward()
    """

    def forward(self, logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor,
                logged_log_prob: Tensor, *, position_weights: Tensor | None = None,
                baseline: Tensor | float | None = None) -> Tensor:
        return F.offpolicy_vpg_loss(logits, candidates, chosen, rewards, logged_log_prob,
                                    position_weights=position_weights, baseline=baseline, **self._options())


class TopKReinforceLoss(_OffPolicyLoss):
    """Chen et al. (2019)'s top-K off-policy corrected REINFORCE: each shown item weighted by
    ``(π_θ(a) / β(a)) · K (1 - π_θ(a))^{K-1}`` with single-draw probabilities, score
    ``log π_θ(a)`` (see :func:`capg_rec.functional.topk_reinforce_loss`).

    Args:
        num_candidates, max_weight, self_normalize: as in :class:`OffPolicyCAPGLoss` (no method; the cap
            applies to ``π_θ / β``).
        temperature, reduction, validate_args: as in :class:`VPGLoss`.

    Shape:
        As :class:`VPGLoss`, plus ``logged_log_item_prob [B, L]``: ``log β(a_l | x)``.

    Example:
        >>> loss_fn = TopKReinforceLoss(num_candidates=10, max_weight=100.0)
        >>> logits = torch.randn(4, 100, requires_grad=True)
        >>> logged = torch.randn(4, 100)                       # the logging (behaviour) policy's logits
        >>> candidates = capg_rec.sample_candidates(logged, 10)
        >>> chosen = candidates[:, :2]
        >>> beta = logged.log_softmax(1).gather(1, chosen)    # log β(a_l | x)
        >>> loss = loss_fn(logits, candidates, chosen, torch.rand(4, 2), beta)
        >>> loss.backward()
    """

    def forward(self, logits: Tensor | CatalogScores, candidates: Tensor, chosen: Tensor, rewards: Tensor,
                logged_log_item_prob: Tensor, *, position_weights: Tensor | None = None,
                baseline: Tensor | float | None = None) -> Tensor:
        return F.topk_reinforce_loss(logits, candidates, chosen, rewards, logged_log_item_prob,
                                     position_weights=position_weights, baseline=baseline, **self._options())
