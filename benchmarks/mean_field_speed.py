"""Forward + backward time of the mean-field inclusion method, as a ratio to bare scoring.

    OMP_NUM_THREADS=1 python benchmarks/mean_field_speed.py [--reps 50] [--large-reps 3]

"bare" is logsumexp over the catalog, forward and backward, from a leaf (the logits, or for the large catalogs
the user and item embeddings of an ``EmbeddingCatalog``): the reference of any estimator that normalises over
the catalog (not a strict floor: see ``loss_speed.py``). "direct" is ``mean_field_log_inclusion`` on an
unvalidated catalog; "public" is ``inclusion_log_prob(..., method="mean_field")`` with its input checks
(whichever implementation it dispatches to). All columns of a row are timed in the same process, round-robin in
short runs of each, as CPU time of this process (one thread), and the median is reported, so that the ratios
hold on a busy machine. B = 128, L = 1 target per row, standard-normal logits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from capg_rec._checks import positive_int
from capg_rec import DenseCatalog, EmbeddingCatalog, inclusion_log_prob
from capg_rec._mean_field import mean_field_log_inclusion
from capg_rec.plackett_luce import expert_runs

DENSE = [(10, 1), (50, 1), (20, 2), (200, 5)]  # (K, M) at N = 1000
LARGE = [(100_000, 10, 1), (100_000, 200, 5), (1_000_000, 10, 1)]  # (N, K, M) through EmbeddingCatalog


def _median_times(steps: dict[str, Callable[[], None]], reps: int, run: int = 5) -> dict[str, float]:
    """Median seconds of each step over ``reps`` repetitions (rounded up to whole runs), taken round-robin in runs
    of ``run`` (after one warm-up each): a run lets the allocator settle on the step's own buffers, which
    another step's would otherwise evict (page faults, several times the arithmetic at N = 1000)."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    run = min(run, reps)
    for _ in range(-(-reps // run)):
        for name, step in steps.items():
            for _ in range(run):
                start = time.process_time()
                step()
                times[name].append(time.process_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _dense_steps(batch: int, num_items: int, k: int, experts: int) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, experts, num_items, generator=gen).requires_grad_()
    items = torch.randint(0, num_items, (batch, 1), generator=gen)
    runs = expert_runs(k, experts)

    def bare() -> None:
        torch.logsumexp(logits, dim=2).sum().backward()
        logits.grad = None

    def direct() -> None:
        mean_field_log_inclusion(DenseCatalog(logits, validate_args=False), items, runs).sum().backward()
        logits.grad = None

    def public() -> None:
        inclusion_log_prob(logits, items, k, method="mean_field").sum().backward()
        logits.grad = None

    return {"bare": bare, "direct": direct, "public": public}


def _large_steps(batch: int, num_items: int, k: int, experts: int, dim: int) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(0)
    user = (torch.randn(batch, experts, dim, generator=gen) / dim**0.5).requires_grad_()
    item = torch.randn(num_items, experts, dim, generator=gen).requires_grad_()
    items = torch.randint(0, num_items, (batch, 1), generator=gen)
    runs = expert_runs(k, experts)

    def bare() -> None:  # unvalidated, as in the dense rows and loss_speed.py
        EmbeddingCatalog(user, item, validate_args=False).log_normalizer().sum().backward()
        user.grad = item.grad = None

    def direct() -> None:
        mean_field_log_inclusion(EmbeddingCatalog(user, item, validate_args=False), items, runs).sum().backward()
        user.grad = item.grad = None

    def public() -> None:
        inclusion_log_prob(EmbeddingCatalog(user, item), items, k, method="mean_field").sum().backward()
        user.grad = item.grad = None

    return {"bare": bare, "direct": direct, "public": public}


def _row(label: str, times: dict[str, float]) -> str:
    bare = times["bare"]
    cells = [f"{times[name] * 1e3:9.2f} ms ({times[name] / bare:5.1f}x)" for name in ("direct", "public")]
    return f"{label:<24} {bare * 1e3:9.2f} ms  " + "  ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--items", type=int, default=1000, help="N of the dense rows")
    parser.add_argument("--reps", type=positive_int, default=50, help="repetitions of the dense rows")
    parser.add_argument("--large-reps", type=positive_int, default=3, help="repetitions of the EmbeddingCatalog rows")
    parser.add_argument("--dim", type=int, default=16, help="embedding width of the EmbeddingCatalog rows")
    parser.add_argument("--skip-large", action="store_true")
    args = parser.parse_args()
    if args.items < max(k for k, _ in DENSE):
        parser.error(f"--items must be at least the dense rows' largest K, {max(k for k, _ in DENSE)}")
    torch.set_num_threads(1)
    print(f"{'case':<24} {'bare':>12}  {'direct (x bare)':>22}  {'public (x bare)':>22}   (B={args.batch}, 1 thread)")
    for k, experts in DENSE:
        times = _median_times(_dense_steps(args.batch, args.items, k, experts), args.reps)
        print(_row(f"N={args.items} K={k} M={experts}", times), flush=True)
    if args.skip_large:
        return
    for num_items, k, experts in LARGE:
        times = _median_times(_large_steps(args.batch, num_items, k, experts, args.dim), args.large_reps)
        print(_row(f"N={num_items:.0e} K={k} M={experts}", times), flush=True)


if __name__ == "__main__":
    main()
