"""Statistics behind :func:`~capg_rec.validate.validate_esr` (private).

Exact binomial tests per item, Pearson chi-square over whole ordered draws, and sample sizes from
the exact power of the binomial test. Every function works on NumPy arrays; SciPy is imported lazily.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

MIN_EXPECTED = 5.0


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
    return multinomial_test(counts, probs)[0]


def multinomial_test(counts: np.ndarray, probs: np.ndarray) -> tuple[float, bool]:
    """:func:`multinomial_p_value` and whether it tested anything: False where no draw was counted or every cell
    pooled into one (the p-value is then 1 by default, not by evidence)."""
    stats = scipy_stats()
    total = counts.sum()
    if total == 0:
        return 1.0, False
    if bool((counts[probs <= 0] > 0).any()):
        return 0.0, True
    expected = probs / probs.sum() * total
    keep = expected >= MIN_EXPECTED
    obs, exp = list(counts[keep].astype(float)), list(expected[keep])
    pooled_obs, pooled_exp = float(counts[~keep].sum()), float(expected[~keep].sum())
    if pooled_exp >= MIN_EXPECTED or not obs:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    elif pooled_exp > 0:
        smallest = int(np.argmin(exp))
        obs[smallest] += pooled_obs
        exp[smallest] += pooled_exp
    if len(obs) < 2:
        return 1.0, False
    o, e = np.asarray(obs), np.asarray(exp)
    return float(stats.chi2.sf(((o - e) ** 2 / e).sum(), len(o) - 1)), True


def z_scores(empirical: np.ndarray, claimed: np.ndarray, unit_variance: np.ndarray,
             num_samples: int) -> np.ndarray:
    """``(empirical − claimed) / sqrt(unit_variance / n)``; ±inf where the claimed variance is 0
    but the values differ, 0 where they agree."""
    diff = empirical - claimed
    se = np.sqrt(unit_variance / num_samples)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = diff / se
    return np.where(se > 0, z, np.where(diff == 0, 0.0, np.copysign(np.inf, diff)))


_EXACT_TRIALS = 2 ** 53
"""Trials beyond which scipy's binomial functions fail (integers past float64's exact ones)."""


def binomial_power(trials: int, low: float, high: float, truth: float, level: float) -> float:
    """Exact probability that :func:`binomial_p_values` (``p ∈ [low, high]``) is at most ``level`` for a count
    ``~ Binomial(trials, truth)``: the power of the two-sided test against ``truth``."""
    stats = scipy_stats()
    tail = level / 2  # rejected: P_low(X ≤ c) ≤ tail or P_high(X ≥ c) ≤ tail
    below = stats.binom.ppf(tail, trials, low)  # the smallest c with P_low(X ≤ c) ≥ tail
    if stats.binom.cdf(below, trials, low) > tail:
        below -= 1  # the largest count rejected as too small (-1: none)
    above = stats.binom.isf(tail, trials, high)  # the smallest c with P_high(X > c) ≤ tail
    while above >= 0 and stats.binom.sf(above - 1, trials, high) <= tail:
        above -= 1  # (isf rounds; counts above `above` are rejected as too large)
    return float(stats.binom.cdf(below, trials, truth) + stats.binom.sf(above, trials, truth))


def _alternatives(claim: float, rel_error: float) -> list[float]:
    """The success probabilities off ``claim`` by a relative ``rel_error``, either way, that can be."""
    return [max(claim * (1 - rel_error), 0.0)] + ([claim * (1 + rel_error)] if claim * (1 + rel_error) <= 1 else [])


def samples_needed(claim: float, low: float, high: float, trials: int, rel_error: float, power: float,
                   level: float) -> int | None:
    """Draws ``n`` at which the exact test of :func:`binomial_p_values` (``n·trials`` trials of success
    probability ``claim``, accepted in ``[low, high]``) at ``level`` rejects a truth off by a relative
    ``rel_error`` either way with probability at least ``power`` (exact binomial power, found by
    doubling then bisection from the normal approximation; that approximation's n itself where the search
    would pass 2^53 trials, beyond which scipy's binomial does not count: claims below about 1e-13 at a 10% error). None
    where a truth lies within ``[low, high]``: the test accepts it at any ``n``."""
    stats = scipy_stats()
    truths = _alternatives(claim, rel_error)
    if any(low <= q <= high for q in truths):
        return None

    def enough(n: int) -> bool:
        return min(binomial_power(n * trials, low, high, q, level) for q in truths) >= power

    z_level, z_power = stats.norm.isf(level / 2), stats.norm.ppf(power)
    guess = max(((z_level * math.sqrt(claim * (1 - claim)) + z_power * math.sqrt(q * (1 - q))) / (claim - q)) ** 2
                for q in truths)
    bad, good = 0, max(1, math.ceil(guess / trials))
    while good * trials <= _EXACT_TRIALS and not enough(good):
        bad, good = good, 2 * good
    if good * trials > _EXACT_TRIALS:  # beyond scipy's exact binomial: the normal approximation's n
        return max(1, math.ceil(guess / trials))
    while good - bad > 1:
        mid = (bad + good) // 2
        bad, good = (bad, mid) if enough(mid) else (mid, good)
    return good


def detectable_rel_error(claim: float, low: float, high: float, trials: int, power: float, level: float) -> float:
    """The smallest relative error ``r`` such that every truth ``claim·(1 ± r')``, ``r' ≥ r``, that is a
    probability is rejected with probability at least ``power`` by the exact test over ``trials`` trials
    (``inf`` if not even a truth of 0 is)."""

    def threshold(truth_at: Callable[[float], float], largest: float) -> float:
        """The least r in (0, largest] whose truth is rejected with ``power`` (the power grows with r)."""
        if binomial_power(trials, low, high, truth_at(largest), level) < power:
            return math.inf
        lo, hi = 0.0, largest
        for _ in range(50):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if binomial_power(trials, low, high, truth_at(mid), level) >= power else (mid, hi)
        return hi

    down = threshold(lambda r: claim * (1 - r), 1.0)
    most_up = 1 / claim - 1  # the largest relative error upwards that is still a probability
    up = threshold(lambda r: claim * (1 + r), most_up) if most_up > 0 else 0.0
    return max(down, most_up if up == math.inf else up)


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
