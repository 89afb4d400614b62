"""Transitional: the old import paths of the draft sources, until recipe.py, tests/test_bundled_model.py
and scripts/ import from the modules that hold them (:mod:`.draft`, :mod:`.rollback`,
:mod:`.model_draft`, :mod:`.prompt_lookup`, :mod:`.config`, :mod:`.factory`). Delete it then."""

from __future__ import annotations

from attnkit.speculative import factory
from attnkit.speculative.config import DRAFT_KINDS
from attnkit.speculative.draft import DEFAULT_VERIFY_COST, DraftRun, DraftSource, Proposal
from attnkit.speculative.model_draft import ModelDraft, check_same_vocabulary
from attnkit.speculative.model_draft import check_confidence as _check_confidence
from attnkit.speculative.prompt_lookup import PromptLookupDraft
from attnkit.speculative.rollback import drop_newest, restore_session, snapshot_session

__all__ = ["DRAFT_KINDS", "DEFAULT_VERIFY_COST", "DraftRun", "DraftSource", "Proposal", "ModelDraft",
           "check_same_vocabulary", "PromptLookupDraft", "drop_newest", "restore_session", "snapshot_session",
           "check_confidence", "make_draft"]


def check_confidence(confidence):
    """The old one-argument form of :func:`attnkit.speculative.model_draft.check_confidence`."""
    return _check_confidence("draft confidence", confidence)


def make_draft(kind, spec=None, target=None, *, lookup=False, confidence=None, weights=None):
    """The old form of :func:`attnkit.speculative.factory.make_draft`."""
    return factory.make_draft(kind, target, draft=spec, draft_lookup=lookup, draft_confidence=confidence,
                              draft_weights=weights)
