"""Parquet logs: a writer that appends batches of tensors as row groups, and a streaming reader.

The reader never loads a file: it reads one row group at a time (``ParquetFile.iter_batches``),
turns each Arrow list column into a tensor through its flat values buffer (no Python loop over
rows), and splits the row groups of all files over DataLoader workers and distributed ranks, each
row group going to exactly one (worker, rank). Every value check names the file, the row group, the
row and the column it failed on; none is a silent skip.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import math
import os
import uuid
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch import Tensor

from capg_rec._checks import check_count, check_flag, is_id_tensor, is_int, resolve_validate_args
from capg_rec._json import plain
from capg_rec.logs import _handover
from capg_rec.logs.schema import IN_BAND_BYTES, LOG_SCHEMA, REQUIRED_COLUMNS, TENSOR_COLUMNS, LogMetadata, \
    LoggedBatch, file_schema
from capg_rec.marginals import DEFAULT_METHOD, InclusionMethod, inclusion_method, inclusion_methods

__all__ = ["LogWriter", "write_logs", "LoggedImpressions"]

LOG_TOLERANCE = 1e-6
"""How far above its bound (0, or log K for the expected count) a logged log-propensity may be: the
rounding of a probability of 1 computed in float32."""

_READ_ROWS = 16_384  # rows decoded and checked at once (then cut into batches): fewer, larger Arrow calls

_LIST_WIDTH = {"candidates": "num_candidates", "shown": "num_shown", "rewards": "num_shown",
               "log_inclusion": "num_shown", "log_expected_count": "num_shown", "features": "num_features"}
_DTYPES = {"request_id": torch.long, "context": torch.long, "features": torch.float32, "candidates": torch.long,
           "shown": torch.long, "rewards": torch.float32, "log_inclusion": torch.float64,
           "log_expected_count": torch.float64, "log_candidate_prob": torch.float64}
_NUMPY_DTYPES = {name: torch.empty(0, dtype=dtype).numpy().dtype for name, dtype in _DTYPES.items()}
_FLOAT32_MAX = float(np.nextafter(2.0**128 - 2.0**103, 0))  # the largest float64 that rounds to a finite float32


def _readable_as(got: pa.DataType, want: pa.DataType, name: str) -> bool:
    """Whether column ``name`` of Arrow type ``got`` reads as :data:`LOG_SCHEMA`'s ``want``: lists as any list layout
    (``large_list``, ``fixed_size_list``; elements declared non-nullable or named otherwise, as Spark and Polars
    write them) of readable values; integers as any integer type that int64 holds; floats as any float type, and
    rewards and features (read as float32, the schema's type) as integers too (clicks stored as 0 and 1); strings as
    either string type, dictionary-encoded or not (as pandas writes a categorical); rewards and features as booleans
    (clicks as true and false: 1 and 0)."""
    if pa.types.is_list(want):
        layouts = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
        return any(layout(got) for layout in layouts) and _readable_as(got.value_type, want.value_type, name)
    if pa.types.is_integer(want):
        return pa.types.is_signed_integer(got) or (pa.types.is_unsigned_integer(got) and got.bit_width < 64)
    if pa.types.is_floating(want):
        return pa.types.is_floating(got) or (name in _NUMBERS_AS_FLOATS and (pa.types.is_integer(got)
                                                                           or pa.types.is_boolean(got)))
    if pa.types.is_string(want):
        if pa.types.is_dictionary(got):
            got = got.value_type
        return pa.types.is_string(got) or pa.types.is_large_string(got)
    return got == want


def _also_readable(name: str) -> str:
    """What else :func:`_readable_as` reads as column ``name``'s schema type, for messages."""
    want = LOG_SCHEMA.field(name).type
    element = want.value_type if pa.types.is_list(want) else want
    kinds = "boolean, integer or float" if name in _NUMBERS_AS_FLOATS else "float" if pa.types.is_floating(element) \
        else "integer" if pa.types.is_integer(element) else "string (dictionary-encoded too)"
    return f"or another list layout, or {kinds} type read as it" if pa.types.is_list(want) else \
        f"or another {kinds} type read as it"


_NUMBERS_AS_FLOATS = ("rewards", "features")
"""The float columns that read integer columns too."""


def _first(bad: np.ndarray | None) -> int | None:
    """Index of the first True of a 1-d mask (None: no mask, none is True), or None."""
    return int(bad.argmax()) if bad is not None and bad.any() else None


def _value_problems(cols: dict[str, np.ndarray], meta: LogMetadata, num_items: int | None
                    ) -> Iterator[tuple[str, np.ndarray | None, str]]:
    """``(column, bad rows [n] bool, what is wrong)`` for every value check whose columns are present; the
    rows are None where one pass over the whole column (its min and max) shows that none is bad."""
    sorted_candidates = None
    if "candidates" in cols:
        c = cols["candidates"]
        if c.shape[1] > 1:
            # numpy's sort: a CPU torch.sort of short rows is ~10x slower
            sorted_candidates = np.sort(c, axis=1)
            yield "candidates", _repeats(sorted_candidates), "repeats an item"
        if num_items is not None:
            yield "candidates", _outside(c, 0, num_items - 1), f"holds an id outside [0, {num_items}) " \
                "(an item the catalog does not have)"
        else:
            yield "candidates", _outside(c, 0, None), "holds a negative id"
    if "shown" in cols:
        s = cols["shown"]
        if s.shape[1] > 1:
            yield "shown", _repeats(np.sort(s, axis=1)), "repeats an item"
        if "candidates" in cols:
            candidates = sorted_candidates if sorted_candidates is not None else cols["candidates"]
            yield "shown", ~_rows_hold(candidates, s), \
                "holds an item that is not among the row's candidates (shown ⊄ candidates)"
        elif num_items is not None:
            yield "shown", _outside(s, 0, num_items - 1), f"holds an id outside [0, {num_items})"
        else:
            yield "shown", _outside(s, 0, None), "holds a negative id"
    for name in ("rewards", "features"):  # read as float32: a wider type's values must lie in its range
        if name in cols:
            yield name, _outside(cols[name], -_FLOAT32_MAX, _FLOAT32_MAX), \
                "is not finite (NaN or inf) in float32, the type it is read as"
    bounds = {"log_inclusion": 0.0, "log_expected_count": math.log(meta.num_candidates), "log_candidate_prob": 0.0}
    for name, bound in bounds.items():
        if name in cols:
            x = cols[name] if cols[name].ndim == 2 else cols[name][:, None]
            if _outside(x, -math.inf, bound + LOG_TOLERANCE) is None:
                continue  # one pass: finite and below the bound
            yield name, _outside(x, -math.inf, math.inf), "is not finite (a zero, NaN or infinite propensity)"
            what = "a propensity > 1" if bound == 0.0 else f"an expected count > K = {meta.num_candidates}"
            yield name, (x.astype(np.float64) > bound + LOG_TOLERANCE).any(1), f"is {what} (log above {bound:g})"


def _outside(x: np.ndarray, low: float, high: float | None) -> np.ndarray | None:
    """Rows of ``x [n, k]`` holding a value outside ``[low, high]`` (``high`` None: no upper bound) or, for
    floats, one that is not finite → ``[n]`` bool; None when one min/max pass over ``x`` shows that none does."""
    high = math.inf if high is None else high
    if x.size == 0:
        return None
    floats = np.issubdtype(x.dtype, np.floating)
    # compared as Python numbers (float64, or exact ints): numpy would round a bound to a narrower column's type
    lo, hi = x.min().item(), x.max().item()  # a NaN propagates to both, and fails every comparison below
    if lo >= low and hi <= high and (not floats or (math.isfinite(lo) and math.isfinite(hi))):
        return None
    wide = x.astype(np.float64) if floats else x  # the rows of a failed check, located in float64
    ok = (wide >= low) & (wide <= high)
    if floats:
        ok &= np.isfinite(wide)
    return ~ok.all(1)


def _repeats(ordered: np.ndarray) -> np.ndarray | None:
    """Rows of ``ordered [n, k]`` (each sorted) that hold an id twice → ``[n]`` bool (numpy's row reductions:
    torch's are ~5x slower), or None when one pass shows that none does."""
    same = ordered[:, 1:] == ordered[:, :-1]
    if not same.any():
        return None
    return same.any(1)


def _rows_hold(ordered: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Whether each row of ``ordered [n, k]`` (each sorted) holds every id of its row of ``ids [n, l]`` → ``[n]``
    bool: a binary search in its own row for each id (torch's batched search: numpy has none), not an
    ``[n, l, k]`` comparison."""
    if ids.shape[1] == 0:
        return np.ones(ids.shape[0], dtype=bool)
    if ordered.shape[1] == 0:
        return np.zeros(ids.shape[0], dtype=bool)
    # contiguous (torch's search copies and warns about strided ones), writable (torch warns of read-only memory)
    ordered, ids = (torch.from_numpy(np.require(a, np.int64, ["C", "W"])) for a in (ordered, ids))
    at = torch.searchsorted(ordered, ids).clamp_(max=ordered.shape[1] - 1)
    return (ordered.gather(1, at) == ids).all(1).numpy()


def _row(row: int, file_row: int | None) -> str:
    return f"row {row}" if file_row is None else f"row {row} (file row {file_row + row})"


def _raise_first(cols: dict[str, np.ndarray], meta: LogMetadata, num_items: int | None, where: str,
                 row0: int, file_row0: int | None = None) -> None:
    """``ValueError`` naming ``where``, the row (``row0`` + index; and the file's row if ``file_row0``
    is given) and the column of the first failing check."""
    for column, bad, what in _value_problems(cols, meta, num_items):
        row = _first(bad)
        if row is not None:
            raise ValueError(f"{where}, {_row(row0 + row, file_row0)}: column {column!r} {what}")


class LogWriter:
    """Write logged requests to a Parquet file, one row group per :meth:`write` (or per
    ``row_group_size`` rows).

    Args:
        path: the ``.parquet`` file to create (its directory must exist). It is written beside it, to a
            hidden temporary file that replaces ``path`` when the writer closes; if the ``with`` block
            raises, that file is removed and an existing ``path`` is left as it was.
        num_candidates: K, the width of ``candidates``.
        num_shown: L, the width of ``shown``, ``rewards`` and the per-item log-propensities.
        num_items: N, the catalog size the ids index (checked: ids in ``[0, N)``), or None.
        method: the inclusion method behind ``log_inclusion`` (its name is stored).
        num_features: F, the width of ``features``, or None for a file without features.
        policy_version: the logging policy's version, stored in every row.
        extra: JSON-serialisable facts stored in the file metadata (environment, temperature, ε...).
        row_group_size: rows per row group at most (default: one row group per :meth:`write`).
        compression: Parquet compression codec.
        validate_args: check every batch before it is written (as the reader does).

    Shape:
        :meth:`write` takes a :class:`LoggedBatch` of B rows (``request_id`` None numbers rows on from
        the rows written so far).

    Example (a sketch: the names it takes come from your loop)::

        with LogWriter("logs.parquet", num_candidates=K, num_shown=L, num_items=N) as writer:
            logged = log_propensities(logits, candidates, shown, epsilon=0.05)
            writer.write(LoggedBatch(users, candidates, shown, rewards, *logged))
    """

    def __init__(self, path: str | os.PathLike, *, num_candidates: int, num_shown: int, num_items: int | None = None,
                 method: str | InclusionMethod = DEFAULT_METHOD, num_features: int | None = None,
                 policy_version: str = "", extra: dict[str, Any] | None = None, row_group_size: int | None = None,
                 compression: str = "snappy", validate_args: bool | None = None) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        num_candidates = check_count("num_candidates", num_candidates)
        num_shown = check_count("num_shown", num_shown, high=num_candidates)
        if num_items is not None:
            num_items = check_count("num_items", num_items, low=num_candidates)
        if num_features is not None:
            num_features = check_count("num_features", num_features)
        if row_group_size is not None:
            row_group_size = check_count("row_group_size", row_group_size)
        if not isinstance(policy_version, str):
            raise TypeError(f"policy_version must be a str, got {type(policy_version).__name__}")
        if not isinstance(method, (str, InclusionMethod)):
            raise TypeError(f"method must be an InclusionMethod or a name, got {type(method).__name__}")
        if not isinstance(compression, str):
            raise TypeError(f"compression must be a codec name, got {type(compression).__name__}")
        if compression.lower() != "none" and not _codec_available(compression):
            raise ValueError(f"compression must be 'none' or a Parquet codec this pyarrow has (snappy, gzip, brotli, "
                             f"lz4, zstd), got {compression!r}")
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
        extra = plain(extra)  # numpy's numbers as Python's
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as err:
            raise TypeError(f"extra must hold JSON values (str, int, float, bool, None, lists and dicts of them): "
                            f"{err}") from None
        try:  # standard JSON, which other readers of the metadata take
            json.dumps(extra, allow_nan=False)
        except ValueError:
            raise ValueError(f"extra must hold finite numbers (JSON has no NaN or infinity), got {extra!r}") from None
        self.meta = LogMetadata(num_candidates, num_shown, _method_name(method),
                                num_items, num_features, extra=dict(extra or {}))
        self.path = Path(path)
        self.policy_version = policy_version
        self.row_group_size = row_group_size
        self.validate = resolve_validate_args(validate_args)
        self.schema = file_schema(self.meta)
        self.rows_written = 0
        self.batches_written = 0
        if self.path.is_dir():
            raise ValueError(f"path must be a file to create, got the folder {self.path}")
        if self.path.exists() and not self.path.is_file():  # a device such as /dev/null would be replaced by a file
            raise ValueError(f"path must be a regular file to create or replace, got {self.path}, which is not one")
        if not self.path.parent.is_dir():  # else the error would name the hidden file written first
            raise ValueError(f"path must be in an existing folder, got {self.path} ({self.path.parent} is not one)")
        # the name cut short (50 characters, at most 200 bytes): a legal name of up to 255 bytes leaves room for it
        self._partial = self.path.with_name(f".{self.path.name[:50]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
        try:
            # page checksums: a flipped bit in a page that still decodes is read as an error, not as another value
            self._writer = pq.ParquetWriter(self._partial, self.schema, compression=compression,
                                            write_page_checksum=True)
        except BaseException as err:
            with contextlib.suppress(OSError):  # a read-only file system refuses even the unlink of nothing
                self._partial.unlink(missing_ok=True)  # opened before it failed: leave nothing behind
            if isinstance(err, OSError):  # named by the path asked for, not by the hidden file written first
                reason = os.strerror(err.errno) if err.errno else str(err)  # pyarrow's names the hidden file
                raise OSError(err.errno, f"path {self.path} cannot be written ({reason})") from err
            raise

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            self.close()
        else:
            self.discard()

    def close(self) -> None:
        """Finish the file and put it at ``path`` (idempotent). A writer collected while still open was never
        closed (a job that failed outside a ``with`` block, say): its file is finished beside ``path``, as
        ``<path>.unclosed`` (not read as logs), ``path`` is left as it was, and a warning says so."""
        if self._writer is not None:
            self._finish(self.path)

    def _finish(self, target: Path) -> None:
        """Finish the file and move it to ``target`` (on failure, remove it and raise)."""
        self._writer.close()
        self._writer = None
        try:
            os.replace(self._partial, target)
        except OSError:
            self._partial.unlink(missing_ok=True)
            raise

    def __del__(self) -> None:
        if getattr(self, "_writer", None) is not None:
            try:  # (a name near the file system's limit has no room for the suffix: the rows are then lost)
                kept = self.path.with_name(self.path.name + ".unclosed")
                for copy_number in itertools.count(1):  # an earlier unclosed writer's rows stay where they are
                    if not kept.exists():
                        break
                    kept = self.path.with_name(f"{self.path.name}.unclosed.{copy_number}")
                self._finish(kept)
            except OSError:
                kept = None
                with contextlib.suppress(OSError):
                    self.discard()
            warnings.warn(f"LogWriter for {self.path} was never closed: the path was left as it was, and its "
                          f"{self.rows_written} rows are {f'in {kept}' if kept else 'lost'} (close the writer, or use "
                          "it in a with block)", UserWarning, stacklevel=1)

    def discard(self) -> None:
        """Drop what was written, leaving ``path`` as it was (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._partial.unlink(missing_ok=True)

    def write(self, batch: LoggedBatch) -> None:
        """Append ``batch`` (B rows) as one row group (or several of ``row_group_size`` rows)."""
        if self._writer is None:
            raise ValueError(f"LogWriter for {self.path} is closed")
        if not isinstance(batch, LoggedBatch):
            raise TypeError(f"batch must be a LoggedBatch, got {type(batch).__name__}")
        cols = {name: x.detach().cpu().resolve_neg().numpy() for name, x in self._columns(batch).items()}
        n = len(cols["context"])
        if self.validate:
            where = f"batch {self.batches_written} written to {self.path}"
            _raise_first(cols, self.meta, self.meta.num_items, where, 0)
        if "request_id" not in cols:
            cols["request_id"] = np.arange(self.rows_written, self.rows_written + n)
        arrays = []
        for f in self.schema:
            if f.name == "policy_version":
                arrays.append(pa.repeat(pa.scalar(self.policy_version, pa.string()), n))
                continue
            values = cols[f.name]
            if values.ndim == 1:
                arrays.append(pa.array(values, type=f.type))
            else:
                width = values.shape[1]
                offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32) if n else [0], pa.int32())
                arrays.append(pa.ListArray.from_arrays(offsets, pa.array(values.ravel(), type=f.type.value_type)))
        # pyarrow's own default cuts a write into row groups of 1,048,576 rows: one per write() unless asked
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=self.schema),
                                 row_group_size=self.row_group_size or max(n, 1))
        self.rows_written += n
        self.batches_written += 1

    def _columns(self, batch: LoggedBatch) -> dict[str, Tensor]:
        """The batch's tensors by column, checked for type and shape, cast to the file's dtypes."""
        if not isinstance(batch.context, Tensor):
            raise TypeError(f"batch.context must be a torch.Tensor, got {type(batch.context).__name__}")
        if batch.context.dim() != 1:
            raise ValueError(f"batch.context must have shape [B], got {list(batch.context.shape)}")
        cols: dict[str, Tensor] = {}
        for name in TENSOR_COLUMNS:
            x = getattr(batch, name)
            if x is None:
                if name == "request_id" or (name == "features" and self.meta.num_features is None):
                    continue
                raise ValueError(f"batch.{name} must be a tensor, got None")
            if name == "features" and self.meta.num_features is None:
                raise ValueError("batch.features must be None: the file was opened without num_features")
            if not isinstance(x, Tensor):
                raise TypeError(f"batch.{name} must be a torch.Tensor, got {type(x).__name__}")
            integer = _DTYPES[name] == torch.long
            if not (is_id_tensor(x) if integer else x.is_floating_point()):  # bools and complex numbers are neither
                raise TypeError(f"batch.{name} must have {'an integer' if integer else 'a floating'} dtype, "
                                f"got {x.dtype}")
            width = getattr(self.meta, _LIST_WIDTH[name]) if name in _LIST_WIDTH else None
            shape = (len(batch.context),) if width is None else (len(batch.context), width)
            if tuple(x.shape) != shape:
                rule = "" if width is None else f" (the file's {_LIST_WIDTH[name]}={width})"
                raise ValueError(f"batch.{name} must have shape {list(shape)}{rule}, got {list(x.shape)}")
            cols[name] = x.to(_DTYPES[name])
        return cols


def _method_name(method: str | InclusionMethod) -> str:
    """The name stored for ``method``: a name as given (logs of another system may name their own), an instance by
    the name it is registered under (``MeanField()`` is ``"mean_field"``), else its ``repr``."""
    if isinstance(method, str):
        return method
    return next((name for name in inclusion_methods() if inclusion_method(name) == method), repr(method))


def write_logs(path: str | os.PathLike, batch: LoggedBatch, **kwargs: Any) -> None:
    """Write one :class:`LoggedBatch` to a new file; K, L and F are read off the shapes of its candidates, shown
    items and features, and ``kwargs`` go to :class:`LogWriter` (``num_items``, ``method``, ``policy_version``, ...)."""
    if not isinstance(batch, LoggedBatch):
        raise TypeError(f"batch must be a LoggedBatch, got {type(batch).__name__}")
    given = sorted({"num_candidates", "num_shown", "num_features"} & set(kwargs))
    if given:
        raise TypeError(f"write_logs reads {given} off the batch's shapes: do not pass them")
    for name in ("candidates", "shown", "features"):
        x = getattr(batch, name)
        if name != "features" or x is not None:
            if not isinstance(x, Tensor):
                raise TypeError(f"batch.{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 2:
                raise ValueError(f"batch.{name} must have 2 dims [B, width], got shape {list(x.shape)}")
    widths = dict(num_candidates=batch.candidates.shape[1], num_shown=batch.shown.shape[1],
                  num_features=None if batch.features is None else batch.features.shape[1])
    with LogWriter(path, **widths, **kwargs) as writer:
        writer.write(batch)


def _codec_available(name: str) -> bool:
    try:
        return pa.Codec.is_available(name)
    except ValueError:  # a name pyarrow does not know
        return False


def _first_null(pf: pq.ParquetFile, name: str) -> tuple[int, int, int] | None:
    """``(row group, row in it, row in the file)`` of the first null of the top-level, non-nested column ``name``, or
    None: the row groups that hold one from the footer's statistics (of its leaf column: nested columns count one leaf
    per field), else read; the row read from that row group."""
    leaves = pf.metadata.schema
    leaf = next(i for i in range(len(leaves)) if leaves.column(i).path == name)
    first = 0
    for group in range(pf.num_row_groups):
        stats = pf.metadata.row_group(group).column(leaf).statistics
        if stats is None or not stats.has_null_count or stats.null_count > 0:
            column = pf.read_row_group(group, columns=[name]).column(0)
            if column.null_count > 0:
                row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
                return group, row, first + row
        first += pf.metadata.row_group(group).num_rows
    return None


def _readable(batches: Iterator[pa.RecordBatch], where: str) -> Iterator[pa.RecordBatch]:
    """``batches`` as read, with a failure to decode them (a corrupted page) a ``ValueError`` naming ``where``."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as err:
            raise ValueError(f"{where} cannot be read: {err}") from err
        yield batch


def _folder_files(folder: Path) -> list[Path]:
    """The ``.parquet`` files (any case) under ``folder`` and its subfolders (Hive-style partitions, ``date=.../``;
    linked folders too, each visited once), in path order, leaving out those whose name or folder starts with ``.``
    or ``_`` (hidden files, a writer's temporary ones, ``_SUCCESS`` markers), as ``pyarrow.dataset`` does."""
    files, seen = [], set()
    for top, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:  # a link back into the tree: its files are listed once
            dirs.clear()
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        files.extend(Path(top) / name for name in names
                     if name.lower().endswith(".parquet") and not name.startswith((".", "_"))
                     and os.path.isfile(os.path.join(top, name)))
    return sorted(files)


def _log_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    elif not isinstance(paths, Sequence) or not all(isinstance(p, (str, os.PathLike)) for p in paths):
        raise TypeError(f"path_or_paths must be a path, a directory or a list of paths, got {paths!r}")
    elif not paths:
        raise ValueError("path_or_paths must name at least one path, got an empty list")
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(_folder_files(p) if p.is_dir() else [p])
    if not files:
        raise ValueError(f"path_or_paths: no .parquet file in {[str(p) for p in paths]}")
    seen: dict[Path, Path] = {}
    for f in files:  # a file named twice (directly, or through its directory) would be read twice
        same = seen.setdefault(f.resolve(), f)
        if same is not f:
            raise ValueError(f"path_or_paths names the log file {f} more than once (as {same} too)")
    return files


class LoggedImpressions(torch.utils.data.IterableDataset):
    """Stream :class:`LoggedBatch` es of ``batch_size`` rows from Parquet logs, row group by row group.

    The row groups of all files are split over DataLoader workers and ranks (``rank * num_workers +
    worker`` takes every ``world_size * num_workers``-th one): each row is read by exactly one of
    them. Use ``DataLoader(dataset, batch_size=None, num_workers=...)``: batching happens here.
    Different ranks may get different numbers of rows (whole row groups).

    Args:
        path_or_paths: a file, a directory of ``.parquet`` files (searched recursively: Hive-style partition
            folders too, whose values are not read as columns; names starting with ``.`` or ``_`` are left out,
            as ``pyarrow.dataset`` leaves them), or a list of them (naming a file twice,
            directly or through its directory, is a ``ValueError``: its rows would be read twice).
        batch_size: rows per batch (the last one of each worker may be smaller).
        columns: the :class:`LoggedBatch` fields to read (default: all there are); the others are None.
        shuffle_row_groups: visit the row groups in a random order (seeded by ``seed`` and the epoch,
            see :meth:`set_epoch`); rows within a row group keep their order.
        seed: the shuffling seed, the same on every rank.
        drop_last: drop each worker's last batch when it is smaller than ``batch_size``.
        rank, world_size: this process's shard; default: ``torch.distributed``'s when it is
            initialised, else the ``RANK`` and ``WORLD_SIZE`` environment variables a launcher such as torchrun
            sets (those ``init_process_group`` reads), else one process.
        num_items: the catalog size N that ids must index (default: the file's, if it recorded one);
            pass the new catalog's size to catch logged items it no longer has.
        validate_args: check every value (lengths, ids, ``shown ⊆ candidates``, propensities in
            ``(0, 1]`` and finite); ``False`` skips the checks for speed. Nulls, and list columns with a
            row of another width, raise either way (their checks cost little).

    Attributes:
        meta: the files' :class:`LogMetadata` (K, L, F, method and N agree across them; the rest, such as
            ``extra``, is the first file's).
        file_meta: each file's own, in the order of :attr:`files` (e.g. the environment each records).

    Shape:
        Yields :class:`LoggedBatch` with ``context [B]``, ``features [B, F]`` or None, ``candidates
        [B, K]`` and ``shown [B, L]`` (int64), ``rewards [B, L]`` (float32), ``log_inclusion`` and
        ``log_expected_count [B, L]`` and ``log_candidate_prob [B]`` (float64), ``request_id [B]``.

    Example (a sketch: the names it takes come from your loop)::

        data = LoggedImpressions("logs/", batch_size=512, shuffle_row_groups=True)
        for batch in torch.utils.data.DataLoader(data, batch_size=None, num_workers=2):
            loss = off_policy_loss(model(batch.context), batch.candidates, batch.shown, batch.rewards, ...)
    """

    def __init__(self, path_or_paths: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int, *,
                 columns: Sequence[str] | None = None, shuffle_row_groups: bool = False, seed: int = 0,
                 drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
                 num_items: int | None = None, validate_args: bool | None = None) -> None:
        super().__init__()
        self.files = _log_files(path_or_paths)
        self.batch_size = check_count("batch_size", batch_size)
        self.shuffle_row_groups = check_flag("shuffle_row_groups", shuffle_row_groups)
        self.drop_last = check_flag("drop_last", drop_last)
        self.seed = check_count("seed", seed, low=0)
        self.validate = resolve_validate_args(validate_args)
        if (rank is None) != (world_size is None):
            raise ValueError("rank and world_size must be given together (or neither)")
        if world_size is not None:
            world_size = check_count("world_size", world_size)
            rank = check_count("rank", rank, low=0, high=world_size - 1)
        self.rank, self.world_size = rank, world_size
        self._digests: dict[tuple[Path, int, int], str] = {}  # for fingerprint()
        self._parent_rank: tuple[int, int] | None = None  # the rank of the process that sent this copy to a worker
        if num_items is not None:
            num_items = check_count("num_items", num_items)
        # In shared memory: DataLoader workers, persistent ones included, read the epoch set here.
        self._epoch = torch.zeros((), dtype=torch.long, device="cpu").share_memory_()
        self.meta, self.row_groups, self.file_meta = self._inspect(num_items)
        self.num_items = num_items if num_items is not None else self.meta.num_items
        present = set(TENSOR_COLUMNS) - ({"features"} if self.meta.num_features is None else set())
        if columns is None:
            columns = [c for c in TENSOR_COLUMNS if c in present]
        elif isinstance(columns, str) or not isinstance(columns, Iterable):
            raise TypeError(f"columns must be a list of column names, got {columns!r}")
        else:
            columns = list(columns)  # a generator is read once
            if not all(isinstance(c, str) for c in columns):
                raise TypeError(f"columns must be a list of column names, got {columns!r}")
        if not columns:
            raise ValueError(f"columns must name at least one of {sorted(present)}, got none")
        unknown = [c for c in columns if c not in present]
        if unknown:
            raise ValueError(f"columns must be among {sorted(present)}, got {unknown}")
        self.columns = list(dict.fromkeys(columns))

    @property
    def num_rows(self) -> int:
        """Rows in all files (all ranks and workers together)."""
        return sum(group[2] for group in self.row_groups)

    def fingerprint(self) -> str:
        """A digest of the files' names and bytes: it changes when a file is rewritten with other rows (a
        relabelled reward too), e.g. to refuse resuming a run on changed logs. This reader reads each file once for it,
        at disk speed (about a second per GB here), and keeps its digest while the file's size and modification time
        stay the same (a new reader reads them anew)."""
        digest = hashlib.sha256()
        for path in self.files:
            stat = path.stat()
            key = (path, stat.st_size, stat.st_mtime_ns)
            if key not in self._digests:
                file_digest = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 22):
                        file_digest.update(chunk)
                self._digests[key] = file_digest.hexdigest()
            digest.update(f"{path.name}:{self._digests[key]}:".encode())
        return digest.hexdigest()

    @property
    def epoch(self) -> int:
        """The epoch whose row-group order is read (see :meth:`set_epoch`)."""
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle the row groups for this epoch (with ``shuffle_row_groups``), the same on every rank. DataLoader
        workers see it at their next pass, persistent ones (``persistent_workers=True``) too: the epoch lies in
        shared memory."""
        self._epoch.fill_(check_count("epoch", epoch, low=0, high=2**63 - 1))  # an int64

    def __getstate__(self) -> dict[str, Any]:
        """The state sent to a DataLoader worker, with this process's rank: a worker that a spawn or forkserver
        start made has no process group of its own to ask."""
        state = self.__dict__.copy()
        state["_parent_rank"] = self._rank()
        return state

    def _inspect(self, num_items: int | None
                 ) -> tuple[LogMetadata, list[tuple[int, int, int, int]], tuple[LogMetadata, ...]]:
        """Every file's schema and metadata checked → the first file's metadata, ``[(file, row group, rows, the
        group's first row)]`` and every file's metadata."""
        meta, groups, metas = None, [], []
        for index, path in enumerate(self.files):
            try:
                pf = pq.ParquetFile(path)
            except (OSError, pa.ArrowException) as err:
                raise ValueError(f"log file {path}: not a readable Parquet file ({err})") from err
            with pf:
                schema = pf.schema_arrow
                here = LogMetadata.from_arrow(schema.metadata, str(path))
                metas.append(here)
                twice = sorted({name for name in schema.names if schema.names.count(name) > 1})
                if twice:
                    raise ValueError(f"log file {path}: column(s) {twice} appear more than once")
                for name in (*REQUIRED_COLUMNS, *(["features"] if here.num_features is not None else [])):
                    if name not in schema.names:
                        raise ValueError(f"log file {path}: missing column {name!r}")
                    if not _readable_as(schema.field(name).type, LOG_SCHEMA.field(name).type, name):
                        raise ValueError(f"log file {path}: column {name!r} must have type "
                                         f"{LOG_SCHEMA.field(name).type} ({_also_readable(name)}), got "
                                         f"{schema.field(name).type}")
                if meta is None:
                    meta = here
                else:
                    # every file's ids are checked against one N: the reader's, or else the files' (which must agree)
                    agreed = ("num_candidates", "num_shown", "num_features", "method",
                              *(("num_items",) if num_items is None else ()))
                    for name in agreed:
                        if getattr(here, name) != getattr(meta, name):
                            raise ValueError(f"log file {path}: {name} = {getattr(here, name)} differs from "
                                             f"{self.files[0]}'s {getattr(meta, name)}")
                bad = _first_null(pf, "policy_version")  # checked always, as every null
                if bad is not None:
                    group, row, file_row = bad
                    raise ValueError(f"log file {path}, row group {group}, row {row} (file row {file_row}): column "
                                     "'policy_version' is missing (null)")
                first = 0
                for g in range(pf.num_row_groups):
                    rows = pf.metadata.row_group(g).num_rows
                    groups.append((index, g, rows, first))
                    first += rows
        return meta, groups, tuple(metas)

    def subset(self, row_groups: Sequence[int]) -> LoggedImpressions:
        """The same reader over some of its row groups only (indices into :attr:`row_groups`, in the
        order given), e.g. to hold the last ones out for evaluation."""
        if isinstance(row_groups, np.ndarray) and row_groups.ndim == 1:  # numpy's, e.g. np.arange(n)[-2:]
            row_groups = row_groups.tolist()
        if isinstance(row_groups, (str, bytes)) or not isinstance(row_groups, Sequence) or \
                not all(is_int(i) for i in row_groups):
            raise TypeError(f"row_groups must be a sequence of ints, got {row_groups!r}")
        row_groups = [int(i) for i in row_groups]  # numpy's too
        bad = [i for i in row_groups if not 0 <= i < len(self.row_groups)]
        if bad or len(set(row_groups)) != len(row_groups):
            raise ValueError(f"row_groups must be distinct indices in [0, {len(self.row_groups)}), "
                             f"got {list(row_groups)}")
        other = copy.copy(self)
        other.row_groups = [self.row_groups[i] for i in row_groups]
        other._parent_rank = self._parent_rank
        other._epoch = self._epoch.clone().share_memory_()  # its own epoch
        return other

    def num_batches(self, num_workers: int = 0) -> int:
        """The batches this rank yields in the current epoch (see :meth:`set_epoch`) through a
        ``DataLoader(..., num_workers=num_workers)`` (each worker's last batch may be short)."""
        num_workers = check_count("num_workers", num_workers, low=0)
        rank, world = self._rank()
        workers = max(num_workers, 1)
        total = 0
        for worker in range(workers):
            rows = sum(group[2] for group in self._row_groups_of(rank * workers + worker, world * workers))
            total += rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)
        return total

    def _rank(self) -> tuple[int, int]:
        """``(rank, world_size)``: the ones given, else ``torch.distributed``'s, else (in a DataLoader worker without
        a process group) that of the process that made the worker, else the launcher's, else one process."""
        if self.rank is not None:
            return self.rank, self.world_size
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return self._parent_rank or _launcher_rank() or (0, 1)

    def _shard(self) -> tuple[int, int]:
        """``(shard, num_shards)`` of this process and DataLoader worker."""
        rank, world = self._rank()
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank * workers + worker, world * workers

    def _row_groups_of(self, shard: int, num_shards: int) -> list[tuple[int, int, int, int]]:
        order = list(range(len(self.row_groups)))
        if self.shuffle_row_groups:
            # every (seed, epoch) its own order, for seeds of any size (a product would overflow or collide)
            key = hashlib.blake2b(f"{self.seed}:{self.epoch}".encode(), digest_size=8).digest()
            g = torch.Generator().manual_seed(int.from_bytes(key, "little"))
            order = torch.randperm(len(order), generator=g, device="cpu").tolist()
        return [self.row_groups[i] for i in order[shard::num_shards]]

    def _my_row_groups(self) -> list[tuple[int, int, int, int]]:
        return self._row_groups_of(*self._shard())

    def __iter__(self) -> Iterator[LoggedBatch]:
        pending: list[dict[str, np.ndarray]] = []
        count = 0
        current: tuple[int, pq.ParquetFile | None] = (-1, None)
        try:
            for file_index, group, _, first_row in self._my_row_groups():
                if current[0] != file_index:
                    if current[1] is not None:
                        current[1].close()
                    # pages written with checksums (as LogWriter writes them) are verified
                    current = (file_index, pq.ParquetFile(self.files[file_index], page_checksum_verification=True))
                row0 = 0
                where = f"log file {self.files[file_index]}, row group {group}"
                for record_batch in _readable(current[1].iter_batches(
                        batch_size=max(self.batch_size, _READ_ROWS), row_groups=[group], columns=self.columns,
                        use_threads=False), where):
                    cols = self._arrays(record_batch, where, row0, first_row)
                    row0 += record_batch.num_rows
                    pending.append(cols)
                    count += record_batch.num_rows
                    while count >= self.batch_size:
                        batch, pending = _split(pending, self.batch_size)
                        count -= self.batch_size
                        yield _batch(batch)
            if count and not self.drop_last:
                yield _batch(_split(pending, count)[0])
        finally:
            if current[1] is not None:
                current[1].close()

    def _arrays(self, record_batch: pa.RecordBatch, where: str, row0: int, file_row0: int) -> dict[str, np.ndarray]:
        """The batch's columns as numpy views of Arrow's buffers (read-only, in the file's dtypes: copied and cast
        once, into the batch); with validation, every check (naming ``where`` and the row: ``row0`` is the
        batch's first row in its row group, ``file_row0`` the group's first in the file)."""
        cols = {}
        for name in self.columns:
            arr = record_batch.column(name)
            if arr.null_count:  # checked always (a count Arrow keeps): a null would turn the column into floats
                row = _first(arr.is_null().to_numpy(zero_copy_only=False))
                raise ValueError(f"{where}, {_row(row0 + row, file_row0)}: column {name!r} is missing (null)")
            n = len(arr)
            if name in _LIST_WIDTH:
                width = getattr(self.meta, _LIST_WIDTH[name])
                # Structure, checked always (one vectorised pass): rows whose lengths make up for each other
                # would shift every later row's values onto the wrong request.
                lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
                row = _first(lengths != width)
                if row is not None:
                    raise ValueError(f"{where}, {_row(row0 + row, file_row0)}: column {name!r} must hold {width} "
                                     f"values per row, got {lengths[row]}")
                values = arr.flatten()
                if values.null_count:
                    row = _first(values.is_null().to_numpy(zero_copy_only=False)) // width
                    raise ValueError(f"{where}, {_row(row0 + row, file_row0)}: column {name!r} holds a missing "
                                     "(null) value")
                cols[name] = values.to_numpy(zero_copy_only=False).reshape(n, width)
            else:
                cols[name] = arr.to_numpy(zero_copy_only=False)
        if self.validate:
            _raise_first(cols, self.meta, self.num_items, where, row0, file_row0)
        return cols


def _launcher_rank() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` from the environment, as a launcher such as torchrun sets them (a process of a multi-rank
    job that made no process group must still read its own shard, not every row), or None where they are not set."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    try:
        rank, world = int(rank), int(world)
    except ValueError:
        raise ValueError(f"the environment's RANK={rank!r} and WORLD_SIZE={world!r} must be integers (a launcher's "
                         "ranks), or pass rank= and world_size=") from None
    if not 0 <= rank < world:
        raise ValueError(f"the environment's RANK={rank} must be in [0, WORLD_SIZE={world}), or pass rank= and "
                         "world_size=")
    return rank, world


def _split(pending: list[dict[str, np.ndarray]], size: int
           ) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """The first ``size`` rows of the pending pieces, and the pieces left."""
    taken, left, need = [], [], size
    for piece in pending:
        n = len(next(iter(piece.values())))
        if need >= n:
            taken.append(piece)
            need -= n
        elif need > 0:
            taken.append({k: v[:need] for k, v in piece.items()})
            left.append({k: v[need:] for k, v in piece.items()})
            need = 0
        else:
            left.append(piece)
    joined = taken[0] if len(taken) == 1 else {k: np.concatenate([p[k] for p in taken]) for k in taken[0]}
    return joined, left


def _batch(cols: dict[str, np.ndarray]) -> LoggedBatch:
    """The columns copied (and cast to the schema's dtypes) into ONE byte buffer, each a contiguous typed view
    of it: a batch never keeps the larger decoded chunk it was cut from alive. A DataLoader worker on Linux makes
    the buffer in a slot of its shared-memory pool (:mod:`capg_rec.logs._handover`), else in its own memory (the
    batch then goes in-band through its pipe); elsewhere a worker makes a batch of more than
    :data:`~capg_rec.logs.schema.IN_BAND_BYTES` in a shared-memory block, as the DataLoader's own collate does (it is
    not copied there when sent)."""
    layout, nbytes = _handover.pack((_NUMPY_DTYPES[name].str, x.shape) for name, x in cols.items())
    slot = _handover.buffer(nbytes) if _handover.available() else None
    if slot is not None:
        storage = torch.from_numpy(slot).untyped_storage()
    elif nbytes > IN_BAND_BYTES and not _handover._SUPPORTED and torch.utils.data.get_worker_info() is not None:
        storage = torch.UntypedStorage._new_shared(nbytes)
    else:  # host memory whatever the default device (numpy writes into it)
        storage = torch.empty(nbytes, dtype=torch.uint8, device="cpu").untyped_storage()
    out = dict(zip(cols, _handover.views(storage, layout)))
    for name, x in cols.items():
        np.copyto(out[name].numpy(), x, casting="unsafe")  # the file's type was checked readable as the schema's
    return LoggedBatch(**{name: out.get(name) for name in LoggedBatch._fields})
