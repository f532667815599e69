"""The repository's scripts (benchmarks, integration runs, examples) as importable modules for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """Import ``ROOT / relative`` (e.g. ``"benchmarks/loss_speed.py"``) under its file name, registered in
    ``sys.modules`` (its dataclasses look their module up there)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
