"""Bad input to the top-level API (a review's sweep of it): each gets a ``ValueError`` or ``TypeError`` naming the
argument, never a silent wrong answer or an error from deep inside."""

from __future__ import annotations

import pytest
import torch

import capg_rec
from capg_rec import DenseCatalog, EmbeddingCatalog, candidate_log_prob, inclusion_log_prob, sample_candidates
from capg_rec import functional as F


def _problem(batch: int = 4, num_items: int = 8, k: int = 3):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, num_items, generator=gen)
    candidates = sample_candidates(logits, k, generator=gen)
    return logits, candidates, candidates[:, :1], torch.randn(batch, 1, generator=gen)


def _catalogs(logits: torch.Tensor) -> list:
    gen = torch.Generator().manual_seed(1)
    users, items = torch.randn(logits.shape[0], 4, generator=gen), torch.randn(logits.shape[1], 4, generator=gen)
    return [DenseCatalog(logits), EmbeddingCatalog(users, items, chunk_size=3)]


@pytest.mark.parametrize("lookup", ["gather", "log_softmax"])
def test_catalog_lookups_refuse_ids_on_another_device(lookup):
    """A CPU catalog read ids on the meta device as garbage (uninitialised memory, e.g. 3.6e19)."""
    logits, candidates, _, _ = _problem()
    for catalog in _catalogs(logits):
        with pytest.raises(ValueError, match="items must be on the scores' device cpu, got meta"):
            getattr(catalog, lookup)(candidates.to("meta"))


@pytest.mark.parametrize("validate", [True, False])
def test_probabilities_refuse_ids_on_another_device(validate):
    logits, candidates, chosen, _ = _problem()
    with pytest.raises(ValueError, match="candidates must be on the scores' device cpu, got meta"):
        candidate_log_prob(logits, candidates.to("meta"), validate_args=validate)
    with pytest.raises(ValueError, match="items must be on the scores' device cpu, got meta"):
        inclusion_log_prob(logits, chosen.to("meta"), 3, validate_args=validate)


def test_meta_inputs_are_refused_by_name_when_validating():
    """Checks read values, which meta tensors do not hold: a ValueError naming the logits, not torch's
    ``NotImplementedError: Cannot copy out of meta tensor``."""
    logits, candidates, chosen, rewards = _problem()
    meta = [x.to("meta") for x in (logits, candidates, chosen, rewards)]
    calls = [lambda: F.capg_loss(*meta), lambda: F.vpg_loss(*meta),
             lambda: F.offpolicy_capg_loss(*meta, meta[3]), lambda: F.offpolicy_vpg_loss(*meta, meta[3][:, 0]),
             lambda: F.topk_reinforce_loss(*meta, meta[3]), lambda: DenseCatalog(meta[0]),
             lambda: candidate_log_prob(meta[0], meta[1]), lambda: inclusion_log_prob(meta[0], meta[2], 3),
             lambda: sample_candidates(meta[0], 3)]
    for call in calls:
        with pytest.raises(ValueError, match="logits is on the meta device"):
            call()
    assert DenseCatalog(meta[0], validate_args=False).num_items == 8  # shapes alone: fine unchecked
    assert capg_rec.CAPGLoss(3)(*_problem()).isfinite()
