"""The TorchRec example's conversion to CA-PG: a small diff from the in-batch example, shown in the README as it is."""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.scripts import ROOT

BEFORE, AFTER = "examples/torchrec_two_tower_inbatch.py", "examples/torchrec_two_tower.py"


def _code(relative: str) -> list[str]:
    """The file's lines after its module docstring (each file's docstring describes that file)."""
    text = (ROOT / relative).read_text()
    return text[text.index('"""', 3) + 3:].lstrip("\n").splitlines(keepends=True)


def conversion_diff(context: int) -> list[str]:
    """The unified diff from the in-batch example to the CA-PG one, module docstrings left out."""
    return list(difflib.unified_diff(_code(BEFORE), _code(AFTER), BEFORE, AFTER, n=context))


def _kind(line: str) -> str:
    text = line[1:].strip()
    if text.startswith('"""') or text.endswith('"""'):
        return "docstrings"
    if text.startswith("#"):
        return "comments"
    if "parser.add_argument(" in text:
        return "argparse"
    if text.startswith(("import ", "from ")):
        return "imports"
    return "code"


def changed_lines(diff: list[str]) -> dict[str, int]:
    """Changed non-blank lines per kind: in each hunk of a diff without context, a line replaced counts
    once (the larger of the lines removed and added), a line only added or only removed once."""
    hunks: list[list[str]] = []
    for line in diff[2:]:
        if line.startswith("@@"):
            hunks.append([])
        elif line[1:].strip():
            hunks[-1].append(line)
    counts: dict[str, int] = {}
    for hunk in hunks:
        for kind in {_kind(line) for line in hunk}:
            removed = sum(line[0] == "-" and _kind(line) == kind for line in hunk)
            added = sum(line[0] == "+" and _kind(line) == kind for line in hunk)
            counts[kind] = counts.get(kind, 0) + max(removed, added)
    return counts


def test_conversion_changes_at_most_30_lines_of_model_and_training_code():
    counts = changed_lines(conversion_diff(context=0))
    assert 0 < counts["code"] <= 30, counts
    assert sum(counts.values()) <= 45, counts  # imports, docstrings, comments and argparse included


def test_changed_lines_counts_a_replaced_line_once():
    diff = list(difflib.unified_diff(["a = 1\n", "b = 2\n", "c = 3\n"], ["a = 1\n", "b = 4\n", "d = 5\n", "c = 3\n",
                                                                        "import os\n"], n=0))
    assert changed_lines(diff) == {"code": 2, "imports": 1}


def test_readme_shows_the_conversion_diff():
    """The README's diff block is exactly the diff of the two files, so the docs cannot drift from the code."""
    blocks = re.findall(r"^```diff\n(.*?)^```$", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    assert blocks == ["".join(conversion_diff(context=1))]


def test_in_batch_example_trains_a_few_steps_in_one_process(tmp_path):
    """The in-batch softmax example (the model before its conversion) runs through TrainPipelineSparseDist
    in one process and writes its learning curve."""
    pytest.importorskip("torchrec")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, str(ROOT / BEFORE), "--steps", "3", "--num-items", "300", "--batch-size",
                          "8", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert curve["world_size"] == 1 and len(curve["reward"]) == 3 and (tmp_path / "curve.png").exists()
    assert all(math.isfinite(r) for r in curve["reward"])
