"""The paper's ESR model: a mixture-of-experts two-tower over user and item ids."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from capg_rec._checks import check_count

__all__ = ["TwoTowerMoE"]


class TwoTowerMoE(nn.Module):
    """M experts, each with D-dim user and item embeddings; ``logit_m(x, a) = <u_m(x), v_m(a)>``.

    Embeddings start ``N(0, 1)`` (``nn.Embedding``'s default, as in the paper's code), drawn
    through ``generator``. ``forward(users [B]) → logits [B, M, N]`` over the whole catalog.

    Args:
        num_users, num_items: U and N, the rows of the user and item tables.
        num_experts: M (default 1).
        dim: D (default 10).
        generator: the initial embeddings' randomness (None: torch's default generator).

    Shape:
        - parameters: ``user [M, U, D]``, ``item [M, N, D]``
        - forward: ``users [B]`` (ids) → logits ``[B, M, N]``

    Example:
        >>> model = TwoTowerMoE(num_users=4, num_items=20, num_experts=2, dim=8)
        >>> model(torch.tensor([0, 3])).shape
        torch.Size([2, 2, 20])
    """

    def __init__(self, num_users: int, num_items: int, *, num_experts: int = 1, dim: int = 10,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        check_count("num_users", num_users)
        check_count("num_items", num_items)
        check_count("num_experts", num_experts)
        check_count("dim", dim)
        self.user = nn.Parameter(torch.randn(num_experts, num_users, dim, generator=generator))
        self.item = nn.Parameter(torch.randn(num_experts, num_items, dim, generator=generator))

    @property
    def num_experts(self) -> int:
        return self.user.shape[0]

    def forward(self, users: Tensor) -> Tensor:
        if not torch.jit.is_scripting() and not torch.jit.is_tracing() and not torch.compiler.is_compiling():
            self._check_users(users)
        return torch.bmm(self.user.index_select(1, users), self.item.mT).transpose(0, 1)  # [M, B, N] → [B, M, N]

    @torch.jit.unused
    def _check_users(self, users: Tensor) -> None:
        """Eager calls only: int32 or int64 ids, in ``[0, U)`` when they are a plain CPU tensor (one read of host
        memory; on other devices, and scripted, traced or compiled, torch's own errors: no device sync)."""
        if not isinstance(users, Tensor) or users.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"users must be an int32 or int64 tensor of ids, got "
                            f"{users.dtype if isinstance(users, Tensor) else type(users).__name__}")
        if users.numel() and users.is_cpu and type(users) is Tensor and \
                not torch._C._are_functorch_transforms_active():
            low, high = torch.stack(torch.aminmax(users)).tolist()
            if low < 0 or high >= self.user.shape[1]:
                raise ValueError(f"users must hold ids in [0, {self.user.shape[1]})")
