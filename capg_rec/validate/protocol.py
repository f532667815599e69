"""What a retriever must offer to be validated, and adapters for capg_rec's own ESRs.

A custom ESR implements :class:`ESR`: it samples K candidates per context and reports the
log-probabilities it claims. :class:`CatalogESR` makes anything that produces logits or a
:class:`~capg_rec.catalog.CatalogScores` (a tensor, a catalog, a model such as a two-tower
retriever) satisfy it, using capg_rec's sampler and estimators.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from capg_rec._checks import check_count, check_positive
from capg_rec.catalog import CatalogScores, DenseCatalog, EmbeddingCatalog, as_catalog
from capg_rec.marginals import Enumeration, InclusionMethod, inclusion_log_prob, inclusion_method
from capg_rec.plackett_luce import candidate_log_prob, expert_of_position, expert_runs, sample_candidates

__all__ = ["ESR", "CatalogESR"]

ScoresSource = Tensor | CatalogScores | Callable[[Any], Tensor | CatalogScores]

@runtime_checkable
class ESR(Protocol):
    """An early-stage retriever that can be validated.

    Required:

    * ``num_candidates``: K, the number of candidates per draw.
    * ``sample(contexts, num_samples, generator)`` → ``LongTensor[B, S, K]``: S independent
      draws per context, in draw order, randomness only from ``generator``.
    * ``inclusion_log_prob(contexts)`` → ``[B, N]``: the claimed ``log P(a ∈ A^K | x_b)`` for
      every item a (−inf for items that are never drawn).

    Optional:

    * ``with_replacement`` (default False): the K positions are drawn independently (items
      may repeat) and ``inclusion_log_prob`` claims ``log E[#times a is drawn]`` instead; this
      is what the CA-PG-SwR score ``log Σ_k π_{m(k)}(a)`` means.
    * ``candidate_log_prob(contexts, candidates [B, C, K])`` → ``[B, C]``: the claimed
      log-probability of each ordered draw; checked exactly on tiny catalogs.

    Shape:
        ``sample`` → ``[B, S, K]`` (int64); ``inclusion_log_prob`` → ``[B, N]``; ``candidate_log_prob``:
        ``[B, C, K]`` → ``[B, C]``.

    Example:
        >>> esr = CatalogESR(torch.randn(2, 10), num_candidates=3)      # or a class of your own
        >>> isinstance(esr, ESR), esr.sample(None, 5, torch.Generator().manual_seed(0)).shape
        (True, torch.Size([2, 5, 3]))
    """

    num_candidates: int

    def sample(self, contexts: Any, num_samples: int, generator: torch.Generator) -> Tensor: ...

    def inclusion_log_prob(self, contexts: Any) -> Tensor: ...


def _replicate(catalog: CatalogScores, copies: int) -> CatalogScores:
    """The same catalog with every row repeated ``copies`` times (row ``b·c + j``)."""
    if isinstance(catalog, DenseCatalog):
        return DenseCatalog(catalog.scores.repeat_interleave(copies, 0), validate_args=False)
    if isinstance(catalog, EmbeddingCatalog):
        masked = None if catalog.masked_items is None else catalog.masked_items.repeat_interleave(copies, 0)
        return EmbeddingCatalog(catalog.user.repeat_interleave(copies, 0), catalog.item, masked_items=masked,
                                chunk_size=catalog.chunk_size, validate_args=False)
    raise TypeError(f"cannot replicate {type(catalog).__name__}")


class CatalogESR:
    """capg_rec's PL(-MoE) ESR over ``scores`` as an :class:`ESR`.

    Sampling is :func:`~capg_rec.sample_candidates` (or, for a method that is not a probability such as
    ``WithReplacement``, one independent softmax draw per position); claims come from
    :func:`~capg_rec.inclusion_log_prob` with ``method`` and :func:`~capg_rec.candidate_log_prob`.

    Args:
        scores: logits ``[B, N]`` / ``[B, M, N]``, a :class:`CatalogScores`, or a callable (e.g. a
            ``torch.nn.Module`` such as a two-tower retriever) mapping contexts to either; a tensor or catalog
            ignores the contexts.
        num_candidates: K.
        temperature: τ > 0 (default 1.0).
        method: an :class:`~capg_rec.InclusionMethod`, yours included, or a registered name; None (default):
            ``"enumerate"`` for a draw of more than one expert block where it is affordable
            (:meth:`~capg_rec.Enumeration.affordable`), else ``"exact"``, which is exact for one block and
            block-exact, an approximation, for more: a correct mixture ESR may then fail its inclusion checks.
        max_elements: bounds the ``B·copies·M·N`` scores held at once while sampling (default ``2^22``).

    Shape:
        As :class:`ESR`: :meth:`sample` → ``[B, S, K]``; :meth:`inclusion_log_prob` → ``[B, N]``;
        :meth:`candidate_log_prob`: ``[B, C, K]`` → ``[B, C]``.

    Example:
        >>> from capg_rec.validate import validate_esr
        >>> _ = torch.manual_seed(0)
        >>> esr = CatalogESR(torch.randn(2, 10), num_candidates=3)
        >>> validate_esr(esr, num_samples=500, max_enumerated_draws=0).passed
        True
    """

    def __init__(self, scores: ScoresSource, num_candidates: int, *, temperature: float = 1.0,
                 method: str | InclusionMethod | None = None, max_elements: int = 1 << 22) -> None:
        if not isinstance(scores, (Tensor, CatalogScores)) and not callable(scores):
            raise TypeError("scores must be a logits tensor, a CatalogScores or a callable returning "
                            f"one, got {type(scores).__name__}")
        self.scores = scores
        self.num_candidates = check_count("num_candidates", num_candidates)
        self.temperature = check_positive("temperature", temperature)
        self.method = None if method is None else inclusion_method(method)
        self.max_elements = check_count("max_elements", max_elements)
        self.with_replacement = self.method is not None and not self.method.is_probability

    def catalog(self, contexts: Any) -> CatalogScores:
        """The catalog scores for ``contexts`` (no gradient is tracked)."""
        with torch.no_grad():
            out = self.scores(contexts) if callable(self.scores) else self.scores
        return as_catalog(out.detach() if isinstance(out, Tensor) else out, self.temperature)

    def _over_copies(self, catalog: CatalogScores, copies: int, fn: Callable[[CatalogScores, slice], Tensor]
                     ) -> Tensor:
        """``fn(replicated catalog, copy slice)`` over ``copies`` copies of every row → ``[B, copies, ...]``.

        Dense and embedding catalogs are replicated in chunks; any other catalog is used as is,
        one copy at a time.
        """
        batch = catalog.batch_size
        replicable = isinstance(catalog, (DenseCatalog, EmbeddingCatalog))
        step = max(1, self.max_elements // (batch * catalog.num_experts * catalog.num_items)) if replicable else 1
        out = []
        for start in range(0, copies, step):
            size = min(step, copies - start)
            rep = _replicate(catalog, size) if replicable else catalog
            res = fn(rep, slice(start, start + size))
            out.append(res.reshape(batch, size, *res.shape[1:]))
        return torch.cat(out, dim=1)

    def sample(self, contexts: Any, num_samples: int, generator: torch.Generator) -> Tensor:
        """``num_samples`` draws per context → ``LongTensor[B, S, K]``."""
        num_samples = check_count("num_samples", num_samples)
        catalog = self.catalog(contexts)
        k = self.num_candidates
        if self.with_replacement:
            experts = expert_of_position(k, catalog.num_experts).tolist()
            return self._over_copies(catalog, num_samples, lambda rep, _: rep.top_items(
                1, experts=experts, generator=generator, perturb=True)[..., 0])
        return self._over_copies(catalog, num_samples,
                                 lambda rep, _: sample_candidates(rep, k, generator=generator))

    def inclusion_log_prob(self, contexts: Any) -> Tensor:
        """Claimed ``log P(a ∈ A^K)`` of every item → ``[B, N]`` (``log E[count]`` for a method that is
        not a probability)."""
        catalog = self.catalog(contexts)
        items = torch.arange(catalog.num_items, device=catalog.device).expand(catalog.batch_size, -1)
        method = self.method
        if method is None:  # block-exact's error in a mixture would fail a correct ESR (0.04 at N = 12, K = 4)
            blocks = len(expert_runs(self.num_candidates, catalog.num_experts))  # "exact" is exact for one
            method = "enumerate" if blocks > 1 and Enumeration.affordable(catalog.num_items, self.num_candidates) \
                else "exact"
        with torch.no_grad():
            return inclusion_log_prob(catalog, items, self.num_candidates, method=method)

    def candidate_log_prob(self, contexts: Any, candidates: Tensor) -> Tensor:
        """Claimed log-probability of each ordered draw ``candidates [B, C, K]`` → ``[B, C]``."""
        catalog = self.catalog(contexts)
        k = candidates.shape[-1]
        with torch.no_grad():
            return self._over_copies(catalog, candidates.shape[1], lambda rep, sl: candidate_log_prob(
                rep, candidates[:, sl].reshape(-1, k), with_replacement=self.with_replacement))
