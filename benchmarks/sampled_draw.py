"""How far the sampled catalog's candidate draw is from the exact Plackett-Luce draw.

    OMP_NUM_THREADS=1 python benchmarks/sampled_draw.py [--seeds 300] [--draws 500]

The sampled draw is a Gumbel top-K over head ∪ negative sample, the sample's keys carrying their
logQ weights (``SampledCatalog.top_items(perturb=True)``); its law is the PL law over that pool,
averaged over the sampler's randomness.

* Small catalogs (N = 10, K = 3): for each sampler seed the PL law over the pool is enumerated
  exactly (every ordered K-tuple), averaged over ``--seeds`` seeds (those whose pool holds at
  least K items: the sampled catalog refuses to draw from fewer), and compared with the exact PL
  law over K-subsets of the catalog: total variation, with the Monte-Carlo noise level
  ``½ Σ_A se(A)`` of that average.
* Large catalogs (N = 10^5, K = 10): inclusion frequencies over ``--draws`` draws (a fresh sample
  per draw) against as many exact draws (:class:`~capg_rec.EmbeddingCatalog`): the inclusion
  error ``Σ_bins |f - f_exact| / (2K)`` over 101 bins per row (its 100 most likely items one by
  one, every other item pooled: per-item frequencies of a flat policy are all noise), with the
  same metric between two independent exact runs as the noise floor.

Writes JSON, CSV and a PNG into ``--out``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import torch
from tqdm import tqdm

from capg_rec import EmbeddingCatalog, SampledCatalog, UniformSampler, sample_candidates
from capg_rec.ann import ExactIndex
from capg_rec.train.report import write_csv, write_json


def _towers(num_items: int, batch: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = dim ** -0.25
    return (scale * torch.randn(batch, dim, generator=g, dtype=torch.float64),
            scale * torch.randn(num_items, dim, generator=g, dtype=torch.float64))


def _subset_law(ids: torch.Tensor, keys: torch.Tensor, num_items: int) -> torch.Tensor:
    """PL law (K = 3, without replacement) over pool ``ids [P]`` with log-weights ``keys [P]`` →
    probabilities of the sorted id triples, flattened ``[N³]``."""
    w = torch.softmax(keys, 0)
    i, j, k = torch.meshgrid(*(torch.arange(len(ids)),) * 3, indexing="ij")
    distinct = (i != j) & (j != k) & (i != k)
    p = w[i] * w[j] / (1 - w[i]) * w[k] / (1 - w[i] - w[j]).clamp(min=1e-300)
    p = torch.where(distinct, p, 0.0)
    trip = torch.stack([ids[i], ids[j], ids[k]], -1).sort(-1).values
    code = (trip[..., 0] * num_items + trip[..., 1]) * num_items + trip[..., 2]
    return torch.zeros(num_items ** 3, dtype=p.dtype).index_add_(0, code.flatten(), p.flatten())


def small(seeds: int, temperatures: list[float]) -> list[dict]:
    n, k, batch = 10, 3, 3
    user, item = _towers(n, batch, 4, seed=0)
    index = ExactIndex(item)
    rows = []
    for tau in temperatures:
        scores = (user @ item.T) / tau
        exact = [_subset_law(torch.arange(n), scores[b], n) for b in range(batch)]
        for head in (0, 3):
            for s in tqdm((4, 8, 16, 32), desc=f"small tau={tau} head={head}", leave=False):
                laws = []
                for seed in range(seeds):
                    cat = SampledCatalog(user, item, temperature=tau, sampler=UniformSampler(s),
                                         index=index if head else None, head_size=head,
                                         generator=torch.Generator().manual_seed(seed))
                    per_row = []
                    for b in range(batch):
                        keep_h = cat.head_ids[b] >= 0
                        keep_s = ~cat.sample_drop[b]
                        ids = torch.cat([cat.head_ids[b][keep_h], cat.sample_ids[keep_s]])
                        keys = torch.cat([cat.head_scores[b, 0][keep_h],
                                          (cat.sample_scores[b, 0] + cat.sample_log_weight)[keep_s]])
                        per_row.append(_subset_law(ids, keys, n) if len(ids) >= k else None)
                    laws.append(per_row)
                for b in range(batch):
                    drawn = [law[b] for law in laws if law[b] is not None]
                    if not drawn:
                        continue
                    stack = torch.stack(drawn)
                    mean = stack.mean(0)
                    noise = 0.5 * float((stack.std(0) / len(drawn) ** 0.5).sum())
                    rows.append(dict(N=n, K=k, tau=tau, head=head, negatives=s, row=b,
                                     tv=0.5 * float((mean - exact[b]).abs().sum()), mc_noise=noise,
                                     seeds_with_pool_ge_K=len(drawn)))
    return rows


def _frequencies(draws: list[torch.Tensor], bins: torch.Tensor) -> torch.Tensor:
    """``draws``: list of ``[B, K]`` → inclusion frequencies of each row's ``bins [B, T]`` items and,
    last, the expected number drawn from outside them → ``[B, T + 1]``."""
    ids = torch.stack(draws).transpose(0, 1).flatten(1)  # [B, R·K]
    hit = ids.unsqueeze(2) == bins.unsqueeze(1)  # [B, R·K, T]
    inside = hit.sum(1).double()
    outside = (~hit.any(2)).sum(1, keepdim=True).double()
    return torch.cat([inside, outside], 1) / len(draws)


def large(num_items: int, draws: int, temperatures: list[float]) -> list[dict]:
    k, batch = 10, 4
    user, item = _towers(num_items, batch, 32, seed=1)
    user, item = user.float(), item.float()
    index = ExactIndex(item)
    rows = []
    for tau in temperatures:
        full = EmbeddingCatalog(user, item, tau, chunk_size=1 << 16, validate_args=False)
        g = torch.Generator().manual_seed(0)
        bins = full.top_items(100)[:, 0]  # each row's 100 most likely items, one bin each; the rest pooled
        exact_a = _frequencies([sample_candidates(full, k, generator=g, validate_args=False)
                                for _ in tqdm(range(draws), desc=f"exact tau={tau}", leave=False)], bins)
        exact_b = _frequencies([sample_candidates(full, k, generator=g, validate_args=False)
                                for _ in range(draws)], bins)
        floor = (exact_a - exact_b).abs().sum(1) / (2 * k)
        heads = index.search(user, 100)[1]
        for head in (0, 100):
            for s in (1024, 4096):
                found = []
                for seed in tqdm(range(draws), desc=f"sampled tau={tau} head={head} S={s}", leave=False):
                    gen = torch.Generator().manual_seed(seed)
                    cat = SampledCatalog(user, item, temperature=tau, sampler=UniformSampler(s),
                                         head_items=heads if head else None, generator=gen, validate_args=False)
                    found.append(sample_candidates(cat, k, generator=gen, validate_args=False))
                err = (_frequencies(found, bins) - exact_a).abs().sum(1) / (2 * k)
                top_share = float(torch.softmax(user @ item.T / tau, 1).topk(100, dim=1).values.sum(1).mean())
                rows.append(dict(N=num_items, K=k, tau=tau, head=head, negatives=s, draws=draws,
                                 inclusion_error=float(err.mean()), noise_floor=float(floor.mean()),
                                 top100_mass=top_share))
    return rows


def _plot(small_rows: list[dict], large_rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2 if large_rows else 1, figsize=(10 if large_rows else 5, 3.6), squeeze=False)
    axes = axes[0]
    for tau in sorted({r["tau"] for r in small_rows}):
        for head in (0, 3):
            sel = [r for r in small_rows if r["tau"] == tau and r["head"] == head]
            xs = sorted({r["negatives"] for r in sel})
            axes[0].plot(xs, [statistics.mean(r["tv"] for r in sel if r["negatives"] == x) for x in xs], marker="o",
                         label=f"τ={tau}, head={head}")
    axes[0].set(xscale="log", xlabel="uniform negatives S", ylabel="TV over K-subsets", title="N=10, K=3")
    axes[0].legend(fontsize=7)
    if large_rows:  # --large-size 0: no second panel
        labels = [f"τ={r['tau']} h={r['head']} S={r['negatives']}" for r in large_rows]
        axes[1].barh(labels, [r["inclusion_error"] for r in large_rows], label="sampled vs exact")
        axes[1].barh(labels, [r["noise_floor"] for r in large_rows], alpha=0.6, label="exact vs exact (noise)")
        axes[1].set(xlabel="Σ|f - f_exact| / 2K", title=f"N={large_rows[0]['N']}, K=10")
        axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=300, help="at least 2 (the Monte-Carlo noise is a standard deviation)")
    p.add_argument("--draws", type=int, default=500)
    p.add_argument("--large-size", type=int, default=100_000)
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.3])
    p.add_argument("--large-temperatures", type=float, nargs="+", default=[1.0, 0.3, 0.1])
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/sampled_draw"))
    args = p.parse_args(argv)
    if args.seeds < 2:
        p.error(f"--seeds must be at least 2 (a standard deviation over them), got {args.seeds}")
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    small_rows = small(args.seeds, args.temperatures)
    large_rows = large(args.large_size, args.draws, args.large_temperatures) if args.large_size else []
    write_json(args.out / "sampled_draw.json",
               {"args": {k: str(v) for k, v in vars(args).items()}, "small": small_rows, "large": large_rows})
    for name, rows in (("small", small_rows), ("large", large_rows)):
        if rows:
            write_csv(args.out / f"sampled_draw_{name}.csv", rows)
    _plot(small_rows, large_rows, args.out / "sampled_draw.png")
    for r in small_rows:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    for r in large_rows:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
