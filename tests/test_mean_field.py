"""Mean-field inclusion probabilities (:mod:`capg_rec._mean_field`): shift invariance by
construction, float32 against float64, masks, extreme inputs, second derivatives, torch.compile and
torch.func, and accuracy against the exact method."""

import collections
import math
import unittest.mock
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import capg_rec._mean_field as mean_field
from capg_rec import CAPGLoss, DenseCatalog, EmbeddingCatalog, inclusion_log_prob, sample_candidates, testing
from capg_rec._mean_field import mean_field_log_inclusion
from capg_rec.plackett_luce import expert_runs
from tests import references


def _log_inclusion(scores, items, k, **kwargs):
    """Mean-field ``log π`` of ``items [B, L]`` under scores ``[B, M, N]`` (no input checks)."""
    return mean_field_log_inclusion(DenseCatalog(scores, validate_args=False), items, expert_runs(k, scores.shape[1]),
                                    **kwargs)


def _value_and_grad(scores, items, k, weights=None):
    """``log π [B, L]`` and the gradient of ``Σ weights · log π`` (finite entries) w.r.t. the scores."""
    scores = scores.detach().clone().requires_grad_()
    out = _log_inclusion(scores, items, k)
    weights = torch.ones_like(out) if weights is None else weights
    (grad,) = torch.autograd.grad((weights * out.masked_fill(~torch.isfinite(out), 0.0)).sum(), scores)
    return out.detach(), grad


def _scores(batch, experts, n, seed, scale=1.0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(batch, experts, n, generator=gen, dtype=dtype)


def _all_items(batch, n):
    return torch.arange(n).expand(batch, n)


# --- shift invariance ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shift", "grid"), [(1e4, 2.0 ** -8), (-1e4, 2.0 ** -8), (2.0 ** 100, 2.0 ** 77),
                                             (-(2.0 ** 100), 2.0 ** 77)])
@pytest.mark.parametrize(("k", "m"), [(1, 1), (10, 1), (10, 2), (12, 3)])
def test_shift_changes_nothing_bit_for_bit(shift, grid, k, m):
    """Scores on a grid that stays exact after the shift: only score differences are ever formed,
    so values and gradients are identical to the last bit (shifts 1e4 and ~1.3e30, float32)."""
    base = torch.round(_scores(3, m, 40, seed=k + m, scale=4.0, dtype=torch.float32) / 2.0 ** -8) * grid
    shifted = base + shift
    assert torch.equal(shifted - shift, base)  # the grid is exact at the shifted magnitude
    items = torch.tensor([[0, 5, 39], [7, 7, 1], [20, 2, 3]])
    out, grad = _value_and_grad(base, items, k)
    out_shifted, grad_shifted = _value_and_grad(shifted, items, k)
    assert torch.equal(out, out_shifted) and torch.equal(grad, grad_shifted)
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("shift", [1e3, 3e3, 1e4])
def test_probabilities_sum_to_k_after_a_float32_shift(shift):
    """Regression: at +1e4 the float32 probabilities summed to 19.8 instead of 10."""
    scores = _scores(4, 1, 1000, seed=0, dtype=torch.float32) + shift
    p = _log_inclusion(scores, _all_items(4, 1000), 10).exp()
    torch.testing.assert_close(p.sum(dim=1), torch.full((4,), 10.0), rtol=1e-4, atol=0.0)
    assert (p <= 1.0).all()


def test_equal_large_scores_split_evenly():
    """Regression: two items both at 1e4 (float32), K = 1, gave log π = -6056 instead of log 1/2."""
    out = _log_inclusion(torch.full((1, 1, 2), 1e4), torch.tensor([[0, 1]]), 1)
    torch.testing.assert_close(out, torch.full((1, 2), math.log(0.5)))


def test_extreme_finite_scores_behave_like_a_mask():
    """Regression: one score at 1e30 and the others at -1e30 (float32) gave P = 1 for a -1e30 item.
    Right answer: the top item is certain, the others have log π ≈ -2e30; gradients as for a
    softmax with one certain item (d log π(b)/ds_b = 1, d log π(b)/ds_top = -1)."""
    scores = torch.full((1, 1, 5), -1e30)
    scores[0, 0, 0] = 1e30
    out, grad = _value_and_grad(scores, torch.tensor([[0, 1, 2]]), 1)
    assert out[0, 0] == 0.0
    torch.testing.assert_close(out[0, 1:], torch.full((2,), -2e30), rtol=1e-6, atol=0.0)
    expected = torch.tensor([[[-2.0, 1.0, 1.0, 0.0, 0.0]]])
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-6)


# --- float32 against float64 ----------------------------------------------------------------------------


@pytest.mark.parametrize("tau", [1.0, 0.2, 1e-2, 1e-3])
@pytest.mark.parametrize("k", [1, 10, 50])
def test_float32_agrees_with_float64(tau, k):
    """Same (float32) scores, computed in float32 and float64: values and gradients agree, from
    typical temperatures down to τ = 1e-3 on 3·randn logits (score gaps in the hundreds, where
    float32 exponentials underflow). Regression: at τ = 1e-3 the float32 gradients were 95-99% off."""
    scores = (_scores(16, 1, 300, seed=k, scale=3.0, dtype=torch.float32) / tau).float()
    gen = torch.Generator().manual_seed(1)
    items = torch.randint(0, 300, (16, 3), generator=gen)
    items[:, 0] = scores[:, 0].argmax(dim=1)
    out32, grad32 = _value_and_grad(scores, items, k)
    out64, grad64 = _value_and_grad(scores.double(), items, k)
    torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-6)
    row_error = (grad32.double() - grad64).flatten(1).norm(dim=1) / grad64.flatten(1).norm(dim=1).clamp(min=1e-6)
    assert row_error.max() < 1e-3, row_error.max()


@pytest.mark.parametrize("tau", [1.0, 0.2])
def test_float32_agrees_with_float64_for_a_mixture(tau):
    scores = (_scores(16, 3, 300, seed=3, scale=3.0, dtype=torch.float32) / tau).float()
    items = torch.randint(0, 300, (16, 3), generator=torch.Generator().manual_seed(2))
    out32, grad32 = _value_and_grad(scores, items, 12)
    out64, grad64 = _value_and_grad(scores.double(), items, 12)
    torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-6)
    row_error = (grad32.double() - grad64).flatten(1).norm(dim=1) / grad64.flatten(1).norm(dim=1).clamp(min=1e-6)
    assert row_error.max() < 1e-4, row_error.max()


@pytest.mark.parametrize(("kind", "k", "m"), [("scale5", 10, 1), ("scale5", 40, 1), ("scale5", 12, 3),
                                              ("peak", 10, 1), ("peak", 12, 2)])
def test_confident_rows_take_the_linear_space_solve(kind, k, m, monkeypatch):
    """Confident policies (5·randn logits, or one item per expert 12 nats ahead) have rates far
    above 12 at the root, where ``1 + expm1(-x)`` keeps no digits of ``x e^{-x}``: the linear-space
    solve still takes them (the log-space solve never runs), with ``x e^{-x}`` from one exact pass;
    float32 values and gradients agree with plain float64 autograd through 60 Newton steps."""
    scores = _scores(8, m, 300, seed=k + m, scale=5.0 if kind == "scale5" else 1.0, dtype=torch.float32)
    if kind == "peak":
        scores[:, :, 7] += 12.0
    gen = torch.Generator().manual_seed(5)
    items = torch.randint(0, 300, (8, 3), generator=gen)
    items[:, 0] = scores[:, 0].argmax(dim=1)
    def refuse(*args, **kwargs):
        raise AssertionError("the log-space solve ran")
    monkeypatch.setattr(mean_field._RobustSolve, "__init__", refuse)
    for dtype, rtol in ((torch.float32, 1e-5), (torch.float64, 1e-11)):
        out, grad = _value_and_grad(scores.to(dtype), items, k)
        leaf = scores.double().requires_grad_()
        ref = _unrolled_log_inclusion(leaf, items, k)
        (ref_grad,) = torch.autograd.grad(ref.sum(), leaf)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=rtol, atol=rtol)
        error = (grad.double() - ref_grad).abs().flatten(1).amax(1) / ref_grad.abs().flatten(1).amax(1)
        assert error.max() < 10 * rtol, error.max()


@pytest.mark.parametrize("kind", ["masked", "shifted"])
@pytest.mark.parametrize(("k", "m"), [(10, 1), (12, 3)])
def test_confident_rows_match_the_log_space_solve_in_float64(kind, k, m, monkeypatch):
    """Rows with rates beyond the cap end with a second-order step (Newton's error grows with the
    rates): float64 values and gradients within 1e-14 of the log-space solve run alone at tol 1e-14
    (a last Newton step left 7e-14 on values, 1.3e-13 on gradients)."""
    scores = _scores(16, m, 400, seed=k, scale=5.0)
    scores = scores.masked_fill(scores < -5.0, -math.inf) if kind == "masked" else scores + 1e4
    items = torch.randint(0, 400, (16, 3), generator=torch.Generator().manual_seed(1))
    items[:, 0] = scores[:, 0].argmax(dim=1)
    out, grad = _value_and_grad(scores, items, k)
    monkeypatch.setattr(mean_field, "_FAST_ITER", 0)  # the log-space solve only
    leaf = scores.clone().requires_grad_()
    ref = _log_inclusion(leaf, items, k, tol=1e-14)
    (ref_grad,) = torch.autograd.grad(ref.masked_fill(~torch.isfinite(ref), 0.0).sum(), leaf)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-14, atol=1e-14)
    error = (grad - ref_grad).abs().flatten(1).amax(1) / ref_grad.abs().flatten(1).amax(1)
    assert error.max() < 1e-14, error.max()


def test_extreme_mixture_stays_finite():
    """A mixture at τ = 1e-3: derivatives through the survival of earlier blocks can exceed the
    float32 range (1e200 in float64); values stay right and nothing is NaN or infinite."""
    scores = (_scores(8, 5, 300, seed=4, scale=3.0, dtype=torch.float32) / 1e-3).float()
    items = torch.randint(0, 300, (8, 3), generator=torch.Generator().manual_seed(3))
    out32, grad32 = _value_and_grad(scores, items, 20)
    out64, _ = _value_and_grad(scores.double(), items, 20)
    torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(grad32).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_survival_overflowing_to_minus_inf_gives_no_nan(dtype):
    """Regression: with score gaps near 1e5 (5e4·randn, five experts, K = 40), an item's log-survival
    summed over blocks overflowed to -inf; the backward then formed -inf - -inf (or 0 × -inf) for the
    derivative through the survival, and whole rows of gradients were NaN (4 of 16 in float64)."""
    scores = _scores(16, 5, 100, seed=13, scale=5e4, dtype=dtype)
    items = torch.stack([scores[:, 0].argmax(dim=1), scores[:, 2].argsort(dim=1, descending=True)[:, 30],
                         torch.full((16,), 5)], dim=1)
    out, grad = _value_and_grad(scores, items, 40)
    assert not torch.isnan(out).any() and torch.isfinite(grad).all()


# --- definition, masks, edge cases -----------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k", "m", "scale"), [(7, 3, 1, 1.0), (7, 3, 2, 2.0), (6, 3, 3, 0.5), (30, 10, 5, 1.0),
                                                    (40, 7, 3, 3.0), (40, 20, 1, 8.0)])
def test_matches_reference_definition(n, k, m, scale):
    scores = _scores(2, m, n, seed=n + k + m, scale=scale)
    got = _log_inclusion(scores, _all_items(2, n), k).exp().numpy()
    ref = np.stack([references.mean_field_inclusion(scores[b].numpy(), k) for b in range(2)])
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-13)


def test_masked_items_are_removed_items():
    """-inf scores (different items per row) give the same probabilities as the catalog without
    them; masked targets get -inf with zero gradient, and no gradient anywhere is NaN."""
    scores = _scores(2, 1, 12, seed=5, scale=2.0)
    keep = [[0, 1, 2, 4, 5, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 8, 10, 11]]
    masked = torch.full_like(scores, -math.inf)
    for row, ids in enumerate(keep):
        masked[row, 0, ids] = scores[row, 0, ids]
    out, grad = _value_and_grad(masked, _all_items(2, 12), 4)
    assert torch.isfinite(grad).all()
    for row, ids in enumerate(keep):
        reduced = _log_inclusion(scores[row:row + 1, :, ids], _all_items(1, len(ids)), 4)
        torch.testing.assert_close(out[row, ids], reduced[0], rtol=1e-12, atol=1e-14)
        dropped = [i for i in range(12) if i not in ids]
        assert (out[row, dropped] == -math.inf).all() and (grad[row, 0, dropped] == 0).all()


def test_partly_masked_experts_match_the_definition():
    """An item masked for one expert only can still be drawn by the others (against the reference
    definition); an expert left with as many items as its block draws takes them for sure. Finite
    gradients throughout."""
    scores = _scores(2, 3, 10, seed=6, scale=1.5)
    scores[0, 0, [1, 4, 5]] = -math.inf
    scores[0, 2, [1, 7]] = -math.inf
    scores[1, 1, :8] = -math.inf  # expert 1 keeps items 8 and 9, and its block draws 2
    out, grad = _value_and_grad(scores, _all_items(2, 10), 6)
    ref = references.mean_field_inclusion(scores[0].numpy(), 6)
    np.testing.assert_allclose(out[0].exp().numpy(), ref, rtol=1e-7, atol=1e-12)
    assert (out[1, 8:] == 0.0).all() and torch.isfinite(out[1]).all()
    assert torch.isfinite(grad).all()


def test_target_masked_under_every_expert():
    scores = _scores(1, 2, 8, seed=7)
    scores[0, :, 3] = -math.inf
    out, grad = _value_and_grad(scores, torch.tensor([[3, 0, 3]]), 4)
    assert out[0, 0] == -math.inf and out[0, 2] == -math.inf and torch.isfinite(out[0, 1])
    assert torch.isfinite(grad).all() and (grad[0, :, 3] == 0).all()


def test_bad_settings_raise():
    scores = _scores(1, 1, 5, seed=18)
    items = torch.tensor([[0]])
    with pytest.raises(ValueError, match="max_iter"):
        _log_inclusion(scores, items, 2, max_iter=0)
    with pytest.raises(TypeError, match="max_iter"):
        _log_inclusion(scores, items, 2, max_iter=2.0)
    with pytest.raises(ValueError, match="tol"):
        _log_inclusion(scores, items, 2, tol=0.0)
    with pytest.raises(TypeError, match="tol"):
        _log_inclusion(scores, items, 2, tol="small")


def test_empty_batch():
    scores = torch.zeros(0, 2, 9, requires_grad=True)
    out = mean_field_log_inclusion(DenseCatalog(scores, validate_args=False), torch.zeros(0, 3, dtype=torch.long),
                                   expert_runs(4, 2))
    assert out.shape == (0, 3)
    out.sum().backward()
    assert scores.grad.shape == (0, 2, 9)


def test_repeated_targets_and_all_items():
    scores = _scores(2, 2, 9, seed=8)
    out = _log_inclusion(scores, torch.tensor([[4, 4, 0], [8, 1, 8]]), 5)
    full = _log_inclusion(scores, _all_items(2, 9), 5)
    torch.testing.assert_close(out, torch.stack([full[0, [4, 4, 0]], full[1, [8, 1, 8]]]))
    torch.testing.assert_close(full.exp().sum(dim=1), torch.full((2,), 5.0, dtype=torch.float64))


def test_embedding_catalog_matches_dense():
    """A catalog of at most 2048 items is used whole, whatever its placement."""
    gen = torch.Generator().manual_seed(9)
    user = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    item = torch.randn(300, 2, 4, generator=gen, dtype=torch.float64)
    items = torch.tensor([[0, 1], [299, 3], [7, 7]])
    runs = expert_runs(20, 2)
    dense = mean_field_log_inclusion(DenseCatalog(torch.einsum("bmd,nmd->bmn", user, item) / 0.5), items, runs)
    embedded = mean_field_log_inclusion(EmbeddingCatalog(user, item, temperature=0.5, chunk_size=64), items, runs)
    torch.testing.assert_close(embedded, dense)


@pytest.mark.parametrize(("k", "m", "n", "spread", "rtol"),
                         [(10, 1, 20_000, 0.6, 1e-6), (100, 1, 20_000, 0.6, 1e-6), (300, 1, 3000, 0.3, 1e-6),
                          (30, 3, 20_000, 0.6, 1e-4), (200, 3, 20_000, 0.6, 1e-4), (60, 2, 20_000, 0.6, 1e-4)])
def test_large_catalog_summary_matches_whole(k, m, n, spread, rtol, monkeypatch):
    """Above 2048 items the tail enters through power sums; it agrees with the whole catalog. For a mixture
    the tail's survival through the earlier blocks is its mean (measured 3e-5 at most; 1.7e-3 when the tail
    was taken as never drawn by earlier blocks). A flat catalog with a large K (N = 3000, K = 300, spread 0.3:
    2.8e-7) is where a head of 4n rather than 8n items shows (7.8e-6, found by a review's mutation)."""
    gen = torch.Generator().manual_seed(10)
    user = torch.randn(3, m, 8, generator=gen, dtype=torch.float64)
    item = torch.randn(n, m, 8, generator=gen, dtype=torch.float64) * spread
    catalog = EmbeddingCatalog(user, item, chunk_size=4096)
    items = torch.cat([catalog.top_items(3)[:, 0], torch.tensor([[5, 17], [1000, n - 1], [7, 8]])], 1)
    runs = expert_runs(k, m)
    summarised = mean_field_log_inclusion(catalog, items, runs)
    monkeypatch.setattr(mean_field, "_head_size", lambda n, runs: n)
    whole = mean_field_log_inclusion(catalog, items, runs)
    torch.testing.assert_close(summarised.exp(), whole.exp(), rtol=rtol, atol=0.0)


def test_a_head_that_holds_a_later_block_s_items_is_solved_to_its_root(monkeypatch):
    """A mixture above 2048 items whose head (8n + K - n items, near-equal) holds all the mass (the tail 30 nats
    below): the last block's n items come from the head items the earlier blocks left, and its root sits at the
    solve's lower bound for κ. A review's mutant that took that bound from the whole head rather than the part left
    (a bound 0.24 too high) passed every other test; here it is 11% off, against 0 for the whole catalog."""
    k, m, n = 200, 3, 2100
    runs = expert_runs(k, m)
    head = 8 * 67 + k - 67
    user = torch.ones(2, m, 2, dtype=torch.float64)
    item = torch.zeros(n, m, 2, dtype=torch.float64)
    item[head:, :, 0] = -30.0
    item[:head, :, 1] = torch.linspace(0, 1e-3, head, dtype=torch.float64).view(-1, 1)  # no exact ties
    items = torch.tensor([[0, 5, head - 1, head, n - 1]] * 2)
    catalog = EmbeddingCatalog(user, item)
    summarised = mean_field_log_inclusion(catalog, items, runs)
    monkeypatch.setattr(mean_field, "_head_size", lambda n, runs: n)
    torch.testing.assert_close(summarised.exp(), mean_field_log_inclusion(catalog, items, runs).exp(), rtol=1e-6,
                               atol=0.0)


def test_accuracy_against_exact():
    """The documented accuracy (README): within 1e-3 (τ = 1) to 3e-2 (τ = 0.2) of the exact method,
    mean relative error over all items of an N = 1000 standard-normal catalog."""
    logits = _scores(1, 1, 1000, seed=11)[:, 0]
    items = _all_items(1, 1000)
    for tau, bound in ((1.0, 1e-3), (0.2, 3e-2)):
        for k in (10, 50):
            exact = inclusion_log_prob(logits, items, k, temperature=tau, method="exact").exp()
            approx = _log_inclusion((logits / tau).unsqueeze(1), items, k).exp()
            error = ((approx - exact).abs() / exact).mean().item()
            assert error < bound, (tau, k, error)


# --- derivatives -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k", "m"), [(6, 3, 1), (7, 4, 2), (8, 5, 3)])
def test_gradcheck_and_gradgradcheck(n, k, m):
    scores = _scores(2, m, n, seed=n).requires_grad_()
    items = torch.tensor([[0, 3], [5, 5]])
    def fn(x):
        return _log_inclusion(x, items, k)
    assert torch.autograd.gradcheck(fn, (scores,))
    assert torch.autograd.gradgradcheck(fn, (scores,))


@pytest.mark.parametrize(("row", "k"), [([300.0, 0.0, 0.0, -math.inf], 2), ([1000.0, 0, 0, 0, 0, 0], 4),
                                        ([300.0, 0.0, 0.0, -20.0], 2)])
def test_rows_whose_live_items_all_saturate_have_the_right_gradient(row, k):
    """Regression: where every live item of a row is saturated (``x > ω``: score gaps in the hundreds,
    K near the number of live items) the log-space solve took the empty rest group's scale from the
    mask, a logaddexp absorbed the saturated items' mean rate, and the gradient came out multiplied
    by it (0.226 for 0.173 in the first row, float32 and float64 alike). The values were right."""
    scores = torch.tensor([[row]], dtype=torch.float64).expand(2, 1, -1).clone()
    scores[1] -= 7.0  # and a shifted copy: the same answers
    live = [i for i, v in enumerate(row) if math.isfinite(v)]
    items = torch.tensor(live).expand(2, -1)
    assert torch.autograd.gradcheck(lambda x: _log_inclusion(x, items, k), (scores.requires_grad_(),))
    _, grad = _value_and_grad(scores, items, k)
    torch.testing.assert_close(grad[0], grad[1], rtol=0.0, atol=1e-12)
    torch.testing.assert_close(grad.sum(dim=2), torch.zeros(2, 1, dtype=torch.float64), rtol=0.0, atol=1e-12)


@settings(max_examples=40)
@given(data=st.data())
def test_log_space_solve_passes_gradcheck(data):
    """The log-space solve on every row (the fast one switched off), on tiny float64 catalogs (one expert
    or two) with masks and ties: its derivatives are those of its values (finite differences).

    Logits lie in [-5, 5], so rates stay below ``x ≲ 10`` and third derivatives below ``x² ≈ 100``:
    central differences with step 1e-5 err by ``h²/6 · 100 ≈ 2e-9``, and κ, solved to ``tol = 1e-13``
    (or 4 of its ulps, 1e-14 here), adds ``1e-13 / h = 1e-8``; ``atol = 1e-6`` is 100 times that. (Gaps
    of thousands make derivatives of order ``x^n`` with ``x ~ e^{gap}``, beyond any finite difference:
    the saturated rows above are checked one by one.)"""
    scores = data.draw(testing.logits(max_batch=2, max_experts=2, min_items=2, max_items=6, masked=True,
                                      extreme=False, dtype=torch.float64))
    scores = scores if scores.dim() == 3 else scores.unsqueeze(1)
    k = data.draw(st.integers(1, scores.shape[2] - 1))
    items = torch.arange(scores.shape[2]).expand(scores.shape[0], -1)

    def fn(x):
        out = _log_inclusion(x, items, k, tol=1e-13)
        return out.masked_fill(~torch.isfinite(out), 0.0)

    with unittest.mock.patch.object(mean_field, "_FAST_ITER", 0):
        assert torch.autograd.gradcheck(fn, (scores.requires_grad_(),), eps=1e-5, atol=1e-6)


def test_gradcheck_through_the_tail():
    gen = torch.Generator().manual_seed(12)
    user = torch.randn(2, 1, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    item = torch.randn(3000, 1, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    items = torch.tensor([[0, 3], [5, 2999]])
    def fn(u, v):
        return mean_field_log_inclusion(EmbeddingCatalog(u, v), items, expert_runs(2, 1))
    assert torch.autograd.gradcheck(fn, (user, item), atol=1e-6, fast_mode=True)


def test_gradcheck_through_a_mixture_s_tail():
    """The tail's survival through earlier blocks (M > 1 above 2048 items) is part of the graph: first and second
    derivatives against finite differences, with a mask and a temperature."""
    gen = torch.Generator().manual_seed(13)
    user = torch.randn(2, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    item = torch.randn(2100, 2, 3, generator=gen, dtype=torch.float64)
    items, masked = torch.tensor([[0, 3], [5, 2099]]), torch.tensor([[7, -1], [8, 9]])

    def fn(u):
        catalog = EmbeddingCatalog(u, item, temperature=0.7, masked_items=masked)
        return mean_field_log_inclusion(catalog, items, expert_runs(12, 2))

    assert torch.autograd.gradcheck(fn, (user,), atol=1e-6)
    assert torch.autograd.gradgradcheck(fn, (user,), atol=1e-5)


@pytest.mark.parametrize(("k", "m", "rtol"), [(30, 1, 1e-4), (24, 2, 3e-3)])
def test_second_derivatives_through_the_tail_match_the_whole_catalog(k, m, rtol, monkeypatch):
    """Hessian-vector products of the summarised catalog (head + tail power sums) against those of the same catalog
    read whole, on a flat catalog, whose tail holds most of the mass and rates near the series' 1/8 limit. A
    review's mutant that dropped the powers from the tail's slope in the recorded backward's derivatives of κ
    passed every other test (relative errors of 3e-2 and 1.5e-2 here; for a mixture the tail's survival is its mean,
    1e-3 off)."""
    gen = torch.Generator().manual_seed(21)
    user = torch.randn(2, m, 8, generator=gen, dtype=torch.float64)
    item = torch.randn(3000, m, 8, generator=gen, dtype=torch.float64) * 0.3
    items = torch.tensor([[0, 5, 2999], [17, 1000, 3]])
    weights = torch.tensor([[1.0, -0.5, 2.0], [0.3, 0.7, -1.0]], dtype=torch.float64)
    direction = torch.randn(user.shape, generator=gen, dtype=torch.float64)

    def hvp():
        def fn(u):
            return (weights * mean_field_log_inclusion(EmbeddingCatalog(u, item), items, expert_runs(k, m))).sum()
        return torch.autograd.functional.hvp(fn, user, direction)[1]

    summarised = hvp()
    monkeypatch.setattr(mean_field, "_head_size", lambda n, runs: n)
    torch.testing.assert_close(summarised, hvp(), rtol=rtol, atol=1e-8)


def _unrolled_log_inclusion(scores, items, k, steps=60):
    """Reference in plain autograd: each block's root by Newton steps from the sampling-with-
    replacement solution, differentiated through every step (float64, tiny N)."""
    log_rho = torch.zeros_like(scores[:, 0])
    hazards = []
    for expert, count in expert_runs(k, scores.shape[1]):
        s = scores[:, expert]
        rho = torch.exp(log_rho)
        kappa = torch.logsumexp(s + log_rho, dim=1) - math.log(count)
        for _ in range(steps):
            x = torch.exp(s - kappa.unsqueeze(1))
            hit = (rho * -torch.expm1(-x)).sum(dim=1)
            slope = (rho * x * torch.exp(-x)).sum(dim=1)
            kappa = kappa - torch.log1p((count - hit) / slope)
        hazards.append(s.gather(1, items) - kappa.unsqueeze(1))
        log_rho = log_rho - torch.exp(s - kappa.unsqueeze(1))
    return torch.log(-torch.expm1(-torch.exp(torch.logsumexp(torch.stack(hazards), dim=0))))


@pytest.mark.parametrize(("k", "m"), [(3, 1), (4, 2), (6, 3)])
def test_hessian_vector_product_matches_unrolled_autograd(k, m):
    scores = _scores(2, m, 7, seed=13 + m)
    items = torch.tensor([[0, 2, 6], [1, 1, 5]])
    weights = torch.tensor([[1.0, -0.5, 2.0], [0.3, 0.7, -1.0]], dtype=torch.float64)
    direction = _scores(2, m, 7, seed=14)
    ours = torch.autograd.functional.hvp(lambda x: (weights * _log_inclusion(x, items, k)).sum(), scores, direction)
    ref = torch.autograd.functional.hvp(lambda x: (weights * _unrolled_log_inclusion(x, items, k)).sum(),
                                        scores, direction)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-7, atol=1e-9)


def test_torch_func_grad_and_vmap():
    scores = _scores(3, 2, 9, seed=15)
    items = torch.tensor([[0, 3], [5, 5], [1, 2]])
    def fn(x):
        return _log_inclusion(x, items, 4)
    leaf = scores.clone().requires_grad_()
    (expected,) = torch.autograd.grad(fn(leaf).sum(), leaf)
    torch.testing.assert_close(torch.func.grad(lambda x: fn(x).sum())(scores), expected, rtol=1e-7, atol=1e-10)
    batch = _scores(4, 3, 2 * 9, seed=16).reshape(4, 3, 2, 9)
    torch.testing.assert_close(torch.func.vmap(fn)(batch), torch.stack([fn(x) for x in batch]))


@pytest.mark.parametrize(("k", "m", "scale", "max_iter"), [(3, 1, 1.0, 6), (4, 2, 1.0, 6), (3, 1, 300.0, 24)])
def test_compiles_without_graph_breaks(k, m, scale, max_iter):
    """No host syncs: fullgraph compilation traces; its solve (the fast one's fixed steps, then the log-space one
    for every row, in a while_loop that stops when all rows are done or at max_iter steps in all) agrees with
    eager's."""
    scores = _scores(3, m, 12, seed=17, scale=scale, dtype=torch.float32).requires_grad_()
    items = torch.tensor([[0, 3], [5, 5], [1, 2]])
    runs = expert_runs(k, m)
    def fn(x):
        return mean_field_log_inclusion(DenseCatalog(x, validate_args=False), items, runs)
    compiled = torch.compile(lambda x: mean_field_log_inclusion(DenseCatalog(x, validate_args=False), items, runs,
                                                                max_iter=max_iter), fullgraph=True, backend="eager")
    out = compiled(scores)
    (grad,) = torch.autograd.grad(out.sum(), scores)
    (expected_grad,) = torch.autograd.grad(fn(scores).sum(), scores)
    torch.testing.assert_close(out, fn(scores), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5)


def test_compiled_solve_stops_when_every_row_is_done():
    """Regression: a compiled graph unrolled the solve's Python loop into all max_iter = 50 steps (18.9 ms a call
    against 0.93 ms eager at B = 128, N = 1000, K = 10). Each of its two stages is now a while_loop whose body is one
    step: a cap of 50 steps or of 500 compiles to the same graph, and on moderate scores each loop's body runs the
    few times the rows need (counted by wrapping the bodies in the graph), not up to its cap (12 and 38 steps)."""
    scores = _scores(4, 1, 30, seed=3, dtype=torch.float32)
    items = torch.tensor([[0], [1], [2], [3]])
    graphs, steps = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        for node in gm.graph.nodes:
            if node.target is torch.ops.higher_order.while_loop:
                body = getattr(gm, node.args[1].target)
                body.forward = lambda *a, _run=body.forward, _loop=node.name: steps.append(_loop) or _run(*a)
        return gm.forward

    counts = []
    for max_iter in (50, 500):
        torch._dynamo.reset()
        steps.clear()
        compiled = torch.compile(lambda x, n=max_iter: mean_field_log_inclusion(
            DenseCatalog(x, validate_args=False), items, expert_runs(5, 1), max_iter=n), fullgraph=True,
            backend=backend)
        torch.testing.assert_close(compiled(scores), _log_inclusion(scores, items, 5), rtol=1e-5, atol=1e-6)
        counts.append(sorted(collections.Counter(steps).values()))
    assert counts[0] == counts[1] and len(counts[0]) == 2 and max(counts[0]) <= 3, counts
    sizes = []
    for gm in graphs:
        loops = [node for node in gm.graph.nodes if node.target is torch.ops.higher_order.while_loop]
        assert len(loops) == 2  # the fast solve's steps, then the log-space solve's
        sizes.append(sum(1 for _ in gm.graph.nodes))
    assert sizes[0] == sizes[1] < 1000  # 50 steps unrolled: several thousand nodes


@pytest.mark.parametrize("m", [1, 2])
def test_compiled_loss_through_aot_autograd_matches_eager(m):
    """The default loss, compiled through AOT autograd (what inductor runs on: functionalised, forward and backward
    graphs), gives eager's value and gradient. Regression: the solve's while_loop took one tensor as two of its
    inputs, which AOT autograd refuses ('cond_fn might be aliasing the input or the output'); the eager backend of
    the test above traced it."""
    logits = _scores(8, m, 50, seed=5, dtype=torch.float32).squeeze(1).requires_grad_()
    candidates = sample_candidates(logits.detach(), 6, generator=torch.Generator().manual_seed(0))
    chosen, rewards = candidates[:, :2], torch.rand(8, 2, generator=torch.Generator().manual_seed(1))
    loss = CAPGLoss(6, validate_args=False)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=False)
    (grad,) = torch.autograd.grad(compiled(logits, candidates, chosen, rewards), logits)
    (expected,) = torch.autograd.grad(loss(logits, candidates, chosen, rewards), logits)
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


def test_compiled_gradients_of_a_confident_mixture_match_eager():
    """Compiled mean-field takes the fast solve's steps first, as eager does, before the log-space solve. Regression
    (found by review): a compiled solve that sent every row through the log-space solve from the fast one's start
    found another root in an expert block whose best item had survived the earlier blocks with ρ = 1 - 3.5e-19, and
    the gradient was off by 0.6 (of 3.3); the values still agreed."""
    g = torch.Generator().manual_seed(3)
    logits = 300.0 * torch.randn(8, 4, 300, generator=g, dtype=torch.float64)
    items = torch.randint(0, 300, (8, 5), generator=g)
    weights = torch.randn(8, 5, generator=g, dtype=torch.float64)

    def loss(x):
        v = inclusion_log_prob(x, items, 4, method="mean_field", validate_args=False)
        return (torch.where(torch.isfinite(v), v, torch.zeros_like(v)) * weights).sum()

    leaf = logits.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(leaf), leaf)
    (got,) = torch.autograd.grad(torch.compile(loss, fullgraph=True, dynamic=False, backend="aot_eager")(leaf), leaf)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("scale", [3.0, 20.0])
def test_inductor_compiled_mean_field_of_confident_rows_matches_float64(scale):
    """Compiled by inductor (the default backend), float32 mean-field's log-probabilities and gradients are float64
    eager's to float32 accuracy, at logit spreads of ~20 and ~100. Regression: torch 2.13's inductor takes expm1 as
    exp(x) - 1 on the CPU, whose 0 for tiny rates sent the log-space solve's sum Q to ~1e-27 and κ to a wrong root
    (0.30 in probability here, 1.0 at B = 64, N = 1000, K = 200, M = 5); with torch.expm1 in the log-hit's forward
    or backward (a mutation round), log-probabilities near -9 were 2.5e-4 off and gradients 6.5e-3."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1, 100, generator=g) * scale
    items = torch.randint(0, 100, (16, 4), generator=g)
    leaf = logits.double().requires_grad_()
    want = inclusion_log_prob(leaf, items, 10, method="mean_field")
    (want_grad,) = torch.autograd.grad(want.exp().sum(), leaf)
    compiled = torch.compile(lambda x: inclusion_log_prob(x, items, 10, method="mean_field", validate_args=False),
                             fullgraph=True, dynamic=False)
    leaf32 = logits.clone().requires_grad_()
    got = compiled(leaf32)
    (grad,) = torch.autograd.grad(got.exp().sum(), leaf32)
    assert (want > -13.0).any() and (want < -5.0).any()  # items far enough down for the log-hit's small rates
    close = want > -30.0  # beyond that, float32's rounding of the scores themselves dominates
    torch.testing.assert_close(got.double()[close], want.detach()[close], rtol=0.0, atol=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, rtol=0.0, atol=1e-5)


@pytest.mark.parametrize(("k", "m", "n"), [(10, 1, 300), (20, 2, 300), (10, 1, 3000)])
def test_rows_the_fast_solve_leaves_are_solved_alone(monkeypatch, k, m, n):
    """A float32 batch mixing typical rows with confident ones (scores ×30, some of which the fast solve
    leaves unconverged): only those rows go to the log-space solve, and every row's value and gradient
    match that row computed alone, to the solver's tolerance ``eps^(2/3)`` (dense mixtures through the
    survival factors, and through a 3000-item embedding catalog, the tail's power sums). Regression: through
    the tail a row's gradient alone and in its batch differed by 1e-4 relative in float32 (1e-7 in float64):
    the last Newton step moved the head's terms of ∂f/∂κ without their factor 1 + r and the tail's with it."""
    calls = []
    robust = mean_field._robust_solve
    monkeypatch.setattr(mean_field, "_robust_solve", lambda s, *a: calls.append(s.shape[0]) or robust(s, *a))
    gen = torch.Generator().manual_seed(11)
    batch = 16
    scale = torch.tensor([1.0, 30.0] * (batch // 2)).view(batch, 1, 1)
    user = torch.randn(batch, m, 8, generator=gen) * scale
    item = torch.randn(n, m, 8, generator=gen)

    def value_and_grad(rows):
        u = user[rows].clone().requires_grad_()
        catalog = DenseCatalog(torch.einsum("bmd,nmd->bmn", u, item)) if n <= 300 else EmbeddingCatalog(u, item)
        items = catalog.top_items(3, experts=[0])[:, 0]  # likely items, some saturated
        out = mean_field_log_inclusion(catalog, items, expert_runs(k, m))
        (grad,) = torch.autograd.grad(out.sum(), u)
        return out.detach(), grad

    out, grad = value_and_grad(slice(None))
    assert any(0 < size < batch for size in calls)  # a mixed batch: the subset path ran
    tol = torch.finfo(torch.float32).eps ** (2.0 / 3.0)
    for b in range(batch):
        alone, alone_grad = value_and_grad(slice(b, b + 1))
        torch.testing.assert_close(out[b:b + 1], alone, rtol=tol, atol=tol)
        torch.testing.assert_close(grad[b:b + 1], alone_grad, rtol=tol, atol=tol * float(alone_grad.abs().max()))
    assert bool(torch.isfinite(grad).all())


def test_an_earlier_block_s_tiny_take_of_a_saturated_item_is_kept_when_compiled():
    """The case below compiled by inductor, whose expm1 (e^x - 1) loses 1 - ρ where ρ rounds to 1: the log-space
    solve's n - Σ_sat ρ must take it from capg_rec's expm1 (a mutation round: with torch.expm1 there the compiled
    log-probability was -488 and its gradient 6e109)."""
    logits = torch.tensor([[[-251., 0., -74., 582., 494., 133., 23.], [-66., -731., -111., 577., 182., 32., 73.],
                            [797., 296., 809., 58., -483., -32., -6.]]], dtype=torch.float64, requires_grad=True)
    item = torch.tensor([[1]])
    compiled = torch.compile(lambda x: inclusion_log_prob(x, item, 6, validate_args=False), fullgraph=True,
                             dynamic=False)
    out = compiled(logits)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    want = inclusion_log_prob(logits, item, 6)
    (want_grad,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=0.0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_earlier_block_s_tiny_take_of_a_saturated_item_is_kept(dtype):
    """Regression (found by review): at M = 3, a later block whose n items are saturated ones that an earlier
    block may have taken with a chance below eps (ρ rounds to 1) lost that chance, all the room left for the
    others: κ sat in a flat stretch of f, the log-probability of an item that fills that room was -488 (enumeration:
    -98) and its gradient 6e109, against a finite difference of 0. The log-space solve now takes n - Σ_sat ρ as
    (n - #sat) + Σ_sat (1 - ρ), 1 - ρ from log ρ: -93.5, and the gradient matches finite differences."""
    logits = torch.tensor([[[-251., 0., -74., 582., 494., 133., 23.], [-66., -731., -111., 577., 182., 32., 73.],
                            [797., 296., 809., 58., -483., -32., -6.]]], dtype=torch.float64)
    item = torch.tensor([[1]])
    x = logits.to(dtype).requires_grad_()
    out = inclusion_log_prob(x, item, 6)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert -100.0 < out.item() < -90.0
    assert grad.abs().max() <= 1.0 + 1e-6
    if dtype == torch.float64:
        step = 1e-5
        for j in range(logits.numel()):
            e = torch.zeros(logits.numel(), dtype=dtype).view_as(logits)
            e.view(-1)[j] = step
            with torch.no_grad():
                fd = (inclusion_log_prob(logits + e, item, 6) - inclusion_log_prob(logits - e, item, 6)) / (2 * step)
            assert abs(fd.item() - grad.view(-1)[j].item()) < 1e-5, j


@pytest.mark.parametrize("m", [2, 3])
def test_a_mixture_s_summarised_tail_survives_earlier_blocks(m):
    """Equal scores over 3,000 items: every item's probability is K / N. Above 2048 items the tail is
    summarised, and it entered every block whole: the probabilities summed to 196.5 for K = 200 under three
    experts (1.7% low per item). The tail's survival is now its mean rate's, exact for equal scores (up to
    the tail series' truncation, x^4/24 at rates below 1/8)."""
    n, k = 3000, 200
    user = torch.zeros(2, m, 4, dtype=torch.float64)
    item = torch.randn(n, m, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    every = torch.arange(n).expand(2, -1)
    got = mean_field_log_inclusion(EmbeddingCatalog(user, item), every, expert_runs(k, m)).exp()
    torch.testing.assert_close(got, torch.full_like(got, k / n), rtol=1e-5, atol=0.0)


def test_an_unconverged_solve_warns():
    """Eager, the solve knows when max_iter ran out: it warns rather than return probabilities that sum to 2.4 K
    without a word (logit scale 30, K = 50, max_iter = 4)."""
    scores = 30 * torch.randn(1, 1, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    items = torch.arange(1000).unsqueeze(0)
    with pytest.warns(RuntimeWarning, match="max_iter=4"):
        _log_inclusion(scores, items, 50, max_iter=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converged = _log_inclusion(scores, items, 50)
        # stalled at float32 rounding with the count right (found by review: warned at any max_iter)
        stalled = torch.tensor([[325.77023, 324.32169, 262.93720, 256.61874, 247.92570, 229.93037, 219.98981,
                                 212.29944, 206.42386, 205.29959, 205.27470]])
        got = _log_inclusion(stalled.unsqueeze(1), torch.arange(11).unsqueeze(0), 10).exp().sum()
    torch.testing.assert_close(converged.exp().sum(), torch.tensor(50.0, dtype=torch.float64))
    assert abs(float(got) - 10.0) < 1e-4



@pytest.mark.parametrize("num_experts", [1, 3])
def test_one_draw_is_the_softmax_exactly(num_experts):
    """Found by mutation testing: turning off the K = 1 shortcut (Rosén's equation instead, up to 10% off) left every
    test passing. One draw's inclusion probability is the drawing expert's softmax, to rounding, on dense logits and
    on an embedding catalog of more items than mean-field reads whole."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(4, num_experts, 50, generator=g, dtype=torch.float64)
    items = torch.arange(50).expand(4, -1)
    want = logits[:, 0].log_softmax(-1)
    torch.testing.assert_close(inclusion_log_prob(logits, items, 1, method="mean_field"), want, rtol=1e-14, atol=1e-14)
    user = torch.randn(4, num_experts, 8, generator=g, dtype=torch.float64)
    item = torch.randn(3000, num_experts, 8, generator=g, dtype=torch.float64)
    want = torch.einsum("bd,nd->bn", user[:, 0], item[:, 0]).log_softmax(-1)
    items = torch.tensor([[0, 5, 2999]] * 4)
    torch.testing.assert_close(inclusion_log_prob(EmbeddingCatalog(user, item), items, 1, method="mean_field"),
                               want.gather(1, items), rtol=1e-13, atol=1e-13)
