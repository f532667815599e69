"""Off-policy data: serving-time propensity logging, a Parquet log format, its writer and streaming reader.

* :func:`log_propensities` / :func:`explore_candidates`: what a serving ESR stores for each request,
  and the exploration sampler (tempered PL, ε-uniform mixture) those propensities describe,
* :data:`LOG_SCHEMA`, :class:`LogWriter`, :func:`write_logs`: the Parquet format, one row per request,
* :class:`LoggedImpressions`: a streaming ``IterableDataset`` of :class:`LoggedBatch` tensors.
"""

from capg_rec.logs.propensity import LoggedPropensities, explore_candidates, log_propensities

__all__ = ["log_propensities", "explore_candidates", "LoggedPropensities"]
