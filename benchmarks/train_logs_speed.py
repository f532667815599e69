"""Rows per second of ``capg-rec train --logs``'s training steps, next to the Parquet reader's rate on the same logs.

Uses the logs at ``--logs`` (their K and L; ``--rows``, ``-K`` and ``-L`` are not used), or else writes ``--rows``
rows of K candidates and L shown items to a file of its own in OUT for the run and deletes it after (``capg-rec log``'s
generator: a fresh ESR on the synthetic problem at τ = 2, ε = 0.05). Times ``--steps`` steps of
:class:`~capg_rec.train.logged.LogTrainer` (read, forward, off-policy loss, backward, Adagrad; no evaluation) at
``--batch-size`` rows, then one read of the same rows by :class:`~capg_rec.logs.LoggedImpressions` through a
DataLoader with ``--workers`` workers, in wall-clock and CPU seconds (a shared machine's wall clock depends on its
load, recorded as ``load_average``).
Writes ``train_logs_speed.json`` to ``--out``.

    OMP_NUM_THREADS=1 python benchmarks/train_logs_speed.py --rows 100000 -K 50 -L 5 --out runs/train_logs_speed
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from capg_rec.logs import LoggedImpressions
from capg_rec.logs.cli import generate_logs
from capg_rec.sim.synthetic import synthetic_env
from capg_rec.train.logged import LogTrainConfig, LogTrainer
from capg_rec.train.model import TwoTowerMoE


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--logs", default=None, help="a log file of the synthetic problem (default: written for the run)")
    p.add_argument("--rows", type=int, default=100_000, help="rows to write (without --logs)")
    p.add_argument("-K", type=int, default=50)
    p.add_argument("-L", type=int, default=5)
    p.add_argument("--estimator", default="capg")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=100, help="training steps to time (at most one epoch)")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--out", default="runs/train_logs_speed")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.logs is not None:
        return _measure(p, args, out, Path(args.logs))
    logs = out / f"logs-{os.getpid()}.parquet"  # generated data is not kept, and no file of the user's is touched
    try:
        env = synthetic_env()
        model = TwoTowerMoE(env.num_users, env.num_items, generator=torch.Generator().manual_seed(0))
        generate_logs(env, model, logs, num_interactions=args.rows, num_candidates=args.K, num_outputs=args.L,
                      temperature=2.0, epsilon=0.05, batch_size=8192)
        result = _measure(p, args, out, logs)
    finally:
        logs.unlink(missing_ok=True)
    return result


def _measure(p: argparse.ArgumentParser, args: argparse.Namespace, out: Path, logs: Path) -> dict:
    """Times the trainer and the reader on ``logs``; writes and returns the result."""
    env = synthetic_env()
    config = LogTrainConfig((logs,), estimator=args.estimator, batch_size=args.batch_size, workers=args.workers,
                            holdout=0.0)
    trainer = LogTrainer(config, env)
    steps = min(args.steps, trainer.num_steps)
    if steps < 2:
        p.error(f"--steps: at least 2 steps are timed (the logs give {trainer.num_steps} per epoch)")
    trainer.step()  # the first step starts the DataLoader (and its workers)
    wall, cpu = _clock()
    for _ in range(steps - 1):
        trainer.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rows = (steps - 1) * args.batch_size
    reader = LoggedImpressions(logs, args.batch_size)
    read_rows, (read_wall, read_cpu) = 0, _clock()
    for batch in torch.utils.data.DataLoader(reader, batch_size=None, num_workers=args.workers):
        read_rows += len(batch.context)
        if read_rows >= rows:
            break
    read_wall, read_cpu = time.perf_counter() - read_wall, time.process_time() - read_cpu
    result = {"logs": str(logs), "K": trainer.config.num_candidates, "L": trainer.config.num_outputs,
              "estimator": args.estimator, "batch_size": args.batch_size, "workers": args.workers,
              "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
              "trainer": {"rows": rows, "seconds": wall, "cpu_seconds": cpu, "rows_per_second": rows / wall,
                          "rows_per_cpu_second": rows / cpu},
              "reader": {"rows": read_rows, "seconds": read_wall, "cpu_seconds": read_cpu,
                         "rows_per_second": read_rows / read_wall}}
    if args.workers == 0:
        result["reader"]["rows_per_cpu_second"] = read_rows / read_cpu
    result["reader_over_trainer"] = result["reader"]["rows_per_second"] / result["trainer"]["rows_per_second"]
    if args.logs is None:
        result["logs"] = f"{args.rows} rows written for the run (deleted)"
    (out / "train_logs_speed.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
