"""The result of :func:`~capg_rec.validate.validate_esr`: checks, worst items, text, JSON, plot."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from capg_rec._json import finite

__all__ = ["Check", "ItemResult", "ValidationReport"]


@dataclass(frozen=True)
class Check:
    """One check. Statistical checks carry their Bonferroni-adjusted family p-value and the share
    ``level`` of α they were run at (fail when ``p_value <= level``); deterministic checks have
    ``None`` for both. No tensors.

    Attributes:
        name: e.g. ``"claims"``, ``"distinct"``, ``"inclusion"`` (``"expected_count"`` with replacement),
            ``"draw_claims"``, ``"ordered_draws"``.
        passed: whether it passed.
        detail: what was tested, in words.
        p_value, level: the family p-value and its level (default None: a deterministic check).

    Example:
        >>> from capg_rec.validate import CatalogESR, validate_esr
        >>> report = validate_esr(CatalogESR(torch.randn(2, 10), 3), num_samples=500, max_enumerated_draws=0)
        >>> [check.name for check in report.checks], report.check("claims").p_value
        (['claims', 'distinct', 'inclusion'], None)
    """

    name: str
    passed: bool
    detail: str
    p_value: float | None = None
    level: float | None = None


@dataclass(frozen=True)
class ItemResult:
    """One (context, item) pair: claimed and empirical inclusion probability (expected count for a
    with-replacement ESR), the z-score and the Bonferroni-adjusted p-value. No tensors.

    Attributes:
        context, item: the row b and the item id a.
        claimed, empirical: the ESR's claim and the share of its draws that held a (mean count with replacement).
        z: ``(empirical - claimed) / stderr``.
        p_value: the exact binomial test's p-value, Bonferroni-adjusted over the B·N pairs (at most 1).

    Example:
        >>> from capg_rec.validate import CatalogESR, validate_esr
        >>> report = validate_esr(CatalogESR(torch.randn(2, 10), 3), num_samples=500, max_enumerated_draws=0)
        >>> worst = report.worst[0]                                 # the smallest p-value first
        >>> len(report.worst), 0 <= worst.claimed <= 1, worst.p_value <= report.worst[-1].p_value
        (10, True, True)
    """

    context: int
    item: int
    claimed: float
    empirical: float
    z: float
    p_value: float


@dataclass(frozen=True)
class ValidationReport:
    """Monte-Carlo validation of an ESR's claimed probabilities.

    ``claimed``, ``empirical`` and ``stderr`` are ``[B, N]`` arrays (probabilities, or expected
    counts for a with-replacement ESR; ``stderr`` is the claimed standard error of the empirical
    value). ``samples_needed`` is the number of draws per context that would detect a relative
    error ``rel_error`` either way (with probability ``power``, the exact power of this report's
    per-item binomial test at its per-item level; None where the tolerance accepts it) on the
    least likely of the items each context usually retrieves (``reference_claim``: the smallest
    K-th largest claim over contexts); ``detectable_rel_error`` is that relative error at the
    sample size used.

    Attributes:
        passed, alpha, checks: every check passed; the false-alarm rate α; the :class:`Check` s (see :meth:`check`).
        num_samples, num_contexts, num_items, num_candidates, with_replacement, tolerance: n, B, N, K, the
            ESR's kind and the inclusion test's absolute tolerance.
        worst: the ``num_worst`` :class:`ItemResult` s with the smallest p-values; max_abs_z: the largest ``|z|``.
        calibration_error, calibration_noise: the binned calibration error and its noise floor.
        rel_error, power, reference_claim, samples_needed, detectable_rel_error: the sample-size estimate above.
        claimed, empirical, stderr: the per-pair arrays; critical_z: the Bonferroni critical z of :meth:`plot`'s
            error bars.

    Shape:
        claimed, empirical, stderr: ``[B, N]`` numpy arrays (left out of :meth:`to_dict`).

    Example:
        >>> from capg_rec.validate import CatalogESR, validate_esr
        >>> _ = torch.manual_seed(0)
        >>> report = validate_esr(CatalogESR(torch.randn(2, 10), 3), num_samples=500, max_enumerated_draws=0)
        >>> report.passed, report.claimed.shape, "claimed" in report.to_dict()    # print(report): a summary
        (True, (2, 10), False)
    """

    passed: bool
    alpha: float
    num_samples: int
    num_contexts: int
    num_items: int
    num_candidates: int
    with_replacement: bool
    tolerance: float
    checks: tuple[Check, ...]
    worst: tuple[ItemResult, ...]
    max_abs_z: float
    calibration_error: float
    calibration_noise: float
    rel_error: float
    power: float
    reference_claim: float | None
    samples_needed: int | None
    detectable_rel_error: float | None
    claimed: np.ndarray = field(repr=False)
    empirical: np.ndarray = field(repr=False)
    stderr: np.ndarray = field(repr=False)
    critical_z: float = field(repr=False, default=float("nan"))

    def check(self, name: str) -> Check:
        """The check called ``name``."""
        for c in self.checks:
            if c.name == name:
                return c
        raise ValueError(f"name must be one of {[c.name for c in self.checks]}, got {name!r}")

    def to_dict(self) -> dict:
        """Everything except the ``[B, N]`` arrays, as JSON-ready Python values."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("claimed", "empirical", "stderr")}
        out["checks"] = [c.__dict__ for c in self.checks]
        out["worst"] = [w.__dict__ for w in self.worst]
        return finite(out)  # non-finite numbers at any depth (an unbounded z-score) as None

    def __str__(self) -> str:
        quantity = "E[count]" if self.with_replacement else "P(in A^K)"
        lines = [
            f"ESR validation: {'PASS' if self.passed else 'FAIL'} at alpha={self.alpha:g} "
            f"(B={self.num_contexts} contexts, N={self.num_items} items, K={self.num_candidates}, "
            f"n={self.num_samples} draws per context"
            + (f", tolerance={self.tolerance:g}" if self.tolerance else "") + ")",
        ]
        for c in self.checks:
            stat = f" p={c.p_value:.3g} (level {c.level:.3g})" if c.p_value is not None else ""
            lines.append(f"  [{'ok' if c.passed else 'FAIL'}] {c.name}:{stat} {c.detail}")
        lines.append(f"  calibration error {self.calibration_error:.3g} (noise floor {self.calibration_noise:.3g}), "
                     f"max |z| {self.max_abs_z:.3g}")
        if self.samples_needed is not None:
            needed = f"{self.samples_needed:.3g}" if self.samples_needed >= 10 ** 6 else str(self.samples_needed)
            resolved = (f"{self.detectable_rel_error:.1%}" if math.isfinite(self.detectable_rel_error)
                        else "no relative error (even a truth of 0 passes)")
            lines.append(f"  resolving a {self.rel_error:.0%} relative error at {quantity}={self.reference_claim:.3g} "
                         f"needs n ≈ {needed} (power {self.power:.0%}); this run resolves {resolved}")
        if self.worst:
            lines.append(f"  worst items ({quantity}):")
            lines.append("    context     item      claimed    empirical        z   adj. p")
            for w in self.worst:
                lines.append(f"    {w.context:7d} {w.item:8d} {w.claimed:12.6g} {w.empirical:12.6g} "
                             f"{w.z:8.2f} {w.p_value:8.2g}")
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """Save a PNG: claimed vs empirical values with error bars (± the Bonferroni critical z
        times the claimed standard error; a bar missing the diagonal is about a rejected item), and
        the relative deviation against the claim for the items with an expected count ≥ 5."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:  # pragma: no cover - matplotlib is installed wherever the tests run
            raise ImportError("plotting needs matplotlib: pip install matplotlib") from err
        claimed, empirical = self.claimed.ravel(), self.empirical.ravel()
        bar = self.critical_z * self.stderr.ravel()
        label = "expected count" if self.with_replacement else "inclusion probability"
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
        left.errorbar(claimed, empirical, yerr=bar, fmt=".", ms=3, alpha=0.6, elinewidth=0.7)
        hi = max(float(claimed.max()), float(empirical.max()))
        left.plot([0, hi], [0, hi], "k--", lw=0.8)
        left.set(xlabel=f"claimed {label}", ylabel=f"empirical {label}",
                 title=f"{'PASS' if self.passed else 'FAIL'}, n={self.num_samples}, alpha={self.alpha:g}")
        shown = claimed * self.num_samples >= 5  # expected count ≥ 5: resolvable relative errors
        deviation = empirical[shown] / claimed[shown] - 1  # at least -1
        right.errorbar(claimed[shown], deviation, yerr=bar[shown] / claimed[shown], fmt=".", ms=3, alpha=0.6,
                       elinewidth=0.7)
        right.axhline(0.0, color="k", ls="--", lw=0.8)
        top = max(1.0, 2.0 * float(deviation.max())) if deviation.size else 1.0
        if top > 1.0:  # linear within ±1, logarithmic beyond: a claim off by 500x stays in view
            right.set_yscale("symlog", linthresh=1.0)
        right.set(xscale="log", xlabel=f"claimed {label} (n × claim ≥ 5)", ylabel="empirical / claimed − 1",
                  ylim=(-1, top), title=f"calibration error {self.calibration_error:.3g} "
                                        f"(noise floor {self.calibration_noise:.3g})")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path
