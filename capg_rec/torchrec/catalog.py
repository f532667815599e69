"""Catalog scores over an item table whose rows are split across ranks.

Each rank holds a contiguous block of item rows (a row-wise shard, a whole table, or nothing)
and its own users. The users are all-gathered once, every catalog-wide reduction is computed on
the local rows for all users (streamed in chunks with recomputation in backward, exactly as
:class:`capg_rec.EmbeddingCatalog` does), and the per-rank partial results are combined with
autograd-aware collectives. A loss computed from these scores on each rank therefore back-
propagates ``∂(Σ_ranks loss)/∂(local rows)`` into the local item rows and ``∂(Σ_ranks loss)/∂(users)``
into the local users: the same gradients as one process holding the concatenated batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from capg_rec._checks import check_count, check_flag, check_float_tensor, check_id_tensor, check_positive, \
    resolve_validate_args
from capg_rec._numerics import no_autocast, safe_logsumexp, top_k
from capg_rec.catalog import CatalogScores, _chunked_top_k, _ChunkedLogPowerSums, _expert_views, chunk_items, \
    available_given_masks
from capg_rec._collective import agree, all_gather_rows, exchange, gather_rows, on_ranks, ranks_where, \
    reduce_rows, stack_ranks
from capg_rec.torchrec._noise import BLOCK, BlockNoise, draw_seed

__all__ = ["ShardedEmbeddingCatalog"]

_DTYPES = (torch.float32, torch.float64)  # compute dtypes, by code in the set-up exchange


class ShardedEmbeddingCatalog(CatalogScores):
    """``s[b, m, n] = <user[b, m], item[n, m]> / τ`` with the item rows split over ranks.

    Args:
        user: this rank's users ``[B_r, D]`` or ``[B_r, M, D]`` (``B_r`` may be 0).
        item: this rank's item rows ``[R, D]`` or ``[R, M, D]``: global ids ``[row_offset, row_offset + R)``
            (``R`` may be 0 on ranks that hold none); the ranks' rows must tile ``[0, num_items)``.
            Scored in the wider of the user's and item's dtypes, at least float32, as by
            :class:`capg_rec.EmbeddingCatalog`.
        num_items: N, the size of the whole catalog.
        row_offset: global id of the first local row (default 0).
        temperature: τ > 0 (default 1.0).
        masked_items: ``[B_r, E]`` global ids of items outside each of this rank's users' catalog
            (already seen, unavailable), padded with ``-1``: they score ``-inf``, are never drawn and
            are left out of every catalog-wide reduction (each rank drops those among its rows).
        chunk_size: items scored at once; memory is ``O(ΣB_r·M·chunk_size)``. None: the default of
            :func:`capg_rec.catalog.chunk_items` for the ``ΣB_r·M`` score rows of every rank's users (the same on
            every rank).
        process_group: the ranks sharing the catalog; ``None`` means a single process (no collectives).
        validate_args: check the values (finite embeddings, ids in range, the same id widths on
            every rank) collectively: every rank raises the same ``ValueError`` or none. ``None``
            takes :func:`capg_rec.set_default_validate_args`'s default; it must be the same on every rank.

    All ranks of the group must call the same methods in the same order, with id tensors of the
    same width (the estimators do); with validation off a mistake there is undefined behaviour.
    Set-up errors (types, shapes, layouts) are raised on every rank alike. With validation off,
    :meth:`gather` and :meth:`log_power_sums` make no host sync; the constructor makes one (the
    ranks' batch sizes), plus the value checks when validating, in the same collective.
    ``batch_size`` is the local ``B_r``; results are for this rank's users. Sampling noise is a
    function of (seed, global user index, expert, item id) only: fixed blocks of item ids, each
    drawn by a generator seeded from (seed, block, expert), with the seed drawn from rank 0's
    generator, so a seed gives the same candidates at any world size. The global user index is
    the position in the batch concatenated over ranks in rank order.

    Shape:
        - user: ``[B_r, D]`` or ``[B_r, M, D]``; item: ``[R, D]`` or ``[R, M, D]``; masked_items: ``[B_r, E]``
        - scores ``s``: ``[B_r, M, N]`` for this rank's users, never held whole: :meth:`gather` of
          ``items [B_r, L]`` → ``[B_r, M, L]``, :meth:`log_power_sums` → ``[B_r, M, P]``, :meth:`top_items` →
          ``[B_r, M, k]``

    Example:
        >>> catalog = ShardedEmbeddingCatalog(torch.randn(4, 8), torch.randn(100, 8), num_items=100)  # one process
        >>> candidates = capg_rec.sample_candidates(catalog, 10)
        >>> catalog.gather(candidates).shape
        torch.Size([4, 1, 10])
    """

    def __init__(self, user: Tensor, item: Tensor, *, num_items: int, row_offset: int = 0,
                 temperature: float = 1.0, masked_items: Tensor | None = None, chunk_size: int | None = None,
                 process_group: dist.ProcessGroup | None = None, validate_args: bool | None = None) -> None:
        self.group = process_group
        self._rank = 0 if process_group is None else dist.get_rank(process_group)

        def set_up() -> list[int | Tensor]:
            return self._set_up(user, item, num_items, row_offset, temperature, masked_items, chunk_size,
                                validate_args)

        if process_group is None and not resolve_validate_args(validate_args):
            table = [set_up()]  # plain ints: nothing to check or exchange
        else:
            device = user.device if isinstance(user, Tensor) else torch.device("cpu")
            table = exchange(set_up, 12, process_group, device)
            self._agree_on_set_up(table)
        self._sizes = [entries[0] for entries in table]
        self.chunk_size = chunk_items(chunk_size, sum(self._sizes) * self.num_experts, self.device)  # every user
        self._start = sum(self._sizes[: self._rank])
        widths = [entries[1] for entries in table]
        self._masked_all = None  # [B_tot, E_max]: everyone's masked ids, as local row ids
        if max(widths) > 0:
            mine = self._masked_sorted if self._masked_sorted is not None else \
                torch.empty((self.batch_size, 0), dtype=torch.long, device=self.device)
            padded = torch.nn.functional.pad(mine, (0, max(widths) - mine.shape[1]), value=-1)
            masked = padded if self.group is None else all_gather_rows(padded, self._sizes, self.group)
            self._masked_all = self._local_ids(masked)
        self.user_all = self._user if self.group is None else \
            gather_rows(self._user, self._sizes, self._rank, self.group)  # [B_tot, M, D]
        del self._user

    def _set_up(self, user: Tensor, item: Tensor, num_items: int, row_offset: int, temperature: float,
                masked_items: Tensor | None, chunk_size: int | None, validate_args: bool | None
                ) -> list[int | Tensor]:
        """This rank's structural checks and attributes → its entries of the set-up exchange."""
        self.validate = resolve_validate_args(validate_args)
        user = check_float_tensor("user", user, ndims=(2, 3), validate=False)
        item = check_float_tensor("item", item, ndims=(2, 3), validate=False)
        tau = check_positive("temperature", temperature)
        self.num_items = check_count("num_items", num_items)
        self.row_offset = check_count("row_offset", row_offset, low=0)
        user, item, dtype = _expert_views(user, item)
        if chunk_size is not None:
            check_count("chunk_size", chunk_size)
        if self.group is None and (row_offset, item.shape[0]) != (0, num_items):
            raise ValueError(f"without a process_group item must hold the whole catalog: row_offset=0 and "
                             f"{num_items} rows, got row_offset={row_offset} and {item.shape[0]} rows")
        if row_offset + item.shape[0] > num_items:
            raise ValueError(f"local rows [row_offset={row_offset}, {row_offset + item.shape[0]}) must lie "
                             f"inside the catalog [0, num_items={num_items})")
        self.dtype, self.device = dtype, user.device
        self._source_dtypes = (user.dtype, item.dtype)
        user, item = user.to(self.dtype), item.to(self.dtype)
        self.item = item  # [R, M, D]
        self.batch_size, self.num_experts = user.shape[:2]
        self._user = user / tau if tau != 1.0 else user
        self._masked_sorted = None  # [B_r, E] this rank's masked global ids, sorted (padding first)
        width = 0
        if masked_items is not None:
            masked = check_id_tensor("masked_items", masked_items, batch_size=self.batch_size, allow_empty=True,
                                     columns="E")
            self._masked_sorted, width = masked.sort(dim=1).values.contiguous(), masked.shape[1]
        bad: list[int | Tensor] = [0, 0, 0]
        if self.validate:
            bad = [~_finite(user), ~_finite(item),
                   _outside(self._masked_sorted, -1, num_items) if self._masked_sorted is not None else 0]
        return [self.batch_size, width, int(self.validate), self.num_experts, user.shape[2],
                _DTYPES.index(self.dtype), num_items, row_offset, item.shape[0], *bad]

    def _agree_on_set_up(self, table: list[list[int]]) -> None:
        """Set-up decisions every rank takes alike from the exchanged ``table`` (see :meth:`_set_up`)."""
        def differ(column: int) -> bool:
            return len({entries[column] for entries in table}) > 1

        if differ(2):
            raise ValueError(f"validate_args must be the same on every rank, got {[bool(e[2]) for e in table]}")
        if differ(3) or differ(4) or differ(5):
            raise ValueError("user and item must have the same (M, D) on every rank, and score in the same dtype (the "
                             "wider of the two, at least float32), got (M, D, scoring dtype) "
                             f"{[(e[3], e[4], str(_DTYPES[e[5]])) for e in table]}")
        if differ(6):
            raise ValueError(f"num_items must be the same on every rank, got {[e[6] for e in table]}")
        blocks = sorted((e[7], e[7] + e[8]) for e in table if e[8])
        ends = [0] + [stop for _, stop in blocks]
        if [start for start, _ in blocks] != ends[:-1] or ends[-1] != self.num_items:
            raise ValueError(f"the ranks' item rows must tile the catalog [0, {self.num_items}) without overlap, "
                             f"got blocks {[(e[7], e[7] + e[8]) for e in table]} (by rank)")
        for column, message in ((9, "user must be finite (no NaN or inf)"), (10, "item must be finite (no NaN or inf)"),
                                (11, f"masked_items must hold ids in [-1, {self.num_items}) (-1 pads)")):
            failed = ranks_where(table, column)
            if failed:
                raise ValueError(message + on_ranks(self.group, failed))

    # -- collectives (identity in a single process) --------------------------------------------
    def _local_ids(self, ids: Tensor) -> Tensor:
        """Global ids → local row ids; ``-1`` pads stay ``-1`` (other ranks' rows fall outside ``[0, R)``)."""
        return torch.where(ids >= 0, ids - self.row_offset, -1)

    def _everyone(self, ids: Tensor) -> Tensor:
        """This rank's ``[B_r, L]`` → everyone's ``[B_tot, L]`` (the same L on every rank)."""
        return ids if self.group is None else all_gather_rows(ids, self._sizes, self.group)

    def _per_rank(self, partial: Tensor) -> Tensor:
        """Every rank's ``partial [B_tot, ...]`` → ``[W, B_tot, ...]`` (differentiable)."""
        if self.group is None:
            return partial.unsqueeze(0)
        flat = gather_rows(partial, [partial.shape[0]] * len(self._sizes), self._rank, self.group)
        return flat.view(len(self._sizes), *partial.shape)

    def _mine(self, x: Tensor) -> Tensor:
        return x[self._start: self._start + self.batch_size]

    def _ids(self, name: str, ids: Tensor, *, low: int) -> Tensor:
        """``ids [B_r, L]`` as int64. With validation, collectively: the same L on every rank and ids in
        ``[low, num_items)`` (one exchange); without, structure only (no host sync)."""
        if not self.validate:
            return check_id_tensor(name, ids, batch_size=self.batch_size, allow_empty=True)
        checked: list[Tensor] = []

        def local() -> list[int | Tensor]:
            checked.append(check_id_tensor(name, ids, batch_size=self.batch_size, allow_empty=True))
            return [checked[0].shape[1], _outside(checked[0], low, self.num_items)]

        table = exchange(local, 2, self.group, self.device)
        if len({entries[0] for entries in table}) > 1:
            raise ValueError(f"{name} must have the same number of columns on every rank, got "
                             f"{[entries[0] for entries in table]} (by rank)")
        failed = ranks_where(table, 1)
        if failed:
            pads = " (-1 pads)" if low < 0 else ""
            raise ValueError(f"{name} must hold ids in [{low}, {self.num_items}){pads}" + on_ranks(self.group, failed))
        return checked[0]

    def _drop(self, exclude: Tensor | None) -> Tensor | None:
        """Everyone's masked and ``exclude``d items as local row ids ``[B_tot, E']`` (``-1`` pads), or None."""
        parts = [] if self._masked_all is None else [self._masked_all]
        if exclude is not None:
            parts.append(self._local_ids(self._everyone(self._ids("exclude", exclude, low=-1))))
        return torch.cat(parts, dim=1) if parts else None

    # -- the CatalogScores protocol ------------------------------------------------------------
    def agree(self, passed: Tensor) -> Tensor:
        return agree(passed, self.group)

    def _stack_batches(self, x: Tensor) -> Tensor:
        return stack_ranks(x, self.group)

    def num_available(self) -> Tensor:
        if self._masked_sorted is None:
            return super().num_available()
        return available_given_masks(self._masked_sorted, self.num_items, self.num_experts)

    def gather(self, items: Tensor) -> Tensor:
        items = self._ids("items", items, low=0)
        local = self._local_ids(self._everyone(items))  # [B_tot, L]
        rows = self.item.shape[0]
        owned = (local >= 0) & (local < rows)
        if rows:
            vec = self.item[local.clamp(0, rows - 1)]  # [B_tot, L, M, D]
        else:  # zeros that still depend on item and user_all: on every rank the backward reaches the
            # lookup's outputs, so every rank joins the lookup's backward collectives
            vec = self.item.sum(0).expand(*local.shape, -1, -1)
        with no_autocast(vec.device):
            part = torch.einsum("bmd,blmd->bml", self.user_all, vec) * owned.unsqueeze(1)
        scores = part if self.group is None else reduce_rows(part, self._sizes, self._rank, self.group)
        if self._masked_sorted is None or self._masked_sorted.shape[1] == 0:
            return scores
        pos = torch.searchsorted(self._masked_sorted, items.contiguous()).clamp(max=self._masked_sorted.shape[1] - 1)
        masked = self._masked_sorted.gather(1, pos) == items  # [B_r, L]
        return scores.masked_fill(masked.unsqueeze(1), -math.inf)

    def log_power_sums(self, exclude: Tensor | None = None, num_powers: int = 1) -> Tensor:
        self._arguments("num_powers must be the same on every rank", 1,
                        lambda: [check_count("num_powers", num_powers)])
        # check_finite stays off: one rank's overflow error would leave the others in the next collective
        part = _ChunkedLogPowerSums.apply(self.user_all, self.item, self._drop(exclude), num_powers, self.chunk_size,
                                          False)
        return self._mine(safe_logsumexp(self._per_rank(part), 0))  # -inf (zero grad) where no rank has an item

    def top_items(self, k: int, *, experts: Sequence[int] | None = None, exclude: Tensor | None = None,
                  generator: torch.Generator | None = None, perturb: bool = False) -> Tensor:
        def arguments() -> list[int]:
            check_count("k", k, high=self.num_items)
            perturbed = check_flag("perturb", perturb)
            chosen = list(range(self.num_experts)) if experts is None else [int(m) for m in experts]
            if any(m < 0 or m >= self.num_experts for m in chosen):
                raise ValueError(f"experts must be in [0, {self.num_experts}), got {chosen}")
            sel.extend(chosen)
            # int hashes are the same in every process; a perturbed draw takes a collective of its own (its seed)
            return [k, len(chosen), hash(tuple(chosen)) >> 2, int(perturbed)]

        sel: list[int] = []
        self._arguments("every rank must draw alike (the same K in sample_candidates) and ask top_items for the "
                        "same k, experts and perturb (a draw of K from a mixture asks each expert block for its share "
                        "of K)", 4, arguments, shown="top_items' k = ")
        with torch.no_grad():
            user = self.user_all.detach()[:, sel]
            item = self.item.detach()[:, sel]
            drop = self._drop(exclude)
            noise = None
            if perturb:
                noise = BlockNoise(self._shared_seed(generator, k, sel), user.shape[0], sel, self.row_offset,
                                   self.dtype, self.device, block_size=min(BLOCK, self.num_items))
            vals, ids = _chunked_top_k(user, item, k, drop, noise, self.chunk_size)
            if self.group is None:
                return ids
            short = k - vals.shape[2]  # ranks with fewer than k rows pad with -inf
            vals = torch.nn.functional.pad(vals, (0, short), value=-torch.inf)
            ids = torch.nn.functional.pad(ids + self.row_offset, (0, short), value=-1)
            all_vals, all_ids = self._per_rank(vals), self._per_rank(ids)  # [W, B_tot, M', k]
            all_vals = all_vals.permute(1, 2, 0, 3).flatten(2)
            all_ids = all_ids.permute(1, 2, 0, 3).flatten(2)
            # In id order (pads last), so that top_k's ties go to the lower id, as on one process (each rank's k
            # are its best with the same ties); torch.topk's order of ties depended on the ranks' layout.
            order = torch.where(all_ids >= 0, all_ids, self.num_items).argsort(dim=2)
            all_vals, all_ids = all_vals.gather(2, order), all_ids.gather(2, order)
            return self._mine(all_ids.gather(2, top_k(all_vals, k)))

    def _arguments(self, same: str, size: int, check: Callable[[], list[int]], shown: str = "") -> None:
        """A method's argument checks (``check``: ``size`` ints, the first shown after ``shown``), raised on every
        rank when validating with a group (one exchange, which also requires the same arguments everywhere, else a
        ``ValueError`` starting with ``same``: the method's collectives pair them), else on this rank."""
        if not self.validate or self.group is None:
            check()
            return
        table = exchange(check, size, self.group, self.device)
        if len({tuple(entries) for entries in table}) > 1:  # the first entry is shown: the others are fingerprints
            raise ValueError(f"{same}, got {shown}{[entries[0] for entries in table]} by rank"
                             f"{' (or other experts)' if size > 1 else ''}")

    def _shared_seed(self, generator: torch.Generator | None, k: int, experts: list[int]) -> list[int]:
        """A seed drawn from ``generator`` on every rank and taken from rank 0 of the group (read back:
        generators are seeded from the host). The same exchange checks that every rank draws ``k`` items
        under the same ``experts`` (the draw's gathers would otherwise abort the process group): a
        ``ValueError`` on every rank."""
        seed = draw_seed(generator)
        if self.group is None:
            return seed.tolist()
        # int hashes do not depend on the process (unlike str ones): the experts' fingerprint agrees where they do
        mine = torch.tensor([*seed.tolist(), k, len(experts), hash(tuple(experts)) >> 2], device=self.device)
        parts = [torch.empty_like(mine) for _ in self._sizes]
        dist.all_gather(parts, mine, group=self.group)
        if any(not torch.equal(p[2:], mine[2:]) for p in parts):
            raise ValueError(f"every rank must draw alike (the same K in sample_candidates), got draws of k = "
                             f"{[int(p[2]) for p in parts]} items under {[int(p[3]) for p in parts]} experts by rank "
                             f"(or other experts)")
        return parts[0][:2].tolist()


def _finite(x: Tensor) -> Tensor:
    """0-dim bool: no NaN or inf in ``x`` (one min/max reduction; True when empty)."""
    if x.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=x.device)
    lo, hi = torch.aminmax(x.detach())
    return torch.isfinite(lo) & torch.isfinite(hi)


def _outside(ids: Tensor, low: int, high: int) -> Tensor:
    """0-dim bool: some id of ``ids`` lies outside ``[low, high)`` (False when empty)."""
    if ids.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=ids.device)
    lo, hi = torch.aminmax(ids)
    return (lo < low) | (hi >= high)
