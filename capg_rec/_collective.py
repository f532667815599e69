"""Collectives of the sharded catalog and the rank-global baselines (private): rows gathered over ranks with
autograd, and checks that every rank passes or fails together.

A rank that raises while the others wait in a collective hangs the job, so every check that may
fail on some ranks only goes through :func:`exchange`: each rank runs its local checks, the
outcomes are all-gathered in one collective (one host sync), and every rank then takes the same
decision from the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

_ERRORS = {"TypeError": TypeError, "ValueError": ValueError, "RuntimeError": RuntimeError}


def all_gather_rows(x: Tensor, sizes: Sequence[int], group: dist.ProcessGroup) -> Tensor:
    """Every rank's rows ``x [sizes[r], ...]`` concatenated in rank order → ``[Σ sizes, ...]`` (no grad)."""
    width = max(sizes)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


class _RowsFunction(torch.autograd.Function):
    """The row collectives' shared context: ``(x, sizes, rank, group)``."""

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.sizes, ctx.rank, ctx.group = inputs


class _AllGatherRows(_RowsFunction):
    """:func:`all_gather_rows` with autograd: the backward sums the gradients over ranks and keeps
    this rank's rows (:class:`_ReduceScatterRows`), whose own backward is this gather again, so
    every order of derivative is available."""

    @staticmethod
    def forward(x: Tensor, sizes: Sequence[int], rank: int, group: dist.ProcessGroup) -> Tensor:
        return all_gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _ReduceScatterRows.apply(grad, ctx.sizes, ctx.rank, ctx.group), None, None, None


class _ReduceScatterRows(_RowsFunction):
    """``x [Σ sizes, ...]`` summed over ranks, this rank's rows ``[sizes[rank], ...]`` kept (an
    all-reduce and a slice: gloo has no uneven reduce-scatter); the backward is :class:`_AllGatherRows`."""

    @staticmethod
    def forward(x: Tensor, sizes: Sequence[int], rank: int, group: dist.ProcessGroup) -> Tensor:
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(sizes[:rank])
        return total[start: start + sizes[rank]]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _AllGatherRows.apply(grad, ctx.sizes, ctx.rank, ctx.group), None, None, None


def gather_rows(x: Tensor, sizes: Sequence[int], rank: int, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``x [sizes[r], ...]`` → ``[Σ sizes, ...]``, differentiable (the backward sums over ranks)."""
    return _AllGatherRows.apply(x, sizes, rank, group)


def reduce_rows(x: Tensor, sizes: Sequence[int], rank: int, group: dist.ProcessGroup) -> Tensor:
    """``Σ_ranks x [Σ sizes, ...]``, this rank's rows ``[sizes[rank], ...]``, differentiable."""
    return _ReduceScatterRows.apply(x, sizes, rank, group)


def exchange(local: Callable[[], Sequence[int | Tensor]], size: int, group: dist.ProcessGroup | None,
             device: torch.device) -> list[list[int]]:
    """Every rank's ``local()`` (``size`` ints or 0-dim integer/bool tensors) → ``[W][size]`` Python ints.

    One all-gather and one host sync. An exception raised by ``local`` on any rank is raised on every rank (the
    lowest such rank's, naming it): a ``TypeError`` or ``ValueError`` as itself, any other as a ``RuntimeError``
    naming its type, so that no rank is left waiting in the all-gather. Without a group it is simply raised.
    """
    error: Exception | None = None
    try:
        values = list(local())
    except Exception as err:  # every rank must hear of it, whatever it is
        if group is None:
            raise
        error, values = err, [0] * size
    row = torch.stack([torch.as_tensor(v, device=device).to(torch.long).reshape(())
                       for v in [int(error is not None), *values]])
    if group is None:
        return [row.tolist()[1:]]
    parts = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, row, group=group)
    table = torch.stack(parts).tolist()
    failed = [r for r, entries in enumerate(table) if entries[0]]
    if failed:
        reports: list[tuple[str, str] | None] = [None] * len(table)
        dist.all_gather_object(reports, None if error is None else (type(error).__name__, str(error)), group=group)
        kind, message = reports[failed[0]]
        if kind not in _ERRORS:
            kind, message = "RuntimeError", f"{kind}: {message}"
        raise _ERRORS[kind](f"{message} (on rank {failed[0]} of the process group)") from error
    return [entries[1:] for entries in table]


def stack_ranks(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Every rank's ``x`` (one shape on all) stacked in rank order → ``[W, *x.shape]`` (one all-gather; no grad)."""
    if group is None:
        return x.unsqueeze(0)
    return all_gather_rows(x.unsqueeze(0), [1] * dist.get_world_size(group), group)


def agree(passed: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Checks' results ``passed [C]`` (bool) → True where every rank of ``group`` passed (one all-reduce)."""
    return least(passed, group).bool()


def least(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Integers (or bools) ``values [C]`` → each one's least over the ranks of ``group`` (one all-reduce)."""
    if group is None:
        return values
    out = values.to(torch.int64)
    dist.all_reduce(out, op=dist.ReduceOp.MIN, group=group)
    return out


def ranks_where(table: list[list[int]], column: int) -> list[int]:
    """The ranks whose entry ``column`` of an :func:`exchange` table is non-zero."""
    return [r for r, entries in enumerate(table) if entries[column]]


def on_ranks(group: dist.ProcessGroup | None, failed: list[int]) -> str:
    """The end of a collective check's message: which ranks failed it (nothing without a group)."""
    return "" if group is None else f" on every rank; not so on rank(s) {failed}"
