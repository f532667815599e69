"""Train a TorchRec two-tower retriever as the early stage of a two-stage recommender.

In the style of TorchRec's ``examples/retrieval/two_tower_train.py``: embedding tables built on
the meta device, sharded by ``DistributedModelParallel``, a fused row-wise Adagrad applied in
backward to the tables, Adam on the dense tower, and a train task whose forward returns
``(loss, outputs)``. Each step the retriever proposes K candidates per user from the whole
catalog, a later-stage ranker (LSR) shows the best L of them, and the user's rewards for what
was shown are the feedback (simulated here by ``capg_rec.sim``'s synthetic environment).

``--loss bce`` is the usual pointwise objective (binary cross-entropy of the shown items'
scores against "reward above median"); ``--loss capg`` is CA-PG. The two differ by a few lines
in ``TrainTask`` (see the README section "Add CA-PG to your TorchRec retrieval training").

    torchrun --nproc_per_node=2 examples/torchrec_two_tower.py --loss capg
    python examples/torchrec_two_tower.py --loss bce          # one process
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from tqdm import tqdm

import capg_rec
from capg_rec.sim import OptimalLSR, synthetic_env
from capg_rec.torchrec import TwoTowerRetriever, global_mean_baseline


class TrainTask(nn.Module):
    """Retriever + LSR feedback + loss; ``forward(features, users) -> (loss, (rewards, candidates))``."""

    def __init__(self, retriever: TwoTowerRetriever, env, num_candidates: int, num_shown: int,
                 loss: str) -> None:
        super().__init__()
        self.retriever, self.env = retriever, env
        self.num_candidates, self.num_shown = num_candidates, num_shown
        self.generator = torch.Generator().manual_seed(0)  # same seed on every rank
        self.use_capg = loss == "capg"
        self.loss_fn = capg_rec.CAPGLoss(num_candidates) if self.use_capg else nn.BCEWithLogitsLoss()

    def forward(self, features: KeyedJaggedTensor, users: torch.Tensor):
        catalog = self.retriever(features)  # scores of every item of the (sharded) catalog
        candidates = capg_rec.sample_candidates(catalog, self.num_candidates, generator=self.generator)
        picks, _ = OptimalLSR()(self.env.ranking_scores(users, candidates), self.num_shown)
        chosen = candidates.gather(1, picks)  # what the LSR shows
        rewards = self.env.sample_reward(users, chosen, generator=self.generator)
        if self.use_capg:
            baseline = global_mean_baseline(rewards, dist.group.WORLD)  # the same at any world size
            loss = self.loss_fn(catalog, candidates, chosen, rewards, baseline=baseline)
        else:
            logits = catalog.gather(chosen)[:, 0]  # [B, L] scores of the shown items
            loss = self.loss_fn(logits, (rewards > rewards.median()).float())
        return loss, (rewards.detach(), candidates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=["bce", "capg"], default="capg")
    parser.add_argument("--num-items", type=int, default=1000)
    parser.add_argument("--num-experts", type=int, default=2)
    parser.add_argument("--embedding-dim", type=int, default=16, help="D per expert")
    parser.add_argument("--batch-size", type=int, default=64, help="users per rank and step")
    parser.add_argument("--candidates", type=int, default=10)
    parser.add_argument("--shown", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    if "RANK" not in os.environ:  # plain `python`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="29511")
    dist.init_process_group("gloo")
    rank, device = dist.get_rank(), torch.device("cpu")

    env = synthetic_env(num_items=args.num_items)
    width = args.num_experts * args.embedding_dim  # one item row holds every expert's vector
    tables = [EmbeddingConfig(name="item_table", embedding_dim=width, num_embeddings=args.num_items,
                              feature_names=["catalog"]),
              EmbeddingConfig(name="user_table", embedding_dim=width, num_embeddings=env.num_users,
                              feature_names=["user_id"])]
    embeddings = EmbeddingCollection(tables=tables, device=torch.device("meta"))
    tower = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, width))
    retriever = TwoTowerRetriever(embeddings, item_table="item_table", num_experts=args.num_experts,
                                  user_features=["user_id"], user_tower=tower)
    task = TrainTask(retriever, env, args.candidates, args.shown, args.loss)
    _apply_optimizer_in_backward(RowWiseAdagrad, task.retriever.embeddings.parameters(), {"lr": args.lr})
    # static_graph=False: the catalog's own collectives run inside the loss's backward.
    model = DistributedModelParallel(module=task, device=device,
                                     data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=False))
    optimizer = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda params: torch.optim.Adam(params, lr=args.lr))
    user_generator = torch.Generator().manual_seed(1000 + rank)  # each rank draws its own users
    rewards = []
    for step in tqdm(range(args.steps), disable=rank != 0):
        users = env.sample_users(args.batch_size, generator=user_generator)
        features = KeyedJaggedTensor.from_lengths_sync(["user_id"], users, torch.ones_like(users))
        features = model.module.retriever.with_catalog(features)  # this rank's item rows
        loss, (reward, _) = model(features, users)
        optimizer.zero_grad()
        loss.backward()  # also steps the fused table optimizer
        optimizer.step()
        rewards.append(float(reward.mean()))
        if rank == 0 and (step + 1) % 50 == 0:
            tqdm.write(f"step {step + 1}: mean reward of shown items {sum(rewards[-50:]) / 50:.3f} "
                       f"(best possible {env.optimal_value(args.shown):.3f})")
    dist.barrier()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
