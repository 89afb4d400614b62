"""Prompt lookup drafting (attnkit.speculative.prompt_lookup): the match it finds and adaptive proposal
lengths."""

from attnkit.speculative import PromptLookupDraft


def test_prompt_lookup_finds_most_recent_continuation():
    d = PromptLookupDraft(max_ngram=3, min_ngram=1)
    ctx = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert d.lookup(ctx, 3) == [5, 6, 7]  # the latest earlier "1 2 3" was followed by 5 6 7
    # "2 3 5" -> up to the end of the context, then on through the proposal itself (period 7)
    assert d.lookup(ctx + [5], 10) == [6, 7, 1, 2, 3, 5, 6, 7, 1, 2]
    assert d.lookup([4, 7, 7, 7], 3) == [7, 7, 7]  # a run continues
    assert d.lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert d.lookup([8, 8, 8, 42], 4) == []
    assert PromptLookupDraft(2, 2).lookup([1, 7, 3, 0, 7], 2) == []  # only a 1-gram match


def test_prompt_lookup_sizes_proposals_by_match_length():
    """Adaptive prompt lookup: a long match earns a longer proposal than a short one, a match whose
    drafts the target keeps rejecting earns none (at a CPU-like verification cost), and a free
    verification drafts up to the cap."""
    d = PromptLookupDraft()
    d.adaptive, d.verify_cost = True, 0.1
    assert d.planned_length(30, 16) > d.planned_length(4, 16) > d.planned_length(1, 16) >= 1
    for _ in range(20):  # 1-token matches whose first draft is always rejected
        d._last = (1, 3)
        d.feedback(0)
    assert d.planned_length(1, 16) == 0
    assert d.planned_length(30, 16) <= 16
    d.verify_cost = 0.0  # a free verification (memory-bound GPU): draft all the way
    assert d.planned_length(30, 16) == 16
    d.verify_cost = 0.1
    base = b"def f(x):\n    return x + 1\n\n"
    ctx = list(base * 3) + list(b"def f(x):\n    re")
    m, e = d.match(ctx)
    assert m >= 16 and ctx[e + 1] == ord("t")
    before = d.next_accept_probability(m)
    out = d.lookup(ctx, 16)
    assert out and out[0] == ord("t")
    d.feedback(0)  # the target rejected the first draft
    assert d.next_accept_probability(m) < before
    # without adaptive gamma the proposal is the fixed length
    fixed = PromptLookupDraft()
    assert len(fixed.lookup(ctx, 5)) == 5
