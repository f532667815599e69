"""Off-policy evaluation of an ESR from logs: marginal-IPS and self-normalised estimates of its value.

Each logged row holds the L shown items, their rewards and the logging ESR's ``log π₀(a_l ∈ A^K | x)``;
the ESR to evaluate gives ``log π_θ(a_l ∈ A^K | x)`` of the same items. With the weight
``w_l = π_θ(a_l ∈ A^K) / π₀(a_l ∈ A^K)`` and the per-row means ``Y_i = (1/L) Σ_l w_il r_il`` and
``W_i = (1/L) Σ_l w_il``:

* ``ips = mean_i Y_i``. Without a cap (``max_weight``) its expectation is exactly
  ``(1/L) E_x[Σ_a r̄(x, a) ρ₀(x, a) π_θ(a ∈ A^K | x)]`` with ``ρ₀(x, a) = P_{A~π₀}(LSR shows a | a ∈ A)``:
  the value of π_θ (per shown position, as the trainer reports it) *if the later stage showed each
  item at the rate it had under the logging ESR*. When π_θ changes the company an item keeps in
  the candidate set, the LSR's real show-rate changes too, which no marginal weight sees.
* ``snips = Σ_i Y_i / Σ_i W_i``: consistent for the ratio
  ``E_x[Σ_a r̄ ρ₀ π_θ] / E_x[Σ_a ρ₀ π_θ]`` (the mean reward of a shown item), which equals the IPS
  target when ``Σ_a ρ₀(x, a) π_θ(a ∈ A^K | x) = L`` (as for π_θ = π₀); lower variance, small bias.

IPS's weights are capped below ``sqrt`` of the dtype's largest value (their squares stay finite); SNIPS and the
effective sample size, which do not depend on the weights' scale, take them uncapped (relative to the largest).
``max_weight`` caps both. Confidence intervals are normal, from the sample variance (SNIPS: the delta method); the
effective sample size is ``(Σ_i W_i)² / Σ_i W_i²`` (n for equal weights). Below
``min_effective_sample_size`` the intervals are NaN, with a warning: a sample variance over a handful of
weighted rows claims a certainty the rows do not hold (one row with weight gives SNIPS a zero-width
interval; none gives IPS one at 0). Above it they are still asymptotic: with skewed weights at an effective sample
size of a few tens, a nominal 95% IPS interval was seen to cover 86–91% of the time (SNIPS: 91%). No threshold
catches a large weight that the logs rarely show: the samples without it have equal, small weights, a high effective
sample size and intervals that miss the value (a review's check: an item in 0.2% of the shown rows, of weight 230,
300 rows: intervals in half of the samples, none of them covering), so raising ``min_effective_sample_size`` does
not buy coverage there. Bound the largest weight the evaluated ESR can reach (``π_θ / π₀`` over the items it
retrieves) apart, or cap it with ``max_weight``.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import asdict, dataclass

from torch import Tensor

from capg_rec._checks import DeferredChecks, is_number, resolve_validate_args
from capg_rec.functional import LOG_PROB_TOLERANCE, _capped_log_weights, _relative_weights

__all__ = ["OffPolicyEstimate", "off_policy_value"]


@dataclass(frozen=True)
class OffPolicyEstimate:
    """Estimates of an ESR's value from logs, with ``confidence``-level normal intervals (all floats: no tensors).

    Attributes:
        ips, ips_ci_low, ips_ci_high: the marginal-IPS estimate and its interval.
        snips, snips_ci_low, snips_ci_high: the self-normalised estimate and its interval (delta method).
        effective_sample_size: ``(Σ_i W_i)² / Σ_i W_i²`` (n for equal weights); intervals are NaN below
            ``min_effective_sample_size``.
        num_samples: n, the logged rows.
        confidence: the intervals' level.

    Example:
        >>> logged = torch.rand(20, 2).log()                   # evaluating the logging ESR itself: weights 1
        >>> est = off_policy_value(logged, logged, torch.ones(20, 2))
        >>> est.ips, est.snips, est.effective_sample_size, est.num_samples
        (1.0, 1.0, 20.0, 20)
    """

    ips: float
    ips_ci_low: float
    ips_ci_high: float
    snips: float
    snips_ci_low: float
    snips_ci_high: float
    effective_sample_size: float
    num_samples: int
    confidence: float

    def to_dict(self) -> dict:
        return asdict(self)


def off_policy_value(target_log_inclusion: Tensor, logged_log_inclusion: Tensor, rewards: Tensor, *,
                     max_weight: float | None = None, confidence: float = 0.95,
                     min_effective_sample_size: float = 10.0, validate_args: bool | None = None) -> OffPolicyEstimate:
    """IPS and SNIPS estimates of the value of the ESR that gives ``target_log_inclusion [n, L]``
    (``log π_θ(a_l ∈ A^K | x_i)``; ``-inf`` for an item it never retrieves, e.g. a greedy top-K)
    from rows logged with ``logged_log_inclusion [n, L]`` (``log π₀``, finite) and ``rewards [n, L]``.

    ``max_weight`` caps the weights (lower variance; IPS biased low for rewards >= 0, high for rewards <= 0, SNIPS
    either way). Without it, IPS's weights are still capped below ``sqrt`` of float64's largest value (1.3e154: the
    estimates are computed in float64, whatever the inputs' dtype), so that their squares stay finite: a weight that
    large is beyond any unbiased use anyway. SNIPS and the effective sample size take the weights relative to the
    largest, uncapped (but for ``max_weight``), so rows beyond that cap keep their ratios. Needs ``n >= 2``
    rows. Both estimates' intervals are NaN (and a warning says so) where that effective sample size is below
    ``min_effective_sample_size``; they are normal intervals, of zero width where every row's weighted reward is
    the same (all rewards 0, say). Every item the evaluated ESR can retrieve must be one the logging ESR could
    (items it masked or never retrieved have no logged rows: the estimates miss their share, and nothing here can
    tell).
    """
    for name, x in (("target_log_inclusion", target_log_inclusion), ("logged_log_inclusion", logged_log_inclusion),
                    ("rewards", rewards)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape [n, L], got {list(x.shape)}")
        if x.shape != target_log_inclusion.shape:
            raise ValueError(f"{name} must have the shape of target_log_inclusion "
                             f"{list(target_log_inclusion.shape)}, got {list(x.shape)}")
    num_samples, length = target_log_inclusion.shape
    if num_samples < 2 or length < 1:
        raise ValueError(f"target_log_inclusion must have at least 2 rows and 1 column, got {[num_samples, length]}")
    if not is_number(confidence):
        raise TypeError(f"confidence must be a number, got {type(confidence).__name__}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if not is_number(min_effective_sample_size):
        raise TypeError(f"min_effective_sample_size must be a number, got {type(min_effective_sample_size).__name__}")
    if not 0 <= min_effective_sample_size < math.inf:
        raise ValueError(f"min_effective_sample_size must be finite and >= 0, got {min_effective_sample_size!r}")
    if resolve_validate_args(validate_args):
        checks = DeferredChecks()
        checks.no_nan_or_inf("target_log_inclusion", target_log_inclusion, allow_masked=True)
        checks.no_nan_or_inf("logged_log_inclusion", logged_log_inclusion)
        checks.no_nan_or_inf("rewards", rewards)
        for name, x in (("target_log_inclusion", target_log_inclusion), ("logged_log_inclusion", logged_log_inclusion)):
            checks.at_most(x, LOG_PROB_TOLERANCE, f"{name} must be <= 0 (a log-probability)")
        checks.run()
    target, logged = target_log_inclusion.detach().double(), logged_log_inclusion.detach().double()
    rewards = rewards.detach().double()
    log_weight = _capped_log_weights(target - logged, max_weight)
    y = (log_weight.exp() * rewards).mean(1)  # [n]
    z = statistics.NormalDist().inv_cdf((1 + confidence) / 2)
    ips = float(y.mean())
    ips_se = _std(y) / math.sqrt(num_samples)
    # SNIPS and the effective sample size do not depend on the weights' scale: relative to the largest, weights
    # far below 1 (an ESR that the logs rarely match) keep their ratios instead of underflowing to 0, and weights
    # beyond IPS's cap keep theirs instead of tying at it
    unit = _relative_weights(target - logged if max_weight is None else log_weight)
    y_unit, w = (unit * rewards).mean(1), unit.mean(1)  # [n]
    w_sum = float(w.sum())
    snips = float(y_unit.sum()) / w_sum if w_sum > 0 else math.nan
    snips_se = _std(y_unit - snips * w) / math.sqrt(num_samples) / float(w.mean()) if w_sum > 0 else math.nan
    ess = float(w.sum()) ** 2 / float((w * w).sum()) if w_sum > 0 else 0.0
    if ess < min_effective_sample_size:
        warnings.warn(f"off_policy_value: the weights' effective sample size is {ess:.3g}, below "
                      f"min_effective_sample_size={min_effective_sample_size:g}: the confidence intervals are NaN "
                      "(few logged rows carry weight for this ESR)", stacklevel=2)
        ips_se = snips_se = math.nan
    return OffPolicyEstimate(ips=ips, ips_ci_low=ips - z * ips_se, ips_ci_high=ips + z * ips_se, snips=snips,
                             snips_ci_low=snips - z * snips_se, snips_ci_high=snips + z * snips_se,
                             effective_sample_size=ess, num_samples=num_samples, confidence=float(confidence))


def _std(x: Tensor) -> float:
    """The sample standard deviation of ``x [n]``, of ``x`` over its largest magnitude (squares of values near
    the weights' cap would overflow)."""
    scale = float(x.abs().max())
    return scale * float((x / scale).std()) if 0 < scale < math.inf else float(x.std())
