"""Gradient variance of each estimator at a fixed policy as K grows (the paper's Theorem 1).

For a fixed ESR (the initial two-tower model on the synthetic environment) and a few fixed
users, draw R independent (candidates, LSR pick, reward) samples per user and take each
sample's gradient of the loss with respect to the user's logits ``[N]``. Reported per K and
estimator: the per-coordinate variance of that gradient, averaged over the N coordinates and
the users, and the squared norm of its mean (the signal: ``‖ḡ‖² - tr(S)/R``, an unbiased estimate of
``‖E g‖²``, which ``‖ḡ‖²`` alone overstates by ``tr(Cov)/R``; it may come out slightly negative where
the noise dominates). All samples of one user run as one
batch of R rows with ``reduction="none"``, so the R gradients come from a single backward.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from capg_rec._checks import check_count, check_distinct
from capg_rec.plackett_luce import sample_candidates
from capg_rec.sim.env import MatrixEnv
from capg_rec.sim.lsr import OptimalLSR
from capg_rec.train.config import ESTIMATOR_LABELS, TrainConfig
from capg_rec.train.model import TwoTowerMoE
from capg_rec.train.report import markdown_table, method_colors, write_csv, write_json
from capg_rec.train.trainer import make_loss

__all__ = ["gradient_variance", "gradient_variance_report"]


def gradient_variance(env: MatrixEnv, ks: Sequence[int], estimators: Sequence[str], *, num_users: int = 8,
                      samples: int = 1000, seed: int = 0) -> list[dict]:
    """Rows ``{estimator, K, variance, signal}`` (see the module docstring)."""
    check_count("num_users", num_users, high=env.num_users)
    check_count("samples", samples, low=2)
    g = torch.Generator().manual_seed(seed)
    root = g.initial_seed()  # seed as torch reads it (-1 too)
    model = TwoTowerMoE(env.num_users, env.num_items, generator=g)
    users = torch.randperm(env.num_users, generator=g)[:num_users]
    lsr = OptimalLSR()
    rows = []
    for k in ks:  # all checked before any is computed
        check_count("K", k, high=env.num_items)
    for k in ks:
        # each K its own draws, the same for every estimator (a K's row does not depend on the other Ks asked)
        seed_k = int(np.random.SeedSequence([root, k]).generate_state(1)[0])
        for estimator in estimators:
            g = torch.Generator().manual_seed(seed_k)
            loss_fn = make_loss(TrainConfig(estimator=estimator, num_candidates=k))
            loss_fn.reduction = "none"
            variance = signal = 0.0
            for user in users.tolist():
                with torch.no_grad():
                    base = model(torch.tensor([user]))[:, 0]  # [1, N]
                logits = base.expand(samples, -1).clone().requires_grad_(True)  # [R, N]
                who = torch.full((samples,), user)
                candidates = sample_candidates(logits.detach(), k, generator=g)
                picks, _ = lsr(env.ranking_scores(who, candidates), 1, g)
                chosen = candidates.gather(1, picks)
                rewards = env.sample_reward(who, chosen, g)
                loss_fn(logits, candidates, chosen, rewards).sum().backward()
                grads = logits.grad.double()  # row r = sample r's gradient
                spread = grads.var(dim=0)  # unbiased, per coordinate
                variance += float(spread.mean()) / num_users
                # ‖mean‖² overshoots ‖E g‖² by tr(Cov)/R on average: taken off, so the signal is unbiased
                signal += float(grads.mean(dim=0).pow(2).sum() - spread.sum() / samples) / num_users
            rows.append({"estimator": ESTIMATOR_LABELS[estimator], "K": k, "variance": variance, "signal": signal})
    return rows


def gradient_variance_report(out: str | os.PathLike, *, ks: Sequence[int] | None = None,
                             estimators: Sequence[str] | None = None, seed: int = 0,
                             samples: int = 1000, num_users: int = 8) -> str:
    """Run :func:`gradient_variance` on the paper's synthetic environment and write
    ``variance.{md,csv,json,png}`` into ``out``; returns the Markdown table."""
    from capg_rec.sim.synthetic import synthetic_env

    ks = list(ks or (2, 5, 10, 20, 50, 100))
    check_distinct("ks", ks)
    estimators = list(estimators or ("vpg", "vpg_swr", "capg", "capg_swr"))
    check_distinct("estimators", estimators)  # a repeat wrote more cells than headers
    rows = gradient_variance(synthetic_env(), ks, estimators, num_users=num_users, samples=samples, seed=seed)
    out = Path(out)  # made once there is something to write into it
    out.mkdir(parents=True, exist_ok=True)
    header = ["K"] + [ESTIMATOR_LABELS[e] for e in estimators]
    table = [[k] + [f"{r['variance']:.3g}" for e in estimators for r in rows
                    if r["K"] == k and r["estimator"] == ESTIMATOR_LABELS[e]] for k in ks]
    text = ("# Gradient variance at a fixed policy\n\nMean per-coordinate variance of one sample's gradient "
            f"w.r.t. the user's logits (synthetic env, initial ESR, {num_users} users x {samples} samples, "
            "optimal LSR, L = 1).\n\n" + markdown_table(header, table))
    (out / "variance.md").write_text(text, encoding="utf-8")
    write_csv(out / "variance.csv", rows)
    write_json(out / "variance.json", rows)
    _plot(rows, out / "variance.png")
    return text


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 3.4))
    colors = method_colors([r["estimator"] for r in rows])
    for name in colors:
        mine = [r for r in rows if r["estimator"] == name]
        ax.plot([r["K"] for r in mine], [r["variance"] for r in mine], "o-", label=name,
                color=colors[name])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("number of candidates K")
    ax.set_ylabel("per-coordinate gradient variance")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
