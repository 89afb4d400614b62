"""Speculative decoding (seed 003): the acceptance rule, draft sources (a draft model, prompt lookup,
self-speculation with a compressed cache) and the generation loop. See :mod:`.acceptance`,
:mod:`.drafts` and :mod:`.generate`."""

from attnkit.speculative.acceptance import (
    Acceptance,
    acceptance_probabilities,
    greedy_accept,
    outcome_probabilities,
    residual_distribution,
    speculative_accept,
)
from attnkit.speculative.drafts import (
    DRAFT_KINDS,
    DraftRun,
    DraftSource,
    ModelDraft,
    PromptLookupDraft,
    Proposal,
    check_same_vocabulary,
    make_draft,
)
from attnkit.speculative.generate import GammaController, SpeculativeStats, best_gamma, speculative_generate

__all__ = [
    "Acceptance", "acceptance_probabilities", "greedy_accept", "outcome_probabilities", "residual_distribution",
    "speculative_accept", "DRAFT_KINDS", "DraftRun", "DraftSource", "ModelDraft", "PromptLookupDraft", "Proposal",
    "check_same_vocabulary", "make_draft", "GammaController", "SpeculativeStats", "best_gamma",
    "speculative_generate",
]
