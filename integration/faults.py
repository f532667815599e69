"""Faults on one rank end in errors on every rank, within the process group's timeout, never in a hang.

Run with ``CAPG_COLLECTIVE_TIMEOUT_S=T torchrun --nproc_per_node=2 integration/faults.py --out DIR``
(a small T, e.g. 5). After a normal training step on both ranks:

* a skipping rank: the last rank's rewards are NaN, so the loss's input check fails there; every
  rank must raise the same ``ValueError`` (the checks are collective), skip the batch, and the next
  step must then run on both ranks, in step;
* a frozen rank: the last rank sleeps for 3 T before its forward. The other ranks must fail in the
  retriever's own collectives after about T (the catalog's process group inherits the world
  group's timeout; it used to have the 30-minute default), and the sleeper must fail too when it
  wakes, its partners gone.

With ``--kill``, after the warm-up step the last rank exits instead (a killed process: no error,
no goodbye); the others must fail in their next step within the timeout.

Each rank writes ``DIR/faults_rank{r}.json``: what each phase raised and how long it took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import _harness as h
from capg_rec import CAPGLoss, sample_candidates

SETUP = h.Setup(num_items=1_000, num_experts=1, dim=4)
K, SHOWN, BATCH = 5, 2, 3


def step(model, users: torch.Tensor, rewards_fill: float = 1.0) -> None:
    catalog = model(model.module.with_catalog(h.user_batch(users)))
    candidates = sample_candidates(catalog, K, generator=torch.Generator().manual_seed(0))
    rewards = torch.full((users.shape[0], SHOWN), rewards_fill, device=users.device)
    CAPGLoss(K)(catalog, candidates, candidates[:, :SHOWN], rewards).backward()


def attempt(call) -> dict[str, object]:
    start = time.monotonic()
    try:
        call()
        outcome = {"raised": None}
    except Exception as err:  # noqa: BLE001 - what it raised is the result
        outcome = {"raised": type(err).__name__, "message": str(err)[:300]}
    return {**outcome, "seconds": round(time.monotonic() - start, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill", action="store_true", help="the last rank exits after the warm-up step")
    args = parser.parse_args()
    rank, world = h.init()
    timeout = h.env_int("CAPG_COLLECTIVE_TIMEOUT_S", 300)
    last = rank == world - 1
    model = h.shard(SETUP, lr=0.1)
    users = torch.arange(BATCH, device=h.device()) + rank * BATCH
    report = {"timeout_s": timeout, "warm_up": attempt(lambda: step(model, users))}
    if args.kill:
        if last:
            os._exit(0)  # exit 0: torchrun then leaves the survivors to finish instead of terminating them
        report["killed_rank"] = attempt(lambda: step(model, users))
        return _finish(args.out, rank, report)
    report["skipping_rank"] = attempt(lambda: step(model, users, float("nan") if last else 1.0))
    report["after_skip"] = attempt(lambda: step(model, users))
    if last:
        time.sleep(3 * timeout)
    report["frozen_rank"] = attempt(lambda: step(model, users))
    return _finish(args.out, rank, report)


def _finish(out: Path, rank: int, report: dict) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"faults_rank{rank}.json").write_text(json.dumps(report, indent=1))
    sys.stdout.flush()
    os._exit(0)  # the group is broken by design: no teardown collective could complete


if __name__ == "__main__":
    main()
