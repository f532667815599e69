"""Moved to :mod:`capg_rec.baselines` (plain ``torch.distributed``); this path is kept so that imports of it, and
baselines saved whole (``torch.save`` of the module) under it, still load."""

from capg_rec.baselines import ContextBaseline, global_mean_baseline

__all__ = ["ContextBaseline", "global_mean_baseline"]
