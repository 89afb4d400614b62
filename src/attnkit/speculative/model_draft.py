"""A model drafting for speculative decoding (:class:`ModelDraft`): a second, smaller model with the
target's vocabulary (``draft_model``, e.g. the bundled ``tiny-draft``) or the target itself over a
compressed cache (``self``).

- ``draft_model``: the draft decodes autoregressively with its own KV cache, as in Leviathan et al.
  2023, "Fast Inference from Transformers via Speculative Decoding" (arXiv 2211.17192).
- ``self``: the target drafts with a compressed cache from an eviction method (``streaming``, ``h2o``,
  ``keyformer``, ``snapkv``...) and verifies with its full cache, as in TriForce (Sun et al. 2024,
  "TriForce: Lossless Acceleration of Long Sequence Generation with Hierarchical Speculative Decoding",
  arXiv 2404.11912) and MagicDec (Chen et al. 2024, arXiv 2408.11049). The draft cache is filled during the
  target's own prompt pass (one forward feeds both caches).
- ``lookup``: the draft itself is drafted for: it verifies prompt-lookup guesses several per forward
  instead of decoding one token per forward, TriForce's hierarchy (section 4.2) with prompt lookup
  decoding (Saxena 2023) at the bottom. Where a draft forward is mostly fixed cost this saves draft
  forwards. A round's first guesses go into the same forward as the tokens the target just added (the
  draft's catch-up).
- ``confidence``: a round stops early after the first token the draft gave less than that probability,
  as transformers' ``assistant_confidence_threshold`` and SpecDec++ (Huang et al. 2024, arXiv
  2405.19715) do: where drafting is slow and verification compute-bound, the tokens the target would
  likely reject cost both.
- ``weights`` ``"int8"``: the draft runs weight-only int8 copies of its model's linear layers
  (:mod:`attnkit.speculative.int8_weights`; QuantSpec, Tiwari et al. 2025, arXiv 2502.10424), which
  makes a draft forward cheaper where few-row float projections are most of it.

Rolling the draft cache back after a round: :mod:`attnkit.speculative.rollback`. After a round the
draft has fed ``gamma - 1`` of its own tokens; when all, or all but the last, are accepted the live
state is already right and nothing is restored.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from attnkit.errors import AttnkitError
from attnkit.forward import forward, logits_of, prefill
from attnkit.methods.base import Method, resolve_method
from attnkit.methods.full import Full
from attnkit.methods.spec import parse_method_spec
from attnkit.model import LoadedModel
from attnkit.sampling import next_token_distribution
from attnkit.session import Session, Step, new_session
from attnkit.speculative.draft import DraftRun, DraftSource, Proposal
from attnkit.speculative.int8_weights import check_draft_weights, int8_bytes, int8_weight_view
from attnkit.speculative.prompt_lookup import PromptLookupDraft
from attnkit.speculative.rollback import SessionSnapshot, drop_newest, restore_session, snapshot_session
from attnkit.validate import is_number


def check_confidence(name: str, value) -> float | None:
    """A draft's stopping threshold: None (always draft gamma tokens) or a probability in (0, 1)."""
    if value is None:
        return None
    if not is_number(value) or not 0 < value < 1:
        raise AttnkitError(f"{name} must be a probability between 0 and 1 (exclusive), got {value!r}")
    return float(value)


def check_lookup_cache(method: Method) -> None:
    """Lookup guessing cuts rejected guesses off the draft cache: it needs a cache that only appends."""
    if not method.decode_only_appends():
        raise AttnkitError(f"lookup guessing for the draft needs a draft cache that only appends while decoding "
                           f"('full', or 'snapkv' without decode_budget), so that rejected guesses can be cut "
                           f"off; {method.describe()} evicts while decoding")


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


def run_plan(plan: Generator[tuple[list[int], int], torch.Tensor, Proposal],
             feed: Callable[[list[int], int], torch.Tensor]) -> Proposal:
    """Run a draft's plan (:meth:`ModelDraft.proposing`) with ``feed(tokens, start) -> logits`` for each
    of its feeds; its proposal."""
    try:
        request = next(plan)
        while True:
            request = plan.send(feed(*request))
    except StopIteration as done:
        return done.value


class ModelDraft(DraftSource):
    """A model drafting token by token with its own cache under `method` (``full`` for a separate
    draft model; an eviction method for self-speculation, then `model` is None = the target itself).

    `share_prefill` (self-speculation only): build the draft cache from the target's prompt pass
    instead of a second pass over the prompt (not for a method that runs the decoder layers itself,
    ``Method.run_layers``: the shared pass runs the target's layers, so such a draft prefills on its own).
    `weights` ``"int8"``: draft with weight-only int8 copies of the drafting model's linear layers
    (:mod:`attnkit.speculative.int8_weights`; QuantSpec's idea), made once per model and kept.
    """

    def __init__(self, model: LoadedModel | None = None, method: str | Method | None = "full", *,
                 share_prefill: bool = True, kind: str | None = None, lookup: PromptLookupDraft | None = None,
                 confidence: float | None = None, weights: str | None = None):
        self.model = model
        self.confidence = check_confidence("draft_confidence", confidence)
        self.weights = check_draft_weights(weights)
        # [(model, its int8 view)], made on first use; one list shared with this source's forks (a batch's
        # sequences draft with one view)
        self._int8: list[tuple[LoadedModel, LoadedModel]] = []
        self.method = parse_method_spec(method) if isinstance(method, str) else resolve_method(method)
        if lookup is not None:
            check_lookup_cache(self.method)
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
        suffix = "" if isinstance(self.method, Full) else f"[{self.method.describe()}]"
        return f"draft_model[{self.model.spec}]{suffix}{under}"

    def _drafting(self, model: LoadedModel) -> LoadedModel:
        """The model the draft runs: `model`, or its int8 view (made once per model object)."""
        if self.weights == "same":
            return model
        if not self._int8 or self._int8[0][0] is not model:
            self._int8[:] = [(model, int8_weight_view(model))]
        return self._int8[0][1]

    def weight_bytes(self) -> int:
        own = 0 if self.model is None else sum(p.nbytes for p in self.model.hf.parameters())
        return own + (int8_bytes(self._int8[0][1]) if self._int8 else 0)

    def fork(self) -> ModelDraft:
        """A fresh source with the same model, method and options (its own cache and lookup index), for
        another sequence of a batch; the int8 view, once made, is shared."""
        twin = ModelDraft(self.model, self.method, share_prefill=self.share_prefill, kind=self.kind,
                          lookup=None if self.lookup is None else self.lookup.fork(), confidence=self.confidence,
                          weights=self.weights)
        twin._int8 = self._int8
        return twin

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
            # guesses run to the round's cap: a draft forward over a few more tokens costs about what a
            # one-token forward does, so a longer guess saves a forward whenever it holds and costs little
            # when it does not (sizing guesses by the target's verification cost took more draft forwards)
            self.lookup.adaptive = False
        self.cached = n
        self.forwards = 0
        self._cost = self._estimate_cost(run.target, n)
        if self.model is None and self.share_prefill and self.method.run_layers is None:
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
        """The draft's next token when a point-mass guess proposes `guess` (the acceptance rule of
        Leviathan et al. 2023, section 2.3, with a point-mass proposal: accept with probability ``q(guess)``,
        else draw from ``q`` without `guess`), so the
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
        guarantee holds (Leviathan et al. 2023, section 2.3: any number of drafts per round)."""
        if self.confidence is None:
            return False
        prob = q[token] if q is not None else logits.float().softmax(-1)[token]
        return float(prob) < self.confidence

    def propose(self, context: list[int], gamma: int) -> Proposal:
        return run_plan(self.proposing(context, gamma), self._feed)

    def proposing(self, context: list[int], gamma: int) -> Generator[tuple[list[int], int], torch.Tensor, Proposal]:
        """:meth:`propose` as a plan: it yields every feed ``(tokens, start)`` it needs, is sent the logits
        ``[len(tokens), V]`` after each of those tokens, and returns the proposal. :meth:`propose` runs it
        with :meth:`_feed`; a batch runs its sequences' plans side by side, one forward per feed over all
        of them (:mod:`attnkit.speculative.rows`)."""
        if self.session is None:
            raise AttnkitError("the draft source was not started")
        L = len(context)
        if self.cached >= L:  # cannot happen in the loop: the context always ends with an unfed token
            raise AttnkitError("draft cache is ahead of the context")
        self._round_start = L
        self._snapshots = []
        if self.lookup is not None:
            return (yield from self._propose_with_lookup(context, gamma))
        logits = (yield context[self.cached:], self.cached)[-1]
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
                logits = (yield [tok], L + i)[-1]
                self.cached = L + i + 1
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def _propose_with_lookup(self, context: list[int], gamma: int) -> Generator[tuple[list[int], int], torch.Tensor,
                                                                                  Proposal]:
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
            rows = yield unseen + guesses, start
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

