"""The paper's synthetic environment with every user and item computed on demand from a seed.

:func:`~capg_rec.sim.synthetic_env` precomputes ``[U, N]`` tables, which caps it near 10^5 items.
:class:`OnDemandSyntheticEnv` has the same model (users and items ``U[-1, 1]^d``, L2-normalised;
``q_raw = scale · xᵀ[(1 - η) M0 + η Mz] a``, ``η = √(ρ_x ρ_a)``, ``q = softplus(q_raw) + 1``,
``r ~ N(q, σ(x, a)²)``) but derives the vector of user or item ``i`` from a counter-based hash of
``(seed, i, coordinate)``: nothing of size N is stored, any id's vector costs O(d), and the result
does not depend on which other ids are asked for. The ``d × d`` components are drawn once from
``torch.Generator(seed)``. It answers the calls a trainer makes of a
:class:`~capg_rec.sim.MatrixEnv` (``sample_users``, ``expected_reward``, ``ranking_scores``,
``sample_reward``, ``optimal_value``) and scales to 10^7+ items.

Its components are drawn independently (the paper's released code couples items to users; the
on-demand environment does not reproduce that coupling), so its values differ from
``synthetic_env(paper_coupling=True)``; :meth:`OnDemandSyntheticEnv.to_matrix_env` gives the dense
equivalent of a small instance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from capg_rec._checks import check_count, check_device, check_generator, check_positive, is_int
from capg_rec.sim.env import MatrixEnv, check_ids, check_user_items, settings_text
from capg_rec.sim.synthetic import _unit_rows

__all__ = ["OnDemandSyntheticEnv"]

_BLOCK = 1 << 22
"""Entries of the ``[users, items]`` tables (times d for vectors) computed at once by the scans over the catalog."""

_MASK32 = 0xFFFFFFFF
_USER, _ITEM = 0x55534552, 0x4954454D  # domain tags: users and items draw from separate streams


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x · c) mod 2^32`` for ``x`` in ``[0, 2^32)``, in int64 without overflow (16-bit halves)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit avalanche mixer (xor-shift-multiply, lowbias32 constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _hashed_uniform(seed: int, tag: int, ids: Tensor, dim: int) -> Tensor:
    """``U(0, 1)`` float64 ``[..., dim]`` (32 random bits each, centred in their bins), a pure function of
    ``(seed, tag, id, coordinate)``; int64 ids < 2^62 (distinct vectors for ids < 2^32)."""
    key = _mix32(torch.tensor((seed & _MASK32) ^ tag, dtype=torch.long, device=ids.device))
    key = _mix32(key ^ ((seed >> 32) & _MASK32))
    h = _mix32(key ^ _mix32(ids & _MASK32) ^ _mix32(_mix32((ids >> 32) & _MASK32) + 1))
    coord = _mix32(torch.arange(1, dim + 1, device=ids.device))
    return (_mix32(h.unsqueeze(-1) ^ coord).double() + 0.5) * 2.0**-32


class OnDemandSyntheticEnv:
    """The synthetic bandit of :mod:`capg_rec.sim.synthetic` with vectors computed on demand.

    Args:
        seed: determines every component (default 0, in ``[0, 2^62)``).
        num_users, num_items: U contexts and N items (default 1000 and 10^6; each up to 2^32: a vector comes
            from a 32-bit hash of its id, so more ids than that would repeat vectors).
        dim: d; scale: the logit scale of ``q_raw`` (the paper's and the defaults: d = 10, scale 10).
        device: where vectors and rewards are computed (default ``"cpu"``; None: torch's default device).

    Shape:
        - :meth:`sample_users` → ``[B]``; :meth:`expected_reward`, :meth:`sample_reward`: ``users [B]``,
          ``items [B, L]`` → float32 ``[B, L]``
        - :meth:`user_vectors`, :meth:`item_vectors`: ids ``[...]`` → float64 ``[..., d]``

    Example:
        >>> env = OnDemandSyntheticEnv(num_users=8, num_items=10**7)      # nothing of size N is stored
        >>> users = env.sample_users(4)
        >>> env.expected_reward(users, torch.randint(10**7, (4, 3))).shape, env.item_vectors(torch.tensor([7])).shape
        (torch.Size([4, 3]), torch.Size([1, 10]))
    """

    def __init__(self, seed: int = 0, *, num_users: int = 1000, num_items: int = 1_000_000, dim: int = 10,
                 scale: float = 10.0, device: str | torch.device | None = "cpu") -> None:
        if not is_int(seed):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if not 0 <= seed < 2**62:
            raise ValueError(f"seed must be in [0, 2^62), got {seed}")
        self.seed = int(seed)
        self.num_users = check_count("num_users", num_users, high=2**32)
        self.num_items = check_count("num_items", num_items, high=2**32)
        self.dim = check_count("dim", dim)
        self.scale = check_positive("scale", scale)
        self.device = check_device("device", torch.get_default_device() if device is None else device)
        g = torch.Generator().manual_seed(self.seed)  # numpy's ints too
        self.w_user = torch.randn(dim, generator=g, dtype=torch.float64).to(self.device)
        self.w_item = torch.randn(dim, generator=g, dtype=torch.float64).to(self.device)
        self.m_latent = _unit_rows(torch.randn(dim, dim, generator=g, dtype=torch.float64)).to(self.device)
        self.m_base = _unit_rows(torch.randn(dim, dim, generator=g, dtype=torch.float64)).to(self.device)
        self.w_noise = torch.randn(dim, dim, generator=g, dtype=torch.float64).to(self.device)
        self.name = f"ondemand_synthetic(seed={seed}, U={num_users}, N={num_items}, d={dim}" \
            f"{settings_text(('scale', self.scale, 10.0))})"  # every setting that makes other tables

    def user_vectors(self, users: Tensor) -> Tensor:
        """``users [...]`` (ids) → ``[..., d]`` float64 unit vectors."""
        return self._vectors(_USER, check_ids("users", users, self.num_users))

    def item_vectors(self, items: Tensor) -> Tensor:
        """``items [...]`` (ids) → ``[..., d]`` float64 unit vectors."""
        return self._vectors(_ITEM, check_ids("items", items, self.num_items))

    def _vectors(self, tag: int, ids: Tensor) -> Tensor:
        """Unit vectors of checked int64 ``ids`` (the hash is of int64 ids: narrower ones would overflow in it)."""
        return _unit_rows(2 * _hashed_uniform(self.seed, tag, ids.to(self.device), self.dim) - 1)

    def _tables(self, users: Tensor, items: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q_raw``, ``q`` and ``reward_std`` of ``users [B]`` × ``items [B, L]`` (float64 ``[B, L]``); ids outside
        ``[0, U)`` and ``[0, N)`` are a ``ValueError`` (their hashes would give a user or item that is not there)."""
        users, items = check_user_items(users, items, self.num_users, self.num_items)
        return self._tables_of(self._vectors(_USER, users), self._vectors(_ITEM, items))

    def _tables_of(self, x: Tensor, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The tables of user vectors ``x [B, d]`` × item vectors ``a [B, L, d]`` (or ``[1, L, d]``)."""
        eta = torch.sqrt(torch.sigmoid(x @ self.w_user + 3).unsqueeze(1) * torch.sigmoid(a @ self.w_item + 3))
        base = (x @ self.m_base).unsqueeze(1) @ a.mT  # [B, 1, L]
        latent = (x @ self.m_latent).unsqueeze(1) @ a.mT
        q_raw = self.scale * ((1 - eta) * base.squeeze(1) + eta * latent.squeeze(1))
        std = torch.sigmoid(((x @ self.w_noise).unsqueeze(1) @ a.mT).squeeze(1) + 1)
        return q_raw, F.softplus(q_raw) + 1, std

    def sample_users(self, batch_size: int, generator: torch.Generator | None = None) -> Tensor:
        """``batch_size`` users drawn uniformly with replacement → ``LongTensor[B]``."""
        check_count("batch_size", batch_size)
        return torch.randint(self.num_users, (batch_size,), generator=check_generator(generator), device=self.device)

    def expected_reward(self, users: Tensor, items: Tensor) -> Tensor:
        """``q(x_b, a_{b,l})``: ``users [B]``, ``items [B, L]`` → float32 ``[B, L]``."""
        return self._tables(users, items)[1].float()

    def ranking_scores(self, users: Tensor, items: Tensor) -> Tensor:
        """The LSR's scores ``q_raw`` of ``items [B, K]`` → float32 ``[B, K]``."""
        return self._tables(users, items)[0].float()

    def sample_reward(self, users: Tensor, items: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """``r ~ N(q, reward_std²)`` → float32 ``[B, L]``."""
        _, q, std = self._tables(users, items)
        noise = torch.randn(items.shape, generator=check_generator(generator), dtype=torch.float32, device=self.device)
        return q.float() + std.float() * noise  # the draws of MatrixEnv.sample_reward

    def top_items(self, users: Tensor, k: int, *, chunk_size: int = 65536) -> tuple[Tensor, Tensor]:
        """Each user's k best items by ``q`` (a full scan, chunked: ``chunk_size`` items and as many users as keep a
        chunk's tables near :data:`_BLOCK` entries at a time): ``users [B]`` → ``(q, ids)`` ``[B, k]``."""
        users = check_ids("users", users, self.num_users)
        if users.dim() != 1:
            raise ValueError(f"users must have shape [B], got {list(users.shape)}")
        check_count("chunk_size", chunk_size)
        rows = max(1, _BLOCK // min(chunk_size, self.num_items))
        if users.shape[0] > rows:
            parts = [self.top_items(users[start:start + rows], k, chunk_size=chunk_size)
                     for start in range(0, users.shape[0], rows)]
            return torch.cat([q for q, _ in parts]), torch.cat([i for _, i in parts])
        check_count("k", k, high=self.num_items)
        best_q = torch.zeros(users.shape[0], 0, dtype=torch.float64, device=self.device)
        best_id = torch.zeros(users.shape[0], 0, dtype=torch.long, device=self.device)
        x = self._vectors(_USER, users)
        for start in range(0, self.num_items, chunk_size):
            ids = torch.arange(start, min(start + chunk_size, self.num_items), device=self.device)
            q = self._tables_of(x, self._vectors(_ITEM, ids).unsqueeze(0))[1]
            ids = ids.expand(users.shape[0], -1)
            best_q, pos = torch.cat([best_q, q], 1).topk(min(k, best_q.shape[1] + q.shape[1]), dim=1)
            best_id = torch.cat([best_id, ids], 1).gather(1, pos)
        return best_q, best_id

    def optimal_value(self, num_outputs: int = 1, *, users: Tensor | None = None) -> float:
        """Best achievable policy value: mean over ``users`` (default: all) of the mean of the top-L ``q``. A scan of
        every item for each user: about 0.2 s per user per 10^6 items here (195 s for 1,000 users at 10^6 items, in
        a review's run); at large N, pass a sample of ``users``."""
        check_count("num_outputs", num_outputs, high=self.num_items)
        users = torch.arange(self.num_users, device=self.device) if users is None else users
        if isinstance(users, Tensor) and users.numel() == 0:
            raise ValueError("users must name at least one user (the mean over none is undefined)")
        return float(self.top_items(users, num_outputs)[0].mean())

    def to_matrix_env(self) -> MatrixEnv:
        """The dense :class:`~capg_rec.sim.MatrixEnv` with the same tables (for small U × N)."""
        rows = max(1, _BLOCK // (self.num_items * self.dim))  # users at a time: [rows, N, d] vectors
        items = torch.arange(self.num_items, device=self.device)
        tables = [self._tables(users, items.expand(users.shape[0], -1))
                  for users in torch.arange(self.num_users, device=self.device).split(rows)]
        q_raw, q, std = (torch.cat(parts).float() for parts in zip(*tables))
        return MatrixEnv(q, std, q_raw, name=self.name)
