"""Train a TorchRec two-tower retriever with in-batch softmax: the model before its conversion to CA-PG.

The model has the shape of TorchRec's ``examples/retrieval`` two-tower: an
``EmbeddingBagCollection`` of user features and one of item features (as TorchRec's
``TwoTowerRetrieval`` holds them), an MLP on the pooled user features (the query tower) and one
on the item embeddings (the candidate tower), tables built on the meta device and sharded by
``DistributedModelParallel``, a fused optimizer applied in backward to the tables, Adam on the
towers, a train task whose forward returns ``(loss, outputs)``, and ``TrainPipelineSparseDist``
driving the steps. Each step every item goes through the candidate tower, and the batch's users
are served K candidates drawn from the softmax over the whole catalog (standing in for the
serving index whose logs such a model trains on); a later-stage ranker (LSR) shows the best L,
and the users' rewards are the feedback (simulated by ``capg_rec.sim``). The users whose reward
is at least the batch's median click: the loss is the in-batch softmax of the clicking users over
their clicked items. ``examples/torchrec_two_tower.py`` is this file converted to CA-PG.

    torchrun --nproc_per_node=2 examples/torchrec_two_tower_inbatch.py --out runs/two_tower_inbatch
    python examples/torchrec_two_tower_inbatch.py                # one process

With ``--out``, rank 0 writes the learning curve (``curve.json``, ``curve.png``).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec import KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.modules.mlp import MLP
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.streamable import Pipelineable
from tqdm import tqdm

from capg_rec.sim import OptimalLSR, synthetic_env

# Tables start in [-1, 1], wider than TorchRec's default ±1/√N: the towers' outputs then start apart
# (from nearly one common vector, the in-batch softmax's gradient nearly vanishes).
INIT = {"weight_init_min": -1.0, "weight_init_max": 1.0}


@dataclass
class UserBatch(Pipelineable):
    """What the data loader gives: user ids, the item features' KJT (every item, one per sample) and the
    user features' KJT. Each sharded module's KJT is an attribute, as the pipeline needs."""
    users: Tensor
    catalog: KeyedJaggedTensor
    user_features: KeyedJaggedTensor

    def to(self, device: torch.device, non_blocking: bool = False) -> UserBatch:
        return UserBatch(*(x.to(device=device, non_blocking=non_blocking) for x in vars(self).values()))

    def record_stream(self, stream: torch.Stream) -> None:
        for x in vars(self).values():
            x.record_stream(stream)

    def pin_memory(self) -> UserBatch:
        return UserBatch(*(x.pin_memory() for x in vars(self).values()))


class Feedback(nn.Module):
    """Serving, the LSR, the rewards and the loss: ``(queries, items, users) -> (loss, mean reward)``. A
    submodule, so that the pipeline's trace of the task stops at it."""

    def __init__(self, env, temperature: float, num_candidates: int, num_shown: int) -> None:
        super().__init__()
        self.env, self.temperature, self.num_candidates, self.num_shown = env, temperature, num_candidates, num_shown
        self.generator = torch.Generator().manual_seed(0)  # the same seed on every rank

    def forward(self, queries: Tensor, items: Tensor, users: Tensor) -> tuple[Tensor, Tensor]:
        gumbel = torch.empty(len(users), len(items)).exponential_(generator=self.generator).log().neg()  # [B, N]
        candidates = (queries.detach() @ items.detach().T / self.temperature + gumbel).topk(self.num_candidates).indices
        picks, _ = OptimalLSR()(self.env.ranking_scores(users, candidates), self.num_shown)
        chosen = candidates.gather(1, picks)  # what the LSR shows
        rewards = self.env.sample_reward(users, chosen, generator=self.generator)
        clicks = rewards[:, 0] >= rewards[:, 0].median()  # the users who clicked what they were shown
        logits = queries[clicks] @ items[chosen[clicks, 0]].T / self.temperature  # in-batch: the clicked items
        loss = nn.functional.cross_entropy(logits, torch.arange(len(logits)))
        return loss, rewards.detach().mean()


class UnitNorm(nn.Module):
    """Each vector scaled to length 1: ``[..., D]`` → ``[..., D]`` (scores become cosines / τ)."""

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.normalize(x, dim=-1)


class TrainTask(nn.Module):
    def __init__(self, items: nn.Module, users: nn.Module, towers: list[nn.Module], feedback: Feedback) -> None:
        super().__init__()
        self.items, self.users, self.query_tower, self.candidate_tower, self.feedback = items, users, *towers, feedback

    def forward(self, batch: UserBatch) -> tuple[Tensor, Tensor]:
        queries = self.query_tower(self.users(batch.user_features)["user_id"])  # [B, D]
        items = self.candidate_tower(self.items(batch.catalog)["item_id"])  # [N, D]: every item
        return self.feedback(queries, items, batch.users)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-items", type=int, default=1000)
    parser.add_argument("--embedding-dim", type=int, default=32, help="D of the tower outputs")
    parser.add_argument("--batch-size", type=int, default=64, help="users per rank and step")
    parser.add_argument("--candidates", type=int, default=10)
    parser.add_argument("--shown", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--table-optimizer", choices=["sgd", "rowwise_adagrad"], default="sgd")
    parser.add_argument("--table-lr", type=float, default=1.0)
    parser.add_argument("--tower-lr", type=float, default=0.003)
    parser.add_argument("--unit-norm", action=argparse.BooleanOptionalAction, default=True,
                        help="unit-length user and item vectors, so scores are bounded by 1/τ")
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if "RANK" not in os.environ:  # plain `python`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="localhost", MASTER_PORT="29511")
    dist.init_process_group("gloo")
    rank, world, device = dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    torch.manual_seed(0)  # the tables' and towers' initial weights: the same in every run

    env = synthetic_env(num_items=args.num_items)
    width, meta = args.embedding_dim, torch.device("meta")
    items = EmbeddingBagCollection(device=meta, tables=[EmbeddingBagConfig(
        name="item_table", embedding_dim=16, num_embeddings=args.num_items, feature_names=["item_id"], **INIT)])
    users = EmbeddingBagCollection(device=meta, tables=[EmbeddingBagConfig(
        name="user_table", embedding_dim=16, num_embeddings=env.num_users, feature_names=["user_id"], **INIT)])
    towers = [nn.Sequential(MLP(16, [64, width], device=meta), *([UnitNorm()] * args.unit_norm))
              for _ in range(2)]  # the query and candidate towers
    task = TrainTask(items, users, towers, Feedback(env, args.temperature, args.candidates, args.shown))
    table_optimizer = torch.optim.SGD if args.table_optimizer == "sgd" else RowWiseAdagrad
    _apply_optimizer_in_backward(table_optimizer, [*items.parameters(), *users.parameters()], {"lr": args.table_lr})
    constraints = {"item_table": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]),
                   "user_table": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])}
    sharders = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device=device.type),
                                       constraints=constraints)
    plan = planner.collective_plan(task, sharders, dist.group.WORLD)
    model = DistributedModelParallel(task, device=device, plan=plan, sharders=sharders)
    optimizer = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda params: torch.optim.Adam(params, lr=args.tower_lr))
    user_generator = torch.Generator().manual_seed(1000 + rank)  # each rank draws its own users

    def batches():
        item_ids = torch.arange(args.num_items)
        for _ in range(args.steps):
            ids = env.sample_users(args.batch_size, generator=user_generator)
            catalog = KeyedJaggedTensor.from_lengths_sync(["item_id"], item_ids, torch.ones_like(item_ids))
            yield UserBatch(ids, catalog, KeyedJaggedTensor.from_lengths_sync(["user_id"], ids, torch.ones_like(ids)))

    pipeline, it, curve = TrainPipelineSparseDist(model, optimizer, device), batches(), []
    for step in tqdm(range(args.steps), disable=rank != 0):
        reward = pipeline.progress(it).clone()
        dist.all_reduce(reward)
        curve.append(float(reward) / world)
        if rank == 0 and (step + 1) % 50 == 0:
            tqdm.write(f"step {step + 1}: mean reward of shown items {sum(curve[-50:]) / 50:.3f} "
                       f"(best possible {env.optimal_value(args.shown):.3f})")
    if rank == 0 and args.out is not None:
        _save(args, "in-batch softmax", curve, env.optimal_value(args.shown), world)
    dist.barrier()
    del model, pipeline
    dist.destroy_process_group()


def _save(args: argparse.Namespace, label: str, curve: list[float], best: float, world: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "curve.json").write_text(json.dumps({"config": config, "world_size": world, "best": best,
                                                     "reward": curve}, indent=1))
    smooth = [sum(curve[max(0, i - 19): i + 1]) / len(curve[max(0, i - 19): i + 1]) for i in range(len(curve))]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(curve, alpha=0.3)
    ax.plot(smooth, label=f"{label}, {world} rank(s)")
    ax.axhline(best, ls=":", c="k", label="best possible")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of shown items")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "curve.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
