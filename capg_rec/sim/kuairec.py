"""KuaiRec environment: the fully observed ``small_matrix.csv`` the paper's real-data table uses.

KuaiRec (Gao et al., CIKM 2022; CC BY-SA 4.0) is not shipped with capg_rec: download it and pass
the path of ``small_matrix.csv`` (1411 users × 3327 videos, about 4.7M rows). The expected reward
is the watch ratio clipped to ``[0, 10]``; observed rewards are ``q · (1 + N(0, 0.3²))``.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import numpy as np
import torch

from capg_rec.sim.env import MatrixEnv, settings_text

__all__ = ["load_kuairec", "KUAIREC_COLUMNS"]

KUAIREC_COLUMNS = ("user_id", "video_id", "play_duration", "video_duration", "time", "date",
                   "timestamp", "watch_ratio")
_MAX_WATCH_RATIO = 10.0


def _dense_mean(rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Mean of ``values`` per (row, col) cell on re-numbered ids; empty cells get their column's mean."""
    _, r = np.unique(rows, return_inverse=True)
    _, c = np.unique(cols, return_inverse=True)
    shape = (int(r.max()) + 1, int(c.max()) + 1)
    cell = r * shape[1] + c
    total = np.bincount(cell, weights=values, minlength=shape[0] * shape[1]).reshape(shape)
    count = np.bincount(cell, minlength=shape[0] * shape[1]).reshape(shape).astype(np.float64)
    seen = count > 0
    table = np.divide(total, count, out=np.zeros(shape), where=seen)
    col_mean = total.sum(axis=0) / count.sum(axis=0)
    return np.where(seen, table, col_mean[None, :])


def _check_field_counts(path: str, block: int = 1 << 24) -> None:
    """Every line holds ``len(KUAIREC_COLUMNS)`` fields (blank lines aside), with lines ended as ``np.loadtxt`` ends
    them (``\\n``, ``\\r\\n`` or ``\\r``): reading only some columns would take a line of more (a comma inside a
    field) with its values shifted. Counted in blocks of ``block`` bytes, vectorised (about 1 s of the 30 s that
    loading a 370 MB file takes)."""
    expected = len(KUAIREC_COLUMNS) - 1  # commas a line
    with open(path, "rb") as f:
        line, pending = 1, b""
        while True:
            chunk = f.read(block)
            raw = pending + chunk
            if chunk:  # up to the last line end; a last \r may be the first half of \r\n
                held = 1 if raw.endswith(b"\r") else 0
                cut = max(raw.rfind(b"\n", 0, len(raw) - held), raw.rfind(b"\r", 0, len(raw) - held)) + 1
                lines, pending = raw[:cut], raw[cut:]
            else:
                lines, pending = (raw + b"\n" if raw else b""), b""
            lines = lines.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if lines:
                a = np.frombuffer(lines, dtype=np.uint8)
                ends = np.flatnonzero(a == ord("\n"))
                starts = np.concatenate([[0], ends[:-1] + 1])
                commas = np.add.reduceat(a == ord(","), starts, dtype=np.int64)
                for i in np.flatnonzero(commas != expected):
                    if lines[starts[i]:ends[i]].strip():  # a blank line is skipped when read
                        raise ValueError(f"{path}: line {line + i} must hold {expected + 1} comma-separated fields "
                                         f"({','.join(KUAIREC_COLUMNS)}), got {commas[i] + 1}")
                line += len(ends)
            if not chunk:
                return


def load_kuairec(path: str | os.PathLike, *, relative_noise: float = 0.3) -> MatrixEnv:
    """Load KuaiRec's ``small_matrix.csv`` into a :class:`MatrixEnv` (q = clipped watch ratio).

    The file must have exactly the header ``user_id,video_id,play_duration,video_duration,time,
    date,timestamp,watch_ratio``. Users and videos are re-numbered ``0..U-1`` / ``0..N-1`` in id
    order. A (user, video) pair seen twice is averaged; a missing pair (the matrix is 99.6%
    dense) gets the video's mean watch ratio. The environment's name, ``kuairec(table=…)``, carries a
    digest of the table, so that checkpoints and reused runs of other data are refused. Raises
    ``ValueError`` on a malformed file.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"path must be an existing KuaiRec small_matrix.csv file, got {path!r}")
    with open(path, encoding="utf-8-sig") as f:  # a spreadsheet's byte-order mark too
        try:
            header = tuple(h.strip() for h in f.readline().strip().split(","))
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not a UTF-8 text file ({err})") from None
    if header != KUAIREC_COLUMNS:
        raise ValueError(f"{path}: header must be {','.join(KUAIREC_COLUMNS)}, got {','.join(header)!r}")
    _check_field_counts(path)
    try:
        with warnings.catch_warnings():  # an empty file is reported below, as a ValueError
            warnings.simplefilter("ignore", UserWarning)
            data = np.loadtxt(path, delimiter=",", skiprows=1, usecols=(0, 1, 7), dtype=np.float64,
                              ndmin=2, comments=None, encoding="utf-8-sig")
    except ValueError as err:
        raise ValueError(f"{path}: user_id, video_id and watch_ratio must be numeric ({err})") from err
    if data.shape[0] == 0:
        raise ValueError(f"{path}: the file has a header but no rows")
    if not np.isfinite(data).all():
        raise ValueError(f"{path}: user_id, video_id and watch_ratio must be finite (found NaN or inf)")
    ids = data[:, :2]
    if (ids != np.round(ids)).any():
        raise ValueError(f"{path}: user_id and video_id must be integers")
    table = _dense_mean(ids[:, 0], ids[:, 1], np.clip(data[:, 2], 0.0, _MAX_WATCH_RATIO))
    q = torch.from_numpy(table).float()
    digest = hashlib.sha256(q.numpy().tobytes()).hexdigest()[:12]  # runs on other data are told apart by name
    noise = settings_text(("relative_noise", relative_noise, 0.3))  # its reward tables differ too
    return MatrixEnv.from_table(q, relative_noise=relative_noise, name=f"kuairec(table={digest}{noise})")
