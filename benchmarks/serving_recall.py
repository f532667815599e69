"""Recall@K of the serving export's greedy top-K through each FAISS index kind, against the exact
full-catalog greedy draw, and the time per batch of requests:

    OMP_NUM_THREADS=1 python benchmarks/serving_recall.py --num-items 100000 --out runs/serving

Item vectors and users are drawn as a trained two-tower's would look (clustered items, users near
clusters), so that an approximate index has real structure to exploit. Writes ``serving_recall.json``
and ``serving_recall.csv`` to ``--out``. Each time is the median of ``--reps`` calls after a warm-up call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from capg_rec import EmbeddingCatalog, greedy_candidates
from capg_rec._checks import positive_int
from capg_rec.ann import FaissIndex, recall_at_k
from capg_rec.serving import ServingRetriever
from capg_rec.train.report import write_csv, write_json


def clustered(num: int, experts: int, dim: int, clusters: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``num`` vectors ``[num, experts, dim]`` around random cluster centres."""
    centre = clusters[torch.randint(len(clusters), (num,), generator=g)]
    return (centre + 0.3 * torch.randn(num, experts, dim, generator=g)).squeeze(1) if experts == 1 else \
        centre + 0.3 * torch.randn(num, experts, dim, generator=g)


def _timed(call: Callable[[], torch.Tensor], reps: int) -> tuple[torch.Tensor, float]:
    """``call()``'s result and its median wall-clock ms over ``reps`` calls after one warm-up call (the full scan
    and the indexes alike)."""
    out = call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = call()
        times.append((time.perf_counter() - start) * 1e3)
    return out, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].rstrip(":") + ".")
    parser.add_argument("--num-items", type=int, default=100_000)
    parser.add_argument("--experts", type=int, default=1)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--candidates", type=int, default=50)
    parser.add_argument("--reps", type=positive_int, default=5, help="timed calls per method, after one warm-up")
    parser.add_argument("--out", type=Path, default=Path("runs/serving"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    m, d = args.experts, args.dim
    clusters = torch.randn(256, m, d, generator=g)
    items = clustered(args.num_items, m, d, clusters, g)
    users = clustered(args.batch, m, d, clusters, g)
    exact, exact_ms = _timed(lambda: greedy_candidates(EmbeddingCatalog(users, items), args.candidates), args.reps)
    rows = [{"index": "full-catalog scan", "build_s": 0.0, "batch_ms": exact_ms, "recall_at_k": 1.0}]
    for kind in tqdm(["flat", "hnsw", "ivf"], desc="indexes"):
        start = time.perf_counter()
        index = FaissIndex(items, kind=kind, num_threads=1)
        build = time.perf_counter() - start
        server = ServingRetriever(lambda u: u, items, index=index)
        got, batch_ms = _timed(lambda: server.retrieve(users, num_candidates=args.candidates).candidates, args.reps)
        rows.append({"index": f"faiss {kind}", "build_s": build, "batch_ms": batch_ms,
                     "recall_at_k": recall_at_k(got, exact)})
    args.out.mkdir(parents=True, exist_ok=True)
    setting = {k: getattr(args, k) for k in ("num_items", "experts", "dim", "batch", "candidates")}
    write_json(args.out / "serving_recall.json", {"setting": setting, "results": rows})
    write_csv(args.out / "serving_recall.csv", rows)
    print(f"N={args.num_items} M={m} D={d} B={args.batch} K={args.candidates}")
    for row in rows:
        print(f"{row['index']:18s} build {row['build_s']:7.2f} s  batch {row['batch_ms']:8.1f} ms  "
              f"recall@K {row['recall_at_k']:.4f}")


if __name__ == "__main__":
    main()
