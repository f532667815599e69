"""Bad input to the top-level API (a review's sweep of it): each gets a ``ValueError`` or ``TypeError`` naming the
argument, never a silent wrong answer or an error from deep inside."""

from __future__ import annotations

import math

import pytest
import torch

import capg_rec
from capg_rec import DenseCatalog, EmbeddingCatalog, candidate_log_prob, inclusion_log_prob, sample_candidates
from capg_rec import functional as F
from capg_rec.testing import count_host_syncs


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


@pytest.mark.parametrize("perturb", ["False", 1, None])
def test_top_items_takes_perturb_as_a_bool(perturb):
    """``perturb="False"`` made a perturbed draw (a truthy string)."""
    logits, _, _, _ = _problem()
    catalogs = _catalogs(logits) + [capg_rec.SampledCatalog(torch.randn(4, 4), torch.randn(8, 4),
                                                            sampler=capg_rec.UniformSampler(6))]
    for catalog in catalogs:
        with pytest.raises(TypeError, match="perturb must be True or False"):
            catalog.top_items(2, perturb=perturb)


@pytest.mark.parametrize("bad", [8, -2])
def test_every_catalog_refuses_exclusions_out_of_range_by_name(bad):
    """An id of ``exclude`` outside [-1, N) was ignored silently by the embedding and sampled catalogs and failed inside
    torch (a RuntimeError) in the dense one (found by review); ``-1`` pads, and the checks off, are as before."""
    logits, _, _, _ = _problem()
    catalogs = _catalogs(logits) + [capg_rec.SampledCatalog(torch.randn(4, 4), torch.randn(8, 4),
                                                            sampler=capg_rec.UniformSampler(6))]
    exclude = torch.tensor([[bad], [1], [-1], [2]])
    for catalog in catalogs:
        for call in (lambda: catalog.log_power_sums(exclude), lambda: catalog.top_items(2, exclude=exclude)):
            with pytest.raises(ValueError, match=r"exclude must hold ids in \[-1, 8\)"):
                call()
        padded = catalog.log_power_sums(exclude.clamp(min=-1, max=7))
        assert padded.shape == (4, 1, 1) and padded.isfinite().all()
    assert DenseCatalog(logits, validate_args=False).log_power_sums(torch.full((4, 1), -2)).isfinite().all()


@pytest.mark.parametrize("validate", [True, False])
def test_an_embedding_catalog_refuses_tables_and_masks_on_another_device(validate):
    """With the checks off, masked_items on another device were scattered as garbage (a log normaliser that changed from
    run to run) and an item table on another device failed inside torch at the first use, naming neither (found by
    review); either is a ValueError naming it, checks or not."""
    user, item, masks = torch.randn(4, 8), torch.randn(30, 8), torch.tensor([[0], [1], [2], [3]])
    with pytest.raises(ValueError, match="masked_items must be on the scores' device cpu, got meta"):
        EmbeddingCatalog(user, item, masked_items=masks.to("meta"), validate_args=validate)
    with pytest.raises(ValueError, match="item must be on the scores' device cpu, got meta|item is on the meta device"):
        EmbeddingCatalog(user, item.to("meta"), validate_args=validate)  # with the checks: meta holds no values


def test_samplers_check_the_arguments_of_their_public_methods():
    """Called directly (the catalogs call them with checked arguments), they leaked torch's errors, or answered
    garbage: ``-5`` ids drawn, ``-inf`` counts for float ids."""
    uniform, in_batch = capg_rec.UniformSampler(8), capg_rec.InBatchSampler()
    batch = torch.tensor([[1, 2], [2, 3]])
    for num_items in (0, -1):
        with pytest.raises(ValueError, match="num_items must be >= 1"):
            uniform.draw(num_items, None, generator=None, device="cpu")
        with pytest.raises(ValueError, match="num_items must be >= 1"):
            uniform.log_expected_count(torch.arange(3), num_items, None)
    with pytest.raises(TypeError, match="num_items must be an int"):
        uniform.draw(2.5, None, generator=None, device="cpu")
    with pytest.raises(ValueError, match="device must name a torch device"):
        uniform.draw(8, None, generator=None, device="bogus")
    with pytest.raises(TypeError, match=r"ids must be an integer tensor \[S\], got list"):
        uniform.log_expected_count([1, 2], 8, None)
    with pytest.raises(ValueError, match="batch_items must be 2-d"):
        in_batch.draw(20, torch.ones(4, dtype=torch.long), generator=None, device="cpu")
    with pytest.raises(TypeError, match="batch_items must be an integer tensor"):
        in_batch.draw(20, torch.ones(2, 2), generator=None, device="cpu")
    with pytest.raises(TypeError, match="batch_items must be an integer tensor"):
        in_batch.observe([1, 2])
    with pytest.raises(ValueError, match=r"batch_items must hold ids in \[-1, 20\) \(-1: padding\), got values in "
                                         r"\[-5, -5\]"):
        in_batch.draw(20, torch.full((2, 2), -5), generator=None, device="cpu")
    with pytest.raises(ValueError, match=r"batch_items must hold ids in \[-1, 3\)"):
        in_batch.draw(3, batch, generator=None, device="cpu")
    with pytest.raises(TypeError, match=r"ids must be an integer tensor \[S\], got torch.float32"):
        in_batch.log_expected_count(torch.ones(3), 20, None)
    assert in_batch.draw(20, batch, generator=None, device="cpu").tolist() == [1, 2, 2, 3]  # valid: as before
    for device in (None, torch.device("cpu"), "cpu"):  # None (torch's default) as before (a diff review)
        assert uniform.draw(8, None, generator=None, device=device).shape == (8,)
        assert in_batch.draw(20, batch, generator=None, device=device).shape == (4,)
    mixed = capg_rec.MixedSampler(in_batch, uniform)  # None: the batch's device for both parts (a diff review)
    torch.set_default_device("meta")
    try:
        assert mixed.draw(20, batch, generator=None, device=None).device.type == "cpu"
    finally:
        torch.set_default_device(None)
    with pytest.raises(TypeError, match="device must be a torch.device, a str or None, got float 1.5"):
        uniform.draw(8, None, generator=None, device=1.5)


def test_in_batch_draws_read_no_value_back_with_the_checks_off():
    """Its ids' range check read two values back with int() on every draw, checks off too (a diff review)."""
    sampler, batch = capg_rec.InBatchSampler(), torch.tensor([[1, 2], [2, 3]])
    capg_rec.set_default_validate_args(False)
    try:
        with count_host_syncs() as calls:
            sampler.draw(20, batch, generator=None, device="cpu")
    finally:
        capg_rec.set_default_validate_args(True)
    assert calls == []
    with count_host_syncs() as calls:  # checks on: through numpy, on the host
        sampler.draw(20, batch, generator=None, device="cpu")
    assert "__int__" not in calls and "item" not in calls


def test_in_batch_sampler_refuses_a_seed_out_of_range_and_tables_that_are_not_counts():
    with pytest.raises(ValueError, match=r"seed must be in \[-2\^63, 2\^64\) \(a torch.Generator's seeds\), got "
                                         r"1180591620717411303424"):
        capg_rec.InBatchSampler(seed=2**70)
    with pytest.raises(ValueError, match="seed must be in"):
        capg_rec.InBatchSampler(seed=-2**63 - 1)
    assert capg_rec.InBatchSampler(seed=-1).seed == -1  # torch takes it (a diff review: refused at first)
    sampler = capg_rec.InBatchSampler(num_buckets=16)
    sampler.observe(torch.tensor([[1, 2], [2, 3]]))
    for bad in (math.nan, math.inf, -1.0):
        state = sampler.state_dict()
        state["interval"].fill_(bad)  # NaN tables gave NaN expected counts
        with pytest.raises(ValueError, match=r"state\['interval'\] must hold finite values >= 0"):
            capg_rec.InBatchSampler(num_buckets=16).load_state_dict(state)


def test_drawn_sample_refuses_complex_ids_and_names_a_bad_device():
    sampler = capg_rec.UniformSampler(4)
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        capg_rec.DrawnSample(torch.ones(4, dtype=torch.complex64), sampler)
    sample = capg_rec.DrawnSample(torch.arange(4), sampler)
    with pytest.raises(ValueError, match="device must name a torch device, got 'bogus'"):
        sample.to("bogus")
    with pytest.raises(TypeError, match="device must be a torch.device"):
        sample.to(1.5)


def test_faiss_index_refuses_float64_vectors_beyond_float32():
    """faiss scores in float32: vectors of 1e200 became inf there, and it answered ids -1 and wrong ones."""
    pytest.importorskip("faiss")
    from capg_rec.ann import FaissIndex
    gen = torch.Generator().manual_seed(0)
    items = torch.randn(20, 4, generator=gen, dtype=torch.float64)
    with pytest.raises(ValueError, match="item_vectors must be within float32's range"):
        FaissIndex(items * 1e200)
    with pytest.raises(ValueError, match="queries must be within float32's range"):
        FaissIndex(items).search(torch.randn(3, 4, generator=gen, dtype=torch.float64) * 1e200, 3)
    with pytest.raises(ValueError, match="must have inner products within float32's range"):  # a diff review
        FaissIndex(items.float() * 1e30).search(torch.randn(3, 4, generator=gen) * 1e10, 3)


@pytest.mark.parametrize("kind", ["exact", "faiss"])
def test_index_scores_of_half_queries_are_float32(kind):
    """Scored in float32 and returned in float16, products of 200-scaled vectors came back inf."""
    if kind == "faiss":
        pytest.importorskip("faiss")
    from capg_rec.ann import ExactIndex, FaissIndex
    gen = torch.Generator().manual_seed(0)
    items, queries = (torch.randn(n, 4, generator=gen).half() * 200 for n in (20, 3))
    scores, ids = (ExactIndex if kind == "exact" else FaissIndex)(items).search(queries, 3)
    assert scores.dtype == torch.float32 and bool(scores.isfinite().all())
    torch.testing.assert_close(scores, (queries.float() @ items.float().T).gather(1, ids))


def test_recall_counts_no_padding_as_a_hit():
    """-1 (an index's padding) matched -1 in the exact ids: recall_at_k([[-1, -1]], [[1, -1]]) was 0.5."""
    from capg_rec.ann import recall_at_k
    assert recall_at_k(torch.tensor([[-1, -1]]), torch.tensor([[1, -1]])) == 0.0
    assert recall_at_k(torch.tensor([[1, -1]]), torch.tensor([[1, -1]])) == 1.0
    assert recall_at_k(torch.tensor([[1, 2], [3, -1]]), torch.tensor([[1, 4], [3, 5]])) == 0.5
    with pytest.raises(ValueError, match=r"found and exact must hold at least one id \(exact: not -1\), got shape "
                                         r"\(1, 1\) of -1 ids"):
        recall_at_k(torch.tensor([[1]]), torch.tensor([[-1]]))


def test_enumeration_affordable_checks_its_sizes():
    enumeration = capg_rec.marginals.Enumeration
    with pytest.raises(TypeError, match="num_items must be an int"):
        enumeration.affordable("8", 3)
    with pytest.raises(ValueError, match="num_items must be >= 1"):
        enumeration.affordable(-1, 3)
    with pytest.raises(ValueError, match="num_candidates must be >= 1"):
        enumeration.check_affordable(8, -1)
    assert not enumeration.affordable(3, 5)  # no draw of 5 out of 3 (it clamped K to N: True)
    with pytest.raises(ValueError, match="num_candidates must be at most num_items = 3"):
        enumeration.check_affordable(3, 5)
    assert enumeration.affordable(8, 8)


def test_testing_strategies_check_their_options_when_made():
    from capg_rec import testing
    for option in ("extreme", "ties", "masked"):
        with pytest.raises(TypeError, match=f"{option} must be True or False"):
            testing.logits(**{option: "no"})  # a truthy string turned the option on
    for make in (testing.logits, testing.contexts):
        with pytest.raises(TypeError, match="dtype must be a floating torch.dtype, got torch.int64"):
            make(dtype=torch.long)
    with pytest.raises(ValueError, match="max_items must be >= 1"):
        testing.esr_cases(max_items=0)  # checked when made, not at Hypothesis's first draw


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_importance_weights_stay_at_most_max_weight(dtype):
    """exp(log 100) rounded to 100.00000762939453 in float32 (a review); a cap beyond the dtype's range, or one it
    cannot hold, is taken as the dtype's largest number at most the cap (the first fix raised torch's overflow
    error at max_weight=1e5 in float16: a diff review)."""
    log_ratio = torch.tensor([10.0, 4.6052, -1e4, 1e4], dtype=dtype)
    weights = F.importance_weights(log_ratio, max_weight=100.0)
    assert bool((weights <= 100.0).all()) and float(weights[0]) >= 99.0
    assert bool((F.importance_weights(log_ratio, max_weight=100.3) <= 100.3).all())
    for cap in (1e5, 1e39, 1e300):
        assert bool(F.importance_weights(log_ratio, max_weight=cap).isfinite().all())
    logits, candidates, chosen, rewards = _problem()
    loss = F.offpolicy_vpg_loss(logits.to(dtype), candidates, chosen, rewards.to(dtype), rewards[:, 0].to(dtype) - 5,
                                max_weight=1e39)
    assert loss.isfinite()


def test_log_reader_takes_the_launchers_ranks_without_a_process_group(tmp_path, monkeypatch):
    """A torchrun job that made no process group read every row on every rank."""
    from capg_rec.logs import LoggedImpressions
    from logs import write_logs
    write_logs(tmp_path / "a.parquet", [3, 4, 5, 6])
    everything = sorted(int(r) for b in LoggedImpressions(tmp_path, 4) for r in b.request_id)
    mine = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        mine.append(sorted(int(r) for b in LoggedImpressions(tmp_path, 4) for r in b.request_id))
        given = LoggedImpressions(tmp_path, 4, rank=int(rank), world_size=2)
        assert mine[-1] == sorted(int(r) for b in given for r in b.request_id)
    assert sorted(mine[0] + mine[1]) == everything and mine[0] and mine[1]
    for rank, world, message in (("x", "2", "must be integers"), ("2", "2", r"RANK=2 must be in \[0, WORLD_SIZE=2\)")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(ValueError, match=message):
            list(LoggedImpressions(tmp_path, 4))


def test_masks_and_heads_are_named_by_their_own_width():
    """A review: masked_items of the wrong shape was refused as "must have shape [B=4, L]"; its width is E (as the
    docstrings give it), a SampledCatalog's head H."""
    users, items = torch.randn(4, 3), torch.randn(10, 3)
    with pytest.raises(ValueError, match=r"masked_items must have shape \[B=4, E\], got \(5, 1\)"):
        EmbeddingCatalog(users, items, masked_items=torch.zeros(5, 1, dtype=torch.long))
    sampler = capg_rec.UniformSampler(4)
    with pytest.raises(ValueError, match=r"masked_items must have shape \[B=4, E\], got \(5, 1\)"):
        capg_rec.SampledCatalog(users, items, sampler=sampler, masked_items=torch.zeros(5, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"head_items must have shape \[B=4, H\], got \(3,\)"):
        capg_rec.SampledCatalog(users, items, sampler=sampler, head_items=torch.zeros(3, dtype=torch.long))
    # a diff review: batch_items, of any batch, was named [B=4, H'] (a [7, 2] is taken)
    with pytest.raises(ValueError, match=r"batch_items must have shape \[B', H'\], got \(7,\)"):
        capg_rec.SampledCatalog(users, items, sampler=sampler, batch_items=torch.zeros(7, dtype=torch.long))
