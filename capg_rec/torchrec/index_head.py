"""The head of the retriever's sampled mode from a nearest-neighbour index over its item side.

The sampled mode scores exactly the ids a batch lists and estimates the rest of the catalog from a
negative sample. A confident policy's mass sits in a few items per user, which the sample rarely holds:
an index over the item vectors names them. Their rows must be looked up in the same lookup as the
sample's (the one TorchRec's train pipeline prefetches), so the index is queried before the forward,
with the user side computed without gradient, and its ids listed in the batch's features.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torchrec import KeyedJaggedTensor

from capg_rec._checks import check_count, check_device, is_int
from capg_rec.ann import ExactIndex, ItemIndex
from capg_rec.torchrec.retriever import TwoTowerRetriever

__all__ = ["IndexHead"]


class IndexHead:
    """Each user's best items under every expert, from an index of the retriever's item side, rebuilt every
    ``refresh_every`` calls (the first included).

    A call looks the batch's users up (:meth:`TwoTowerRetriever.user_vectors`, no gradient) and searches the
    index; a rebuild passes every item through the item side (:meth:`TwoTowerRetriever.item_vectors`). Both
    are collective when the tables are sharded: every rank calls alike, once per batch (a rank without users
    too), and both run the retriever in eval mode (no dropout; batch norm's running statistics are read, not
    updated), whatever mode training has it in. ``-1`` pads what an approximate index did not find. List the
    ids with the negative sample (:meth:`TwoTowerRetriever.with_catalog` ``items``) and pass them to the
    forward as ``index_items``: the catalog then knows that they are each expert's best H (mean-field's and
    the plug-in's head; less the padding and masked items). Between rebuilds the item side has moved on,
    and under ``TrainPipelineSparseDist`` the user side is one step behind (the batch is prepared while the
    previous one trains): the head is the best items of a slightly older model, scored exactly with the
    current one.

    Each rank holds an index of every item (``N × M × D`` floats on ``device``), and the item vectors it was
    built from, which :meth:`state_dict` carries into a checkpoint with the number of calls so far: a head loaded
    from it continues as the saved one would (the same index until the same next rebuild).

    Args:
        retriever: the retriever (its embeddings sharded or not).
        size: items per expert, H.
        index: builds an :class:`~capg_rec.ann.ItemIndex` from the item vectors ``[N, M, D]`` (default
            :class:`~capg_rec.ann.ExactIndex`; e.g. ``functools.partial(FaissIndex, kind="hnsw")``).
        refresh_every: calls between rebuilds.
        device: where the index lives and is searched.

    Shape:
        ``features`` of B users (stride B, without the catalog feature) → ids ``[B, M, H]`` on the features'
        device.

    Example (a sketch: the names it takes come from your loop)::

        head = IndexHead(retriever, 100, refresh_every=50)
        found = head(user_features)                                   # [B, M, H]
        listed = torch.cat([sample.ids, found.flatten()]).unique()
        catalog = retriever(retriever.with_catalog(user_features, items=listed), sample=sample,
                            index_items=found)
    """

    def __init__(self, retriever: TwoTowerRetriever, size: int, *,
                 index: Callable[[Tensor], ItemIndex] = ExactIndex, refresh_every: int = 100,
                 device: torch.device | str = "cpu") -> None:
        if not isinstance(retriever, TwoTowerRetriever):
            raise TypeError(f"retriever must be a TwoTowerRetriever, got {type(retriever).__name__}")
        if not callable(index):
            raise TypeError(f"index must be a callable building an ItemIndex from item vectors, got "
                            f"{type(index).__name__}")
        self.retriever = retriever
        self.size = check_count("size", size, high=retriever.num_items)
        self.refresh_every = check_count("refresh_every", refresh_every)
        self.device = check_device("device", device)
        self._make_index = index
        self.index: ItemIndex | None = None
        self._vectors: Tensor | None = None  # what the index was built from
        self.calls = 0

    def refresh(self) -> None:
        """Rebuild the index from the item side now (collective when sharded)."""
        self._build(self.retriever.item_vectors(self.device))  # in eval mode

    def _build(self, vectors: Tensor) -> None:
        index = self._make_index(vectors)
        if not isinstance(index, ItemIndex):
            raise TypeError(f"index must build an ItemIndex, got {type(index).__name__}")
        self.index, self._vectors = index, vectors

    def state_dict(self) -> dict[str, object]:
        """``{"calls": int}`` and, once built, ``"vectors"``: the item vectors ``[N, M, D]`` of the last rebuild
        (a checkpoint of N × M × D floats per rank)."""
        state: dict[str, object] = {"calls": self.calls}
        if self._vectors is not None:
            state["vectors"] = self._vectors
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`'s output: the index is rebuilt from the saved vectors (a local build, no
        collective), and rebuilt from the item side again on the saved schedule."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if "calls" not in state or set(state) - {"calls", "vectors"}:
            raise ValueError(f"state must hold 'calls' and, once built, 'vectors', got keys {sorted(state)}")
        calls, vectors = state["calls"], state.get("vectors")
        if not is_int(calls) or calls < 0:
            raise ValueError(f"state['calls'] must be an int >= 0, got {calls!r}")
        calls = int(calls)
        if calls % self.refresh_every and vectors is None:
            raise ValueError(f"state holds no 'vectors' at call {calls}, between rebuilds (every "
                             f"{self.refresh_every} calls): it is not an IndexHead state of this schedule")
        if vectors is not None:
            shape = (self.retriever.num_items, self.retriever.num_experts)
            if not isinstance(vectors, Tensor) or not vectors.is_floating_point():
                raise TypeError(f"state['vectors'] must be a floating-point torch.Tensor of item vectors, got "
                                f"{vectors.dtype if isinstance(vectors, Tensor) else type(vectors).__name__}")
            if vectors.dim() != 3 or tuple(vectors.shape[:2]) != shape:  # D is checked at the first search
                raise ValueError(f"state['vectors'] must be item vectors [N, M, D] with (N, M) = {shape}, got "
                                 f"{tuple(vectors.shape)}")
            self._build(vectors.to(self.device))
        else:
            self.index, self._vectors = None, None
        self.calls = calls

    def __call__(self, features: KeyedJaggedTensor, dense: Tensor | None = None, *,
                 bag_features: KeyedJaggedTensor | None = None) -> Tensor:
        if self.calls % self.refresh_every == 0:
            self.refresh()
        user = self.retriever.user_vectors(features, dense, bag_features=bag_features)  # in eval mode
        if user.shape[-1] != self.index.dim:  # a restored head's vectors are checked here, where D is known
            raise ValueError(f"the index holds item vectors of D={self.index.dim} (load_state_dict's, or the item "
                             f"side's at the last rebuild), the retriever's users have D={user.shape[-1]}: load a "
                             "state of this retriever, or refresh()")
        self.calls += 1  # a refused call does not count
        if user.shape[0] == 0:  # a rank without users (the lookups above are collective: it took part)
            return torch.zeros(0, user.shape[1], self.size, dtype=torch.long, device=user.device)
        return self.index.search(user.to(self.device), self.size)[1].to(user.device)


