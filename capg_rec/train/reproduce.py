"""The paper's experiments as runnable targets, with its numbers side by side.

Each target is a grid of (method, setting) cells, run for several seeds. Runs are resumable:
a finished run (``result.json``) is reused, an interrupted one restarts from its checkpoint.
Writes ``results.md`` / ``results.csv`` / ``results.json`` and ``curves.png`` into the output dir.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from capg_rec._checks import check_distinct
from capg_rec.sim.env import MatrixEnv
from capg_rec.train.checkpoint import read_checkpoint
from capg_rec.train.config import ESTIMATOR_LABELS, TrainConfig
from capg_rec.train.report import markdown_table, mean_pm_se, mean_se, plot_curves, value_at, write_csv, write_json
from capg_rec.train.trainer import Trainer, TrainResult

__all__ = ["Cell", "TARGETS", "build_target", "run_cells", "summarize"]

TARGETS = ("table2", "table3", "movielens", "kuairec", "grpo")

# The paper's numbers: (method, setting) -> (value @50K, value @500K); None where not reported.
_PAPER_TABLE2 = {
    "vpg": {"K=5": (7.09, 7.22), "K=10": (7.16, 7.17), "K=20": (6.86, 6.86), "noisy": (7.25, 7.25),
            "uniform": (3.27, 3.28), "anti": (1.07, 1.07)},
    "vpg_swr": {"K=5": (7.68, 8.33), "K=10": (7.80, 8.54), "K=20": (7.88, 8.74), "noisy": (7.86, 8.55),
                "uniform": (3.80, 6.39), "anti": (1.05, 1.08)},
    "capg": {"K=5": (7.39, 8.19), "K=10": (7.99, 8.44), "K=20": (8.39, 8.70), "noisy": (8.14, 8.42),
             "uniform": (5.64, 6.73), "anti": (1.00, 1.00)},
    "capg_swr": {"K=5": (7.37, 8.11), "K=10": (7.94, 8.40), "K=20": (8.33, 8.62), "noisy": (8.11, 8.41),
                 "uniform": (5.79, 6.90), "anti": (1.00, 1.00)},
}
_LSR_COLUMNS = ("noisy", "uniform", "anti")
"""table2's LSR-alignment columns (``lsr``)."""
_PAPER_TABLE3 = {  # @500K only; L = 5 values are sums over the 5 positions
    "vpg": {"L=1,M=1": 7.17, "L=1,M=5": 7.63, "L=5,M=1": 25.0, "L=5,M=5": 26.5},
    "vpg_swr": {"L=1,M=1": 8.54, "L=1,M=5": 8.58, "L=5,M=1": 38.1, "L=5,M=5": 37.2},
    "capg": {"L=1,M=1": 8.44, "L=1,M=5": 8.88, "L=5,M=1": 36.2, "L=5,M=5": 37.2},
    "capg_swr": {"L=1,M=1": 8.40, "L=1,M=5": 8.82, "L=5,M=1": 36.3, "L=5,M=5": 37.6},
}
_PAPER_GRPO = {
    "vpg_swr": {"K=20": (8.71, 8.88), "K=50": (8.84, 8.98), "K=100": (8.93, 9.02), "K=200": (9.00, 9.06)},
    "capg_swr": {"K=20": (8.58, 8.97), "K=50": (8.89, 9.07), "K=100": (9.02, 9.10), "K=200": (9.08, 9.11)},
}
_PAPER_KUAIREC = {
    "vpg_swr": {"K=50": (5.05, 7.91), "K=100": (5.39, 8.22), "K=200": (5.92, 8.26)},
    "capg_swr": {"K=50": (5.61, 7.19), "K=100": (6.37, 7.82), "K=200": (7.10, 8.32)},
}
_GRPO_GROUP, _GRPO_OFFSET = 4, 1.0


@dataclass(frozen=True)
class Cell:
    """One (method, setting) of a target; ``scale`` converts our per-position mean to the
    paper's unit (L for its sum-over-positions values). No tensors.

    Attributes:
        setting: the table column, e.g. ``"K=10"`` or ``"noisy"``.
        config: the run's :class:`~capg_rec.train.config.TrainConfig` (its estimator is the row, :attr:`method`).
        paper: the paper's values at 50K and 500K steps (None where it reports none; default both None).
        scale: default 1.0.

    Example:
        >>> factory, cells = build_target("table2", steps=1000)          # factory() builds the environment
        >>> cells[0].setting, cells[0].method, cells[0].paper
        ('K=5', 'V-PG-SwR', (7.68, 8.33))
    """

    setting: str
    config: TrainConfig
    paper: tuple[float | None, float | None] = (None, None)
    scale: float = 1.0

    @property
    def method(self) -> str:
        label = ESTIMATOR_LABELS[self.config.estimator]
        return f"{label} ({self.config.capg_method})" if self.config.capg_method else label


def _estimators(estimators: Sequence[str] | None, default: Sequence[str]) -> list[str]:
    chosen = list(estimators) if estimators else list(default)
    check_distinct("estimators", chosen)
    for e in chosen:
        if e not in ESTIMATOR_LABELS:
            raise ValueError(f"estimators must be among {tuple(ESTIMATOR_LABELS)}, got {e!r}")
    return chosen


def build_target(target: str, *, steps: int, estimators: Sequence[str] | None = None,
                 data: str | os.PathLike | None = None, lsr: Sequence[str] = (),
                 ks: Sequence[int] | None = None, eval_every: int = 1000,
                 capg_method: str | None = None) -> tuple[Callable[[], MatrixEnv], list[Cell]]:
    """``(env factory, cells)`` of a target. ``lsr`` adds table2's LSR-alignment columns (K = 10,
    the train LSR is also the evaluation LSR, CA-PGs with the adaptive learning rate);
    ``capg_method`` sets the inclusion method of the CA-PG (``capg``) cells."""
    if ks is not None:
        check_distinct("ks", ks)
    factory, cells = _target_cells(target, steps=steps, estimators=estimators, data=data, lsr=lsr, ks=ks,
                                   eval_every=eval_every)
    if capg_method is not None:
        if not any(c.config.estimator == "capg" for c in cells):
            raise ValueError(f"capg_method applies to the 'capg' estimator, which target {target!r} does not run "
                             f"here: add 'capg' to estimators (got capg_method={capg_method!r})")
        cells = [Cell(c.setting, c.config.replace(capg_method=capg_method), c.paper, c.scale)
                 if c.config.estimator == "capg" else c for c in cells]
    return factory, cells


def _target_cells(target: str, *, steps: int, estimators: Sequence[str] | None,
                  data: str | os.PathLike | None, lsr: Sequence[str], ks: Sequence[int] | None,
                  eval_every: int) -> tuple[Callable[[], MatrixEnv], list[Cell]]:
    base = TrainConfig(steps=steps, eval_every=eval_every)
    cells: list[Cell] = []
    if target == "table2":
        from capg_rec.sim.synthetic import synthetic_env

        for est in _estimators(estimators, ("vpg_swr", "capg_swr")):
            for k in ks or (5, 10, 20):
                cells.append(Cell(f"K={k}", base.replace(estimator=est, num_candidates=k),
                                  _PAPER_TABLE2[est].get(f"K={k}", (None, None))))
            for name in lsr:
                if name not in _LSR_COLUMNS:  # a KeyError before
                    raise ValueError(f"lsr must hold table2's LSR columns ({', '.join(_LSR_COLUMNS)}), got {name!r}")
                cfg = base.replace(estimator=est, train_lsr=name, eval_lsr=name,
                                   adaptive_lr=est.startswith("capg"))
                cells.append(Cell(name, cfg, _PAPER_TABLE2[est][name]))
        return synthetic_env, cells
    if target == "table3":
        from capg_rec.sim.synthetic import synthetic_env

        for est in _estimators(estimators, ("vpg_swr", "capg_swr")):
            for length in (1, 5):
                for experts in (1, 5):
                    key = f"L={length},M={experts}"
                    cfg = base.replace(estimator=est, num_outputs=length, num_experts=experts)
                    cells.append(Cell(key, cfg, (None, _PAPER_TABLE3[est][key]), scale=float(length)))
        return synthetic_env, cells
    if target == "grpo":
        from capg_rec.sim.synthetic import synthetic_env

        for est in _estimators(estimators, ("vpg_swr", "capg_swr")):
            offset = _GRPO_OFFSET if est.startswith("capg") else 0.0  # the paper's best choice for V-PG
            for k in ks or (20, 50, 100, 200):
                cfg = base.replace(estimator=est, num_candidates=k, num_experts=5, group_size=_GRPO_GROUP,
                                   group_offset=offset)
                cells.append(Cell(f"K={k}", cfg, _PAPER_GRPO.get(est, {}).get(f"K={k}", (None, None))))
        return synthetic_env, cells
    if target in ("movielens", "kuairec"):
        if target == "kuairec":
            if data is None:
                raise ValueError("data must be the path of KuaiRec's small_matrix.csv for target 'kuairec'")
            from capg_rec.sim.kuairec import load_kuairec

            def factory() -> MatrixEnv:
                return load_kuairec(data)
            paper = _PAPER_KUAIREC
        else:
            from capg_rec.sim.movielens import movielens_env as factory
            paper = {}
        for est in _estimators(estimators, ("vpg_swr", "capg_swr")):
            for k in ks or (50, 100, 200):
                cells.append(Cell(f"K={k}", base.replace(estimator=est, num_candidates=k),
                                  paper.get(est, {}).get(f"K={k}", (None, None))))
        return factory, cells
    raise ValueError(f"target must be one of {TARGETS}, got {target!r}")


def _run_dir(out: Path, cell: Cell, seed: int) -> Path:
    slug = cell.setting.replace("=", "").replace(",", "_")
    method = f"_{cell.config.capg_method}" if cell.config.capg_method else ""
    return out / "runs" / f"{cell.config.estimator}{method}_{slug}_seed{seed}"


def run_cells(env: MatrixEnv, cells: Sequence[Cell], seeds: Sequence[int], out: str | os.PathLike, *,
              checkpoint_every: int = 5000, progress: bool = True) -> dict[tuple[str, str], list[TrainResult]]:
    """Run every cell for every seed (resuming finished or checkpointed runs) → results."""
    from tqdm.auto import tqdm

    out = Path(out)
    results: dict[tuple[str, str], list[TrainResult]] = {}
    jobs = [(cell, seed) for cell in cells for seed in seeds]
    for cell, seed in tqdm(jobs, desc="runs", disable=not progress):
        run_dir = _run_dir(out, cell, seed)
        config = cell.config.replace(seed=seed)
        done = run_dir / "result.json"
        if done.exists():
            try:
                saved = json.loads(done.read_text(encoding="utf-8"))
            except ValueError as err:  # a damaged file (a run killed while writing it, an edit)
                raise ValueError(f"{done} is not a readable result ({err}): delete it to train that run again, or "
                                 "give another output folder") from None
            if saved.get("env", env.name) != env.name:
                raise _other_env(run_dir, saved["env"], env)
            same_cell = saved["config"] == config.replace(steps=saved["config"]["steps"]).to_dict()  # any length
            if not same_cell:
                raise _other_run(run_dir, saved["config"], config)
            # the run asked for, or one of another length that stopped on an overflow within this one's steps: the
            # run asked for would stop there too (runs are deterministic)
            stopped_alike = same_cell and saved["stopped_at"] is not None and saved["stopped_at"] <= config.steps
            if same_cell and saved["steps_done"] > config.steps and not stopped_alike:
                raise _longer_run(run_dir, saved["steps_done"], saved["config"]["steps"], config.steps)
            if (saved["config"] == config.to_dict() or stopped_alike) and "env" in saved:
                # a value that was NaN (a diverged run) is saved as null: NaN again
                history = [dict(row, policy_value=math.nan if row["policy_value"] is None else row["policy_value"])
                           for row in saved["history"]]
                result = TrainResult(config=saved["config"], history=history,
                                     overflow_steps=saved["overflow_steps"], stopped_at=saved["stopped_at"],
                                     steps_done=saved["steps_done"], lr=saved["lr"], seconds=saved["seconds"])
                results.setdefault((cell.method, cell.setting), []).append(result)
                continue
        trainer = _resumable(run_dir / "checkpoint.pt", env, config) or Trainer(env, config)
        result = trainer.run(out_dir=run_dir, checkpoint_every=checkpoint_every, progress=progress)
        results.setdefault((cell.method, cell.setting), []).append(result)
    return results


def _resumable(path: Path, env: MatrixEnv, config: TrainConfig) -> Trainer | None:
    """The checkpointed run of ``config`` (or of a shorter one, then extended), else ``None``."""
    try:
        state = read_checkpoint(path)
    except FileNotFoundError:
        return None
    if state["env"] != env.name:  # an interrupted run, as a finished one
        raise _other_env(path.parent, state["env"], env)
    same = state["config"] == config.replace(steps=state["config"]["steps"]).to_dict()
    if not same:
        raise _other_run(path.parent, state["config"], config)
    if same and state["step"] >= config.steps and state["config"]["steps"] != config.steps:
        raise _longer_run(path.parent, state["step"], state["config"]["steps"], config.steps)
    return Trainer.from_state(state, env, steps=config.steps) if same and state["step"] < config.steps else None


def _other_env(run_dir: Path, saved: str, env: MatrixEnv) -> ValueError:
    """What a run on ``env`` raises where ``run_dir`` holds one on the environment named ``saved``."""
    return ValueError(f"{run_dir} holds a run on {saved}, not on {env.name}: give each environment (and data file) "
                      "its own output folder")


class OtherRun(ValueError):
    """A folder holds a run of another configuration, which a run here would overwrite."""


def _other_run(run_dir: Path, saved: dict, config: TrainConfig) -> OtherRun:
    """What a run of ``config`` raises where ``run_dir`` holds a run of another configuration (``saved``, beyond its
    length): it would overwrite that run."""
    wanted = config.to_dict()
    keys = [key for key in sorted(set(saved) | set(wanted)) if key != "steps" and saved.get(key) != wanted.get(key)]
    differ = ", ".join(f"{key}={saved.get(key)!r} there, {wanted.get(key)!r} here" for key in keys)
    return OtherRun(f"{run_dir} holds a run of another configuration ({differ}): a run here would overwrite it; "
                    "give another output folder")


def _longer_run(run_dir: Path, step: int, target: int, steps: int) -> ValueError:
    """What a run of ``steps`` raises where ``run_dir`` holds a longer one of the same cell (at ``step`` of
    ``target``): it would overwrite that run."""
    return ValueError(f"{run_dir} holds this run at step {step} of {target}: a run of {steps} steps would overwrite "
                      "it; give another output folder, or as many steps as the run has")


def _number(x: float) -> int | float:
    """``x`` as an int where it is one (a count of positions), else as is."""
    return int(x) if float(x).is_integer() else x


def summarize(target: str, env: MatrixEnv, cells: Sequence[Cell], results: dict, out: str | os.PathLike,
              *, steps: int) -> str:
    """Write ``results.{md,csv,json}`` and ``curves.png``; return the Markdown text."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    per_run, rows, summary = [], [], []
    for cell in cells:
        runs = results.get((cell.method, cell.setting), [])
        if not runs:
            continue
        values = [value_at(r.history, steps) * cell.scale for r in runs]
        mean, se = mean_se(values)
        overflows = sum(r.overflow_count for r in runs)
        stopped = sum(r.stopped_at is not None for r in runs)
        p50, p500 = cell.paper
        rows.append([cell.method, cell.setting, mean_pm_se(mean, se, 2), len(runs),
                     "–" if p50 is None else f"{p50:.2f}", "–" if p500 is None else f"{p500:.2f}",
                     f"{overflows} ({stopped} stopped)"])
        summary.append({"method": cell.method, "setting": cell.setting, "mean": mean, "se": se, "n": len(runs),
                        "values": values, "paper_50k": p50, "paper_500k": p500, "overflows": overflows,
                        "stopped_runs": stopped, "config": cell.config.to_dict(),
                        "positions_summed": _number(cell.scale)})
        for r in runs:
            per_run.append({"method": cell.method, "setting": cell.setting, "seed": r.config["seed"],
                            "steps_done": r.steps_done, f"value@{steps}": value_at(r.history, steps) * cell.scale,
                            "overflow_count": r.overflow_count, "stopped_at": r.stopped_at, "lr": r.lr,
                            "seconds": round(r.seconds, 1), "positions_summed": _number(cell.scale)})
    unit = " (sum over positions)" if any(c.scale != 1 for c in cells) else ""
    header = ["method", "setting", f"ours @{steps} steps{unit} (mean ± se)", "seeds", "paper @50K",
              "paper @500K", "overflows"]
    best = env.optimal_value(1)
    text = (f"# {target}: {env.name}\n\nPolicy value of the greedy ESR (exact, all {env.num_users} users); "
            f"best achievable (L = 1, under the optimal LSR): {best:.3f}.\n\n" + markdown_table(header, rows))
    (out / "results.md").write_text(text, encoding="utf-8")
    if per_run:
        write_csv(out / "results.csv", per_run)
    write_json(out / "results.json", {"target": target, "env": env.name, "steps": steps,
                                      "best_value": best, "cells": summary, "runs": per_run})
    panels: dict[str, dict[str, list]] = {}
    for cell in cells:  # in the tables' unit (found by review: L = 5 cells were plotted per position, tabled summed)
        for r in results.get((cell.method, cell.setting), []):
            history = [{**row, "policy_value": row["policy_value"] * cell.scale} for row in r.history]
            panels.setdefault(cell.setting, {}).setdefault(cell.method, []).append(history)
    if panels:
        # the best value is the optimal LSR's at L = 1: drawn only on the panels valued so (found by review); panels
        # of sums over positions beside per-position ones get their own y axes
        optimum = {c.setting: best if c.scale == 1 and c.config.num_outputs == 1 and c.config.eval_lsr == "optimal"
                   else None for c in cells}
        plot_curves(panels, out / "curves.png", optimum=optimum, ylabel=f"policy value (greedy ESR){unit}",
                    sharey=len({c.scale for c in cells}) == 1)
    return text
