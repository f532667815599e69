"""Time of one catalog-wide pass of ``EmbeddingCatalog`` (log normaliser forward + backward) by chunk size.

    OMP_NUM_THREADS=1 python benchmarks/chunk_size.py                      # the CPU, N = 10^5 and 10^6
    python benchmarks/chunk_size.py --device cuda --items 100000 1000000 10000000

For each N and (B, M), D = 32: the median of ``--reps`` passes (CPU time on the CPU, wall-clock time to a device
synchronisation on CUDA) at each chunk size, and at the default (``chunk_size=None``:
:func:`capg_rec.catalog.chunk_items`), with the peak memory above the embeddings on CUDA. Chunks of more than
``--max-scores`` scores (``B·M·chunk``), or of twice N items or more, are skipped (the default never). Prints a
Markdown table (ms, and × the fastest chunk of its row) and writes results.json, results.csv and chunk_size.png to
``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import statistics
import time

import torch
from tqdm.auto import tqdm

from capg_rec import EmbeddingCatalog
from capg_rec._checks import positive_int, positive_int_pair
from capg_rec.catalog import chunk_items


def time_pass(user: torch.Tensor, item: torch.Tensor, chunk: int | None, reps: int) -> float:
    """Median ms of a log-normaliser forward + backward (the first pass, a warm-up, left out)."""
    cuda = user.device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    times = []
    for _ in range(reps + 1):
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        EmbeddingCatalog(user, item, chunk_size=chunk, validate_args=False).log_normalizer().sum().backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(clock() - start)
        user.grad = item.grad = None
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--items", type=positive_int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--shapes", type=positive_int_pair("B,M"), nargs="+", default=[(128, 1), (1024, 1), (128, 5)],
                        help="B,M pairs")
    parser.add_argument("--chunks", type=positive_int, nargs="+",
                        default=[4096, 8192, 32768, 131072, 524288, 2097152])
    parser.add_argument("--max-scores", type=positive_int, default=2**28)
    parser.add_argument("--dim", type=positive_int, default=32)
    parser.add_argument("--reps", type=positive_int, default=5)
    parser.add_argument("--out", default="runs/chunk_size")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    cases = [(n, b, m) for n in args.items for b, m in args.shapes]
    for n, b, m in tqdm(cases, desc="chunk sizes"):
        gen = torch.Generator().manual_seed(0)
        user = (torch.randn(b, m, args.dim, generator=gen) / args.dim**0.5).to(device).requires_grad_()
        item = torch.randn(n, m, args.dim, generator=gen).to(device).requires_grad_()
        default = chunk_items(None, b * m, device)
        for chunk in sorted({*args.chunks, default}):
            if chunk != default and (b * m * chunk > args.max_scores or chunk >= 2 * n):  # the default always
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            ms = time_pass(user, item, None if chunk == default else chunk, args.reps)
            peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
            rows.append({"N": n, "B": b, "M": m, "chunk": chunk, "default": chunk == default, "ms": ms,
                         "peak_mib": peak})
        del user, item
    for row in rows:
        best = min(r["ms"] for r in rows if (r["N"], r["B"], r["M"]) == (row["N"], row["B"], row["M"]))
        row["x_fastest"] = row["ms"] / best
    _report(rows, args, device)


def _report(rows: list[dict], args: argparse.Namespace, device: torch.device) -> None:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "dim": args.dim, "reps": args.reps}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{meta}\n\n| N | B, M | chunk | ms | × fastest | peak MiB |\n|---|---|---|---|---|---|")
    for r in rows:
        peak = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        mark = " (default)" if r["default"] else ""
        print(f"| {r['N']:g} | {r['B']}, {r['M']} | {r['chunk']}{mark} | {r['ms']:.3g} | {r['x_fastest']:.2f} | "
              f"{peak} |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["N"], r["B"], r["M"]) for r in rows}):
        line = [r for r in rows if (r["N"], r["B"], r["M"]) == key]
        ax.plot([r["chunk"] for r in line], [r["ms"] for r in line], marker="o", label=f"N={key[0]:g}, B={key[1]}, "
                f"M={key[2]}")
        ax.scatter([r["chunk"] for r in line if r["default"]], [r["ms"] for r in line if r["default"]], s=120,
                   facecolors="none", edgecolors="black")
    ax.set(xscale="log", yscale="log", xlabel="chunk size (items)", ylabel="ms per pass (forward + backward)",
           title=f"EmbeddingCatalog pass by chunk size on {meta['gpu'] or 'the CPU'} (circled: the default)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "chunk_size.png", dpi=120)
    print(f"\nwritten: {out / 'results.json'}, {out / 'results.csv'}, {out / 'chunk_size.png'}")


if __name__ == "__main__":
    main()
