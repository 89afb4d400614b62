"""Speculative decoding: the acceptance rule (Leviathan et al. 2023, arXiv 2211.17192), draft sources
(a draft model, prompt lookup, self-speculation with a compressed cache), their configuration and the
generation loop.

- :mod:`.config`: :class:`SpeculativeConfig`, every option, validated once;
- :mod:`.draft`: the contract of a draft source; :mod:`.model_draft`, :mod:`.prompt_lookup`: the
  sources; :mod:`.factory`: a source from a config; :mod:`.rollback`: undoing a round's cache writes;
  :mod:`.int8_weights`: a draft's int8 weights;
- :mod:`.acceptance`: the acceptance rule; :mod:`.gamma`: how many tokens to draft; :mod:`.target`:
  the target's verification attention and shared prompt pass; :mod:`.generate`: the loop (one prompt
  or a batch); :mod:`.rows`: a batch's verification and draft feeds, one forward for all its sequences;
- :mod:`.bench`: speed against plain decoding.
"""

from attnkit.speculative.acceptance import (
    Acceptance,
    acceptance_probabilities,
    greedy_accept,
    outcome_probabilities,
    residual_distribution,
    speculative_accept,
)
from attnkit.speculative.config import DRAFT_KINDS, SpeculativeConfig, speculative_config
from attnkit.speculative.draft import DraftRun, DraftSource, Proposal
from attnkit.speculative.factory import make_draft
from attnkit.speculative.gamma import GammaController, best_gamma
from attnkit.speculative.generate import SpeculativeStats, speculative_generate
from attnkit.speculative.model_draft import ModelDraft, check_same_vocabulary
from attnkit.speculative.prompt_lookup import PromptLookupDraft

__all__ = [
    "Acceptance", "acceptance_probabilities", "greedy_accept", "outcome_probabilities", "residual_distribution",
    "speculative_accept", "DRAFT_KINDS", "SpeculativeConfig", "speculative_config", "DraftRun", "DraftSource",
    "Proposal", "make_draft", "GammaController", "best_gamma", "SpeculativeStats", "speculative_generate",
    "ModelDraft", "check_same_vocabulary", "PromptLookupDraft",
]
