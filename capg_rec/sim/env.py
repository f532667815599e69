"""Dense user × item bandit environments: every expected reward is a table lookup.

An environment holds three precomputed tables over U users and N items:

* ``q [U, N]``: the expected reward ``q(x, a) = E[r | x, a]`` (what the policy value averages),
* ``reward_std [U, N]``: the standard deviation of the Gaussian observed reward,
* ``lsr_scores [U, N]``: what the oracle late-stage rankers order candidates by (a monotone
  transform of ``q``, e.g. the synthetic environment's pre-softplus ``q_raw``).

A training step only gathers from these tables; nothing is recomputed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from capg_rec._checks import check_count, check_generator, is_id_tensor, is_number, python_number

__all__ = ["MatrixEnv"]


def check_ids(name: str, ids: object, count: int) -> Tensor:
    """``ids``: an integer tensor (a ``TypeError`` otherwise) of ids in ``[0, count)`` (a ``ValueError`` otherwise: a
    negative id would wrap around to another user or item) → as int64 (one host read of its range)."""
    if not is_id_tensor(ids):
        raise TypeError(f"{name} must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if not ids.is_signed():  # torch has no aminmax of uint16-64 (found by review)
        if ids.dtype == torch.uint64 and ids.numel() and bool((ids.view(torch.int64) < 0).any()):
            raise ValueError(f"{name} must hold ids in [0, {count}), got ids of 2^63 or more")
        ids = ids.long()
    low, high = (int(v) for v in torch.aminmax(ids)) if ids.numel() else (0, 0)
    if low < 0 or high >= count:
        raise ValueError(f"{name} must hold ids in [0, {count}), got ids in [{low}, {high}]")
    return ids.long()


def check_user_items(users: object, items: object, num_users: int, num_items: int) -> tuple[Tensor, Tensor]:
    """``users [B]`` and ``items [B, L]`` checked as :func:`check_ids`, and their shapes (one row of items per user:
    other shapes would broadcast) → both as int64."""
    users, items = check_ids("users", users, num_users), check_ids("items", items, num_items)
    if users.dim() != 1 or items.dim() != 2 or items.shape[0] != users.shape[0]:
        raise ValueError(f"users and items must have shapes [B] and [B, L], got {list(users.shape)} and "
                         f"{list(items.shape)}")
    return users, items


def settings_text(*settings: tuple[str, object, object]) -> str:
    """``", key=value"`` for each ``(key, value, default)`` whose value is not its default, numbers written exactly
    (a float's shortest exact form; numpy's as Python's): what an environment's name adds for the settings that
    make other tables, since checkpoints, reused runs and logs are matched to an environment by its name."""
    return "".join(f", {key}={python_number(value)!r}" for key, value, default in settings
                   if python_number(value) != default)


@dataclass(frozen=True, eq=False)
class MatrixEnv:
    """A contextual bandit over a dense expected-reward table (users are the contexts).

    ``q``, ``reward_std`` and ``lsr_scores`` are float tensors of one shape ``[U, N]``;
    ``reward_std`` must be ``>= 0``. Observed rewards are ``r ~ N(q, reward_std²)``.

    Attributes:
        q: the expected rewards ``E[r | x, a]``, finite.
        reward_std: the observed rewards' standard deviations, finite and ``>= 0``.
        lsr_scores: what the LSRs rank candidates by (in the built environments, ``from_table`` and the synthetic
            one, a monotone transform of ``q``; not checked here).
        name: the environment's name (default ``"matrix"``), by which checkpoints, runs and logs are matched.

    Shape:
        - q, reward_std, lsr_scores: ``[U, N]``
        - :meth:`sample_users` → ``[B]``; :meth:`expected_reward`, :meth:`sample_reward`: ``users [B]``,
          ``items [B, L]`` → ``[B, L]``

    Example:
        >>> env = MatrixEnv.from_table(torch.rand(4, 20))      # relative_noise=0.3; LSRs rank by q
        >>> users = env.sample_users(3)
        >>> env.sample_reward(users, torch.tensor([[0, 1]] * 3)).shape, env.num_users, env.num_items
        (torch.Size([3, 2]), 4, 20)
    """

    q: Tensor
    reward_std: Tensor
    lsr_scores: Tensor
    name: str = "matrix"

    def __post_init__(self) -> None:
        for field in ("q", "reward_std", "lsr_scores"):
            value = getattr(self, field)
            if not isinstance(value, Tensor) or not value.is_floating_point():
                raise TypeError(f"{field} must be a 2-d float tensor [U, N], got {type(value).__name__} "
                                f"{getattr(value, 'dtype', '')}")
            if value.dim() != 2 or 0 in value.shape:  # no user to draw, or no item to retrieve
                raise ValueError(f"{field} must be a 2-d float tensor [U, N] of U, N >= 1, got shape "
                                 f"{list(value.shape)}")
            if value.shape != self.q.shape:
                raise ValueError(f"{field} must have the shape of q {tuple(self.q.shape)}, "
                                 f"got {tuple(value.shape)}")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{field} must be finite (no NaN or inf)")
        if bool((self.reward_std < 0).any()):
            raise ValueError(f"reward_std must be >= 0, got min {float(self.reward_std.min())}")
        if not isinstance(self.name, str):  # runs and checkpoints are matched by it
            raise TypeError(f"name must be a str, got {type(self.name).__name__} {self.name!r}")

    @property
    def num_users(self) -> int:
        return self.q.shape[0]

    @property
    def num_items(self) -> int:
        return self.q.shape[1]

    def sample_users(self, batch_size: int, generator: torch.Generator | None = None) -> Tensor:
        """``batch_size`` users drawn uniformly with replacement → ``LongTensor[B]``."""
        check_count("batch_size", batch_size)
        return torch.randint(self.num_users, (batch_size,), generator=check_generator(generator), device=self.q.device)

    def expected_reward(self, users: Tensor, items: Tensor) -> Tensor:
        """``q(x_b, a_{b,l})``: ``users [B]``, ``items [B, L]`` → ``[B, L]``."""
        users, items = check_user_items(users, items, self.num_users, self.num_items)
        return self.q[users.unsqueeze(1), items]

    def ranking_scores(self, users: Tensor, items: Tensor) -> Tensor:
        """The LSR's scores of the given items: ``users [B]``, ``items [B, K]`` → ``[B, K]``."""
        users, items = check_user_items(users, items, self.num_users, self.num_items)
        return self.lsr_scores[users.unsqueeze(1), items]

    def sample_reward(self, users: Tensor, items: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Observed rewards ``r ~ N(q, reward_std²)``: ``users [B]``, ``items [B, L]`` → ``[B, L]``."""
        users, items = check_user_items(users, items, self.num_users, self.num_items)
        idx = (users.unsqueeze(1), items)
        noise = torch.randn(items.shape, generator=check_generator(generator), dtype=self.q.dtype, device=self.q.device)
        return self.q[idx] + self.reward_std[idx] * noise

    def optimal_value(self, num_outputs: int = 1) -> float:
        """Best achievable policy value: the mean over users of the mean of the top-L ``q``."""
        check_count("num_outputs", num_outputs, high=self.num_items)
        return float(self.q.topk(num_outputs, dim=1).values.mean())

    @classmethod
    def from_table(cls, q: Tensor, *, relative_noise: float = 0.3, name: str = "matrix") -> MatrixEnv:
        """An environment from an expected-reward table ``q [U, N]`` with multiplicative noise
        ``r = q · (1 + ε)``, ``ε ~ N(0, relative_noise²)``; the LSRs rank by ``q`` itself."""
        if not isinstance(q, Tensor) or not q.is_floating_point():
            raise TypeError(f"q must be a float tensor [U, N], got {type(q).__name__}")
        if not is_number(relative_noise):
            raise TypeError(f"relative_noise must be a number >= 0, got {relative_noise!r}")
        if not 0 <= relative_noise < math.inf:
            raise ValueError(f"relative_noise must be a finite number >= 0, got {relative_noise!r}")
        return cls(q, float(relative_noise) * q.abs(), q, name=name)

    def subset(self, users: Tensor | None = None, items: Tensor | None = None) -> MatrixEnv:
        """The environment restricted to some users and/or items: ``[U']`` and ``[N']`` ids (re-numbered from 0 in
        that order; an id twice is two users or items: a resample) or bool masks ``[U]``, ``[N]``. It is another
        environment, which checkpoints and logs tell apart:
        named ``"<name>[subset <digest of its tables>]"``."""
        tables = [self.q, self.reward_std, self.lsr_scores]
        for name, ids, count, dim in (("users", users, self.num_users, 0), ("items", items, self.num_items, 1)):
            if ids is None:
                continue
            if isinstance(ids, Tensor) and ids.dtype == torch.bool:
                if ids.shape != (count,):
                    raise ValueError(f"{name} as a mask must have shape [{count}], got {list(ids.shape)}")
                ids = ids.nonzero().squeeze(1)
            ids = check_ids(name, ids, count)
            if ids.dim() != 1 or not ids.numel():
                raise ValueError(f"{name} must be a non-empty 1-d tensor of ids, got shape {list(ids.shape)}")
            tables = [t.index_select(dim, ids.to(t.device)) for t in tables]
        data = (t.detach().cpu().double().resolve_neg().numpy().tobytes() for t in tables)  # numpy: no negative bit
        digest = hashlib.sha256(b"".join(data)).hexdigest()
        return MatrixEnv(*tables, name=f"{self.name}[subset {digest[:12]}]")
