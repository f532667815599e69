"""Multi-rank parity: sharded catalog scores vs the same retriever in one process.

Run with ``torchrun --nproc_per_node=W integration/parity.py --out DIR``. Every rank builds the
retriever sharded over the W ranks and, as the reference, unsharded with the whole global batch.
For each set-up (uneven row-wise split, a mixture of experts, table-wise tables) it checks:

* the raw reductions (normalizer, power sums with exclusions, gather, top-k, Gumbel top-k),
  also against :class:`capg_rec.EmbeddingCatalog`;
* for each estimator, the candidates sampled from a seed, the loss (mean over ranks vs the
  global-batch loss), and every embedding row after one fused-SGD step;
* all of the above again with masked items (``masked_items``: each row's best items and random
  ones), which must also never be drawn, and with the global batch's mean reward as the baseline
  (:func:`capg_rec.torchrec.global_mean_baseline`);
* a batch split with ranks that hold no users (B_r = 0), and an empty global batch;
* that gather and the power sums make no host sync with validation off;
* that bad set-ups and bad values on one rank only raise the same error on every rank instead
  of hanging, and that the ranks stay in step afterwards.

Each rank writes ``DIR/parity_rank{r}.json`` (check name → relative error, and the error messages
each rank raised) and exits non-zero if any check exceeds its tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

import _harness as h
from capg_rec import CAPGLoss, EmbeddingCatalog, OffPolicyCAPGLoss, OffPolicyVPGLoss, TopKReinforceLoss, VPGLoss, \
    candidate_log_prob, inclusion_log_prob, sample_candidates
from capg_rec.functional import vpg_loss
from capg_rec.testing import count_host_syncs
from capg_rec.torchrec import ContextBaseline, ShardedEmbeddingCatalog, global_mean_baseline
from capg_rec._collective import exchange

SETUPS = {
    "rw_uneven": h.Setup(num_items=10_001, num_experts=1, dim=8, temperature=0.5),
    "rw_moe": h.Setup(num_items=10_001, num_experts=3, dim=4, chunk_size=777),
    "table_wise": h.Setup(num_items=3_001, num_experts=2, dim=4, temperature=2.0, sharding="table_wise"),
    # small enough that the inclusion methods read the whole catalog through gather alone: a rank
    # without item rows must still join the lookup's backward
    "table_wise_small": h.Setup(num_items=1_001, num_experts=2, dim=4, sharding="table_wise"),
}
CANDIDATES, SHOWN, GLOBAL_BATCH, LR = 7, 3, 6, 0.5
ESTIMATORS = {
    "vpg": lambda: VPGLoss(CANDIDATES),
    "vpg_swr": lambda: VPGLoss(CANDIDATES, with_replacement=True),
    "capg_plugin": lambda: CAPGLoss(CANDIDATES, method="plugin"),
    "capg_mean_field": lambda: CAPGLoss(CANDIDATES, method="mean_field"),
    "capg_exact": lambda: CAPGLoss(CANDIDATES, method="exact"),
    "capg_swr": lambda: CAPGLoss(CANDIDATES, method="with_replacement"),
}
EMPTY_SPLITS = {1: [GLOBAL_BATCH], 2: [0, GLOBAL_BATCH], 3: [2, 0, GLOBAL_BATCH - 2]}  # users per rank
EMPTY_RANK_SETUPS = ("rw_uneven", "table_wise")
TOLERANCE = 1e-5
# updates are differences of O(1) rows: float32 leaves them ~1e-5 relative precision; allow 1e-3
UPDATE_TOLERANCE_FACTOR = TOLERANCE / 1e-3


def rel(a: Tensor, b: Tensor) -> float:
    """max |a - b| / max |b| (0 when both are empty); infinities must coincide."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    if not torch.equal(torch.isinf(a), torch.isinf(b)) or not torch.equal(a[torch.isinf(a)], b[torch.isinf(b)]):
        return float("inf")
    finite = torch.isfinite(b)
    if not finite.any():
        return 0.0
    return float((a[finite] - b[finite]).abs().max() / b[finite].abs().max().clamp_min(1e-30))


def same(a: Tensor, b: Tensor) -> float:
    return 0.0 if torch.equal(a, b) else float("inf")


def lsr(users: Tensor, candidates: Tensor, num_items: int) -> tuple[Tensor, Tensor]:
    """A fixed later-stage ranker: shows the SHOWN candidates of highest hidden utility; reward = utility."""
    utility = torch.sin(users.unsqueeze(1) * 12.9898 + candidates * 78.233) * 0.5 + 0.5  # [B, K] in [0, 1]
    top = utility.topk(SHOWN, dim=1)
    return candidates.gather(1, top.indices), top.values


def masks_for(setup: h.Setup, reference, global_kjt) -> Tensor:
    """Masked ids ``[GLOBAL_BATCH, 11]`` (-1 pads): each row's 3 best items under expert 0 (so the
    masks change what is drawn), random ones (on every rank's rows), a repeat, a row with none."""
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        best = reference(global_kjt).top_items(3, experts=[0])[:, 0]
    masked = torch.cat([best, torch.randint(0, setup.num_items, (GLOBAL_BATCH, 6), generator=g),
                        torch.full((GLOBAL_BATCH, 2), -1)], 1)
    masked[1] = -1
    masked[2, 9] = masked[2, 0]
    return masked


def check_reductions(name, setup, model, reference, state, local_kjt, global_kjt, mine, record,
                     masked: Tensor | None = None) -> None:
    h.load(model, state)
    h.load(reference, state)
    cat = model(local_kjt, masked_items=None if masked is None else masked[mine])
    ref = reference(global_kjt, masked_items=masked)
    # the independent reference: plain EmbeddingCatalog over the full tables
    users = global_kjt[h.USER_ID].values()
    dense = EmbeddingCatalog(state[f"embeddings.embeddings.{h.USER_TABLE}.weight"][users].view(
        -1, setup.num_experts, setup.dim), state[f"embeddings.embeddings.{h.ITEM_TABLE}.weight"].view(
        setup.num_items, setup.num_experts, setup.dim), setup.temperature, masked_items=masked)
    g = torch.Generator().manual_seed(11)
    exclude = torch.randint(0, setup.num_items, (GLOBAL_BATCH, 5), generator=g)
    exclude[0, 2:] = -1
    items = torch.randint(0, setup.num_items, (GLOBAL_BATCH, 4), generator=g)
    if masked is not None:
        items[:, 0] = masked[:, 0]  # masked targets: -inf
        items[1, 0] = 0
    record(f"{name}/ref_vs_dense/log_power_sums", rel(ref.log_power_sums(exclude, 3), dense.log_power_sums(exclude, 3)))
    record(f"{name}/ref_vs_dense/gather", rel(ref.gather(items), dense.gather(items)))
    # scores on the grid tie often, so top-k lists are compared by the scores they pick
    def picked(ids: Tensor, rows: slice = slice(None)) -> Tensor:
        full = torch.zeros(GLOBAL_BATCH, *ids.shape[1:], dtype=torch.long)
        full[rows] = ids
        return dense.gather(full.flatten(1)).view(GLOBAL_BATCH, setup.num_experts, *ids.shape[1:])[rows]

    record(f"{name}/ref_vs_dense/top_items", same(picked(ref.top_items(9, exclude=exclude)),
                                                  picked(dense.top_items(9, exclude=exclude))))
    record(f"{name}/num_available", same(cat.num_available(), dense.num_available()[mine]))
    record(f"{name}/log_normalizer", rel(cat.log_normalizer(), ref.log_normalizer()[mine]))
    record(f"{name}/log_power_sums", rel(cat.log_power_sums(exclude[mine], 3), ref.log_power_sums(exclude, 3)[mine]))
    record(f"{name}/gather", rel(cat.gather(items[mine]), ref.gather(items)[mine]))
    record(f"{name}/top_items", same(picked(cat.top_items(9, exclude=exclude[mine]), mine),
                                     picked(ref.top_items(9, exclude=exclude))[mine]))
    for m in range(setup.num_experts):
        sampled = cat.top_items(5, experts=[m], exclude=exclude[mine], perturb=True,
                                generator=torch.Generator().manual_seed(5 + m))
        expected = ref.top_items(5, experts=[m], exclude=exclude, perturb=True,
                                 generator=torch.Generator().manual_seed(5 + m))[mine]
        record(f"{name}/gumbel_top_items/expert{m}", same(sampled, expected))
        if masked is not None:
            record(f"{name}/gumbel_top_items/expert{m}/never_masked", never_masked(sampled[:, 0], masked[mine]))


def never_masked(ids: Tensor, masked: Tensor) -> float:
    """0 when no id of ``ids [B, K]`` is among its row's ``masked [B, E]``."""
    return float("inf") if (ids.unsqueeze(2) == masked.unsqueeze(1)).any() else 0.0


def check_estimator(name, est, setup, model, reference, state, local_kjt, global_kjt, mine, record,
                    masked: Tensor | None = None) -> None:
    h.load(model, state)
    h.load(reference, state)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    dense_params = [p for n, p in model.named_parameters() if "embeddings" not in n]
    dense_opt = torch.optim.SGD(dense_params, lr=LR) if dense_params else None
    cat = model(local_kjt, masked_items=None if masked is None else masked[mine])
    ref = reference(global_kjt, masked_items=masked)
    cand = sample_candidates(cat, CANDIDATES, generator=torch.Generator().manual_seed(2024))
    ref_cand = sample_candidates(ref, CANDIDATES, generator=torch.Generator().manual_seed(2024))
    record(f"{name}/{est}/candidates", same(cand, ref_cand[mine]))
    if masked is not None:
        record(f"{name}/{est}/candidates_never_masked", never_masked(cand, masked[mine]))
    users = global_kjt[h.USER_ID].values()
    chosen, rewards = lsr(users, ref_cand, setup.num_items)
    # with masks, also a baseline: the mean reward of the global batch, on every rank
    baseline = None if masked is None else global_mean_baseline(rewards[mine], dist.group.WORLD)
    ref_baseline = None if masked is None else rewards.mean().expand(GLOBAL_BATCH)
    if baseline is not None:
        record(f"{name}/{est}/global_mean_baseline", rel(baseline, ref_baseline[mine]))
    loss = ESTIMATORS[est]()(cat, cand, chosen[mine], rewards[mine], baseline=baseline)
    ref_loss = ESTIMATORS[est]()(ref, ref_cand, chosen, rewards, baseline=ref_baseline)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    # a baseline of the batch mean makes the loss a sum of terms that cancel: measure its error
    # against the size of the loss without it
    scale = ref_loss if baseline is None else ESTIMATORS[est]()(ref, ref_cand, chosen, rewards).detach()
    record(f"{name}/{est}/loss", rel(mean_loss / dist.get_world_size(), ref_loss)
           * float(ref_loss.abs()) / max(float(ref_loss.abs()), float(scale.abs()), 1e-30))
    loss.backward()
    ref_loss.backward()
    ref_opt.step()
    if dense_opt is not None:
        dense_opt.step()
    for key, err in h.max_shard_error(model, reference).items():
        record(f"{name}/{est}/after_step/{key}", err)
    # the update itself, so that a wrong gradient scale cannot hide behind large rows
    for key, err in h.max_shard_error(model, reference, base=state).items():
        record(f"{name}/{est}/update/{key}", err * UPDATE_TOLERANCE_FACTOR)


def expect_error(check: str, fragment: str, call, record, messages: dict[str, str] | None = None,
                 kind: type[Exception] = ValueError) -> None:
    """``call()`` must raise ``kind`` whose message contains ``fragment`` (kept in ``messages``)."""
    try:
        call()
    except kind as err:
        record(check, 0.0 if fragment in str(err) else float("inf"))
        if messages is not None:
            messages[check] = f"{type(err).__name__}: {err}"
        return
    record(check, float("inf"))


def check_bad_setups(mine: slice, record, messages: dict[str, str]) -> None:
    """Mis-configurations fail on every rank with a clear message (no rank is left waiting)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    setup = h.Setup(num_items=1_000, num_experts=2, dim=4)
    users = h.user_batch(torch.arange(GLOBAL_BATCH)[mine])
    model = h.shard(setup, lr=LR)
    expect_error("bad_setup/missing_catalog_feature", "with_catalog", lambda: model(users), record)
    wrong = h.user_batch(torch.arange(GLOBAL_BATCH)[mine])
    wrong = h.KeyedJaggedTensor.concat([wrong, h.KeyedJaggedTensor.from_lengths_sync(
        [h.CATALOG], torch.arange(3), torch.tensor([3] + [0] * (wrong.stride() - 1)))])
    expect_error("bad_setup/wrong_catalog_rows", "must list this rank's item rows", lambda: model(wrong), record)
    # the last rank alone lists its rows in the wrong order: every rank raises (validation exchanges first)
    kjt = model.module.with_catalog(users)
    if rank == world - 1:
        catalog = kjt.values()[-model.module.catalog_ids().numel():]
        catalog.copy_(catalog.flip(0).clone())
    expect_error("bad_setup/one_rank_wrong_catalog_order", "must list this rank's item rows",
                 lambda: model(kjt), record, messages)
    # the last rank alone passes a KJT whose lengths miss a sample (found by review: TorchRec's reshape raised a
    # RuntimeError there, outside the collective check, and left the other ranks waiting)
    kjt = model.module.with_catalog(users)
    if rank == world - 1:
        kjt = h.KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths()[1:], stride=kjt.stride())
    expect_error("bad_setup/one_rank_lengths_miss_a_sample", "must hold one length per key and sample",
                 lambda: model(kjt), record, messages)
    replicated = h.shard(h.Setup(num_items=1_000, num_experts=2, dim=4, sharding="data_parallel"), lr=LR)
    expect_error("bad_setup/data_parallel_item_table", "row_wise or table_wise",
                 lambda: replicated(replicated.module.with_catalog(users)), record)


def check_one_rank_errors(record, messages: dict[str, str]) -> None:
    """Bad arguments on the last rank only: every rank raises the same error, then all go on in step.
    Also: with validation off, gather and the power sums read nothing back to the host."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    num_items, last = 20, rank == world - 1
    g = torch.Generator().manual_seed(3)
    users, items = torch.randn(2 * world, 2, 3, generator=g), torch.randn(num_items, 2, 3, generator=g)
    block = -(-num_items // world)
    offset, mine = min(rank * block, num_items), slice(2 * rank, 2 * rank + 2)
    rows = items[offset: offset + block]
    masked = torch.tensor([[3, -1], [19, 7]] * world)

    def catalog(user=None, item=None, **kw) -> ShardedEmbeddingCatalog:
        args = {"num_items": num_items, "row_offset": offset, "process_group": group, "masked_items": masked[mine],
                "chunk_size": 4, **kw}
        return ShardedEmbeddingCatalog(users[mine] if user is None else user, rows if item is None else item, **args)

    nan_user = users[mine].clone()
    nan_user[1, 1, 0] = float("nan") if last else 0.0
    expect_error("one_rank/nan_user", "user must be finite", lambda: catalog(nan_user), record, messages)
    expect_error("one_rank/masked_out_of_range", "masked_items must hold ids in [-1, 20)",
                 lambda: catalog(masked_items=torch.tensor([[20], [0]]) if last else torch.tensor([[0], [1]])),
                 record, messages)
    expect_error("one_rank/user_dims", "user must have 2 or 3 dims",
                 lambda: catalog(users[mine][0, 0] if last else None), record, messages)
    expect_error("one_rank/masked_dtype", "masked_items must have an integer dtype",
                 lambda: catalog(masked_items=masked[mine].float() if last else masked[mine]), record, messages,
                 kind=TypeError)
    if world > 1:
        expect_error("one_rank/validate_args_differ", "validate_args must be the same on every rank",
                     lambda: catalog(validate_args=not last), record, messages)
        expect_error("one_rank/dtypes_differ", "score in the same dtype",  # float64 users on one rank only
                     lambda: catalog(users[mine].double() if last else None), record, messages)
        expect_error("one_rank/overlapping_rows", "must tile the catalog",
                     lambda: catalog(item=items[:rows.shape[0]] if last else None, row_offset=0 if last else offset),
                     record, messages)
    def local_bug() -> list[int]:
        if last:
            raise IndexError("a bug in a local check")
        return [1]

    # any exception of a local check reaches every rank (found by review: only TypeError and ValueError did)
    expect_error("one_rank/other_exception", "IndexError: a bug in a local check",
                 lambda: exchange(local_bug, 1, group, torch.device("cpu")), record, messages, kind=RuntimeError)
    good = catalog()
    ids = torch.tensor([[0, 5], [19, 3]])
    expect_error("one_rank/gather_out_of_range", "items must hold ids in [0, 20)",
                 lambda: good.gather(ids + 1 if last else ids), record, messages)
    expect_error("one_rank/exclude_out_of_range", "exclude must hold ids in [-1, 20)",
                 lambda: good.log_power_sums(ids - 6 if last else ids), record, messages)
    if world > 1:
        expect_error("one_rank/gather_widths", "items must have the same number of columns on every rank",
                     lambda: good.gather(ids[:, :1] if last else ids), record, messages)
        expect_error("one_rank/exclude_widths", "exclude must have the same number of columns on every rank",
                     lambda: good.top_items(3, exclude=ids[:, :1] if last else ids), record, messages)
    # still in step: the same values as one process holding everything
    reference = EmbeddingCatalog(users, items, masked_items=masked, chunk_size=3)
    record("one_rank/after_errors/log_normalizer", rel(good.log_normalizer(), reference.log_normalizer()[mine]))
    record("one_rank/after_errors/gather", rel(good.gather(ids), reference.gather(ids.repeat(world, 1))[mine]))
    quiet = catalog(validate_args=False)
    with count_host_syncs() as calls:
        scores = quiet.gather(ids)
        quiet.log_softmax(ids)
        quiet.log_power_sums(ids, 2)
    record("no_host_sync/gather_log_softmax_log_power_sums", float(len(calls)))
    record("no_host_sync/values", rel(scores, reference.gather(ids.repeat(world, 1))[mine]))


def check_self_normalized(record) -> None:
    """SNIPS weights are normalised over the global batch: the mean of the ranks' off-policy losses and their
    gradients equal one process's over the whole batch, with logged propensities that shrink down the batch, so
    that the ranks' own means differ (found by review: each rank normalised over its own rows)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_items, k, length = 40, 4, 2
    g = torch.Generator().manual_seed(5)
    user, item = torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(num_items, 4, generator=g)
    logits = user @ item.T
    cand = sample_candidates(logits, k, generator=g)
    chosen, rewards = cand[:, :length], torch.rand(GLOBAL_BATCH, length, generator=g)
    rarer = 3.0 * torch.arange(GLOBAL_BATCH) / GLOBAL_BATCH
    logged = {"capg": inclusion_log_prob(0.5 * logits, chosen, k) - rarer.unsqueeze(1),
              "vpg": candidate_log_prob(0.5 * logits, cand) - rarer,
              "topk": (0.5 * logits).log_softmax(-1).gather(1, chosen) - rarer.unsqueeze(1)}
    losses = {"capg": OffPolicyCAPGLoss(k, self_normalize=True), "vpg": OffPolicyVPGLoss(k, self_normalize=True),
              "topk": TopKReinforceLoss(k, self_normalize=True)}
    mine, block = h.my_slice(GLOBAL_BATCH, rank, world), -(-num_items // world)
    offset = min(rank * block, num_items)
    for name, loss_fn in losses.items():
        u = user[mine].clone().requires_grad_()
        catalog = ShardedEmbeddingCatalog(u, item[offset: offset + block], num_items=num_items, row_offset=offset,
                                          process_group=dist.group.WORLD)
        loss = loss_fn(catalog, cand[mine], chosen[mine], rewards[mine], logged[name][mine])
        (loss / world).backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ref_user = user.clone().requires_grad_()
        ref = loss_fn(ref_user @ item.T, cand, chosen, rewards, logged[name])
        ref.backward()
        record(f"snips/{name}/loss", rel(mean / world, ref))
        record(f"snips/{name}/user_grad", rel(u.grad, ref_user.grad[mine]))


def check_shared_seed_and_context_baseline(record) -> None:
    """Draws take rank 0's generator's seed whatever the other ranks' generators hold, and a ContextBaseline keeps
    the moving averages of every rank's rows (each found by a mutation round: a rank's own seed, and averages of a
    rank's own rows, passed every other check)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_items, k = 30, 4
    g = torch.Generator().manual_seed(9)
    user, item = torch.randn(GLOBAL_BATCH, 2, 3, generator=g), torch.randn(num_items, 2, 3, generator=g)
    mine, block = h.my_slice(GLOBAL_BATCH, rank, world), -(-num_items // world)
    offset = min(rank * block, num_items)
    catalog = ShardedEmbeddingCatalog(user[mine], item[offset: offset + block], num_items=num_items,
                                      row_offset=offset, process_group=dist.group.WORLD)
    drawn = sample_candidates(catalog, k, generator=torch.Generator().manual_seed(11 + 100 * rank))
    one = sample_candidates(ShardedEmbeddingCatalog(user, item, num_items=num_items), k,
                            generator=torch.Generator().manual_seed(11))
    record("shared_seed/candidates", same(drawn, one[mine]))
    contexts = torch.arange(GLOBAL_BATCH) % 3
    rewards = torch.arange(2.0 * GLOBAL_BATCH).view(GLOBAL_BATCH, 2)
    ranks, single = ContextBaseline(3, decay=0.5, process_group=dist.group.WORLD), ContextBaseline(3, decay=0.5)
    for step in range(2):
        got, want = ranks(contexts[mine], rewards[mine] * (step + 1)), single(contexts, rewards * (step + 1))
        record(f"context_baseline/step{step}", rel(got, want[mine]))
    record("context_baseline/average", rel(ranks.average, single.average))


def check_empty_ranks(name, setup, model, reference, state, users, rank, world, record) -> None:
    """Ranks without users (B_r = 0) next to ranks with some, and an empty global batch: empty
    results there, the right ones elsewhere, no collective left hanging."""
    sizes = EMPTY_SPLITS[world]
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    global_kjt = reference.with_catalog(h.user_batch(users))
    local_kjt = model.module.with_catalog(h.user_batch(users[mine]))
    masked = masks_for(setup, reference, global_kjt)
    check_reductions(f"{name}/empty_ranks", setup, model, reference, state, local_kjt, global_kjt, mine, record,
                     masked)
    cat = model(local_kjt, masked_items=masked[mine])
    ref = reference(global_kjt, masked_items=masked)
    cand = sample_candidates(cat, CANDIDATES, generator=torch.Generator().manual_seed(7))
    ref_cand = sample_candidates(ref, CANDIDATES, generator=torch.Generator().manual_seed(7))
    record(f"{name}/empty_ranks/candidates", same(cand, ref_cand[mine]))
    record(f"{name}/empty_ranks/candidate_log_prob", rel(candidate_log_prob(cat, cand),
                                                          candidate_log_prob(ref, ref_cand)[mine]))
    chosen, rewards = lsr(users, ref_cand, setup.num_items)
    loss = vpg_loss(cat, cand, chosen[mine], rewards[mine], reduction="none", validate_args=False)
    record(f"{name}/empty_ranks/vpg_loss", rel(loss, vpg_loss(ref, ref_cand, chosen, rewards, reduction="none")[mine]))
    loss.sum().backward()
    # an empty global batch: every rank has B_r = 0
    none = h.user_batch(users[:0])
    empty = torch.zeros(0, CANDIDATES, dtype=torch.long)
    record(f"{name}/empty_batch/candidates", same(sample_candidates(model(model.module.with_catalog(none)),
                                                                    CANDIDATES), empty))
    for est, make in ESTIMATORS.items():
        cat, ref = model(model.module.with_catalog(none)), reference(reference.with_catalog(none))
        loss = make()(cat, empty, empty[:, :SHOWN], torch.zeros(0, SHOWN))
        loss.backward()
        record(f"{name}/empty_batch/{est}", rel(loss, make()(ref, empty, empty[:, :SHOWN], torch.zeros(0, SHOWN))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world = h.init()
    results: dict[str, float] = {}

    def record(check: str, err: float) -> None:
        results[check] = err
        if err > TOLERANCE:
            print(f"[rank {rank}] FAIL {check}: {err:.3g}", file=sys.stderr, flush=True)

    messages: dict[str, str] = {}
    mine = h.my_slice(GLOBAL_BATCH, rank, world)
    for name, setup in SETUPS.items():
        state = h.full_state(setup, seed=len(name))
        model, reference = h.shard(setup, lr=LR), h.build(setup)
        h.load(model, state)
        h.load(reference, state)
        users = torch.arange(GLOBAL_BATCH) * 7 % setup.num_users
        global_kjt = reference.with_catalog(h.user_batch(users))
        local_kjt = model.module.with_catalog(h.user_batch(users[mine]))
        masked = masks_for(setup, reference, global_kjt)
        for suffix, mask in (("", None), ("/masked", masked)):
            check_reductions(name + suffix, setup, model, reference, state, local_kjt, global_kjt, mine, record, mask)
            for est in ESTIMATORS:
                print(f"[rank {rank}] {name}{suffix}/{est}", file=sys.stderr, flush=True)
                check_estimator(name + suffix, est, setup, model, reference, state, local_kjt, global_kjt, mine,
                                record, mask)
        if name in EMPTY_RANK_SETUPS:
            check_empty_ranks(name, setup, model, reference, state, users, rank, world, record)
        del model
    check_bad_setups(mine, record, messages)
    check_one_rank_errors(record, messages)
    check_self_normalized(record)
    check_shared_seed_and_context_baseline(record)
    failures = sorted(k for k, v in results.items() if v > TOLERANCE)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"parity_rank{rank}.json").write_text(json.dumps(
        {"world_size": world, "tolerance": TOLERANCE, "failures": failures, "errors": results,
         "messages": messages}, indent=1))
    h.teardown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
