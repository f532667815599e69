"""The off-policy study: learn an ESR from logs of another ESR, next to on-policy CA-PG.

For each (K, seed): a logging ESR is partly trained online (CA-PG-SwR, ``logging_steps`` steps)
and served at a softened temperature τ₀; it writes ``max(sizes)`` logged rows (user, ordered
candidates, the LSR's picks, rewards, and its log-propensities: ``log π₀(a ∈ A^K)`` by the
default inclusion method, the log expected count and ``log π₀(A^K)`` of the ordered draw), in
memory. Every learner starts from the logging ESR's parameters (scored at τ = 1) and makes up to
``epochs`` passes over the first n rows in :class:`~capg_rec.logs.LoggedBatch` batches with the
loss of its estimator in ``capg-rec train --logs`` (one optimizer throughout); with more than one
pass it keeps the parameters after the pass whose held-out SNIPS estimate is highest (selection by
off-policy evaluation, as a user without the environment would select). On-policy CA-PG gets the
same number of interactions (n / B online steps, each interaction used once). Reported per learner:
the true value of its greedy ESR (exact, from the environment, as the trainer evaluates) and the
off-policy estimates (IPS, SNIPS) of that value from ``eval_rows`` held-out logged rows.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor

from capg_rec._checks import all_finite, check_choice, check_count, check_distinct, check_positive
from capg_rec.catalog import DenseCatalog
from capg_rec.logs.propensity import log_propensities
from capg_rec.logs.schema import LoggedBatch
from capg_rec.offpolicy_evaluation import off_policy_value
from capg_rec.plackett_luce import greedy_candidates, sample_candidates
from capg_rec.sim.env import MatrixEnv
from capg_rec.sim.lsr import OptimalLSR
from capg_rec.train.config import SEED_MAX, TrainConfig, python_numbers
from capg_rec.train.logged import _LR, _estimator_loss, ope_columns
from capg_rec.train.report import legend_below, markdown_table, mean_pm_se, mean_se, write_csv, write_json
from capg_rec.train.trainer import Trainer, policy_value

__all__ = ["OffPolicyStudy", "LEARNERS", "run_offpolicy_study"]

LEARNERS = {
    "capg_clip": "off-policy CA-PG (capped IPS)",
    "capg_snips": "off-policy CA-PG (SNIPS)",
    "capg_swr": "off-policy CA-PG-SwR",
    "vpg_ips": "IPS V-PG",
    "topk_reinforce": "top-K REINFORCE (Chen et al.)",
    "supervised": "supervised (softmax CE, r > 0)",
    "capg_onpolicy": "on-policy CA-PG (same interactions)",
}
_ESTIMATOR = {"capg_clip": "capg"}  # an off-policy learner → its estimator of capg-rec train --logs (else the same)
_CHUNK = 4096


@dataclass(frozen=True)
class OffPolicyStudy:
    """The study's grid and knobs (defaults: the full grid), validated on creation; no tensors.

    Attributes:
        env: ``"synthetic"`` (default) or ``"movielens"``.
        ks, sizes, seeds: the grid: K values (10, 50, 200), logged rows n each learner trains on (10^4, 10^5,
            10^6; each at least ``batch_size``) and seeds (0, 1, 2).
        learners: keys of :data:`LEARNERS` (default all).
        num_outputs: L (default 1, at most every K).
        logging_steps, logging_temperature: the logging ESR's online CA-PG-SwR steps (1000) and serving τ₀ (2.0).
        batch_size, lr, epochs: B (128); the off-policy learners' learning rate (1e-2; ``vpg_ips`` takes 1e-1);
            passes over the logs at most (1).
        max_weight: the importance weights' cap (default 100.0; None: the losses' overflow cap only).
        eval_rows: held-out logged rows of the off-policy estimates (default 20,000).

    Example:
        >>> study = OffPolicyStudy(ks=(10,), sizes=(1000,), seeds=(0,), learners=("capg_clip", "capg_onpolicy"))
        >>> study.env, study.max_weight, study.epochs                    # run_offpolicy_study(study, out) runs it
        ('synthetic', 100.0, 1)
    """

    env: str = "synthetic"
    ks: tuple[int, ...] = (10, 50, 200)
    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    seeds: tuple[int, ...] = (0, 1, 2)
    learners: tuple[str, ...] = tuple(LEARNERS)
    num_outputs: int = 1
    logging_steps: int = 1000
    logging_temperature: float = 2.0
    batch_size: int = 128
    max_weight: float | None = 100.0
    eval_rows: int = 20_000
    lr: float = 1e-2
    epochs: int = 1

    def __post_init__(self) -> None:
        check_choice("env", self.env, ("synthetic", "movielens"))
        for name in ("epochs", "logging_steps", "batch_size", "eval_rows", "num_outputs"):
            check_count(name, getattr(self, name))
        for name in ("logging_temperature", "lr"):
            check_positive(name, getattr(self, name))
        if self.max_weight is not None:  # None: the losses' overflow cap only
            check_positive("max_weight", self.max_weight)
        for name in ("ks", "sizes", "seeds", "learners"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
            check_distinct(name, getattr(self, name))
        unknown = set(self.learners) - set(LEARNERS)
        if unknown:
            raise ValueError(f"learners must be among {tuple(LEARNERS)}, got {sorted(unknown)}")
        for name in ("ks", "sizes"):
            for value in getattr(self, name):
                check_count(f"{name} entries", value)
        for seed in self.seeds:  # as TrainConfig's (a negative seed wrapped around in torch.Generator)
            check_count("seeds entries", seed, low=0, high=SEED_MAX)
        if self.num_outputs > min(self.ks):
            raise ValueError(f"num_outputs must be <= every K of ks, got {self.num_outputs} and ks {list(self.ks)}")
        if min(self.sizes) < self.batch_size:
            raise ValueError(f"sizes must be at least the study's batch of {self.batch_size} rows (each size is "
                             f"trained in whole batches), got {min(self.sizes)}")
        python_numbers(self)


@dataclass
class _Logs:
    """Logged rows in memory (ids as int32), the fields of a :class:`~capg_rec.logs.LoggedBatch`."""

    users: Tensor
    candidates: Tensor
    chosen: Tensor
    rewards: Tensor
    log_inclusion: Tensor
    log_count: Tensor
    log_set: Tensor

    def rows(self, start: int, stop: int) -> _Logs:
        return _Logs(*(getattr(self, f.name)[start:stop] for f in fields(self)))

    def batch(self, index: Tensor) -> LoggedBatch:
        """The rows ``index`` as a :class:`~capg_rec.logs.LoggedBatch` (ids as int64)."""
        return LoggedBatch(context=self.users[index].long(), candidates=self.candidates[index].long(),
                           shown=self.chosen[index].long(), rewards=self.rewards[index],
                           log_inclusion=self.log_inclusion[index], log_expected_count=self.log_count[index],
                           log_candidate_prob=self.log_set[index])


@torch.no_grad()
def _log(model: torch.nn.Module, env: MatrixEnv, num_rows: int, num_candidates: int, num_outputs: int,
         temperature: float, generator: torch.Generator, progress: Callable[[int], None]) -> _Logs:
    """``num_rows`` rows served by ``model`` at ``temperature`` with the optimal LSR."""
    parts: dict[str, list[Tensor]] = {}
    lsr = OptimalLSR()
    for start in range(0, num_rows, _CHUNK):
        users = env.sample_users(min(_CHUNK, num_rows - start), generator)
        catalog = DenseCatalog(model(users), temperature, validate_args=False)
        candidates = sample_candidates(catalog, num_candidates, generator=generator, validate_args=False)
        picks, _ = lsr(env.ranking_scores(users, candidates), num_outputs)
        chosen = candidates.gather(1, picks)
        logged = log_propensities(catalog, candidates, chosen, validate_args=False)
        row = {"users": users.int(), "candidates": candidates.int(), "chosen": chosen.int(),
               "rewards": env.sample_reward(users, chosen, generator),
               "log_inclusion": logged.log_inclusion.clamp(max=0.0), "log_count": logged.log_expected_count,
               "log_set": logged.log_candidate_prob}
        for name, value in row.items():
            parts.setdefault(name, []).append(value)
        progress(len(users))
    return _Logs(**{name: torch.cat(values) for name, values in parts.items()})


def _offpolicy_loss(learner: str, num_candidates: int, num_outputs: int, num_experts: int, max_weight: float
                    ) -> Callable[[Tensor, LoggedBatch], Tensor]:
    """``loss(logits [B, M, N], batch)`` of an off-policy learner: its estimator's loss from logs, at τ = 1."""
    estimator = _ESTIMATOR.get(learner, learner)
    return _estimator_loss(estimator, num_candidates, num_outputs, num_experts=num_experts, temperature=1.0,
                           max_weight=max_weight, method="with_replacement" if estimator == "capg_swr" else None)


def _train_offline(model: torch.nn.Module, logs: _Logs, learner: str, study: OffPolicyStudy, num_candidates: int,
                   generator: torch.Generator, select: Callable[[torch.nn.Module], float]) -> tuple[int, int]:
    """Up to ``study.epochs`` passes over ``logs`` in shuffled batches, one optimizer throughout; with more than
    one, ``model`` ends with the parameters of the pass that ``select`` (a held-out estimate) scores highest →
    (that pass, the number of skipped non-finite steps)."""
    loss_fn = _offpolicy_loss(learner, num_candidates, study.num_outputs, model.num_experts, study.max_weight)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=_LR.get(_ESTIMATOR.get(learner, learner), study.lr))
    skipped, best, best_pass, best_state = 0, -math.inf, study.epochs, None
    for epoch in range(1, study.epochs + 1):
        skipped += _one_pass(model, logs, loss_fn, optimizer, study.batch_size, generator)
        if study.epochs > 1:
            score = select(model)
            if score > best:  # ties keep the earlier pass
                best, best_pass, best_state = score, epoch, copy.deepcopy(model.state_dict())
    if best_state is not None:
        model.load_state_dict(best_state)
    return best_pass, skipped


def _one_pass(model: torch.nn.Module, logs: _Logs, loss_fn: Callable[[Tensor, LoggedBatch], Tensor],
              optimizer: torch.optim.Optimizer, batch_size: int, generator: torch.Generator) -> int:
    """One pass over ``logs`` in shuffled batches → the number of skipped (non-finite) steps."""
    order = torch.randperm(len(logs.users), generator=generator)
    skipped = 0
    for start in range(0, len(order) - batch_size + 1, batch_size):
        batch = logs.batch(order[start:start + batch_size])
        loss = loss_fn(model(batch.context), batch)
        optimizer.zero_grad(set_to_none=True)
        if not all_finite(loss.detach()):
            skipped += 1
            continue
        loss.backward()
        if not all(all_finite(p.grad) for p in model.parameters() if p.grad is not None):
            skipped += 1
            continue
        optimizer.step()
    return skipped


@torch.no_grad()
def _ope(model: torch.nn.Module, env: MatrixEnv, logs: _Logs, num_candidates: int) -> dict[str, float]:
    """IPS/SNIPS estimates of the greedy ESR's value: its inclusion is 1 on its noise-free draw
    (:func:`~capg_rec.greedy_candidates`, each expert's best remaining items), 0 elsewhere."""
    top = torch.cat([greedy_candidates(model(torch.arange(s, min(s + 256, env.num_users))), num_candidates,
                                       validate_args=False) for s in range(0, env.num_users, 256)])
    member = torch.zeros(env.num_users, env.num_items, dtype=torch.bool)
    member.scatter_(1, top, True)
    inside = member[logs.users.long().unsqueeze(1), logs.chosen.long()]
    target = torch.where(inside, 0.0, -math.inf)
    return ope_columns(off_policy_value(target, logs.log_inclusion.double(), logs.rewards.double(),
                                        validate_args=False))


def run_offpolicy_study(study: OffPolicyStudy, out: str | Path, *, progress: bool = True) -> str:
    """Run the grid, write ``results.{md,csv,json}`` and ``values.png`` / ``ope.png`` to ``out``;
    return the Markdown text."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from capg_rec.train.cli import _make_env  # here: the command line module imports this one

    env = _make_env(study.env, None)
    runs: list[dict] = []
    rows_per_k = max(study.sizes) + study.eval_rows
    work = len(study.ks) * len(study.seeds) * (rows_per_k + sum(study.sizes) * len(study.learners))
    bar = tqdm(total=work, unit="row", disable=not progress, desc="offpolicy")
    for k in study.ks:
        for seed in study.seeds:
            generator = torch.Generator().manual_seed(seed)
            config = TrainConfig(estimator="capg_swr", num_candidates=k, num_outputs=study.num_outputs,
                                 steps=study.logging_steps, eval_every=study.logging_steps,
                                 batch_size=study.batch_size, seed=seed)
            bar.set_postfix_str(f"K={k} seed={seed}: logging ESR")
            logging_trainer = Trainer(env, config)
            logging_trainer.run(progress=False)
            logging_model = logging_trainer.model
            bar.set_postfix_str(f"K={k} seed={seed}: logs")
            logs = _log(logging_model, env, rows_per_k, k, study.num_outputs, study.logging_temperature, generator,
                        bar.update)
            held_out = logs.rows(max(study.sizes), rows_per_k)
            start_value = policy_value(logging_model, env, OptimalLSR(), k, study.num_outputs)
            logged_mean = float(env.expected_reward(logs.users.long(), logs.chosen.long()).mean())
            for n in study.sizes:
                train_logs = logs.rows(0, n)
                for learner in study.learners:
                    bar.set_postfix_str(f"K={k} seed={seed} n={n}: {learner}")
                    model = copy.deepcopy(logging_model)
                    started = time.perf_counter()
                    skipped, passes = 0, 1
                    if learner == "capg_onpolicy":
                        trainer = Trainer(env, config.replace(estimator="capg", steps=n // study.batch_size,
                                                              eval_every=n // study.batch_size,
                                                              seed=seed + 1000))
                        trainer.model.load_state_dict(model.state_dict())
                        trainer.run(progress=False)
                        model = trainer.model
                    else:
                        passes, skipped = _train_offline(
                            model, train_logs, learner, study, k, torch.Generator().manual_seed(seed + n),
                            lambda m: _ope(m, env, held_out, k)["ope_snips"])
                    value = policy_value(model, env, OptimalLSR(), k, study.num_outputs)
                    runs.append({"env": env.name, "K": k, "n": n, "seed": seed, "learner": learner,
                                 "true_value": value, "logging_greedy_value": start_value,
                                 "logged_mean_reward": logged_mean, **_ope(model, env, held_out, k),
                                 "passes": passes, "skipped_steps": skipped,
                                 "seconds": round(time.perf_counter() - started, 2)})
                    bar.update(n)
            write_json(out / "results.json", {"study": asdict(study), "env": env.name, "runs": runs})
    bar.close()
    return _summarize(study, env, runs, out)


def _summarize(study: OffPolicyStudy, env: MatrixEnv, runs: Sequence[dict], out: Path) -> str:
    write_csv(out / "results.csv", runs)
    write_json(out / "results.json", {"study": asdict(study), "env": env.name, "runs": list(runs)})
    header = ["K", "n", "learner", "true value (mean ± se)", "gain / on-policy gain", "OPE IPS", "OPE SNIPS",
              "passes", "seeds"]
    table, cells = [], {}
    for r in runs:
        cells.setdefault((r["K"], r["n"], r["learner"]), []).append(r)
    for (k, n, learner), group in cells.items():
        mean, se = mean_se([r["true_value"] for r in group])
        start = sum(r["logging_greedy_value"] for r in group) / len(group)
        on = cells.get((k, n, "capg_onpolicy"))
        ratio = "–"
        if on:
            on_mean = sum(r["true_value"] for r in on) / len(on)
            ratio = f"{(mean - start) / (on_mean - start):.2f}" if on_mean != start else "–"
        ips = sum(r["ope_ips"] for r in group) / len(group)
        snips = sum(r["ope_snips"] for r in group) / len(group)
        passes = sum(r.get("passes", 1) for r in group) / len(group)
        table.append([k, n, LEARNERS[learner], mean_pm_se(mean, se, 3), ratio, f"{ips:.3f}", f"{snips:.3f}",
                      f"{passes:.3g}", len(group)])
    ranking = []
    for k in study.ks:
        for n in study.sizes:
            per_seed = [[r for r in runs if (r["K"], r["n"], r["seed"]) == (k, n, seed)] for seed in study.seeds]
            per_seed = [group for group in per_seed if len(group) > 2]
            if per_seed:
                ips = sum(_rank_correlation(g, "ope_ips") for g in per_seed) / len(per_seed)
                snips = sum(_rank_correlation(g, "ope_snips") for g in per_seed) / len(per_seed)
                ranking.append([k, n, f"{ips:.2f}", f"{snips:.2f}", len(per_seed)])
    starts = {(r["K"], r["seed"]): (r["logging_greedy_value"], r["logged_mean_reward"]) for r in runs}
    lines = [f"- K={k}, seed {s}: greedy value of the logging ESR's model {g:.3f}; mean expected reward of the "
             f"logged (τ₀ = {study.logging_temperature}) impressions {m:.3f}" for (k, s), (g, m) in starts.items()]
    text = (f"# offpolicy: {env.name}\n\nTrue value: the greedy ESR's exact policy value (all {env.num_users} "
            f"users, optimal LSR, L = {study.num_outputs}); best achievable "
            f"{env.optimal_value(study.num_outputs):.3f}. OPE: IPS / SNIPS estimates of the same greedy ESR from "
            f"{study.eval_rows} held-out logged rows (target: the value if the LSR showed items at the logging "
            f"rate). Weights capped at {study.max_weight}. Passes: over the n logged rows, up to {study.epochs}, "
            f"the one with the best held-out SNIPS estimate kept (mean over seeds; on-policy: each interaction "
            f"once).\n\n" + markdown_table(header, table)
            + "\nDo the OPE estimates rank the learned ESRs as their true values do? Spearman correlation across "
              "learners, mean over seeds:\n\n"
            + (markdown_table(["K", "n", "IPS vs true", "SNIPS vs true", "seeds"], ranking) if ranking else
               "(not computed: it needs more than two learners run on the same logs)\n")
            + "\nStarting points:\n\n" + "\n".join(lines) + "\n")
    (out / "results.md").write_text(text, encoding="utf-8")
    _plot(cells, study, out)
    return text


def _rank_correlation(group: Sequence[dict], key: str) -> float:
    """Spearman correlation of ``key`` with the true value across ``group`` (ties broken by order)."""
    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0] * len(values)
        for rank, i in enumerate(order):
            out[i] = rank
        return out

    a, b = ranks([r[key] for r in group]), ranks([r["true_value"] for r in group])
    n = len(group)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b)) / (n * (n * n - 1))


def _plot(cells: dict, study: OffPolicyStudy, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(study.ks), figsize=(4.6 * len(study.ks), 3.6), squeeze=False)
    for ax, k in zip(axes[0], study.ks):
        for learner in study.learners:
            xs, ys, es = [], [], []
            for n in study.sizes:
                group = cells.get((k, n, learner))
                if group:
                    mean, se = mean_se([r["true_value"] for r in group])
                    xs.append(n)
                    ys.append(mean)
                    es.append(se)
            if xs:
                ax.errorbar(xs, ys, yerr=es, marker="o", ms=3, lw=1, capsize=2, label=LEARNERS[learner])
        starts = [r["logging_greedy_value"] for group in cells.values() for r in group if r["K"] == k]
        if starts:
            ax.axhline(sum(starts) / len(starts), color="gray", ls="--", lw=0.8, label="logging ESR (greedy)")
        ax.set_xscale("log")
        ax.set_title(f"K = {k}")
        ax.set_xlabel("logged interactions n")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("true policy value (greedy ESR)")
    legend_below(fig, axes[0], fontsize=7)
    fig.savefig(out / "values.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    for learner in study.learners:
        pts = [(r["true_value"], r["ope_ips"], r["ope_snips"]) for group in cells.values() for r in group
               if r["learner"] == learner]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, label=f"{LEARNERS[learner]} (IPS)")
    lims = ax.get_xlim()
    ax.plot(lims, lims, color="gray", ls="--", lw=0.8)
    ax.set_xlabel("true value")
    ax.set_ylabel("OPE estimate (IPS)")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "ope.png", dpi=120)
    plt.close(fig)
