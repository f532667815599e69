"""Benchmark: a whole online training step against the core loss step alone.

``python -m capg_rec.train.bench`` prints, per estimator, the median CPU time of one trainer
step on the paper's synthetic environment (sampling, LSR, rewards, loss, backward, optimizer;
K = 10, B = 128 by default), of the loss forward + backward alone on a ``[B, N]`` logits leaf
(as the step runs it, without input checks; and with them, as a user's loop calls it), their
ratio, and the step's breakdown. CPU time (one thread) rather than wall time, so that
the figures hold on a shared machine.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from capg_rec._checks import check_positive, flagged, positive_float, positive_int
from capg_rec.catalog import DenseCatalog
from capg_rec.marginals import DEFAULT_METHOD
from capg_rec.plackett_luce import sample_candidates
from capg_rec.train.config import ESTIMATOR_LABELS, TrainConfig
from capg_rec.train.report import markdown_table
from capg_rec.train.trainer import Trainer, make_loss

__all__ = ["bench_train_step", "main"]


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e3 * statistics.median(times)


_WARMUP = 50
"""Calls before the timed ones."""


def _trainer(estimator: str, num_candidates: int, batch_size: int, capg_method: str | None,
             logit_scale: float) -> tuple:
    """The arguments checked (a ``ValueError`` or ``TypeError`` naming a bad one) → the synthetic problem, the
    config and a trainer of it."""
    from capg_rec.sim.synthetic import synthetic_env

    check_positive("logit_scale", logit_scale)
    env = synthetic_env()
    config = TrainConfig(estimator=estimator, num_candidates=num_candidates, batch_size=batch_size,
                         capg_method=capg_method, steps=10**9)
    return env, config, Trainer(env, config)


def bench_train_step(estimator: str = "capg_swr", *, num_candidates: int = 10, batch_size: int = 128,
                     repeats: int = 100, warmup: int = _WARMUP, capg_method: str | None = None,
                     logit_scale: float = 1.0) -> dict:
    """Median milliseconds of a trainer step, of its parts and of the core loss step alone.

    ``logit_scale`` multiplies the initial logits (both towers by its square root): a confident
    policy, as after training, whose tiny probabilities exercise the underflow paths."""
    return _bench(*_trainer(estimator, num_candidates, batch_size, capg_method, logit_scale), repeats=repeats,
                  warmup=warmup, logit_scale=logit_scale)


def _bench(env, config: TrainConfig, trainer: Trainer, *, repeats: int, warmup: int, logit_scale: float) -> dict:
    """:func:`bench_train_step` of a trainer made by :func:`_trainer`."""
    batch_size, num_candidates = config.batch_size, config.num_candidates
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(math.sqrt(logit_scale))
    g = trainer.generator
    users = env.sample_users(batch_size, g)
    logits = trainer.model(users).detach()
    candidates = sample_candidates(logits, num_candidates, generator=g)
    picks, _ = trainer.train_lsr(env.ranking_scores(users, candidates), 1, g)
    chosen = candidates.gather(1, picks)
    rewards = env.sample_reward(users, chosen, g)
    leaf = logits[:, 0].clone().requires_grad_(True)  # [B, N]
    weights = trainer.position_weights
    validated = make_loss(config)

    def loss_step(loss_fn: torch.nn.Module) -> None:
        leaf.grad = None
        loss_fn(leaf, candidates, chosen, rewards, position_weights=weights).backward()

    def lsr_and_reward() -> None:
        p, _ = trainer.train_lsr(env.ranking_scores(users, candidates), 1, g)
        env.sample_reward(users, candidates.gather(1, p), g)

    parts = {
        "step": trainer.step,
        "core loss (fwd+bwd)": lambda: loss_step(trainer.loss_fn),
        "validated loss (fwd+bwd)": lambda: loss_step(validated),
        "ESR forward": lambda: trainer.model(users),
        "sampling": lambda: sample_candidates(DenseCatalog(logits, validate_args=False), num_candidates, generator=g),
        "LSR + rewards": lsr_and_reward,
        "optimizer": trainer.optimizer.step,
    }
    out = {name: _median_ms(fn, repeats, warmup) for name, fn in parts.items()}
    out["ratio"] = out["step"] / out["core loss (fwd+bwd)"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--estimators", nargs="+", default=["vpg_swr", "capg_swr", "vpg", "capg"],
                        choices=tuple(ESTIMATOR_LABELS))
    parser.add_argument("-K", "--num-candidates", type=positive_int, default=10)
    parser.add_argument("--batch-size", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=100)
    parser.add_argument("--logit-scale", type=positive_float, default=1.0,
                        help="multiply the initial logits (a confident policy, as after training)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    made = {}
    for est in args.estimators:  # the options checked first: exit 2, as for an option's type
        try:
            made[est] = _trainer(est, args.num_candidates, args.batch_size, None, args.logit_scale)
        except ValueError as err:  # e.g. more candidates than the problem's items
            parser.error(flagged(str(err), args))
    for est in args.estimators:
        r = _bench(*made[est], repeats=args.repeats, warmup=_WARMUP, logit_scale=args.logit_scale)
        label = ESTIMATOR_LABELS[est] + (f" ({DEFAULT_METHOD})" if est == "capg" else "")
        rows.append([label, f"{r['step']:.2f}", f"{r['core loss (fwd+bwd)']:.2f}",
                     f"{r['ratio']:.2f}", f"{r['validated loss (fwd+bwd)']:.2f}", f"{r['ESR forward']:.2f}",
                     f"{r['sampling']:.2f}", f"{r['LSR + rewards']:.2f}", f"{r['optimizer']:.2f}"])
    print(f"Training step vs core loss step (CPU ms, median of {args.repeats}; K = {args.num_candidates}, "
          f"B = {args.batch_size}, N = 1000, logits x{args.logit_scale:g}, 1 thread)\n")
    print(markdown_table(["estimator", "whole step", "core loss step", "ratio", "loss with input checks",
                          "ESR forward", "sampling", "LSR + rewards", "optimizer"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
