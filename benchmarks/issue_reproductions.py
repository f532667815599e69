"""The core-hardening reproductions (one line each), in the API that both this version and the
one before it share, so that a checkout of either can be checked. Prints FIXED or BROKEN per item:

    PYTHONPATH=<checkout> OMP_NUM_THREADS=1 python benchmarks/issue_reproductions.py
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

import capg_rec
from capg_rec import CAPGLoss, EmbeddingCatalog, VPGLoss, inclusion_log_prob, sample_candidates

SWR = "with_replacement" if hasattr(capg_rec, "inclusion_methods") else "swr"  # the earlier name


def _swr_loss(k: int, **kw) -> torch.nn.Module:
    return CAPGLoss(k, method=SWR, **kw)


def shift_log_half() -> bool:
    out = inclusion_log_prob(torch.full((1, 2), 1e4), torch.tensor([[0, 1]]), 1)
    return abs(float(out[0, 0]) - math.log(0.5)) < 1e-5


def shift_sums_to_k() -> bool:
    x = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)) + 1e4
    return abs(float(inclusion_log_prob(x, torch.arange(1000)[None], 10).exp().sum()) - 10) < 1e-3


def hvp_matches_hessian(loss_fn: torch.nn.Module) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=g, dtype=torch.float64)
    cand = sample_candidates(x, 3, generator=g)
    v = torch.arange(16.0, dtype=torch.float64).reshape(2, 8)

    def f(y: torch.Tensor) -> torch.Tensor:
        return loss_fn(y, cand, cand[:, :1], torch.ones(2, 1, dtype=torch.float64))

    _, hv = torch.autograd.functional.hvp(f, x, v)
    full = torch.autograd.functional.hessian(f, x).reshape(16, 16) @ v.reshape(16)
    return bool(hv.abs().max() > 1e-3) and torch.allclose(hv.reshape(16), full, atol=1e-6)


def func_grad() -> bool:
    fn = CAPGLoss(3, validate_args=False)
    grad = torch.func.grad(lambda y: fn(y, torch.tensor([[0, 1, 2]]), torch.tensor([[0]]), torch.ones(1, 1)))(
        torch.randn(1, 6))
    return bool(grad.abs().sum() > 0)


def float16_gradient() -> bool:
    x16 = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float16, requires_grad=True)
    x64 = x16.detach().double().requires_grad_()
    for x in (x16, x64):
        _swr_loss(1)(x, torch.tensor([[0]]), torch.tensor([[0]]), torch.ones(1, 1, dtype=x.dtype)).backward()
    return torch.allclose(x16.grad.double(), x64.grad, atol=2e-3)


def extreme_logits() -> bool:
    """Fixed either way: a probability of ~0, or (since the checks of scores beyond resolution) a ValueError, as the
    second draw must choose among 0, 1 and -1e30, which float32 cannot tell apart 1e30 below the best."""
    x = torch.tensor([[1e30, -1e30, 0.0, 1.0]])
    try:
        return float(inclusion_log_prob(x, torch.tensor([[1]]), 2).exp()) < 1e-6
    except ValueError as err:
        return "below their expert's best score" in str(err) or "beyond resolution" in str(err)


def embedding_overflow_is_an_error() -> bool:
    try:
        EmbeddingCatalog(torch.full((1, 2), 1e20), torch.full((5, 2), 1e20)).log_normalizer()
    except ValueError:
        return True
    return False


def masked_logits_accepted() -> bool:
    x = torch.randn(2, 10)
    x[:, 3] = -math.inf
    x.requires_grad_()
    cand = torch.tensor([[0, 1, 2], [4, 5, 6]])
    CAPGLoss(3)(x, cand, cand[:, :1], torch.ones(2, 1)).backward()
    return bool(torch.isfinite(x.grad).all())


def masked_logits_unchecked() -> bool:
    x = torch.randn(2, 10)
    x[:, 3] = -math.inf
    x.requires_grad_()
    cand = torch.tensor([[0, 1, 2], [4, 5, 6]])
    loss = CAPGLoss(3, validate_args=False)(x, cand, cand[:, :1], torch.ones(2, 1))
    loss.backward()
    return bool(loss != 0) and bool(torch.isfinite(x.grad).all())


def empty_batch() -> bool:
    empty = torch.zeros(0, 3, dtype=torch.long)
    return float(CAPGLoss(3)(torch.randn(0, 10, requires_grad=True), empty, empty[:, :1], torch.zeros(0, 1))) == 0


def compiles_fullgraph() -> bool:
    torch._dynamo.reset()
    x = torch.randn(4, 30, requires_grad=True)
    cand = sample_candidates(x.detach(), 5)
    compiled = torch.compile(CAPGLoss(5, validate_args=False), fullgraph=True, backend="eager")
    return bool(torch.isfinite(compiled(x, cand, cand[:, :2], torch.rand(4, 2))))


def wrong_type_is_a_type_error() -> bool:
    try:
        CAPGLoss(3, validate_args="no")
    except TypeError:
        return True
    return False


CHECKS: list[tuple[str, Callable[[], bool]]] = [
    ("1 mean-field shift invariance: full((1,2),1e4) gives log 1/2", shift_log_half),
    ("1 mean-field probabilities sum to K at +1e4", shift_sums_to_k),
    ("2 hvp through TOP1 matches the Hessian", lambda: hvp_matches_hessian(_swr_loss(3))),
    ("2 hvp through VPG matches the Hessian", lambda: hvp_matches_hessian(VPGLoss(3))),
    ("2 hvp through mean-field CA-PG matches the Hessian", lambda: hvp_matches_hessian(CAPGLoss(3))),
    ("2 hvp through plug-in CA-PG matches the Hessian", lambda: hvp_matches_hessian(CAPGLoss(3, method="plugin"))),
    ("2 torch.func.grad through CA-PG", func_grad),
    ("3 fp16 TOP1(1) gradient agrees with fp64", float16_gradient),
    ("4 one logit at 1e30: mean-field gives ~0 to an item at -1e30", extreme_logits),
    ("4 EmbeddingCatalog whose inner products overflow: ValueError", embedding_overflow_is_an_error),
    ("5 -inf masked logits accepted by the default loss", masked_logits_accepted),
    ("5 masked logits, checks off: finite loss and gradients", masked_logits_unchecked),
    ("6 empty batch through the default loss", empty_batch),
    ("7 default loss compiles with fullgraph (checks off)", compiles_fullgraph),
    ("8 set_default_validate_args", lambda: hasattr(capg_rec, "set_default_validate_args")),
    ("10 capg_rec.functional", lambda: hasattr(capg_rec, "functional")),
    ("11 inclusion methods as objects", lambda: hasattr(capg_rec, "register_inclusion_method")),
    ("12 TypeError for a wrong type", wrong_type_is_a_type_error),
]

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0].rstrip(":") + ".").parse_args()  # --help
    for name, check in CHECKS:
        try:
            ok, why = check(), ""
        except Exception as err:  # a crash is one way of being broken: report it and go on
            ok, why = False, f" [{type(err).__name__}: {str(err)[:60]}]"
        print("FIXED " if ok else "BROKEN", name + why, flush=True)
