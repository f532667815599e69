"""Head/tail summary of a catalog for the inclusion-probability methods (private).

The "head" of a row is the union of every expert's top-H items plus the target items; it is
kept item by item. The rest of the catalog (the "tail") is summarised by its log power sums
``log Σ_tail exp(p · s)``, ``p = 1..P``, which one streaming pass computes for any placement of
the catalog. For a small catalog the head is the whole catalog and the tail is empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from capg_rec.catalog import CatalogScores, every_score, unpadded


@dataclass
class HeadTail:
    """``head_ids [B, T]`` (−1 marks an unused slot), ``head_scores [B, M, T]`` (−inf in unused
    slots), ``target_pos [B, L]`` (each target's slot in the head), ``tail_log_power_sums
    [B, M, P]`` (−inf when the tail is empty), ``head_floor [B, M]`` (each expert's score of its
    own ``head_size``-th best item, no gradient; −inf when the head is the whole catalog)."""

    head_ids: Tensor
    head_scores: Tensor
    target_pos: Tensor
    tail_log_power_sums: Tensor
    head_floor: Tensor


WHOLE_UP_TO = 2048
"""Catalogs of at most this many items are read whole, item by item, by the methods that read the best items
(mean-field, plug-in, exact), even where the catalog estimates its sums."""


def read_whole(catalog: CatalogScores) -> bool:
    """Whether a method that reads the best items should score every item of ``catalog`` (:func:`every_score`): a
    small catalog that estimates its sums (names fewer best items exactly than it has), or one that scores the whole of
    itself in one product (:attr:`~capg_rec.CatalogScores._whole_in_one_product`: faster than its streamed top
    items and sums at this size)."""
    return catalog.num_items <= WHOLE_UP_TO and (catalog.exact_top < catalog.num_items
                                                  or catalog._whole_in_one_product)


def head_size_for(num_items: int, num_candidates: int, *, minimum: int = 1024) -> int:
    """Items per expert kept exactly: the whole catalog when small, else ``max(8K, minimum)``."""
    if num_items <= WHOLE_UP_TO:
        return num_items
    return min(num_items, max(8 * num_candidates, minimum))


def summarize(catalog: CatalogScores, targets: Tensor, head_size: int, num_powers: int) -> HeadTail:
    """Build the head (union of top-``head_size`` per expert plus ``targets [B, L]``) and the tail."""
    batch, num_targets = targets.shape
    experts = catalog.num_experts
    # Each id scored once under every expert as it comes (the best items, then the targets), then sorted so
    # that repeats are side by side.
    if head_size >= catalog.num_items:
        ids = torch.arange(catalog.num_items, device=catalog.device).expand(batch, -1)
        floor = torch.full((batch, experts), -torch.inf, dtype=catalog.dtype, device=catalog.device)
        scores = every_score(catalog)
    else:
        ids = catalog.top_items(head_size).flatten(1)  # [B, M·H], each expert's best first
        with catalog._trusting():  # the catalog's own draws
            scores = catalog.gather(unpadded(ids))
        with torch.no_grad():  # expert m's own H-th best; -inf where that slot is a pad (-1: fewer items to name)
            floor = scores.view(batch, experts, experts, head_size)[..., -1].diagonal(dim1=1, dim2=2)
            floor = floor.masked_fill(ids.view(batch, experts, head_size)[..., -1] < 0, -torch.inf)
    if num_targets:
        scores = torch.cat([scores, catalog.gather(targets)], dim=2)
        ids = torch.cat([ids, targets], dim=1)
    sorted_ids, order = ids.sort(dim=1, stable=True)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    head_ids = torch.where(first, sorted_ids, torch.full_like(sorted_ids, -1))
    # Each target's slot: the first sorted occurrence of its id.
    slot = torch.arange(ids.shape[1], device=ids.device).expand(batch, -1)
    first_slot = torch.where(first, slot, torch.zeros_like(slot)).cummax(dim=1).values
    inverse = order.argsort(dim=1)
    target_pos = first_slot.gather(1, inverse[:, ids.shape[1] - num_targets:])
    head_scores = scores.gather(2, order.unsqueeze(1).expand(-1, experts, -1)).masked_fill(
        (head_ids < 0).unsqueeze(1), -torch.inf)  # repeats, and -1 (unused slots of a sampled catalog's draw)
    if head_size >= catalog.num_items:
        tail = torch.full((batch, experts, num_powers), -torch.inf, dtype=catalog.dtype, device=catalog.device)
    else:
        tail = catalog.log_power_sums(head_ids, num_powers)
    return HeadTail(head_ids, head_scores, target_pos, tail, floor)
