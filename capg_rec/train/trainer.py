"""Online training of an ESR behind a fixed LSR, as in the paper's experiments.

Each step: sample B users, draw K candidates from the current ESR (exact PL(-MoE) sampling),
let the LSR pick L of them, observe noisy rewards, take a policy-gradient step with the chosen
estimator. Every ``eval_every`` steps the *greedy* ESR (its top-K) is scored exactly: the policy
value is the mean over all users of the expected ``q`` of the evaluation LSR's picks.

All randomness flows through one ``torch.Generator`` seeded from the config, and checkpoints
store its state, so a resumed run continues bit-identically (file format: :mod:`capg_rec.train.checkpoint`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from capg_rec._checks import all_finite, check_count, check_items, is_int
from capg_rec.catalog import DenseCatalog
from capg_rec.losses import CAPGLoss, VPGLoss
from capg_rec.marginals import Enumeration
from capg_rec.plackett_luce import greedy_candidates, sample_candidates, unresolved_draws
from capg_rec.rewards import dcg_weights, group_normalize
from capg_rec.sim.env import MatrixEnv
from capg_rec.sim.lsr import LSRPolicy, make_lsr
from capg_rec.train.checkpoint import CHECKPOINT_VERSION, read_checkpoint, write_checkpoint
from capg_rec.train.config import TrainConfig
from capg_rec.train.model import TwoTowerMoE
from capg_rec.train.report import json_text

__all__ = ["Trainer", "TrainResult", "policy_value", "make_loss"]

_EVAL_CHUNK = 256


def make_loss(config: TrainConfig, *, validate_args: bool = True) -> torch.nn.Module:
    """The loss module of ``config.estimator``."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    k = config.num_candidates
    common = dict(temperature=config.temperature, validate_args=validate_args)
    if config.estimator == "vpg":
        return VPGLoss(k, **common)
    if config.estimator == "vpg_swr":
        return VPGLoss(k, with_replacement=True, **common)
    if config.estimator == "capg":
        return CAPGLoss(k, **common) if config.capg_method is None else \
            CAPGLoss(k, method=config.capg_method, **common)
    return CAPGLoss(k, method="with_replacement", **common)


@torch.no_grad()
def policy_value(model: torch.nn.Module, env: MatrixEnv, lsr: LSRPolicy, num_candidates: int,
                 num_outputs: int, *, temperature: float = 1.0, seed: int = 0) -> float:
    """Exact value of the greedy ESR (top-K logits) under ``lsr``: mean over all users of the
    expected mean ``q`` of the L picks. Uses ``lsr.expected_value`` when the ranker has it,
    otherwise one draw of ``lsr`` with a generator seeded by ``seed`` (exact if deterministic). NaN when the
    model's logits are not finite (an optimizer step that overflowed the parameters)."""
    if not callable(model):
        raise TypeError(f"model must be a callable of user ids (a torch.nn.Module), got {type(model).__name__}")
    if not all(hasattr(env, name) for name in ("num_users", "num_items", "ranking_scores", "expected_reward")):
        raise TypeError(f"env must be an environment (a MatrixEnv, an OnDemandSyntheticEnv), got {type(env).__name__}")
    if not (callable(lsr) or hasattr(lsr, "expected_value")):
        raise TypeError(f"lsr must be an LSR (a callable, or one with expected_value), got {type(lsr).__name__}")
    generator = torch.Generator().manual_seed(check_count("seed", seed, low=0, high=2**64 - 1))
    total = 0.0
    for start in range(0, env.num_users, _EVAL_CHUNK):
        users = torch.arange(start, min(start + _EVAL_CHUNK, env.num_users))
        logits = model(users)
        if logits.shape[-1] != env.num_items:  # a model of another catalog never retrieves the rest
            raise ValueError(f"model must score the environment's {env.num_items} items, its logits have "
                             f"{logits.shape[-1]}")
        if not all_finite(logits):
            return math.nan
        candidates = greedy_candidates(logits, num_candidates, temperature=temperature)
        scores = env.ranking_scores(users, candidates)
        q = env.expected_reward(users, candidates)
        if hasattr(lsr, "expected_value"):
            values = lsr.expected_value(scores, q, num_outputs)
        else:
            picks, _ = lsr(scores, num_outputs, generator)
            values = q.gather(1, picks).mean(dim=1)
        total += float(values.double().sum())
    return total / env.num_users


@dataclass
class TrainResult:
    """What a run produced: the learning curve and the overflow record (no tensors).

    Attributes:
        config: the run's config as a dict (with the LSRs it used).
        history: one row per evaluation: ``step``, ``policy_value``, the mean ``loss`` since the last, ``overflows``
            (a run from logs adds its off-policy estimates).
        overflow_steps: the steps whose loss or gradient was not finite.
        stopped_at: the step an overflow stopped the run at (``on_overflow="stop"``), or None.
        steps_done, lr, seconds: steps taken, the learning rate used, seconds spent training.

    Example:
        >>> result = TrainResult(config={}, history=[{"step": 0, "policy_value": 1.5}], overflow_steps=[7])
        >>> result.final_value, result.overflow_count, result.stopped_at
        (1.5, 1, None)
    """

    config: dict
    history: list[dict] = field(default_factory=list)
    overflow_steps: list[int] = field(default_factory=list)
    stopped_at: int | None = None
    steps_done: int = 0
    lr: float = 0.0
    seconds: float = 0.0

    @property
    def final_value(self) -> float:
        return self.history[-1]["policy_value"]

    @property
    def overflow_count(self) -> int:
        return len(self.overflow_steps)

    def to_dict(self) -> dict:
        return {"config": self.config, "history": self.history, "overflow_steps": self.overflow_steps,
                "overflow_count": self.overflow_count, "stopped_at": self.stopped_at,
                "steps_done": self.steps_done, "lr": self.lr, "seconds": self.seconds,
                "final_value": self.final_value}


class Trainer:
    """Online PG training of a :class:`TwoTowerMoE` ESR on a :class:`MatrixEnv`.

    ``train_lsr`` / ``eval_lsr`` override the config's named rankers with any LSR callable (or another name). The
    run's files and checkpoint record what was used (a callable as ``"custom: <its repr>"``), and a checkpoint of a
    run with a callable is loaded only with a callable passed again (it cannot be saved).

    Args:
        env: the :class:`MatrixEnv` (K and the evaluation's K at most its N items).
        config: the :class:`TrainConfig`; its ``seed`` seeds the one generator of the run (model, draws, rewards).
        train_lsr, eval_lsr: LSR callables or names in place of the config's (None: the config's).

    Shape:
        ``model(users [B]) → logits [B, M, N]``; ``baseline_table``, ``baseline_seen``: ``[U]``.

    Example:
        >>> from capg_rec.sim import synthetic_env
        >>> trainer = Trainer(synthetic_env(num_users=4, num_items=20), TrainConfig(num_candidates=5, steps=10))
        >>> trainer.model(torch.arange(4)).shape, trainer.result.lr        # trainer.run() trains (10 steps)
        (torch.Size([4, 1, 20]), 0.01)
    """

    def __init__(self, env: MatrixEnv, config: TrainConfig, *, train_lsr: LSRPolicy | None = None,
                 eval_lsr: LSRPolicy | None = None) -> None:
        self._setup(env, config, train_lsr, eval_lsr)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.model = TwoTowerMoE(env.num_users, env.num_items, num_experts=config.num_experts,
                                 dim=config.embedding_dim, generator=self.generator)
        self.baseline_table = torch.zeros(env.num_users)
        self.baseline_seen = torch.zeros(env.num_users, dtype=torch.bool)
        self.step_count = 0
        self.interval_losses: list[float] = []  # losses since the last evaluation
        self.result = TrainResult(config=self._recorded_config())
        self.result.lr = config.base_lr * (self.estimate_adaptive_factor() if config.adaptive_lr else 1.0)
        self.optimizer = self._optimizer(self.result.lr)

    # ----------------------------------------------------------------- setup
    def _setup(self, env: MatrixEnv, config: TrainConfig, train_lsr: LSRPolicy | None,
               eval_lsr: LSRPolicy | None) -> None:
        if not isinstance(env, MatrixEnv):
            raise TypeError(f"env must be a MatrixEnv, got {type(env).__name__}")
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        for name in ("num_candidates", "eval_candidates"):
            if (getattr(config, name) or 0) > env.num_items:
                raise ValueError(f"{name} must be at most the environment's {env.num_items} items, got "
                                 f"{getattr(config, name)}")
        self.env, self.config = env, config
        self.train_lsr = make_lsr(train_lsr if train_lsr is not None else config.train_lsr, argument="train_lsr")
        self.eval_lsr = make_lsr(eval_lsr if eval_lsr is not None else config.eval_lsr, argument="eval_lsr")
        self.lsr_labels = {"train_lsr": _lsr_label(train_lsr, config.train_lsr),
                           "eval_lsr": _lsr_label(eval_lsr, config.eval_lsr)}
        self.eval_candidates = config.eval_candidates or config.num_candidates
        self.loss_fn = make_loss(config, validate_args=False)  # the step checks what it does not build itself
        method = getattr(self.loss_fn, "method", None)
        if isinstance(method, Enumeration):  # before any file is written: not at step 1
            method.check_affordable(env.num_items, config.num_candidates)
        self.position_weights = self._position_weights()

    def _position_weights(self) -> Tensor:
        length = self.config.num_outputs
        if self.config.position_weights == "dcg":
            return dcg_weights(length)
        fill = 1.0 / length if self.config.position_weights == "mean" else 1.0
        return torch.full((length,), fill)

    def _optimizer(self, lr: float) -> torch.optim.Optimizer:
        params = self.model.parameters()  # fused: one kernel per step for all parameters
        if self.config.optimizer == "adagrad":
            return torch.optim.Adagrad(params, lr=lr, fused=True)
        if self.config.optimizer == "adam":
            return torch.optim.Adam(params, lr=lr, fused=True)
        return torch.optim.SGD(params, lr=lr, fused=True)

    @torch.no_grad()
    def estimate_adaptive_factor(self) -> float:
        """``1 / E[π_LSR(pick | x, A^K)]`` under the initial ESR (Monte-Carlo, the paper's
        adaptive learning rate), from ``adaptive_lr_batches`` batches of the run's generator."""
        total, count = 0.0, 0
        for _ in range(self.config.adaptive_lr_batches):
            users, candidates = self._sample(self.config.batch_size)
            _, propensities = self.train_lsr(self.env.ranking_scores(users, candidates),
                                             self.config.num_outputs, self.generator)
            if propensities is None:
                raise ValueError("adaptive_lr needs an LSR that returns propensities (got None)")
            total += float(propensities.double().sum())
            count += propensities.numel()
        return count / total

    # ------------------------------------------------------------- one step
    def _sample(self, batch_size: int) -> tuple[Tensor, Tensor]:
        users = self.env.sample_users(batch_size, self.generator)
        logits = self.model(users).detach()
        return users, sample_candidates(logits, self.config.num_candidates,
                                        temperature=self.config.temperature, generator=self.generator)

    def _baseline(self, users: Tensor, rewards: Tensor) -> Tensor | None:
        """Per-user moving average of past mean rewards (unseen users: this batch's mean)."""
        if self.config.baseline == "none":
            return None
        observed = rewards.mean(dim=1)
        baseline = torch.where(self.baseline_seen[users], self.baseline_table[users], observed.mean())
        counts = torch.zeros(self.env.num_users).index_add_(0, users, torch.ones_like(observed))
        sums = torch.zeros(self.env.num_users).index_add_(0, users, observed)
        hit = counts > 0
        batch_mean = sums[hit] / counts[hit]
        decay = self.config.baseline_decay
        old = self.baseline_table[hit]
        self.baseline_table[hit] = torch.where(self.baseline_seen[hit], decay * old + (1 - decay) * batch_mean,
                                               batch_mean)
        self.baseline_seen[hit] = True
        return baseline

    def step(self) -> tuple[float, bool]:
        """One training step → ``(loss, overflowed)``.

        A non-finite loss or gradient is a *gradient overflow*: it is recorded in
        ``result.overflow_steps``, no parameter changes, and with ``on_overflow="stop"`` the run
        is marked stopped (``result.stopped_at``). An update that makes the parameters non-finite (finite
        gradients, a learning rate far too large) shows as an overflow of the next step, whose logits are
        not finite (the policy value is then NaN), or so far apart that the draw cannot tell them apart
        (:func:`~capg_rec.plackett_luce.unresolved_draws`).
        """
        self.step_count += 1
        loss, overflowed = self._step()
        if overflowed:
            self.result.overflow_steps.append(self.step_count)
            if self.config.on_overflow == "stop":
                self.result.stopped_at = self.step_count
        return loss, overflowed

    def _step(self) -> tuple[float, bool]:
        cfg = self.config
        users = self.env.sample_users(cfg.batch_size, self.generator)
        if cfg.group_size > 1:
            users = users.repeat_interleave(cfg.group_size)
        logits = self.model(users)
        if not all_finite(logits):  # checked once here: the sampler and the loss skip their checks
            return math.nan, True
        catalog = DenseCatalog(logits.detach(), cfg.temperature, validate_args=False)
        if unresolved_draws(catalog, cfg.num_candidates, ordered=True).any():  # logits too far apart to draw from
            return math.nan, True
        candidates = sample_candidates(catalog, cfg.num_candidates, generator=self.generator, validate_args=False)
        picks, _ = self.train_lsr(self.env.ranking_scores(users, candidates), cfg.num_outputs, self.generator)
        picks = check_items("the LSR's picks", picks, batch_size=len(users), num_items=cfg.num_candidates)
        chosen = candidates.gather(1, picks)
        rewards = self.env.sample_reward(users, chosen, self.generator)
        if cfg.group_size > 1:
            grouped = rewards.view(cfg.batch_size, cfg.group_size, cfg.num_outputs)
            rewards = group_normalize(grouped, offset=cfg.group_offset, dim=1, validate_args=False).view_as(rewards)
        baseline = self._baseline(users, rewards)
        loss = self.loss_fn(logits, candidates, chosen, rewards, position_weights=self.position_weights,
                            baseline=baseline)
        return self._apply(loss)

    def _apply(self, loss: Tensor) -> tuple[float, bool]:
        """Backward and optimizer step of ``loss`` → ``(loss, overflowed)``: nothing changes when the loss
        or a gradient is not finite."""
        self.optimizer.zero_grad(set_to_none=True)
        if not bool(torch.isfinite(loss)):
            return float(loss.detach()), True
        loss.backward()
        if not all(all_finite(p.grad) for p in self.model.parameters() if p.grad is not None):
            self.optimizer.zero_grad(set_to_none=True)
            return float(loss.detach()), True
        self.optimizer.step()
        return float(loss.detach()), False

    def evaluate(self) -> float:
        """Exact policy value of the current greedy ESR under the evaluation LSR."""
        return policy_value(self.model, self.env, self.eval_lsr, self.eval_candidates, self.config.num_outputs,
                            temperature=self.config.temperature, seed=self.config.seed + self.step_count)

    # ------------------------------------------------------------------ run
    def run(self, *, out_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
            progress: bool = True) -> TrainResult:
        """Train until ``config.steps`` (or an overflow with ``on_overflow="stop"``).

        With ``out_dir``: appends each evaluation to ``metrics.jsonl``, writes ``result.json`` at
        the end and, every ``checkpoint_every`` steps and at the end, an atomic ``checkpoint.pt``.
        """
        from tqdm.auto import tqdm

        cfg = self.config
        out = Path(out_dir) if out_dir is not None else None
        if checkpoint_every is not None:  # checked before anything is written
            check_count("checkpoint_every", checkpoint_every)
            if out is None:
                raise ValueError("checkpoint_every needs an out_dir to write the checkpoints to")
        if out is not None:  # metrics.jsonl mirrors the history (a resumed run drops later rows)
            out.mkdir(parents=True, exist_ok=True)
            _atomic_write_text(out / "metrics.jsonl", "".join(json_text(r) + "\n" for r in self.result.history))
        if not self.result.history:
            self._record(out, None)
        started = time.perf_counter()
        bar = tqdm(total=self.num_steps, initial=self.step_count, disable=not progress,
                   desc=f"{cfg.label} K={cfg.num_candidates}", leave=False)
        try:  # the bar is closed before an error is reported (left open, its clean-up erased the message)
            while self.step_count < self.num_steps and self.result.stopped_at is None:
                loss, overflowed = self.step()
                bar.update(1)
                if not overflowed:
                    self.interval_losses.append(loss)
                if self.step_count % cfg.eval_every == 0 or self.step_count == self.num_steps or \
                        self.result.stopped_at is not None:
                    losses = self.interval_losses
                    mean_loss = sum(losses) / len(losses) if losses else None
                    if self.step_count % cfg.eval_every == 0:  # an off-grid end-of-run row keeps them
                        losses.clear()
                    self._record(out, mean_loss)
                    bar.set_postfix_str(self._progress_text(self.result.history[-1]))
                if checkpoint_every is not None and self.step_count % checkpoint_every == 0:
                    self.save(out / "checkpoint.pt")
        finally:
            bar.close()
        if checkpoint_every is not None and self.step_count % checkpoint_every:  # the end, off the grid
            self.save(out / "checkpoint.pt")
        self.result.steps_done = self.step_count
        self.result.seconds += time.perf_counter() - started
        if out is not None:
            # reproduce reuses a run of this env only (training from logs may have none)
            record = dict(self.result.to_dict(), env=None if self.env is None else self.env.name)
            _atomic_write_text(out / "result.json", json_text(record, indent=1))
        return self.result

    @property
    def num_steps(self) -> int:
        """The step the run ends at."""
        return self.config.steps

    def _evaluation(self) -> dict:
        """The evaluation columns of a metrics row."""
        return {"policy_value": self.evaluate()}

    @staticmethod
    def _progress_text(row: dict) -> str:
        return f"value={row['policy_value']:.3f}"

    def _record(self, out: Path | None, mean_loss: float | None) -> None:
        row = {"step": self.step_count, **self._evaluation(), "loss": mean_loss,
               "overflows": self.result.overflow_count}
        self.result.history.append(row)
        if out is not None:
            with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json_text(row) + "\n")

    # ---------------------------------------------------------- checkpoints
    def _recorded_config(self) -> dict:
        """The config as the run's files record it: with the LSRs it used (a callable's label, see :class:`Trainer`)."""
        return {**self.config.to_dict(), **self.lsr_labels}

    def state_dict(self) -> dict:
        """Everything a resume needs, as containers of tensors, numbers and strings."""
        return {"version": CHECKPOINT_VERSION, "config": self.config.to_dict(), "lsrs": self.lsr_labels,
                "env": self.env.name,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(), "baseline_table": self.baseline_table,
                "baseline_seen": self.baseline_seen, "step": self.step_count, "interval_losses": self.interval_losses,
                "result": self.result.to_dict() if self.result.history else None, "lr": self.result.lr}

    def save(self, path: str | os.PathLike) -> None:
        """Write a checksummed checkpoint atomically; the one it replaces is kept as ``<path>.prev``
        (see :func:`~capg_rec.train.checkpoint.write_checkpoint`)."""
        write_checkpoint(self.state_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike, env: MatrixEnv, *, train_lsr: LSRPolicy | None = None,
             eval_lsr: LSRPolicy | None = None, steps: int | None = None) -> Trainer:
        """Rebuild a trainer from a checkpoint file (verified, falling back to ``<path>.prev`` if it
        is corrupt: :func:`~capg_rec.train.checkpoint.read_checkpoint`); see :meth:`from_state`."""
        return cls.from_state(read_checkpoint(path), env, train_lsr=train_lsr, eval_lsr=eval_lsr, steps=steps)

    @classmethod
    def from_state(cls, state: dict, env: MatrixEnv, *, train_lsr: LSRPolicy | None = None,
                   eval_lsr: LSRPolicy | None = None, steps: int | None = None) -> Trainer:
        """Rebuild a trainer from a :meth:`state_dict` on the env it was trained on. The run keeps
        its saved config; ``steps`` (> the saved step) sets another target."""
        if state.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"checkpoint version must be {CHECKPOINT_VERSION}, got {state.get('version')!r}")
        if "kind" in state:
            raise ValueError(f"the checkpoint is of a run trained from {state['kind']}, not online: load it with "
                             "capg_rec.train.logged.LogTrainer")
        config = TrainConfig(**state["config"])
        if steps is not None:
            if not is_int(steps):
                raise TypeError(f"steps must be an int, got {type(steps).__name__} {steps!r}")
            if steps <= state["step"]:
                raise ValueError(f"steps must be an int > the checkpoint's step {state['step']} to continue "
                                 f"the run, got {steps!r}")
            steps = int(steps)
            config = config.replace(steps=steps)
        given = {"train_lsr": train_lsr, "eval_lsr": eval_lsr}
        for name, label in state.get("lsrs", {}).items():
            if given[name] is None and label.startswith(_CUSTOM):  # a callable is not saved: it must come again
                raise ValueError(f"the run trained with a {name} of its own ({label}): pass it again to go on "
                                 f"(Trainer.load(path, env, {name}=...); the command line cannot)")
            if given[name] is None and label != state["config"][name]:  # another name, given to Trainer
                given[name] = label
        trainer = cls.__new__(cls)
        trainer._setup(env, config, given["train_lsr"], given["eval_lsr"])
        if env.name != state["env"]:
            raise ValueError(f"env must be the checkpoint's {state['env']!r}, got {env.name!r}")
        shape = tuple(state["model"]["user"].shape[1:2]) + tuple(state["model"]["item"].shape[1:2])
        if shape != (env.num_users, env.num_items):
            raise ValueError(f"env must have the checkpoint's (users, items) = {shape}, "
                             f"got {(env.num_users, env.num_items)}")
        trainer.generator = torch.Generator()
        trainer.generator.set_state(state["generator"])
        trainer.model = TwoTowerMoE(env.num_users, env.num_items, num_experts=config.num_experts,
                                    dim=config.embedding_dim)
        trainer.model.load_state_dict(state["model"])
        trainer.baseline_table, trainer.baseline_seen = state["baseline_table"], state["baseline_seen"]
        trainer.step_count = state["step"]
        trainer.interval_losses = state["interval_losses"]
        trainer._restore_result(state, extended=steps is not None and steps != state["config"]["steps"])
        trainer.optimizer = trainer._optimizer(state["lr"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        return trainer

    def _restore_result(self, state: dict, *, extended: bool) -> None:
        """``self.result`` from a :meth:`state_dict` (``step_count`` and ``config`` already restored; ``extended``:
        to a target other than the saved run's)."""
        saved = state["result"]
        self.result = TrainResult(config=self._recorded_config(), lr=state["lr"])
        if saved is not None:
            stopped = saved["stopped_at"]
            if stopped is not None and self.step_count < self.num_steps:
                what = "cannot go on to a later target" if extended else "is over (its result.json holds its values)"
                raise ValueError(f"the run stopped at step {stopped} on a gradient overflow (on_overflow='stop'): it "
                                 f"{what}; start a new run (e.g. with a lower learning rate, or on_overflow='skip')")
            history = saved["history"]
            if history and history[-1]["step"] % self.config.eval_every and self.step_count < self.num_steps:
                history = history[:-1]  # the end-of-run evaluation of a run now extended
            self.result.history = history
            self.result.overflow_steps = saved["overflow_steps"]
            self.result.stopped_at = saved["stopped_at"]
            self.result.seconds = saved["seconds"]


_CUSTOM = "custom: "


def _lsr_label(given: LSRPolicy | str | None, configured: str) -> str:
    """How a run records the LSR it used: the config's name, another name given, or a callable's repr."""
    if given is None:
        return configured
    return given if isinstance(given, str) else f"{_CUSTOM}{given!r}"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
