"""A draft source built from a :class:`attnkit.speculative.config.SpeculativeConfig` (:func:`make_draft`)."""

from __future__ import annotations

import torch

from attnkit.model import LoadedModel, load_model
from attnkit.speculative.config import (
    SpeculativeConfig,
    draft_model_spec,
    self_draft_method,
    speculative_config,
)
from attnkit.speculative.draft import DraftSource
from attnkit.speculative.model_draft import ModelDraft, check_same_vocabulary
from attnkit.speculative.prompt_lookup import PromptLookupDraft


def make_draft(config: SpeculativeConfig | str | DraftSource, target: LoadedModel | None = None,
               **options) -> DraftSource:
    """The draft source of `config` (a config, or a source name with `options`: SpeculativeConfig field
    names, e.g. ``make_draft("self", draft="snapkv:budget_tokens=512", draft_lookup=True)``).

    - ``draft_model``: `draft` is a model spec (default ``tiny-draft``; an ``@method-spec`` suffix gives
      the draft its own attention method) or a :class:`LoadedModel`; a spec is loaded on `target`'s device
      and dtype, and the draft's vocabulary is checked against `target`'s;
    - ``prompt_lookup``: `draft` is ``max_ngram=N,min_ngram=M,max_match=K,max_candidates=C``;
    - ``self``: `draft` is the draft cache's method spec or a :class:`attnkit.methods.base.Method`
      (:func:`attnkit.speculative.config.self_draft_method`);
    - a :class:`DraftSource` instance is returned as it is.

    A model draft's `draft_lookup` (True or a ``prompt_lookup`` spec) makes it verify prompt-lookup
    guesses several at a time (TriForce's hierarchy, Sun et al. 2024, arXiv 2404.11912, section 4.2),
    `draft_confidence` stops a round after the first token it gave less than that probability, and
    `draft_weights` ``"int8"`` drafts with weight-only int8 copies of the model's linear layers.
    """
    config = speculative_config(config, **options)
    source = config.source
    if isinstance(source, DraftSource):
        return source
    if source == "prompt_lookup":
        return PromptLookupDraft.from_spec(config.draft)
    lookup = nested_lookup(config.draft_lookup)
    model_options = dict(lookup=lookup, confidence=config.draft_confidence, weights=config.draft_weights)
    if source == "self":
        return ModelDraft(None, self_draft_method(config.draft, lookup is not None), kind="self", **model_options)
    if isinstance(config.draft, LoadedModel):
        model, method = config.draft, "full"
    else:
        model_spec, method = draft_model_spec(config.draft)
        model = load_model(model_spec, device=target.device if target is not None else "cpu",
                           dtype=target.dtype if target is not None else torch.float32)
    if target is not None:
        check_same_vocabulary(target, model)
    return ModelDraft(model, method, kind="draft_model", **model_options)


def nested_lookup(lookup: bool | str) -> PromptLookupDraft | None:
    """The prompt-lookup guesser of a model draft (`draft_lookup`: True for the defaults, or a
    ``prompt_lookup`` spec), or None."""
    if lookup is False or lookup is None:
        return None
    return PromptLookupDraft() if lookup is True else PromptLookupDraft.from_spec(lookup)
