"""The exact inclusion method on every input a user can send: extreme but finite logits, per-row
shifts, masked items and targets (``-inf``), second derivatives and ``torch.func``, and memory
bounded by a setting. The references enumerate every ordered draw with 60-digit arithmetic, so
they stay exact for logit gaps of 1e30."""

from __future__ import annotations

import ctypes
import gc
import itertools
import math
import weakref

import mpmath
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from capg_rec import inclusion_log_prob
from capg_rec._enumerate import inclusion_probs
from capg_rec._exact import _FFTConv, exact_log_inclusion
from capg_rec._head_tail import HeadTail
from capg_rec.plackett_luce import expert_of_position, expert_runs
from capg_rec.testing import logits as logit_strategy

INF = math.inf

# |got - want| <= rtol (1 + |want|) for log π, |got - want| <= gtol for its gradient (entries lie in
# [-1, 1]). float32: a few hundred ulps (the computation chains ~100 roundings, and log π itself is
# known to eps·|log π|); float64: the quadrature's truncation (1e-13 relative) and node rule (8
# Gauss–Legendre points per panel, ~1e-13), with a margin of 100.
_RTOL = {torch.float32: 3e-5, torch.float64: 1e-11}
_GTOL = {torch.float32: 3e-4, torch.float64: 1e-9}


def _summary(scores: torch.Tensor, targets: torch.Tensor) -> HeadTail:
    """The whole catalog as head: ``scores [B, M, N]`` (``-inf`` = masked), ``targets [B, L]``."""
    batch, experts, items = scores.shape
    return HeadTail(torch.arange(items).expand(batch, -1), scores, targets,
                    torch.full((batch, experts, 4), -INF, dtype=scores.dtype),
                    torch.full((batch, experts), -INF, dtype=scores.dtype))


def _exact(scores: torch.Tensor, k: int, targets: torch.Tensor | None = None, **settings) -> torch.Tensor:
    """``log π`` of every item (or of ``targets``) for ``scores [B, N]`` or ``[B, M, N]``."""
    if scores.dim() == 2:
        scores = scores.unsqueeze(1)
    if targets is None:
        targets = torch.arange(scores.shape[2]).expand(scores.shape[0], -1)
    return exact_log_inclusion(_summary(scores, targets), expert_runs(k, scores.shape[1]), **settings)


def _enumerated(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``log π`` of every item of ``scores [B, N]`` (``-inf`` = masked) → ``[B, N]``, and its Jacobian
    ``d log π_a / d s_b`` → ``[B, N, N]``, by enumerating the ordered draws of each row's unmasked
    items with 60-digit arithmetic (mpmath, which torch installs): exact for gaps of 1e30 too."""
    log_pi = torch.full(scores.shape, -INF, dtype=torch.float64)
    jac = torch.zeros(*scores.shape, scores.shape[1], dtype=torch.float64)
    with mpmath.workdps(60):
        for row, values in enumerate(scores.double().tolist()):
            keep = [i for i, v in enumerate(values) if v > -INF]
            if len(keep) <= k:
                log_pi[row, keep] = 0.0
                continue
            s = {i: mpmath.mpf(values[i]) for i in keep}
            mass = {a: mpmath.mpf(0) for a in keep}
            slope = {a: [mpmath.mpf(0)] * len(values) for a in keep}  # Σ_draws p · d log p / ds
            for draw in itertools.permutations(keep, k):
                p, dlog_p, left = mpmath.mpf(1), [mpmath.mpf(0)] * len(values), list(keep)
                for d in draw:
                    top = max(s[b] for b in left)
                    w = {b: mpmath.exp(s[b] - top) for b in left}
                    total = mpmath.fsum(w.values())
                    p *= w[d] / total
                    dlog_p[d] += 1
                    for b in left:
                        dlog_p[b] -= w[b] / total
                    left.remove(d)
                for a in draw:
                    mass[a] += p
                    slope[a] = [x + p * y for x, y in zip(slope[a], dlog_p)]
            for a in keep:
                log_pi[row, a] = float(mpmath.log(mass[a]))
                jac[row, a] = torch.tensor([float(x / mass[a]) for x in slope[a]], dtype=torch.float64)
    return log_pi, jac


def _jacobian(fn, x: torch.Tensor) -> torch.Tensor:
    """``d fn(x)[b, a] / d x[b, :]`` for a row-wise ``fn``: ``x [B, N]`` → ``[B, A, N]`` (masked entries 0)."""
    x = x.detach().requires_grad_()
    out = fn(x)
    rows = []
    for a in range(out.shape[1]):
        keep = torch.isfinite(out[:, a])
        (grad,) = torch.autograd.grad(out[:, a].where(keep, torch.zeros_like(out[:, a])).sum(), x,
                                      retain_graph=True)
        rows.append(grad)
    return torch.stack(rows, dim=1)


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    got, want = got.detach().double(), want.detach().double()
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (what, got, want)
    finite = torch.isfinite(want)
    err = (got[finite] - want[finite]).abs() / (1.0 + want[finite].abs())
    assert float(torch.cat([err, err.new_zeros(1)]).max()) <= _RTOL[dtype], (what, got, want)


def _assert_grad_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert bool(torch.isfinite(got).all()), (what, got)
    assert float((got.double() - want).abs().max()) <= _GTOL[dtype], (what, got, want)


def _extreme_rows(spread: float) -> torch.Tensor:
    """Items far above, far below and around 0, ties after rounding, three clusters."""
    return torch.tensor([
        [spread, 0.0, -1.0, -spread, 0.5],
        [0.0, 0.3, -spread, -2.0 * spread, 1.0],
        [spread, 0.5 * spread, 0.0, -1.0, 2.0],
        [-spread, 0.25, -0.5, spread, spread - 3.0],
    ], dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spread", [1e2, 1e4, 1e6, 1e10, 1e20, 1e30])
def test_extreme_logits_match_enumeration(dtype, spread):
    """Values and the whole Jacobian against log-space enumeration of the (rounded) input. The
    issue's repro: one logit at 1e20, K = 2, gave d log π(a)/ds_a = 57 for the item at -1e20, and
    K = 1 gave log π = -0.46 for the top item."""
    x = _extreme_rows(spread).to(dtype)
    for k in (1, 2, 3):
        want, want_jac = _enumerated(x, k)
        _assert_close(_exact(x, k), want, dtype, (spread, k))
        _assert_grad_close(_jacobian(lambda s, k=k: _exact(s, k), x), want_jac, dtype, (spread, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_far_items_have_their_analytic_limits(dtype):
    """K = 1 is the softmax; an item 1e30 below the rest has d log π/ds = 1 for itself and -1 for
    the item it must beat; an item 1e30 above is drawn for sure with zero gradient."""
    x = torch.tensor([[0.0, 1.0, -1e30], [1e30, 0.0, -0.5]], dtype=dtype).requires_grad_()
    out = _exact(x, 1)
    assert torch.allclose(out.detach().double(), torch.log_softmax(x.detach().double(), 1), rtol=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(out[0, 2], x)
    assert torch.allclose(grad[0].double(), torch.tensor([-1.0 / (1 + math.e), -math.e / (1 + math.e), 1.0],
                                                         dtype=torch.float64), atol=_GTOL[dtype])
    out2 = _exact(x, 2)
    assert float(out2[1, 0].detach()) == 0.0
    (grad,) = torch.autograd.grad(out2[1, 0], x, retain_graph=True)
    assert float(grad.abs().max()) == 0.0
    (grad,) = torch.autograd.grad(out2[0, 2], x)  # the third item must beat one of the two others
    assert abs(float(grad[0, 2]) - 1.0) <= _GTOL[dtype]


def _shift_rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(3, 6, generator=gen, dtype=torch.float64) * torch.tensor([[0.5], [2.0], [6.0]],
                                                                                 dtype=torch.float64)
    return torch.cat([rows, torch.tensor([[9.0, 9.0, 0.0, -40.0, 1.0, 1.0]], dtype=torch.float64)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shift", [1e3, -1e3, 1e4, -1e4, 1e30, -1e30])
def test_shifted_rows_agree_with_float64(dtype, shift):
    """A row shifted by c is as accurate as an unshifted one: against enumeration of the input as
    rounded (a shift of 1e30 rounds every float32 logit to the same value: then all tie)."""
    x = (_shift_rows() + shift).to(dtype)
    for k in (1, 3):
        want, want_jac = _enumerated(x, k)
        _assert_close(_exact(x, k), want, dtype, (shift, k))
        _assert_grad_close(_jacobian(lambda s, k=k: _exact(s, k), x), want_jac, dtype, (shift, k))


@pytest.mark.parametrize("dtype,shifts", [(torch.float32, [2.0**10, -2.0**10, 2.0**14, -2.0**14]),
                                          (torch.float64, [2.0**10, 2.0**14, -2.0**40, 2.0**40])])
def test_exact_shifts_change_nothing(dtype, shifts):
    """Logits on a 1/64 grid shifted by a power of two are shifted exactly: values and gradients are
    then bitwise the same, for one expert and a mixture, with and without a tail."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 2, 7, generator=gen) * 2 * 64).round().to(dtype) / 64
    targets = torch.tensor([[0, 3], [6, 6], [2, 5]])
    tail = torch.tensor([-2.5, -5.5, -8.5, -11.5], dtype=dtype).expand(3, 2, -1)  # e^{0.5} items at -3

    def run(shift: float) -> tuple[torch.Tensor, ...]:
        scores = (x + shift).requires_grad_()
        t = (tail + shift * torch.arange(1, 5, dtype=dtype)).requires_grad_()
        outs = []
        for summary in (_summary(scores, targets),
                        HeadTail(_summary(scores, targets).head_ids, scores, targets, t, scores[..., 0].detach())):
            out = exact_log_inclusion(summary, [(0, 2), (1, 2)])
            outs += [out, *torch.autograd.grad(out.sum(), scores)]
        return tuple(o.detach() for o in outs)

    base = run(0.0)
    for shift in shifts:
        for a, b in zip(run(shift), base):
            assert torch.equal(a, b), shift


def _masked_rows(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(5, 6, generator=gen, dtype=torch.float64) * 2).to(dtype)
    mask = torch.tensor([[0, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                         [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    return x.masked_fill(mask, -INF)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_masked_items_match_enumeration_of_the_masked_catalog(dtype, k):
    """-inf logits are items outside the row's catalog: never drawn, excluded from every count, a
    masked target gets -inf with zero gradient, and no gradient is NaN (the last row has k or
    fewer items left: all of them are drawn). Both leave-one-out paths: all slots, one target."""
    x = _masked_rows(dtype)
    want, want_jac = _enumerated(x, k)
    _assert_close(_exact(x, k), want, dtype, k)
    jac = _jacobian(lambda s: _exact(s, k), x)
    _assert_grad_close(jac, want_jac, dtype, k)
    assert float(jac.masked_select(torch.isinf(x).unsqueeze(1).expand_as(jac)).abs().max()) == 0.0
    for target in range(6):
        targets = torch.full((5, 1), target)
        xg = x.clone().requires_grad_()
        got = _exact(xg, k, targets)
        _assert_close(got, want[:, target:target + 1], dtype, (k, target))
        (grad,) = torch.autograd.grad(got.where(torch.isfinite(got), torch.zeros_like(got)).sum(), xg)
        assert bool(torch.isfinite(grad).all()) and float(grad[torch.isinf(x)].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_items_of_a_mixture_are_absent(dtype):
    """With two experts (block-exact), masking items gives what the catalog without them gives, and
    a target masked under every expert gets -inf with zero gradient; one masked under expert 0
    only can still be drawn by expert 1."""
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(2, 2, 7, generator=gen, dtype=torch.float64) * 2).to(dtype)
    drop = [[1, 4], [0, 5, 6]]
    masked = x.clone()
    for row, items in enumerate(drop):
        masked[row, :, items] = -INF
    xg = masked.clone().requires_grad_()
    got = _exact(xg, 3)
    (grad,) = torch.autograd.grad(got.where(torch.isfinite(got), torch.zeros_like(got)).sum(), xg)
    assert bool(torch.isfinite(grad).all()) and float(grad[torch.isinf(masked)].abs().max()) == 0.0
    for row, items in enumerate(drop):
        keep = [i for i in range(7) if i not in items]
        alone = _exact(x[row:row + 1, :, keep], 3)[0]
        assert bool(torch.isinf(got[row, items]).all())
        _assert_close(got[row, keep], alone, dtype, row)
    one_expert = x.clone()
    one_expert[:, 0, 2] = -INF
    out = _exact(one_expert.requires_grad_(), 3)
    (grad,) = torch.autograd.grad(out.sum(), one_expert)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(grad).all())
    assert float(grad[:, 0, 2].abs().max()) == 0.0


@given(logit_strategy(max_batch=3, max_items=5, min_items=2, dtype=torch.float32),
       st.integers(1, 3), st.sampled_from([0.0, 1e3, -1e4]), st.integers(0, 2**31 - 1))
def test_property_shift_masks_and_float64(x, k, shift, seed):
    """Logits from the library's own strategy (±1e4 extremes, ties) with random -inf masks: float32
    and float64 agree with float64 enumeration of the rounded input, with finite gradients."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(x.shape, generator=gen) < 0.25
    mask[:, 0] = False  # at least one item per row
    x = (x.double() + shift).masked_fill(mask, -INF)
    for dtype in (torch.float32, torch.float64):
        y = x.to(dtype)
        want, want_jac = _enumerated(y, k)
        _assert_close(_exact(y, k), want, dtype, k)
        _assert_grad_close(_jacobian(lambda s: _exact(s, k), y), want_jac, dtype, k)


def _finite_inputs(scores: torch.Tensor):
    """The finite entries of ``scores`` as a leaf, and a function putting them back."""
    keep = torch.isfinite(scores)
    leaf = scores[keep].detach().clone().requires_grad_()
    return leaf, lambda v: scores.detach().masked_scatter(keep, v)


@pytest.mark.parametrize("case", ["one_target", "all_slots", "mixture", "masked", "fft", "tail", "pieces"])
def test_gradgradcheck(case):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 2, 5, generator=gen, dtype=torch.float64) * 2
    targets, runs, settings = torch.tensor([[0, 3, 4], [1, 1, 2]]), [(0, 2)], {}
    if case == "one_target":
        targets = torch.tensor([[3], [0]])
    elif case == "mixture":
        runs = [(0, 1), (1, 2)]
    elif case == "masked":
        x[0, :, 1] = -INF
        x[1, 0, 4] = -INF
        targets = torch.tensor([[1, 3, 0], [4, 2, 2]])
    elif case == "fft":  # K = 14 > 12: the long factors of the product tree go through _FFTConv
        x = torch.randn(1, 1, 20, generator=gen, dtype=torch.float64)
        targets, runs = torch.tensor([[0, 5, 19, 7, 2]]), [(0, 14)]
    elif case == "pieces":
        runs, settings = [(0, 1), (1, 2)], {"memory_budget": 2**17}  # checkpointed, a few pieces per row
    leaf, fill = _finite_inputs(x)
    if case == "tail":
        tail = torch.tensor([[0.3, 0.2, 0.1, 0.0], [-1.0, -1.5, -2.0, -2.5]], dtype=torch.float64)
        tail = tail.unsqueeze(1).expand(-1, 2, -1).contiguous().requires_grad_()

        def fn(v, t):
            s = fill(v)
            return exact_log_inclusion(HeadTail(torch.arange(5).expand(2, -1), s, targets, t, s[..., 0]), runs)

        args = (leaf, tail)
    else:
        def fn(v):
            out = exact_log_inclusion(_summary(fill(v), targets), runs, **settings)
            return out.where(torch.isfinite(out), torch.zeros_like(out))

        args = (leaf,)
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


def test_hessian_vector_product_matches_enumeration():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64) * 2
    weights = torch.rand(3, 5, generator=gen, dtype=torch.float64)
    v = torch.randn(3, 5, generator=gen, dtype=torch.float64)

    def loss(fn):
        def value(s):
            out = fn(s)
            return (weights * out.where(torch.isfinite(out), torch.zeros_like(out))).sum()
        return value

    for k in (1, 2):
        _, got = torch.autograd.functional.hvp(loss(lambda s, k=k: _exact(s, k)), x, v)
        _, want = torch.autograd.functional.hvp(
            loss(lambda s, k=k: inclusion_probs(s.unsqueeze(1), expert_of_position(k, 1)).log()), x, v)
        assert bool(torch.isfinite(got).all()) and torch.allclose(got, want, rtol=0.0, atol=1e-9), (k, got, want)


def test_torch_func_grad():
    """``torch.func.grad`` through the exact method equals autograd (its Functions have
    ``setup_context``; inside torch.func the pieces are not checkpointed, which it refuses)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 6, generator=gen, dtype=torch.float64)
    targets = torch.tensor([[0, 5], [3, 3]])
    for k in (2, 14):  # K = 14: the long factors of the product tree go through _FFTConv
        xk = torch.randn(2, 1, 20, generator=gen, dtype=torch.float64) if k == 14 else x
        runs = expert_runs(k, xk.shape[1])

        def value(s, runs=runs):
            return exact_log_inclusion(_summary(s, targets), runs).sum()

        leaf = xk.clone().requires_grad_()
        (want,) = torch.autograd.grad(value(leaf), leaf)
        assert torch.allclose(torch.func.grad(value)(xk), want, rtol=1e-12, atol=1e-15)


def test_fft_conv_under_vmap_and_grad():
    gen = torch.Generator().manual_seed(4)
    a, b = torch.rand(4, 3, 16, generator=gen, dtype=torch.float64), torch.rand(4, 3, 16, generator=gen,
                                                                             dtype=torch.float64)
    for conj in (False, True):
        batched = torch.func.vmap(lambda u, w, conj=conj: _FFTConv.apply(u, w, 20, conj))(a, b)
        assert torch.allclose(batched, _FFTConv.apply(a, b, 20, conj), rtol=1e-12, atol=1e-14)
        grad = torch.func.grad(lambda u, conj=conj: _FFTConv.apply(u, b, 20, conj).square().sum())(a)
        leaf = a.clone().requires_grad_()
        (want,) = torch.autograd.grad(_FFTConv.apply(leaf, b, 20, conj).square().sum(), leaf)
        assert torch.allclose(grad, want, rtol=1e-12, atol=1e-14)


def _mixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 2, 40, generator=gen, dtype=torch.float64) * torch.tensor([0.3, 1.0, 3.0, 1.0, 1.0, 8.0],
                                                                                   dtype=torch.float64).view(-1, 1, 1)
    x[3, :, :4] += 1e4
    x[4, :, 5:9] = -INF
    x[5, :, 0] = -1e30
    return x, torch.tensor([[0, 7], [39, 39], [2, 3], [0, 20], [5, 6], [0, 1]])


@pytest.mark.parametrize("runs", [[(0, 6)], [(0, 3), (1, 3)]])
def test_memory_budget_does_not_change_the_result(runs):
    """A tiny budget (one row and one node per piece, checkpointed) and the default one agree to
    rounding, values and gradients; so do a row alone and the row inside a batch of other rows."""
    x, targets = _mixed_batch()
    results = []
    for budget in (2**18, 2**20, 2**30):  # a few nodes per piece, tens of nodes, everything at once
        leaf = x.clone().requires_grad_()
        out = exact_log_inclusion(_summary(leaf, targets), runs, memory_budget=budget)
        results.append((out.detach(), torch.autograd.grad(out.where(torch.isfinite(out), out.new_zeros(())).sum(),
                                                         leaf)[0]))
    for out, grad in results[:-1]:
        assert torch.equal(torch.isinf(out), torch.isinf(results[-1][0]))
        assert torch.allclose(out, results[-1][0], rtol=1e-12, atol=1e-14)
        assert torch.allclose(grad, results[-1][1], rtol=1e-10, atol=1e-14)
    whole = results[-1][0]

    def value(s):
        out = exact_log_inclusion(_summary(s, targets), runs, memory_budget=2**18)
        return out.where(torch.isfinite(out), out.new_zeros(())).sum()

    assert torch.allclose(torch.func.grad(value)(x), results[0][1], rtol=1e-12, atol=1e-15)  # not checkpointed
    for row in range(x.shape[0]):
        alone = exact_log_inclusion(_summary(x[row:row + 1], targets[row:row + 1]), runs)
        assert torch.allclose(alone[0], whole[row], rtol=1e-12, atol=1e-14), row


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for backward while ``fn()`` runs (an upper bound: views
    of one storage count once each)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_memory_kept_for_backward_is_bounded_by_the_budget():
    """What autograd keeps grows with B·N (the inputs' size), not with B·N·K·Q: with a 1 MiB budget
    the pieces are recomputed in backward."""
    gen = torch.Generator().manual_seed(1)
    batch, items, k = 16, 300, 12
    x = torch.randn(batch, 1, items, generator=gen).requires_grad_()
    targets = torch.randint(0, items, (batch, 2), generator=gen)
    budget = 2**20
    saved = _saved_bytes(lambda: exact_log_inclusion(_summary(x, targets), [(0, k)], memory_budget=budget))
    assert saved <= 64 * batch * items * x.element_size() + budget, saved


def _kept_storage_bytes(fn) -> int:
    """Bytes of the distinct storages that autograd keeps alive from ``fn()`` (views of one storage counted once)."""
    refs = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    gc.collect()
    live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for r in refs if (t := r()) is not None}
    del out
    return sum(live.values())


def test_a_smaller_budget_never_keeps_more():
    """What a mixture keeps for backward is its inputs, nodes and outputs whatever the budget (found by review: each
    piece's output was kept too, so below a few MiB a smaller budget kept more: 0.26, 0.63 and 0.63 MiB here at 4 MiB,
    256 KiB and 64 KiB; now 0.10 MiB at each)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 200, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 200, (4, 2), generator=gen)
    kept = [_kept_storage_bytes(lambda: exact_log_inclusion(_summary(x, targets), expert_runs(20, 2),
                                                            memory_budget=budget)) for budget in (2**22, 2**18, 2**16)]
    assert kept[1] <= kept[0] and kept[2] <= kept[0], [k / 2**20 for k in kept]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_bytes_in_use() -> int | None:
    """Bytes the C heap has handed out and not taken back (glibc's ``mallinfo2``; None elsewhere): it sees
    every tensor the CPU allocator holds, however autograd or ``torch.utils.checkpoint`` keeps it."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.skipif(_heap_bytes_in_use() is None, reason="needs glibc's mallinfo2 to see the heap")
def test_memory_kept_after_a_mixture_forward_is_bounded_by_the_budget():
    """A mixture's earlier blocks take every slot's leave-one-out count as a derivative inside each piece.
    Under ``torch.utils.checkpoint`` that inner derivative made the forward recompute each piece at once and
    keep all of it until backward: 215 MiB kept at a 1 MiB budget, more than the 114 MiB of no budget. What
    stays in use after the forward now grows with B·M·N and the budget of each block."""
    gen = torch.Generator().manual_seed(3)
    batch, experts, items, k, budget = 8, 4, 600, 40, 2**20
    x = torch.randn(batch, experts, items, generator=gen).requires_grad_()
    targets = torch.randint(0, items, (batch, 1), generator=gen)
    runs = expert_runs(k, experts)
    exact_log_inclusion(_summary(x[:1], targets[:1]), runs, memory_budget=budget)  # caches filled
    gc.collect()
    before = _heap_bytes_in_use()
    out = exact_log_inclusion(_summary(x, targets), runs, memory_budget=budget)
    gc.collect()
    kept = _heap_bytes_in_use() - before
    assert kept <= 64 * x.numel() * x.element_size() + experts * budget, kept / 2**20
    out.sum().backward()
    assert bool(torch.isfinite(x.grad).all())


def test_forward_mode_with_a_budget_that_recomputes_pieces():
    """One expert under ``torch.autograd.forward_ad`` on a leaf that also requires grad, with a budget small
    enough that the pieces would be recomputed in backward: that Function has no jvp (NotImplementedError,
    found by review), so the pieces are kept there; the tangent is the directional derivative."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 1, 50, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 50, (4, 2), generator=gen)

    def value(s):
        return exact_log_inclusion(_summary(s, targets), [(0, 5)], memory_budget=2**10).sum()

    (grad,) = torch.autograd.grad(value(x), x)
    with torch.autograd.forward_ad.dual_level():
        out = value(torch.autograd.forward_ad.make_dual(x, v))
        tangent = torch.autograd.forward_ad.unpack_dual(out).tangent
    torch.testing.assert_close(tangent, (grad * v).sum(), rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize(("num_items", "num_targets"), [(6, 2), (6, 6), (20, 20), (100, 11)])
def test_torch_func_jvp_for_one_expert_with_any_number_of_targets(num_items, num_targets):
    """``torch.func.jvp`` of the one-expert exact method equals the directional derivative from reverse mode (found by
    review: with more than about sqrt(N) targets every slot's probability was taken through a recorded derivative,
    and jvp raised torch's "requires_grad_() ... inside of a function being transformed")."""
    import capg_rec

    gen = torch.Generator().manual_seed(num_items)
    x = torch.randn(2, num_items, generator=gen, dtype=torch.float64)
    v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    items = torch.stack([torch.randperm(num_items, generator=gen)[:num_targets] for _ in range(2)])

    def value(z):
        return capg_rec.inclusion_log_prob(z, items, 3, method="exact")

    _, tangent = torch.func.jvp(value, (x,), (v,))
    leaf = x.clone().requires_grad_()
    out = value(leaf)
    rows = [torch.autograd.grad(out[b, j], leaf, retain_graph=True)[0] for b in range(2) for j in range(num_targets)]
    expected = torch.stack([(g * v).sum() for g in rows]).view(2, num_targets)
    torch.testing.assert_close(tangent, expected, rtol=1e-8, atol=1e-10)


def test_a_tail_alone_needing_gradients_under_a_small_budget():
    """Only the tail's power sums need a gradient, and a row has no tail: under a budget small enough that pieces are
    recomputed in backward, a piece of that row used nothing that needs one, and its backward raised "element 0 of
    tensors does not require grad" (found by review). Now its gradient is zero, as with no budget."""
    gen = torch.Generator().manual_seed(0)
    batch, items = 3, 12
    scores = torch.randn(batch, 1, items, generator=gen)
    tail = torch.randn(batch, 1, 4, generator=gen) - 1.0
    tail[0] = -INF
    targets = torch.randint(0, items, (batch, 2), generator=gen)
    grads = []
    for budget in (2**12, 2**30):
        leaf = tail.clone().requires_grad_()
        summary = HeadTail(torch.arange(items).expand(batch, -1), scores, targets, leaf,
                           torch.full((batch, 1), -INF))
        (grad,) = torch.autograd.grad(exact_log_inclusion(summary, [(0, 4)], memory_budget=budget).sum(), leaf)
        grads.append(grad)
    assert torch.equal(grads[0][0], torch.zeros_like(grads[0][0])) and bool(grads[0][1:].abs().sum() > 0)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_empty_batch_and_no_targets():
    x = torch.randn(0, 1, 5, requires_grad=True)
    out = exact_log_inclusion(_summary(x, torch.zeros(0, 2, dtype=torch.long)), [(0, 2)])
    assert out.shape == (0, 2)
    out.sum().backward()
    assert x.grad.shape == x.shape
    y = torch.randn(3, 1, 5)
    assert exact_log_inclusion(_summary(y, torch.zeros(3, 0, dtype=torch.long)), [(0, 2)]).shape == (3, 0)


def test_bad_memory_budget_raises():
    summary = _summary(torch.randn(1, 1, 5), torch.tensor([[0]]))
    with pytest.raises(TypeError, match="memory_budget"):
        exact_log_inclusion(summary, [(0, 1)], memory_budget=1.5)
    with pytest.raises(ValueError, match="memory_budget"):
        exact_log_inclusion(summary, [(0, 1)], memory_budget=0)


def test_reference_agrees_with_probability_space_enumeration():
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for k in (1, 2, 4):
        def log_pi(s, k=k):
            return inclusion_probs(s.unsqueeze(1), expert_of_position(k, 1)).log()

        want, want_jac = _enumerated(x, k)
        assert torch.allclose(log_pi(x), want, rtol=1e-13, atol=1e-13)
        assert torch.allclose(_jacobian(log_pi, x), want_jac, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype,gaps", [(torch.float64, [1e4, 1e30]), (torch.float32, [1e4, 1e30])])
def test_mixture_item_far_below_the_others(dtype, gaps):
    """Block-exact with few items (the second block's count can stay below k at any g): an item far
    below everything is drawn in the second block exactly when too few of the others are present,
    so its probability tends to a constant as it sinks. At a gap of 60 panels still resolve its
    neighbourhood (the reference integrates the definition adaptively); at 1e4 or 1e30 they cannot,
    and the flat part below the range gives the same constant, with finite gradients."""
    from tests.test_exact import _block_exact_reference

    base = torch.tensor([[[0.3, -0.2, 1.0, 0.0], [0.1, 0.5, -0.4, 0.0]]], dtype=torch.float64)
    near = base.clone()
    near[..., 3] = -60.0
    want = torch.tensor(_block_exact_reference(near[0].numpy(), 3), dtype=torch.float64).log()
    for gap in gaps:
        x = base.clone()
        x[..., 3] = -gap
        x = x.to(dtype).requires_grad_()
        got = _exact(x, 3)
        (grad,) = torch.autograd.grad(got.sum(), x)
        assert bool(torch.isfinite(grad).all())
        assert torch.allclose(got[0].detach().double(), want, rtol=_RTOL[dtype], atol=_RTOL[dtype]), (gap, got, want)


@pytest.mark.parametrize("experts", [1, 2])
def test_exact_beyond_the_head_is_invariant_to_a_logit_offset(experts):
    """Regression (found by review): above 2048 items the rest's power sums were taken on the logits' own scale and
    then recentred, so an offset cancelled their digits: at 1e16 (float64) the result was 1.5e-2 off, and
    logits all rounding to one value (1e30) gave 3 K/N instead of K/N. They are taken relative to each row's best."""
    n, k = 3000, 4
    base = torch.randn(2, experts, n, dtype=torch.float64, generator=torch.Generator().manual_seed(20)) * 2
    items = torch.tensor([[0, 1], [5, 2999]])
    for shift in (1e8, 1e16):
        shifted = (base + shift).requires_grad_()
        reference = (shifted.detach() - shift).requires_grad_()  # the same values, recentred exactly
        got = inclusion_log_prob(shifted, items, k, method="exact")
        want = inclusion_log_prob(reference, items, k, method="exact")
        torch.testing.assert_close(got, want, rtol=1e-9, atol=0)
        g, = torch.autograd.grad(got.sum(), shifted)
        w, = torch.autograd.grad(want.sum(), reference)
        torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-12)
    uniform = torch.full((1, experts, n), 1e30, dtype=torch.float64)  # as zeros: K/N with one expert
    torch.testing.assert_close(inclusion_log_prob(uniform, items[:1], k, method="exact"),
                               inclusion_log_prob(torch.zeros_like(uniform), items[:1], k, method="exact"),
                               rtol=1e-12, atol=0)
    # float32 at an offset of 1e7: within float32's own rounding of the recentred values
    single = (base + 1e7).float()
    torch.testing.assert_close(inclusion_log_prob(single, items, k, method="exact").double(),
                               inclusion_log_prob(single.double() - 1e7, items, k, method="exact"),
                               rtol=0, atol=100 * torch.finfo(torch.float32).eps)


def test_an_expert_that_draws_no_position_changes_nothing():
    """With more experts than candidates (M > K), the experts past K draw no position: their masks changed "exact"'s
    answer (found by review: [0, 0.875, 0.875] for two items certain to be drawn, where every other method gave 1),
    since its every-item-is-drawn shortcut counted their unmasked items."""
    import capg_rec

    ninf = -math.inf
    items = torch.arange(3)[None]
    for drawing in ([[ninf, 0.0, 0.0], [ninf, 0.0, 0.0]], [[ninf, 1.0, 0.0], [ninf, 0.0, 2.0]]):
        two = torch.tensor(drawing, dtype=torch.float64)[None]
        want = capg_rec.inclusion_log_prob(two, items, 2, method="enumerate")
        for unused in ([0.0, 0.0, 0.0], [0.0, ninf, 0.0], [ninf, 0.0, 0.0]):
            logits = torch.tensor([*drawing, unused], dtype=torch.float64)[None]
            got = capg_rec.inclusion_log_prob(logits, items, 2, method="exact")
            torch.testing.assert_close(got.exp(), want.exp(), rtol=0.0, atol=1e-12)
