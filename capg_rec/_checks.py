"""Input validation shared by the public functions (private).

Every check raises ``ValueError`` naming the argument, what was expected and what was given.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def check_positive(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_flag(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_count(name: str, value: int, *, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_float_tensor(name: str, x: object, *, ndims: tuple[int, ...]) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dims, got shape {tuple(x.shape)}")
    if not all_finite(x):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return x


def all_finite(x: Tensor) -> bool:
    """No NaN or inf in ``x``: one min/max reduction (NaN propagates), ~10x cheaper than isfinite().all()."""
    if x.numel() == 0:
        return True
    x = x.detach()
    lo, hi = torch.aminmax(x.permute(sorted(range(x.dim()), key=x.stride, reverse=True)))  # memory order: no copy
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def check_items(name: str, items: object, *, batch_size: int, num_items: int,
                unique: bool = True, width: int | None = None) -> Tensor:
    """Validate an id tensor ``[B, L]`` with ids in ``[0, num_items)``; returns it as int64."""
    if not isinstance(items, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of item ids, got {type(items).__name__}")
    if items.dtype.is_floating_point or items.dtype.is_complex or items.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {items.dtype}")
    if items.dim() != 2 or items.shape[0] != batch_size:
        raise ValueError(f"{name} must have shape [B={batch_size}, L], got {tuple(items.shape)}")
    if width is not None and items.shape[1] != width:
        raise ValueError(f"{name} must have {width} columns, got {items.shape[1]}")
    if items.shape[1] == 0:
        raise ValueError(f"{name} must have at least one column")
    items = items.long()
    lo, hi = (int(v) for v in torch.aminmax(items))
    if lo < 0 or hi >= num_items:
        raise ValueError(f"{name} must hold ids in [0, {num_items}), got values in [{lo}, {hi}]")
    if unique and items.shape[1] > 1:
        s = items.sort(dim=1).values
        if bool((s[:, 1:] == s[:, :-1]).any()):
            raise ValueError(f"{name} must not repeat an item within a row")
    return items
