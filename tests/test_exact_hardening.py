"""The exact inclusion method on every input a user can send: second derivatives (gradgradcheck,
Hessian-vector products against enumeration) and ``torch.func``."""

from __future__ import annotations

import math

import pytest
import torch

from capg_rec._enumerate import inclusion_probs
from capg_rec._exact import _FFTConv, exact_log_inclusion
from capg_rec._head_tail import HeadTail
from capg_rec.plackett_luce import expert_of_position, expert_runs

INF = math.inf


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


def _finite_inputs(scores: torch.Tensor):
    """The finite entries of ``scores`` as a leaf, and a function putting them back."""
    keep = torch.isfinite(scores)
    leaf = scores[keep].detach().clone().requires_grad_()
    return leaf, lambda v: scores.detach().masked_scatter(keep, v)


@pytest.mark.parametrize("case", ["one_target", "all_slots", "mixture", "fft", "tail"])
def test_gradgradcheck(case):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 2, 5, generator=gen, dtype=torch.float64) * 2
    targets, runs, settings = torch.tensor([[0, 3, 4], [1, 1, 2]]), [(0, 2)], {}
    if case == "one_target":
        targets = torch.tensor([[3], [0]])
    elif case == "mixture":
        runs = [(0, 1), (1, 2)]
    elif case == "fft":  # K = 14 > 12: the long factors of the product tree go through _FFTConv
        x = torch.randn(1, 1, 20, generator=gen, dtype=torch.float64)
        targets, runs = torch.tensor([[0, 5, 19, 7, 2]]), [(0, 14)]
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
