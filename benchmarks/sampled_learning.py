"""Learning with the sampled catalog against the full catalog, on the on-demand synthetic environment.

    OMP_NUM_THREADS=1 python benchmarks/sampled_learning.py [--num-items 100000] [--steps 200] [--seeds 0 1 2]
    OMP_NUM_THREADS=1 python benchmarks/sampled_learning.py --env movielens [--negatives 256] ...

An ESR two-tower (user and item embeddings, D = 10, N(0, 1) init as the paper's model) trained
online: each step B users, K candidates drawn on-policy, the optimal LSR shows the best L of them
(by the environment's ``q_raw``), rewards ``r ~ N(q, σ²)``, batch-mean baseline, SGD. Estimators:

* ``full``: CA-PG-SwR / CA-PG (mean-field) on :class:`~capg_rec.EmbeddingCatalog` (exact draw, exact loss),
* ``sampled``: the same losses on :class:`~capg_rec.SampledCatalog`: S uniform negatives, a head of
  each user's ``--head`` best items (an exact index over the current item table, standing in for a
  perfect-recall ANN) plus the candidates; the candidates are drawn from the sampled catalog.

``--env movielens``: the MovieLens environment of ``capg-rec`` (610 users, 2,269 items; ``--num-items`` and
``--num-users`` do not apply) instead of the on-demand synthetic one.

Policy value: the greedy ESR's top-K for 256 fixed users, the optimal LSR's L picks, mean expected
reward, divided by the best achievable value for those users. Writes JSON, CSV and a PNG to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import time

import torch
from tqdm import tqdm

from capg_rec import CAPGLoss, EmbeddingCatalog, SampledCatalog, UniformSampler, inclusion_methods, sample_candidates
from capg_rec.ann import ExactIndex
from capg_rec.sim.env import MatrixEnv
from capg_rec.sim.ondemand import OnDemandSyntheticEnv

K, SHOWN, DIM, EVAL_USERS = 10, 2, 10, 256


Env = OnDemandSyntheticEnv | MatrixEnv


def _best(env: Env, users: torch.Tensor) -> float:
    """The best achievable value for ``users``: the mean of each one's top-L expected rewards."""
    if isinstance(env, MatrixEnv):
        return float(env.q[users].topk(SHOWN, dim=1).values.mean())
    return float(env.top_items(users, SHOWN)[0].mean())


def _policy_value(env: Env, user_w: torch.Tensor, item_w: torch.Tensor, users: torch.Tensor,
                  best: float) -> float:
    with torch.no_grad():
        candidates = ExactIndex(item_w).search(user_w[users], K)[1]
        picks = env.ranking_scores(users, candidates).topk(SHOWN, dim=1).indices
        return float(env.expected_reward(users, candidates.gather(1, picks)).mean()) / best


def run(env: Env, *, method: str, catalog: str, seed: int, steps: int, batch: int, lr: float,
        negatives: int, head: int, eval_every: int, eval_users: torch.Tensor, best: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    user_w = torch.randn(env.num_users, DIM, generator=g).requires_grad_()
    item_w = torch.randn(env.num_items, DIM, generator=g).requires_grad_()
    opt = torch.optim.SGD([user_w, item_w], lr=lr)
    loss_fn = CAPGLoss(K, method=method, validate_args=False)
    index = ExactIndex(item_w.detach()) if head else None  # holds the live table: always current
    history = [dict(step=0, value=_policy_value(env, user_w.detach(), item_w.detach(), eval_users, best))]
    start = time.process_time()
    for step in range(1, steps + 1):
        users = env.sample_users(batch, g)
        u = user_w[users]
        if catalog == "full":
            with torch.no_grad():
                candidates = sample_candidates(EmbeddingCatalog(u.detach(), item_w.detach(), validate_args=False),
                                               K, generator=g, validate_args=False)
            cat = EmbeddingCatalog(u, item_w, validate_args=False)
        else:
            with torch.no_grad():
                draw = SampledCatalog(u.detach(), item_w.detach(), sampler=UniformSampler(negatives), index=index,
                                      head_size=head, generator=g, validate_args=False)
                candidates = sample_candidates(draw, K, generator=g, validate_args=False)
            cat = SampledCatalog(u, item_w, sampler=UniformSampler(negatives), index=index, head_size=head,
                                 head_items=candidates, generator=g, validate_args=False)
        picks = env.ranking_scores(users, candidates).topk(SHOWN, dim=1).indices
        chosen = candidates.gather(1, picks)
        rewards = env.sample_reward(users, chosen, g)
        loss = loss_fn(cat, candidates, chosen, rewards, baseline=rewards.mean().expand(batch))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % eval_every == 0 or step == steps:
            history.append(dict(step=step, value=_policy_value(env, user_w.detach(), item_w.detach(), eval_users,
                                                               best)))
    return dict(method=method, catalog=catalog, seed=seed, final_value=history[-1]["value"], history=history,
                cpu_s=time.process_time() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-items", type=int, default=100_000)
    p.add_argument("--num-users", type=int, default=1000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--negatives", type=int, default=4096)
    p.add_argument("--head", type=int, default=80,
                   help="items per user from the index (mean-field needs 8n + K - n = 80 at K = 10)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=["with_replacement", "mean_field"],
                   choices=[m for m in inclusion_methods() if m not in ("exact", "enumerate")],  # no sampled catalog
                   help="inclusion methods (exact and enumerate do not run on a sampled catalog)")
    p.add_argument("--env", choices=("synthetic", "movielens"), default="synthetic")
    p.add_argument("--env-seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/sampled_learning"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.env == "movielens":
        from capg_rec.sim.movielens import movielens_env

        env = movielens_env()
    else:
        env = OnDemandSyntheticEnv(args.env_seed, num_users=args.num_users, num_items=args.num_items)
    eval_users = torch.arange(min(EVAL_USERS, env.num_users))
    best = _best(env, eval_users)
    jobs = [(m, c, s) for s in args.seeds for m in args.methods for c in ("full", "sampled")]
    results = []
    for method, catalog, seed in tqdm(jobs, desc="runs"):
        results.append(run(env, method=method, catalog=catalog, seed=seed, steps=args.steps, batch=args.batch,
                           lr=args.lr, negatives=args.negatives, head=args.head, eval_every=args.eval_every,
                           eval_users=eval_users, best=best))
    (args.out / "sampled_learning.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "best_value": best, "runs": results}, indent=1))
    with open(args.out / "sampled_learning.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "catalog", "seed", "step", "value"])
        for r in results:
            for h in r["history"]:
                w.writerow([r["method"], r["catalog"], r["seed"], h["step"], h["value"]])
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, (method, catalog) in enumerate((m, c) for m in args.methods for c in ("full", "sampled")):
        for r in (r for r in results if r["method"] == method and r["catalog"] == catalog):
            ax.plot([h["step"] for h in r["history"]], [h["value"] for h in r["history"]], color=f"C{i}",
                    ls="-" if catalog == "full" else "--", alpha=0.8,
                    label=f"{method}, {catalog}" if r["seed"] == args.seeds[0] else None)
    title = "MovieLens" if args.env == "movielens" else "on-demand synthetic"
    ax.set(xlabel="step", ylabel="policy value / best", title=f"{title}, N={env.num_items}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "sampled_learning.png", dpi=110)
    plt.close(fig)
    print(f"best value {best:.4f}")
    for method in args.methods:
        for catalog in ("full", "sampled"):
            values = [r["final_value"] for r in results if r["method"] == method and r["catalog"] == catalog]
            secs = [r["cpu_s"] for r in results if r["method"] == method and r["catalog"] == catalog]
            mean = sum(values) / len(values)
            print(f"{method:>17} {catalog:>8}: final value/best {mean:.4f} (seeds {[round(v, 4) for v in values]}),"
                  f" {sum(secs) / len(secs):.0f} CPU s per run")


if __name__ == "__main__":
    main()
