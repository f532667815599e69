"""Training configuration: every knob of the paper's online experiments, validated on creation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

from capg_rec._checks import is_int, is_number, python_number
from capg_rec.marginals import inclusion_methods
from capg_rec.sim.lsr import LSR_NAMES

__all__ = ["TrainConfig", "ESTIMATORS", "PAPER_LR", "ESTIMATOR_LABELS"]

ESTIMATORS = ("vpg", "vpg_swr", "capg", "capg_swr")
ESTIMATOR_LABELS = {"vpg": "V-PG", "vpg_swr": "V-PG-SwR", "capg": "CA-PG", "capg_swr": "CA-PG-SwR"}
PAPER_LR = {"vpg": 1e-1, "vpg_swr": 1e-1, "capg": 1e-2, "capg_swr": 1e-2}
"""The paper's learning rates (Adagrad, batch 128), chosen on its default setting."""

_OPTIMIZERS = ("adagrad", "adam", "sgd")
_POSITION_WEIGHTS = ("mean", "sum", "dcg")
_BASELINES = ("none", "context")
_ON_OVERFLOW = ("stop", "skip")


SEED_MAX = 2**63 - 1
"""The largest seed: torch's generators take a 64-bit integer."""


def _int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not is_int(value):
        raise TypeError(f"{name} must be an int >= {low}, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")


def _num(name: str, value: object, *, positive: bool) -> None:
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


def python_numbers(config: object) -> None:
    """A frozen dataclass's numpy numbers, in its fields and their tuples, as Python's (checked already): a config
    is saved as JSON, which numpy's numbers are not."""
    def plain(value: object) -> object:
        return tuple(plain(v) for v in value) if isinstance(value, tuple) else python_number(value)

    for f in fields(config):
        object.__setattr__(config, f.name, plain(getattr(config, f.name)))


def _choice(name: str, value: object, choices: tuple) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class TrainConfig:
    """One online training run (the paper's defaults unless noted), validated on creation (no tensors).

    Attributes:
        estimator: ``"vpg"`` | ``"vpg_swr"`` | ``"capg"`` | ``"capg_swr"`` (default); ``capg_method`` picks
            CA-PG's inclusion probability (``None`` = the library default).
        num_candidates, num_outputs, num_experts, temperature: K (10), L (1), M (1) and τ (1.0) of the ESR.
        steps, batch_size, embedding_dim, seed: 50,000 steps of B = 128 users, D = 10, seed 0.
        optimizer, lr: ``"adagrad"`` (or ``"adam"``, ``"sgd"``); lr ``None`` = the paper's (1e-1 for V-PGs,
            1e-2 for CA-PGs). ``adaptive_lr`` (False) scales it by the inverse mean LSR propensity, estimated
            once at the start over ``adaptive_lr_batches`` (20) batches (the paper's appendix).
        train_lsr, eval_lsr: LSR names (``"optimal"``, ``"noisy"``, ``"uniform"``, ``"anti"``; default optimal).
        eval_every, eval_candidates: every 1000 steps the greedy ESR with ``eval_candidates`` (None: K) is scored.
        position_weights: ``"mean"`` (1/L, the paper's code; default), ``"sum"`` (1) or ``"dcg"``: the weights
            of the trained objective; the reported value is the mean of q over the L picks whatever they are.
        group_size, group_offset: G > 1 with c >= 0: GRPO, each user served G times and rewards normalised within
            the group, plus c (defaults: G = 1, off; c = 0.0; ``reproduce grpo`` takes c = 1 for CA-PG).
        baseline, baseline_decay: ``"context"`` subtracts a per-user moving average of past rewards with that
            decay in ``[0, 1)`` (default ``"none"``, 0.9).
        on_overflow: on a non-finite loss or gradient, ``"stop"`` (as the paper; default) or ``"skip"``.

    Example:
        >>> config = TrainConfig(estimator="capg", num_candidates=20, num_outputs=2)
        >>> config.base_lr, config.label, config.replace(estimator="vpg").base_lr
        (0.01, 'CA-PG', 0.1)
    """

    estimator: str = "capg_swr"
    num_candidates: int = 10
    num_outputs: int = 1
    num_experts: int = 1
    temperature: float = 1.0
    capg_method: str | None = None
    steps: int = 50_000
    batch_size: int = 128
    optimizer: str = "adagrad"
    lr: float | None = None
    adaptive_lr: bool = False
    adaptive_lr_batches: int = 20
    embedding_dim: int = 10
    train_lsr: str = "optimal"
    eval_lsr: str = "optimal"
    eval_every: int = 1000
    eval_candidates: int | None = None
    position_weights: str = "mean"
    group_size: int = 1
    group_offset: float = 0.0
    baseline: str = "none"
    baseline_decay: float = 0.9
    on_overflow: str = "stop"
    seed: int = 0

    def __post_init__(self) -> None:
        _choice("estimator", self.estimator, ESTIMATORS)
        for name in ("num_candidates", "num_outputs", "num_experts", "steps", "batch_size",
                     "adaptive_lr_batches", "embedding_dim", "eval_every", "group_size"):
            _int(name, getattr(self, name), 1)
        _int("seed", self.seed, 0, SEED_MAX)
        python_numbers(self)
        if self.num_outputs > self.num_candidates:
            raise ValueError(f"num_outputs must be <= num_candidates={self.num_candidates}, "
                             f"got {self.num_outputs}")
        if self.num_experts > self.num_candidates:
            raise ValueError(f"num_experts must be <= num_candidates={self.num_candidates}, "
                             f"got {self.num_experts}")
        if self.eval_candidates is not None:
            _int("eval_candidates", self.eval_candidates, self.num_outputs)
        _num("temperature", self.temperature, positive=True)
        if self.lr is not None:
            _num("lr", self.lr, positive=True)
        _num("group_offset", self.group_offset, positive=False)
        _num("baseline_decay", self.baseline_decay, positive=False)
        if self.baseline_decay >= 1:
            raise ValueError(f"baseline_decay must be in [0, 1), got {self.baseline_decay}")
        if self.capg_method is not None:
            _choice("capg_method", self.capg_method, inclusion_methods())
            if self.estimator != "capg" and (self.estimator, self.capg_method) != ("capg_swr", "with_replacement"):
                raise ValueError(f"capg_method is the inclusion method of estimator 'capg' (capg_swr's is "
                                 f"'with_replacement'; V-PG has none), got estimator {self.estimator!r} with "
                                 f"capg_method {self.capg_method!r}")
        if not isinstance(self.adaptive_lr, bool):
            raise TypeError(f"adaptive_lr must be a bool, got {self.adaptive_lr!r}")
        _choice("optimizer", self.optimizer, _OPTIMIZERS)
        _choice("train_lsr", self.train_lsr, LSR_NAMES)
        _choice("eval_lsr", self.eval_lsr, LSR_NAMES)
        _choice("position_weights", self.position_weights, _POSITION_WEIGHTS)
        _choice("baseline", self.baseline, _BASELINES)
        _choice("on_overflow", self.on_overflow, _ON_OVERFLOW)

    @property
    def base_lr(self) -> float:
        """The configured learning rate, or the paper's for this estimator."""
        return self.lr if self.lr is not None else PAPER_LR[self.estimator]

    @property
    def label(self) -> str:
        return ESTIMATOR_LABELS[self.estimator]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: object) -> TrainConfig:
        return dataclasses.replace(self, **changes)
