"""Four planted ESR bugs, and the sample sizes at which ``capg_rec.validate`` catches them.

Each buggy ESR samples from one distribution and claims another, the way a real implementation
goes wrong (none of these bugs is in capg_rec itself):

* ``shared_noise``: a mixture-of-experts sampler that draws one Gumbel vector and reuses it for
  every expert block (the paper's appendix), with exact (enumerated) claims: on its own catalog of 6 items
  at K = 4, whatever ``--sizes`` asks (the enumeration's size), at the first size only.
* ``swapped_prefix``: the paper's arg-top-(k-1) plug-in inclusion probability, computed with a
  shortcut prefix that swaps the target for the K-th item in place instead of shifting the list.
* ``temperature_twice``: the claims divide the logits by τ and then pass τ again (τ²), the sampler
  uses τ.
* ``swr_block_power``: a CA-PG-SwR mixture score ``log Σ_m π_m(a)^{n_m}`` (log-probabilities
  multiplied by the block size n_m) instead of ``log Σ_m n_m π_m(a)``. The SwR score is not a
  probability; what it claims is the expected number of times a is drawn when every position k
  draws independently from expert m(k), and that is what the validation checks.

Run ``python examples/planted_bugs.py`` to find, for each bug and catalog size, the smallest
number of draws per context (from a grid) at which every one of five seeds fails each
statistical check, and which deterministic checks catch it at any n; the table is printed and
written as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from torch import Tensor

from capg_rec import expert_of_position, inclusion_log_prob
from capg_rec._numerics import gumbel_like, log1mexp
from capg_rec.validate import CatalogESR, validate_esr


class Planted:
    """An ESR that samples with ``sampler`` and claims with ``claims`` (both ``contexts →``)."""

    def __init__(self, num_candidates: int, sampler, claims, *, with_replacement: bool = False,
                 candidate_log_prob=None) -> None:
        self.num_candidates = num_candidates
        self.with_replacement = with_replacement
        self._sampler, self._claims = sampler, claims
        if candidate_log_prob is not None:
            self.candidate_log_prob = candidate_log_prob

    def sample(self, contexts: Any, num_samples: int, generator: torch.Generator) -> Tensor:
        return self._sampler(contexts, num_samples, generator)

    def inclusion_log_prob(self, contexts: Any) -> Tensor:
        return self._claims(contexts)


def shared_noise_sample(logits: Tensor, num_candidates: int, num_samples: int,
                        generator: torch.Generator) -> Tensor:
    """BUG: one Gumbel vector per draw, shared by all expert blocks. ``logits [B, M, N]`` → ``[B, S, K]``."""
    batch, num_experts, num_items = logits.shape
    noise = gumbel_like((batch, num_samples, num_items), generator=generator, dtype=logits.dtype,
                        device=logits.device)
    taken = torch.zeros(batch, num_samples, num_items, dtype=torch.bool)
    picks = []
    for m in expert_of_position(num_candidates, num_experts).tolist():
        pick = (logits[:, m].unsqueeze(1) + noise).masked_fill(taken, -torch.inf).argmax(2)
        taken.scatter_(2, pick.unsqueeze(2), True)
        picks.append(pick)
    return torch.stack(picks, dim=2)


def swapped_prefix_plugin(logits: Tensor, num_candidates: int) -> Tensor:
    """BUG: the plug-in ``1 − Π_k (1 − w_a / (Z − W(prefix_{<k})))`` whose prefix is the greedy
    top-(K−1) with the target replaced in place by the K-th item. ``logits [B, N]`` → ``[B, N]``."""
    s = logits.double()
    batch, num_items = s.shape
    order = s.argsort(dim=1, descending=True)
    rank = order.argsort(dim=1)
    k = num_candidates
    prefix = order[:, :k - 1].unsqueeze(1).expand(batch, num_items, k - 1).clone()  # [B, N(target), K-1]
    inside = rank < k - 1
    slot = rank.clamp(max=k - 2).unsqueeze(2)
    swapped = torch.where(inside, order[:, k - 1].unsqueeze(1), prefix.gather(2, slot)[..., 0])
    prefix.scatter_(2, slot, swapped.unsqueeze(2))
    log_z = torch.logsumexp(s, dim=1, keepdim=True)  # [B, 1]
    removed = torch.logcumsumexp(s.gather(1, prefix.reshape(batch, -1)).view(batch, num_items, k - 1), dim=2)
    removed = torch.cat([removed.new_full((batch, num_items, 1), -torch.inf), removed], dim=2)  # [B, N, K]
    log_denominator = log_z.unsqueeze(2) + log1mexp(removed - log_z.unsqueeze(2))
    log_hazard = s.unsqueeze(2) - log_denominator
    return log1mexp(log1mexp(log_hazard).sum(dim=2)).to(logits.dtype)


def swr_block_power(logits: Tensor, num_candidates: int) -> Tensor:
    """BUG: ``log Σ_m n_m · log π_m(a)`` inside the exponent, i.e. ``log Σ_m π_m(a)^{n_m}``.
    ``logits [B, M, N]`` → ``[B, N]``."""
    experts, sizes = torch.unique_consecutive(expert_of_position(num_candidates, logits.shape[1]),
                                              return_counts=True)
    log_soft = torch.log_softmax(logits, dim=2)[:, experts]  # [B, R, N]
    return torch.logsumexp(sizes.view(1, -1, 1).to(logits.dtype) * log_soft, dim=1)


def all_items(logits: Tensor) -> Tensor:
    return torch.arange(logits.shape[-1]).expand(logits.shape[0], -1)


def planted_esrs(num_items: int = 20, num_candidates: int = 5, seed: int = 0) -> dict[str, Planted]:
    """The four buggy ESRs on fixed problems (logits drawn from ``seed``): two contexts, N items,
    K candidates (a 2-expert mixture for the SwR bug); the shared-noise bug always uses a tiny
    2-expert catalog (N = 6, K = 4) so that its claims can be exact (enumerated)."""
    g = torch.Generator().manual_seed(seed)
    moe_tiny = 1.5 * torch.randn(2, 2, 6, generator=g)
    single = 2.0 * torch.randn(2, num_items, generator=g)
    moe = torch.randn(2, 2, num_items, generator=g)
    tau, k = 0.8, num_candidates
    exact_moe = CatalogESR(moe_tiny, 4, method="enumerate")
    exact = CatalogESR(single, k, method="exact")
    tempered = CatalogESR(single, k, temperature=tau, method="exact")
    swr = CatalogESR(moe, k, method="with_replacement")
    return {
        "shared_noise": Planted(4, lambda _, n, gen: shared_noise_sample(moe_tiny, 4, n, gen),
                                exact_moe.inclusion_log_prob, candidate_log_prob=exact_moe.candidate_log_prob),
        "swapped_prefix": Planted(k, exact.sample, lambda _: swapped_prefix_plugin(single, k)),
        "temperature_twice": Planted(k, tempered.sample, lambda _: inclusion_log_prob(
            single / tau, all_items(single), k, temperature=tau, method="exact")),
        "swr_block_power": Planted(k, swr.sample, lambda _: swr_block_power(moe, k), with_replacement=True),
    }


GRID = (20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000)


def smallest_catching_n(esr: Planted, check: str, seeds: range, alpha: float) -> int | None:
    """The smallest n in GRID at which ``check`` fails for every seed (None if none does)."""
    for n in GRID:
        if all(not validate_esr(esr, num_samples=n, alpha=alpha, seed=s).check(check).passed for s in seeds):
            return n
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alpha", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--sizes", default="20:5,200:10,1000:50", help="N:K pairs, comma separated")
    parser.add_argument("--out", default="runs/planted_bugs/planted_bugs.json", help="the JSON file to write (its "
                        "folder is made)")
    args = parser.parse_args()
    if args.seeds < 1:  # all() over no seeds holds for a correct ESR too
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    if not 0.0 < args.alpha < 1.0:
        parser.error(f"--alpha must be in (0, 1), got {args.alpha}")
    try:
        sizes = list(dict.fromkeys(tuple(int(v) for v in pair.split(":")) for pair in args.sizes.split(",")))
    except ValueError:
        parser.error(f"--sizes must be N:K pairs of integers, comma separated, got {args.sizes!r}")
    for pair in sizes:
        if len(pair) != 2 or not 2 <= pair[1] < pair[0]:  # K >= 2: the swapped prefix needs a K-th item to swap in
            parser.error(f"--sizes: each pair N:K needs 2 <= K < N, got {':'.join(map(str, pair))}")
    rows = []
    print(f"alpha={args.alpha}; n = smallest draws per context (grid {GRID[0]}..{GRID[-1]}) at which "
          f"all {args.seeds} seeds fail the check; deterministic checks fail at any n")
    print(f"{'bug':18s} {'N':>5s} {'K':>3s} {'check':15s} {'caught at n':>14s} {'time s':>7s}")
    for num_items, k in sizes:
        for name, esr in planted_esrs(num_items, k).items():
            if name == "shared_noise" and (num_items, k) != sizes[0]:
                continue  # its catalog does not depend on the size
            n_items = 6 if name == "shared_noise" else num_items
            for check in validate_esr(esr, num_samples=GRID[0], alpha=args.alpha).checks:
                start = time.perf_counter()
                if check.p_value is None:  # deterministic: report only when it catches the bug
                    if check.passed:
                        continue
                    n, shown = 0, "any n"
                else:
                    n = smallest_catching_n(esr, check.name, range(args.seeds), args.alpha)
                    shown = "not in grid" if n is None else str(n)
                rows.append({"bug": name, "num_items": n_items, "num_candidates": esr.num_candidates,
                             "check": check.name, "deterministic": check.p_value is None, "smallest_n": n})
                print(f"{name:18s} {n_items:5d} {esr.num_candidates:3d} {check.name:15s} {shown:>14s} "
                      f"{time.perf_counter() - start:7.1f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"alpha": args.alpha, "seeds": args.seeds, "grid": GRID, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
