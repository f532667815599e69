"""Multi-rank parity: sharded catalog scores vs the same retriever in one process.

Run with ``torchrun --nproc_per_node=W integration/parity.py --out DIR``. Every rank builds the
retriever sharded over the W ranks and, as the reference, unsharded with the whole global batch.
For each set-up (uneven row-wise split, a mixture of experts, table-wise tables) it checks:

* the raw reductions (normalizer, power sums with exclusions, gather, top-k, Gumbel top-k),
  also against :class:`capg_rec.EmbeddingCatalog`;
* for each estimator, the candidates sampled from a seed, the loss (mean over ranks vs the
  global-batch loss), and every embedding row after one fused-SGD step;
* that bad set-ups raise a clear ``ValueError`` on every rank instead of hanging.

Each rank writes ``DIR/parity_rank{r}.json`` (check name → relative error) and exits non-zero if
any check exceeds its tolerance.
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
from capg_rec import CAPGLoss, EmbeddingCatalog, VPGLoss, sample_candidates

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


def check_reductions(name, setup, model, reference, state, local_kjt, global_kjt, mine, record) -> None:
    cat, ref = model(local_kjt), reference(global_kjt)
    # the independent reference: plain EmbeddingCatalog over the full tables
    users = global_kjt[h.USER_ID].values()
    dense = EmbeddingCatalog(state[f"embeddings.embeddings.{h.USER_TABLE}.weight"][users].view(
        -1, setup.num_experts, setup.dim), state[f"embeddings.embeddings.{h.ITEM_TABLE}.weight"].view(
        setup.num_items, setup.num_experts, setup.dim), setup.temperature)
    g = torch.Generator().manual_seed(11)
    exclude = torch.randint(0, setup.num_items, (GLOBAL_BATCH, 5), generator=g)
    exclude[0, 2:] = -1
    items = torch.randint(0, setup.num_items, (GLOBAL_BATCH, 4), generator=g)
    record(f"{name}/ref_vs_dense/log_power_sums", rel(ref.log_power_sums(exclude, 3), dense.log_power_sums(exclude, 3)))
    record(f"{name}/ref_vs_dense/gather", rel(ref.gather(items), dense.gather(items)))
    # scores on the grid tie often, so top-k lists are compared by the scores they pick
    def picked(ids: Tensor, rows: slice = slice(None)) -> Tensor:
        full = torch.zeros(GLOBAL_BATCH, *ids.shape[1:], dtype=torch.long)
        full[rows] = ids
        return dense.gather(full.flatten(1)).view(GLOBAL_BATCH, setup.num_experts, *ids.shape[1:])[rows]

    record(f"{name}/ref_vs_dense/top_items", same(picked(ref.top_items(9, exclude=exclude)),
                                                  picked(dense.top_items(9, exclude=exclude))))
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


def check_estimator(name, est, setup, model, reference, state, local_kjt, global_kjt, mine, record) -> None:
    h.load(model, state)
    h.load(reference, state)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    dense_params = [p for n, p in model.named_parameters() if "embeddings" not in n]
    dense_opt = torch.optim.SGD(dense_params, lr=LR) if dense_params else None
    cat, ref = model(local_kjt), reference(global_kjt)
    cand = sample_candidates(cat, CANDIDATES, generator=torch.Generator().manual_seed(2024))
    ref_cand = sample_candidates(ref, CANDIDATES, generator=torch.Generator().manual_seed(2024))
    record(f"{name}/{est}/candidates", same(cand, ref_cand[mine]))
    users = global_kjt[h.USER_ID].values()
    chosen, rewards = lsr(users, ref_cand, setup.num_items)
    loss = ESTIMATORS[est]()(cat, cand, chosen[mine], rewards[mine])
    ref_loss = ESTIMATORS[est]()(ref, ref_cand, chosen, rewards)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    record(f"{name}/{est}/loss", rel(mean_loss / dist.get_world_size(), ref_loss))
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


def expect_error(check: str, fragment: str, call, record) -> None:
    """``call()`` must raise a ValueError whose message contains ``fragment``."""
    try:
        call()
    except ValueError as err:
        record(check, 0.0 if fragment in str(err) else float("inf"))
        return
    record(check, float("inf"))


def check_bad_setups(mine: slice, record) -> None:
    """Mis-configurations fail on every rank with a clear message (no rank is left waiting)."""
    setup = h.Setup(num_items=1_000, num_experts=2, dim=4)
    users = h.user_batch(torch.arange(GLOBAL_BATCH)[mine])
    model = h.shard(setup, lr=LR)
    expect_error("bad_setup/missing_catalog_feature", "with_catalog", lambda: model(users), record)
    wrong = h.user_batch(torch.arange(GLOBAL_BATCH)[mine])
    wrong = h.KeyedJaggedTensor.concat([wrong, h.KeyedJaggedTensor.from_lengths_sync(
        [h.CATALOG], torch.arange(3), torch.tensor([3] + [0] * (wrong.stride() - 1)))])
    expect_error("bad_setup/wrong_catalog_rows", "must list this rank's item rows", lambda: model(wrong), record)
    del model
    replicated = h.shard(h.Setup(num_items=1_000, num_experts=2, dim=4, sharding="data_parallel"), lr=LR)
    expect_error("bad_setup/data_parallel_item_table", "row_wise or table_wise",
                 lambda: replicated(replicated.module.with_catalog(users)), record)
    del replicated


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

    mine = h.my_slice(GLOBAL_BATCH, rank, world)
    for name, setup in SETUPS.items():
        state = h.full_state(setup, seed=len(name))
        model, reference = h.shard(setup, lr=LR), h.build(setup)
        h.load(model, state)
        h.load(reference, state)
        users = torch.arange(GLOBAL_BATCH) * 7 % setup.num_users
        global_kjt = reference.with_catalog(h.user_batch(users))
        local_kjt = model.module.with_catalog(h.user_batch(users[mine]))
        check_reductions(name, setup, model, reference, state, local_kjt, global_kjt, mine, record)
        for est in ESTIMATORS:
            print(f"[rank {rank}] {name}/{est}", file=sys.stderr, flush=True)
            check_estimator(name, est, setup, model, reference, state, local_kjt, global_kjt, mine, record)
        del model
    check_bad_setups(mine, record)
    failures = sorted(k for k, v in results.items() if v > TOLERANCE)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"parity_rank{rank}.json").write_text(json.dumps(
        {"world_size": world, "tolerance": TOLERANCE, "failures": failures, "errors": results}, indent=1))
    h.teardown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
