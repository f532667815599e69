"""The paper's synthetic environment (its Section 5.1 and its released experiment code).

Users ``x`` and items ``a`` are ``U[-1, 1]^d`` vectors, L2-normalised. With a base projection
``M0`` and a latent projection ``Mz`` (N(0, 1) entries, rows L2-normalised), per-user and per-item
*reactiveness* ``ρ_x = σ(w_x·x + 3)``, ``ρ_a = σ(w_a·a + 3)`` (``w ~ N(0, I)``) and
``η = √(ρ_x ρ_a)``::

    q_raw(x, a) = scale · xᵀ [(1 - η) M0 + η Mz] a
    q(x, a)     = softplus(q_raw) + 1                    (expected reward, > 1)
    r           ~ N(q, σ(x, a)²),  σ(x, a) = sigmoid(xᵀ W a + 1),  W ~ N(0, 1)^{d×d}

The oracle LSRs rank by ``q_raw`` (same order as ``q``; the noisy LSR's softmax uses it).

**The paper's coupling.** The released code re-seeds the global RNG with the same seed before
drawing each component, so the item vectors *equal* the user vectors, ``w_a = w_x`` and
``Mz = M0`` (η then has no effect and ``q_raw = scale · xᵀ M0 a``). That is the environment
behind the paper's tables (best policy value ≈ 9.1 at its seed 12345); ``paper_coupling=True``
(the default) reproduces it draw for draw. ``paper_coupling=False`` draws every component
independently from one stream (best value ≈ 8.7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from capg_rec._checks import check_count, check_flag, check_positive, is_int
from capg_rec.sim.env import MatrixEnv, settings_text

__all__ = ["synthetic_env", "PAPER_SEED"]

PAPER_SEED = 12345
"""The environment seed of the paper's released configuration."""


def _unit_rows(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _draw(seed: int, num_users: int, num_items: int, dim: int, paper_coupling: bool) -> dict[str, Tensor]:
    """The random components, drawn in float32 in the released code's order."""
    g = torch.Generator().manual_seed(seed)

    def restart() -> torch.Generator:
        return torch.Generator().manual_seed(seed) if paper_coupling else g

    g = restart()
    users = _unit_rows(2 * torch.rand(num_users, dim, generator=g) - 1)
    w_user = torch.randn(dim, generator=g)
    g = restart()
    items = _unit_rows(2 * torch.rand(num_items, dim, generator=g) - 1)
    w_item = torch.randn(dim, generator=g)
    g = restart()
    m_latent = _unit_rows(torch.randn(dim, dim, generator=g))
    g = restart()
    m_base = _unit_rows(torch.randn(dim, dim, generator=g))
    w_noise = torch.randn(dim, dim, generator=g)
    parts = dict(users=users, items=items, w_user=w_user, w_item=w_item, m_base=m_base,
                 m_latent=m_latent, w_noise=w_noise)
    return {k: v.double() for k, v in parts.items()}


def synthetic_env(seed: int = PAPER_SEED, *, num_users: int = 1000, num_items: int = 1000, dim: int = 10,
                  scale: float = 10.0, paper_coupling: bool = True) -> MatrixEnv:
    """Build the paper's synthetic environment; every table ``[U, N]`` is precomputed (float32).

    Deterministic in ``seed`` (explicit ``torch.Generator``; drawn in float32, computed in float64).
    The defaults are the paper's: 1000 users, 1000 items, d = 10, scale 10, its seed and coupling.
    """
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2^63), got {seed}")
    seed = int(seed)
    check_count("num_users", num_users)
    check_count("num_items", num_items)
    check_count("dim", dim)
    scale = check_positive("scale", scale)
    paper_coupling = check_flag("paper_coupling", paper_coupling)
    p = _draw(seed, num_users, num_items, dim, paper_coupling)
    users, items = p["users"], p["items"]
    rho_user = torch.sigmoid(users @ p["w_user"] + 3)
    rho_item = torch.sigmoid(items @ p["w_item"] + 3)
    eta = torch.sqrt(rho_user.unsqueeze(1) * rho_item)  # [U, N]
    q_raw = scale * ((1 - eta) * (users @ p["m_base"] @ items.T) + eta * (users @ p["m_latent"] @ items.T))
    q = F.softplus(q_raw) + 1
    reward_std = torch.sigmoid(users @ p["w_noise"] @ items.T + 1)
    coupling = "paper" if paper_coupling else "independent"
    # the settings besides the shape (which a checkpoint checks apart) that make other tables
    settings = settings_text(("dim", dim, 10), ("scale", scale, 10.0))
    return MatrixEnv(q.float(), reward_std.float(), q_raw.float(),
                     name=f"synthetic(seed={seed}, {coupling}{settings})")
