"""Benchmark: drawing K candidates from the whole catalog, sharded catalog vs the plain embedding catalog.

    python integration/bench_sampling.py --out DIR [--num-items 100000 --batch 128 --candidates 20]

One process, one thread. Times ``capg_rec.sample_candidates`` (exact Gumbel top-K over every item)
on :class:`capg_rec.EmbeddingCatalog` (noise drawn chunk by chunk from the generator: it depends
on the chunking) and on :class:`capg_rec.torchrec.ShardedEmbeddingCatalog` (noise that depends only
on the seed, the global user index, the expert and the item id: the same at any world size).
Reports the median over ``--reps`` calls (after a warm-up) in ``DIR/bench_sampling.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from capg_rec import EmbeddingCatalog, sample_candidates
from capg_rec.torchrec import ShardedEmbeddingCatalog


def _median_ms(call, reps: int) -> float:
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-items", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--candidates", type=int, default=20)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--experts", type=int, default=1)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    user = torch.randn(args.batch, args.experts, args.dim, generator=g)
    item = torch.randn(args.num_items, args.experts, args.dim, generator=g)
    catalogs = {"embedding_catalog": EmbeddingCatalog(user, item, chunk_size=args.chunk_size),
                "sharded_catalog": ShardedEmbeddingCatalog(user, item, num_items=args.num_items,
                                                           chunk_size=args.chunk_size)}
    results = {}
    for name, catalog in catalogs.items():
        gen = torch.Generator().manual_seed(1)
        results[f"{name}_sample_ms"] = _median_ms(lambda: sample_candidates(catalog, args.candidates, generator=gen),
                                                  args.reps)
        results[f"{name}_top_k_ms"] = _median_ms(lambda: catalog.top_items(args.candidates), args.reps)
    results["ratio"] = results["sharded_catalog_sample_ms"] / results["embedding_catalog_sample_ms"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_sampling.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                              "results": results}, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
