"""Sampling and ordered-draw log-probabilities against exact enumeration and Monte-Carlo."""

import math

import numpy as np
import pytest
import torch

from capg_rec import (CAPGLoss, DenseCatalog, EmbeddingCatalog, VPGLoss, candidate_log_prob, expert_of_position,
                      greedy_candidates, inclusion_log_prob, sample_candidates)
from capg_rec._enumerate import all_draws, draw_log_probs
from capg_rec._numerics import gumbel_top_k
from tests.stats import assert_counts_match, chi_square_pvalue

CASES = [(5, 2, 1), (6, 3, 1), (5, 3, 2), (7, 3, 3), (4, 3, 2), (6, 2, 2)]  # (N, K, M)


def _scores(n, m, seed, scale=1.5, batch=1):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(batch, m, n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(("k", "m", "expected"), [
    (10, 5, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]), (7, 3, [0, 0, 0, 1, 1, 2, 2]), (4, 1, [0, 0, 0, 0]),
    (3, 5, [0, 1, 2]), (1, 1, [0])])
def test_expert_of_position(k, m, expected):
    assert expert_of_position(k, m).tolist() == expected


@pytest.mark.parametrize(("n", "k", "m"), CASES)
def test_candidate_log_prob_matches_enumeration(n, k, m):
    scores = _scores(n, m, seed=n * 10 + k, batch=2)
    draws = all_draws(n, k)
    ref = draw_log_probs(scores, draws, expert_of_position(k, m))  # [2, S]
    assert torch.allclose(ref.exp().sum(1), torch.ones(2, dtype=torch.float64))
    rows = torch.arange(2).repeat_interleave(len(draws))
    got = candidate_log_prob(scores[rows], draws.repeat(2, 1))
    torch.testing.assert_close(got, ref.reshape(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("n", "k", "m"), CASES)
def test_candidate_log_prob_gradient_matches_enumeration(n, k, m):
    scores = _scores(n, m, seed=k + m, batch=1).requires_grad_()
    draws = all_draws(n, k)[:7]
    ref = draw_log_probs(scores, draws, expert_of_position(k, m)).sum()
    got = candidate_log_prob(scores.expand(len(draws), -1, -1), draws).sum()
    torch.testing.assert_close(torch.autograd.grad(got, scores)[0], torch.autograd.grad(ref, scores)[0])


@pytest.mark.parametrize(("k", "m"), [(3, 2), (4, 2), (2, 5), (5, 1), (7, 3), (8, 3)])
def test_candidate_log_prob_with_replacement_is_sum_of_softmaxes(k, m):
    """Each position under its own expert, for even and uneven runs and fewer positions than experts;
    a masked item that is not drawn changes nothing but its own (zero) gradient."""
    scores = _scores(9, m, seed=3 + k, batch=3)
    scores[0, :, 8] = -math.inf
    scores.requires_grad_()
    cand = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(b))[:k] for b in range(3)])
    experts = expert_of_position(k, m)
    ref = scores.log_softmax(2)[torch.arange(3).unsqueeze(1), experts, cand].sum(1)  # [B]
    got = candidate_log_prob(scores, cand, with_replacement=True)
    torch.testing.assert_close(got, ref)
    weights = torch.tensor([1.0, -2.0, 0.5], dtype=scores.dtype)
    grad, = torch.autograd.grad((got * weights).sum(), scores)
    grad_ref, = torch.autograd.grad((ref * weights).sum(), scores)
    torch.testing.assert_close(grad, grad_ref)
    assert grad[0, :, 8].eq(0).all()


@pytest.mark.parametrize(("k", "m"), [(3, 2), (2, 3)])
def test_candidate_log_prob_with_replacement_gradgradcheck(k, m):
    scores = _scores(5, m, seed=k, batch=2).requires_grad_()
    cand = torch.tensor([[0, 3, 1], [4, 2, 0]])[:, :k]
    assert torch.autograd.gradgradcheck(lambda s: candidate_log_prob(s, cand, with_replacement=True), (scores,))


def test_candidate_log_prob_gradcheck():
    scores = _scores(5, 2, seed=1, batch=2).requires_grad_()
    cand = torch.tensor([[0, 3, 1], [4, 2, 0]])
    for wr in (False, True):
        assert torch.autograd.gradcheck(lambda s: candidate_log_prob(s, cand, with_replacement=wr), (scores,))


def test_temperature_divides_logits():
    scores = _scores(6, 1, seed=2, batch=2)
    cand = torch.tensor([[0, 1], [3, 2]])
    torch.testing.assert_close(candidate_log_prob(scores, cand, temperature=0.25),
                               candidate_log_prob(scores * 4, cand))


@pytest.mark.parametrize("logits", [[1.0, 2.0, -3.0, 0.5, -math.inf], [-1.0, -2.0, -3.0, -0.5, -1.0]])
def test_logits_that_overflow_over_a_small_temperature_are_refused(logits):
    """Finite logits over τ = 1e-40 overflow float32: +inf scores gave NaN probabilities and a greedy order that
    was not the logits' ([0, 1] for [1, 0]); -inf ones masked the items (an error about masking). Every entry
    point now names the temperature."""
    import capg_rec

    x = torch.tensor([logits])
    chosen, cand = torch.tensor([[3]]), torch.tensor([[3, 0]])
    calls = [lambda: capg_rec.inclusion_log_prob(x, chosen, 2, temperature=1e-40),
             lambda: candidate_log_prob(x, cand, temperature=1e-40),
             lambda: capg_rec.greedy_candidates(x, 2, temperature=1e-40),
             lambda: capg_rec.sample_candidates(x, 2, temperature=1e-40),
             lambda: capg_rec.CAPGLoss(2, temperature=1e-40)(x, cand, chosen, torch.ones(1, 1)),
             lambda: capg_rec.VPGLoss(2, temperature=1e-40)(x, cand, chosen, torch.ones(1, 1))]
    for call in calls:
        with pytest.raises(ValueError, match="temperature"):
            call()
    capg_rec.greedy_candidates(x, 2, temperature=1e-30)  # within range: accepted
    masked = torch.full((1, 5), -math.inf)  # every item masked: nothing overflows (found by review: refused)
    none = capg_rec.inclusion_log_prob(masked, chosen, 2, temperature=0.5, method="with_replacement")
    assert none.item() == -math.inf
    nan = x.clone()
    nan[0, 0] = math.nan  # the logits' own fault is named as such at any temperature (found by review)
    with pytest.raises(ValueError, match="logits must be finite"):
        capg_rec.CAPGLoss(2, temperature=0.5)(nan, cand, chosen, torch.ones(1, 1))
    torch.testing.assert_close(candidate_log_prob(x, cand, temperature=1e-3), candidate_log_prob(x * 1e3, cand))


def _draw_counts(draws: torch.Tensor, sampled: torch.Tensor) -> np.ndarray:
    n = int(draws.max()) + 1
    code = lambda d: (d * n ** torch.arange(d.shape[1])).sum(1)  # noqa: E731
    index = {int(c): i for i, c in enumerate(code(draws))}
    return np.bincount([index[int(c)] for c in code(sampled)], minlength=len(draws))


@pytest.mark.parametrize(("n", "k", "m"), CASES)
@pytest.mark.parametrize("placement", ["dense", "embedding"])
def test_sampler_matches_enumeration_chi_square(n, k, m, placement):
    """Ordered draws follow sequential PL-MoE exactly (χ² over all ordered outcomes)."""
    num_samples = 20_000
    gen = torch.Generator().manual_seed(1234 + n + k + m)
    if placement == "dense":
        scores = _scores(n, m, seed=n + k + m)
        catalog = DenseCatalog(scores.expand(num_samples, -1, -1))
    else:
        user = torch.randn(1, m, 3, generator=gen, dtype=torch.float64)
        item = torch.randn(n, m, 3, generator=gen, dtype=torch.float64)
        scores = torch.einsum("bmd,nmd->bmn", user, item)
        catalog = EmbeddingCatalog(user.expand(num_samples, -1, -1), item, chunk_size=2)
    sampled = sample_candidates(catalog, k, generator=gen)
    draws = all_draws(n, k)
    probs = draw_log_probs(scores, draws, expert_of_position(k, m))[0].exp().numpy()
    assert chi_square_pvalue(_draw_counts(draws, sampled), probs) > 1e-6


@pytest.mark.parametrize(("n", "k", "group_size"), [(5, 2, 2), (7, 3, 2), (7, 2, 3), (6, 3, 6), (7, 1, 4)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_two_level_gumbel_top_k_matches_enumeration(n, k, group_size, dtype):
    """The two-level draw is exact for any group size, incl. a padded last group and excluded items."""
    num_samples = 20_000
    scores = _scores(n, 1, seed=n + k + group_size).to(dtype)
    scores[..., 1] = -torch.inf  # an excluded item is never drawn
    gen = torch.Generator().manual_seed(99 + n + k)
    sampled = gumbel_top_k(scores.expand(num_samples, -1, -1), k, generator=gen, group_size=group_size)[:, 0]
    assert not (sampled == 1).any()
    draws = all_draws(n, k)
    log_p = draw_log_probs(scores.double(), draws, expert_of_position(k, 1))[0]
    assert chi_square_pvalue(_draw_counts(draws, sampled), log_p.exp().numpy()) > 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_two_level_gumbel_top_k_with_empty_groups(dtype):
    """Whole groups of excluded items, and fewer non-empty groups than draws: with groups of 3
    over 12 items, item i is in group i mod 4, so items 0, 4, 8 share group 0 and groups 1-3 hold
    nothing drawable; the draw is then a PL order of 0, 4, 8 (χ² over the 6 orders)."""
    num_samples = 20_000
    scores = torch.full((num_samples, 12), -torch.inf, dtype=dtype)
    scores[:, [0, 4, 8]] = torch.tensor([1.0, 0.0, -0.5], dtype=dtype)
    sampled = gumbel_top_k(scores, 3, generator=torch.Generator().manual_seed(5), group_size=3)
    draws = all_draws(3, 3)
    ids = torch.tensor([0, 4, 8])
    log_p = draw_log_probs(torch.tensor([[[1.0, 0.0, -0.5]]], dtype=torch.float64), draws, expert_of_position(3, 1))[0]
    code = {tuple(ids[d].tolist()): i for i, d in enumerate(draws)}
    counts = np.bincount([code[tuple(row)] for row in sampled.tolist()], minlength=len(draws))
    assert chi_square_pvalue(counts, log_p.exp().numpy()) > 1e-6


def test_default_sampler_is_exact_on_a_larger_catalog():
    """At N = 200, K = 4 the sampler takes the two-level path (groups of 7): the first draw
    follows the softmax and each item's inclusion frequency its exact probability."""
    from capg_rec import inclusion_log_prob

    num_samples, n, k = 40_000, 200, 4
    logits = _scores(n, 1, seed=5, scale=2.0)[:, 0]
    sampled = sample_candidates(logits.expand(num_samples, -1), k, generator=torch.Generator().manual_seed(3))
    assert (sampled.sort(1).values.diff(dim=1) > 0).all()
    first = np.bincount(sampled[:, 0].numpy(), minlength=n)
    assert_counts_match(first, torch.softmax(logits[0], 0).numpy(), num_samples)
    included = np.bincount(sampled.flatten().numpy(), minlength=n)
    exact = inclusion_log_prob(logits, torch.arange(n)[None], k, method="exact")[0].exp().numpy()
    assert_counts_match(included, exact, num_samples)


def test_sampler_with_extreme_logits():
    """One item 2e4 above the rest (fp32): it comes first, the others are distinct, in range, and
    spread uniformly (the two-level path must not lose the low-scoring groups)."""
    num_samples, n, k = 4000, 1000, 10
    logits = torch.full((num_samples, n), -1e4)
    logits[:, 7] = 1e4
    sampled = sample_candidates(logits, k, generator=torch.Generator().manual_seed(0))
    assert (sampled[:, 0] == 7).all()
    assert (sampled.sort(1).values.diff(dim=1) > 0).all() and int(sampled.max()) < n
    rest = np.bincount(sampled[:, 1:].flatten().numpy(), minlength=n)
    probs = np.full(n, (k - 1) / (n - 1))
    probs[7] = 0.0
    assert_counts_match(rest, probs, num_samples)


def test_shared_noise_sampler_is_detected():
    """Power check: one Gumbel vector shared by all expert blocks (the paper appendix's sampler)
    is biased when experts differ, and the χ² test above rejects it."""
    num_samples = 20_000
    scores = torch.tensor([[[3.0, 0.0, 0.0], [0.0, 3.0, 0.0]]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    u = torch.rand(num_samples, 3, generator=gen, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u))
    first = (scores[:, 0] + gumbel).argmax(1)
    second = (scores[:, 1] + gumbel).scatter(1, first[:, None], -torch.inf).argmax(1)
    sampled = torch.stack([first, second], 1)
    draws = all_draws(3, 2)
    probs = draw_log_probs(scores, draws, expert_of_position(2, 2))[0].exp().numpy()
    assert chi_square_pvalue(_draw_counts(draws, sampled), probs) < 1e-6


def test_greedy_is_blockwise_argmax():
    scores = torch.tensor([[[5.0, 4.0, 3.0, 0.0], [6.0, 0.0, 1.0, 2.0]]])
    assert greedy_candidates(scores, 4).tolist() == [[0, 1, 3, 2]]
    assert greedy_candidates(scores[:, 0], 3).tolist() == [[0, 1, 2]]


def test_sampling_is_reproducible_and_distinct():
    logits = torch.randn(64, 2, 300)
    a = sample_candidates(logits, 20, generator=torch.Generator().manual_seed(0))
    b = sample_candidates(logits, 20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    assert (a.sort(1).values.diff(dim=1) > 0).all()


def test_embedding_catalog_reductions_match_dense():
    gen = torch.Generator().manual_seed(0)
    user = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    item = torch.randn(37, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    emb = EmbeddingCatalog(user, item, temperature=0.7, chunk_size=5)
    dense = DenseCatalog(torch.einsum("bmd,nmd->bmn", user, item), temperature=0.7)
    exclude = torch.tensor([[0, 5, -1], [36, 1, 2], [-1, -1, -1]])
    items = torch.tensor([[1, 2], [3, 36], [0, 0]])
    for cat in (emb, dense):
        assert cat.top_items(6, exclude=exclude).shape == (3, 2, 6)
    assert torch.equal(emb.top_items(6, exclude=exclude), dense.top_items(6, exclude=exclude))
    out_e = (emb.log_power_sums(exclude, 3), emb.gather(items), emb.log_softmax(items), *emb.gather_with_rest(items))
    out_d = (dense.log_power_sums(exclude, 3), dense.gather(items), dense.log_softmax(items),
             *dense.gather_with_rest(items))
    for a, b in zip(out_e, out_d):
        torch.testing.assert_close(a, b)
    weights = torch.randn(3, 2, 3, generator=gen, dtype=torch.float64)
    grads_e = torch.autograd.grad((out_e[0] * weights).sum() + sum(o.sum() for o in out_e[1:]), (user, item))
    grads_d = torch.autograd.grad((out_d[0] * weights).sum() + sum(o.sum() for o in out_d[1:]), (user, item))
    for a, b in zip(grads_e, grads_d):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(
        lambda u, v: EmbeddingCatalog(u, v, chunk_size=4).log_power_sums(exclude, 2), (user, item))


def test_all_excluded_row_gives_minus_inf_and_finite_grad():
    logits = torch.randn(2, 3, requires_grad=True)
    out = DenseCatalog(logits).log_power_sums(torch.tensor([[0, 1, 2], [0, -1, -1]]), 2)
    assert torch.isneginf(out[0]).all() and torch.isfinite(out[1]).all()
    (grad,) = torch.autograd.grad(torch.where(torch.isfinite(out), out, 0).sum(), logits)
    assert torch.isfinite(grad).all() and (grad[0] == 0).all()


@pytest.mark.parametrize("fn", ["sample", "greedy", "logprob"])
def test_bad_inputs_raise(fn):
    logits = torch.randn(2, 5)
    call = {
        "sample": lambda lg, k: sample_candidates(lg, k),
        "greedy": lambda lg, k: greedy_candidates(lg, k),
        "logprob": lambda lg, k: candidate_log_prob(lg, torch.arange(k).expand(2, k)),
    }[fn]
    with pytest.raises(ValueError, match="num_candidates|candidates"):
        call(logits, 6)
    with pytest.raises(ValueError, match="logits"):
        call(torch.tensor([[0.0, float("nan"), 1.0]]), 1)
    with pytest.raises(ValueError, match="logits"):
        call(torch.ones(5, dtype=torch.float32), 1)
    with pytest.raises(TypeError, match="logits"):
        call(torch.ones(2, 5, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="temperature"):
        {"sample": sample_candidates, "greedy": greedy_candidates}.get(fn, lambda lg, k, temperature: (
            candidate_log_prob(lg, torch.arange(k).expand(2, k), temperature=temperature)))(
                logits, 2, temperature=0.0)


def test_candidate_ids_are_checked():
    logits = torch.randn(2, 5)
    with pytest.raises(ValueError, match="candidates.*ids in"):
        candidate_log_prob(logits, torch.tensor([[0, 5], [1, 2]]))
    with pytest.raises(ValueError, match="candidates.*ids in"):
        candidate_log_prob(logits, torch.tensor([[0, -1], [1, 2]]))
    with pytest.raises(ValueError, match="repeat"):
        candidate_log_prob(logits, torch.tensor([[0, 0], [1, 2]]))
    with pytest.raises(ValueError, match="shape"):
        candidate_log_prob(logits, torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="integer"):
        candidate_log_prob(logits, torch.tensor([[0.0, 1.0], [1.0, 2.0]]))


@pytest.mark.parametrize("bad", [2.0, True])
def test_expert_of_position_checks_types_even_after_an_int_call(bad):
    """Regression: the runs were cached before the check, and 2.0 and True hash like 2 and 1, so after
    an int call the same value as a float or bool was served the int's entry instead of a TypeError."""
    expert_of_position(int(bad), 1)
    with pytest.raises(TypeError, match="num_candidates must be an int"):
        expert_of_position(bad, 1)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        expert_of_position(2, bad if bad is True else 1.0)


def test_sample_candidates_names_a_generator_of_the_wrong_type():
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None"):
        sample_candidates(torch.randn(2, 5), 2, generator=5)


def test_draws_among_scores_beyond_resolution_are_refused_and_right_within_it():
    """Found by review: items far below a row's best (a soft mask such as -1e9 in float32) round alike relative to
    it, and a draw that had to choose among them was wrong, silently: the sampler always took the same item (1/3
    each, by symmetry), mean-field gave them 0 and the plug-in 1, "enumerate" summed to 9, the ordered-draw
    log-probability missed its log(1/3). Every entry point now refuses such a draw when validating; in float64
    the same scores are within resolution, and every method, the draw's probability and the sampler are right."""
    soft = [[0.0, 0.5, -1e9, -1e9, -1e9]]
    items = torch.arange(5).expand(1, 5)
    x32 = torch.tensor(soft)
    beyond = r"must draw .*among items more than 5.243e\+05 below their expert's best score"
    with pytest.raises(ValueError, match=beyond):
        sample_candidates(x32, 3)
    for method in ("exact", "mean_field", "plugin", "enumerate"):
        with pytest.raises(ValueError, match=beyond):
            inclusion_log_prob(x32, items, 3, method=method)
    with pytest.raises(ValueError, match=beyond):
        candidate_log_prob(x32, torch.tensor([[0, 1, 2]]))
    for loss in (CAPGLoss(3), VPGLoss(3)):
        with pytest.raises(ValueError, match=beyond):
            loss(x32, torch.tensor([[0, 1, 2]]), torch.tensor([[2]]), torch.ones(1, 1))
    # A draw that takes every unmasked item chooses none of them: π = 1, as for K = N; greedy draws by score alone.
    forced = torch.tensor([[0.0, 0.0, -math.inf, -1e9]])
    assert (inclusion_log_prob(forced, torch.tensor([[0, 1, 3]]), 3) == 0).all()
    assert greedy_candidates(x32, 3)[0].tolist() == [1, 0, 2]
    x64 = torch.tensor(soft, dtype=torch.float64)
    want = torch.tensor([[1.0, 1.0, 1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    for method in ("exact", "mean_field", "plugin", "enumerate"):
        torch.testing.assert_close(inclusion_log_prob(x64, items, 3, method=method).exp(), want)
    torch.testing.assert_close(candidate_log_prob(x64, torch.tensor([[0, 1, 2]])),
                               torch.tensor([math.log(1 / (1 + math.exp(0.5)) / 3)], dtype=torch.float64))
    num_samples = 30_000
    drawn = sample_candidates(x64.expand(num_samples, -1), 3, generator=torch.Generator().manual_seed(0))
    counts = np.bincount(drawn.flatten().numpy(), minlength=5)
    assert_counts_match(counts, want[0].numpy(), num_samples)
    with pytest.raises(ValueError, match=r"more than 2.815e\+14 below"):
        sample_candidates(torch.tensor([[0.0, 0.5, -1e30, -1e30, -1e30]], dtype=torch.float64), 3)


@pytest.mark.parametrize("base", [-1e9, 1e8, -3e38])
def test_the_sampler_adds_its_noise_to_scores_relative_to_the_best(base):
    """Found by review: the Gumbel noise was added to the raw scores, so that a row of equal scores near -1e9 (a row
    of soft-masked items), 1e8 or -3e38 rounded it away and drew its first item always (or almost). Five equal
    scores are drawn uniformly, and so is the block of a mixture's expert whose scores all carry an offset."""
    num_samples = 20_000
    gen = torch.Generator().manual_seed(0)
    drawn = sample_candidates(torch.full((num_samples, 5), base), 2, generator=gen)
    assert_counts_match(np.bincount(drawn[:, 0].numpy(), minlength=5), np.full(5, 0.2), num_samples)
    mixture = torch.zeros(num_samples, 2, 6)
    mixture[:, 1] += abs(base) if base > -1e30 else 1e30
    drawn = sample_candidates(mixture, 4, generator=gen)
    picks = np.bincount(drawn[:, 2].numpy(), minlength=6)  # expert 1's first pick, among the 4 items left
    taken = np.bincount(drawn[:, :2].flatten().numpy(), minlength=6) / num_samples  # each item's share taken by then
    assert_counts_match(picks, (1 - taken) / 4, num_samples, method_tolerance=0.01)


def test_an_ordered_draw_taking_one_item_beyond_resolution_is_allowed():
    """A draw that takes one item beyond resolution (a soft mask of -1e9) leaves nothing to order among such items:
    it is resolved, and sampling and the ordered-draw probability are right. Refusing it (a rule of "some taken"
    for "more than one taken") went unnoticed by every test (a review's mutation)."""
    x = torch.tensor([[0.0, 0.5, -1e9]])
    draws = torch.tensor([[1, 0, 2], [0, 1, 2]])
    want = draw_log_probs(x.double().unsqueeze(1), draws, expert_of_position(3, 1))[0]  # enumeration, float64
    got = candidate_log_prob(x.expand(2, -1), draws)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    drawn = sample_candidates(x, 3, generator=torch.Generator().manual_seed(0))
    assert drawn[0, 2] == 2 and sorted(drawn[0].tolist()) == [0, 1, 2]


def test_draws_beyond_resolution_are_refused_even_far_apart_and_k_n_and_huge_bests_are_right():
    """Reviews of the resolution checks: a rule that took far items lying 40 nats apart (beyond their rounding)
    answered wrong (mean-field 0.934 and 0 for two certain items at -1e7 in float32; "enumerate" π = 2 for two equal
    items both taken at -1e20; the plug-in 1 and 0.368 for a mixture's 0.731 and 0.269): any draw that takes such
    items and must choose or order them is refused. A mixture's K = N inclusion probabilities (all 1) are taken, and
    the sampler no longer draws masked items where the best score exceeds ~1e31 and its groups hold fewer than k."""
    beyond = r"must draw .*among items more than 5.243e\+05 below their expert's best score"
    apart = torch.tensor([[0.0, -1e7, -1e7 - 60, -1e7 - 120, -1e7 - 180]])
    for method in ("mean_field", "plugin", "enumerate", "exact"):
        with pytest.raises(ValueError, match=beyond):
            inclusion_log_prob(apart, torch.tensor([[2, 3]]), 4, method=method)
    with pytest.raises(ValueError, match=beyond):
        inclusion_log_prob(torch.tensor([[0.0, -1e20, -1e20, -1e20 - 1e14, -1e20 - 2e14]]), torch.tensor([[1, 2]]), 3,
                           method="enumerate")
    mixed = torch.tensor([[[10.0, -50, -50, 10, -50], [0, -1e7, -1e7 - 1, -1e7 - 1000, -1e7 - 2000]]])
    with pytest.raises(ValueError, match=beyond):
        inclusion_log_prob(mixed, torch.tensor([[1, 2]]), 3, method="plugin")
    with pytest.raises(ValueError, match=beyond):
        sample_candidates(-torch.arange(20.0).expand(3, -1), 10, temperature=1e-5)  # far apart, but far
    mixture = torch.tensor([[[0.0, -1e9, -1e9, -1e9], [0.0, 1.0, 2.0, 3.0]]])
    assert (inclusion_log_prob(mixture, torch.tensor([[0, 3]]), 4) == 0).all()
    with pytest.raises(ValueError, match="must draw"):
        sample_candidates(mixture, 4)  # the order of expert 0's three alike items is not resolved
    for dtype, base in ((torch.float32, 1.1e31), (torch.float64, 1e300)):
        row = torch.full((1, 200), -math.inf, dtype=dtype)
        row[0, [0, 25, 50]] = base
        for seed in range(20):
            drawn = sample_candidates(row, 3, generator=torch.Generator().manual_seed(seed))
            assert sorted(drawn[0].tolist()) == [0, 25, 50], (dtype, drawn)
