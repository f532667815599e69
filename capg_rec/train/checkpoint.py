"""Checkpoint files: checksummed, written atomically next to the previous good one, loaded without pickle code.

A file is one header line, ``capg_rec-checkpoint <version> <sha256 hex>``, then the bytes of
``torch.save(state)``. Reading checks the version and the checksum of those bytes (a flipped byte
anywhere is refused, naming the file) and loads them with ``torch.load(weights_only=True)``: the
state holds only containers, tensors, numbers and strings, so a planted file cannot run code.
Writing keeps the file it replaces as ``<name>.prev``; reading falls back to it, with a warning,
when the newest file is missing or corrupt.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import warnings
from pathlib import Path

import torch

__all__ = ["read_checkpoint", "write_checkpoint", "CHECKPOINT_VERSION"]

CHECKPOINT_VERSION = 2
_MAGIC = b"capg_rec-checkpoint"
_ZIP_MAGIC = b"PK\x03\x04"  # a bare torch.save file: what capg_rec wrote before checksums


def _previous(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def _encode(payload: bytes) -> bytes:
    digest = hashlib.sha256(payload).hexdigest()
    return b"%s %d %s\n" % (_MAGIC, CHECKPOINT_VERSION, digest.encode("ascii")) + payload


def write_checkpoint(state: dict, path: str | os.PathLike) -> None:
    """Write ``state`` to ``path`` atomically (temp file, fsync, ``os.replace``); the file it
    replaces becomes ``<path>.prev``, unless it is unreadable while ``<path>.prev`` is intact (what a resume fell back
    to): then that one is kept. An interrupted write leaves both earlier files intact."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_encode(buffer.getvalue()))
        f.flush()
        os.fsync(f.fileno())
    previous = _previous(path)
    if path.exists() and (not previous.exists() or _intact(path) or not _intact(previous)):
        os.replace(path, previous)
    os.replace(tmp, path)


def _intact(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint whose header and checksum are right (its content not loaded)."""
    try:
        _verified_payload(path)
    except (OSError, ValueError):
        return False
    return True


def _verified_payload(path: Path) -> bytes:
    """The serialized state in ``path``; ``ValueError`` (naming the file) unless its header and checksum are right."""
    data = path.read_bytes()
    header, _, payload = data.partition(b"\n")
    fields = header.split(b" ")
    if len(fields) != 3 or fields[0] != _MAGIC:
        old = " (written by an earlier capg_rec, without a checksum)" if data.startswith(_ZIP_MAGIC) else ""
        raise ValueError(f"checkpoint {path} is not a capg_rec checkpoint of version {CHECKPOINT_VERSION}{old}")
    if fields[1] != str(CHECKPOINT_VERSION).encode():
        raise ValueError(f"checkpoint {path} has version {fields[1].decode(errors='replace')}, "
                         f"this capg_rec reads version {CHECKPOINT_VERSION}")
    if hashlib.sha256(payload).hexdigest().encode() != fields[2]:
        raise ValueError(f"checkpoint {path} is corrupt: its content does not match its sha256 checksum")
    return payload


def _read_verified(path: Path) -> dict:
    """The state in ``path``; ``ValueError`` (naming the file) unless it is an intact checkpoint."""
    payload = _verified_payload(path)
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as err:
        raise ValueError(f"checkpoint {path} holds more than tensors, numbers, strings and containers; "
                         f"it is not loaded, as loading it could run code ({err})") from err
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path} must hold a dict, got {type(state).__name__}")
    return state


def read_checkpoint(path: str | os.PathLike) -> dict:
    """The verified state saved in ``path``. If ``path`` is missing or corrupt and ``<path>.prev``
    is intact, that one is returned with a ``RuntimeWarning``; otherwise the error names both files."""
    path = Path(path)
    previous = _previous(path)
    try:
        return _read_verified(path)
    except (OSError, ValueError) as err:
        if not previous.exists():
            raise
        try:
            state = _read_verified(previous)
        except (OSError, ValueError) as previous_err:
            raise ValueError(f"{err}; and the previous one: {previous_err}") from err
        step = state.get("step", "?")
        warnings.warn(f"{err}; using the previous checkpoint {previous} (step {step})", RuntimeWarning,
                      stacklevel=2)
        return state
