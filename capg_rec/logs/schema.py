"""The off-policy log format: one Parquet row per request, and the tensors a batch of rows becomes.

Columns (:data:`LOG_SCHEMA`; every column but ``features`` is required, none may hold nulls):

=======================  ===================  ==================================================================
column                   Arrow type           content
=======================  ===================  ==================================================================
``request_id``           int64                the request's id (not checked; the writer numbers 0, 1, ... per file)
``context``              int64                the context key (e.g. the user id)
``features``             list<float32> [F]    optional: the context's features, F per row
``candidates``           list<int64> [K]      the K items the logging ESR drew, in draw order, distinct
``shown``                list<int64> [L]      the L items the later stage showed, in its order, ⊆ candidates
``rewards``              list<float32> [L]    the reward of each shown item
``log_inclusion``        list<float64> [L]    ``log π0(shown_l ∈ A^K | x)`` (≤ 0, finite)
``log_expected_count``   list<float64> [L]    ``log Σ_k π0_{m(k)}(shown_l)`` (≤ log K, finite)
``log_candidate_prob``   float64              ``log π0(A^K | x)`` of the ordered draw (≤ 0, finite)
``policy_version``       string               the logging policy's version
=======================  ===================  ==================================================================

The reader also takes the other Arrow layouts of these columns that data pipelines write: ``large_list``
or ``fixed_size_list``, list elements declared non-nullable, narrower integer and other float types (read
as the types above).

File-level metadata (:class:`LogMetadata`, stored as JSON under the schema metadata key ``capg_rec``):
the schema version, K, L, F (or null), the catalog size N the ids index (or null), the name of the
inclusion method behind ``log_inclusion`` and free-form ``extra`` fields (the generating environment,
temperature, ε, ...).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from capg_rec._json import plain
from capg_rec.logs import _handover

__all__ = ["LOG_SCHEMA", "SCHEMA_VERSION", "REQUIRED_COLUMNS", "TENSOR_COLUMNS", "LogMetadata", "LoggedBatch",
           "file_schema"]

SCHEMA_VERSION = 1
"""The version of :data:`LOG_SCHEMA` this capg_rec writes and reads."""

LOG_SCHEMA = pa.schema([
    pa.field("request_id", pa.int64(), nullable=False),
    pa.field("context", pa.int64(), nullable=False),
    pa.field("features", pa.list_(pa.float32())),
    pa.field("candidates", pa.list_(pa.int64()), nullable=False),
    pa.field("shown", pa.list_(pa.int64()), nullable=False),
    pa.field("rewards", pa.list_(pa.float32()), nullable=False),
    pa.field("log_inclusion", pa.list_(pa.float64()), nullable=False),
    pa.field("log_expected_count", pa.list_(pa.float64()), nullable=False),
    pa.field("log_candidate_prob", pa.float64(), nullable=False),
    pa.field("policy_version", pa.string(), nullable=False),
])
"""The full log schema (``features`` is optional: a file without features leaves the column out)."""

REQUIRED_COLUMNS = tuple(name for name in LOG_SCHEMA.names if name != "features")

TENSOR_COLUMNS = tuple(name for name in LOG_SCHEMA.names if name != "policy_version")
"""The columns that become tensors of a :class:`LoggedBatch`."""

_METADATA_KEY = b"capg_rec"


@dataclass(frozen=True)
class LogMetadata:
    """File-level facts of a log: K, L, F, the catalog size N, the inclusion method's name, ``extra``.

    Attributes:
        num_candidates: K, the logging ESR's draw size.
        num_shown: L ≤ K, the items the later stage showed.
        method: the name of the inclusion method behind ``log_inclusion``.
        num_items: N, the catalog size the ids index (default None: not recorded).
        num_features: F (default None: no ``features`` column).
        schema_version: default :data:`SCHEMA_VERSION`; a reader refuses another.
        extra: free-form JSON fields (the generating environment, temperature, ε, ...; default empty).

    Example:
        >>> meta = LogMetadata(num_candidates=10, num_shown=2, method="mean_field", num_items=1000)
        >>> LogMetadata.from_arrow(meta.to_arrow(), "logs.parquet") == meta   # stored in the file's schema metadata
        True
    """

    num_candidates: int
    num_shown: int
    method: str
    num_items: int | None = None
    num_features: int | None = None
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_arrow(self) -> dict[bytes, bytes]:
        return {_METADATA_KEY: json.dumps(plain(dataclasses.asdict(self))).encode()}

    @classmethod
    def from_arrow(cls, metadata: dict[bytes, bytes] | None, path: str) -> LogMetadata:
        """Read it back; ``ValueError`` naming ``path`` when it is missing, malformed or of another version."""
        if not metadata or _METADATA_KEY not in metadata:
            raise ValueError(f"log file {path}: no capg_rec metadata (K, L, method): not written by LogWriter")
        try:
            fields = json.loads(metadata[_METADATA_KEY])
            meta = cls(**fields)
        except (ValueError, TypeError) as err:
            raise ValueError(f"log file {path}: malformed capg_rec metadata ({err})") from err
        if meta.schema_version != SCHEMA_VERSION:
            raise ValueError(f"log file {path}: schema version {meta.schema_version}, this capg_rec reads "
                             f"version {SCHEMA_VERSION}")
        if not isinstance(meta.method, str) or not isinstance(meta.extra, dict):
            raise ValueError(f"log file {path}: metadata method must be a str and extra a dict, got "
                             f"{meta.method!r} and {type(meta.extra).__name__}")
        for name in ("num_candidates", "num_shown", "num_items", "num_features"):
            value = getattr(meta, name)
            if value is None and name in ("num_items", "num_features"):
                continue  # not recorded
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"log file {path}: metadata {name} must be an int >= 1, got {value!r}")
        # what LogWriter refuses: a reader trusting them would batch L shown items of K < L candidates
        if meta.num_shown > meta.num_candidates:
            raise ValueError(f"log file {path}: metadata num_shown must be <= num_candidates={meta.num_candidates} "
                             f"(the later stage shows some of the candidates), got {meta.num_shown}")
        if meta.num_items is not None and meta.num_items < meta.num_candidates:
            raise ValueError(f"log file {path}: metadata num_items must be >= num_candidates={meta.num_candidates} "
                             f"(K distinct candidates of the catalog), got {meta.num_items}")
        return meta


def file_schema(meta: LogMetadata) -> pa.Schema:
    """The schema of a file: :data:`LOG_SCHEMA` (without ``features`` when F is None) with ``meta``."""
    schema = LOG_SCHEMA if meta.num_features is not None else LOG_SCHEMA.remove(LOG_SCHEMA.get_field_index("features"))
    return schema.with_metadata(meta.to_arrow())


class LoggedBatch(NamedTuple):
    """A batch of B logged requests as tensors (what :class:`~capg_rec.logs.LoggedImpressions` yields
    and :class:`~capg_rec.logs.LogWriter` takes).

    Attributes:
        context: ``LongTensor[B]`` the context keys.
        candidates: ``LongTensor[B, K]``.
        shown: ``LongTensor[B, L]``.
        rewards: ``[B, L]`` float32.
        log_inclusion: ``[B, L]`` float64.
        log_expected_count: ``[B, L]`` float64.
        log_candidate_prob: ``[B]`` float64.
        features: ``[B, F]`` float32, or None.
        request_id: ``LongTensor[B]``, or None (the writer then numbers rows from 0 on).

    The log-propensities stay float64: ``log π0(A^K)`` reaches thousands of nats at K = 200, where
    float32 keeps only ~1e-4 of absolute accuracy, and an importance weight is the exponential of a
    difference of such numbers. A field the reader was told not to read is None.

    Shape:
        context, log_candidate_prob, request_id: ``[B]``; candidates: ``[B, K]``; shown, rewards, log_inclusion,
        log_expected_count: ``[B, L]``; features: ``[B, F]``.

    Example:
        >>> from capg_rec.logs import log_propensities
        >>> logits = torch.randn(4, 20, dtype=torch.float64)
        >>> candidates = capg_rec.sample_candidates(logits, 5)
        >>> shown = candidates[:, :2]
        >>> batch = LoggedBatch(torch.arange(4), candidates, shown, torch.rand(4, 2),
        ...                     *log_propensities(logits, candidates, shown))
        >>> batch.shown.shape, batch.log_candidate_prob.dtype, batch.features is None
        (torch.Size([4, 2]), torch.float64, True)
    """

    context: Tensor | None
    candidates: Tensor | None
    shown: Tensor | None
    rewards: Tensor | None
    log_inclusion: Tensor | None
    log_expected_count: Tensor | None
    log_candidate_prob: Tensor | None
    features: Tensor | None = None
    request_id: Tensor | None = None


IN_BAND_BYTES = 1 << 19
"""Batches up to this size go between processes in-band (see :func:`_reduce_for_processes`)."""

_NUMPY_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64,
                 torch.float32, torch.float16)


def _reduce_for_processes(batch: LoggedBatch) -> tuple:
    """How multiprocessing (a DataLoader worker's queue, ``torch.multiprocessing``) pickles a :class:`LoggedBatch`
    of plain, contiguous host tensors not in shared memory: in a DataLoader worker on Linux, through a slot of the
    worker's shared-memory pool (:mod:`capg_rec.logs._handover`), or in-band as numpy arrays through the pipe when no
    slot is free (whatever its size: no more of ``/dev/shm``, which may be what is short); elsewhere in-band if it is
    small (faster than a shared-memory block of its own, whose setup outweighs the copy below about 512 KiB:
    ``benchmarks/log_reader_speed.py``). Any other batch pickles as tensors do (shared memory, which a batch the user
    shared stays). ``pickle``, ``copy`` and ``torch.save`` are not affected."""
    # a lazily negated view (its negative bit set) would lose its sign as a tensor pickled between processes
    fields = tuple(x.resolve_neg() if isinstance(x, Tensor) and x.is_neg() else x for x in batch)
    if all(x is None or (type(x) is Tensor and x.device.type == "cpu" and not x.requires_grad and x.is_contiguous()
                         and not x.is_shared() and x.dtype in _NUMPY_DTYPES) for x in fields):
        in_worker = _handover.available()
        pooled = _handover.send(fields) if in_worker else None
        if pooled is not None:
            return _from_pool, pooled
        if in_worker or sum(x.nbytes for x in fields if x is not None) <= IN_BAND_BYTES:
            return _from_arrays, (tuple(None if x is None else x.numpy() for x in fields),)
    return LoggedBatch, fields


def _from_arrays(arrays: tuple[np.ndarray | None, ...]) -> LoggedBatch:
    """A :class:`LoggedBatch` unpickled from :func:`_reduce_for_processes`'s arrays (sharing their memory)."""
    _handover.sweep()  # a worker with no slot (a full /dev/shm) sends in-band: exited workers' pools may hold it
    return LoggedBatch(*(None if a is None else torch.from_numpy(a) for a in arrays))


def _from_pool(*args: object) -> LoggedBatch:
    """A :class:`LoggedBatch` unpickled from a slot of a DataLoader worker's pool (copied out of it)."""
    return LoggedBatch(*_handover.receive(*args))


ForkingPickler.register(LoggedBatch, _reduce_for_processes)
