"""Training an ESR from Parquet logs (``capg-rec train --logs``): the off-policy counterpart of :class:`Trainer`.

The logs (:mod:`capg_rec.logs`, written by ``capg-rec log`` or a serving job) are split by row group: the last
``holdout`` share of them is held out for off-policy evaluation, the others are streamed in shuffled row-group
order for ``epochs`` passes, one optimizer step per batch, with the off-policy estimator of the config. The
model is the trainer's :class:`~capg_rec.train.model.TwoTowerMoE` over the logs' context keys and catalog.
Every ``eval_every`` steps the greedy ESR is scored: exactly on the environment the logs came from, when
there is one (as the online trainer does), and by IPS/SNIPS on the held-out rows
(:func:`~capg_rec.offpolicy_evaluation.off_policy_value`). Progress, checkpoints, resume and the metrics
files are the online trainer's (:meth:`Trainer.run`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from capg_rec._checks import all_finite, is_number
from capg_rec.losses import OffPolicyCAPGLoss, OffPolicyVPGLoss, TopKReinforceLoss
from capg_rec.marginals import DEFAULT_METHOD, inclusion_method, inclusion_methods
from capg_rec.offpolicy_evaluation import OffPolicyEstimate, off_policy_value
from capg_rec.plackett_luce import expert_runs, greedy_candidates
from capg_rec.sim.env import MatrixEnv
from capg_rec.sim.lsr import LSR_NAMES, make_lsr
from capg_rec.train.checkpoint import CHECKPOINT_VERSION, read_checkpoint
from capg_rec.train.config import SEED_MAX, _choice, _int, _num, python_numbers
from capg_rec.train.model import TwoTowerMoE
from capg_rec.train.report import plot_curves, write_csv
from capg_rec.train.trainer import Trainer, TrainResult

if TYPE_CHECKING:
    from capg_rec.logs.schema import LogMetadata, LoggedBatch

__all__ = ["LOG_ESTIMATORS", "LogTrainConfig", "LogTrainer", "eval_lsr_name", "logged_loss", "write_log_reports"]

LOG_ESTIMATORS = {
    "capg": "off-policy CA-PG",
    "capg_snips": "off-policy CA-PG (SNIPS)",
    "capg_swr": "off-policy CA-PG-SwR",
    "vpg_ips": "IPS V-PG",
    "topk_reinforce": "top-K REINFORCE",
    "supervised": "supervised (softmax CE, r > 0)",
}
"""The estimators ``capg-rec train --logs`` offers, by name."""

_LR = {"vpg_ips": 1e-1}  # the paper's V-PG rate; every other estimator uses CA-PG's 1e-2
_ON_OVERFLOW = ("stop", "skip")
_LOGS_CHANGED = "the logs changed since the checkpoint: the files at these paths hold other rows (their bytes differ)"


@dataclass(frozen=True)
class LogTrainConfig:
    """One run of training from logs, validated on creation (no tensors).

    Attributes:
        logs: the Parquet files or directories (a list or tuple; stored as a tuple of resolved paths).
        estimator: one of :data:`LOG_ESTIMATORS` (default ``"capg"``).
        capg_method: the inclusion method of the CA-PG estimators (``None``: the logs' method, that of their
            ``log_inclusion``, when it is a built-in or registered one, else the library default; another one than
            the logs' warns: each weight would be a ratio of two approximations; ``capg_swr`` is ``capg`` with
            ``"with_replacement"``, weighted by the logged expected count).
        max_weight: caps the importance weights (default 100.0; ``None``: only the overflow cap).
        num_candidates, num_outputs: K and L, the logs' (``None`` until read from them).
        num_experts, embedding_dim, temperature, seed: the model's M (1), D (10), τ (1.0) and initial seed (0).
        epochs, batch_size, workers: passes (1) over the training row groups, shuffled by row group with ``seed``,
            in batches of 512 rows read by that many DataLoader workers (0: in this process).
        optimizer, lr: ``"adagrad"`` (or ``"adam"``, ``"sgd"``); lr ``None``: 1e-2, 1e-1 for ``vpg_ips``.
        holdout, eval_every: the share in ``[0, 1)`` of the row groups (the last ones) held out for OPE (0.1);
            evaluate every 100 steps.
        eval_lsr: the LSR that scores the true value (``None``: the LSR recorded in the logs, else optimal).
        on_overflow: ``"stop"`` (default) or ``"skip"``, as :class:`~capg_rec.train.TrainConfig`'s.

    Example:
        >>> config = LogTrainConfig(["logs/"], estimator="vpg_ips")      # paths are not opened here
        >>> config.base_lr, config.label, config.num_candidates
        (0.1, 'IPS V-PG', None)
    """

    logs: tuple[str, ...]
    estimator: str = "capg"
    capg_method: str | None = None
    max_weight: float | None = 100.0
    num_candidates: int | None = None
    num_outputs: int | None = None
    num_experts: int = 1
    embedding_dim: int = 10
    temperature: float = 1.0
    epochs: int = 1
    batch_size: int = 512
    workers: int = 0
    optimizer: str = "adagrad"
    lr: float | None = None
    holdout: float = 0.1
    eval_every: int = 100
    eval_lsr: str | None = None
    on_overflow: str = "stop"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.logs, (str, os.PathLike)) or not isinstance(self.logs, (list, tuple)) or \
                not all(isinstance(p, (str, os.PathLike)) for p in self.logs):
            raise TypeError(f"logs must be a list of paths (a file is [path]), got {self.logs!r}")
        if not self.logs:
            raise ValueError("logs must name at least one file")
        object.__setattr__(self, "logs", tuple(str(Path(p).resolve()) for p in self.logs))
        _choice("estimator", self.estimator, tuple(LOG_ESTIMATORS))
        if self.capg_method is not None:
            _choice("capg_method", self.capg_method, inclusion_methods())
            if not self.estimator.startswith("capg"):
                raise ValueError(f"capg_method is for the CA-PG estimators, got estimator {self.estimator!r}")
            if self.estimator == "capg_swr" and self.capg_method != "with_replacement":
                raise ValueError(f"estimator 'capg_swr' is CA-PG with method 'with_replacement', got capg_method "
                                 f"{self.capg_method!r}")
        if self.max_weight is not None:
            _num("max_weight", self.max_weight, positive=True)
        for name in ("num_candidates", "num_outputs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 1)
        for name in ("num_experts", "embedding_dim", "epochs", "batch_size", "eval_every"):
            _int(name, getattr(self, name), 1)
        _int("workers", self.workers, 0)
        _int("seed", self.seed, 0, SEED_MAX)
        _num("temperature", self.temperature, positive=True)
        if self.lr is not None:
            _num("lr", self.lr, positive=True)
        _num("holdout", self.holdout, positive=False)
        if self.holdout >= 1:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        _choice("optimizer", self.optimizer, ("adagrad", "adam", "sgd"))
        if self.eval_lsr is not None:
            _choice("eval_lsr", self.eval_lsr, LSR_NAMES)
        _choice("on_overflow", self.on_overflow, _ON_OVERFLOW)
        python_numbers(self)

    @property
    def method(self) -> str | None:
        """The CA-PG inclusion method (``None``: the default), ``with_replacement`` for ``capg_swr``."""
        return "with_replacement" if self.estimator == "capg_swr" else self.capg_method

    @property
    def base_lr(self) -> float:
        return self.lr if self.lr is not None else _LR.get(self.estimator, 1e-2)

    @property
    def label(self) -> str:
        return LOG_ESTIMATORS[self.estimator]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: object) -> LogTrainConfig:
        return dataclasses.replace(self, **changes)


def logged_loss(config: LogTrainConfig, num_candidates: int, num_outputs: int
                ) -> Callable[[Tensor, LoggedBatch], Tensor]:
    """``loss(logits [B, M, N], batch)`` of ``config.estimator`` on a :class:`~capg_rec.logs.LoggedBatch`, with
    the logged propensity that estimator's weight needs; positions weighted 1/L, as the online trainer."""
    return _estimator_loss(config.estimator, num_candidates, num_outputs, num_experts=config.num_experts,
                           temperature=config.temperature, max_weight=config.max_weight, method=config.method)


def _estimator_loss(estimator: str, num_candidates: int, num_outputs: int, *, num_experts: int, temperature: float,
                    max_weight: float | None, method: str | None) -> Callable[[Tensor, LoggedBatch], Tensor]:
    """:func:`logged_loss` from its parts: ``estimator`` one of :data:`LOG_ESTIMATORS`, ``method`` the CA-PG
    inclusion method (``None``: the default; ``capg_swr`` needs ``"with_replacement"``)."""
    k = num_candidates
    weights = torch.full((num_outputs,), 1.0 / num_outputs)
    if estimator == "supervised":
        # the single-draw probability of a mixture: the average over the K positions of softmax_{m(k)}
        log_share = torch.tensor([math.log(count / k) for _, count in expert_runs(k, num_experts)])

        def supervised(logits: Tensor, batch: LoggedBatch) -> Tensor:
            log_softmax = torch.log_softmax(logits / temperature, dim=-1)  # [B, M, N]
            single = (log_softmax + log_share.to(logits).unsqueeze(1)).logsumexp(1)  # [B, N]
            log_p = single.gather(1, batch.shown)
            return -(log_p * (batch.rewards > 0) * weights.to(log_p)).sum(1).mean()
        return supervised
    common = dict(max_weight=max_weight, temperature=temperature, validate_args=False)
    if estimator.startswith("capg"):
        loss_fn = OffPolicyCAPGLoss(k, self_normalize=estimator == "capg_snips",
                                    **({} if method is None else {"method": method}), **common)

        def logged(batch: LoggedBatch) -> Tensor:
            return batch.log_expected_count if method == "with_replacement" else batch.log_inclusion
    elif estimator == "vpg_ips":
        loss_fn = OffPolicyVPGLoss(k, **common)

        def logged(batch: LoggedBatch) -> Tensor:
            return batch.log_candidate_prob
    else:
        loss_fn = TopKReinforceLoss(k, **common)
        log_k = math.log(k)

        def logged(batch: LoggedBatch) -> Tensor:  # β(a), the logging draw's single-draw probability: count / K
            return (batch.log_expected_count - log_k).clamp(max=0.0)

    def loss(logits: Tensor, batch: LoggedBatch) -> Tensor:
        return loss_fn(logits, batch.candidates, batch.shown, batch.rewards, logged(batch),
                       position_weights=weights.to(logits))
    return loss


def eval_lsr_name(eval_lsr: str | None, metas: Sequence[LogMetadata]) -> str:
    """The LSR that scores a log-trained ESR: ``eval_lsr``, else the one the log files (``metas``, each file's)
    record, else optimal; files that record different ones need ``eval_lsr``."""
    if eval_lsr:
        return eval_lsr
    recorded = sorted({str(meta.extra["lsr"]) for meta in metas if "lsr" in meta.extra})  # files that record one
    if len(recorded) > 1:
        raise ValueError(f"eval_lsr must be given: the log files record different LSRs, {recorded}")
    return recorded[0] if recorded else "optimal"


OPE_COLUMNS = ("ope_ips", "ope_ips_low", "ope_ips_high", "ope_snips", "ope_snips_low", "ope_snips_high", "ope_ess")
"""The metrics columns of an off-policy estimate."""


def ope_columns(est: OffPolicyEstimate) -> dict[str, float]:
    """The metrics columns of an off-policy estimate (as the trainer and the study report it)."""
    return dict(zip(OPE_COLUMNS, (est.ips, est.ips_ci_low, est.ips_ci_high, est.snips, est.snips_ci_low,
                                  est.snips_ci_high, est.effective_sample_size)))


class LogTrainer(Trainer):
    """Train a :class:`TwoTowerMoE` from Parquet logs with an off-policy estimator (see the module docstring).

    ``run``, ``save`` and the checkpoint file are :class:`Trainer`'s; :meth:`load` resumes a saved run.

    Args:
        config: the :class:`LogTrainConfig`; K and L are filled in from the logs, which must record their catalog
            size N (``num_items``).
        env: the environment the logs were generated on (its catalog must be the logs'), or None (OPE only).

    Shape:
        ``model(users [B]) → logits [B, M, N]``, users being the logs' context keys.

    Example:
        >>> import os, tempfile
        >>> from capg_rec.logs import LoggedBatch, log_propensities, write_logs
        >>> logits = torch.randn(8, 20, dtype=torch.float64)
        >>> candidates = capg_rec.sample_candidates(logits, 5)
        >>> shown = candidates[:, :2]
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "logs.parquet")
        >>> write_logs(path, LoggedBatch(torch.arange(8), candidates, shown, torch.rand(8, 2),
        ...                              *log_propensities(logits, candidates, shown)), num_items=20)
        >>> trainer = LogTrainer(LogTrainConfig([path], batch_size=4, holdout=0.0))
        >>> trainer.num_steps, trainer.config.num_candidates, trainer.config.num_outputs   # trainer.run() trains
        (2, 5, 2)
        >>> folder.cleanup()
    """

    def __init__(self, config: LogTrainConfig, env: MatrixEnv | None = None) -> None:
        self._setup_logs(config, env)
        generator = torch.Generator().manual_seed(self.config.seed)
        self.model = TwoTowerMoE(self.num_users, self.num_items, num_experts=self.config.num_experts,
                                 dim=self.config.embedding_dim, generator=generator)
        self.step_count, self.epoch, self.epoch_step = 0, 0, 0
        self.interval_losses: list[float] = []
        self.result = TrainResult(config=self.config.to_dict(), lr=self.config.base_lr)
        self.optimizer = self._optimizer(self.result.lr)

    # ----------------------------------------------------------------- setup
    def _setup_logs(self, config: LogTrainConfig, env: MatrixEnv | None) -> None:
        from capg_rec.logs.parquet import LoggedImpressions

        if not isinstance(config, LogTrainConfig):
            raise TypeError(f"config must be a LogTrainConfig, got {type(config).__name__}")
        if env is not None and not isinstance(env, MatrixEnv):
            raise TypeError(f"env must be a MatrixEnv or None, got {type(env).__name__}")
        # one process reads every row: not a launcher's or process group's shard of them
        data = LoggedImpressions(list(config.logs), config.batch_size, shuffle_row_groups=True, seed=config.seed,
                                 rank=0, world_size=1)
        meta = data.meta
        if not data.num_rows:
            raise ValueError(f"logs: {', '.join(map(str, config.logs))} hold no rows to train on")
        if meta.num_items is None:
            raise ValueError(f"logs: {config.logs[0]} records no catalog size (num_items): the model needs it")
        if env is not None and meta.num_items != env.num_items:
            raise ValueError(f"logs: their catalog has {meta.num_items} items, the environment {env.name!r} has "
                             f"{env.num_items}: these logs were not written on it")
        for path, here in zip(data.files, data.file_meta):  # every file's: the first one's alone let others in
            recorded = here.extra.get("env")  # capg-rec log records it; logs of your own may not
            if env is not None and isinstance(recorded, str) and recorded != env.name:
                raise ValueError(f"env must be the environment the logs were written on, {recorded!r} (log file "
                                 f"{path}), got {env.name!r}: the true policy value would be measured on another one")
        for name, value in (("num_candidates", meta.num_candidates), ("num_outputs", meta.num_shown)):
            if getattr(config, name) not in (None, value):
                raise ValueError(f"{name} = {getattr(config, name)} differs from the logs' {value}")
        config = config.replace(num_candidates=meta.num_candidates, num_outputs=meta.num_shown)
        if config.estimator in ("capg", "capg_snips") and config.capg_method != "with_replacement":
            # the weights' numerator by the method of their denominator (with_replacement's is the expected count)
            known = meta.method in inclusion_methods() and inclusion_method(meta.method).is_probability
            if config.capg_method is None and known:
                config = config.replace(capg_method=meta.method)
            elif (config.capg_method or DEFAULT_METHOD) != meta.method:
                warnings.warn(f"the logs' log_inclusion came from inclusion method {meta.method!r}, the loss computes "
                              f"{config.capg_method or DEFAULT_METHOD!r}: each weight is a ratio of two approximations "
                              "(biased where they differ)", stacklevel=3)
        if config.num_experts > config.num_candidates:
            raise ValueError(f"num_experts must be <= the logs' K = {config.num_candidates}, "
                             f"got {config.num_experts}")
        groups = len(data.row_groups)
        held = math.ceil(round(config.holdout * groups, 9))  # 0.07 · 100 is 7.000000000000001: 7, not 8
        if held >= groups:
            raise ValueError(f"holdout = {config.holdout} leaves no row group to train on: the logs have {groups} "
                             "row group(s) (write them in several, or pass holdout 0)")
        self.config, self.env, self.meta = config, env, meta
        self.train_data = data.subset(range(groups - held))
        self.eval_data = data.subset(range(groups - held, groups))
        if not self.train_data.num_rows:  # its row groups are empty (a serving job may write empty ones)
            raise ValueError(f"holdout = {config.holdout} leaves no rows to train on: the {groups - held} row "
                             f"group(s) before the held-out {held} of the logs' {groups} are empty")
        self.num_items = meta.num_items
        self.num_users = env.num_users if env is not None else self._count_users(data)
        self.epoch_batches = []
        for epoch in range(config.epochs):
            self.train_data.set_epoch(epoch)
            self.epoch_batches.append(self.train_data.num_batches(config.workers))
        self.eval_candidates = config.num_candidates
        self.eval_lsr_name = eval_lsr_name(config.eval_lsr, data.file_meta)
        if not config.eval_lsr and self.eval_lsr_name not in LSR_NAMES:  # a ranker of the logging system's own
            raise ValueError(f"the logs record lsr {self.eval_lsr_name!r} (their extra['lsr']), not one of "
                             f"{LSR_NAMES}: pass eval_lsr (--eval-lsr) to score the ESR under a built-in one")
        self.eval_lsr = make_lsr(self.eval_lsr_name, argument="eval_lsr")
        self.loss_fn = logged_loss(config, config.num_candidates, config.num_outputs)
        self._batches: Iterator | None = None

    @staticmethod
    def _count_users(data) -> int:
        """Context keys index the user table: the largest ``extra["num_users"]`` the files record, and where a file
        records none, at least 1 + the largest key."""
        counts = []
        for path, here in zip(data.files, data.file_meta):
            if "num_users" not in here.extra:
                continue
            recorded = here.extra["num_users"]  # a whole number (another tool may write 1000.0)
            if not (is_number(recorded) and math.isfinite(recorded) and float(recorded).is_integer()) or recorded < 1:
                raise ValueError(f"logs: {path} records num_users = {recorded!r} in its metadata's extra, "
                                 "not a number of users (an int >= 1)")
            counts.append(int(recorded))
        if len(counts) == len(data.files):
            return max(counts)
        keys = data.subset(range(len(data.row_groups)))
        keys.columns, keys.shuffle_row_groups = ["context"], False
        largest = max(int(batch.context.max()) for batch in keys)
        return max([largest + 1, *counts])

    @property
    def num_steps(self) -> int:
        return sum(self.epoch_batches)

    # ------------------------------------------------------------- one step
    def _next_batch(self) -> LoggedBatch:
        """The next training batch; a new epoch reshuffles the row groups. A resumed run skips the batches its
        epoch had already taken, so that it sees the rows the uninterrupted run would."""
        from torch.utils.data import DataLoader

        while True:
            if self._batches is None:
                self.train_data.set_epoch(self.epoch)
                self._batches = iter(DataLoader(self.train_data, batch_size=None, num_workers=self.config.workers))
                for _ in range(self.epoch_step):
                    next(self._batches)
            batch = next(self._batches, None)
            if batch is not None:
                self.epoch_step += 1
                return batch
            self._batches, self.epoch, self.epoch_step = None, self.epoch + 1, 0

    def _scores(self, batch: LoggedBatch) -> Tensor:
        """The model's logits ``[B, M, N]`` for the batch's context keys, which must be users it has."""
        if bool((batch.context < 0).any() | (batch.context >= self.num_users).any()):
            raise ValueError(f"logs: column 'context' holds a key outside [0, {self.num_users}) (the users the "
                             "model has)")
        return self.model(batch.context)

    def _step(self) -> tuple[float, bool]:
        batch = self._next_batch()
        logits = self._scores(batch)
        if not all_finite(logits):
            return math.nan, True
        return self._apply(self.loss_fn(logits, batch))

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def off_policy_estimate(self) -> dict:
        """IPS/SNIPS of the greedy ESR (inclusion 1 on its top-K, 0 elsewhere) on the held-out rows; NaN when its
        scores are not finite (an update that overflowed the parameters)."""
        targets, logged, rewards = [], [], []
        for batch in self.eval_data:
            scores = self._scores(batch)
            if not all_finite(scores):  # nothing ranks them: no estimate of this ESR
                return dict.fromkeys(OPE_COLUMNS, math.nan)
            top = greedy_candidates(scores, self.config.num_candidates, temperature=self.config.temperature,
                                    validate_args=False)
            inside = (batch.shown.unsqueeze(2) == top.unsqueeze(1)).any(2)
            targets.append(torch.where(inside, 0.0, -math.inf).double())
            logged.append(batch.log_inclusion)
            rewards.append(batch.rewards.double())
        if sum(len(t) for t in targets) < 2:
            return dict.fromkeys(OPE_COLUMNS)
        return ope_columns(off_policy_value(torch.cat(targets), torch.cat(logged), torch.cat(rewards),
                                            validate_args=False))

    def _evaluation(self) -> dict:
        return {"policy_value": self.evaluate() if self.env is not None else None, **self.off_policy_estimate()}

    @staticmethod
    def _progress_text(row: dict) -> str:
        parts = [f"{name}={row[key]:.3f}" for name, key in (("value", "policy_value"), ("snips", "ope_snips"))
                 if row[key] is not None]
        return " ".join(parts)

    # ---------------------------------------------------------- checkpoints
    def _recorded_config(self) -> dict:
        return self.config.to_dict()  # its LSR is the config's, named

    def state_dict(self) -> dict:
        return {"version": CHECKPOINT_VERSION, "kind": "logs", "config": self.config.to_dict(),
                "env": None if self.env is None else self.env.name, "num_rows": self.train_data.num_rows,
                "logs_fingerprint": self.train_data.fingerprint(),
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step_count,
                "epoch": self.epoch, "epoch_step": self.epoch_step, "interval_losses": self.interval_losses,
                "result": self.result.to_dict() if self.result.history else None, "lr": self.result.lr}

    @classmethod
    def load(cls, path: str | os.PathLike, env: MatrixEnv | None = None, *, epochs: int | None = None
             ) -> LogTrainer:
        """Rebuild a trainer from a checkpoint file (verified as :meth:`Trainer.load`); see :meth:`from_state`."""
        return cls.from_state(read_checkpoint(path), env, epochs=epochs)

    @classmethod
    def from_state(cls, state: dict, env: MatrixEnv | None = None, *, epochs: int | None = None) -> LogTrainer:
        """Rebuild a trainer from a :meth:`state_dict`, on the same logs and environment. The run keeps its saved
        config; ``epochs`` sets another target (it must end after the saved step)."""
        if state.get("version") != CHECKPOINT_VERSION or state.get("kind") != "logs":
            raise ValueError(f"the checkpoint must be one of a run trained from logs, of version {CHECKPOINT_VERSION}")
        config = LogTrainConfig(**state["config"])
        if epochs is not None:
            config = config.replace(epochs=epochs)
        trainer = cls.__new__(cls)
        saved = state.get("logs_fingerprint")  # absent in checkpoints written before it was kept
        try:
            trainer._setup_logs(config, env)
        except ValueError as err:  # logs rewritten with another K or L, say: that is what to say, not the option
            from capg_rec.logs.parquet import LoggedImpressions

            try:
                changed = saved is not None and saved != LoggedImpressions(list(config.logs), 1).fingerprint()
            except (OSError, ValueError):
                changed = False
            if changed:
                raise ValueError(_LOGS_CHANGED) from err
            raise
        name = None if env is None else env.name
        if name != state["env"]:
            raise ValueError(f"env must be the checkpoint's {state['env']!r}, got {name!r}")
        if trainer.train_data.num_rows != state["num_rows"]:
            raise ValueError(f"the logs changed since the checkpoint: {trainer.train_data.num_rows} training rows, "
                             f"the run had {state['num_rows']}")
        if saved is not None and saved != trainer.train_data.fingerprint():
            raise ValueError(_LOGS_CHANGED)
        if epochs is not None and trainer.num_steps <= state["step"]:
            raise ValueError(f"epochs = {epochs} ends at step {trainer.num_steps}, the saved run is at step "
                             f"{state['step']}; give more epochs to go on")
        trainer.num_users = state["model"]["user"].shape[1]  # the run's own table (an earlier capg_rec sized it
        trainer.model = TwoTowerMoE(trainer.num_users, trainer.num_items,  # from the first log file alone)
                                    num_experts=config.num_experts, dim=config.embedding_dim)
        trainer.model.load_state_dict(state["model"])
        trainer.step_count, trainer.epoch, trainer.epoch_step = state["step"], state["epoch"], state["epoch_step"]
        trainer.interval_losses = state["interval_losses"]
        trainer._restore_result(state, extended=epochs is not None and epochs != state["config"]["epochs"])
        trainer.optimizer = trainer._optimizer(state["lr"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        return trainer


def write_log_reports(trainer: LogTrainer, out: str | os.PathLike) -> list[Path]:
    """``metrics.csv`` (the evaluations) and ``curves.png`` (the true value, else the SNIPS estimate, over the
    steps; none when neither was measured: no environment and no held-out rows) next to the trainer's
    ``metrics.jsonl`` and ``result.json`` → the files written."""
    out = Path(out)
    history = trainer.result.history
    write_csv(out / "metrics.csv", history)
    key = "policy_value" if trainer.env is not None else "ope_snips"
    curve = [dict(row, policy_value=row[key]) for row in history if row[key] is not None]
    if curve:
        ylabel = "policy value (greedy ESR)" if key == "policy_value" else "OPE SNIPS (greedy ESR, held out)"
        optimum = trainer.env.optimal_value(trainer.config.num_outputs) if trainer.env is not None else None
        plot_curves({f"{trainer.config.label}, K={trainer.config.num_candidates}": {trainer.config.label: [curve]}},
                    out / "curves.png", optimum=optimum, ylabel=ylabel)
        return [out / "metrics.csv", out / "curves.png"]
    return [out / "metrics.csv"]
