"""Serving-time logging: logged propensities against exact enumeration of the exploration mixture,
against Monte-Carlo frequencies of the matching sampler, across catalog placements, and bad inputs."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from capg_rec import DenseCatalog, EmbeddingCatalog, expert_of_position
from capg_rec._enumerate import all_draws, draw_log_probs
from capg_rec.logs import LoggedPropensities, explore_candidates, log_propensities
from capg_rec.testing import esr_cases
from tests.stats import assert_counts_match


def _mixture_oracle(logits, k, tau, eps):
    """Every ordered draw of the ε-mixture, by enumeration → (draws [S, K], probs [B, S], counts [B, N]).

    ``counts`` is the with-replacement expected count (1-ε) Σ_k softmax_{m(k)} + ε K/N_avail."""
    scores = (logits if logits.dim() == 3 else logits.unsqueeze(1)).double() / tau
    batch, _, n = scores.shape
    experts = expert_of_position(k, scores.shape[1])
    draws = all_draws(n, k)
    pl = draw_log_probs(scores, draws, experts).exp()  # [B, S]
    ok = (scores > -math.inf).all(1)  # [B, N]: items the uniform draw can return
    avail = ok.sum(1, keepdim=True).double()
    falling = torch.exp(torch.lgamma(avail - k + 1) - torch.lgamma(avail + 1))
    uniform = torch.where(ok[:, draws].all(2), falling, 0.0) if eps > 0 else torch.zeros_like(pl)
    probs = (1 - eps) * pl + eps * uniform
    swr = torch.softmax(scores, 2)[:, experts].sum(1)  # [B, N]
    counts = (1 - eps) * swr + (eps * k / avail * ok if eps > 0 else 0.0)
    return draws, probs, counts


def _inclusion_from(draws, probs, n):
    member = torch.zeros(draws.shape[0], n, dtype=probs.dtype).scatter_(1, draws, 1.0)
    return probs @ member  # [B, N]


def _draw_index(draws, candidates):
    """Row of ``draws`` [S, K] equal to each candidate row [R, K] → [R]."""
    return (candidates.unsqueeze(1) == draws.unsqueeze(0)).all(2).int().argmax(1)


@pytest.mark.parametrize(("n", "k", "m"), [(5, 1, 1), (6, 2, 1), (7, 3, 1), (5, 2, 2), (7, 3, 2), (4, 3, 2)])
@pytest.mark.parametrize(("tau", "eps"), [(1.0, 0.0), (2.5, 0.0), (1.0, 0.3), (0.7, 1.0), (2.0, 0.1)])
def test_exact_enumeration(n, k, m, tau, eps):
    """All three outputs equal the enumerated mixture for every ordered draw and every shown item,
    with one item masked in the second row."""
    g = torch.Generator().manual_seed(n * 10 + k + m)
    logits = 1.5 * torch.randn(2, m, n, generator=g, dtype=torch.float64)
    logits[1, :, n - 1] = -math.inf
    draws, probs, counts = _mixture_oracle(logits, k, tau, eps)
    inclusion = _inclusion_from(draws, probs, n)
    possible = probs > 0
    for b in range(2):
        cands = draws[possible[b]]  # every draw row b can make, as a batch of requests
        rows = logits[b:b + 1].expand(len(cands), -1, -1)
        shown = cands[:, :min(2, k)].flip(1)
        got = log_propensities(rows, cands, shown, method="enumerate", temperature=tau, epsilon=eps)
        assert isinstance(got, LoggedPropensities)
        torch.testing.assert_close(got.log_candidate_prob.exp(), probs[b][possible[b]], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got.log_inclusion.exp(), inclusion[b][shown], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got.log_expected_count.exp(), counts[b][shown], rtol=1e-9, atol=1e-12)


def test_exact_method_matches_enumeration_for_one_expert():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 7, generator=g, dtype=torch.float64)
    cands = explore_candidates(logits, 3, temperature=2.0, epsilon=0.2, generator=g)
    shown = cands[:, :2]
    exact = log_propensities(logits, cands, shown, method="exact", temperature=2.0, epsilon=0.2)
    ref = log_propensities(logits, cands, shown, method="enumerate", temperature=2.0, epsilon=0.2)
    torch.testing.assert_close(exact.log_inclusion, ref.log_inclusion, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(exact.log_candidate_prob, ref.log_candidate_prob)


@given(case=esr_cases(max_batch=2, max_experts=2, max_items=6, masked=True),
       eps=st.sampled_from([0.0, 0.25, 1.0]))
def test_monte_carlo(case, eps):
    """Frequencies of explore_candidates draws (each item's inclusion, each ordered draw) agree with
    the logged propensities, within exact binomial bounds (Bonferroni over all entries, α = 1e-6)."""
    logits, k, tau, seed = case
    batch, n = logits.shape[0], logits.shape[-1]
    if eps > 0:  # the uniform draw needs K items unmasked under every expert
        ok = (logits > -math.inf).reshape(batch, -1, n).all(1).sum(1).min()
        k = min(k, int(ok))
    samples = 4000
    g = torch.Generator().manual_seed(seed)
    rows = logits.repeat_interleave(samples, 0)
    cands = explore_candidates(rows, k, temperature=tau, epsilon=eps, generator=g)
    draws = all_draws(n, k)
    idx = _draw_index(draws, cands).view(batch, samples)
    draw_counts = torch.zeros(batch, len(draws)).scatter_add_(1, idx, torch.ones(batch, samples))
    everything = draws.repeat(batch, 1)
    grid = logits.repeat_interleave(len(draws), 0)
    logged = log_propensities(grid, everything, everything, method="enumerate", temperature=tau, epsilon=eps,
                              validate_args=False)
    claimed_draw = logged.log_candidate_prob.exp().view(batch, -1)
    incl = torch.full((batch * len(draws), n), math.nan, dtype=logged.log_inclusion.dtype)
    incl.scatter_(1, everything, logged.log_inclusion.exp())  # each item's claim, from a draw holding it
    claimed_item = torch.nanmean(incl.view(batch, len(draws), n), 1).nan_to_num(0.0)
    item_counts = torch.zeros(batch, n).scatter_add_(1, cands.view(batch, -1), torch.ones(batch, samples * k))
    probs = np.concatenate([claimed_draw.double().numpy().ravel(), claimed_item.double().numpy().ravel()])
    counts = np.concatenate([draw_counts.numpy().ravel(), item_counts.numpy().ravel()])
    assert_counts_match(counts, probs, samples, alpha=1e-6)


def _embedding_pair(batch, n, m, d, seed, masked=None):
    g = torch.Generator().manual_seed(seed)
    user, item = torch.randn(batch, m, d, generator=g), torch.randn(n, m, d, generator=g)
    dense = torch.einsum("bmd,nmd->bmn", user, item)
    if masked is not None:
        index = torch.where(masked >= 0, masked, n).unsqueeze(1).expand(-1, m, -1)  # padding: a spare column
        dense = torch.nn.functional.pad(dense, (0, 1)).scatter(2, index, -math.inf)[..., :n]
    emb = EmbeddingCatalog(user, item, masked_items=masked, chunk_size=7)
    return dense, emb


@pytest.mark.parametrize("eps", [0.0, 0.3])
@pytest.mark.parametrize("method", ["mean_field", "plugin", "exact"])
def test_embedding_catalog_matches_dense(method, eps):
    masked = torch.tensor([[3, -1], [0, 5], [-1, -1]])
    dense, emb = _embedding_pair(3, 20, 2, 4, seed=1, masked=masked)
    g = torch.Generator().manual_seed(0)
    cands = explore_candidates(dense, 6, epsilon=eps, generator=g)
    shown = cands[:, [4, 1]]
    a = log_propensities(dense, cands, shown, method=method, epsilon=eps)
    b = log_propensities(emb, cands, shown, method=method, epsilon=eps)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_embedding_sampler_frequencies():
    """The uniform part streamed over chunks: never a masked item, each item with frequency
    (1-ε)π + εK/N_avail (binomial bounds)."""
    masked = torch.tensor([[3, 11, -1]])
    dense, emb = _embedding_pair(1, 13, 1, 3, seed=2, masked=masked)
    samples, k, eps = 6000, 4, 0.5
    user, item = emb.user.expand(samples, -1, -1), emb.item
    many = EmbeddingCatalog(user, item, masked_items=masked.expand(samples, -1), chunk_size=5)
    cands = explore_candidates(many, k, epsilon=eps, generator=torch.Generator().manual_seed(5))
    assert not torch.isin(cands, masked[0]).any()
    assert (cands.sort(1).values.diff(1) > 0).all()
    counts = torch.bincount(cands.flatten(), minlength=13).double().numpy()
    free = [a for a in range(13) if a not in (3, 11)]
    rows = torch.tensor([[a, *[b for b in free if b != a][:k - 1]] for a in free])  # a request holding a
    logged = log_propensities(dense.double().expand(len(free), -1, -1), rows, rows[:, :1], method="exact",
                              epsilon=eps)
    claims = np.zeros(13)
    claims[free] = logged.log_inclusion[:, 0].exp().numpy()
    assert_counts_match(counts, claims, samples, alpha=1e-6)


def test_empty_batch_and_device(device):
    logits = torch.randn(0, 2, 9, device=device)
    cands = explore_candidates(logits, 3, epsilon=0.5, generator=torch.Generator(device).manual_seed(0))
    assert cands.shape == (0, 3)
    got = log_propensities(logits, cands, cands[:, :2], epsilon=0.5)
    assert [tuple(x.shape) for x in got] == [(0, 2), (0, 2), (0,)]
    logits = torch.randn(5, 2, 9, device=device)
    g = torch.Generator(device).manual_seed(0)
    cands = explore_candidates(logits, 3, temperature=2.0, epsilon=0.5, generator=g)
    got = log_propensities(logits, cands, cands[:, :2], temperature=2.0, epsilon=0.5)
    assert all(x.device.type == device.type and torch.isfinite(x).all() for x in got)
    assert (got.log_inclusion <= 0).all() and (got.log_candidate_prob <= 0).all()


def test_epsilon_one_is_uniform_and_shift_invariant():
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(0)) * 1e3
    cands = torch.tensor([[0, 1, 2], [7, 6, 5]])
    got = log_propensities(logits, cands, cands[:, :1], epsilon=1.0)
    torch.testing.assert_close(got.log_inclusion, torch.full((2, 1), math.log(3 / 8)))
    torch.testing.assert_close(got.log_candidate_prob, torch.full((2,), -math.log(8 * 7 * 6)))
    a = log_propensities(logits, cands, cands[:, :2], epsilon=0.2, method="plugin")
    b = log_propensities(logits + 1e4, cands, cands[:, :2], epsilon=0.2, method="plugin")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_uniform_share_counts_the_items_unmasked_under_every_expert():
    """The uniform draw of an ε-mixture takes the items unmasked under every expert: an item masked under one
    expert only is out of it (N_avail = 5 of 6 here, so π = 2/5 and the ordered draw 1/20). Counting it in (under
    any expert) went unnoticed by every test (a review's mutation: 2/6 and 1/30)."""
    logits = torch.randn(1, 2, 6, generator=torch.Generator().manual_seed(0))
    logits[0, 0, 5] = -math.inf
    cands = torch.tensor([[0, 1]])
    got = log_propensities(logits, cands, cands[:, :1], epsilon=1.0)
    torch.testing.assert_close(got.log_inclusion, torch.full((1, 1), math.log(2 / 5)))
    torch.testing.assert_close(got.log_candidate_prob, torch.full((1,), -math.log(5 * 4)))


def test_compiles_without_host_syncs():
    logits = torch.randn(4, 2, 12, generator=torch.Generator().manual_seed(0))
    cands = explore_candidates(logits, 4, generator=torch.Generator().manual_seed(1))

    def fn(x, c):
        return log_propensities(x, c, c[:, :2], method="plugin", epsilon=0.1, validate_args=False)

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    for x, y in zip(compiled(logits, cands), fn(logits, cands)):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(epsilon=-0.1), ValueError, "epsilon"),
    (dict(epsilon=1.5), ValueError, "epsilon"),
    (dict(epsilon=math.nan), ValueError, "epsilon"),
    (dict(epsilon="0.1"), TypeError, "epsilon"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(method="with_replacement"), ValueError, "method"),
    (dict(method=3), TypeError, "method"),
    (dict(shown=torch.tensor([[0], [9]])), ValueError, "shown"),
    (dict(shown=torch.tensor([[0], [1]]).float()), TypeError, "shown"),
    (dict(shown=torch.tensor([[0]])), ValueError, "shown"),
    (dict(shown=torch.tensor([[0, 1, 2, 4], [4, 5, 6, 7]])), ValueError, "shown"),
    (dict(candidates=torch.tensor([[0, 1, 0], [4, 5, 6]])), ValueError, "candidates"),
    (dict(candidates=torch.tensor([[0, 1, 10], [4, 5, 6]])), ValueError, "candidates"),
    (dict(candidates=torch.tensor([[0, 1, 9], [4, 5, 6]]), shown=torch.tensor([[9], [4]])), ValueError,
     "masked"),
])
def test_bad_inputs(kwargs, error, match):
    logits = torch.randn(2, 10)
    logits[0, 9] = -math.inf
    args = dict(logits=logits, candidates=torch.tensor([[0, 1, 2], [4, 5, 6]]), shown=torch.tensor([[1], [6]]))
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(error, match=match):
        log_propensities(args["logits"], args["candidates"], args["shown"], **kwargs)


def test_bad_sampler_inputs():
    logits = torch.randn(2, 5)
    logits[1, :3] = -math.inf
    with pytest.raises(ValueError, match="epsilon"):
        explore_candidates(logits, 2, epsilon=2.0)
    with pytest.raises(ValueError, match="num_candidates"):
        explore_candidates(logits, 6)
    with pytest.raises(ValueError, match="unmasked"):
        explore_candidates(logits, 3, epsilon=1.0)
    with pytest.raises(ValueError, match="temperature"):
        explore_candidates(DenseCatalog(logits), 2, temperature=2.0)


@pytest.mark.parametrize("eps", [0.0, 0.4])
def test_sharded_catalog_matches_dense(eps):
    """The TorchRec placement (one process; its masks reach the uniform draw through gather)."""
    pytest.importorskip("torchrec")
    from capg_rec.torchrec import ShardedEmbeddingCatalog

    masked = torch.tensor([[3, -1], [0, 5], [-1, -1]])
    g = torch.Generator().manual_seed(4)
    user, item = torch.randn(3, 2, 4, generator=g), torch.randn(20, 2, 4, generator=g)
    sharded = ShardedEmbeddingCatalog(user, item, num_items=20, masked_items=masked, chunk_size=7)
    dense = torch.einsum("bmd,nmd->bmn", user, item).masked_fill(
        torch.zeros(3, 20, dtype=torch.bool).scatter(1, masked.clamp(min=0), masked >= 0).unsqueeze(1), -math.inf)
    cands = explore_candidates(sharded, 6, epsilon=eps, generator=torch.Generator().manual_seed(0))
    assert not (cands.unsqueeze(2) == masked.unsqueeze(1)).any()
    shown = cands[:, [2, 5]]
    a = log_propensities(dense, cands, shown, method="plugin", epsilon=eps)
    b = log_propensities(sharded, cands, shown, method="plugin", epsilon=eps)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_items", "k"), [(1000, 10), (1_000_000, 50)])
def test_uniform_draw_log_prob_is_exact_in_float32(num_items, k):
    """Regression: log((N - K)! / N!) of a uniform draw was a difference of two lgammas of ~10^7 taken in
    the catalog's float32, off by 0.77 nats at N = 10^6 (an importance weight off by 2x). Now within float32's
    rounding of the result (a few ulps of ~700)."""
    gen = torch.Generator().manual_seed(0)
    catalog = EmbeddingCatalog(torch.randn(2, 4, generator=gen), 0.1 * torch.randn(num_items, 4, generator=gen))
    candidates = explore_candidates(catalog, k, epsilon=1.0, generator=gen)
    got = log_propensities(catalog, candidates, candidates[:, :1], epsilon=1.0).log_candidate_prob
    want = math.lgamma(num_items - k + 1) - math.lgamma(num_items + 1)
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs() <= 4 * abs(want) * torch.finfo(torch.float32).eps).all(), got


def test_logged_ids_are_refused_naming_the_argument():
    """Logged ids outside the catalog, repeated, or shown items that are not candidates: a ValueError naming
    ``shown`` or ``candidates``."""
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    candidates = torch.tensor([[0, 1, 2], [3, 4, 5]])
    cases = [(candidates, torch.tensor([[0], [10]]), r"shown must hold ids in \[0, 10\)"),
             (candidates, torch.tensor([[0], [-1]]), r"shown must hold ids in \[0, 10\)"),
             (candidates, torch.tensor([[0], [6]]), "shown must be a subset of candidates"),
             (candidates, torch.tensor([[0, 0], [3, 4]]), "shown must not repeat"),
             (torch.tensor([[0, 1, 1], [3, 4, 5]]), torch.tensor([[0], [3]]), "candidates must not repeat"),
             (torch.tensor([[0, 1, 12], [3, 4, 5]]), torch.tensor([[0], [3]]),
              r"candidates must hold ids in \[0, 10\)")]
    for cand, shown, message in cases:
        with pytest.raises(ValueError, match=message):
            log_propensities(logits, cand, shown)


@pytest.mark.parametrize("epsilon", [0.0, 0.25])
def test_the_logging_call_refuses_draws_among_scores_beyond_resolution(epsilon):
    """The serving-time calls take the resolution checks of the draw they describe (a review of them found soft
    masks answered wrong everywhere): a soft-masked row whose draw must choose among its -1e9 items is a ValueError
    for explore_candidates and log_propensities alike; the same row with K = 2 is logged as before."""
    soft = torch.tensor([[0.0, 0.5, -1e9, -1e9, -1e9]])
    beyond = r"must draw .*among items more than 5.243e\+05 below their expert's best score"
    with pytest.raises(ValueError, match=beyond):
        explore_candidates(soft, 3, epsilon=epsilon, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=beyond):
        log_propensities(soft, torch.tensor([[1, 0, 2]]), torch.tensor([[2]]), epsilon=epsilon)
    drawn = explore_candidates(soft, 2, epsilon=epsilon, generator=torch.Generator().manual_seed(0))
    logged = log_propensities(soft, drawn, drawn[:, :1], epsilon=epsilon)
    assert torch.isfinite(logged.log_inclusion).all()


def test_an_item_masked_under_one_expert_only_is_not_in_the_uniform_draw():
    """The ε-mixture's uniform draw takes items unmasked under every expert: an item masked under expert 0 alone is
    drawn only by the PL part, so its propensities are (1 - ε) times the PL's (found by mutation testing: taking
    items unmasked under *any* expert made log_inclusion 1.5 nats too high, and no test had such an item)."""
    logits = torch.randn(1, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits[0, 0, 4] = -math.inf  # item 4: masked under expert 0, which draws position 0; expert 1 draws position 1
    candidates, shown, eps = torch.tensor([[0, 4]]), torch.tensor([[4]]), 0.5
    mixed = log_propensities(logits, candidates, shown, method="exact", epsilon=eps)
    plain = log_propensities(logits, candidates, shown, method="exact", epsilon=0.0)
    for got, want in zip(mixed, plain):
        torch.testing.assert_close(got, want + math.log1p(-eps))
