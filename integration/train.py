"""Multi-rank CA-PG training of the two-tower retriever, next to the single-process run.

Run with ``torchrun --nproc_per_node=W integration/train.py --out DIR``. Each rank trains the
sharded retriever (row-wise item table, fused SGD in backward, user tower under DDP) on its
slice of every global batch of the paper's synthetic environment (``capg_rec.sim``); alongside,
it trains the unsharded retriever on the whole global batch from the same initial weights and
seeds: the single-process run. The oracle LSR shows the ``SHOWN`` best of the K candidates and
the reward is the environment's expected reward of what it shows; the baseline is a per-user
moving average (:class:`capg_rec.torchrec.ContextBaseline`, kept over the global batch).

Rank 0 writes ``DIR/train.json`` (both learning curves, whether the reward rose) and
``DIR/train.png``; the run exits non-zero if the curves differ by more than ``--tolerance``
(relative) at any step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import _harness as h
from capg_rec import CAPGLoss, sample_candidates
from capg_rec.sim import OptimalLSR, synthetic_env
from capg_rec.torchrec import ContextBaseline

CANDIDATES, SHOWN = 10, 2


def step(net, optimizer, env, users, seed: int,
         baseline: ContextBaseline) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One training step on ``users``; (loss, mean reward, candidates)."""
    catalog = net(net_module(net).with_catalog(h.user_batch(users)))
    candidates = sample_candidates(catalog, CANDIDATES, generator=torch.Generator().manual_seed(seed))
    picks, _ = OptimalLSR()(env.ranking_scores(users, candidates), SHOWN)
    chosen = candidates.gather(1, picks)
    rewards = env.expected_reward(users, chosen)
    loss = CAPGLoss(CANDIDATES)(catalog, candidates, chosen, rewards,
                                baseline=baseline(users, rewards))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach(), rewards.mean(), candidates


def net_module(net):
    return net.module if hasattr(net, "module") else net


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--num-items", type=int, default=3_001)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    rank, world = h.init()
    env = synthetic_env(num_users=500, num_items=args.num_items)
    setup = h.Setup(num_items=args.num_items, num_experts=2, dim=8, num_users=env.num_users, tower=True)
    state = h.full_state(setup, seed=3, grid=False)
    model, reference = h.shard(setup, lr=args.lr), h.build(setup)
    h.load(model, state)
    h.load(reference, state)
    tower = [p for n, p in model.named_parameters() if "embeddings" not in n]
    runs = {"sharded": (model, torch.optim.SGD(tower, lr=args.lr)),
            "single_process": (reference, torch.optim.SGD(reference.parameters(), lr=args.lr))}
    mine = h.my_slice(args.global_batch, rank, world)
    # per-user moving averages of the reward: kept over the global batch on every rank
    baselines = {"sharded": ContextBaseline(env.num_users, process_group=dist.group.WORLD),
                 "single_process": ContextBaseline(env.num_users)}
    curves = {name: {"loss": [], "reward": []} for name in runs}
    same_candidates = []
    for t in range(args.steps):
        users = env.sample_users(args.global_batch, generator=torch.Generator().manual_seed(10_000 + t))
        loss, reward, cand = step(model, runs["sharded"][1], env, users[mine], t, baselines["sharded"])
        stats = torch.stack([loss, reward])
        dist.all_reduce(stats)
        curves["sharded"]["loss"].append(float(stats[0]) / world)
        curves["sharded"]["reward"].append(float(stats[1]) / world)
        ref_loss, ref_reward, ref_cand = step(reference, runs["single_process"][1], env, users, t,
                                              baselines["single_process"])
        curves["single_process"]["loss"].append(float(ref_loss))
        curves["single_process"]["reward"].append(float(ref_reward))
        agree = torch.tensor([float(torch.equal(cand, ref_cand[mine]))])
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)
        same_candidates.append(bool(agree))
    deviation = {key: max(abs(a - b) for a, b in zip(curves["sharded"][key], curves["single_process"][key]))
                 / max(abs(b) for b in curves["single_process"][key]) for key in ("loss", "reward")}
    rewards = curves["sharded"]["reward"]
    learned = sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5
    ok = all(d <= args.tolerance for d in deviation.values())
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {"world_size": world, "steps": args.steps, "global_batch": args.global_batch,
                   "num_items": args.num_items, "relative_deviation": deviation, "learned": learned,
                   "steps_with_identical_candidates": sum(same_candidates), "curves": curves}
        (args.out / "train.json").write_text(json.dumps(summary, indent=1))
        _plot(curves, world, args.out / "train.png")
        print(json.dumps({k: v for k, v in summary.items() if k != "curves"}), flush=True)
    h.teardown(model)
    return 0 if ok else 1


def _plot(curves: dict, world: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for key, ax in zip(("reward", "loss"), axes):
        ax.plot(curves["single_process"][key], label="1 process", lw=3, alpha=0.5)
        ax.plot(curves["sharded"][key], "--", label=f"{world} ranks (sharded)")
        ax.set_xlabel("step")
        ax.set_ylabel(f"mean {key}")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
