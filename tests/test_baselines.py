"""The rank-global reward baselines (plain torch.distributed: no TorchRec needed), one process and a one-rank gloo
group; several ranks: tests/test_torchrec_multirank.py."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import capg_rec
from capg_rec import ContextBaseline, global_mean_baseline
from capg_rec.testing import count_host_syncs


@pytest.mark.parametrize("with_group", [False, True])
def test_global_mean_baseline_is_the_batch_mean(with_group, request, device):
    group = request.getfixturevalue("one_rank") if with_group else None
    rewards = torch.tensor([[1.0, 2.0], [0.5, -3.5]], device=device, requires_grad=True)
    base = global_mean_baseline(rewards, group)
    assert base.shape == (2,) and not base.requires_grad
    torch.testing.assert_close(base, rewards.detach().mean().expand(2))
    assert global_mean_baseline(torch.zeros(0, 3, device=device), group).shape == (0,)
    with count_host_syncs() as calls:
        global_mean_baseline(rewards, group, validate_args=False)
    assert calls == []
    with pytest.raises(ValueError, match="rewards must be finite"):
        global_mean_baseline(torch.tensor([[1.0, math.nan]]), group)
    with pytest.raises(ValueError, match="rewards must have 2 dims"):
        global_mean_baseline(torch.ones(3), group)


def test_global_mean_baseline_of_many_half_precision_rewards():
    """Regression (found by review): the sum and the count were taken in the rewards' dtype, so 70,000 float16
    rewards of 1 (beyond float16's 65,504) gave a NaN baseline; they are taken in float64."""
    base = global_mean_baseline(torch.ones(70_000, 1, dtype=torch.float16))
    assert base.dtype == torch.float16 and torch.equal(base, torch.ones_like(base))


def test_context_baseline_is_a_per_context_moving_average(one_rank):
    """The trainer's rule: seen contexts get their moving average, new ones this batch's mean."""
    rounds = [(torch.tensor([0, 2, 2]), torch.tensor([[1.0, 3.0], [4.0, 0.0], [2.0, 2.0]])),
              (torch.tensor([2, 1, 0]), torch.tensor([[6.0, 0.0], [1.0, 1.0], [5.0, 5.0]]))]
    expected = [torch.full((3,), (2.0 + 2.0 + 2.0) / 3),
                torch.tensor([2.0, (3.0 + 1.0 + 5.0) / 3, 2.0])]
    for group in (None, one_rank):
        baseline = ContextBaseline(4, decay=0.5, process_group=group)
        for (contexts, rewards), want in zip(rounds, expected):
            torch.testing.assert_close(baseline(contexts, rewards), want)
        # after round 2: context 0 = 0.5·2 + 0.5·5, context 1 = 1, context 2 = 0.5·2 + 0.5·3
        torch.testing.assert_close(baseline.average, torch.tensor([3.5, 1.0, 2.5, 0.0]))
        assert baseline.seen.tolist() == [True, True, True, False]
        assert set(baseline.state_dict()) == {"average", "seen"}
        asymmetric = ContextBaseline(2, decay=0.9, process_group=group)  # decay and 1 - decay told apart
        for reward in (1.0, 0.0):
            asymmetric(torch.tensor([0]), torch.full((1, 2), reward))
        torch.testing.assert_close(asymmetric.average, torch.tensor([0.9, 0.0]))
        with pytest.raises(ValueError, match=r"contexts must hold ids in \[0, 4\)"):
            baseline(torch.tensor([4]), torch.ones(1, 2))
        with pytest.raises(ValueError, match="contexts must be a 1-dim tensor"):
            baseline(torch.tensor([[0]]), torch.ones(1, 2))
        # review: None passed the checks and failed inside torch, between two collectives (other ranks waited)
        with pytest.raises(TypeError, match="contexts must be a 1-dim tensor of ids"):
            baseline(None, torch.ones(1, 2))
        with pytest.raises(ValueError, match="decay must be in"):
            ContextBaseline(3, decay=1.0)
        assert baseline(torch.zeros(0, dtype=torch.long), torch.zeros(0, 2)).shape == (0,)
        # review: rows without rewards gave NaN and wrote it into the averages for good
        before = baseline.average.clone()
        with pytest.raises(ValueError, match=r"rewards must have at least one column .* got shape \[1, 0\]"):
            baseline(torch.tensor([0]), torch.zeros(1, 0))
        torch.testing.assert_close(baseline.average, before)

def test_global_mean_baseline_of_rows_without_rewards_is_zero():
    """Rewards ``[B, 0]`` (no shown items) have mean 0, as an empty batch has, not 0/0."""
    assert torch.equal(global_mean_baseline(torch.zeros(3, 0)), torch.zeros(3))


def test_baselines_need_no_torchrec():
    """Regression (a review): the baselines lived in capg_rec.torchrec, which refuses to import without TorchRec,
    so a plain DDP loop could not use them. They are capg_rec's, and capg_rec.torchrec still exports them."""
    code = ("import sys; sys.modules['torchrec'] = None; import torch, capg_rec\n"
            "print(float(capg_rec.global_mean_baseline(torch.ones(2, 3))[0]),"
            " capg_rec.ContextBaseline(3)(torch.tensor([1]), torch.ones(1, 2)).tolist())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1.0", "[1.0]"]
    torchrec = pytest.importorskip("capg_rec.torchrec")
    assert torchrec.ContextBaseline is capg_rec.ContextBaseline
    assert torchrec.global_mean_baseline is capg_rec.global_mean_baseline
    # a diff review: a baseline saved whole under the old path (pickle names its class's module) failed to load
    import io

    saved, buffer = capg_rec.ContextBaseline.__module__, io.BytesIO()
    capg_rec.ContextBaseline.__module__ = "capg_rec.torchrec.baselines"  # as the old code saved it
    try:
        torch.save(capg_rec.ContextBaseline(3), buffer)
    finally:
        capg_rec.ContextBaseline.__module__ = saved
    assert b"capg_rec.torchrec.baselines" in buffer.getvalue()
    buffer.seek(0)
    assert isinstance(torch.load(buffer, weights_only=False), capg_rec.ContextBaseline)
