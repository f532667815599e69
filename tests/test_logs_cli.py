"""``capg-rec log`` end to end at tiny sizes (fresh and checkpointed logging ESRs, read back with the
reader, propensities recomputed), its usage errors, and the reader benchmark script."""

import json
import os
import math

import pytest
import torch

from capg_rec.cli import main
from capg_rec.logs import LoggedImpressions, log_propensities
from capg_rec.sim.synthetic import synthetic_env
from capg_rec.train import Trainer, TrainConfig
from capg_rec.train.model import TwoTowerMoE
from tests.scripts import load_script



def _run(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


def _read_all(path, batch_size=1000):
    batches = list(LoggedImpressions(path, batch_size))
    return type(batches[0])(*(None if x[0] is None else torch.cat(x) for x in zip(*batches)))


def _assert_recomputed(model, batch, tau, eps, method):
    logits = model(batch.context)
    again = log_propensities(logits.detach().double(), batch.candidates, batch.shown, method=method, temperature=tau,
                             epsilon=eps)
    for name, x, y in zip(again._fields, again, (batch.log_inclusion, batch.log_expected_count,
                                                 batch.log_candidate_prob)):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9, msg=name)


def test_log_fresh_esr(tmp_path, capsys):
    out = tmp_path / "logs.parquet"
    code = _run(["log", "-n", "300", "-K", "8", "-L", "2", "--temperature", "2", "--epsilon", "0.2", "--batch-size",
                 "128", "--method", "plugin", "--lsr", "noisy", "--seed", "3", "--out", str(out), "--no-progress"])
    assert code == 0
    summary = json.loads((tmp_path / "logs.json").read_text())
    assert json.loads(capsys.readouterr().out) == summary
    assert summary["rows"] == 300 and summary["row_groups"] == 3 and summary["policy_version"] == "fresh-seed3"
    assert 0 < summary["mean_inclusion"] <= 1 and math.isfinite(summary["mean_reward"])
    data = LoggedImpressions(out, 100)
    assert data.num_rows == 300 and data.meta.method == "plugin" and data.meta.num_items == 1000
    assert data.meta.extra["epsilon"] == 0.2 and data.meta.extra["env"].startswith("synthetic")
    batch = _read_all(out)
    assert batch.candidates.shape == (300, 8) and batch.shown.shape == (300, 2) and batch.features is None
    # the summary's mean over rows and shown items (over rows alone went unnoticed: a review's mutation)
    assert summary["mean_inclusion"] == pytest.approx(float(batch.log_inclusion.double().exp().mean()), rel=1e-5)
    assert torch.equal(batch.request_id, torch.arange(300))
    env = synthetic_env()
    torch.testing.assert_close(batch.rewards.mean().item(), summary["mean_reward"], rtol=1e-5, atol=0)
    model = TwoTowerMoE(env.num_users, env.num_items, generator=torch.Generator().manual_seed(3))
    _assert_recomputed(model, batch, 2.0, 0.2, "plugin")


def test_log_from_checkpoint(tmp_path):
    env = synthetic_env()
    config = TrainConfig(num_candidates=6, num_outputs=2, num_experts=2, steps=2, batch_size=16, eval_every=2,
                         temperature=0.5)
    trainer = Trainer(env, config)
    trainer.run(out_dir=tmp_path / "run", checkpoint_every=2, progress=False)
    out = tmp_path / "from_ckpt.parquet"
    code = _run(["log", "--checkpoint", str(tmp_path / "run" / "checkpoint.pt"), "-n", "200", "--temperature",
                 "1.5", "--out", str(out), "--summary", str(tmp_path / "s.json"), "--no-progress"])
    assert code == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["policy_version"] == "checkpoint.pt@step2" and summary["checkpoint_step"] == 2
    data = LoggedImpressions(out, 64)
    assert (data.meta.num_candidates, data.meta.num_shown) == (6, 2)  # the checkpoint's K and L
    _assert_recomputed(trainer.model, _read_all(out), 1.5, 0.0, "mean_field")


@pytest.mark.parametrize("argv", [["--epsilon", "1.5"], ["--temperature", "0"], ["-K", "0"], ["-K", "3", "-L", "4"],
                                  ["--method", "nope"], ["--env", "kuairec"]])
def test_log_usage_errors(tmp_path, argv, capsys):
    assert _run(["log", "-n", "10", "--out", str(tmp_path / "x.parquet"), "--no-progress", *argv]) == 2
    assert "capg-rec log: error:" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "named"), [
    (["--embedding-dim", "0"], "argument --embedding-dim: must be an integer >= 1, got 0"),
    (["-L", "0"], "argument -L/--num-outputs: must be an integer >= 1"),
    (["-M", "0"], "argument -M/--num-experts: must be an integer >= 1"),
    (["-n", "0"], "argument -n/--num-interactions: must be an integer >= 1"),
    (["--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number > 0, got nan"),
    (["--epsilon", "nan"], "argument --epsilon: must be a number in [0, 1], got nan"),
    (["--epsilon", "-0.1"], "argument --epsilon: must be a number in [0, 1]"),
    (["-K", "4", "-L", "5"], "-L 5: more items shown than the K = 4 candidates"),
    (["-K", "1001"], "-K 1001: more candidates than the environment's 1000 items")])
def test_log_errors_name_the_option(tmp_path, capsys, argv, named):
    """Regression: these messages named a parameter ("dim must be >= 1", "num_outputs must be in [1, 4]")."""
    assert _run(["log", "-n", "10", "--out", str(tmp_path / "x.parquet"), "--no-progress", *argv]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize("argv", [["-K", "1000", "-L", "1"], ["-K", "4", "-L", "4"], ["--epsilon", "1"],
                                  ["--epsilon", "0"]])
def test_log_takes_the_options_bounds(tmp_path, argv):
    """The bounds themselves are valid: K = N (every item a candidate), L = K, ε = 1 and 0 (a mutation round: with
    the bounds exclusive, each was refused)."""
    assert _run(["log", "-n", "10", "--out", str(tmp_path / "x.parquet"), "--no-progress", *argv]) == 0


def test_log_checkpoint_env_mismatch(tmp_path, capsys):
    trainer = Trainer(synthetic_env(), TrainConfig(steps=1, batch_size=4, eval_every=1))
    trainer.save(tmp_path / "c.pt")
    assert _run(["log", "--checkpoint", str(tmp_path / "c.pt"), "--env", "movielens", "-n", "5",
                 "--out", str(tmp_path / "x.parquet")]) == 2
    assert "trained on 'synthetic'" in capsys.readouterr().err


def test_log_names_a_missing_or_corrupt_checkpoint(tmp_path, capsys):
    """Found by review: a missing checkpoint's message was the OS's alone, not naming --checkpoint; an intact one
    without the keys of a training run escaped as a KeyError."""
    from capg_rec.train.checkpoint import write_checkpoint

    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    write_checkpoint({"kind": "online"}, tmp_path / "partial.pt")
    for name in ("nothere.pt", "bad.pt", "partial.pt"):
        assert _run(["log", "--checkpoint", str(tmp_path / name), "-n", "5", "--out", str(tmp_path / "x.parquet")]) == 2
        err = capsys.readouterr().err
        assert "--checkpoint" in err and str(tmp_path / name) in err and "Traceback" not in err


def test_reader_benchmark_runs(tmp_path):
    module = load_script("benchmarks/log_reader_speed.py")
    result = module.main(["--rows", "3000", "-K", "6", "-L", "2", "--batch-size", "256", "--row-group-size", "1000",
                          "--workers", "0", "--trainer-steps", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "reader_speed.json").read_text())
    assert saved["rows"] == result["rows"] == 3000 and saved["reader_checked"]["rows_per_second"] > 0
    for reader in ("reader_checked", "reader_unchecked"):  # from the first batch on: after it, 3000 - 256 rows
        assert saved[reader]["rows_per_second_sustained"] > 0 and saved[reader]["seconds_to_first_batch"] > 0
        assert saved[f"ratio_sustained_{reader.split('_')[1]}"] > 0
    assert not (tmp_path / "synthetic_logs.parquet").exists()


def test_a_refused_log_run_leaves_the_existing_logs(tmp_path, capsys):
    """Options refused once logging has begun (ε, τ, the method) left a 0-row file where the logs were."""
    out = tmp_path / "logs.parquet"
    assert _run(["log", "-n", "40", "--batch-size", "20", "--out", str(out), "--no-progress"]) == 0
    for argv in (["--epsilon", "1.5"], ["--temperature", "-1"], ["--method", "with_replacement"]):
        assert _run(["log", "-n", "40", "--out", str(out), "--no-progress", *argv]) == 2
        assert "capg-rec log: error:" in capsys.readouterr().err
        assert LoggedImpressions(out, 16).num_rows == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.json", "logs.parquet"]


def test_log_refuses_a_summary_that_would_overwrite_the_logs_or_is_a_folder(tmp_path, capsys):
    """Regression (found by review): --out logs.json wrote the logs, then the summary over them (exit 0, the logs
    lost); a --summary folder failed with a traceback after the logs were written; a summary in a folder not yet
    there failed the same way. The first two exit 2 before any logging; the third is made."""
    assert _run(["log", "-n", "20", "--batch-size", "10", "--out", str(tmp_path / "logs.json"), "--no-progress"]) == 2
    assert "would overwrite the logs" in capsys.readouterr().err
    assert _run(["log", "-n", "20", "--out", str(tmp_path / "a.parquet"), "--summary", str(tmp_path / "a.parquet"),
                 "--no-progress"]) == 2
    (tmp_path / "folder").mkdir()
    assert _run(["log", "-n", "20", "--out", str(tmp_path / "b.parquet"), "--summary", str(tmp_path / "folder"),
                 "--no-progress"]) == 2
    assert "a folder, not a file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    assert _run(["log", "-n", "20", "--out", str(tmp_path / "c.parquet"), "--summary",
                 str(tmp_path / "new" / "s.json"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "new" / "s.json").read_text())["rows"] == 20


@pytest.mark.parametrize(("argv", "named"), [(["-M", "20"], "more experts than the K = 10 positions"),
                                             (["-M", "4", "-K", "3"], "more experts than the K = 3"),
                                             (["--seed", "-1"], "--seed must be in [0, 9223372036854775807]")])
def test_log_refuses_more_experts_than_positions_and_negative_seeds(tmp_path, capsys, argv, named):
    """Regression (found by review): accepted, where train refuses them."""
    assert _run(["log", "-n", "10", "--out", str(tmp_path / "x.parquet"), "--no-progress", *argv]) == 2
    assert named in capsys.readouterr().err


def test_log_names_a_checkpoint_trained_from_logs(tmp_path, capsys):
    """Regression (found by review): a train --logs checkpoint failed with "TrainConfig.__init__() got an
    unexpected keyword argument 'logs'"."""
    assert _run(["log", "-K", "5", "-L", "2", "-n", "600", "--batch-size", "200", "--out",
                 str(tmp_path / "logs.parquet"), "--no-progress"]) == 0
    assert _run(["train", "--logs", str(tmp_path / "logs.parquet"), "--batch-size", "100", "--holdout", "0.34",
                 "--out", str(tmp_path / "t")]) in (0, None)
    capsys.readouterr()
    assert _run(["log", "--checkpoint", str(tmp_path / "t" / "checkpoint.pt"), "-n", "10", "--out",
                 str(tmp_path / "again.parquet"), "--no-progress"]) == 2
    assert "a run trained from logs" in capsys.readouterr().err


def test_log_refuses_fewer_positions_than_the_checkpoints_experts(tmp_path, capsys):
    """Found by review: -K 2 for a 3-expert checkpoint logged with expert 2 never serving, under the checkpoint's
    version as if it were its ESR."""
    run = tmp_path / "m3"
    assert _run(["train", "-M", "3", "-K", "6", "--steps", "2", "--eval-every", "2", "--out", str(run)]) == 0
    capsys.readouterr()
    assert _run(["log", "--checkpoint", str(run / "checkpoint.pt"), "-K", "2", "-n", "10", "--no-progress",
                 "--out", str(tmp_path / "l.parquet")]) == 2
    assert "-K 2: fewer positions than the ESR's 3 experts" in capsys.readouterr().err
    assert not (tmp_path / "l.parquet").exists()
    assert _run(["log", "--seed", str(2**64), "-n", "10", "--out", str(tmp_path / "s.parquet")]) == 2


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, where no file can be made")
def test_an_out_file_that_cannot_be_written_is_named_as_given(capsys):
    """`log --out` where no file can be made named the hidden partial file it writes first (a review); LogWriter's
    OSError names the path it was given."""
    from capg_rec.logs import LogWriter

    assert _run(["log", "-n", "10", "--out", "/proc/capg_rec_no_such.parquet", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("capg-rec log: error: --out /proc/capg_rec_no_such.parquet: cannot write there "
                                       "(No such file or directory)\n")
    with pytest.raises(OSError, match=r"^\[Errno 2\] path /proc/capg_rec_no_such.parquet cannot be written"):
        LogWriter("/proc/capg_rec_no_such.parquet", num_candidates=2, num_shown=1)


def test_log_out_errors_name_out_on_a_read_only_file_system_and_behind_a_dangling_link(tmp_path, monkeypatch, capsys):
    """A diff review's findings: on a read-only file system LogWriter's clean-up (an unlink of the partial file that
    was never made) raised first, naming the hidden file; the command dropped the path of other write errors; a link
    to nothing on --out's path was not named."""
    import errno
    import pathlib

    import pyarrow.parquet as pq

    from capg_rec.logs import LogWriter

    (tmp_path / "dl").symlink_to(tmp_path / "nowhere")
    assert _run(["log", "-n", "10", "--no-progress", "--out", str(tmp_path / "dl" / "x.parquet")]) == 2
    assert f"{tmp_path / 'dl'} is a link to nothing, not a folder" in capsys.readouterr().err
    if os.path.isdir("/proc/self"):  # a --summary that cannot be written was found after the logs were (a traceback)
        logs = tmp_path / "z.parquet"
        assert _run(["log", "-n", "10", "--no-progress", "--out", str(logs), "--summary", "/proc/capg_rec_s.json"]) == 2
        assert "--summary /proc/capg_rec_s.json: cannot write there" in capsys.readouterr().err
        assert not logs.exists()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(pq, "ParquetWriter", read_only)
    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    with pytest.raises(OSError, match=rf"path {tmp_path / 'x.parquet'} cannot be written \(Read-only file system\)"):
        LogWriter(tmp_path / "x.parquet", num_candidates=2, num_shown=1)
    assert _run(["log", "-n", "10", "--no-progress", "--out", str(tmp_path / "y.parquet")]) == 2
    assert capsys.readouterr().err == (f"capg-rec log: error: --out {tmp_path / 'y.parquet'}: cannot write there "
                                       "(Read-only file system)\n")


def test_log_files_of_long_names_write_and_other_kinds_of_files_are_not_replaced(tmp_path):
    """A diff review's findings: a legal name of 235 characters was refused (the hidden partial file's name went past
    255 bytes); `--out /dev/null` run as root replaced the device by a regular file (here a FIFO stands for it)."""
    from capg_rec.logs import LogWriter, LoggedBatch

    path = tmp_path / ("n" * 235 + ".parquet")
    with LogWriter(path, num_candidates=2, num_shown=1) as writer:
        writer.write(LoggedBatch(torch.tensor([0]), torch.tensor([[0, 1]]), torch.tensor([[1]]), torch.ones(1, 1),
                                 torch.full((1, 1), -0.5, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64),
                                 torch.full((1,), -1.0, dtype=torch.float64)))
    assert path.is_file() and LoggedImpressions(path, 1).num_rows == 1
    for name in ("日" * 80, "a" * 247):  # 248 and 255 bytes: legal names, the hidden file's within the limit too
        with LogWriter(tmp_path / (name + ".parquet"), num_candidates=2, num_shown=1):
            pass
        assert (tmp_path / (name + ".parquet")).is_file()
    never_closed = LogWriter(tmp_path / ("b" * 247 + ".parquet"), num_candidates=2, num_shown=1)
    with pytest.warns(UserWarning, match="was never closed: .* its 0 rows are lost"):
        never_closed.__del__()  # no room for ".unclosed" beside this name: a warning, not a traceback
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nor a hidden file left
    never_closed._writer = None
    fifo = tmp_path / "fifo.parquet"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="path must be a regular file to create or replace, got .*fifo.parquet"):
        LogWriter(fifo, num_candidates=2, num_shown=1)
