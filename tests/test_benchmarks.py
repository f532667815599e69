"""benchmarks/loss_speed.py runs end to end at tiny sizes, one repetition, and writes its table, JSON, CSV and chart."""

from __future__ import annotations

import csv
import json
import os
import sys

import pytest
import torch

import capg_rec

from tests.scripts import ROOT, load_script


# Stands in for the released code: the same package path, class and call, with log-softmax scores.
FAKE_POLICY = '''
class BaselineEarlyStagePolicy:
    def __init__(self, base_model, action_set, random_seed):
        self.base_model = base_model

    def calc_prob_given_actions(self, actions, candidate_actions, n_candidate_action, is_credit_assigned=False,
                                is_top1=False, is_vanilla_replacement=False):
        log_p = self.base_model(context=None, context_id=None).log_softmax(-1)[0]  # [M, B, N] -> expert 0
        score = log_p.gather(1, actions) if is_credit_assigned or is_top1 else log_p.gather(1, candidate_actions).sum(1)
        return score.exp(), score
'''


def _load():
    return load_script("benchmarks/loss_speed.py")


@pytest.fixture
def fake_paper(tmp_path, monkeypatch):
    root = tmp_path / "paper"
    (root / "src" / "policy").mkdir(parents=True)
    (root / "src" / "__init__.py").write_text("")
    (root / "src" / "policy" / "__init__.py").write_text(FAKE_POLICY)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield root
    for name in [n for n in sys.modules if n == "src" or n.startswith("src.")]:
        del sys.modules[name]


TINY = ["--batch", "4", "--items", "30", "--reps", "1", "--warmup", "0"]


def test_every_estimator_variant_and_output(tmp_path, fake_paper, capsys):
    bench = _load()
    out = tmp_path / "out"
    result = bench.main(TINY + ["--configs", "4,1", "6,2", "--exact", "--exact-reps", "1", "--large",
                                "--large-items", "200", "--large-reps", "1", "--dim", "4", "--no-compile",
                                "--paper-code", str(fake_paper), "--out", str(out)])
    cells = result["cells"]
    assert all(c["error"] is None and c["ms"] > 0 and c["ratio"] > 0 for c in cells), cells
    got = {(c["N"], c["K"], c["M"], c["estimator"], c["variant"]) for c in cells}
    everyone = [n for n in bench.LABELS if n != "capg_exact"]
    want = set()
    for k, m in ((4, 1), (6, 2)):
        want |= {(n, k, m, "bare", "checks") for n in (30, 200)}
        want |= {(n, k, m, e, v) for n in (30, 200) for e in everyone for v in ("checks", "no checks")}
        want |= {(30, k, m, e, "paper code") for e in bench.PAPER_FLAGS}
        want |= {(30, k, m, "capg_exact", v) for v in ("checks", "no checks")}
    assert got == want
    extra = result["after_exact"]
    assert (extra["K"], extra["M"]) == (6, 2)
    assert min(extra["before_ms"], extra["first_after_ms"], extra["after_ms"], extra["exact_call_s"]) > 0
    assert json.loads((out / "results.json").read_text()) == result
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(cells)
    assert (out / "ratios.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "| N | K, M | estimator |" in table and "first call after" in table


def test_compiled_column_is_measured_or_skipped_with_its_error(tmp_path):
    bench = _load()
    result = bench.main(TINY + ["--configs", "4,2", "--estimators", "capg_swr", "--out", str(tmp_path)])
    (compiled,) = [c for c in result["cells"] if c["variant"] == "compiled"]
    if compiled["error"] is None:
        assert compiled["ms"] > 0 and compiled["compile_s"] > 0 and compiled["graphs"] >= 1
    else:  # a machine without a working inductor toolchain: the run goes on, the class is named
        assert compiled["ms"] is None and compiled["error"].split(":")[0].isidentifier()


def test_bench_accuracy_table_covers_every_builtin_method():
    """`capg-rec bench`'s accuracy table at N = 1000 (the enumeration method, N <= 8, is not in it)."""
    from capg_rec.bench import accuracy_table

    rows = accuracy_table(2000)
    assert len(rows) == 12
    for name in ("mean_field", "plugin", "with_replacement"):
        assert all(0 <= row[f"{name}_vs_exact"] < 1 for row in rows)
    assert all(row["mean_field_vs_exact"] < 0.03 for row in rows)  # the README's documented accuracy


def test_bench_accuracy_columns_follow_their_definitions(monkeypatch):
    """The accuracy table's columns on draws whose frequencies are known: rows alternate between the items
    [0, K) and [K, 2K), so each of those 2K items is seen in half the draws. Against Monte-Carlo, each method's
    mean |p - p_mc| / p_mc over the items seen (the denominator is the Monte-Carlo frequency), and the standard
    error's mean sqrt((1 - p_mc) / (p_mc n))."""
    import numpy as np

    from capg_rec.bench import accuracy_table

    def alternating(logits, k, generator=None):
        rows = torch.arange(logits.shape[0]).unsqueeze(1)
        return (rows % 2) * k + torch.arange(k)

    monkeypatch.setattr(capg_rec, "sample_candidates", alternating)
    n = 1000
    rows = accuracy_table(n)
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for row in rows:
        k, tau = row["K"], row["tau"]
        assert row["mc_items"] == 2 * k
        assert row["mc_se"] == pytest.approx(np.sqrt(0.5 / (0.5 * n)))
        p = capg_rec.inclusion_log_prob(logits, torch.arange(2 * k).unsqueeze(0), k, temperature=tau,
                                        method="exact").exp()[0]
        assert row["exact_vs_mc"] == pytest.approx(float(((p - 0.5).abs() / 0.5).mean()), rel=1e-9)


def test_bench_cost_table_survives_a_failed_bare_case(monkeypatch):
    """A bare case that fails (timeout, memory cap) while the others run leaves every row with an error naming it;
    before, the ratios raised KeyError and the whole bench stopped (found by review)."""
    import subprocess
    from types import SimpleNamespace

    from capg_rec import bench

    def run(cmd, **kwargs):
        if cmd[cmd.index("--case") + 1] == "bare":
            raise subprocess.TimeoutExpired(cmd, 1.0)
        return SimpleNamespace(returncode=0, stdout=json.dumps({"seconds": 0.01, "peak_mib": 1.0}), stderr="")

    monkeypatch.setattr(bench.subprocess, "run", run)
    rows = bench.cost_table([100], [(10, 1)], batch=2, dim=4, reps=1, case_timeout=1.0, memory_limit_gib=1.0)
    assert [row["estimator"] for row in rows] == list(bench.ESTIMATORS)
    assert all(row["error"].endswith("not finished within 1 s") for row in rows)

    def timed(cmd, **kwargs):  # every case 3x bare in time, 2x in memory
        bare = cmd[cmd.index("--case") + 1] == "bare"
        return SimpleNamespace(returncode=0, stdout=json.dumps({"seconds": 0.01 if bare else 0.03,
                                                                "peak_mib": 10.0 if bare else 20.0}), stderr="")

    monkeypatch.setattr(bench.subprocess, "run", timed)
    rows = bench.cost_table([100], [(10, 1)], batch=2, dim=4, reps=1, case_timeout=1.0, memory_limit_gib=1.0)
    # a case's cost over bare's (its inverse went unnoticed: a review's mutation)
    want = {True: (1.0, 1.0), False: (3.0, 2.0)}
    assert all((row["time_ratio"], row["memory_ratio"]) == pytest.approx(want[row["estimator"] == "bare"])
               for row in rows)


def test_old_new_comparison_runs_in_one_process(tmp_path):
    """benchmarks/loss_cost_ab.py against this very checkout (renamed): every cell, both versions, files written."""
    import subprocess

    root = ROOT
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "loss_cost_ab.py"), "--old", str(root),
                          "--reps", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TMPDIR": str(temporary)})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "ab.json").read_text())
    assert len(rows) == 4 * 5 * 2 and all(r["old_ms"] > 0 and r["new_ms"] > 0 for r in rows)
    assert (tmp_path / "ab.csv").exists()
    assert not list(temporary.iterdir())  # the earlier version's copy is removed (a review found it left behind)


def test_issue_reproductions_are_all_fixed():
    """benchmarks/issue_reproductions.py on this checkout: every line FIXED (a review found one that expected the
    behaviour before the checks of scores beyond resolution, which now refuse that draw)."""
    import subprocess

    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "issue_reproductions.py")], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and len(lines) >= 18 and all(line.startswith("FIXED") for line in lines), run.stdout


def test_train_logs_speed_writes_its_logs_for_the_run_and_deletes_them(tmp_path):
    """A review: logs left in --out from an earlier run were reused whatever -K, -L and --rows said, and kept."""
    module = load_script("benchmarks/train_logs_speed.py")
    for k in (5, 6):
        result = module.main(["--rows", "600", "-K", str(k), "-L", "2", "--batch-size", "64", "--steps", "3",
                              "--out", str(tmp_path)])
        assert result["K"] == k and result["L"] == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == ["train_logs_speed.json"]


def test_reverse_logcumsumexp_benchmark_runs_and_its_gradient_is_the_more_accurate(capsys):
    """benchmarks/reverse_logcumsumexp.py: a timing row per shape; capg_rec's gradient error against float64
    is finite and, at a spread of 10^4 in float32, below torch.logcumsumexp's."""
    load_script("benchmarks/reverse_logcumsumexp.py").main(["--reps", "1"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    timings = [r for r in rows if r[0].strip().startswith("[")]
    errors = {r[0].strip(): (float(r[1]), float(r[2])) for r in rows if r[0].strip() in ("1", "300", "10000")}
    assert len(timings) == 4 and all(float(r[1]) > 0 and float(r[2]) > 0 for r in timings)
    assert set(errors) == {"1", "300", "10000"}
    assert errors["10000"][1] < errors["10000"][0] / 10


def test_cpu_kernels_benchmark_times_every_kernel(capsys):
    """benchmarks/cpu_kernels.py: a row per kernel with positive times, printed as a table."""
    rows = load_script("benchmarks/cpu_kernels.py").main(["--reps", "1"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 19 and len(table) == 20
    assert all(ours > 0 and old > 0 and (other is None or other > 0) for _, ours, old, other in rows)


@pytest.mark.parametrize("script", ["benchmarks/cpu_kernels.py", "benchmarks/reverse_logcumsumexp.py"])
def test_benchmarks_refuse_no_repetitions(script, capsys):
    """--reps 0 is a usage error naming the option, not a failure to take the median of nothing."""
    with pytest.raises(SystemExit) as raised:
        load_script(script).main(["--reps", "0"])
    assert raised.value.code == 2 and "--reps must be >= 1, got 0" in capsys.readouterr().err


def test_scale_spreads_the_scores_and_is_recorded(tmp_path):
    """``--scale`` multiplies the scores (a trained ESR's are wider than standard normal) and is in the results."""
    bench = _load()
    base, wide = (bench.dense_problem(4, 30, 3, 2, scale=s) for s in (1.0, 3.0))
    assert (wide.leaves[0] - 3.0 * base.leaves[0]).abs().max() < 1e-5
    user, wide_user = (bench.embedding_problem(4, 30, 3, 1, 4, scale=s).leaves[0] for s in (1.0, 3.0))
    assert (wide_user - 3.0 * user).abs().max() < 1e-6
    result = bench.main(TINY + ["--configs", "4,1", "--estimators", "capg_swr", "--no-compile", "--scale", "3",
                                "--out", str(tmp_path)])
    assert result["meta"]["scale"] == 3.0


@pytest.mark.parametrize(("script", "argv", "named"), [
    ("loss_speed", ["--configs", "10"], "--configs"),
    ("loss_speed", ["--configs", "0,1"], "--configs"),
    ("loss_speed", ["--reps", "0"], "--reps"),
    ("loss_speed", ["--warmup", "-1"], "--warmup"),
    ("loss_speed", ["--paper-code", "/nonexistent"], "--paper-code"),
    ("offpolicy_speed", ["--warmup", "-3"], "--warmup"),
    ("sampled_cost", ["--one", "1000", "nonsense"], "--one"),
    ("sampled_cost", ["--one", "1000", "in_batch", "--batch-sizes", "16", "64"], "--batch-sizes"),  # 16 alone
    ("sampled_cost", ["--batch-sizes", "0"], "--batch-sizes"),
    ("sampled_accuracy", ["--seeds", "1"], "--seeds"),  # a standard deviation over one seed is NaN (a review)
    ("sampled_draw", ["--seeds", "1"], "--seeds"),
])
def test_nonsense_options_are_argparse_errors(script, argv, named, tmp_path, capsys):
    """Found by review: tracebacks from deep in the code (or a silently mislabelled timing) for nonsense options;
    each is now argparse's exit 2 naming the option, before anything runs."""
    module = load_script(f"benchmarks/{script}.py")
    with pytest.raises(SystemExit) as exit_info:
        module.main([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bench_case_times_cpu_and_takes_the_peak_of_its_own_steps(monkeypatch):
    """capg-rec bench timed a case with the wall clock (another process's load entered its ratios: 0.69x and 1.00x
    for one case in two runs) and charged the process's lifetime peak to the steps (what the setup touched, measured
    against the memory resident after it); a ratio to a bare peak of a few MiB was printed as if it meant something
    (found by review)."""
    from types import SimpleNamespace

    from capg_rec import bench

    clocks = {"process_time": 0.0, "perf_counter": 0.0}

    def clock(name, step):
        def read():
            clocks[name] += step
            return clocks[name]
        return read

    monkeypatch.setattr(bench, "time", SimpleNamespace(process_time=clock("process_time", 0.5),
                                                       perf_counter=clock("perf_counter", 100.0)))
    big = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB touched, then freed: not the case's
    del big
    result = bench.run_case("capg_swr", batch=2, num_items=50, k=2, experts=1, dim=4, reps=2)
    assert result["seconds"] == 0.5
    if bench._reset_peak() is not None:  # Linux: the high-water mark of the steps alone
        assert result["peak_mib"] < 64
    monkeypatch.setattr(bench, "_reset_peak", lambda: None)  # elsewhere: none, not the lifetime peak's remainder
    assert bench.run_case("capg_swr", batch=2, num_items=50, k=2, experts=1, dim=4, reps=1)["peak_mib"] is None

    def small(cmd, **kwargs):  # a bare peak of 3 MiB: page noise, no ratio to it
        bare = cmd[cmd.index("--case") + 1] == "bare"
        return SimpleNamespace(returncode=0, stdout=json.dumps({"seconds": 0.01, "peak_mib": 3.0 if bare else 270.0}),
                               stderr="")

    monkeypatch.setattr(bench.subprocess, "run", small)
    rows = bench.cost_table([100], [(10, 1)], batch=2, dim=4, reps=1, case_timeout=1.0, memory_limit_gib=1.0)
    assert all(row["memory_ratio"] is None for row in rows)
    assert all(bench._format_cost(row).endswith("— memory") for row in rows)

    def unmeasured(cmd, **kwargs):  # no high-water mark to reset: no peak, and no ratio
        return SimpleNamespace(returncode=0, stdout=json.dumps({"seconds": 0.01, "peak_mib": None}), stderr="")

    monkeypatch.setattr(bench.subprocess, "run", unmeasured)
    rows = bench.cost_table([100], [(10, 1)], batch=2, dim=4, reps=1, case_timeout=1.0, memory_limit_gib=1.0)
    assert all(row["memory_ratio"] is None and "— MiB" in bench._format_cost(row) for row in rows)
