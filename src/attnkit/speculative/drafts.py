"""Draft sources for speculative decoding, behind one small interface (:class:`DraftSource`).

A source proposes up to ``gamma`` tokens after the current context, with the distributions it drew
them from (``p`` in seed 003's notation) or ``None`` for a deterministic draft (a point mass), and is
told after verification how many of them the target accepted (:meth:`DraftSource.feedback`), so it
can roll its own state back. Losslessness never depends on what a source proposes: the acceptance
rule only needs the ``p`` the proposal was really drawn from. What a source proposes only decides the
speed.

- :class:`ModelDraft` ``draft_model``: a second, smaller model with the same vocabulary (e.g. the
  bundled ``tiny-draft``) decoding autoregressively with its own KV cache.
- :class:`ModelDraft` ``self``: the target model itself drafting with a compressed cache from an
  eviction method (``streaming``, ``h2o``, ``keyformer``, ``snapkv``...), verified by the same model
  with its full cache, as in TriForce (Sun et al. 2024) and MagicDec (Chen et al. 2024). The draft
  cache is filled during the target's own prompt pass (one forward feeds both caches).
- :class:`PromptLookupDraft` ``prompt_lookup``: the continuation of the most recent earlier occurrence
  of the context's last n-gram in prompt + output (prompt lookup decoding; Saxena 2023), no model.
- A model draft may itself be drafted for (``lookup``, ``--draft-lookup``): it verifies prompt-lookup
  guesses several per forward instead of decoding one token per forward, TriForce's hierarchy (Sun et
  al. 2024, section 4.2) with prompt lookup at the bottom. Where a draft step is mostly fixed cost (a
  small model on a CPU) this is what makes self-speculation pay (README: 1.22x -> 1.48x at 32k on two
  prompts; 1.79x there with the confidence stop below). A round's first guesses go into the same
  forward as the tokens the target just added (the draft's catch-up).
- A model draft may stop a round early (``confidence``, ``--draft-confidence``): after the first token
  it gave less than that probability, as transformers' ``assistant_confidence_threshold`` and
  SpecDec++ (Huang et al. 2024) do. Where drafting is slow and verification compute-bound (a CPU)
  the tokens the target would likely reject cost both; stopping saves them (README).
- A model draft may run weight-only int8 copies of its model's linear layers (``weights``,
  ``--draft-weights int8``; :mod:`attnkit.speculative.int8_weights`, QuantSpec's idea): where few-row
  float projections are most of a draft forward (a CPU) this makes it a quarter to a third cheaper
  (README: self-speculation at 16k 1.55x -> 1.67x side by side).

**Rolling back a draft cache.** After a round the draft has fed ``gamma - 1`` of its own tokens;
those beyond the accepted ones must be undone. For a cache that only appends while decoding (``full``;
``snapkv``, which compresses the prompt once) dropping the newest slots (``LayerKV.length -= k``) is
exact: later slots are never read and the next append overwrites them. An evicting cache cannot be
truncated: writing a drafted token may have evicted an entry for good, and the method's statistics
(``LayerKV.extras`` score buffers, ``session.layer_state`` counters and saved keys, ``session.shared``
scores) have absorbed the drafted tokens. For those the source snapshots the whole draft session
after each token it feeds (tensors cloned, cost: one copy of the *compressed* cache per drafted token,
``gamma - 1`` copies per round) and restores the snapshot of the last accepted token (no replay
forward). When all, or all but the last, drafted tokens are accepted the live state is already right
and nothing is restored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnkit.cache import LayerKV
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method, Session, Step, parse_method_spec
from attnkit.methods.full import FullAttention
from attnkit.model import LoadedModel
from attnkit.runner import forward, logits_of, new_session, prefill, resolve_method
from attnkit.sampling import SamplingConfig, next_token_distribution
from attnkit.speculative.int8_weights import check_draft_weights, int8_bytes, int8_weight_view

DRAFT_KINDS = ("draft_model", "prompt_lookup", "self")

# Extra cost of each drafted token in the target's verification forward, relative to a one-token target
# step (the forward over gamma + 1 tokens costs about 1 + gamma * this). On a GPU the step is
# memory-bound and this is ~0; on one CPU core the extra rows cost matmul and attention compute.
# Measured here (1 thread, tiny at 2k context, timed inside the speculative loop, against the decoding
# step without position checks): 1.1 steps for 2 tokens, 1.2-1.3 for 3, 1.4 for 4, 1.5 for 5, about 2 for
# 9: 0.1-0.13 per token. (Sizing with 0.12 instead of 0.1 changes prompt lookup's modelled speed-up by
# 1 %, below the benchmark's spread: scripts/simulate_prompt_lookup.py --verify-cost 0.1,0.12.)
DEFAULT_VERIFY_COST = 0.1


@dataclass
class Proposal:
    """Drafted tokens ``[g]`` (``g <= gamma``, possibly 0) and the distributions ``[g, V]`` they were
    drawn from; ``probs=None`` means a deterministic draft (point mass on each token)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass
class DraftRun:
    """What a source learns when a generation starts."""

    target: LoadedModel
    prompt_ids: torch.Tensor  # [n]
    max_new_tokens: int
    sampling: SamplingConfig
    generator: torch.Generator | None
    chunk_size: int | None = None
    adaptive: bool = False  # gamma adaptive: a source that sizes its own proposals may propose fewer
    verify_cost: float = DEFAULT_VERIFY_COST  # cost of one more verified token / a 1-token target step


class DraftSource:
    """The interface. ``start`` once per generation, then per round ``propose`` and ``feedback``."""

    kind: str = "base"
    forwards: int = 0  # model forwards run while proposing in the current generation (0: no model)

    def start(self, run: DraftRun) -> Session | None:
        """Prepare for a generation. May return a session to be filled by the target's prompt pass
        (the source then owns a cache built from the target's own forward); None otherwise."""
        return None

    def propose(self, context: list[int], gamma: int) -> Proposal:
        """Up to `gamma` (>= 1) tokens to follow `context` (prompt + everything generated so far)."""
        raise NotImplementedError

    def feedback(self, accepted: int) -> None:
        """The target accepted the first `accepted` tokens of the last proposal."""

    def relative_cost(self) -> float:
        """Estimated cost of drafting one token relative to one target forward (for adaptive gamma)."""
        return 0.0

    def weight_bytes(self) -> int:
        """Bytes of weights the source holds besides the target's (a draft model's, int8 copies)."""
        return 0

    def sizes_own_proposals(self) -> bool:
        """Whether the source chooses how many tokens to propose (gamma is then only a cap), instead of
        the loop's :class:`attnkit.speculative.generate.GammaController`."""
        return False

    def describe(self) -> str:
        return self.kind


# ---- snapshots of an evicting session ------------------------------------------------------------
def _copy_state(obj):
    """Deep copy of tensors inside dicts/lists/tuples; any other object is kept by reference (e.g. the
    Step a method remembers, whose identity is what it compares)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _copy_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_state(v) for v in obj)
    return obj


@dataclass
class SessionSnapshot:
    layers: list
    layer_state: list
    shared: dict


def snapshot_session(session: Session) -> SessionSnapshot:
    """Everything a method may change while decoding: every layer's slots (keys, values, positions,
    length, extras) and the per-layer and shared method state."""
    layers = []
    for kv in session.cache.layers:
        if kv is None:
            layers.append(None)
        else:
            layers.append(LayerKV(kv.keys.clone(), kv.values.clone(), kv.positions.clone(), kv.length, kv.ring,
                                  {k: v.clone() for k, v in kv.extras.items()}))
    return SessionSnapshot(layers, _copy_state(session.layer_state), _copy_state(session.shared))


def restore_session(session: Session, snap: SessionSnapshot) -> None:
    """Put a snapshot back (its tensors are handed over, not copied again: use each snapshot once)."""
    session.cache.layers = list(snap.layers)
    session.layer_state = snap.layer_state
    session.shared = snap.shared


def drop_newest(session: Session, count: int) -> None:
    """Undo the last `count` tokens fed to a cache that only appends while decoding (``full``, the
    target's; ``Method.decode_only_appends``, a compressed draft cache, which holds fewer slots than
    positions): its newest `count` slots in every layer are never read again and are overwritten by the
    next append."""
    for kv in session.cache.layers:
        if kv is None:
            continue
        if kv.ring:
            raise AttnkitError("a ring-buffer cache has overwritten the entries a rollback would restore; "
                               "snapshot the session instead")
        if not 0 <= count <= kv.length:
            raise AttnkitError(f"cannot drop the newest {count} of {kv.length} entries of this cache")
        kv.length -= count


# ---- vocabulary check ------------------------------------------------------------------------------
def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise a clear AttnkitError unless the draft scores the same token ids as the target."""
    tv, dv = target.geometry.vocab_size, draft.geometry.vocab_size
    if tv != dv:
        raise AttnkitError(
            f"draft model {draft.spec!r} has a vocabulary of {dv} tokens but the target {target.spec!r} has {tv}: "
            f"speculative decoding compares the two models' distributions token by token, so the draft must "
            f"use the target's tokenizer and vocabulary")
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is dt or not (hasattr(tt, "get_vocab") and hasattr(dt, "get_vocab")):
        return
    if tt.get_vocab() != dt.get_vocab():
        raise AttnkitError(
            f"draft model {draft.spec!r} and target {target.spec!r} both have {tv} tokens but their tokenizers "
            f"map tokens to different ids: speculative decoding needs the same tokenizer for both")


# ---- a model drafting autoregressively ----------------------------------------------------------
class ModelDraft(DraftSource):
    """A model drafting token by token with its own cache under `method` (``full`` for a separate
    draft model; an eviction method for self-speculation, then `model` is None = the target itself).

    `share_prefill` (self-speculation only): build the draft cache from the target's prompt pass
    instead of a second pass over the prompt. `weights` ``"int8"``: draft with weight-only int8 copies of
    the drafting model's linear layers (:mod:`attnkit.speculative.int8_weights`; QuantSpec's idea), made
    once per model and kept.
    """

    def __init__(self, model: LoadedModel | None = None, method: str | Method | None = "full", *,
                 share_prefill: bool = True, kind: str | None = None, lookup: PromptLookupDraft | None = None,
                 confidence: float | None = None, weights: str | None = None):
        self.model = model
        self.confidence = check_confidence(confidence)
        self.weights = check_draft_weights(weights)
        self._int8: tuple[LoadedModel, LoadedModel] | None = None  # (model, its int8 view), made on first use
        self.method = parse_method_spec(method) if isinstance(method, str) else resolve_method(method)
        if lookup is not None and not self.method.decode_only_appends():
            raise AttnkitError(f"lookup guessing for the draft needs a draft cache that only appends while decoding "
                               f"('full', or 'snapkv' without decode_budget), so that rejected guesses can be cut "
                               f"off; {self.method.describe()} evicts while decoding")
        self.lookup = lookup  # prompt-lookup guesses the draft verifies (TriForce's hierarchy)
        self.share_prefill = share_prefill
        self.kind = kind or ("self" if model is None else "draft_model")
        self.drafter: LoadedModel | None = None  # the model that drafts (the target itself for self)
        self.session: Session | None = None
        self.cached = 0  # context tokens the draft cache holds (a prefix of the context)
        self._snapshots: list[SessionSnapshot] = []  # [i]: the session after feeding the i-th draft
        self._round_start = 0
        self._cost = 1.0

    def describe(self) -> str:
        under = "" if self.lookup is None else f" <- {self.lookup.describe()}"
        if self.confidence is not None:
            under = f" stop<{self.confidence:g}{under}"
        if self.weights != "same":
            under = f" {self.weights}{under}"
        if self.model is None:
            return f"self[{self.method.describe()}]{under}"
        suffix = "" if isinstance(self.method, FullAttention) else f"[{self.method.describe()}]"
        return f"draft_model[{self.model.spec}]{suffix}{under}"

    def _drafting(self, model: LoadedModel) -> LoadedModel:
        """The model the draft runs: `model`, or its int8 view (made once per model object)."""
        if self.weights == "same":
            return model
        if self._int8 is None or self._int8[0] is not model:
            self._int8 = (model, int8_weight_view(model))
        return self._int8[1]

    def weight_bytes(self) -> int:
        own = 0 if self.model is None else sum(p.nbytes for p in self.model.hf.parameters())
        return own + (int8_bytes(self._int8[1]) if self._int8 is not None else 0)

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self, run: DraftRun) -> Session | None:
        self.sampling, self.generator = run.sampling, run.generator
        if self.model is None:
            self.drafter = self._drafting(run.target)
        else:
            check_same_vocabulary(run.target, self.model)
            if self.model.device != run.target.device:
                raise AttnkitError(f"draft model {self.model.spec!r} is on {self.model.device} but the target is on "
                                   f"{run.target.device}; put both on the same device")
            self.drafter = self._drafting(self.model)
        n = run.prompt_ids.shape[0]
        limit = self.drafter.geometry.max_positions
        if n + run.max_new_tokens > limit:
            raise AttnkitError(f"the draft model {self.drafter.spec!r} allows {limit} positions, fewer than the prompt "
                               f"({n}) + max_new_tokens ({run.max_new_tokens})")
        self.session = new_session(self.drafter, self.method, n, run.max_new_tokens)
        self._snapshots = []
        if self.lookup is not None:
            self.lookup.start(run)
            # guesses run to the round's cap: a draft forward costs about the same with 2 or 12 tokens in it
            # (``tiny``, 512 cached: 5.7-6.1 against 6.6-7.3 ms), so a longer guess saves a forward whenever it
            # holds and costs little when it does not. (Sizing them by the target's verification cost, as
            # prompt lookup sizes its own proposals, took 4.78 instead of 3.44 draft forwards per round on a
            # 16k bench prompt.)
            self.lookup.adaptive = False
        self.cached = n
        self.forwards = 0
        self._cost = self._estimate_cost(run.target, n)
        if self.model is None and self.share_prefill:
            return self.session
        prefill(self.drafter, self.session, run.prompt_ids.to(self.drafter.device), run.chunk_size)
        return None

    def _estimate_cost(self, target: LoadedModel, context: int) -> float:
        """Bytes one draft step reads over bytes one target step reads (weights + KV), the memory-bound
        cost model of MagicDec; used only to choose gamma adaptively."""
        def weight_bytes(m: LoadedModel) -> int:
            return sum(p.nbytes for p in m.hf.parameters()) + int8_bytes(m)

        def kv_bytes(m: LoadedModel, tokens: int) -> int:
            g = m.geometry
            return 2 * g.n_layers * g.n_kv_heads * g.head_dim * tokens * m.dtype.itemsize

        draft_tokens = context
        budget = getattr(self.method, "budget_tokens", None)
        if isinstance(budget, int):
            draft_tokens = min(context, budget)
        elif isinstance(getattr(self.method, "budget", None), float):
            draft_tokens = min(context, max(1, int(self.method.budget * context)))
        elif hasattr(self.method, "window"):
            draft_tokens = min(context, int(self.method.window))
        target_bytes = weight_bytes(target) + kv_bytes(target, context)
        draft_bytes = weight_bytes(self.drafter) + kv_bytes(self.drafter, draft_tokens)
        return draft_bytes / max(1, target_bytes)

    def relative_cost(self) -> float:
        return self._cost

    # ---- feeding -------------------------------------------------------------------------------------
    def _feed(self, tokens: list[int], start: int) -> torch.Tensor:
        """Run `tokens` at positions start.. through the draft; logits ``[len(tokens), V]`` after each
        (one forward when the cache only appends, else one decode step per token)."""
        model, session = self.drafter, self.session
        device = model.device
        if len(tokens) > 1 and self.method.decode_only_appends():
            self.forwards += 1
            ids = torch.tensor(tokens, device=device)
            hidden = forward(model, ids, start, lambda pos: Step(session, "decode", pos), all_positions=True)
            return logits_of(model, hidden)
        rows = []
        self.forwards += len(tokens)
        for i, tok in enumerate(tokens):  # evicting methods decode one token at a time
            hidden = forward(model, torch.tensor([tok], device=device), start + i,
                             lambda pos: Step(session, "decode", pos))
            rows.append(logits_of(model, hidden)[-1])
        return torch.stack(rows)

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft's own next token from `logits` ``[V]`` and the distribution it was drawn from
        (None when greedy)."""
        if self.sampling.do_sample:
            p = next_token_distribution(logits, self.sampling)
            return int(torch.multinomial(p, 1, generator=self.generator)), p
        return int(logits.argmax(-1)), None

    def _judge(self, logits: torch.Tensor, guess: int) -> tuple[bool, int, torch.Tensor | None]:
        """The draft's next token when a point-mass guess proposes `guess` (seed 003's rule with ``p`` a
        point mass: accept with probability ``q(guess)``, else draw from ``q`` without `guess`), so the
        token is distributed exactly as the draft's own ``q``: ``(accepted, token, q)``."""
        if not self.sampling.do_sample:
            tok = int(logits.argmax(-1))
            return tok == guess, tok, None
        q = next_token_distribution(logits, self.sampling)
        u = float(torch.rand((), generator=self.generator, device=q.device))
        if u < float(q[guess]):
            return True, guess, q
        rest = q.clone()  # u < 1, so a rejected guess has q(guess) < 1: rest has mass
        rest[guess] = 0.0
        return False, int(torch.multinomial(rest / rest.sum(), 1, generator=self.generator)), q

    def _unsure(self, logits: torch.Tensor, token: int, q: torch.Tensor | None) -> bool:
        """Whether drafting stops after `token`: the draft gave it less than `confidence` probability
        (``q``, or the softmax of `logits` when greedy). The decision uses only what the draft drew, so
        the proposal is still a stopping time of the draft's own samples and the acceptance rule's
        guarantee holds (seed 003; Leviathan et al. 2023 allow any number of drafts per round)."""
        if self.confidence is None:
            return False
        prob = q[token] if q is not None else logits.float().softmax(-1)[token]
        return float(prob) < self.confidence

    def propose(self, context: list[int], gamma: int) -> Proposal:
        if self.session is None:
            raise AttnkitError("the draft source was not started")
        L = len(context)
        if self.cached >= L:  # cannot happen in the loop: the context always ends with an unfed token
            raise AttnkitError("draft cache is ahead of the context")
        self._round_start = L
        self._snapshots = []
        if self.lookup is not None:
            return self._propose_with_lookup(context, gamma)
        logits = self._feed(context[self.cached:], self.cached)[-1]
        self.cached = L
        snapshot = not self.method.decode_only_appends()
        tokens, probs = [], []
        for i in range(gamma):
            tok, p = self._choose(logits)
            tokens.append(tok)
            if p is not None:
                probs.append(p)
            if self._unsure(logits, tok, p):
                break
            if i < gamma - 1:
                if snapshot:
                    self._snapshots.append(snapshot_session(self.session))  # state after token L - 1 + i
                logits = self._feed([tok], L + i)[-1]
                self.cached = L + i + 1
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def _propose_with_lookup(self, context: list[int], gamma: int) -> Proposal:
        """TriForce's hierarchy (Sun et al. 2024, section 4.2) with prompt lookup at the bottom: the
        draft verifies n-gram guesses in one forward of several tokens, as the target verifies the
        draft, instead of one forward per drafted token. Every drafted token is still distributed as the
        draft's own next-token distribution (:meth:`_judge`), and the draft's cache is cut back to the
        tokens it kept after each of its forwards (exact: it only appends).

        Each forward takes the tokens the draft has not seen yet (the round's first: the end of the
        context the target just extended; later: the token just drafted) followed by the guesses for
        what comes after them, so the round's first guesses ride along with the catch-up instead of
        waiting for a forward of their own. The guesses run to the round's cap (see :meth:`start`)."""
        tokens, probs = [], []
        unseen = context[self.cached:]
        unsure = False
        while len(tokens) < gamma and not unsure:
            start = self.cached  # position of unseen[0]
            guesses = self.lookup.lookup_after(context, tokens, gamma - len(tokens))
            rows = self._feed(unseen + guesses, start)
            first = len(unseen) - 1  # rows[first + j]: the draft's logits for the place of guesses[j]
            kept = 0
            for j in range(len(guesses) + 1):
                if len(tokens) >= gamma:
                    break
                row = rows[first + j]
                if j == len(guesses):  # every guess passed: the draft's own next token
                    ok = False
                    tok, p = self._choose(row)
                else:
                    ok, tok, p = self._judge(row, guesses[j])
                tokens.append(tok)
                probs.append(p)
                unsure = self._unsure(row, tok, p)
                if not ok or unsure:
                    break
                kept += 1
            if guesses:
                self.lookup.feedback(kept)
            fed = start + len(unseen) + len(guesses)
            self.cached = start + len(unseen) + kept  # the unseen tokens and the guesses that passed
            if fed > self.cached:
                drop_newest(self.session, fed - self.cached)
            unseen = tokens[-1:]  # not fed: the draft's own token or its replacement for a failed guess
        return Proposal(tokens, torch.stack(probs) if self.sampling.do_sample else None)

    def feedback(self, accepted: int) -> None:
        keep = self._round_start + accepted  # context + the accepted drafts
        if self.cached > keep:
            if self.method.decode_only_appends():
                drop_newest(self.session, self.cached - keep)
            else:
                restore_session(self.session, self._snapshots[accepted])
            self.cached = keep
        self._snapshots = []


# ---- prompt lookup -----------------------------------------------------------------------------------
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
    With the default ``max_candidates=1`` that is the most recent occurrence (on held-out code with
    ``tiny`` it predicted better than an older, longer match: the model tends to repeat what it just
    wrote), and the backward match length only sizes the proposal. A deterministic draft (point-mass
    ``p``). The index of n-grams grows with the context (each position is indexed once), so finding
    candidates is a dictionary access.

    With adaptive gamma the source sizes each proposal itself (``gamma`` is then a cap): a longer match
    predicts its continuation better (measured on held-out code with ``tiny``: the next token is right
    19% of the time after a 1-token match, 63% after 3, 84% after 8-15, over 90% after 20), so it keeps
    per match length ``m`` an estimate ``a(m)`` of that probability (a prior ``m / (m + 2)`` worth
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
        for name in ("max_ngram", "min_ngram", "max_match", "max_candidates"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise AttnkitError(f"prompt_lookup: {name} must be a whole number >= 1, got {v!r}")
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


# ---- construction from a kind and a spec ---------------------------------------------------------------
DEFAULT_SELF_METHOD = "streaming:budget_tokens=256,sinks=4"
DEFAULT_SELF_LOOKUP_METHOD = "snapkv:budget_tokens=512"  # with lookup guessing: a cache that only appends
DEFAULT_DRAFT_MODEL = "tiny-draft"


def check_confidence(confidence) -> float | None:
    """A draft's stopping threshold: None (always draft gamma tokens) or a probability in (0, 1)."""
    if confidence is None:
        return None
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise AttnkitError(f"draft confidence must be a probability between 0 and 1 (exclusive), got {confidence!r}")
    return float(confidence)


def _key_values(spec: str, what: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise AttnkitError(f"{what}: expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def make_draft(kind: str, spec: str | LoadedModel | Method | None = None, target: LoadedModel | None = None,
               *, lookup: bool | str = False, confidence: float | None = None,
               weights: str | None = None) -> DraftSource:
    """A draft source from the CLI's ``--speculate KIND [--draft SPEC]``:

    - ``draft_model``: SPEC is a model spec (default ``tiny-draft``) or a :class:`LoadedModel`; an
      optional ``@method-spec`` suffix gives the draft its own attention method
      (``tiny-draft@window:window=256``);
    - ``prompt_lookup``: SPEC is ``max_ngram=N,min_ngram=M,max_match=K,max_candidates=C`` (defaults 3,
      1, 64 and 1);
    - ``self``: SPEC is the draft cache's method spec (default ``streaming:budget_tokens=256,sinks=4``,
      with `lookup` ``snapkv:budget_tokens=512``) or a :class:`Method`.

    `lookup` (``draft_model`` and ``self``; ``--draft-lookup``): the draft verifies prompt-lookup
    guesses several at a time instead of decoding token by token (TriForce's hierarchy,
    :meth:`ModelDraft._propose_with_lookup`); True for the default lookup, or a ``prompt_lookup`` SPEC.
    It needs a draft cache that only appends while decoding (``full``, ``snapkv`` without
    ``decode_budget``).

    `confidence` (``draft_model`` and ``self``; ``--draft-confidence``): a round's drafting stops after
    the first token the draft gave less than this probability (:meth:`ModelDraft._unsure`), so unlikely
    drafts cost neither draft forwards nor verification rows; None drafts gamma tokens every round.

    `weights` (``draft_model`` and ``self``; ``--draft-weights``): ``"int8"`` drafts with weight-only
    int8 copies of the drafting model's linear layers (:mod:`attnkit.speculative.int8_weights`), the
    target still verifying with its own; None or ``"same"``: the model's own weights.
    """
    from attnkit.model import load_model

    if lookup and kind not in ("draft_model", "self"):
        raise AttnkitError(f"lookup guessing is for a model draft (draft_model, self), not {kind!r}")
    if confidence is not None and kind not in ("draft_model", "self"):
        raise AttnkitError(f"a confidence threshold is for a model draft (draft_model, self), whose tokens have "
                           f"probabilities; {kind!r} has none")
    check_confidence(confidence)
    if check_draft_weights(weights) != "same" and kind not in ("draft_model", "self"):
        raise AttnkitError(f"draft weights {weights!r} are for a model draft (draft_model, self); {kind!r} runs no "
                           f"model")
    if kind == "prompt_lookup":
        if spec is not None and not isinstance(spec, str):
            raise AttnkitError(f"prompt_lookup takes a spec string like 'max_ngram=3,min_ngram=1', got "
                               f"{type(spec).__name__}")
        opts = _key_values(spec or "", "prompt_lookup spec")
        names = ("max_ngram", "min_ngram", "max_match", "max_candidates")
        unknown = sorted(set(opts) - set(names))
        if unknown:
            raise AttnkitError(f"prompt_lookup has no option {', '.join(unknown)}; options: {', '.join(names)}")
        try:
            values = {k: int(v) for k, v in opts.items()}
        except ValueError:
            raise AttnkitError(f"prompt_lookup options must be whole numbers, got {spec!r}") from None
        return PromptLookupDraft(**values)
    if kind == "self":
        if isinstance(spec, Method):
            method = spec
        else:
            method = parse_method_spec(spec or (DEFAULT_SELF_LOOKUP_METHOD if lookup else DEFAULT_SELF_METHOD))
        if isinstance(method, FullAttention):
            raise AttnkitError("self-speculation drafts with a compressed cache: give an eviction method such as "
                               f"{DEFAULT_SELF_METHOD!r}, not {method.describe()!r} (that is the target itself)")
        return ModelDraft(None, method, kind="self", lookup=_nested_lookup(lookup), confidence=confidence,
                          weights=weights)
    if kind == "draft_model":
        method: str | Method = "full"
        if isinstance(spec, LoadedModel):
            model = spec
        else:
            text = spec or DEFAULT_DRAFT_MODEL
            model_spec, at, method_spec = text.partition("@")
            if at:
                method = parse_method_spec(method_spec)
            model = load_model(model_spec, device=target.device if target is not None else "cpu",
                               dtype=target.dtype if target is not None else torch.float32)
        if target is not None:
            check_same_vocabulary(target, model)
        return ModelDraft(model, method, kind="draft_model", lookup=_nested_lookup(lookup), confidence=confidence,
                          weights=weights)
    raise AttnkitError(f"unknown draft source {kind!r}; choose one of {', '.join(DRAFT_KINDS)}")


def _nested_lookup(lookup: bool | str) -> PromptLookupDraft | None:
    """The prompt-lookup guesser of a model draft (`make_draft`'s `lookup`), or None."""
    if lookup is False or lookup is None:
        return None
    if lookup is True:
        return PromptLookupDraft()
    if not isinstance(lookup, str):
        raise AttnkitError(f"lookup must be true/false or a prompt_lookup spec, got {lookup!r}")
    source = make_draft("prompt_lookup", lookup)
    assert isinstance(source, PromptLookupDraft)
    return source
