"""Nearest-neighbour item indexes: exact reference, faiss flat parity, approximate recall, errors."""

import math

import pytest
import torch

from capg_rec.ann import ExactIndex, FaissIndex, recall_at_k


def _data(n=500, b=7, d=12, m=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    items = torch.randn((n, d) if m is None else (n, m, d), generator=g)
    queries = torch.randn((b, d) if m is None else (b, m, d), generator=g)
    return items, queries


@pytest.mark.parametrize("m", [None, 3])
def test_exact_index_matches_full_topk(device, m):
    items, queries = _data(m=m)
    items, queries = items.to(device), queries.to(device)
    scores, ids = ExactIndex(items, chunk_size=64).search(queries, 10)
    full = torch.einsum("bd,nd->bn", queries, items) if m is None else torch.einsum("bmd,nmd->bmn", queries, items)
    ref = full.topk(10, dim=-1)
    assert ids.device.type == device.type
    torch.testing.assert_close(scores, ref.values)
    assert torch.equal(ids, ref.indices)


@pytest.mark.parametrize("m", [None, 2])
def test_faiss_flat_equals_exact(m):
    items, queries = _data(m=m)
    s_exact, i_exact = ExactIndex(items).search(queries, 20)
    s_faiss, i_faiss = FaissIndex(items, kind="flat").search(queries, 20)
    assert torch.equal(i_faiss, i_exact)
    torch.testing.assert_close(s_faiss, s_exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_approximate_kinds_run_and_refresh(kind):
    items, queries = _data(n=2000)
    index = FaissIndex(items, kind=kind, nprobe=64 if kind == "ivf" else 16, ef_search=256)
    _, found = index.search(queries, 10)
    _, exact = ExactIndex(items).search(queries, 10)
    assert found.shape == (7, 10) and found.dtype == torch.long
    assert recall_at_k(found, exact) > 0.5  # sanity only; benchmarks/serving_recall.py measures recall
    index.refresh(items[:100])
    assert index.num_items == 100
    _, ids = index.search(queries, 5)
    assert int(ids.max()) < 100


def test_recall_at_k():
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert recall_at_k(a, a) == 1.0
    assert recall_at_k(torch.tensor([[1, 2, 9], [7, 8, 9]]), a) == pytest.approx(1 / 3)
    for bad in (a.float(), a > 2, a.tolist()):  # found by review: float ids were compared as they came
        with pytest.raises(TypeError, match="found must be an integer tensor of ids"):
            recall_at_k(bad, a)
    with pytest.raises(ValueError, match="found and exact must hold at least one id"):  # found by review: gave 1.0
        recall_at_k(a[:0], a[:0])


def test_index_errors():
    items, queries = _data()
    index = ExactIndex(items)
    with pytest.raises(ValueError, match="queries"):
        index.search(queries[:, :5], 3)
    with pytest.raises(ValueError, match="k"):
        index.search(queries, 501)
    with pytest.raises(TypeError, match="item_vectors"):
        ExactIndex(items.long())
    with pytest.raises(ValueError, match="kind"):
        FaissIndex(items, kind="lsh")


@pytest.mark.parametrize("index_class", [ExactIndex, FaissIndex])
def test_non_finite_vectors_are_refused(index_class):
    """A NaN or inf item or query is a ValueError naming it (ExactIndex made a NaN item every query's best
    match; FaissIndex dropped it silently); with validation off, nothing is read."""
    import capg_rec
    items, queries = _data()
    for bad in (float("nan"), float("inf")):
        broken = items.clone()
        broken[2, 0] = bad
        with pytest.raises(ValueError, match="item_vectors must be finite"):
            index_class(broken)
        with pytest.raises(ValueError, match="queries must be finite"):
            index_class(items).search(torch.cat([queries[:1] * bad, queries[1:]]), 3)
    capg_rec.set_default_validate_args(False)
    try:
        index_class(items).search(queries, 3)
    finally:
        capg_rec.set_default_validate_args(True)


def test_index_regressions_from_review():
    """Each failed before its fix: ExactIndex scored float16 queries in float16 (products overflow and tie: recall
    0.08 of the float32 top-k) and followed in-place updates of the tensor it was built from (a view, not a snapshot
    as FaissIndex holds); faiss's padded slots scored -FLT_MAX, not -inf; zero experts or dims were accepted (a crash
    at search, or all scores 0); a refresh that failed had already set num_items; recall_at_k took lists (an
    AttributeError)."""
    g = torch.Generator().manual_seed(0)
    items, queries = 30 * torch.randn(200, 8, generator=g), 30 * torch.randn(5, 8, generator=g)
    exact = ExactIndex(items)
    ref = exact.search(queries, 10)[1]
    assert recall_at_k(exact.search(queries.half(), 10)[1], ref) == 1.0
    items.mul_(-1)  # an optimizer step in place: the index keeps the vectors it was built from until refresh()
    assert torch.equal(exact.search(queries, 10)[1], ref)
    ivf = FaissIndex(torch.randn(64, 4, generator=g), kind="ivf", nlist=16, nprobe=1)
    scores, ids = ivf.search(torch.randn(3, 4, generator=g), 64)
    assert bool((ids == -1).any()) and bool((scores[ids == -1] == -math.inf).all())
    for bad in (torch.randn(10, 0, 4), torch.randn(10, 2, 0)):
        with pytest.raises(ValueError, match=r"item_vectors.shape\[(1|-1)\] \((M|D)\) must be >= 1"):
            ExactIndex(bad)
    with pytest.raises(ValueError, match="N"):
        exact.refresh(torch.randn(0, 8))
    assert exact.num_items == 200 and exact.search(queries, 3)[1].shape == (5, 3)
    with pytest.raises(TypeError, match="found must be an integer tensor of ids, got list"):
        recall_at_k([[1, 2]], ref[:1, :2])


def test_faiss_threads_are_its_own():
    """Regression (found by review): FaissIndex(num_threads=1) set the OpenMP threads once, process-wide: torch ran on
    one thread from then on, and a later index with num_threads=None too."""
    before = torch.get_num_threads()
    index = FaissIndex(torch.randn(100, 4), num_threads=before + 1)
    index.search(torch.randn(3, 4), 5)
    assert torch.get_num_threads() == before


def test_faiss_indexes_of_fewer_items_than_their_defaults():
    """A flat index returns every item, item 0 included, with ExactIndex's scores; an IVF index of fewer items than
    its default number of lists (4·√N) still builds and searches (found by mutation testing: no test found item 0
    among all, nor built an IVF index on so few items)."""
    g = torch.Generator().manual_seed(0)
    items, queries = torch.randn(10, 4, generator=g), torch.randn(3, 4, generator=g)
    scores, ids = FaissIndex(items).search(queries, 10)
    want_scores, want_ids = ExactIndex(items).search(queries, 10)
    torch.testing.assert_close(scores, want_scores)
    assert torch.equal(ids.sort(1).values, torch.arange(10).expand(3, -1))
    _, ivf = FaissIndex(items, kind="ivf").search(queries, 3)
    assert ivf.shape == (3, 3) and bool(((ivf >= 0) & (ivf < 10)).all())


def test_recall_of_zero_dim_ids_is_a_value_error():
    """A review's sweep: 0-d ids gave torch's IndexError."""
    from capg_rec.ann import recall_at_k

    with pytest.raises(ValueError, match=r"found and exact must have one shape \[\.\.\., k\]"):
        recall_at_k(torch.tensor(1), torch.tensor(1))


def test_index_results_of_your_own_are_checked_and_exact_scores_never_rank_an_overflow_first():
    """A review's findings: what an index of your own returns was served unchecked (a repeated id, an id beyond the
    catalog, a short row), where the same ids as index_items were refused; ExactIndex, the reference, ranked a NaN
    score (an inf - inf product) first and scored float64 items in the queries' float32 (overflowing to inf)."""
    from capg_rec.ann import ItemIndex

    items, queries = _data(n=40, b=3, d=4)

    class Mine(ItemIndex):
        def __init__(self, vectors, edit):
            self.edit = edit
            super().__init__(vectors)

        def _build(self, per_expert):
            self.vectors = per_expert

        def _search_one(self, expert, q, k):
            scores, ids = (q @ self.vectors[expert].T).topk(k, 1)
            return self.edit(scores, ids)

    def repeat(s, i):
        i[:, 1] = i[:, 0]
        return s, i

    def beyond(s, i):
        i[:, 1] = 45
        return s, i

    assert torch.equal(Mine(items, lambda s, i: (s, i.int())).search(queries, 5)[1], ExactIndex(items).search(
        queries, 5)[1])  # integer ids of any width, as int64
    for edit, error, match in ((repeat, ValueError, "ids must not repeat"),
                               (beyond, ValueError, r"ids must hold ids in \[-1, 40\)"),
                               (lambda s, i: (s[:, :-1], i[:, :-1]), ValueError, r"scores \[B=3, k=5\]"),
                               (lambda s, i: (s, i.float()), TypeError, "integer dtype"),
                               (lambda s, i: (s.long(), i), TypeError, "floating-point scores"),
                               (lambda s, i: [s, i], TypeError, r"a \(scores, ids\) pair")):
        with pytest.raises(error, match=match):
            Mine(items, edit).search(queries, 5)
    for vectors in ([[3e38, -3e38], [0.0, 1.0], [1.0, 0.0]], [[-3e38, 0.0], [-2e38, 0.0], [1.0, 0.0]]):  # NaN, -inf
        with pytest.raises(ValueError, match=r"queries and item_vectors must have inner products within "
                                             r"torch.float32's range, got one that overflows .* of expert 0"):
            ExactIndex(torch.tensor(vectors)).search(torch.tensor([[10.0, 10.0]]), 3)
    wide = torch.tensor([[1.0], [1.0 + 1e-12]], dtype=torch.float64)
    scores, ids = ExactIndex(wide).search(torch.tensor([[1.0]]), 1)
    assert ids.item() == 1 and scores.dtype == torch.float64  # scored in the wider dtype, as the catalogs do


def test_faiss_indexes_pickle_and_ivf_lists_fit_small_catalogs(capfd):
    """A FaissIndex held the faiss module and could not be pickled, deep-copied or saved (a review); an IVF index of
    50 items made 28 lists and faiss warned about its training on every build."""
    import copy
    import pickle

    items, queries = _data(n=50, b=3, d=4)
    for kind in ("flat", "hnsw", "ivf"):
        index = FaissIndex(items, kind=kind)
        for other in (pickle.loads(pickle.dumps(index)), copy.deepcopy(index)):
            assert [torch.equal(a, b) for a, b in zip(other.search(queries, 5), index.search(queries, 5))] == [True] * 2
    assert "WARNING" not in capfd.readouterr().err


@pytest.mark.parametrize("kind", ["exact", "faiss"])
def test_indexes_and_greedy_candidates_take_negative_views(kind):
    """Vectors and logits with the negative bit set (``torch._neg_view``, ``z.conj().imag``) were a RuntimeError from
    numpy in FaissIndex and in greedy_candidates (found by review); they give the values of the plain tensors."""
    import capg_rec

    g = torch.Generator().manual_seed(0)
    items, queries = torch.randn(50, 4, generator=g), torch.randn(3, 4, generator=g)
    make = ExactIndex if kind == "exact" else FaissIndex
    want = make(items).search(queries, 5)
    for got in (make(torch._neg_view(-items)).search(queries, 5), make(items).search(torch._neg_view(-queries), 5)):
        torch.testing.assert_close(got, want)
    for logits in (torch.randn(2, 7, generator=g), torch.randn(2, 3000, generator=g)):
        assert torch.equal(capg_rec.greedy_candidates(torch._neg_view(-logits), 3),
                           capg_rec.greedy_candidates(logits, 3))
