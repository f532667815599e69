"""The core as a demanding PyTorch user drives it: masks, empty batches, every dtype, every autograd
mode, torch.compile, the module-wide validation default and pluggable inclusion methods."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import capg_rec
from capg_rec import (CAPGLoss, DenseCatalog, EmbeddingCatalog, InclusionMethod, VPGLoss, candidate_log_prob,
                      functional, greedy_candidates, inclusion_log_prob, sample_candidates)
from capg_rec._enumerate import inclusion_probs
from capg_rec.marginals import Exact, MeanField, PlugIn, WithReplacement, _known_lookups
from capg_rec.testing import esr_cases
from capg_rec.validate import CatalogESR, validate_esr

FAST_METHODS = ["with_replacement", "plugin", "mean_field"]
METHODS = [*FAST_METHODS, "exact"]
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _loss(name: str, k: int, **kw) -> torch.nn.Module:
    if name == "vpg":
        return VPGLoss(k, **kw)
    if name == "vpg_swr":
        return VPGLoss(k, with_replacement=True, **kw)
    return CAPGLoss(k, method=name, **kw)


LOSSES = ["vpg", "vpg_swr", *METHODS]


def _tolerance(dtype: torch.dtype, span: float) -> float:
    """Absolute error allowed on a log-probability computed in ``dtype``'s compute precision from
    scores spanning ``span``: a few dozen roundings of numbers of that size (each ``eps·span``)."""
    eps = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
    return 64 * eps * (1.0 + span)


@pytest.fixture
def restore_validation():
    yield
    capg_rec.set_default_validate_args(True)


# ---------------------------------------------------------------- masks (-inf logits)

def _masked_case(seed: int, experts: int, n: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, experts, n, generator=g, dtype=torch.float64) * 2
    keep = torch.ones(3, n, dtype=torch.bool)
    keep[0, [1, 4]] = False
    keep[1, 6] = False  # row 2 keeps every item
    return logits.masked_fill(~keep.unsqueeze(1), -math.inf), keep


@pytest.mark.parametrize("method", [*METHODS, "enumerate"])
@pytest.mark.parametrize("experts", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_masked_items_are_removed_from_the_catalog(method, experts, k):
    """Masking an item (-inf) gives each row exactly what the catalog without that item gives:
    values and gradients; masked items get log-probability -inf and zero gradient."""
    logits, keep = _masked_case(k + 10 * experts, experts)
    logits.requires_grad_()
    items = torch.arange(7).expand(3, -1)
    out = inclusion_log_prob(logits, items, k, method=method)
    (grad,) = torch.autograd.grad(out.masked_fill(~keep, 0).sum(), logits)
    assert torch.isfinite(grad).all()
    assert (out[~keep] == -math.inf).all() and (grad.masked_select(~keep.unsqueeze(1)) == 0).all()
    for b in range(3):
        sub = logits.detach()[b:b + 1, :, keep[b]].requires_grad_()
        ref = inclusion_log_prob(sub, torch.arange(int(keep[b].sum())).unsqueeze(0), k, method=method)
        torch.testing.assert_close(out[b, keep[b]], ref[0], rtol=1e-6, atol=1e-9)
        (ref_grad,) = torch.autograd.grad(ref.sum(), sub)
        torch.testing.assert_close(grad[b][:, keep[b]], ref_grad[0], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("experts", [1, 2])
def test_enumeration_of_the_masked_catalog(experts):
    logits, keep = _masked_case(3, experts)
    probs = inclusion_log_prob(logits, torch.arange(7).expand(3, -1), 3, method="plugin").exp()
    exact = inclusion_log_prob(logits, torch.arange(7).expand(3, -1), 3, method="enumerate").exp()
    for b in range(3):
        ref = inclusion_probs(logits[b:b + 1, :, keep[b]], capg_rec.expert_of_position(3, experts))[0]
        torch.testing.assert_close(exact[b, keep[b]], ref)
        assert (probs[b, ~keep[b]] == 0).all() and (exact[b, ~keep[b]] == 0).all()


@pytest.mark.parametrize("loss_name", LOSSES)
def test_losses_with_masked_items_have_finite_gradients(loss_name):
    """The default loss with -inf logits used to return 0.0 with non-finite gradients."""
    logits, keep = _masked_case(5, 2, n=12)
    logits.requires_grad_()
    cand = sample_candidates(logits.detach(), 4, generator=torch.Generator().manual_seed(0))
    loss = _loss(loss_name, 4)(logits, cand, cand[:, :2], torch.rand(3, 2, dtype=torch.float64) + 0.5)
    loss.backward()
    assert torch.isfinite(loss) and loss != 0
    assert torch.isfinite(logits.grad).all() and (logits.grad.masked_select(~keep.unsqueeze(1)) == 0).all()


def test_the_sampler_never_draws_masked_items_and_counts_them():
    logits, keep = _masked_case(0, 2, n=9)
    gen = torch.Generator().manual_seed(1)
    draws = sample_candidates(logits.repeat(200, 1, 1), 7, generator=gen)
    assert keep.repeat(200, 1).gather(1, draws).all()
    assert keep.gather(1, greedy_candidates(logits, 7)).all()
    with pytest.raises(ValueError, match="unmasked"):
        sample_candidates(logits, 8, generator=gen)  # row 0 has 7 unmasked items
    with pytest.raises(ValueError, match="unmasked"):
        inclusion_log_prob(logits, torch.zeros(3, 1, dtype=torch.long), 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("num_items", "draw"), [(4, [0, 1, 3, 2]), (5, [0, 1, 3, 2]), (4, [2, 1, 3, 0])])
def test_a_draw_holding_a_masked_item_has_log_prob_minus_inf_and_finite_gradients(dtype, num_items, draw):
    """Regression: a masked item drawn where nothing unmasked is left gave NaN ((-inf) - (-inf)), not the
    documented -inf, on dense logits and embedding catalogs alike; the gradient stays finite and a
    constant shift of the row leaves it unchanged (it sums to 0)."""
    logits = torch.tensor([[0.5, -1.0, -math.inf, 0.3, -math.inf][:num_items]], dtype=dtype, requires_grad=True)
    out = candidate_log_prob(logits, torch.tensor([draw]))
    assert out.item() == -math.inf
    (grad,) = torch.autograd.grad(out.sum(), logits)
    assert torch.isfinite(grad).all() and abs(grad.sum().item()) <= num_items * torch.finfo(dtype).eps  # N roundings
    g = torch.Generator().manual_seed(3)
    user = torch.randn(1, 3, generator=g, dtype=dtype)
    item = torch.randn(num_items, 3, generator=g, dtype=dtype, requires_grad=True)
    masked = torch.tensor([[i for i in range(num_items) if logits[0, i] == -math.inf]])
    out = candidate_log_prob(EmbeddingCatalog(user, item, masked_items=masked), torch.tensor([draw]),
                             validate_args=False)
    assert out.item() == -math.inf
    assert torch.isfinite(torch.autograd.grad(out.sum(), item)[0]).all()


def test_embedding_catalog_default_chunk_is_the_cpus_or_a_score_budget_elsewhere():
    from capg_rec.catalog import chunk_items
    assert EmbeddingCatalog(torch.randn(3, 2, 4), torch.randn(30, 2, 4)).chunk_size == 8192
    assert chunk_items(None, 128, torch.device("cpu")) == 8192
    assert chunk_items(None, 128, torch.device("cuda")) == 2**25 // 128  # read off the device's type only
    assert chunk_items(None, 10**6, torch.device("cuda", 1)) == 8192  # never below the CPU's
    assert chunk_items(100, 128, torch.device("cuda")) == 100
    # inside a transform B·M is a sample's, and the transform multiplies what a chunk holds (a review)
    per_sample = torch.func.vmap(lambda x: x * chunk_items(None, 1, torch.device("cuda")))(torch.ones(3))
    assert per_sample.tolist() == [8192] * 3
    with pytest.raises(TypeError, match="chunk_size"):
        EmbeddingCatalog(torch.randn(3, 4), torch.randn(30, 4), chunk_size=8.0)
    with pytest.raises(ValueError, match="chunk_size"):
        EmbeddingCatalog(torch.randn(3, 4), torch.randn(30, 4), chunk_size=0)


def test_embedding_catalog_masked_items_equal_minus_inf_logits():
    g = torch.Generator().manual_seed(2)
    user = torch.randn(3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    item = torch.randn(30, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    masked = torch.tensor([[3, 7, -1], [29, -1, -1], [-1, -1, -1]])
    emb = EmbeddingCatalog(user, item, masked_items=masked, chunk_size=7)
    logits = torch.einsum("bmd,nmd->bmn", user, item)
    drop = torch.zeros(3, 31, dtype=torch.bool).scatter(1, masked.clamp(min=-1) % 31, True)[:, :30]
    dense = DenseCatalog(logits.masked_fill(drop.unsqueeze(1), -math.inf))
    assert torch.equal(emb.num_available(), dense.num_available())
    items = torch.tensor([[0, 3, 5], [29, 1, 2], [4, 5, 6]])
    for method in FAST_METHODS:
        a, b = (inclusion_log_prob(c, items, 5, method=method) for c in (emb, dense))
        torch.testing.assert_close(a, b)
        ga, gb = (torch.autograd.grad(x.masked_fill(x == -math.inf, 0).sum(), (user, item), retain_graph=True)
                  for x in (a, b))
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y)
    draws = sample_candidates(emb, 27, generator=g)
    assert not drop.gather(1, draws).any()
    with pytest.raises(ValueError, match="masked_items"):
        EmbeddingCatalog(user, item, masked_items=torch.tensor([[30], [0], [0]]))


@pytest.mark.parametrize("experts, dtype", [(1, torch.float32), (3, torch.float64), (2, torch.bfloat16)])
def test_embedding_catalog_reads_a_small_catalog_whole_in_one_product(experts, dtype, monkeypatch):
    """Mean-field, the plug-in and the exact method read a catalog of at most 2048 items whole. An EmbeddingCatalog
    looked every item up for every row ([B, N, D], scattered back in backward): mean-field at N = 1000 took 13x its
    time on the same scores as logits (found by review). One product now, equal to the lookups (masks and temperature
    included), with the same gradients."""
    from capg_rec.catalog import CatalogScores, every_score

    g = torch.Generator().manual_seed(4)
    user = torch.randn(5, experts, 8, generator=g).to(dtype).requires_grad_()
    item = torch.randn(40, experts, 8, generator=g).to(dtype).requires_grad_()
    masked = torch.tensor([[1, 2, -1], [3, 3, 39], [-1, -1, -1], [0, 5, 6], [7, -1, 8]])
    catalog = EmbeddingCatalog(user, item, temperature=0.7, masked_items=masked)
    whole, looked_up = every_score(catalog), CatalogScores._every_score(catalog)
    assert whole.dtype == looked_up.dtype and torch.equal(whole == -math.inf, looked_up == -math.inf)
    weights = torch.randn(whole.shape, generator=g, dtype=whole.dtype).masked_fill(whole.detach() == -math.inf, 0.0)
    grads = [torch.autograd.grad((x.masked_fill(x == -math.inf, 0.0) * weights).sum(), (user, item), retain_graph=True)
             for x in (whole, looked_up)]
    eps = torch.finfo(whole.dtype).eps
    torch.testing.assert_close(whole.masked_fill(whole == -math.inf, 0.0),
                               looked_up.masked_fill(looked_up == -math.inf, 0.0), rtol=16 * eps, atol=16 * eps)
    for a, b in zip(*grads):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=16 * torch.finfo(dtype).eps, atol=16 * torch.finfo(dtype).eps)
    lookups = []
    gather = EmbeddingCatalog.gather
    monkeypatch.setattr(EmbeddingCatalog, "gather", lambda self, items: lookups.append(items.shape) or
                        gather(self, items))
    candidates = sample_candidates(catalog, 4, generator=g)
    for method in ("mean_field", "plugin", "exact"):
        fresh = EmbeddingCatalog(user, item, temperature=0.7, masked_items=masked)  # a graph of its own
        CAPGLoss(4, method=method)(fresh, candidates, candidates[:, :2], torch.ones(5, 2)).backward()
    assert all(shape[1] < 40 for shape in lookups), lookups  # no lookup of every item
    # the plug-in, which took its greedy prefixes through the streamed top items (half as fast at N = 1000), reads
    # it whole too, with the streamed path's values and gradients
    monkeypatch.undo()
    values = []
    for in_one in (True, False):
        fresh = EmbeddingCatalog(user, item, temperature=0.7, masked_items=masked)
        fresh._whole_in_one_product = in_one
        if in_one:
            monkeypatch.setattr(EmbeddingCatalog, "top_items", lambda *args, **kwargs: pytest.fail("streamed"))
        out = inclusion_log_prob(fresh, candidates[:, :2], 4, method="plugin")
        values.append((out, *torch.autograd.grad(out.sum(), (user, item))))
        monkeypatch.undo()
    # the streamed sums' exps (exp2 on the CPU) err by |x|·eps, |x| of ten or so here, and add in another order
    tolerance = 256 * torch.finfo(whole.dtype).eps
    for a, b in zip(*values):
        torch.testing.assert_close(a.double(), b.double(), rtol=tolerance, atol=tolerance * b.abs().max().item())


# ---------------------------------------------------------------- empty batches

@pytest.mark.parametrize("method", [*METHODS, "enumerate"])
def test_empty_batch_inclusion(method):
    out = inclusion_log_prob(torch.randn(0, 2, 6), torch.zeros(0, 2, dtype=torch.long), 3, method=method)
    assert out.shape == (0, 2)


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch_losses(loss_name, reduction):
    logits = torch.randn(0, 6, requires_grad=True)
    empty = torch.zeros(0, 3, dtype=torch.long)
    loss = _loss(loss_name, 3, reduction=reduction)(logits, empty, empty[:, :1], torch.zeros(0, 1))
    assert loss.shape == ((0,) if reduction == "none" else ())
    if reduction != "none":
        assert loss.item() == 0.0
        loss.backward()
        assert logits.grad.shape == (0, 6)


def test_empty_batch_samplers_and_catalogs():
    assert sample_candidates(torch.randn(0, 2, 6), 3).shape == (0, 3)
    assert greedy_candidates(torch.randn(0, 6), 3).shape == (0, 3)
    assert candidate_log_prob(torch.randn(0, 6), torch.zeros(0, 3, dtype=torch.long)).shape == (0,)
    emb = EmbeddingCatalog(torch.randn(0, 4), torch.randn(10, 4))
    assert sample_candidates(emb, 3).shape == (0, 3)
    assert inclusion_log_prob(emb, torch.zeros(0, 1, dtype=torch.long), 3).shape == (0, 1)


# ---------------------------------------------------------------- half precision

def test_float16_gradients_are_right():
    """fp16 logits are computed in float32: the issue's repro gave gradients 8-210% off or NaN."""
    x16 = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float16, requires_grad=True)
    x64 = x16.detach().double().requires_grad_()
    for name in LOSSES:
        cand = torch.tensor([[0, 2]]) if name != "with_replacement" else torch.tensor([[0]])
        k = cand.shape[1]
        for x in (x16, x64):
            _loss(name, k)(x, cand, cand[:, :1], torch.ones(1, 1, dtype=x.dtype)).backward()
        assert x16.grad.dtype == torch.float16
        torch.testing.assert_close(x16.grad.double(), x64.grad, rtol=2e-3, atol=2e-3)
        x16.grad = x64.grad = None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("method", METHODS)
def test_low_precision_agrees_with_float64(dtype, method):
    g = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(4, 2, 50, generator=g)).to(dtype)
    items = torch.randint(0, 50, (4, 3), generator=g)
    low = inclusion_log_prob(x, items, 6, method=method)
    ref = inclusion_log_prob(x.double(), items, 6, method=method)
    span = float(x.double().abs().max())
    assert low.dtype == torch.float32
    torch.testing.assert_close(low.double(), ref, rtol=0, atol=_tolerance(dtype, span))


# ---------------------------------------------------------------- property: shift, dtype, gradients

@given(case=esr_cases(max_batch=2, max_experts=2, min_items=2, max_items=6, masked=True), data=st.data())
def test_shift_invariance_dtype_agreement_and_finite_gradients(case, data):
    """Every method and loss, on logits with ±1e4 values, ties and -inf masks: a per-row shift
    changes nothing, float32 agrees with float64, and gradients are finite."""
    logits, k, tau, _ = case
    k = min(k, logits.shape[-1] - 1) or 1
    method = data.draw(st.sampled_from([*METHODS, "enumerate"]))
    shift = data.draw(st.sampled_from([-1e4, -3.0, 1e3, 1e4]))
    finite = torch.where(torch.isfinite(logits), logits, 0.0)
    span = float(finite.abs().max()) / tau
    batch = logits.shape[0]
    shifts = torch.tensor([shift, -shift / 2][:batch]).view(batch, *([1] * (logits.dim() - 1)))
    available = torch.isfinite(logits.view(batch, -1, logits.shape[-1])[:, 0])  # [B, N]
    items = torch.arange(logits.shape[-1]).expand(batch, -1)
    x64 = logits.double().requires_grad_()
    ref = inclusion_log_prob(x64, items, k, temperature=tau, method=method)
    x32 = logits.clone().requires_grad_()
    out = inclusion_log_prob(x32, items, k, temperature=tau, method=method)
    moved = inclusion_log_prob(logits + shifts, items, k, temperature=tau, method=method)
    tol = _tolerance(torch.float32, span + abs(shift) / tau)
    assert (out[~available] == -math.inf).all() and (ref[~available] == -math.inf).all()
    torch.testing.assert_close(out[available].double(), ref[available], rtol=0, atol=tol)
    torch.testing.assert_close(moved[available].double(), ref[available], rtol=0, atol=tol)
    for x, y in ((x32, out), (x64, ref)):
        (grad,) = torch.autograd.grad(y.masked_fill(~available, 0).sum(), x)
        assert torch.isfinite(grad).all()


# ---------------------------------------------------------------- second order, torch.func

def _plain_log_softmax_score(logits: torch.Tensor, cand: torch.Tensor, with_replacement: bool) -> torch.Tensor:
    """V-PG(-SwR) score of one expert written with plain torch ops (the autograd reference)."""
    if with_replacement:
        return torch.log_softmax(logits, 1).gather(1, cand).sum(1)
    total = torch.zeros(logits.shape[0], dtype=logits.dtype)
    removed = torch.zeros_like(logits, dtype=torch.bool)
    for k in range(cand.shape[1]):
        total = total + torch.log_softmax(logits.masked_fill(removed, -math.inf), 1).gather(1, cand[:, k:k + 1])[:, 0]
        removed = removed.scatter(1, cand[:, k:k + 1], True)
    return total


@pytest.mark.parametrize("far", [None, -1000.0])
@pytest.mark.parametrize("name", ["vpg", "vpg_swr", "with_replacement"])
def test_hessian_vector_products_match_plain_autograd(name, far):
    """hvp through the losses used to be exactly 0 (once-differentiable Functions), and NaN for V-PG where
    the suffix masses leave the CPU's fast path (``far``: a last candidate 1000 nats down; always on CUDA)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 8, generator=g, dtype=torch.float64)
    cand = sample_candidates(logits, 3, generator=g)
    if far is not None:
        logits = logits.scatter(1, cand[:, -1:], far)
    rewards = torch.rand(3, 1, generator=g, dtype=torch.float64)
    v = torch.randn(3, 8, generator=g, dtype=torch.float64)

    def ours(x):
        return _loss(name, 3)(x, cand, cand[:, :1], rewards)

    def plain(x):
        if name == "with_replacement":
            score = torch.logsumexp(torch.log_softmax(x, 1).gather(1, cand[:, :1]) + math.log(3), 1)
            return -(rewards[:, 0] * score).mean()
        return -(rewards[:, 0] * _plain_log_softmax_score(x, cand, name == "vpg_swr")).mean()

    _, h_ours = torch.autograd.functional.hvp(ours, logits, v)
    _, h_plain = torch.autograd.functional.hvp(plain, logits, v)
    assert h_plain.abs().max() > 1e-3
    torch.testing.assert_close(h_ours, h_plain)


@pytest.mark.parametrize("name", LOSSES)
def test_gradgradcheck_every_loss(name):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 2, 6, generator=g, dtype=torch.float64)
    cand = sample_candidates(logits, 3, generator=g)
    rewards = torch.rand(2, 2, generator=g, dtype=torch.float64)
    fn = _loss(name, 3)
    x = logits.requires_grad_()
    assert torch.autograd.gradgradcheck(lambda y: fn(y, cand, cand[:, :2], rewards), (x,))


@pytest.mark.parametrize("name", ["vpg", "vpg_swr", *FAST_METHODS])
def test_torch_func_grad_and_vmap(name):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 10, generator=g, dtype=torch.float64, requires_grad=True)
    cand = sample_candidates(logits.detach(), 3, generator=g)
    rewards = torch.rand(4, 2, generator=g, dtype=torch.float64)
    fn = _loss(name, 3, validate_args=False)
    (expected,) = torch.autograd.grad(fn(logits, cand, cand[:, :2], rewards), logits)
    got = torch.func.grad(lambda x: fn(x, cand, cand[:, :2], rewards))(logits.detach())
    torch.testing.assert_close(got, expected)
    per_row = torch.func.vmap(torch.func.grad(lambda x, c, r: fn(x[None], c[None], c[None, :2], r[None])))(
        logits.detach(), cand, rewards)
    torch.testing.assert_close(per_row, expected * logits.shape[0])


# ---------------------------------------------------------------- torch.compile

@pytest.mark.parametrize("name", ["vpg", "vpg_swr", *FAST_METHODS])
def test_losses_compile_without_graph_breaks(name):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 2, 30, generator=g, requires_grad=True)
    cand = sample_candidates(logits.detach(), 5, generator=g)
    rewards = torch.rand(4, 2, generator=g)
    fn = _loss(name, 5, validate_args=False)
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lru_cache")  # found by review: a warning on every compile
        got = compiled(logits, cand, cand[:, :2], rewards)
    torch.testing.assert_close(got, fn(logits, cand, cand[:, :2], rewards))


def test_checks_under_compile_name_the_setting_or_run_between_graphs():
    """A loss whose own checks are off, on an EmbeddingCatalog built with the default (checked): under fullgraph the
    error names validate_args (it was Dynamo's "function marked as skipped", found by review); without fullgraph the
    checks run eagerly between graphs and the value is eager's."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    user, item = torch.randn(2, 3, generator=g), torch.randn(6, 3, generator=g)
    cand = torch.tensor([[0, 1, 2], [0, 1, 3]])
    rewards = torch.ones(2, 2)
    loss = CAPGLoss(3, method="with_replacement", validate_args=False)

    def fn(u):
        return loss(EmbeddingCatalog(u, item), cand, cand[:, :2], rewards)

    with pytest.raises(Exception, match="validate_args=False"):
        torch.compile(fn, fullgraph=True, backend="eager")(user)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="eager")(user), fn(user))


@pytest.mark.parametrize("name", ["vpg", "with_replacement", "mean_field"])
def test_compiled_losses_with_checks_on_compile_once(name):
    """Without fullgraph and with the default checks, the checks run eagerly between graphs and later calls compile
    nothing: before, Dynamo traced the checks' functions one by one, guarded on each tensor's identity, and compiled
    them again on every call until its recompile limit (8, with a warning), and warned that it could not trace a query
    of torch.func's transforms. The values are eager's; NaN logits raise."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    loss = _loss(name, 5)
    compiled = torch.compile(loss, backend="eager")
    g = torch.Generator().manual_seed(3)

    def inputs():
        logits = torch.randn(4, 30, generator=g, requires_grad=True)
        cand = sample_candidates(logits.detach(), 5, generator=g)
        return logits, cand, cand[:, :2], torch.rand(4, 2, generator=g)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            args = inputs()
            torch.testing.assert_close(compiled(*args), loss(*args))
    assert not [w for w in caught if "Dynamo" in str(w.message)]  # it warned that it could not trace the vmap query
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(4):
        compiled(*inputs())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    logits, *rest = inputs()
    with pytest.raises(ValueError, match="logits must be finite"):
        compiled(logits.detach().index_fill(1, torch.tensor([3]), math.nan), *rest)


def test_built_in_methods_are_known_under_compile():
    """A built-in method's lookups are known under torch.compile as in eager (Dynamo's bound methods have no __func__
    in the set: every built-in method counted as one of the user's there, whose output a validated loss checks)."""
    class Mine(MeanField):
        def log_inclusion(self, catalog, items, runs):
            return super().log_inclusion(catalog, items, runs)

    own = MeanField()
    own.log_inclusion = lambda catalog, items, runs: None
    for method in (MeanField(), PlugIn(), WithReplacement(), Exact(), Mine(), own):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, m=method: x + _known_lookups(m), fullgraph=True, backend="eager")
        assert float(compiled(torch.zeros(()))) == _known_lookups(method) == (type(method) is not Mine
                                                                              and method is not own)


# ---------------------------------------------------------------- validation default

def test_module_wide_validate_args_default(restore_validation):
    nan = torch.tensor([[0.0, float("nan"), 1.0, 2.0]])
    calls = {
        "sample_candidates": lambda: sample_candidates(nan, 2),
        "greedy_candidates": lambda: greedy_candidates(nan, 2),
        "inclusion_log_prob": lambda: inclusion_log_prob(nan, torch.tensor([[0]]), 2),
        "candidate_log_prob": lambda: candidate_log_prob(nan, torch.tensor([[0, 1]])),
        "DenseCatalog": lambda: DenseCatalog(nan),
        "EmbeddingCatalog": lambda: EmbeddingCatalog(nan, torch.randn(5, 4)),
        "CAPGLoss": lambda: CAPGLoss(2)(nan, torch.tensor([[0, 2]]), torch.tensor([[0]]), torch.ones(1, 1)),
        "capg_loss": lambda: functional.capg_loss(nan, torch.tensor([[0, 2]]), torch.tensor([[0]]), torch.ones(1, 1)),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError):
            call()
    capg_rec.set_default_validate_args(False)
    for name, call in calls.items():
        call()  # no check, no error: undefined values, as documented
    with pytest.raises(ValueError, match="logits"):
        inclusion_log_prob(nan, torch.tensor([[0]]), 2, validate_args=True)  # the argument wins
    with pytest.raises(TypeError, match="value"):
        capg_rec.set_default_validate_args(1)


# ---------------------------------------------------------------- the API shape

def test_functional_equals_modules():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 2, 20, generator=g, requires_grad=True)
    cand = sample_candidates(logits.detach(), 4, generator=g)
    args = (logits, cand, cand[:, :2], torch.rand(5, 2, generator=g))
    assert torch.equal(VPGLoss(4)(*args), functional.vpg_loss(*args))
    assert torch.equal(VPGLoss(4, with_replacement=True)(*args), functional.vpg_loss(*args, with_replacement=True))
    for method in (*METHODS, capg_rec.PlugIn(), capg_rec.WithReplacement()):
        assert torch.equal(CAPGLoss(4, method=method)(*args), functional.capg_loss(*args, method=method))



def test_every_module_forwards_every_option_to_its_function():
    """A mutation review: OffPolicyCAPGLoss could drop the baseline (and so could the other off-policy modules, or drop
    position weights) with no test failing. Each module equals its function with every option set, and each option
    changes the loss (so that the comparison would see one dropped)."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 2, 20, generator=g)
    cand = sample_candidates(logits, 4, generator=g)
    chosen, rewards = cand[:, :2], torch.rand(5, 2, generator=g)
    logged = {"capg": capg_rec.inclusion_log_prob(logits, chosen, 4) - 0.3,
              "vpg": candidate_log_prob(logits, cand) - 0.3,
              "topk": capg_rec.inclusion_log_prob(logits, chosen, 4, method="with_replacement") - math.log(4) - 0.3}
    pairs = [(VPGLoss, functional.vpg_loss, None, {"with_replacement": True}),
             (CAPGLoss, functional.capg_loss, None, {"method": "plugin"}),
             (capg_rec.OffPolicyCAPGLoss, functional.offpolicy_capg_loss, "capg", {"method": "plugin"}),
             (capg_rec.OffPolicyVPGLoss, functional.offpolicy_vpg_loss, "vpg", {}),
             (capg_rec.TopKReinforceLoss, functional.topk_reinforce_loss, "topk", {})]
    call = {"baseline": torch.rand(5, generator=g), "position_weights": torch.tensor([1.0, 0.25])}
    built = {"temperature": 0.7, "reduction": "sum"}
    for module, function, log_name, own in pairs:
        extra = {"max_weight": 1.05, "self_normalize": True} if log_name else {}
        args = (logits, cand, chosen, rewards) + ((logged[log_name],) if log_name else ())
        full = function(*args, **call, **built, **own, **extra)
        torch.testing.assert_close(module(4, **built, **own, **extra)(*args, **call), full, rtol=0, atol=0)
        for name in (*call, *built, *own, *extra):  # each option matters here
            kept = {k: v for k, v in {**call, **built, **own, **extra}.items() if k != name}
            assert not torch.allclose(function(*args, **kept), full), (module.__name__, name)

class _HalfOfSwR(InclusionMethod):
    """A user's own method: half the SwR expected count (deliberately wrong for the validator)."""

    is_probability = False
    uses_top_items = False

    def log_inclusion(self, catalog, items, runs):
        return capg_rec.WithReplacement().log_inclusion(catalog, items, runs) - math.log(2)


def test_a_users_method_plugs_into_losses_validator_and_registry():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(3, 12, generator=g, requires_grad=True)
    cand = sample_candidates(logits.detach(), 4, generator=g)
    args = (logits, cand, cand[:, :1], torch.rand(3, 1, generator=g))
    ours, swr = (torch.autograd.grad(CAPGLoss(4, method=m)(*args), logits)[0]
                 for m in (_HalfOfSwR(), "with_replacement"))
    torch.testing.assert_close(ours, swr)  # a constant offset of the score: the same gradient
    report = validate_esr(CatalogESR(logits.detach(), 4, method=_HalfOfSwR()), num_samples=2000, seed=0)
    assert not report.passed
    capg_rec.register_inclusion_method("half_swr", _HalfOfSwR)
    assert "half_swr" in capg_rec.inclusion_methods()
    assert isinstance(capg_rec.inclusion_method("half_swr"), _HalfOfSwR)
    assert "_HalfOfSwR()" in repr(CAPGLoss(4, method="half_swr"))
    with pytest.raises(TypeError, match="factory"):
        capg_rec.register_inclusion_method("bad", 3)
    with pytest.raises(TypeError, match="method"):
        CAPGLoss(4, method=3)
    with pytest.raises(ValueError, match="method"):
        CAPGLoss(4, method="nope")


class _Returns(InclusionMethod):
    """A user's method that returns ``make(items)``."""

    def __init__(self, make):
        self.make = make

    def log_inclusion(self, catalog, items, runs):
        return self.make(items)


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda items: torch.zeros(items.shape[1]), ValueError, "shape"),  # [L]: broadcast to a loss of 0 before
    (lambda items: torch.zeros(items.shape, dtype=torch.long), TypeError, "floating"),
    (lambda items: items.tolist(), TypeError, "floating"),
    (lambda items: torch.full(items.shape, 5.0), ValueError, "log-probability"),  # a loss of -10 before
    (lambda items: torch.full(items.shape, math.nan), ValueError, "NaN"),
])
def test_a_users_method_output_is_checked(make, error, match):
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 6, generator=g, requires_grad=True)
    cand = sample_candidates(logits.detach(), 3, generator=g)
    method = _Returns(make)
    with pytest.raises(error, match=match):
        capg_rec.inclusion_log_prob(logits, cand[:, :2], 3, method=method)
    with pytest.raises(error, match=match):
        CAPGLoss(3, method=method)(logits, cand, cand[:, :2], torch.ones(2, 2))


def test_a_users_method_with_checks_off_takes_no_collective(monkeypatch):
    """Found by review: the output check of a user's method agreed across processes even with checks off (a sync,
    a collective that a process skipping the loss would leave waiting, and no torch.compile)."""
    pytest.importorskip("torchrec")
    from capg_rec.torchrec.catalog import ShardedEmbeddingCatalog

    calls = []
    monkeypatch.setattr(ShardedEmbeddingCatalog, "agree", lambda self, passed: calls.append(1) or passed)
    gen = torch.Generator().manual_seed(0)
    user, item = torch.randn(4, 4, generator=gen), torch.randn(50, 4, generator=gen)
    cand = torch.stack([torch.randperm(50, generator=gen)[:5] for _ in range(4)])
    method = _Returns(lambda items: torch.full(items.shape, -1.0))
    catalog = ShardedEmbeddingCatalog(user, item, num_items=50, validate_args=False)
    capg_rec.functional.capg_loss(catalog, cand, cand[:, :2], torch.ones(4, 2), method=method, validate_args=False)
    assert not calls
    with pytest.raises(ValueError, match="shape"):  # still refused, where it is found
        capg_rec.functional.capg_loss(catalog, cand, cand[:, :2], torch.ones(4, 2), validate_args=False,
                                      method=_Returns(lambda items: torch.zeros(items.shape[1])))


def test_registration_keeps_the_built_ins_and_checks_the_factory():
    with pytest.raises(ValueError, match="built-in"):  # silently replaced "exact" before
        capg_rec.register_inclusion_method("exact", capg_rec.MeanField)
    with pytest.raises(ValueError, match="identifier"):  # " mean_field" was registered beside the built-in
        capg_rec.register_inclusion_method(" mean_field", capg_rec.PlugIn)
    with pytest.raises(TypeError, match="no arguments"):  # failed at first use before
        capg_rec.register_inclusion_method("needs_one", lambda scale: capg_rec.PlugIn())
    with pytest.raises(TypeError, match="InclusionMethod"):
        capg_rec.register_inclusion_method("not_a_method", lambda: 3)
    class Raises(InclusionMethod):  # its own TypeError is its own, not "needs arguments" (found by review)
        def __init__(self, table=None):
            self.size = len(table)

        def log_inclusion(self, catalog, items, runs):
            return items

    with pytest.raises(TypeError, match="has no len"):
        capg_rec.register_inclusion_method("raises", Raises)
    assert isinstance(capg_rec.inclusion_method("exact"), capg_rec.Exact)
    assert not {" mean_field", "needs_one", "not_a_method"} & set(capg_rec.inclusion_methods())


@pytest.mark.parametrize("device", DEVICES)
def test_losses_run_on_every_device(device):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 2, 30, generator=g).to(device).requires_grad_()
    cand = sample_candidates(logits.detach(), 5, generator=torch.Generator(device).manual_seed(0))
    for name in LOSSES:
        loss = _loss(name, 5)(logits, cand, cand[:, :2], torch.rand(4, 2, device=device))
        loss.backward()
        assert loss.device.type == device and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_logits_are_caught(name, bad):
    """A NaN or +inf anywhere in a row, candidate or not, is a ValueError naming the logits (the
    check is one amax, which propagates NaN)."""
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(3, 2, 20, generator=g, dtype=torch.float64)
    cand = sample_candidates(logits, 4, generator=g)
    poisoned = logits.clone()
    poisoned[1, 1, min(set(range(20)) - set(cand[1].tolist()))] = bad  # one entry, not a candidate
    with pytest.raises(ValueError, match="logits"):
        _loss(name, 4)(poisoned, cand, cand[:, :2], torch.rand(3, 2, dtype=torch.float64))


@pytest.mark.parametrize("spread", [1.0, 300.0, 1e4])
def test_reverse_logcumsumexp_matches_float64(spread, device):
    """The CPU fast path (float64 suffix sums), and the path of other devices, torch.compile and torch.func
    (also the CPU's for spreads beyond 700 nats), against float64 values and gradients."""
    from capg_rec._numerics import reverse_logcumsumexp

    g = torch.Generator().manual_seed(13)
    x = (spread * torch.randn(4, 2, 30, generator=g)).to(device).requires_grad_()
    x.data[0, 0, 5] = -math.inf
    v = torch.randn(4, 2, 30, generator=g).to(device)
    x64 = x.detach().double().requires_grad_()
    want = torch.logcumsumexp(x64.flip(2), 2).flip(2)  # the float64 reference
    (grad_want,) = torch.autograd.grad(want, x64, v.double())
    # Each e^{x_j - out_k} inherits the float32 rounding of out_k and x_j: ~2 eps |x| relative.
    grad_rtol = 1e-5 + 4 * torch.finfo(torch.float32).eps * spread
    for got in (reverse_logcumsumexp(x, 2), torch.func.vmap(lambda t: reverse_logcumsumexp(t, 1))(x)):
        torch.testing.assert_close(got, want.float(), rtol=2e-6, atol=1e-5 * spread)
        (grad,) = torch.autograd.grad(got, x, v)
        torch.testing.assert_close(grad, grad_want.float(), rtol=grad_rtol, atol=1e-6)


@pytest.mark.parametrize("spread", [1.0, 1e4])
def test_reverse_logcumsumexp_second_derivatives_where_a_position_gets_no_gradient(spread, device):
    """Regression: torch.logcumsumexp's backward takes the log of the incoming gradient, so a position that
    a loss slices off (as every PL suffix mass does) made the Hessian-vector products NaN on every path
    but the CPU's eager fast path: on CUDA, under torch.func, and on the CPU beyond 700 nats."""
    from capg_rec._numerics import reverse_logcumsumexp

    g = torch.Generator().manual_seed(14)
    x = (spread * torch.randn(3, 2, 6, generator=g, dtype=torch.float64)).to(device)
    v = torch.randn(3, 2, 6, generator=g, dtype=torch.float64).to(device)

    def loss(fn):
        return lambda t: (fn(t)[..., :-1] ** 2).sum()

    ours, plain = loss(lambda t: reverse_logcumsumexp(t, 2)), loss(_pairwise_reverse_logcumsumexp)
    _, hvp = torch.autograd.functional.hvp(ours, x, v)
    _, want = torch.autograd.functional.hvp(plain, x, v)
    assert torch.isfinite(want).all() and want.abs().max() > 1e-3
    torch.testing.assert_close(hvp, want)
    hessian = [torch.func.jacrev(torch.func.grad(f))(x) for f in (ours, plain)]
    torch.testing.assert_close(*hessian)
    masked = x.clone()
    masked[0, 0, 2:] = -math.inf  # a suffix of masked entries: -inf, no gradient
    masked[1, 1, 3] = -math.inf
    kept = masked.isfinite()

    def finite(t):
        return reverse_logcumsumexp(torch.where(kept, t, masked), 2)[..., :-1].nan_to_num(neginf=0.0)

    assert torch.autograd.gradgradcheck(finite, (x.clone().requires_grad_(),))


def _pairwise_reverse_logcumsumexp(x: torch.Tensor) -> torch.Tensor:
    """The reference of second derivatives: torch.logsumexp over the ``[K, K]`` upper triangle (no -inf)."""
    size = x.shape[-1]
    later = torch.arange(size, device=x.device) >= torch.arange(size, device=x.device).unsqueeze(1)
    return torch.logsumexp(x.unsqueeze(-2).masked_fill(~later, -math.inf), -1)


@pytest.mark.parametrize("spread", [1.0, 1e4])
def test_reverse_logcumsumexp_with_masked_suffixes(spread):
    """-inf entries add nothing, an all -inf suffix is -inf, and gradients are never NaN (torch's own
    logcumsumexp gives NaN gradients at -inf)."""
    from capg_rec._numerics import reverse_logcumsumexp

    x = torch.tensor([[0.0, spread, -math.inf, 1.0, -math.inf, -math.inf]], dtype=torch.float64, requires_grad=True)
    out = reverse_logcumsumexp(x, 1)
    finite = x.detach().clone()
    want = [torch.logsumexp(finite[0, k:][torch.isfinite(finite[0, k:])], 0) if torch.isfinite(finite[0, k:]).any()
            else torch.tensor(-math.inf, dtype=torch.float64) for k in range(6)]
    torch.testing.assert_close(out[0], torch.stack(want))
    (grad,) = torch.autograd.grad(out.masked_fill(~torch.isfinite(out), 0).sum(), x)
    assert torch.isfinite(grad).all() and (grad[0, [2, 4, 5]] == 0).all()


@pytest.mark.parametrize("name", ["vpg_swr", "with_replacement"])
def test_unchecked_swr_losses_make_no_host_sync(name):
    from capg_rec.testing import count_host_syncs

    logits = torch.randn(4, 2, 30, requires_grad=True)
    cand = sample_candidates(logits.detach(), 5, generator=torch.Generator().manual_seed(0))
    fn = _loss(name, 5, validate_args=False)
    with count_host_syncs() as calls:
        fn(logits, cand, cand[:, :2], torch.rand(4, 2)).backward()
    assert calls == []
    with count_host_syncs() as calls:
        _loss(name, 5)(logits, cand, cand[:, :2], torch.rand(4, 2))
    assert set(calls) <= {"numpy"}  # the checks read CPU tensors through numpy views (tests/test_checks.py)


def test_method_settings_are_checked():
    with pytest.raises(ValueError, match="tol"):
        capg_rec.MeanField(tol=1.0)
    with pytest.raises(ValueError, match="max_iter"):
        capg_rec.MeanField(max_iter=0)
    with pytest.raises(TypeError, match="max_iter"):
        capg_rec.MeanField(max_iter=2.5)
    with pytest.raises(ValueError, match="memory_budget"):
        capg_rec.Exact(memory_budget=0)
    assert capg_rec.MeanField(max_iter=8) == capg_rec.MeanField(max_iter=8) != capg_rec.MeanField()


def _run_as_two_processes(first, second) -> list[str]:
    """``DeferredChecks.run`` of two check lists as two processes run it: each ``agree`` is an AND over both,
    the two meeting at a barrier (threads); results of different shapes fail both, as a collective whose
    sizes differ does. → each one's outcome: "ok" or its error message."""
    import threading

    barrier, slots, outcomes = threading.Barrier(2, timeout=10), [None, None], ["", ""]

    def agree(i):
        def call(local):
            slots[i] = local
            barrier.wait()
            shapes_differ = slots[0].shape != slots[1].shape
            out = None if shapes_differ else slots[0] & slots[1]
            barrier.wait()
            if shapes_differ:
                raise RuntimeError("collective sizes differ")
            return out
        return call

    def run(i, checks):
        try:
            checks.run(agree(i))
            outcomes[i] = "ok"
        except (ValueError, RuntimeError) as err:
            outcomes[i] = str(err)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def test_deferred_checks_agree_whatever_each_process_checked():
    """A check that failed in this process names no other; one that passed here but failed in another process
    says so; processes that took different numbers of checks (paths that depend on their data, an empty batch)
    still raise together, or pass together (regression: the agreement had one entry per check, a collective of
    different sizes that hung or aborted gloo)."""
    from capg_rec._checks import DeferredChecks

    def checks(*results: bool) -> DeferredChecks:
        c = DeferredChecks()
        for i, ok in enumerate(results):
            c.require(torch.tensor(ok) if i % 2 else ok, f"check {i} failed")
        return c

    with pytest.raises(ValueError, match=r"^check 0 failed$"):
        checks(False).run()
    checks(True, True).run()
    assert _run_as_two_processes(checks(True, False), checks(True, True)) == [
        "check 1 failed", "check 1 failed (in another process)"]
    assert _run_as_two_processes(checks(True, False), checks(True)) == [
        "check 1 failed", "an input check failed in another process (which raised its error)"]
    assert _run_as_two_processes(checks(True, True, True), checks(True)) == ["ok", "ok"]
    assert _run_as_two_processes(checks(), checks(True)) == ["ok", "ok"]
    assert _run_as_two_processes(checks(), checks(False)) == [
        "an input check failed in another process (which raised its error)", "check 0 failed"]


@pytest.mark.parametrize("name", ["vpg", "capg_swr", "capg_mean_field"])
def test_candidates_need_only_the_drawing_experts_score(name):
    """A candidate masked under another expert is a draw the mixture can make (position k uses expert
    m(k) alone); masked under its own expert it is not, and the checks say so."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 2, 12, generator=g, dtype=torch.float64)
    cand = capg_rec.sample_candidates(logits, 4, generator=g)  # positions 0, 1 from expert 0; 2, 3 from 1
    loss = {"vpg": capg_rec.VPGLoss(4), "capg_swr": capg_rec.CAPGLoss(4, method="with_replacement"),
            "capg_mean_field": capg_rec.CAPGLoss(4)}[name]
    chosen, rewards = cand[:, :2], torch.ones(4, 2, dtype=torch.float64)
    other = logits.clone()
    other[torch.arange(4), 1, cand[:, 0]] = -math.inf  # drawn by expert 0, masked under expert 1
    assert torch.isfinite(loss(other, cand, chosen, rewards))
    own = logits.clone()
    own[torch.arange(4), 0, cand[:, 0]] = -math.inf
    with pytest.raises(ValueError, match="masked items"):
        loss(own, cand, chosen, rewards)


@pytest.mark.parametrize("num_candidates", [5, 100])  # a sort, and counting for wide rows
def test_repeated_or_out_of_range_candidates_are_caught_at_any_width(num_candidates):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 300, generator=g)
    cand = capg_rec.sample_candidates(logits, num_candidates, generator=g)
    chosen, rewards = cand[:, :1], torch.ones(3, 1)
    loss = capg_rec.CAPGLoss(num_candidates, method="with_replacement")
    assert torch.isfinite(loss(logits, cand, chosen, rewards))
    repeated = cand.clone()
    repeated[2, -1] = repeated[2, 1]
    with pytest.raises(ValueError, match="candidates must not repeat"):
        loss(logits, repeated, chosen, rewards)
    outside = cand.clone()
    outside[1, -1] = 300
    with pytest.raises(ValueError, match=r"candidates must hold ids in \[0, 300\)"):
        loss(logits, outside, chosen, rewards)


@pytest.mark.filterwarnings("ignore:mean-field reads")  # a sampled catalog without an index head: biased, alike
@pytest.mark.filterwarnings("ignore:the plug-in takes")
@pytest.mark.parametrize("num_items", [300, 3000])  # read whole; streamed in chunks
@pytest.mark.parametrize("placement", ["embedding", "sampled"])
def test_catalogs_score_in_their_own_dtype_under_autocast(device, num_items, placement):
    """An autocast region (mixed-precision training) does not change what a catalog computes: its products
    run in its own dtype, so losses and gradients equal those outside the region (the chunked sums ran in
    half precision and failed to mask with float32's lowest value; their backward, which autocast does not
    reach, recomputed the scores in float32)."""
    g = torch.Generator().manual_seed(0)
    user = torch.randn(4, 2, 8, generator=g).to(device).requires_grad_()
    item = torch.randn(num_items, 2, 8, generator=g).to(device).requires_grad_()
    low = torch.float16 if device.type == "cuda" else torch.bfloat16

    def catalog():
        if placement == "embedding":
            return capg_rec.EmbeddingCatalog(user, item, chunk_size=1000)
        return capg_rec.SampledCatalog(user, item, sampler=capg_rec.UniformSampler(64),
                                       head_items=cand, generator=torch.Generator(device=device).manual_seed(1))

    cand = capg_rec.sample_candidates(capg_rec.EmbeddingCatalog(user.detach(), item.detach()), 6,
                                      generator=torch.Generator(device=device).manual_seed(2))
    chosen, rewards = cand[:, :2], torch.rand(4, 2, generator=g).to(device)
    # CUDA adds the gradients of gathered rows with atomics, in any order: there, two runs of one computation
    # differ in float32's last bits (half precision would differ from the third significant digit on)
    atomics = 64 * torch.finfo(torch.float32).eps if device.type == "cuda" else 0.0
    for loss_fn in (capg_rec.CAPGLoss(6), capg_rec.CAPGLoss(6, method="plugin"), capg_rec.VPGLoss(6),
                    capg_rec.CAPGLoss(6, method="with_replacement")):
        want = loss_fn(catalog(), cand, chosen, rewards)
        with torch.autocast(device.type, dtype=low):
            got = loss_fn(catalog(), cand, chosen, rewards)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, b in zip(torch.autograd.grad(got, (user, item)), torch.autograd.grad(want, (user, item))):
            torch.testing.assert_close(a, b, rtol=atomics, atol=atomics * b.abs().max().item())


@pytest.mark.parametrize("placement", ["embedding", "sharded", "sampled"])
@pytest.mark.parametrize(("user_dtype", "item_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float64),
                                                        (torch.float16, torch.bfloat16)])
def test_catalogs_score_user_and_item_of_different_dtypes_in_the_wider(device, placement, user_dtype, item_dtype):
    """Found by review: a user tower that autocast ran in bfloat16 beside a float32 item table (nn.Embedding, which
    autocast leaves alone) was refused ('user and item must share a dtype'); a SampledCatalog scored a float64 table
    in its float32 users' dtype. Every catalog scores in the wider dtype, at least float32: the loss equals the one
    from both cast there, and each gradient comes back in its input's dtype."""
    if placement == "sharded":
        pytest.importorskip("torchrec")
        from capg_rec.torchrec import ShardedEmbeddingCatalog

        def build(u, v):
            return ShardedEmbeddingCatalog(u, v, num_items=v.shape[0], chunk_size=7)
    elif placement == "sampled":  # a head of the whole catalog: exact sums, every method
        def build(u, v):
            return capg_rec.SampledCatalog(u, v, sampler=capg_rec.UniformSampler(4),
                                           head_items=torch.arange(30, device=device).expand(4, -1),
                                           generator=torch.Generator(device=device).manual_seed(3))
    else:
        def build(u, v):
            return capg_rec.EmbeddingCatalog(u, v, chunk_size=7)
    g = torch.Generator().manual_seed(0)
    wide = torch.promote_types(torch.promote_types(user_dtype, item_dtype), torch.float32)
    user = torch.randn(4, 8, generator=g).to(device=device, dtype=user_dtype).requires_grad_()
    item = torch.randn(30, 8, generator=g).to(device=device, dtype=item_dtype).requires_grad_()
    cand = capg_rec.sample_candidates(build(user.detach(), item.detach()), 5,
                                      generator=torch.Generator(device=device).manual_seed(1))
    chosen, rewards = cand[:, :2], torch.rand(4, 2, generator=g).to(device)
    for loss_fn in (capg_rec.CAPGLoss(5), capg_rec.VPGLoss(5)):
        got = loss_fn(build(user, item), cand, chosen, rewards)
        ref_user, ref_item = user.detach().to(wide).requires_grad_(), item.detach().to(wide).requires_grad_()
        want = loss_fn(build(ref_user, ref_item), cand, chosen, rewards)
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0)
        grads = torch.autograd.grad(got, (user, item))
        assert [x.dtype for x in grads] == [user_dtype, item_dtype]
        for a, b in zip(grads, torch.autograd.grad(want, (ref_user, ref_item))):
            # a sampled catalog looks its rows up in the table's dtype: an item both in the head and the sample adds
            # its two gradients there (one more rounding of that dtype); CUDA adds gathered rows' gradients with
            # atomics, in any order (as in the autocast test above)
            eps = torch.finfo(a.dtype).eps if placement == "sampled" and a.dtype.itemsize < 4 else 0.0
            eps = max(eps, 32 * torch.finfo(a.dtype).eps if device.type == "cuda" else 0.0)
            torch.testing.assert_close(a, b.to(a.dtype), rtol=2 * eps, atol=2 * eps * b.abs().max().item())


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("experts", [1, 2])
def test_losses_evaluate_under_no_grad_and_inference_mode(loss_name, experts):
    """Evaluation without autograd (torch.no_grad, torch.inference_mode) gives the values with autograd (the
    exact method's mixtures failed under inference_mode: their inner derivative was recorded on inference
    tensors)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, experts, 40, generator=g, dtype=torch.float64).squeeze(1)
    cand = capg_rec.sample_candidates(logits, 5, generator=g)
    chosen, rewards = cand[:, :2], torch.rand(4, 2, generator=g, dtype=torch.float64)
    want = _loss(loss_name, 5)(logits.requires_grad_(), cand, chosen, rewards)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = _loss(loss_name, 5)(logits.detach(), cand, chosen, rewards)
        assert float(got) == float(want)


def test_protocol_lookups_refuse_what_they_cannot_answer():
    """Found by review: EmbeddingCatalog.gather scored id -1 as item N - 1 and broadcast a [1, L] tensor to every
    row; top_items(k > N) returned N columns (and the dense catalog raised torch's 'selected index k out of
    range'). Each is now an error."""
    gen = torch.Generator().manual_seed(0)
    user, item = torch.randn(2, 4, generator=gen), torch.randn(10, 4, generator=gen)
    embedded, dense = EmbeddingCatalog(user, item), DenseCatalog(user @ item.T)
    for bad in (-1, 10):
        with pytest.raises(ValueError, match=r"items must hold ids in \[0, 10\)"):
            embedded.gather(torch.tensor([[bad], [0]]))
    with pytest.raises(ValueError, match="items must have shape"):
        embedded.gather(torch.tensor([[1]]))
    for catalog in (embedded, dense):
        with pytest.raises(ValueError, match="k must be in"):
            catalog.top_items(11)
    ids = torch.tensor([[1, 2], [3, 9]])
    torch.testing.assert_close(embedded.gather(ids), dense.gather(ids))


@pytest.mark.parametrize("module", ["capg_rec", "capg_rec.functional", "capg_rec.torchrec", "capg_rec.logs",
                                    "capg_rec.offpolicy_evaluation", "capg_rec.ann", "capg_rec.serving",
                                    "capg_rec.validate", "capg_rec.testing", "capg_rec.sim"])
def test_every_exported_name_is_in_the_readme_api_section(module):
    """Found by review: a dozen exported names were nowhere in the README. Every name of a public module's
    ``__all__`` is named, in backquotes, in its "Public API" section."""
    import importlib
    from pathlib import Path

    if module == "capg_rec.torchrec":
        pytest.importorskip("torchrec")
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = text.split("## Public API", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in importlib.import_module(module).__all__ if f"`{name}`" not in section]
    assert not missing, f"{module} exports {missing}, which the README's Public API section does not name"


def test_a_masked_item_of_id_zero_counts_as_masked():
    """Found by mutation testing: counting masked ids from 1 rather than 0 left every test passing; then a row that
    masks item 0 had one item too many available, and a draw of the whole catalog took the masked item."""
    user, item = torch.randn(2, 4), torch.randn(3, 4)
    catalog = capg_rec.EmbeddingCatalog(user, item, masked_items=torch.tensor([[0, -1], [2, 2]]))
    assert torch.equal(catalog.num_available(), torch.tensor([[2], [2]]))
    with pytest.raises(ValueError, match="unmasked"):
        capg_rec.sample_candidates(catalog, 3)
