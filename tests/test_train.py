"""The online trainer of capg_rec.train: learning, overflow handling, checkpoints, options, CLI."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re

import numpy as np
import pytest
import torch

from capg_rec import dcg_weights, group_normalize
from capg_rec.plackett_luce import greedy_candidates
from capg_rec.sim import MatrixEnv, synthetic_env
from capg_rec.train.cli import register
from capg_rec.train.checkpoint import read_checkpoint
from capg_rec.train.config import TrainConfig
from capg_rec.train.offpolicy import OffPolicyStudy
from capg_rec.train.reproduce import TARGETS, Cell, build_target, run_cells
from capg_rec.train.model import TwoTowerMoE
from capg_rec.train.trainer import Trainer, make_loss, policy_value
from capg_rec.train.variance import gradient_variance


@pytest.fixture(scope="module")
def env() -> MatrixEnv:
    return synthetic_env(0, num_users=60, num_items=50)


def _config(**kw) -> TrainConfig:
    base = dict(num_candidates=5, steps=40, batch_size=16, eval_every=20)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("estimator", ["vpg_swr", "capg_swr", "vpg", "capg"])
def test_trainer_learns_on_a_tiny_problem(env, estimator):
    steps = 60 if estimator == "capg" else 200
    method = dict(capg_method="plugin") if estimator == "capg" else {}
    trainer = Trainer(env, _config(estimator=estimator, steps=steps, eval_every=steps, **method))
    result = trainer.run(progress=False)
    start, end = result.history[0]["policy_value"], result.history[-1]["policy_value"]
    assert [row["step"] for row in result.history] == [0, steps]
    assert end > start + 0.3, (start, end)
    assert result.overflow_count == 0 and result.stopped_at is None


def test_a_user_lsr_with_invalid_picks_is_a_clear_error(env):
    """The step skips the loss's input checks, so it checks what a user's LSR returns itself."""
    repeat = lambda scores, n, g: (torch.zeros(scores.shape[0], n, dtype=torch.long), None)  # noqa: E731
    outside = lambda scores, n, g: (torch.full((scores.shape[0], n), scores.shape[1]), None)  # noqa: E731
    with pytest.raises(ValueError, match="LSR's picks must not repeat"):
        Trainer(env, _config(num_outputs=2), train_lsr=repeat).step()
    with pytest.raises(ValueError, match=r"LSR's picks must hold ids in \[0, 5\)"):
        Trainer(env, _config(), train_lsr=outside).step()


def test_policy_value_is_exact(env):
    trainer = Trainer(env, _config())
    users = torch.arange(env.num_users)
    with torch.no_grad():
        candidates = greedy_candidates(trainer.model(users), 5)
    expected = env.q.gather(1, candidates).max(dim=1).values.double().mean()  # optimal LSR, L = 1
    assert trainer.evaluate() == pytest.approx(float(expected), rel=1e-6)
    # A callable LSR without expected_value: one seeded draw, identical when repeated.
    value = policy_value(trainer.model, env, lambda s, n, g: (s.topk(n, dim=1).indices, None), 5, 1)
    assert value == pytest.approx(float(expected), rel=1e-6)


def test_evaluation_with_a_sampling_lsr_draws_a_new_stream_at_each_step(env):
    """A callable evaluation LSR without expected_value is drawn once per evaluation, seeded by seed + step: two
    evaluations of one model at different steps see different draws, each the one policy_value makes with that seed
    (a mutation round: seeding every evaluation alike left the tests passing)."""
    def sampling_lsr(scores, n, generator):
        return torch.rand(scores.shape, generator=generator).topk(n, dim=1).indices, None

    trainer = Trainer(env, _config(seed=3), eval_lsr=sampling_lsr)
    values = []
    for step in (0, 7):
        trainer.step_count = step  # the evaluation's seed, without moving the model
        values.append(trainer.evaluate())
        assert values[-1] == policy_value(trainer.model, env, sampling_lsr, 5, 1, seed=3 + step)
    assert values[0] != values[1]


def test_policy_value_over_more_users_than_one_chunk():
    """policy_value scores users in chunks of 256: with 300 users it is still their mean (dividing by the last
    chunk's size gave 5.08 for a mean of values in [0, 1]: a review's mutation)."""
    big = synthetic_env(0, num_users=300, num_items=40)
    trainer = Trainer(big, _config())
    with torch.no_grad():
        candidates = greedy_candidates(trainer.model(torch.arange(300)), 5)
    expected = big.q.gather(1, candidates).max(dim=1).values.double().mean()  # optimal LSR, L = 1
    assert trainer.evaluate() == pytest.approx(float(expected), rel=1e-6)


def test_context_baseline_is_a_moving_average_with_its_decay(env):
    """A user's baseline after rewards 1 then 0 at decay 0.9 is 0.9 (swapping decay and 1 - decay, 0.1, went
    unnoticed: a review's mutation); a group's rows are one user each (users repeated row by row, not tiled)."""
    trainer = Trainer(env, _config(baseline="context", baseline_decay=0.9))
    users = torch.tensor([3])
    trainer._baseline(users, torch.ones(1, 1))
    trainer._baseline(users, torch.zeros(1, 1))
    assert float(trainer._baseline(users, torch.zeros(1, 1))) == pytest.approx(0.9)
    grouped = Trainer(env, _config(group_size=3, batch_size=4))
    seen = []
    model = grouped.model

    class Spy(torch.nn.Module):
        def forward(self, users):
            seen.append(users)
            return model(users)

    grouped.model = Spy()
    grouped.step()
    rows = seen[0].view(4, 3)
    assert torch.equal(rows, rows[:, :1].expand(-1, 3)), rows


class _FakeLoss(torch.nn.Module):
    """A loss that is non-finite (value or gradient) at chosen calls."""

    def __init__(self, bad_calls: set[int], kind: str) -> None:
        super().__init__()
        self.bad_calls, self.kind, self.calls = bad_calls, kind, 0

    def forward(self, logits, candidates, chosen, rewards, *, position_weights=None, baseline=None):
        self.calls += 1
        loss = logits.logsumexp(-1).mean()
        if self.calls in self.bad_calls:
            if self.kind == "loss":
                return loss * float("inf")
            zero = (logits - logits.detach()).sum()  # 0 with gradient 1 ...
            return loss * 0 + torch.sqrt(zero)  # ... through sqrt at 0: finite loss, infinite gradient
        return loss


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_overflow_skip_counts_and_leaves_parameters(env, kind):
    trainer = Trainer(env, _config(on_overflow="skip", steps=6))
    trainer.loss_fn = _FakeLoss({2, 5}, kind)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.step()  # a good step changes the parameters
    after_good = [p.detach().clone() for p in trainer.model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after_good))
    _, overflowed = trainer.step()  # call 2 overflows: no change
    assert overflowed
    assert all(torch.equal(a, p) for a, p in zip(after_good, trainer.model.parameters()))
    result = trainer.run(progress=False)
    assert result.overflow_steps == [2, 5] and result.stopped_at is None and result.steps_done == 6
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_overflow_stop_ends_the_run(env):
    trainer = Trainer(env, _config(on_overflow="stop", steps=50))
    trainer.loss_fn = _FakeLoss({7}, "loss")
    result = trainer.run(progress=False)
    assert result.stopped_at == 7 and result.steps_done == 7 and result.overflow_count == 1
    assert result.history[-1]["step"] == 7  # evaluated at the interruption, as the paper reports


@pytest.mark.parametrize("on_overflow", ["stop", "skip"])
def test_an_update_that_overflows_the_parameters_ends_cleanly(env, tmp_path, on_overflow):
    """SGD at lr 1e6: the gradients are finite, the step makes the parameters huge. The next step's logits
    count as an overflow (so far apart that no draw can tell them apart; a review found the sampler's draw among
    such scores biased, and it now refuses them), and the evaluation that follows gave a traceback (non-finite
    logits) with no result.json; non-finite logits now give NaN (null in the files)."""
    trainer = Trainer(env, _config(optimizer="sgd", lr=1e6, steps=20, eval_every=5, on_overflow=on_overflow))
    result = trainer.run(out_dir=tmp_path, progress=False)
    assert result.overflow_count >= 1
    assert (result.stopped_at is not None) == (on_overflow == "stop")
    saved = json.loads((tmp_path / "result.json").read_text())["history"][-1]["policy_value"]
    assert saved == result.history[-1]["policy_value"]
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.fill_(math.inf)
    assert math.isnan(trainer.evaluate())


@pytest.mark.parametrize("options", [dict(), dict(baseline="context", adaptive_lr=True, train_lsr="noisy"),
                                     dict(group_size=3, group_offset=1.0, num_experts=2, num_outputs=2,
                                          position_weights="dcg")])
def test_checkpoint_resume_is_bit_identical(env, tmp_path, options):
    config = _config(steps=60, eval_every=20, **options)
    straight = Trainer(env, config)
    full = straight.run(progress=False)
    first = Trainer(env, config.replace(steps=30))
    first.run(out_dir=tmp_path, checkpoint_every=30, progress=False)
    resumed = Trainer.load(tmp_path / "checkpoint.pt", env, steps=60)
    result = resumed.run(out_dir=tmp_path, progress=False)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert result.history == full.history
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [r["step"] for r in result.history] == [0, 20, 40, 60]
    assert json.loads((tmp_path / "result.json").read_text())["steps_done"] == 60


def test_a_run_checkpoints_its_last_step_off_the_grid(env, tmp_path):
    """A run shorter than (or not a multiple of) checkpoint_every still leaves its end to resume from."""
    trainer = Trainer(env, _config(steps=7, eval_every=5))
    trainer.run(out_dir=tmp_path, checkpoint_every=5, progress=False)
    resumed = Trainer.load(tmp_path / "checkpoint.pt", env)
    assert resumed.step_count == 7
    for a, b in zip(trainer.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    # a finished run loaded again keeps its end-of-run evaluation (only an extended run drops it; dropping it always
    # went unnoticed: a review's mutation)
    assert [row["step"] for row in resumed.result.history] == [row["step"] for row in trainer.result.history] \
        == [0, 5, 7]


def test_interrupted_checkpoint_write_keeps_the_last_good_one(env, tmp_path, monkeypatch):
    trainer = Trainer(env, _config(steps=10))
    trainer.run(progress=False)
    path = tmp_path / "checkpoint.pt"
    trainer.save(path)
    good = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.step()

    def crash(obj, f, *args, **kwargs):
        f.write(b"partial garbage")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        trainer.save(path)
    monkeypatch.undo()
    restored = Trainer.load(path, env)
    assert all(torch.equal(good[k], v) for k, v in restored.model.state_dict().items())
    assert restored.step_count == 10


def _flip_inside(path, tensor: torch.Tensor) -> None:
    """Flip bytes in the middle of ``tensor``'s data inside the checkpoint file."""
    data = bytearray(path.read_bytes())
    raw = tensor.detach().numpy().tobytes()
    at = data.find(raw)
    assert at > 0
    for i in range(at + len(raw) // 2, at + len(raw) // 2 + 16):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_corrupt_checkpoint_is_refused(env, tmp_path):
    trainer = Trainer(env, _config(steps=10))
    trainer.run(progress=False)
    path = tmp_path / "checkpoint.pt"
    trainer.save(path)
    _flip_inside(path, trainer.model.state_dict()["user"])
    with pytest.raises(ValueError, match=f"checkpoint {re.escape(str(path))} is corrupt"):
        Trainer.load(path, env)


def test_corrupt_checkpoint_falls_back_to_the_previous_one(env, tmp_path):
    trainer = Trainer(env, _config(steps=10))
    path = tmp_path / "checkpoint.pt"
    for _ in range(5):
        trainer.step()
    trainer.save(path)
    good = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    for _ in range(5):
        trainer.step()
    trainer.save(path)  # the step-5 file is kept as checkpoint.pt.prev
    _flip_inside(path, trainer.model.state_dict()["user"])
    with pytest.warns(RuntimeWarning, match=r"is corrupt.*using the previous checkpoint .*\.prev \(step 5\)"):
        restored = Trainer.load(path, env)
    assert restored.step_count == 5
    assert all(torch.equal(good[k], v) for k, v in restored.model.state_dict().items())
    # The run that fell back saves again: the corrupt file is dropped, not rotated over the intact .prev (found by
    # review: the next save moved it there, and the only good checkpoint was gone).
    restored.step()
    restored.save(path)
    assert Trainer.load(path, env).step_count == 6
    assert read_checkpoint(tmp_path / "checkpoint.pt.prev")["step"] == 5
    # ...but a file it cannot read with no intact .prev beside it (an earlier capg_rec's, say) is kept as .prev, as
    # any replaced file is (found by the review of that fix: it was deleted)
    older = tmp_path / "older" / "checkpoint.pt"
    older.parent.mkdir()
    torch.save({"step": 1}, older)
    restored.save(older)
    assert (older.parent / "checkpoint.pt.prev").read_bytes()[:4] == b"PK\x03\x04"
    _flip_inside(path, restored.model.state_dict()["user"])
    _flip_inside(tmp_path / "checkpoint.pt.prev", good["user"])
    with pytest.raises(ValueError, match=r"checkpoint\.pt is corrupt.*checkpoint\.pt\.prev is corrupt"):
        Trainer.load(path, env)


class _Planted:
    """Unpickling this creates ``marker``: what a pickle-loaded file in --out could do."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_loading_a_checkpoint_runs_no_code(env, tmp_path):
    path, marker = tmp_path / "checkpoint.pt", tmp_path / "code-ran"
    torch.save({"version": 1, "planted": _Planted(marker)}, path)  # a bare pickle
    with pytest.raises(ValueError, match="not a capg_rec checkpoint"):
        Trainer.load(path, env)
    assert not marker.exists()
    from capg_rec.train.checkpoint import _encode

    buffer = io.BytesIO()
    torch.save({"version": 2, "planted": _Planted(marker)}, buffer)
    path.write_bytes(_encode(buffer.getvalue()))  # with a valid header and checksum
    with pytest.raises(ValueError, match="could run code"):
        Trainer.load(path, env)
    assert not marker.exists()


def test_load_keeps_the_saved_run_unless_told(env, tmp_path):
    trainer = Trainer(env, _config(steps=10))
    for _ in range(4):
        trainer.step()
    trainer.save(tmp_path / "c.pt")
    assert Trainer.load(tmp_path / "c.pt", env).config == trainer.config
    assert Trainer.load(tmp_path / "c.pt", env, steps=5).config.steps == 5
    for steps in (4, 2):
        with pytest.raises(ValueError, match="steps must be an int > the checkpoint's step 4"):
            Trainer.load(tmp_path / "c.pt", env, steps=steps)
    assert Trainer.load(tmp_path / "c.pt", env, steps=np.int64(5)).config.steps == 5  # numpy's ints too
    for steps in (5.0, True):  # a TypeError, as for any count (a ValueError before)
        with pytest.raises(TypeError, match="steps must be an int"):
            Trainer.load(tmp_path / "c.pt", env, steps=steps)
    other = MatrixEnv(env.q, env.reward_std, env.lsr_scores, name="other")
    with pytest.raises(ValueError, match="env must be the checkpoint's"):
        Trainer.load(tmp_path / "c.pt", other)


def _train_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="capg-rec")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *argv])
    return args.func(args)


class _Started(Exception):
    pass


def test_cli_resume_continues_the_saved_run(tmp_path, monkeypatch, capsys):
    out = ["--out", str(tmp_path)]
    assert _train_cli(*out, "--steps", "10", "-K", "5", "--batch-size", "16", "--eval-every", "10",
                      "--checkpoint-every", "10", "--lr", "0.05", "--seed", "3") == 0
    saved = Trainer.load(tmp_path / "checkpoint.pt", synthetic_env()).config
    started = []

    def fake_run(self, **kwargs):
        started.append(self.config)
        raise _Started

    monkeypatch.setattr(Trainer, "run", fake_run)
    with pytest.raises(_Started):
        _train_cli(*out, "--resume")
    assert started[-1] == saved and saved.steps == 10 and saved.lr == 0.05 and saved.num_candidates == 5
    with pytest.raises(_Started):  # options equal to the saved ones, and a longer run
        _train_cli(*out, "--resume", "--steps", "25", "--lr", "0.05", "-K", "5", "--estimator", "capg_swr")
    assert started[-1] == saved.replace(steps=25)
    with pytest.raises(_Started):  # the run's own method, named (review: refused, "saved: None")
        _train_cli(*out, "--resume", "--capg-method", "with_replacement")
    assert started[-1] == saved
    for extra, named in [(("--estimator", "vpg"), "--estimator vpg (saved: 'capg_swr')"),
                         (("--capg-method", "mean_field"), "--capg-method mean_field (saved: 'with_replacement')"),
                         (("--lr", "0.1"), "--lr 0.1 (saved: 0.05)"), (("--seed", "0"), "--seed 0"),
                         (("--adaptive-lr",), "--adaptive-lr True"), (("--env", "movielens"), "--env movielens"),
                         (("--steps", "10"), "--steps 10: the saved run is at step 10"),
                         (("--steps", "5"), "--steps 5: the saved run is at step 10")]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            _train_cli(*out, "--resume", *extra)
        assert exit_info.value.code == 2 and named in capsys.readouterr().err
    assert len(started) == 3
    with pytest.raises(SystemExit) as exit_info:
        _train_cli("--out", str(tmp_path / "none"), "--resume")
    assert exit_info.value.code == 2 and "no checkpoint" in capsys.readouterr().err


def test_reproduce_refuses_to_overwrite_a_longer_run(env, tmp_path):
    """Found by review: a reproduce run of fewer steps than one saved in its folder (finished, or interrupted past
    them) trained a new run into that folder, overwriting the longer one; one folder, one run, as for train."""
    cell = Cell("K=5", _config(steps=20, eval_every=10))
    run_cells(env, [cell], [0], tmp_path, checkpoint_every=10, progress=False)
    run_dir = next((tmp_path / "runs").iterdir())
    saved = {path.name: path.read_bytes() for path in run_dir.iterdir()}
    shorter = Cell("K=5", _config(steps=10, eval_every=10))
    with pytest.raises(ValueError, match="holds this run at step 20 of 20: a run of 10 steps would overwrite it"):
        run_cells(env, [shorter], [0], tmp_path, checkpoint_every=10, progress=False)
    (run_dir / "result.json").unlink()  # an interrupted longer run: only its step-20 checkpoint is left
    with pytest.raises(ValueError, match="holds this run at step 20 of 20: a run of 10 steps would overwrite it"):
        run_cells(env, [shorter], [0], tmp_path, checkpoint_every=10, progress=False)
    assert {path.name: path.read_bytes() for path in run_dir.iterdir()} == {
        name: data for name, data in saved.items() if name != "result.json"}
    # its checkpoint exactly at the steps asked (interrupted at step 10 of 20): refused alike
    other = tmp_path / "other"
    trainer = Trainer(env, cell.config.replace(seed=0))
    for _ in range(10):
        trainer.step()
    run_cells(env, [Cell("K=5", _config(steps=5, eval_every=5))], [0], other, progress=False)  # makes the folder
    (only,) = (other / "runs").iterdir()
    (only / "result.json").unlink()
    trainer.save(only / "checkpoint.pt")
    with pytest.raises(ValueError, match="holds this run at step 10 of 20: a run of 10 steps would overwrite it"):
        run_cells(env, [shorter], [0], other, checkpoint_every=10, progress=False)
    # a finished run of the steps asked whose result.json is gone: trained again, as before (nothing longer lost)
    finished = tmp_path / "finished"
    run_cells(env, [shorter], [0], finished, checkpoint_every=10, progress=False)
    (next((finished / "runs").iterdir()) / "result.json").unlink()
    (result,) = run_cells(env, [shorter], [0], finished, checkpoint_every=10, progress=False)[("CA-PG-SwR", "K=5")]
    assert result.steps_done == 10


def test_reproduce_refuses_to_overwrite_a_run_of_another_configuration(env, tmp_path):
    """Found by review: a run whose configuration differs from the one in its folder but for what the folder's
    name says (another --eval-every, say) was trained into it, replacing the earlier run's results."""
    run_cells(env, [Cell("K=5", _config(steps=20, eval_every=10))], [0], tmp_path, checkpoint_every=10,
              progress=False)
    run_dir = next((tmp_path / "runs").iterdir())
    saved = {path.name: path.read_bytes() for path in run_dir.iterdir()}
    other = Cell("K=5", _config(steps=20, eval_every=5))
    message = "holds a run of another configuration \\(eval_every=10 there, 5 here\\): a run here would overwrite it"
    with pytest.raises(ValueError, match=message):
        run_cells(env, [other], [0], tmp_path, checkpoint_every=10, progress=False)
    (run_dir / "result.json").unlink()  # an interrupted run: only its checkpoint is left
    with pytest.raises(ValueError, match=message):
        run_cells(env, [other], [0], tmp_path, checkpoint_every=10, progress=False)
    # an interrupted run on another environment, refused as a finished one is (it was trained over: the diff review)
    another = MatrixEnv(env.q, env.reward_std, env.lsr_scores, name="another")
    with pytest.raises(ValueError, match=f"holds a run on {re.escape(env.name)}, not on another"):
        run_cells(another, [Cell("K=5", _config(steps=20, eval_every=10))], [0], tmp_path, progress=False)
    assert {path.name: path.read_bytes() for path in run_dir.iterdir()} == {
        name: data for name, data in saved.items() if name != "result.json"}


def test_reproduce_reuses_a_diverged_run(env, tmp_path):
    """Regression (found by review): a run whose value went NaN saved it as null, and reusing the run read None
    back (a TypeError in the summary's arithmetic); it is NaN again, in the table as in the first call."""
    from capg_rec.train.reproduce import summarize

    cell = Cell("K=5", _config(estimator="vpg", steps=6, eval_every=2, lr=1e30, optimizer="sgd"))
    first = run_cells(env, [cell], [0], tmp_path, progress=False)
    assert math.isnan(first[("V-PG", "K=5")][0].history[-1]["policy_value"])
    again = run_cells(env, [cell], [0], tmp_path, progress=False)  # reused from result.json
    assert math.isnan(again[("V-PG", "K=5")][0].history[-1]["policy_value"])
    table = summarize("t", env, [cell], first, tmp_path, steps=6)
    assert summarize("t", env, [cell], again, tmp_path, steps=6) == table


def test_reproduce_plots_what_its_tables_hold_one_colour_per_method(env, tmp_path, monkeypatch):
    """Found by review: table3's L = 5 cells were tabled as sums over the positions and plotted per position; a method
    the paper does not name (CA-PG (plugin)) took a new colour of matplotlib's cycle for each seed, other methods'
    among them; a run that overflowed got its dot at its NaN value (invisible)."""
    from capg_rec.train import report
    from capg_rec.train.reproduce import summarize

    drawn = {}

    def plot_curves(panels, path, **kwargs):
        drawn.update(panels=panels, **kwargs)

    monkeypatch.setattr("capg_rec.train.reproduce.plot_curves", plot_curves)
    cells = [Cell("L=5", _config(estimator="capg_swr", steps=4, eval_every=2), scale=5.0)]
    results = run_cells(env, cells, [0], tmp_path, progress=False)
    summarize("t", env, cells, results, tmp_path, steps=4)
    plotted = drawn["panels"]["L=5"]["CA-PG-SwR"][0][-1]["policy_value"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert plotted == pytest.approx(saved["cells"][0]["values"][0]) and saved["cells"][0]["positions_summed"] == 5
    assert "sum over positions" in drawn["ylabel"] and drawn["optimum"] == {"L=5": None}
    # the optimal LSR's best value on its panels only, and panels of sums beside per-position ones on their own axes
    mixed = [Cell("uniform", _config(estimator="capg_swr", steps=4, eval_every=2, eval_lsr="uniform")),
             Cell("K=5", _config(estimator="capg_swr", steps=4, eval_every=2))]
    summarize("t", env, mixed, run_cells(env, mixed, [0], tmp_path / "u", progress=False), tmp_path / "u", steps=4)
    assert drawn["optimum"] == {"uniform": None, "K=5": pytest.approx(env.optimal_value(1))} and drawn["sharey"]
    wider = [Cell("L=3", _config(estimator="capg_swr", steps=4, eval_every=2, num_outputs=3))]  # per position
    summarize("t", env, wider, run_cells(env, wider, [0], tmp_path / "w", progress=False), tmp_path / "w", steps=4)
    assert drawn["optimum"] == {"L=3": None}  # the best value drawn is L = 1's (a diff review)
    both = cells + mixed[1:]
    summarize("t", env, both, run_cells(env, both, [0], tmp_path / "b", progress=False), tmp_path / "b", steps=4)
    assert not drawn["sharey"]
    colors = report.method_colors(["CA-PG (plugin)", "V-PG-SwR", "CA-PG (plugin)", "mine", "CA-PG"])
    assert colors == {"CA-PG (plugin)": colors["CA-PG (plugin)"], "V-PG-SwR": "tab:orange", "mine": colors["mine"],
                      "CA-PG": "tab:blue"}
    assert len(set(colors.values())) == 4 and not {colors["mine"], colors["CA-PG (plugin)"]} & set(
        report.METHOD_COLORS.values())
    import matplotlib.pyplot as plt

    seen = []
    monkeypatch.setattr(plt, "close", lambda fig: seen.append(fig))
    nan = float("nan")
    history = [{"step": 0, "policy_value": 1.0}, {"step": 2, "policy_value": 2.0},
               {"step": 4, "policy_value": nan, "overflows": 1}]
    report.plot_curves({"p": {"mine": [history, history, history], "V-PG": [history]}}, tmp_path / "c.png")
    lines = seen[0].axes[0].get_lines()
    assert len({line.get_color() for line in lines if line.get_label() != "best possible (optimal LSR)"}) == 2
    dots = [line for line in lines if line.get_marker() == "o"]
    assert dots and all(list(dot.get_xdata()) == [2] and list(dot.get_ydata()) == [2.0] for dot in dots)


def test_reproduce_refuses_runs_of_another_environment_and_repeated_cells(env, tmp_path, capsys):
    """A finished run is reused only for its own environment (the same config on another env or data file
    was reported as this one's); a repeated K or estimator would count one run twice."""
    cell = Cell("K=5", _config(steps=10, eval_every=10))
    run_cells(env, [cell], [0], tmp_path, progress=False)
    assert json.loads(next((tmp_path / "runs").glob("*/result.json")).read_text())["env"] == env.name
    assert run_cells(env, [cell], [0], tmp_path, progress=False)[("CA-PG-SwR", "K=5")][0].steps_done == 10
    other = MatrixEnv(env.q, env.reward_std, env.lsr_scores, name="another")
    with pytest.raises(ValueError, match=f"holds a run on {re.escape(env.name)}, not on another"):
        run_cells(other, [cell], [0], tmp_path, progress=False)
    with pytest.raises(ValueError, match="ks must not repeat a value"):
        build_target("table2", steps=10, ks=[5, 5])
    with pytest.raises(ValueError, match="estimators must not repeat"):
        build_target("table2", steps=10, estimators=["capg", "capg"])
    for grid in (dict(sizes=(10_000, 10_000)), dict(ks=(10, 10)), dict(seeds=(0, 0)),
                 dict(learners=("capg_clip", "capg_clip"))):
        with pytest.raises(ValueError, match=f"{next(iter(grid))} must not repeat"):
            OffPolicyStudy(**grid)
    from capg_rec.train.variance import gradient_variance_report
    with pytest.raises(ValueError, match="ks must not repeat"):
        gradient_variance_report(tmp_path / "v", ks=[2, 2])
    parser = argparse.ArgumentParser(prog="capg-rec")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["reproduce", "table2", "--ks", "5", "5", "--out", str(tmp_path / "t")])
    with pytest.raises(SystemExit) as exit_info:
        args.func(args)
    assert exit_info.value.code == 2 and "ks must not repeat" in capsys.readouterr().err


def test_group_normalisation_and_baseline_reach_the_loss(env):
    seen = {}

    class Spy(torch.nn.Module):
        def forward(self, logits, candidates, chosen, rewards, *, position_weights=None, baseline=None):
            seen.update(rewards=rewards, baseline=baseline, weights=position_weights)
            return logits.logsumexp(-1).mean()

    trainer = Trainer(env, _config(group_size=4, group_offset=2.0, baseline="context", num_outputs=2,
                                   position_weights="sum"))
    trainer.loss_fn = Spy()
    trainer.step()
    groups = seen["rewards"].view(16, 4, 2)
    torch.testing.assert_close(groups.mean(dim=1), torch.full((16, 2), 2.0), atol=1e-5, rtol=0)
    assert seen["baseline"].shape == (64,)
    assert torch.equal(seen["weights"], torch.ones(2))


def test_a_run_records_the_lsrs_it_used_and_resumes_only_with_them(env, tmp_path):
    """Regression (found by review): a Trainer given LSR callables wrote the config's names ("optimal") into its
    result.json and checkpoint, and a resume went on under the config's LSRs without a word (the curve then mixed
    two rankers). A callable is recorded by its repr and must be passed again; another name given is kept."""
    from capg_rec.sim import NoisyLSR, UniformLSR

    trainer = Trainer(env, _config(steps=20, eval_every=10), train_lsr=UniformLSR(), eval_lsr=NoisyLSR(3.0))
    trainer.run(out_dir=tmp_path, checkpoint_every=10, progress=False)
    recorded = json.loads((tmp_path / "result.json").read_text())["config"]
    assert recorded["train_lsr"] == "custom: UniformLSR()"
    assert recorded["eval_lsr"] == "custom: NoisyLSR(temperature=3.0)"
    with pytest.raises(ValueError, match=r"trained with a train_lsr of its own \(custom: UniformLSR\(\)\): pass it "
                                         r"again"):
        Trainer.load(tmp_path / "checkpoint.pt", env, steps=30)
    with pytest.raises(ValueError, match="eval_lsr of its own"):
        Trainer.load(tmp_path / "checkpoint.pt", env, train_lsr=UniformLSR(), steps=30)
    again = Trainer.load(tmp_path / "checkpoint.pt", env, train_lsr=UniformLSR(), eval_lsr=NoisyLSR(3.0), steps=30)
    assert again.result.config["eval_lsr"] == "custom: NoisyLSR(temperature=3.0)"
    named = Trainer(env, _config(steps=10, eval_every=10), eval_lsr="uniform")
    named.run(out_dir=tmp_path / "named", checkpoint_every=10, progress=False)
    resumed = Trainer.load(tmp_path / "named" / "checkpoint.pt", env, steps=20)
    assert isinstance(resumed.eval_lsr, UniformLSR) and resumed.result.config["eval_lsr"] == "uniform"


def test_adaptive_lr_factor(env):
    assert Trainer(env, _config(adaptive_lr=True)).result.lr == pytest.approx(1e-2)  # optimal LSR: 1
    uniform = Trainer(env, _config(adaptive_lr=True, train_lsr="uniform"))
    assert uniform.result.lr == pytest.approx(5e-2)  # propensity 1/K = 1/5
    with pytest.raises(ValueError, match="propensities"):
        Trainer(env, _config(adaptive_lr=True), train_lsr=lambda s, n, g: (s.topk(n, dim=1).indices, None))


@pytest.mark.parametrize("bad", [dict(estimator="ppo"), dict(num_outputs=6), dict(num_experts=6),
                                 dict(lr=-1.0), dict(steps=0), dict(on_overflow="ignore"),
                                 dict(train_lsr="greedy"), dict(group_offset=-1.0), dict(baseline_decay=1.0),
                                 dict(capg_method="magic"), dict(capg_method="exact"),
                                 dict(estimator="vpg", capg_method="plugin"), dict(position_weights="linear"),
                                 dict(temperature=0.0)])
def test_bad_config_raises(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        _config(**bad)


@pytest.mark.parametrize("bad", [dict(batch_size=1.5), dict(steps="10"), dict(adaptive_lr="yes"), dict(estimator=3),
                                 dict(temperature=None), dict(seed=True)])
def test_config_values_of_the_wrong_type_are_type_errors(bad):
    """Regression (found by review): wrong types raised ValueError (or, for steps='10', a bare comparison error)."""
    name = next(iter(bad))
    with pytest.raises(TypeError, match=name):
        _config(**bad)


def test_bad_trainer_arguments(env, tmp_path):
    with pytest.raises(ValueError, match="num_candidates"):
        Trainer(env, _config(num_candidates=51))
    with pytest.raises(TypeError, match="env"):
        Trainer("synthetic", _config())
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        Trainer(env, {"steps": 3})
    with pytest.raises(ValueError, match="checkpoint_every needs an out_dir"):
        Trainer(env, _config()).run(checkpoint_every=10, progress=False)
    trainer = Trainer(env, _config(steps=2))
    trainer.save(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="env"):
        Trainer.load(tmp_path / "c.pt", synthetic_env(0, num_users=61, num_items=50))


def test_targets_and_cli(tmp_path, capsys):
    for target in TARGETS:
        if target == "kuairec":
            with pytest.raises(ValueError, match="data"):
                build_target(target, steps=10)
            continue
        factory, cells = build_target(target, steps=10)
        assert cells and all(c.config.steps == 10 for c in cells)
    parser = argparse.ArgumentParser(prog="capg-rec")
    register(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "t2"
    args = parser.parse_args(["reproduce", "table2", "--steps", "20", "--seeds", "1", "--ks", "5",
                              "--eval-every", "10", "--out", str(out)])
    assert args.func(args) == 0
    text = (out / "results.md").read_text()
    assert "CA-PG-SwR" in text and "7.37" in text  # the paper's number next to ours
    assert "± n/a" in text and "± 0.00" not in text  # one seed: no standard error (it read 0.00)
    assert all(cell["se"] is None for cell in json.loads((out / "results.json").read_text())["cells"])
    for name in ("results.csv", "results.json", "curves.png"):
        assert (out / name).stat().st_size > 0
    out = tmp_path / "plugin"
    args = parser.parse_args(["reproduce", "table2", "--steps", "10", "--seeds", "1", "--ks", "5", "--estimators",
                              "vpg", "capg", "--capg-method", "plugin", "--eval-every", "10", "--out", str(out)])
    assert args.func(args) == 0
    rows = json.loads((out / "results.json").read_text())["cells"]
    assert {r["method"] for r in rows} == {"V-PG", "CA-PG (plugin)"}
    assert [r["config"]["capg_method"] for r in rows] == [None, "plugin"]
    assert (out / "runs" / "capg_plugin_K5_seed0" / "result.json").exists()
    with pytest.raises(ValueError, match="capg_method"):
        build_target("table2", steps=10, estimators=["capg"], capg_method="magic")
    with pytest.raises(ValueError, match="'capg' estimator"):
        build_target("table2", steps=10, capg_method="plugin")  # the default cells have no CA-PG
    args = parser.parse_args(["reproduce", "variance", "--capg-method", "plugin", "--out", str(tmp_path / "v")])
    with pytest.raises(SystemExit) as exit_info:
        args.func(args)
    assert exit_info.value.code == 2 and "variance" in capsys.readouterr().err
    args = parser.parse_args(["train", "--steps", "20", "--eval-every", "10", "-K", "5", "--out",
                              str(tmp_path / "tr"), "--checkpoint-every", "10"])
    assert args.func(args) == 0
    args = parser.parse_args(["train", "--steps", "30", "--out", str(tmp_path / "tr"), "--resume"])
    assert args.func(args) == 0
    assert json.loads((tmp_path / "tr" / "result.json").read_text())["steps_done"] == 30
    assert "under the optimal LSR after 30 steps (best achievable under the optimal LSR" in capsys.readouterr().out
    args = parser.parse_args(["train", "--steps", "2", "--eval-every", "2", "-K", "5", "--eval-lsr", "uniform",
                              "--out", str(tmp_path / "uni")])
    assert args.func(args) == 0  # the value printed is the eval LSR's, the best the optimal LSR's (found by review)
    assert "under the uniform LSR after 2 steps (best achievable under the optimal LSR" in capsys.readouterr().out
    # the README's promise: metrics as CSV and a learning curve (only metrics.jsonl and result.json were written)
    rows = (tmp_path / "tr" / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,") and [r.split(",")[0] for r in rows[1:]] == ["0", "10", "20", "30"]
    assert (tmp_path / "tr" / "curves.png").stat().st_size > 0


def test_gradient_variance_of_a_k_does_not_depend_on_the_other_ks(env, tmp_path):
    """A review: one generator ran through every K, so K = 10's row changed with the Ks asked before it; and a K
    beyond the catalog was refused only after the Ks before it were computed, leaving an empty output folder."""
    alone = gradient_variance(env, [10], ["vpg", "capg_swr"], num_users=2, samples=50, seed=3)
    after = gradient_variance(env, [5, 10], ["vpg", "capg_swr"], num_users=2, samples=50, seed=3)
    assert alone == [row for row in after if row["K"] == 10]
    # a diff review: seed -1, which torch takes (as 2^64 - 1), was refused by numpy's seeding of each K
    assert gradient_variance(env, [10], ["vpg"], num_users=1, samples=20, seed=-1) == \
        gradient_variance(env, [10], ["vpg"], num_users=1, samples=20, seed=2**64 - 1)
    from capg_rec.train.variance import gradient_variance_report

    with pytest.raises(ValueError, match="K must be"):
        gradient_variance_report(tmp_path / "v", ks=[10, 2000], samples=50, num_users=2)
    assert not (tmp_path / "v").exists()


def test_gradient_variance_grows_with_k_for_vpg_only(env):
    rows = gradient_variance(env, [2, 20], ["vpg", "capg_swr"], num_users=4, samples=400, seed=0)
    var = {(r["estimator"], r["K"]): r["variance"] for r in rows}
    assert var[("V-PG", 20)] > 3 * var[("V-PG", 2)]
    assert var[("CA-PG-SwR", 20)] < var[("V-PG", 20)] / 3


def test_demo_and_bench_run(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="capg-rec")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo", "--steps", "24", "--out", str(tmp_path / "demo")])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "V-PG-SwR" in printed and "CA-PG-SwR" in printed and "curves.png" in printed
    # a review: a demo of other --steps into the same folder ended in a traceback (exit 1)
    args = parser.parse_args(["demo", "--steps", "36", "--out", str(tmp_path / "demo")])
    with pytest.raises(SystemExit) as exit_info:
        args.func(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "capg-rec demo: error: --out: " in err and "holds a run of another" in err
    assert "give the --steps of the run there" in err
    # a diff review: a damaged result.json got the --steps hint and no file name (a bare JSON error)
    damaged = next((tmp_path / "demo" / "runs").glob("*/result.json"))
    damaged.write_text('{"config": ', encoding="utf-8")
    args = parser.parse_args(["demo", "--steps", "24", "--out", str(tmp_path / "demo")])
    with pytest.raises(SystemExit) as exit_info:
        args.func(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"{damaged} is not a readable result" in err and "--steps" not in err
    from capg_rec.train.bench import bench_train_step

    timings = bench_train_step("capg_swr", repeats=2, warmup=1, logit_scale=10.0)
    assert timings["step"] > 0 and timings["ratio"] > 0
    with pytest.raises(ValueError, match="logit_scale"):
        bench_train_step("capg_swr", repeats=2, warmup=1, logit_scale=-1.0)
    from capg_rec.train.bench import main as bench_main

    # review: these ended in tracebacks (a StatisticsError for no repeats)
    for argv, message in ((["-K", "0"], "-K/--num-candidates: must be an integer >= 1"),
                          (["--repeats", "0"], "--repeats: must be an integer >= 1"),
                          (["--logit-scale", "-1"], "--logit-scale: must be a finite number > 0"),
                          (["-K", "2000"], "--num-candidates must be at most the environment's 1000 items")):
        with pytest.raises(SystemExit) as exit_info:
            bench_main(["--estimators", "capg_swr", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_adaptive_lr_matches_the_papers_rounded_values():
    # Appendix: with base lr 1e-2 the adaptive rates of "noisy", "uniform", "anti" are 2e-2, 1e-1, 1e-2.
    env = synthetic_env()
    lrs = {lsr: Trainer(env, TrainConfig(estimator="capg_swr", train_lsr=lsr, adaptive_lr=True)).result.lr
           for lsr in ("noisy", "uniform", "anti")}
    assert round(lrs["noisy"], 2) == 0.02
    assert lrs["uniform"] == pytest.approx(0.1) and lrs["anti"] == pytest.approx(0.01)


def test_package_ships_its_license_and_type_marker():
    """The metadata declares MIT: the LICENSE file says so; py.typed is shipped as package data."""
    import importlib.resources
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    license_text = (root / "LICENSE").read_text(encoding="utf-8")
    assert license_text.startswith("MIT License") and "Copyright (c) 2026 the capg_rec authors" in license_text
    assert importlib.resources.files("capg_rec").joinpath("py.typed").is_file()
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["license"] == {"text": "MIT"}
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["capg_rec"]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"rewards": torch.tensor([[1.0, math.nan], [0.0, 1.0]])}, ValueError, "rewards must be finite"),
    ({"rewards": [[1.0, 2.0]]}, TypeError, "rewards must be a torch.Tensor"),
    ({"rewards": torch.tensor([[1, 2]])}, TypeError, "rewards must have a floating dtype"),
    ({"eps": 0.0}, ValueError, "eps must be a finite number > 0"),
    ({"eps": -0.0}, ValueError, "eps must be a finite number > 0"),
    ({"offset": math.nan}, ValueError, "offset must be finite"),
    ({"offset": "1"}, TypeError, "offset must be a number"),
    ({"dim": 5}, ValueError, r"dim must be in \[-2, 2\)"),
    ({"dim": 0.0}, TypeError, "dim must be an int"),
])
def test_group_normalize_names_bad_input(kwargs, error, match):
    """Regression: group_normalize checked nothing (NaN rewards or eps = 0 on a constant group gave NaN;
    a list, a bad dim or integer rewards failed inside torch)."""
    args = {"rewards": torch.tensor([[1.0, 2.0], [1.0, 2.0]]), **kwargs}
    rewards = args.pop("rewards")
    with pytest.raises(error, match=match):
        group_normalize(rewards, **args)


def test_group_normalize_and_dcg_weights_values():
    r = torch.tensor([[1.0, 5.0], [3.0, 5.0]], dtype=torch.float64)
    torch.testing.assert_close(group_normalize(r, offset=2.0, eps=1e-12),
                               torch.tensor([[1.0, 2.0], [3.0, 2.0]], dtype=torch.float64))
    torch.testing.assert_close(dcg_weights(3, dtype=torch.float64),
                               1.0 / torch.log2(torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64)))
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        dcg_weights(3, dtype=torch.long)
    # half precision: in float32, returned in its dtype (a constant float16 group was NaN: eps rounds to 0 there;
    # found by review)
    for dtype in (torch.float16, torch.bfloat16):
        torch.testing.assert_close(group_normalize(torch.ones(4, 3, dtype=dtype), offset=1.0),
                                   torch.ones(4, 3, dtype=dtype))
        torch.testing.assert_close(group_normalize(r.to(dtype), offset=2.0), group_normalize(r, offset=2.0).to(dtype))


def test_group_normalize_puts_a_constant_group_at_its_offset():
    """A constant float32 group came out anywhere up to ±10 from its offset (its mean a rounding step off its value,
    over a std of that size plus eps: 538 of 1,600 random constants more than 0.01 off; found by review). In float64
    the mean of a narrower dtype's equal values is exact: every entry is the offset."""
    gen = torch.Generator().manual_seed(0)
    for size in (2, 3, 7, 64, 1000):
        values = torch.randn(50, generator=gen) * 10.0 ** torch.randint(-3, 4, (50,), generator=gen)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            groups = values.to(dtype).expand(size, -1)  # column j: `size` rewards all equal to values[j]
            out = group_normalize(groups, offset=1.0)
            assert out.dtype == dtype and bool((out == 1.0).all()), (size, dtype, out[0])
    groups = torch.tensor([[0.1] * 7, [0.7] * 7, [1.3] * 7]).T
    torch.testing.assert_close(group_normalize(groups, offset=1.0), torch.ones(7, 3))


@pytest.mark.parametrize(("extra", "named"), [
    (("--checkpoint-every", "0"), "argument --checkpoint-every: must be an integer >= 1, got 0"),
    (("-K", "0"), "argument -K/--num-candidates: must be an integer >= 1, got 0"),  # said 'num_candidates must...'
    (("--batch-size", "0"), "argument --batch-size: must be an integer >= 1, got 0"),
    (("--eval-every", "0"), "argument --eval-every: must be an integer >= 1, got 0"),
    (("--lr", "nan"), "argument --lr: must be a finite number > 0, got nan"),
    (("--temperature", "-1"), "argument --temperature: must be a finite number > 0, got -1.0"),
    (("--estimator", "capg_swr", "--capg-method", "exact"), "--capg-method: the inclusion method of --estimator capg"),
    (("--estimator", "vpg", "--capg-method", "plugin"), "--capg-method: the inclusion method of --estimator capg"),
    (("--capg-method", "exact"), "not of capg_swr (the default)"),  # it trained CA-PG-SwR, silently
    (("--data", "/nonexistent.csv"), "--data: the KuaiRec file of --env kuairec"),
])
def test_cli_refuses_options_that_would_be_ignored_or_fail_late(tmp_path, capsys, extra, named):
    """Regression: online --checkpoint-every 0 ended in a traceback after the run had started; --capg-method
    with an estimator that has none was ignored yet recorded in result.json; --data without --env kuairec was
    ignored. Each now exits 2 before anything runs or is written."""
    with pytest.raises(SystemExit) as exit_info:
        _train_cli("--out", str(tmp_path / "run"), "--steps", "2", *extra)
    assert exit_info.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_gradient_variance_signal_is_unbiased_against_enumeration():
    """The signal estimates ‖E g‖² without the tr(Cov)/R that ‖mean‖² adds (with R = 4 samples it reported
    1.25 for an exact 0.03): its mean over seeds matches the enumerated value within a CLT bound."""
    import itertools

    torch.manual_seed(0)
    users, items, k, samples, seeds = 3, 6, 2, 4, 150
    q = torch.rand(users, items) * 3 + 0.5
    tiny = MatrixEnv(q, 0.5 * torch.ones(users, items), q.clone(), name="tiny")
    g = torch.Generator().manual_seed(0)
    model = TwoTowerMoE(users, items, generator=g)
    who = torch.randperm(users, generator=g)
    draws = torch.tensor(list(itertools.permutations(range(items), k)))  # every ordered draw [P, K]
    loss_fn = make_loss(TrainConfig(estimator="vpg", num_candidates=k))
    loss_fn.reduction = "none"
    exact = 0.0
    for u in who.tolist():
        s = model(torch.tensor([u]))[:, 0].detach()
        log_p = torch.zeros(len(draws), dtype=torch.float64)
        for i, draw in enumerate(draws.tolist()):
            left = list(range(items))
            for a in draw:
                log_p[i] += float(s[0, a].double() - torch.logsumexp(s[0, left].double(), 0))
                left.remove(a)
        chosen = draws.gather(1, tiny.lsr_scores[u][draws].argmax(1, keepdim=True))
        logits = s.expand(len(draws), -1).clone().requires_grad_(True)
        loss_fn(logits, draws, chosen, torch.ones(len(draws), 1)).sum().backward()
        mean = (log_p.exp() * tiny.q[u][chosen[:, 0]].double()) @ logits.grad.double()  # E g, per unit reward
        exact += float(mean.pow(2).sum()) / users
    got = torch.tensor([gradient_variance(tiny, [k], ["vpg"], num_users=users, samples=samples, seed=seed)[0]["signal"]
                        for seed in range(seeds)], dtype=torch.float64)
    assert abs(float(got.mean()) - exact) <= 4.5 * float(got.std()) / seeds ** 0.5, (float(got.mean()), exact)


@pytest.mark.parametrize("argv", [["demo", "-K", "0"], ["demo", "--steps", "-5"], ["demo", "--seeds", "0"],
                                  ["demo", "-K", "2000"], ["bench", "--reps", "0"], ["bench", "--mc-samples", "0"],
                                  ["bench", "--sizes", "300", "0"], ["bench", "--out", "."],
                                  ["bench", "--case-timeout", "-1"], ["bench", "--memory-limit", "-1"],
                                  ["bench", "--case-timeout", "nan"], ["bench", "--out", "afile/x.json"],
                                  ["bench", "--skip-cost", "--skip-accuracy"], ["bench", "--sizes", "5"],
                                  ["bench", "--sizes", "500", "500"]])
def test_demo_and_bench_refuse_bad_arguments_up_front(argv, tmp_path, capsys, monkeypatch):
    """They raised tracebacks (demo), wrote empty tables before a KeyError (demo --seeds 0), ran every case to
    NaN or 'no median' and exited 0 (bench), or failed on --out only after computing everything; bench also ran
    nothing and exited 0 with both parts skipped, printed a table of errors for sizes below its K and ran repeated
    sizes twice (a later review)."""
    from capg_rec.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").touch()  # found by a later review: an --out under a file failed after all the work
    if argv[0] == "demo":
        argv = [*argv, "--out", str(tmp_path / "demo")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "error" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("argv", "named"), [
    (["reproduce", "table3", "--ks", "3"], "--ks: not used by the table3 target"),
    (["reproduce", "table3", "--lsr", "noisy"], "--lsr: not used by the table3 target"),
    (["reproduce", "table2", "--sizes", "5", "--max-weight", "3"], "--max-weight, --sizes: not used by the table2"),
    (["reproduce", "offpolicy", "--steps", "7", "--estimators", "vpg"], "--estimators, --steps: not used by the "
                                                                         "offpolicy target"),
    (["reproduce", "offpolicy", "--quick", "--seeds", "2"], "--seeds: not used by the offpolicy target with --quick"),
    (["reproduce", "table2", "--quick"], "--quick: not used by the table2 target (it reads"),  # not "with --quick"
    (["reproduce", "offpolicy", "--quick", "--steps", "2"], "--steps: not used by the offpolicy target (it reads"),
    (["reproduce", "variance", "--seeds", "2"], "--seeds: not used by the variance target"),
    (["reproduce", "table2", "--seeds", "0"], "--seeds: must be an integer >= 1"),
    (["reproduce", "table2", "--seeds", "-1"], "--seeds: must be an integer >= 1"),
    (["reproduce", "table2", "--steps", "0"], "--steps: must be an integer >= 1"),  # named the parameter 'steps'
    (["reproduce", "table2", "--ks", "5", "0"], "--ks: must be an integer >= 1"),
    (["reproduce", "offpolicy", "--sizes", "0"], "--sizes: must be an integer >= 1"),
    (["reproduce", "offpolicy", "--sizes", "10"], "--sizes must be at least the study's batch of 128 rows"),
    (["reproduce", "offpolicy", "--logging-temperature", "0"], "--logging-temperature: must be a finite number > 0"),
    (["reproduce", "offpolicy", "--first-seed", "-1"], "--first-seed must be in [0, 2^63 - --seeds]"),
    (["reproduce", "offpolicy", "--first-seed", str(2**63 - 1), "--seeds", "2"], "--first-seed must be in"),
])
def test_reproduce_refuses_options_its_target_does_not_read(tmp_path, capsys, argv, named):
    """Regression (found by review): options of another target were ignored (table3 ran K = 10 with --ks 3, the
    off-policy study its own steps), --quick silently replaced --seeds, and --seeds 0 wrote empty tables and
    reported files it never wrote. Each exits 2 before anything runs."""
    from capg_rec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["train", "--group-offset", "nan"], "--group-offset must be a finite number >= 0, got nan"),
    (["train", "--seed", "-1"], "--seed must be an int in [0, 9223372036854775807], got -1"),
    (["train", "-K", "5", "-L", "6"], "--num-outputs must be <= --num-candidates=5, got 6"),
    (["train", "-K", "100000"], "--num-candidates must be at most the environment's 1000 items, got 100000"),
    (["train", "--estimator", "capg", "--capg-method", "bogus"], "--capg-method must be one of"),
    (["train", "--env", "kuairec", "--data", "."], "--data: path must be an existing KuaiRec small_matrix.csv"),
    (["reproduce", "table2", "--ks", "100000"], "--ks must be at most the environment's 1000 items"),
    (["reproduce", "table2", "--ks", "5", "5"], "--ks must not repeat a value"),
    (["reproduce", "table2", "--capg-method", "exact", "--estimators", "vpg"], "--capg-method applies to"),
    (["reproduce", "kuairec", "--data", "."], "--data must be an existing KuaiRec small_matrix.csv file"),
    (["reproduce", "variance", "--ks", "100000"], "--ks must be in [1, 1000], got 100000"),
    (["log", "-n", "20", "--method", "bogus"], "--method must be an InclusionMethod or one of"),
])
def test_bad_options_are_named_as_typed(tmp_path, capsys, argv, message):
    """Regression (found by review): 14 errors of the command line named the config's field (num_outputs,
    group_offset, capg_method, path, K) or nothing, not the option typed."""
    from capg_rec.cli import main

    out = tmp_path / ("logs.parquet" if argv[0] == "log" else "out")
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, *(["--steps", "2"] if argv[0] != "log" and "variance" not in argv else []), "--out", str(out)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_option_names_in_paths_and_typed_values_stay_as_they_are(tmp_path, capsys):
    """Regression (found by a review of the change that names the options): names of options inside a path or a
    value the user typed were rewritten too ('/t/--num-candidates.csv', "got '--batch-size'")."""
    from capg_rec.cli import main

    folder = tmp_path / "batch_size"
    folder.mkdir()
    for argv, kept in ((["train", "--env", "kuairec", "--data", str(tmp_path / "num_candidates.csv")],
                        "num_candidates.csv"),
                       (["train", "--estimator", "capg", "--capg-method", "batch_size"], "got 'batch_size'"),
                       (["log", "-n", "10", "--no-progress"], f"got the folder {folder}")):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--out", str(folder if argv[0] == "log" else tmp_path / "out")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and kept in err and "--num-candidates" not in err and \
            "--batch-size" not in err, err


def test_grpo_takes_estimators_the_paper_did_not_run(tmp_path):
    """Regression (found by review): reproduce grpo --estimators vpg ended in a KeyError (the paper's GRPO table has
    only the with-replacement estimators)."""
    _, cells = build_target("grpo", steps=2, estimators=("vpg",), ks=(5,))
    assert [cell.config.estimator for cell in cells] == ["vpg"] and cells[0].paper == (None, None)


@pytest.mark.parametrize("command", ["train", "reproduce", "demo"])
def test_an_out_that_is_a_file_exits_2(tmp_path, capsys, command):
    """Regression (found by review): --out naming an existing file ended in a FileExistsError or
    NotADirectoryError traceback (exit 1) once the run had started."""
    from capg_rec.cli import main

    target = tmp_path / "taken.json"
    target.write_text("{}")
    argv = {"train": ["train", "--steps", "2"], "reproduce": ["reproduce", "table2", "--steps", "2", "--seeds", "1"],
            "demo": ["demo", "--steps", "2"]}[command]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(target)])
    assert exit_info.value.code == 2 and "a file, not a folder" in capsys.readouterr().err
    assert target.read_text() == "{}"


def test_resume_refuses_data_its_env_does_not_read(tmp_path, capsys):
    """Regression (found by review): train --resume --data X on a synthetic run ignored --data."""
    _train_cli("--out", str(tmp_path / "run"), "--steps", "2", "--eval-every", "2", "--batch-size", "4")
    with pytest.raises(SystemExit) as exit_info:
        _train_cli("--out", str(tmp_path / "run"), "--resume", "--steps", "4", "--data", "/nonexistent.csv")
    assert exit_info.value.code == 2 and "--data: the KuaiRec file" in capsys.readouterr().err


def test_a_run_stopped_by_an_overflow_is_not_resumed_into_another(env, tmp_path):
    """Regression (found by review): resuming a run that stopped on an overflow at an off-grid step with a later
    target dropped the stop's row as 'the end-of-run evaluation of a run now extended', reported the earlier value as
    final, and extended nothing (exit 0). Now a ValueError says why, and the saved run is left as it was."""
    trainer = Trainer(env, _config(steps=10, eval_every=4))
    apply = trainer._apply
    trainer._apply = lambda loss: apply(loss * math.nan) if trainer.step_count == 6 else apply(loss)
    result = trainer.run(out_dir=tmp_path, checkpoint_every=100, progress=False)
    assert result.stopped_at == 6 and [row["step"] for row in result.history] == [0, 4, 6]
    saved = (tmp_path / "result.json").read_text()
    # a later target, or the saved one (10), which it never reached either (review: the message spoke of a later
    # target then too)
    for steps, what in ((20, "cannot go on to a later target"), (None, "is over")):
        with pytest.raises(ValueError, match=f"stopped at step 6 on a gradient overflow.*: it {what}"):
            Trainer.load(tmp_path / "checkpoint.pt", env, steps=steps)
    assert (tmp_path / "result.json").read_text() == saved


def test_reproduce_reuses_a_run_stopped_by_an_overflow_at_a_later_target(env, tmp_path):
    """Review: extending a table (more steps) whose V-PG run had stopped on an overflow failed as a whole, as it
    tried to resume that run; the run asked for would stop at the same step (runs are deterministic)."""
    config = TrainConfig(estimator="vpg", optimizer="sgd", lr=1e38, num_candidates=4, steps=10, eval_every=5,
                         batch_size=8, temperature=0.01)
    first = run_cells(env, [Cell("x", config)], [0], tmp_path, checkpoint_every=2, progress=False)
    (result,) = first[("V-PG", "x")]
    assert result.stopped_at is not None and result.stopped_at < 10
    again = run_cells(env, [Cell("x", config.replace(steps=20))], [0], tmp_path, checkpoint_every=2, progress=False)
    assert again[("V-PG", "x")][0].history == result.history
    # asked exactly the steps where it stopped: that run too
    exact = run_cells(env, [Cell("x", config.replace(steps=result.stopped_at))], [0], tmp_path, checkpoint_every=2,
                      progress=False)
    assert exact[("V-PG", "x")][0].history == result.history


def test_help_states_each_default_once_and_every_method(capsys):
    """Regression (found by review): train --help stated --estimator's default twice, and --capg-method listed
    three of the methods it takes; log --help offered with_replacement, which it refuses."""
    from capg_rec.cli import main
    from capg_rec.marginals import inclusion_methods

    for command in ("train", "log"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        text = text[text.index("options:"):]
        if command == "train":
            estimator = text[text.index("--estimator {"):text.index("--capg-method CAPG_METHOD")]
            assert estimator.count("default capg_swr") == 1
            method = text[text.index("--capg-method CAPG_METHOD"):]
            assert all(name in method[:300] for name in inclusion_methods())
        else:
            method = text[text.index("--method METHOD inclusion"):]
            assert "with_replacement" not in method[:200] and "mean_field" in method[:200]
    # demo and bench stated none of their defaults (found by review)
    for command, defaults in (("demo", ("default: 3000", "default: 20", "default: 1", "default: runs/demo")),
                              ("bench", ("default: 1000 100000 1000000", "default: 128", "default: 16", "default: 3",
                                         "default: 100000", "default: runs/bench.json"))):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(default in text for default in defaults), command


def test_bench_json_records_its_settings(tmp_path, monkeypatch):
    """Found by review: bench.json held the tables alone, not the batch, width, repetitions and draws they came from,
    nor that its seconds are CPU time."""
    from capg_rec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--skip-cost", "--mc-samples", "100", "--out", str(tmp_path / "b.json")])
    assert exit_info.value.code == 0
    settings = json.loads((tmp_path / "b.json").read_text())["settings"]
    assert settings == {"accuracy": {"mc_samples": 100}}  # the settings of the tables that ran (a diff review)
    from capg_rec.bench import cost_table

    monkeypatch.setattr("capg_rec.bench.cost_table", lambda *args: {"stub": True})
    assert cost_table is not None
    with pytest.raises(SystemExit):
        main(["bench", "--skip-accuracy", "--sizes", "200", "--batch", "4", "--out", str(tmp_path / "c.json")])
    cost = json.loads((tmp_path / "c.json").read_text())["settings"]["cost"]
    assert cost["sizes"] == [200] and cost["batch"] == 4 and "CPU seconds" in cost["seconds"]


def test_a_method_that_cannot_score_the_catalog_exits_2(tmp_path, capsys):
    """Regression (found by review): --capg-method enumerate on 1,000 items was a traceback from the first step."""
    with pytest.raises(SystemExit) as exit_info:
        _train_cli("--out", str(tmp_path / "run"), "--estimator", "capg", "--capg-method", "enumerate", "--steps", "2")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Enumeration holds every ordered draw times every item" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first row (found by review)


def test_study_options_that_cannot_be_honoured_are_refused(tmp_path):
    """Found by review: reproduce variance wrote 4 cells under 2 headers for --estimators vpg vpg, and
    build_target("table2", lsr=["optimal"]) was a bare KeyError."""
    from capg_rec.train.variance import gradient_variance_report

    with pytest.raises(ValueError, match="estimators must not repeat"):
        gradient_variance_report(tmp_path / "variance", ks=[2], estimators=["vpg", "vpg"])
    with pytest.raises(ValueError, match="noisy, uniform, anti"):
        build_target("table2", steps=10, lsr=["optimal"])


def test_cli_errors_found_by_the_command_review(tmp_path, capsys):
    """A mid-run error was erased by the progress bar's clean-up (the bar is closed before it is reported);
    `--estimator capg_swr --capg-method with_replacement` (its own method) was refused with a message that
    contradicted itself; `reproduce variance` listed --capg-method among the options it reads; a seed beyond 64
    bits was torch's 'Overflow when unpacking long long'."""
    from capg_rec.cli import main

    def run(*argv):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(list(argv))
        return exit_info.value.code, capsys.readouterr().err

    code, err = run("train", "--estimator", "capg", "--capg-method", "enumerate", "--steps", "3", "--out",
                    str(tmp_path / "e"))
    assert code == 2 and err.rstrip().endswith("got 9.56e+32 for N = 1000, K = 10")  # nothing erases it
    assert "Enumeration holds" in err.rsplit("\r", 1)[-1]  # written after the bar's last carriage return
    code, err = run("train", "--estimator", "capg_swr", "--capg-method", "with_replacement", "--steps", "2",
                    "--eval-every", "2", "--out", str(tmp_path / "s"))
    assert code == 0, err
    code, err = run("reproduce", "variance", "--steps", "10")
    assert code == 2 and "--capg-method" not in err
    code, err = run("train", "--seed", str(10**20), "--steps", "3", "--out", str(tmp_path / "big"))
    assert code == 2 and "seed must be an int in [0, 9223372036854775807]" in err


def test_demo_says_when_ca_pg_reached_v_pgs_value_also_at_step_0_or_never():
    """Found by review: the demo dropped its line when CA-PG-SwR's first value already beat V-PG-SwR's last (step 0
    read as no step), and said nothing when it never reached it."""
    from capg_rec.train.cli import _reach_line
    from capg_rec.train.trainer import TrainResult

    def run(values):
        history = [{"step": 100 * i, "policy_value": v} for i, v in enumerate(values)]
        return TrainResult(config={"seed": 3}, history=history, steps_done=100 * (len(values) - 1))

    vpg = run([5.0, 6.0, 7.0])
    assert _reach_line(vpg, run([5.0, 7.5, 8.0])) == ("seed 3: CA-PG-SwR reached V-PG-SwR's 200-step value (7.000) "
                                                      "after 100 steps (2.0x fewer).")
    assert "started at V-PG-SwR's 200-step value (7.000) or above (step 0" in _reach_line(vpg, run([7.2, 8.0]))
    assert _reach_line(vpg, run([5.0, 6.5])) == ("seed 3: CA-PG-SwR did not reach V-PG-SwR's 200-step value (7.000) in "
                                                 "its 100 steps.")


def test_csv_files_write_every_undefined_value_as_an_empty_cell(tmp_path):
    """Found by review: metrics.csv wrote an undefined interval (NaN) as "nan" but a missing OPE value (None) as an
    empty cell; both are empty now, in every CSV the commands write (they share write_csv)."""
    from capg_rec.train.report import write_csv

    write_csv(tmp_path / "m.csv", [{"step": 0, "low": math.nan, "ope": None, "value": 1.5}])
    assert (tmp_path / "m.csv").read_text().splitlines() == ["step,low,ope,value", "0,,,1.5"]


@pytest.mark.parametrize("temperature", [1e-4])
def test_a_tiny_temperature_trains_as_before(temperature):
    """A review of the resolution checks: at τ = 1e-4 the fresh model's scaled logits spread over 3e5, and the first
    version of the trainer's check (a resolution of 32,768) called that an overflow and stopped at step 1. The
    resolution is 524,288 in float32 now: the run trains, with no overflow (at τ = 2e-5 its draws reach beyond it,
    and the run counts them as overflows)."""
    env = synthetic_env(0, num_users=60, num_items=50)
    result = Trainer(env, TrainConfig(num_candidates=5, steps=20, batch_size=16, eval_every=10,
                                      temperature=temperature, lr=0.5)).run(progress=False)
    assert result.overflow_count == 0 and result.stopped_at is None


def test_a_checkpoint_of_another_version_is_refused(tmp_path):
    """An intact checkpoint (its checksum right) of another format version is refused, naming the version (found by
    mutation testing: skipping the version check returned its state)."""
    import hashlib

    from capg_rec.train.checkpoint import read_checkpoint

    buffer = io.BytesIO()
    torch.save({"step": 0}, buffer)
    payload = buffer.getvalue()
    path = tmp_path / "old.pt"
    path.write_bytes(b"capg_rec-checkpoint 1 " + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    with pytest.raises(ValueError, match="has version 1, this capg_rec reads version 2"):
        read_checkpoint(path)


def test_policy_value_model_and_trainer_arguments_are_checked():
    """A review's sweep of bad input: numpy seeds failed in torch's generator, a float or bool seed gave torch's
    RuntimeError, a model of 20 items was scored on an environment of 30 (4.51, silently), a wrong model, env or
    lsr failed deep inside; a config dict, user ids out of range or of floats gave torch's errors; a bad train_lsr
    or eval_lsr was blamed on "lsr"."""
    from capg_rec.sim import NoisyLSR, OptimalLSR

    env = synthetic_env(0, num_users=8, num_items=30)
    model = TwoTowerMoE(8, 30, dim=3, generator=torch.Generator().manual_seed(0))
    lsr = OptimalLSR()

    def drawn(scores, length, generator):  # no expected_value: the seed draws its picks
        return NoisyLSR()(scores, length, generator)

    assert policy_value(model, env, drawn, 5, 1, seed=np.int64(1)) == policy_value(model, env, drawn, 5, 1, seed=1)
    for kwargs, error, match in (({"seed": 1.0}, TypeError, "seed"), ({"seed": True}, TypeError, "seed"),
                                 ({"seed": -1}, ValueError, "seed"), ({"seed": 2**64}, ValueError, "seed")):
        with pytest.raises(error, match=match):
            policy_value(model, env, lsr, 5, 1, **kwargs)
    with pytest.raises(ValueError, match="model must score the environment's 30 items, its logits have 20"):
        policy_value(TwoTowerMoE(8, 20, dim=3), env, lsr, 5, 1)
    for args, match in ((("m", env, lsr), "model"), ((model, "e", lsr), "env"), ((model, env, 3), "lsr")):
        with pytest.raises(TypeError, match=match):
            policy_value(*args, 5, 1)
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        make_loss({"estimator": "capg"})
    with pytest.raises(ValueError, match=r"users must hold ids in \[0, 8\)"):
        model(torch.tensor([8]))
    for bad in (torch.tensor([1.0]), torch.tensor([1], dtype=torch.int8)):
        with pytest.raises(TypeError, match="users must be an int32 or int64 tensor"):
            model(bad)
    with torch.device("meta"):  # a diff review: the eager check read a meta tensor's values
        assert TwoTowerMoE(8, 30)(torch.tensor([1], device="meta")).shape == (1, 1, 30)
    assert torch.jit.script(model)(torch.tensor([0, 1])).shape == (2, 1, 30)  # a diff review: the checks broke it

    class Valued:  # no __call__: policy_value reads expected_value only
        expected_value = staticmethod(OptimalLSR().expected_value)

    assert policy_value(model, env, Valued(), 5, 1) == policy_value(model, env, lsr, 5, 1)
    with pytest.raises(TypeError, match="train_lsr must be an LSR name"):
        Trainer(env, TrainConfig(steps=3), train_lsr=5)
    with pytest.raises(ValueError, match="eval_lsr must be one of"):
        Trainer(env, TrainConfig(steps=3), eval_lsr="zzz")


def test_ctrl_c_ends_a_command_with_a_message_and_code_130(tmp_path, monkeypatch, capsys):
    """A command interrupted by Ctrl-C ended in a traceback (a review); it now says so in one line and exits 130, as
    a shell reports a SIGINT; an interrupted train run says whether it left a checkpoint to resume from (a review:
    it promised one before the first was written)."""
    from capg_rec import cli

    def interrupted(args):
        raise KeyboardInterrupt

    build_parser = cli.build_parser
    parser = build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    out = tmp_path / "a run"
    for argv, said in ((["demo", "--steps", "1"], "capg-rec demo: interrupted\n"),
                       (["train", "--out", str(out)], "capg-rec train: interrupted before its first checkpoint: "
                                                      "nothing to --resume, start it again\n"),
                       (["train", "--out", str(out)], f"capg-rec train: interrupted; continue from its last checkpoint "
                                                      f"with --resume --out '{out}'\n")):
        if "continue" in said:  # only the .prev (interrupted between a checkpoint's two renames), under a space
            out.mkdir()
            (out / "checkpoint.pt.prev").write_bytes(b"")
        args = build_parser().parse_args(argv)
        monkeypatch.setattr(parser, "parse_args",
                            lambda _, args=args: argparse.Namespace(**{**vars(args), "func": interrupted}))
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 130
        assert capsys.readouterr().err == said


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, where no folder can be made")
def test_an_out_folder_that_cannot_be_made_is_named_with_exit_2(capsys):
    """`--out` where no folder can be made (a review: /proc, /sys, a folder without write permission) ended in a
    FileNotFoundError or PermissionError traceback, exit 1, once the run had started; it exits 2 at once, naming it."""
    from capg_rec.cli import main

    for argv in (["train", "--steps", "2"], ["reproduce", "variance", "--ks", "2"], ["demo", "--steps", "2"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--out", "/proc/capg_rec_no_such/run"])
        assert exit_info.value.code == 2
        assert "--out /proc/capg_rec_no_such/run: cannot write there" in capsys.readouterr().err


def test_an_out_behind_a_dangling_link_or_an_unsearchable_folder_exits_2(tmp_path, monkeypatch, capsys):
    """A diff review's findings: an --out that is (or lies under) a link to nothing passed the check and failed at
    mkdir with a traceback, exit 1; a folder on the way that cannot be searched raised PermissionError from the
    check itself."""
    from capg_rec import cli
    from capg_rec.train import cli as train_cli

    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out in ("dangling", "dangling/run"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["train", "--steps", "2", "--out", str(tmp_path / out)])
        assert exit_info.value.code == 2
        assert f"{tmp_path / 'dangling'} is a link to nothing, not a folder" in capsys.readouterr().err

    def unsearchable(folder):
        raise PermissionError(13, "Permission denied")

    long = tmp_path / "y" / ("a" * 300) / "run"  # made folder by folder, then refused: y was left behind
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--steps", "2", "--out", str(long)])
    assert exit_info.value.code == 2 and "a name longer than" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
    monkeypatch.setattr(train_cli, "_file_in_the_way", unsearchable)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--steps", "2", "--out", str(tmp_path / "locked" / "run")])
    assert exit_info.value.code == 2
    assert f"--out {tmp_path / 'locked' / 'run'}: cannot write there (Permission denied)" in capsys.readouterr().err
