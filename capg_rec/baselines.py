"""Reward baselines that are the same whatever the number of ranks the batch is split over (plain
``torch.distributed``: DDP and TorchRec alike; also exported by :mod:`capg_rec.torchrec`).

A baseline computed from one rank's rewards (``rewards.mean()``) changes with the split: W ranks
then train a different model than one process on the concatenated batch. These baselines reduce
over the ranks of a process group, so one step over W ranks equals one step of a single process.
They are constants for the loss (no gradient) and make no host sync with validation off; with
validation on, the checks are collective (one exchange): every rank raises the same error or none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from capg_rec._checks import check_count, check_flag, check_float_tensor, check_id_tensor, is_number, \
    resolve_validate_args
from capg_rec._collective import exchange, on_ranks, ranks_where

__all__ = ["ContextBaseline", "global_mean_baseline"]


def _all_sum(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``x`` summed over the ranks of ``group`` in float64 (ranks may hold rewards of other dtypes, whose
    buffers must match in size; half-precision counts would overflow), as float64 (a copy; itself without a group)."""
    x = x.to(torch.float64, copy=True)
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def _checked(rewards: Tensor, contexts: Tensor | None, num_contexts: int, group: dist.ProcessGroup | None,
             validate_args: bool | None) -> tuple[Tensor, Tensor | None]:
    """``rewards [B_r, L]`` (finite when validating) and ``contexts [B_r]`` (ids in range when validating; none
    for ``num_contexts = 0``), checked on every rank alike."""
    validate = resolve_validate_args(None if validate_args is None else check_flag("validate_args", validate_args))
    checked: list[Tensor | None] = []

    def local() -> list[Tensor]:
        r = check_float_tensor("rewards", rewards, ndims=(2,), validate=False).detach()
        c = None
        if num_contexts and r.shape[1] == 0 and r.shape[0]:  # a row's mean reward would be NaN, and kept
            raise ValueError(f"rewards must have at least one column (a shown item's) per row, got shape "
                             f"{list(r.shape)}")
        if num_contexts:  # None too is refused here (with the checks on, on every rank: in their exchange)
            if not isinstance(contexts, Tensor) or contexts.dim() != 1:
                raise (ValueError if isinstance(contexts, Tensor) else TypeError)(
                    f"contexts must be a 1-dim tensor of ids [B_r], got {getattr(contexts, 'shape', type(contexts))}")
            c = check_id_tensor("contexts", contexts.unsqueeze(1), batch_size=r.shape[0])[:, 0]
        checked.extend([r, c])
        if not validate:
            return []
        bad_reward = ~torch.isfinite(r).all()
        bad_context = ((c < 0) | (c >= num_contexts)).any() if c is not None else torch.zeros((), dtype=torch.bool)
        return [bad_reward, bad_context]

    if not validate:  # structure only, on this rank (no host sync)
        local()
        return checked[0], checked[1]
    device = rewards.device if isinstance(rewards, Tensor) else torch.device("cpu")
    table = exchange(local, 2, group, device)
    for column, message in ((0, "rewards must be finite"), (1, f"contexts must hold ids in [0, {num_contexts})")):
        failed = ranks_where(table, column)
        if failed:
            raise ValueError(message + on_ranks(group, failed))
    return checked[0], checked[1]


def global_mean_baseline(rewards: Tensor, process_group: dist.ProcessGroup | None = None, *,
                         validate_args: bool | None = None) -> Tensor:
    """The mean reward of every rank's rows: ``rewards [B_r, L]`` → ``[B_r]`` (one all-reduce).

    ``process_group``: the ranks whose batches make the global batch (``dist.group.WORLD`` for all);
    ``None``: this process only (then it is ``rewards.mean()``). An empty global batch gives 0.
    ``validate_args``: check that the rewards are finite (collectively, one host sync); ``None``
    takes :func:`capg_rec.set_default_validate_args`'s default.
    """
    rewards, _ = _checked(rewards, None, 0, process_group, validate_args)
    return _global_mean(rewards, process_group)


def _global_mean(rewards: Tensor, process_group: dist.ProcessGroup | None) -> Tensor:
    stats = _all_sum(torch.stack([rewards.sum(dtype=torch.float64), torch.tensor(
        float(rewards.numel()), dtype=torch.float64, device=rewards.device)]), process_group)
    return (stats[0] / stats[1].clamp(min=1)).to(rewards.dtype).expand(rewards.shape[0])


class ContextBaseline(nn.Module):
    """Per-context moving average of past rewards (a context: a user, a query), kept in step on
    every rank: ``baseline(contexts [B_r], rewards [B_r, L])`` → ``[B_r]``.

    A context's baseline is the moving average (decay ``decay``) of its past mean rewards over
    every rank's rows, or, for a context never seen, the global mean of this step's per-row mean
    rewards; the call then folds this step's rewards into the averages. Each call all-reduces
    ``[2, num_contexts]`` floats (the per-context sums and counts) and one pair; the table is a
    buffer (saved in the state dict). With ``process_group=None`` it is one process's baseline.

    Args:
        num_contexts: contexts are ids in ``[0, num_contexts)``.
        decay: weight of the past, in ``[0, 1)`` (default 0.9).
        process_group: the ranks sharing the global batch (``dist.group.WORLD`` for all; default None: this
            process only).
        validate_args: check the rewards (finite) and contexts (in range) collectively at each call
            (one host sync); ``None`` takes :func:`capg_rec.set_default_validate_args`'s default.

    Shape:
        - contexts: ``[B_r]`` ids; rewards: ``[B_r, L]`` → baseline ``[B_r]`` (the rewards' dtype)
        - buffers: ``average [num_contexts]`` (torch's default float dtype), ``seen [num_contexts]`` (bool)

    Example:
        >>> baseline = ContextBaseline(num_contexts=10)            # one process: process_group=None
        >>> contexts = torch.tensor([0, 3])
        >>> baseline(contexts, torch.tensor([[1.0, 3.0], [0.0, 0.0]]))   # never seen: this step's mean, 1
        tensor([1., 1.])
        >>> baseline(contexts, torch.tensor([[2.0, 2.0], [1.0, 1.0]]))   # seen: their averages so far
        tensor([2., 0.])
    """

    def __init__(self, num_contexts: int, *, decay: float = 0.9,
                 process_group: dist.ProcessGroup | None = None, validate_args: bool | None = None) -> None:
        super().__init__()
        self.num_contexts = check_count("num_contexts", num_contexts)
        if not is_number(decay) or not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.decay, self.process_group = float(decay), process_group
        self.validate_args = None if validate_args is None else check_flag("validate_args", validate_args)
        self.register_buffer("average", torch.zeros(num_contexts))
        self.register_buffer("seen", torch.zeros(num_contexts, dtype=torch.bool))

    def forward(self, contexts: Tensor, rewards: Tensor) -> Tensor:
        rewards, contexts = _checked(rewards, contexts, self.num_contexts, self.process_group, self.validate_args)
        observed = rewards.mean(dim=1).to(self.average.dtype)
        fresh = _global_mean(observed.unsqueeze(1), self.process_group)
        baseline = torch.where(self.seen[contexts], self.average[contexts], fresh).to(rewards.dtype)
        stats = torch.zeros(2, self.num_contexts, dtype=self.average.dtype, device=self.average.device)
        stats[0].index_add_(0, contexts, observed)
        stats[1].index_add_(0, contexts, torch.ones_like(observed))
        sums, counts = _all_sum(stats, self.process_group).to(self.average.dtype)
        hit = counts > 0
        mean = sums / counts.clamp(min=1)
        updated = torch.where(self.seen, self.decay * self.average + (1 - self.decay) * mean, mean)
        self.average.copy_(torch.where(hit, updated, self.average))
        self.seen |= hit
        return baseline
