"""capg_rec: credit-assigned policy gradients as drop-in losses for early-stage retrievers."""

from capg_rec.catalog import CatalogScores, DenseCatalog, EmbeddingCatalog, as_catalog
from capg_rec.losses import CAPGLoss, TOP1PGLoss, VPGLoss
from capg_rec.marginals import DEFAULT_METHOD, METHODS, inclusion_log_prob
from capg_rec.plackett_luce import candidate_log_prob, expert_of_position, greedy_candidates, sample_candidates
from capg_rec.rewards import dcg_weights, group_normalize

__all__ = [
    "CAPGLoss", "TOP1PGLoss", "VPGLoss",
    "CatalogScores", "DenseCatalog", "EmbeddingCatalog", "as_catalog",
    "DEFAULT_METHOD", "METHODS", "inclusion_log_prob",
    "candidate_log_prob", "expert_of_position", "greedy_candidates", "sample_candidates",
    "dcg_weights", "group_normalize",
]
__version__ = "0.1.0"
