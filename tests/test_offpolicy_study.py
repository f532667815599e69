"""The off-policy study (`capg-rec reproduce offpolicy`) and benchmarks/offpolicy_speed.py run end to end at
tiny sizes and write their files."""

from __future__ import annotations

import csv
import importlib.util
import json
import pathlib
import sys

import pytest

from capg_rec.cli import main
from capg_rec.train.offpolicy import LEARNERS, OffPolicyStudy

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "offpolicy_speed.py"


def test_study_writes_every_learner_and_its_estimates(tmp_path, capsys):
    out = tmp_path / "study"
    with pytest.raises(SystemExit) as done:
        main(["reproduce", "offpolicy", "--ks", "3", "--sizes", "256", "--seeds", "1", "--logging-steps", "2",
              "--out", str(out)])
    assert done.value.code == 0
    saved = json.loads((out / "results.json").read_text())
    assert {r["learner"] for r in saved["runs"]} == set(LEARNERS)
    for r in saved["runs"]:
        assert r["K"] == 3 and r["n"] == 256 and r["true_value"] > 0 and r["ope_ess"] >= 0
    with open(out / "results.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(LEARNERS)
    assert (out / "values.png").stat().st_size > 0 and (out / "ope.png").stat().st_size > 0
    assert "off-policy CA-PG (capped IPS)" in (out / "results.md").read_text()
    assert "on-policy CA-PG" in capsys.readouterr().out


def test_study_options_are_checked():
    with pytest.raises(ValueError, match="learners"):
        OffPolicyStudy(learners=("nope",))
    with pytest.raises(ValueError, match="sizes"):
        OffPolicyStudy(sizes=(10,))


def test_speed_benchmark_writes_its_json(tmp_path):
    spec = importlib.util.spec_from_file_location("offpolicy_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    result = module.main(["--batch", "4", "--items", "30", "--ks", "3", "--reps", "1", "--warmup", "0",
                          "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == result["rows"] and len(saved["rows"]) == 8
    assert all(r["ratio_min"] > 0 for r in saved["rows"])
