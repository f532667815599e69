"""This checkout's losses against an earlier version's, in ONE process, call for call:

    OMP_NUM_THREADS=1 python benchmarks/loss_cost_ab.py --old /path/to/earlier/checkout --out runs/ab

The earlier checkout's ``capg_rec`` package is copied to a temporary folder as ``capg_rec_old`` (its
imports renamed), so both versions run side by side on the same tensors, alternating call by call:
separate processes differ by up to 3x on this kind of machine (the allocator's state, where the
large buffers land), which swamps a 5% comparison. Forward+backward from a logits leaf, B=128,
N=1000, L=1, one thread, the median of ``--reps`` calls each, timed in CPU time (``time.process_time``: other
processes' load on a shared machine does not enter it) (a sixth for mean-field and plug-in at
K=200, M=5, slow before). It uses only the API both versions share (``swr`` was the earlier name of
``with_replacement``). Logits are standard normal, or ``--logit-scale`` times that (a confident policy).
Writes ``ab.json`` and ``ab.csv`` (old ms, new ms, new/old) to ``--out``.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

import capg_rec
from capg_rec._checks import positive_int
from capg_rec.train.report import write_csv, write_json

CELLS = [(10, 1), (50, 1), (20, 2), (200, 5)]


def import_renamed(checkout: Path, alias: str = "capg_rec_old") -> ModuleType:
    """The ``capg_rec`` package of ``checkout``, importable next to this one as ``alias`` (from a temporary copy,
    removed when the process exits: some modules import others lazily)."""
    folder = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    shutil.copytree(checkout / "capg_rec", folder / alias)
    for path in (folder / alias).rglob("*.py"):
        path.write_text(re.sub(r"\bcapg_rec\b", alias, path.read_text()))
    sys.path.insert(0, str(folder))
    return importlib.import_module(alias)


def losses(module: ModuleType) -> dict[str, Callable[[int, bool], torch.nn.Module]]:
    swr = "with_replacement" if hasattr(module, "inclusion_methods") else "swr"
    return {
        "vpg": lambda k, v: module.VPGLoss(k, validate_args=v),
        "vpg_swr": lambda k, v: module.VPGLoss(k, with_replacement=True, validate_args=v),
        "capg_mean_field": lambda k, v: module.CAPGLoss(k, method="mean_field", validate_args=v),
        "capg_plugin": lambda k, v: module.CAPGLoss(k, method="plugin", validate_args=v),
        "capg_swr": lambda k, v: module.CAPGLoss(k, method=swr, validate_args=v),
    }


def compare(old: ModuleType, reps: int, scale: float = 1.0) -> list[dict]:
    torch.set_num_threads(1)
    new_losses, old_losses = losses(capg_rec), losses(old)
    rows = []
    for k, m in CELLS:
        g = torch.Generator().manual_seed(0)
        logits = (scale * torch.randn(128, m, 1000, generator=g)).requires_grad_()
        cand = capg_rec.sample_candidates(logits.detach(), k, generator=g)
        chosen, rewards = cand[:, :1], torch.rand(128, 1)
        for name in new_losses:
            for checks in (True, False):
                fns = {"old": old_losses[name](k, checks), "new": new_losses[name](k, checks)}
                slow = name in ("capg_mean_field", "capg_plugin") and k == 200
                n = max(7, reps // 6) if slow else reps
                times: dict[str, list[float]] = {"old": [], "new": []}
                for who in ("old", "new", "old", "new"):  # warm-up
                    fns[who](logits, cand, chosen, rewards).backward()
                for i in range(n):
                    for who in ("old", "new") if i % 2 else ("new", "old"):
                        start = time.process_time()
                        fns[who](logits, cand, chosen, rewards).backward()
                        times[who].append(time.process_time() - start)
                a, b = (statistics.median(times[w]) * 1e3 for w in ("old", "new"))
                rows.append({"K": k, "M": m, "loss": name, "checks": checks, "old_ms": a, "new_ms": b,
                             "new_over_old": b / a})
                print(f"{k:4d} {m:2d} {name:16s} {'checks' if checks else 'no checks':9s} {a:9.3f} {b:9.3f} "
                      f"{b / a:6.2f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].rstrip(":") + ".")
    parser.add_argument("--old", type=Path, required=True, help="an earlier checkout of this repository")
    parser.add_argument("--reps", type=positive_int, default=60)
    parser.add_argument("--logit-scale", type=float, default=1.0,
                        help="logits are this times standard normal (5: a confident policy, as after training)")
    parser.add_argument("--out", type=Path, default=Path("runs/ab"))
    args = parser.parse_args()
    if not (args.old / "capg_rec" / "__init__.py").is_file():
        parser.error(f"--old: {args.old} holds no capg_rec package (a checkout of this repository)")
    print(f"{'K':>4s} {'M':>2s} {'loss':16s} {'':9s} {'old ms':>9s} {'new ms':>9s} {'new/old':>6s}")
    rows = compare(import_renamed(args.old), args.reps, args.logit_scale)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "ab.json", rows)
    write_csv(args.out / "ab.csv", rows)


if __name__ == "__main__":
    main()
