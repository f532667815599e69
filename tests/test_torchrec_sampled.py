"""The retriever's sampled mode: a SampledCatalog over the rows a batch lists (a negative sample and the
head), looked up through TorchRec. Multi-rank runs are in test_torchrec_multirank.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor  # noqa: E402

import capg_rec  # noqa: E402
from capg_rec import CAPGLoss, DrawnSample, SampledCatalog, UniformSampler, sample_candidates  # noqa: E402
from capg_rec.torchrec import TwoTowerRetriever  # noqa: E402

NUM_ITEMS, NUM_USERS, M, D = 3000, 8, 2, 3  # more than the 2048 items that mean-field reads whole


def _retriever(num_items: int = NUM_ITEMS, **kw) -> TwoTowerRetriever:
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name="item_table", embedding_dim=M * D, num_embeddings=num_items, feature_names=["catalog"]),
        EmbeddingConfig(name="user_table", embedding_dim=M * D, num_embeddings=NUM_USERS, feature_names=["user_id"])])
    return TwoTowerRetriever(ec, item_table="item_table", num_experts=M, user_features=["user_id"], **kw)


def _retriever_one_expert() -> TwoTowerRetriever:
    torch.manual_seed(1)
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name="item_table", embedding_dim=D, num_embeddings=NUM_ITEMS, feature_names=["catalog"]),
        EmbeddingConfig(name="user_table", embedding_dim=D, num_embeddings=NUM_USERS, feature_names=["user_id"])])
    return TwoTowerRetriever(ec, item_table="item_table", user_features=["user_id"])


def _users(users: list[int]) -> KeyedJaggedTensor:
    ids = torch.tensor(users, dtype=torch.long)
    return KeyedJaggedTensor.from_lengths_sync(["user_id"], ids, torch.ones_like(ids))


def _batch(retriever, users, num_samples=20, head_width=4, seed=0, num_items=NUM_ITEMS):
    g = torch.Generator().manual_seed(seed)
    sampler = UniformSampler(num_samples)
    sample = DrawnSample(sampler.draw(num_items, None, generator=g, device=torch.device("cpu")), sampler)
    head = torch.stack([torch.randperm(num_items, generator=g)[:head_width] for _ in users])
    head[0, -1] = -1  # padding
    listed = torch.cat([sample.ids, head.flatten()[head.flatten() >= 0]]).unique()
    return retriever.with_catalog(_users(users), items=listed), sample, head


def _tables(retriever):
    weights = retriever.embeddings.embeddings
    return weights["user_table"].weight, weights["item_table"].weight


@pytest.mark.filterwarnings("ignore:mean-field reads")  # no index head: biased, alike in both
@pytest.mark.filterwarnings("ignore:the plug-in takes")
@pytest.mark.parametrize("method", ["with_replacement", "mean_field", "plugin"])
@pytest.mark.parametrize("masked", [False, True])
def test_sampled_mode_equals_a_sampled_catalog_on_the_whole_table(masked, method):
    """Sums, scores, draws, a CA-PG loss and the tables' gradients equal those of a SampledCatalog built on
    the full tables with the same sample and head."""
    retriever = _retriever()
    users = [3, 1, 7, 0, 5]
    kjt, sample, head = _batch(retriever, users, num_samples=300, head_width=40)
    mask = torch.tensor([[head[0, 0].item(), -1]] * len(users)) if masked else None
    catalog = retriever(kjt, sample=sample, head_items=head, masked_items=mask)
    assert isinstance(catalog, SampledCatalog)
    user_w, item_w = _tables(retriever)
    ref = SampledCatalog(user_w[torch.tensor(users)].view(-1, M, D), item_w.view(-1, M, D), sampler=sample,
                         head_items=head, masked_items=mask)
    exclude = head[:, :2]
    torch.testing.assert_close(catalog.log_power_sums(exclude, 3), ref.log_power_sums(exclude, 3))
    named = torch.where(head >= 0, head, head[:, :1])
    torch.testing.assert_close(catalog.gather(named), ref.gather(named))
    draws = [c.top_items(4, experts=[1], generator=torch.Generator().manual_seed(9), perturb=True)
             for c in (catalog, ref)]
    assert torch.equal(*draws)
    candidates = sample_candidates(ref, 3, generator=torch.Generator().manual_seed(4))
    chosen, rewards = candidates[:, :1], torch.rand(len(users), 1, generator=torch.Generator().manual_seed(5))
    grads = []
    for c, tables in ((catalog, _tables(retriever)), (ref, (user_w, item_w))):
        for t in tables:
            t.grad = None
        CAPGLoss(3, method=method)(c, candidates, chosen, rewards).backward()
        grads.append([t.grad.clone() for t in tables])
    for mine, theirs in zip(*grads):
        torch.testing.assert_close(mine, theirs)
    assert float(grads[0][1].abs().sum(1).gt(0).sum()) <= len(set(sample.ids.tolist()) | set(head.flatten().tolist()))


def test_sampled_mode_refuses_what_it_cannot_score():
    retriever = _retriever()
    kjt, sample, head = _batch(retriever, [1, 2])
    with pytest.raises(TypeError, match="sample must be a DrawnSample"):
        retriever(kjt, head_items=head)
    with pytest.raises(ValueError, match="head_items must be an id tensor"):
        retriever(kjt, sample=sample, head_items=head[:1])
    listed = set(kjt["catalog"].values().tolist())
    unlisted = torch.tensor([[next(i for i in range(NUM_ITEMS) if i not in listed)]] * 2)
    with pytest.raises(ValueError, match="every id of head_items must be listed"):
        retriever(kjt, sample=sample, head_items=unlisted)
    catalog = retriever(kjt, sample=sample, head_items=head)
    with pytest.raises(ValueError, match="was not looked up"):
        catalog.gather(unlisted)
    plain = retriever.with_catalog(_users([1, 2]))  # every row listed: the sample is, trivially
    assert isinstance(retriever(plain, sample=sample), SampledCatalog)
    small = _retriever(num_items=100)  # mean-field reads catalogs of up to 2048 items whole
    kjt, sample, head = _batch(small, [1, 2], num_samples=10, head_width=3, num_items=100)
    candidates = head[:, :2].clamp(min=0)
    candidates[0, 1] = head[0, 1]
    with pytest.raises(ValueError, match="was not looked up"):
        CAPGLoss(2)(small(kjt, sample=sample, head_items=head), candidates, candidates[:, :1], torch.ones(2, 1))
    with pytest.raises(TypeError, match="items must be a 1-d tensor"):
        retriever.with_catalog(_users([1]), items=torch.zeros(2, 2, dtype=torch.long))
    bad = retriever.with_catalog(_users([1, 2]), items=torch.tensor([0, NUM_ITEMS]))
    with pytest.raises(ValueError, match="must list item ids in"):
        retriever(bad, sample=DrawnSample(torch.tensor([0]), UniformSampler(1)))


def test_a_loss_checks_the_lookups_of_an_inclusion_method_of_your_own():
    """A validated loss skips the lookup checks of the ids its checks vouched for only around the library's own
    methods: a method of your own that reads ids the batch did not list is refused inside the loss, as outside it.
    Regression (found by review): inside the loss it read other rows silently and gave a finite loss."""

    class WholeSoftmax(capg_rec.InclusionMethod):  # log(K · softmax(a)), the whole catalog read exactly
        is_probability = uses_top_items = False

        def log_inclusion(self, catalog, items, runs):
            every = catalog.gather(torch.arange(catalog.num_items).expand(catalog.batch_size, -1))[:, 0]
            return catalog.gather(items)[:, 0] - every.logsumexp(1, keepdim=True) + math.log(sum(n for _, n in runs))

    retriever = _retriever(num_items=100)
    kjt, sample, head = _batch(retriever, [1, 2], num_samples=10, head_width=3, num_items=100)
    catalog = retriever(kjt, sample=sample, head_items=head)
    candidates = head[:, :2].clamp(min=0)
    candidates[0, 1] = head[0, 1]
    with pytest.raises(ValueError, match="was not looked up"):
        capg_rec.inclusion_log_prob(catalog, candidates, 2, method=WholeSoftmax())
    with pytest.raises(ValueError, match="was not looked up"):
        CAPGLoss(2, method=WholeSoftmax())(catalog, candidates, candidates[:, :1], torch.ones(2, 1))
    replaced = capg_rec.MeanField()  # a library method whose log_inclusion is replaced on the instance
    replaced.log_inclusion = WholeSoftmax().log_inclusion.__func__.__get__(replaced)
    with pytest.raises(ValueError, match="was not looked up"):
        CAPGLoss(2, method=replaced)(catalog, candidates, candidates[:, :1], torch.ones(2, 1))


def test_sampled_estimate_is_unbiased_through_the_retriever():
    """Over sampler seeds the mean of the estimated normaliser's exp is the exact one, within 4 standard
    errors of the seeds' mean (a one-sided chance below 1e-4 under normality)."""
    retriever = _retriever()
    users = [0, 4]
    user_w, item_w = _tables(retriever)
    exact = torch.logsumexp(torch.einsum("bmd,nmd->bmn", user_w[torch.tensor(users)].view(-1, M, D).double(),
                                         item_w.view(-1, M, D).double()), dim=2)
    values = []
    with torch.no_grad():
        for seed in range(400):
            kjt, sample, head = _batch(retriever, users, num_samples=15, head_width=3, seed=seed)
            values.append(retriever(kjt, sample=sample, head_items=head).log_normalizer().double().exp())
    values = torch.stack(values)
    mean, se = values.mean(0), values.std(0) / math.sqrt(len(values))
    assert bool(((mean - exact.exp()).abs() <= 4 * se).all()), (mean, exact.exp(), se)


def test_index_head_names_each_experts_best_items_and_rebuilds_on_schedule():
    """The head is each expert's exact top H of the user·item scores (an exact index); between rebuilds it
    keeps the index it has, and every `refresh_every` calls it reads the item side anew."""
    from capg_rec.torchrec import IndexHead
    retriever = _retriever()
    users = [3, 1, 7]
    user_w, item_w = _tables(retriever)

    def best(h):
        scores = torch.einsum("bmd,nmd->bmn", user_w[torch.tensor(users)].view(-1, M, D), item_w.view(-1, M, D))
        return scores.topk(h, dim=2).indices

    head = IndexHead(retriever, 7, refresh_every=2)
    first = head(_users(users))
    assert first.shape == (3, M, 7) and torch.equal(first, best(7))
    before = best(7)
    with torch.no_grad():
        item_w.mul_(-1.0)  # every expert's ranking reversed
    assert torch.equal(head(_users(users)), before)  # the second call: the same index
    assert torch.equal(head(_users(users)), best(7)) and not torch.equal(best(7), before)  # rebuilt


def test_index_head_state_dict_continues_as_the_saved_head():
    """A head loaded from a checkpoint keeps the saved index until the saved schedule rebuilds it, as the saved head
    does (found by review: it had no state, so a restarted run rebuilt at once and its head shifted)."""
    from capg_rec.torchrec import IndexHead
    retriever = _retriever()
    users = _users([3, 1, 7])
    _, item_w = _tables(retriever)
    head = IndexHead(retriever, 5, refresh_every=3)
    old = head(users)
    head(users)
    state = head.state_dict()
    assert state["calls"] == 2 and state["vectors"].shape == (NUM_ITEMS, M, D)
    with torch.no_grad():
        item_w.mul_(-1.0)  # every expert's ranking reversed
    restored = IndexHead(retriever, 5, refresh_every=3)
    restored.load_state_dict(state)
    third = restored(users)
    assert torch.equal(third, head(users)) and torch.equal(third, old)  # call 3: the saved index
    fourth = restored(users)
    assert torch.equal(fourth, head(users)) and not torch.equal(fourth, old)  # call 4: both rebuilt
    assert not torch.equal(IndexHead(retriever, 5, refresh_every=3)(users), old)  # unrestored: rebuilt at once
    with pytest.raises(TypeError, match="state must be a dict"):
        restored.load_state_dict([2])
    for bad, match in (({"calls": -1}, r"state\['calls'\] must be an int >= 0"),
                       ({"calls": 2}, "no 'vectors' at call 2"), ({"calls": 0, "other": 1}, "must hold 'calls'"),
                       ({"calls": 2, "vectors": torch.zeros(3, M, D)}, "vectors"),
                       ({"calls": 2, "vectors": torch.zeros(NUM_ITEMS, M + 1, D)}, "vectors")):
        with pytest.raises(ValueError, match=match):
            restored.load_state_dict(bad)
    with pytest.raises(TypeError, match=r"floating-point torch.Tensor of item vectors, got torch.int64"):
        restored.load_state_dict({"calls": 2, "vectors": torch.zeros(NUM_ITEMS, M, D, dtype=torch.long)})
    with pytest.raises(TypeError, match=r"floating-point torch.Tensor of item vectors, got ndarray"):
        restored.load_state_dict({"calls": 2, "vectors": np.zeros((NUM_ITEMS, M, D), np.float32)})
    fresh = IndexHead(retriever, 5, refresh_every=3)  # as after a restart: D unknown until the users come
    fresh.load_state_dict({"calls": 2, "vectors": torch.zeros(NUM_ITEMS, M, D + 1)})
    with pytest.raises(ValueError, match=rf"item vectors of D={D + 1} \(load_state_dict's.* users have D={D}: load a "
                                         r"state of this retriever, or refresh\(\)"):
        fresh(users)
    assert fresh.calls == 2  # a refused call does not count (it moved the head on to its next rebuild)
    fresh.load_state_dict(state)  # the right state after a wrong one (a diff review: refused against the wrong D)
    assert torch.equal(fresh(users), old)
    restored.load_state_dict({"calls": np.int64(0)})  # a state from before the first build: nothing built
    assert restored.index is None and sorted(restored.state_dict()) == ["calls"] and type(restored.calls) is int


def test_sampled_mode_with_an_index_head_equals_a_sampled_catalog_with_the_index():
    """An index head listed in the batch (index_items) gives the catalog a SampledCatalog with the same index
    gives: the sums, the head's size (mean-field reads it without a bias warning), CA-PG losses and the
    tables' gradients."""
    import warnings

    from capg_rec.ann import ExactIndex
    from capg_rec.torchrec import IndexHead
    retriever = _retriever()
    users = [3, 1, 7, 0]
    h = 30  # mean-field's head at K = 6, M = 2: 8·3 + 3 = 27 best items per expert
    found = IndexHead(retriever, h)(_users(users))
    g = torch.Generator().manual_seed(0)
    sampler = UniformSampler(200)
    sample = DrawnSample(sampler.draw(NUM_ITEMS, None, generator=g, device=torch.device("cpu")), sampler)
    listed = torch.cat([sample.ids, found.flatten()]).unique()
    kjt = retriever.with_catalog(_users(users), items=listed)
    user_w, item_w = _tables(retriever)
    index = ExactIndex(item_w.detach().view(-1, M, D))

    def reference():
        return SampledCatalog(user_w[torch.tensor(users)].view(-1, M, D), item_w.view(-1, M, D), sampler=sample,
                              index=index, head_size=h)

    candidates = sample_candidates(reference(), 6, generator=torch.Generator().manual_seed(4))
    chosen, rewards = candidates[:, :2], torch.rand(len(users), 2, generator=g)
    for method in ("mean_field", "plugin", "with_replacement"):
        grads = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "mean-field reads ... biased"
            for catalog in (retriever(kjt, sample=sample, index_items=found), reference()):
                assert catalog.exact_top == h
                torch.testing.assert_close(catalog.log_power_sums(None, 3), reference().log_power_sums(None, 3))
                for t in _tables(retriever):
                    t.grad = None
                CAPGLoss(6, method=method)(catalog, candidates, chosen, rewards).backward()
                grads.append([t.grad.clone() for t in _tables(retriever)])
        for mine, theirs in zip(*grads):
            torch.testing.assert_close(mine, theirs)


def test_index_head_and_index_items_refuse_bad_input():
    from capg_rec.torchrec import IndexHead
    retriever = _retriever()
    with pytest.raises(TypeError, match="retriever must be a TwoTowerRetriever"):
        IndexHead(retriever.embeddings, 3)
    with pytest.raises(ValueError, match="size"):
        IndexHead(retriever, 0)
    with pytest.raises(ValueError, match="refresh_every"):
        IndexHead(retriever, 3, refresh_every=0)
    with pytest.raises(TypeError, match="index must be a callable"):
        IndexHead(retriever, 3, index="flat")
    with pytest.raises(TypeError, match="index must build an ItemIndex"):
        IndexHead(retriever, 3, index=lambda items: items)(_users([1]))
    kjt, sample, head = _batch(retriever, [1, 2])
    found = IndexHead(retriever, 3)(_users([1, 2]))
    with pytest.raises(ValueError, match="index_items must be an id tensor"):
        retriever(kjt, sample=sample, index_items=found[:, 0])
    with pytest.raises(ValueError, match="every id of index_items must be listed"):
        retriever(kjt, sample=sample, index_items=found)
    with pytest.raises(TypeError, match="head_items and index_items need one"):
        retriever(kjt, index_items=found)
    user_w, item_w = _tables(retriever)
    from capg_rec.ann import ExactIndex
    index = ExactIndex(item_w.detach().view(-1, M, D))
    with pytest.raises(ValueError, match="index .with head_size. or index_items, not both"):
        SampledCatalog(user_w[:2].view(-1, M, D), item_w.view(-1, M, D), sampler=sample, index=index, head_size=3,
                       index_items=found)
    with pytest.raises(ValueError, match="index_items must be an id tensor"):
        SampledCatalog(user_w[:2].view(-1, M, D), item_w.view(-1, M, D), sampler=sample, index_items=found[:, :1])
    with pytest.raises(ValueError, match="index_items must hold ids"):
        SampledCatalog(user_w[:2].view(-1, M, D), item_w.view(-1, M, D), sampler=sample, index_items=found - NUM_ITEMS)


def test_listed_rows_check_every_call_outside_trusting():
    """The sampled mode's item side checks every id it is asked for, except inside ``trusting`` (call sites that
    every rank runs alike, with ids checked otherwise); with nothing listed it still gives rows of the ids' shape
    there (regression: a view error on that rank alone, which left the others waiting)."""
    from capg_rec.torchrec.retriever import _ListedRows
    rows = _ListedRows(torch.tensor([5, 2, 9]), torch.arange(6.0).view(3, 1, 2), None, True)
    torch.testing.assert_close(rows(torch.tensor([[2, 9], [5, 5]])),
                               torch.tensor([[2.0, 3.0], [4.0, 5.0], [0.0, 1.0], [0.0, 1.0]]).view(2, 2, 1, 2))
    unlisted = torch.tensor([[3]])
    assert rows.listed(unlisted) is False and rows.listed(torch.tensor([[9, 2]])) is True
    with pytest.raises(ValueError, match="was not looked up"):
        rows(unlisted)
    with rows.trusting():
        assert rows(unlisted).shape == (1, 1, 1, 2)
    with pytest.raises(ValueError, match="was not looked up"):
        rows(unlisted)
    empty = _ListedRows(torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, 2), None, True)
    assert empty.listed(unlisted) is False and empty.listed(unlisted[:0]) is True
    with pytest.raises(ValueError, match="was not looked up"):
        empty(unlisted)
    with empty.trusting():
        assert torch.equal(empty(torch.tensor([[3, 4]])), torch.zeros(1, 2, 1, 2))


@pytest.mark.parametrize("method", ["mean_field", "plugin", "exact"])
def test_a_rank_without_users_reads_a_small_catalog_whole_without_listing_it(method):
    """A rank with an empty batch asks the item side for no item when the catalog is read whole (found by a diff review:
    the one-product read asked it for every item, which that rank had not listed, and every rank raised); it still
    calls the item side, whose check is collective."""
    from capg_rec.torchrec.retriever import _ListedRows, _RankSampledCatalog

    item, listed = torch.randn(50, 4), torch.tensor([5, 9, 11])
    asked = []

    class Rows(_ListedRows):
        def __call__(self, ids):
            asked.append(ids.numel())
            return super().__call__(ids)

    user = torch.zeros(0, 4, requires_grad=True)
    cat = _RankSampledCatalog(user, Rows(listed, item[listed], None, True), num_items=50,
                              sampler=DrawnSample(listed, UniformSampler(3)), group=None, check_draws=True)
    asked.clear()
    none = torch.zeros(0, 3, dtype=torch.long)
    loss = CAPGLoss(3, method=method)(cat, none, none[:, :1], torch.zeros(0, 1))
    assert float(loss) == 0.0 and 0 in asked
    loss.backward()  # in the graph, as a lookup of no item is (found by a diff review: no grad_fn, a rank raised)
    assert torch.equal(user.grad, torch.zeros(0, 4))


def test_resampled_catalog_of_the_sampled_mode_equals_a_fresh_one():
    """The loss's catalog of an on-policy step, drawn candidates as its head and a second sample listed in the
    same lookup, is the SampledCatalog built on the full tables with that sample, head and index head; an id
    of the new sample that was not listed raises."""
    from capg_rec.torchrec import IndexHead
    retriever = _retriever()
    users = [3, 1, 7]
    found = IndexHead(retriever, 30)(_users(users))
    g = torch.Generator().manual_seed(0)
    sampler = UniformSampler(150)
    first, second = (DrawnSample(sampler.draw(NUM_ITEMS, None, generator=g, device=torch.device("cpu")), sampler)
                     for _ in range(2))
    kjt = retriever.with_catalog(_users(users), items=torch.cat([first.ids, second.ids, found.flatten()]).unique())
    catalog = retriever(kjt, sample=first, index_items=found)
    candidates = sample_candidates(catalog, 6, generator=torch.Generator().manual_seed(3))
    chosen, rewards = candidates[:, :2], torch.rand(len(users), 2, generator=g)
    user_w, item_w = _tables(retriever)
    ref = SampledCatalog(user_w[torch.tensor(users)].view(-1, M, D), item_w.view(-1, M, D), sampler=second,
                         index_items=found, head_items=candidates)
    grads = []
    for c in (catalog.resampled(second, head_items=candidates), ref):
        assert c.exact_top == 30
        torch.testing.assert_close(c.log_power_sums(None, 3), ref.log_power_sums(None, 3))
        for t in _tables(retriever):
            t.grad = None
        CAPGLoss(6)(c, candidates, chosen, rewards).backward()
        grads.append([t.grad.clone() for t in _tables(retriever)])
    for mine, theirs in zip(*grads):
        torch.testing.assert_close(mine, theirs)
    listed = set(kjt["catalog"].values().tolist())
    unlisted = torch.tensor([next(i for i in range(NUM_ITEMS) if i not in listed)])
    with pytest.raises(ValueError, match="was not looked up"):
        catalog.resampled(DrawnSample(unlisted, UniformSampler(1)))


def test_index_head_regressions_from_review():
    """Regressions, each failing before its fix: an empty batch (the index head, the user side and the
    catalogs raised a reshape error); the index head in train mode (it updated batch norm's running
    statistics and drew dropout); bool ids (isin's error, not one naming the argument); one expert's head
    given as [B, H] (refused by the forward, taken by SampledCatalog); a resampled catalog with a sampler
    that is not a listed sample (an unrelated "not looked up" error); a bad device string."""
    from torch import nn

    from capg_rec.ann import ExactIndex
    from capg_rec.torchrec import IndexHead
    retriever = _retriever()
    empty = _users([])
    assert retriever.user_vectors(empty).shape == (0, M, D)
    found = IndexHead(retriever, 4)(empty)
    assert found.shape == (0, M, 4) and found.dtype == torch.long
    sampler = UniformSampler(20)
    sample = DrawnSample(sampler.draw(NUM_ITEMS, None, generator=torch.Generator().manual_seed(0),
                                      device=torch.device("cpu")), sampler)
    kjt = retriever.with_catalog(empty, items=sample.ids.unique())
    assert retriever(kjt, sample=sample, index_items=found).log_normalizer().shape == (0, M)
    user_w, item_w = _tables(retriever)
    for kw in ({"index_items": found}, {"index": ExactIndex(item_w.detach().view(-1, M, D)), "head_size": 4}):
        assert SampledCatalog(user_w[:0].view(0, M, D), item_w.view(-1, M, D), sampler=sample, **kw).exact_top == 4
    torch.manual_seed(0)
    tower = nn.Sequential(nn.Linear(M * D, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, M * D))
    towered = _retriever(user_tower=tower)
    towered.train()
    tower[2].eval()  # a mode of its own, put back as it was
    head = IndexHead(towered, 5)
    rng = torch.get_rng_state()
    first = head(_users([1, 2, 3]))
    assert int(tower[1].num_batches_tracked) == 0 and torch.equal(rng, torch.get_rng_state())
    assert torch.equal(first, head(_users([1, 2, 3])))
    assert towered.training and tower[1].training and not tower[2].training
    kjt, sample, head_ids = _batch(retriever, [1, 2])
    with pytest.raises(TypeError, match="index_items must be an integer tensor"):
        retriever(kjt, sample=sample, index_items=torch.ones(2, M, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="head_items must be an integer tensor"):
        retriever(kjt, sample=sample, head_items=head_ids > 0)
    with pytest.raises(ValueError, match="device must name a torch device"):
        IndexHead(retriever, 3, device="nope")
    catalog = retriever(kjt, sample=sample, head_items=head_ids)
    with pytest.raises(TypeError, match="sampler must be a DrawnSample .* got UniformSampler"):
        catalog.resampled(UniformSampler(10))
    single = _retriever_one_expert()
    found = IndexHead(single, 6)(_users([1, 2]))
    g = torch.Generator().manual_seed(0)
    sampler = UniformSampler(30)
    sample = DrawnSample(sampler.draw(NUM_ITEMS, None, generator=g, device=torch.device("cpu")), sampler)
    kjt = single.with_catalog(_users([1, 2]), items=torch.cat([sample.ids, found.flatten()]).unique())
    assert single(kjt, sample=sample, index_items=found[:, 0]).exact_top == 6


def test_index_heads_count_only_usable_ids_and_refuse_repeats():
    """Regression: an index head's padding (-1: an approximate index that found fewer) and masked items counted
    as exactly named best items (mean-field then silently took its head partly from the sample), a head
    repeating an id counted each copy, and the forward took negative ids silently. exact_top is now the
    fewest usable ids of any row and expert, and mean-field warns below its head."""
    import warnings
    retriever = _retriever()
    users = [3, 1]
    user_w, item_w = _tables(retriever)
    g = torch.Generator().manual_seed(0)
    sampler = UniformSampler(100)
    sample = DrawnSample(sampler.draw(NUM_ITEMS, None, generator=g, device=torch.device("cpu")), sampler)
    user, item = user_w[torch.tensor(users)].view(-1, M, D), item_w.view(-1, M, D)
    found = torch.arange(2 * M * 30).view(2, M, 30)
    padded = found.clone()
    padded[1, 0, -4:] = -1
    assert SampledCatalog(user, item, sampler=sample, index_items=padded).exact_top == 26
    masked = torch.tensor([found[0, 1, :8:2].tolist(), [7, 7, -1, -1]])  # 4 of row 0's expert-1 head; none of row 1's
    catalog = SampledCatalog(user, item, sampler=sample, index_items=found, masked_items=masked)
    assert catalog.exact_top == 26
    candidates = found[:, 0, :6]
    with pytest.warns(UserWarning, match="names only its best 26 exactly"):  # mean-field reads 8·3 + 3 = 27
        CAPGLoss(6)(catalog, candidates, candidates[:, :2], torch.ones(2, 2))
    repeated = found.clone()
    repeated[0, 1, 3] = repeated[0, 1, 2]
    with pytest.raises(ValueError, match="index_items must not repeat an item within a row"):
        SampledCatalog(user, item, sampler=sample, index_items=repeated)
    kjt = retriever.with_catalog(_users(users), items=torch.cat([sample.ids, found.flatten()]).unique())
    for bad, message in ((repeated, "must not repeat"), (found - 2 * M * 30 - 5, r"must hold ids in \[-1, ")):
        with pytest.raises(ValueError, match=message):
            retriever(kjt, sample=sample, index_items=bad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert retriever(kjt, sample=sample, index_items=padded).exact_top == 26


def test_the_readme_recipe_takes_an_approximate_index_padding():
    """Regression: the README's listing ``torch.cat([sample.ids, found.flatten()]).unique()`` kept the ``-1``
    that an approximate index pads with (here FAISS IVF probing one list), and ``with_catalog`` passed it on:
    a ValueError with validation, an IndexError without. ``-1`` entries are now left out of the listing, and
    the catalog is the one listing only the found ids."""
    import functools

    pytest.importorskip("faiss")
    from capg_rec.ann import FaissIndex
    from capg_rec.torchrec import IndexHead

    retriever = _retriever(num_items=600)
    users = [3, 1, 7]
    found = IndexHead(retriever, 40, index=functools.partial(FaissIndex, kind="ivf", nlist=30, nprobe=1))(
        _users(users))
    assert (found == -1).any() and (found >= 0).any()
    g = torch.Generator().manual_seed(0)
    sampler = UniformSampler(50)
    sample = DrawnSample(torch.cat([sampler.draw(600, None, generator=g, device=torch.device("cpu")),
                                    torch.tensor([-1])]), sampler)  # an unused slot too
    listed = torch.cat([sample.ids, found.flatten()]).unique()
    sums = []
    for items in (listed, listed[listed >= 0]):
        kjt = retriever.with_catalog(_users(users), items=items)
        assert (kjt["catalog"].values() >= 0).all()
        sums.append(retriever(kjt, sample=sample, index_items=found).log_power_sums(None, 2))
    torch.testing.assert_close(sums[0], sums[1], rtol=0, atol=0)
    assert torch.isfinite(sums[0]).all()


def test_towers_and_exports_regressions_from_review():
    """Regressions (found by review), each failing before its fix: batch norm in the item tower (its statistics
    over each chunk of rows, updated twice a step by the recomputed chunks) was taken; user_vectors took dense with
    a wrong number of rows (a bare RuntimeError), integer dense, and dense without a user tower (ignored); a dense
    of another dtype than the tower's failed in the matmul (on one rank, after the others had gone on); the
    exports ran in the module's mode (train: dropout on, batch norm's statistics updated)."""
    from torch import nn

    with pytest.raises(ValueError, match="item_tower must map item rows one by one"):
        _retriever(item_tower=nn.Sequential(nn.Linear(M * D, M * D), nn.BatchNorm1d(M * D)))
    torch.manual_seed(0)
    user_tower = nn.Sequential(nn.Linear(M * D + 2, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, M * D))
    item_tower = nn.Sequential(nn.Linear(M * D, 8), nn.Dropout(0.5), nn.Linear(8, M * D))
    towered = _retriever(user_tower=user_tower, item_tower=item_tower)
    users, dense = _users([1, 2, 3]), torch.randn(3, 2)
    for bad, error, match in ((dense[:2], ValueError, r"dense must have shape \[B, F\] with B = 3"),
                              (dense.long(), TypeError, "dense must be a floating tensor"),
                              (dense.double(), TypeError, "dense must have the user tower's dtype torch.float32")):
        with pytest.raises(error, match=match):
            towered.user_vectors(users, bad)
        with pytest.raises(error, match=match):
            towered(towered.with_catalog(users), bad)
    with pytest.raises(ValueError, match="dense features need a user_tower"):
        _retriever().user_vectors(users, dense)
    towered.train()
    tracked = int(user_tower[1].num_batches_tracked)
    first = (towered.user_vectors(users, dense), towered.item_vectors())
    second = (towered.user_vectors(users, dense), towered.item_vectors())
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])  # no dropout
    assert int(user_tower[1].num_batches_tracked) == tracked and towered.training and item_tower[1].training
    towered.eval()
    assert torch.equal(towered.user_vectors(users, dense), first[0])


def test_sampled_mode_checks_what_a_sampler_of_your_own_gives():
    """The retriever builds its sampled catalogs unchecked (its checks are collective): a NaN log expected count of a
    sampler of your own gave a normaliser of -inf there while a SampledCatalog refused it (found by review). Its
    collective checks now ask the sample, naming the sampler's class."""
    class Own(capg_rec.NegativeSampler):
        def draw(self, num_items, batch_items, *, generator, device):
            return torch.tensor([3, 4, 5])

        def log_expected_count(self, ids, num_items, batch_items):
            out = torch.full(ids.shape, math.log(3 / num_items), dtype=torch.float64)
            out[0] = math.nan
            return out

    retriever = _retriever()
    sample, head = DrawnSample(torch.tensor([3, 4, 5]), Own()), torch.tensor([[10, 11], [12, 13]])
    kjt = retriever.with_catalog(_users([3, 1]), items=torch.cat([sample.ids, head.flatten()]).unique())
    with pytest.raises(ValueError, match=r"Own\.log_expected_count must give finite values or -inf"):
        retriever(kjt, sample=sample, head_items=head)
    retriever.validate_args = False  # unchecked, as asked
    assert retriever(kjt, sample=sample, head_items=head).log_normalizer().shape == (2, M)


def test_sampled_mode_asks_the_counts_the_catalog_reads():
    """The retriever's check of a sample's counts asked them without the batch: a sample of an InBatchSampler with a
    given frequency (whose counts need the batch) was refused; and it asked log_expected_count where the catalog reads
    each row's counts from the other rows (a sampler that draws the batch, the batch being the heads), so a NaN there
    still gave a normaliser of -inf (the diff review)."""
    retriever = _retriever()
    head = torch.tensor([[10, 11, 12], [12, 13, -1]])
    frequency = torch.full((NUM_ITEMS,), 1 / NUM_ITEMS, dtype=torch.float64)
    for sampler in (capg_rec.InBatchSampler(frequency=frequency),
                    capg_rec.MixedSampler(capg_rec.InBatchSampler(frequency=frequency), UniformSampler(4))):
        sample = DrawnSample(sampler.draw(NUM_ITEMS, head, generator=None, device="cpu"), sampler)
        listed = torch.cat([sample.ids, head.flatten()])
        kjt = retriever.with_catalog(_users([3, 1]), items=listed[listed >= 0].unique())
        got = retriever(kjt, sample=sample, head_items=head).log_normalizer()
        assert got.shape == (2, M) and bool(got.isfinite().all())

    class OwnInBatch(capg_rec.NegativeSampler):
        draws_batch = property(lambda self: True)

        def draw(self, num_items, batch_items, *, generator, device):
            return batch_items.reshape(-1)

        def log_expected_count(self, ids, num_items, batch_items):
            return torch.full(ids.shape, math.log(6 / num_items), dtype=torch.float64)

        def log_expected_count_from_others(self, ids, num_items, batch_items):
            out = self.log_expected_count(ids, num_items, batch_items).expand(batch_items.shape[0], -1).clone()
            out[:, 0] = math.nan
            return out

    head = torch.tensor([[10, 11, 12], [13, 14, 15]])
    sampler = OwnInBatch()
    sample = DrawnSample(sampler.draw(NUM_ITEMS, head, generator=None, device="cpu"), sampler)
    kjt = retriever.with_catalog(_users([3, 1]), items=head.flatten())
    with pytest.raises(ValueError, match=r"OwnInBatch\.log_expected_count_from_others must give finite values"):
        retriever(kjt, sample=sample, head_items=head)
