"""Statistics behind :func:`~capg_rec.validate.validate_esr` (private).

Exact binomial tests per item, Pearson chi-square over whole ordered draws, and normal-theory
sample sizes. Every function works on NumPy arrays; SciPy is imported lazily.
"""

from __future__ import annotations

import math

import numpy as np

_MIN_EXPECTED = 5.0


def scipy_stats():
    """``scipy.stats``, or an ImportError that says how to install it."""
    try:
        from scipy import stats
    except ImportError as err:  # pragma: no cover - scipy is installed wherever the tests run
        raise ImportError("capg_rec.validate needs SciPy: pip install scipy "
                          "(or pip install 'capg-rec[test]')") from err
    return stats


def binomial_p_values(counts: np.ndarray, trials: int, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Two-sided exact p-values that ``counts ~ Binomial(trials, p)`` with ``p ∈ [low, high]``.

    Twice the smaller tail, each tail taken at the end of the interval that favours the count
    (``P_low(X ≤ c)`` and ``P_high(X ≥ c)``), capped at 1. Under the hypothesis the p-value is
    super-uniform, so a Bonferroni bound over any family of them is valid.
    """
    stats = scipy_stats()
    lower_tail = stats.binom.cdf(counts, trials, low)
    upper_tail = stats.binom.sf(counts - 1, trials, high)
    return np.minimum(1.0, 2.0 * np.minimum(lower_tail, upper_tail))


def multinomial_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of ``counts [C]`` against cell probabilities ``probs [C]``.

    Cells with expected count below 5 are pooled into one cell (merged into the smallest kept
    cell if the pool itself stays below 5). A count in a cell of probability 0 gives 0.
    """
    stats = scipy_stats()
    total = counts.sum()
    if total == 0:
        return 1.0
    if bool((counts[probs <= 0] > 0).any()):
        return 0.0
    expected = probs / probs.sum() * total
    keep = expected >= _MIN_EXPECTED
    obs, exp = list(counts[keep].astype(float)), list(expected[keep])
    pooled_obs, pooled_exp = float(counts[~keep].sum()), float(expected[~keep].sum())
    if pooled_exp >= _MIN_EXPECTED or not obs:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    elif pooled_exp > 0:
        smallest = int(np.argmin(exp))
        obs[smallest] += pooled_obs
        exp[smallest] += pooled_exp
    if len(obs) < 2:
        return 1.0
    o, e = np.asarray(obs), np.asarray(exp)
    return float(stats.chi2.sf(((o - e) ** 2 / e).sum(), len(o) - 1))


def z_scores(empirical: np.ndarray, claimed: np.ndarray, unit_variance: np.ndarray,
             num_samples: int) -> np.ndarray:
    """``(empirical − claimed) / sqrt(unit_variance / n)``; ±inf where the claimed variance is 0
    but the values differ, 0 where they agree."""
    diff = empirical - claimed
    se = np.sqrt(unit_variance / num_samples)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = diff / se
    return np.where(se > 0, z, np.where(diff == 0, 0.0, np.copysign(np.inf, diff)))


def detection_z(level: float, power: float) -> float:
    """``z_{1−level/2} + z_{power}``: the standardised shift a two-sided test at ``level``
    detects with probability ``power`` (normal approximation)."""
    stats = scipy_stats()
    return float(stats.norm.isf(level / 2) + stats.norm.ppf(power))


def samples_needed(value: float, unit_variance: float, rel_error: float, z: float) -> int:
    """Samples needed to detect a relative error ``rel_error`` in a mean ``value`` whose
    per-sample variance is ``unit_variance``: ``⌈z² v / (r·value)²⌉``."""
    return math.ceil(z * z * unit_variance / (rel_error * value) ** 2)


def calibration(claimed: np.ndarray, empirical: np.ndarray, unit_variance: np.ndarray, num_samples: int,
                num_bins: int = 10) -> tuple[float, float]:
    """Binned calibration error and its noise floor.

    Entries are sorted by claim and cut into equal-count bins; the error is the count-weighted
    mean of ``|mean(empirical) − mean(claimed)|`` per bin. The noise floor is the same quantity's
    expectation for a correct claim (normal approximation, ``sqrt(2/π)`` × the bin's standard
    error), so an error well above it means miscalibration.
    """
    order = np.argsort(claimed, kind="stable")
    total = claimed.size
    error = noise = 0.0
    for idx in np.array_split(order, min(num_bins, total)):
        weight = idx.size / total
        error += weight * abs(float(empirical[idx].mean() - claimed[idx].mean()))
        noise += weight * math.sqrt(2 / math.pi) * math.sqrt(float(unit_variance[idx].sum()) / num_samples) / idx.size
    return error, noise
