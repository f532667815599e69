"""``capg-rec train | reproduce | demo`` subcommands (registered by ``capg_rec.cli``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from capg_rec.sim.lsr import LSR_NAMES
from capg_rec.train.config import ESTIMATORS, TrainConfig

__all__ = ["register"]

_REPRODUCE_TARGETS = ("table2", "table3", "movielens", "kuairec", "grpo", "variance")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train``, ``reproduce`` and ``demo`` to a ``capg-rec`` argparse parser."""
    p = subparsers.add_parser("train", help="online training of an ESR on a simulated problem")
    p.add_argument("--env", choices=("synthetic", "movielens", "kuairec"), default="synthetic")
    p.add_argument("--data", help="KuaiRec small_matrix.csv (for --env kuairec)")
    p.add_argument("--estimator", choices=ESTIMATORS, default="capg_swr")
    p.add_argument("--capg-method", default=None, help="CA-PG inclusion method (exact, mean_field, plugin)")
    p.add_argument("-K", "--num-candidates", type=int, default=10)
    p.add_argument("-L", "--num-outputs", type=int, default=1)
    p.add_argument("-M", "--num-experts", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=50_000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--optimizer", choices=("adagrad", "adam", "sgd"), default="adagrad")
    p.add_argument("--lr", type=float, default=None, help="default: the paper's (1e-1 V-PG, 1e-2 CA-PG)")
    p.add_argument("--adaptive-lr", action="store_true", help="scale lr by the inverse mean LSR propensity")
    p.add_argument("--train-lsr", choices=LSR_NAMES, default="optimal")
    p.add_argument("--eval-lsr", choices=LSR_NAMES, default="optimal")
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--position-weights", choices=("mean", "sum", "dcg"), default="mean")
    p.add_argument("--group-size", type=int, default=1, help="GRPO group size (1 = off)")
    p.add_argument("--group-offset", type=float, default=0.0, help="constant added after group normalisation")
    p.add_argument("--baseline", choices=("none", "context"), default="none")
    p.add_argument("--on-overflow", choices=("stop", "skip"), default="stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/train")
    p.add_argument("--checkpoint-every", type=int, default=5000)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.set_defaults(func=_train)

    p = subparsers.add_parser("reproduce", help="rerun one of the paper's experiments next to its numbers")
    p.add_argument("target", choices=_REPRODUCE_TARGETS)
    p.add_argument("--steps", type=int, default=50_000)
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0..S-1)")
    p.add_argument("--out", default=None, help="default runs/<target>")
    p.add_argument("--data", help="KuaiRec small_matrix.csv (target kuairec)")
    p.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=None)
    p.add_argument("--ks", nargs="+", type=int, default=None, help="candidate-set sizes K")
    p.add_argument("--lsr", nargs="*", choices=LSR_NAMES[1:], default=(),
                   help="table2: also the LSR-alignment columns")
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--capg-method", default=None, help="inclusion method of the CA-PG cells (default: the library's)")
    p.set_defaults(func=_reproduce)

    p = subparsers.add_parser("demo", help="a short V-PG-SwR vs CA-PG-SwR run (a few minutes on a laptop)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("-K", "--num-candidates", type=int, default=20)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--out", default="runs/demo")
    p.set_defaults(func=_demo)


def _make_env(name: str, data: str | None):
    if name == "synthetic":
        from capg_rec.sim.synthetic import synthetic_env

        return synthetic_env()
    if name == "movielens":
        from capg_rec.sim.movielens import movielens_env

        return movielens_env()
    if data is None:
        raise ValueError("--data must give the path of KuaiRec's small_matrix.csv for --env kuairec")
    from capg_rec.sim.kuairec import load_kuairec

    return load_kuairec(data)


def _train(args: argparse.Namespace) -> int:
    from capg_rec.train.trainer import Trainer

    env = _make_env(args.env, args.data)
    out = Path(args.out)
    if args.resume:
        trainer = Trainer.load(out / "checkpoint.pt", env, steps=args.steps)
    else:
        config = TrainConfig(
            estimator=args.estimator, capg_method=args.capg_method, num_candidates=args.num_candidates,
            num_outputs=args.num_outputs, num_experts=args.num_experts, temperature=args.temperature,
            steps=args.steps, batch_size=args.batch_size, optimizer=args.optimizer, lr=args.lr,
            adaptive_lr=args.adaptive_lr, train_lsr=args.train_lsr, eval_lsr=args.eval_lsr,
            eval_every=args.eval_every, position_weights=args.position_weights, group_size=args.group_size,
            group_offset=args.group_offset, baseline=args.baseline, on_overflow=args.on_overflow, seed=args.seed)
        trainer = Trainer(env, config)
    result = trainer.run(out_dir=out, checkpoint_every=args.checkpoint_every)
    print(f"{trainer.config.label} on {env.name}: policy value {result.final_value:.4f} after "
          f"{result.steps_done} steps (best achievable {env.optimal_value(trainer.config.num_outputs):.4f}); "
          f"{result.overflow_count} gradient overflows")
    print(f"metrics: {out / 'metrics.jsonl'}, result: {out / 'result.json'}, checkpoint: {out / 'checkpoint.pt'}")
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    out = Path(args.out or f"runs/{args.target}")
    if args.target == "variance":
        from capg_rec.train.variance import gradient_variance_report

        if args.capg_method is not None:
            raise ValueError("--capg-method is not used by the variance target (its CA-PG is the default method)")

        print(gradient_variance_report(out, ks=args.ks, estimators=args.estimators, seed=0))
        return 0
    from capg_rec.train.reproduce import build_target, run_cells, summarize

    factory, cells = build_target(args.target, steps=args.steps, estimators=args.estimators, data=args.data,
                                  lsr=args.lsr, ks=args.ks, eval_every=args.eval_every,
                                  capg_method=args.capg_method)
    env = factory()
    results = run_cells(env, cells, range(args.seeds), out)
    print(summarize(args.target, env, cells, results, out, steps=args.steps))
    print(f"written: {out / 'results.md'}, {out / 'results.csv'}, {out / 'results.json'}, {out / 'curves.png'}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from capg_rec.sim.synthetic import synthetic_env
    from capg_rec.train.reproduce import Cell, run_cells, summarize

    env = synthetic_env()
    base = TrainConfig(num_candidates=args.num_candidates, steps=args.steps, eval_every=max(1, args.steps // 12))
    cells = [Cell(f"K={args.num_candidates}", base.replace(estimator=e)) for e in ("vpg_swr", "capg_swr")]
    out = Path(args.out)
    print(f"Training the paper's ESR on its synthetic problem ({env.num_users} users x {env.num_items} items), "
          f"K = {args.num_candidates}, optimal LSR, {args.steps} steps, {args.seeds} seed(s) per method ...",
          file=sys.stderr)
    results = run_cells(env, cells, range(args.seeds), out)
    print(summarize("demo", env, cells, results, out, steps=args.steps))
    setting = cells[0].setting
    for vpg, capg in zip(results[("V-PG-SwR", setting)], results[("CA-PG-SwR", setting)]):
        target = vpg.final_value
        reached = next((row["step"] for row in capg.history if row["policy_value"] >= target), None)
        if reached:
            print(f"seed {capg.config['seed']}: CA-PG-SwR reached V-PG-SwR's {vpg.steps_done}-step value "
                  f"({target:.3f}) after {reached} steps ({vpg.steps_done / max(reached, 1):.1f}x fewer).")
    print(f"table: {out / 'results.md'} (also {out / 'results.csv'}, {out / 'results.json'}); "
          f"plot: {out / 'curves.png'}")
    return 0
