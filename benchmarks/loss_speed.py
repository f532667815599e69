"""Forward + backward time of every capg_rec loss as a multiple of bare scoring, beside the paper's code.

    OMP_NUM_THREADS=1 python benchmarks/loss_speed.py [--reps 50] [--exact] [--large] [--paper-code PATH]
    python benchmarks/loss_speed.py --device cuda --no-compile

One process, one thread (on CPU; ``--device cuda`` runs the same problems on the GPU, each call timed to its
end by a device synchronisation), B = 128, L = 1, (K, M) in (10, 1), (50, 1), (20, 2), (200, 5). The inputs are
leaves: logits ``[B, N]`` / ``[B, M, N]`` at N = 1000, and with ``--large`` embeddings (D = 32) scored through
``EmbeddingCatalog`` at N = 1e5 and 1e6. A cell is the median of ``--reps`` forward + backward calls after
``--warmup`` calls (fewer at large N and for the exact method), in CPU time on the CPU. "bare" is the normaliser
alone, ``torch.logsumexp(logits).sum()`` or ``EmbeddingCatalog.log_normalizer().sum()``, forward + backward: the
reference that the targets are set against (not a strict floor: at M > 1 capg_rec's own one-node log-softmax,
which the with-replacement estimators use, beats ``torch.logsumexp``'s backward on the CPU, so they can come out
below 1x: at K = 200, M = 5; at K = 20, M = 2 they came out at 0.7–1.5x in a review's runs, with the allocator's
state). The scores are standard normal; ``--scale S`` spreads them S times
wider, as a trained (confident) ESR's are: mean-field's root solve then takes more Newton steps.

Columns: capg_rec with its default input checks; with ``validate_args=False``; ``torch.compile`` (inductor,
default mode, ``validate_args=False``; the first call, compilation included, is reported apart with the number
of graphs compiled, more than one meaning graph breaks); and, with ``--paper-code PATH``, the paper authors'
released code (a checkout of it, imported from PATH and never copied: its licence is non-commercial; it needs
only torch) on the same logits: its V-PG, V-PG-SwR, CA-PG plug-in and TOP1 (for M > 1 its own TOP1 formula),
called as its training loop calls them. ``--exact`` times the exact method last (N = 1000 only, not compiled),
and re-times CA-PG-SwR at the largest (K, M) right before and after one exact call.

Prints a Markdown table (ms and × bare) and writes results.json, results.csv and ratios.png to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from capg_rec import CAPGLoss, EmbeddingCatalog, VPGLoss, sample_candidates
from capg_rec._checks import positive_int, positive_int_pair

LABELS = {"vpg": "V-PG", "vpg_swr": "V-PG-SwR", "capg_mean_field": "CA-PG mean-field (default)",
          "capg_plugin": "CA-PG plug-in", "capg_swr": "CA-PG-SwR / TOP1", "capg_exact": "CA-PG exact"}
VARIANTS = ("checks", "no checks", "compiled", "paper code")
TARGETS = {"vpg": 2.0, "vpg_swr": 1.3, "capg_mean_field": 3.0, "capg_plugin": 3.0, "capg_swr": 1.3}
"""The ratios to bare asked of each estimator (drawn on the chart)."""
PAPER_FLAGS = {"vpg": {}, "vpg_swr": {"is_vanilla_replacement": True},
               "capg_plugin": {"is_credit_assigned": True}, "capg_swr": {"is_top1": True}}
"""capg_rec estimator → the paper code's ``calc_prob_given_actions`` flags for the same loss."""
NUM_SHOWN = 1


def make_loss(name: str, k: int, validate: bool | None) -> torch.nn.Module:
    """capg_rec's loss module for an estimator key (``validate``: None = the default checks)."""
    if name.startswith("vpg"):
        return VPGLoss(k, with_replacement=name == "vpg_swr", validate_args=validate)
    method = {"capg_mean_field": "mean_field", "capg_plugin": "plugin", "capg_swr": "with_replacement",
              "capg_exact": "exact"}[name]
    return CAPGLoss(k, method=method, validate_args=validate)


@dataclasses.dataclass
class Cell:
    """One measurement; ``ms`` is None when it failed (``error``: the exception's class and message)."""

    N: int
    K: int
    M: int
    estimator: str
    variant: str
    ms: float | None = None
    ratio: float | None = None
    compile_s: float | None = None
    graphs: int | None = None
    error: str | None = None


@dataclasses.dataclass
class Problem:
    """Leaves, a draw and what is shown for one (N, K, M); ``build(leaves, validate)`` is what a loss scores."""

    num_items: int
    k: int
    m: int
    leaves: list[Tensor]
    build: Callable[[Sequence[Tensor], bool | None], Tensor | EmbeddingCatalog]
    bare: Callable[[], Tensor]
    candidates: Tensor
    chosen: Tensor
    rewards: Tensor

    def loss_step(self, name: str, validate: bool | None) -> Callable[..., Tensor]:
        """``step(*leaves) → loss`` of a capg_rec estimator."""
        loss_fn = make_loss(name, self.k, validate)
        return lambda *leaves: loss_fn(self.build(leaves, validate), self.candidates, self.chosen, self.rewards)


def _draw(problem_scores: Tensor | EmbeddingCatalog, batch: int, k: int, gen: torch.Generator
          ) -> tuple[Tensor, Tensor, Tensor]:
    """A PL draw, the shown items (distinct candidates) and their rewards."""
    candidates = sample_candidates(problem_scores, k, generator=gen)
    shown = torch.rand(batch, k, generator=gen).argsort(1)[:, :NUM_SHOWN]
    return candidates, candidates.gather(1, shown), torch.rand(batch, NUM_SHOWN, generator=gen)


def _on(device: torch.device, *tensors: Tensor) -> list[Tensor]:
    """The tensors (drawn on the CPU, so that every device times the same problem) moved to ``device``."""
    return [t.to(device) for t in tensors]


def dense_problem(batch: int, num_items: int, k: int, m: int, device: torch.device = torch.device("cpu"),
                  scale: float = 1.0) -> Problem:
    """Logits leaf ``[B, N]`` (M = 1) or ``[B, M, N]``, normal with standard deviation ``scale``."""
    gen = torch.Generator().manual_seed(0)
    shape = (batch, num_items) if m == 1 else (batch, m, num_items)
    cpu_logits = scale * torch.randn(*shape, generator=gen)
    draw = _on(device, *_draw(cpu_logits, batch, k, gen))
    logits = cpu_logits.to(device).requires_grad_()
    return Problem(num_items, k, m, [logits], lambda leaves, validate: leaves[0],
                   lambda: torch.logsumexp(logits, -1).sum(), *draw)


def embedding_problem(batch: int, num_items: int, k: int, m: int, dim: int,
                      device: torch.device = torch.device("cpu"), scale: float = 1.0) -> Problem:
    """User ``[B, M, D]`` and item ``[N, M, D]`` embedding leaves, scores ≈ normal with standard deviation
    ``scale``."""
    gen = torch.Generator().manual_seed(0)
    user = scale * torch.randn(batch, m, dim, generator=gen) / dim**0.5
    item = torch.randn(num_items, m, dim, generator=gen)

    def build(leaves: Sequence[Tensor], validate: bool | None) -> EmbeddingCatalog:
        return EmbeddingCatalog(*leaves, validate_args=validate)

    with torch.no_grad():
        draw = _on(device, *_draw(EmbeddingCatalog(user, item), batch, k, gen))
    user, item = (t.to(device).requires_grad_() for t in (user, item))
    return Problem(num_items, k, m, [user, item], build,
                   lambda: build([user, item], False).log_normalizer().sum(), *draw)


def time_ms(step: Callable[[], Tensor], leaves: Sequence[Tensor], reps: int, warmup: int) -> float:
    """Median ms of ``step().backward()`` over ``reps`` calls after ``warmup`` calls."""
    return 1e3 * statistics.median(_calls(step, leaves, warmup + reps)[warmup:])


def _calls(step: Callable[[], Tensor], leaves: Sequence[Tensor], count: int) -> list[float]:
    """Seconds of each of ``count`` calls: CPU time on the CPU (``time.process_time``: another process's load on
    a shared machine does not enter it), wall-clock time to a device synchronisation on CUDA."""
    times = []
    cuda = leaves[0].is_cuda
    clock = time.perf_counter if cuda else time.process_time
    for _ in range(count):
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        step().backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(clock() - start)
        for leaf in leaves:
            leaf.grad = None
    return times


def _compiled_cell(cell: Cell, problem: Problem, reps: int, warmup: int) -> None:
    """Compile afresh (no cache entries of earlier shapes), time the first call apart (in wall-clock seconds: the
    compiler's worker processes do part of the work, which this process's CPU time misses), then the rest."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(problem.loss_step(cell.estimator, False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = functools.partial(compiled, *problem.leaves)
        start = time.perf_counter()
        _calls(step, problem.leaves, 1)
        cell.compile_s = time.perf_counter() - start
        cell.graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        cell.ms = time_ms(step, problem.leaves, reps, warmup)


class _LogitsModel(torch.nn.Module):
    """The paper's policies read logits ``[M, B, N]`` from ``base_model(context=..., context_id=...)``."""

    def __init__(self, logits: Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, context: object = None, context_id: object = None) -> Tensor:
        return self.logits


def paper_step(path: str, problem: Problem, name: str) -> tuple[Callable[[], Tensor], list[Tensor]]:
    """The released code's loss for ``name`` on the problem's logits (moved to its ``[M, B, N]`` layout),
    reduced as its learner reduces it (mean over shown items, then over the batch) → ``(step, leaves)``."""
    if path not in sys.path:
        sys.path.insert(0, path)
    from src.policy import BaselineEarlyStagePolicy  # the released code, imported from the user's checkout

    (logits,) = problem.leaves
    leaf = logits.detach().reshape(-1, problem.m, problem.num_items).transpose(0, 1).contiguous().requires_grad_()
    policy = BaselineEarlyStagePolicy(base_model=_LogitsModel(leaf), action_set=None, random_seed=0)
    flags = PAPER_FLAGS[name]

    def step() -> Tensor:
        _, log_prob = policy.calc_prob_given_actions(
            actions=problem.chosen, candidate_actions=problem.candidates, n_candidate_action=problem.k, **flags)
        per_shown = log_prob if log_prob.dim() == 2 else log_prob.unsqueeze(1)  # V-PG: [B] → [B, 1]
        return -(per_shown * problem.rewards).mean()

    return step, [leaf]


def measure(problem: Problem, estimators: Sequence[str], variants: Sequence[str], reps: int, warmup: int,
            paper_code: str | None, bar: tqdm, bare: Cell | None = None) -> list[Cell]:
    """Bare (unless given), then every (estimator, variant) cell of one problem; failures are recorded, not raised."""
    where = {"N": problem.num_items, "K": problem.k, "M": problem.m}
    cells = []
    if bare is None:
        bar.set_description(f"N={problem.num_items} K={problem.k} M={problem.m} bare")
        bare = Cell(**where, estimator="bare", variant="checks", ratio=1.0,
                    ms=time_ms(problem.bare, problem.leaves, reps, warmup))
        cells.append(bare)
        bar.update()
    for name in estimators:
        for variant in variants:
            if variant == "paper code" and name not in PAPER_FLAGS:
                continue
            bar.set_description(f"N={problem.num_items} K={problem.k} M={problem.m} {name} {variant}")
            cell = Cell(**where, estimator=name, variant=variant)
            try:
                if variant == "compiled":
                    _compiled_cell(cell, problem, reps, warmup)
                elif variant == "paper code":
                    cell.ms = time_ms(*paper_step(paper_code, problem, name), reps, warmup)
                else:
                    step = problem.loss_step(name, None if variant == "checks" else False)
                    cell.ms = time_ms(functools.partial(step, *problem.leaves), problem.leaves, reps, warmup)
                cell.ratio = cell.ms / bare.ms
            except Exception as e:  # noqa: BLE001 - a failing cell is reported and the run goes on
                cell.ms, cell.error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if variant == "compiled":
                    tqdm.write(f"torch.compile failed for {name} at N={problem.num_items} K={problem.k} "
                               f"M={problem.m}: {type(e).__name__} (column skipped for this cell)")
            cells.append(cell)
            bar.update()
    return cells


def after_exact(problem: Problem, reps: int, warmup: int) -> dict[str, float]:
    """CA-PG-SwR (default checks) timed right before one exact call, then its first call and median after."""
    step = functools.partial(problem.loss_step("capg_swr", None), *problem.leaves)
    before = time_ms(step, problem.leaves, reps, warmup)
    exact_s = _calls(functools.partial(problem.loss_step("capg_exact", None), *problem.leaves), problem.leaves, 1)[0]
    first = 1e3 * _calls(step, problem.leaves, 1)[0]
    return {"N": problem.num_items, "K": problem.k, "M": problem.m, "exact_call_s": exact_s, "before_ms": before,
            "first_after_ms": first, "after_ms": time_ms(step, problem.leaves, reps, 0)}


def _fmt(cell: Cell | None) -> str:
    if cell is None:
        return "—"
    if cell.ms is None:
        return f"failed: {cell.error.split(':')[0]}"
    ratio = f"{cell.ratio:.1f}×" if cell.ratio < 10 else f"{cell.ratio:.0f}×"
    return f"{cell.ms:.3g} ({ratio})" if cell.ms < 100 else f"{cell.ms:.0f} ({ratio})"


def markdown(cells: Sequence[Cell], extra: dict[str, float] | None) -> str:
    """One row per (N, K, M, estimator): ms (× bare) per variant, compile time and graph count."""
    configs = list(dict.fromkeys((c.K, c.M) for c in cells))
    order = ["bare", *LABELS]
    cells = sorted(cells, key=lambda c: (c.N, configs.index((c.K, c.M)), order.index(c.estimator)))
    index = {(c.N, c.K, c.M, c.estimator, c.variant): c for c in cells}
    header = ("N", "K, M", "estimator", "default checks", "validate_args=False", "compiled", "compile (1st call)",
              "paper code")
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for (n, k, m, name) in dict.fromkeys((c.N, c.K, c.M, c.estimator) for c in cells):
        got = {v: index.get((n, k, m, name, v)) for v in VARIANTS}
        comp = got["compiled"]
        compile_s = "—" if comp is None or comp.compile_s is None else \
            f"{comp.compile_s:.1f} s, {comp.graphs} graph{'s' if comp.graphs != 1 else ''}"
        cols = [_fmt(got["checks"])] + (["", "", "", ""] if name == "bare" else
                                         [_fmt(got["no checks"]), _fmt(comp), compile_s, _fmt(got["paper code"])])
        lines.append(f"| {n:g} | {k}, {m} | {LABELS.get(name, name)} | " + " | ".join(cols) + " |")
    if extra:
        bare = index[(extra["N"], extra["K"], extra["M"], "bare", "checks")].ms
        title = (f"CA-PG-SwR (default checks) at N={extra['N']}, K={extra['K']}, M={extra['M']} around one exact call "
                 f"({extra['exact_call_s']:.1f} s):")
        lines += ["", title, "", "| | ms | × bare |", "|---|---|---|"]
        lines += [f"| {label} | {extra[key]:.3g} | {extra[key] / bare:.1f}× |" for label, key in
                  (("before (median)", "before_ms"), ("first call after", "first_after_ms"),
                   ("after (median)", "after_ms"))]
    return "\n".join(lines)


def plot(cells: Sequence[Cell], path: pathlib.Path) -> None:
    """A panel per (K, M) (rows) and N (columns): × bare per estimator and variant (log scale), targets dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({c.N for c in cells})
    configs = list(dict.fromkeys((c.K, c.M) for c in cells))
    fig, axes = plt.subplots(len(configs), len(sizes), figsize=(6.5 * len(sizes), 3.4 * len(configs)),
                             squeeze=False, sharey=True)
    variants = [v for v in VARIANTS if any(c.variant == v and c.estimator != "bare" for c in cells)]
    width = 0.8 / len(variants)
    for col, n in enumerate(sizes):
        names = [name for name in LABELS if any((c.N, c.estimator) == (n, name) for c in cells)]
        for row, (k, m) in enumerate(configs):
            ax = axes[row][col]
            for j, variant in enumerate(variants):
                ratios = {c.estimator: c.ratio for c in cells if (c.N, c.K, c.M, c.variant) == (n, k, m, variant)}
                xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(names))]
                ys = [ratios.get(name) or math.nan for name in names]
                bars = ax.bar(xs, ys, width, label=variant, color=f"C{j}")
                labels = ["" if math.isnan(y) else f"{y:.1f}" if y < 10 else f"{y:.0f}" for y in ys]
                ax.bar_label(bars, labels, fontsize=5, rotation=90, padding=1)
            for i, name in enumerate(names):
                if name in TARGETS:
                    ax.hlines(TARGETS[name], i - 0.45, i + 0.45, colors="k", linestyles="--", linewidth=0.8)
            ax.axhline(1.0, color="grey", linewidth=0.8)  # bare
            ax.set_yscale("log")
            ax.set_title(f"N={n:g}, K={k}, M={m}", fontsize=9)
            ax.set_xticks(range(len(names)), [LABELS[x].replace(" (default)", "") for x in names],
                          rotation=25, ha="right", fontsize=7)
            ax.set_ylabel("× bare (log; dashes: targets)", fontsize=8)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("forward + backward time ÷ bare scoring (normaliser alone)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _count(estimators: Sequence[str], variants: Sequence[str]) -> int:
    """Cells of one problem: bare, and every (estimator, variant) that exists."""
    return 1 + sum(v != "paper code" or n in PAPER_FLAGS for n in estimators for v in variants)


def allocator() -> dict[str, str | None]:
    """The memory-allocator settings of this process: with glibc's defaults, freed buffers of a few MB are
    handed back to the OS and faulted in again on the next call (1.4x on float64 suffix sums of
    [128, 5, 201] here);
    ``GLIBC_TUNABLES=glibc.malloc.trim_threshold=...:glibc.malloc.mmap_threshold=...`` or a preloaded
    jemalloc/tcmalloc (PyTorch's CPU tuning advice) keep them. Recorded so that runs compare like with like."""
    return {name: os.environ.get(name) for name in ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CONF")}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=positive_int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=positive_int, default=128)
    parser.add_argument("--items", type=positive_int, default=1000)
    parser.add_argument("--configs", nargs="+", type=positive_int_pair("K,M"),
                        default=[(10, 1), (50, 1), (20, 2), (200, 5)], help="K,M pairs")
    parser.add_argument("--estimators", nargs="+", default=[n for n in LABELS if n != "capg_exact"],
                        choices=[n for n in LABELS if n != "capg_exact"])
    parser.add_argument("--exact", action="store_true", help="also the exact method (slow; N = --items only)")
    parser.add_argument("--exact-reps", type=positive_int, default=3)
    parser.add_argument("--large", action="store_true", help="also N = --large-items through EmbeddingCatalog")
    parser.add_argument("--large-items", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--large-reps", type=positive_int, default=5)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="standard deviation of the scores (a trained ESR's are larger: more confident)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--paper-code", default=None, help="a checkout of the paper authors' released code")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default="runs/loss_speed")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if any(k > args.items for k, _ in args.configs):
        parser.error(f"--configs: K must be at most --items={args.items}")
    if args.paper_code and not (pathlib.Path(args.paper_code) / "src" / "policy").is_dir():
        parser.error(f"--paper-code: {args.paper_code} is not a checkout of the released code (no src/policy)")
    torch.set_num_threads(1)
    torch._logging.set_logs(dynamo=logging.ERROR, inductor=logging.ERROR)
    configs = args.configs
    device = torch.device(args.device)
    paper = str(pathlib.Path(args.paper_code).resolve()) if args.paper_code else None
    variants = [v for v in VARIANTS if not (v == "compiled" and args.no_compile or v == "paper code" and not paper)]
    large_variants = [v for v in variants if v != "paper code"]
    large = args.large_items if args.large else []
    total = len(configs) * (_count(args.estimators, variants) + len(large) * _count(args.estimators, large_variants)
                            + (2 if args.exact else 0))
    cells: list[Cell] = []
    extra = None
    with tqdm(total=total, unit="cell") as bar:
        for k, m in configs:
            cells += measure(dense_problem(args.batch, args.items, k, m, device, args.scale), args.estimators, variants,
                             args.reps, args.warmup, paper, bar)
        for n in large:
            for k, m in configs:
                cells += measure(embedding_problem(args.batch, n, k, m, args.dim, device, args.scale), args.estimators,
                                 large_variants, args.large_reps, 1, None, bar)
        if args.exact:  # last, so that no other cell runs after an exact call
            k, m = max(configs)
            bar.set_description(f"CA-PG-SwR around one exact call, K={k} M={m}")
            extra = after_exact(dense_problem(args.batch, args.items, k, m, device, args.scale), args.reps,
                                args.warmup)
            bares = {(c.K, c.M): c for c in cells if (c.N, c.estimator) == (args.items, "bare")}
            for k, m in configs:
                cells += measure(dense_problem(args.batch, args.items, k, m, device, args.scale), ["capg_exact"],
                                 ["checks", "no checks"], args.exact_reps, 1, None, bar, bare=bares[(k, m)])
    table = markdown(cells, extra)
    print(table)
    print("allocator settings:", allocator())
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"argv": list(sys.argv[1:] if argv is None else argv), "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "threads": torch.get_num_threads(),
            "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "batch": args.batch, "shown": NUM_SHOWN, "dim": args.dim, "scale": args.scale,
            "paper_code": paper is not None, "allocator": allocator()}
    result = {"meta": meta, "cells": [dataclasses.asdict(c) for c in cells], "after_exact": extra}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in dataclasses.fields(Cell)])
        writer.writeheader()
        writer.writerows(result["cells"])
    plot(cells, out / "ratios.png")
    print(f"\nwritten: {out / 'results.json'}, {out / 'results.csv'}, {out / 'ratios.png'}")
    return result


if __name__ == "__main__":
    main()
