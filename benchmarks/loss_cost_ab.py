"""One version's loss costs, as JSON, in the API that this version and the one before it share, so
two checkouts can be compared run against run (alternate them):

    PYTHONPATH=<checkout> OMP_NUM_THREADS=1 python benchmarks/loss_cost_ab.py 40 > costs.json

Forward+backward from a logits leaf, B=128, N=1000, L=1, one thread: ms medians of REPS calls
(a fifth of them for mean-field at K=200, M=5, slow before this version).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch

import capg_rec
from capg_rec import CAPGLoss, VPGLoss, sample_candidates

SWR = "with_replacement" if hasattr(capg_rec, "inclusion_methods") else "swr"  # the earlier name


def median_ms(step: Callable[[], None], reps: int) -> float:
    for _ in range(5):
        step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def main(reps: int) -> dict:
    torch.set_num_threads(1)
    losses = {
        "vpg": lambda k, v: VPGLoss(k, validate_args=v),
        "vpg_swr": lambda k, v: VPGLoss(k, with_replacement=True, validate_args=v),
        "capg_mean_field": lambda k, v: CAPGLoss(k, method="mean_field", validate_args=v),
        "capg_plugin": lambda k, v: CAPGLoss(k, method="plugin", validate_args=v),
        "capg_swr": lambda k, v: CAPGLoss(k, method=SWR, validate_args=v),
    }
    out = {}
    for k, m in [(10, 1), (50, 1), (20, 2), (200, 5)]:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(128, m, 1000, generator=g).requires_grad_()
        cand = sample_candidates(logits.detach(), k, generator=g)
        chosen, rewards = cand[:, :1], torch.rand(128, 1)
        row = {"bare": median_ms(lambda: torch.logsumexp(logits, -1).sum().backward(), reps)}
        for name, make in losses.items():
            n = max(5, reps // 5) if name == "capg_mean_field" and k == 200 else reps
            for checks in (True, False):
                fn = make(k, checks)
                row[name + ("" if checks else "_nochecks")] = median_ms(
                    lambda: fn(logits, cand, chosen, rewards).backward(), n)
        out[f"{k},{m}"] = row
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)))
