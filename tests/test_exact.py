"""The exact inclusion probability (``capg_rec._exact``): enumeration, an independent reference of
the block-exact approximation, gradients, Σπ = K, Monte-Carlo, float32 extremes, head/tail."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import integrate

import capg_rec._exact as exact_module
from capg_rec._enumerate import inclusion_probs
from capg_rec._exact import EXACT_NUM_POWERS, _FFTConv, _nodes, _pb_poly, exact_log_inclusion
from capg_rec._head_tail import head_size_for, summarize
from capg_rec.catalog import DenseCatalog, EmbeddingCatalog
from capg_rec.plackett_luce import expert_of_position, expert_runs, sample_candidates

from tests.stats import assert_counts_match


def _log_pi(logits: torch.Tensor, targets: torch.Tensor, num_candidates: int,
            head_size: int | None = None, **settings) -> torch.Tensor:
    catalog = DenseCatalog(logits)
    head = head_size_for(catalog.num_items, num_candidates) if head_size is None else head_size
    summary = summarize(catalog, targets, head, EXACT_NUM_POWERS)
    runs = expert_runs(num_candidates, catalog.num_experts)
    return exact_log_inclusion(summary, runs, **settings)


def _all_items(batch: int, num_items: int) -> torch.Tensor:
    return torch.arange(num_items).expand(batch, -1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 15.0])
def test_single_expert_matches_enumeration(dtype, scale):
    gen = torch.Generator().manual_seed(int(scale * 10))
    for num_items in (2, 4, 7):
        for k in range(1, min(3, num_items) + 1):
            logits = torch.randn(6, num_items, generator=gen, dtype=torch.float64) * scale
            ref = inclusion_probs(logits.unsqueeze(1), expert_of_position(k, 1))
            # Both leave-one-out paths: every slot at once (many targets), one target at a time.
            for targets in (_all_items(6, num_items), torch.randint(0, num_items, (6, 1), generator=gen)):
                got = _log_pi(logits.to(dtype), targets, k).double().exp()
                want = ref.gather(1, targets)
                assert torch.allclose(got, want, rtol=1e-4, atol=0.0), (num_items, k, got, want)


def _block_exact_reference(scores: np.ndarray, num_candidates: int) -> np.ndarray:
    """The block-exact approximation from its definition, with adaptive quadrature and a direct
    Poisson-binomial DP: ``scores [M, N]`` → ``[N]`` (independent of the library code)."""
    experts = expert_of_position(num_candidates, scores.shape[0]).tolist()
    survive = np.ones(scores.shape[1])
    miss = np.zeros(scores.shape[1])  # log P(not drawn so far)
    pi = np.zeros(scores.shape[1])
    for expert in dict.fromkeys(experts):
        k = experts.count(expert)
        s = scores[expert]

        def integrand(g: float, a: int, s=s, k=k) -> float:
            dist = np.zeros(k + 1)
            dist[0] = 1.0
            for b in range(len(s)):
                if b != a:
                    p = survive[b] * -math.expm1(-math.exp(s[b] - g))
                    dist[1:] = dist[1:] * (1 - p) + dist[:-1] * p
                    dist[0] *= 1 - p
            z = s[a] - g
            return math.exp(z - math.exp(z)) * dist[:k].sum()

        hazard = np.array([integrate.quad(integrand, s.min() - 40, s.max() + 40, args=(a,), points=list(s),
                                          limit=400, epsabs=0.0, epsrel=1e-11)[0] for a in range(len(s))])
        pi += np.exp(miss) * hazard
        miss += np.log1p(-hazard)
        survive = survive * (1 - hazard)
    return pi


# Block-exact against enumeration, N ≤ 7, K ≤ 3, M ∈ {2, 3}: the largest absolute error measured
# over 64 random rows per (N, K, M) and logit scales 0.1-10 was 0.26 (the independence of the
# survivors is a large-N approximation; with N = 3 and two single-draw blocks it is 0.2-0.3).
# The bound below is that measurement rounded up; the reference test above pins the method itself.
_BLOCK_EXACT_SMALL_N_TOLERANCE = 0.3


@pytest.mark.parametrize("num_experts", [2, 3])
def test_block_exact_matches_its_definition_and_approximates_enumeration(num_experts):
    gen = torch.Generator().manual_seed(num_experts)
    for num_items, k, scale in ((4, 3, 1.0), (6, 3, 3.0), (7, 3, 0.3), (5, 2, 10.0)):
        if k < num_experts:
            continue
        logits = torch.randn(2, num_experts, num_items, generator=gen, dtype=torch.float64) * scale
        got = _log_pi(logits, _all_items(2, num_items), k).exp()
        want = torch.tensor(np.stack([_block_exact_reference(row.numpy(), k) for row in logits]))
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-12), (got, want)
        exact = inclusion_probs(logits, expert_of_position(k, num_experts))
        assert (got - exact).abs().max() <= _BLOCK_EXACT_SMALL_N_TOLERANCE


def test_one_run_of_a_mixture_equals_the_single_logit_result():
    logits = torch.randn(3, 3, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    targets = torch.tensor([[0, 5], [7, 7], [39, 1]])
    mixture = summarize(DenseCatalog(logits), targets, 40, EXACT_NUM_POWERS)
    single = summarize(DenseCatalog(logits[:, 1]), targets, 40, EXACT_NUM_POWERS)
    assert torch.equal(exact_log_inclusion(mixture, [(1, 4)]), exact_log_inclusion(single, [(0, 4)]))
    # Neighbouring runs of one expert are one block.
    assert torch.equal(exact_log_inclusion(mixture, [(1, 2), (1, 2)]), exact_log_inclusion(single, [(0, 4)]))


@pytest.mark.parametrize("num_experts,k", [(1, 1), (1, 3), (2, 3), (3, 3)])
def test_gradcheck(num_experts, k):
    logits = (torch.randn(2, num_experts, 5, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
              * 2).requires_grad_()
    targets = torch.tensor([[0, 3], [4, 4]])
    runs = expert_runs(k, num_experts)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return exact_log_inclusion(summarize(DenseCatalog(x), targets, 5, EXACT_NUM_POWERS), runs)

    assert torch.autograd.gradcheck(fn, (logits,))


def test_gradcheck_through_the_tail_power_sums():
    logits = torch.randn(2, 3000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    summary = summarize(DenseCatalog(logits), torch.tensor([[3], [2999]]), head_size_for(3000, 2), EXACT_NUM_POWERS)
    head = summary.head_scores.detach().requires_grad_()
    tail = summary.tail_log_power_sums.detach().requires_grad_()

    def fn(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return exact_log_inclusion(dataclasses.replace(summary, head_scores=h, tail_log_power_sums=t), [(0, 2)])

    # Only the head slots that matter (the target's and the best ones) are perturbed, to keep it fast.
    assert torch.autograd.gradcheck(lambda t: fn(head, t), (tail,))
    slots = torch.cat([summary.target_pos[:, :1], head[:, 0].topk(3).indices], 1)

    def on_slots(values: torch.Tensor) -> torch.Tensor:
        return fn(head.scatter(2, slots.unsqueeze(1), values), tail)

    assert torch.autograd.gradcheck(on_slots, (head.detach().gather(2, slots.unsqueeze(1)).requires_grad_(),))


def test_gradient_matches_enumeration():
    logits = (torch.randn(4, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
              * 3).requires_grad_()
    targets = torch.tensor([[0], [1], [5], [2]])
    got = torch.autograd.grad(_log_pi(logits, targets, 3).sum(), logits)[0]
    ref = inclusion_probs(logits.unsqueeze(1), expert_of_position(3, 1)).log().gather(1, targets).sum()
    want = torch.autograd.grad(ref, logits)[0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("k", [1, 10, 100])
@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_probabilities_sum_to_k(k, tau):
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(k), dtype=torch.float64) / tau
    pi = _log_pi(logits, _all_items(2, 1000), k).exp()
    assert torch.allclose(pi.sum(1), torch.full((2,), float(k), dtype=torch.float64), rtol=1e-6, atol=0.0)
    assert bool((pi <= 1.0).all())


def _counts(logits: torch.Tensor, k: int, num_samples: int, seed: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1], dtype=torch.float64)
    chunk = 2000
    for _ in range(num_samples // chunk):
        picks = sample_candidates(logits.expand(chunk, *logits.shape[1:]), k, generator=gen)
        counts += torch.bincount(picks.reshape(-1), minlength=logits.shape[-1]).double()
    return counts.numpy()


@pytest.mark.parametrize("k,tau", [(10, 1.0), (10, 0.3), (200, 1.0)])
def test_single_expert_matches_monte_carlo(k, tau):
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(k), dtype=torch.float64) / tau
    pi = _log_pi(logits, _all_items(1, 1000), k).exp()[0].numpy()
    num_samples = 20000
    assert_counts_match(_counts(logits.float(), k, num_samples, seed=k), pi, num_samples, alpha=1e-6)


# Block-exact vs Monte-Carlo, N = 1000, M = 5, K = 10 (2e5 samples, expert logits sharing 80% of
# their variance, τ ∈ {1, 0.5}): the bias RMS over items with π ≥ 0.01 was below the Monte-Carlo
# noise (3-4e-4), the relative bias RMS ≤ 0.8%, and the largest |π_block-exact − π_MC|, noise
# included, was 2.4e-3 (τ = 0.5). The tolerance is that largest deviation rounded up.
_BLOCK_EXACT_TOLERANCE = 3e-3


def test_block_exact_matches_monte_carlo_within_its_tolerance():
    gen = torch.Generator().manual_seed(7)
    common, own = torch.randn(1, 1, 1000, generator=gen), torch.randn(1, 5, 1000, generator=gen)
    logits = (math.sqrt(0.8) * common + math.sqrt(0.2) * own).double() / 0.5
    pi = _log_pi(logits, _all_items(1, 1000), 10).exp()[0].numpy()
    num_samples = 20000
    assert_counts_match(_counts(logits.float(), 10, num_samples, seed=8), pi, num_samples, alpha=1e-6,
                        method_tolerance=_BLOCK_EXACT_TOLERANCE)


@pytest.mark.parametrize("num_experts", [1, 2])
def test_float32_extremes_stay_finite(num_experts):
    base = torch.tensor([0.0, 1e4, -1e4, 5e3, -70.0, 3.0, 2.0, -5e3, 1.0, -1.0])
    logits = torch.stack([base, base.roll(3)])[:, None].expand(-1, num_experts, -1).contiguous()
    logits = logits + 0.5 * torch.arange(num_experts).view(1, -1, 1)
    targets = torch.tensor([[1, 2, 4, 0, 7], [0, 2, 4, 6, 9]])
    for dtype in (torch.float32, torch.float64):
        x = logits.to(dtype).requires_grad_()
        out = _log_pi(x, targets, 3)
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(grad).all())
        assert bool((out <= 0).all())
        if dtype == torch.float32:
            low32 = out.detach()
        else:  # a float32 logit of size 1e4 is itself only known to ±5e-4
            assert torch.allclose(low32.double(), out.detach(), rtol=1e-4, atol=1e-2)
    assert low32[0, 0] > -1e-3  # the item 1e4 above everything is surely drawn
    assert low32[0, 1] < -1e4  # e^{-1e4}: finite, and as small as it should be


def test_wide_gaps_match_enumeration():
    """Items 1e4 above and below the rest: the softmax for K = 1, enumeration (where it does not
    underflow) for larger K, finite logs below."""
    logits = torch.tensor([[1e4, 1e4 - 1.0, 0.3, 0.0, -0.5, -1e4 + 2.0, -1e4]], dtype=torch.float64)
    items = _all_items(1, 7)
    for k in (1, 2, 3, 4):
        got = _log_pi(logits, items, k)
        if k == 1:
            assert torch.allclose(got, logits.log_softmax(1), rtol=0.0, atol=1e-8)
        ref = inclusion_probs(logits.unsqueeze(1), expert_of_position(k, 1))
        known = ref > 1e-300
        assert torch.allclose(got.exp()[known], ref[known], rtol=1e-6, atol=0.0), (k, got, ref)
        assert bool(torch.isfinite(got).all()) and bool((got[~known] < -5e3).all())


@pytest.mark.parametrize("gap", [10.0, 1e4])
def test_node_count_does_not_grow_with_the_logit_gap(gap):
    """The count of clocks past g is flat across a gap (items far above have all rung), so the
    range stays short; and where it must be long (items present with probability 1/2 only, so
    the count can stay below k all the way down), its gaps cost a few nodes each."""
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(0))
    logits[:, :5] += gap
    logits[:, -5:] -= gap
    valid, no_tail = torch.ones_like(logits, dtype=torch.bool), torch.full((4,), -math.inf)
    for k in (1, 5, 10, 200):
        g, _, g_hi, _ = _nodes(logits, torch.ones_like(logits), valid, no_tail, k, True)
        assert g.shape[1] <= 100, (k, g.shape)
        assert bool((g_hi - g.min(1).values < 30.0).all())
    small = logits[:, 245:257].clone()
    small[:, :3] += gap
    small[:, -3:] -= gap
    g, _, g_hi, _ = _nodes(small, torch.full_like(small, 0.5), valid[:, :12], no_tail, 9, False)
    assert bool((g_hi - g.min(1).values > 2 * gap).all()) and g.shape[1] <= 300, g.shape


def test_gaps_between_score_clusters_agree_with_panels(monkeypatch):
    """Clusters of scores 100 apart and a mixture with K close to N (the count can stay below k
    over the whole range): one Gauss–Legendre rule in e^{-g} per gap agrees with panels there."""
    logits = torch.randn(3, 2, 30, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    logits[:, :, :4] += 100.0
    logits[:, :, 10:13] += 200.0
    logits[:, :, -4:] -= 100.0
    items = _all_items(3, 30)
    got = _log_pi(logits, items, 24)
    monkeypatch.setattr(exact_module, "_QUIET", math.inf)  # no gaps: panels all the way
    want = _log_pi(logits, items, 24)
    assert torch.allclose(got, want, rtol=0.0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fft_products_match_direct_products(dtype):
    gen = torch.Generator().manual_seed(1)
    p = torch.rand(2, 3, 300, generator=gen, dtype=torch.float64) ** 4  # probabilities spread over decades
    for k in (13, 40, 200):
        direct = _pb_poly(p, k, fft=False)
        fast = _pb_poly(p.to(dtype), k, fft=True).double()
        # Absolute: the factors are probability vectors, so FFT rounding is ~1e-16 of 1 (it is in
        # float64 for float32 input too; the float32 error is the input's rounding).
        tol = 1e-14 if dtype == torch.float64 else 1e-6
        assert (fast - direct).abs().max() <= tol
    a, b = torch.rand(2, 2, 16, generator=gen, dtype=torch.float64), torch.rand(2, 2, 16, generator=gen,
                                                                                 dtype=torch.float64)
    for conj in (False, True):  # product and correlation, with first and second derivatives
        fn = lambda x, y, conj=conj: _FFTConv.apply(x, y, 20, conj)  # noqa: E731
        args = (a.requires_grad_(), b.requires_grad_())
        assert torch.autograd.gradcheck(fn, args) and torch.autograd.gradgradcheck(fn, args)


def test_node_chunks_do_not_change_the_result():
    logits = torch.randn(2, 2, 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64).requires_grad_()
    items = torch.tensor([[0, 7], [39, 39]])
    whole = _log_pi(logits, items, 6)
    (grad_whole,) = torch.autograd.grad(whole.sum(), logits)
    chunked = _log_pi(logits, items, 6, memory_budget=1)  # one row and one node per piece
    (grad_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    assert torch.allclose(chunked, whole, rtol=1e-12, atol=0.0)
    assert torch.allclose(grad_chunked, grad_whole, rtol=1e-10, atol=1e-14)


def test_tiny_probabilities_keep_relative_accuracy():
    logits = torch.cat([torch.zeros(1, 6), torch.tensor([[-60.0, -80.0]])], 1).double()
    ref = inclusion_probs(logits.unsqueeze(1), expert_of_position(2, 1))[0, 6:]
    got = _log_pi(logits.float(), torch.tensor([[6, 7]]), 2)[0].double()
    assert torch.allclose(got, ref.log(), rtol=0.0, atol=1e-4)  # π ≈ 1e-26 and 2e-35


def test_all_items_drawn_when_k_equals_n():
    logits = torch.randn(2, 2, 6, generator=torch.Generator().manual_seed(0)).requires_grad_()
    out = _log_pi(logits, torch.tensor([[0, 5], [3, 3]]), 6)
    assert torch.equal(out.detach(), torch.zeros(2, 2))
    out.sum().backward()
    assert bool(torch.isfinite(logits.grad).all())


@pytest.mark.parametrize("k", [10, 200])
def test_head_and_tail_match_the_whole_catalog_as_head(k):
    gen = torch.Generator().manual_seed(k)
    user, item = torch.randn(2, 16, generator=gen, dtype=torch.float64), torch.randn(20000, 16, generator=gen,
                                                                                     dtype=torch.float64)
    catalog = EmbeddingCatalog(user, item, temperature=2.0)
    targets = torch.cat([catalog.top_items(3)[:, 0], torch.tensor([[5, 19999], [0, 1]])], 1)
    runs = [(0, k)]
    split = summarize(catalog, targets, head_size_for(20000, k), EXACT_NUM_POWERS)
    assert bool(torch.isfinite(split.tail_log_power_sums).all())  # the tail is not empty
    whole = summarize(catalog, targets, 20000, EXACT_NUM_POWERS)
    got, want = exact_log_inclusion(split, runs).exp(), exact_log_inclusion(whole, runs).exp()
    assert torch.allclose(got, want, rtol=1e-4, atol=0.0)


def test_bad_runs_raise():
    summary = summarize(DenseCatalog(torch.randn(1, 2, 5)), torch.tensor([[0]]), 5, EXACT_NUM_POWERS)
    for runs, match in (([], "empty"), ([(2, 1)], "experts in"), ([(0, 0)], "counts"), ([(0, 1, 2)], "pairs")):
        with pytest.raises(ValueError, match=match):
            exact_log_inclusion(summary, runs)
