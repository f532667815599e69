"""SampledCatalog and negative samplers: unbiased sums, exact limits, masks, dtypes, losses, errors."""

import itertools
import math
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

import capg_rec
from capg_rec import CAPGLoss, VPGLoss
from capg_rec._numerics import gumbel_top_k
from capg_rec.ann import ExactIndex
from capg_rec import catalog as capg_catalog
from capg_rec.catalog import EmbeddingCatalog
from capg_rec.sampled import DrawnSample, InBatchSampler, MixedSampler, SampledCatalog, UniformSampler
from tests.scripts import load_script
from tests.stats import assert_counts_match


def _towers(b=3, n=60, d=4, m=None, dtype=torch.float64, seed=0, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    user = scale * torch.randn((b, d) if m is None else (b, m, d), generator=g, dtype=dtype)
    item = torch.randn((n, d) if m is None else (n, m, d), generator=g, dtype=dtype)
    return user.to(device), item.to(device)


EXCLUDE = torch.tensor([[1, 2, -1], [3, 3, 4], [-1, -1, -1]])


def _clt_check(ratios: torch.Tensor, alpha: float = 1e-6) -> None:
    """``ratios [R, ...]`` estimates of 1: each mean within the CLT bound from its empirical std,
    Bonferroni over entries (two-sided)."""
    r = ratios.shape[0]
    z = stats.norm.isf(alpha / (2 * ratios[0].numel()))
    mean, std = ratios.mean(0), ratios.std(0)
    bound = z * std / math.sqrt(r)
    assert bool(((mean - 1).abs() <= bound).all()), f"means {mean.flatten()} vs bounds {bound.flatten()}"
    assert bool((std > 0).all())  # the check is not vacuous: the estimates do vary


@pytest.mark.parametrize("m", [None, 2])
def test_uniform_estimate_is_unbiased(m):
    """E[exp(estimated log Σ_{n ∉ E} e^{p s})] equals the exact sum (p = 1..3, with an ANN head)."""
    user, item = _towers(m=m)
    exact = EmbeddingCatalog(user, item).log_power_sums(EXCLUDE, 3)
    index = ExactIndex(item)
    ratios = torch.stack([
        (SampledCatalog(user, item, sampler=UniformSampler(12), index=index, head_size=3,
                        generator=torch.Generator().manual_seed(r)).log_power_sums(EXCLUDE, 3) - exact).exp()
        for r in range(400)])
    _clt_check(ratios)


def test_mixed_in_batch_estimate_is_unbiased():
    """In-batch items drawn from a known popularity q plus uniform negatives: the balance-heuristic
    weights (expected counts add up) make the sums unbiased."""
    user, item = _towers()
    n = item.shape[0]
    q = torch.softmax(torch.linspace(0, 3, n, dtype=torch.float64), 0)
    exact = EmbeddingCatalog(user, item).log_power_sums(EXCLUDE, 2)
    sampler = MixedSampler(InBatchSampler(frequency=q), UniformSampler(5))
    ratios = []
    for r in range(400):
        g = torch.Generator().manual_seed(r)
        batch = torch.multinomial(q, 8, replacement=True, generator=g).view(2, 4)
        cat = SampledCatalog(user, item, sampler=sampler, head_items=EXCLUDE[:, :2].clamp(min=0),
                             batch_items=batch, generator=g)
        ratios.append((cat.log_power_sums(EXCLUDE, 2) - exact).exp())
    _clt_check(torch.stack(ratios))


def _draws(num_items: int, size: int, q: torch.Tensor | None = None):
    """Every ordered draw of ``size`` ids with replacement from ``num_items`` (uniform, or ``q``), with its
    probability: ``(ids [size], probability)``."""
    for ids in itertools.product(range(num_items), repeat=size):
        ids = torch.tensor(ids)
        yield ids, (float(q[ids].prod()) if q is not None else num_items ** -size)


@pytest.mark.parametrize("m", [None, 2])
def test_uniform_estimate_is_exactly_unbiased(m):
    """The expectation of the estimated sums over every draw of S = 3 uniform negatives from 6 items (each a
    DrawnSample of UniformSampler), weighed by its probability, is the exact sum to rounding (p = 1..3, an
    exact index head, excluded ids): unlike a bound over seeds, any bias in the expected counts fails it."""
    user, item = _towers(n=6, m=m)
    exact = EmbeddingCatalog(user, item).log_power_sums(EXCLUDE, 3).exp()
    sampler, index = UniformSampler(3), ExactIndex(item)
    expected = sum(p * SampledCatalog(user, item, sampler=DrawnSample(ids, sampler), index=index,
                                      head_size=2).log_power_sums(EXCLUDE, 3).exp() for ids, p in _draws(6, 3))
    torch.testing.assert_close(expected, exact, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("own_heads", [False, True])
def test_mixed_in_batch_estimate_is_exactly_unbiased(own_heads):
    """In-batch items iid from a known popularity q plus uniform negatives: the expectation over every batch
    and every uniform draw is the exact sum, so the balance-heuristic weights (expected counts add up) make
    the sums unbiased. ``own_heads``: the batch is the rows' own heads, whose sample terms each row drops
    and counts out of the others' slots."""
    user, item = _towers(b=2, n=5, scale=0.5)
    q = torch.softmax(torch.linspace(0, 2, 5, dtype=torch.float64), 0)
    exclude = torch.tensor([[4, -1], [0, 2]])
    exact = EmbeddingCatalog(user, item).log_power_sums(exclude, 2).exp()
    sampler = MixedSampler(InBatchSampler(frequency=q), UniformSampler(2))
    expected = 0.0
    for batch, p_batch in _draws(5, 2, q):
        batch = batch.view(2, 1)
        heads = batch if own_heads else torch.tensor([[1, 2], [3, -1]])  # never the batch (compared by value)
        for ids, p in _draws(5, 2):
            drawn = DrawnSample(torch.cat([batch.view(-1), ids]), sampler, batch_items=batch)
            cat = SampledCatalog(user, item, sampler=drawn, head_items=heads,
                                 batch_items=None if own_heads else batch)
            expected = expected + p_batch * p * cat.log_power_sums(exclude, 2).exp()
    torch.testing.assert_close(expected, exact, rtol=1e-12, atol=0.0)


def test_exact_when_head_holds_everything(device):
    user, item = _towers(device=device)
    everything = torch.arange(item.shape[0], device=device).expand(user.shape[0], -1)
    cat = SampledCatalog(user, item, sampler=UniformSampler(9), head_items=everything,
                         generator=torch.Generator(device).manual_seed(0))
    ref = EmbeddingCatalog(user, item)
    exclude = EXCLUDE.to(device)
    torch.testing.assert_close(cat.log_power_sums(exclude, 3), ref.log_power_sums(exclude, 3))
    assert torch.equal(cat.top_items(5, exclude=exclude), ref.top_items(5, exclude=exclude))


def test_exact_when_the_sample_covers_the_catalog():
    """Every item drawn exactly once per batch (known frequency 1/N per slot): the estimate is exact."""
    user, item = _towers()
    n = item.shape[0]
    sampler = InBatchSampler(frequency=torch.full((n,), 1.0 / n, dtype=torch.float64))
    cat = SampledCatalog(user, item, sampler=sampler, head_items=EXCLUDE[:, :1].clamp(min=0),
                         batch_items=torch.arange(n).view(4, -1))
    torch.testing.assert_close(cat.log_power_sums(EXCLUDE, 3), EmbeddingCatalog(user, item).log_power_sums(EXCLUDE, 3))


def _reference(cat: SampledCatalog, user, item, exclude, p):
    """The estimator written out row by row from the full score matrix."""
    full = torch.einsum("bmd,nmd->bmn", cat.user, item.unsqueeze(1) if item.dim() == 2 else item)
    out = torch.empty(cat.batch_size, cat.num_experts, dtype=full.dtype)
    masked = cat.masked_items
    for b in range(cat.batch_size):
        gone = {int(i) for i in exclude[b] if i >= 0} | ({int(i) for i in masked[b] if i >= 0} if masked is not None
                                                          else set())
        head = {int(i) for i in cat.head_ids[b] if i >= 0}
        for m in range(cat.num_experts):
            terms = [p * full[b, m, i] for i in head - gone]
            for j, w in zip(cat.sample_ids.tolist(), cat.sample_log_weight.tolist()):
                if j >= 0 and j not in head and j not in gone:
                    terms.append(p * full[b, m, j] + w)
            out[b, m] = torch.logsumexp(torch.stack(terms), 0) if terms else -math.inf
    return out


def test_masks_and_exclusion_remove_their_terms_exactly():
    user, item = _towers(m=2)
    masked = torch.tensor([[5, -1], [6, 7], [-1, -1]])
    cat = SampledCatalog(user, item, sampler=UniformSampler(40), index=ExactIndex(item), head_size=4,
                         head_items=torch.tensor([[5, 1], [6, 3], [0, 9]]), masked_items=masked,
                         generator=torch.Generator().manual_seed(3))
    for p in (1, 2, 3):
        torch.testing.assert_close(cat.log_power_sums(EXCLUDE, p)[..., p - 1], _reference(cat, user, item, EXCLUDE, p))
    assert torch.equal(cat.num_available(), torch.tensor([[59, 59], [58, 58], [60, 60]]))
    gathered = cat.gather(torch.tensor([[5, 0], [7, 0], [5, 0]]))
    assert bool((gathered[:2, :, 0] == -math.inf).all()) and bool(torch.isfinite(gathered[2]).all())
    for perturb in (False, True):
        top = cat.top_items(20, exclude=EXCLUDE, perturb=perturb, generator=torch.Generator().manual_seed(1))
        for b in range(3):
            bad = {int(i) for i in EXCLUDE[b] if i >= 0} | {int(i) for i in masked[b] if i >= 0}
            assert not bad & set(top[b].flatten().tolist())
            for m in range(2):
                assert len(set(top[b, m].tolist())) == 20 and int(top[b, m].min()) >= 0


def _sampled_sums(user, item, exclude, seed=3):
    """log_power_sums (p = 1..3) of a catalog with a head, masked items and a fixed sample."""
    masked = torch.tensor([[5, -1], [6, 7], [-1, -1]])
    cat = SampledCatalog(user, item, sampler=UniformSampler(40), head_items=torch.tensor([[5, 1], [6, 3], [0, 9]]),
                         masked_items=masked, generator=torch.Generator().manual_seed(seed))
    return cat.log_power_sums(exclude, 3)


def test_power_sums_twice_differentiable():
    """gradcheck and gradgradcheck (float64) of the estimated power sums in both towers, with a head,
    masked items and exclusions."""
    user, item = _towers(m=2, n=20)
    user.requires_grad_(True)
    item.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda u, i: _sampled_sums(u, i, EXCLUDE), (user, item))
    assert torch.autograd.gradgradcheck(lambda u, i: _sampled_sums(u, i, EXCLUDE), (user, item))


def test_row_with_every_term_left_out_is_minus_inf_with_zero_gradient():
    """A row whose head and sample terms are all excluded or masked: -inf, no NaN in the gradient, and the
    other rows' gradients are those of a catalog without it."""
    user, item = _towers(n=10)
    user.requires_grad_(True)
    everything = torch.tensor([list(range(10)), [0, 1] + [-1] * 8, [-1] * 10])
    out = _sampled_sums(user, item, everything)
    assert bool((out[0] == -math.inf).all()) and bool(torch.isfinite(out[1:]).all())
    torch.where(torch.isfinite(out), out, 0.0).sum().backward()
    assert bool(torch.isfinite(user.grad).all()) and bool((user.grad[0] == 0).all())
    assert bool((user.grad[1:] != 0).any())


def test_reductions_leave_the_scores_unchanged_and_run_under_torch_func():
    """The sums' in-place passes write only buffers of their own: repeated calls, draws and top items leave
    the stored scores as they were and give the same sums; torch.func.grad matches autograd."""
    user, item = _towers(m=2)
    cat = SampledCatalog(user, item, sampler=UniformSampler(30), index=ExactIndex(item), head_size=3,
                         head_items=EXCLUDE.clamp(min=0), generator=torch.Generator().manual_seed(6))
    head, sample = cat.head_scores.clone(), cat.sample_scores.clone()
    first = cat.log_power_sums(EXCLUDE, 3)
    cat.top_items(5, exclude=EXCLUDE, perturb=True, generator=torch.Generator().manual_seed(0))
    cat.top_items(5, experts=[1], perturb=False)
    torch.testing.assert_close(cat.log_power_sums(EXCLUDE, 3), first, rtol=0, atol=0)
    assert torch.equal(cat.head_scores, head) and torch.equal(cat.sample_scores, sample)

    def total(u):
        return _sampled_sums(u, item, EXCLUDE).sum()
    u = user.clone().requires_grad_(True)
    total(u).backward()
    torch.testing.assert_close(torch.func.grad(total)(u.detach()), u.grad)


def test_shift_invariance():
    """A constant c added to every score of a row (an extra coordinate) changes no probability."""
    user, item = _towers(d=3)
    shifts = torch.tensor([0.0, 1e4, -3e5], dtype=torch.float64)
    ones = torch.ones(item.shape[0], 1, dtype=torch.float64)

    def make(c):
        return SampledCatalog(torch.cat([user, c.unsqueeze(1)], 1), torch.cat([item, ones], 1),
                              sampler=UniformSampler(15), index=ExactIndex(torch.cat([item, ones], 1)), head_size=3,
                              generator=torch.Generator().manual_seed(4))
    base, shifted = make(torch.zeros(3, dtype=torch.float64)), make(shifts)
    items = torch.tensor([[0, 1], [2, 3], [4, 5]])
    torch.testing.assert_close(shifted.log_softmax(items), base.log_softmax(items), rtol=0, atol=1e-9)
    torch.testing.assert_close(shifted.log_power_sums(EXCLUDE, 3) - shifts.view(3, 1, 1) * torch.arange(1, 4),
                               base.log_power_sums(EXCLUDE, 3), rtol=1e-12, atol=1e-9)
    for perturb in (False, True):
        a = base.top_items(6, perturb=perturb, generator=torch.Generator().manual_seed(2))
        b = shifted.top_items(6, perturb=perturb, generator=torch.Generator().manual_seed(2))
        assert torch.equal(a, b)


def test_float32_matches_float64():
    user, item = _towers()
    out = {}
    for dtype in (torch.float32, torch.float64):
        cat = SampledCatalog(user.to(dtype), item.to(dtype), sampler=UniformSampler(20),
                             head_items=EXCLUDE.clamp(min=0), generator=torch.Generator().manual_seed(5))
        assert cat.log_power_sums(EXCLUDE, 3).dtype == dtype
        out[dtype] = cat.log_power_sums(EXCLUDE, 3)
    torch.testing.assert_close(out[torch.float32].double(), out[torch.float64], rtol=1e-5, atol=1e-5)
    half = SampledCatalog(user.half(), item.half(), sampler=UniformSampler(20))
    assert half.dtype == torch.float32


def test_streaming_frequency_estimate():
    """Yi et al.'s estimator is exact for periodic items: every step → 1, every 4th step → 1/4."""
    sampler = InBatchSampler(alpha=0.1)
    for step in range(1, 41):
        batch = torch.tensor([[7, 5 if step % 4 == 0 else -1]])
        sampler.draw(100, batch, generator=None, device=torch.device("cpu"))
    log_count = sampler.log_expected_count(torch.tensor([7, 5, 11]), 100, None)
    torch.testing.assert_close(log_count[:2], torch.tensor([0.0, -math.log(4)], dtype=torch.float64))
    assert log_count[2] == -math.inf  # never seen (no collision at these ids)


@pytest.mark.parametrize("method", ["with_replacement", "mean_field", "plugin"])
def test_estimators_run_with_finite_gradients(method, device):
    """CA-PG (supported methods) and V-PG on the sampled catalog, with a catalog over 2048 items
    so that mean-field and the plug-in take their head/tail paths; gradients reach both towers."""
    k = 6
    user, item = _towers(b=4, n=3000, d=8, m=2, dtype=torch.float32, device=device)
    user.requires_grad_(True)
    table = torch.nn.Embedding.from_pretrained(item.flatten(1), freeze=False).to(device)

    def tower(ids):
        return table(ids).unflatten(-1, (2, 8))
    g = torch.Generator(device).manual_seed(0)
    base = SampledCatalog(user.detach(), item, sampler=UniformSampler(256), index=ExactIndex(item), head_size=60,
                          generator=g)
    candidates = capg_rec.sample_candidates(base, k, generator=g)
    chosen, rewards = candidates[:, :2], torch.rand(4, 2, generator=g.manual_seed(1), device=device)
    cat = SampledCatalog(user, tower, num_items=3000, sampler=MixedSampler(InBatchSampler(), UniformSampler(256)),
                         index=ExactIndex(item), head_size=60, head_items=candidates, generator=g)
    loss = CAPGLoss(k, method=method)(cat, candidates, chosen, rewards) + VPGLoss(k)(cat, candidates, chosen, rewards)
    loss.backward()
    assert torch.isfinite(loss)
    assert bool(torch.isfinite(user.grad).all()) and bool(user.grad.abs().sum() > 0)
    assert bool(torch.isfinite(table.weight.grad).all()) and bool(table.weight.grad.abs().sum() > 0)


def test_mean_field_matches_full_catalog_when_head_holds_everything():
    user, item = _towers(b=2, n=3000, d=6, dtype=torch.float64)
    items = torch.tensor([[0, 1, 2], [3, 4, 5]])
    everything = torch.arange(3000).expand(2, -1)
    cat = SampledCatalog(user, item, sampler=UniformSampler(8), head_items=everything)
    exact = capg_rec.inclusion_log_prob(EmbeddingCatalog(user, item), items, 10, method="mean_field")
    torch.testing.assert_close(capg_rec.inclusion_log_prob(cat, items, 10, method="mean_field"), exact)


def test_exact_method_is_refused():
    user, item = _towers(b=2, n=3000, d=6)
    cat = SampledCatalog(user, item, sampler=UniformSampler(2000), index=ExactIndex(item), head_size=50)
    with pytest.raises(ValueError, match="'exact' method is not supported"):
        capg_rec.inclusion_log_prob(cat, torch.tensor([[0], [1]]), 10, method="exact")


@pytest.mark.parametrize("m", [None, 2])
def test_draw_is_gumbel_top_k_of_the_keys(m):
    """top_items(perturb=True) is gumbel_top_k of head ∪ sample keys (the sample's carrying log w, left-out
    slots -inf) with the same generator: the same ids, also where the keys are laid out padded (width 43)."""
    user, item = _towers(b=4, m=m)
    cat = SampledCatalog(user, item, sampler=UniformSampler(38), head_items=torch.tensor([[1, 2, 3, 4, 5]] * 4),
                         masked_items=torch.tensor([[7], [8], [-1], [9]]), generator=torch.Generator().manual_seed(2))
    sample = (cat.sample_scores + cat.sample_log_weight).masked_fill(cat.sample_drop.unsqueeze(1), -math.inf)
    keys = torch.cat([cat.head_scores, sample], 2)  # [B, M, 43]
    ids = torch.cat([cat.head_ids, cat.sample_ids.expand(4, -1)], 1)
    for expert in range(cat.num_experts):
        for k in (1, 3, 10):
            want = ids.gather(1, gumbel_top_k(keys[:, expert], k, generator=torch.Generator().manual_seed(k)))
            got = cat.top_items(k, experts=[expert], perturb=True, generator=torch.Generator().manual_seed(k))
            assert torch.equal(got[:, 0], want)


def test_draw_is_exact_pl_when_head_holds_everything():
    """First-position frequencies of sample_candidates against the softmax (binomial bounds)."""
    user, item = _towers(b=1, n=6, d=3, scale=0.7)
    cat = SampledCatalog(user, item, sampler=UniformSampler(3), head_items=torch.arange(6).view(1, -1))
    g = torch.Generator().manual_seed(0)
    draws = 4000
    firsts = torch.stack([capg_rec.sample_candidates(cat, 2, generator=g)[0, 0] for _ in range(draws)])
    probs = torch.softmax(torch.einsum("bd,nd->bn", user, item)[0], 0).numpy()
    assert_counts_match(np.bincount(firsts.numpy(), minlength=6), probs, draws)


def test_empty_batch_and_compile():
    user, item = _towers(b=0)
    cat = SampledCatalog(user, item, sampler=UniformSampler(10))
    assert cat.log_power_sums(None, 2).shape == (0, 1, 2)
    assert cat.top_items(3).shape == (0, 1, 3)
    user, item = _towers()
    cat = SampledCatalog(user, item, sampler=UniformSampler(10), head_items=EXCLUDE.clamp(min=0), validate_args=False)
    compiled = torch.compile(lambda e: cat.log_power_sums(e, 3), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(EXCLUDE), cat.log_power_sums(EXCLUDE, 3))


def test_errors():
    user, item = _towers()
    with pytest.raises(TypeError, match="sampler"):
        SampledCatalog(user, item, sampler="uniform")
    with pytest.raises(TypeError, match="item"):
        SampledCatalog(user, 3, sampler=UniformSampler(4))
    with pytest.raises(ValueError, match="num_items"):
        SampledCatalog(user, lambda ids: item[ids], sampler=UniformSampler(4))
    with pytest.raises(ValueError, match="index"):
        SampledCatalog(user, item, sampler=UniformSampler(4), head_size=3)
    with pytest.raises(ValueError, match="head_items"):
        SampledCatalog(user, item, sampler=InBatchSampler())
    with pytest.raises(ValueError, match="head_items"):
        SampledCatalog(user, item, sampler=UniformSampler(4), head_items=torch.tensor([[60], [0], [0]]))
    with pytest.raises(ValueError, match="index"):
        SampledCatalog(user, item, sampler=UniformSampler(4), index=ExactIndex(item[:, :3]), head_size=2)
    cat = SampledCatalog(user, item, sampler=UniformSampler(4))
    with pytest.raises(ValueError, match="num_powers"):
        cat.log_power_sums(None, 4)
    with pytest.raises(ValueError, match="k=5"):
        cat.top_items(5)
    with pytest.raises(ValueError, match="alpha"):
        InBatchSampler(alpha=2.0)
    with pytest.raises(TypeError, match="NegativeSampler"):
        MixedSampler(UniformSampler(3), 4)


def _script(name):
    return load_script(f"benchmarks/{name}.py")


def test_benchmarks_run_and_write_their_files(tmp_path):
    """The sampled-catalog benchmarks at tiny sizes: each writes its JSON, CSV and PNG."""
    _script("sampled_accuracy").main(["--sizes", "3000", "--negatives", "64", "--temperatures", "1", "--seeds", "2",
                                      "--batch", "2", "--ann-size", "500", "--out", str(tmp_path / "acc")])
    _script("sampled_draw").main(["--seeds", "2", "--draws", "2", "--large-size", "300", "--temperatures", "1",
                                  "--large-temperatures", "1", "--out", str(tmp_path / "draw")])
    _script("sampled_learning").main(["--num-items", "300", "--num-users", "20", "--steps", "2", "--batch", "4",
                                      "--seeds", "0", "--negatives", "32", "--head", "20", "--eval-every", "1",
                                      "--out", str(tmp_path / "learn")])
    cost = _script("sampled_cost")
    rows = []
    for config, batch in (("in_batch", 128), ("sampled_swr_S1024", 128), ("full_mf", 128), ("in_batch", 16),
                          ("sampled_swr_S128", 16)):
        row = cost._one(3000, config, reps=1, batch=batch)
        assert row["step_ms"] > 0 and row["config"] == config and row["B"] == batch
        rows.append({**row, "ratio_to_in_batch": 1.0})
    cost._plot(rows, tmp_path / "cost.png")  # a panel per batch size
    assert (tmp_path / "cost.png").stat().st_size > 0
    for sub, stem in (("acc", "sampled_accuracy"), ("draw", "sampled_draw"), ("learn", "sampled_learning")):
        for ext in ("json", "png"):
            assert (tmp_path / sub / f"{stem}.{ext}").stat().st_size > 0
    assert (tmp_path / "acc" / "sampled_accuracy.csv").exists()
    assert (tmp_path / "learn" / "sampled_learning.csv").exists()
    assert (tmp_path / "draw" / "sampled_draw_small.csv").exists()


def test_drawn_sample_refuses_what_is_not_a_sample():
    """DrawnSample names the argument: ids must be a 1-d integer tensor, sampler the NegativeSampler that drew them."""
    sampler = UniformSampler(4)
    ids = torch.tensor([3, 1, 4, 1])
    assert torch.equal(DrawnSample(ids, sampler).draw(10, None, generator=None, device=torch.device("cpu")), ids)
    for bad in (ids.float(), ids.bool(), [3, 1, 4, 1]):
        with pytest.raises(TypeError, match="ids must be an integer tensor"):
            DrawnSample(bad, sampler)
    with pytest.raises(ValueError, match="ids must be 1-d"):  # a wrong shape of the right type: a value error
        DrawnSample(ids.view(2, 2), sampler)
    for bad in (None, DrawnSample(ids, sampler)):
        with pytest.raises(TypeError, match="sampler must be the NegativeSampler"):
            DrawnSample(ids, bad)
    with pytest.raises(TypeError, match="batch_items must be an integer tensor"):
        DrawnSample(ids, sampler, batch_items=ids.float())


def test_drawn_in_batch_sample_counts_with_the_batch_it_was_drawn_with():
    """Regression: a DrawnSample of an InBatchSampler with a given frequency (alone or mixed) took its expected
    counts from the catalog's own batch (its head_items) rather than the draw's: the normaliser was biased
    (−inf with no head, −1 nat with a head of other width). With the draw's batch it equals the sampler's own
    catalog exactly; without it, it is refused."""
    user, item = _towers(m=2)
    frequency = torch.softmax(torch.randn(60, generator=torch.Generator().manual_seed(1)), 0)
    batch = torch.tensor([[4, 9, -1, 7], [1, 2, 3, 5], [8, 8, 0, 11]])
    head = torch.tensor([[30, 31], [32, 33], [34, 35]])
    for sampler in (InBatchSampler(frequency=frequency), MixedSampler(InBatchSampler(frequency=frequency),
                                                                     UniformSampler(16))):
        own = SampledCatalog(user, item, sampler=sampler, batch_items=batch, head_items=head,
                             generator=torch.Generator().manual_seed(5))
        ids = sampler.draw(60, batch, generator=torch.Generator().manual_seed(5), device=torch.device("cpu"))
        for head_items in (head, None):
            drawn = SampledCatalog(user, item, sampler=DrawnSample(ids, sampler, batch_items=batch),
                                   head_items=head_items)
            if head_items is not None:
                torch.testing.assert_close(drawn.log_power_sums(None, 3), own.log_power_sums(None, 3), rtol=0, atol=0)
            assert torch.isfinite(drawn.log_normalizer()).all()
        # without batch_items it takes the catalog's (here the draw's: as before), and moves with .to
        same = SampledCatalog(user, item, sampler=DrawnSample(ids, sampler).to("cpu"), batch_items=batch,
                              head_items=head)
        torch.testing.assert_close(same.log_power_sums(None, 3), own.log_power_sums(None, 3), rtol=0, atol=0)
        assert torch.equal(DrawnSample(ids, sampler, batch_items=batch).to("cpu").batch_items, batch)
    assert not UniformSampler(3).draws_batch and InBatchSampler().draws_batch
    assert MixedSampler(UniformSampler(3), InBatchSampler()).draws_batch


@pytest.mark.parametrize("mixed", [False, True])
def test_drawn_sample_keeps_the_counts_of_its_draw_when_the_sampler_reads_ahead(mixed):
    """A streaming InBatchSampler learns from every draw; a pipeline that reads batches ahead (TorchRec's
    TrainPipelineSparseDist, a DataLoader) draws the next batches' samples before this one's catalog is built.
    The catalog of a DrawnSample takes the counts of its own draw: the same whether the next samples were drawn
    before or after it (found by review: it read the sampler's estimate at catalog time, steps ahead)."""
    user, item = _towers(m=2)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(60, (3, 4), generator=g) for _ in range(6)]

    def sampler():
        streaming = InBatchSampler(num_buckets=64, alpha=0.5)
        return MixedSampler(streaming, UniformSampler(8)) if mixed else streaming

    def normalizers(ahead: int) -> list[torch.Tensor]:
        s, gen, samples, out = sampler(), torch.Generator().manual_seed(4), [], []
        for step, batch in enumerate(batches):
            samples.append(DrawnSample(s.draw(60, batch, generator=gen, device=torch.device("cpu")), s))
            if step >= ahead:  # the catalog of the batch drawn `ahead` steps ago
                done = step - ahead
                out.append(SampledCatalog(user, item, sampler=samples[done], head_items=batches[done]).log_normalizer())
        return out

    eager, pipelined = normalizers(0), normalizers(2)
    for a, b in zip(eager, pipelined):  # the batches whose catalogs both built
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert len(pipelined) == len(batches) - 2
    assert not torch.equal(eager[0], eager[1])  # the estimate moves from step to step: the check can fail
    one = InBatchSampler(num_buckets=64)
    one.draw(60, batches[0], generator=None, device=torch.device("cpu"))
    kept = DrawnSample(batches[0].flatten(), one)
    before = kept.log_expected_count(batches[0].flatten(), 60, batches[0])
    one.draw(60, torch.cat([batches[0], batches[0]]), generator=None, device=torch.device("cpu"))  # twice the copies
    torch.testing.assert_close(kept.log_expected_count(batches[0].flatten(), 60, batches[0]), before, rtol=0, atol=0)
    torch.testing.assert_close(kept.to("cpu").log_expected_count(batches[0].flatten(), 60, batches[0]), before,
                               rtol=0, atol=0)
    assert not torch.equal(one.log_expected_count(batches[0].flatten(), 60, batches[0]), before)
    outside = torch.tensor([x for x in range(60) if x not in set(batches[0].flatten().tolist())][:5])
    torch.testing.assert_close(kept.log_expected_count(outside, 60, None), one.log_expected_count(outside, 60, None),
                               rtol=0, atol=0)  # ids outside the draw: the sampler's estimate as it is


def test_streaming_in_batch_count_estimates_the_expected_copies():
    """Regression: the streaming estimate recorded whether an item was seen in a step (at most 1 per step)
    while each of its copies in the sample is weighted by it, so popular items, named many times per batch,
    were counted as rare (E[Ẑ]/Z near 1.8). Five items of chance 0.1 per slot, 256 slots per step, are in
    every batch (missed with chance 0.9^256 = 2e-12), so their estimate is the moving average (rate α) of
    Binomial(256, 0.1) copies: within 5 of its standard deviations, sqrt(α/(2-α)·256·0.1·0.9), of 25.6."""
    num_items, slots, alpha = 200, 256, 0.01
    q = torch.cat([torch.full((5,), 0.1), torch.full((num_items - 5,), 0.5 / (num_items - 5))]).double()
    sampler = InBatchSampler(alpha=alpha)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2000):
        sampler.observe(torch.multinomial(q, slots, replacement=True, generator=gen).view(8, 32))
    est = sampler.log_expected_count(torch.arange(5), num_items, None).exp()
    sd = math.sqrt(alpha / (2 - alpha) * slots * 0.1 * 0.9)
    assert ((est - slots * 0.1).abs() <= 5 * sd).all(), est


def test_given_frequency_must_sum_to_one():
    """Popularity counts (or any vector not summing to 1) put log Ẑ off by the log of their sum: refused."""
    with pytest.raises(ValueError, match="frequency must sum to 1"):
        InBatchSampler(frequency=torch.ones(50))
    InBatchSampler(frequency=torch.full((50,), 1 / 50))


def test_methods_that_read_the_best_items_check_how_many_the_catalog_names_exactly():
    """exact_top: every item on an exact catalog, the index head on a sampled one (all when the head holds
    every item). Above 2048 items, mean-field with fewer exact best items than its head (8n + K - n) warns
    that its probabilities are biased (it returned them silently), and the exact method is refused with a
    ValueError before any lookup (it failed on top_items' 'exceeds the head and sample'); at most 2048
    items, every method reads the whole catalog, exactly."""
    user, item = _towers(b=2, n=3000, d=6, dtype=torch.float64)
    items = torch.tensor([[0, 1], [3, 4]])
    assert EmbeddingCatalog(user, item).exact_top == 3000
    short = SampledCatalog(user, item, sampler=UniformSampler(64), index=ExactIndex(item), head_size=20)
    assert short.exact_top == 20
    with pytest.warns(UserWarning, match="best 80 items .* only its best 20 exactly"):
        capg_rec.inclusion_log_prob(short, items, 10, method="mean_field")
    with pytest.raises(ValueError, match="'exact' method is not supported"):
        capg_rec.inclusion_log_prob(SampledCatalog(user, item, sampler=UniformSampler(8)), items, 10, method="exact")
    wide = SampledCatalog(user, item, sampler=UniformSampler(64), index=ExactIndex(item), head_size=80)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capg_rec.inclusion_log_prob(wide, items, 10, method="mean_field")
    small_user, small_item = _towers(b=2, n=100, d=6, dtype=torch.float64)
    small = SampledCatalog(small_user, small_item, sampler=UniformSampler(8))
    assert small.exact_top == 0
    torch.testing.assert_close(capg_rec.inclusion_log_prob(small, items, 10, method="exact"),
                               capg_rec.inclusion_log_prob(EmbeddingCatalog(small_user, small_item), items, 10,
                                                           method="exact"))


@pytest.mark.parametrize("draw", ["sample", "greedy"])
def test_draws_refuse_more_candidates_than_the_head_and_sample_hold(draw):
    """A head and sample holding fewer than K usable items (the rest masked, repeated or unused) is a
    ValueError naming the row, never a draw holding a masked item or an unused slot's -1."""
    user, item = _towers(b=2, n=30, d=4)
    index = ExactIndex(item)
    seen = index.search(user, 6)[1]  # each user's 6 nearest items are masked: 2 of the 8 head items stay usable
    pick = (lambda c, k: capg_rec.sample_candidates(c, k, generator=torch.Generator().manual_seed(1))) \
        if draw == "sample" else capg_rec.greedy_candidates
    for seed in range(20):
        cat = SampledCatalog(user, item, sampler=UniformSampler(3), index=index, head_size=8, masked_items=seen,
                             generator=torch.Generator().manual_seed(seed))
        slots = torch.cat([cat.head_ids, cat.sample_ids.expand(2, -1)], 1)
        usable = [len(set(row.tolist()) - set(s.tolist()) - {-1}) for row, s in zip(slots, seen)]
        if min(usable) >= 4:
            drawn = pick(cat, 4)
            assert not bool((drawn.unsqueeze(2) == seen.unsqueeze(1)).any()) and bool((drawn >= 0).all())
        with pytest.raises(ValueError, match=f"row {int(np.argmin(usable))} has {min(usable)};"):
            pick(cat, min(usable) + 1)


def test_a_draw_short_of_unmasked_items_blames_the_masks():
    """A row whose masks leave fewer than K items is refused naming the masks, as for any catalog, not the head
    and sample (no sample can help). Regression (found by review): the draw's one check, new at this stop, said
    to raise head_size or the number of negatives."""
    user, item = _towers(b=2, n=6, d=3)
    masked = torch.tensor([[0, 1, 2, 3], [0, 1, 2, -1]])  # row 0: 2 unmasked items
    cat = SampledCatalog(user, item, sampler=UniformSampler(50), masked_items=masked,
                         generator=torch.Generator().manual_seed(1))
    for draw in (lambda c: capg_rec.sample_candidates(c, 3), lambda c: capg_rec.greedy_candidates(c, 3)):
        with pytest.raises(ValueError, match=r"needs 3 unmasked items, but row 0 has 2 \(items scored -inf are "):
            draw(cat)


@pytest.mark.parametrize("k", [1, 6])
def test_the_plugin_reads_small_catalogs_whole(k):
    """Up to 2048 items the plug-in reads a sampled catalog whole, as mean-field does: the dense logits'
    values and gradients (it took its prefix and the mass left from head ∪ sample, off by nats). Regression
    (found by review): at K = 1 mean-field returned the softmax over the estimated normaliser (off by 1.1 nats)."""
    user, item = _towers(b=3, n=50, d=4, m=2, scale=1.5)
    items = torch.tensor([[0, 5, 9], [1, 2, 3], [7, 7, 40]])
    for method in ("plugin", "mean_field"):
        leaves = [user.clone().requires_grad_(), user.clone().requires_grad_()]
        cat = SampledCatalog(leaves[0], item, sampler=UniformSampler(12), generator=torch.Generator().manual_seed(0))
        dense = torch.einsum("bmd,nmd->bmn", leaves[1], item)
        got, want = (capg_rec.inclusion_log_prob(c, items, k, method=method) for c in (cat, dense))
        torch.testing.assert_close(got, want)
        grads = [torch.autograd.grad(v.sum(), leaf)[0] for v, leaf in zip((got, want), leaves)]
        torch.testing.assert_close(*grads)


@pytest.mark.parametrize("n", [2048, 2049])
def test_catalogs_of_at_most_2048_items_are_read_whole(n):
    """At the bound itself, 2048 items, the methods that read the best items read a sampled catalog whole: the
    embedding catalog's values (a mutation round: with the bound exclusive the plug-in raised "k=10 exceeds the head
    and sample"). One item more, the sampled catalog's head and sample take over: the plug-in refuses K = 10 there."""
    user, item = _towers(b=2, n=n, d=6)
    items = torch.tensor([[0, 1], [3, 4]])
    sampled = SampledCatalog(user, item, sampler=UniformSampler(8), generator=torch.Generator().manual_seed(0))
    if n == 2048:
        for method in ("plugin", "mean_field", "exact"):
            torch.testing.assert_close(capg_rec.inclusion_log_prob(sampled, items, 10, method=method),
                                       capg_rec.inclusion_log_prob(EmbeddingCatalog(user, item), items, 10,
                                                                   method=method))
    else:
        with pytest.raises(ValueError, match="exceeds the head and sample"):
            capg_rec.inclusion_log_prob(sampled, items, 10, method="plugin")


@pytest.mark.parametrize("tower", ["table", "callable"])
def test_a_small_catalog_read_whole_looks_each_item_up_once(tower):
    """Read whole, a sampled catalog looks each item up once and scores it in one product (found by review: every
    item was looked up for every row, a [B, N, M, D] copy, 10x the time and 23x the memory of an embedding
    catalog's read at B = 512, N = 2000, D = 64): the embedding catalog's values and gradients, masks included."""
    user, item = _towers(b=4, n=40, d=3, m=2)
    masked = torch.tensor([[5, -1], [0, 39], [-1, -1], [7, 7]])
    looked_up = []

    def lookup(ids):
        looked_up.append(ids.numel())
        return item[ids]

    leaves = [user.clone().requires_grad_(), user.clone().requires_grad_()]
    sampled = SampledCatalog(leaves[0], item if tower == "table" else lookup, sampler=UniformSampler(6),
                             num_items=None if tower == "table" else 40, masked_items=masked,
                             generator=torch.Generator().manual_seed(0))
    looked_up.clear()
    got = capg_catalog.every_score(sampled)
    want = capg_catalog.every_score(EmbeddingCatalog(leaves[1], item, masked_items=masked))
    torch.testing.assert_close(got, want)
    if tower == "callable":
        assert looked_up == [40]
    finite = want.isfinite()
    grads = [torch.autograd.grad(v[finite].sin().sum(), leaf)[0] for v, leaf in zip((got, want), leaves)]
    torch.testing.assert_close(*grads)


def test_the_exact_method_names_the_head_it_would_need():
    """Beyond 2048 items the exact method reads max(8K, 1024) best items per expert: at K = 130, 1040, more than a
    head of 1024 names (a mutation round: with 4K the catalog's power-sum error was raised instead)."""
    user, item = _towers(b=1, n=3000, d=6)
    cat = SampledCatalog(user, item, sampler=UniformSampler(64), index=ExactIndex(item), head_size=1024,
                         generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="best 1040 items"):
        capg_rec.inclusion_log_prob(cat, torch.tensor([[0, 1]]), 130, method="exact")


def test_draw_checks_follow_validate_args_and_empty_batches_read_whole():
    """The usable-items check of top_items is a host sync: off with validate_args=False (it ran every draw);
    an empty batch whose head names every item is read whole (exact_top took amin over zero rows)."""
    user, item = _towers(b=2, n=30, d=4)
    cat = SampledCatalog(user, item, sampler=UniformSampler(3), validate_args=False,
                         generator=torch.Generator().manual_seed(0))
    assert not cat.check_draws
    cat._check_usable = None  # would fail if called
    cat.top_items(2, generator=torch.Generator().manual_seed(1), perturb=True)
    empty_user = user[:0]
    everything = torch.arange(12).expand(0, -1)
    small = SampledCatalog(empty_user, item[:10], sampler=UniformSampler(3), head_items=everything)
    for method in ("plugin", "mean_field"):
        assert capg_rec.inclusion_log_prob(small, torch.zeros(0, 2, dtype=torch.long), 3, method=method).shape == (0, 2)


def test_resampled_keeps_users_items_masks_and_index_head_with_a_new_sample_and_head():
    """resampled() is the catalog built anew with the new sampler, head and generator: sums, scores and
    gradients; the index head is not queried again (its ids are kept)."""
    g = torch.Generator().manual_seed(0)
    user = torch.randn(3, 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    item = torch.randn(4000, 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    masked = torch.tensor([[4, -1], [7, 9], [-1, -1]])
    index = ExactIndex(item.detach())
    first = SampledCatalog(user, item, sampler=UniformSampler(50), index=index, head_size=20, temperature=0.7,
                           masked_items=masked, generator=torch.Generator().manual_seed(1))
    head = torch.tensor([[1, 2], [3, -1], [5, 6]])
    again = first.resampled(UniformSampler(80), head_items=head, generator=torch.Generator().manual_seed(2))
    fresh = SampledCatalog(user, item, sampler=UniformSampler(80), index=index, head_size=20, temperature=0.7,
                           masked_items=masked, head_items=head, generator=torch.Generator().manual_seed(2))
    assert again.exact_top == fresh.exact_top == 20 and again.sample_ids.shape == (80,)
    assert torch.equal(again.index_items, first.index_items)
    torch.testing.assert_close(again.log_power_sums(None, 3), fresh.log_power_sums(None, 3), rtol=0, atol=0)
    ids = torch.tensor([[4, 0], [7, 1], [2, 3]])
    torch.testing.assert_close(again.gather(ids), fresh.gather(ids), rtol=0, atol=0)
    got = torch.autograd.grad(again.log_normalizer().sum(), (user, item))
    want = torch.autograd.grad(fresh.log_normalizer().sum(), (user, item))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_exact_top_of_an_index_head_of_every_item_and_the_plugins_warning():
    """Regressions: an index head of all N items with masked items counted N less the masked (the methods then
    took another path, and on several ranks different ones); the plug-in read a head shorter than K (masked or
    padded slots, or none) without the warning mean-field gives, its prefixes silently biased."""
    from capg_rec.ann import ExactIndex
    g = torch.Generator().manual_seed(0)
    user = torch.randn(3, 4, generator=g, dtype=torch.float64)
    small = torch.randn(20, 4, generator=g, dtype=torch.float64)
    masked = torch.tensor([[0, 1], [2, -1], [-1, -1]])
    whole = SampledCatalog(user, small, sampler=UniformSampler(5), index=ExactIndex(small), head_size=20,
                           masked_items=masked, generator=g)
    assert whole.exact_top == 20
    big = torch.randn(3000, 4, generator=g, dtype=torch.float64)
    found = ExactIndex(big).search(user, 12)[1]
    short = SampledCatalog(user, big, sampler=UniformSampler(50), index_items=found, masked_items=found[:, :8],
                           generator=g)
    assert short.exact_top == 4
    candidates = found[:, 8:]
    with pytest.warns(UserWarning, match="the plug-in takes each expert's best items .* names only its best 4"):
        capg_rec.inclusion_log_prob(short, candidates, 6, method="plugin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full = SampledCatalog(user, big, sampler=UniformSampler(50), index_items=found, generator=g)
        capg_rec.inclusion_log_prob(full, candidates, 6, method="plugin")


def test_index_items_refuse_a_head_wider_than_the_catalog_and_non_tensors():
    g = torch.Generator().manual_seed(0)
    user, item = torch.randn(3, 4, generator=g), torch.randn(20, 4, generator=g)
    with pytest.raises(ValueError, match=r"index_items.shape\[2\] \(H\) must be in \[1, 20\]"):
        SampledCatalog(user, item, sampler=UniformSampler(5), index_items=torch.zeros(3, 1, 21, dtype=torch.long))
    with pytest.raises(TypeError, match="index_items must be an integer tensor of item ids, got list"):
        SampledCatalog(user, item, sampler=UniformSampler(5), index_items=[[0, 1]] * 3)


def test_head_summary_masks_the_unused_slots_of_a_short_draw():
    """With validation off, a sampled catalog whose head and sample hold fewer usable items than a method's head
    names -1 slots in its draw; the head summary scores them -inf (regression: the item side's row for id -1 came
    out as a finite score there)."""
    from capg_rec._head_tail import summarize

    g = torch.Generator().manual_seed(0)
    user, item = torch.randn(2, 2, 4, generator=g, dtype=torch.float64), torch.randn(50, 2, 4, generator=g,
                                                                                       dtype=torch.float64)
    item[-1] = 3 * user[0]  # the row id -1 reads scores high
    sample = DrawnSample(torch.arange(10).repeat(3), UniformSampler(30))  # 10 distinct items
    catalog = SampledCatalog(user, item, sampler=sample, head_items=torch.tensor([[10, 11], [12, 13]]),
                             validate_args=False)
    summary = summarize(catalog, torch.zeros(2, 0, dtype=torch.long), 20, 3)
    unused = (summary.head_ids < 0).unsqueeze(1).expand_as(summary.head_scores)
    assert unused.any() and bool((summary.head_scores[unused] == -math.inf).all())
    assert bool(summary.head_scores[~unused].isfinite().all())


def test_a_draw_beyond_the_head_and_sample_raises_in_one_process_whatever_the_batch():
    """In one process a draw of more items than the head and sample hold raises, rows or none, validated or not
    (regression: with validation on, a batch of no rows returned an empty draw, as a rank without rows of a
    sharded job does)."""
    for batch in (0, 2):
        for validate in (True, False):
            catalog = SampledCatalog(torch.randn(batch, 1, 4), torch.randn(20, 1, 4), validate_args=validate,
                                     sampler=DrawnSample(torch.arange(5), UniformSampler(5)))
            with pytest.raises(ValueError, match="k=6 exceeds the"):
                catalog.top_items(6)


def test_top_items_names_experts_outside_the_catalog():
    """Regression: ``top_items(experts=...)`` took an expert beyond M or a negative one as a slice and returned
    an empty result (no error) on the dense, embedding and sampled catalogs."""
    user, item = _towers(m=2)
    catalogs = [capg_rec.DenseCatalog(torch.einsum("bmd,nmd->bmn", user, item)), EmbeddingCatalog(user, item),
                EmbeddingCatalog(user, item, chunk_size=7),
                SampledCatalog(user, item, sampler=UniformSampler(40), generator=torch.Generator().manual_seed(0))]
    for cat in catalogs:
        assert cat.top_items(3, experts=[1]).shape == (3, 1, 3)
        assert torch.equal(cat.top_items(3, experts=(1, 0)), cat.top_items(3)[:, [1, 0]])
        for experts in ([2], [-1], [0, 5]):
            with pytest.raises(ValueError, match=r"experts must be in \[0, 2\)"):
                cat.top_items(3, experts=experts)
        for experts in ([True], ["0"], 1, [0.0], torch.tensor([0.0]), torch.tensor([[0]]), torch.tensor([True])):
            with pytest.raises(TypeError, match="experts must be a sequence of ints"):
                cat.top_items(3, experts=experts)
        for experts in (torch.tensor([1, 0]), np.array([1, 0])):  # 1-d integer tensors and arrays, as before
            assert torch.equal(cat.top_items(3, experts=experts), cat.top_items(3)[:, [1, 0]])


@pytest.mark.parametrize("mixed", [False, True])
def test_in_batch_sample_of_the_rows_own_heads_is_unbiased(mixed):
    """Regression (found by review): with the batch the catalog's own head_items (the default), a row's own head
    items are scored exactly and their sample terms dropped, but their slots still counted in the expected counts:
    every tail term was weighed by (slots - own) / slots, E[Ẑ/Z] = 0.75 at B = 4 (1 - 1/B), and 0.66-0.96 mixed
    with uniform negatives. A row's counts now come from the other rows' slots. Heads iid from q (the
    frequency's model), a CLT bound over seeds."""
    user, item = _towers(b=4, n=50, scale=0.3)
    q = torch.softmax(0.3 * torch.randn(50, generator=torch.Generator().manual_seed(7), dtype=torch.float64), 0)
    exact = EmbeddingCatalog(user, item).log_normalizer()
    ratios = []
    for seed in range(600):
        g = torch.Generator().manual_seed(seed)
        head = torch.multinomial(q, 12, replacement=True, generator=g).view(4, 3)
        head[1, 2] = -1  # a pad: rows own different numbers of slots
        sampler = InBatchSampler(frequency=q)
        if mixed:
            sampler = MixedSampler(sampler, UniformSampler(6))
        cat = SampledCatalog(user, item, sampler=sampler, head_items=head, generator=g)
        ratios.append((cat.log_normalizer() - exact).exp())
    _clt_check(torch.stack(ratios))


def test_the_rows_own_heads_given_again_as_the_batch_are_unbiased():
    """Regression (found by review): batch_items given explicitly as the head_items took the path for a batch drawn
    apart, E[Ẑ/Z] = 1 - 1/B (0.76 at B = 4); only a batch left to its default was counted as the rows' own. A batch
    equal to the head by value now is, and resampled(...) with both likewise. Same draws, same CLT bound as above."""
    user, item = _towers(b=4, n=50, scale=0.3)
    q = torch.softmax(0.3 * torch.randn(50, generator=torch.Generator().manual_seed(7), dtype=torch.float64), 0)
    exact = EmbeddingCatalog(user, item).log_normalizer()
    ratios, again = [], []
    for seed in range(600):
        g = torch.Generator().manual_seed(seed)
        head = torch.multinomial(q, 12, replacement=True, generator=g).view(4, 3)
        cat = SampledCatalog(user, item, sampler=InBatchSampler(frequency=q), head_items=head, batch_items=head.clone(),
                             generator=g)
        ratios.append((cat.log_normalizer() - exact).exp())
        again.append((cat.resampled(InBatchSampler(frequency=q), head_items=head, batch_items=head, generator=g)
                      .log_normalizer() - exact).exp())
    _clt_check(torch.stack(ratios))
    _clt_check(torch.stack(again))


def test_an_in_batch_sample_without_other_rows_is_refused():
    """Regression (found by review): a batch of one row drew only its own head items, whose terms are dropped, so its
    normaliser was silently its head's alone (Ẑ/Z = 0.23). Now a ValueError; mixed with uniform negatives it works."""
    user, item = _towers(b=1, n=50)
    q = torch.full((50,), 1 / 50, dtype=torch.float64)
    head, g = torch.tensor([[3, 7]]), torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="row 0 has no other row to draw from"):
        SampledCatalog(user, item, sampler=InBatchSampler(frequency=q), head_items=head, generator=g)
    mixed = SampledCatalog(user, item, sampler=MixedSampler(InBatchSampler(frequency=q), UniformSampler(8)),
                           head_items=head, generator=g)
    assert torch.isfinite(mixed.log_normalizer()).all()


@pytest.mark.parametrize("num_items", [1000, 10**6])
def test_frequency_off_by_a_tenth_is_refused_at_any_size(num_items):
    """Regression (found by review): the sum-to-1 slack was N·eps, 0.12 at N = 10^6 in float32: popularity normalised
    over a stale N (sum 0.9) passed and every logQ weight came out 1/0.9 too large. The slack is now the pairwise
    sum's, and a vector normalised in float32 still passes."""
    counts = torch.rand(num_items, generator=torch.Generator().manual_seed(0)) + 0.5
    InBatchSampler(frequency=counts / counts.sum())
    with pytest.raises(ValueError, match="frequency must sum to 1"):
        InBatchSampler(frequency=0.9 * counts / counts.sum())


def test_a_frequency_off_by_rounding_is_refused_with_its_error_and_the_way_out():
    """A float32-normalised frequency in float64 is off by ~1e-8, beyond float64's slack: the message said "got 1"
    (six digits of the sum; found by review). It gives the error and the slack, and the advice works."""
    frequency = torch.full((30,), 1 / 30, dtype=torch.float32).double()
    with pytest.raises(ValueError, match=r"within 1.33e-15 \(torch.float64 at N = 30\), got 1 \+ 5.22e-08: normalise"):
        InBatchSampler(frequency=frequency)
    InBatchSampler(frequency=frequency / frequency.sum())
    with pytest.raises(ValueError, match="got all zeros"):  # where that advice would give NaN (found by review)
        InBatchSampler(frequency=torch.zeros(5))
    with pytest.raises(ValueError, match="got an empty tensor"):
        InBatchSampler(frequency=torch.zeros(0))


def test_a_whole_catalog_head_with_padding_names_only_what_it_found():
    """Regression (found by review): head_size = N from an index that found fewer (-1 padding) reported exact_top = N
    (head_size = N - 1 reported the count found), and mean-field's warning about a short head was skipped."""
    user, item = _towers(b=2, n=30)

    class Short(ExactIndex):  # an approximate index: finds 5 items, pads the rest with -1
        def _search_one(self, expert, queries, k):
            scores, ids = super()._search_one(expert, queries, k)
            return scores.masked_fill(torch.arange(k) >= 5, -math.inf), ids.masked_fill(torch.arange(k) >= 5, -1)

    g = torch.Generator().manual_seed(0)
    for size in (29, 30):
        cat = SampledCatalog(user, item, sampler=UniformSampler(4), index=Short(item), head_size=size, generator=g)
        assert cat.exact_top == 5


def test_a_generator_of_another_type_is_named():
    """Regression (found by review): generator='x' gave torch's 'randint() received an invalid combination of
    arguments' from SampledCatalog and from explore_candidates (so from ServingRetriever.retrieve(sample=True))."""
    from capg_rec.logs import explore_candidates
    user, item = _towers(b=2, n=20)
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got str"):
        SampledCatalog(user, item, sampler=UniformSampler(8), generator="x")
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got str"):
        explore_candidates(torch.randn(2, 20), 3, epsilon=0.5, generator="x")


def test_sampled_catalog_regressions_from_review():
    """Each failed or passed silently before its fix: scores that overflow (a finite, wrong normaliser, or -inf read
    as every item masked); an index over another number of items (an IndexError, or head ids >= N with a tower);
    sample ids outside [-1, N) (an IndexError, or an id >= N scored by a tower, other negatives taken as unused
    slots); top_items(0) and (-1) (ZeroDivisionError, math domain error); num_items next to a table (ignored);
    InBatchSampler's seed 'a' (a RuntimeError) and more buckets than its hashes reach."""
    user, item = _towers(b=2, n=20, dtype=torch.float32)
    ones, g = (torch.ones(2, 4), torch.ones(20, 4)), torch.Generator().manual_seed(0)  # every score 4 · scale
    with pytest.raises(ValueError, match="overflow"):
        SampledCatalog(*ones, sampler=UniformSampler(8), temperature=1e-38, generator=g)
    cat = SampledCatalog(ones[0] * 1e19, ones[1] * 1e19, sampler=UniformSampler(8), validate_args=False, generator=g)
    with pytest.raises(ValueError, match="overflow"):
        SampledCatalog(ones[0] * 1e19, ones[1] * 1e19, sampler=UniformSampler(8), head_items=torch.tensor([[1], [2]]),
                       generator=g)
    with pytest.raises(ValueError, match="overflow"):  # the candidates' scores, gathered by a loss
        _overflowing_gather(user, item)
    assert cat.sample_scores.shape == (2, 1, 8)  # unchecked without validation
    with pytest.raises(ValueError, match="index must be built on the catalog's 20 items, got 50"):
        SampledCatalog(user, item, sampler=UniformSampler(8), index=ExactIndex(torch.randn(50, 4)), head_size=3)
    for ids in ([5, 25], [5, -5]):
        with pytest.raises(ValueError, match=r"sampler must draw ids in \[0, 20\)"):
            SampledCatalog(user, item, sampler=DrawnSample(torch.tensor(ids), UniformSampler(2)))
        with pytest.raises(ValueError, match="sampler must draw ids"):
            SampledCatalog(user, lambda i: item[i.clamp(max=19)], num_items=20,
                           sampler=DrawnSample(torch.tensor(ids), UniformSampler(2)))
    cat = SampledCatalog(user, item, sampler=UniformSampler(8))
    for k in (0, -1):
        with pytest.raises(ValueError, match="k must be"):
            cat.top_items(k)
    with pytest.raises(ValueError, match="num_items=1000 differs from the item table's 20 rows"):
        SampledCatalog(user, item, sampler=UniformSampler(8), num_items=1000)
    with pytest.raises(TypeError, match="seed must be an int"):
        InBatchSampler(seed="a")
    with pytest.raises(ValueError, match="num_buckets must be at most"):
        InBatchSampler(num_buckets=2**40)


def _overflowing_gather(user, item):
    """A catalog whose head and sample are fine, asked for an item whose score overflows."""
    user, big = torch.ones_like(user), item.clone()
    big[7] = 1e38  # 4 · 1e38: beyond float32
    cat = SampledCatalog(user, big, sampler=DrawnSample(torch.tensor([0, 1]), UniformSampler(2)),
                         head_items=torch.tensor([[2], [3]]))
    return cat.gather(torch.tensor([[7], [7]]))


def test_an_item_side_giving_nan_is_named_not_taken_for_an_overflow():
    """An item tower that gives NaN vectors was reported as an overflow with advice to scale the embeddings down
    (found by review), in the sample, the head and a lookup alike; a real overflow keeps its message."""
    user, item = _towers(b=2, n=20, dtype=torch.float32)

    def tower(ids):
        return item[ids].masked_fill((ids == 3).unsqueeze(-1), math.nan)

    message = "the item side gave vectors that are not finite"
    for made in (dict(sampler=DrawnSample(torch.tensor([3, 4]), UniformSampler(2))),
                 dict(sampler=UniformSampler(2), head_items=torch.tensor([[3], [5]]))):
        with pytest.raises(ValueError, match=message):
            SampledCatalog(user, tower, num_items=20, **made)
    cat = SampledCatalog(user, tower, num_items=20, sampler=DrawnSample(torch.tensor([5, 4]), UniformSampler(2)))
    with pytest.raises(ValueError, match=message):
        cat.gather(torch.tensor([[3], [1]]))
    with pytest.raises(ValueError, match="overflow torch.float32"):
        _overflowing_gather(user, item)
    # read whole (up to 2048 items), where an item outside the head and sample is first seen (found by a diff review)
    candidates = torch.tensor([[1, 2, 4], [5, 6, 7]])
    for method in ("mean_field", "plugin", "exact"):
        with pytest.raises(ValueError, match=message):
            CAPGLoss(3, method=method)(cat, candidates, candidates[:, :1], torch.ones(2, 1))
    # NaN vectors of a masked item (in the head, a lookup or the whole read) are refused too: the mask's gradient,
    # 0 times NaN, made the users' gradient NaN silently (found by a diff review); finite vectors of a masked item
    # whose product overflows are harmless there, as before
    masked = dict(num_items=20, sampler=DrawnSample(torch.tensor([5, 4]), UniformSampler(2)),
                  masked_items=torch.tensor([[3], [3]]))
    with pytest.raises(ValueError, match=message):
        SampledCatalog(user, tower, head_items=torch.tensor([[3], [1]]), **masked)
    with pytest.raises(ValueError, match=message):
        SampledCatalog(user, tower, **masked).gather(torch.tensor([[3], [1]]))
    for method in ("mean_field", "plugin", "exact"):
        with pytest.raises(ValueError, match=message):
            CAPGLoss(3, method=method)(SampledCatalog(user, tower, **masked), candidates, candidates[:, :1],
                                       torch.ones(2, 1))

    def overflowing(ids):  # 4e38 against a user of ones: beyond float32
        return item[ids].masked_fill((ids == 3).unsqueeze(-1), 1e38)

    leaf = torch.ones(2, 4, requires_grad=True)
    cat = SampledCatalog(leaf, overflowing, **masked)
    assert cat.gather(torch.tensor([[3], [1]]))[0, 0, 0] == -math.inf
    CAPGLoss(3)(cat, candidates, candidates[:, :1], torch.ones(2, 1)).backward()
    assert leaf.grad.isfinite().all()
    with pytest.raises(ValueError, match="overflow torch.float32"):  # unmasked, it is an overflow
        SampledCatalog(torch.ones(2, 4), overflowing, num_items=20,
                       sampler=UniformSampler(2)).gather(torch.tensor([[3], [1]]))
    # but not in the negative sample, whose sums add each slot's bias (-inf for a masked one) to its score: inf - inf
    # (a diff review asked for it to pass there; the sums then came out -inf)
    drawn = dict(masked, sampler=DrawnSample(torch.tensor([3, 4]), UniformSampler(2)))
    with pytest.raises(ValueError, match="overflow torch.float32"):
        SampledCatalog(torch.ones(2, 4), overflowing, **drawn)


def test_exclude_of_another_shape_or_dtype_is_refused_by_every_catalog():
    """Regression (found by review): an exclude of another batch size broadcast silently on EmbeddingCatalog (the sums
    of other rows' exclusions) and failed inside torch on SampledCatalog; float ids were taken. Shape and dtype are
    checked now (no host read)."""
    user, item = _towers(b=3, n=20)
    for cat in (EmbeddingCatalog(user, item), capg_rec.DenseCatalog(user @ item.T),
                SampledCatalog(user, item, sampler=UniformSampler(8), generator=torch.Generator().manual_seed(0))):
        for bad, error in ((torch.tensor([[1], [2]]), ValueError), (torch.tensor([1, 2, 3]), ValueError),
                           (torch.tensor([[1.0], [2.0], [3.0]]), TypeError)):
            with pytest.raises(error, match="exclude must"):
                cat.log_power_sums(bad)
            with pytest.raises(error, match="exclude must"):
                cat.top_items(2, exclude=bad)


def test_a_row_with_fewer_items_than_mean_field_s_head_gets_no_false_floor():
    """Found by review: masks leaving 40 items, fewer than mean-field's head (90): the head's last slot was a pad,
    read as the largest id in the batch, whose finite score became the head's floor and clamped κ. With the checks
    off the probabilities summed to 11.07 for K = 20 (-0.75 on one item). Every unmasked item is in the index
    head here and the tail is empty: the answer is the dense one."""
    from capg_rec._mean_field import mean_field_log_inclusion
    from capg_rec.plackett_luce import expert_runs

    n, k, m = 3000, 20, 2
    gen = torch.Generator().manual_seed(0)
    user = torch.randn(1, m, 4, generator=gen, dtype=torch.float64)
    item = torch.randn(n, m, 4, generator=gen, dtype=torch.float64)
    logits = torch.einsum("bmd,nmd->bmn", user, item)
    logits[:, :, :n - 40] = -math.inf
    items, runs = torch.arange(n - 40, n).view(1, -1), expert_runs(k, m)
    dense = mean_field_log_inclusion(capg_rec.DenseCatalog(logits), items, runs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "names only its best 40 exactly": the whole of this row
        catalog = SampledCatalog(user, item, sampler=UniformSampler(100), index_items=logits.topk(200, dim=2).indices,
                                 masked_items=torch.arange(n - 40).view(1, -1),
                                 generator=torch.Generator().manual_seed(0), validate_args=False)
        sampled = mean_field_log_inclusion(catalog, items, runs)
    torch.testing.assert_close(sampled.exp(), dense.exp(), rtol=0, atol=1e-9)


def test_sampler_and_head_arguments_found_by_review():
    """Regressions (found by review): a DrawnSample of an InBatchSampler with a given frequency, on a catalog
    without the batch, dropped its whole sample silently (every expected count log(q · 0)); a float16 frequency
    biased every logQ weight (1e-6 is a subnormal there, 1.3% off); an index with the default head_size=0 was
    ignored; a 2-d id tensor was a TypeError."""
    g = torch.Generator().manual_seed(0)
    n, users, items = 1000, torch.randn(2, 4, generator=g), torch.randn(1000, 4, generator=g)
    sampler = InBatchSampler(frequency=torch.full((n,), 1.0 / n))
    batch = torch.randint(n, (2, 5), generator=g)
    drawn = DrawnSample(sampler.draw(n, batch, generator=g, device=torch.device("cpu")), sampler)
    with pytest.raises(ValueError, match="InBatchSampler needs the batch's named items for its expected counts"):
        SampledCatalog(users, items, num_items=n, sampler=drawn).log_normalizer()
    estimate = SampledCatalog(users, items, num_items=n, sampler=DrawnSample(drawn.ids, sampler, batch_items=batch))
    assert torch.isfinite(estimate.log_normalizer()).all()
    with pytest.raises(TypeError, match="frequency must be float32 or float64"):
        InBatchSampler(frequency=torch.full((n,), 1.0 / n, dtype=torch.float16))
    with pytest.raises(ValueError, match="index needs head_size > 0"):
        SampledCatalog(users, items, num_items=n, sampler=UniformSampler(10), index=ExactIndex(items))
    with pytest.raises(ValueError, match=r"ids must be 1-d \[S\], got shape \[2, 2\]"):
        DrawnSample(torch.zeros(2, 2, dtype=torch.long), UniformSampler(4))
    with pytest.raises(TypeError, match="ids must be an integer tensor .S., got torch.float32"):
        DrawnSample(torch.zeros(4), UniformSampler(4))


def test_a_drawn_sample_holds_its_sampler_s_whole_draw():
    """Regression (found by review): a DrawnSample of fewer ids than its sampler draws was taken, and every estimated
    sum came out that share of the truth (3 of 5 uniform ids: 3/5). A validating catalog refuses it (unused -1 slots
    not counted; an in-batch draw's size is that of the batch it was drawn from, its own or else the catalog's);
    the sample itself is made as before, under torch.compile and vmap too."""
    g = torch.Generator().manual_seed(0)
    users, items = torch.randn(2, 4, generator=g), torch.randn(50, 4, generator=g)

    def catalog(sample, **kwargs):
        return SampledCatalog(users, items, sampler=sample, **kwargs)

    with pytest.raises(ValueError, match=r"sample must hold the 5 ids that UniformSampler\(num_samples=5\) draws "
                                         r"\(-1: unused slots, not counted\), got 3"):
        catalog(DrawnSample(torch.tensor([1, 2, 3]), UniformSampler(5)))
    short = DrawnSample(torch.tensor([1, 2, 3]), UniformSampler(5))
    assert torch.isfinite(SampledCatalog(users, items, sampler=short, validate_args=False).log_normalizer()).all()
    assert torch.isfinite(catalog(DrawnSample(torch.tensor([1, 2, 3, -1, 4, 5]), UniformSampler(5))).log_normalizer()
                          ).all()  # an unused slot
    batch = torch.tensor([[1, 2], [3, -1]])
    sampler = MixedSampler(InBatchSampler(), UniformSampler(5))
    drawn = sampler.draw(50, batch, generator=g, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"sample must hold the 8 ids .* from batch_items of shape \[2, 2\] .*got 7"):
        catalog(DrawnSample(drawn[1:], sampler, batch_items=batch), head_items=batch)
    with pytest.raises(ValueError, match=r"sample must hold the 8 ids .* from batch_items of shape \[2, 2\] .*got 7"):
        catalog(DrawnSample(drawn[1:], sampler), head_items=batch)  # drawn from the catalog's own head
    assert torch.isfinite(catalog(DrawnSample(drawn, sampler), head_items=batch).log_normalizer()).all()
    with pytest.raises(ValueError, match=r"batch_items must be 2-d \[B, H\], got shape \[3\]"):
        DrawnSample(torch.tensor([1, 2, 3]), InBatchSampler(), batch_items=batch[0, :1].repeat(3))
    made = torch.compile(lambda ids: DrawnSample(ids, UniformSampler(5)).ids * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(made(torch.arange(5)), torch.arange(0, 10, 2))  # found by review of the first fix
    with pytest.raises(ValueError, match="samplers must hold at least one NegativeSampler"):
        MixedSampler()


def test_streaming_estimate_of_rare_items_is_not_biased_by_their_first_gaps():
    """Zipf batches, 128 slots per step for 4000 steps over 2000 items: the rarest 800 (E[count] 0.008–0.013 per
    step) are seen n ≈ 30–50 times. At a fixed rate (alpha = 0.01) their first gap kept weight 0.99^n ≈ 0.7, and
    1/δ of so few gaps overestimated their counts by 23–41% on average (found by review). With plain means over the
    first 1/alpha sightings, 1/δ̂ of n geometric gaps is biased by about 1/n and spread by 1/√n per item: the mean
    ratio over m items is within 1/n + 4/√(n·m) of 1."""
    num_items, slots, steps = 2000, 128, 4000
    q = 1.0 / torch.arange(1, num_items + 1, dtype=torch.float64)
    q /= q.sum()
    sampler = InBatchSampler(alpha=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        sampler.observe(torch.multinomial(q, slots, replacement=True, generator=gen).view(32, 4))
    rare = torch.arange(1200, num_items)
    ratio = sampler.log_expected_count(rare, num_items, None).exp() / (slots * q[rare])
    n = float(slots * q[rare].min() * steps)  # the fewest sightings expected
    assert abs(float(ratio.mean()) - 1.0) <= 1.0 / n + 4.0 / math.sqrt(n * rare.numel()), float(ratio.mean())


def test_streaming_estimate_state_dict_round_trip_and_device_moves(device):
    """``state_dict`` carries the streaming estimate into a checkpoint (a resume restarted it from step 0), and a
    batch on another device moves the estimate there (it was reset while the step count went on, so every item's
    next sighting counted as its first: counts ~250x too small, found by review). A sampler restored from the state,
    or fed on another device, gives the same estimates as one that ran throughout on one device."""
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 50, (4, 3), generator=gen) for _ in range(60)]
    whole, restored = InBatchSampler(alpha=0.1), InBatchSampler(alpha=0.1)
    for b in batches[:30]:
        whole.observe(b)
    state = whole.state_dict()
    assert state["step"] == 30 and state["seed"] == 0 and state["sightings"].shape == (2, (1 << 18) + 1)
    for b in batches[30:]:
        whole.observe(b)
    restored.load_state_dict(state)  # kept in memory while `whole` went on: a snapshot (found by review)
    for b in batches[30:]:
        restored.observe(b.to(device))  # the rest of the steps on the device
    ids = torch.arange(50)
    torch.testing.assert_close(restored.log_expected_count(ids.to(device), 50, None).cpu(),
                               whole.log_expected_count(ids, 50, None), rtol=1e-12, atol=0.0)
    mixed = MixedSampler(UniformSampler(3), InBatchSampler())
    mixed.samplers[1].observe(batches[0])
    again = MixedSampler(UniformSampler(3), InBatchSampler())
    again.load_state_dict(mixed.state_dict())
    assert again.samplers[1].step == 1
    assert InBatchSampler().state_dict() == {"step": 0, "seed": 0} and UniformSampler(3).state_dict() == {}


def test_sampler_state_dict_refuses_what_does_not_fit():
    sampler = InBatchSampler(num_buckets=8)
    sampler.observe(torch.tensor([[1, 2]]))
    state = sampler.state_dict()
    with pytest.raises(TypeError, match="state must be a dict"):
        sampler.load_state_dict([("step", 1)])
    with pytest.raises(ValueError, match="'step', 'seed' and either none or all"):
        sampler.load_state_dict({"step": 1, "seed": 0, "last": state["last"]})
    with pytest.raises(ValueError, match=r"state\['step'\]"):
        sampler.load_state_dict({**state, "step": -1})
    with pytest.raises(ValueError, match=r"state\['seed'\] is 3, but this sampler hashes with seed=0"):
        sampler.load_state_dict({**state, "seed": 3})  # other hash functions: the tables would mean nothing
    with pytest.raises(ValueError, match=r"state\['copies'\].*num_buckets"):
        sampler.load_state_dict({**InBatchSampler(num_buckets=16).state_dict(), "last": state["last"],
                                 "interval": state["interval"], "copies": torch.zeros(2, 17, dtype=torch.float64),
                                 "sightings": state["sightings"]})
    later = InBatchSampler(num_buckets=8)
    for _ in range(5):
        later.observe(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"state\['step'\] must be at least the last step its tables saw an item at, "
                       "5, got 0"):  # the estimate then came out 21 times too large (found by review)
        sampler.load_state_dict({**later.state_dict(), "step": 0})
    with pytest.raises(ValueError, match="keeps no state"):
        UniformSampler(3).load_state_dict({"step": 1})
    with pytest.raises(ValueError, match="one entry per sampler"):
        MixedSampler(UniformSampler(3), InBatchSampler()).load_state_dict({"0": {}})
    assert sampler.step == 1  # nothing was loaded


@pytest.mark.parametrize("kind", ["dense", "embedding", "sampled", "sampled_tower"])
def test_named_items_are_checked_by_every_catalog(kind):
    """``gather`` and ``log_softmax`` of ids out of range, of the wrong shape or dtype: a ValueError or TypeError
    naming ``items``. A SampledCatalog scored id -1 as the last item and took a [1, L] for every row silently, a
    DenseCatalog gave torch's RuntimeError and gathered the first row alone for [1, L] (found by review)."""
    gen = torch.Generator().manual_seed(0)
    user, item = torch.randn(3, 4, generator=gen), torch.randn(100, 4, generator=gen)
    catalog = {"dense": lambda: capg_rec.DenseCatalog(user @ item.T),
               "embedding": lambda: EmbeddingCatalog(user, item),
               "sampled": lambda: SampledCatalog(user, item, sampler=UniformSampler(8)),
               "sampled_tower": lambda: SampledCatalog(user, lambda ids: item[ids], num_items=100,
                                                       sampler=UniformSampler(8))}[kind]()
    good = torch.tensor([[1], [2], [3]])
    for fn in (catalog.gather, catalog.log_softmax):
        assert fn(good).shape == (3, 1, 1)
        for bad in ([[-1], [2], [3]], [[100], [2], [3]]):
            with pytest.raises(ValueError, match=r"items must hold ids in \[0, 100\)"):
                fn(torch.tensor(bad))
        with pytest.raises(ValueError, match=r"items must have shape \[B=3, L\]"):
            fn(torch.tensor([[1]]))
        with pytest.raises(TypeError, match="items must have an integer dtype"):
            fn(good.float())
        assert fn(good[:, :0]).shape == (3, 1, 0)  # no columns: nothing to score
    if kind == "dense":
        with pytest.raises(ValueError, match=r"items and also must hold ids in \[0, 100\)"):
            catalog.gather_with_rest(good, also=torch.tensor([[100], [2], [3]]))


def test_a_callable_item_towers_own_errors_pass_through():
    """The ids of a callable item tower are checked before it runs (with the checks on); an error of the tower's
    own, on valid ids, is its own: it was reported as "items must hold ids" with its cause hidden (found by
    review)."""
    embed = torch.nn.Embedding(100, 8)
    category = torch.arange(100)

    def tower(ids: torch.Tensor) -> torch.Tensor:
        return embed(category[ids])

    catalog = SampledCatalog(torch.randn(2, 8), tower, num_items=100, sampler=UniformSampler(4))
    category[60] = 150  # a bug inside the tower: a category id beyond its table
    with pytest.raises(IndexError, match="index out of range in self"):
        catalog.gather(torch.tensor([[10, 60], [1, 2]]))
    with pytest.raises(ValueError, match=r"items must hold ids in \[0, 100\), got values in \[1, 100\]"):
        catalog.gather(torch.tensor([[10, 100], [1, 2]]))  # an id of its own out of range: checked first


def test_a_drawn_item_of_zero_expected_count_is_refused():
    """A given frequency of 0 for an item that the batch holds: its sample terms were silently left out of the sums
    (found by review); with the checks on it is a ValueError naming the item."""
    gen = torch.Generator().manual_seed(0)
    user, item = torch.randn(3, 4, generator=gen), torch.randn(20, 4, generator=gen)
    frequency = torch.full((20,), 1 / 19, dtype=torch.float64)
    frequency[5] = 0.0
    sampler = InBatchSampler(frequency=frequency)
    batch = torch.tensor([[1, 2], [5, 3], [4, 6]])
    with pytest.raises(ValueError, match="sampler drew item 5, whose expected count it gives as 0"):
        SampledCatalog(user, item, sampler=sampler, batch_items=batch)
    SampledCatalog(user, item, sampler=sampler, batch_items=batch, validate_args=False)  # checks off: as before
    SampledCatalog(user, item, sampler=sampler, batch_items=batch.clamp(max=4).where(batch != 5, 4))


def test_in_batch_hashes_are_made_on_the_host_under_any_default_device():
    """InBatchSampler drew its hash functions from a CPU generator onto the default device: under
    torch.set_default_device("cuda") that raises (found by review; "meta" stands in for it here, and its hash
    functions there could not even be read)."""
    with torch.device("meta"):
        sampler = InBatchSampler(num_buckets=64)
    assert sampler._mult.device.type == "cpu" and sampler._add.device.type == "cpu"
    sampler.observe(torch.tensor([[1, 2], [2, 3]]))
    assert torch.isfinite(sampler.log_expected_count(torch.tensor([1, 2, 3]), 10, None)).all()


def test_streaming_estimate_takes_the_least_copies_over_hash_functions():
    """Two items that share a bucket under one hash function but not the other: each hash's bucket of the common
    one sees the copies of both, and the count-min rule (the smallest copies, the largest gap over the hash
    functions) gives each item its own count. Taking the largest copies went unnoticed by every test (a review's
    mutation: 6 and 6 for items of 5 and 1 copies a step)."""
    sampler = InBatchSampler(num_buckets=4, num_hashes=2)
    ids = torch.arange(64)
    buckets = sampler._buckets(ids)  # [2, 64]
    a, b = next((i, j) for i in range(64) for j in range(i + 1, 64)
                if buckets[0, i] == buckets[0, j] and buckets[1, i] != buckets[1, j])
    batch = torch.tensor([[a] * 5 + [b]])
    for _ in range(50):
        sampler.observe(batch)
    torch.testing.assert_close(sampler.log_expected_count(torch.tensor([a, b]), 64, None).exp(),
                               torch.tensor([5.0, 1.0], dtype=torch.float64))


def test_ids_are_checked_before_a_lookup_off_the_cpu_and_not_inside_trusting(monkeypatch):
    """Off the CPU a lookup of an id out of range is a device-side assert, not an error to catch: with the checks on
    the ids are checked first (torch.gather's own error is converted on the CPU), except inside the losses' trusted
    lookups. A device other than the CPU is simulated by the catalog's device attribute (the branch no CPU test took,
    found by review), without the check that the ids are on it; a copy made inside a trusted lookup checks its
    own."""
    catalog = capg_rec.DenseCatalog(torch.randn(2, 10))
    bad = torch.tensor([[1], [12]])
    with pytest.raises(ValueError, match=r"items must hold ids in \[0, 10\)$"):  # torch's error, converted
        catalog.gather(bad)
    monkeypatch.setattr(capg_rec.catalog, "check_same_device", lambda device, **tensors: None)
    catalog.device = torch.device("meta")
    with pytest.raises(ValueError, match=r"items must hold ids in \[0, 10\), got values in \[1, 12\]"):
        catalog.gather(bad)  # checked before the lookup
    with catalog._trusting():
        with pytest.raises(ValueError, match=r"items must hold ids in \[0, 10\)$"):
            catalog.gather(bad)  # trusted: no check of its own, the lookup's error
    user, item = torch.randn(2, 4), torch.randn(10, 4)
    sampled = SampledCatalog(user, lambda ids: item[ids], num_items=10, sampler=UniformSampler(3))
    with sampled._trusting():
        copied = sampled.resampled(UniformSampler(3))
    with pytest.raises(ValueError, match="got values in"):
        copied.gather(torch.tensor([[1], [-1]]))


def test_streaming_frequency_is_one_over_the_mean_gap_before_its_rate_floor():
    """Until 1/alpha sightings the streaming estimate is the plain mean of an item's gaps: seen at steps 1, 2 and 12
    (gaps 1, 1, 10), its expected count is exactly 1/4 (found by mutation testing: a moving average from zero, 0.248,
    passed the statistical bound)."""
    sampler = InBatchSampler(alpha=0.01)
    for step in range(1, 13):
        sampler.observe(torch.tensor([[7 if step in (1, 2, 12) else -1]]))
    assert float(sampler.log_expected_count(torch.tensor([7]), 100, None).exp()) == pytest.approx(0.25, rel=1e-12)


def test_count_min_takes_the_longest_interval_over_hashes():
    """An item that shares one hash's bucket with a more frequent item keeps its own rate from the other hash: the
    longest interval over hashes (found by mutation testing: the shortest gave it its neighbour's rate, 1 for 1/4,
    and no test had a collision of different frequencies)."""
    sampler = InBatchSampler(num_buckets=4, num_hashes=2)
    buckets = sampler._buckets(torch.arange(64))
    a, c = next((i, j) for i in range(64) for j in range(i + 1, 64)
                if buckets[0, i] == buckets[0, j] and buckets[1, i] != buckets[1, j])
    for step in range(1, 41):  # c at every step, a at every 4th
        sampler.observe(torch.tensor([[c, a if step % 4 == 0 else -1]]))
    torch.testing.assert_close(sampler.log_expected_count(torch.tensor([a, c]), 64, None).exp(),
                               torch.tensor([0.25, 1.0], dtype=torch.float64))


def test_rows_of_exactly_k_unmasked_items_draw_them():
    """A row whose unmasked items are exactly K draws all of them (found by mutation testing: refusing it passed)."""
    g = torch.Generator().manual_seed(0)
    user, item = torch.randn(2, 4, generator=g), torch.randn(10, 4, generator=g)
    cat = SampledCatalog(user, item, sampler=UniformSampler(50), masked_items=torch.arange(3, 10).expand(2, -1),
                         generator=g, validate_args=True)
    assert torch.equal(capg_rec.sample_candidates(cat, 3, generator=g).sort(1).values, torch.arange(3).expand(2, -1))


def test_an_agreed_read_of_the_best_items_does_not_skip_a_later_check_with_exclusions():
    """Once a read of the best k agreed there is room for k, a call that excludes items is still checked: here only
    4 of 6 items are left, and 5 are asked (found by mutation testing: the mutant returned excluded items)."""
    g = torch.Generator().manual_seed(0)
    user, item = torch.randn(2, 4, generator=g), torch.randn(6, 4, generator=g)
    cat = SampledCatalog(user, item, sampler=UniformSampler(4), head_items=torch.arange(6).expand(2, -1), generator=g,
                         validate_args=True)
    cat._best_items(5)  # as mean-field reads its head
    with pytest.raises(ValueError, match="k=5 exceeds the usable items"):
        cat.top_items(5, exclude=torch.tensor([[0, 1], [0, 1]]))


def test_a_padded_slot_is_not_another_rows_draw():
    """A -1 slot of a row's own head holds no item: with a given frequency of 0 for item 0, the row still has the
    other row's slots to draw from (found by mutation testing: a check over any slot rather than all refused it)."""
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([0.0, 0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    cat = SampledCatalog(torch.randn(2, 4, generator=g), torch.randn(6, 4, generator=g),
                         sampler=InBatchSampler(frequency=q), head_items=torch.tensor([[1, 2, -1], [3, 4, 5]]),
                         validate_args=True)
    assert torch.isfinite(cat.log_power_sums()).all()


class _OwnSampler(capg_rec.NegativeSampler):
    """A sampler of a user's own, drawing ``ids`` and giving ``counts(ids)`` as their log expected counts."""

    def __init__(self, ids, counts):
        self.ids, self.counts = ids, counts

    def draw(self, num_items, batch_items, *, generator, device):
        return self.ids

    def log_expected_count(self, ids, num_items, batch_items):
        return self.counts(ids)


def _uniform_log_counts(ids):
    return torch.full(ids.shape, math.log(3 / 100), dtype=torch.float64)


def _with_first(value):
    def counts(ids):
        out = _uniform_log_counts(ids)
        out[0] = value
        return out
    return counts


@pytest.mark.parametrize("sampler, error, message", [
    (_OwnSampler(torch.tensor([3, 4, 5]), _with_first(math.nan)), ValueError, "got NaN or \\+inf"),
    (_OwnSampler(torch.tensor([3, 4, 5]), _with_first(math.inf)), ValueError, "got NaN or \\+inf"),
    (_OwnSampler(torch.tensor([3, 4, 5]), lambda ids: _uniform_log_counts(ids)[:, None]), ValueError,
     r"log_expected_count must give shape \[3\] \(one per id\), got \[3, 1\]"),
    (_OwnSampler(torch.tensor([3, 4, 5]), lambda ids: _uniform_log_counts(ids)[:1]), ValueError,
     r"must give shape \[3\]"),
    (_OwnSampler(torch.tensor([3, 4, 5]), lambda ids: torch.zeros_like(ids)), TypeError,
     r"log_expected_count must give a floating tensor \[3\], got torch.int64"),
    (_OwnSampler(torch.tensor([3.0, 4.0, 5.0]), _uniform_log_counts), TypeError,
     r"draw's ids must be an integer tensor \[S\], got torch.float32"),
    (_OwnSampler(torch.tensor([[3, 4, 5]]), _uniform_log_counts), ValueError, r"draw's ids must be 1-d \[S\]"),
])
def test_what_a_sampler_of_your_own_gives_is_checked(sampler, error, message):
    """A NaN log expected count gave a log normaliser of -inf, a loss of -inf and a draw that always took the item;
    +inf dropped the item's term; a count of shape [S, 1] gave a normaliser [B, S]; float ids were truncated (found by
    review): a TypeError or ValueError naming the sampler's method."""
    gen = torch.Generator().manual_seed(0)
    user, item, head = torch.randn(2, 4, generator=gen), torch.randn(100, 4, generator=gen), torch.tensor([[0, 1, 2],
                                                                                                         [7, 8, 9]])
    with pytest.raises(error, match=f"_OwnSampler.*{message}"):
        SampledCatalog(user, item, sampler=sampler, head_items=head)
    good = _OwnSampler(torch.tensor([3, 4, 5]), _uniform_log_counts)
    assert SampledCatalog(user, item, sampler=good, head_items=head).log_normalizer().shape == (2, 1)


class _OwnInBatch(capg_rec.NegativeSampler):
    """A sampler of your own that draws the batch's items, with ``counts(ids)`` as their log expected counts."""

    def __init__(self, counts):
        self.counts = counts

    @property
    def draws_batch(self):
        return True

    def draw(self, num_items, batch_items, *, generator, device):
        return batch_items.reshape(-1)

    def log_expected_count(self, ids, num_items, batch_items):
        return self.counts(ids)


def test_what_a_sampler_of_your_own_gives_is_named_on_every_path():
    """The per-row path (a sampler that draws the batch's items, the batch being the head) named the per-row shape
    [B, S] after log_expected_count, whose shape is [S]; a count of shape [S, 1] met torch's expand error there; a
    DrawnSample was named instead of the sampler inside it; NaN at a later copy of an id (-1: outside every sum) was
    refused (found by review)."""
    gen = torch.Generator().manual_seed(0)
    user, item, head = torch.randn(2, 4, generator=gen), torch.randn(100, 4, generator=gen), torch.tensor([[0, 1, 2],
                                                                                                         [7, 8, 9]])
    for counts, message in ((lambda ids: _uniform_log_counts(ids)[:-1], r"_OwnInBatch\.log_expected_count must give "
                             r"shape \[6\] \(one per id\), got \[5\]"),
                            (lambda ids: _uniform_log_counts(ids)[:, None], r"_OwnInBatch\.log_expected_count must "
                             r"give shape \[6\] \(one per id\), got \[6, 1\]"),
                            (_with_first(math.nan), r"_OwnInBatch\.log_expected_count_from_others must give finite")):
        with pytest.raises(ValueError, match=message):
            SampledCatalog(user, item, sampler=_OwnInBatch(counts), head_items=head)
    own = _OwnSampler(torch.tensor([3, 4, 5]), _with_first(math.nan))
    with pytest.raises(ValueError, match=r"_OwnSampler\.log_expected_count must give finite"):
        SampledCatalog(user, item, sampler=DrawnSample(own.ids, own), head_items=head)

    def nan_past_first_copies(ids):  # NaN at the -1 slots (later copies and unused): outside every sum
        return torch.where(ids >= 0, _uniform_log_counts(ids), math.nan)

    repeats = _OwnSampler(torch.tensor([3, 4, 5, 5, -1]), nan_past_first_copies)
    clean = _OwnSampler(torch.tensor([3, 4, 5, 5, -1]), _uniform_log_counts)
    torch.testing.assert_close(SampledCatalog(user, item, sampler=repeats, head_items=head).log_normalizer(),
                               SampledCatalog(user, item, sampler=clean, head_items=head).log_normalizer())
