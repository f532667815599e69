"""Small log-space helpers shared by the probability code (private)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

T = TypeVar("T")

_LOG_HALF = -math.log(2.0)


def eager_cpu(x: Tensor) -> bool:
    """Whether ``x`` lives on the CPU outside ``torch.compile`` and ``torch.func`` transforms: where a host
    read is no device sync and numpy may run (the CPU fast paths). Under a transform ``x`` itself may be a
    plain tensor while the tensors it meets are batched (vmap over the ids of shared logits): no fast path."""
    return (x.is_cpu and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()
            and not torch._C._functorch.is_functorch_wrapped_tensor(x))


def cumsum(x: Tensor, dim: int) -> Tensor:
    """``torch.cumsum(x, dim)``, except where :func:`refuses_float_cumsum`: there a scan of ``⌈log2 n⌉`` shifted
    additions (Hillis–Steele: the same sums, added in another order; elementwise ops, so neither autocast nor TF32
    matmuls touch them)."""
    if not refuses_float_cumsum(x):
        return torch.cumsum(x, dim)
    x = x.movedim(dim, -1)
    shift = 1
    while shift < x.shape[-1]:
        x = x + torch.nn.functional.pad(x[..., :-shift], (shift, 0))
        shift *= 2
    return x.movedim(-1, dim)


def refuses_float_cumsum(x: Tensor) -> bool:
    """Whether ``torch.cumsum`` of ``x`` raises: a floating CUDA tensor under ``torch.use_deterministic_algorithms``
    (torch has no deterministic float cumsum there)."""
    return x.is_floating_point() and x.device.type == "cuda" and torch.are_deterministic_algorithms_enabled()


def select_experts(x: Tensor, experts: Sequence[int]) -> Tensor:
    """``x[:, experts]`` — a view (no copy) when the experts are consecutive. ``experts`` must be ints in
    ``[0, x.shape[1])`` (a ``TypeError`` / ``ValueError`` naming them otherwise: a slice would silently
    come back empty)."""
    if isinstance(experts, (Tensor, np.ndarray)) and experts.ndim == 1:
        experts = experts.tolist()  # its entries are checked below
    if isinstance(experts, (str, bytes, Tensor, np.ndarray)) or not isinstance(experts, Sequence):
        raise TypeError(f"experts must be a sequence of ints, got {type(experts).__name__}")
    if any(isinstance(m, bool) or not hasattr(m, "__index__") for m in experts):
        raise TypeError(f"experts must be a sequence of ints, got {list(experts)}")
    idx = [operator.index(m) for m in experts]
    if any(not 0 <= m < x.shape[1] for m in idx):
        raise ValueError(f"experts must be in [0, {x.shape[1]}) (the catalog's experts), got {idx}")
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return x[:, idx[0]:idx[0] + len(idx)]
    return x[:, idx]


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate on the whole range (Maechler 2012).

    ``x = 0`` gives ``-inf``; values above 0 are clamped to 0 (rounding noise only).
    """
    x = x.clamp(max=0.0)
    near = x > _LOG_HALF
    # Double-where: each branch only sees inputs where it is finite, so gradients stay finite.
    safe_near = torch.where(near, x, torch.full_like(x, -1.0))
    safe_far = torch.where(near, torch.full_like(x, -1.0), x)
    return torch.where(near, torch.log(-expm1(safe_near)), torch.log1p(-torch.exp(safe_far)))


def masked_logsumexp(x: Tensor, drop: Tensor, dim: int) -> Tensor:
    """``logsumexp`` over the entries where ``drop`` (broadcastable to ``x``) is False; ``-inf`` (with
    zero grad) where every entry is dropped."""
    return filled_logsumexp(x.masked_fill(drop, torch.finfo(x.dtype).min), dim)


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device``'s type where it is on, for the products that score a catalog: they are
    computed in the catalog's own dtype (an autocast region would run them in half precision, with
    ``finfo(float32)`` constants that half precision cannot hold, and unlike their recomputation in a
    backward, which autocast does not reach)."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def exp_floor(dtype: torch.dtype) -> float:
    """Lowest argument worth exponentiating: below it ``exp`` leaves the normal range, where libm
    takes a slow path (~100x) for values that are rounding noise next to the sums they enter."""
    if dtype == torch.float16:
        return -math.inf
    return math.log(torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).tiny) + 1.0


def exp_floored(x: Tensor) -> Tensor:
    """``exp(x)`` with ``x`` raised to :func:`exp_floor` first (for terms of sums dominated by ~1)."""
    return exp_(x.clamp(min=exp_floor(x.dtype)))


_LOG2_E = 1.0 / math.log(2.0)


def exp_floored_(x: Tensor) -> Tensor:
    """:func:`exp_floored` in place. float32 on the CPU goes through ``exp2``: torch's CPU ``exp`` of
    float32 is ~3x slower than ``exp2``, ~1.6x with the multiply (``benchmarks/cpu_kernels.py``). That
    costs a relative error of at most ``|x|·eps`` (1e-5 at the floor), in terms far below the 1 that
    dominates their sums."""
    return exp_(x.clamp_min_(exp_floor(x.dtype)))


def exp_(x: Tensor) -> Tensor:
    """``exp`` in place; float32 on the CPU through ``exp2`` (see :func:`exp_floored_`), whose relative error
    ``|x|·eps`` grows with the argument's magnitude."""
    if x.dtype == torch.float32 and x.is_cpu:
        return x.mul_(_LOG2_E).exp2_()
    return x.exp_()


def expm1(x: Tensor) -> Tensor:
    """``torch.expm1``; under ``torch.compile``, for ``|x| < 1``, Kahan's ``(e^x - 1)·x / log(e^x)`` (within a few
    ulps), since inductor's CPU kernels take ``e^x - 1``, which loses the digits below ``eps`` there (torch 2.13: a
    relative error of 1.4e-3 at ``x = -1e-5`` in float32, and 1 below ``eps``: ``expm1(1e-17)`` gives 0); ``e^x - 1``
    elsewhere, where it loses nothing. Differentiable, with finite gradients in every branch."""
    if not torch.compiler.is_compiling():
        return torch.expm1(x)
    u = torch.exp(x)
    near = (x.abs() < 1) & (u != 1)  # u == 1: x itself (|x| below eps)
    safe = torch.where(near, u, 2.0)  # the quotient on a placeholder elsewhere: finite, and so is its gradient
    return torch.where(u == 1, x, torch.where(near, (safe - 1) * x / torch.log(safe), u - 1))


def expm1_(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``expm1(x)`` into ``out`` (default: in place), without autograd. float32 on the CPU goes through
    numpy's vectorised ``expm1`` (within 2.5 ulp of the float64 value, like torch's, but ~3x faster
    here: ``benchmarks/cpu_kernels.py``); under ``torch.compile``, :func:`expm1`."""
    out = x if out is None else out
    if x.dtype == torch.float32 and out.dtype == torch.float32 and eager_cpu(x) and not (x.is_neg() or out.is_neg()):
        np.expm1(x.detach().numpy(), out=out.detach().numpy())
        return out
    if torch.compiler.is_compiling():
        return out.copy_(expm1(x))
    return torch.expm1(x, out=out)


def bound_once(cls: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Class decorator: a ``cls.apply`` that skips ``Function.apply``'s per-call binding of its arguments
    to ``inspect.signature(forward)`` (~20 µs, as much as a small kernel) when every argument is given
    positionally, outside ``torch.func`` transforms and ``torch.compile`` (which get ``Function.apply``)."""
    generic = cls.apply
    arity = len(inspect.signature(cls.forward).parameters)
    base = super(torch.autograd.Function, cls).apply  # the C apply, bound to cls

    def apply(*args: object) -> object:
        if len(args) != arity or torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return generic(*args)
        return base(*_unwrap_dead_wrappers(args))

    cls.apply = staticmethod(apply)
    return cls


def _unwrap_dead_wrappers(args: tuple) -> tuple:
    """What ``Function.apply`` does to its arguments outside transforms (tensors left over from a
    finished ``torch.func`` transform are unwrapped)."""
    return torch._functorch.utils.unwrap_dead_wrappers(args)


def _softmax_terms(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """``top = max(x)`` (at least the lowest finite value), ``terms = exp_floored(x - top)`` and
    ``total = Σ terms`` along ``dim`` (kept). ``-inf`` entries give floor terms, which add nothing to a
    total >= 1 and which :func:`scaled_terms` turns into exact zeros."""
    top = x.amax(dim=dim, keepdim=True).clamp_min_(torch.finfo(x.dtype).min)
    terms = exp_floored_(x - top)
    return top, terms, terms.sum(dim=dim, keepdim=True)


def _softmax(x: Tensor, dim: int) -> Tensor:
    """``softmax(x)`` along ``dim`` in differentiable ops: exactly 0 (with zero gradient) at ``-inf`` and
    below the exp floor, and on rows with nothing above it."""
    shifted = x - x.detach().amax(dim=dim, keepdim=True).clamp(min=torch.finfo(x.dtype).min)
    terms = torch.exp(torch.where(shifted >= exp_floor(x.dtype), shifted, -math.inf))
    total = terms.sum(dim=dim, keepdim=True)
    return terms / total.masked_fill(total == 0, 1.0)


def scaled_terms(terms: Tensor, scale: Tensor) -> Tensor:
    """``terms * scale`` for ``0 <= terms <= 1`` (floored exps) and a broadcastable ``scale``,
    without subnormal numbers, here or downstream (an x86 slow path): products below
    ``2^p·tiny`` (p = mantissa bits; fp32: 2e-31) become exactly 0, and so do terms at the exp
    floor (``-inf`` entries) whatever the scale; the others move by less than that or by
    ``4·e^floor·|scale|`` (fp32: 1e-37 of the scale).

    Adding and subtracting ``C = max(2^2p·tiny / |scale|, 8·e^floor / eps)`` rounds ``terms`` to
    multiples of ``ulp(C)`` (Sterbenz: the subtraction is exact). When the product is recorded for
    a higher-order backward the rounding would give wrong derivatives (at ``scale = 0`` every term
    rounds to 0), so there only the floor terms are zeroed. float16 (no exp floor, and a normal range
    too narrow for the shift) gets the plain product.
    """
    if terms.dtype == torch.float16:
        return terms * scale
    kept, low, tiny, top = _FLUSH[terms.dtype]
    if torch.is_grad_enabled() and (terms.requires_grad or scale.requires_grad):
        return torch.where(terms >= kept, terms, 0.0) * scale
    shift = low / scale.abs().clamp(min=tiny, max=top)
    return (terms + shift).sub_(shift).mul_(scale)


def _flush_constants(dtype: torch.dtype) -> tuple[float, float, float, float]:
    """:func:`scaled_terms`' constants: the smallest term kept (``2·e^floor``), ``2^2p·tiny``, and the
    scales below and above which the shift stops growing or shrinking."""
    finfo = torch.finfo(dtype)
    floor = math.exp(exp_floor(dtype))
    low = (2 / finfo.eps) ** 2 * finfo.tiny
    return 2 * floor, low, finfo.tiny, low * finfo.eps / (8 * floor)


_FLUSH = {dtype: _flush_constants(dtype) for dtype in (torch.bfloat16, torch.float32, torch.float64)}


@bound_once
class _SoftmaxGrad(torch.autograd.Function):
    """The backward of the Functions below as a Function of its own, so that it is differentiable in
    turn: ``coef · softmax(x) + scatter_add(index, named)`` along ``dim`` → shape of ``x``, where the
    softmax leaves out, if ``rest`` is set, the entries given by ``drop`` or else by ``index`` (:func:`_kept`).

    The forward reuses the floored exps ``terms`` and their ``total`` (> 0); the backward recomputes
    the softmax from ``x`` in differentiable ops.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, coef: Tensor, named: Tensor | None, terms: Tensor, total: Tensor,
                index: Tensor | None, dim: int, rest: bool, drop: Tensor | None) -> Tensor:
        grad = scaled_terms(terms, coef / total)
        if named is None:
            return grad
        if torch._C._functorch.is_batchedtensor(named) and not torch._C._functorch.is_batchedtensor(grad):
            raise RuntimeError("the gradient of a gather-with-rest (the plug-in's) does not run under torch.func.vmap "
                               "over the ids of scores that are not batched themselves: expand the scores over the "
                               "vmapped dimension")
        return grad.scatter_add_(dim, index, named)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:
        x, coef, named, _, _, index, dim, rest, drop = inputs
        ctx.save_for_backward(x, coef, index, drop)
        ctx.dim, ctx.rest, ctx.has_named = dim, rest, named is not None

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, coef, index, drop = ctx.saved_tensors
        dim = ctx.dim
        p = _softmax(_kept(x, index, drop, dim) if ctx.rest else x, dim)
        weighted = grad * p
        mean = weighted.sum(dim=dim, keepdim=True)  # <grad, p>: d/d coef
        grad_named = grad.gather(dim, index) if ctx.has_named else None
        return coef * (weighted - p * mean), mean, grad_named, None, None, None, None, None, None


def _softmax_grad(x: Tensor, coef: Tensor, named: Tensor | None, terms: Tensor, total: Tensor,
                  index: Tensor | None, dim: int, rest: bool, drop: Tensor | None) -> Tensor:
    """:class:`_SoftmaxGrad`, as a node of the graph only when the backward is itself recorded (a
    higher-order gradient); a plain backward skips the node's cost."""
    if torch.is_grad_enabled():
        return _SoftmaxGrad.apply(x, coef, named, terms, total, index, dim, rest, drop)
    return _SoftmaxGrad.forward(x, coef, named, terms, total, index, dim, rest, drop)


def _kept(x: Tensor, index: Tensor, drop: Tensor | None, dim: int) -> Tensor:
    """``x`` with ``-inf`` at the entries left out of a rest: by default those in ``index``; ``drop`` holds
    their positions along ``dim`` (integers; both a scatter into a copy of ``x``) or is an added mask
    broadcastable to ``x`` (floats, 0 or ``-inf``: cheaper where it is shared, e.g. ``[B, 1, N]`` over M
    experts; a CPU masked_fill is 10x slower)."""
    if drop is not None and drop.is_floating_point():
        return x + drop
    return x.scatter(dim, index if drop is None else drop, -math.inf)


@bound_once
class _LogSumExp(torch.autograd.Function):
    """``logsumexp`` of ``x`` (``-inf`` allowed) whose exps are floored (:func:`exp_floored`), so
    confident scores (spreads beyond ~87 in fp32) stay on the fast path; gradient = the (floored)
    softmax, through :class:`_SoftmaxGrad`. Returns ``(out, terms, total)``; the last two are for the
    backward only."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
        top, terms, total = _softmax_terms(x, dim)
        return (top + total.log()).squeeze(dim), terms, total

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        x, dim = inputs
        _, terms, total = output
        ctx.mark_non_differentiable(terms, total)
        ctx.set_materialize_grads(False)  # no [..., N] zeros for the gradients of terms and total
        ctx.save_for_backward(x, terms, total)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, grad: Tensor | None, *_) -> tuple[Tensor | None, None]:
        if grad is None:  # grads are not materialized
            return None, None
        x, terms, total = ctx.saved_tensors
        return _softmax_grad(x, grad.unsqueeze(ctx.dim), None, terms, total, None, ctx.dim, False, None), None


@bound_once
class _LogSoftmaxAt(torch.autograd.Function):
    """``x.gather(dim, index) - logsumexp(x, dim)`` (``-inf`` allowed) as one autograd node, with the
    exps floored as in :class:`_LogSumExp`: the backward is one scaled softmax plus a scatter-add. A
    named ``-inf`` entry gives ``-inf`` and passes no gradient."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, index: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
        top, terms, total = _softmax_terms(x, dim)
        # Shifted first: exact near the top. Out of place: torch 2.11's compile of an in-place update of
        # a saved output gave wrong gradients.
        return (x.gather(dim, index) - top) - total.log(), terms, total

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        x, index, dim = inputs
        out, terms, total = output
        ctx.mark_non_differentiable(terms, total)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, index, out, terms, total)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, grad: Tensor | None, *_) -> tuple[Tensor | None, None, None]:
        if grad is None:
            return None, None, None
        x, index, out, terms, total = ctx.saved_tensors
        grad = grad.masked_fill(out == -math.inf, 0.0)
        coef = grad.sum(dim=ctx.dim, keepdim=True).neg_()
        return _softmax_grad(x, coef, grad, terms, total, index, ctx.dim, False, None), None, None


def log_softmax_at(x: Tensor, index: Tensor, dim: int) -> Tensor:
    """``log_softmax(x, dim).gather(dim, index)`` without the ``[..., N]`` output: e.g. ``x [B, M, N]``,
    ``index [B, M, L]`` → ``[B, M, L]``. ``-inf`` entries of ``x`` are masked: a named one gives
    ``-inf``; none gets a gradient."""
    return _LogSoftmaxAt.apply(x, index, dim)[0]


@bound_once
class _GatherWithRest(torch.autograd.Function):
    """``(x.gather(dim, index), logsumexp of x over the rest)`` (``-inf`` allowed; the rest leaves out the
    entries given by ``drop`` or else by ``index``, :func:`_kept`) as one node, exps floored as in
    :class:`_LogSumExp`; the backward is one scaled softmax in which the entries left out are exact zeros,
    plus a scatter-add."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, index: Tensor, drop: Tensor | None, dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        kept = _kept(x, index, drop, dim)
        top = kept.amax(dim=dim, keepdim=True).clamp_min_(torch.finfo(x.dtype).min)
        terms = exp_floored_(kept.sub_(top))  # in place: one [..., N] buffer
        total = terms.sum(dim=dim, keepdim=True)
        rest = _empty_to_minus_inf((top + total.log()).squeeze(dim))
        # Nothing left (total = N·e^floor): a total of 1 keeps the backward's scale finite, and the
        # floor terms still come out as exact zeros.
        return x.gather(dim, index), rest, terms, total.clamp_min_(1.0)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        x, index, drop, dim = inputs
        named, _, terms, total = output
        ctx.mark_non_differentiable(terms, total)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        ctx.save_for_backward(x, index, drop, named, terms, total)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, grad_named: Tensor | None, grad_rest: Tensor | None, *_) -> tuple[Tensor | None, None, None,
                                                                                           None]:
        if grad_named is None and grad_rest is None:
            return None, None, None, None
        x, index, drop, named, terms, total = ctx.saved_tensors
        if grad_named is not None:
            grad_named = grad_named.masked_fill(named == -math.inf, 0.0)
        coef = torch.zeros_like(total) if grad_rest is None else grad_rest.unsqueeze(ctx.dim)
        return _softmax_grad(x, coef, grad_named, terms, total, index, ctx.dim, True, drop), None, None, None


def gather_with_rest(x: Tensor, index: Tensor, dim: int, drop: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``x.gather(dim, index)`` and the ``logsumexp`` of ``x`` over the entries not dropped (``-inf`` if
    none is left): e.g. ``x [B, M, N]``, ``index [B, M, K]`` → ``[B, M, K]``, ``[B, M]``. ``drop`` gives the
    entries left out of the rest (default: those in ``index``): their positions along ``dim``, or an added
    mask of 0 and ``-inf`` broadcastable to ``x`` (:func:`_kept`). ``-inf`` entries of ``x`` are masked: they
    add nothing and get no gradient."""
    return _GatherWithRest.apply(x, index, drop, dim)[:2]


Runs = tuple[tuple[int, int], ...]


def sequential_log_softmax(x: Tensor, index: Tensor, runs: Runs) -> Tensor:
    """``x_{m(k)}[index_k] - log(Σ_{n ∉ index_{<k}} e^{x_{m(k), n}})``: the log-probability that a Plackett-Luce
    draw takes its k-th item from what the first k - 1 left, under the expert m(k) that draws position k,
    for ``x [B, M, N]`` (``-inf`` masks), ``index [B, K]`` (distinct ids) and ``runs`` the experts' blocks of
    consecutive positions ``((expert, count), ...)`` (:func:`~capg_rec.plackett_luce.expert_runs`) → ``[B, K]``.

    On the CPU (eager, outside ``torch.func``) one node (:class:`_SequentialLogSoftmax`): one pass over ``x``
    forward and one backward, float64 suffix sums over ``[B, K]``; it is exact where every suffix holds more
    than ``2^p`` times the floored exps' worst error (p = mantissa bits), which a host read checks. Else, and
    on other devices, the composite :func:`_sequential_log_softmax`."""
    if index.numel() and eager_cpu(x):
        out, sums = _SequentialLogSoftmax.apply(x, index, runs)[:2]
        floor_error = x.shape[2] * math.exp(exp_floor(x.dtype))
        if float(sums.amin()) >= floor_error / torch.finfo(x.dtype).eps:  # a CPU tensor: no device sync
            return out
    return _sequential_log_softmax(x, index, runs)


def _sequential_log_softmax(x: Tensor, index: Tensor, runs: Runs) -> Tensor:
    """:func:`sequential_log_softmax` in composite differentiable ops (every expert at every position, then
    each position's own), relative to each expert's best score (a constant: shift-invariant in any dtype)."""
    x = x - x.detach().amax(dim=2, keepdim=True).clamp(min=torch.finfo(x.dtype).min)
    named, rest = gather_with_rest(x, index.unsqueeze(1).expand(-1, x.shape[1], -1), 2)
    every = named - reverse_logcumsumexp(torch.cat([named, rest.unsqueeze(2)], 2), 2)[..., :-1]  # [B, M, K]
    every = every.masked_fill(named == -math.inf, -math.inf)  # a masked draw with nothing left: not NaN
    experts = position_index(runs, x.device)
    return every.gather(1, experts.view(1, 1, -1).expand(x.shape[0], 1, -1))[:, 0]


def constant_cache(maxsize: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """``functools.lru_cache`` for a function that builds constant tensors, bypassed inside ``torch.func``
    transforms: a tensor made there can come back wrapped at the transform's level, and a cached one then
    outlived that level (a nested ``torch.func.grad`` failed on its second call). Under ``inference_mode`` the
    tensors are made as normal ones (an inference tensor, cached, could not be saved for a later backward)."""
    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: object) -> T:
            if torch.compiler.is_compiling():  # traced: constants of the graph (Dynamo cannot trace the mode checks,
                return fn(*args)                # and traces through a cache, with a warning that it does)
            if torch._C._are_functorch_transforms_active():
                return fn(*args)
            if torch.is_inference_mode_enabled():
                with torch.inference_mode(False):
                    return cached(*args)
            return cached(*args)

        call.cache_clear = cached.cache_clear
        return call
    return decorate


@constant_cache(maxsize=64)
def position_index(runs: Runs, device: torch.device, of_block: bool = False) -> Tensor:
    """The expert (or, with ``of_block``, the block) of each position ``[K]``; made once per runs and device."""
    return torch.tensor([i if of_block else e for i, (e, n) in enumerate(runs) for _ in range(n)], device=device)


@bound_once
class _SequentialLogSoftmax(torch.autograd.Function):
    """:func:`sequential_log_softmax` on the CPU. Expert m's floored exps ``terms = e^{x - top}``, zeroed at
    the items drawn before its block ends, give its rest ``R_m``; the drawn items' exact float64 exps
    ``e_k`` (each under its own expert) the block's suffix sums ``S_k = R_{m(k)} + Σ_{j ≥ k, j in the block}
    e_j``; the output is ``log e_k - log S_k``. Backward, with ``r_k = g_k / S_k``: ``-terms_m · Σ_{k in m's
    block} r_k`` plus, at each drawn item under its expert, ``g_j - e_j Σ_{k ≤ j in its block} r_k``. A
    higher-order gradient differentiates the composite path instead. Outputs ``(log e - log S, S)``; S is
    for the accuracy check only."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, index: Tensor, runs: Runs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        batch, num_experts, num_items = x.shape
        top = x.amax(dim=2, keepdim=True).clamp_min_(torch.finfo(x.dtype).min)
        terms = exp_floored_(x - top)
        # Each expert's terms zeroed at the items drawn before its block ends: Σ ends ≤ M·K writes per row.
        for (expert, _), end in zip(runs, itertools.accumulate(n for _, n in runs)):
            terms[:, expert].scatter_(1, index[:, :end], 0.0)
        if len(runs) == 1:  # one expert draws all: broadcasts rather than gathers
            (expert, _), = runs
            picked, top_of = x[:, expert].gather(1, index), top[:, expert]
            rest = terms[:, expert].sum(1, keepdim=True)
        else:
            experts = position_index(runs, x.device)
            picked = x.reshape(batch, -1).gather(1, experts * num_items + index)  # each under its own expert
            # index_select, not advanced indexing: ~5x faster on a CPU for a [B, K] result
            top_of, rest = top[:, :, 0].index_select(1, experts), terms.sum(2).index_select(1, experts)
        shifted = picked.double() - top_of.double()  # [B, K]
        named = shifted.exp()
        # The rests summed in x's dtype: a float64 sum of [B, M, N] would convert a copy.
        sums = _block_suffix(named, runs, reverse=True).add_(rest.double())
        return shifted.sub_(sums.log()).to(x.dtype), sums, terms, named

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        x, index, runs = inputs
        _, sums, terms, named = output
        ctx.mark_non_differentiable(sums, terms, named)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, index, sums, terms, named)
        ctx.runs = runs

    @staticmethod
    def backward(ctx, grad: Tensor | None, *_) -> tuple[Tensor | None, None, None]:
        if grad is None:
            return None, None, None
        x, index, sums, terms, named = ctx.saved_tensors
        runs = ctx.runs
        if torch.is_grad_enabled():  # a recorded backward: through the composite path's ops
            with torch.enable_grad():
                out = _sequential_log_softmax(x, index, runs)
            return torch.autograd.grad(out, x, grad, create_graph=True)[0], None, None
        batch, num_experts, num_items = x.shape
        ratio = grad.double() / sums  # S_k >= e_k > 0
        grad_named = (grad.double() - named * _block_suffix(ratio, runs, reverse=False)).to(x.dtype)
        if num_experts == 1:
            grad_x = scaled_terms(terms, ratio.sum(1).neg_().to(x.dtype).view(batch, 1, 1))
            grad_x[:, 0].scatter_add_(1, index, grad_named)
            return grad_x, None, None
        coef = torch.zeros(batch, num_experts, 1, dtype=x.dtype, device=x.device)
        block_sums = torch.stack([r.sum(1) for r in ratio.split([n for _, n in runs], 1)], 1)
        coef[:, [e for e, _ in runs], 0] = block_sums.neg_().to(x.dtype)
        grad_x = scaled_terms(terms, coef).contiguous()  # terms follow x's layout
        experts = position_index(runs, x.device)
        grad_x.view(batch, -1).scatter_add_(1, experts * num_items + index, grad_named)
        return grad_x, None, None


def _block_suffix(x: Tensor, runs: Runs, *, reverse: bool) -> Tensor:
    """Cumulative sums of ``x [B, K]`` within each block of consecutive positions: from the block's end
    (``reverse``) or from its start."""
    sums = [p.flip(1).cumsum(1).flip(1) if reverse else p.cumsum(1) for p in x.split([n for _, n in runs], 1)]
    return torch.cat(sums, 1) if len(sums) > 1 else sums[0]


def filled_logsumexp(x: Tensor, dim: int) -> Tensor:
    """``logsumexp`` of ``x`` whose dropped entries hold the dtype's lowest finite value or ``-inf``;
    ``-inf`` (with zero grad) where all were dropped."""
    return _empty_to_minus_inf(_LogSumExp.apply(x, dim)[0])


def _empty_to_minus_inf(out: Tensor) -> Tensor:
    """A logsumexp over entries that all held the lowest finite value (nothing left) → ``-inf``."""
    return out.masked_fill(out < torch.finfo(out.dtype).min / 2, -math.inf)


def gumbel_like(shape: tuple[int, ...], *, generator: torch.Generator | None, dtype: torch.dtype,
                device: torch.device) -> Tensor:
    """Standard Gumbel(0, 1) noise drawn through an explicit generator."""
    u = torch.rand(shape, generator=generator, dtype=dtype, device=device)
    return u.clamp_min_(torch.finfo(dtype).tiny).log_().neg_().log_().neg_()


def gumbel_group_size(num_items: int, k: int) -> int:
    """:func:`gumbel_top_k`'s default group size, ``√(N/k)``; 1 (no groups) below 4, where the groups' extra
    operations cost more than the noise they save (at N = 128, k = 10 on a CPU: 420 µs against 280 for 128 rows)."""
    size = int(math.sqrt(num_items / k))
    return size if size >= _LEAST_GROUP else 1


_LEAST_GROUP = 4


def gumbel_top_k(scores: Tensor, k: int, *, generator: torch.Generator | None,
                 group_size: int | None = None) -> Tensor:
    """Indices of the k largest ``scores + Gumbel(0, 1)`` along the last dim, best first → ``[..., k]``:
    an exact Plackett-Luce draw of k items without replacement (``-inf`` scores are never drawn
    while finite ones remain).

    Two-level ("top-down") Gumbel-max: the items are split into groups of ``group_size`` (default
    :func:`gumbel_group_size`, ``√(N/k)``); a group's largest perturbed score is Gumbel(logsumexp of the group), so
    the k best groups are drawn first, and only their items get noise, conditioned on their
    group's maximum (a truncated Gumbel; Kool, van Hoof & Welling 2019, appendix B). The k best
    items always lie in the k best groups, so the draw is exact, with ``N/g + k·g`` random
    numbers per row instead of N (and top-k over as many values). The noise is added to the scores relative to
    their row's best (a constant): large scores (all near -1e9, say) would round it away.
    """
    n = scores.shape[-1]
    size = gumbel_group_size(n, k) if group_size is None else group_size
    if size < 2:
        top = scores.amax(dim=-1, keepdim=True)
        return (scores - torch.where(top > -math.inf, top, 0.0) + _gumbel(scores.shape, scores, generator)).topk(
            k, dim=-1).indices
    groups = -(-n // size)
    picked = min(k, groups)
    lead = scores.shape[:-1]
    finfo = torch.finfo(scores.dtype)
    noise = _gumbel((*lead, groups + size * picked), scores, generator)  # one draw: groups, then items
    # Item j·G + i belongs to group i, so group reductions run over a strided dim (vectorised).
    padded = scores if n == groups * size else \
        torch.nn.functional.pad(scores, (0, groups * size - n), value=-math.inf)
    members = padded.view(*lead, size, groups)  # [..., g, G]
    # In-place chains and clamps rather than masks: this is the sampler's hot path. An empty
    # group's key stays at the lowest finite value, below every group that has an item.
    peak = members.amax(dim=-2, keepdim=True).clamp_(min=finfo.min)
    best = peak.amax(dim=-1, keepdim=True)  # [..., 1, 1]: the row's best; the keys are relative to it
    group_max = (members - peak).clamp_(min=exp_floor(scores.dtype)).exp_().sum(dim=-2).log_().add_(
        (peak - best).clamp_(min=finfo.min).squeeze(-2))  # an empty group stays finite below a best beyond 1e31
    top, group = group_max.add_(noise[..., :groups]).topk(picked, dim=-1, sorted=False)  # [..., k']
    perturbed = members.gather(-1, group.unsqueeze(-2).expand(*lead, size, picked)).sub_(best)  # [..., g, k']
    perturbed += noise[..., groups:].view(*lead, size, picked)
    peak = perturbed.amax(dim=-2, keepdim=True).clamp_(min=finfo.min)
    keys = _truncated_keys(perturbed, peak, top.unsqueeze(-2))
    ids = group.unsqueeze(-2) + groups * torch.arange(size, device=scores.device).unsqueeze(-1)  # [..., g, k']
    return ids.flatten(-2).gather(-1, keys.flatten(-2).topk(k, dim=-1).indices)


def _truncated_keys(perturbed: Tensor, peak: Tensor, top: Tensor) -> Tensor:
    """A group's perturbed scores ``x`` (maximum ``peak``) shifted so that their maximum is ``top``, as Gumbels
    truncated there: ``-log(e^-top - e^-peak + e^-x) = top - softplus(top - x + log(1 - e^(x - peak)))``, in
    log-space (absolute accuracy is what a comparison of sampled keys needs). The clamps keep expm1, log and
    softplus off their slow paths (very negative arguments, zero): 1 - e^-40 rounds to 1 even in float64, and the
    others move keys by < e^-86. A -inf item stays -inf."""
    gap = (perturbed - peak).clamp_(min=-40.0).expm1_().neg_().clamp_(min=torch.finfo(perturbed.dtype).tiny).log_()
    shift = gap.add_(top).sub_(perturbed).clamp_(min=exp_floor(perturbed.dtype))
    return top - torch.nn.functional.softplus(shift)


def top_k(x: Tensor, k: int) -> Tensor:
    """Positions of the k largest entries along the last dim, best first → ``[..., k]`` (no gradient).

    Ties are broken by position: among equal values the lower position comes first, and at the k-th
    value the lowest positions are the ones kept (``-inf`` entries tie too; NaN ranks as ``+inf``). On
    CPU tensors outside ``torch.compile`` and ``torch.func`` transforms this runs in numpy (a selection
    then a sort of the k: ``torch.topk`` on the CPU sorts each row serially, 5x slower at k = 50 of
    1000); elsewhere it is ``torch.topk`` with the same ties (:func:`_top_k_torch`)."""
    if 0 < k <= x.shape[-1] and x.numel() and x.dtype in _NUMPY_TOP_K and eager_cpu(x):
        return _top_k_numpy(x.detach().resolve_neg(), k)  # numpy reads no negative bit (a torch._neg_view)
    return _top_k_torch(x, k)


_NUMPY_TOP_K = (torch.float32, torch.float64)


def _top_k_numpy(x: Tensor, k: int) -> Tensor:
    """:func:`top_k` of a CPU tensor: :func:`_top_k_grouped` for float32 rows much longer than k, else
    :func:`_top_k_partition`."""
    n = x.shape[-1]
    pos = _top_k_grouped(x.reshape(-1, n).numpy(), k) if x.dtype == torch.float32 else None
    if pos is None:
        return _top_k_partition(x, k)
    return torch.from_numpy(pos).view(*x.shape[:-1], k)


def _top_k_partition(x: Tensor, k: int) -> Tensor:
    """:func:`top_k` of a CPU tensor: numpy's (vectorised) partition gives each row's k-th value; the
    entries above it, and the lowest positions of those equal to it, are kept; one sort orders the k."""
    n = x.shape[-1]
    a = x.reshape(-1, n).numpy()
    kth = np.partition(a, n - k, axis=1)[:, n - k:n - k + 1]
    kept = a >= kth
    flat = _rows_of(np.flatnonzero(kept), a.shape[0], k, n)
    if flat is None:  # ties at the k-th value: keep the lowest positions
        above, tied = a > kth, a == kth
        kept = above | (tied & (np.cumsum(tied, axis=1) <= k - above.sum(1, keepdims=True)))
        flat = _rows_of(np.flatnonzero(kept), a.shape[0], k, n)
        if flat is None:  # NaN entries
            return _top_k_torch(x, k)
    pos = _descending(a.reshape(-1)[flat], flat - n * np.arange(flat.shape[0]).reshape(-1, 1))
    return torch.from_numpy(pos).view(*x.shape[:-1], k)


def _top_k_grouped(a: np.ndarray, k: int) -> np.ndarray | None:
    """:func:`top_k` of float32 rows ``a [R, n]`` by pruning → ``[R, k]`` positions, or None where it does
    not apply (rows shorter than ``8k``, NaN): the maxima of ``G ≈ 4k`` groups (:func:`_group_maxima`)
    are entries of the row, so the k-th largest of them is at most the row's k-th largest, and
    every entry of the top k is at least it. Only the entries that reach it (typically a few times k)
    are sorted, in one ``(row, value descending)`` key whose stable order puts lower positions first among
    equal values. About 3x faster than the partition at ``k = 10`` of 1000, 10–14x at 10–50 of 10^5
    (``benchmarks/cpu_kernels.py``)."""
    num_rows, n = a.shape
    size = n // (4 * k) if k else 0
    if size < 2 or num_rows == 0:
        return None
    maxima = _group_maxima(a, size)
    if np.isnan(maxima).any():  # NaN ranks first: left to the partition path
        return None
    width = maxima.shape[1]
    bound = np.partition(maxima, width - k, axis=1)[:, width - k:width - k + 1]
    flat = np.flatnonzero(a >= bound)  # increasing: by row, then position
    rows = flat // n
    counts = np.bincount(rows, minlength=num_rows)
    bits = (a.reshape(-1)[flat] + np.float32(0)).view(np.int32)  # -0.0 → +0.0 first: the two are equal
    ordered = bits ^ ((bits >> 31) & np.iinfo(np.int32).max)  # increasing with the value
    key = rows << 32 | (np.iinfo(np.int32).max - ordered.astype(np.int64))  # by row, then value descending
    order = np.argsort(key, kind="stable")
    first = np.cumsum(counts) - counts
    return flat[order[first[:, None] + np.arange(k)]] - n * np.arange(num_rows)[:, None]


def _group_maxima(a: np.ndarray, size: int) -> np.ndarray:
    """The maxima of groups of ``size`` entries of each row of ``a [R, n]``, and the remainder entry by entry →
    ``[R, n // size + n % size]``. Short groups are strided (group i holds entries ``j·G + i``: one reduction
    across the rows of a ``[size, G]`` view, vectorised over the G groups); long ones (:func:`_consecutive_groups`)
    are consecutive (a reduction along rows, in torch's kernel: 1.8–4.7x faster there, at k = 10 and 50 of 16,384
    and 10^5 items; ``benchmarks/cpu_kernels.py``)."""
    num_rows, n = a.shape
    groups = n // size
    whole = a[:, :groups * size]
    if _consecutive_groups(n, size):
        maxima = torch.from_numpy(whole).reshape(num_rows, groups, size).amax(2).numpy()
    else:
        maxima = whole.reshape(num_rows, size, groups).max(axis=1)
    return np.concatenate([maxima, a[:, groups * size:]], axis=1) if groups * size < n else maxima


def _consecutive_groups(n: int, size: int) -> bool:
    """Whether :func:`_group_maxima` takes consecutive groups: of at least 128 entries in rows of up to 2^14 (that
    stay in a core's cache), of at least 400 in longer rows (measured crossovers on a 2-core x86 machine)."""
    return size >= (128 if n <= 1 << 14 else 400)


def _rows_of(flat: np.ndarray, num_rows: int, k: int, n: int) -> np.ndarray | None:
    """Increasing flat positions in ``[R, n]`` as ``[R, k]``, or None unless every row holds exactly k."""
    if flat.size != num_rows * k:
        return None
    flat = flat.reshape(num_rows, k)
    row = np.arange(num_rows)  # a row with fewer than k would put a neighbour's entry at one of its ends
    return flat if np.array_equal(flat[:, 0] // n, row) and np.array_equal(flat[:, -1] // n, row) else None


def _descending(values: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``pos [R, k]`` (increasing along each row) reordered by ``values [R, k]`` descending, ties in
    increasing position. float32 values and positions below 2^31 pack into one int64 key whose plain
    sort (vectorised) is the order; otherwise a stable argsort."""
    key_type = np.int32 if values.dtype == np.float32 else np.int64
    bits = (values + values.dtype.type(0)).view(key_type)  # -0.0 → +0.0 first: the two are equal
    ordered = bits ^ ((bits >> (8 * bits.itemsize - 1)) & np.iinfo(key_type).max)  # increasing with the value
    if key_type is np.int64 or pos.shape[1] and pos[:, -1].max() >= 2**31:
        return np.take_along_axis(pos, np.argsort(~ordered, axis=1, kind="stable"), 1)
    key = (~ordered).astype(np.int64) << 32 | pos
    key.sort(axis=1)
    return key & 0xFFFFFFFF


def _top_k_torch(x: Tensor, k: int) -> Tensor:
    """:func:`top_k` in torch ops (any device, no host sync): ``torch.topk`` gives the k-th value, the
    entries kept are chosen as in :func:`_top_k_numpy`, and a stable sort orders them."""
    if k == 0:
        return torch.zeros((*x.shape[:-1], 0), dtype=torch.long, device=x.device)
    with torch.no_grad():
        n = x.shape[-1]
        x = x.nan_to_num(nan=math.inf, posinf=math.inf)  # NaN ranks as +inf (first), as in torch.topk
        kth = x.topk(k, dim=-1).values[..., -1:]
        above, tied = x > kth, x == kth
        kept = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
        rank = torch.arange(n, 0, -1, device=x.device)  # larger for lower positions
        pos = torch.where(kept, rank, 0).topk(k, dim=-1).indices  # the kept, in increasing position
        order = x.gather(-1, pos).sort(dim=-1, descending=True, stable=True).indices
        return pos.gather(-1, order)


def _gumbel(shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    return gumbel_like(tuple(shape), generator=generator, dtype=like.dtype, device=like.device)


def log1mexp_exp(y: Tensor) -> Tensor:
    """``log(1 - exp(-exp(y)))``: e.g. the log-probability that a Gumbel clock has rung.

    Stays accurate for very negative ``y`` (where the value is about ``y``) and for large ``y``
    (where it is about ``-exp(-exp(y))``).
    """
    small = y < -10.0
    y_small = torch.where(small, y, torch.full_like(y, -20.0))
    y_big = torch.where(small, torch.zeros_like(y), y).clamp(max=30.0)  # beyond 30 the value is 0
    return torch.where(small, y_small - 0.5 * torch.exp(y_small), log1mexp(-torch.exp(y_big)))


def safe_logsumexp(x: Tensor, dim: int) -> Tensor:
    """``torch.logsumexp`` whose value and gradients (all orders) stay NaN-free when every entry
    along ``dim`` is ``-inf`` (a masked item's terms): then ``-inf`` with zero gradient. (``-inf`` is
    held at the lowest finite value, whose terms vanish next to any finite one and whose clamp passes
    no gradient.) A NaN entry gives NaN, as in ``torch.logsumexp``."""
    lowest = torch.finfo(x.dtype).min
    out = torch.logsumexp(x.clamp_min(lowest), dim=dim)
    return torch.where(out <= lowest / 2, -math.inf, out)


def _log_total(total: Tensor, top: Tensor) -> Tensor:
    """``log(total) + top`` for a sum of exps relative to its largest term (``total >= 1``), or of none
    (``total = 0``: ``-inf``, with zero gradient where the plain log would give NaN)."""
    return torch.where(total > 0, total.clamp_min(torch.finfo(total.dtype).tiny).log() + top, -math.inf)


_CUMSUM_SPREAD = 300.0
"""Spread within which :func:`reverse_logcumsumexp` sums float64 exps: a suffix total is then at least e^-300, whose
square, in the double backward of its log (``-g / total²``), stays far above float64's underflow (at 700 it did not:
second derivatives were inf or NaN beyond ~354 nats)."""
_PAIRS = 1 << 24  # entries of one slice of _ReverseLogCumSumExp's [..., K, K] triangle (64 MiB in float32)


def reverse_logcumsumexp(x: Tensor, dim: int) -> Tensor:
    """``log Σ_{j ≥ k} exp(x_j)`` along ``dim`` (e.g. ``[B, M, K]``, small K); ``-inf`` entries (masked)
    add nothing, a suffix of them alone gives ``-inf``, and no gradient is NaN.

    On the CPU, ``torch.logcumsumexp`` is a serial log-add per element (1.9 ms fwd+bwd at
    ``[128, 1, 200]``); when every finite entry lies within :data:`_CUMSUM_SPREAD` of its row's maximum, a float64
    suffix sum of ``exp(x - max)`` is exact to float32 and ~10x faster. Otherwise (extreme spreads), on other
    devices, under ``torch.compile`` and under ``torch.func`` transforms, it is :class:`_ReverseLogCumSumExp`."""
    if x.numel() and eager_cpu(x):  # no host read under vmap/grad
        top = x.detach().amax(dim=dim, keepdim=True).nan_to_num_(neginf=0.0)
        shifted = x.double() - top  # -inf (masked) stays -inf: a term 0 with zero gradient
        spread = shifted.detach().nan_to_num(neginf=0.0).amin()  # over the finite entries
        if float(spread) > -_CUMSUM_SPREAD:  # a host read of a CPU tensor: no device sync
            return _log_total(shifted.exp().flip(dim).cumsum(dim).flip(dim), top).to(x.dtype)
    return _ReverseLogCumSumExp.apply(x, dim)


@bound_once
class _ReverseLogCumSumExp(torch.autograd.Function):
    """``torch.logcumsumexp`` along ``dim``, reversed, with a backward of its own. torch's backward takes
    the log of the incoming gradient, so its second derivatives are NaN wherever that gradient is 0 (e.g.
    at a position sliced off afterwards). Here a plain backward is ``grad_j = Σ_{k ≤ j} g_k e^{x_j - out_k}``
    in log space and float64 (torch's, made exact at wide spreads), and a recorded one (a higher-order
    gradient, or under ``torch.func``) is ``Σ_k g_k softmax_k`` over the ``[K, K]`` upper triangle in
    differentiable ops, in slices of at most ``_PAIRS`` entries."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, dim: int) -> Tensor:
        lowest = torch.finfo(x.dtype).min  # torch.logcumsumexp's own gradient is NaN at -inf
        out = torch.logcumsumexp(torch.where(x > -math.inf, x, lowest).flip(dim), dim).flip(dim)
        return torch.where(out > lowest / 2, out, -math.inf)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:
        x, dim = inputs
        ctx.save_for_backward(x, output)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        x, out = ctx.saved_tensors
        if torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
            return _reverse_logcumsumexp_grad_pairs(x, grad, ctx.dim), None
        x64, out64 = x.double(), out.double().masked_fill(out == -math.inf, 0.0)  # such suffixes hold no x
        pos, neg = (torch.exp(x64 + torch.logcumsumexp(torch.where(g > 0, g.log(), -math.inf) - out64, ctx.dim))
                    for g in (grad.double(), -grad.double()))
        return (pos - neg).to(x.dtype), None


def _reverse_logcumsumexp_grad_pairs(x: Tensor, grad: Tensor, dim: int) -> Tensor:
    """``Σ_k grad_k · softmax(x_{j ≥ k})_j`` along ``dim`` in differentiable ops (the gradient of
    :class:`_ReverseLogCumSumExp` for a higher-order backward)."""
    x, grad = x.movedim(dim, -1), grad.movedim(dim, -1)
    size = x.shape[-1]
    pos = torch.arange(size, device=x.device)
    step = max(1, _PAIRS // max(1, x.numel()))  # positions per slice: [..., step, K] entries at most _PAIRS
    total = torch.zeros_like(x)
    for start in range(0, size, step):
        later = pos >= pos[start:start + step].unsqueeze(1)  # [step, K]: j >= k
        p = _softmax(x.unsqueeze(-2).masked_fill(~later, -math.inf), -1)  # [..., step, K]
        total = total + (grad[..., start:start + step].unsqueeze(-1) * p).sum(-2)
    return total.movedim(-1, dim)


def safe_logaddexp(a: Tensor, b: Tensor) -> Tensor:
    """``torch.logaddexp`` whose second derivatives are right (torch's are not where an argument is
    ``-inf``, nor where the two are far apart) and whose gradients stay NaN-free when both are ``-inf``."""
    top = torch.maximum(a, b).detach().nan_to_num(neginf=0.0)
    return _log_total(torch.exp(a - top) + torch.exp(b - top), top)
