"""Throughput of the Parquet log reader against what a trainer consumes.

Writes a synthetic log (``--rows`` rows, K candidates, L shown, valid propensities), then reads it with
:class:`capg_rec.logs.LoggedImpressions` at ``--batch-size`` rows per batch through a DataLoader with
``--workers`` workers, with the value checks on and off, and times a CA-PG training step on batches
of the same shape (a two-tower ESR of the synthetic problem's size, mean-field CA-PG, Adagrad) as the
trainer's consumption rate. Writes ``reader_speed.json`` to ``--out``.

Rates are rows per second of wall-clock time and, since a shared machine's wall clock depends on its
load (recorded as ``load_average``), also of CPU time: the reading worker's (the DataLoader worker
processes', or this process's with ``--workers 0``), the consuming process's, and the trainer step's. The
wall-clock rate is given over the whole pass and, as ``sustained``, from the first batch on: a pass starts its
workers (a fork, then their first pages and first row group), which a DataLoader with ``persistent_workers=True``
does once for all epochs.

    OMP_NUM_THREADS=1 python benchmarks/log_reader_speed.py --rows 1000000 --out runs/log_reader_speed
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from capg_rec import CAPGLoss
from capg_rec.logs import LoggedBatch, LoggedImpressions, LogWriter
from capg_rec.train.model import TwoTowerMoE


def write_synthetic(path: Path, rows: int, k: int, length: int, num_items: int, num_users: int,
                    row_group_size: int, seed: int = 0) -> None:
    """A valid log of ``rows`` rows: consecutive candidate ids from a random start (distinct), the
    first L shown, log-propensities in (-10, 0)."""
    g = torch.Generator().manual_seed(seed)
    with LogWriter(path, num_candidates=k, num_shown=length, num_items=num_items, policy_version="bench",
                   validate_args=False) as writer:
        for start in tqdm(range(0, rows, row_group_size), desc="writing", unit="row groups"):
            n = min(row_group_size, rows - start)
            first = torch.randint(num_items, (n, 1), generator=g)
            candidates = (first + torch.arange(k)) % num_items
            writer.write(LoggedBatch(
                torch.randint(num_users, (n,), generator=g), candidates, candidates[:, :length],
                torch.randn(n, length, generator=g), -10 * torch.rand(n, length, generator=g, dtype=torch.float64),
                -10 * torch.rand(n, length, generator=g, dtype=torch.float64),
                -100 * torch.rand(n, generator=g, dtype=torch.float64)))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def read_rate(path: Path, batch_size: int, workers: int, validate: bool) -> dict:
    """Rows per second of a full pass (DataLoader with ``workers`` workers; 0: in this process), per
    second of wall clock, of the readers' CPU time and of the consuming process's CPU time."""
    data = LoggedImpressions(path, batch_size, validate_args=validate)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers)
    wall, cpu, children, rows = time.perf_counter(), time.process_time(), _children_cpu(), 0
    first = None  # (time, rows) at the first batch
    for batch in tqdm(loader, desc=f"reading ({'checked' if validate else 'unchecked'}, {workers} workers)",
                      unit="batches", total=-(-data.num_rows // batch_size)):
        rows += len(batch.context)
        first = first or (time.perf_counter(), rows)
    end = time.perf_counter()
    del loader  # its workers exit and are waited for: their CPU time is in RUSAGE_CHILDREN
    wall, cpu, children = end - wall, time.process_time() - cpu, _children_cpu() - children
    reader_cpu = children if workers else cpu
    sustained = (rows - first[1]) / (end - first[0]) if first is not None and rows > first[1] else None
    return {"rows": rows, "rows_per_second": rows / wall, "rows_per_second_sustained": sustained,
            "seconds_to_first_batch": None if first is None else first[0] - (end - wall),
            "rows_per_reader_cpu_second": rows / reader_cpu, "rows_per_consumer_cpu_second": rows / cpu}


def trainer_rate(batch_size: int, k: int, length: int, num_items: int, num_users: int, steps: int) -> dict:
    """Rows per second (wall clock and CPU time) of a CA-PG step (forward, backward, Adagrad) on
    logged-shape batches."""
    g = torch.Generator().manual_seed(1)
    model = TwoTowerMoE(num_users, num_items, generator=g)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    loss_fn = CAPGLoss(k, validate_args=False)
    users = torch.randint(num_users, (batch_size,), generator=g)
    candidates = (torch.randint(num_items, (batch_size, 1), generator=g) + torch.arange(k)) % num_items
    shown, rewards = candidates[:, :length], torch.randn(batch_size, length, generator=g)

    def step() -> None:
        loss = loss_fn(model(users), candidates, shown, rewards)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    step()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"rows_per_second": steps * batch_size / wall, "rows_per_cpu_second": steps * batch_size / cpu}


def _ratio(rate: float | None, trainer: float) -> float | None:
    return None if rate is None else rate / trainer


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("-K", type=int, default=50)
    p.add_argument("-L", type=int, default=5)
    p.add_argument("--num-items", type=int, default=1000)
    p.add_argument("--num-users", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--row-group-size", type=int, default=65_536)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--trainer-steps", type=int, default=20)
    p.add_argument("--out", default="runs/log_reader_speed")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "synthetic_logs.parquet"
    write_synthetic(path, args.rows, args.K, args.L, args.num_items, args.num_users, args.row_group_size)
    checked = read_rate(path, args.batch_size, args.workers, True)
    unchecked = read_rate(path, args.batch_size, args.workers, False)
    trainer = trainer_rate(args.batch_size, args.K, args.L, args.num_items, args.num_users, args.trainer_steps)
    result = {"rows": checked["rows"], "K": args.K, "L": args.L, "batch_size": args.batch_size,
              "workers": args.workers, "row_group_size": args.row_group_size, "file_bytes": path.stat().st_size,
              "reader_checked": checked, "reader_unchecked": unchecked, "trainer": trainer,
              "trainer_step": f"CA-PG (mean-field) step, TwoTowerMoE {args.num_users}x{args.num_items}, D=10",
              "ratio_wall_checked": checked["rows_per_second"] / trainer["rows_per_second"],
              "ratio_wall_unchecked": unchecked["rows_per_second"] / trainer["rows_per_second"],
              "ratio_sustained_checked": _ratio(checked["rows_per_second_sustained"], trainer["rows_per_second"]),
              "ratio_sustained_unchecked": _ratio(unchecked["rows_per_second_sustained"], trainer["rows_per_second"]),
              "ratio_cpu_checked": checked["rows_per_reader_cpu_second"] / trainer["rows_per_cpu_second"],
              "ratio_cpu_unchecked": unchecked["rows_per_reader_cpu_second"] / trainer["rows_per_cpu_second"],
              "load_average": os.getloadavg(), "cpu_count": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine()}
    (out / "reader_speed.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    path.unlink()  # generated data is not kept
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
