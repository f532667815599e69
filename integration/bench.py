"""Benchmark: one CA-PG training step on a 10^6-item catalog, unsharded vs sharded over ranks.

    python integration/bench.py --out DIR          # runs every configuration, prints the table

Configurations: the unsharded retriever (plain ``EmbeddingCollection``, one process), and the
retriever row-wise sharded over W = 1 and 2 ranks (``torchrun``, gloo, one thread per rank), each
rank with B users per step. A step is: forward (one lookup), Gumbel top-K sampling from the whole
catalog, the CA-PG loss, backward with the fused SGD. Reported per rank: median step time, peak
RSS, its growth over the process's footprint before the model was built, and the bytes of item
rows the rank holds. Ratios are to the unsharded step. Results go to ``DIR/bench.json``/``.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import _harness as h
    from capg_rec import CAPGLoss, sample_candidates

    sharded = args.mode == "sharded"
    rank, world = h.init() if sharded else (0, 1)
    torch.set_num_threads(1)
    setup = h.Setup(num_items=args.num_items, num_experts=1, dim=args.dim, num_users=10_000,
                    chunk_size=args.chunk_size)
    base_mb = _rss_mb()
    if sharded:
        model = h.shard(setup, lr=0.01)
        retriever = model.module
    else:
        model = retriever = h.build(setup)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = int(retriever.catalog_ids().numel())
    loss_fn = CAPGLoss(args.candidates)
    times = []
    for step in range(args.steps + 1):
        users = torch.randint(10_000, (args.batch,), generator=torch.Generator().manual_seed(step * 97 + rank))
        start = time.perf_counter()
        catalog = model(retriever.with_catalog(h.user_batch(users)))
        candidates = sample_candidates(catalog, args.candidates, generator=torch.Generator().manual_seed(step))
        chosen = candidates[:, :2]
        rewards = torch.rand(chosen.shape, generator=torch.Generator().manual_seed(step))
        loss = loss_fn(catalog, candidates, chosen, rewards)
        if not sharded:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if not sharded:
            optimizer.step()
        if sharded:
            dist.barrier()
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
    result = {"mode": args.mode, "world_size": world, "rank": rank, "step_s": statistics.median(times),
              "peak_rss_mb": _peak_mb(), "rss_growth_mb": _peak_mb() - base_mb,
              "item_rows": rows, "item_mb": rows * setup.width * 4 / 2**20}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.mode}_w{world}_r{rank}.json").write_text(json.dumps(result))
    if sharded:
        h.teardown(model)


def driver(args: argparse.Namespace) -> None:
    here = Path(__file__).resolve()
    common = ["--out", str(args.out), "--num-items", str(args.num_items), "--dim", str(args.dim),
              "--batch", str(args.batch), "--steps", str(args.steps), "--candidates", str(args.candidates),
              "--chunk-size", str(args.chunk_size)]
    path = os.pathsep.join(p for p in (str(here.parents[1]), os.environ.get("PYTHONPATH")) if p)  # this checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    runs = [[sys.executable, str(here), "--worker", "--mode", "unsharded", *common]]
    for world in args.worlds:
        runs.append([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                     str(here), "--worker", "--mode", "sharded", *common])
    for cmd in runs:
        print("running:", " ".join(cmd[2:5]), flush=True)
        subprocess.run(cmd, check=True, env=env, cwd=here.parent, capture_output=True)
    results = [json.loads(p.read_text()) for p in sorted(Path(args.out).glob("*_w*_r*.json"))]
    base = next(r for r in results if r["mode"] == "unsharded")
    for r in results:
        r["step_ratio"] = r["step_s"] / base["step_s"]
        r["peak_rss_ratio"] = r["peak_rss_mb"] / base["peak_rss_mb"]
        r["rss_growth_ratio"] = r["rss_growth_mb"] / base["rss_growth_mb"]
        r["item_ratio"] = r["item_mb"] / base["item_mb"]
        r["users_per_s"] = args.batch * r["world_size"] / r["step_s"]
    results.sort(key=lambda r: (r["mode"] != "unsharded", r["world_size"], r["rank"]))
    (Path(args.out) / "bench.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                           "results": results}, indent=1))
    with open(Path(args.out) / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    print(f"N={args.num_items:,} D={args.dim} B={args.batch}/rank K={args.candidates} CA-PG step, 1 thread/rank")
    print(f"{'config':<14}{'rank':>5}{'step s':>9}{'x':>7}{'peak RSS MB':>13}{'x':>7}"
          f"{'RSS growth MB':>15}{'x':>7}{'item rows MB':>14}{'x':>7}{'users/s':>9}")
    for r in results:
        name = "unsharded" if r["mode"] == "unsharded" else f"sharded W={r['world_size']}"
        print(f"{name:<14}{r['rank']:>5}{r['step_s']:>9.2f}{r['step_ratio']:>7.2f}{r['peak_rss_mb']:>13.0f}"
              f"{r['peak_rss_ratio']:>7.2f}{r['rss_growth_mb']:>15.0f}{r['rss_growth_ratio']:>7.2f}"
              f"{r['item_mb']:>14.1f}{r['item_ratio']:>7.2f}{r['users_per_s']:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-items", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128, help="users per rank")
    parser.add_argument("--candidates", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--chunk-size", type=int, default=16_384)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["unsharded", "sharded"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
