"""The CPU kernels under capg_rec's hot paths, against the torch/numpy calls they replace: time per call.

    OMP_NUM_THREADS=1 python benchmarks/cpu_kernels.py [--reps 200]

- exp of float32: ``torch.exp`` against ``exp_floored_`` (``exp2`` of ``x·log2 e`` on the CPU) of a copy
  (one new buffer each), on ``[128, 1000]`` and ``[128, 5, 1000]`` standard normals shifted to a maximum
  of 0;
- expm1 of float32: ``torch.expm1`` against ``expm1_`` (numpy's vectorised ``expm1`` on the CPU) into a
  buffer, on ``-e^x`` of the same (the arguments of mean-field's Newton steps);
- top-k of float32 rows, best first with capg_rec's tie policy: ``top_k`` (the pruned path where rows hold
  at least 8k entries) against its partition path and ``torch.topk`` (which does not order ties alike);
- the pruned path's group maxima (about 4k groups of n / 4k entries), consecutive groups in torch (what it takes
  for long groups) against strided groups in numpy (what it takes for short ones);
- the Gumbel top-k draw of k of n items per row: ``gumbel_top_k`` with its default groups (none below a group
  size of 4) against the two-level draw with groups of ``int(√(n/k))`` (its default before) and, last
  column, one Gumbel per item.

Times are medians (CPU time) of ``--reps`` calls after a tenth as many; the top-k, group-maximum and Gumbel rows take
``--reps`` times ``128 · 1000`` over their shape's number of entries instead (at least 3 calls: fewer for the
large shapes). The table also gives each baseline over capg_rec's time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from capg_rec._numerics import _top_k_partition, exp_floored_, expm1_, gumbel_top_k, top_k

EXP_SHAPES = [(128, 1000), (128, 5, 1000)]
TOP_K = [(128, 1000, 10), (128, 1000, 50), (640, 1000, 200), (128, 16384, 10), (128, 16384, 100),
         (128, 100_000, 10), (128, 100_000, 50)]
GROUP_MAXIMA = [(128, 16384, 10), (128, 100_000, 10), (128, 100_000, 50)]
GUMBEL = [(128, 138, 10), (128, 1034, 10), (128, 256, 50), (128, 1000, 200), (128, 16384, 100)]


def median_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(max(1, reps // 10)):
        fn()
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e6 * statistics.median(times)


def main(argv: list[str] | None = None) -> list[tuple[str, float, float, float | None]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape in EXP_SHAPES:
        x = torch.randn(shape, generator=gen)
        x -= x.amax(-1, keepdim=True)
        rows.append((f"exp {list(shape)}", median_us(lambda: exp_floored_(x.clone()), args.reps),
                     median_us(lambda: torch.exp(x), args.reps), None))
    for shape in EXP_SHAPES:
        x = -torch.randn(shape, generator=gen).exp()
        out = torch.empty_like(x)
        rows.append((f"expm1 {list(shape)}", median_us(lambda: expm1_(x, out), args.reps),
                     median_us(lambda: torch.expm1(x, out=out), args.reps), None))
    for num_rows, n, k in TOP_K:
        x = torch.randn(num_rows, n, generator=gen)
        reps = max(3, args.reps * 1000 // (num_rows * n // 128))
        rows.append((f"top-{k} of [{num_rows}, {n}]", median_us(lambda: top_k(x, k), reps),
                     median_us(lambda: _top_k_partition(x, k), reps), median_us(lambda: x.topk(k), reps)))
    for num_rows, n, k in GROUP_MAXIMA:
        a = torch.randn(num_rows, n, generator=gen).numpy()
        size = n // (4 * k)
        whole = a[:, :n // size * size]
        reps = max(3, args.reps * 1000 // (num_rows * n // 128))
        rows.append((f"maxima of groups of {size}, [{num_rows}, {n}]",
                     median_us(lambda: torch.from_numpy(whole).reshape(num_rows, -1, size).amax(2), reps),
                     median_us(lambda: whole.reshape(num_rows, size, -1).max(axis=1), reps), None))
    for num_rows, n, k in GUMBEL:
        x = torch.randn(num_rows, n, generator=gen)
        reps = max(3, args.reps * 1000 // (num_rows * n // 128))
        grouped = max(2, int((n / k) ** 0.5))
        rows.append((f"Gumbel top-{k} of [{num_rows}, {n}]", median_us(lambda: gumbel_top_k(x, k, generator=gen), reps),
                     median_us(lambda: gumbel_top_k(x, k, generator=gen, group_size=grouped), reps),
                     median_us(lambda: gumbel_top_k(x, k, generator=gen, group_size=1), reps)))
    print("| kernel | capg_rec µs | replaced call µs (× capg_rec); group maxima: strided groups in numpy | "
          "torch.topk / one Gumbel per item µs (× capg_rec) |")
    print("|---|---|---|---|")
    for name, ours, old, torch_topk in rows:
        other = "" if torch_topk is None else f"{torch_topk:.0f} ({torch_topk / ours:.1f}×)"
        print(f"| {name} | {ours:.0f} | {old:.0f} ({old / ours:.1f}×) | {other} |")
    return rows


if __name__ == "__main__":
    main()
