"""``capg-rec train | reproduce | demo`` subcommands (registered by ``capg_rec.cli``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from capg_rec.sim.lsr import LSR_NAMES
from capg_rec.train.config import ESTIMATORS, TrainConfig

if TYPE_CHECKING:
    from capg_rec.train.trainer import Trainer

__all__ = ["register"]

_REPRODUCE_TARGETS = ("table2", "table3", "movielens", "kuairec", "grpo", "variance", "offpolicy")
_ENVS = ("synthetic", "movielens", "kuairec")
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))


def _option(parser: argparse.ArgumentParser, *flags: str, help: str | None = None, **kwargs: Any) -> None:
    """A ``train`` option setting the TrainConfig field of its name. It defaults to ``None`` (not
    given) so that a resume can tell the options a user typed from the saved run's."""
    default = getattr(TrainConfig, flags[-1].lstrip("-").replace("-", "_"))
    parts = [help] if help else []
    if default is not None and kwargs.get("action") is None:
        parts.append(f"default {default}")
    parser.add_argument(*flags, default=None, help="; ".join(parts) + " (with --resume: the saved run's)", **kwargs)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train``, ``reproduce`` and ``demo`` to a ``capg-rec`` argparse parser."""
    p = subparsers.add_parser(
        "train", help="online training of an ESR on a simulated problem",
        description="Train an ESR online on a simulated problem. With --resume the run saved in OUT continues "
                    "unchanged: the run's options default to the saved ones, one that differs from them is an "
                    "error, and only --steps (above the saved step) may change, to extend or shorten the run.")
    p.add_argument("--env", choices=_ENVS, default=None, help="default synthetic (with --resume: the saved run's)")
    p.add_argument("--data", help="KuaiRec small_matrix.csv (for --env kuairec)")
    _option(p, "--estimator", choices=ESTIMATORS)
    _option(p, "--capg-method", help="CA-PG inclusion method (exact, mean_field, plugin); default the library's")
    _option(p, "-K", "--num-candidates", type=int)
    _option(p, "-L", "--num-outputs", type=int)
    _option(p, "-M", "--num-experts", type=int)
    _option(p, "--temperature", type=float)
    _option(p, "--steps", type=int)
    _option(p, "--batch-size", type=int)
    _option(p, "--optimizer", choices=("adagrad", "adam", "sgd"))
    _option(p, "--lr", type=float, help="default the paper's (1e-1 V-PG, 1e-2 CA-PG)")
    _option(p, "--adaptive-lr", action="store_true", help="scale lr by the inverse mean LSR propensity")
    _option(p, "--train-lsr", choices=LSR_NAMES)
    _option(p, "--eval-lsr", choices=LSR_NAMES)
    _option(p, "--eval-every", type=int)
    _option(p, "--position-weights", choices=("mean", "sum", "dcg"))
    _option(p, "--group-size", type=int, help="GRPO group size (1 = off)")
    _option(p, "--group-offset", type=float, help="constant added after group normalisation")
    _option(p, "--baseline", choices=("none", "context"))
    _option(p, "--on-overflow", choices=("stop", "skip"))
    _option(p, "--seed", type=int)
    p.add_argument("--out", default="runs/train")
    p.add_argument("--checkpoint-every", type=int, default=5000)
    p.add_argument("--resume", action="store_true", help="continue the run saved in OUT/checkpoint.pt")
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
    g = p.add_argument_group("offpolicy", "options of the off-policy study (target offpolicy; --ks and --seeds too)")
    g.add_argument("--env", choices=("synthetic", "movielens"), default="synthetic")
    g.add_argument("--sizes", nargs="+", type=int, default=None,
                   help="numbers of logged interactions n (default 10^4 10^5 10^6)")
    g.add_argument("--learners", nargs="+", default=None, help="default all")
    g.add_argument("--logging-steps", type=int, default=None, help="online steps of the logging ESR (default 1000)")
    g.add_argument("--logging-temperature", type=float, default=None, help="τ₀ of the logging ESR (default 2)")
    g.add_argument("--max-weight", type=float, default=None, help="importance-weight cap (default 100)")
    g.add_argument("--first-seed", type=int, default=0, help="seeds FIRST_SEED .. FIRST_SEED + SEEDS - 1")
    g.add_argument("--quick", action="store_true", help="a small setting: K=10, n=10^4, 1 seed, 200 logging steps")
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


def _fail(message: str) -> NoReturn:
    """Report a usage or input error of ``train`` and exit with status 2, as argparse does."""
    print(f"capg-rec train: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _resume(args: argparse.Namespace, given: dict, out: Path) -> Trainer:
    """The trainer of the run saved in ``out``, checked against the options the user typed."""
    from capg_rec.train.checkpoint import read_checkpoint
    from capg_rec.train.trainer import Trainer

    path = out / "checkpoint.pt"
    try:
        state = read_checkpoint(path)
    except FileNotFoundError:
        _fail(f"--resume: no checkpoint {path} to continue (is --out right?)")
    saved = dict(state["config"], env=state["env"].partition("(")[0])
    given = dict(given, env=args.env) if args.env is not None else given
    conflicts = [f"--{name.replace('_', '-')} {value} (saved: {saved[name]!r})"
                 for name, value in given.items() if name != "steps" and value != saved[name]]
    if conflicts:
        _fail(f"--resume continues the run saved in {path} unchanged; these options differ from it: "
              f"{', '.join(conflicts)}. Drop them, or start a new run in another --out.")
    steps = given.get("steps")
    if steps is not None and steps <= state["step"]:
        _fail(f"--resume --steps {steps}: the saved run is at step {state['step']}; give more steps to go on")
    if saved["env"] not in _ENVS:
        _fail(f"--resume: the saved run's env {state['env']!r} is not one this command builds")
    return Trainer.from_state(state, _make_env(saved["env"], args.data), steps=steps)


def _train(args: argparse.Namespace) -> int:
    from capg_rec.train.trainer import Trainer

    given = {name: getattr(args, name) for name in _CONFIG_FIELDS if getattr(args, name, None) is not None}
    out = Path(args.out)
    try:
        if args.resume:
            trainer = _resume(args, given, out)
        else:
            trainer = Trainer(_make_env(args.env or "synthetic", args.data), TrainConfig(**given))
    except ValueError as err:
        _fail(str(err))
    env = trainer.env
    result = trainer.run(out_dir=out, checkpoint_every=args.checkpoint_every)
    print(f"{trainer.config.label} on {env.name}: policy value {result.final_value:.4f} after "
          f"{result.steps_done} steps (best achievable {env.optimal_value(trainer.config.num_outputs):.4f}); "
          f"{result.overflow_count} gradient overflows")
    print(f"metrics: {out / 'metrics.jsonl'}, result: {out / 'result.json'}, checkpoint: {out / 'checkpoint.pt'}")
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    out = Path(args.out or f"runs/{args.target}")
    if args.target == "offpolicy":
        return _offpolicy(args, out)
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


def _offpolicy(args: argparse.Namespace, out: Path) -> int:
    from capg_rec.train.offpolicy import OffPolicyStudy, run_offpolicy_study

    options: dict[str, Any] = {"env": args.env}
    if args.quick:
        options.update(ks=(10,), sizes=(10_000,), seeds=(0,), logging_steps=200, eval_rows=10_000)
    else:
        options["seeds"] = tuple(range(args.first_seed, args.first_seed + args.seeds))
    for name in ("ks", "sizes", "learners"):
        if getattr(args, name) is not None:
            options[name] = tuple(getattr(args, name))
    for name in ("logging_steps", "logging_temperature", "max_weight"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    print(run_offpolicy_study(OffPolicyStudy(**options), out))
    print(f"written: {out / 'results.md'}, {out / 'results.csv'}, {out / 'results.json'}, {out / 'values.png'}, "
          f"{out / 'ope.png'}")
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
