"""``capg-rec train | reproduce | demo`` subcommands (registered by ``capg_rec.cli``)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from capg_rec._checks import flagged, positive_float, positive_int
from capg_rec.marginals import DEFAULT_METHOD, inclusion_methods
from capg_rec.sim.lsr import LSR_NAMES
from capg_rec.train.config import ESTIMATORS, TrainConfig
from capg_rec.train.logged import LOG_ESTIMATORS, LogTrainConfig, eval_lsr_name
from capg_rec.train.offpolicy import LEARNERS

if TYPE_CHECKING:
    from capg_rec.train.trainer import Trainer, TrainResult

__all__ = ["register"]

_REPRODUCE_TARGETS = ("table2", "table3", "movielens", "kuairec", "grpo", "variance", "offpolicy")
_ENVS = ("synthetic", "movielens", "kuairec")
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))
_LOG_FIELDS = tuple(f.name for f in dataclasses.fields(LogTrainConfig))
_LOG_ONLY = ("epochs", "workers", "max_weight", "holdout")
_ONLINE_ONLY = ("steps", "adaptive_lr", "train_lsr", "position_weights", "group_size", "group_offset", "baseline")


def _option(parser: argparse.ArgumentParser, *flags: str, help: str | None = None, defaults: bool = True,
            **kwargs: Any) -> None:
    """A ``train`` option setting the TrainConfig field of its name. It defaults to ``None`` (not
    given) so that a resume can tell the options a user typed from the saved run's; ``defaults``: the help
    states the defaults (else ``help`` does)."""
    name = flags[-1].lstrip("-").replace("-", "_")
    default = getattr(TrainConfig, name)
    parts = [help] if help else []
    if defaults and default is not None and kwargs.get("action") is None:
        parts.append(f"default {default}")
        if hasattr(LogTrainConfig, name) and getattr(LogTrainConfig, name) != default:  # training from logs
            parts.append(f"with --logs: {getattr(LogTrainConfig, name) or 'the logs' + chr(39)}")
    parser.add_argument(*flags, default=None, help="; ".join(parts) + " (with --resume: the saved run's)", **kwargs)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train``, ``reproduce`` and ``demo`` to a ``capg-rec`` argparse parser."""
    p = subparsers.add_parser(
        "train", help="online training of an ESR on a simulated problem, or off-policy from Parquet logs",
        description="Train an ESR online on a simulated problem, or from Parquet logs (--logs) with an off-policy "
                    "estimator. With --resume the run saved in OUT continues unchanged: the run's options default "
                    "to the saved ones, one that differs from them is an error, and only --steps (--epochs with "
                    "--logs), ending after the saved step, may change, to extend or shorten the run.")
    p.add_argument("--env", choices=_ENVS, default=None, help="default synthetic (with --resume: the saved run's)")
    p.add_argument("--data", help="KuaiRec small_matrix.csv (for --env kuairec)")
    _option(p, "--estimator", choices=ESTIMATORS + tuple(e for e in LOG_ESTIMATORS if e not in ESTIMATORS),
            help=f"online: {', '.join(ESTIMATORS)} (default {TrainConfig.estimator}); with --logs: "
                 f"{', '.join(LOG_ESTIMATORS)} (default {LogTrainConfig.estimator})", defaults=False)
    _option(p, "--capg-method", help=f"CA-PG's inclusion method, one of {', '.join(inclusion_methods())} (enumerate: "
                                     "small catalogs, draws × items within those of 8 items); default the library's, "
                                     "with --logs the logs' own")
    _option(p, "-K", "--num-candidates", type=positive_int)
    _option(p, "-L", "--num-outputs", type=positive_int)
    _option(p, "-M", "--num-experts", type=positive_int)
    _option(p, "--temperature", type=positive_float)
    _option(p, "--steps", type=positive_int)
    _option(p, "--batch-size", type=positive_int)
    _option(p, "--optimizer", choices=("adagrad", "adam", "sgd"))
    _option(p, "--lr", type=positive_float, help="default the paper's (1e-1 V-PG, 1e-2 CA-PG)")
    _option(p, "--adaptive-lr", action="store_true", help="scale lr by the inverse mean LSR propensity")
    _option(p, "--train-lsr", choices=LSR_NAMES)
    _option(p, "--eval-lsr", choices=LSR_NAMES)
    _option(p, "--eval-every", type=positive_int)
    _option(p, "--position-weights", choices=("mean", "sum", "dcg"),
            help="weights of the L positions in the trained objective (the reported policy value is the mean of "
                 "q over the L picks whatever they are)")
    _option(p, "--group-size", type=positive_int, help="GRPO group size (1 = off)")
    _option(p, "--group-offset", type=float, help="constant added after group normalisation")
    _option(p, "--baseline", choices=("none", "context"))
    _option(p, "--on-overflow", choices=("stop", "skip"))
    _option(p, "--seed", type=int)
    p.add_argument("--out", default="runs/train")
    p.add_argument("--checkpoint-every", type=positive_int, default=5000,
                   help="steps between checkpoints (default 5000; a setting of this call, not of the run: give it "
                        "again with --resume)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in OUT/checkpoint.pt")
    g = p.add_argument_group(
        "from logs", "train from Parquet logs (capg-rec log, or a serving job's in capg_rec.logs' schema); K and L "
        "are the logs'; the true value is scored on the environment the logs record (if capg_rec.sim has it), "
        "the OPE estimate on the held-out row groups; --steps, --adaptive-lr, --train-lsr, --position-weights, "
        "--group-*, --baseline and --env are online options")
    g.add_argument("--logs", nargs="+", default=None, metavar="PATH", help="Parquet files or directories of them")
    g.add_argument("--epochs", type=int, default=None, help="passes over the training rows (default 1)")
    g.add_argument("--workers", type=int, default=None, help="DataLoader workers reading the logs (default 0)")
    g.add_argument("--max-weight", type=positive_float, default=None, help="importance-weight cap (default 100)")
    g.add_argument("--holdout", type=float, default=None,
                   help="share of the row groups (the last ones) held out for OPE (default 0.1)")
    p.set_defaults(func=_train)

    p = subparsers.add_parser("reproduce", help="rerun one of the paper's experiments next to its numbers")
    p.add_argument("target", choices=_REPRODUCE_TARGETS)
    p.add_argument("--steps", type=positive_int, default=None, help="default 50000")
    p.add_argument("--seeds", type=positive_int, default=None, help="number of seeds (0..S-1; default 3)")
    p.add_argument("--out", default=None, help="default runs/<target>")
    p.add_argument("--data", help="KuaiRec small_matrix.csv (target kuairec)")
    p.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=None)
    p.add_argument("--ks", nargs="+", type=positive_int, default=None, help="candidate-set sizes K")
    p.add_argument("--lsr", nargs="*", choices=LSR_NAMES[1:], default=None,
                   help="table2: also the LSR-alignment columns")
    p.add_argument("--eval-every", type=positive_int, default=None, help="default 1000")
    p.add_argument("--capg-method", default=None, help="inclusion method of the CA-PG cells (default: the library's)")
    g = p.add_argument_group("offpolicy", "options of the off-policy study (target offpolicy; --ks and --seeds too)")
    g.add_argument("--env", choices=("synthetic", "movielens"), default=None, help="default synthetic")
    g.add_argument("--sizes", nargs="+", type=positive_int, default=None,
                   help="numbers of logged interactions n, each at least the study's batch of 128 rows (default "
                        "10^4 10^5 10^6)")
    g.add_argument("--learners", nargs="+", default=None, choices=tuple(LEARNERS), metavar="LEARNER",
                   help=f"among {', '.join(LEARNERS)} (default all; the study's names: capg_clip is train --logs' "
                        "capg)")
    g.add_argument("--logging-steps", type=positive_int, default=None,
                   help="online steps of the logging ESR (default 1000)")
    g.add_argument("--logging-temperature", type=positive_float, default=None,
                   help="τ₀ of the logging ESR (default 2)")
    g.add_argument("--max-weight", type=positive_float, default=None, help="importance-weight cap (default 100)")
    g.add_argument("--epochs", type=positive_int, default=None,
                   help="passes over the logs at most; the pass with the best held-out SNIPS estimate is kept "
                        "(default 1)")
    g.add_argument("--first-seed", type=int, default=None, help="seeds FIRST_SEED .. FIRST_SEED + SEEDS - 1 "
                                                                 "(default 0)")
    g.add_argument("--quick", action="store_true", help="a small setting: K=10, n=10^4, 1 seed, 200 logging steps")
    p.set_defaults(func=_reproduce)

    p = subparsers.add_parser("demo", help="a short V-PG-SwR vs CA-PG-SwR run (one to two minutes on 2 CPU cores)")
    p.add_argument("--steps", type=positive_int, default=3000, help="gradient steps of each run (default: 3000)")
    p.add_argument("-K", "--num-candidates", type=positive_int, default=20,
                   help="candidates the ESR draws (default: 20)")
    p.add_argument("--seeds", type=positive_int, default=1, help="runs per estimator (default: 1)")
    p.add_argument("--out", default="runs/demo", help="the results' folder (default: runs/demo)")
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

    try:
        return load_kuairec(data)
    except (ValueError, OSError) as err:  # the loader names its path argument, or the file alone
        raise ValueError(f"--data: {err}") from None


def _original_message(err: Exception) -> str:
    """``err``'s message, or for an error a DataLoader worker re-raised here (its message the worker's whole
    traceback) the original error's own message: one line."""
    text = str(err)
    if "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def _fail(message: str, command: str = "train") -> NoReturn:
    """Report a usage or input error of ``command`` and exit with status 2, as argparse does."""
    print(f"capg-rec {command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _out_dir(path: str, command: str = "train") -> Path:
    """``--out`` as a folder: one that cannot be made or written to (:func:`unwritable`) exits 2 (a run writes several
    files into it). Nothing is left behind by the check: a run refused later leaves no folder."""
    out = Path(path)
    reason = unwritable(out)
    if reason is not None:
        _fail(f"--out {out}: {reason}", command)
    return out


def unwritable(folder: Path) -> str | None:
    """Why no file can be written in ``folder`` (made if need be), or None: something else than a folder on its path
    (a file, a link to nothing), or a folder on the way that refuses a write (tried, not asked with ``os.access``:
    root is refused too, e.g. on /proc or a read-only file system) or a search. Leaves nothing behind."""
    try:
        blocking = _file_in_the_way(folder)
        if blocking is not None:
            return _not_a_folder(blocking)
        existing = next((p for p in (folder, *folder.parents) if p.is_dir()), Path("."))  # where the first write goes
        longest = os.pathconf(existing, "PC_NAME_MAX")  # -1: no limit
        too_long = [part for part in folder.parts[len(existing.parts):] if 0 < longest < len(os.fsencode(part))]
        if too_long:  # the folders before it would be made, then refused
            return f"cannot write there (a name longer than {longest} bytes: {too_long[0][:40]}...)"
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".capg_rec-"))
    except OSError as err:
        return f"cannot write there ({err.strerror or err})"
    return None


def _file_in_the_way(folder: Path) -> Path | None:
    """The first of ``folder`` and its parents that exists as something else than a folder, a link to nothing
    included (it cannot be created there), or None."""
    return next((p for p in (folder, *folder.parents) if (p.exists() or p.is_symlink()) and not p.is_dir()), None)


def _not_a_folder(blocking: Path) -> str:
    """What :func:`_file_in_the_way` found, said: ``"PATH is a file, not a folder"`` (or a link to nothing)."""
    what = "a link to nothing" if blocking.is_symlink() and not blocking.exists() else "a file"
    return f"{blocking} is {what}, not a folder"


_RUN_FILES = ("checkpoint.pt", "checkpoint.pt.prev", "result.json")
"""What a ``train`` run that got anywhere leaves in its folder: a fresh run there would take its place (and a later
resume, its ``.prev`` checkpoint)."""


def _fresh(out: Path) -> None:
    """Exit 2 where ``out`` holds a run already: ``--resume`` continues it; a new run takes another folder."""
    held = [name for name in _RUN_FILES if (out / name).exists()]
    if held:
        _fail(f"--out {out} holds a run already ({', '.join(held)}): pass --resume to continue it, or give the new "
              "run another --out (or remove that folder)")


def _resume(args: argparse.Namespace, given: dict, out: Path) -> Trainer:
    """The trainer of the run saved in ``out``, checked against the options the user typed."""
    from capg_rec.train.checkpoint import read_checkpoint
    from capg_rec.train.trainer import Trainer

    path = out / "checkpoint.pt"
    try:
        state = read_checkpoint(path)
    except FileNotFoundError:
        _fail(f"--resume: no checkpoint {path} to continue (is --out right?)")
    if state.get("kind") == "logs":
        _fail(f"--resume: the run saved in {path} trained from logs; continue it with the same --logs")
    saved = dict(state["config"], env=state["env"].partition("(")[0])
    if saved.get("capg_method") is None:  # the method the run used: its estimator's (CA-PG's: the library default)
        saved["capg_method"] = {"capg": DEFAULT_METHOD, "capg_swr": "with_replacement"}.get(saved["estimator"])
    given = dict(given, env=args.env) if args.env is not None else given
    _check_unchanged(path, saved, given, "steps", TrainConfig(**state["config"]).base_lr)
    steps = given.get("steps")
    if steps is not None and steps <= state["step"]:
        _fail(f"--resume --steps {steps}: the saved run is at step {state['step']}; give more steps to go on")
    if saved["env"] not in _ENVS:
        _fail(f"--resume: the saved run's env {state['env']!r} is not one this command builds")
    if args.data is not None and saved["env"] != "kuairec":
        _fail(f"--data: the KuaiRec file of --env kuairec, not used by the saved run's env {saved['env']!r}")
    return Trainer.from_state(state, _make_env(saved["env"], args.data), steps=steps)


def _saved_logs(out: Path) -> list[str] | None:
    """The logs of the run from logs saved in ``out``, or None (an online run); exit 2 if there is no readable
    checkpoint to continue."""
    from capg_rec.train.checkpoint import read_checkpoint

    path = out / "checkpoint.pt"
    try:
        with warnings.catch_warnings():  # read again, and warned about, where the run is resumed
            warnings.simplefilter("ignore")
            state = read_checkpoint(path)
    except FileNotFoundError:
        _fail(f"--resume: no checkpoint {path} to continue (is --out right?)")
    except (OSError, ValueError) as err:
        _fail(f"--resume: {err}")
    return list(state["config"]["logs"]) if state.get("kind") == "logs" else None


def _check_unchanged(path: Path, saved: dict, given: dict, extendable: str, base_lr: float) -> None:
    """Exit 2 unless every option in ``given`` but ``extendable`` has the saved run's value (``--lr``: the base rate
    the run used, ``base_lr``, when it saved none)."""
    saved = dict(saved, lr=base_lr) if saved.get("lr") is None else saved
    conflicts = [f"--{name.replace('_', '-')} {value} (saved: {saved[name]!r})"
                 for name, value in given.items() if name != extendable and value != saved[name]]
    if conflicts:
        _fail(f"--resume continues the run saved in {path} unchanged; these options differ from it: "
              f"{', '.join(conflicts)}. Drop them, or start a new run in another --out.")


def _log_env(paths: list[str], data: str | None):
    """The simulated environment the logs record (``extra["env"]``, as ``capg-rec log`` writes: the first file's that
    records one; the trainer refuses files of another), or None."""
    from capg_rec.logs.parquet import LoggedImpressions

    name = next((meta.extra["env"] for meta in LoggedImpressions(paths, 1).file_meta if "env" in meta.extra), None)
    if data is not None and (not isinstance(name, str) or name.partition("(")[0] != "kuairec"):
        raise ValueError(f"--data: the KuaiRec file of logs written on kuairec, not used by logs of env {name!r}")
    if not isinstance(name, str) or name.partition("(")[0] not in _ENVS:
        print(f"capg-rec train: the logs record no capg_rec.sim environment (env {name!r}): OPE estimates only",
              file=sys.stderr)
        return None
    env = _make_env(name.partition("(")[0], data)
    if env.name != name:
        raise ValueError(f"the logs' environment {name!r} is not the one built here ({env.name!r})")
    return env


def _train_logs(args: argparse.Namespace, given: dict, out: Path) -> int:
    from capg_rec.logs.parquet import LoggedImpressions
    from capg_rec.train.checkpoint import read_checkpoint
    from capg_rec.train.logged import LogTrainer, write_log_reports

    online = [f"--{name.replace('_', '-')}" for name in _ONLINE_ONLY if name in given]
    if online or args.env is not None:
        _fail(f"{', '.join(online + (['--env'] if args.env is not None else []))}: options of online training, "
              "not of --logs (the environment is the one the logs record)")
    given = {name: value for name, value in given.items() if name in _LOG_FIELDS}
    given.update({name: getattr(args, name) for name in _LOG_ONLY if getattr(args, name) is not None})
    given["logs"] = tuple(str(Path(p).resolve()) for p in args.logs)
    try:
        env = _log_env(args.logs, args.data)
        if args.resume:
            path = out / "checkpoint.pt"
            try:
                state = read_checkpoint(path)
            except FileNotFoundError:
                _fail(f"--resume: no checkpoint {path} to continue (is --out right?)")
            except (OSError, ValueError) as err:
                _fail(f"--resume: {err}")
            if state.get("kind") != "logs":
                _fail(f"--resume: the run saved in {path} trained online; drop --logs to continue it")
            saved = dict(state["config"])  # a run given no eval LSR took the logs' own
            saved["eval_lsr"] = eval_lsr_name(saved.get("eval_lsr"), LoggedImpressions(args.logs, 1).file_meta)
            _check_unchanged(path, saved, given, "epochs", LogTrainConfig(**state["config"]).base_lr)
            trainer = LogTrainer.from_state(state, env, epochs=given.get("epochs"))
        else:
            trainer = LogTrainer(LogTrainConfig(**given), env)
        result = trainer.run(out_dir=out, checkpoint_every=args.checkpoint_every)
    except (ValueError, TypeError) as err:
        # --env is not an option of training from logs; what names no option is about the logs (a file, its rows)
        message = flagged(_original_message(err), args, env="env", path_or_paths="--logs")
        _fail(message if message.startswith("--") else f"--logs: {message}")
    written = write_log_reports(trainer, out)
    cfg, last = trainer.config, result.history[-1]
    value = "no environment" if env is None else f"policy value {last['policy_value']:.4f} under the " \
        f"{trainer.eval_lsr_name} LSR (best achievable under the optimal LSR {env.optimal_value(cfg.num_outputs):.4f})"
    snips_interval = [last.get(key, math.nan) for key in ("ope_snips_low", "ope_snips_high")]  # older runs: none
    ope = "" if last["ope_snips"] is None else f"; held-out OPE SNIPS {last['ope_snips']:.4f} " \
        f"[{snips_interval[0]:.4f}, {snips_interval[1]:.4f}], IPS {last['ope_ips']:.4f} [{last['ope_ips_low']:.4f}, " \
        f"{last['ope_ips_high']:.4f}], ESS {last['ope_ess']:.0f}"
    print(f"{cfg.label} from {trainer.train_data.num_rows} logged rows, {result.steps_done} steps "
          f"({cfg.epochs} epochs): {value}{ope}; {result.overflow_count} gradient overflows")
    if env is None and last["ope_snips"] is None:
        print("nothing measured the ESR: the logs name no environment and --holdout 0 keeps no rows out",
              file=sys.stderr)
    print(f"metrics: {', '.join(map(str, [out / 'metrics.jsonl', *written]))}, result: {out / 'result.json'}, "
          f"checkpoint: {out / 'checkpoint.pt'}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from capg_rec.train.report import plot_curves, write_csv
    from capg_rec.train.trainer import Trainer

    given = {name: getattr(args, name) for name in _CONFIG_FIELDS if getattr(args, name, None) is not None}
    out = _out_dir(args.out)
    if not args.resume:
        _fresh(out)
    elif args.logs is None:  # a run from logs continues from the same logs
        args.logs = _saved_logs(out)
    if args.logs is not None:
        return _train_logs(args, given, out)
    log_only = [f"--{name.replace('_', '-')}" for name in _LOG_ONLY if getattr(args, name) is not None]
    if log_only:
        _fail(f"{', '.join(log_only)}: options of training from logs (--logs)")
    estimator = given.get("estimator", TrainConfig.estimator)
    if estimator not in ESTIMATORS:
        _fail(f"--estimator {estimator}: an off-policy estimator, for --logs; online: {', '.join(ESTIMATORS)}")
    if not args.resume and "capg_method" in given and estimator != "capg" and \
            (estimator, given["capg_method"]) != ("capg_swr", "with_replacement"):
        _fail(f"--capg-method: the inclusion method of --estimator capg, not of {estimator}"
              f"{' (the default)' if 'estimator' not in given else ''} (capg_swr's is with_replacement; V-PG has "
              "none)")
    if not args.resume and args.data is not None and (args.env or "synthetic") != "kuairec":
        _fail(f"--data: the KuaiRec file of --env kuairec, not used by --env {args.env or 'synthetic'}")
    try:
        if args.resume:
            trainer = _resume(args, given, out)
        else:
            trainer = Trainer(_make_env(args.env or "synthetic", args.data), TrainConfig(**given))
    except ValueError as err:
        _fail(flagged(str(err), args))
    env = trainer.env
    try:
        result = trainer.run(out_dir=out, checkpoint_every=args.checkpoint_every)
    except (ValueError, TypeError) as err:  # e.g. a method that cannot score this catalog
        _fail(flagged(str(err), args))
    cfg, best = trainer.config, env.optimal_value(trainer.config.num_outputs)
    write_csv(out / "metrics.csv", result.history)
    plot_curves({f"{cfg.label} on {env.name}, K={cfg.num_candidates}": {cfg.label: [result.history]}},
                out / "curves.png", optimum=best)
    print(f"{cfg.label} on {env.name}: policy value {result.final_value:.4f} under the "
          f"{trainer.lsr_labels['eval_lsr']} LSR after {result.steps_done} steps (best achievable under the optimal "
          f"LSR {best:.4f}); {result.overflow_count} gradient overflows")
    print(f"metrics: {out / 'metrics.jsonl'}, {out / 'metrics.csv'}, {out / 'curves.png'}, result: "
          f"{out / 'result.json'}, checkpoint: {out / 'checkpoint.pt'}")
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    """``capg-rec reproduce``: a bad target, option or output folder exits 2 with the reason."""
    try:
        return _reproduce_target(args)
    except ValueError as err:
        _fail(flagged(str(err), args, K="--ks", num_candidates="--ks", path="--data"), "reproduce")


_TRAINING = ("steps", "seeds", "estimators", "ks", "eval_every", "capg_method")
_OFFPOLICY = ("ks", "seeds", "env", "sizes", "learners", "logging_steps", "logging_temperature", "max_weight", "epochs",
              "first_seed", "quick")
_REPRODUCE_OPTIONS = {"table2": (*_TRAINING, "lsr"), "table3": tuple(o for o in _TRAINING if o != "ks"),
                      "grpo": _TRAINING, "movielens": _TRAINING, "kuairec": (*_TRAINING, "data"),
                      "variance": ("ks", "estimators"), "offpolicy": _OFFPOLICY}
"""The options each ``reproduce`` target reads (besides ``--out``); another one given is an error, not ignored."""
_REPRODUCE_DEFAULTS = {"steps": 50_000, "seeds": 3, "eval_every": 1000, "lsr": (), "env": "synthetic", "first_seed": 0}


def _reproduce_target(args: argparse.Namespace) -> int:
    out = _out_dir(args.out or f"runs/{args.target}", "reproduce")
    names = {name for options in _REPRODUCE_OPTIONS.values() for name in options}
    ignored = sorted(name for name in names - set(_REPRODUCE_OPTIONS[args.target])
                     if getattr(args, name) not in (None, False))
    if ignored:
        raise ValueError(f"{', '.join('--' + name.replace('_', '-') for name in ignored)}: not used by the "
                         f"{args.target} target (it reads "
                         f"{', '.join('--' + o.replace('_', '-') for o in _REPRODUCE_OPTIONS[args.target])})")
    quick_set = [name for name in ("seeds", "first_seed") if args.quick and getattr(args, name) is not None]
    if quick_set:
        raise ValueError(f"{', '.join('--' + name.replace('_', '-') for name in quick_set)}: not used by the "
                         f"{args.target} target with --quick, which sets the seeds")
    for name, value in _REPRODUCE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
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
        if not 0 <= args.first_seed <= 2**63 - args.seeds:  # the study's message would name its seeds
            raise ValueError(f"--first-seed must be in [0, 2^63 - --seeds] (seeds are int64), got {args.first_seed}")
        options["seeds"] = tuple(range(args.first_seed, args.first_seed + args.seeds))
    for name in ("ks", "sizes", "learners"):
        if getattr(args, name) is not None:
            options[name] = tuple(getattr(args, name))
    for name in ("logging_steps", "logging_temperature", "max_weight", "epochs"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    print(run_offpolicy_study(OffPolicyStudy(**options), out))
    print(f"written: {out / 'results.md'}, {out / 'results.csv'}, {out / 'results.json'}, {out / 'values.png'}, "
          f"{out / 'ope.png'}")
    return 0


def _reach_line(vpg: TrainResult, capg: TrainResult) -> str:
    """When CA-PG-SwR first reached V-PG-SwR's final value, in one seed's runs (also at step 0, or never)."""
    target = vpg.final_value
    reached = next((row["step"] for row in capg.history if row["policy_value"] >= target), None)
    head = f"seed {capg.config['seed']}: CA-PG-SwR"
    value = f"V-PG-SwR's {vpg.steps_done}-step value ({target:.3f})"
    if reached is None:
        return f"{head} did not reach {value} in its {capg.steps_done} steps."
    if reached == 0:
        return f"{head} started at {value} or above (step 0, before any update)."
    return f"{head} reached {value} after {reached} steps ({vpg.steps_done / reached:.1f}x fewer)."


def _demo(args: argparse.Namespace) -> int:
    from capg_rec.sim.synthetic import synthetic_env
    from capg_rec.train.reproduce import Cell, OtherRun, run_cells, summarize

    env = synthetic_env()
    if args.num_candidates > env.num_items:
        _fail(f"-K must be at most the {env.num_items} items, got {args.num_candidates}", "demo")
    base = TrainConfig(num_candidates=args.num_candidates, steps=args.steps, eval_every=max(1, args.steps // 12))
    cells = [Cell(f"K={args.num_candidates}", base.replace(estimator=e)) for e in ("vpg_swr", "capg_swr")]
    out = _out_dir(args.out, "demo")
    print(f"Training the paper's ESR on its synthetic problem ({env.num_users} users x {env.num_items} items), "
          f"K = {args.num_candidates}, optimal LSR, {args.steps} steps, {args.seeds} seed(s) per method ...",
          file=sys.stderr)
    try:
        results = run_cells(env, cells, range(args.seeds), out)
    except ValueError as err:  # e.g. a folder holding a demo of other --steps (whose eval_every is steps // 12)
        hint = " (the demo evaluates every --steps // 12 steps: give the --steps of the run there)" \
            if isinstance(err, OtherRun) else ""
        _fail(f"--out: {err}{hint}", "demo")
    print(summarize("demo", env, cells, results, out, steps=args.steps))
    setting = cells[0].setting
    for vpg, capg in zip(results[("V-PG-SwR", setting)], results[("CA-PG-SwR", setting)]):
        print(_reach_line(vpg, capg))
    print(f"table: {out / 'results.md'} (also {out / 'results.csv'}, {out / 'results.json'}); "
          f"plot: {out / 'curves.png'}")
    return 0
