"""Catalog scores: what the estimators need from the catalog, for any placement of it.

Every estimator in capg_rec touches the catalog only through a :class:`CatalogScores` object,
which exposes the scaled scores ``s[b, m, n] = logit_m(x_b, n) / τ`` (B contexts, M experts,
N items) through three reductions that can be computed block by block and combined:

* :meth:`~CatalogScores.gather`: the scores of a few named items (differentiable),
* :meth:`~CatalogScores.log_power_sums`: ``log Σ_{n ∉ exclude} exp(p · s[b, m, n])`` for
  ``p = 1..P`` (differentiable; ``p = 1`` is the softmax normalizer),
* :meth:`~CatalogScores.top_items`: the ids of the k best items, optionally after Gumbel
  perturbation (no gradient; this is also the sampler),

and two combinations of the first two that a placement may fuse: :meth:`~CatalogScores.log_softmax`
of named items and :meth:`~CatalogScores.gather_with_rest` (their scores and the mass of the rest).

Two placements live here: :class:`DenseCatalog` (a logits tensor) and :class:`EmbeddingCatalog`
(user and item embeddings scored chunk by chunk, recomputed in backward, so memory stays
``O(B·M·chunk)``). The TorchRec integration adds a third, whose item rows are sharded over ranks.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from capg_rec._checks import _memory_order, all_finite, check_count, check_flag, check_float_tensor, check_id_tensor, \
    check_items, check_positive, check_same_device, resolve_validate_args
from capg_rec._numerics import (bound_once, eager_cpu, exp_floored, filled_logsumexp, gather_with_rest, gumbel_like,
                               gumbel_top_k, log_softmax_at, no_autocast, scaled_terms, select_experts, top_k)

__all__ = ["CatalogScores", "DenseCatalog", "EmbeddingCatalog", "as_catalog"]


class CatalogScores(abc.ABC):
    """Scaled scores ``s[b, m, n]`` of N items under M experts for B contexts (abstract).

    Implementations must provide the attributes ``batch_size``, ``num_experts``, ``num_items``,
    ``dtype``, ``device`` and the three reductions below. Item ids are global catalog ids in
    ``[0, num_items)``; an ``exclude`` tensor ``[B, E]`` may be padded with ``-1``. A score of
    ``-inf`` marks an item outside a row's catalog (masked): it is never drawn, has probability
    0 and gets no gradient. ``dtype`` is the compute dtype: float32 for half-precision inputs.

    Shape:
        - :meth:`gather`, :meth:`log_softmax`: ``items [B, L]`` → ``[B, M, L]``
        - :meth:`log_power_sums`: ``exclude [B, E]`` (or None) → ``[B, M, P]``; :meth:`log_normalizer` → ``[B, M]``
        - :meth:`top_items`: ``k`` → ids ``[B, M', k]`` (M' = ``len(experts)``, else M)

    Example:
        >>> catalog = capg_rec.DenseCatalog(torch.randn(4, 100))      # a CatalogScores: B = 4, M = 1, N = 100
        >>> catalog.log_power_sums(num_powers=2).shape
        torch.Size([4, 1, 2])
    """

    batch_size: int
    num_experts: int
    num_items: int
    dtype: torch.dtype
    device: torch.device

    @abc.abstractmethod
    def gather(self, items: Tensor) -> Tensor:
        """Scores of named items: ``items [B, L]`` → ``[B, M, L]`` (differentiable)."""

    @abc.abstractmethod
    def log_power_sums(self, exclude: Tensor | None = None, num_powers: int = 1) -> Tensor:
        """``log Σ_{n ∉ exclude[b]} exp(p · s[b, m, n])`` for ``p = 1..P`` → ``[B, M, P]``.

        Differentiable. A row whose items are all excluded gives ``-inf``.
        """

    @abc.abstractmethod
    def top_items(self, k: int, *, experts: Sequence[int] | None = None, exclude: Tensor | None = None,
                  generator: torch.Generator | None = None, perturb: bool = False) -> Tensor:
        """Ids of the k highest scores per row and expert → ``[B, len(experts), k]``, best first.

        With ``perturb=True`` fresh Gumbel(0, 1) noise (drawn through ``generator``) is added
        to the scores first, which makes the result an exact Plackett-Luce draw of k items.
        ``k`` is at most ``num_items`` (ValueError otherwise); excluded items are never returned while at
        least k are left in the row (not checked: a host read), else they fill its last slots. No gradient.
        """

    _source_dtypes: tuple[torch.dtype, ...] = ()
    """The dtypes of the tensors the scores were computed from, where they differ from :attr:`dtype` (float16
    logits scored in float32), set by the placements that take such tensors."""

    @property
    def _gradient_dtype(self) -> torch.dtype:
        """The narrowest dtype the scores' gradients reach: the off-policy losses cap their weights so that gradients
        stay finite there."""
        return narrowest(self.dtype, *self._source_dtypes)

    def agree(self, passed: Tensor) -> Tensor:
        """Input checks' results ``passed [C]`` (bool) → True where a check passed in every process that
        shares this catalog, so that all of them raise or none does (default: one process)."""
        return passed

    def _stack_batches(self, x: Tensor) -> Tensor:
        """``x`` of every process whose batch makes one global batch with this one (the processes that share a
        sharded catalog, in rank order) → ``[W, *x.shape]``, without gradient: for statistics of the global batch,
        such as the self-normalised weights' mean (default: one process, ``[1, *x.shape]``)."""
        return x.unsqueeze(0)

    def _vouch(self, name: str, items: Tensor) -> tuple[Tensor | bool, str] | None:
        """For the losses' checks: whether this process's catalog can score every id of ``items [B, L]``
        (valid ids; a local check, no collective) and the message if not; None when it can score any
        (the default). A placement that holds only some rows (TorchRec's sampled mode) answers here, so
        that the answer joins the checks' one :meth:`agree`."""
        return None

    def _every_score(self) -> Tensor:
        """Every item's scores ``[B, M, N]`` (:func:`every_score`; default: :meth:`gather` of every id in every row,
        outside :meth:`_trusting`: nobody vouched for the whole catalog). A placement that can score the whole
        catalog in fewer operations (one product) gives the same values here."""
        everything = torch.arange(self.num_items, device=self.device).expand(self.batch_size, -1)
        with self._trusting(False):
            return self.gather(everything)

    validate = False  # whether the value checks are on (each placement sets its own)
    _trusted = False  # inside :meth:`_trusting`
    _whole_in_one_product = False  # :meth:`_every_score` is one product (small catalogs are then read whole)
    _lookup_refuses_bad_ids = True  # on the CPU, torch's lookup (gather, index_select) raises for an id out of range

    @contextlib.contextmanager
    def _trusting(self, trust: bool = True) -> Iterator[None]:
        """A context in which :meth:`gather` skips checks of its own (collective ones included): for a call site
        that every process runs alike, with ids checked otherwise (:meth:`_vouch`'d into an agreement, or the
        catalog's own :meth:`top_items`). ``trust=False`` takes the checks again inside such a context (for ids
        nobody vouched for: :func:`every_score`). Default: :attr:`_trusted` for the time of the context."""
        self._trusted, before = trust, self._trusted
        try:
            yield
        finally:
            self._trusted = before

    def _named(self, items: Tensor, name: str = "items") -> Tensor:
        """``items [B, L]`` checked for its type and shape (a ``[1, L]`` would score the first row alone) and, with
        the checks on outside :meth:`_trusting`, for ids in range where a lookup does not refuse them at no cost:
        off the CPU (an index out of range is a device-side assert there); on the CPU :func:`ids_in_range` turns the
        lookup's own error into a ``ValueError``."""
        items = check_id_tensor(name, items, batch_size=self.batch_size, allow_empty=True)
        check_same_device(self.device, **{name: items})  # a CPU gather reads ids on the meta device as garbage
        free = self._lookup_refuses_bad_ids and self.device.type == "cpu"  # where the lookup runs
        if self.validate and not self._trusted and not free and items.numel():
            check_items(name, items, batch_size=self.batch_size, num_items=self.num_items, unique=False)
        return items

    def _exclusions(self, exclude: object) -> Tensor | None:
        """``exclude [B, E]`` (or None) checked for its type and shape and, with the checks on outside
        :meth:`_trusting`, for ids in ``[-1, N)`` (``-1``: padding; one host read): one out of range was ignored by
        some placements and failed inside torch in others. A placement whose processes must raise alike checks
        only the type and shape here."""
        exclude = check_exclude(exclude, self.batch_size)
        if exclude is not None and self.validate and not self._trusted:
            check_items("exclude", exclude, batch_size=self.batch_size, num_items=self.num_items, unique=False,
                        low=-1, columns="E")
        return exclude

    def _drawing(self, num_candidates: int,
                 failed: Exception | None = None) -> contextlib.AbstractContextManager | None:
        """For a draw of ``num_candidates``: None (the default) leaves its checks to the caller
        (:func:`~capg_rec.plackett_luce.check_enough_items`); a placement that checks its draws itself does so here,
        in one go for the whole draw, and returns the context to draw in. ``failed``: this process's arguments were
        bad (``num_candidates`` is a placeholder): the check must fail in every process, and this one raise it."""
        return None

    def _recentred(self) -> CatalogScores:
        """The same catalog with each row and expert's scores less a constant of its own where that is cheap
        (every probability is unchanged): sums over the catalog taken on that scale keep their digits at any
        offset of the logits, which sums on the original scale, rounded to the catalog's dtype, lose. Default:
        itself (scores given as dot products have no such constant)."""
        return self

    def _best_items(self, k: int) -> int:
        """:attr:`exact_top`, asked by a method about to read each expert's best ``k`` items (:meth:`top_items`): a
        placement that checks such reads may check this one here, along with whatever it agrees on for
        :attr:`exact_top`."""
        return self.exact_top

    @property
    def exact_top(self) -> int:
        """How many of each expert's best items :meth:`top_items` names exactly (default: all of them;
        an estimated catalog, fewer). Methods that read the best items one by one check it."""
        return self.num_items

    def num_available(self) -> Tensor:
        """Items not masked, per row and expert → ``LongTensor[B, M]`` (default: every item)."""
        return torch.full((self.batch_size, self.num_experts), self.num_items, dtype=torch.long,
                          device=self.device)

    def log_normalizer(self) -> Tensor:
        """``logsumexp_n s[b, m, n]`` → ``[B, M]`` (differentiable)."""
        return self.log_power_sums(None, 1)[..., 0]

    def log_softmax(self, items: Tensor) -> Tensor:
        """``s[b, m, a] - logsumexp_n s[b, m, n]`` of named items: ``items [B, L]`` → ``[B, M, L]``
        (differentiable)."""
        return self.gather(items) - self.log_normalizer().unsqueeze(2)

    def gather_with_rest(self, items: Tensor, also: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The scores of named items ``[B, M, L]`` and ``log Σ_{n ∉ items[b]} exp(s[b, m, n])``
        ``[B, M]`` (differentiable; ``items [B, L]`` holds ids, no padding). With ``also [B, L']`` (ids),
        their scores follow the items' (``[B, M, L + L']``) but they stay in the rest."""
        named = items if also is None else torch.cat([items, also], 1)
        return self.gather(named), self.log_power_sums(items, 1)[..., 0]


def check_exclude(exclude: object, batch_size: int) -> Tensor | None:
    """``exclude`` as the protocol takes it: None, or an integer tensor ``[B, E]`` of ids (its shape and dtype only: a
    check without a host read; a batch of another size would broadcast, or fail inside torch)."""
    return None if exclude is None else check_id_tensor("exclude", exclude, batch_size=batch_size, allow_empty=True,
                                                        columns="E")


def every_score(catalog: CatalogScores) -> Tensor:
    """Every item's scores ``[B, M, N]`` (a small catalog read whole), each id checked as in any lookup, also
    where a caller trusts the ids it vouched for: nobody vouched for the whole catalog."""
    return catalog._every_score()


def unpadded(ids: Tensor) -> Tensor:
    """Id tensor ``ids`` with its ``-1`` pads replaced by the largest id present (0 if none): the ids to ask a
    catalog for when the pads' scores are masked anyway, so that a catalog holding only some rows (a sampled
    one's) is never asked for another."""
    return torch.where(ids >= 0, ids, ids.amax().clamp(min=0)) if ids.numel() else ids


_CPU_CHUNK_ITEMS = 8192
_DEVICE_CHUNK_SCORES = 2**25


def chunk_items(chunk_size: int | None, rows: int, device: torch.device) -> int:
    """``chunk_size`` checked (an int >= 1), or for None the default number of items scored at once for ``rows``
    score rows (``B·M``) on ``device``: 8,192 on the CPU, where a chunk of more than ~10^6 scores leaves the cache
    (at B = 128, 2.5x slower a pass at 131,072 items); on other devices (a GPU) as many as make ``2^25`` scores, at
    least 8,192, as a GPU needs large kernels (``benchmarks/chunk_size.py`` measures both). Also 8,192 inside
    ``torch.func`` transforms, where ``rows`` is a sample's and the transform multiplies what a chunk holds."""
    if chunk_size is not None:
        return check_count("chunk_size", chunk_size)
    if device.type == "cpu" or torch._C._are_functorch_transforms_active():
        return _CPU_CHUNK_ITEMS
    return max(_CPU_CHUNK_ITEMS, _DEVICE_CHUNK_SCORES // max(rows, 1))


def resolution(dtype: torch.dtype) -> float:
    """How far below its expert's best score an item may lie for a draw or a probability to tell its score apart from
    a neighbour's: ``1 / (16 eps)`` (float32 524,288, float64 2.8e14). A score ``g`` below the best is rounded by up
    to ``g·eps/2`` relative to it, and so are the log-probabilities that depend on it: 0.03 at this limit. Items
    further below (a soft mask such as -1e9 or ``finfo.min`` in float32) round alike, and neither the samplers nor
    the methods can choose among them right: the checks refuse a draw of a dense catalog's that must
    (:func:`~capg_rec.plackett_luce.unresolved_draws`)."""
    return 1.0 / (16 * torch.finfo(dtype).eps)


def agreement(catalog: CatalogScores) -> Callable[[Tensor], Tensor] | None:
    """``catalog.agree`` where a subclass makes it collective, else None (one process: checks that all
    passed need no tensor of results)."""
    return None if type(catalog).agree is CatalogScores.agree else catalog.agree


def as_catalog(scores: Tensor | CatalogScores, temperature: float = 1.0, *,
               validate_args: bool | None = None) -> CatalogScores:
    """Wrap logits ``[B, N]`` / ``[B, M, N]`` in a :class:`DenseCatalog`; pass catalogs through.

    A catalog object carries its own temperature, so ``temperature`` must then be 1.
    ``validate_args`` is :class:`DenseCatalog`'s.
    """
    if isinstance(scores, CatalogScores):
        if check_positive("temperature", temperature) != 1.0:
            raise ValueError("temperature must be 1.0 when a CatalogScores object is given: "
                             f"set the temperature on the catalog instead (got {temperature})")
        return scores
    if not isinstance(scores, Tensor):
        raise TypeError(f"logits must be a torch.Tensor or a CatalogScores, got {type(scores).__name__}")
    return DenseCatalog(scores, temperature, validate_args=validate_args)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype probabilities are computed in: the widest of ``dtypes`` (a user's and an item's), at least float32
    (half precision's 10- or 7-bit mantissas and, for float16, range cannot hold log-probabilities)."""
    return functools.reduce(torch.promote_types, dtypes, torch.float32)


def check_scaled(logits: Tensor, scores: Tensor, tau: float) -> None:
    """Finite ``logits`` (``-inf`` allowed) over a temperature ``tau < 1`` must stay finite in ``scores``: ``+inf``
    would make NaN probabilities, ``-inf`` would mask an item (ValueError naming the temperature)."""
    logits = _memory_order(logits.detach())
    lo, hi = (float(v) for v in torch.aminmax(logits))  # one pass; NaN propagates
    if not hi < math.inf:  # NaN or +inf: the logits' own fault
        raise ValueError("logits must be finite or -inf (masked) (no NaN or +inf)")
    if hi == -math.inf:  # every item masked: nothing to overflow
        return
    if lo == -math.inf:  # masked items: the lowest finite logit (a second pass, only then)
        lo = float(logits.masked_fill(logits == -math.inf, hi).amin())
    if not (float(_memory_order(scores.detach()).amax()) < math.inf and lo / tau > -torch.finfo(scores.dtype).max):
        raise ValueError(f"logits / temperature must stay finite: logits in [{lo:g}, {hi:g}] overflow the "
                         f"{str(scores.dtype).removeprefix('torch.')} range at temperature={tau:g}")


def narrowest(*dtypes: torch.dtype) -> torch.dtype:
    """The floating dtype of the smallest range among ``dtypes`` (float16's, when there)."""
    return min(dtypes, key=lambda dtype: torch.finfo(dtype).max)


def _exclusion_mask(exclude: Tensor | None, batch_size: int, start: int, stop: int,
                    device: torch.device) -> Tensor | None:
    """``[B, stop - start]`` bool, True where item ``start + j`` is excluded in row b."""
    if exclude is None or exclude.numel() == 0:
        return None
    width = stop - start
    inside = (exclude >= start) & (exclude < stop)
    # Ids outside [start, stop) land in a spare last column, so every write is the same True. Out of place:
    # under torch.func.vmap the ids may be batched while the fresh mask is not.
    mask = torch.zeros(batch_size, width + 1, dtype=torch.bool, device=device)
    return mask.scatter(1, torch.where(inside, exclude - start, width), True)[:, :width].contiguous()


class DenseCatalog(CatalogScores):
    """A catalog given as a logits tensor ``[B, N]`` (one logit model) or ``[B, M, N]`` (MoE).

    Args:
        logits: ``[B, N]`` or ``[B, M, N]``; ``-inf`` masks an item out of a row's catalog.
            float16/bfloat16 logits are computed in float32 (their gradients come back in their dtype).
        temperature: τ > 0; the scores are ``logits / τ``.
        validate_args: check that the logits hold no NaN or ``+inf`` (a pass and a host sync);
            ``None`` takes :func:`capg_rec.set_default_validate_args`'s default.

    Shape:
        - logits: ``[B, N]`` (M = 1) or ``[B, M, N]``; scores ``s``: ``[B, M, N]``
        - :meth:`gather` of ``items [B, L]`` → ``[B, M, L]``; :meth:`top_items` → ``[B, M, k]``

    Example:
        >>> catalog = DenseCatalog(torch.randn(4, 3, 100), temperature=0.5)   # 3 experts
        >>> catalog.gather(torch.tensor([[0, 5]] * 4)).shape
        torch.Size([4, 3, 2])
        >>> candidates = capg_rec.sample_candidates(catalog, 10)
    """

    def __init__(self, logits: Tensor, temperature: float = 1.0, *, validate_args: bool | None = None) -> None:
        validate = resolve_validate_args(validate_args)
        logits = check_float_tensor("logits", logits, ndims=(2, 3), validate=validate, allow_masked=True)
        if logits.dim() == 3 and logits.shape[1] == 0:
            raise ValueError(f"logits [B, M, N] must have at least one expert (M >= 1), got shape {list(logits.shape)}")
        tau = check_positive("temperature", temperature)
        scores = logits.unsqueeze(1) if logits.dim() == 2 else logits
        self._source_dtypes = (scores.dtype,)
        if scores.dtype != compute_dtype(scores.dtype):
            scores = scores.to(compute_dtype(scores.dtype))
        self.scores = scores / tau if tau != 1.0 else scores  # [B, M, N]
        if validate and tau < 1.0 and self.scores.numel():
            check_scaled(scores, self.scores, tau)
        self.batch_size, self.num_experts, self.num_items = self.scores.shape
        self.dtype, self.device = self.scores.dtype, self.scores.device
        self.validate = validate

    def num_available(self) -> Tensor:
        scores = self.scores.detach()
        if scores.numel() and eager_cpu(scores) and float(scores.amin()) > -math.inf:  # nothing masked: one reduction
            return super().num_available()
        return (scores > -math.inf).sum(2, dtype=torch.int32).long()  # int32 sums: 30% faster on the CPU

    def _within_resolution(self, low: float | None = None, high: float | None = None) -> bool:
        """Whether every unmasked score lies within :func:`resolution` of every other: then every unmasked item is
        resolved. Read on the host for CPU scores (one or two passes; ``low`` and ``high``: the scores' least and
        largest, where known); False elsewhere (no sync: count them instead)."""
        scores = self.scores.detach()
        if not scores.numel():
            return True
        if not eager_cpu(scores):
            return False
        if low is None or high is None:
            low, high = (float(v) for v in torch.aminmax(scores))
        if low == -math.inf and high > -math.inf:  # masked items: the lowest unmasked score
            low = float(torch.nan_to_num(scores, nan=high, neginf=high).amin())
        return high == -math.inf or high - low <= resolution(self.dtype)  # False for NaN or +inf

    def _num_resolved(self) -> Tensor:
        """Items within :func:`resolution` of their expert's best score, per row and expert → ``LongTensor[B, M]``
        (none in a row of masked items)."""
        scores = self.scores.detach()
        if not scores.numel():
            return self.num_available()
        top = scores.amax(2, keepdim=True)
        floor = torch.where(top > -math.inf, top - resolution(self.dtype), math.inf)
        return (scores >= floor).sum(2, dtype=torch.int32).long()

    def _recentred(self) -> DenseCatalog:
        """Each row and expert's scores less their max (detached; 0 for a row of masked items)."""
        top = self.scores.detach().amax(2, keepdim=True)
        out = copy.copy(self)
        out.scores = self.scores - torch.where(torch.isfinite(top), top, 0.0)
        return out

    def gather(self, items: Tensor) -> Tensor:
        return ids_in_range(self.num_items, self.scores.gather, 2, self._per_expert(self._named(items)))

    def log_softmax(self, items: Tensor) -> Tensor:  # one node, no [B, M, N] zeros in backward
        return ids_in_range(self.num_items, log_softmax_at, self.scores, self._per_expert(self._named(items)), 2)

    def gather_with_rest(self, items: Tensor, also: Tensor | None = None) -> tuple[Tensor, Tensor]:
        items = self._named(items)
        named = items if also is None else torch.cat([items, self._named(also, "also")], 1)
        return ids_in_range(self.num_items, self._gather_with_rest, items, named, name="items and also")

    def _gather_with_rest(self, items: Tensor, named: Tensor) -> tuple[Tensor, Tensor]:
        if self.num_experts == 1:  # the items scattered into a copy of the scores: no mask to make
            return gather_with_rest(self.scores, named.unsqueeze(1), 2, items.unsqueeze(1))
        # One [B, 1, N] mask (-inf at the items) for every expert: B·L writes, not B·M·L into a copy of the scores.
        drop = torch.zeros(self.batch_size, 1, self.num_items, dtype=self.dtype, device=self.device)
        if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(items):  # maybe batched
            drop = drop.scatter(2, items.unsqueeze(1), -math.inf)
        else:
            drop.scatter_(2, items.unsqueeze(1), -math.inf)
        return gather_with_rest(self.scores, self._per_expert(named), 2, drop)

    def _per_expert(self, items: Tensor) -> Tensor:
        return items.unsqueeze(1).expand(-1, self.num_experts, -1)

    def _drop(self, scores: Tensor, exclude: Tensor | None, value: float) -> Tensor:
        """``scores [B, E, N]`` with each row's excluded items set to ``value`` (differentiable).

        One scatter of E writes per row (no ``[B, N]`` mask, no host sync); padding (``-1``) writes
        to a spare last column. (A scatter-min without the spare column has a 6x slower backward.)"""
        exclude = self._exclusions(exclude)
        if exclude is None or exclude.numel() == 0:
            return scores
        index = torch.where(exclude >= 0, exclude, self.num_items).unsqueeze(1).expand(-1, scores.shape[1], -1)
        return torch.nn.functional.pad(scores, (0, 1)).scatter(2, index, value)[..., :-1]

    def log_power_sums(self, exclude: Tensor | None = None, num_powers: int = 1) -> Tensor:
        check_count("num_powers", num_powers)
        lowest = torch.finfo(self.dtype).min
        return torch.stack([filled_logsumexp(self._drop(self.scores if p == 1 else p * self.scores, exclude, lowest),
                                             dim=2) for p in range(1, num_powers + 1)], -1)

    def top_items(self, k: int, *, experts: Sequence[int] | None = None, exclude: Tensor | None = None,
                  generator: torch.Generator | None = None, perturb: bool = False) -> Tensor:
        check_count("k", k, high=self.num_items)
        perturb = check_flag("perturb", perturb)
        with torch.no_grad():
            s = self._drop(self.scores if experts is None else select_experts(self.scores, experts), exclude, -math.inf)
            if perturb:
                return gumbel_top_k(s, k, generator=generator)
            return top_k(s, k)


def available_given_masks(masked_items: Tensor, num_items: int, num_experts: int) -> Tensor:
    """Items left per row and expert once ``masked_items [B, E]`` (ids, ``-1`` pads, repeats allowed) are
    masked under every expert → ``LongTensor[B, M]``."""
    s = masked_items.sort(dim=1).values
    distinct = s >= 0
    distinct[:, 1:] &= s[:, 1:] != s[:, :-1]
    return (num_items - distinct.sum(1)).unsqueeze(1).expand(-1, num_experts)


T = TypeVar("T")


def ids_in_range(num_items: int, fn: Callable[..., T], *args: object, name: str = "items") -> T:
    """``fn(*args)``, a lookup of ids, where torch's error for an id out of range (an ``IndexError`` or
    ``RuntimeError``: "out of bounds") becomes a ``ValueError`` naming them (``name``): the check costs nothing
    when the ids are fine (on the CPU; elsewhere :meth:`CatalogScores._named` checks them first)."""
    if torch.compiler.is_compiling():
        return fn(*args)
    try:
        return fn(*args)
    except (IndexError, RuntimeError) as error:
        if "out of bounds" not in str(error) and "out of range" not in str(error):
            raise
        raise ValueError(f"{name} must hold ids in [0, {num_items})") from error


def masked_named_scores(scores: Tensor, items: Tensor, masked_items: Tensor | None, *, check: bool) -> Tensor:
    """The scores ``[B, M, L]`` of ``items [B, L]`` with ``-inf`` at each row's ``masked_items [B, E]``; with
    ``check``, a ``ValueError`` where an unmasked item's score overflowed (inf or NaN: one host sync)."""
    masked = None if masked_items is None else (items.unsqueeze(2) == masked_items.unsqueeze(1)).any(2).unsqueeze(1)
    return _masked(scores, masked, check=check)


def _masked(scores: Tensor, masked: Tensor | None, *, check: bool) -> Tensor:
    """``scores [B, M, L]`` with ``-inf`` where ``masked [B, 1, L]`` (None: nowhere); with ``check``, a ``ValueError``
    where an unmasked score overflowed (inf or NaN: one host sync)."""
    if check and scores.numel() and not all_finite(scores.detach()):  # before the masks' -inf; masked entries are
        if masked is None or not all_finite(scores.detach().masked_fill(masked, 0.0)):  # only read on this rare path
            raise _overflow_error(scores.dtype)
    return scores if masked is None else scores.masked_fill(masked, -math.inf)


def _overflow_error(dtype: torch.dtype) -> ValueError:
    return ValueError(f"user and item embeddings give scores <user, item> that overflow {dtype} (inf or NaN): "
                      "scale them down (or the temperature up), or compute in float64")


@bound_once
class _ChunkedLogPowerSums(torch.autograd.Function):
    """``log Σ_n exp(p · <u[b,m], v[n,m]>)`` over non-excluded n, streamed over item chunks.

    Backward recomputes each chunk's scores, so no ``[B, M, N]`` tensor is ever kept; it is written in
    differentiable ops, so it has a backward in turn (which keeps ``O(B·M·chunk)`` per chunk).
    ``check_finite`` raises a ValueError where a score or a power sum overflows (one host sync).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(user: Tensor, item: Tensor, exclude: Tensor | None, num_powers: int, chunk_size: int,
                check_finite: bool = False) -> Tensor:
        batch, experts, _ = user.shape
        lowest = torch.finfo(user.dtype).min
        powers = torch.arange(1, num_powers + 1, dtype=user.dtype, device=user.device)
        out = torch.full((batch, experts, num_powers), -torch.inf, dtype=user.dtype, device=user.device)
        finite = []  # per chunk: no score is +inf or NaN, and no row of a chunk overflowed to -inf
        for start in range(0, item.shape[0], chunk_size):
            stop = min(start + chunk_size, item.shape[0])
            with no_autocast(user.device):
                s = torch.einsum("bmd,nmd->bmn", user, item[start:stop])
            mask = _exclusion_mask(exclude, batch, start, stop, user.device)
            if mask is not None:
                s = s.masked_fill(mask.unsqueeze(1), lowest)
            top = s.amax(dim=2, keepdim=True)  # `lowest` where the whole chunk is excluded
            if check_finite:
                finite.append(torch.isfinite(top).all())
            d = s - top
            sums = torch.stack([exp_floored(d if p == 1 else p * d).sum(2) for p in range(1, num_powers + 1)], -1)
            part = (sums.log() + powers * top).masked_fill(top <= lowest / 2, -torch.inf)
            out = torch.logaddexp(out, part)
        if check_finite and not bool(torch.stack([*finite, (out < math.inf).all()]).all()):
            raise _overflow_error(user.dtype)
        return out

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:
        user, item, exclude, _, chunk_size, _ = inputs
        ctx.save_for_backward(user, item, output, exclude)
        ctx.chunk_size = chunk_size

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, None, None, None, None]:
        user, item, out, exclude = ctx.saved_tensors
        batch, num_powers = user.shape[0], out.shape[-1]
        lowest = torch.finfo(user.dtype).min
        powers = torch.arange(1, num_powers + 1, dtype=user.dtype, device=user.device)
        # d out_p / d s = p · exp(p·s - out_p) = p · r^p · exp(p·out_1 - out_p), r = exp(s - out_1) ≤ 1;
        # rows with no support (out = -inf) get no gradient.
        empty = out == -torch.inf
        log_z = out[..., :1].masked_fill(empty[..., :1], 0.0)  # [B, M, 1]
        scale = torch.exp((powers * log_z - out).masked_fill(empty, 0.0))
        coef = (grad_out * powers * scale).masked_fill(empty, 0.0)  # [B, M, P]
        grad_user, parts = torch.zeros_like(user), []
        # A recorded (higher-order) backward, or one under vmap, collects the chunks out of place.
        grad_item = None if torch.is_grad_enabled() else torch.zeros_like(item)
        for start in range(0, item.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, item.shape[0])
            v = item[start:stop]
            with no_autocast(user.device):
                s = torch.einsum("bmd,nmd->bmn", user, v)
            mask = _exclusion_mask(exclude, batch, start, stop, user.device)
            if mask is not None:  # their exps land on the floor, which scaled_terms turns into exact zeros
                s = s.masked_fill(mask.unsqueeze(1), lowest)
            d = s - log_z  # log r
            grad_s = sum(scaled_terms(exp_floored(d if p == 1 else p * d), coef[..., p - 1:p])
                         for p in range(1, num_powers + 1))
            with no_autocast(user.device):
                grad_user = grad_user + torch.einsum("bmn,nmd->bmd", grad_s, v)
                part = torch.einsum("bmn,bmd->nmd", grad_s, user)
            if grad_item is None:
                parts.append(part)
            else:
                grad_item[start:stop] = part
        if grad_item is None:
            grad_item = torch.cat(parts) if parts else torch.zeros_like(item)
        return grad_user, grad_item, None, None, None, None


def _chunked_top_k(user: Tensor, item: Tensor, k: int, exclude: Tensor | None,
                   noise: Callable[[int, int], Tensor] | None, chunk_size: int,
                   check_finite: bool = False) -> tuple[Tensor, Tensor]:
    """The ``min(k, N)`` best of ``<user[b,m], item[n,m]> + noise(start, stop)[b,m,n-start]``.

    ``user [B, M, D]``, ``item [N, M, D]``, streamed over ``chunk_size`` items; ``noise`` (or None)
    gives the perturbation of items ``[start, stop)`` as ``[B, M, stop - start]``. Returns
    ``(values, ids) [B, M, min(k, N)]``, best first (ties: lower id first, as :func:`top_k`), ids in
    ``[0, N)``; excluded items score -inf.
    ``check_finite`` raises a ValueError where a score is +inf or NaN (read off the best values: one
    host sync); scores that overflow to -inf rank last, as excluded items do.
    """
    batch, num_sel = user.shape[:2]
    best_val = torch.full((batch, num_sel, 0), -torch.inf, dtype=user.dtype, device=user.device)
    best_idx = torch.zeros((batch, num_sel, 0), dtype=torch.long, device=user.device)
    with torch.no_grad():
        for start in range(0, item.shape[0], chunk_size):
            stop = min(start + chunk_size, item.shape[0])
            with no_autocast(user.device):
                s = torch.einsum("bmd,nmd->bmn", user, item[start:stop])
            if noise is not None:
                s = s + noise(start, stop)
            mask = _exclusion_mask(exclude, batch, start, stop, user.device)
            if mask is not None:
                s = s.masked_fill(mask.unsqueeze(1), -torch.inf)
            ids = torch.arange(start, stop, device=user.device).expand(batch, num_sel, -1)
            # Kept items precede the chunk's (higher) ids, and equal kept values are in id order: position order
            # among equal values is id order.
            merged = torch.cat([best_val, s], 2)
            pos = top_k(merged, min(k, merged.shape[2]))
            best_val, best_idx = merged.gather(2, pos), torch.cat([best_idx, ids], 2).gather(2, pos)
    if check_finite and not bool((best_val[..., :1] < math.inf).all()):  # NaN and +inf sort first
        raise _overflow_error(user.dtype)
    return best_val, best_idx


def _expert_views(user: Tensor, item: Tensor) -> tuple[Tensor, Tensor, torch.dtype]:
    """``user [B, D] | [B, M, D]`` and ``item [N, D] | [N, M, D]`` as ``[B, M, D]``, ``[N, M, D]``, checked to
    agree on (M, D), and the dtype they are scored in: the wider of theirs, at least float32 (a bfloat16 user
    tower under autocast beside a float32 item table scores in float32)."""
    user = user.unsqueeze(1) if user.dim() == 2 else user
    item = item.unsqueeze(1) if item.dim() == 2 else item
    if user.shape[1:] != item.shape[1:]:
        raise ValueError(f"user [B, M, D] and item [N, M, D] must agree on (M, D), got "
                         f"{tuple(user.shape[1:])} and {tuple(item.shape[1:])}")
    return user, item, compute_dtype(user.dtype, item.dtype)


class EmbeddingCatalog(CatalogScores):
    """A catalog scored from embeddings: ``s[b, m, n] = <user[b, m], item[n, m]> / τ``.

    Catalog-wide reductions stream over ``chunk_size`` items at a time, with recomputation in
    backward, so memory is ``O(B·M·chunk_size)`` beyond the embeddings themselves (by default, 8,192 items on the
    CPU and ``2^25`` scores a chunk elsewhere: :func:`chunk_items`).

    Args:
        user: ``[B, D]`` or ``[B, M, D]``.
        item: ``[N, D]`` or ``[N, M, D]``; scores are computed in the wider of the two dtypes, at least float32
            (float16/bfloat16 in float32), and gradients reach each in its own dtype.
        temperature: τ > 0.
        masked_items: ``[B, E]`` ids of items outside each row's catalog (already seen,
            unavailable), padded with ``-1``; they score ``-inf``.
        chunk_size: items scored at once; None: :func:`chunk_items`'s default for the user's device and ``B·M``. A
            draw's Gumbel noise is made a chunk at a time, so a seeded draw depends on the chunk size (and differs
            from one of the same scores as dense logits); its law does not.
        validate_args: check that the embeddings are finite, that their scores do not overflow
            and that ``masked_items`` holds ids in ``[-1, N)``; ``None`` takes the module default.

    Shape:
        - user: ``[B, D]`` or ``[B, M, D]``; item: ``[N, D]`` or ``[N, M, D]``; masked_items: ``[B, E]``
        - scores ``s``: ``[B, M, N]``, never held whole: :meth:`gather` of ``items [B, L]`` → ``[B, M, L]``,
          :meth:`log_power_sums` → ``[B, M, P]``, :meth:`top_items` → ``[B, M, k]``

    Example:
        >>> catalog = EmbeddingCatalog(torch.randn(4, 8), torch.randn(100, 8), masked_items=torch.tensor([[3, -1]] * 4))
        >>> candidates = capg_rec.sample_candidates(catalog, 10)
    """

    def __init__(self, user: Tensor, item: Tensor, temperature: float = 1.0, *, masked_items: Tensor | None = None,
                 chunk_size: int | None = None, validate_args: bool | None = None) -> None:
        self.validate = resolve_validate_args(validate_args)
        user = check_float_tensor("user", user, ndims=(2, 3), validate=self.validate)
        item = check_float_tensor("item", item, ndims=(2, 3), validate=self.validate)
        check_same_device(user.device, item=item)  # the scores' device is the users' (found by review: torch's error)
        tau = check_positive("temperature", temperature)
        user, item, dtype = _expert_views(user, item)
        self.chunk_size = chunk_items(chunk_size, user.shape[0] * user.shape[1], user.device)
        self._source_dtypes = (user.dtype, item.dtype)
        user, item = user.to(dtype), item.to(dtype)
        self.user = user / tau if tau != 1.0 else user  # [B, M, D], temperature folded in
        self.item = item  # [N, M, D]
        self.batch_size, self.num_experts = self.user.shape[:2]
        self.num_items = item.shape[0]
        self.dtype, self.device = dtype, user.device
        self.masked_items = None if masked_items is None else check_items(  # on the scores' device, checks or not
            "masked_items", masked_items, batch_size=self.batch_size, num_items=self.num_items, unique=False,
            validate=self.validate, low=-1, columns="E", device=self.device)  # (found by review: scattered wrong)

    def num_available(self) -> Tensor:
        if self.masked_items is None:
            return super().num_available()
        return available_given_masks(self.masked_items, self.num_items, self.num_experts)

    def _with_masked(self, exclude: Tensor | None) -> Tensor | None:
        exclude = self._exclusions(exclude)
        if self.masked_items is None or exclude is None:
            return self.masked_items if exclude is None else exclude
        return torch.cat([self.masked_items, exclude], dim=1)

    def gather(self, items: Tensor) -> Tensor:
        items = self._named(items)
        with no_autocast(self.device):  # index_select: a negative id is an error, not the last item
            named = ids_in_range(self.num_items, self.item.index_select, 0, items.reshape(-1))
            scores = torch.einsum("bmd,blmd->bml", self.user, named.view(*items.shape, *self.item.shape[1:]))
        return masked_named_scores(scores, items, self.masked_items, check=self.validate)

    _whole_in_one_product = True

    def _every_score(self) -> Tensor:
        """One ``[B, M, D] × [N, M, D]`` product rather than :meth:`gather`'s lookup of every item for every row
        (a ``[B, N, D]`` copy, and its scatter back in backward: mean-field at N = 1000 took 13x the time it takes
        on the same scores as logits)."""
        with no_autocast(self.device):
            scores = torch.einsum("bmd,nmd->bmn", self.user, self.item)  # hence _whole_in_one_product
        masked = _exclusion_mask(self.masked_items, self.batch_size, 0, self.num_items, self.device)
        return _masked(scores, None if masked is None else masked.unsqueeze(1), check=self.validate)  # as gather

    def log_power_sums(self, exclude: Tensor | None = None, num_powers: int = 1) -> Tensor:
        check_count("num_powers", num_powers)
        return _ChunkedLogPowerSums.apply(self.user, self.item, self._with_masked(exclude), num_powers,
                                          self.chunk_size, self.validate)

    def top_items(self, k: int, *, experts: Sequence[int] | None = None, exclude: Tensor | None = None,
                  generator: torch.Generator | None = None, perturb: bool = False) -> Tensor:
        check_count("k", k, high=self.num_items)
        perturb = check_flag("perturb", perturb)
        user = self.user if experts is None else select_experts(self.user, experts)
        item = self.item if experts is None else select_experts(self.item, experts)
        noise = None
        if perturb:
            def noise(start: int, stop: int) -> Tensor:
                shape = (user.shape[0], user.shape[1], stop - start)
                return gumbel_like(shape, generator=generator, dtype=self.dtype, device=self.device)
        return _chunked_top_k(user, item, k, self._with_masked(exclude), noise, self.chunk_size,
                              check_finite=self.validate)[1]
