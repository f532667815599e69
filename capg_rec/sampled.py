"""A sampled catalog: catalog-wide sums estimated from a negative sample plus an exact head.

:class:`SampledCatalog` is a :class:`~capg_rec.catalog.CatalogScores` whose step cost does not grow
with the catalog. Scores are ``s[b, m, n] = <user[b, m], item[n, m]> / τ``. Per row it keeps

* a **head** H_b scored exactly: each expert's ``head_size`` best items from an
  :class:`~capg_rec.ann.ItemIndex` (refreshed by the caller every few steps) and/or named
  ``head_items`` (the candidates or logged items),
* a **negative sample** S (shared by the rows) from a :class:`NegativeSampler`, each distinct id j
  carrying ``log w_j = log(times drawn) - log E[times drawn]`` (the logQ correction of Yi et al. 2019;
  for a mixture of samplers, the balance heuristic: expected counts add up),

and estimates ``Σ_{n ∉ E} exp(p · s_n) ≈ Σ_{n ∈ H \\ E} exp(p · s_n) + Σ_{j ∈ S \\ (H ∪ E)} w_j exp(p · s_j)``,
which is unbiased for any fixed head and exclusion set E, since ``E[Σ_{slots} 1(j) / E[count_j]] = 1``
for every item the sampler can draw. Everything is a logsumexp over these terms, so it is shift
invariant by construction; excluded and masked items lose their head term and their sample terms
exactly. Named items (:meth:`~SampledCatalog.gather`) are always exact.

What each inclusion method gets:

* ``"with_replacement"`` (CA-PG-SwR) and V-PG: only the normaliser, estimated.
* ``"mean_field"``: for catalogs over 2048 items it reads the catalog's best items and the tail's
  power sums ``p = 1..3``, both served here (the best items are those of H ∪ S; the tail sums are
  estimated). Make ``head_size`` at least mean-field's head (``8·n + K - n`` for the largest
  expert block n) so that its tail series stays accurate.
* ``"plugin"``: the top-(K-1) prefix is taken from H ∪ S (exact when the head holds the true top).
* ``"exact"``: refused for catalogs over 2048 items (it reads power sums up to ``p = 4`` whose
  importance estimates have a heavy tail, and more best items than the head names): a ``ValueError``.
  Mean-field warns when the head is below its own (its probabilities are then biased).

Up to 2048 items, mean-field, plug-in and exact read the whole catalog, exactly; CA-PG-SwR and V-PG
use the estimated normaliser at every size.

Candidate sampling (``top_items(perturb=True)``, hence :func:`~capg_rec.sample_candidates`) is a
Gumbel top-K over H ∪ S with the sample's keys ``s_j + log w_j``: each drawn slot stands for the
tail mass it estimates. The draw is exact when the head holds the whole catalog; otherwise it is an
approximation: only items of H ∪ S can be drawn, and even at the first position an item's chance is
a ratio of estimates (its weight over the estimated normaliser), not unbiased over samples: with
few negatives the head is over-drawn or under-drawn (``benchmarks/sampled_draw.py`` measures its
distance from the exact draw). With
``validate_args``, asking :meth:`~SampledCatalog.top_items` for more items than a row's head and sample
hold usable (unmasked, not excluded, distinct) is a ``ValueError`` naming the row (a host sync).
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
import math
import numbers
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from capg_rec._checks import FAILED_ELSEWHERE, _host_view, all_finite, check_count, check_device, check_flag, \
    check_float_tensor, check_generator, check_items, check_positive, is_id_tensor, is_int, raise_where_short, \
    resolve_validate_args, validating_by_default
from capg_rec._numerics import (exp_floor, gumbel_group_size, gumbel_top_k, no_autocast, safe_logsumexp,
                                select_experts, top_k)
from capg_rec.ann import ItemIndex
from capg_rec.catalog import CatalogScores, _exclusion_mask, _masked, _overflow_error, agreement, \
    available_given_masks, compute_dtype, ids_in_range, masked_named_scores, unpadded

__all__ = ["SampledCatalog", "NegativeSampler", "UniformSampler", "InBatchSampler", "MixedSampler", "DrawnSample",
           "MAX_SAMPLED_POWERS"]

MAX_SAMPLED_POWERS = 3
"""The highest power sum ``Σ exp(p·s)`` a :class:`SampledCatalog` estimates (mean-field's tail needs 3)."""

_NOT_FINITE_VECTORS = ("the item side gave vectors that are not finite (NaN or inf) for items asked of this "
                       "SampledCatalog (masked items' too: their gradient, 0 times NaN, is NaN): check the item tower "
                       "or table")


class NegativeSampler(abc.ABC):
    """Draws a negative sample of item ids shared by a batch, and knows each id's expected count.

    ``draw`` returns ids ``[S]`` (``-1`` marks an unused slot); ``log_expected_count(ids)`` gives
    ``log E[number of slots holding id]`` for any ids (``-inf`` for an id it can never draw). The
    sampled catalog divides each drawn id's term by that expectation, which makes its sums unbiased.

    Shape:
        - :meth:`draw`: ``batch_items [B, H]`` (or None) → ids ``[S]`` (int64, ``-1``: unused)
        - :meth:`log_expected_count`: ``ids [S]`` → ``[S]`` (float64)

    Example:
        >>> sampler = capg_rec.UniformSampler(64)                      # a NegativeSampler
        >>> ids = sampler.draw(1000, None, generator=None, device="cpu")
        >>> ids.shape, sampler.log_expected_count(ids, 1000, None).dtype
        (torch.Size([64]), torch.float64)
    """

    @abc.abstractmethod
    def draw(self, num_items: int, batch_items: Tensor | None, *, generator: torch.Generator | None,
             device: torch.device) -> Tensor:
        """Ids ``[S]`` (int64, ``-1``: unused) for a catalog of ``num_items``; ``batch_items [B, H]`` are the
        batch's named items (``-1`` padded; ``None``: none)."""

    @abc.abstractmethod
    def log_expected_count(self, ids: Tensor, num_items: int, batch_items: Tensor | None) -> Tensor:
        """``log E[count of id]`` in a draw, for ``ids [S]`` → ``[S]`` (dtype float64)."""

    @property
    def draws_batch(self) -> bool:
        """Whether the sample holds the batch's own named items (``batch_items``)."""
        return False

    def state_dict(self) -> dict[str, object]:
        """What the sampler has learnt from the steps so far (for a checkpoint); stateless samplers: ``{}``."""
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`'s output."""
        if _checked_state(state):
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")

    def _draw_size(self, batch_items: Tensor | None) -> int | Tensor | None:
        """How many ids (not ``-1``) :meth:`draw` returns given ``batch_items`` (None: not known, as for a sampler of
        your own)."""
        return None

    def _frozen(self, ids: Tensor) -> NegativeSampler:
        """A sampler that gives ``ids [S]`` the expected counts this one gives them now, whatever later draws teach
        this one: what a :class:`DrawnSample` keeps of its sampler (default: a sampler that learns nothing, itself)."""
        return self

    def log_expected_count_from_others(self, ids: Tensor, num_items: int, batch_items: Tensor) -> Tensor:
        """``log E[count of id]`` from the slots of the other rows of ``batch_items [B, H]`` only, per row → ``[B, S]``:
        where the batch is the catalog's own head, a row's own items are scored exactly and their sample terms
        dropped, so its sums take the other rows' draws alone. The default: a sample that does not come from the
        batch's rows, whose counts are the same for every row."""
        return _checked_log_count(self, "log_expected_count", self.log_expected_count(ids, num_items, batch_items),
                                  tuple(ids.shape)).expand(batch_items.shape[0], -1)


def _checked_state(state: object) -> dict[str, object]:
    """A sampler's ``load_state_dict`` argument: a dict (a ``TypeError`` naming ``state`` otherwise)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    return state


def _integer_ids(name: str, x: object, shape: str, dims: int | None = None) -> Tensor:
    """``x`` itself: an integer tensor (of ``dims`` dims, if given), else a ``TypeError`` (``ValueError`` for its dims)
    naming ``name``, whose expected ``shape`` it states."""
    if not is_id_tensor(x):
        raise TypeError(f"{name} must be an integer tensor {shape}, got {getattr(x, 'dtype', type(x).__name__)}")
    if dims is not None and x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-d {shape}, got shape {list(x.shape)}")
    return x


def _checked_log_count(sampler: NegativeSampler, method: str, log_count: object, shape: tuple[int, ...],
                       used: Tensor | None = None) -> Tensor:
    """What ``sampler.<method>`` gave for the sample's ids (a sampler of your own may give anything): a floating tensor
    of ``shape`` (a ``TypeError`` / ``ValueError`` naming the sampler's method otherwise); with ``used`` (bool, the
    slots that enter the sums: not ``-1``), no NaN or ``+inf`` there (a NaN term reads as ``-inf`` in the sums, an
    infinite count as a term of 0: both silently)."""
    owner = sampler.sampler if isinstance(sampler, DrawnSample) else sampler  # the class its user wrote
    name = f"{type(owner).__name__}.{method}"
    if not isinstance(log_count, Tensor) or not log_count.is_floating_point():
        raise TypeError(f"{name} must give a floating tensor {list(shape)}, got "
                        f"{getattr(log_count, 'dtype', type(log_count).__name__)}")
    if tuple(log_count.shape) != shape:
        raise ValueError(f"{name} must give shape {list(shape)} (one per id), got {list(log_count.shape)}")
    if used is not None and log_count.numel() and not bool((log_count[..., used] < math.inf).all()):  # NaN fails too
        raise ValueError(f"{name} must give finite values or -inf (an id it never draws), got NaN or +inf")
    return log_count


def _sample_log_counts(sampler: NegativeSampler, ids: Tensor, num_items: int, batch_items: Tensor | None,
                       per_row: bool, used: Tensor | None) -> Tensor:
    """The log expected counts of the sample's ``ids [S]`` that a :class:`SampledCatalog` reads, checked
    (:func:`_checked_log_count`): each row's from the other rows of ``batch_items [B, H]`` → ``[B, S]`` where
    ``per_row`` (the batch is the rows' own heads, and the sampler draws it), else the sample's → ``[S]``."""
    if per_row:
        return _checked_log_count(sampler, "log_expected_count_from_others", sampler.log_expected_count_from_others(
            ids, num_items, batch_items), (batch_items.shape[0], len(ids)), used)
    return _checked_log_count(sampler, "log_expected_count", sampler.log_expected_count(ids, num_items, batch_items),
                              (len(ids),), used)


def _device(device: object) -> torch.device | None:
    """A sampler's ``device`` argument: a ``torch.device``, a device string, or None (torch's default device for a
    draw of its own, the batch's for a draw of the batch's items)."""
    return None if device is None else check_device("device", device)


def _batch_ids(batch_items: object, num_items: int | None = None) -> Tensor:
    """``batch_items [B, H]``: 2-d integer ids; with the checks on, ids in ``[-1, num_items)`` (``-1``: padding; no
    upper bound without ``num_items``) where they are plain host tensors (read through numpy: no host sync)."""
    batch_items = _integer_ids("batch_items", batch_items, "[B, H]", 2)
    host = _host_view(batch_items) if batch_items.numel() and validating_by_default() else None  # None: compiled
    if host is not None:
        low, high = int(host.min()), int(host.max())
        if low < -1 or (num_items is not None and high >= num_items):
            raise ValueError(f"batch_items must hold ids in [-1, {num_items if num_items is not None else 'N'}) "
                             f"(-1: padding), got values in [{low}, {high}]")
    return batch_items


class UniformSampler(NegativeSampler):
    """``num_samples`` ids uniform over the catalog, with replacement (``E[count] = S / N``).

    Args:
        num_samples: S, the ids drawn per batch.

    Shape:
        - :meth:`draw` → ids ``[S]`` in ``[0, N)``
        - :meth:`log_expected_count`: ``ids [S]`` → ``[S]`` (float64), each ``log(S / N)``

    Example:
        >>> sampler = UniformSampler(64)
        >>> ids = sampler.draw(1000, None, generator=None, device="cpu")
        >>> sampler.log_expected_count(ids, 1000, None).exp().unique()
        tensor([0.0640], dtype=torch.float64)
    """

    def __init__(self, num_samples: int) -> None:
        self.num_samples = check_count("num_samples", num_samples)

    def draw(self, num_items: int, batch_items: Tensor | None, *, generator: torch.Generator | None,
             device: torch.device) -> Tensor:
        return torch.randint(check_count("num_items", num_items), (self.num_samples,),
                             generator=check_generator(generator), device=_device(device))

    def _draw_size(self, batch_items: Tensor | None) -> int | Tensor | None:
        return self.num_samples

    def log_expected_count(self, ids: Tensor, num_items: int, batch_items: Tensor | None) -> Tensor:
        ids = _integer_ids("ids", ids, "[S]")
        num_items = check_count("num_items", num_items)
        return torch.full(ids.shape, math.log(self.num_samples / num_items), dtype=torch.float64, device=ids.device)

    def __repr__(self) -> str:
        return f"UniformSampler(num_samples={self.num_samples})"


_PRIME = 2_147_483_647  # 2^31 - 1: ids below 2^32 times a multiplier below it stay inside int64


class InBatchSampler(NegativeSampler):
    """The batch's own named items as negatives (``batch_items`` flattened), logQ-corrected.

    ``E[count of j]`` per batch is either given (``frequency [N]``, summing to 1: the chance that one
    batch slot holds item j; then ``E[count] = slots · q_j``) or estimated online as in Yi et al. (2019):
    per hash bucket, the last step an item was seen, a moving average ``δ`` (rate ``alpha``) of the
    steps between sightings and one ``c`` of its copies in a batch where it is seen;
    ``E[count] = E[copies | seen] · P(seen) ≈ c / δ``, with ``δ`` the largest and ``c`` the smallest over
    ``num_hashes`` hash functions (collisions only shorten the one and raise the other, as in a count-min
    sketch). An item's first sighting sets ``δ`` to the steps so far and ``c`` to its copies; until an item
    has been seen ``1/alpha`` times its averages are plain means of its sightings (rate ``1/n`` at the n-th),
    so that a rare item's ``1/δ`` does not rest on its first gap (which a fixed rate keeps at weight
    ``(1 - alpha)^n``: an item seen 30 times at ``alpha = 0.01`` had its count overestimated by 40–90%, as
    ``1/δ`` of a few gaps is biased upwards). Each :meth:`draw` is one step: it records the batch first. The
    estimate follows the batches to their device, and :meth:`state_dict` carries it into a checkpoint. The
    online estimate counts per step, not per slot: it holds for batches of one size (a step of 8 slots after
    steps of 64 had its counts estimated 8 times too high), so drop an epoch's last, smaller batch
    (``drop_last=True``) or pass ``frequency``, with which the counts follow each batch's slots.

    In-batch negatives never reach items that are never named: the estimate is biased towards
    popular items unless the batch covers the catalog. :class:`MixedSampler` adds uniform negatives.
    When the batch is the catalog's own ``head_items`` (the default), a row's own named items are
    scored exactly in its head and their sample terms dropped, and its sums weigh the other rows' items
    by the expected counts of the other rows' slots: unbiased where the rows are drawn independently,
    each slot holding j with chance ``q_j`` (a fixed set of users whose items differ from the population's
    is not such a draw; pass ``batch_items`` drawn apart to take none of a row's own items).

    Args:
        frequency: ``[N]`` float32/float64, the chance that one batch slot holds each item (sums to 1);
            None: estimated online.
        num_buckets: hash buckets of the online estimate (at most ``2^31 - 1``).
        num_hashes: hash functions of the online estimate.
        alpha: the moving averages' rate, in (0, 1].
        seed: picks the hash functions.

    Shape:
        - :meth:`draw`: ``batch_items [B, H]`` (required; ``-1`` padded) → ids ``[B·H]``
        - :meth:`log_expected_count`: ``ids [S]`` → ``[S]`` (float64; ``-inf`` for an item never seen)

    Example:
        >>> sampler = InBatchSampler()
        >>> batch = torch.tensor([[1, 2], [2, 3]])
        >>> ids = sampler.draw(10, batch, generator=None, device="cpu")      # one step: records the batch
        >>> ids, sampler.log_expected_count(ids, 10, batch).exp()
        (tensor([1, 2, 2, 3]), tensor([1., 2., 2., 1.], dtype=torch.float64))
    """

    def __init__(self, *, frequency: Tensor | None = None, num_buckets: int = 1 << 18, num_hashes: int = 2,
                 alpha: float = 0.01, seed: int = 0) -> None:
        if frequency is not None:
            frequency = check_float_tensor("frequency", frequency, ndims=(1,))
            if frequency.dtype not in (torch.float32, torch.float64):  # 1e-6 is a float16 subnormal, off by 1.3%
                raise TypeError(f"frequency must be float32 or float64 (half precision rounds the small probabilities "
                                f"of a large catalog), got {frequency.dtype}")
            if bool((frequency < 0).any()) or not bool(torch.isfinite(frequency).all()):
                raise ValueError("frequency must hold finite probabilities >= 0")
            total = float(frequency.double().sum())
            if total == 0.0:
                raise ValueError("frequency must hold probabilities that sum to 1 (the chance that one batch slot "
                                 f"holds each item), got {'an empty tensor' if not frequency.numel() else 'all zeros'}")
            # Normalised in its dtype (a pairwise sum: ⌈log2 N⌉ roundings, then one per quotient), a vector sums to 1
            # within (⌈log2 N⌉ + 1)·eps; N·eps, the bound of a sequential sum, let 10% errors through at N = 10^6.
            slack = (math.ceil(math.log2(max(frequency.shape[0], 2))) + 1) * torch.finfo(frequency.dtype).eps
            if abs(total - 1.0) > slack:
                raise ValueError(f"frequency must sum to 1 (the chance that one batch slot holds each item) within "
                                 f"{slack:.3g} ({frequency.dtype} at N = {frequency.shape[0]}), got 1 "
                                 f"{'+' if total > 1 else '-'} {abs(total - 1.0):.3g}: normalise popularity counts in "
                                 "the frequency's own dtype first (frequency / frequency.sum())")
        self.frequency = frequency
        self.num_buckets = check_count("num_buckets", num_buckets)
        self.num_hashes = check_count("num_hashes", num_hashes)
        if self.num_buckets > _PRIME:  # hashes are taken modulo the prime: more buckets would stay empty
            raise ValueError(f"num_buckets must be at most {_PRIME}, got {num_buckets}")
        self.alpha = check_positive("alpha", alpha)
        if self.alpha > 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not is_int(seed):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if not -2**63 <= seed < 2**64:  # a torch.Generator's seeds
            raise ValueError(f"seed must be in [-2^63, 2^64) (a torch.Generator's seeds), got {seed}")
        self.seed = seed = int(seed)
        g = torch.Generator().manual_seed(seed)
        self._mult = torch.randint(1, _PRIME, (num_hashes, 1), generator=g, device="cpu")  # whatever the default
        self._add = torch.randint(0, _PRIME, (num_hashes, 1), generator=g, device="cpu")
        self.step = 0
        self._last: Tensor | None = None  # [h, buckets + 1] float64: step of the last sighting (0: never)
        self._interval: Tensor | None = None  # [h, buckets + 1] float64: moving average of the gaps
        self._copies: Tensor | None = None  # [h, buckets + 1] float64: moving average of the copies when seen
        self._sightings: Tensor | None = None  # [h, buckets + 1] float64: how often seen
        self._snapshot: tuple[Tensor, Tensor] | None = None  # a frozen copy's ids (sorted) and their log counts

    def _frozen(self, ids: Tensor) -> NegativeSampler:
        if self.frequency is not None or self._snapshot is not None:  # learns nothing, or frozen already
            return self
        frozen = copy.copy(self)  # shares the tables, which it reads only for ids outside its snapshot
        ids, _ = ids.reshape(-1).long().sort()
        frozen._snapshot = (ids, self.log_expected_count(ids, 0, None))
        return frozen

    def _buckets(self, ids: Tensor) -> Tensor:
        mult, add = self._mult.to(ids.device), self._add.to(ids.device)
        return ((ids.clamp(min=0).unsqueeze(0) * mult + add) % _PRIME) % self.num_buckets  # [h, S]

    def observe(self, batch_items: Tensor) -> None:
        """Record one step's named items ``[B, H]`` (``-1`` padded) in the frequency estimate."""
        ids = _batch_ids(batch_items).reshape(-1)
        if self._last is None:  # the last column: padding's spare bucket
            zeros = torch.zeros(self.num_hashes, self.num_buckets + 1, dtype=torch.float64, device=ids.device)
            self._last, self._interval, self._copies, self._sightings = (zeros.clone() for _ in range(4))
        elif self._last.device != ids.device:  # the batches moved: the estimate follows them
            self._last, self._interval, self._copies, self._sightings = (
                t.to(ids.device) for t in (self._last, self._interval, self._copies, self._sightings))
        self.step += 1
        buckets = torch.where(ids >= 0, self._buckets(ids), self.num_buckets)  # [h, S]
        for row, last, interval, copies, sightings in zip(buckets, self._last, self._interval, self._copies,
                                                          self._sightings):
            seen, count = torch.unique(row, return_counts=True)  # each bucket once, with its copies
            gap = self.step - last[seen]  # the steps so far at a first sighting
            n = sightings[seen] + 1.0
            rate = torch.clamp(1.0 / n, min=self.alpha)  # plain means of the first 1/alpha sightings
            interval[seen] = interval[seen] + rate * (gap - interval[seen])
            copies[seen] = copies[seen] + rate * (count.double() - copies[seen])
            sightings[seen] = n
            last[seen] = float(self.step)

    _STATE = ("last", "interval", "copies", "sightings")

    def state_dict(self) -> dict[str, object]:
        """A snapshot (copies, which later steps leave alone): ``{"step": int, "seed": int}`` (the seed picks the hash
        functions) and, once a batch was seen, the estimate's ``[num_hashes, num_buckets + 1]`` float64 tables
        (``last``, ``interval``, ``copies``, ``sightings``); with a given ``frequency``: ``{}``."""
        if self.frequency is not None:
            return {}
        state: dict[str, object] = {"step": self.step, "seed": self.seed}
        if self._last is not None:
            state.update(zip(self._STATE, (t.clone() for t in (self._last, self._interval, self._copies,
                                                                self._sightings))))
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        if self.frequency is not None:
            return NegativeSampler.load_state_dict(self, state)
        _checked_state(state)
        tables = [k for k in self._STATE if k in state]
        if {"step", "seed"} - set(state) or tables not in ([], list(self._STATE)) or \
                set(state) - {"step", "seed", *self._STATE}:
            raise ValueError(f"state must hold 'step', 'seed' and either none or all of {self._STATE}, got keys "
                             f"{sorted(state)}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"state['step'] must be an int >= 0, got {step!r}")
        if state["seed"] != self.seed:
            raise ValueError(f"state['seed'] is {state['seed']!r}, but this sampler hashes with seed={self.seed}: "
                             "build it with the seed of the sampler whose state this is")
        shape = (self.num_hashes, self.num_buckets + 1)
        for key in tables:
            t = state[key]
            if not isinstance(t, Tensor) or t.dtype != torch.float64 or tuple(t.shape) != shape:
                raise ValueError(f"state[{key!r}] must be a float64 tensor of shape {shape} (num_hashes, num_buckets "
                                 f"+ 1), got {t.dtype if isinstance(t, Tensor) else type(t).__name__} "
                                 f"{tuple(t.shape) if isinstance(t, Tensor) else ''}")
            if not bool(((t >= 0) & (t < math.inf)).all()):  # steps, gaps, copies, counts
                raise ValueError(f"state[{key!r}] must hold finite values >= 0 (an estimate's tables)")
        if tables and step < float(state["last"].max()):
            raise ValueError(f"state['step'] must be at least the last step its tables saw an item at, "
                             f"{float(state['last'].max()):g}, got {step} (the tables of a later step?)")
        self.step = int(step)
        loaded = [state[k].clone() for k in tables] or [None] * 4  # type: ignore[union-attr]
        self._last, self._interval, self._copies, self._sightings = loaded

    def draw(self, num_items: int, batch_items: Tensor | None, *, generator: torch.Generator | None,
             device: torch.device) -> Tensor:
        if batch_items is None:
            raise ValueError("InBatchSampler needs the batch's named items: pass head_items (or batch_items) "
                             "to the SampledCatalog")
        batch_items = _batch_ids(batch_items, check_count("num_items", num_items))
        device = _device(device)
        if self.frequency is None:
            self.observe(batch_items)
        return batch_items.reshape(-1).to(device)

    def log_expected_count(self, ids: Tensor, num_items: int, batch_items: Tensor | None) -> Tensor:
        ids = _integer_ids("ids", ids, "[S]")
        if self.frequency is not None:
            if self.frequency.shape[0] != num_items:
                raise ValueError(f"frequency must have num_items={num_items} entries, got {self.frequency.shape[0]}")
            if batch_items is None:  # its slots: without them every count would be 0 and every sample term dropped
                raise ValueError("InBatchSampler needs the batch's named items for its expected counts: pass "
                                 "head_items (or batch_items) to the SampledCatalog, or the batch_items a DrawnSample "
                                 "was drawn with")
            slots = (batch_items >= 0).sum().to(torch.float64)
            q = self.frequency.to(device=ids.device, dtype=torch.float64)[ids.clamp(min=0)]
            return torch.log(q * slots)
        if self._snapshot is None:
            return self._estimate(ids)
        # a frozen copy: its ids' counts as they were when it was made, another id's from the tables as they are
        known, counts = (t.to(ids.device) for t in self._snapshot)
        slot = _found(known, ids.reshape(-1)).reshape(ids.shape)  # known.shape[0] where absent
        return torch.where(slot < known.shape[0], torch.cat([counts, counts.new_zeros(1)])[slot], self._estimate(ids))

    def _estimate(self, ids: Tensor) -> Tensor:
        """``log E[count]`` of ``ids`` from the streaming estimate's tables as they are."""
        if self._last is None:
            return torch.full(ids.shape, -math.inf, dtype=torch.float64, device=ids.device)
        buckets = self._buckets(ids)
        interval = self._interval.to(ids.device).gather(1, buckets).amax(0)
        copies = self._copies.to(ids.device).gather(1, buckets).amin(0)
        seen = self._last.to(ids.device).gather(1, buckets).amin(0) > 0
        return torch.where(seen, torch.log(copies.clamp(min=1e-300)) - torch.log(interval.clamp(min=1e-300)),
                           -math.inf)

    @property
    def draws_batch(self) -> bool:
        return True

    def _draw_size(self, batch_items: Tensor | None) -> int | Tensor | None:
        return None if batch_items is None else (batch_items != -1).sum()

    def log_expected_count_from_others(self, ids: Tensor, num_items: int, batch_items: Tensor) -> Tensor:
        # Every slot holds j with the same chance: the other rows' slots hold (slots - own) / slots of E[count].
        own = (batch_items >= 0).sum(1).to(torch.float64)  # [B]
        slots = own.sum()
        shared = self.log_expected_count(ids, num_items, batch_items)  # [S]
        share = torch.log((slots - own).clamp(min=0.0) / slots.clamp(min=1.0)).to(shared.device)
        return shared.unsqueeze(0) + share.unsqueeze(1)

    def __repr__(self) -> str:
        source = "given" if self.frequency is not None else f"streaming(alpha={self.alpha})"
        return f"InBatchSampler(frequency={source})"


class MixedSampler(NegativeSampler):
    """Several samplers' draws together (Yang et al. 2020: in-batch plus uniform); an id's expected
    count is the sum of theirs, so every item any of them can draw is covered without bias.

    Args:
        *samplers: the :class:`NegativeSampler` objects whose draws are concatenated (at least one).

    Shape:
        - :meth:`draw` → their ids one after the other, ``[S_1 + S_2 + ...]``
        - :meth:`log_expected_count`: ``ids [S]`` → ``[S]`` (float64), the logsumexp of theirs

    Example:
        >>> sampler = MixedSampler(InBatchSampler(), UniformSampler(64))
        >>> sampler.draw(1000, torch.tensor([[1, 2], [2, 3]]), generator=None, device="cpu").shape
        torch.Size([68])
    """

    def __init__(self, *samplers: NegativeSampler) -> None:
        if not samplers:
            raise ValueError("samplers must hold at least one NegativeSampler: MixedSampler(UniformSampler(256), ...)")
        for s in samplers:
            if not isinstance(s, NegativeSampler):
                raise TypeError(f"samplers must be NegativeSampler objects, got {type(s).__name__}")
        self.samplers = samplers

    def draw(self, num_items: int, batch_items: Tensor | None, *, generator: torch.Generator | None,
             device: torch.device) -> Tensor:
        if device is None and isinstance(batch_items, Tensor):  # one device for every part: the batch's
            device = batch_items.device
        return torch.cat([s.draw(num_items, batch_items, generator=generator, device=device) for s in self.samplers])

    def log_expected_count(self, ids: Tensor, num_items: int, batch_items: Tensor | None) -> Tensor:
        parts = torch.stack([s.log_expected_count(ids, num_items, batch_items) for s in self.samplers])
        return torch.logsumexp(parts, dim=0)

    @property
    def draws_batch(self) -> bool:
        return any(s.draws_batch for s in self.samplers)

    def _draw_size(self, batch_items: Tensor | None) -> int | Tensor | None:
        sizes = [s._draw_size(batch_items) for s in self.samplers]
        return None if any(size is None for size in sizes) else sum(sizes)

    def _frozen(self, ids: Tensor) -> NegativeSampler:
        parts = [s._frozen(ids) for s in self.samplers]
        return self if all(p is s for p, s in zip(parts, self.samplers)) else MixedSampler(*parts)

    def state_dict(self) -> dict[str, object]:
        """Each sampler's state, under its position (``"0"``, ``"1"``, ...)."""
        return {str(i): s.state_dict() for i, s in enumerate(self.samplers)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        keys = [str(i) for i in range(len(self.samplers))]
        if sorted(_checked_state(state)) != sorted(keys):
            raise ValueError(f"state must hold one entry per sampler, {keys}, got keys {sorted(state)}")
        for key, sampler in zip(keys, self.samplers):
            sampler.load_state_dict(state[key])  # type: ignore[arg-type]

    def log_expected_count_from_others(self, ids: Tensor, num_items: int, batch_items: Tensor) -> Tensor:
        parts = torch.stack([s.log_expected_count_from_others(ids, num_items, batch_items) for s in self.samplers])
        return torch.logsumexp(parts, dim=0)

    def __repr__(self) -> str:
        return f"MixedSampler({', '.join(map(repr, self.samplers))})"


class DrawnSample(NegativeSampler):
    """A negative sample drawn in advance by ``sampler``: :meth:`draw` returns it, expected counts are the
    sampler's as they were when the sample was made (a streaming :class:`InBatchSampler` learns from every later
    draw: a training pipeline that reads batches ahead has drawn the next ones by the time this one's catalog is
    built). For samples drawn with the batch, so that their rows are looked up with it (as
    :meth:`capg_rec.torchrec.TwoTowerRetriever.with_catalog` does).

    Args:
        ids: the sample ``[S]`` (int64 ids, ``-1``: unused), e.g. ``sampler.draw(num_items, batch_items,
            generator=g, device=d)``: the sampler's whole draw (a validating catalog refuses more or fewer ids, where
            the library knows the sampler's draw: each id's term is divided by the expected count of that draw).
        sampler: the :class:`NegativeSampler` that drew it.
        batch_items: the ``batch_items [B, H]`` it was drawn with, where that is not the batch of the catalog it
            goes to (the catalog's ``batch_items``, else its ``head_items``, which are taken for it otherwise): the
            expected counts of an :class:`InBatchSampler` with a given ``frequency`` depend on it, and a sample
            drawn from the catalog's own head counts each row's own slots out.

    Shape:
        - ids: ``[S]``; batch_items: ``[B, H]``
        - :meth:`draw` → ``ids [S]``; :meth:`log_expected_count`: ``ids [S]`` → ``[S]`` (float64)

    Example:
        >>> sampler = UniformSampler(64)
        >>> sample = DrawnSample(sampler.draw(1000, None, generator=None, device="cpu"), sampler)
        >>> catalog = SampledCatalog(torch.randn(4, 8), torch.randn(1000, 8), sampler=sample)
        >>> catalog.sample_ids.shape
        torch.Size([64])
    """

    def __init__(self, ids: Tensor, sampler: NegativeSampler, batch_items: Tensor | None = None) -> None:
        if not isinstance(sampler, NegativeSampler) or isinstance(sampler, DrawnSample):
            raise TypeError(f"sampler must be the NegativeSampler that drew ids, got {type(sampler).__name__}")
        _integer_ids("ids", ids, "[S]", 1)
        if batch_items is not None:
            _integer_ids("batch_items", batch_items, "[B, H]", 2)
        self.ids, self.sampler = ids.long(), sampler._frozen(ids)
        self.batch_items = None if batch_items is None else batch_items.long()

    def _size_problem(self, batch_items: Tensor | None) -> str | None:
        """What is wrong, if the sample does not hold as many ids (not ``-1``) as its sampler draws from its own
        ``batch_items``, else from the catalog's ``batch_items`` (where its draw depends on them; None: no check):
        each drawn id's term is divided by the sampler's expected count, which holds for its whole draw only (3 of 5
        uniform ids would make every estimated sum 3/5 of the truth). One host read; a validating catalog asks (the
        TorchRec retriever in its collective checks)."""
        drawn_with = self.batch_items if self.batch_items is not None else batch_items
        size = self.sampler._draw_size(drawn_with)
        if size is None:
            return None
        used, size = int((self.ids != -1).sum()), int(size)
        if used == size:
            return None
        return (f"sample must hold the {size} ids that {self.sampler!r} draws"
                f"{f' from batch_items of shape {list(drawn_with.shape)}' if self.sampler.draws_batch else ''}"
                f" (-1: unused slots, not counted), got {used}")

    def _check_counts(self, num_items: int, head_items: Tensor | None) -> None:
        """A ``TypeError`` / ``ValueError`` where the log expected counts of the sample's ids that a
        :class:`SampledCatalog` of ``head_items [B, H]`` (its batch) reads are not a floating tensor of one per id
        (per row, where the sample draws the batch), or NaN or ``+inf``: what a validating catalog checks, for the
        TorchRec retriever's collective checks, whose sampled catalogs are built unchecked."""
        ids = self.ids[self.ids >= 0]
        batch = None if head_items is None else head_items.long()
        _sample_log_counts(self, ids, num_items, batch, batch is not None and self.draws_batch,
                           torch.ones_like(ids, dtype=torch.bool))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DrawnSample:
        """The same sample (and batch) on ``device``."""
        device = _device(device)
        moved = [None if x is None else x.to(device, non_blocking=non_blocking) for x in (self.ids, self.batch_items)]
        return DrawnSample(moved[0], self.sampler, batch_items=moved[1])

    def draw(self, num_items: int, batch_items: Tensor | None, *, generator: torch.Generator | None,
             device: torch.device) -> Tensor:
        return self.ids.to(device)

    def log_expected_count(self, ids: Tensor, num_items: int, batch_items: Tensor | None) -> Tensor:
        drawn_with = self.batch_items.to(ids.device) if self.batch_items is not None else batch_items
        return self.sampler.log_expected_count(ids, num_items, drawn_with)

    @property
    def draws_batch(self) -> bool:
        return self.sampler.draws_batch

    def log_expected_count_from_others(self, ids: Tensor, num_items: int, batch_items: Tensor) -> Tensor:
        mine = self.batch_items
        if mine is None or (mine.shape == batch_items.shape and torch.equal(mine.to(batch_items.device), batch_items)):
            return self.sampler.log_expected_count_from_others(ids, num_items, batch_items)  # drawn from those rows
        return super().log_expected_count_from_others(ids, num_items, batch_items)  # from another batch

    def __repr__(self) -> str:
        return f"DrawnSample({self.ids.shape[0]} ids, {self.sampler!r})"


def _found(sorted_ids: Tensor, ids: Tensor) -> Tensor:
    """The slot of ``sorted_ids [W] | [B, W]`` (sorted, copies kept) holding the first copy of each of
    ``ids [B, E]`` (``-1``: none), or ``W`` where it is absent → ``[B, E]``: a binary search each."""
    width = sorted_ids.shape[-1]
    if width == 0:
        return torch.zeros_like(ids)
    pos = torch.searchsorted(sorted_ids, ids.contiguous()).clamp(max=width - 1)
    at = sorted_ids[pos] if sorted_ids.dim() == 1 else sorted_ids.gather(1, pos)
    return torch.where((at == ids) & (ids >= 0), pos, width)


def _first_copies(ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For ``ids [..., T]``: the sorted ids with later copies (and ``-1``) set to ``-1``, the number
    of copies of each kept id (0 elsewhere) and the sorted ids themselves → three ``[..., T]``."""
    sorted_ids = ids.sort(dim=-1).values
    first = _first_of_runs(sorted_ids)
    # copies of the run starting at i: the end of its run (the insertion point right of its id) minus i
    slot = torch.arange(ids.shape[-1], device=ids.device)
    copies = torch.where(first, torch.searchsorted(sorted_ids, sorted_ids, right=True) - slot, 0)
    return torch.where(first, sorted_ids, -1), copies, sorted_ids


def _first_of_runs(sorted_ids: Tensor) -> Tensor:
    """Sorted ids ``[..., T]`` → bool ``[..., T]``: the first copy of each id ``>= 0``."""
    before = torch.nn.functional.pad(sorted_ids[..., :-1], (1, 0), value=-1)  # each id's left neighbour
    return (sorted_ids != before) & (sorted_ids >= 0)


def _distinct(ids: Tensor) -> tuple[Tensor, Tensor]:
    """``ids [B, T]`` sorted per row, with later copies (and ``-1``) set to ``-1``, and the sorted ids
    themselves → two ``[B, T]``."""
    sorted_ids = ids.sort(dim=-1).values
    return torch.where(_first_of_runs(sorted_ids), sorted_ids, -1), sorted_ids


def _log_sum_exp(head: Tensor, sample: Tensor) -> Tensor:
    """``log Σ exp`` over the last dim of ``head [B, M, T]`` and ``sample [B, M, S]`` together → ``[B, M]``.

    ``sample`` must be a tensor of the caller's own: it is overwritten with its exps, so that its
    terms take one ``[B, M, S]`` buffer each way (the exps are also the backward's). The terms are
    taken relative to the largest (a constant), so the result is shift invariant. ``-inf`` entries add
    nothing and get zero gradient; with no finite entry the result is ``-inf``."""
    parts = [x for x in (head, sample) if x.shape[-1]]
    if not parts:
        return safe_logsumexp(torch.cat([head, sample], -1), dim=-1)
    top = parts[0].detach().amax(-1)
    if len(parts) == 2:
        top = torch.maximum(top, parts[1].detach().amax(-1))
    ref = top.clamp(min=torch.finfo(top.dtype).min).unsqueeze(-1)  # a row with no finite entry: any reference
    total = _exp_in_place(sample.sub_(ref)).sum(-1) if sample.shape[-1] else 0.0
    if head.shape[-1]:
        total = _exp_in_place(head - ref).sum(-1) + total
    # total >= 1 where a term is finite; elsewhere 0, whose log's gradient the clamp keeps finite
    return torch.where(top > -math.inf, total.clamp_min(torch.finfo(top.dtype).tiny).log() + ref.squeeze(-1),
                       -math.inf)


def _exp_in_place(x: Tensor) -> Tensor:
    """``exp(x)`` of relative terms ``x <= 0``, in place, with terms below
    :func:`~capg_rec._numerics.exp_floor` (which vanish next to the largest, 1) set to 0 with zero
    gradient: their exps leave the normal range, where ``exp`` is ~25x slower. A mask fill keeps only
    the mask for the backward (a clamp in place would keep a copy of ``x``)."""
    return x.masked_fill_(x < exp_floor(x.dtype), -math.inf).exp_()


ItemSource = Tensor | Callable[[Tensor], Tensor]

_NO_ROWS = 1 << 62
"""The usable items of a catalog without rows, in agreements of the least: more than any draw needs."""


def _fewest(counts: Tensor) -> int:
    """The least of each row's ``counts [B]``; :data:`_NO_ROWS` without rows (nothing to draw: room for any k)."""
    return int(counts.amin()) if counts.numel() else _NO_ROWS


def check_index_items(index_items: object, *, batch_size: int, num_experts: int, num_items: int,
                      validate: bool) -> Tensor:
    """An index head ``[B, M, H]`` (``[B, H]`` for one expert) of integer ids; with ``validate``, each row and
    expert's ids in ``[-1, N)`` (``-1``: padding, where an approximate index found fewer), none twice →
    ``[B, M, H]`` int64."""
    if not isinstance(index_items, Tensor) or index_items.dtype == torch.bool or index_items.is_floating_point() \
            or index_items.is_complex():
        raise TypeError(f"index_items must be an integer tensor of item ids, got "
                        f"{getattr(index_items, 'dtype', type(index_items).__name__)}")
    found = index_items.unsqueeze(1) if index_items.dim() == 2 and num_experts == 1 else index_items
    if found.dim() != 3 or found.shape[:2] != (batch_size, num_experts):
        raise ValueError(f"index_items must be an id tensor [B={batch_size}, M={num_experts}, H]"
                         f"{' (or [B, H])' if num_experts == 1 else ''}, got {tuple(index_items.shape)}")
    check_count("index_items.shape[2] (H)", found.shape[2], high=num_items)
    rows = check_items("index_items", found.reshape(-1, found.shape[2]), batch_size=batch_size * num_experts,
                       num_items=num_items, validate=validate, low=-1, columns="H")
    return rows.view(found.shape)


def _lookup(table: Tensor, ids: Tensor) -> Tensor:
    """``table [N, M, D]`` rows of ``ids [...]`` → ``[..., M, D]``; an id out of ``[0, N)`` is an error (a negative
    one is not the last row, as it is for ``table[ids]``)."""
    return table.index_select(0, ids.reshape(-1)).view(*ids.shape, *table.shape[1:])


class SampledCatalog(CatalogScores):
    """Scores ``<user[b, m], item[n, m]> / τ`` with catalog-wide sums estimated (see the module doc).

    Args:
        user: ``[B, D]`` or ``[B, M, D]``.
        item: the item table ``[N, D] | [N, M, D]``, or an item tower: a callable mapping ids ``[...]``
            to ``[..., D] | [..., M, D]`` (then ``num_items`` is required). Scores are computed in the widest
            of the user's and the table's (or the tower's parameters') dtypes, at least float32.
        sampler: the :class:`NegativeSampler`; it draws once, at construction, through ``generator``.
        temperature: τ > 0.
        index: an :class:`~capg_rec.ann.ItemIndex` over the items (queried with the user vectors):
            each expert's ``head_size`` best items join the head.
        head_size: items per expert from ``index`` (0: no index head).
        index_items: ``[B, M, H]`` (``[B, H]`` for one expert) ids: each expert's H best items, found
            beforehand in an index (where the item rows must be looked up before the catalog is built, as in
            TorchRec's sampled mode): the same head as ``index`` with ``head_size=H``, without the query.
            ``-1`` pads the slots of an approximate index that found fewer; no id twice per row and expert.
        head_items: ``[B, H]`` ids scored exactly in every sum (the candidates, logged items), ``-1``
            padded. They are also the in-batch sampler's batch unless ``batch_items`` is given.
        batch_items: ``[B', H']`` ids for in-batch samplers (``-1`` padded).
        masked_items: ``[B, E]`` ids outside each row's catalog (``-1`` padded): scored ``-inf``.
        num_items: N, required for a callable ``item``.
        generator: the sampler's randomness.
        validate_args: check embeddings are finite and ids in range (host syncs); ``None``: the default.

    Shape:
        - user: ``[B, D]`` or ``[B, M, D]``; item: ``[N, D]`` or ``[N, M, D]``, or a tower ``[...]`` → ``[..., D]``
          or ``[..., M, D]``
        - head_items: ``[B, H]``; index_items: ``[B, M, H]``; batch_items: ``[B', H']``; masked_items: ``[B, E]``
        - :meth:`gather` of ``items [B, L]`` → ``[B, M, L]`` (exact); :meth:`log_power_sums` → ``[B, M, P]``,
          ``P ≤ 3`` (estimated)

    Example:
        >>> item_tower = torch.nn.Embedding(1000, 8)       # a callable item side: num_items is required
        >>> catalog = SampledCatalog(torch.randn(4, 8), item_tower, sampler=UniformSampler(64), num_items=1000)
        >>> # (index=..., head_size=... would add each expert's best items from an ItemIndex to the head)
        >>> candidates = capg_rec.sample_candidates(catalog, 10)
        >>> catalog = catalog.resampled(UniformSampler(64), head_items=candidates)
        >>> loss_fn = capg_rec.CAPGLoss(10, method="with_replacement")
        >>> loss = loss_fn(catalog, candidates, candidates[:, :2], torch.rand(4, 2))
        >>> loss.backward()
    """

    def __init__(self, user: Tensor, item: ItemSource, *, sampler: NegativeSampler, temperature: float = 1.0,
                 index: ItemIndex | None = None, head_size: int = 0, index_items: Tensor | None = None,
                 head_items: Tensor | None = None, batch_items: Tensor | None = None,
                 masked_items: Tensor | None = None, num_items: int | None = None,
                 generator: torch.Generator | None = None, validate_args: bool | None = None) -> None:
        self.validate = resolve_validate_args(validate_args)
        self.check_draws = self.validate  # top_items checks each row holds k usable items (a host sync)
        self._source = (user, item, temperature, num_items)  # for resampled()
        user = check_float_tensor("user", user, ndims=(2, 3), validate=self.validate)
        if not isinstance(sampler, NegativeSampler):
            raise TypeError(f"sampler must be a NegativeSampler, got {type(sampler).__name__}")
        check_generator(generator)
        tau = check_positive("temperature", temperature)
        user = user.unsqueeze(1) if user.dim() == 2 else user
        tower = item.parameters() if isinstance(item, torch.nn.Module) else ()
        self._source_dtypes = (user.dtype, *([item.dtype] if isinstance(item, Tensor) else
                                             [p.dtype for p in tower if p.is_floating_point()]))
        self.dtype = compute_dtype(*self._source_dtypes)
        self.user = user.to(self.dtype) / tau if tau != 1.0 else user.to(self.dtype)  # [B, M, D]
        self.batch_size, self.num_experts = self.user.shape[:2]
        self.device = user.device
        if isinstance(item, Tensor):
            item = check_float_tensor("item", item, ndims=(2, 3), validate=self.validate)
            table = item.unsqueeze(1) if item.dim() == 2 else item
            if table.shape[1:] != self.user.shape[1:]:
                raise ValueError(f"user [B, M, D] and item [N, M, D] must agree on (M, D), got "
                                 f"{tuple(self.user.shape[1:])} and {tuple(table.shape[1:])}")
            self.num_items = table.shape[0]
            if num_items is not None and num_items != self.num_items:
                raise ValueError(f"num_items={num_items} differs from the item table's {self.num_items} rows (it is "
                                 "for a callable item tower)")
            self._tower: Callable[[Tensor], Tensor] = functools.partial(_lookup, table)
        elif callable(item):
            if num_items is None:
                raise ValueError("num_items is required when item is a callable item tower")
            self.num_items = check_count("num_items", num_items)
            self._tower = item
            self._lookup_refuses_bad_ids = False  # the ids are checked for it (CatalogScores._named)
        else:
            raise TypeError(f"item must be a torch.Tensor or a callable item tower, got {type(item).__name__}")
        self.sampler = sampler
        self.masked_items = self._ids("masked_items", masked_items, "E")
        given_batch = batch_items
        head_items = self._ids("head_items", head_items, "H")
        batch_items = head_items if batch_items is None else self._ids("batch_items", batch_items, "H'", any_batch=True)
        # The rows' own heads (see below): by default, or given again as the batch (compared by value).
        own_batch = head_items is not None and (given_batch is None or (
            batch_items.shape == head_items.shape and torch.equal(batch_items, head_items)))
        if index is not None and not isinstance(index, ItemIndex):
            raise TypeError(f"index must be an ItemIndex, got {type(index).__name__}")
        if index is not None and index.num_items != self.num_items:
            raise ValueError(f"index must be built on the catalog's {self.num_items} items, got {index.num_items}")
        self.head_size = check_count("head_size", head_size, low=0, high=self.num_items)
        if self.head_size and index is None:
            raise ValueError("head_size > 0 needs an index (an ItemIndex over the items)")
        if index is not None and not self.head_size:
            raise ValueError("index needs head_size > 0 (the items per expert it adds to the head), got head_size=0")
        found = self._index_items(index_items, index)
        with torch.no_grad():
            parts = [] if head_items is None else [head_items]
            if self.head_size and found is None:
                if (index.num_experts or 1) != self.num_experts or index.dim != self.user.shape[2]:
                    raise ValueError(f"index must be built on M={self.num_experts} experts of dim "
                                     f"D={self.user.shape[2]}, got M={index.num_experts or 1}, D={index.dim}")
                queries = self.user if index.num_experts is not None else self.user[:, 0]
                found = index.search(queries, self.head_size)[1].reshape(self.batch_size, self.num_experts,
                                                                          self.head_size)
            self.index_items, self._exact_top = found, None  # [B, M, H] or None
            self._room_for: int | None = None  # a k that every row can read its best of (see _best_items)
            if found is not None:
                self.head_size = found.shape[2]
                parts.append(found.flatten(1))
            head = torch.cat(parts, 1) if parts else torch.zeros(self.batch_size, 0, dtype=torch.long,
                                                                 device=self.device)
            # [B, T] (-1: a later copy or unused) and the same sorted with its copies, for lookups
            self.head_ids, self._head_sorted = _distinct(head.to(self.device)) if head.shape[1] else (head, head)
            sample = _integer_ids(f"{type(sampler).__name__}.draw's ids", sampler.draw(
                self.num_items, batch_items, generator=generator, device=self.device), "[S]", 1)
            low, high = (int(v) for v in torch.aminmax(sample)) if self.validate and sample.numel() else (0, 0)
            if low < -1 or high >= self.num_items:
                raise ValueError(f"sampler must draw ids in [0, {self.num_items}) (-1: an unused slot), got ids in "
                                 f"[{low}, {high}]")
            problem = sampler._size_problem(batch_items) if self.validate and isinstance(sampler, DrawnSample) \
                else None
            if problem is not None:
                raise ValueError(problem)
            self.sample_ids, copies, self._sample_sorted = _first_copies(sample.to(self.device).long())  # [S]
            # Where the batch is the rows' own heads, a row's own head items are in the sample but scored exactly
            # (their terms dropped): its sums take the other rows' draws, whose expected counts are those of the other
            # rows' slots ([B, S]).
            per_row = own_batch and sampler.draws_batch
            log_count = _sample_log_counts(sampler, self.sample_ids, self.num_items, batch_items, per_row,
                                           self.sample_ids >= 0 if self.validate else None)  # [B, S] or [S]
            if per_row:
                log_count = log_count.unsqueeze(1)  # [B, 1, S]
                if self.validate and log_count.shape[2]:
                    # A row that no other row's slot can give an item (a batch of one row) has no estimate of
                    # the catalog outside its head: its sums would silently be its head's alone.
                    alone = (log_count == -math.inf).all(2)[:, 0]
                    if bool(alone.any()):
                        raise ValueError(f"sampler draws from the batch's other rows only, and row "
                                         f"{int(alone.nonzero()[0, 0])} has no other row to draw from (a batch of "
                                         "one row?): mix in a UniformSampler (MixedSampler), or batch more rows")
            never = (self.sample_ids >= 0) & (log_count == -math.inf)  # drawn, yet of expected count 0
            if self.validate and bool(never.any()):
                item = int(self.sample_ids[never.nonzero()[0, -1]])
                raise ValueError(f"sampler drew item {item}, whose expected count it gives as 0 (a given frequency "
                                 "of 0 for an item in the batch?): its terms would silently be left out of the sums")
            usable = ~never & (self.sample_ids >= 0)
            log_weight = torch.where(usable, copies.to(torch.float64).log() - log_count, -math.inf)
            self.sample_log_weight = log_weight.to(self.dtype)  # [S], or [B, 1, S] per row
            # The sample's terms are its scores plus this bias: log w_j, or -inf where left out of the sums:
            # unused slots (-1: unused or a later copy), ids in the head (scored exactly) and masked ids.
            # Without head or masks it is shared by the rows.
            bias = self.sample_log_weight.masked_fill(~usable, -math.inf)
            bias = bias.view(1, 1, -1) if bias.dim() == 1 else bias  # [B | 1, 1, S]
            named = [ids for ids in (self.head_ids, self.masked_items) if ids is not None and ids.shape[1]]
            self._sample_bias = self._without(bias, torch.cat(named, 1)) if named else bias  # [B | 1, 1, S]
        self.head_scores = self.user.new_zeros(self.batch_size, self.num_experts, 0)  # [B, M, T]
        if head.shape[1]:
            self.head_scores = self.gather(unpadded(self.head_ids)).masked_fill(
                (self.head_ids < 0).unsqueeze(1), -math.inf)
        # The sample is shared by the rows: S lookups, one [B, M, D] × [S, M, D] product.
        vectors = self._vectors(unpadded(self.sample_ids))
        with no_autocast(self.device):
            if self.num_experts == 1:
                self.sample_scores = (self.user[:, 0] @ vectors[:, 0].T).unsqueeze(1)
            else:
                self.sample_scores = torch.matmul(self.user.transpose(0, 1), vectors.permute(1, 2, 0)).transpose(0, 1)
        if self._not_finite(self.sample_scores, lambda: vectors):
            # an overflow of finite vectors, in any slot: the sums add a slot's bias (-inf where left out) to its score
            raise _overflow_error(self.dtype)

    @property
    def sample_drop(self) -> Tensor:
        """Sample slots left out of every sum, per row → bool ``[B, S]``: unused (``-1``: unused or a later
        copy), in the row's head (scored exactly) or masked."""
        return (self._sample_bias[:, 0] == -math.inf).expand(self.batch_size, -1)

    def _without(self, bias: Tensor, ids: Tensor) -> Tensor:
        """``bias [B | 1, 1, S]`` with ``-inf`` at the sample slots holding one of each row's ``ids [B, E]``
        (``-1``: none) → a new ``[B, 1, S]``.

        The first copy of an id in the sorted sample is the slot that is kept; the misses go to a spare
        last column, so that one scatter writes them all."""
        size = self._sample_sorted.shape[0]
        if size == 0 or ids.shape[1] == 0:
            return bias.expand(self.batch_size, 1, size)
        out = bias.new_empty(self.batch_size, 1, size + 1)  # the spare column is never read
        out[..., :size] = bias
        return out.scatter_(2, _found(self._sample_sorted, ids).unsqueeze(1), -math.inf)[..., :size]

    def resampled(self, sampler: NegativeSampler, *, head_items: Tensor | None = None,
                  batch_items: Tensor | None = None, generator: torch.Generator | None = None) -> SampledCatalog:
        """This catalog's users, item side, temperature, masks and index head with a fresh negative sample
        (``sampler`` draws it, through ``generator``; a :class:`DrawnSample` gives one drawn already) and
        ``head_items``: e.g. the loss's catalog once candidates are drawn from this one, whose sample they
        come from (the sums of a catalog whose head was chosen from its own sample are biased). The item side
        is called again for the new ids (in TorchRec's sampled mode they must have been listed too).

        Example (a sketch: the names it takes come from your loop)::

            candidates = sample_candidates(catalog, K)
            loss = CAPGLoss(K)(catalog.resampled(UniformSampler(4096), head_items=candidates), candidates,
                               chosen, rewards)
        """
        user, item, temperature, num_items = self._source
        new = copy.copy(self)  # a subclass's own attributes come along
        new._trusted = False  # a copy made inside a caller's _trusting() checks its own lookups
        SampledCatalog.__init__(new, user, item, sampler=sampler, temperature=temperature,
                                index_items=self.index_items, head_items=head_items, batch_items=batch_items,
                                masked_items=self.masked_items, num_items=num_items, generator=generator,
                                validate_args=self.validate)
        new.check_draws = self.check_draws
        return new

    def _index_items(self, index_items: Tensor | None, index: ItemIndex | None) -> Tensor | None:
        """``index_items`` checked, as ``[B, M, H]`` on the catalog's device (None if not given)."""
        if index_items is None:
            return None
        if index is not None:
            raise ValueError("give index (with head_size) or index_items, not both")
        return check_index_items(index_items, batch_size=self.batch_size, num_experts=self.num_experts,
                                 num_items=self.num_items, validate=self.validate).to(self.device)

    def _ids(self, name: str, ids: Tensor | None, columns: str, any_batch: bool = False) -> Tensor | None:
        if ids is None:
            return None
        if any_batch and isinstance(ids, Tensor) and ids.dim() != 2:  # of any batch: B' in its message, not B
            raise ValueError(f"{name} must have shape [B', {columns}], got {tuple(ids.shape)}")
        batch = ids.shape[0] if any_batch and isinstance(ids, Tensor) else self.batch_size
        return check_items(name, ids, batch_size=batch, num_items=self.num_items, unique=False,
                           validate=self.validate, low=-1, columns=columns).to(self.device)

    def _vectors(self, ids: Tensor) -> Tensor:
        """Item vectors of ``ids [...]`` → ``[..., M, D]`` in the compute dtype."""
        v = self._tower(ids)
        if v.dim() == ids.dim() + 1:
            v = v.unsqueeze(-2)
        if v.shape[-2:] != self.user.shape[1:]:
            raise ValueError(f"the item tower must give [..., D] or [..., M, D] with (M, D) = "
                             f"{tuple(self.user.shape[1:])}, got {tuple(v.shape)}")
        return v.to(self.dtype)

    def _score(self, items: Tensor) -> Tensor:
        """``items [B, L]`` → ``[B, M, L]`` (no mask applied).

        A product and a sum rather than a batched matmul of B·M ``[L, D] × [D, 1]`` products, whose
        backward is 3x slower at L = 10."""
        return (self._vectors(items) * self.user.unsqueeze(1)).sum(-1).transpose(1, 2)

    def num_available(self) -> Tensor:
        if self.masked_items is None:
            return super().num_available()
        return available_given_masks(self.masked_items, self.num_items, self.num_experts)

    def _every_score(self) -> Tensor:
        """Every item's vectors looked up once ``[N, M, D]`` and one product with the users, rather than the default
        lookup of every item for every row (a ``[B, N, M, D]`` copy: 23x the memory and 10x the time of an
        :class:`~capg_rec.EmbeddingCatalog`'s read at B = 512, N = 2000, D = 64), masks scattered as that catalog's
        are. The ids are in range by construction; the item side's own checks run (nobody vouched for the whole
        catalog: in TorchRec's sampled mode, every row must have been listed). An empty batch asks for no item, but
        still calls the item side (whose checks may be collective), and stays in the graph as a lookup would."""
        everything = torch.arange(self.num_items if self.batch_size else 0, device=self.device)
        with self._trusting(False):
            vectors = self._vectors(everything)
        if not self.batch_size:
            return (self.user.sum() + vectors.sum()) * self.user.new_zeros(0, self.num_experts, self.num_items)
        with no_autocast(self.device):
            scores = torch.einsum("bmd,nmd->bmn", self.user, vectors)
        suspect = self._not_finite(scores, lambda: vectors)
        masked = _exclusion_mask(self.masked_items, self.batch_size, 0, self.num_items, self.device)
        return _masked(scores, None if masked is None else masked.unsqueeze(1), check=suspect)

    def gather(self, items: Tensor) -> Tensor:
        items = self._named(items)
        # A table's lookup refuses ids out of range itself; a callable tower's errors are its own.
        table = self._lookup_refuses_bad_ids
        scores = ids_in_range(self.num_items, self._score, items) if table else self._score(items)

        def vectors() -> Tensor:  # read again only where a score is not finite, with no collective
            with self._trusting():
                return self._vectors(items)

        return masked_named_scores(scores, items, self.masked_items, check=self._not_finite(scores, vectors))

    def _not_finite(self, scores: Tensor, vectors: Callable[[], Tensor]) -> bool:
        """With the checks on, whether a score is not finite (one host read; False with them off); if so, a
        ``ValueError`` where the item ``vectors()`` it was made of are not finite, masked items' included (the mask's
        gradient, 0 times NaN, is NaN). True means an overflow of finite vectors, for the masks' check to judge
        (harmless where masked): the scores are read again only then."""
        if not (self.validate and scores.numel() and not all_finite(scores.detach())):
            return False
        if not all_finite(vectors().detach()):
            raise ValueError(_NOT_FINITE_VECTORS)
        return True

    def _terms(self, exclude: Tensor | None) -> tuple[Tensor, Tensor]:
        """The head's scores ``[B, M, T]`` and the sample's bias ``[B | 1, 1, S]`` (``log w_j``) with ``-inf``
        where left out of the sums: unused, in the head (sample), masked or in ``exclude [B, E]``."""
        head, bias = self.head_scores, self._sample_bias
        exclude = self._exclusions(exclude)
        if exclude is not None and exclude.numel():
            size = self.head_ids.shape[1]
            if size:  # the first copy of an id in the sorted head is its kept slot
                spare = torch.zeros(self.batch_size, size + 1, dtype=torch.bool, device=self.device)
                gone = spare.scatter_(1, _found(self._head_sorted, exclude), True)[:, :size]
                head = head.masked_fill(gone.unsqueeze(1), -math.inf)
            bias = self._without(bias, exclude)
        return head, bias

    @property
    def exact_top(self) -> int:
        """How many of each expert's best items the index head names exactly in every row: its size, less
        the most slots of a row and expert that are padding (``-1``: an approximate index that found fewer)
        or masked items (the whole catalog when the head holds every item of every row). A host sync, once."""
        if self._exact_top is None:
            self._exact_top, = self._least(self._named_best())
        return self._exact_top

    def _best_items(self, k: int) -> int:
        """:attr:`exact_top`, and with ``check_draws`` in the same agreement whether every row (of every process,
        all asking for the same k) holds ``k`` usable items: then a read of each expert's best k (:meth:`top_items`
        without exclusions, e.g. mean-field's head) skips its own check; else it takes it, in every process alike."""
        if not (self.check_draws and self._agrees_alike()) or k >= self.num_items:  # k >= N: read whole, no top_items
            return self.exact_top
        usable = self._usable()
        mine = _fewest(usable)
        named, room, fewest, most = self._least(self._named_best(), mine - k, k, -k)
        self._exact_top = named
        self._room_for = k if room >= 0 and fewest == -most else None
        return named

    def _named_best(self) -> int:
        """:attr:`exact_top` from this catalog's rows alone."""
        if self.head_size >= self.num_items and bool((self.index_items >= 0).all()):  # an index head of every item
            return self.num_items
        if self.head_ids.shape[1] >= self.num_items:
            if self.batch_size == 0 or int((self.head_ids >= 0).sum(1).amin()) >= self.num_items:
                return self.num_items
        if self.index_items is None or self.batch_size == 0:
            return self.head_size
        usable = self.index_items >= 0
        if self.masked_items is not None and self.masked_items.shape[1]:
            usable &= ~(self.index_items.unsqueeze(3) == self.masked_items.view(self.batch_size, 1, 1, -1)).any(3)
        return int(usable.sum(2).amin())

    def _least(self, *values: int) -> tuple[int, ...]:
        """Each of ``values``, the least over the processes that share this catalog (here one; a subclass whose
        processes must take the same paths agrees on them, in one agreement)."""
        return values

    def _agrees_alike(self) -> bool:
        """Whether :meth:`_least` agrees among all the processes that share this catalog: one process, or a subclass
        that agrees through it as through :meth:`agree` (one that overrides :meth:`agree` alone keeps the checks of
        each call, which go through :meth:`agree`)."""
        return agreement(self) is None or type(self)._least is not SampledCatalog._least

    def _drawing(self, num_candidates: int,
                 failed: Exception | None = None) -> contextlib.AbstractContextManager | None:
        """With ``check_draws``, one check that every row has ``num_candidates`` unmasked items and that its head
        and sample hold as many usable ones (in every process, which must all draw as many; one agreement), and a
        context in which the draw's :meth:`top_items` calls, one per expert block, skip their own checks: each
        block's expert finds the usable items that the earlier blocks left, since usable means the same under
        every expert (not unused, repeated or masked)."""
        if not (self.check_draws and self._agrees_alike()):
            return None
        usable, available = self._usable(), self.num_available()[:, 0]  # masks are every expert's
        mine, unmasked = _fewest(usable), _fewest(available)
        fine, room, spare, fewest, most = self._least(int(failed is None), mine - num_candidates,
                                                      unmasked - num_candidates, num_candidates, -num_candidates)
        if not fine:  # some process's arguments were bad
            raise failed if failed is not None else ValueError(FAILED_ELSEWHERE)
        if fewest != -most:
            raise ValueError(f"num_candidates must be the same in every process that shares this SampledCatalog, "
                             f"got {fewest} to {-most}")
        if spare < 0:  # the masks leave too few: no sample can help
            if unmasked >= num_candidates:
                raise ValueError(f"num_candidates={num_candidates} needs more unmasked items in another process's "
                                 "rows (items scored -inf are masked)")
            row = int((available < num_candidates).nonzero()[0, 0])
            raise ValueError(f"num_candidates={num_candidates} needs {num_candidates} unmasked items, but row {row} "
                             f"has {int(available[row])} (items scored -inf are masked)")
        if room < 0:
            if mine >= num_candidates:
                raise ValueError(f"num_candidates={num_candidates} exceeds the usable items of another process's "
                                 "SampledCatalog: raise head_size or the number of negatives")
            row = int((usable < num_candidates).nonzero()[0, 0])
            raise ValueError(f"num_candidates={num_candidates} exceeds the usable items (not masked or repeated) of "
                             f"this SampledCatalog's head and sample: row {row} has {int(usable[row])}; raise "
                             "head_size or the number of negatives")
        return self._checks_off()

    @contextlib.contextmanager
    def _checks_off(self) -> Iterator[None]:
        self.check_draws = False
        try:
            yield
        finally:
            self.check_draws = True

    def _usable(self) -> Tensor:
        """Usable items in each row's head and sample (neither unused, a later copy, nor masked) → ``[B]``."""
        head = (self.head_scores[:, 0] > -math.inf).sum(1)
        return head + (self._sample_bias[:, 0] > -math.inf).sum(1)  # a bias shared by the rows broadcasts

    def log_power_sums(self, exclude: Tensor | None = None, num_powers: int = 1) -> Tensor:
        """Estimated ``log Σ_{n ∉ exclude[b]} exp(p · s[b, m, n])``, ``p = 1..P ≤ 3`` → ``[B, M, P]``:
        exact over the head, importance-weighted over the sample (an unbiased estimate of the sum)."""
        check_count("num_powers", num_powers)
        if num_powers > MAX_SAMPLED_POWERS:
            raise ValueError(f"num_powers must be <= {MAX_SAMPLED_POWERS} for a SampledCatalog, got {num_powers}: "
                             "it estimates power sums only up to p = 3, so the 'exact' method is not supported; "
                             "use 'with_replacement', 'mean_field' or 'plugin'")
        head, bias = self._terms(exclude)
        out = [_log_sum_exp(head if p == 1 else p * head, torch.add(bias, self.sample_scores, alpha=p))
               for p in range(1, num_powers + 1)]
        return torch.stack(out, -1)

    def _check_usable(self, keys: Tensor, k: int, experts: Sequence[int] | None) -> None:
        """Raise a ``ValueError`` (in every process that shares the catalog) where a row's head and sample
        hold fewer than ``k`` usable items (``keys [B, M', T]``: ``-inf`` where unused, a later copy,
        masked or excluded): the k best would name unused slots (``-1``) or masked items."""
        usable = (keys > -math.inf).sum(-1)  # [B, M']
        raise_where_short(self.agree, usable < k, lambda at: (
            f"k={k} exceeds the usable items (not masked, excluded or repeated) of this SampledCatalog's head and "
            f"sample: row {at[0]} has {int(usable[at])} under expert {at[1] if experts is None else experts[at[1]]}; "
            "raise head_size or the number of negatives"),
            f"k={k} exceeds the usable items of another process's SampledCatalog: raise head_size or the number of "
            "negatives")

    def top_items(self, k: int, *, experts: Sequence[int] | None = None, exclude: Tensor | None = None,
                  generator: torch.Generator | None = None, perturb: bool = False) -> Tensor:
        """The k best of head ∪ sample (the catalog's best when the head holds them); with
        ``perturb=True`` a Gumbel top-k over head ∪ sample whose sample keys carry their logQ
        weights (exact when the head is the whole catalog; see the module doc)."""
        check_count("k", k)
        perturb = check_flag("perturb", perturb)
        size = self.head_ids.shape[1]
        pool = size + self.sample_ids.shape[0]
        # Every process decides alike whether this call checks its rows' room (one agreement): not when a draw or
        # a read of the best k items agreed on it already (_drawing, _best_items).
        agreed = exclude is None and k == self._room_for
        if agreed:
            self._room_for = None  # for one read: a later call (maybe with another k elsewhere) checks again
        checking = self.check_draws and not agreed
        if k > pool:
            collective = agreement(self) is not None
            if collective and not self.batch_size:  # no rows here, nothing to draw: take part in the others' check
                if checking:
                    self._check_usable(self.user.new_zeros(0, 1, 0), k, experts)
                return self.sample_ids.new_zeros(0, self.num_experts if experts is None else len(experts), k)
            if not (checking and collective):  # checks off, or one process: raise here (else in the check below)
                raise ValueError(f"k={k} exceeds the head and sample of this SampledCatalog ({pool} slots): "
                                 "raise head_size or the number of negatives")
        with torch.no_grad():
            head, bias = self._terms(exclude)
            sample = self.sample_scores
            if experts is not None:  # views for consecutive experts
                head, sample = select_experts(head, experts), select_experts(sample, experts)
            # One buffer of keys: the head's scores, the sample's plus its bias (or its -inf); for the Gumbel
            # top-k padded with -inf to whole groups of gumbel_top_k's own group size, which spares it a copy.
            width = size + sample.shape[2]
            group = gumbel_group_size(width, k)
            padded = -(-width // group) * group if perturb and group > 1 else width
            keys = sample.new_empty(*sample.shape[:2], padded)
            keys[..., :size] = head
            if perturb:
                torch.add(sample, bias, out=keys[..., size:width])
            else:
                keys[..., size:width] = sample
                keys[..., size:width].masked_fill_(bias == -math.inf, -math.inf)
            keys[..., width:] = -math.inf
            if checking:
                self._check_usable(keys[..., :width], k, experts)
            pos = gumbel_top_k(keys, k, generator=generator, group_size=group) if perturb else top_k(keys, k)
            if not size:
                return self.sample_ids[pos]
            in_head = self.head_ids.unsqueeze(1).expand(-1, pos.shape[1], -1).gather(2, pos.clamp(max=size - 1))
            if pool == size:
                return in_head
            return torch.where(pos < size, in_head, self.sample_ids[(pos - size).clamp(min=0)])
