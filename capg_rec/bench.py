"""``capg-rec bench``: what each estimator costs and how accurate each inclusion method is.

Two tables, measured in one run:

(a) cost: forward+backward time and extra peak memory of each estimator's loss, as ratios to
    "bare scoring" (the chunked catalog logits + logsumexp, forward and backward) on the same
    embeddings. Every case runs in a fresh process so that its peak memory is its own; its time is CPU time
    (one thread: another process's load on a shared machine does not enter it), its memory the peak resident
    memory of its timed steps beyond what the process held before them (the kernel's high-water mark, reset
    after the warm-up; on Linux only: elsewhere none is given). A memory ratio to a bare peak below 8 MiB is not
    given: that is page noise.
(b) accuracy: mean relative error of every method's inclusion probabilities against a
    Monte-Carlo estimate and against the exact method (N = 1000 standard-normal logits, as in
    the paper's table). The with-replacement method gives an expected count ``c``, not a probability: its rows
    compare ``1 - (1 - c/K)^K``, the chance of being drawn at least once in K draws with replacement.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from capg_rec._checks import positive_float, positive_int

ESTIMATORS = ("bare", "vpg", "vpg_swr", "capg_exact", "capg_mean_field", "capg_plugin", "capg_swr")


def _loss(name: str, k: int):
    from capg_rec import CAPGLoss, VPGLoss

    return {"vpg": lambda: VPGLoss(k), "vpg_swr": lambda: VPGLoss(k, with_replacement=True),
            "capg_exact": lambda: CAPGLoss(k, method="exact"),
            "capg_mean_field": lambda: CAPGLoss(k, method="mean_field"),
            "capg_plugin": lambda: CAPGLoss(k, method="plugin"),
            "capg_swr": lambda: CAPGLoss(k, method="with_replacement")}[name]()


_MEMORY_FLOOR_MIB = 8.0
"""Bare peaks below this are page noise: no memory ratio to them."""


def _status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _reset_peak() -> float | None:
    """Resets the kernel's resident high-water mark to the current resident memory → that memory (MiB), or None
    where it cannot be reset (not Linux): then no peak is measured."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_mib("VmRSS")
    except OSError:
        return None


def run_case(name: str, batch: int, num_items: int, k: int, experts: int, dim: int, reps: int) -> dict:
    """Time one estimator's forward+backward in this process → ``{"seconds", "peak_mib"}``."""
    from capg_rec import EmbeddingCatalog, sample_candidates

    torch.manual_seed(0)
    user = (torch.randn(batch, experts, dim) / dim**0.5).requires_grad_()
    item = (torch.randn(num_items, experts, dim)).requires_grad_()
    catalog = EmbeddingCatalog(user, item)
    cand = sample_candidates(catalog, k, generator=torch.Generator().manual_seed(0))
    chosen, rewards = cand[:, :1], torch.rand(batch, 1)

    def step() -> None:
        cat = EmbeddingCatalog(user, item)
        loss = cat.log_normalizer().sum() if name == "bare" else _loss(name, k)(cat, cand, chosen, rewards)
        loss.backward()
        user.grad = item.grad = None

    step()  # warm-up
    base = _reset_peak()  # None: not measured (the lifetime peak would hold the warm-up's, and the setup's)
    times = []
    for _ in range(reps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    peak = None if base is None else max(_status_mib("VmHWM") - base, 0.0)
    return {"seconds": statistics.median(times), "peak_mib": peak}


def _limit_memory(gib: float):
    """A ``preexec_fn`` capping the case's address space, so an oversized case fails cleanly."""
    limit = int(gib * 2**30)
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def cost_table(sizes: list[int], configs: list[tuple[int, int]], batch: int, dim: int, reps: int,
               case_timeout: float, memory_limit_gib: float) -> list[dict]:
    rows = []
    for num_items in sizes:
        for k, experts in configs:
            results = {}
            for name in ESTIMATORS:
                cmd = [sys.executable, "-m", "capg_rec.bench", "--case", name, "--batch", str(batch),
                       "--items", str(num_items), "--k", str(k), "--experts", str(experts), "--dim", str(dim),
                       "--reps", str(reps)]
                try:
                    out = subprocess.run(cmd, capture_output=True, text=True, timeout=case_timeout,
                                         preexec_fn=_limit_memory(memory_limit_gib))
                except subprocess.TimeoutExpired:
                    results[name] = {"error": f"not finished within {case_timeout:.0f} s"}
                    continue
                if out.returncode != 0:
                    lines = out.stderr.strip().splitlines()
                    results[name] = {"error": lines[-1] if lines else f"exit status {out.returncode}"}
                else:
                    results[name] = json.loads(out.stdout.strip().splitlines()[-1])
            bare = results["bare"]
            for name in ESTIMATORS:
                r = results[name]
                row = {"N": num_items, "K": k, "M": experts, "estimator": name}
                if "error" in r or "error" in bare:  # no ratio without the bare reference
                    row["error"] = r.get("error", f"bare: {bare.get('error')}")
                else:
                    row.update(seconds=r["seconds"], time_ratio=r["seconds"] / bare["seconds"], peak_mib=r["peak_mib"],
                               memory_ratio=r["peak_mib"] / bare["peak_mib"] if r["peak_mib"] is not None
                               and bare["peak_mib"] is not None and bare["peak_mib"] >= _MEMORY_FLOOR_MIB else None)
                rows.append(row)
                print(_format_cost(row), flush=True)
    return rows


def _format_cost(row: dict) -> str:
    head = f"N={row['N']:>8} K={row['K']:>3} M={row['M']}  {row['estimator']:<16}"
    if "error" in row:
        return f"{head} ERROR {row['error']}"
    memory = "     — memory" if row["memory_ratio"] is None else f"x{row['memory_ratio']:5.2f} memory"
    peak = "       —" if row["peak_mib"] is None else f"{row['peak_mib']:8.1f}"
    return f"{head} {row['seconds'] * 1e3:9.1f} ms  x{row['time_ratio']:5.2f} time   {peak} MiB  {memory}"


def _mean_or_none(x: np.ndarray) -> float | None:
    """The mean, or None (JSON null) where no item was drawn often enough to compare (too few draws)."""
    return float(np.mean(x)) if x.size else None


def accuracy_table(num_samples: int, seed: int = 0) -> list[dict]:
    """Mean relative error of each method at N = 1000, standard-normal logits: against a
    Monte-Carlo estimate (items seen ≥ 100 times) and against the exact method (all items)."""
    from capg_rec import Exact, MeanField, PlugIn, WithReplacement, inclusion_log_prob, sample_candidates

    rows = []
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 1000, generator=gen, dtype=torch.float64)
    items = torch.arange(1000).unsqueeze(0)
    for tau in (1.0, 0.5, 0.2):
        for k in (10, 20, 50, 100):
            counts = torch.zeros(1000, dtype=torch.float64)
            for start in range(0, num_samples, 5000):
                n = min(5000, num_samples - start)
                draws = sample_candidates((logits / tau).expand(n, -1), k, generator=gen)
                counts += torch.bincount(draws.reshape(-1), minlength=1000)
            p_mc = (counts / num_samples).numpy()
            seen = p_mc * num_samples >= 100
            row = {"tau": tau, "K": k, "mc_items": int(seen.sum()),
                   "mc_se": _mean_or_none(np.sqrt((1 - p_mc[seen]) / (p_mc[seen] * num_samples)))}
            probs = {}
            methods = {"exact": Exact(), "mean_field": MeanField(), "plugin": PlugIn(),
                       "with_replacement": WithReplacement()}  # enumeration is for few draws only
            for name, method in methods.items():
                p = inclusion_log_prob(logits, items, k, temperature=tau, method=method).exp()[0]
                if not method.is_probability:  # E[count] → P(drawn at least once)
                    p = 1 - (1 - p / k) ** k
                probs[name] = p.numpy()
            for name, p in probs.items():
                row[f"{name}_vs_mc"] = _mean_or_none(np.abs(p[seen] - p_mc[seen]) / p_mc[seen])
                if name != "exact":
                    row[f"{name}_vs_exact"] = float(np.mean(np.abs(p - probs["exact"]) / probs["exact"]))
            rows.append(row)
            print("  ".join(f"{key}={val:.2g}" if isinstance(val, float) else f"{key}={val}"
                            for key, val in row.items()), flush=True)
    return rows


_COST_CASES = ((10, 1), (200, 5))
"""The cost table's (K, M)."""


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="cost and accuracy tables of every estimator",
                              description="The cost of every estimator's forward+backward as a ratio to bare scoring, "
                                          "and the inclusion methods' accuracy against the exact method (and a "
                                          "Monte-Carlo estimate), written as one JSON file (--out).")
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[1_000, 100_000, 1_000_000],
                   help=f"catalog sizes N of the cost table (each at least its largest K, {_COST_CASES[-1][0]}; "
                        "default: 1000 100000 1000000)")
    p.add_argument("--batch", type=positive_int, default=128, help="contexts B (default: 128)")
    p.add_argument("--dim", type=positive_int, default=16, help="embedding width D (default: 16)")
    p.add_argument("--reps", type=positive_int, default=3, help="timed calls per case, their median kept (default: 3)")
    p.add_argument("--case-timeout", type=positive_float, default=1800.0,
                   help="seconds allowed per (estimator, size) case")
    p.add_argument("--memory-limit", type=positive_float, default=16.0, help="GiB of address space allowed per case")
    p.add_argument("--mc-samples", type=positive_int, default=100_000,
                   help="Monte-Carlo draws of the accuracy table (default: 100000)")
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--out", default="runs/bench.json",
                   help="where the tables are written as JSON (default: runs/bench.json)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> None:
    import pathlib

    out = pathlib.Path(args.out)
    problem = None  # found before the tables are computed, not after
    largest = max(k for k, _ in _COST_CASES)
    if args.skip_cost and args.skip_accuracy:
        problem = "--skip-cost and --skip-accuracy together leave nothing to run"
    elif not args.skip_cost and min(args.sizes) < largest:
        problem = f"--sizes must be at least the cost table's largest K = {largest}, got {min(args.sizes)}"
    elif not args.skip_cost and len(set(args.sizes)) < len(args.sizes):
        problem = f"--sizes must not repeat a value, got {args.sizes}"
    elif out.is_dir():
        problem = f"--out must be a file path, got the folder {out}"
    else:
        try:  # its folder, made now: a file on the way is an error before the work
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            problem = f"--out {out}: its folder cannot be made ({err.strerror or err})"
    if problem is not None:
        print(f"capg-rec bench: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    result: dict = {"settings": {}}  # of the tables that run
    if not args.skip_cost:
        result["settings"]["cost"] = {"sizes": args.sizes, "batch": args.batch, "dim": args.dim, "reps": args.reps,
                                      "case_timeout": args.case_timeout, "memory_limit_gib": args.memory_limit,
                                      "seconds": "median CPU seconds of a forward+backward"}
        print("(a) cost: forward+backward of each loss, ratio to bare scoring (chunked logits + logsumexp)")
        result["cost"] = cost_table(args.sizes, list(_COST_CASES), args.batch, args.dim, args.reps,
                                    args.case_timeout, args.memory_limit)
    if not args.skip_accuracy:
        result["settings"]["accuracy"] = {"mc_samples": args.mc_samples}
        print("(b) accuracy: mean relative error of inclusion probabilities vs Monte-Carlo "
              f"({args.mc_samples} draws; mc_se is its own relative standard error) and vs exact, N=1000")
        result["accuracy"] = accuracy_table(args.mc_samples)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"tables written to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=ESTIMATORS, required=True)
    for flag in ("batch", "items", "k", "experts", "dim", "reps"):
        parser.add_argument(f"--{flag}", type=int, required=True)
    a = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(run_case(a.case, a.batch, a.items, a.k, a.experts, a.dim, a.reps)))
