"""ServingRetriever: the greedy top-K through an index equals the full-catalog greedy draw; a sampled
retrieval logs the propensities of the policy that drew it."""

import math

import pytest
import torch

from capg_rec import EmbeddingCatalog, greedy_candidates
from capg_rec.ann import ExactIndex, FaissIndex, ItemIndex
from capg_rec.logs import log_propensities
from capg_rec.serving import Retrieved, ServingRetriever


def _towers(num_items: int, num_experts: int, dim: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shape = (num_items, dim) if num_experts == 1 else (num_items, num_experts, dim)
    items = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
    proj = torch.randn(dim, num_experts * dim, generator=g, dtype=torch.float64).to(device)

    def user_tower(x):
        out = x @ proj
        return out if num_experts == 1 else out.view(x.shape[0], num_experts, dim)
    return user_tower, items


@pytest.mark.parametrize("num_experts, k", [(1, 5), (3, 7), (2, 12)])
def test_greedy_through_an_exact_index_is_the_catalog_greedy_draw(device, num_experts, k):
    tower, items = _towers(60, num_experts, 4, seed=num_experts, device=device)
    users = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    expected = greedy_candidates(EmbeddingCatalog(tower(users), items), k)
    for index in (ExactIndex(items), *([FaissIndex(items.float())] if device.type == "cpu" else [])):
        got = ServingRetriever(tower, items, index=index).retrieve(users, num_candidates=k)
        assert got.log_inclusion is None and got.log_candidate_prob is None
        torch.testing.assert_close(got.candidates, expected, rtol=0, atol=0)


@pytest.mark.parametrize("num_experts, epsilon, tau", [(1, 0.0, 1.0), (2, 0.2, 2.0), (1, 1.0, 0.5)])
def test_sampled_retrieval_logs_the_drawing_policys_propensities(num_experts, epsilon, tau):
    tower, items = _towers(40, num_experts, 3, seed=7)
    users = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    server = ServingRetriever(tower, items, index=ExactIndex(items), temperature=tau, epsilon=epsilon,
                              method="exact")
    got = server.retrieve(users, num_candidates=4, sample=True, generator=torch.Generator().manual_seed(3))
    cand = got.candidates
    assert cand.shape == (6, 4) and (cand.sort(1).values.diff(dim=1) > 0).all()
    u = tower(users)
    logits = torch.einsum("bmd,nmd->bmn", u.view(6, num_experts, 3), items.view(40, num_experts, 3))
    ref = log_propensities(logits, cand, cand, method="exact", temperature=tau, epsilon=epsilon)
    torch.testing.assert_close(got.log_inclusion, ref.log_inclusion)
    torch.testing.assert_close(got.log_expected_count, ref.log_expected_count)
    torch.testing.assert_close(got.log_candidate_prob, ref.log_candidate_prob)
    picks = torch.tensor([[2, 0]] * 6)
    shown, inclusion, count = got.at(picks)
    torch.testing.assert_close(shown, cand.gather(1, picks))
    torch.testing.assert_close(inclusion, ref.log_inclusion.gather(1, picks))
    assert (inclusion <= 0).all() and torch.isfinite(count).all()


@pytest.mark.parametrize("num_experts, k", [(1, 5), (3, 7)])
def test_masked_items_are_never_served_and_the_logs_are_the_masked_policy_s(device, num_experts, k):
    """Regression (found by review): serving took no masked_items (already seen items), and one passed went to the
    user tower (a TypeError, or dropped by a tower taking **kwargs: masked items served and logged as drawable). The
    greedy top-K now equals the greedy draw of the masked logits, through an exact and a FAISS index, and a draw
    logs the masked policy's propensities."""
    tower, items = _towers(60, num_experts, 4, seed=num_experts, device=device)
    users = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    plain = greedy_candidates(EmbeddingCatalog(tower(users), items), k)
    masked = torch.cat([plain[:, ::2], torch.full((9, 2), -1, device=device)], 1)  # the best taken away, -1 pads
    catalog = EmbeddingCatalog(tower(users), items, masked_items=masked)
    expected = greedy_candidates(catalog, k)
    assert not (expected.unsqueeze(2) == masked.unsqueeze(1)).any()
    for index in (ExactIndex(items), *([FaissIndex(items.float())] if device.type == "cpu" else [])):
        got = ServingRetriever(tower, items, index=index).retrieve(users, num_candidates=k, masked_items=masked)
        torch.testing.assert_close(got.candidates, expected, rtol=0, atol=0)
    server = ServingRetriever(tower, items, index=ExactIndex(items), epsilon=0.3, method="exact")
    got = server.retrieve(users, num_candidates=k, sample=True, masked_items=masked,
                          generator=torch.Generator(device).manual_seed(3))
    assert not (got.candidates.unsqueeze(2) == masked.unsqueeze(1)).any()
    ref = log_propensities(catalog, got.candidates, got.candidates, method="exact", epsilon=0.3)
    torch.testing.assert_close(got.log_inclusion, ref.log_inclusion)
    torch.testing.assert_close(got.log_candidate_prob, ref.log_candidate_prob)
    with pytest.raises(ValueError, match=r"masked_items must hold ids in \[-1, 60\)"):
        server.retrieve(users, num_candidates=k, masked_items=masked + 60)
    with pytest.raises(ValueError, match=r"request 0 masks more than N - K = 55 items: fewer than K=5 items are left "
                                         r"to retrieve"):  # all but 3 items masked
        server.retrieve(users[:1], num_candidates=5, masked_items=torch.arange(57, device=device).view(1, -1))


@pytest.mark.parametrize("num_experts", [1, 2])
def test_greedy_serving_with_thousands_of_masked_items(device, num_experts):
    """Regression (found by review): the masked ids were compared with every found id, a [B, K + E, E] tensor (565 MB
    and 1 s at E = 3,000, slower than scoring the catalog); a binary search gives the same draw."""
    tower, items = _towers(2000, num_experts, 4, seed=3, device=device)
    users = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(device)
    gen = torch.Generator().manual_seed(4)
    masked = torch.stack([torch.randperm(2000, generator=gen)[:1500] for _ in range(5)]).to(device)
    masked[0, :700] = -1  # padding, and repeats
    masked[1, 700:900] = masked[1, :200]
    server = ServingRetriever(tower, items, index=ExactIndex(items))
    got = server.retrieve(users, num_candidates=20, masked_items=masked)
    torch.testing.assert_close(got.candidates, greedy_candidates(EmbeddingCatalog(tower(users), items,
                                                                                  masked_items=masked), 20))


def test_a_short_greedy_draw_names_its_cause():
    """It said "it masks more than N - K items, or an approximate index found too few" whichever it was; and picks
    of more positions than K were called repeats (a review)."""
    tower, items = _towers(200, 1, 4, seed=5)
    users = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))

    class Shallow(ExactIndex):  # an approximate index that finds 30 items at most
        def _search_one(self, expert, queries, k):
            scores, ids = super()._search_one(expert, queries, k)
            return scores.masked_fill(torch.arange(k) >= 30, -math.inf), ids.masked_fill(torch.arange(k) >= 30, -1)

    server = ServingRetriever(tower, items, index=Shallow(items))
    masked = greedy_candidates(EmbeddingCatalog(tower(users), items), 20)  # the best 20: 10 of the 30 found left
    with pytest.raises(ValueError, match=r"the index found fewer than K=15 items for request 0 that it does not mask "
                                         r"\(an approximate index: search deeper\)"):
        server.retrieve(users, num_candidates=15, masked_items=masked)
    with pytest.raises(ValueError, match=r"the index found fewer than K=35 items for request 0 \(an approximate"):
        server.retrieve(users, num_candidates=35)
    too_many = torch.cat([torch.full((1, 190), -1), torch.arange(190)[None], torch.full((1, 190), -1)])
    with pytest.raises(ValueError, match=r"request 1 masks more than N - K = 185 items"):
        ServingRetriever(tower, items).retrieve(users, num_candidates=15, masked_items=too_many)
    got = ServingRetriever(tower, items).retrieve(users, num_candidates=4, sample=True)
    with pytest.raises(ValueError, match="picks must have at most K=4 columns"):
        got.at(torch.tensor([[0, 1, 2, 3, 0]] * 3))


def test_the_user_side_runs_before_any_argument_check():
    """Regression (found by review): with a sharded model the user side is a collective of every rank, and a K
    outside [1, N] on one rank raised before it, so the other ranks waited until the process group's timeout."""
    tower, items = _towers(20, 2, 3, seed=5)
    calls = []
    server = ServingRetriever(lambda x: calls.append(1) or tower(x), items, index=ExactIndex(items))
    users = torch.randn(2, 3, dtype=torch.float64)
    for bad, error in ((21, ValueError), (0, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match="num_candidates"):
            server.retrieve(users, num_candidates=bad)
    with pytest.raises(ValueError, match="masked_items"):
        server.retrieve(users, num_candidates=2, masked_items=torch.tensor([[20], [0]]))
    with pytest.raises(TypeError, match="sample"):
        server.retrieve(users, num_candidates=2, sample="yes")
    assert len(calls) == 5


def test_sampled_retrieval_frequencies_match_the_logged_inclusion():
    """Monte-Carlo: each item's retrieval frequency over R draws against exp(log_inclusion), within a
    binomial bound (z for a two-sided 1e-6 level, Bonferroni over the items)."""
    tower, items = _towers(12, 1, 3, seed=11)
    users = torch.randn(1, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).expand(4000, 3)
    server = ServingRetriever(tower, items, index=ExactIndex(items), temperature=1.5, epsilon=0.1, method="exact")
    got = server.retrieve(users, num_candidates=3, sample=True, generator=torch.Generator().manual_seed(5))
    freq = torch.zeros(12, dtype=torch.float64).index_add_(0, got.candidates.flatten(),
                                                           torch.ones(got.candidates.numel(), dtype=torch.float64))
    freq /= users.shape[0]
    p = torch.full((12,), -math.inf, dtype=torch.float64)
    p[got.candidates.flatten()] = got.log_inclusion.flatten()  # the same for every row: one context
    p = p.exp()
    z = 5.45  # Φ^{-1}(1 - 1e-6 / (2·12)) ≈ 5.45
    bound = z * (p * (1 - p) / users.shape[0]).sqrt() + 1e-12
    assert ((freq - p).abs() <= bound).all(), (freq - p).abs() / bound


class _ShortIndex(ExactIndex):
    """An index that finds only 2 items per query, as an approximate one can (ids -1 beyond)."""

    def _search_one(self, expert, queries, k):
        scores, ids = super()._search_one(expert, queries, k)
        return scores, torch.where(torch.arange(k) < 2, ids, -1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_user_tower_samples_from_the_float32_item_vectors(dtype):
    """The item vectors were cast to the user's dtype: a float16 user failed on a float32 entry beyond float16's
    range (an error about an `item` argument never passed), and a bfloat16 one logged propensities of
    bf16-rounded vectors (1.3e-2 nats off). Both are now scored in float32, as every catalog scores half inputs."""
    gen = torch.Generator().manual_seed(0)
    item = torch.randn(50, 4, generator=gen)
    item[7, 0] = 7e4 if dtype == torch.float16 else item[7, 0]
    user = (torch.randn(3, 4, generator=gen) * (1e-4 if dtype == torch.float16 else 1.0)).to(dtype)
    got = ServingRetriever(lambda x: x, item, method="exact").retrieve(user, num_candidates=5, sample=True,
                                                                       generator=torch.Generator().manual_seed(1))
    want = log_propensities(user.double() @ item.double().T, got.candidates, got.candidates, method="exact")
    torch.testing.assert_close(got.log_candidate_prob.double(), want.log_candidate_prob, rtol=0, atol=1e-5)


def test_bad_input_is_a_clear_error():
    tower, items = _towers(20, 2, 3, seed=0)
    users = torch.randn(3, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match="user_tower"):
        ServingRetriever("tower", items)
    with pytest.raises(ValueError, match="index must be built on item_vectors"):
        ServingRetriever(tower, items, index=ExactIndex(items[:10]))
    with pytest.raises(ValueError, match="index must be built on item_vectors"):
        ServingRetriever(tower, items, index=ExactIndex(items[:, 0]))
    with pytest.raises(ValueError, match="epsilon"):
        ServingRetriever(tower, items, epsilon=1.5)
    with pytest.raises(TypeError, match="epsilon"):
        ServingRetriever(tower, items, epsilon="0.1")
    with pytest.raises(ValueError, match="temperature"):
        ServingRetriever(tower, items, temperature=0.0)
    with pytest.raises(ValueError, match="item_vectors"):
        ServingRetriever(tower, items.masked_fill(items > 2, float("nan")))
    with pytest.raises(TypeError, match="index"):
        ServingRetriever(tower, items, index="flat")
    server = ServingRetriever(tower, items)
    with pytest.raises(ValueError, match="num_candidates"):
        server.retrieve(users, num_candidates=21)
    with pytest.raises(ValueError, match="user_tower"):
        ServingRetriever(lambda x: x, items).retrieve(users, num_candidates=2)
    with pytest.raises(ValueError, match="greedy retrieval has no propensities"):
        server.retrieve(users, num_candidates=2).at(torch.zeros(3, 1, dtype=torch.long))
    got = server.retrieve(users, num_candidates=2, sample=True)
    with pytest.raises(ValueError, match="picks"):
        got.at(torch.full((3, 1), 2))
    # regressions (found by review): a repeated pick was taken (log_propensities refuses repeated shown items), a
    # method that gives no probability failed only at the first sampled retrieval
    with pytest.raises(ValueError, match="picks must not repeat a position"):
        got.at(torch.tensor([[0, 1], [1, 1], [0, 1]]))
    with pytest.raises(ValueError, match="method must give a probability"):
        ServingRetriever(tower, items, method="with_replacement")
    # found by review: an index of another dimension was taken (the first retrieval named the queries), and one
    # refreshed to another catalog since served that catalog's ids
    with pytest.raises(ValueError, match="index must be built on item_vectors.*of dim 4"):
        ServingRetriever(tower, items, index=ExactIndex(torch.randn(20, 2, 4, dtype=torch.float64)))
    index = ExactIndex(items)
    moved = ServingRetriever(tower, items, index=index)
    index.refresh(items[:10])
    with pytest.raises(ValueError, match="index must be built on item_vectors: it holds 10 items"):
        moved.retrieve(users, num_candidates=2)

    class Remote(ExactIndex):  # an index of its own making that does not record D is taken (as before)
        def __init__(self, item_vectors):
            self.inner, self.num_items, self.num_experts = ExactIndex(item_vectors), 20, 2

        def search(self, queries, k):
            return self.inner.search(queries, k)

    remote = ServingRetriever(tower, items, index=Remote(items))
    assert remote.retrieve(users, num_candidates=2).candidates.shape == (3, 2)
    with pytest.raises(ValueError, match="fewer than K"):  # expert 0's block needs 3 items; the index found 2
        ServingRetriever(tower, items, index=_ShortIndex(items)).retrieve(users, num_candidates=5)
    assert isinstance(got, Retrieved) and issubclass(_ShortIndex, ItemIndex)


def test_recall_benchmark_writes_its_files(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "serving_recall.py"), "--num-items", "500",
                          "--batch", "8", "--candidates", "5", "--dim", "4", "--experts", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "serving_recall.json").read_text())["results"]
    assert [r["index"] for r in rows] == ["full-catalog scan", "faiss flat", "faiss hnsw", "faiss ivf"]
    assert rows[1]["recall_at_k"] == 1.0 and all(0 <= r["recall_at_k"] <= 1 for r in rows)
    assert (tmp_path / "serving_recall.csv").exists()


def test_the_server_serves_a_snapshot_of_the_item_vectors():
    """Regression (found by review): the server kept a view of the item table while its index is a snapshot, so
    after an in-place update greedy retrieval (the index) and sampled retrieval and its logged propensities (the
    live table) served two policies. Both serve the vectors it was built on."""
    g = torch.Generator().manual_seed(0)
    items = torch.randn(200, 8, generator=g)
    users = torch.randn(3, 8, generator=g)
    server = ServingRetriever(lambda u: u, items, temperature=1e-3)
    before = server.retrieve(users, num_candidates=3, sample=True, generator=torch.Generator().manual_seed(1))
    items.neg_()  # the training job updates its table in place
    after = server.retrieve(users, num_candidates=3, sample=True, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(after.log_inclusion, before.log_inclusion, rtol=0, atol=0)
    assert torch.equal(after.candidates, before.candidates)
    assert torch.equal(server.retrieve(users, num_candidates=3).candidates, after.candidates)  # τ → 0: the greedy
