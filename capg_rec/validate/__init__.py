"""Validate any early-stage retriever's claimed probabilities with Monte-Carlo statistics.

Implement :class:`ESR` (or wrap logits, a catalog or a model with :class:`CatalogESR`) and call
:func:`validate_esr`; the :class:`ValidationReport` says, at a chosen false-alarm rate α,
whether the retriever's samples agree with the probabilities it claims.
"""

from capg_rec.validate.protocol import ESR, CatalogESR
from capg_rec.validate.report import Check, ItemResult, ValidationReport
from capg_rec.validate.validation import validate_esr

__all__ = ["ESR", "CatalogESR", "Check", "ItemResult", "ValidationReport", "validate_esr"]
