"""Forward + backward time, cost model and peak memory of the "exact" inclusion method.

    OMP_NUM_THREADS=1 python benchmarks/exact_runtime.py [--batch 128] [--repeats 3] [--memory-budget BYTES]
    OMP_NUM_THREADS=1 python benchmarks/exact_runtime.py --rss-batch 30000   # peak memory at a large batch
    OMP_NUM_THREADS=1 python benchmarks/exact_runtime.py --cost-model        # c(k) for k = 1 .. 200

Each configuration runs in a fresh subprocess (so its peak RSS is its own) under an address-space
limit; a configuration that exceeds it is reported as "out of memory". Per configuration:

* median CPU ms of forward + backward;
* Q, the quadrature nodes per row (mean over rows and expert blocks), and the time per unit of
  the cost model's work ``W = Σ_blocks B · Q · T`` (T head slots), ``ns/unit``: the model's c(k),
  which grows with the draws k of a block (``--cost-model`` sweeps k at one configuration);
* peak RSS: the process's (``ru_maxrss``), the interpreter, torch and the inputs included (some 350 MB
  at B = 8), not the method's alone;
* another estimator's call after the exact ones: median ms of ``torch.logsumexp`` forward +
  backward on a ``[128, 1000]`` leaf (50 calls, CPU time) before and after them, and their ratio (1.0: the
  exact method left the process as fast as it found it; calls of 0.4 ms vary by some 10% from run to run).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
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
RSS_CONFIG = ("N=100 K=10 M=1", 1, 100, 10, 1.0, 0.0)
COST_MODEL_DRAWS = (1, 2, 5, 10, 12, 20, 50, 100, 200)  # at N=1000, M=1, B=64


def _bare_ms(torch, calls: int = 50) -> float:
    """Median ms (CPU time) of logsumexp forward + backward on a [128, 1000] leaf."""
    x0 = torch.randn(128, 1000, generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(calls):
        x = x0.clone().requires_grad_()
        start = time.process_time()
        torch.logsumexp(x, 1).sum().backward()
        times.append(time.process_time() - start)
    return 1000 * statistics.median(times)


def _run_one(config: tuple, batch: int, repeats: int, budget: int | None) -> dict:
    import torch

    import capg_rec._exact as exact
    from capg_rec._head_tail import head_size_for, summarize
    from capg_rec.catalog import DenseCatalog
    from capg_rec.plackett_luce import expert_runs

    torch.set_num_threads(1)
    name, experts, items, k, tau, gap = config
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, experts, items, generator=g)
    if gap:
        logits[:, :, :5] += gap
        logits[:, :, -5:] -= gap
    targets = torch.randint(0, items, (batch, 1), generator=g)
    runs = expert_runs(k, experts)
    blocks = exact._check_runs(runs, experts)
    nodes: list[float] = []
    find_nodes = exact._nodes

    def counting_nodes(*args, **kwargs):
        out = find_nodes(*args, **kwargs)
        nodes.append(float(torch.isfinite(out[1]).sum(1).double().mean()))  # real nodes per row
        return out

    exact._nodes = counting_nodes
    settings = {} if budget is None else {"memory_budget": budget}
    bare_before = _bare_ms(torch)
    times, work = [], 0.0
    for _ in range(repeats):
        nodes.clear()
        x = logits.clone().requires_grad_()
        start = time.process_time()
        catalog = DenseCatalog(x, temperature=tau)
        summary = summarize(catalog, targets, head_size_for(items, k), exact.EXACT_NUM_POWERS)
        out = exact.exact_log_inclusion(summary, runs, **settings)
        out.sum().backward()
        times.append(time.process_time() - start)
        assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(x.grad).all())
        slots = summary.head_scores.shape[2]
        # nodes holds one entry per block and node search (search chunks of a block: same weight)
        per_block = len(nodes) // len(blocks)
        q = [statistics.mean(nodes[i * per_block:(i + 1) * per_block]) for i in range(len(blocks))]
        work = sum(batch * qb * slots for qb in q)
    bare_after = _bare_ms(torch)
    ms = 1000 * statistics.median(times)
    return {"name": name, "ms": ms, "nodes": statistics.mean(q), "ns_per_unit": 1e6 * ms / work,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "bare_before": bare_before, "bare_after": bare_after}


def _subprocess(args: argparse.Namespace, index: int, batch: int, extra: list[str] | None = None) -> dict | str:
    command = [sys.executable, __file__, "--only", str(index), "--batch", str(batch), "--repeats", str(args.repeats),
               "--memory-limit-gb", str(args.memory_limit_gb), *(extra or [])]
    if args.memory_budget is not None:
        command += ["--memory-budget", str(args.memory_budget)]
    proc = subprocess.run(command, check=False, capture_output=True, text=True)
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    err = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    return "out of memory" if "memory" in err.lower() else err[:60]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-budget", type=int, default=None, help="bytes (default: the library's)")
    parser.add_argument("--memory-limit-gb", type=float, default=8.0)
    parser.add_argument("--rss-batch", type=int, default=None,
                        help=f"only the peak RSS of one fwd+bwd of {RSS_CONFIG[0]} at this batch size")
    parser.add_argument("--cost-model", action="store_true", help="c(k) of the cost model for k = 1 .. 200")
    parser.add_argument("--only", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--draws", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in (("batch", args.batch), ("repeats", args.repeats), ("memory-budget", args.memory_budget),
                        ("rss-batch", args.rss_batch)):
        if value is not None and value < 1:
            parser.error(f"--{name} must be a positive integer, got {value}")
    if args.only is not None:
        limit = int(args.memory_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        config = RSS_CONFIG if args.only < 0 else CONFIGS[args.only]
        if args.draws is not None:
            config = (f"N=1000 K={args.draws} M=1", 1, 1000, args.draws, 1.0, 0.0)
        print(json.dumps(_run_one(config, args.batch, args.repeats, args.memory_budget)))
        return
    if args.cost_model:
        print(f"{'k':>4s} {'Q':>5s} {'fwd+bwd ms':>11s} {'ns per row·node·slot':>21s}   "
              "(N=1000, M=1, B=64, fp32, 1 thread)")
        for k in COST_MODEL_DRAWS:
            row = _subprocess(args, 0, 64, ["--draws", str(k)])
            if isinstance(row, str):
                print(f"{k:4d} {row:>20s}", flush=True)
            else:
                print(f"{k:4d} {row['nodes']:5.0f} {row['ms']:11.1f} {row['ns_per_unit']:21.0f}", flush=True)
        return
    if args.rss_batch is not None:
        args.repeats = 1
        row = _subprocess(args, -1, args.rss_batch)
        shown = row if isinstance(row, str) else f"{row['peak_mb']:.0f} MB peak RSS, {row['ms'] / 1000:.1f} s CPU"
        print(f"{RSS_CONFIG[0]}, B={args.rss_batch}, fp32, 1 thread: {shown}")
        return
    print(f"{'configuration':32s} {'fwd+bwd ms':>11s} {'Q':>6s} {'ns/unit':>8s} {'peak MB':>8s} "
          f"{'bare ms before/after':>21s}   (B={args.batch}, fp32, 1 thread)")
    for i, (name, *_) in enumerate(CONFIGS):
        row = _subprocess(args, i, args.batch)
        if isinstance(row, str):
            print(f"{name:32s} {row:>20s}", flush=True)
            continue
        bare = f"{row['bare_before']:.3f}/{row['bare_after']:.3f} ({row['bare_after'] / row['bare_before']:.2f}x)"
        print(f"{name:32s} {row['ms']:11.1f} {row['nodes']:6.0f} {row['ns_per_unit']:8.3f} {row['peak_mb']:8.0f} "
              f"{bare:>21s}", flush=True)


if __name__ == "__main__":
    main()
