"""Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding):
the draft is the continuation of an earlier occurrence of the context's last n-gram in prompt + output. No
model runs; the draft is deterministic (a point-mass ``p`` in the acceptance rule of Leviathan et al.
2023, arXiv 2211.17192)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from attnkit.errors import AttnkitError
from attnkit.session import Session
from attnkit.speculative.draft import DEFAULT_VERIFY_COST, DraftRun, DraftSource, Proposal
from attnkit.validate import whole

OPTIONS = ("max_ngram", "min_ngram", "max_match", "max_candidates")  # what a prompt_lookup spec may set


# match-length buckets of the acceptance model: 1, 2, 3, 4, 5-6, 7-9, 10-14, 15-22, 23+
_MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 14, 22)


def _match_bucket(m: int) -> int:
    for i, hi in enumerate(_MATCH_BUCKETS):
        if m <= hi:
            return i
    return len(_MATCH_BUCKETS)


@dataclass
class PromptLookupDraft(DraftSource):
    """n-gram lookup in prompt + output (prompt lookup decoding; Saxena 2023): find the earlier
    occurrences of the context's last ``n`` tokens (``n`` from `max_ngram` down to `min_ngram`), take,
    among the latest `max_candidates` of them, the one whose match reaches furthest back (up to
    `max_match` tokens; the most recent among equals) and propose what followed it (see :meth:`lookup`).
    With the default ``max_candidates=1`` that is the most recent occurrence (a model tends to repeat
    what it just wrote, so the latest occurrence predicts better than an older, longer match), and the
    backward match length only sizes the proposal. A deterministic draft (point-mass
    ``p``). The index of n-grams grows with the context (each position is indexed once), so finding
    candidates is a dictionary access.

    With adaptive gamma the source sizes each proposal itself (``gamma`` is then a cap): a longer match
    predicts its continuation better (the next token is right far more often after a long match than
    after a 1-token one), so it keeps per match length ``m`` an estimate ``a(m)`` of that probability (a prior ``m / (m + 2)`` worth
    `prior_weight` trials, updated by every drafted token the target examines; accepting ``j`` drafts
    lengthens the match to ``m + j``), and proposes the ``k`` maximising the expected tokens of the round
    per unit of verification cost (Leviathan et al. eq. 1 with a per-position acceptance),

        (1 + sum_{i=1..k} prod_{j<i} a(m + j)) / (1 + k * verify_cost),

    ``k = 0`` (no proposal: a plain decoding step) included. It depends on the acceptances only, never on
    timings, so a seeded run is reproducible.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    max_match: int = 64
    max_candidates: int = 1
    prior_weight: float = 4.0
    kind: str = field(default="prompt_lookup", init=False)

    def __post_init__(self):
        for name in OPTIONS:
            whole(f"prompt_lookup: {name}", getattr(self, name), 1)
        if self.min_ngram > self.max_ngram:
            raise AttnkitError(f"prompt_lookup: min_ngram ({self.min_ngram}) is larger than max_ngram "
                               f"({self.max_ngram})")
        if self.max_match < self.max_ngram:
            raise AttnkitError(f"prompt_lookup: max_match ({self.max_match}) is smaller than max_ngram "
                               f"({self.max_ngram})")
        self.adaptive, self.verify_cost = False, DEFAULT_VERIFY_COST
        self._reset()

    def _reset(self):
        # n -> {n-gram: end indices e (ascending) whose continuation context[e + 1] is known}
        self._index: dict[int, dict[tuple, list[int]]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        self._tokens: list[int] = []  # the context indexed so far: n-grams ending before its last token
        self._hits = [0.0] * (len(_MATCH_BUCKETS) + 1)  # accepted drafts per match-length bucket
        self._trials = [0.0] * (len(_MATCH_BUCKETS) + 1)  # examined drafts per bucket
        self._last: tuple[int, int] = (0, 0)  # (match length, tokens) of the last proposal

    @classmethod
    def from_spec(cls, spec: str | None) -> PromptLookupDraft:
        """A source from a spec string ``max_ngram=N,min_ngram=M,max_match=K,max_candidates=C`` (any of
        them; defaults 3, 1, 64 and 1); None or ``""`` for the defaults."""
        if spec is not None and not isinstance(spec, str):
            raise AttnkitError(f"prompt_lookup takes a spec string like 'max_ngram=3,min_ngram=1', got "
                               f"{type(spec).__name__}")
        opts = {}
        for item in filter(None, (s.strip() for s in (spec or "").split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise AttnkitError(f"prompt_lookup spec: expected key=value, got {item!r}")
            opts[key.strip()] = value.strip()
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise AttnkitError(f"prompt_lookup has no option {', '.join(unknown)}; options: {', '.join(OPTIONS)}")
        try:
            values = {k: int(v) for k, v in opts.items()}
        except ValueError:
            raise AttnkitError(f"prompt_lookup options must be whole numbers, got {spec!r}") from None
        return cls(**values)

    def fork(self) -> PromptLookupDraft:
        """A fresh source with the same options (an empty index and acceptance model)."""
        return dataclasses.replace(self)

    def describe(self) -> str:
        return f"prompt_lookup(max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, max_match={self.max_match})"

    def start(self, run: DraftRun) -> Session | None:
        """Reset, and index the prompt (part of the prompt's processing, before the first round)."""
        self._reset()
        self.adaptive, self.verify_cost = run.adaptive, run.verify_cost
        self._extend_index(run.prompt_ids.tolist())
        return None

    def _extend_index(self, context: list[int]) -> None:
        known = len(self._tokens)
        if context[:known] != self._tokens:  # not a continuation of the indexed context
            self._index = {n: {} for n in self._index}
            self._tokens, known = [], 0
        tokens = self._tokens
        tokens.extend(context[known:])
        # n-grams end at e <= len - 2 (their continuation is known); those ending before known - 1 are
        # indexed already
        for e in range(max(0, known - 1), len(tokens) - 1):
            for n, table in self._index.items():
                if e - n + 1 >= 0:
                    table.setdefault(tuple(tokens[e - n + 1:e + 1]), []).append(e)

    def match(self, context: list[int]) -> tuple[int, int | None]:
        """``(m, e)``: the earlier occurrence ending at ``e`` of the context's longest matching suffix
        (``m`` tokens, at most `max_match`) among the latest `max_candidates` occurrences of its last
        n-gram (the longest ``n`` that occurs); ``(0, None)`` when not even `min_ngram` tokens recur."""
        self._extend_index(context)
        return self._match_indexed(context)

    def _match_indexed(self, context: list[int]) -> tuple[int, int | None]:
        """:meth:`match` among the occurrences indexed so far (the index is not extended)."""
        L = len(context)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            ends = self._index[n].get(tuple(context[L - n:]))
            if not ends:
                continue
            best_m, best_e = 0, None
            for e in reversed(ends[-self.max_candidates:]):
                m = n
                while m < self.max_match and e - m >= 0 and context[e - m] == context[L - 1 - m]:
                    m += 1
                if m > best_m:
                    best_m, best_e = m, e
            return best_m, best_e
        return 0, None

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        """Up to `gamma` tokens: what followed the best earlier occurrence (:meth:`match`, ending at
        ``e``) of the context's suffix. When that continuation runs into the end of the context it goes
        on through the proposal itself (a copy with period ``L - 1 - e``: ``...abcab`` -> ``cab``), which
        is what copying the earlier occurrence predicts."""
        self._extend_index(context)
        return self._lookup_indexed(context, gamma)

    def lookup_after(self, context: list[int], drafted: list[int], gamma: int) -> list[int]:
        """:meth:`lookup` after ``context + drafted``, indexing only `context` (drafted tokens may be
        rolled back: indexing them would force a reindexing of the whole context next round)."""
        self._extend_index(context)
        return self._lookup_indexed(context + drafted, gamma)

    def _lookup_indexed(self, context: list[int], gamma: int) -> list[int]:
        m, e = self._match_indexed(context)
        self._last = (m, 0)
        if e is None:
            return []
        L = len(context)
        if self.adaptive:
            gamma = self.planned_length(m, gamma)
        out = context[e + 1:min(L, e + 1 + gamma)]
        while len(out) < gamma:
            out.append(out[len(out) - (L - 1 - e)])
        self._last = (m, len(out))
        return out

    def next_accept_probability(self, m: int) -> float:
        """Estimated probability that the target accepts the next copied token after an ``m``-token
        match: accepted over examined drafts in ``m``'s bucket, with the prior ``m / (m + 2)``."""
        b = _match_bucket(m)
        return (self._hits[b] + self.prior_weight * m / (m + 2.0)) / (self._trials[b] + self.prior_weight)

    def planned_length(self, m: int, cap: int) -> int:
        """The number of tokens (0..cap) to propose after an ``m``-token match: the one maximising
        expected emitted tokens per verification cost (class docstring)."""
        best_k, best, expected, survive = 0, 1.0, 1.0, 1.0
        for k in range(1, cap + 1):
            survive *= self.next_accept_probability(m + k - 1)
            expected += survive
            score = expected / (1.0 + k * self.verify_cost)
            if score > best:
                best_k, best = k, score
        return best_k

    def propose(self, context: list[int], gamma: int) -> Proposal:
        return Proposal(self.lookup(context, gamma), None)

    def feedback(self, accepted: int) -> None:
        """Update the acceptance model: the drafts the target examined (the accepted ones and the first
        rejected one), each at its match length."""
        m, k = self._last
        for j in range(min(k, accepted + 1)):
            b = _match_bucket(m + j)
            self._trials[b] += 1.0
            self._hits[b] += float(j < accepted)
        self._last = (m, 0)

    def sizes_own_proposals(self) -> bool:
        return self.adaptive

