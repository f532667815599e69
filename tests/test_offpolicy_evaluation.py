"""Off-policy evaluation: the IPS estimate's expectation by exact enumeration, interval coverage
by seeded Monte-Carlo, input checks."""

import math
import statistics
import warnings

import numpy as np
import pytest
import torch

from capg_rec import expert_of_position, sample_candidates
from capg_rec._enumerate import all_draws, draw_log_probs, inclusion_probs
from capg_rec.offpolicy_evaluation import OffPolicyEstimate, off_policy_value


def _contexts(num_contexts, n, k, m, length, seed):
    """Per context: target and logging logits, fixed item qualities (the LSR shows the ``length``
    candidates of largest quality) and mean rewards; every ordered draw with its π₀ probability."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(num_contexts, m, n, generator=g, dtype=torch.float64)
    logging = torch.randn(num_contexts, m, n, generator=g, dtype=torch.float64)
    quality = torch.randn(num_contexts, n, generator=g, dtype=torch.float64)
    rbar = 1.0 + torch.rand(num_contexts, n, generator=g, dtype=torch.float64)
    draws = all_draws(n, k)
    experts = expert_of_position(k, m)
    p0 = draw_log_probs(logging, draws, experts).exp()  # [X, S]
    chosen = draws.unsqueeze(0).expand(num_contexts, -1, -1).gather(
        2, quality[:, draws].topk(length, dim=2).indices)  # [X, S, L]
    return theta, logging, rbar, draws, experts, p0, chosen


@pytest.mark.parametrize(("n", "k", "m", "length"), [(5, 2, 1, 1), (6, 3, 2, 2), (7, 3, 1, 2), (4, 2, 2, 1)])
def test_ips_expectation_is_the_stated_target(n, k, m, length):
    """E_{x, A~π₀}[ips] = (1/L) E_x Σ_a r̄(x,a) ρ₀(x,a) π_θ(a ∈ A | x), exactly (3 equally likely
    contexts); with π_θ = π₀ it is π₀'s true value (mean over shown positions)."""
    num_contexts = 3
    theta, logging, rbar, draws, experts, p0, chosen = _contexts(num_contexts, n, k, m, length, seed=n + k + m)
    incl, incl0 = inclusion_probs(theta, experts), inclusion_probs(logging, experts)  # [X, N]
    rows = num_contexts * len(draws)
    ctx = torch.arange(num_contexts).repeat_interleave(len(draws))
    chosen_rows = chosen.reshape(rows, length)
    prob = p0.reshape(rows) / num_contexts  # P(x, A)
    shown = torch.zeros(num_contexts, n, dtype=torch.float64)
    shown.index_put_((ctx.unsqueeze(1).expand(-1, length), chosen_rows), prob.unsqueeze(1).expand(-1, length).clone(),
                     accumulate=True)  # P(x, a shown)
    rho0 = shown * num_contexts / incl0
    target = float((rbar * rho0 * incl).sum(1).mean()) / length
    # ips is linear in the rewards: rows scaled by rows · P(x, A) give E[ips] exactly
    rewards = rbar[ctx.unsqueeze(1), chosen_rows] * (rows * prob).unsqueeze(1)
    for log_target, expected in ((incl.log(), target),
                                 (incl0.log(), float((prob * rbar[ctx.unsqueeze(1), chosen_rows].mean(1)).sum()))):
        est = off_policy_value(log_target[ctx.unsqueeze(1), chosen_rows], incl0.log()[ctx.unsqueeze(1), chosen_rows],
                               rewards)
        assert est.ips == pytest.approx(expected, rel=1e-12)


def test_confidence_intervals_cover_at_the_nominal_level():
    """300 seeded replications of n = 1000 logged rows (one context, N = 6, K = 2, noisy rewards):
    the IPS interval covers the exact target, the SNIPS interval the exact ratio target, each at a
    rate within 4 binomial standard errors of 0.95."""
    n, k, reps, rows, conf = 6, 2, 300, 1000, 0.95
    theta, logging, rbar, draws, experts, p0, chosen = _contexts(1, n, k, 1, 1, seed=11)
    incl, incl0 = inclusion_probs(theta, experts)[0], inclusion_probs(logging, experts)[0]
    shown = torch.zeros(n, dtype=torch.float64).index_add_(0, chosen[0, :, 0], p0[0])
    rho0 = shown / incl0
    ips_target = float((rbar[0] * rho0 * incl).sum())
    snips_target = ips_target / float((rho0 * incl).sum())
    g = torch.Generator().manual_seed(5)
    cand = sample_candidates(logging[0].expand(reps * rows, -1), k, generator=g)  # [R n, K]
    table = torch.zeros(n * n, dtype=torch.long)  # ordered draw → the item the LSR shows
    table[draws[:, 0] * n + draws[:, 1]] = chosen[0, :, 0]
    shown_item = table[cand[:, 0] * n + cand[:, 1]].unsqueeze(1)  # [R n, 1]
    rewards = rbar[0][shown_item] + 0.5 * torch.randn(shown_item.shape, generator=g, dtype=torch.float64)
    hits_ips = hits_snips = 0
    for r in range(reps):
        part = slice(r * rows, (r + 1) * rows)
        a = shown_item[part]
        est = off_policy_value(incl.log()[a], incl0.log()[a], rewards[part], confidence=conf)
        hits_ips += est.ips_ci_low <= ips_target <= est.ips_ci_high
        hits_snips += est.snips_ci_low <= snips_target <= est.snips_ci_high
    bound = 4 * math.sqrt(conf * (1 - conf) / reps)
    assert abs(hits_ips / reps - conf) <= bound, hits_ips
    assert abs(hits_snips / reps - conf) <= bound, hits_snips


def test_weights_caps_and_effective_sample_size():
    target = torch.log(torch.tensor([[0.5], [0.5], [0.5], [0.5]], dtype=torch.float64))
    logged = torch.log(torch.tensor([[0.5], [0.25], [0.5], [0.125]], dtype=torch.float64))
    rewards = torch.tensor([[1.0], [2.0], [3.0], [4.0]], dtype=torch.float64)
    est = off_policy_value(target, logged, rewards)  # weights 1, 2, 1, 4
    assert isinstance(est, OffPolicyEstimate) and est.num_samples == 4
    assert est.ips == pytest.approx((1 + 4 + 3 + 16) / 4)
    assert est.snips == pytest.approx(24 / 8)
    assert est.effective_sample_size == pytest.approx(64 / 22)
    capped = off_policy_value(target, logged, rewards, max_weight=2.0)  # weights 1, 2, 1, 2
    assert capped.ips == pytest.approx((1 + 4 + 3 + 8) / 4)
    greedy = off_policy_value(torch.tensor([[0.0], [-math.inf]]), torch.tensor([[-1.0], [-1.0]]),
                              torch.ones(2, 1))  # an item the target never retrieves weighs 0
    assert greedy.ips == pytest.approx(math.e / 2) and greedy.snips == pytest.approx(1.0)
    assert est.to_dict()["num_samples"] == 4


def test_input_checks_name_the_argument():
    x = torch.zeros(3, 2)
    with pytest.raises(TypeError, match="rewards"):
        off_policy_value(x, x, [[0.0]])
    with pytest.raises(TypeError, match="logged_log_inclusion"):
        off_policy_value(x, x.long(), x)
    with pytest.raises(ValueError, match="rewards"):
        off_policy_value(x, x, torch.zeros(3, 1))
    cube = torch.zeros(1, 3, 2)  # the message said "the shape [n, L] of [1, 3, 2], got [1, 3, 2]"
    with pytest.raises(ValueError, match=r"target_log_inclusion must have shape \[n, L\], got \[1, 3, 2\]"):
        off_policy_value(cube, cube, cube)
    with pytest.raises(ValueError, match="at least 2 rows"):
        off_policy_value(x[:1], x[:1], x[:1])
    with pytest.raises(ValueError, match="logged_log_inclusion"):
        off_policy_value(x, x - math.inf, x)
    with pytest.raises(ValueError, match="target_log_inclusion must be <= 0"):
        off_policy_value(x + 0.1, x, x)
    with pytest.raises(ValueError, match="rewards"):
        off_policy_value(x, x, x + math.nan)
    with pytest.raises(ValueError, match="confidence"):
        off_policy_value(x, x, x, confidence=1.0)
    with pytest.raises(ValueError, match="max_weight"):
        off_policy_value(x, x, x, max_weight=-1.0)


def test_weights_at_the_overflow_cap_give_finite_estimates():
    """Regression: log ratios beyond ~354 put the weights at their cap (√ of float64's max), and the
    effective sample size squared their sum as a Python float: OverflowError. Equal capped weights give
    n effective samples and SNIPS the mean reward; mixed ones match numpy on the weights over their largest (capped
    for IPS only)."""
    n = 6
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.5, 0.5]],
                           dtype=torch.float64)
    target = torch.zeros(n, 2, dtype=torch.float64)
    est = off_policy_value(target, torch.full((n, 2), -400.0, dtype=torch.float64), rewards,
                           min_effective_sample_size=0)
    assert est.effective_sample_size == pytest.approx(n, rel=1e-12)
    assert est.snips == pytest.approx(float(rewards.mean()), rel=1e-12)
    assert math.isfinite(est.ips) and math.isfinite(est.ips_ci_high) and est.ips_ci_low <= est.ips <= est.ips_ci_high
    logged = -torch.linspace(300.0, 420.0, 2 * n, dtype=torch.float64).view(n, 2)
    est = off_policy_value(target, logged, rewards, min_effective_sample_size=0)
    log_raw = (target - logged).numpy()
    unit = np.exp(log_raw - log_raw.max())  # SNIPS and ESS: the uncapped weights over the largest
    per_row = unit.mean(1)
    assert est.effective_sample_size == pytest.approx(per_row.sum() ** 2 / (per_row ** 2).sum(), rel=1e-12)
    assert est.snips == pytest.approx((unit * rewards.numpy()).mean(1).sum() / per_row.sum(), rel=1e-12)
    log_w = log_raw.clip(max=math.log(math.sqrt(np.finfo(np.float64).max)))  # IPS: the capped ones
    y = (np.exp(log_w - log_w.max()) * rewards.numpy()).mean(1)
    assert est.ips == pytest.approx(float(np.exp(log_w.max())) * y.mean(), rel=1e-12)
    se = float(np.exp(log_w.max())) * y.std(ddof=1) / math.sqrt(n)
    assert est.ips_ci_high - est.ips == pytest.approx(statistics.NormalDist().inv_cdf(0.975) * se, rel=1e-9)


def test_intervals_are_nan_where_few_rows_carry_weight():
    """Regression: with one logged row in 1,000 that the evaluated (greedy) ESR retrieves, SNIPS's interval had
    width 0 (its residuals are all 0), and with none IPS's was [0, 0]: certainty from nothing. Below
    min_effective_sample_size (default 10) the intervals are NaN, with a warning; above it they are as before."""
    n = 1000
    logged = torch.full((n, 1), math.log(0.5), dtype=torch.float64)
    rewards = torch.ones(n, 1, dtype=torch.float64)

    def greedy(matching: int) -> torch.Tensor:
        target = torch.full((n, 1), -math.inf, dtype=torch.float64)
        target[:matching] = 0.0
        return target

    for matching in (0, 1, 2):
        with pytest.warns(UserWarning, match="effective sample size"):
            est = off_policy_value(greedy(matching), logged, rewards)
        assert est.ips == pytest.approx(2 * matching / n)
        assert all(math.isnan(v) for v in (est.ips_ci_low, est.ips_ci_high, est.snips_ci_low, est.snips_ci_high))
    noisy = rewards + (torch.arange(n, dtype=torch.float64) % 2).view(n, 1)
    est = off_policy_value(greedy(20), logged, noisy)
    assert est.effective_sample_size == pytest.approx(20)
    assert est.ips_ci_low < est.ips < est.ips_ci_high and est.snips_ci_low < est.snips < est.snips_ci_high
    with pytest.raises(ValueError, match="min_effective_sample_size"):
        off_policy_value(greedy(20), logged, noisy, min_effective_sample_size=-1.0)
    with pytest.raises(TypeError, match="min_effective_sample_size"):
        off_policy_value(greedy(20), logged, noisy, min_effective_sample_size="10")


def test_snips_and_effective_sample_size_of_weights_far_below_one():
    """Regression (found by review): with every weight below e^-745 (an ESR that the logs almost never match) the
    weights underflowed to 0: SNIPS was NaN and the effective sample size 0. Both are scale-free: now from the
    weights relative to the largest."""
    target = torch.full((20, 1), -800.0, dtype=torch.float64)
    target[::2] -= 1.0
    rewards = torch.rand(20, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    est = off_policy_value(target, torch.full((20, 1), -1.0, dtype=torch.float64), rewards)
    w = torch.ones(20, dtype=torch.float64)
    w[::2] = math.exp(-1.0)
    assert est.snips == pytest.approx(float((w * rewards[:, 0]).sum() / w.sum()), rel=1e-12)
    assert est.effective_sample_size == pytest.approx(float(w.sum() ** 2 / (w * w).sum()), rel=1e-12)
    assert est.ips == 0.0  # its scale is e^-799: below float64


def test_snips_and_effective_sample_size_of_weights_beyond_the_cap_keep_their_ratios():
    """Regression (found by review): IPS's weights are capped near 1.3e154 (squares finite in float64), and SNIPS
    and the effective sample size were taken from the capped weights, so rows beyond the cap tied. Twenty rows of
    weights e^400 .. e^590, the largest alone rewarded: SNIPS came out 0.05 with an effective sample size of 20 and
    finite intervals, where the last row carries all but e^-10 of the weight."""
    n = 20
    logged = -(400.0 + 10 * torch.arange(n, dtype=torch.float64))[:, None]
    rewards = torch.zeros(n, 1, dtype=torch.float64)
    rewards[-1] = 1.0
    with pytest.warns(UserWarning, match="effective sample size"):
        est = off_policy_value(torch.zeros(n, 1, dtype=torch.float64), logged, rewards)
    w = torch.exp(-logged[:, 0] + logged[-1, 0])  # relative to the largest
    assert est.snips == pytest.approx(float(1 / w.sum()), rel=1e-12)
    assert est.effective_sample_size == pytest.approx(float(w.sum() ** 2 / (w * w).sum()), rel=1e-12)
    assert math.isnan(est.snips_ci_low) and math.isnan(est.ips_ci_high)
    capped = off_policy_value(torch.zeros(n, 1, dtype=torch.float64), logged, rewards, max_weight=10.0,
                              min_effective_sample_size=0.0)  # a cap the user asks for ties them, as IPS's does
    assert capped.snips == pytest.approx(1 / n) and capped.effective_sample_size == pytest.approx(n)


def test_interval_half_widths_follow_their_formulas():
    """Found by mutation testing: the only check of the SNIPS interval was coverage, whose band allows too wide an
    interval (a residual of y - w rather than y - SNIPS·w passed). The half-widths are z·std(y)/√n for IPS and the
    delta method's z·std(y - SNIPS·w)/√n / mean(w) for SNIPS (per-row means y of weighted rewards, w of weights)."""
    g = torch.Generator().manual_seed(0)
    n = 50
    target = torch.log(torch.rand(n, 2, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    logged = torch.log(torch.rand(n, 2, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    rewards = 3.0 + torch.rand(n, 2, generator=g, dtype=torch.float64)
    est = off_policy_value(target, logged, rewards, confidence=0.9)
    weights = (target - logged).exp()
    y, w = (weights * rewards).mean(1), weights.mean(1)
    z = statistics.NormalDist().inv_cdf(0.95)
    snips = float(y.sum() / w.sum())
    assert math.isclose(est.snips, snips, rel_tol=1e-12)
    assert math.isclose(est.ips_ci_high - est.ips, z * float(y.std()) / math.sqrt(n), rel_tol=1e-9)
    assert math.isclose(est.snips_ci_high - est.snips,
                        z * float((y - snips * w).std()) / math.sqrt(n) / float(w.mean()), rel_tol=1e-9)


def test_intervals_are_given_at_the_effective_sample_size_threshold():
    """NaN intervals are for an effective sample size *below* ``min_effective_sample_size``: 10 equally weighted
    rows of 1000 make exactly 10, which gets finite intervals and no warning (found by mutation testing)."""
    target = torch.full((1000, 1), -math.inf, dtype=torch.float64)
    target[:10] = 0.0
    logged = torch.full((1000, 1), math.log(0.5), dtype=torch.float64)
    rewards = 1.0 + (torch.arange(1000) % 2).view(-1, 1).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est = off_policy_value(target, logged, rewards, min_effective_sample_size=10)
    assert est.effective_sample_size == 10 and math.isfinite(est.ips_ci_low) and math.isfinite(est.snips_ci_low)
    with pytest.warns(UserWarning, match="below min_effective_sample_size=11"):
        assert math.isnan(off_policy_value(target, logged, rewards, min_effective_sample_size=11).snips_ci_low)
