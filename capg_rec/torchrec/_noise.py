"""Gumbel noise keyed on global ids, from counter-seeded generators (private).

Sampling from a sharded catalog must not depend on how the catalog is split: the noise added to
the score of item n for user b and expert m must be a function of ``(seed, b, m, n)`` alone,
computed by whichever rank owns item n. The items are cut into fixed blocks of ``min(BLOCK, N)``
global ids; block j's noise for expert m is one ``[B, block]`` draw from a generator seeded with a
hash of ``(seed, j, m)`` (B: the users of every rank, in rank order), so any rank can draw any block
by itself, in one generator call, and gets the same numbers as any other layout would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from capg_rec._numerics import gumbel_like

BLOCK = 4096  # items per noise block (fewer when the catalog is smaller): part of the noise's definition
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """Steele, Lea and Flood's SplitMix64 finaliser on a Python int (a bijection of 64-bit words)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(generator: torch.Generator | None) -> Tensor:
    """Two 31-bit words from ``generator`` (or the default generator) → LongTensor ``[2]`` on its device."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.randint(0, 2**31 - 1, (2,), generator=generator, device=device)


def block_seed(seed: Sequence[int], block: int, expert: int) -> int:
    """The generator seed of noise block ``block`` for expert ``expert`` (63 bits)."""
    x = _splitmix64((seed[0] << 31) | seed[1])
    x = _splitmix64(x ^ block)
    return _splitmix64(x ^ (expert << 40)) >> 1


class BlockNoise:
    """``noise(start, stop)`` → Gumbel(0, 1) noise ``[B, M', stop - start]`` of the rows ``[start, stop)``
    of a rank whose first row is global id ``offset``, for ``experts`` (M' of them) and B users, in
    blocks of ``block_size`` ids (it must be the same on every rank: ``min(BLOCK, N)``).

    Calls must come in increasing order (as the chunked top-k makes them): the last block drawn is
    kept, so a block that two chunks share is drawn once.
    """

    def __init__(self, seed: Sequence[int], num_users: int, experts: Sequence[int], offset: int,
                 dtype: torch.dtype, device: torch.device, block_size: int = BLOCK) -> None:
        self.seed, self.num_users, self.experts = [int(s) for s in seed], num_users, list(experts)
        self.block_size = block_size
        self.offset, self.dtype, self.device = offset, dtype, device
        self._last: tuple[int, Tensor] | None = None

    def block(self, j: int) -> Tensor:
        """Noise of global ids ``[j·block_size, (j + 1)·block_size)``: ``[B, M', block_size]``."""
        if self._last is None or self._last[0] != j:
            parts = []
            for m in self.experts:
                generator = torch.Generator(device=self.device).manual_seed(block_seed(self.seed, j, m))
                parts.append(gumbel_like((self.num_users, self.block_size), generator=generator, dtype=self.dtype,
                                         device=self.device))
            self._last = (j, torch.stack(parts, 1))
        return self._last[1]

    def __call__(self, start: int, stop: int) -> Tensor:
        lo, hi = self.offset + start, self.offset + stop
        size = self.block_size
        first, last = lo // size, (hi - 1) // size
        blocks = [self.block(j) for j in range(first, last + 1)]
        whole = blocks[0] if len(blocks) == 1 else torch.cat(blocks, 2)
        return whole[..., lo - first * size: hi - first * size]
