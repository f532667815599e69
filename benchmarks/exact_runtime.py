"""Forward + backward time and peak memory of the "exact" inclusion method.

    OMP_NUM_THREADS=1 python benchmarks/exact_runtime.py [--batch 128] [--repeats 3]

Each configuration runs in a fresh subprocess (so its peak RSS is its own) under an address-space
limit; a configuration that exceeds it is reported as "out of memory". Prints one row per
configuration: median CPU ms of forward + backward and the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CONFIGS = [  # (name, experts, items, candidates, temperature, spread)
    ("N=1000 K=10 M=1", 1, 1000, 10, 1.0, 0.0),
    ("N=1000 K=200 M=1", 1, 1000, 200, 1.0, 0.0),
    ("N=1000 K=10 M=5", 5, 1000, 10, 1.0, 0.0),
    ("N=1000 K=200 M=5", 5, 1000, 200, 1.0, 0.0),
    ("N=1000 K=10 M=1 tau=0.2", 1, 1000, 10, 0.2, 0.0),
    ("N=20000 K=100 M=1 (head+tail)", 1, 20000, 100, 1.0, 0.0),
    ("N=500 K=10 M=2 gap=1e4", 2, 500, 10, 1.0, 1e4),
    ("N=500 K=200 M=2 gap=1e4", 2, 500, 200, 1.0, 1e4),
    ("N=50 K=45 M=5 gap=1e4", 5, 50, 45, 1.0, 1e4),
]


def _run_one(index: int, batch: int, repeats: int) -> dict:
    import torch

    from capg_rec import inclusion_log_prob

    torch.set_num_threads(1)
    name, experts, items, k, tau, gap = CONFIGS[index]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, experts, items, generator=g)
    if gap:
        logits[:, :, :5] += gap
        logits[:, :, -5:] -= gap
    targets = torch.randint(0, items, (batch, 1), generator=g)
    times = []
    for _ in range(repeats):
        x = logits.clone().requires_grad_()
        start = time.process_time()
        out = inclusion_log_prob(x, targets, k, temperature=tau, method="exact")
        out.sum().backward()
        times.append(time.process_time() - start)
        assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(x.grad).all())
    times.sort()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"name": name, "ms": 1000 * times[len(times) // 2], "peak_mb": peak_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-limit-gb", type=float, default=8.0)
    parser.add_argument("--only", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only is not None:
        limit = int(args.memory_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(_run_one(args.only, args.batch, args.repeats)))
        return
    print(f"{'configuration':32s} {'fwd+bwd ms':>11s} {'peak MB':>8s}   (B={args.batch}, fp32, 1 thread)")
    for i, (name, *_) in enumerate(CONFIGS):
        proc = subprocess.run([sys.executable, __file__, "--only", str(i), "--batch", str(args.batch),
                               "--repeats", str(args.repeats), "--memory-limit-gb", str(args.memory_limit_gb)],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{name:32s} {row['ms']:11.1f} {row['peak_mb']:8.0f}", flush=True)
        else:
            err = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
            status = "out of memory" if "memory" in err.lower() else err[:60]
            print(f"{name:32s} {status:>20s}", flush=True)


if __name__ == "__main__":
    main()
