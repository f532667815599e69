"""Maximum-inner-product item indexes: the nearest-neighbour head of :class:`~capg_rec.sampled.SampledCatalog`.

An :class:`ItemIndex` is built from item vectors ``[N, D]`` (one expert) or ``[N, M, D]`` (one index
per expert, the library's item layout) and answers ``search(queries, k) -> (scores, ids)``, the k
items of largest inner product, best first. ``refresh(item_vectors)`` rebuilds it after the item
tower moved (every n training steps). Two implementations:

* :class:`ExactIndex`: a chunked matmul and top-k in torch (any device; the reference),
* :class:`FaissIndex`: faiss-cpu, inner product; ``"flat"`` (exact), ``"hnsw"`` or ``"ivf"``
  (approximate: measure their recall with :func:`recall_at_k`).

Another index plugs in by subclassing :class:`ItemIndex` (``_build`` and ``_search_one``). Item vectors and
queries must be finite (a ``ValueError``; checked unless ``set_default_validate_args(False)``): a NaN item
would be every query's best match in one index and silently dropped by another.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from capg_rec._checks import all_finite, check_choice, check_count, check_float_tensor, check_items, is_id_tensor, \
    resolve_validate_args
from capg_rec.catalog import _chunked_top_k, compute_dtype

__all__ = ["ItemIndex", "ExactIndex", "FaissIndex", "recall_at_k"]


class ItemIndex(abc.ABC):
    """Top-k inner-product search over a fixed set of item vectors (abstract).

    ``item_vectors [N, D]`` or ``[N, M, D]``; queries ``[B, D]`` or ``[B, M, D]`` to match. Results
    are ``(scores, ids)`` of shape ``[B, k]`` or ``[B, M, k]``, best first, scores at least float32 (half-precision
    products overflow: :class:`ExactIndex` scores in the wider of the queries' and the items' dtypes, as the catalogs
    do; :class:`FaissIndex` in float32, returned in the queries' dtype), ids int64 in ``[0, N)`` (an approximate
    index that finds fewer than k pads with id ``-1``, scored ``-inf``). No gradient flows through an index.

    Args:
        item_vectors: ``[N, D]`` (one expert) or ``[N, M, D]`` (one index per expert); the index holds a snapshot.

    Shape:
        - item_vectors: ``[N, D]`` or ``[N, M, D]``; queries: ``[B, D]`` or ``[B, M, D]`` to match
        - :meth:`search` → ``(scores, ids)``: ``[B, k]`` or ``[B, M, k]`` (ids int64)

    Example:
        >>> index = ExactIndex(torch.randn(100, 4, 8))              # an ItemIndex: M = 4 experts
        >>> scores, ids = index.search(torch.randn(2, 4, 8), k=5)
        >>> ids.shape, ids.dtype, index.num_experts
        (torch.Size([2, 4, 5]), torch.int64, 4)
    """

    num_items: int
    num_experts: int | None  # None: built from [N, D]
    dim: int

    def __init__(self, item_vectors: Tensor) -> None:
        self.refresh(item_vectors)

    def refresh(self, item_vectors: Tensor) -> None:
        """(Re)build the index from ``item_vectors [N, D] | [N, M, D]`` (a snapshot: later in-place updates of
        the tensor do not reach the index until the next refresh). Bad input leaves the index as it was."""
        item_vectors = check_float_tensor("item_vectors", item_vectors, ndims=(2, 3),
                                          validate=resolve_validate_args(None))
        check_count("item_vectors.shape[0] (N)", item_vectors.shape[0])
        if item_vectors.dim() == 3:
            check_count("item_vectors.shape[1] (M)", item_vectors.shape[1])
        check_count("item_vectors.shape[-1] (D)", item_vectors.shape[-1])
        vectors = item_vectors.detach()
        num_experts = item_vectors.shape[1] if item_vectors.dim() == 3 else None
        self._build([vectors] if num_experts is None else list(vectors.unbind(1)))
        self.num_items, self.num_experts, self.dim = item_vectors.shape[0], num_experts, item_vectors.shape[-1]

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The k best items of each query: ``queries [B, D] | [B, M, D]`` → ``(scores, ids)`` ``[B, (M,) k]``."""
        queries = check_float_tensor("queries", queries, ndims=(2, 3), validate=resolve_validate_args(None))
        expected = 2 if self.num_experts is None else 3
        if queries.dim() != expected or queries.shape[-1] != self.dim or (
                expected == 3 and queries.shape[1] != self.num_experts):
            want = "[B, D]" if self.num_experts is None else f"[B, M={self.num_experts}, D]"
            raise ValueError(f"queries must have shape {want} with D={self.dim}, got {tuple(queries.shape)}")
        k = check_count("k", k, high=self.num_items)
        queries = queries.detach()
        if self.num_experts is None:
            return self._checked(self._search_one(0, queries, k), queries.shape[0], k)
        found = [self._checked(self._search_one(m, queries[:, m], k), queries.shape[0], k)
                 for m in range(self.num_experts)]
        return torch.stack([s for s, _ in found], 1), torch.stack([i for _, i in found], 1)

    def _checked(self, found: object, batch: int, k: int) -> tuple[Tensor, Tensor]:
        """What :meth:`_search_one` gave (an index of your own's too): ``(scores, ids)`` ``[B, k]``, float scores and
        integer ids, and with the checks on, ids in ``[-1, N)`` none of which repeats in a row (a repeated or
        foreign id would be served, or scored as a head item, silently) → with ids as int64."""
        name = f"{type(self).__name__}._search_one"
        if not (isinstance(found, tuple) and len(found) == 2 and all(isinstance(x, Tensor) for x in found)):
            raise TypeError(f"{name} must return a (scores, ids) pair of tensors, got {type(found).__name__}")
        scores, ids = found
        if not scores.is_floating_point():
            raise TypeError(f"{name} must return floating-point scores, got {scores.dtype}")
        if scores.shape != (batch, k):
            raise ValueError(f"{name} must return scores [B={batch}, k={k}], got {tuple(scores.shape)}")
        return scores, check_items(f"{name}'s ids", ids, batch_size=batch, num_items=self.num_items, low=-1,
                                   width=k, columns="k", validate=resolve_validate_args(None))

    @abc.abstractmethod
    def _build(self, per_expert: list[Tensor]) -> None:
        """Build one sub-index per ``[N, D]`` tensor of ``per_expert``."""

    @abc.abstractmethod
    def _search_one(self, expert: int, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Expert ``expert``'s index: ``queries [B, D]`` → ``(scores, ids)`` ``[B, k]``, on the queries' device."""


class ExactIndex(ItemIndex):
    """Exact top-k by a matmul over ``chunk_size`` items at a time (memory ``O(B·chunk)``), any device.

    Args:
        item_vectors: ``[N, D]`` or ``[N, M, D]``.
        chunk_size: items scored at once (default 65,536).

    Shape:
        As :class:`ItemIndex`: ``queries [B, D] | [B, M, D]`` → ``(scores, ids)`` ``[B, k] | [B, M, k]``.

    Example:
        >>> index = ExactIndex(torch.randn(1000, 16))
        >>> scores, ids = index.search(torch.randn(4, 16), k=10)
        >>> scores.shape, bool((scores[:, :-1] >= scores[:, 1:]).all())    # best first
        (torch.Size([4, 10]), True)
    """

    def __init__(self, item_vectors: Tensor, *, chunk_size: int = 65536) -> None:
        self.chunk_size = check_count("chunk_size", chunk_size)
        super().__init__(item_vectors)

    def _build(self, per_expert: list[Tensor]) -> None:
        self._vectors = [v.clone() for v in per_expert]  # a snapshot, as any index built from them holds

    def _search_one(self, expert: int, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        # In the wider of the two dtypes, at least float32 (half-precision products overflow and tie), as the
        # catalogs score; a product beyond it among the best k (inf or NaN, which rank first, or -inf, whose order is
        # lost) is a ValueError with the checks on.
        items = self._vectors[expert]
        dtype = compute_dtype(queries.dtype, items.dtype)
        scores, ids = _chunked_top_k(queries.to(dtype).unsqueeze(1), items.to(queries.device, dtype).unsqueeze(1), k,
                                     None, None, self.chunk_size)
        scores, ids = scores[:, 0], ids[:, 0]
        if resolve_validate_args(None) and scores.numel() and not all_finite(scores):  # no item is masked here
            raise ValueError(f"queries and item_vectors must have inner products within {dtype}'s range, got one that "
                             f"overflows (inf or NaN) among the best {k} of expert {expert}")
        return scores, ids


FAISS_KINDS = ("flat", "hnsw", "ivf")


class FaissIndex(ItemIndex):
    """A faiss-cpu inner-product index (float32 on the CPU; results come back on the queries' device).

    Args:
        item_vectors: ``[N, D]`` or ``[N, M, D]``.
        kind: ``"flat"`` (exact: ``IndexFlatIP``), ``"hnsw"`` (``IndexHNSWFlat``, ``hnsw_m`` links,
            search depth ``ef_search``) or ``"ivf"`` (``IndexIVFFlat``, ``nlist`` lists, by default 4·√N and at most
            N/39, ``nprobe`` probed; trained on the items).
        ef_search, hnsw_m, nlist, nprobe: the approximate kinds' settings (their recall trades
            against time: measure it with :func:`recall_at_k`).
        num_threads: faiss's OpenMP threads while it builds and searches (``None``: the process's setting). They
            are set around each call and restored after it: faiss and torch share one OpenMP runtime here, and
            the index must not change torch's thread count.

    Shape:
        As :class:`ItemIndex`: ``queries [B, D] | [B, M, D]`` → ``(scores, ids)`` ``[B, k] | [B, M, k]``
        (ids ``-1``, scored ``-inf``, where an approximate kind found fewer than k).

    Example:
        >>> items = torch.randn(500, 16)
        >>> index = FaissIndex(items, kind="hnsw", ef_search=32)     # needs faiss-cpu
        >>> queries = torch.randn(8, 16)
        >>> _, ids = index.search(queries, k=10)
        >>> _, exact = ExactIndex(items).search(queries, k=10)
        >>> ids.shape, 0.0 <= recall_at_k(ids, exact) <= 1.0
        (torch.Size([8, 10]), True)
    """

    def __init__(self, item_vectors: Tensor, *, kind: str = "flat", hnsw_m: int = 32, ef_search: int = 64,
                 nlist: int | None = None, nprobe: int = 16, num_threads: int | None = None) -> None:
        self.kind = check_choice("kind", kind, FAISS_KINDS)
        self.hnsw_m = check_count("hnsw_m", hnsw_m)
        self.ef_search = check_count("ef_search", ef_search)
        self.nlist = None if nlist is None else check_count("nlist", nlist)
        self.nprobe = check_count("nprobe", nprobe)
        self.num_threads = None if num_threads is None else check_count("num_threads", num_threads)
        _import_faiss()  # not kept: an index holding a module would not pickle
        super().__init__(item_vectors)

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """faiss's OpenMP threads set to ``num_threads`` for a call, and the process's restored after it."""
        if self.num_threads is None:
            yield
            return
        faiss = _import_faiss()
        before = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(self.num_threads)
        try:
            yield
        finally:
            faiss.omp_set_num_threads(before)

    def _build(self, per_expert: list[Tensor]) -> None:
        vectors = [_float32("item_vectors", v) for v in per_expert]
        with self._threads():
            self._indexes = [self._build_one(v.contiguous().numpy()) for v in vectors]
        self._longest = [float(v.double().norm(dim=1).max()) for v in vectors]  # bounds |score| with the query's

    def _build_one(self, vectors):  # numpy [N, D] float32
        faiss = _import_faiss()
        num, dim = vectors.shape
        metric = faiss.METRIC_INNER_PRODUCT
        if self.kind == "flat":
            index = faiss.IndexFlatIP(dim)
        elif self.kind == "hnsw":
            index = faiss.IndexHNSWFlat(dim, self.hnsw_m, metric)
            index.hnsw.efSearch = self.ef_search
        else:
            # default 4·√N lists, at most N/39 (faiss warns below 39 training points a list)
            nlist = self.nlist if self.nlist is not None else max(1, min(int(4 * num ** 0.5), num // 39))
            nlist = min(nlist, num)
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, metric)
            index.train(vectors)
            index.nprobe = min(self.nprobe, nlist)
        index.add(vectors)
        return index

    def _search_one(self, expert: int, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        q = _float32("queries", queries)
        if resolve_validate_args(None) and q.numel():  # Cauchy-Schwarz: every score within float32's range
            reach = float(q.double().norm(dim=1).max()) * self._longest[expert]
            if not reach < torch.finfo(torch.float32).max:
                raise ValueError(f"queries and item_vectors must have inner products within float32's range (faiss "
                                 f"scores in float32), but their norms multiply to {reach:.3g}")
        q = q.contiguous().numpy()
        with self._threads():
            scores, ids = self._indexes[expert].search(q, k)
        ids = torch.from_numpy(ids)
        # An approximate index may find fewer than k: -1 ids, which faiss scores -FLT_MAX; -inf says "none".
        scores = torch.from_numpy(scores).masked_fill_(ids < 0, -math.inf)
        return (scores.to(device=queries.device, dtype=compute_dtype(queries.dtype)),
                ids.to(device=queries.device, dtype=torch.long))


def _float32(name: str, x: Tensor) -> Tensor:
    """``x`` in float32 on the host, where faiss works (without a negative bit, which numpy cannot read): a
    ``ValueError`` naming ``name`` when a finite value leaves float32's range there (faiss would take inf and NaN
    scores; checked with the index's other checks)."""
    y = x.to("cpu", torch.float32).resolve_neg()
    if x.dtype == torch.float64 and resolve_validate_args(None) and not bool(y.isfinite().all()):
        raise ValueError(f"{name} must be within float32's range (faiss scores in float32), got values up to "
                         f"{float(x.abs().max()):.3g}")
    return y


def recall_at_k(found: Tensor, exact: Tensor) -> float:
    """The fraction of the exact top-k ids ``exact [..., k]`` that ``found [..., k]`` also holds in the same row, over
    every row's (the mean over rows when each names k ids); ``-1`` (an index's padding, for an id not found) is no
    id: it matches nothing, and ``-1`` in ``exact`` are not counted."""
    for name, ids in (("found", found), ("exact", exact)):
        if not is_id_tensor(ids):
            raise TypeError(f"{name} must be an integer tensor of ids, got "
                            f"{ids.dtype if isinstance(ids, Tensor) else type(ids).__name__}")
    if found.shape != exact.shape or exact.dim() == 0:
        raise ValueError(f"found and exact must have one shape [..., k], got {tuple(found.shape)} and "
                         f"{tuple(exact.shape)}")
    named = exact >= 0
    if not bool(named.any()):
        raise ValueError(f"found and exact must hold at least one id (exact: not -1), got shape {tuple(exact.shape)}"
                         f"{' of -1 ids' if exact.numel() else ''}")
    hits = ((found.unsqueeze(-1) == exact.unsqueeze(-2)) & named.unsqueeze(-2)).any(-2)
    return float(hits.sum() / named.sum())


def _import_faiss():
    try:
        import faiss
    except ImportError as err:  # pragma: no cover - the dependency is pinned for development
        raise ImportError("FaissIndex needs faiss: pip install faiss-cpu") from err
    return faiss
