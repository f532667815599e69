"""Simulated two-stage recommendation problems: environments and late-stage rankers.

* :func:`synthetic_env`: the paper's synthetic environment (1000 users × 1000 items),
* :func:`load_kuairec`: KuaiRec's fully observed ``small_matrix.csv`` (bring your own copy),
* :func:`movielens_env`: bundled MovieLens ratings completed by matrix factorisation,
* :class:`OnDemandSyntheticEnv`: the synthetic model with vectors computed on demand (10^7+ items),
* LSRs: :class:`OptimalLSR`, :class:`NoisyLSR`, :class:`UniformLSR`, :class:`AntiOptimalLSR`,
  or any callable ``(scores [B, K], L, generator) -> (picks [B, L], propensities [B, L] | None)``.
"""

from capg_rec.sim.env import MatrixEnv
from capg_rec.sim.kuairec import load_kuairec
from capg_rec.sim.lsr import LSR_NAMES, AntiOptimalLSR, LSRPolicy, NoisyLSR, OptimalLSR, UniformLSR, make_lsr
from capg_rec.sim.movielens import movielens_env
from capg_rec.sim.ondemand import OnDemandSyntheticEnv
from capg_rec.sim.synthetic import PAPER_SEED, synthetic_env

__all__ = ["MatrixEnv", "synthetic_env", "PAPER_SEED", "load_kuairec", "movielens_env", "OnDemandSyntheticEnv",
           "LSRPolicy", "OptimalLSR", "NoisyLSR", "UniformLSR", "AntiOptimalLSR", "make_lsr", "LSR_NAMES"]
