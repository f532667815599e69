"""Counter-based Gumbel noise keyed on global ids (private).

Sampling from a sharded catalog must not depend on how the catalog is split: the noise added to
the score of item n for user b and expert m is a pure function of ``(seed, b, m, n)``, computed
by whichever rank owns item n. The hash is Wellons' ``lowbias32`` mixer evaluated in int64 on
32-bit words; every product is split into 16-bit halves so no intermediate exceeds 2^49 (int64
multiplication never overflows).
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x · c) mod 2^32`` for ``x`` in ``[0, 2^32)`` without int64 overflow."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """Wellons' lowbias32: a bijection of 32-bit words with low avalanche bias."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def draw_seed(generator: torch.Generator | None) -> Tensor:
    """Two 31-bit words from ``generator`` (or the default generator) → LongTensor ``[2]`` on CPU."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.randint(0, 2**31 - 1, (2,), generator=generator, device=device).cpu()


def row_keys(seed: Tensor, users: Tensor, experts: Tensor) -> Tensor:
    """Per-(user, expert) hash state: ``seed [2]``, ``users [B]``, ``experts [M]`` → ``[B, M, 1]``."""
    base = _mix32(_mix32(seed[0] & _MASK32) ^ (seed[1] & _MASK32))
    per_expert = _mix32(base ^ _mix32(experts & _MASK32))  # [M]
    return _mix32(per_expert.unsqueeze(0) ^ (users & _MASK32).unsqueeze(1)).unsqueeze(-1)


def hashed_gumbel(keys: Tensor, items: Tensor, dtype: torch.dtype) -> Tensor:
    """Gumbel(0, 1) noise for ``keys [B, M, 1]`` (from :func:`row_keys`) and global ``items [c]`` → ``[B, M, c]``.

    Uniforms use 24 random bits in float32/16 and 32 bits in float64, centred in their bins so
    they lie strictly inside (0, 1).
    """
    h = _mix32(keys ^ _mix32(items & _MASK32))
    if dtype == torch.float64:
        u = (h.to(dtype) + 0.5) * 2.0**-32
    else:
        u = ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24
    return (-torch.log(-torch.log(u))).to(dtype)
