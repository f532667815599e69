"""Strict JSON for result files: a NaN or infinite number (an undefined interval, an unbounded z-score) is ``null``,
which every JSON parser reads (Python's ``NaN`` and ``Infinity`` tokens are not JSON)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np


def json_text(obj: object, indent: int | None = None) -> str:
    """``obj`` as strict JSON, its non-finite floats (at any depth) as ``null``."""
    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def plain(obj: object) -> object:
    """``obj`` with numpy's numbers and bools (``np.float32(1.5)``, ``np.int64(3)``) and arrays of them, in nested
    mappings (keys too) and sequences, as Python's, which ``json`` writes; everything else as is."""
    if isinstance(obj, (np.number, np.bool_)):
        return obj.item()
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufU":
        return obj.tolist()
    if isinstance(obj, Mapping):
        return {k.item() if isinstance(k, (np.number, np.bool_)) else k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def finite(obj: object) -> object:
    """``obj`` with every non-finite float, in nested mappings and sequences too, replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
