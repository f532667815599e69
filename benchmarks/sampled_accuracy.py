"""Accuracy of the sampled catalog against the exact full catalog, and recall of the ANN head.

    OMP_NUM_THREADS=1 python benchmarks/sampled_accuracy.py [--sizes 100000 1000000] [--seeds 20]

A random two-tower (D = 32, user and item vectors N(0, I/√D), so scores are about N(0, 1)) at
temperature τ (τ = 1: a flat policy; τ = 0.1: a confident one). Per (N, τ), B users; each row's
targets are its exact top-2 items and 2 uniform items. The exact values come from
:class:`~capg_rec.EmbeddingCatalog` (chunked over the whole catalog). For each number of uniform
negatives S and sampler seed, a :class:`~capg_rec.SampledCatalog` with a head of the user's
``--head`` best items (exact index, searched by each catalog: a scan of N counted in its time) plus the
targets estimates

* the log normaliser ``log Σ_n exp(s_n)``,
* ``log π(a ∈ A^K)`` of each target by CA-PG-SwR (``with_replacement``), ``mean_field`` and ``plugin``.

Reported: bias (mean over seeds and rows of estimate - exact) and std (over seeds, root-mean over
rows), in nats. Then the recall@k of faiss HNSW and IVF against exact top-k (``--ann-size`` items).
Writes JSON, CSV and a PNG into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

import torch
from tqdm import tqdm

from capg_rec import EmbeddingCatalog, SampledCatalog, UniformSampler, inclusion_log_prob
from capg_rec.ann import ExactIndex, FaissIndex, recall_at_k
from capg_rec.train.report import write_csv, write_json

METHODS = ("with_replacement", "mean_field", "plugin")


def _towers(num_items: int, batch: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = dim ** -0.25
    return scale * torch.randn(batch, dim, generator=g), scale * torch.randn(num_items, dim, generator=g)


def accuracy(sizes: list[int], negatives: list[int], temperatures: list[float], seeds: int, batch: int,
             head: int, k: int, dim: int) -> list[dict]:
    rows = []
    for n in sizes:
        user, item = _towers(n, batch, dim, seed=n)
        index = ExactIndex(item)
        for tau in temperatures:
            full = EmbeddingCatalog(user, item, tau, chunk_size=1 << 16)
            with torch.no_grad():
                top = full.top_items(2)[:, 0]
                rand = torch.randint(n, (batch, 2), generator=torch.Generator().manual_seed(1))
                targets = torch.cat([top, rand], 1)
                exact = {"log_normalizer": full.log_normalizer()[:, 0]}
                for method in METHODS:
                    exact[method] = inclusion_log_prob(full, targets, k, method=method, validate_args=False)
            for s in tqdm(negatives, desc=f"N={n} tau={tau}", leave=False):
                errors: dict[str, list[torch.Tensor]] = {name: [] for name in exact}
                start = time.process_time()
                for seed in range(seeds):
                    with torch.no_grad():
                        # the head through the index, so that the catalog knows it names the best items
                        # (as head_items it was the same ids, but mean-field warned that it could not tell)
                        cat = SampledCatalog(user, item, temperature=tau, sampler=UniformSampler(s),
                                             index=index if head else None,
                                             head_size=head, head_items=targets,
                                             generator=torch.Generator().manual_seed(seed), validate_args=False)
                        errors["log_normalizer"].append(cat.log_normalizer()[:, 0] - exact["log_normalizer"])
                        for method in METHODS:
                            est = inclusion_log_prob(cat, targets, k, method=method, validate_args=False)
                            errors[method].append(est - exact[method])
                seconds = (time.process_time() - start) / seeds
                for name, errs in errors.items():
                    e = torch.stack(errs).double()  # [seeds, B(, L)]
                    rows.append(dict(N=n, tau=tau, negatives=s, quantity=name, bias=float(e.mean()),
                                     std=float(e.var(0).mean().sqrt()), max_abs=float(e.abs().max()),
                                     cpu_s_per_catalog=seconds))
    return rows


def ann_recall(num_items: int, dim: int, batch: int, k: int) -> list[dict]:
    user, item = _towers(num_items, batch, dim, seed=7)
    _, exact = ExactIndex(item).search(user, k)
    out = []
    for kind, opts in [("hnsw", dict(ef_search=64)), ("hnsw", dict(ef_search=256)), ("ivf", dict(nprobe=8)),
                       ("ivf", dict(nprobe=32))]:
        start = time.perf_counter()
        index = FaissIndex(item, kind=kind, num_threads=1, **opts)
        built = time.perf_counter() - start
        start = time.perf_counter()
        _, found = index.search(user, k)
        searched = (time.perf_counter() - start) / batch
        out.append(dict(N=num_items, kind=kind, **opts, k=k, recall=recall_at_k(found, exact), build_s=built,
                        search_ms_per_query=1e3 * searched))
    return out


def _plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    quantities = ["log_normalizer", *METHODS]
    sizes = sorted({r["N"] for r in rows})
    fig, axes = plt.subplots(len(sizes), len(quantities), figsize=(4 * len(quantities), 3.2 * len(sizes)),
                             squeeze=False)
    for i, n in enumerate(sizes):
        for j, q in enumerate(quantities):
            ax = axes[i][j]
            for tau in sorted({r["tau"] for r in rows}):
                sel = sorted((r for r in rows if r["N"] == n and r["quantity"] == q and r["tau"] == tau),
                             key=lambda r: r["negatives"])
                xs = [r["negatives"] for r in sel]
                ax.errorbar(xs, [r["bias"] for r in sel], yerr=[r["std"] for r in sel], marker="o", capsize=3,
                            label=f"τ={tau}")
            ax.axhline(0, color="gray", lw=0.5)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{q}, N={n:.0e}", fontsize=9)
            ax.set_xlabel("uniform negatives S")
            if j == 0:
                ax.set_ylabel("estimate - exact (nats): bias ± std")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--negatives", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.3, 0.1])
    p.add_argument("--seeds", type=int, default=20, help="sampler seeds per cell (at least 2: a standard deviation)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--head", type=int, default=100, help="index head size per row")
    p.add_argument("--k", type=int, default=10, help="candidates K")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--ann-size", type=int, default=100_000, help="items for the ANN recall (0: skip)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/sampled_accuracy"))
    args = p.parse_args(argv)
    if args.seeds < 2:
        p.error(f"--seeds must be at least 2 (a standard deviation over them), got {args.seeds}")
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = accuracy(args.sizes, args.negatives, args.temperatures, args.seeds, args.batch, args.head, args.k,
                    args.dim)
    recall = ann_recall(args.ann_size, args.dim, 64, args.head) if args.ann_size else []
    write_json(args.out / "sampled_accuracy.json",
               {"args": {k: str(v) for k, v in vars(args).items()}, "accuracy": rows, "ann_recall": recall})
    write_csv(args.out / "sampled_accuracy.csv", rows)
    _plot(rows, args.out / "sampled_accuracy.png")
    print(f"{'N':>8} {'tau':>4} {'S':>6} {'quantity':>16} {'bias':>9} {'std':>9}")
    for r in rows:
        print(f"{r['N']:>8} {r['tau']:>4} {r['negatives']:>6} {r['quantity']:>16} {r['bias']:>9.4f} {r['std']:>9.4f}")
    for r in recall:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    if any(not math.isfinite(r["bias"]) for r in rows):
        print("warning: non-finite errors (see the JSON)")


if __name__ == "__main__":
    main()
