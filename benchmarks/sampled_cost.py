"""Cost of a whole CA-PG training step on the sampled catalog, as a ratio to in-batch softmax.

    OMP_NUM_THREADS=1 python benchmarks/sampled_cost.py [--sizes 100000 1000000 10000000] [--reps 10]
        [--batch-sizes 128 1024 4096]

One two-tower model (user and item ``nn.Embedding`` tables, D = 32, sparse gradients, SGD), B users per
step (``--batch-sizes``, 128 by default; the ratios are to the in-batch step at the same B, whose logits
``[B, B]`` grow as B² while a sampled step's grow as B·S), K = 10 candidates, L = 2 shown items, one thread.
Each configuration runs in its own process: the tables are built, then ``--reps`` steps (after 2 warm-ups) are
timed as CPU time of the process; the median is reported, with the peak resident memory beyond the tables (``ru_maxrss``
after the steps minus after building the tables) and the process's peak resident memory once the tables are
built ("RSS MB", ``ru_maxrss``: the interpreter, torch and the tables). Steps:

* ``in_batch``: logits of each user against the batch's positives ``[B, B]``, cross-entropy,
  backward, SGD step (the reference: what two-tower retrievers train with).
* ``sampled_softmax_S``: each user's positive against S = 128 or 1024 uniform negatives, logQ-corrected
  (Yi et al. 2019's sampled softmax; the usual large-catalog objective).
* ``sampled_swr_S`` / ``sampled_mf_S``: on-policy CA-PG-SwR / CA-PG (mean-field): draw K candidates
  from a ``SampledCatalog`` (S uniform negatives; no gradient), then a second ``SampledCatalog``
  whose head is the candidates, the loss, backward, SGD step. Rewards are random numbers (the
  environment is not part of the model's cost).
* ``full_swr`` / ``full_mf`` (N = 10^5 only): the same on the exact ``EmbeddingCatalog`` (dense
  item gradient).
* ``sampled_swr_hnsw`` (``--ann-sizes``): CA-PG-SwR whose sampling catalog also has a head of each
  user's 100 best items from a faiss HNSW index (search every step; the build, a refresh, is
  reported separately).

Writes JSON, CSV and a PNG into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import resource
import statistics
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from capg_rec._checks import positive_int

DIM, K, SHOWN, USERS = 32, 10, 2, 100_000


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _one(num_items: int, config: str, reps: int, batch: int = 128) -> dict:
    """Time ``config`` at ``num_items`` and ``batch`` users per step in this process → a result row."""
    from capg_rec import CAPGLoss, EmbeddingCatalog, SampledCatalog, UniformSampler, sample_candidates
    from capg_rec.ann import FaissIndex

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    full = config.startswith("full")
    users_t = torch.nn.Embedding(USERS, DIM, sparse=True)
    items_t = torch.nn.Embedding(num_items, DIM, sparse=not full)
    with torch.no_grad():
        users_t.weight.normal_(0, DIM ** -0.25, generator=g)
        items_t.weight.normal_(0, DIM ** -0.25, generator=g)
    opt = torch.optim.SGD([users_t.weight, items_t.weight], lr=0.05)
    index, build_s = None, 0.0
    if config.endswith("hnsw"):
        start = time.perf_counter()
        index = FaissIndex(items_t.weight.detach(), kind="hnsw", num_threads=1)
        build_s = time.perf_counter() - start
    base_rss = _rss_mb()
    method = "mean_field" if "_mf" in config else "with_replacement"
    negatives = int(config.split("_S")[1]) if "_S" in config else 1024
    loss_fn = CAPGLoss(K, method=method, validate_args=False)

    def step() -> None:
        users = torch.randint(USERS, (batch,), generator=g)
        u = users_t(users)
        if config == "in_batch":
            positives = torch.randint(num_items, (batch,), generator=g)
            logits = u @ items_t(positives).T
            loss = torch.nn.functional.cross_entropy(logits, torch.arange(batch))
        elif config.startswith("sampled_softmax"):  # the positive against S uniform negatives, logQ-corrected
            positives = torch.randint(num_items, (batch,), generator=g)
            sample = torch.randint(num_items, (negatives,), generator=g)
            pos = (u * items_t(positives)).sum(1, keepdim=True)
            neg = u @ items_t(sample).T - math.log(negatives / num_items)
            loss = torch.nn.functional.cross_entropy(torch.cat([pos, neg], 1), torch.zeros(batch, dtype=torch.long))
        else:
            if full:
                catalog = EmbeddingCatalog(u, items_t.weight, chunk_size=1 << 16, validate_args=False)
                with torch.no_grad():
                    candidates = sample_candidates(EmbeddingCatalog(u.detach(), items_t.weight.detach(),
                                                                    chunk_size=1 << 16, validate_args=False),
                                                   K, generator=g, validate_args=False)
            else:
                with torch.no_grad():
                    draw = SampledCatalog(u.detach(), items_t, num_items=num_items, sampler=UniformSampler(negatives),
                                          index=index, head_size=100 if index is not None else 0, generator=g,
                                          validate_args=False)
                    candidates = sample_candidates(draw, K, generator=g, validate_args=False)
                catalog = SampledCatalog(u, items_t, num_items=num_items, sampler=UniformSampler(negatives),
                                         head_items=candidates, generator=g, validate_args=False)
            rewards = torch.rand(batch, SHOWN, generator=g)
            loss = loss_fn(catalog, candidates, candidates[:, :SHOWN], rewards)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return dict(N=num_items, B=batch, config=config, step_ms=1e3 * statistics.median(times), reps=reps,
                peak_rss_beyond_tables_mb=_rss_mb() - base_rss, rss_after_tables_mb=base_rss,
                index_build_s=build_s)


def _configs(num_items: int, ann_sizes: list[int]) -> list[str]:
    out = ["in_batch", "sampled_softmax_S128", "sampled_softmax_S1024", "sampled_swr_S128", "sampled_swr_S1024",
           "sampled_swr_S4096", "sampled_mf_S1024"]
    if num_items <= 100_000:
        out += ["full_swr", "full_mf"]
    if num_items in ann_sizes:
        out.append("sampled_swr_hnsw")
    return out


def _plot(rows: list[dict], path: pathlib.Path) -> None:
    """One panel per batch size: each configuration's step time over the in-batch step's, against N."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["B"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 3.8), squeeze=False, sharey=True)
    for ax, batch in zip(axes[0], batches):
        mine = [r for r in rows if r["B"] == batch]
        for config in sorted({r["config"] for r in mine} - {"in_batch"}):
            sel = sorted((r for r in mine if r["config"] == config), key=lambda r: r["N"])
            ax.plot([r["N"] for r in sel], [r["ratio_to_in_batch"] for r in sel], marker="o", label=config,
                    ls="--" if config.startswith("sampled_softmax") else "-")
        ax.axhline(1, color="gray", lw=0.5)
        ax.axhline(3, color="red", lw=0.5, ls=":", label="3x (the target)")
        ax.set(xscale="log", yscale="log", xlabel="catalog size N", title=f"B={batch}, D={DIM}, K={K}, one thread")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("step time / in-batch softmax step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    p.add_argument("--ann-sizes", type=int, nargs="*", default=[100_000])
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[128],
                   help="users per step B (each a panel of the plot; in-batch softmax costs B^2 D)")
    p.add_argument("--reps", type=positive_int, default=10)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/sampled_cost"))
    p.add_argument("--one", nargs=2, metavar=("N", "CONFIG"),
                   help="time one configuration in this process and print its JSON; CONFIG one of "
                        f"{', '.join(_configs(100_000, [100_000]))} (full_* and *_hnsw: N = 10^5)")
    args = p.parse_args(argv)
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))  # each once: a ratio is to its own B's in-batch step
    if args.one and len(args.batch_sizes) > 1:
        p.error(f"--one times one configuration: give one batch size, got --batch-sizes {args.batch_sizes}")
    if args.one:
        size, config = args.one
        if not size.isdigit() or int(size) < 1 or config not in _configs(int(size), [int(size)]):
            p.error(f"--one: N an integer >= 1 and CONFIG one of {', '.join(_configs(10**5, [10**5]))} (full_*: "
                    f"N <= 10^5), got {size} {config}")
        print(json.dumps(_one(int(size), config, args.reps, args.batch_sizes[0])))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(n, b, c) for b in args.batch_sizes for n in args.sizes for c in _configs(n, args.ann_sizes)]
    rows = []
    for n, batch, config in tqdm(jobs, desc="configurations"):
        done = subprocess.run([sys.executable, __file__, "--one", str(n), config, "--reps", str(args.reps),
                               "--batch-sizes", str(batch)], capture_output=True, text=True)
        if done.returncode:  # the measured process's own error, not a CalledProcessError (rows so far are kept)
            print(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}",
                  file=sys.stderr)
            p.exit(1, f"sampled_cost.py: --one {n} {config} --batch-sizes {batch} failed (above); measured before "
                      f"it: {rows}\n")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = {(r["N"], r["B"]): r["step_ms"] for r in rows if r["config"] == "in_batch"}
    for r in rows:
        r["ratio_to_in_batch"] = r["step_ms"] / base[r["N"], r["B"]]
    from capg_rec.train.report import write_csv, write_json  # here: the measured processes import less

    write_json(args.out / "sampled_cost.json", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    write_csv(args.out / "sampled_cost.csv", rows)
    _plot(rows, args.out / "sampled_cost.png")
    print(f"{'N':>9} {'B':>5} {'config':>18} {'step ms':>9} {'ratio':>7} {'peak MB':>8} {'RSS MB':>9}")
    for r in rows:
        print(f"{r['N']:>9} {r['B']:>5} {r['config']:>18} {r['step_ms']:>9.1f} {r['ratio_to_in_batch']:>7.1f} "
              f"{r['peak_rss_beyond_tables_mb']:>8.1f} {r['rss_after_tables_mb']:>9.0f}")


if __name__ == "__main__":
    main()
