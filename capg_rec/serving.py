"""Serve a trained two-tower ESR: the item side as a nearest-neighbour index, the user side as a module.

:class:`ServingRetriever` answers ``retrieve(inputs, K)`` with the K candidates of each request,
either the greedy top-K (through the index: no full-catalog pass) or a draw from the serving policy
(the PL ESR at a serving temperature, mixed with ε uniform exploration), together with what
off-policy learning needs to be logged for that draw (:func:`capg_rec.logs.log_propensities`):
``log π0(a_k ∈ A^K)`` and ``log Σ_k π0_{m(k)}(a_k)`` of every candidate and ``log π0(A^K)``. The
later stage then picks the L shown items among the candidates; their logged values are the
candidates' columns at the picks (:meth:`Retrieved.at`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from capg_rec._checks import check_count, check_flag, check_float_tensor, check_id_tensor, check_items, \
    check_positive, is_number
from capg_rec.ann import FaissIndex, ItemIndex
from capg_rec.catalog import EmbeddingCatalog
from capg_rec.logs.propensity import explore_candidates, log_propensities
from capg_rec.marginals import DEFAULT_METHOD, InclusionMethod, inclusion_method
from capg_rec.plackett_luce import expert_runs
from capg_rec.sampled import _found

__all__ = ["ServingRetriever", "Retrieved"]


class Retrieved(NamedTuple):
    """What :meth:`ServingRetriever.retrieve` returns: ``candidates [B, K]`` in draw order and, for a
    sampled draw, the serving policy's ``log_inclusion [B, K]``, ``log_expected_count [B, K]`` (of
    each candidate) and ``log_candidate_prob [B]`` (of the ordered draw); ``None`` for the greedy top-K,
    a deterministic choice that off-policy learning cannot reweight.

    Attributes:
        candidates: the K candidate ids of each request, in draw order.
        log_inclusion: ``log π0(a_k ∈ A^K)`` of each candidate (None: greedy).
        log_expected_count: ``log Σ_k π0_{m(k)}(a_k)`` of each candidate (None: greedy).
        log_candidate_prob: ``log π0(A^K)`` of the ordered draw (None: greedy).

    Shape:
        - candidates, log_inclusion, log_expected_count: ``[B, K]``; log_candidate_prob: ``[B]``
        - :meth:`at`: ``picks [B, L]`` → three ``[B, L]`` tensors

    Example:
        >>> from capg_rec.ann import ExactIndex
        >>> items = torch.randn(50, 8)
        >>> server = ServingRetriever(torch.nn.Identity(), items, index=ExactIndex(items))
        >>> got = server.retrieve(torch.randn(3, 8), num_candidates=5, sample=True)
        >>> shown, log_inclusion, log_count = got.at(torch.tensor([[0, 2]] * 3))   # the later stage's picks
        >>> got.candidates.shape, got.log_candidate_prob.shape, shown.shape
        (torch.Size([3, 5]), torch.Size([3]), torch.Size([3, 2]))
        >>> server.retrieve(torch.randn(3, 8), num_candidates=5).log_inclusion is None     # greedy top-K
        True
    """

    candidates: Tensor
    log_inclusion: Tensor | None = None
    log_expected_count: Tensor | None = None
    log_candidate_prob: Tensor | None = None

    def at(self, picks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The shown items and their logged values: ``picks [B, L]`` (positions among the K candidates)
        → ``shown [B, L]``, ``log_inclusion [B, L]``, ``log_expected_count [B, L]``."""
        if self.log_inclusion is None or self.log_expected_count is None:
            raise ValueError("a greedy retrieval has no propensities to log: retrieve with sample=True")
        picks = check_id_tensor("picks", picks, batch_size=self.candidates.shape[0])
        if picks.shape[1] > self.candidates.shape[1]:
            raise ValueError(f"picks must have at most K={self.candidates.shape[1]} columns (the later stage shows "
                             f"some of the K candidates), got {picks.shape[1]}")
        if picks.numel() and (int(picks.min()) < 0 or int(picks.max()) >= self.candidates.shape[1]):
            raise ValueError(f"picks must be positions in [0, K={self.candidates.shape[1]})")
        ordered = picks.sort(dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise ValueError("picks must not repeat a position within a row (the later stage shows distinct items)")
        return (self.candidates.gather(1, picks), self.log_inclusion.gather(1, picks),
                self.log_expected_count.gather(1, picks))


class ServingRetriever:
    """A trained two-tower ESR for serving: ``user_tower`` scores requests, ``item_vectors`` (the item
    side, after the item tower) are indexed for the greedy top-K.

    Args:
        user_tower: maps a request's inputs to user vectors ``[B, D]`` (one logit model) or ``[B, M, D]``
            (a mixture of M experts; position k uses expert m(k) as in training).
        item_vectors: ``[N, D]`` or ``[N, M, D]``: every item through the item side.
        index: an :class:`~capg_rec.ann.ItemIndex` over ``item_vectors`` for the greedy top-K (default: an
            exact :class:`~capg_rec.ann.FaissIndex`; an approximate one trades recall for time). Among equal
            scores FAISS picks its own way; :class:`~capg_rec.ann.ExactIndex` picks the lower id, as
            :func:`capg_rec.greedy_candidates` does.
        temperature: the serving policy's τ > 0 (a softened ESR explores).
        epsilon: the share ε in ``[0, 1]`` of requests answered by K uniform items.
        method: the inclusion method of the logged ``log_inclusion`` (default: the library's, ``"mean_field"``;
            pass ``"exact"`` where it is affordable: exact for one expert, block-exact, an approximation, for a
            mixture, where only ``"enumerate"`` is exact, on few draws). Write the rows with a
            :class:`~capg_rec.logs.LogWriter` of the same ``method=server.method``: the file records it, and training
            from the logs computes the weights' numerator by it.

    Shape:
        ``retrieve(*inputs, num_candidates=K, masked_items=None)`` (``masked_items [B, E]``) → :class:`Retrieved` of
        ``[B, K]`` (and ``[B]``) tensors.

    Example (a sketch: the names it takes come from your loop)::

        server = ServingRetriever(model.user_tower, item_vectors, temperature=2.0, epsilon=0.05)
        got = server.retrieve(user_features, num_candidates=50, sample=True, generator=g)
        shown, log_inclusion, log_count = got.at(lsr_picks)        # store with the rewards
    """

    def __init__(self, user_tower: Callable[..., Tensor], item_vectors: Tensor, *, index: ItemIndex | None = None,
                 temperature: float = 1.0, epsilon: float = 0.0,
                 method: str | InclusionMethod = DEFAULT_METHOD) -> None:
        if not callable(user_tower):
            raise TypeError(f"user_tower must be callable, got {type(user_tower).__name__}")
        item_vectors = check_float_tensor("item_vectors", item_vectors, ndims=(2, 3), validate=True)
        self.user_tower = user_tower
        self.item_vectors = item_vectors.detach().clone()  # a snapshot, as the index is: one policy served
        self.index = FaissIndex(self.item_vectors) if index is None else index
        if not isinstance(self.index, ItemIndex):
            raise TypeError(f"index must be a capg_rec.ann.ItemIndex, got {type(self.index).__name__}")
        self._check_index()
        self.temperature = check_positive("temperature", temperature)
        if not is_number(epsilon):
            raise TypeError(f"epsilon must be a float, got {type(epsilon).__name__}")
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must lie in [0, 1], got {epsilon}")
        self.epsilon = float(epsilon)
        self.method = inclusion_method(method)
        if not self.method.is_probability:  # found here, not at the first sampled retrieval
            raise ValueError(f"method must give a probability (the logged log_inclusion), got {self.method!r}")

    @property
    def num_items(self) -> int:
        return self.item_vectors.shape[0]

    def _check_index(self) -> None:
        """The index holds as many items, experts and dimensions as ``item_vectors`` (its shape only; that it
        holds these very vectors is trusted): also at each greedy retrieval, for an index refreshed since."""
        item = self.item_vectors
        experts = item.shape[1] if item.dim() == 3 else None
        held = (self.index.num_items, self.index.num_experts, getattr(self.index, "dim", item.shape[-1]))
        if held != (item.shape[0], experts, item.shape[-1]):  # (an index of its own making may not know D)
            raise ValueError(f"index must be built on item_vectors: it holds {held[0]} items for {held[1]} experts "
                             f"of dim {held[2]}, item_vectors {item.shape[0]} for {experts} of dim {item.shape[-1]}")

    @torch.no_grad()
    def user_vectors(self, *inputs: object, **kwargs: object) -> Tensor:
        """The user side of a batch of requests (``user_tower(*inputs, **kwargs)``) → ``[B, M, D]``."""
        user = self.user_tower(*inputs, **kwargs)
        user = check_float_tensor("user_tower(...)", user, ndims=(2, 3), validate=True)
        user = user.unsqueeze(1) if user.dim() == 2 else user
        num_experts = 1 if self.item_vectors.dim() == 2 else self.item_vectors.shape[1]
        if user.shape[1:] != (num_experts, self.item_vectors.shape[-1]):
            raise ValueError(f"user_tower(...) must give [B, M={num_experts}, D={self.item_vectors.shape[-1]}] "
                             f"(or [B, D] for M = 1), got {tuple(user.shape)}")
        return user

    @torch.no_grad()
    def retrieve(self, *inputs: object, num_candidates: int, sample: bool = False,
                 generator: torch.Generator | None = None, masked_items: Tensor | None = None,
                 **kwargs: object) -> Retrieved:
        """K candidates per request: the greedy top-K through the index (``sample=False``), or a draw from
        the serving policy with its log-propensities (``sample=True``: the full catalog is scored, in
        chunks, so that the logged propensities are those of the policy that drew). ``masked_items [B, E]``
        (``-1`` pads) are never served, and the logged propensities are those of the policy without them (as
        training masks them). ``inputs`` and ``kwargs`` go to the user tower."""
        # The user side first: with a sharded model it is a collective of every rank, where an argument error raised
        # before it on one rank would leave the others waiting; nothing after it is collective.
        user = self.user_vectors(*inputs, **kwargs)
        num_candidates = check_count("num_candidates", num_candidates, high=self.num_items)
        masked = None if masked_items is None else check_items(
            "masked_items", masked_items, batch_size=user.shape[0], num_items=self.num_items, unique=False,
            low=-1, columns="E").to(user.device)
        if not check_flag("sample", sample):
            self._check_index()  # refreshed to another catalog since: its ids would be another catalog's
            return Retrieved(self._greedy(user, num_candidates, masked))
        catalog = EmbeddingCatalog(user, self.item_vectors, self.temperature,  # the wider dtype: never half
                                   masked_items=masked)
        candidates = explore_candidates(catalog, num_candidates, epsilon=self.epsilon, generator=generator)
        logged = log_propensities(catalog, candidates, candidates, method=self.method, epsilon=self.epsilon,
                                  validate_args=False)  # our own draw from this very catalog: nothing to check
        return Retrieved(candidates, *logged)

    def _greedy(self, user: Tensor, num_candidates: int, masked: Tensor | None) -> Tensor:
        """Each expert's block takes its best items not taken by earlier blocks (as
        :func:`capg_rec.greedy_candidates`) nor masked, from one index search of the top K + E per expert (E: the
        masked ids per request) → ``[B, K]``."""
        extra = 0 if masked is None else masked.shape[1]
        depth = min(num_candidates + extra, self.num_items)
        found = self.index.search(user if self.index.num_experts is not None else user[:, 0], depth)[1]
        found = found if found.dim() == 3 else found.unsqueeze(1)  # [B, M, K + E], best first
        picks: list[Tensor] = []
        taken = 0
        for expert, count in expert_runs(num_candidates, user.shape[1]):
            best = found[:, expert, :taken + count + extra]  # enough: at most `taken + E` of them are gone
            gone = [*picks, *([] if masked is None else [masked])]
            fresh = best >= 0  # -1: an approximate index found no more
            if gone:  # drop what earlier blocks took and the masked ids, and keep the first `count` others, in order
                among = torch.cat(gone, dim=1).sort(dim=1).values  # searched, not compared pairwise: E may be 1000s
                fresh &= _found(among, best) == among.shape[1]
            short = fresh.sum(1) < count
            if bool(short.any()):
                raise ValueError(self._short_message(num_candidates, masked, int(short.nonzero()[0, 0])))
            order = torch.where(fresh, 0, best.shape[1]) + torch.arange(best.shape[1], device=best.device)
            picks.append(best.gather(1, order.argsort(dim=1))[:, :count])
            taken += count
        return torch.cat(picks, dim=1)

    def _short_message(self, num_candidates: int, masked: Tensor | None, row: int) -> str:
        """Why a request's greedy draw found fewer than K items: it masks more than N - K, or the index found too
        few."""
        room = self.num_items - num_candidates
        if masked is not None and int(masked[row][masked[row] >= 0].unique().numel()) > room:
            return (f"request {row} masks more than N - K = {room} items: fewer than K={num_candidates} items are left "
                    "to retrieve")
        unmasked = "" if masked is None else " that it does not mask"
        return (f"the index found fewer than K={num_candidates} items for request {row}{unmasked} (an approximate "
                "index: search deeper)")
