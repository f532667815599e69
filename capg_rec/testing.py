"""Test helpers for users' own suites: Hypothesis strategies and a validation assertion.

Strategies return Hypothesis ``SearchStrategy`` objects; Hypothesis is imported only when a
strategy is built, so this module imports without it. Tensors are built from drawn values or
from a drawn seed through an explicit ``torch.Generator`` (never global random state), so a
failing example replays exactly.

    from hypothesis import given
    from capg_rec.testing import esr_cases

    @given(esr_cases(max_items=6))
    def test_my_sampler(case):
        logits, k, tau, seed = case
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from capg_rec._checks import check_count, check_flag, check_positive
from capg_rec.validate import ESR, ValidationReport, validate_esr

__all__ = ["count_host_syncs", "EXTREME_LOGIT", "logits", "num_candidates", "num_experts", "temperatures", "seeds",
           "contexts", "esr_cases", "assert_esr_valid"]

EXTREME_LOGIT = 1e4
"""Magnitude of the extreme logits :func:`logits` mixes in (``±1e4``)."""


def _st():
    try:
        from hypothesis import strategies
    except ImportError as err:
        raise ImportError("capg_rec.testing strategies need Hypothesis: pip install hypothesis "
                          "(or pip install 'capg-rec[test]')") from err
    return strategies


def logits(*, max_batch: int = 3, max_experts: int = 1, min_items: int = 1, max_items: int = 8,
           scale: float = 5.0, extreme: bool = True, ties: bool = True, masked: bool = False,
           dtype: torch.dtype = torch.float32):
    """Logits ``[B, N]`` (``max_experts == 1``) or ``[B, M, N]``, with ``1 ≤ B ≤ max_batch``.

    Values are numbers of ``dtype`` in ``[-scale, scale]`` (drawn as float32 numbers within the largest number
    that both float32 and ``dtype`` hold at most ``scale``: rounded to ``dtype`` they stay within it); with
    ``extreme`` many are ``±EXTREME_LOGIT`` (as ``dtype`` holds it: ±9984 in bfloat16), and a row's scores under an
    expert are often shifted together by ``±EXTREME_LOGIT`` (then rounded to ``dtype``): distinct scores far from
    0, which no probability may tell from the unshifted ones but by rounding; with ``ties`` many entries repeat a
    small drawn pool of values; with ``masked`` some items of a row are ``-inf`` under every expert (masked out of
    that row's catalog), at least ``min_items`` of each row staying unmasked.
    """
    st = _st()
    check_count("max_batch", max_batch)
    check_count("max_experts", max_experts)
    check_count("min_items", min_items)
    check_count("max_items", max_items, low=min_items)
    check_positive("scale", scale)
    extreme, ties, masked = (check_flag(n, v) for n, v in (("extreme", extreme), ("ties", ties), ("masked", masked)))
    bound = _at_most(scale, _floating_dtype(dtype))

    @st.composite
    def build(draw) -> Tensor:
        batch = draw(st.integers(1, max_batch))
        experts = draw(st.integers(1, max_experts))
        items = draw(st.integers(min_items, max_items))
        element = st.floats(-bound, bound, allow_nan=False, allow_infinity=False, allow_subnormal=False,
                            width=32)
        if extreme:
            element = st.one_of(element, element, element, st.sampled_from([-EXTREME_LOGIT, EXTREME_LOGIT]))
        if ties:
            pool = draw(st.lists(element, min_size=1, max_size=3))
            element = st.one_of(element, st.sampled_from(pool))
        shape = (batch, items) if max_experts == 1 else (batch, experts, items)
        size = batch * experts * items
        values = draw(st.lists(element, min_size=size, max_size=size))
        out = torch.tensor(values, dtype=torch.float32).reshape(batch, experts, items)
        if extreme:  # a constant shift of a row's scores under an expert: each (row, expert) its own
            shifts = st.sampled_from([0.0, 0.0, EXTREME_LOGIT, -EXTREME_LOGIT])
            out = out + torch.tensor(draw(st.lists(shifts, min_size=batch * experts, max_size=batch * experts)),
                                     dtype=torch.float32).reshape(batch, experts, 1)
        out = out.to(dtype)
        if masked:
            keep = torch.tensor(draw(st.lists(st.booleans(), min_size=batch * items, max_size=batch * items)))
            keep = keep.reshape(batch, items)
            keep[:, :min_items] = True  # at least min_items unmasked, anywhere in the row
            order = torch.tensor(draw(st.permutations(range(items))))
            out = out.masked_fill(~keep[:, order].unsqueeze(1), -torch.inf)
        return out.reshape(shape)

    return build()


def _floating_dtype(dtype: object) -> torch.dtype:
    """``dtype`` itself: a floating ``torch.dtype`` (a ``TypeError`` naming ``dtype`` otherwise)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def _float32_at_most(value: float) -> float:
    """The largest float32 number that is at most ``value`` (> 0)."""
    rounded = np.float32(min(value, float(np.finfo(np.float32).max)))
    return float(rounded if float(rounded) <= value else np.nextafter(rounded, np.float32(0)))


def _at_most(value: float, dtype: torch.dtype) -> float:
    """The largest float32 number at most ``value`` (> 0) that ``dtype`` holds too: a float32 number within it
    stays within it when rounded to ``dtype`` (rounding is monotone and leaves the bound as it is)."""
    bound = _float32_at_most(min(value, torch.finfo(dtype).max))
    if dtype == torch.float16:
        rounded = np.float16(bound)
        return float(rounded if float(rounded) <= bound else np.nextafter(rounded, np.float16(0)))
    if dtype == torch.bfloat16:  # a float32 with its low 16 bits cleared: truncated towards 0
        return float((np.array(bound, np.float32).view(np.int32) & np.int32(-65536)).view(np.float32))
    return bound


def num_candidates(num_items: int):
    """K with ``1 ≤ K ≤ num_items``."""
    return _st().integers(1, check_count("num_items", num_items))


def num_experts(max_experts: int = 4):
    """M with ``1 ≤ M ≤ max_experts``."""
    return _st().integers(1, check_count("max_experts", max_experts))


def temperatures(low: float = 0.05, high: float = 5.0):
    """τ in ``[low, high]``, including both ends and 1."""
    st = _st()
    low, high = check_positive("low", low), check_positive("high", high)
    if high < low:
        raise ValueError(f"high must be >= low={low}, got {high}")
    ends = sorted({x for x in (low, 1.0, high) if low <= x <= high})
    return st.one_of(st.sampled_from(ends), st.floats(low, high))


def seeds():
    """A seed for an explicit ``torch.Generator`` / ``numpy.random.default_rng``."""
    return _st().integers(0, 2**32 - 1)


def contexts(*, max_batch: int = 4, dim: int = 8, scale: float = 1.0, dtype: torch.dtype = torch.float32):
    """Context features ``[B, dim]`` (standard normal × ``scale``, from a drawn seed)."""
    st = _st()
    check_count("max_batch", max_batch)
    check_count("dim", dim)
    check_positive("scale", scale)
    dtype = _floating_dtype(dtype)

    @st.composite
    def build(draw) -> Tensor:
        batch = draw(st.integers(1, max_batch))
        g = torch.Generator().manual_seed(draw(seeds()))
        return scale * torch.randn(batch, dim, generator=g, dtype=dtype)

    return build()


def esr_cases(*, max_batch: int = 3, max_experts: int = 1, min_items: int = 1, max_items: int = 8,
              extreme: bool = True, ties: bool = True, masked: bool = False, dtype: torch.dtype = torch.float32):
    """``(logits, K, τ, seed)`` with ``K`` at most each row's unmasked items: a complete PL(-MoE)
    problem to test against (logits of ``dtype``, as :func:`logits` draws them), whose draw of K need not tell
    apart scores ``logits / τ`` beyond their resolution (:func:`~capg_rec.plackett_luce.unresolved_draws`: the
    checks refuse such draws)."""
    st = _st()
    cases = logits(max_batch=max_batch, max_experts=max_experts, min_items=min_items, max_items=max_items,
                   extreme=extreme, ties=ties, masked=masked, dtype=dtype)  # arguments checked here, not when drawn

    @st.composite
    def build(draw) -> tuple[Tensor, int, float, int]:
        from capg_rec.catalog import DenseCatalog
        from capg_rec.plackett_luce import unresolved_draws

        x = draw(cases)
        tau = draw(temperatures())
        available = int((x > -torch.inf).sum(-1).min())
        scores = DenseCatalog(x, tau, validate_args=False)
        ks = [k for k in range(1, available + 1) if not unresolved_draws(scores, k, ordered=True).any()]
        return x, draw(st.sampled_from(ks)), tau, draw(seeds())

    return build()


def assert_esr_valid(esr: ESR, contexts: Any = None, *, num_samples: int = 20_000, alpha: float = 1e-4,
                     seed: int = 0, **kwargs: Any) -> ValidationReport:
    """Run :func:`~capg_rec.validate.validate_esr` and raise ``AssertionError`` with the report
    if it fails; returns the report. Choose ``alpha`` below 1 / (number of such assertions in the
    suite) so that a correct ESR fails the suite rarely; fix ``seed`` so that it never flakes."""
    report = validate_esr(esr, contexts, num_samples=num_samples, alpha=alpha, seed=seed, **kwargs)
    if not report.passed:
        raise AssertionError(f"ESR claims disagree with its samples:\n{report}")
    return report


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """Within the block, record every call of the Tensor methods through which Python reads values back to the
    host: ``.item()``, ``.tolist()``, ``.numpy()``, ``bool(t)``, ``int(t)``, ``float(t)`` and ``t.__index__()``
    (e.g. ``range(t)``). E.g. assert that a step with checks off makes none of them.

        with count_host_syncs() as calls:
            loss_fn(logits, candidates, chosen, rewards)
        assert calls == []

    Only these Python entry points are seen: an op whose own C++ code waits for a device (``x.cpu()``,
    ``torch.nonzero``, boolean indexing, a size given as a tensor, ``torch.unique`` ...) is not. On a GPU, run the
    block under ``torch.cuda.set_sync_debug_mode("error")`` as well, which catches those too.
    """
    calls: list[str] = []
    names = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"]
    saved = {name: getattr(torch.Tensor, name) for name in names}
    own = {name for name in names if name in vars(torch.Tensor)}  # the others are inherited: deleted afterwards

    def counted(name: str):
        def call(self, *args, **kwargs):
            calls.append(name)
            return saved[name](self, *args, **kwargs)
        return call

    for name in names:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield calls
    finally:
        for name, method in saved.items():
            if name in own:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)
