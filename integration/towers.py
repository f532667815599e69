"""Item tower and bag-collection user side, sharded: one step equals one process's step.

Run with ``torchrun --nproc_per_node=W integration/towers.py --out DIR``. The retriever has a
TorchRec two-tower's shape: user features pooled by an ``EmbeddingBagCollection`` (a user id and a
multi-id history) through a user MLP, and the item table's rows through an item MLP (applied in
chunks, recomputed in backward). The item table is sharded row-wise or table-wise, the bag tables
table-wise (fused SGD in backward),
the towers replicated (DDP, SGD). Every rank also builds the same retriever unsharded and feeds it
the global batch. After one CA-PG step, every parameter of the sharded model (its shards) must
equal the single-process one to 1e-5 relative, and so must the update itself to 1e-3 (float32
differences of O(1) rows; for updates above 1e-2 of the parameter). The serving export of the
model (item vectors gathered from the shards, user vectors, greedy top-K) must equal the single-process
one. Each rank writes ``DIR/towers_rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig,
                      KeyedJaggedTensor)
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

import _harness as h
from capg_rec import CAPGLoss, VPGLoss, sample_candidates
from capg_rec.torchrec import TwoTowerRetriever

NUM_ITEMS, NUM_USERS, ROW_DIM, EXPERTS, DIM = 1_001, 32, 12, 2, 4
CANDIDATES, SHOWN, GLOBAL_BATCH, LR, CHUNK = 5, 2, 6, 0.1, 97
ESTIMATORS = {"capg": lambda: CAPGLoss(CANDIDATES), "vpg_swr": lambda: VPGLoss(CANDIDATES, with_replacement=True)}


def build(device: str) -> TwoTowerRetriever:
    ec = EmbeddingCollection(device=torch.device(device), tables=[EmbeddingConfig(
        name=h.ITEM_TABLE, embedding_dim=ROW_DIM, num_embeddings=NUM_ITEMS, feature_names=[h.CATALOG])])
    ebc = EmbeddingBagCollection(device=torch.device(device), tables=[
        EmbeddingBagConfig(name=h.USER_TABLE, embedding_dim=8, num_embeddings=NUM_USERS, feature_names=[h.USER_ID]),
        EmbeddingBagConfig(name="history_table", embedding_dim=4, num_embeddings=NUM_ITEMS,
                           feature_names=["history"])])
    user_tower = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, EXPERTS * DIM)).to(device)
    item_tower = nn.Sequential(nn.Linear(ROW_DIM, 16), nn.Tanh(), nn.Linear(16, EXPERTS * DIM)).to(device)
    return TwoTowerRetriever(ec, item_table=h.ITEM_TABLE, num_experts=EXPERTS, user_features=[h.USER_ID, "history"],
                             user_embeddings=ebc, user_tower=user_tower, item_tower=item_tower,
                             catalog_feature=h.CATALOG, chunk_size=CHUNK, temperature=0.5)


def shard(sharding: str) -> DistributedModelParallel:
    model = build("meta")
    _apply_optimizer_in_backward(torch.optim.SGD, [*model.embeddings.parameters(),
                                                   *model.user_embeddings.parameters()], {"lr": LR})
    # TorchRec on CPU shards bag collections table-wise only
    constraints = {t: ParameterConstraints(sharding_types=[sharding if t == h.ITEM_TABLE else "table_wise"],
                                           compute_kernels=["fused"])
                   for t in (h.ITEM_TABLE, h.USER_TABLE, "history_table")}
    sharders = [EmbeddingCollectionSharder(), EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=dist.get_world_size(),
                                                         compute_device=h.device().type), constraints=constraints)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=h.device(), plan=plan, sharders=sharders,
                                    data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=False))


def batch(users: Tensor, histories: list[list[int]]) -> KeyedJaggedTensor:
    ids = torch.tensor([i for hist in histories for i in hist], dtype=torch.long)
    lengths = torch.cat([torch.ones_like(users), torch.tensor([len(hist) for hist in histories])])
    return KeyedJaggedTensor.from_lengths_sync([h.USER_ID, "history"], torch.cat([users, ids]),
                                               lengths).to(h.device())


def empty(batch_size: int, lengths: torch.dtype = torch.long) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync([], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=lengths),
                                               stride=batch_size).to(h.device())


def _rel(got: Tensor, want: Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world = h.init()
    g = torch.Generator().manual_seed(8)
    state = {k: torch.randn(v.shape, generator=g) * 0.4 for k, v in build("cpu").state_dict().items()}
    users = torch.arange(GLOBAL_BATCH) * 5 % NUM_USERS
    histories = [[(7 * b + j * 131) % NUM_ITEMS for j in range(b % 4)] for b in range(GLOBAL_BATCH)]
    mine = h.my_slice(GLOBAL_BATCH, rank, world)
    errors: dict[str, float] = {}
    for sharding in ("row_wise", "table_wise"):
        model = shard(sharding)
        for est, make in ESTIMATORS.items():
            reference = build(str(h.device()))
            h.load(model, state)
            h.load(reference, state)
            dense = [p for n, p in model.named_parameters() if "tower" in n]
            ref_opt, opt = torch.optim.SGD(reference.parameters(), lr=LR), torch.optim.SGD(dense, lr=LR)
            # the last rank's features have int32 lengths, the others' int64: with_catalog makes them agree (the
            # job aborted inside gloo)
            last = torch.int32 if rank == world - 1 else torch.long
            cat = model(model.module.with_catalog(empty(GLOBAL_BATCH // world, last)),
                        bag_features=batch(users[mine], histories[mine]))
            ref = reference(reference.with_catalog(empty(GLOBAL_BATCH)), bag_features=batch(users, histories))
            cand = sample_candidates(cat, CANDIDATES, generator=torch.Generator().manual_seed(3))
            ref_cand = sample_candidates(ref, CANDIDATES, generator=torch.Generator().manual_seed(3))
            errors[f"{sharding}/{est}/candidates"] = 0.0 if torch.equal(cand, ref_cand[mine]) else float("inf")
            rewards = torch.sin(users.to(ref_cand.device).unsqueeze(1) * 3.1 + ref_cand[:, :SHOWN] * 0.7) + 1.0
            make()(cat, cand, cand[:, :SHOWN], rewards[mine]).backward()
            make()(ref, ref_cand, ref_cand[:, :SHOWN], rewards).backward()
            opt.step()
            ref_opt.step()
            for key, err in h.max_shard_error(model, reference).items():
                errors[f"{sharding}/{est}/after_step/{key}"] = err
            # the update itself, to 1e-3 of its size, where there is one: the item tower's last bias gets
            # no gradient but rounding (a shift of every item vector leaves each softmax unchanged)
            params = reference.state_dict()
            for key, err in h.max_shard_error(model, reference, base=state).items():
                if float((params[key] - state[key]).abs().max()) > 1e-2 * float(params[key].abs().max()):
                    errors[f"{sharding}/{est}/update/{key}"] = err * 1e-2
            model.zero_grad(set_to_none=True)
        # the serving export: item vectors gathered from the shards in id order, user vectors through the
        # sharded bags, and the greedy top-K through the exported index
        h.load(model, state)
        h.load(reference, state)
        errors[f"{sharding}/export/item_vectors"] = _rel(model.module.item_vectors(h.device()),
                                                         reference.item_vectors(h.device()))
        mine_bags, all_bags = batch(users[mine], histories[mine]), batch(users, histories)
        errors[f"{sharding}/export/user_vectors"] = _rel(
            model.module.user_vectors(empty(GLOBAL_BATCH // world), bag_features=mine_bags),
            reference.user_vectors(empty(GLOBAL_BATCH), bag_features=all_bags)[mine])
        got = model.module.serving_export().retrieve(empty(GLOBAL_BATCH // world), num_candidates=CANDIDATES,
                                                     bag_features=mine_bags).candidates
        want = reference.serving_export().retrieve(empty(GLOBAL_BATCH), num_candidates=CANDIDATES,
                                                   bag_features=all_bags).candidates[mine]
        errors[f"{sharding}/export/greedy_top_k"] = 0.0 if torch.equal(got, want) else float("inf")
        if world > 1:  # KJTs of two layouts across ranks: a ValueError on every rank (the job aborted in gloo)
            for fault in ("bag_lengths_dtype", "bag_values_dtype", "features_weights"):
                bags, features = mine_bags, empty(GLOBAL_BATCH // world)
                if rank == world - 1:
                    bags = KeyedJaggedTensor(keys=bags.keys(), values=bags.values().int() if fault == "bag_values_dtype"
                                             else bags.values(), stride=bags.stride(),
                                             lengths=bags.lengths().int() if fault == "bag_lengths_dtype"
                                             else bags.lengths())
                    if fault == "features_weights":
                        features = KeyedJaggedTensor(keys=[], values=features.values(), lengths=features.lengths(),
                                                     weights=torch.zeros(0), stride=features.stride())
                try:
                    model(model.module.with_catalog(features), bag_features=bags)
                    errors[f"{sharding}/faults/{fault}"] = float("inf")
                except ValueError as err:
                    errors[f"{sharding}/faults/{fault}"] = \
                        0.0 if "must each have one layout on every rank" in str(err) else float("inf")
        del model
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"towers_rank{rank}.json").write_text(json.dumps({"world_size": world, "errors": errors}, indent=1))
    h.teardown()
    return 0 if max(errors.values()) <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
