"""Online training of an ESR behind a fixed LSR, and the paper's experiments.

* :class:`TrainConfig` / :class:`Trainer`: the paper's online loop (Adagrad, B = 128, exact greedy
  evaluation every 1000 steps, gradient-overflow detection, bit-identical resume),
* :mod:`capg_rec.train.checkpoint`: checksummed checkpoint files, written atomically next to the previous one,
* :func:`policy_value`: the exact value of a greedy ESR under an LSR,
* :mod:`capg_rec.train.logged`: :class:`LogTrainer`, the same loop on Parquet logs with an off-policy
  estimator (``capg-rec train --logs``),
* :mod:`capg_rec.train.reproduce`: the paper's tables as runnable targets (``capg-rec reproduce``),
* :mod:`capg_rec.train.variance`: gradient variance vs K (Theorem 1),
* :mod:`capg_rec.train.bench`: a training step against the core loss step.
"""

from capg_rec.train.config import ESTIMATORS, PAPER_LR, TrainConfig
from capg_rec.train.logged import LOG_ESTIMATORS, LogTrainConfig, LogTrainer
from capg_rec.train.model import TwoTowerMoE
from capg_rec.train.trainer import Trainer, TrainResult, make_loss, policy_value

__all__ = ["TrainConfig", "Trainer", "TrainResult", "TwoTowerMoE", "policy_value", "make_loss", "ESTIMATORS",
           "PAPER_LR", "LogTrainConfig", "LogTrainer", "LOG_ESTIMATORS"]
