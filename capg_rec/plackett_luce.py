"""Plackett-Luce (mixture-of-experts) retrieval: sampling and ordered-draw log-probabilities.

The ESR draws K distinct items one position at a time; position k uses expert ``m(k)`` and picks
item a with probability ``exp(s_{m(k)}(a)) / Σ_{b not drawn yet} exp(s_{m(k)}(b))``, where
``s = logits / τ``. Positions are grouped into contiguous expert blocks (:func:`expert_of_position`).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
from torch import Tensor

from capg_rec._checks import check_count, check_flag, check_generator, check_items, raise_where_short, \
    resolve_validate_args
from capg_rec._numerics import constant_cache, log_softmax_at, reverse_logcumsumexp, sequential_log_softmax
from capg_rec.catalog import CatalogScores, DenseCatalog, agreement, as_catalog, resolution

__all__ = ["expert_of_position", "sample_candidates", "greedy_candidates", "candidate_log_prob"]


def expert_of_position(num_candidates: int, num_experts: int) -> Tensor:
    """Position → expert map ``m(k)`` as ``LongTensor[K]``: contiguous blocks, the first blocks
    taking the remainder (K=10, M=5 → 0,0,1,1,2,2,3,3,4,4; K=7, M=3 → 0,0,0,1,1,2,2)."""
    return torch.tensor([e for e, count in expert_runs(num_candidates, num_experts) for _ in range(count)])


@constant_cache(maxsize=64)
def _expert_index(num_candidates: int, num_experts: int, device: torch.device) -> Tensor:
    """:func:`expert_of_position` on ``device``, made once (internal callers only read it)."""
    return expert_of_position(num_candidates, num_experts).to(device)


def expert_runs(num_candidates: int, num_experts: int) -> tuple[tuple[int, int], ...]:
    """The blocks of :func:`expert_of_position` as ``((expert, count), ...)``."""
    # checked before the cache: True and 2.0 hash like 1 and 2, and would be served an int's entry
    return _expert_runs(check_count("num_candidates", num_candidates), check_count("num_experts", num_experts))


@constant_cache(maxsize=256)
def _expert_runs(num_candidates: int, num_experts: int) -> tuple[tuple[int, int], ...]:
    base, extra = divmod(num_candidates, num_experts)
    return tuple((e, base + (e < extra)) for e in range(num_experts) if base + (e < extra) > 0)


def _expert_blocks(candidates: Tensor, num_candidates: int, num_experts: int) -> tuple[Tensor, Tensor | None]:
    """The candidates of each expert's run ``[B, R, n]`` (n = the longest run) and, where runs differ in
    length, which entries are real ``[R, n]`` (the short runs repeat their last candidate)."""
    runs = expert_runs(num_candidates, num_experts)
    longest = runs[0][1]  # the first runs take the remainder
    if all(count == longest for _, count in runs):
        return candidates.reshape(candidates.shape[0], len(runs), longest), None
    positions, keep = _block_positions(runs, candidates.device)
    return candidates[:, positions], keep


@constant_cache(maxsize=64)
def _block_positions(runs: tuple[tuple[int, int], ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """:func:`_expert_blocks`' positions ``[R, n]`` into the draw and its mask ``[R, n]``."""
    longest, starts = runs[0][1], list(itertools.accumulate((n for _, n in runs), initial=0))
    positions = [[start + min(j, count - 1) for j in range(longest)] for start, (_, count) in zip(starts, runs)]
    keep = [[j < count for j in range(longest)] for _, count in runs]
    return torch.tensor(positions, device=device), torch.tensor(keep, device=device)


def _checked(logits: Tensor | CatalogScores, num_candidates: int, temperature: float, validate_args: bool | None,
             generator: torch.Generator | None = None) -> tuple[CatalogScores, bool, int, Exception | None]:
    """The draw's arguments checked → catalog, validate, K and None; or, where they are bad in this process but the
    checks are collective (a catalog shared by processes, validated), one candidate and the error: the draw's first
    check then fails in every process, and this one raises that error (:func:`_draw`)."""
    validate = resolve_validate_args(validate_args)
    catalog = logits if isinstance(logits, CatalogScores) else None
    try:
        check_generator(generator)
        catalog = as_catalog(logits, temperature, validate_args=validate)
        check_count("num_candidates", num_candidates, high=catalog.num_items)
    except (TypeError, ValueError) as err:
        if catalog is None or not (validate and agreement(catalog) is not None):
            raise
        return catalog, validate, 1, err
    return catalog, validate, num_candidates, None


def unmasked_needs(catalog: CatalogScores, num_candidates: int) -> tuple[list[int], Tensor, Tensor]:
    """For a draw of ``num_candidates``: each expert block's expert, the unmasked items it needs ``[R]`` (as many as
    the positions up to the end of its block, whatever the earlier blocks took) and each row's unmasked items under
    it ``[B, R]``."""
    index, needed = _block_needs(num_candidates, catalog.num_experts, catalog.device)
    experts = [m for m, _ in expert_runs(num_candidates, catalog.num_experts)]
    return experts, needed, catalog.num_available().index_select(1, index)


@constant_cache(maxsize=64)
def _block_needs(num_candidates: int, num_experts: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Each expert block's expert ``[R]`` and the unmasked items it needs ``[R]`` (:func:`unmasked_needs`), made on
    ``device`` once (a list made into a device tensor, or indexing by it, waits for the device)."""
    runs = expert_runs(num_candidates, num_experts)
    return (torch.tensor([m for m, _ in runs], device=device),
            torch.tensor(needed_per_block(num_candidates, num_experts), device=device))


def needed_per_block(num_candidates: int, num_experts: int) -> list[int]:
    """The unmasked items each expert block needs: as many as the positions up to its end."""
    return list(itertools.accumulate(n for _, n in expert_runs(num_candidates, num_experts)))


def unresolved_draws(catalog: CatalogScores, num_candidates: int, *, ordered: bool,
                     needs: tuple[list[int], Tensor, Tensor] | None = None) -> Tensor:
    """Where a draw of ``num_candidates`` from a :class:`DenseCatalog` must take items more than
    :func:`~capg_rec.catalog.resolution` below their expert's best → bool ``[B, R]`` per expert block. Relative to the
    best (where every sampler and method works) such scores are rounded by more than 0.03 (``g·eps/2`` at a gap
    ``g``), and nearly equal ones alike (a soft mask such as -1e9 or ``finfo.min`` in float32): a block that takes
    some of them and must choose among more of them, or, when the draw's ``ordered`` (sampling, the ordered-draw
    probability), takes more than one of them, is unresolved. Taking all of them (every unmasked item) needs no
    choice, nor does an inclusion probability with K = N (each is 1). Even far apart from one another such items are
    refused: the methods' own sums (mean-field's root, the enumeration's orders) lose them. As with masked items, each
    block must find enough resolved items whatever the earlier blocks took. The other placements are not checked (all
    False): their scores are dot products, which reach such gaps only through a bias dimension or a tiny
    temperature. ``needs``: :func:`unmasked_needs`' answer, where the caller has it."""
    runs = expert_runs(num_candidates, catalog.num_experts)
    every = not ordered and num_candidates >= catalog.num_items  # each item drawn: π = 1, whatever the blocks take
    if every or not isinstance(catalog, DenseCatalog) or catalog._within_resolution():
        return torch.zeros(catalog.batch_size, len(runs), dtype=torch.bool, device=catalog.device)
    _, needed, available = needs if needs is not None else unmasked_needs(catalog, num_candidates)
    resolved = catalog._num_resolved().index_select(1, _block_needs(num_candidates, catalog.num_experts,
                                                                    catalog.device)[0])
    taken = torch.minimum(needed, available) - resolved  # items beyond resolution drawn
    return (taken > 0) & ((needed < available) | (taken > 1 if ordered else False))


def check_enough_items(catalog: CatalogScores, num_candidates: int, failed: Exception | None = None, *,
                       ordered: bool | None = False) -> None:
    """``ValueError`` unless every expert block can draw its items from the row's unmasked items
    whatever the earlier blocks took: expert m needs as many unmasked items as positions up to
    the end of its block (with one shared mask: K unmasked items per row), and (unless ``ordered`` is None: a greedy
    draw, ordered by score alone) need not tell apart scores beyond resolution (:func:`unresolved_draws`).
    ``failed``: this process's arguments were bad (:func:`_checked`): the agreement fails everywhere, and this
    process raises it."""
    experts, needed, available = needs = unmasked_needs(catalog, num_candidates)
    short = available < needed
    if ordered is not None:
        short = torch.stack([short, unresolved_draws(catalog, num_candidates, ordered=ordered, needs=needs)])

    def message(at: tuple[int, ...]) -> str:
        what, row, block = at if len(at) == 3 else (0, *at)
        if what:
            return _unresolved_message(catalog, num_candidates, f"under expert {experts[block]}, in row {row}")
        return (f"num_candidates={num_candidates} needs {int(needed[block])} unmasked items under expert "
                f"{experts[block]}, but row {row} has {int(available[row, block])} (items scored -inf are masked)")

    raise_where_short(catalog.agree, short, message, f"num_candidates={num_candidates} needs more unmasked items in "
                      "another process's rows (items scored -inf are masked), or draws there among items beyond "
                      "resolution", failed)


def _unresolved_message(catalog: CatalogScores, num_candidates: int, where: str) -> str:
    """The message of a draw among scores beyond resolution (:func:`unresolved_draws`), ``where`` it is."""
    return (f"num_candidates={num_candidates} must draw {where} among items more than "
            f"{resolution(catalog.dtype):.4g} below their expert's best score, which {catalog.dtype} rounds there "
            "by more than 0.03, nearly equal ones alike (a soft mask such as -1e9? mask such items with -inf, then a "
            "row needs K unmasked items)")


def _draw(catalog: CatalogScores, num_candidates: int, *, perturb: bool, generator: torch.Generator | None,
          validate: bool, failed: Exception | None = None) -> Tensor:
    """Each expert block's best (``perturb``: Gumbel-perturbed) items not drawn yet → ``[B, K]``; with ``validate``,
    first :func:`check_enough_items`, unless the catalog checks its draws itself (``CatalogScores._drawing``).
    ``failed``: this process's arguments were bad; the first check fails everywhere and this process raises it."""
    drawing = catalog._drawing(num_candidates, failed)
    if drawing is None:
        if validate:
            check_enough_items(catalog, num_candidates, failed, ordered=True if perturb else None)
        drawing = contextlib.nullcontext()
    picks: list[Tensor] = []
    with drawing:
        for expert, count in expert_runs(num_candidates, catalog.num_experts):
            exclude = torch.cat(picks, dim=1) if picks else None
            picks.append(catalog.top_items(count, experts=[expert], exclude=exclude,
                                           generator=generator, perturb=perturb)[:, 0])
    return torch.cat(picks, dim=1)


def sample_candidates(logits: Tensor | CatalogScores, num_candidates: int, *, temperature: float = 1.0,
                      generator: torch.Generator | None = None, validate_args: bool | None = None) -> Tensor:
    """Draw K candidates from the PL(-MoE) ESR, exactly, in draw order → ``LongTensor[B, K]``.

    ``logits`` is ``[B, N]``, ``[B, M, N]`` or a :class:`~capg_rec.catalog.CatalogScores`; items
    scored ``-inf`` are masked and never drawn (a row with fewer than K others is a ``ValueError``).
    Each expert block is a Gumbel top-k over the items not drawn yet with *fresh* noise (one noise
    vector shared by all blocks, as in the paper's appendix, is biased when experts differ).
    ``validate_args``: check the logits and the unmasked counts (``None``: the module default).
    """
    catalog, validate, num_candidates, failed = _checked(logits, num_candidates, temperature, validate_args, generator)
    return _draw(catalog, num_candidates, perturb=True, generator=generator, validate=validate, failed=failed)


def greedy_candidates(logits: Tensor | CatalogScores, num_candidates: int, *,
                      temperature: float = 1.0, validate_args: bool | None = None) -> Tensor:
    """The noise-free draw: each block takes its expert's best remaining items → ``LongTensor[B, K]``."""
    catalog, validate, num_candidates, failed = _checked(logits, num_candidates, temperature, validate_args)
    return _draw(catalog, num_candidates, perturb=False, generator=None, validate=validate, failed=failed)


def candidate_log_prob(logits: Tensor | CatalogScores, candidates: Tensor, *, temperature: float = 1.0,
                       with_replacement: bool = False, validate_args: bool | None = None) -> Tensor:
    """``log π(A^K | x)`` of the ordered draw ``candidates [B, K]`` → ``[B]`` (the V-PG score).

    Without replacement each position is normalised over the items not drawn yet; the
    remaining mass is summed directly (items outside the draw plus the later draws), never
    obtained by subtraction, so confident policies stay finite. With ``with_replacement=True``
    every position is normalised over the whole catalog (the V-PG-SwR score). A draw that
    holds a masked item (scored ``-inf``) has log-probability ``-inf``. When validating (without replacement), a row
    where a draw of K takes more than one item beyond resolution below its expert's best score, or chooses among
    them (:func:`unresolved_draws`; a soft mask such as -1e9), is a ``ValueError``.
    """
    validate = resolve_validate_args(validate_args)
    catalog = as_catalog(logits, temperature, validate_args=validate)
    candidates = check_items("candidates", candidates, batch_size=catalog.batch_size, num_items=catalog.num_items,
                             unique=not check_flag("with_replacement", with_replacement), validate=validate,
                             columns="K", device=catalog.device)
    if validate and not with_replacement and candidates.shape[1]:
        num_candidates = candidates.shape[1]
        raise_where_short(catalog.agree, unresolved_draws(catalog, num_candidates, ordered=True),
                          lambda at: _unresolved_message(catalog, num_candidates, f"in row {at[0]}"),
                          _unresolved_message(catalog, num_candidates, "in another process's rows"))
    return _candidate_log_prob(catalog, candidates, with_replacement)


def _candidate_log_prob(catalog: CatalogScores, candidates: Tensor, with_replacement: bool) -> Tensor:
    """:func:`candidate_log_prob` on validated inputs."""
    num_candidates = candidates.shape[1]
    experts = _expert_index(num_candidates, catalog.num_experts, catalog.device)
    idx = experts.view(1, 1, -1).expand(catalog.batch_size, 1, -1)
    if with_replacement:  # Σ_k log softmax_{m(k)}(a_k)
        if isinstance(catalog, DenseCatalog):  # each position under its own expert only: K entries, not M·K
            blocks, keep = _expert_blocks(candidates, num_candidates, catalog.num_experts)
            scores = catalog.scores[:, :blocks.shape[1]]  # the runs' experts are the first R
            log_softmax = log_softmax_at(scores, blocks, 2)  # [B, R, n]
            if keep is not None:
                log_softmax = torch.where(keep, log_softmax, 0.0)
            return log_softmax.sum(dim=(1, 2))
        return catalog.log_softmax(candidates).gather(1, idx)[:, 0].sum(dim=1)
    if isinstance(catalog, DenseCatalog):  # one node over the logits
        runs = expert_runs(num_candidates, catalog.num_experts)
        return sequential_log_softmax(catalog.scores, candidates, runs).sum(dim=1)
    scores, outside = catalog.gather_with_rest(candidates)  # [B, M, K], [B, M]: items never drawn
    picked = scores.gather(1, idx)[:, 0]  # [B, K]: s_{m(k)}(a_k)
    # Σ_{j ≥ k} exp(s_j) + exp(outside): a suffix sum whose last term is the never-drawn mass
    remaining = reverse_logcumsumexp(torch.cat([scores, outside.unsqueeze(2)], dim=2), dim=2)[..., :-1]
    log_probs = picked - remaining.gather(1, idx)[:, 0]
    return log_probs.masked_fill(picked == -math.inf, -math.inf).sum(dim=1)  # a masked draw: not NaN
