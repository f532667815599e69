"""The plug-in inclusion probability: its definition, the earlier implementation's values, masks,
second derivatives, torch.compile and streamed catalogs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capg_rec import DenseCatalog, EmbeddingCatalog, expert_of_position, inclusion_log_prob
from capg_rec._head_tail import summarize
from capg_rec._numerics import log1mexp, masked_logsumexp, reverse_logcumsumexp, safe_logaddexp, safe_logsumexp
from capg_rec.catalog import CatalogScores
from capg_rec.marginals import PlugIn
from capg_rec.plackett_luce import expert_runs
from tests import references


def _earlier_plugin(catalog: CatalogScores, items: torch.Tensor, runs) -> torch.Tensor:
    """The implementation the plug-in had before it read only each expert's top-K (head/tail summary,
    one greedy ``topk`` per block over ``[B, L, T]``, denominators over ``[B, L, M, K]``)."""
    num_candidates = sum(n for _, n in runs)
    ht = summarize(catalog, items, min(num_candidates, catalog.num_items), 1)
    batch, num_experts, slots = ht.head_scores.shape
    num_targets = items.shape[1]
    slot = torch.arange(slots, device=catalog.device)
    available = (ht.head_ids >= 0).unsqueeze(1) & (slot.view(1, 1, -1) != ht.target_pos.unsqueeze(2))
    prefix = []
    left = num_candidates - 1
    with torch.no_grad():
        for expert, count in runs:
            take = min(count, left)
            if take == 0:
                break
            s = ht.head_scores[:, expert].unsqueeze(1).expand(-1, num_targets, -1)
            picked = s.masked_fill(~available, -torch.inf).topk(take, dim=2).indices
            available = available.scatter(2, picked, False)
            prefix.append(picked)
            left -= take
    scores = ht.head_scores.unsqueeze(1).expand(-1, num_targets, -1, -1)
    left_in_head = available | (slot.view(1, 1, -1) == ht.target_pos.unsqueeze(2))
    rest = safe_logaddexp(ht.tail_log_power_sums[..., 0].unsqueeze(1),
                          masked_logsumexp(scores, ~left_in_head.unsqueeze(2), dim=3))
    if prefix:
        pre = torch.cat(prefix, dim=2)
        pre_scores = scores.gather(3, pre.unsqueeze(2).expand(-1, -1, num_experts, -1))
        later = reverse_logcumsumexp(pre_scores, dim=3)
        later = torch.cat([later, later.new_full((*later.shape[:3], 1), -torch.inf)], dim=3)
    else:
        later = scores.new_full((batch, num_targets, num_experts, 1), -torch.inf)
    denom = safe_logaddexp(rest.unsqueeze(3), later)
    experts = expert_of_position(num_candidates, catalog.num_experts).to(catalog.device)
    idx = experts.view(1, 1, 1, -1).expand(batch, num_targets, 1, -1)
    target = ht.head_scores.gather(2, ht.target_pos.unsqueeze(1).expand(-1, num_experts, -1)).transpose(1, 2)
    log_hazard = (target.unsqueeze(3) - denom).gather(2, idx)[:, :, 0]
    log_hazard = log_hazard.clamp(max=-torch.finfo(log_hazard.dtype).tiny)
    log_miss = log1mexp(log_hazard)
    log_miss_before = torch.nn.functional.pad(torch.cumsum(log_miss, dim=2)[..., :-1], (1, 0))
    return safe_logsumexp(log_hazard + log_miss_before, dim=2)


def _logits(batch: int, m: int, n: int, seed: int, scale: float = 1.0, ties: bool = False) -> torch.Tensor:
    """``[B, M, N]``; with ``ties`` items come in pairs with the same scores under every expert (the
    greedy prefix is then defined whichever of a tied pair is taken first)."""
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(batch, m, n, generator=g, dtype=torch.float64)
    return x[..., torch.arange(n) // 2] if ties else x


def _plugin(logits, items, k):
    return inclusion_log_prob(logits, items, k, method="plugin", validate_args=False)


CASES = [(n, k, m) for n in (5, 9, 17) for m in (1, 2, 3) for k in sorted({1, 2, m + 1, n // 2, n - 1}) if k < n]


@pytest.mark.parametrize(("n", "k", "m"), CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_matches_the_definition(n, k, m, ties):
    logits = _logits(3, m, n, seed=100 * n + 10 * k + m, scale=1.5, ties=ties)
    got = _plugin(logits, torch.arange(n).expand(3, n), k).exp().numpy()
    ref = np.stack([references.plugin_inclusion(logits[b].numpy(), k) for b in range(3)])
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize(("n", "k", "m"), [(30, 6, 1), (30, 29, 1), (40, 12, 3), (60, 20, 5), (25, 24, 2)])
def test_values_and_gradients_match_the_earlier_implementation(n, k, m):
    logits = _logits(4, m, n, seed=n + k + m, scale=2.0).requires_grad_()
    g = torch.Generator().manual_seed(k)
    items = torch.randint(0, n, (4, 7), generator=g)
    items[:, 1] = items[:, 0]  # a repeated target
    catalog = DenseCatalog(logits, validate_args=False)
    runs = expert_runs(k, m)
    got = PlugIn().log_inclusion(catalog, items, runs)
    ref = _earlier_plugin(catalog, items, runs)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    weights = torch.rand(4, 7, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((got * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_float32_agrees_with_float64_and_is_shift_invariant(m):
    logits = _logits(5, m, 50, seed=m, scale=3.0)
    items = torch.randint(0, 50, (5, 6), generator=torch.Generator().manual_seed(m))
    ref = _plugin(logits, items, 12)
    torch.testing.assert_close(_plugin(logits.float(), items, 12).double(), ref, rtol=0, atol=1e-4)
    shifted = _plugin((logits + 1e4 * torch.arange(1, m + 1).view(1, -1, 1)).float(), items, 12)
    torch.testing.assert_close(shifted.double(), ref, rtol=0, atol=2e-3)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_masked_items_are_never_in_a_prefix_and_masked_targets_get_zero_gradient(m):
    n, k = 12, 4
    logits = _logits(3, m, n, seed=7 + m, scale=2.0)
    keep = torch.ones(3, n, dtype=torch.bool)
    keep[0, [0, 3, 5]] = False
    keep[1, 1::2] = False
    logits = logits.masked_fill(~keep.unsqueeze(1), -torch.inf).requires_grad_()
    items = torch.arange(n).expand(3, n)
    out = _plugin(logits, items, k)
    assert torch.equal(out[~keep], torch.full_like(out[~keep], -torch.inf))
    (grad,) = torch.autograd.grad(out.masked_fill(~keep, 0.0).sum() + out[~keep].clamp(min=-1.0).sum(), logits)
    assert torch.isfinite(grad).all() and (grad[~keep.unsqueeze(1).expand_as(grad)] == 0).all()
    for b in range(3):
        sub = logits.detach()[b, :, keep[b]].numpy()
        ref = references.plugin_inclusion(sub, k)
        np.testing.assert_allclose(out[b, keep[b]].exp().detach().numpy(), ref, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("m", [1, 3])
def test_gradcheck_and_gradgradcheck(m):
    logits = _logits(2, m, 7, seed=m, scale=1.5).requires_grad_()
    mask = torch.zeros(2, 1, 7, dtype=torch.bool)
    mask[0, :, 2] = True
    items = torch.tensor([[0, 3, 4, 4], [6, 1, 1, 3]])

    def f(x):
        return _plugin(x.masked_fill(mask, -torch.inf), items, 4)

    assert torch.autograd.gradcheck(f, (logits,))
    assert torch.autograd.gradgradcheck(f, (logits,))


@pytest.mark.parametrize("m", [1, 2])
def test_compiles_without_graph_breaks_and_handles_empty_batches(m):
    logits = _logits(3, m, 20, seed=m)
    items = torch.tensor([[0, 5], [19, 19], [3, 7]])
    runs = expert_runs(6, m)

    def f(x, a):
        return PlugIn().log_inclusion(DenseCatalog(x, validate_args=False), a, runs)

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(logits, items), f(logits, items))
    empty = f(logits[:0], items[:0])
    assert empty.shape == (0, 2)


@pytest.mark.parametrize("m", [1, 2])
def test_embedding_catalog_beyond_the_full_head(m):
    """N = 5000 streamed: agrees with the same scores as a dense tensor."""
    g = torch.Generator().manual_seed(m)
    user = torch.randn(3, m, 8, generator=g, dtype=torch.float64)
    item = torch.randn(5000, m, 8, generator=g, dtype=torch.float64)
    masked = torch.tensor([[4, -1], [7, 9], [-1, -1]])
    catalog = EmbeddingCatalog(user, item, masked_items=masked, chunk_size=1024)
    dense = torch.einsum("bmd,nmd->bmn", user, item)
    dense[0, :, 4] = dense[1, :, 7] = dense[1, :, 9] = -torch.inf
    items = torch.tensor([[4, 0, 1], [2, 2, 7], [4999, 10, 11]])
    got = _plugin(catalog, items, 10)
    torch.testing.assert_close(got, _plugin(dense, items, 10), rtol=1e-10, atol=1e-12)


def _one_block_inputs(dtype, seed, spread=3.0):
    """A logits leaf ``[B, N]`` and, from it, one expert's sorted top-K scores, the rest, targets in and out
    of the pool (one masked; a row whose last target is the only item left at the last position: h = 1),
    and their slots."""
    from capg_rec._plugin import _left_out
    g = torch.Generator().manual_seed(seed)
    batch, k, n = 6, 8, 30
    logits = spread * torch.randn(batch, n, generator=g, dtype=torch.float64)
    pool = logits.argsort(1, descending=True)[:, :k]
    items = torch.stack([pool[:, 0], pool[:, 3], pool[:, k - 1], logits.argsort(1)[:, 0]], 1)
    logits[1, items[1, 3]] = -torch.inf  # a masked target outside the pool
    in_pool = torch.zeros_like(logits, dtype=torch.bool).scatter(1, pool, True)
    logits[2] = logits[2].masked_fill(~in_pool[2], -torch.inf)  # nothing outside the pool
    logits = logits.to(dtype).requires_grad_()
    parts = (logits.gather(1, pool), masked_logsumexp(logits, in_pool, 1), logits.gather(1, items))
    return logits, parts, _left_out(pool, items)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_block_node_matches_the_log_space_ops(dtype):
    """The one-node float64 path of a single expert and the log-space ops it stands for give the same
    values and gradients (masked targets: -inf and zero gradient; a row with nothing outside the pool)."""
    from capg_rec._plugin import _OneBlockPlugIn, _plugin_one_block, _plugin_one_block_log_space
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-6, "atol": 2e-6}
    for seed in range(3):
        logits, (scores, rest, target), left_out = _one_block_inputs(dtype, seed)
        shift = torch.maximum(scores[:, :1], rest.unsqueeze(1)).detach()
        fast = _OneBlockPlugIn.apply(scores, rest, target, left_out, shift)[0]
        ref = _plugin_one_block_log_space(scores, rest, target, left_out)
        assert torch.equal(fast.isinf(), ref.isinf()) and fast[1, 3] == -torch.inf
        torch.testing.assert_close(fast, ref, **tol)
        torch.testing.assert_close(_plugin_one_block(scores, rest, target, left_out), fast, rtol=0, atol=0)
        weights = torch.rand(fast.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
        (got,) = torch.autograd.grad((fast.masked_fill(fast.isinf(), 0) * weights).sum(), logits, retain_graph=True)
        (want,) = torch.autograd.grad((ref.masked_fill(ref.isinf(), 0) * weights).sum(), logits)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **tol)


def test_one_block_node_second_derivatives_and_extreme_spreads():
    """The node's recorded backward (Hessian-vector products) is the log-space ops' one, and scores spread
    beyond float64's exp range take the log-space ops (finite, right values)."""
    from capg_rec._plugin import _OneBlockPlugIn, _plugin_one_block, _plugin_one_block_log_space
    _, parts, left_out = _one_block_inputs(torch.float64, 5)
    scores, rest, target = (t.detach().requires_grad_() for t in parts)
    target = target.detach()[3:, [0, 1]].requires_grad_()  # no masked target, no h = 1: a smooth function
    scores, rest, left_out = scores.detach()[3:].requires_grad_(), rest.detach()[3:].requires_grad_(), left_out[3:]
    shift = torch.maximum(scores[:, :1], rest.unsqueeze(1)).detach()
    inputs = (scores, rest, target)

    def fast(*x):
        return _OneBlockPlugIn.apply(*x, left_out[:, :2], shift)[0]

    def ref(*x):
        return _plugin_one_block_log_space(*x, left_out[:, :2])

    assert torch.autograd.gradgradcheck(fast, inputs)
    v = tuple(torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype) for x in inputs)
    _, hvp_fast = torch.autograd.functional.hvp(lambda *x: fast(*x).sum(), inputs, v)
    _, hvp_ref = torch.autograd.functional.hvp(lambda *x: ref(*x).sum(), inputs, v)
    for a, b in zip(hvp_fast, hvp_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    spread = torch.tensor([0.0, -500.0, -1000.0, -1500.0], dtype=torch.float64)
    wide = (scores.detach()[:, :4] * 0 + spread).requires_grad_()  # one row: 1500 nats from first to last
    outside = torch.full((3, 1), -1800.0, dtype=torch.float64)  # a target in the rest, 1800 nats down
    args = (wide, torch.full((3,), -1700.0, dtype=torch.float64), outside, torch.tensor([[3]] * 3))
    out = _plugin_one_block(*args)
    torch.testing.assert_close(out, _plugin_one_block_log_space(*args), rtol=1e-12, atol=0)
    assert torch.isfinite(out).all() and (out < -250).all()  # ~ -1800 + 1500: far below float64's exp range


@pytest.mark.parametrize("case", ["mixture", "one expert, wide spread", "one expert"])
def test_plugin_is_shift_invariant_in_float32(case):
    """Regression: the mixture path and the one-expert log-space path (scores spanning more than 600) took
    differences of raw scores, off by about one ulp of the scores after a constant shift of 1e4 (5e-4 in
    log π in float32). On logits that stay exact after the shift (multiples of 1/4), the shifted row now
    gives the unshifted one's value and gradient bit for bit, and both are within float32 of float64."""
    if case == "mixture":
        logits = torch.tensor([[[3.0, 1, 0.5, -1, 2, 0], [0, 2.5, 1, 0.25, -2, 1.5]]])
        items, k = torch.arange(6).view(1, -1), 3
    else:
        logits = torch.tensor([[0.0, -1, -2, -3, -700 if "wide" in case else -7, -0.5, -1.5, -4]])
        items, k = torch.tensor([[0, 1, 2, 3, 5, 6, 7]]), 4
    want = inclusion_log_prob(logits.double(), items, k, method="plugin")
    results = []
    for shift in (0.0, 1e4):
        x = (logits + shift).requires_grad_()
        out = inclusion_log_prob(x, items, k, method="plugin")
        results.append((out, torch.autograd.grad(out.sum(), x)[0]))
        torch.testing.assert_close(out.double(), want, rtol=0, atol=16 * torch.finfo(torch.float32).eps)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def _many_block_inputs(dtype, seed, num_items, k, m, spread=2.0):
    """The many-block node's inputs as the plug-in makes them, from a logits leaf ``[B, M, N]``: a masked item
    (also a target), repeated targets, targets in and out of the pool; with ``num_items`` at most ``m·k`` the
    pool may hold every item (nothing left outside it)."""
    from capg_rec._numerics import position_index
    from capg_rec._plugin import _greedy_prefixes
    g = torch.Generator().manual_seed(seed)
    logits = spread * torch.randn(4, m, num_items, generator=g, dtype=torch.float64)
    logits[1, :, 3] = -torch.inf
    logits = logits.to(dtype).requires_grad_()
    items = torch.randint(0, num_items, (4, 5), generator=g)
    items[:, 1] = items[:, 0]
    items[1, 2] = 3
    runs = expert_runs(k, m)
    experts = [e for e, _ in runs]
    catalog = DenseCatalog(logits, validate_args=False)
    pool = catalog.top_items(k, experts=experts).flatten(1)
    named, rest = catalog.gather_with_rest(pool, also=items)
    size = pool.shape[1]
    prefix, dropped = _greedy_prefixes(pool, items, runs, num_items)
    target = named[..., size:].index_select(1, position_index(runs, logits.device)).transpose(1, 2)
    block = position_index(runs, logits.device, True)
    return logits, (named[:, experts, :size], rest[:, experts], target, prefix, dropped, block)


@pytest.mark.parametrize(("num_items", "k", "m"), [(30, 6, 3), (10, 6, 2), (40, 12, 2)])
@pytest.mark.parametrize(("dtype", "work"), [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                             (torch.float32, torch.float64)])
def test_many_block_node_matches_the_log_space_ops(num_items, k, m, dtype, work):
    """The one-node path of a mixture (linear sums in float32 or float64) and the log-space ops it stands for
    give the same values and gradients: a masked target is -inf with zero gradient, as is a masked item."""
    from capg_rec._plugin import _ManyBlockPlugIn, _plugin_many_blocks_log_space
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-5}
    for seed in range(3):
        logits, args = _many_block_inputs(dtype, seed, num_items, k, m)
        scores, rest = args[:2]
        shift = torch.maximum(scores.amax(2), rest).detach()
        fast = _ManyBlockPlugIn.apply(*args, shift, work)[0]
        ref = _plugin_many_blocks_log_space(*args)
        assert fast.dtype == dtype and fast[1, 2] == -torch.inf
        torch.testing.assert_close(fast, ref, **tol)
        weights = torch.rand(fast.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
        (got,) = torch.autograd.grad((fast.masked_fill(fast.isinf(), 0) * weights).sum(), logits, retain_graph=True)
        (want,) = torch.autograd.grad((ref.masked_fill(ref.isinf(), 0) * weights).sum(), logits)
        assert torch.isfinite(got).all() and (got[1, :, 3] == 0).all()
        torch.testing.assert_close(got, want, **tol)


def test_many_block_node_second_derivatives_and_the_paths_by_spread():
    """The node's recorded backward is the log-space ops' one (gradgradcheck, Hessian-vector products); and
    float32 scores take float32 sums within 80 of their expert's best, float64 ones within 600 and the
    log-space ops beyond (each agreeing with float64's value)."""
    from capg_rec._plugin import _ManyBlockPlugIn, _plugin_many_blocks, _plugin_many_blocks_log_space
    _, (scores, rest, target, prefix, dropped, block) = _many_block_inputs(torch.float64, 0, 30, 6, 3)
    keep = ~target.isinf().any(2)  # a smooth function: no masked target
    inputs = (scores.detach().requires_grad_(), rest.detach().requires_grad_(), target.detach().requires_grad_())
    shift = torch.maximum(scores.amax(2), rest).detach()

    def fast(*x):
        return _ManyBlockPlugIn.apply(*x, prefix, dropped, block, shift, torch.float64)[0][keep]

    def ref(*x):
        return _plugin_many_blocks_log_space(*x, prefix, dropped, block)[keep]

    assert torch.autograd.gradgradcheck(fast, inputs)
    v = tuple(torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype) for x in inputs)
    for a, b in zip(torch.autograd.functional.hvp(lambda *x: fast(*x).sum(), inputs, v)[1],
                    torch.autograd.functional.hvp(lambda *x: ref(*x).sum(), inputs, v)[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    calls = []
    original = _ManyBlockPlugIn.apply

    def spy(*args):
        calls.append(args[-1])
        return original(*args)

    for spread, path in ((10.0, torch.float32), (100.0, torch.float64), (700.0, None)):
        # The pool's last entries pushed `spread` below the best: the prefixes stay, the sums' range grows.
        wide = scores.detach().clone()
        wide[..., -3:] -= spread
        args = (wide, rest.detach(), target.detach(), prefix, dropped, block)
        want = _plugin_many_blocks_log_space(*args)
        calls.clear()
        _ManyBlockPlugIn.apply = spy
        try:
            got = _plugin_many_blocks(*(x.float() if x.is_floating_point() else x for x in args))
        finally:
            _ManyBlockPlugIn.apply = original
        assert calls == ([] if path is None else [path])
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(("num_targets", "loss_scale"), [(1, 65536.0), (60000, 1.0)])
def test_many_block_float32_gradients_stay_finite_near_the_linear_paths_edge(num_targets, loss_scale):
    """Regression: with scores 79.5 nats apart (the float32 sums' path), the node's backward summed d/dw,
    which is about the gradient over a denominator as small as e^-80, in float32 before multiplying by w:
    a loss scale of 65536, or 60,000 targets, overflowed it to inf, and the gradient came out NaN and -inf.
    It now matches float64's."""
    m, k, n = 2, 4, 5
    scores = torch.zeros(1, m, n, dtype=torch.float64)
    scores[..., k - 1:] = -79.5
    items = torch.full((1, num_targets), n - 1)
    grads = []
    for dtype in (torch.float32, torch.float64):
        x = scores.to(dtype).requires_grad_()
        grads.append(torch.autograd.grad(_plugin(x, items, k).sum() * loss_scale, x)[0])
    assert torch.isfinite(grads[0]).all()
    torch.testing.assert_close(grads[0].double(), grads[1], rtol=0, atol=1e-5 * float(grads[1].abs().max()))
