"""capg_rec: credit-assigned policy gradients as drop-in losses for early-stage retrievers."""

from capg_rec import functional
from capg_rec._checks import set_default_validate_args
from capg_rec.baselines import ContextBaseline, global_mean_baseline
from capg_rec.catalog import CatalogScores, DenseCatalog, EmbeddingCatalog, as_catalog
from capg_rec.losses import CAPGLoss, OffPolicyCAPGLoss, OffPolicyVPGLoss, TopKReinforceLoss, VPGLoss
from capg_rec.marginals import (DEFAULT_METHOD, Enumeration, Exact, InclusionMethod, MeanField, PlugIn, WithReplacement,
                                inclusion_log_prob, inclusion_method, inclusion_methods, register_inclusion_method)
from capg_rec.plackett_luce import candidate_log_prob, expert_of_position, greedy_candidates, sample_candidates
from capg_rec.rewards import dcg_weights, group_normalize
from capg_rec.sampled import DrawnSample, InBatchSampler, MixedSampler, NegativeSampler, SampledCatalog, \
    UniformSampler

__all__ = [
    "CAPGLoss", "VPGLoss", "OffPolicyCAPGLoss", "OffPolicyVPGLoss", "TopKReinforceLoss", "functional",
    "CatalogScores", "DenseCatalog", "EmbeddingCatalog", "as_catalog",
    "SampledCatalog", "NegativeSampler", "UniformSampler", "InBatchSampler", "MixedSampler", "DrawnSample",
    "InclusionMethod", "Exact", "MeanField", "PlugIn", "WithReplacement", "Enumeration", "DEFAULT_METHOD",
    "inclusion_log_prob", "inclusion_method", "inclusion_methods", "register_inclusion_method",
    "candidate_log_prob", "expert_of_position", "greedy_candidates", "sample_candidates",
    "dcg_weights", "group_normalize", "global_mean_baseline", "ContextBaseline", "set_default_validate_args",
]
__version__ = "0.1.0"
