"""Statistical acceptance regions for Monte-Carlo tests (derived from the sample size)."""

from __future__ import annotations

import numpy as np
from scipy import stats


def binomial_acceptance(probs: np.ndarray, num_samples: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided exact binomial acceptance bounds on counts, Bonferroni over all entries.

    A correct implementation falls outside with probability at most ``alpha`` in total.
    """
    per_entry = alpha / (2 * probs.size)
    probs = np.clip(probs, 0.0, 1.0)
    low = stats.binom.ppf(per_entry, num_samples, probs)
    high = stats.binom.isf(per_entry, num_samples, probs)
    return low, high


def assert_counts_match(counts: np.ndarray, probs: np.ndarray, num_samples: int, alpha: float = 1e-6,
                        method_tolerance: float | np.ndarray = 0.0) -> None:
    """Every count lies in its acceptance region, widened by ``method_tolerance`` (absolute, in
    probability; one per entry, or one for all) for documented approximations."""
    low, high = binomial_acceptance(probs, num_samples, alpha)
    slack = method_tolerance * num_samples
    bad = (counts < low - slack) | (counts > high + slack)
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} counts outside their {alpha:g} acceptance region; first: "
        f"count={counts[bad][:5]}, expected={probs[bad][:5] * num_samples}")


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit over whole outcomes; cells with expected < 5 pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)
