"""Off-policy data: serving-time propensity logging, a Parquet log format, its writer and streaming reader.

* :func:`log_propensities` / :func:`explore_candidates`: what a serving ESR stores for each request,
  and the exploration sampler (tempered PL, ε-uniform mixture) those propensities describe,
* :data:`LOG_SCHEMA`, :class:`LogWriter`, :func:`write_logs`: the Parquet format, one row per request,
* :class:`LoggedImpressions`: a streaming ``IterableDataset`` of :class:`LoggedBatch` tensors.

Parquet needs ``pyarrow`` (``pip install "capg-rec[logs]"``).
"""

from __future__ import annotations

import importlib
from typing import Any

from capg_rec.logs.propensity import LoggedPropensities, explore_candidates, log_propensities

_NEEDS_PYARROW = {"LogWriter": "parquet", "write_logs": "parquet", "LoggedImpressions": "parquet",
                  "LOG_SCHEMA": "schema", "SCHEMA_VERSION": "schema", "LogMetadata": "schema", "LoggedBatch": "schema"}

__all__ = ["log_propensities", "explore_candidates", "LoggedPropensities", "LogWriter", "write_logs",
           "LoggedImpressions", "LoggedBatch", "LOG_SCHEMA", "SCHEMA_VERSION", "LogMetadata"]


def __getattr__(name: str) -> Any:
    """The Parquet names, imported on first use (the propensities work without pyarrow)."""
    if name not in _NEEDS_PYARROW:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"capg_rec.logs.{_NEEDS_PYARROW[name]}")
    except ImportError as err:
        raise ImportError(f"capg_rec.logs.{name} needs pyarrow: pip install 'capg-rec[logs]'") from err
    return getattr(module, name)
