"""The log-space helpers every catalog-wide reduction goes through."""

import math

import numpy as np
import pytest
import torch

from capg_rec import CAPGLoss, DenseCatalog, EmbeddingCatalog, VPGLoss, sample_candidates
from capg_rec.plackett_luce import expert_runs
from capg_rec._numerics import (_top_k_numpy, _top_k_torch, _truncated_keys, exp_floor, expm1, filled_logsumexp,
                               gather_with_rest, log1mexp, log_softmax_at, masked_logsumexp, safe_logsumexp,
                               scaled_terms, top_k)
from capg_rec.catalog import _chunked_top_k, _ChunkedLogPowerSums


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 50.0, 2000.0])
def test_logsumexp_matches_torch_where_exps_underflow(dtype, scale):
    """Spreads far beyond exp's normal range (fp32: ~87) give torch's value and softmax gradient."""
    x = (scale * torch.randn(6, 2, 300, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    x = x.to(dtype).requires_grad_()
    ref = x.detach().double()
    out = filled_logsumexp(x, 2)
    torch.testing.assert_close(out.double(), torch.logsumexp(ref, 2), rtol=2 * torch.finfo(dtype).eps, atol=0)
    out.sum().backward()
    torch.testing.assert_close(x.grad.double(), torch.softmax(ref, 2), rtol=0, atol=4 * torch.finfo(dtype).eps)


def test_logsumexp_gradcheck_and_dims():
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    for dim in (0, 1, 2, -1):
        assert torch.autograd.gradcheck(lambda t: filled_logsumexp(t, dim), (x,))
        torch.testing.assert_close(filled_logsumexp(x, dim), torch.logsumexp(x, dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 50.0, 2000.0])
def test_log_softmax_at_matches_torch(dtype, scale):
    """The fused gather - logsumexp equals torch's log_softmax at the named entries, with the same
    gradient (repeated indices accumulate), also where exps underflow."""
    gen = torch.Generator().manual_seed(1)
    x = (scale * torch.randn(5, 2, 200, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    index = torch.randint(0, 200, (5, 2, 4), generator=gen)
    index[:, :, 1] = index[:, :, 0]
    weights = torch.randn(5, 2, 4, generator=gen, dtype=dtype)
    out = log_softmax_at(x, index, 2)
    ref_x = x.detach().double().requires_grad_()
    ref = torch.log_softmax(ref_x, 2).gather(2, index)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), ref, rtol=4 * eps, atol=4 * eps * scale)
    (out * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=0, atol=16 * eps)


def test_log_softmax_at_gradcheck_and_dims():
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    for dim in (0, 1, 2):
        index = torch.randint(0, x.shape[dim], tuple(2 if d == dim else n for d, n in enumerate(x.shape)))
        assert torch.autograd.gradcheck(lambda t: log_softmax_at(t, index, dim), (x,))
        torch.testing.assert_close(log_softmax_at(x, index, dim), torch.log_softmax(x, dim).gather(dim, index))


def test_log_softmax_at_keeps_precision_at_large_magnitudes():
    """Shifting by the maximum before subtracting: two tied fp32 scores of -2e5 are log(1/2) each
    to float32 precision, not to the 0.016 spacing of floats near 2e5."""
    x = torch.full((1, 2), -2e5)
    out = log_softmax_at(x, torch.tensor([[0, 1]]), 1)
    torch.testing.assert_close(out, torch.full((1, 2), -math.log(2.0)))


def _rest_reference(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    named = torch.zeros_like(x, dtype=torch.bool).scatter(dim, index, True)
    return torch.logsumexp(x.masked_fill(named, -math.inf), dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 50.0, 2000.0])
def test_gather_with_rest_matches_torch(dtype, scale):
    """Named scores and the logsumexp of the others equal torch's, with the same gradients, when
    either output or both are used, for repeated names, and where exps underflow."""
    gen = torch.Generator().manual_seed(2)
    x = (scale * torch.randn(5, 2, 150, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    index = torch.randint(0, 150, (5, 2, 6), generator=gen)
    index[:, :, 1] = index[:, :, 0]
    named, rest = gather_with_rest(x, index, 2)
    ref_x = x.detach().double().requires_grad_()
    ref_named, ref_rest = ref_x.gather(2, index), _rest_reference(ref_x, index, 2)
    eps = torch.finfo(dtype).eps
    assert torch.equal(named, x.detach().gather(2, index))
    torch.testing.assert_close(rest.double(), ref_rest, rtol=4 * eps, atol=0)
    w_named, w_rest = torch.randn(5, 2, 6, generator=gen, dtype=dtype), torch.randn(5, 2, generator=gen, dtype=dtype)
    for use in ("both", "named", "rest"):
        out = (named * w_named).sum() * (use != "rest") + (rest * w_rest).sum() * (use != "named")
        ref = ((ref_named * w_named.double()).sum() * (use != "rest")
               + (ref_rest * w_rest.double()).sum() * (use != "named"))
        (grad,) = torch.autograd.grad(out, x, retain_graph=True)
        (ref_grad,) = torch.autograd.grad(ref, ref_x, retain_graph=True)
        # exp(x - m) carries the rounding of its argument: ~eps·|x| relative, |x| up to ~4·scale
        atol = 4 * eps * (1 + 4 * scale) * float(ref_grad.abs().max())
        torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=atol)
    only_named = gather_with_rest(x, index, 2)[0].sum()  # the rest unused: its grad arrives as None
    torch.testing.assert_close(torch.autograd.grad(only_named, x)[0].double(),
                               torch.autograd.grad(ref_x.gather(2, index).sum(), ref_x)[0])


def test_gather_with_rest_gradcheck_and_an_empty_rest():
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    for dim in (0, 1, 2):
        index = torch.randint(0, x.shape[dim], tuple(2 if d == dim else n for d, n in enumerate(x.shape)))
        assert torch.autograd.gradcheck(lambda t: gather_with_rest(t, index, dim), (x,))
    every = torch.arange(5).expand(3, 4, 5)
    named, rest = gather_with_rest(x, every, 2)
    assert (rest == -math.inf).all()
    (grad,) = torch.autograd.grad(rest.clamp(min=-1.0).sum() + named.sum(), x)
    assert torch.equal(grad, torch.ones_like(x))  # only the named path carries gradient


def _subnormal(x: torch.Tensor) -> int:
    a = x.abs()
    return int(((a > 0) & (a < torch.finfo(x.dtype).tiny)).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scaled_terms_has_no_subnormals_and_errs_below_the_bound(dtype):
    """Floored exps times scales from 0 to 1e3 (both signs): no subnormal product, and every
    product within 2^p·tiny (p mantissa bits) of the exact one, beyond the product's own rounding;
    exactly 0 where the exact one is below half of that."""
    finfo = torch.finfo(dtype)
    floor = math.exp(exp_floor(dtype))
    terms = torch.cat([torch.full((1, 50), floor, dtype=torch.float64),
                       torch.logspace(-40 if dtype == torch.float32 else -300, 0, 200, dtype=torch.float64)[None]],
                      1).clamp(min=floor).to(dtype).expand(8, -1)
    scale = torch.tensor([0.0, 1e-35, -1e-12, 1e-3, -0.3, 0.74, 1.0, -1e3], dtype=dtype)[:, None]
    out = scaled_terms(terms, scale)
    exact = terms.double() * scale.double()
    bound = (2 / finfo.eps) * finfo.tiny
    assert _subnormal(out) == 0
    assert bool(((out.double() - exact).abs() <= bound + finfo.eps * exact.abs()).all())
    assert bool((out[exact.abs() < bound / 2] == 0).all())


@pytest.mark.parametrize("estimator", ["top1", "vpg_swr", "vpg"])
def test_confident_policy_gradients_have_no_subnormals(estimator):
    """Spreads of hundreds of nats (a trained policy) put most exps on the floor; the backward
    must not turn them into subnormal gradients (each costs ~100x in the matmuls downstream)."""
    gen = torch.Generator().manual_seed(3)
    logits = (30 * torch.randn(64, 1000, generator=gen)).requires_grad_()
    cand = sample_candidates(logits.detach(), 10, generator=gen)
    loss_fn = {"top1": CAPGLoss(10, method="with_replacement"), "vpg_swr": VPGLoss(10, with_replacement=True),
               "vpg": VPGLoss(10)}[estimator]
    loss_fn(logits, cand, cand[:, :2], torch.rand(64, 2, generator=gen)).backward()
    assert _subnormal(logits.grad) == 0 and bool(torch.isfinite(logits.grad).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fully_dropped_rows_are_minus_inf_with_zero_grad(dtype):
    x = torch.randn(3, 7, dtype=dtype, requires_grad=True)
    drop = torch.zeros(3, 7, dtype=torch.bool)
    drop[1] = True
    drop[2, :3] = True
    out = masked_logsumexp(x, drop, 1)
    assert out[1] == -math.inf and torch.isfinite(out[[0, 2]]).all()
    torch.testing.assert_close(out[2], torch.logsumexp(x[2, 3:], 0))
    out[[0, 2]].sum().backward()
    assert (x.grad[1] == 0).all() and (x.grad[2, :3] == 0).all() and torch.isfinite(x.grad).all()


def test_exp_floor_stays_in_the_normal_range():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        value = torch.exp(torch.tensor(exp_floor(dtype), dtype=dtype))
        assert value >= torch.finfo(dtype).tiny
    assert exp_floor(torch.float16) == -math.inf  # fp16's normal range is too narrow to floor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_floored_exps_err_below_the_bound(dtype):
    """``exp_floored_`` (float32 on the CPU through ``exp2(x·log2 e)``) against float64: rounding log2(e)
    to the dtype and rounding the product each move the exponent by up to ``|x|·log2(e)·eps/2``, i.e.
    the result by a relative ``|x|·eps/2``; exp2 and the final rounding add at most 2 ulp. Below the
    floor the value is the floor's."""
    from capg_rec._numerics import exp_floored, exp_floored_

    floor = exp_floor(dtype)
    x = torch.linspace(floor - 20.0, 0.0, 100_001, dtype=torch.float64).to(dtype)
    want = torch.exp(x.double().clamp(min=floor))
    eps = torch.finfo(dtype).eps
    bound = (x.double().clamp(min=floor).abs() + 2) * eps
    for got in (exp_floored_(x.clone()), exp_floored(x)):
        assert ((got.double() - want).abs() / want <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_expm1_matches_float64_within_a_few_ulp(dtype):
    """``expm1_`` (float32 on the CPU through numpy) against float64, into a buffer, in place and on a
    transposed view: within 4 ulp (numpy's vectorised kernels promise 4, torch's round once), i.e. a
    relative ``4·eps``, plus a fraction of the smallest normal where the value is subnormal."""
    from capg_rec._numerics import expm1_

    finfo = torch.finfo(dtype)
    big = math.log(finfo.max) - 1.0
    small = torch.logspace(-40, 0, 2_000, dtype=torch.float64)
    special = torch.tensor([0.0, -0.0, -math.inf, -1e30, finfo.tiny, -finfo.tiny], dtype=torch.float64)
    x = torch.cat([torch.linspace(-big, big, 40_000, dtype=torch.float64), small, -small, special]).to(dtype)
    want = torch.expm1(x.double())
    bound = 4 * finfo.eps * want.abs() + finfo.smallest_normal * finfo.eps
    square = x.view(2, -1).t()  # a non-contiguous view
    for got in (expm1_(x, torch.empty_like(x)), expm1_(x.clone()), expm1_(square.clone()).t().flatten()):
        assert got.dtype == dtype
        assert torch.equal(got.double().isinf(), want.isinf())
        finite = want.isfinite()
        assert ((got.double() - want).abs()[finite] <= bound[finite]).all()


def test_confident_catalog_power_sums_are_exact():
    """Powers of confident scores (3 × a spread of 60 in fp32) still match a float64 reference."""
    logits = 20.0 * torch.randn(4, 2, 500, generator=torch.Generator().manual_seed(1))
    exclude = torch.tensor([[0, 1, -1], [5, 6, 7], [-1, -1, -1], [499, 0, 3]])
    got = DenseCatalog(logits).log_power_sums(exclude, 3)
    keep = torch.ones(4, 500, dtype=torch.bool)
    for b, row in enumerate(exclude.tolist()):
        keep[b, [i for i in row if i >= 0]] = False
    for p in range(1, 4):
        ref = torch.stack([torch.logsumexp(p * logits[b][:, keep[b]].double(), 1) for b in range(4)])
        torch.testing.assert_close(got[..., p - 1].double(), ref, rtol=1e-6, atol=0)


def test_confident_chunked_power_sums_match_dense():
    """The streamed (embedding) power sums and their gradients on confident scores, with chunks
    that are wholly excluded, equal the dense ones."""
    gen = torch.Generator().manual_seed(2)
    user = (6.0 * torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    item = (6.0 * torch.randn(40, 2, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    exclude = torch.tensor([[0, 1, 2, 3, 4], [10, 11, -1, -1, -1], [39, 38, 37, 36, 35]])
    grads = []
    for catalog in (EmbeddingCatalog(user, item, chunk_size=5),
                    DenseCatalog(torch.einsum("bmd,nmd->bmn", user, item))):
        out = catalog.log_power_sums(exclude, 3)
        grads.append((out, *torch.autograd.grad(out.sum(), (user, item))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_entries_add_nothing_and_get_exactly_zero_gradient(dtype):
    """-inf scores (items not in a row's catalog) anywhere: the fused reductions equal torch's over the
    other entries; a row with nothing left gives -inf; no -inf entry gets a gradient, even under
    large upstream gradients, and nothing is NaN."""
    gen = torch.Generator().manual_seed(5)
    x = 3 * torch.randn(4, 2, 50, generator=gen, dtype=torch.float64)
    x[torch.rand(x.shape, generator=gen) < 0.3] = -math.inf
    x[0, 1] = -math.inf  # a row with nothing left
    index = torch.randint(0, 50, (4, 2, 3), generator=gen)
    index[1, 0, 0] = int((x[1, 0] == -math.inf).nonzero()[0])  # a masked target
    x = x.to(dtype).requires_grad_()
    ref = x.detach().double()
    named, rest = gather_with_rest(x, index, 2)
    outputs = [filled_logsumexp(x, 2), log_softmax_at(x, index, 2), named, rest]
    kept = torch.ones_like(ref, dtype=torch.bool)
    kept[0, 1] = False
    refs = [torch.logsumexp(ref, 2), torch.log_softmax(ref, 2).gather(2, index), ref.gather(2, index),
            _rest_reference(ref, index, 2)]
    eps = torch.finfo(dtype).eps
    for out, want in zip(outputs, refs):
        good = torch.isfinite(want)
        assert torch.equal(torch.isfinite(out), good)
        torch.testing.assert_close(out.double()[good], want[good], rtol=8 * eps, atol=8 * eps)
        weights = 1e8 * torch.randn(out.shape, generator=gen, dtype=dtype)
        (grad,) = torch.autograd.grad((torch.where(torch.isfinite(out), out, 0) * weights).sum(), x,
                                      retain_graph=True)
        assert bool(torch.isfinite(grad).all())
        assert bool((grad[ref == -math.inf] == 0).all())
        # a gradient arriving at -inf outputs too (rows with nothing left, masked targets)
        (grad,) = torch.autograd.grad(out, x, torch.full_like(out, 1e3), retain_graph=True)
        assert bool(torch.isfinite(grad).all())
        assert bool((grad[ref == -math.inf] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_match_float64(dtype):
    """float16 and bfloat16: the gradients of the fused reductions are right to the dtype's precision
    (the subnormal-free product must not round small float16 terms to 0)."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, -3.0, 1.5, 0.0]], dtype=dtype, requires_grad=True)
    index = torch.tensor([[0, 2], [1, 1]])
    ref = x.detach().double().requires_grad_()
    for ours, theirs in [(filled_logsumexp(x, 1), torch.logsumexp(ref, 1)),
                         (log_softmax_at(x, index, 1), torch.log_softmax(ref, 1).gather(1, index)),
                         (gather_with_rest(x, index, 1)[1], _rest_reference(ref, index, 1))]:
        (grad,) = torch.autograd.grad(ours.sum(), x)
        (want,) = torch.autograd.grad(theirs.sum(), ref)
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.double(), want, rtol=0, atol=4 * torch.finfo(dtype).eps)
    terms = torch.tensor([1.0, 0.3, 1e-3, 6e-5], dtype=torch.float16)
    assert torch.equal(scaled_terms(terms, torch.tensor(0.25, dtype=torch.float16)), terms * 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scaled_terms_zeroes_floor_terms_whatever_the_scale(dtype):
    """A term on the exp floor (a masked entry) times any scale is exactly 0; a term of 1 is kept."""
    floor = torch.exp(torch.tensor(exp_floor(dtype), dtype=dtype))
    terms = torch.stack([floor, torch.ones((), dtype=dtype)]).expand(5, 2)
    scale = torch.tensor([1e-3, 1.0, 1e8, -1e20, torch.finfo(dtype).max / 4], dtype=dtype)[:, None]
    out = scaled_terms(terms, scale)
    assert bool((out[:, 0] == 0).all())
    torch.testing.assert_close(out[:, 1], scale[:, 0])


def _overflowing_embeddings() -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 finite embeddings whose inner products overflow: item 1 to +inf, item 2 to -inf and item 3
    to NaN (+inf + -inf) for user 0; user 1 sees ordinary scores."""
    user = torch.tensor([[1e20, 1e20], [0.5, -0.5]]).unsqueeze(1)
    item = torch.tensor([[1.0, 2.0], [1e20, 1e20], [-1e20, -1e20], [1e20, -1e20], [0.0, 1.0]]).unsqueeze(1)
    return user, item


def test_chunked_reductions_raise_on_overflowing_scores_when_checking():
    """Finite embeddings whose scores overflow: a ValueError when checking, instead of NaN; an
    overflowing item that is excluded does not count; no check (and no host sync) otherwise."""
    user, item = _overflowing_embeddings()
    for chunk_size in (1, 2, 5):
        with pytest.raises(ValueError, match="overflow"):
            _ChunkedLogPowerSums.apply(user, item, None, 1, chunk_size, True)
        with pytest.raises(ValueError, match="overflow"):
            _chunked_top_k(user, item, 2, None, None, chunk_size, check_finite=True)
        _ChunkedLogPowerSums.apply(user, item, None, 1, chunk_size, False)
        _chunked_top_k(user, item, 2, None, None, chunk_size, check_finite=False)
        out = _ChunkedLogPowerSums.apply(user, item, torch.tensor([[1, 2, 3], [-1, -1, -1]]), 2, chunk_size, True)
        assert bool(torch.isfinite(out).all())
    big = torch.full((1, 1, 1), 1.5e19)  # a finite score of 2.25e38, whose second power overflows
    assert bool(torch.isfinite(_ChunkedLogPowerSums.apply(big, big, None, 1, 1, True)).all())
    with pytest.raises(ValueError, match="overflow"):
        _ChunkedLogPowerSums.apply(big, big, None, 2, 1, True)
    with pytest.raises(ValueError, match="overflow"):  # every score of a row overflows to -inf
        _ChunkedLogPowerSums.apply(user[:1], item[2:3], None, 1, 1, True)


def _sequential_reference(x: torch.Tensor, index: torch.Tensor, runs) -> torch.Tensor:
    """``x_{m(k)}[index_k] - logsumexp_{n ∉ index_{<k}} x_{m(k), n}`` position by position, in float64."""
    x = x.double()
    experts = [e for e, n in runs for _ in range(n)]
    out = []
    for k, m in enumerate(experts):
        left = x[:, m].scatter(1, index[:, :k], -math.inf) if k else x[:, m]
        out.append(x[:, m].gather(1, index[:, k:k + 1])[:, 0] - torch.logsumexp(left, 1))
    return torch.stack(out, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 30.0, 400.0])
@pytest.mark.parametrize("num_experts, num_candidates", [(1, 6), (2, 6), (3, 7), (3, 2)])
@pytest.mark.parametrize("shift", [0.0, 1e4])
@pytest.mark.parametrize("node", [True, False], ids=["cpu-node", "composite"])
def test_sequential_log_softmax_matches_the_term_by_term_sums(dtype, scale, num_experts, num_candidates, shift,
                                                             node, monkeypatch):
    """The one-node CPU path (typical spreads) and the composite one it falls back to (suffixes below the
    floored exps' error: spreads of hundreds; and every other device, forced here) give the float64 value and
    gradient of the same inputs, masks included, for even and uneven blocks and for experts without one, and
    under a constant shift of 1e4. Regression: the composite path summed absolute scores, off by K ulps of
    1e4 (1e-3 in float32) after such a shift."""
    import capg_rec._numerics
    from capg_rec._numerics import sequential_log_softmax

    if not node:
        monkeypatch.setattr(capg_rec._numerics, "eager_cpu", lambda x: False)
    gen = torch.Generator().manual_seed(3)
    runs = expert_runs(num_candidates, num_experts)
    x = scale * torch.randn(5, num_experts, 40, generator=gen, dtype=torch.float64) + shift
    x[0, -1, 7] = x[3, 0, :5] = -math.inf
    index = torch.stack([torch.randperm(40, generator=gen)[:num_candidates] for _ in range(5)])
    index[0, 0], index[3, 0] = 8, 6  # named items stay unmasked
    x = x.to(dtype).requires_grad_()
    out = sequential_log_softmax(x, index, runs)
    same = x.detach().double() - shift  # the same inputs (exactly), where float64 resolves the reference
    want = _sequential_reference(same, index, runs)
    tol = 64 * torch.finfo(dtype).eps * (1 + scale)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, x, g.to(dtype))
    ref = same.requires_grad_()
    (want_grad,) = torch.autograd.grad(_sequential_reference(ref, index, runs), ref, g)
    torch.testing.assert_close(grad.double(), want_grad, rtol=0, atol=tol)
    assert (grad[0, -1, 7] == 0) and (grad[3, 0, :5] == 0).all()


def test_sequential_log_softmax_falls_back_where_the_floored_rest_would_be_wrong():
    """The last named item 80 nats below the best and the rest 95 below: float32's floored exps
    (−86) would count the rest 6000x too large; the composite path sums it from its own maximum."""
    from capg_rec._numerics import _SequentialLogSoftmax, sequential_log_softmax

    x = torch.full((1, 1, 1000), -95.0)
    x[0, 0, 0], x[0, 0, 1] = 0.0, -80.0
    index = torch.tensor([[0, 1]])
    runs = ((0, 2),)
    fused = _SequentialLogSoftmax.apply(x, index, runs)[0]
    want = _sequential_reference(x, index, runs)
    assert (fused[0, 1].double() - want[0, 1]).abs() > 1.0  # what the check guards against
    torch.testing.assert_close(sequential_log_softmax(x, index, runs).double(), want, rtol=0, atol=1e-4)


def test_sequential_log_softmax_second_derivatives():
    from capg_rec._numerics import sequential_log_softmax

    x = torch.randn(2, 2, 9, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[1, 4, 2], [0, 8, 3]])
    runs = ((0, 2), (1, 1))
    assert torch.autograd.gradcheck(lambda t: sequential_log_softmax(t, index, runs), (x,))
    assert torch.autograd.gradgradcheck(lambda t: sequential_log_softmax(t, index, runs), (x,))


def _stable_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """The tie policy by definition: a stable sort by value descending (NaN first, as +inf)."""
    a = x.reshape(-1, x.shape[-1]).double().nan_to_num(nan=math.inf).numpy()
    return torch.from_numpy(np.argsort(-a, axis=1, kind="stable")[:, :k].copy()).view(*x.shape[:-1], k)


def _top_k_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    plain = torch.randn(9, 2, 40, generator=gen, dtype=dtype)
    ties = torch.randint(0, 4, (9, 2, 40), generator=gen).to(dtype)  # many ties, also at the k-th value
    masked = torch.randint(0, 3, (9, 2, 40), generator=gen).to(dtype)
    masked[masked == 0] = -math.inf  # rows with fewer finite entries than k: -inf ties kept
    masked[..., ::4] = -0.0  # -0.0 ties with 0.0
    nan = plain.clone()
    nan[0, 0, 5] = nan[3, 1, 0] = math.nan
    nan[2, 0] = plain[2, 0, 0]  # a row of ties beside rows with NaN
    return [plain, ties, masked, nan, plain[:, :, ::3], plain[:0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [0, 1, 3, 8, 13])
def test_top_k_numpy_and_torch_paths_give_the_tie_policy(dtype, k):
    """Both paths of top_k (numpy on the CPU, torch elsewhere and under compile) return the positions of a
    stable sort by value descending: ties in increasing position, the lowest positions kept at the k-th
    value, -0.0 equal to 0.0, NaN first."""
    for x in _top_k_inputs(dtype):
        k_ = min(k, x.shape[-1])
        ref = _stable_top_k(x, k_)
        assert torch.equal(top_k(x, k_), ref)
        assert torch.equal(_top_k_torch(x, k_), ref)
        if k_ and x.numel():
            assert torch.equal(_top_k_numpy(x, k_), ref)
    x = _top_k_inputs(dtype)[1]
    compiled = torch.compile(lambda t: top_k(t, 8), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), _stable_top_k(x, 8))


@pytest.mark.parametrize("n, k, consecutive", [(1003, 1, True), (1003, 10, False), (1003, 31, False),
                                                (1003, 125, False), (4099, 3, True), (20011, 10, True),
                                                (20011, 20, False)])
def test_top_k_grouped_path_gives_the_tie_policy(n, k, consecutive):
    """The pruned float32 path (rows of at least 8k entries): group maxima bound the k-th value from below,
    with strided or consecutive groups; ties, -inf rows, -0.0, a remainder after the last full group, strided
    rows, and NaN (left to the partition path) give the stable sort's positions."""
    from capg_rec._numerics import _consecutive_groups, _top_k_grouped

    assert _consecutive_groups(n, n // (4 * k)) == consecutive  # both layouts of the groups are under test
    gen = torch.Generator().manual_seed(5)
    plain = torch.randn(6, n, generator=gen)
    ties = torch.randint(0, 3, (6, n), generator=gen).float()
    masked = ties.clone()
    masked[masked == 0] = -math.inf
    masked[1, :] = -math.inf
    masked[2, 7:] = -math.inf  # fewer finite entries than k
    masked[..., ::5] = -0.0
    nan = plain.clone()
    nan[4, 900] = math.nan
    for x in (plain, ties, masked, torch.randn(6, 2 * n, generator=gen)[:, ::2], nan):
        ref = _stable_top_k(x, k)
        assert torch.equal(_top_k_numpy(x, k), ref)
        assert torch.equal(top_k(x, k), ref)
    assert _top_k_grouped(plain.numpy(), k) is not None  # the path under test
    assert _top_k_grouped(nan.numpy(), k) is None


def test_catalog_top_items_break_ties_alike_dense_and_streamed():
    """Duplicate item vectors tie: the dense and the chunked catalog return the same ids (lower id first)."""
    gen = torch.Generator().manual_seed(4)
    user = torch.randn(5, 2, 3, generator=gen)
    item = torch.randn(12, 2, 3, generator=gen)[torch.arange(60) % 12]  # every vector five times
    dense = DenseCatalog(torch.einsum("bmd,nmd->bmn", user, item))
    for chunk_size in (7, 25, 60):
        streamed = EmbeddingCatalog(user, item, chunk_size=chunk_size)
        for k in (1, 11, 24, 60):
            ref = _stable_top_k(dense.scores, k)
            assert torch.equal(dense.top_items(k), ref)
            assert torch.equal(streamed.top_items(k), ref)


def test_gather_with_rest_also_names_items_that_stay_in_the_rest():
    """``also``: their scores follow the items' and they stay in the rest; the dense catalog (one [B, 1, N]
    mask for every expert) and the streamed one (the base class) agree in value and gradient."""
    gen = torch.Generator().manual_seed(5)
    user = torch.randn(4, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    item = torch.randn(40, 3, 5, generator=gen, dtype=torch.float64)
    items = torch.randint(0, 40, (4, 6), generator=gen)
    items[:, 1] = items[:, 0]  # repeated ids
    also = torch.cat([items[:, :1], torch.randint(0, 40, (4, 2), generator=gen)], 1)  # one also named in items
    scores = torch.einsum("bmd,nmd->bmn", user, item)
    dense_named, dense_rest = DenseCatalog(scores).gather_with_rest(items, also=also)
    stream_named, stream_rest = EmbeddingCatalog(user, item, chunk_size=7).gather_with_rest(items, also=also)
    named_ids = torch.cat([items, also], 1).unsqueeze(1).expand(-1, 3, -1)
    dropped = torch.zeros(4, 40, dtype=torch.bool).scatter(1, items, True).unsqueeze(1)
    torch.testing.assert_close(dense_named, scores.gather(2, named_ids))
    torch.testing.assert_close(dense_rest, torch.logsumexp(scores.masked_fill(dropped, -math.inf), 2))
    torch.testing.assert_close(stream_named, dense_named)
    torch.testing.assert_close(stream_rest, dense_rest)
    weights = torch.rand(dense_named.shape, generator=gen, dtype=torch.float64)
    grads = [torch.autograd.grad((n * weights).sum() + r.sum(), user)[0]
             for n, r in ((dense_named, dense_rest), (stream_named, stream_rest))]
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("method", ["mean_field", "exact", "plugin", "with_replacement"])
def test_embedding_catalog_losses_raise_on_overflowing_scores_when_read_whole(method):
    """Regression (found by review): a catalog of at most 2048 items is read whole through gather, which did not
    check the scores: mean-field's loss was NaN and the exact method's 0.0 with validation on, where the chunked
    reductions raise. Now the overflow error; overflowing items that are masked do not count."""
    user, item = _overflowing_embeddings()
    item = torch.cat([item, torch.randn(20, 1, 2, generator=torch.Generator().manual_seed(0))])
    cand, ones = torch.tensor([[0, 4, 5], [0, 4, 5]]), torch.ones(2, 1)
    with pytest.raises(ValueError, match="overflow"):
        CAPGLoss(3, method=method)(EmbeddingCatalog(user, item), cand, cand[:, :1], ones)
    with pytest.raises(ValueError, match="overflow"):  # the drawing scores' check named a masked item
        VPGLoss(3)(EmbeddingCatalog(user, item), torch.tensor([[2, 4, 5], [0, 4, 5]]), torch.tensor([[4], [4]]), ones)
    masked = torch.tensor([[1, 2, 3], [-1, -1, -1]])
    assert torch.isfinite(CAPGLoss(3, method=method)(EmbeddingCatalog(user, item, masked_items=masked), cand,
                                                     cand[:, :1], ones))
    assert EmbeddingCatalog(user, item, validate_args=False).gather(cand).shape == (2, 1, 3)


@pytest.mark.parametrize("method", ["plugin", "exact"])
def test_the_scan_cumsum_that_deterministic_cuda_takes(method, monkeypatch):
    """Under torch.use_deterministic_algorithms, CUDA refuses float cumsums: the plug-in's log-space path (the one
    off the CPU) and the exact method raised there (found by review). Their cumsums then take a scan of shifted
    additions; forced here on the CPU, values, gradients and second derivatives are unchanged, and a long float32
    axis sums within float32 rounding of float64."""
    import capg_rec
    import capg_rec._numerics as numerics
    import capg_rec._plugin as plugin

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 2, 12, generator=gen, dtype=torch.float64)
    items = torch.tensor([[0, 5], [3, 11], [7, 7]])
    monkeypatch.setattr(plugin, "eager_cpu", lambda x: False)  # the log-space plug-in, as off the CPU
    results = []
    for triangular in (False, True):
        monkeypatch.setattr(numerics, "refuses_float_cumsum", lambda x, t=triangular: t and x.is_floating_point())
        calls = []
        monkeypatch.setattr(numerics.torch, "cumsum", lambda *a, _f=torch.cumsum, **k: calls.append(1) or _f(*a, **k))
        leaf = logits.clone().requires_grad_()
        out = capg_rec.inclusion_log_prob(leaf, items, 4, method=method)
        (grad,) = torch.autograd.grad(out.sum(), leaf, create_graph=True)
        (hvp,) = torch.autograd.grad((grad * logits).sum(), leaf)
        results.append((out.detach(), grad.detach(), hvp))
        monkeypatch.undo()
        monkeypatch.setattr(plugin, "eager_cpu", lambda x: False)
        assert bool(calls) != triangular, (triangular, len(calls))  # the triangular path takes no torch.cumsum
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    monkeypatch.setattr(numerics, "refuses_float_cumsum", lambda x: True)
    x = torch.rand(3, 300, generator=gen, dtype=torch.float64)
    scanned = numerics.cumsum(x.float(), 1).double()
    # a scan adds each sum in ⌈log2 n⌉ = 9 steps: within 9 roundings of the running sum
    assert bool(((scanned - x.cumsum(1)).abs() <= 9 * torch.finfo(torch.float32).eps * x.cumsum(1)).all())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # elementwise adds: autocast leaves them in float32 (a product
        under_autocast = numerics.cumsum(x.float(), 1)  # with a triangular matrix ran in bfloat16, found by review)
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, scanned.float())


def test_log1mexp_is_accurate_on_both_sides_of_its_branch():
    """Found by mutation testing: log1mexp's two branches compute the same function, and swapping which side takes
    which left every test passing; near 0 only log(-expm1(x)) keeps its digits (-1e-20 gave -inf)."""
    x = torch.tensor([-1e-300, -1e-20, -1e-10, -1e-3, -0.5, -math.log(2), -1.0, -30.0, -700.0], dtype=torch.float64)
    want = torch.tensor([math.log(-math.expm1(v)) if v > -1.0 else math.log1p(-math.exp(v)) for v in x.tolist()],
                        dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), want, rtol=4 * torch.finfo(torch.float64).eps, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log1mexp_keeps_its_digits_under_inductor(dtype):
    """Regression: torch 2.13's inductor compiles expm1 on the CPU as exp(x) - 1, so a compiled log1mexp gave -inf
    for x = -1e-12 (and compiled mean-field's root solve went wrong through the same expm1: the test in
    test_mean_field). Under torch.compile capg_rec's expm1 is Kahan's; values and gradients as eager's."""
    x = -torch.logspace(-30, 1.5, 64, dtype=dtype)
    x = torch.cat([x, torch.tensor([-math.inf, 0.0], dtype=dtype)]).requires_grad_()
    compiled = torch.compile(log1mexp, fullgraph=True, dynamic=False)
    got, want = compiled(x), log1mexp(x)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=8 * eps, atol=0.0)
    (grad,) = torch.autograd.grad(got[:-2].sum(), x)
    (expected,) = torch.autograd.grad(want[:-2].sum(), x)
    torch.testing.assert_close(grad[:-2], expected[:-2], rtol=16 * eps, atol=0.0)  # (at 0: -inf times 0, NaN)
    largest = 88.0 if dtype == torch.float32 else 709.0  # expm1 finite, (e^x - 1)·x not (found by review)
    u = torch.tensor([1e-20, -1e-9, 3e-5, -0.4, 2.0, 80.0, largest, -200.0, -math.inf, math.inf], dtype=dtype)
    torch.testing.assert_close(torch.compile(expm1, dynamic=False)(u), torch.expm1(u), rtol=4 * eps, atol=0.0)


def test_truncated_gumbel_keys_match_their_formula():
    """The sampler's truncated Gumbels, -log(e^-top - e^-peak + e^-x), against that formula in float64 on moderate
    values, where it is accurate as written (found by mutation testing: clamping x - peak at -4 rather than -40
    raised keys of items far below their group's peak by up to 0.018, a bias no Monte-Carlo test of the draws
    resolves). -inf items stay -inf."""
    g = torch.Generator().manual_seed(0)
    x = -20 * torch.rand(200, 6, generator=g, dtype=torch.float64)
    x[:, 0] = 0.0  # each row's peak
    x[:5, 3] = -math.inf
    peak = x.amax(1, keepdim=True)
    top = 3 * torch.randn(200, 1, generator=g, dtype=torch.float64).abs().neg() + peak  # top <= peak
    want = -torch.log(torch.exp(-top) - torch.exp(-peak) + torch.exp(-x))
    for dtype in (torch.float64, torch.float32):
        got = _truncated_keys(x.to(dtype), peak.to(dtype), top.to(dtype)).double()
        tol = 64 * torch.finfo(dtype).eps * (1 + top.abs().max().item())
        torch.testing.assert_close(got, want, rtol=0.0, atol=tol)
    assert (got[:5, 3] == -math.inf).all()


def test_safe_logsumexp_propagates_nan_as_torch_does():
    """A NaN entry gives NaN, as in ``torch.logsumexp``, not ``-inf`` (a masked row's value): with the checks off,
    CA-PG-SwR over two experts turned a NaN logit into a loss of ``+inf``, which reads as an overflow."""
    x = torch.tensor([[math.nan, 1.0], [-math.inf, -math.inf], [math.inf, 1.0], [0.0, 1.0]], dtype=torch.float64)
    out = safe_logsumexp(x, 1)
    assert math.isnan(out[0]) and out[1] == -math.inf and out[2] == math.inf
    torch.testing.assert_close(out[3], torch.logsumexp(x[3], 0))
    logits = torch.randn(3, 2, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits[1, 0, 7] = math.nan
    candidates = torch.arange(6).repeat(3, 1)
    loss = CAPGLoss(6, method="with_replacement", reduction="none", validate_args=False)(
        logits, candidates, candidates[:, :2], torch.ones(3, 2, dtype=torch.float64))
    assert math.isnan(loss[1]) and bool(loss[[0, 2]].isfinite().all())
