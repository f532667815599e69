"""capg_rec.testing: strategies generate what they promise; the assertion helper passes and fails."""

from __future__ import annotations

import builtins

import pytest
import torch
from hypothesis import find, given, settings

import capg_rec
from capg_rec import testing
from capg_rec.testing import EXTREME_LOGIT, assert_esr_valid
from capg_rec.validate import CatalogESR


@given(testing.logits(max_batch=3, max_experts=1, min_items=2, max_items=6))
def test_single_logits_shape_and_values(x):
    assert x.dim() == 2 and 1 <= x.shape[0] <= 3 and 2 <= x.shape[1] <= 6
    assert x.dtype == torch.float32 and bool(torch.isfinite(x).all())
    assert bool((x.abs() <= 2 * EXTREME_LOGIT).all())  # an extreme value, shifted by another


@given(testing.logits(max_experts=3, extreme=False, ties=False, dtype=torch.float64))
def test_moe_logits_shape_and_values(x):
    assert x.dim() == 3 and 1 <= x.shape[1] <= 3 and x.dtype == torch.float64
    assert bool((x.abs() <= 5.0).all())


@pytest.mark.parametrize("scale,dtype", [(0.1, torch.float32), (2.2, torch.float64), (1e5, torch.float16),
                                         (1e39, torch.bfloat16)])
def test_logits_take_any_scale_and_stay_finite_in_their_dtype(scale, dtype):
    """scale=0.1 or 2.2 raised Hypothesis's InvalidArgument (not float32 numbers), and scale=1e5 in float16 gave
    infinities, which read as masked items."""

    @settings(max_examples=40, database=None, derandomize=True)
    @given(testing.logits(scale=scale, dtype=dtype, extreme=False, ties=False))
    def check(x):
        assert x.dtype == dtype and bool(torch.isfinite(x).all()) and float(x.abs().max()) <= scale

    check()


def test_logits_include_extremes_and_ties():
    extreme = find(testing.logits(min_items=2), lambda x: bool((x.abs() == EXTREME_LOGIT).any()))
    assert bool((extreme.abs() == EXTREME_LOGIT).any())
    tied = find(testing.logits(min_items=3, extreme=False),
                lambda x: x.shape[-1] >= 3 and bool((x[..., 1:] == x[..., :1]).all()) and bool((x != 0).all()))
    assert bool((tied == tied.flatten()[0]).all())



def test_logits_shift_rows_far_from_zero_and_mask_within_limits():
    """A mutation review: no example held distinct scores far from 0 (a row's values at an offset of 1e4 that differ
    by a few units), where a dropped shift by the row's best bites; and nothing tested that masked=True keeps
    min_items unmasked in every row (a mutant that kept none was caught only by chance elsewhere)."""
    def far(x):
        rows = x.reshape(-1, x.shape[-1])
        return any(len(set(r.tolist())) >= 2 and bool((r.abs() > 100).all()) and float(r.max() - r.min()) < 10
                   for r in rows)

    shifted = find(testing.logits(min_items=3, max_experts=2, ties=False), far)
    assert far(shifted)
    masked = find(testing.logits(min_items=2, masked=True), lambda x: bool((x == -torch.inf).any()))
    assert bool((masked == -torch.inf).any())

    @settings(max_examples=200, derandomize=True, database=None)
    @given(testing.logits(max_experts=3, min_items=3, max_items=6, masked=True))
    def check(x):
        x = x if x.dim() == 3 else x.unsqueeze(1)
        unmasked = x > -torch.inf
        assert bool((unmasked == unmasked[:, :1]).all())  # masked under every expert alike
        assert int(unmasked[:, 0].sum(-1).min()) >= 3

    check()

@given(testing.esr_cases(max_items=5))
def test_esr_cases_are_consistent(case):
    x, k, tau, seed = case
    assert 1 <= k <= x.shape[-1] and 0.05 <= tau <= 5.0 and 0 <= seed < 2**32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_esr_cases_in_other_dtypes(dtype):
    """A mutation review: esr_cases drew float32 logits only."""
    @settings(max_examples=20, derandomize=True, database=None)
    @given(testing.esr_cases(max_items=5, max_experts=2, dtype=dtype))
    def check(case):
        x, k, tau, seed = case
        assert x.dtype == dtype and 1 <= k <= x.shape[-1]
        candidates = capg_rec.sample_candidates(x, k, temperature=tau, generator=torch.Generator().manual_seed(seed))
        assert candidates.shape == (x.shape[0], k)

    check()


@given(testing.contexts(max_batch=4, dim=3), testing.num_experts(4), testing.temperatures(0.5, 2.0))
def test_contexts_experts_temperatures(ctx, m, tau):
    assert ctx.shape[1] == 3 and 1 <= ctx.shape[0] <= 4 and 1 <= m <= 4 and 0.5 <= tau <= 2.0


@pytest.mark.parametrize("make,match", [
    (lambda: testing.logits(max_items=0), "max_items"),
    (lambda: testing.logits(min_items=4, max_items=3), "max_items"),
    (lambda: testing.logits(scale=0.0), "scale"),
    (lambda: testing.num_candidates(0), "num_items"),
    (lambda: testing.temperatures(2.0, 1.0), "high"),
    (lambda: testing.contexts(dim=0), "dim"),
])
def test_bad_strategy_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_missing_hypothesis_gives_a_clear_error(monkeypatch):
    real_import = builtins.__import__

    def no_hypothesis(name, *args, **kwargs):
        if name.startswith("hypothesis"):
            raise ImportError("No module named 'hypothesis'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hypothesis)
    with pytest.raises(ImportError, match="pip install hypothesis"):
        testing.seeds()


def test_assert_esr_valid_passes_and_fails():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, -2.0, 0.5]])
    report = assert_esr_valid(CatalogESR(logits, 2, method="enumerate"), num_samples=5_000)
    assert report.passed
    wrong = CatalogESR(logits, 2, temperature=0.5)
    wrong.inclusion_log_prob = CatalogESR(logits, 2, method="enumerate").inclusion_log_prob
    with pytest.raises(AssertionError, match="ESR claims disagree with its samples"):
        assert_esr_valid(wrong, num_samples=5_000)


@settings(max_examples=10)
@given(testing.esr_cases(max_batch=2, max_experts=2, min_items=2, max_items=5))
def test_strategies_drive_a_validation(case):
    """A user-style property test: capg_rec's enumerated PL(-MoE) ESR passes on drawn problems
    (extreme and tied logits included); α = 1e-6 per example keeps the suite flake-free. The
    claims' self-consistency is checked to the scores' own precision: a score s is known to
    eps·|s| only, and a claimed draw sums K such rounded terms (1e4 / τ = 2e5 in fp32: ~0.02)."""
    x, k, tau, seed = case
    resolution = k * torch.finfo(x.dtype).eps * float(x.abs().max()) / tau
    assert_esr_valid(CatalogESR(x, k, temperature=tau, method="enumerate"), num_samples=2_000, alpha=1e-6,
                     seed=seed, sum_tolerance=max(1e-3, resolution))


def test_logits_at_a_scale_beyond_float32_warn_nothing():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        testing.logits(scale=1e300, dtype=torch.float64)  # np.float32(1e300) warned of an overflow


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_logits_stay_within_the_scale_in_their_dtype(dtype):
    """Regression (found by review): the bound was a float32 number, and rounding to bfloat16 took 5.02 to
    5.03125 > scale."""
    @settings(max_examples=200, derandomize=True, database=None)
    @given(testing.logits(scale=5.02, dtype=dtype, extreme=False, max_items=16))
    def check(x):
        assert x.dtype == dtype and x.abs().max() <= 5.02

    check()


def test_count_host_syncs_counts_and_leaves_torch_tensor_as_it_found_it():
    """Regression (found by review): the methods torch.Tensor inherits were set on it afterwards, as its own."""
    names = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"]
    before = {name: vars(torch.Tensor).get(name) for name in names}
    x = torch.ones(2)
    with pytest.raises(RuntimeError, match="inside"):
        with testing.count_host_syncs() as calls:
            x.sum().item()
            bool(x.all())
            raise RuntimeError("inside")
    assert calls == ["item", "__bool__"]
    assert {name: vars(torch.Tensor).get(name) for name in names} == before


def test_esr_cases_refuses_a_dtype_that_is_not_floating():
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype, got torch.int64"):
        testing.esr_cases(dtype=torch.int64)
