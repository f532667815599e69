"""MovieLens environment: the bundled ml-latest-small ratings, completed into a dense table.

MovieLens ratings are sparse (1.7% of 610 × 9,724), so a dense expected-reward table needs a
model: a biased matrix factorisation ``r̂(u, i) = μ + b_u + c_i + p_uᵀ v_i`` fitted by
alternating least squares (each half-step solves every user's / item's ridge regression
exactly, in one batched solve) from a seeded ``N(0, 0.1²)`` start. ``q = clip(r̂, 0.5, 5)``
(the rating scale) and observed rewards are ``q · (1 + N(0, 0.3²))``, as for KuaiRec: a
semi-synthetic problem on real preferences that runs out of the box.

The data (``capg_rec/sim/data/``) are GroupLens's, redistributed under their license: research
use only, no commercial use, cite Harper & Konstan (2015). See ``data/LICENSE-movielens.md``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from capg_rec._checks import check_count, check_positive, is_int
from capg_rec.sim.env import MatrixEnv, settings_text

__all__ = ["movielens_env", "load_movielens_ratings", "fit_matrix_factorization"]

_DATA = Path(__file__).parent / "data" / "ratings.csv"
_RATING_RANGE = (0.5, 5.0)


def load_movielens_ratings(min_item_ratings: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """The bundled ratings as ``(users, items, ratings)`` (ids re-numbered from 0), keeping the
    movies with at least ``min_item_ratings`` ratings."""
    check_count("min_item_ratings", min_item_ratings)
    data = np.loadtxt(_DATA, delimiter=",", skiprows=1, usecols=(0, 1, 2), dtype=np.float64)
    _, items = np.unique(data[:, 1], return_inverse=True)
    keep = np.bincount(items)[items] >= min_item_ratings
    _, users = np.unique(data[keep, 0], return_inverse=True)
    _, items = np.unique(items[keep], return_inverse=True)
    return (torch.from_numpy(users), torch.from_numpy(items), torch.from_numpy(data[keep, 2]))


def _ridge_half_step(rows: Tensor, num_rows: int, design: Tensor, target: Tensor, reg: float) -> Tensor:
    """For every row id ``j``: ``argmin_w Σ_{t: rows[t]=j} (design[t]·w - target[t])² + reg·n_j·|w|²``."""
    dim = design.shape[1]
    gram = torch.zeros(num_rows, dim, dim, dtype=design.dtype).index_add_(
        0, rows, design.unsqueeze(2) * design.unsqueeze(1))
    rhs = torch.zeros(num_rows, dim, dtype=design.dtype).index_add_(0, rows, design * target.unsqueeze(1))
    counts = torch.bincount(rows, minlength=num_rows).to(design.dtype)
    eye = torch.eye(dim, dtype=design.dtype)
    return torch.linalg.solve(gram + reg * (counts.clamp_min(1)).view(-1, 1, 1) * eye, rhs)


def fit_matrix_factorization(users: Tensor, items: Tensor, ratings: Tensor, *, rank: int = 10,
                             reg: float = 0.1, iterations: int = 20, seed: int = 0) -> Tensor:
    """Biased MF by ALS (float64; regularisation ``reg`` times each row's rating count).

    ``users, items [R]`` ids, ``ratings [R]`` → the dense prediction ``[U, N]`` (unclipped).
    """
    check_count("rank", rank)
    check_count("iterations", iterations)
    reg = check_positive("reg", reg)
    num_users, num_items = int(users.max()) + 1, int(items.max()) + 1
    g = torch.Generator().manual_seed(seed)
    ratings = ratings.double()
    mu = ratings.mean()
    p = 0.1 * torch.randn(num_users, rank, generator=g, dtype=torch.float64)
    v = 0.1 * torch.randn(num_items, rank, generator=g, dtype=torch.float64)
    b = torch.zeros(num_users, dtype=torch.float64)
    c = torch.zeros(num_items, dtype=torch.float64)
    ones = torch.ones(len(ratings), 1, dtype=torch.float64)
    for _ in range(iterations):
        w = _ridge_half_step(users, num_users, torch.cat([v[items], ones], 1), ratings - mu - c[items], reg)
        p, b = w[:, :rank], w[:, rank]
        w = _ridge_half_step(items, num_items, torch.cat([p[users], ones], 1), ratings - mu - b[users], reg)
        v, c = w[:, :rank], w[:, rank]
    return mu + b.unsqueeze(1) + c.unsqueeze(0) + p @ v.T


def movielens_env(*, min_item_ratings: int = 10, rank: int = 10, reg: float = 0.1, iterations: int = 20,
                  seed: int = 0, relative_noise: float = 0.3) -> MatrixEnv:
    """The MovieLens environment: 610 users × the movies with ``>= min_item_ratings`` ratings
    (2,269 at the default 10), ``q`` = the ALS completion clipped to the rating scale ``[0.5, 5]``."""
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    seed = int(seed)
    # the other settings that make other tables
    settings = settings_text(("reg", reg, 0.1), ("iterations", iterations, 20), ("relative_noise", relative_noise, 0.3))
    users, items, ratings = load_movielens_ratings(min_item_ratings)
    if users.numel() == 0:
        raise ValueError(f"min_item_ratings={min_item_ratings} keeps no movie (the most rated has fewer ratings)")
    table = fit_matrix_factorization(users, items, ratings, rank=rank, reg=reg, iterations=iterations, seed=seed)
    q = table.clamp(*_RATING_RANGE).float()
    return MatrixEnv.from_table(q, relative_noise=relative_noise,
                                name=f"movielens(min_item_ratings={min_item_ratings}, rank={rank}, seed={seed}"
                                     f"{settings})")
