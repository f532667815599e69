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

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from capg_rec._checks import check_count, check_float_tensor, check_positive
from capg_rec._numerics import masked_logsumexp
from capg_rec.catalog import CatalogScores, _chunked_top_k, _ChunkedLogPowerSums, _expert_views
from capg_rec.torchrec._hash_noise import draw_seed, hashed_gumbel, row_keys

__all__ = ["ShardedEmbeddingCatalog"]


class _AllGatherRows(torch.autograd.Function):
    """Concatenate every rank's rows ``[n_r, ...]`` (sizes may differ) → ``[Σ n_r, ...]``.

    Backward sums the incoming gradients over ranks and returns this rank's rows (a reduce-
    scatter, written as all-reduce + slice because gloo has no reduce-scatter).
    """

    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int], rank: int, group: dist.ProcessGroup) -> Tensor:
        width = max(sizes)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.group, ctx.start, ctx.rows = group, sum(sizes[:rank]), x.shape[0]
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.start: ctx.start + ctx.rows], None, None, None


class ShardedEmbeddingCatalog(CatalogScores):
    """``s[b, m, n] = <user[b, m], item[n, m]> / τ`` with the item rows split over ranks.

    Args:
        user: this rank's users ``[B_r, D]`` or ``[B_r, M, D]``.
        item: this rank's item rows ``[R, D]`` or ``[R, M, D]``: global ids ``[row_offset, row_offset + R)``
            (``R`` may be 0 on ranks that hold none).
        num_items: N, the size of the whole catalog.
        row_offset: global id of the first local row.
        temperature: τ > 0.
        chunk_size: items scored at once; memory is ``O(W·B_r·M·chunk_size)``.
        process_group: the ranks sharing the catalog; ``None`` means a single process (no collectives).

    All ranks of the group must call the same methods in the same order (the estimators do).
    ``batch_size`` is the local ``B_r``; results are for this rank's users. Sampling noise is a
    hash of (seed, global user index, expert, item id), with the seed drawn from rank 0's
    generator, so a seed gives the same candidates at any world size. The global user index is
    the position in the batch concatenated over ranks in rank order.
    """

    def __init__(self, user: Tensor, item: Tensor, *, num_items: int, row_offset: int = 0,
                 temperature: float = 1.0, chunk_size: int = 8192,
                 process_group: dist.ProcessGroup | None = None) -> None:
        user = check_float_tensor("user", user, ndims=(2, 3))
        if not isinstance(item, Tensor) or not item.is_floating_point() or item.dim() not in (2, 3):
            raise ValueError(f"item must be a floating tensor [R, D] or [R, M, D], got {_describe(item)}")
        tau = check_positive("temperature", temperature)
        self.num_items = check_count("num_items", num_items)
        self.chunk_size = check_count("chunk_size", chunk_size)
        self.row_offset = check_count("row_offset", row_offset, low=0)
        user, item = _expert_views(user, item)
        if process_group is None and (row_offset, item.shape[0]) != (0, num_items):
            raise ValueError(f"without a process_group item must hold the whole catalog: row_offset=0 and "
                             f"{num_items} rows, got row_offset={row_offset} and {item.shape[0]} rows")
        if row_offset + item.shape[0] > num_items:
            raise ValueError(f"local rows [row_offset={row_offset}, {row_offset + item.shape[0]}) must lie "
                             f"inside the catalog [0, num_items={num_items})")
        self.item = item  # [R, M, D]
        self.batch_size, self.num_experts = user.shape[:2]
        self.dtype, self.device = user.dtype, user.device
        self.group = process_group
        user = user / tau if tau != 1.0 else user
        if process_group is None:
            self._sizes, self._rank = [self.batch_size], 0
            self.user_all = user  # [B_tot, M, D]
        else:
            self._rank = dist.get_rank(process_group)
            size = torch.tensor([self.batch_size], device=self.device)
            sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(process_group))]
            dist.all_gather(sizes, size, group=process_group)
            self._sizes = [int(s) for s in sizes]
            self.user_all = _AllGatherRows.apply(user, self._sizes, self._rank, process_group)
        self._start = sum(self._sizes[: self._rank])

    # -- collectives (identity in a single process) --------------------------------------------
    def _gather_ids(self, ids: Tensor) -> Tensor:
        """This rank's ``[B_r, E]`` ids → everyone's ``[B_tot, E_max]``, padded with -1."""
        if self.group is None:
            return ids
        width = torch.tensor([ids.shape[1]], device=self.device)
        widths = [torch.empty_like(width) for _ in self._sizes]
        dist.all_gather(widths, width, group=self.group)
        padded = ids.new_full((ids.shape[0], int(max(widths))), -1)
        padded[:, : ids.shape[1]] = ids
        return _AllGatherRows.apply(padded, self._sizes, self._rank, self.group)

    def _per_rank(self, partial: Tensor) -> Tensor:
        """Every rank's ``partial [B_tot, ...]`` → ``[W, B_tot, ...]`` (differentiable)."""
        if self.group is None:
            return partial.unsqueeze(0)
        rows = partial.shape[0]
        flat = _AllGatherRows.apply(partial, [rows] * len(self._sizes), self._rank, self.group)
        return flat.view(len(self._sizes), *partial.shape)

    def _mine(self, x: Tensor) -> Tensor:
        return x[self._start: self._start + self.batch_size]

    def _check_ids(self, name: str, ids: Tensor) -> Tensor:
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[0] != self.batch_size \
                or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor [B={self.batch_size}, L], got {_describe(ids)}")
        ids = ids.long()
        if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= self.num_items):
            raise ValueError(f"{name} must hold ids in [0, {self.num_items}) (or -1 padding), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        return ids

    # -- the CatalogScores protocol ------------------------------------------------------------
    def gather(self, items: Tensor) -> Tensor:
        items = self._check_ids("items", items)
        if bool((items < 0).any()):
            raise ValueError("items must hold ids in [0, num_items), got -1")
        local = self._gather_ids(items) - self.row_offset  # [B_tot, L]
        rows = self.item.shape[0]
        owned = (local >= 0) & (local < rows)
        if rows:
            vec = self.item[local.clamp(0, rows - 1)]  # [B_tot, L, M, D]
        else:  # zeros that still depend on item and user_all: on every rank the backward reaches the
            # lookup's outputs, so every rank joins the lookup's backward collectives
            vec = self.item.sum(0).expand(*local.shape, -1, -1)
        part = torch.einsum("bmd,blmd->bml", self.user_all, vec) * owned.unsqueeze(1)
        return self._mine(self._per_rank(part).sum(0))[..., : items.shape[1]]

    def log_power_sums(self, exclude: Tensor | None = None, num_powers: int = 1) -> Tensor:
        check_count("num_powers", num_powers)
        if exclude is not None:
            exclude = self._gather_ids(self._check_ids("exclude", exclude))
            exclude = torch.where(exclude >= 0, exclude - self.row_offset, -1)
        part = _ChunkedLogPowerSums.apply(self.user_all, self.item, exclude, num_powers, self.chunk_size)
        parts = self._per_rank(part)  # [W, B_tot, M, P]
        return self._mine(masked_logsumexp(parts, ~torch.isfinite(parts), dim=0))

    def top_items(self, k: int, *, experts: Sequence[int] | None = None, exclude: Tensor | None = None,
                  generator: torch.Generator | None = None, perturb: bool = False) -> Tensor:
        check_count("k", k, high=self.num_items)
        sel = list(range(self.num_experts)) if experts is None else [int(m) for m in experts]
        if any(m < 0 or m >= self.num_experts for m in sel):
            raise ValueError(f"experts must be in [0, {self.num_experts}), got {sel}")
        with torch.no_grad():
            user = self.user_all.detach()[:, sel]
            item = self.item.detach()[:, sel]
            if exclude is not None:
                exclude = self._gather_ids(self._check_ids("exclude", exclude))
                exclude = torch.where(exclude >= 0, exclude - self.row_offset, -1)
            noise = None
            if perturb:
                keys = row_keys(self._shared_seed(generator), torch.arange(user.shape[0]), torch.tensor(sel))
                keys = keys.to(self.device)
                offset = self.row_offset

                def noise(start: int, stop: int) -> Tensor:
                    ids = torch.arange(offset + start, offset + stop, device=self.device)
                    return hashed_gumbel(keys, ids, self.dtype)
            vals, ids = _chunked_top_k(user, item, k, exclude, noise, self.chunk_size)
            if self.group is None:
                return ids
            short = k - vals.shape[2]  # ranks with fewer than k rows pad with -inf
            vals = torch.nn.functional.pad(vals, (0, short), value=-torch.inf)
            ids = torch.nn.functional.pad(ids + self.row_offset, (0, short), value=-1)
            all_vals, all_ids = self._per_rank(vals), self._per_rank(ids)  # [W, B_tot, M', k]
            all_vals = all_vals.permute(1, 2, 0, 3).flatten(2)
            all_ids = all_ids.permute(1, 2, 0, 3).flatten(2)
            best = all_vals.topk(k, dim=2).indices
            return self._mine(all_ids.gather(2, best))

    def _shared_seed(self, generator: torch.Generator | None) -> Tensor:
        """A seed drawn from ``generator`` on every rank and taken from rank 0 of the group."""
        seed = draw_seed(generator)
        if self.group is not None:
            seed = seed.to(self.device)
            dist.broadcast(seed, src=dist.get_global_rank(self.group, 0), group=self.group)
            seed = seed.cpu()
        return seed


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
