"""``capg-rec log``: generate off-policy logs from a logging ESR in a simulated environment (registered by
``capg_rec.cli``).

The logging ESR is a :class:`~capg_rec.train.model.TwoTowerMoE`, fresh (seeded) or loaded from a
``capg-rec train`` checkpoint, served as a PL at ``--temperature`` with an ``--epsilon`` uniform
mixture. Each batch: B users, K candidates from the exploration mixture, the LSR shows L of them,
rewards from the environment, and the logging propensities of :func:`~capg_rec.logs.log_propensities`;
the rows go to a Parquet file (:mod:`capg_rec.logs.schema`), one row group per batch, and a JSON summary
next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch

from capg_rec._checks import flagged, fraction, positive_float, positive_int
from capg_rec.marginals import DEFAULT_METHOD, inclusion_method, inclusion_methods
from capg_rec.sim.lsr import LSR_NAMES
from capg_rec.train.cli import _ENVS
from capg_rec.train.config import SEED_MAX

__all__ = ["register", "generate_logs"]



def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``log`` to a ``capg-rec`` argparse parser."""
    p = subparsers.add_parser(
        "log", help="generate off-policy logs (Parquet) from a logging ESR on a simulated problem",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("--env", choices=_ENVS, default=None, help="default synthetic, or the checkpoint's")
    p.add_argument("--data", help="KuaiRec small_matrix.csv (for --env kuairec)")
    p.add_argument("--checkpoint", help="a `capg-rec train` checkpoint.pt: its ESR logs (default: a fresh one)")
    p.add_argument("-K", "--num-candidates", type=positive_int, default=None, help="default 10, or the checkpoint's")
    p.add_argument("-L", "--num-outputs", type=positive_int, default=None, help="default 1, or the checkpoint's")
    p.add_argument("-M", "--num-experts", type=positive_int, default=None, help="experts of a fresh ESR (default 1)")
    p.add_argument("--embedding-dim", type=positive_int, default=None, help="of a fresh ESR (default 10)")
    p.add_argument("--temperature", type=positive_float, default=None,
                   help="τ of the logging PL over the model's logits (default 1, or the checkpoint's)")
    p.add_argument("--epsilon", type=fraction, default=0.0, help="uniform exploration share in [0, 1] (default 0)")
    probabilities = [name for name in inclusion_methods() if inclusion_method(name).is_probability]
    p.add_argument("--method", default=DEFAULT_METHOD,
                   help=f"inclusion method of log_inclusion, one of {', '.join(probabilities)} (default "
                        f"{DEFAULT_METHOD}; the expected count is logged as well, whatever the method)")
    p.add_argument("--lsr", choices=LSR_NAMES, default="optimal", help="the later stage (default optimal)")
    p.add_argument("-n", "--num-interactions", type=positive_int, default=10_000, help="rows to write (default 10000)")
    p.add_argument("--batch-size", type=positive_int, default=2048,
                   help="requests per batch and row group (default 2048)")
    p.add_argument("--policy-version", default=None, help="stored in every row (default: fresh-seed<S> or "
                                                          "the checkpoint's file and step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/logs/logs.parquet", help="the Parquet file to write")
    p.add_argument("--summary", default=None, help="the JSON summary (default: OUT with suffix .json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_log)


def _fail(message: str) -> NoReturn:
    print(f"capg-rec log: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _data_of(env_name: str, data: str | None) -> str | None:
    """``--data``, which only kuairec reads (another environment would ignore it silently)."""
    if data is not None and env_name != "kuairec":
        raise ValueError(f"--data: the KuaiRec file of --env kuairec, not used by env {env_name!r}")
    return data


def _logging_esr(args: argparse.Namespace, env_name: str | None):
    """``(env, model, K, L, τ, facts)`` from the options and the checkpoint, if any."""
    from capg_rec.train.cli import _make_env
    from capg_rec.train.model import TwoTowerMoE

    facts: dict = {}
    if args.checkpoint is not None:
        from capg_rec.train.checkpoint import read_checkpoint
        from capg_rec.train.config import TrainConfig

        try:
            state = read_checkpoint(args.checkpoint)
        except (OSError, ValueError) as err:  # missing, unreadable or corrupt (and no intact .prev): err names it
            raise ValueError(f"--checkpoint: {err}") from err
        if state.get("kind") == "logs":
            raise ValueError(f"--checkpoint {args.checkpoint}: a run trained from logs (capg-rec train --logs), which "
                             "this command does not serve; pass an online run's checkpoint (capg-rec train)")
        missing = sorted({"config", "env", "model", "step"} - state.keys())
        if missing:
            raise ValueError(f"--checkpoint {args.checkpoint}: not a capg-rec train checkpoint (no {missing})")
        config = TrainConfig(**state["config"])
        saved_env = state["env"].partition("(")[0]
        if env_name is not None and env_name != saved_env:
            raise ValueError(f"--env {env_name}: the checkpoint's ESR was trained on {saved_env!r}")
        env = _make_env(saved_env, _data_of(saved_env, args.data))
        if env.name != state["env"]:
            raise ValueError(f"the checkpoint's env {state['env']!r} is not the one built here ({env.name!r})")
        model = TwoTowerMoE(env.num_users, env.num_items, num_experts=config.num_experts, dim=config.embedding_dim)
        model.load_state_dict(state["model"])
        k, length, tau = config.num_candidates, config.num_outputs, config.temperature
        facts = {"checkpoint": str(args.checkpoint), "checkpoint_step": state["step"]}
        version = f"{Path(args.checkpoint).name}@step{state['step']}"
    else:
        env = _make_env(env_name or "synthetic", _data_of(env_name or "synthetic", args.data))
        g = torch.Generator().manual_seed(args.seed)
        model = TwoTowerMoE(env.num_users, env.num_items, num_experts=args.num_experts, dim=args.embedding_dim,
                            generator=g)
        k, length, tau = 10, 1, 1.0
        version = f"fresh-seed{args.seed}"
    k = args.num_candidates if args.num_candidates is not None else k
    if model.num_experts > k:  # positions 1..K go to experts in blocks: some expert would never serve
        raise ValueError(f"-K {k}: fewer positions than the ESR's {model.num_experts} experts (each serves a block "
                         "of positions: one would never serve)")
    if k > env.num_items:
        raise ValueError(f"-K {k}: more candidates than the environment's {env.num_items} items")
    length = args.num_outputs if args.num_outputs is not None else length
    if length > k:
        raise ValueError(f"-L {length}: more items shown than the K = {k} candidates")
    tau = args.temperature if args.temperature is not None else tau
    facts["policy_version"] = args.policy_version if args.policy_version is not None else version
    return env, model, k, length, tau, facts


def generate_logs(env, model: torch.nn.Module, out: str | Path, *, num_interactions: int, num_candidates: int,
                  num_outputs: int, temperature: float = 1.0, epsilon: float = 0.0, method: str = DEFAULT_METHOD,
                  lsr: str = "optimal", batch_size: int = 2048, seed: int = 0, policy_version: str = "",
                  extra: dict | None = None, progress: bool = True) -> dict:
    """Serve ``model`` (logits ``[B, M, N]`` per user batch) on ``env`` for ``num_interactions`` requests
    and write them to ``out`` (Parquet); returns the summary (rows, rewards, propensities, speed)."""
    from tqdm.auto import tqdm

    from capg_rec._checks import check_count, check_positive
    from capg_rec.logs.parquet import LogWriter
    from capg_rec.logs.propensity import _check_epsilon, explore_candidates, log_propensities
    from capg_rec.logs.schema import LoggedBatch
    from capg_rec.sim.lsr import make_lsr

    num_interactions = check_count("num_interactions", num_interactions)
    batch_size = check_count("batch_size", batch_size)
    num_candidates = check_count("num_candidates", num_candidates, high=env.num_items)
    num_outputs = check_count("num_outputs", num_outputs, high=num_candidates)
    # checked here, as Python numbers: they go into the file's metadata (JSON) before anything reads them
    temperature, epsilon = check_positive("temperature", temperature), _check_epsilon(epsilon)
    seed = check_count("seed", seed, low=0, high=2**63 - 1)
    ranker = make_lsr(lsr, argument="lsr")
    g = torch.Generator().manual_seed(seed)
    extra = dict(extra or {}, env=env.name, lsr=lsr, temperature=temperature, epsilon=epsilon, seed=seed,
                 num_users=env.num_users)
    started = time.perf_counter()
    reward_sum, inclusion_sum, min_log_inclusion, set_sum = 0.0, 0.0, 0.0, 0.0
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with LogWriter(out, num_candidates=num_candidates, num_shown=num_outputs, num_items=env.num_items,
                   method=method, policy_version=policy_version, extra=extra) as writer, \
            tqdm(total=num_interactions, desc="logging", unit="rows", disable=not progress) as bar, torch.no_grad():
        while writer.rows_written < num_interactions:
            users = env.sample_users(min(batch_size, num_interactions - writer.rows_written), g)
            logits = model(users)
            candidates = explore_candidates(logits, num_candidates, temperature=temperature, epsilon=epsilon,
                                            generator=g)
            picks, _ = ranker(env.ranking_scores(users, candidates), num_outputs, g)
            shown = candidates.gather(1, picks)
            rewards = env.sample_reward(users, shown, g)
            # float64: log π0(A^K) sums K terms and reaches hundreds of nats, where float32 is off by ~1e-2
            logged = log_propensities(logits.double(), candidates, shown, method=method, temperature=temperature,
                                      epsilon=epsilon)
            writer.write(LoggedBatch(users, candidates, shown, rewards, *logged))
            reward_sum += float(rewards.double().sum())
            inclusion_sum += float(logged.log_inclusion.double().exp().sum())
            min_log_inclusion = min(min_log_inclusion, float(logged.log_inclusion.min()))
            set_sum += float(logged.log_candidate_prob.double().sum())
            bar.update(len(users))
    seconds = time.perf_counter() - started
    rows = writer.rows_written
    return {"out": str(out), "rows": rows, "row_groups": writer.batches_written, "env": env.name,
            "num_items": env.num_items, "num_candidates": num_candidates, "num_outputs": num_outputs,
            "temperature": temperature, "epsilon": epsilon, "method": writer.meta.method, "lsr": lsr,
            "policy_version": policy_version, "mean_reward": reward_sum / (rows * num_outputs),
            "mean_inclusion": inclusion_sum / (rows * num_outputs), "min_log_inclusion": min_log_inclusion,
            "mean_log_candidate_prob": set_sum / rows, "seconds": seconds, "rows_per_second": rows / seconds,
            **{k: v for k, v in extra.items() if k.startswith("checkpoint")}}


def _summary_path(args: argparse.Namespace) -> Path:
    """Where the JSON summary goes, checked before any logging: not the logs' own file, nor a folder."""
    path = Path(args.summary) if args.summary is not None else Path(args.out).with_suffix(".json")
    if path.resolve() == Path(args.out).resolve():
        _fail(f"the summary would overwrite the logs {args.out}: give --out a .parquet name or another --summary")
    if path.is_dir():
        _fail(f"--summary {path}: a folder, not a file")
    from capg_rec.train.cli import unwritable

    for option, file in (("--out", Path(args.out)), ("--summary", path)):
        reason = unwritable(file.parent)  # before the logs are made: a summary refused at the end would lose them
        if reason is not None:
            _fail(f"{option} {file}: {reason}")
    return path


def _log(args: argparse.Namespace) -> int:
    path = _summary_path(args)
    if not 0 <= args.seed <= SEED_MAX:
        _fail(f"--seed must be in [0, {SEED_MAX}], got {args.seed}")
    fresh = [flag for flag, value in (("-M", args.num_experts), ("--embedding-dim", args.embedding_dim))
             if value is not None]
    if args.checkpoint is not None and fresh:
        _fail(f"{', '.join(fresh)}: options of a fresh ESR; the --checkpoint's ESR has its own")
    args.num_experts = 1 if args.num_experts is None else args.num_experts
    args.embedding_dim = 10 if args.embedding_dim is None else args.embedding_dim
    fresh_k = args.num_candidates if args.num_candidates is not None else 10
    if args.checkpoint is None and args.num_experts > fresh_k:
        _fail(f"-M {args.num_experts}: more experts than the K = {fresh_k} positions they draw")
    try:
        env, model, k, length, tau, facts = _logging_esr(args, args.env)
        version = facts.pop("policy_version")
        summary = generate_logs(env, model, args.out, num_interactions=args.num_interactions, num_candidates=k,
                                num_outputs=length, temperature=tau, epsilon=args.epsilon, method=args.method,
                                lsr=args.lsr, batch_size=args.batch_size, seed=args.seed, policy_version=version,
                                extra=facts, progress=not args.no_progress)
    except (ValueError, TypeError) as err:
        _fail(flagged(str(err), args, path="--out"))
    except OSError as err:  # writing --out (its folder, the file): reading the --checkpoint raised above
        _fail(f"--out {args.out}: cannot write there ({os.strerror(err.errno) if err.errno else err})")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(json.dumps(summary, indent=1))
    print(f"logs: {args.out}; summary: {path}", file=sys.stderr)
    return 0
