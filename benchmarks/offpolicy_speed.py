"""Off-policy loss step against the on-policy step of the same estimator.

    OMP_NUM_THREADS=1 python benchmarks/offpolicy_speed.py [--reps 50] [--out runs/offpolicy_speed]

One process, one thread, B = 128, N = 1000, L = 1, K in (10, 50, 200), logits a leaf. A cell is the
fastest and the median of ``--reps`` forward + backward calls (CPU time) after ``--warmup`` calls, the on- and
off-policy calls interleaved (drifting load hits both alike; on a shared machine the fastest call
is the steadier measure of the cost), with input checks on (the default) and off. Pairs: CA-PG
(mean-field) vs off-policy CA-PG (capped); CA-PG-SwR vs off-policy CA-PG-SwR; V-PG vs IPS V-PG;
CA-PG-SwR vs top-K REINFORCE (the same SwR score plus Chen's multiplier). The off-policy calls get
the logged log-propensities as inputs (precomputed, as in a log), so the ratio is the cost of
the weights. Target: ratio <= 1.2. Writes results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import statistics
import time

import torch

from capg_rec._checks import positive_int
from capg_rec import (CAPGLoss, OffPolicyCAPGLoss, OffPolicyVPGLoss, TopKReinforceLoss, VPGLoss,
                      candidate_log_prob, inclusion_log_prob, sample_candidates)

TARGET_RATIO = 1.2


def _pairs(k: int, validate: bool) -> dict[str, tuple[torch.nn.Module, torch.nn.Module, str]]:
    """name → (on-policy loss, off-policy loss, the logged input it takes)."""
    v = dict(validate_args=validate)
    return {
        "capg": (CAPGLoss(k, **v), OffPolicyCAPGLoss(k, max_weight=100.0, **v), "inclusion"),
        "capg_swr": (CAPGLoss(k, method="with_replacement", **v),
                     OffPolicyCAPGLoss(k, method="with_replacement", max_weight=100.0, **v), "count"),
        "vpg": (VPGLoss(k, **v), OffPolicyVPGLoss(k, max_weight=100.0, **v), "set"),
        "topk_reinforce": (CAPGLoss(k, method="with_replacement", **v), TopKReinforceLoss(k, max_weight=100.0, **v),
                           "item"),
    }


def _time_pair(first, second, reps: int, warmup: int) -> tuple[list[float], list[float]]:
    """CPU seconds of each call of two functions, interleaved."""
    for _ in range(warmup):
        first()
        second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, bucket in ((first, times[0]), (second, times[1])):
            start = time.process_time()  # CPU time: another process's load does not enter it
            fn()
            bucket.append(time.process_time() - start)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=positive_int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--out", default="runs/offpolicy_speed")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for k in args.ks:
        logits = torch.randn(args.batch, args.items, generator=g).requires_grad_()
        logging_logits = torch.randn(args.batch, args.items, generator=g) / 2
        candidates = sample_candidates(logging_logits, k, generator=g)
        chosen = candidates[:, :1]
        rewards = torch.rand(args.batch, 1, generator=g)
        count = inclusion_log_prob(logging_logits, chosen, k, method="with_replacement")
        logged = {"inclusion": inclusion_log_prob(logging_logits, chosen, k), "count": count,
                  "set": candidate_log_prob(logging_logits, candidates), "item": (count - math.log(k)).clamp(max=0)}
        for validate in (True, False):
            for name, (on, off, key) in _pairs(k, validate).items():
                def on_step():
                    on(logits, candidates, chosen, rewards).backward()

                def off_step():
                    off(logits, candidates, chosen, rewards, logged[key]).backward()

                on_times, off_times = _time_pair(on_step, off_step, args.reps, args.warmup)
                t_on, t_off = min(on_times), min(off_times)
                m_on, m_off = statistics.median(on_times), statistics.median(off_times)
                rows.append({"K": k, "estimator": name, "checks": validate, "on_ms_min": 1e3 * t_on,
                             "off_ms_min": 1e3 * t_off, "ratio_min": t_off / t_on, "on_ms_median": 1e3 * m_on,
                             "off_ms_median": 1e3 * m_off, "ratio_median": m_off / m_on, "target": TARGET_RATIO})
                print(f"K={k:4d} {name:15s} checks={str(validate):5s} fastest: on {1e3 * t_on:8.3f} ms  off "
                      f"{1e3 * t_off:8.3f} ms  ratio {t_off / t_on:5.2f} | median ratio {m_off / m_on:5.2f}",
                      flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"batch": args.batch, "items": args.items, "reps": args.reps, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "machine": platform.machine(), "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"written: {out / 'results.json'}")
    return result


if __name__ == "__main__":
    main()
