"""numpy's numbers (``np.int64``, ``np.float32``: what a config read through numpy or an array's element gives)
are taken wherever Python's are, as torch takes them, and give the same results; numpy's bool is refused as
Python's is (a ``TypeError`` naming the argument)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from capg_rec import CAPGLoss, EmbeddingCatalog, VPGLoss, group_normalize, inclusion_log_prob, sample_candidates
from capg_rec.functional import offpolicy_capg_loss
from capg_rec.logs import explore_candidates, log_propensities
from capg_rec.offpolicy_evaluation import off_policy_value
from capg_rec.logs import LoggedImpressions
from capg_rec.logs.cli import generate_logs
from capg_rec.sim import synthetic_env
from capg_rec.train.config import TrainConfig
from capg_rec.train.logged import LogTrainConfig
from capg_rec.train.offpolicy import OffPolicyStudy


def _inputs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 2, 12, generator=gen)
    candidates = sample_candidates(logits, 4, generator=gen)
    return logits, candidates, candidates[:, :2], torch.rand(4, 2, generator=gen)


def test_losses_and_probabilities_take_numpy_numbers_alike():
    logits, candidates, chosen, rewards = _inputs()
    for baseline in (np.float32(0.5), np.float16(0.5), np.int64(0)):  # a review: only np.float64 was taken
        assert torch.equal(CAPGLoss(4)(logits, candidates, chosen, rewards, baseline=baseline),
                           CAPGLoss(4)(logits, candidates, chosen, rewards, baseline=float(baseline)))
    with pytest.raises(TypeError, match="baseline"):
        CAPGLoss(4)(logits, candidates, chosen, rewards, baseline=np.True_)
    assert torch.equal(CAPGLoss(np.int64(4))(logits, candidates, chosen, rewards),
                       CAPGLoss(4)(logits, candidates, chosen, rewards))
    assert torch.equal(VPGLoss(np.int32(4), temperature=np.float32(0.5))(logits, candidates, chosen, rewards),
                       VPGLoss(4, temperature=0.5)(logits, candidates, chosen, rewards))
    assert torch.equal(inclusion_log_prob(logits, chosen, np.int64(4), temperature=np.float64(2.0)),
                       inclusion_log_prob(logits, chosen, 4, temperature=2.0))
    logged = torch.full((4, 2), -0.5)
    assert torch.equal(offpolicy_capg_loss(logits, candidates, chosen, rewards, logged, max_weight=np.float32(2.0)),
                       offpolicy_capg_loss(logits, candidates, chosen, rewards, logged, max_weight=2.0))
    draw = sample_candidates(logits, np.int64(3), generator=torch.Generator().manual_seed(1))
    assert torch.equal(draw, sample_candidates(logits, 3, generator=torch.Generator().manual_seed(1)))
    catalog = EmbeddingCatalog(torch.randn(4, 2, 3), torch.randn(12, 2, 3), chunk_size=np.int64(5))
    assert catalog.chunk_size == 5 and type(catalog.chunk_size) is int


def test_logging_and_evaluation_take_numpy_numbers_alike():
    logits, candidates, chosen, _ = _inputs()
    a = log_propensities(logits, candidates, chosen, epsilon=np.float32(0.25), temperature=np.float32(2.0))
    b = log_propensities(logits, candidates, chosen, epsilon=0.25, temperature=2.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    explore_candidates(logits, np.int64(3), epsilon=np.float64(0.5))
    target, logged, rewards = torch.full((8, 1), -1.0), torch.full((8, 1), -1.2), torch.rand(8, 1)
    assert off_policy_value(target, logged, rewards, confidence=np.float32(0.9),
                            min_effective_sample_size=np.int64(2)).confidence == pytest.approx(0.9)
    assert torch.equal(group_normalize(rewards, offset=np.float32(0.5), dim=np.int64(0)),
                       group_normalize(rewards, offset=0.5, dim=0))


def test_a_config_keeps_numpy_numbers_as_python_ones(tmp_path):
    """A run's config is saved as JSON, which numpy's numbers are not (a review of this change: a run from logs
    or the off-policy study failed at its very end, writing its result, and logs generated with numpy numbers
    failed at their metadata)."""
    config = TrainConfig(num_candidates=np.int64(10), temperature=np.float32(0.5), seed=np.uint32(3))
    assert (type(config.num_candidates), type(config.temperature), type(config.seed)) == (int, float, int)
    json.dumps(dataclasses.asdict(config))
    logged = LogTrainConfig(logs=["logs.parquet"], epochs=np.int64(2), temperature=np.float32(0.5))
    assert (type(logged.epochs), type(logged.temperature)) == (int, float)
    json.dumps(dataclasses.asdict(logged))
    study = OffPolicyStudy(ks=(np.int64(20),), seeds=(np.int64(0),), batch_size=np.int64(64), sizes=(np.int64(640),))
    assert type(study.ks[0]) is int and type(study.batch_size) is int
    json.dumps(dataclasses.asdict(study))
    env = synthetic_env(num_users=6, num_items=5)
    generate_logs(env, lambda users: torch.zeros(len(users), 1, 5), tmp_path / "logs.parquet",
                  num_interactions=np.int64(8), num_candidates=np.int64(3), num_outputs=np.int64(1),
                  temperature=np.float32(2.0), epsilon=np.float32(0.25), seed=np.int64(1), progress=False)
    assert LoggedImpressions(tmp_path / "logs.parquet", 4).meta.extra["temperature"] == 2.0
    for bad, error, name in (({"temperature": 0.0}, ValueError, "temperature"), ({"seed": -1}, ValueError, "seed"),
                             ({"epsilon": 1.5}, ValueError, "epsilon"), ({"epsilon": "0.1"}, TypeError, "epsilon")):
        with pytest.raises(error, match=name):  # before a file is made
            generate_logs(env, lambda users: torch.zeros(len(users), 1, 5), tmp_path / "bad.parquet",
                          num_interactions=8, num_candidates=3, num_outputs=1, progress=False, **bad)
    assert not (tmp_path / "bad.parquet").exists()


@pytest.mark.parametrize("call", [
    lambda: sample_candidates(torch.randn(2, 5), np.bool_(True)),
    lambda: sample_candidates(torch.randn(2, 5), True),
    lambda: CAPGLoss(np.bool_(True)),
    lambda: log_propensities(torch.randn(2, 5), torch.tensor([[0, 1]] * 2), torch.tensor([[0]] * 2),
                             epsilon=np.bool_(False)),
    lambda: TrainConfig(num_candidates=np.bool_(True)),
], ids=["sample_candidates", "sample_candidates(True)", "CAPGLoss", "log_propensities", "TrainConfig"])
def test_numpy_bools_are_refused_as_python_bools_are(call):
    with pytest.raises(TypeError, match="num_candidates|epsilon"):
        call()


@pytest.mark.parametrize("zero", [0, 0.0, np.float32(0.0), np.int64(0)])
def test_a_temperature_of_zero_is_refused_in_any_type(zero):
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        CAPGLoss(3, temperature=zero)
