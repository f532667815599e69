"""Monte-Carlo validation of an ESR's claimed probabilities (:func:`validate_esr`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from capg_rec._checks import check_count, check_flag, is_number
from capg_rec.validate import _stats
from capg_rec.validate.protocol import ESR
from capg_rec.validate.report import Check, ItemResult, ValidationReport

__all__ = ["validate_esr"]

_DRAWS_PER_CHUNK = 1 << 21  # B·S·K ids sampled per call to esr.sample


def _check_fraction(name: str, value: float, *, closed_low: bool = False) -> float:
    low = "[0" if closed_low else "(0"
    if not is_number(value):
        raise TypeError(f"{name} must be a number in {low}, 1), got {type(value).__name__} {value!r}")
    if not ((0 <= value if closed_low else 0 < value) and value < 1):
        raise ValueError(f"{name} must be a number in {low}, 1), got {value!r}")
    return float(value)


def _check_claims(name: str, x: object, shape: tuple[int, ...] | None = None) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must return a floating torch.Tensor, got {type(x).__name__} "
                        f"{getattr(x, 'dtype', '')}")
    if (shape is None and x.dim() != 2) or (shape is not None and tuple(x.shape) != shape):
        raise ValueError(f"{name} must return shape {list(shape) if shape else '[B, N]'}, got {list(x.shape)}")
    if bool(torch.isnan(x).any()) or bool((x == math.inf).any()):
        raise ValueError(f"{name} returned NaN or +inf")
    return x.detach()  # claims held in a tensor that requires grad (a learnable table) are values here


def _check_draws(draws: object, batch: int, size: int, k: int, num_items: int) -> Tensor:
    if not isinstance(draws, Tensor) or draws.dtype.is_floating_point or draws.dtype == torch.bool:
        raise TypeError(f"esr.sample must return an integer torch.Tensor, got {type(draws).__name__} "
                        f"{getattr(draws, 'dtype', '')}")
    if tuple(draws.shape) != (batch, size, k):
        raise ValueError(f"esr.sample must return shape [B={batch}, S={size}, K={k}], got {list(draws.shape)}")
    lo, hi = int(draws.min()), int(draws.max())
    if lo < 0 or hi >= num_items:
        raise ValueError(f"esr.sample must return ids in [0, {num_items}), got values in [{lo}, {hi}]")
    return draws.long()


def _all_sequences(num_items: int, k: int, with_replacement: bool) -> Tensor:
    """Every ordered draw → ``[S, K]`` (with repeats when ``with_replacement``)."""
    seqs = (itertools.product(range(num_items), repeat=k) if with_replacement
            else itertools.permutations(range(num_items), k))
    return torch.tensor(list(seqs), dtype=torch.long, device="cpu").reshape(-1, k)


def _num_sequences(num_items: int, k: int, with_replacement: bool) -> int:
    return num_items ** k if with_replacement else math.perm(num_items, k)


def validate_esr(esr: ESR, contexts: Any = None, *, num_samples: int = 20_000, alpha: float = 1e-3,
                 seed: int = 0, tolerance: float = 0.0, sum_tolerance: float = 1e-3, rel_error: float = 0.1,
                 power: float = 0.8, num_worst: int = 10, max_enumerated_draws: int = 5040,
                 progress: bool = False) -> ValidationReport:
    """Check the probabilities an ESR claims against ``num_samples`` of its own draws per context.

    Statistical checks (together they falsely fail a correct ESR with probability ≤ ``alpha``;
    α is split evenly between them):

    * ``inclusion`` (``expected_count`` for a with-replacement ESR): for every context b and item
      a, the number of draws containing a is ``Binomial(n, π_ba)``; an exact two-sided test
      per pair, Bonferroni over all B·N pairs. ``tolerance`` (absolute, on π, or on the expected
      count) accepts any true value within it of the claim — for documented approximations.
      With replacement a's total count is a sum of n·K independent Bernoullis with mean n·μ,
      whose tails are lighter than ``Binomial(nK, μ/K)`` (Hoeffding 1956), so that test is valid.
    * ``ordered_draws`` (tiny catalogs: when the ESR has ``candidate_log_prob`` and there are at
      most ``max_enumerated_draws`` ordered draws): Pearson chi-square of the observed ordered
      draws against the claimed draw probabilities per context, Bonferroni over contexts (an
      asymptotic test: cells expecting fewer than 5 draws are pooled).

    Deterministic checks, with relative tolerance ``sum_tolerance``: the claims are consistent
    (probabilities in [0, 1] summing to K over the catalog, since every draw holds K items;
    expected counts summing to K); draws without replacement hold distinct items; and on tiny
    catalogs the claimed draw probabilities sum to 1 and imply the claimed inclusion values.
    Claims cannot be more consistent than the scores are precise: for scores of magnitude |s| in
    a dtype with machine epsilon eps, use ``sum_tolerance >= K · eps · |s|``.

    The report also lists the ``num_worst`` pairs with the smallest p-values, a binned
    calibration error with its noise floor, and the sample size needed to resolve a relative
    error ``rel_error`` with probability ``power``. Randomness comes only from ``seed``.
    """
    if not isinstance(esr, ESR):
        raise TypeError("esr must implement the ESR protocol (num_candidates, sample(contexts, num_samples, "
                         f"generator), inclusion_log_prob(contexts)), got {type(esr).__name__}")
    k = check_count("esr.num_candidates", esr.num_candidates)
    n = check_count("num_samples", num_samples)
    alpha = _check_fraction("alpha", alpha)
    power = _check_fraction("power", power)
    seed = check_count("seed", seed, low=0, high=2**63 - 1)  # a torch.Generator seed, as Python's int
    progress = check_flag("progress", progress)
    num_worst = check_count("num_worst", num_worst, low=0)
    max_enumerated_draws = check_count("max_enumerated_draws", max_enumerated_draws, low=0)
    for name, value in (("tolerance", tolerance), ("sum_tolerance", sum_tolerance), ("rel_error", rel_error)):
        if not is_number(value):
            raise TypeError(f"{name} must be a finite number >= 0, got {type(value).__name__} {value!r}")
        if not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if rel_error <= 0:
        raise ValueError(f"rel_error must be > 0, got {rel_error!r}")
    with_replacement = check_flag("esr.with_replacement", getattr(esr, "with_replacement", False))
    set_log_prob = getattr(esr, "candidate_log_prob", None)

    with torch.no_grad():
        claims_log = _check_claims("esr.inclusion_log_prob", esr.inclusion_log_prob(contexts))
    batch, num_items = claims_log.shape
    if batch == 0:
        raise ValueError("contexts must hold at least one context: esr.inclusion_log_prob returned B = 0 rows")
    if not with_replacement and k > num_items:
        raise ValueError(f"esr.num_candidates must be <= num_items={num_items} without replacement, got {k}")
    claimed = claims_log.double().exp().cpu().numpy()
    trials = k if with_replacement else 1  # Bernoulli trials per draw for one item
    enumerate_sets = callable(set_log_prob) and _num_sequences(num_items, k, with_replacement) <= max_enumerated_draws

    # Counted on the host (explicitly: a default device set by the user must not move them).
    counts = torch.zeros(batch, num_items, dtype=torch.float64, device="cpu")
    # Ordered draws counted by their index among the enumerated ones (S of them; the last column: any other draw),
    # through a table of every base-N code: a [B, N^K] count reached 6.6 GB at B = 1000, N = K = 7.
    place = num_items ** torch.arange(k - 1, -1, -1, device="cpu")
    seqs = (_all_sequences(num_items, k, with_replacement) if enumerate_sets
            else torch.zeros(0, k, dtype=torch.long, device="cpu"))
    width = seqs.shape[0] + 1
    index_of = torch.full((num_items ** k if enumerate_sets else 0,), width - 1, dtype=torch.long, device="cpu")
    index_of[(seqs * place).sum(1)] = torch.arange(seqs.shape[0], device="cpu")
    seq_counts = torch.zeros(batch * width if enumerate_sets else 0, dtype=torch.float64, device="cpu")
    repeats = 0
    generator = torch.Generator(device=claims_log.device).manual_seed(seed)
    step = max(1, _DRAWS_PER_CHUNK // (batch * k))
    starts = range(0, n, step)
    if progress:
        try:
            from tqdm import tqdm
        except ImportError as err:  # pragma: no cover - tqdm is installed wherever the tests run
            raise ImportError("progress=True needs tqdm: pip install tqdm") from err
        starts = tqdm(starts, desc="validate_esr", unit="chunk")
    with torch.no_grad():
        for start in starts:
            size = min(step, n - start)
            draws = _check_draws(esr.sample(contexts, size, generator), batch, size, k, num_items).cpu()
            ones = torch.ones(batch, size * k, dtype=torch.float64, device="cpu")
            counts.scatter_add_(1, draws.reshape(batch, -1), ones)
            if not with_replacement and k > 1:
                ordered = draws.sort(dim=2).values
                repeats += int((ordered[..., 1:] == ordered[..., :-1]).any(dim=2).sum())
            if enumerate_sets:
                codes = index_of[(draws * place).sum(2)] + torch.arange(batch, device="cpu").unsqueeze(1) * width
                seq_counts += torch.bincount(codes.reshape(-1), minlength=seq_counts.numel()).double()
    empirical = counts.numpy() / n

    stochastic = 1 + int(enumerate_sets)
    level = alpha / stochastic
    checks: list[Check] = []

    # Deterministic: the claims describe K draws.
    totals = claimed.sum(axis=1)
    sum_dev = float(np.abs(totals / k - 1).max())
    over = int((claimed > trials * (1 + sum_tolerance)).sum())
    what = "expected counts" if with_replacement else "probabilities"
    checks.append(Check("claims", sum_dev <= sum_tolerance and over == 0,
                        f"claimed {what} sum to K={k} within {sum_dev:.2g} (relative; allowed {sum_tolerance:g}); "
                        f"{over} above {trials}"))
    if not with_replacement:
        checks.append(Check("distinct", repeats == 0, f"{repeats} of {batch * n} draws repeat an item"))

    # Statistical: per-item exact binomial tests, Bonferroni over B·N.
    per_trial = np.clip(claimed / trials, 0.0, 1.0)
    low = np.clip((claimed - tolerance) / trials, 0.0, 1.0)
    high = np.clip((claimed + tolerance) / trials, 0.0, 1.0)
    family = batch * num_items
    p_item = np.minimum(1.0, family * _stats.binomial_p_values(counts.numpy(), n * trials, low, high))
    unit_var = trials * per_trial * (1 - per_trial)  # per-draw variance bound of an item's count
    z = _stats.z_scores(empirical, claimed, unit_var, n)
    family_p = float(p_item.min())
    checks.append(Check("expected_count" if with_replacement else "inclusion", family_p > level,
                        f"exact binomial test per (context, item), Bonferroni over {family} pairs",
                        family_p, level))

    if enumerate_sets:
        checks.extend(_check_sets(esr, contexts, claimed, seq_counts.view(batch, -1), seqs,
                                  sum_tolerance + tolerance, level, claims_log.device))

    order = np.lexsort((-np.abs(z).ravel(), p_item.ravel()))[:num_worst]
    worst = tuple(ItemResult(int(i // num_items), int(i % num_items), float(claimed.flat[i]),
                             float(empirical.flat[i]), float(z.flat[i]), float(p_item.flat[i])) for i in order)
    cal_error, cal_noise = _stats.calibration(claimed.ravel(), empirical.ravel(), unit_var.ravel(), n)

    # Sample size: the least likely of the items each context usually retrieves.
    top = np.sort(np.where(claimed < trials, claimed, -np.inf), axis=1)[:, ::-1][:, :min(k, num_items)]
    reference = float(top.min(axis=1).min()) if top.size else -math.inf
    needed = detectable = None
    if reference > 0:  # the test of the inclusion check at that claim, per trial
        claim, low, high = (min(max(x / trials, 0.0), 1.0) for x in (reference, reference - tolerance,
                                                                     reference + tolerance))
        needed = _stats.samples_needed(claim, low, high, trials, rel_error, power, level / family)
        detectable = _stats.detectable_rel_error(claim, low, high, n * trials, power, level / family)
    return ValidationReport(
        passed=all(c.passed for c in checks), alpha=alpha, num_samples=n, num_contexts=batch,
        num_items=num_items, num_candidates=k, with_replacement=with_replacement, tolerance=float(tolerance),
        checks=tuple(checks), worst=worst, max_abs_z=float(np.abs(z).max()), calibration_error=cal_error,
        calibration_noise=cal_noise, rel_error=float(rel_error), power=power,
        reference_claim=reference if reference > 0 else None, samples_needed=needed,
        detectable_rel_error=detectable, claimed=claimed, empirical=empirical, stderr=np.sqrt(unit_var / n),
        critical_z=float(_stats.scipy_stats().norm.isf(level / (2 * family))))


def _check_sets(esr: ESR, contexts: Any, claimed: np.ndarray, seq_counts: Tensor, seqs: Tensor, tol: float,
                level: float, device: torch.device) -> list[Check]:
    """Ordered-draw checks on a tiny catalog: claimed draw probabilities vs enumeration and vs
    the observed draws. ``seqs [S, K]`` are every ordered draw, and ``seq_counts [B, S + 1]`` counts the draws by
    their index among them (the last column: any other draw)."""
    batch, num_items = claimed.shape
    with torch.no_grad():
        set_log = esr.candidate_log_prob(contexts, seqs.expand(batch, -1, -1).to(device))
    set_log = _check_claims("esr.candidate_log_prob", set_log, (batch, seqs.shape[0]))
    probs = set_log.double().exp().cpu()
    member = torch.zeros(seqs.shape[0], num_items, dtype=torch.float64, device="cpu")
    member.scatter_add_(1, seqs, torch.ones(seqs.shape, dtype=torch.float64, device="cpu"))
    implied = (probs @ member).numpy()
    mass_dev = float((probs.sum(1) - 1).abs().max())
    incl_dev = float(np.abs(implied - claimed).max())
    consistent = Check("draw_claims", mass_dev <= tol and incl_dev <= tol,
                       f"claimed ordered-draw probabilities sum to 1 within {mass_dev:.2g} and imply the claimed "
                       f"inclusion values within {incl_dev:.2g} (allowed {tol:g})")
    observed = seq_counts[:, :-1]  # [B, S]
    stray = seq_counts[:, -1]  # draws outside the enumerated support
    p, tested = zip(*(_stats.multinomial_test(np.append(observed[b].numpy(), stray[b].item()),
                                              np.append(probs[b].numpy(), 0.0)) for b in range(batch)))
    family_p = min(1.0, batch * min(p))
    where = _worst_draw(p, tested, observed, stray, probs, seqs, level / batch)
    return [consistent, Check("ordered_draws", family_p > level,
                              f"chi-square over {seqs.shape[0]} ordered draws per context, Bonferroni over "
                              f"{batch} contexts; {where}", family_p, level)]


def _worst_draw(p: Sequence[float], tested: Sequence[bool], observed: Tensor, stray: Tensor, probs: Tensor,
                seqs: Tensor, level: float) -> str:
    """Where the ordered-draw test is furthest from its claims: the context of the least p-value (and how many fall
    below the per-context ``level``), and in it the draw seen furthest from its expected count (in standard
    errors), or the draws outside the enumerated support; and the contexts it could not test (``tested``: False
    where every cell pooled into one at this sample size), or that it tested none."""
    untested = sum(not t for t in tested)
    if untested == len(p):
        return (f"not testable at this sample size: no context has two ordered draws (or pools of them) expected "
                f"{_stats.MIN_EXPECTED:g} times or more, so every p is 1; raise the number of samples")
    worst = min(range(len(p)), key=lambda b: (p[b], not tested[b]))  # a tested context first among equal p
    draws = float(observed[worst].sum() + stray[worst])
    expected = probs[worst] * draws  # as claimed (draw_claims checks that the claims sum to 1)
    deviation = (observed[worst] - expected) / expected.clamp(min=1e-300).sqrt()
    at = int(deviation.abs().argmax())
    text = (f"context {worst} is furthest off (p = {p[worst]:.3g}; {sum(q <= level for q in p)} of {len(p)} contexts "
            f"below the per-context level), where draw {seqs[at].tolist()} came {int(observed[worst, at])} times "
            f"against {float(expected[at]):.1f} claimed")
    if stray[worst]:
        text += f", and {int(stray[worst])} draws fell outside the enumerated ones"
    if untested:
        text += f"; {untested} context{'s' if untested > 1 else ''} could not be tested at this sample size"
    return text

