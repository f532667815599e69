"""Small valid logs for tests: ε-explored draws from random logits with their logged propensities."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import torch

from capg_rec.logs import LoggedBatch, LogWriter, explore_candidates, log_propensities


def write_logs(path: Path, sizes: list[int], *, num_candidates: int = 4, num_shown: int = 2, num_items: int = 20,
               num_users: int = 10, extra: dict | None = None, method: str = "mean_field") -> Path:
    """A log of one row group per entry of ``sizes`` (rows each), contexts below ``num_users``."""
    with LogWriter(path, num_candidates=num_candidates, num_shown=num_shown, num_items=num_items, extra=extra or {},
                   method=method) as writer:
        start = 0
        for seed, rows in enumerate(sizes):
            g = torch.Generator().manual_seed(seed)
            logits = torch.randn(rows, num_items, generator=g)
            candidates = explore_candidates(logits, num_candidates, epsilon=0.2, generator=g)
            shown = candidates[:, :num_shown]
            writer.write(LoggedBatch(torch.randint(num_users, (rows,), generator=g), candidates, shown,
                                     torch.rand(rows, num_shown, generator=g).round(),
                                     *log_propensities(logits, candidates, shown, epsilon=0.2),
                                     request_id=torch.arange(start, start + rows)))
            start += rows
    return path


def set_metadata(path: Path, **changes: object) -> None:
    """Rewrite a log's capg_rec metadata with ``changes``."""
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"capg_rec"])
    meta.update(changes)
    pq.write_table(table.replace_schema_metadata({b"capg_rec": json.dumps(meta).encode()}), path)
