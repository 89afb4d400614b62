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

**Rolling back a draft cache.** After a round the draft has fed ``gamma - 1`` of its own tokens;
those beyond the accepted ones must be undone. For an append-only cache (``full``) keeping the first
``L`` slots (``LayerKV.length = L``) is exact: later slots are never read and the next append
overwrites them. An evicting cache cannot be truncated: writing a drafted token may have evicted an
entry for good, and the method's statistics (``LayerKV.extras`` score buffers, ``session.layer_state``
counters and saved keys, ``session.shared`` scores) have absorbed the drafted tokens. For those the
source snapshots the whole draft session after each token it feeds (tensors cloned, cost: one copy of
the *compressed* cache per drafted token, ``gamma - 1`` copies per round) and restores the snapshot
of the last accepted token (no replay forward). When all, or all but the last, drafted tokens are
accepted the live state is already right and nothing is restored.
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

DRAFT_KINDS = ("draft_model", "prompt_lookup", "self")


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


class DraftSource:
    """The interface. ``start`` once per generation, then per round ``propose`` and ``feedback``."""

    kind: str = "base"

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


def truncate_session(session: Session, length: int) -> None:
    """Roll an append-only (``full``) cache back to its first `length` entries: slots at or beyond
    ``length`` are never read and are overwritten by the next append."""
    for kv in session.cache.layers:
        if kv is None:
            continue
        if kv.ring:
            raise AttnkitError("a ring-buffer cache cannot be truncated; snapshot the session instead")
        if length > kv.length:
            raise AttnkitError(f"cannot roll a cache of {kv.length} entries forward to {length}")
        kv.length = length


def append_only(method: Method) -> bool:
    """Whether truncation is an exact rollback for this method's cache (dense attention, no eviction)."""
    return isinstance(method, FullAttention)


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
    instead of a second pass over the prompt.
    """

    def __init__(self, model: LoadedModel | None = None, method: str | Method | None = "full", *,
                 share_prefill: bool = True, kind: str | None = None):
        self.model = model
        self.method = parse_method_spec(method) if isinstance(method, str) else resolve_method(method)
        self.share_prefill = share_prefill
        self.kind = kind or ("self" if model is None else "draft_model")
        self.drafter: LoadedModel | None = None  # the model that drafts (the target itself for self)
        self.session: Session | None = None
        self.cached = 0  # context tokens the draft cache holds (a prefix of the context)
        self._snapshots: list[SessionSnapshot] = []  # [i]: the session after feeding the i-th draft
        self._round_start = 0
        self._cost = 1.0

    def describe(self) -> str:
        if self.model is None:
            return f"self[{self.method.describe()}]"
        suffix = "" if isinstance(self.method, FullAttention) else f"[{self.method.describe()}]"
        return f"draft_model[{self.model.spec}]{suffix}"

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self, run: DraftRun) -> Session | None:
        self.sampling, self.generator = run.sampling, run.generator
        if self.model is None:
            self.drafter = run.target
        else:
            check_same_vocabulary(run.target, self.model)
            if self.model.device != run.target.device:
                raise AttnkitError(f"draft model {self.model.spec!r} is on {self.model.device} but the target is on "
                                   f"{run.target.device}; put both on the same device")
            self.drafter = self.model
        n = run.prompt_ids.shape[0]
        limit = self.drafter.geometry.max_positions
        if n + run.max_new_tokens > limit:
            raise AttnkitError(f"the draft model {self.drafter.spec!r} allows {limit} positions, fewer than the prompt "
                               f"({n}) + max_new_tokens ({run.max_new_tokens})")
        self.session = new_session(self.drafter, self.method, n, run.max_new_tokens)
        self._snapshots = []
        self.cached = n
        self._cost = self._estimate_cost(run.target, n)
        if self.model is None and self.share_prefill:
            return self.session
        prefill(self.drafter, self.session, run.prompt_ids.to(self.drafter.device), run.chunk_size)
        return None

    def _estimate_cost(self, target: LoadedModel, context: int) -> float:
        """Bytes one draft step reads over bytes one target step reads (weights + KV), the memory-bound
        cost model of MagicDec; used only to choose gamma adaptively."""
        def weight_bytes(m: LoadedModel) -> int:
            return sum(p.numel() * p.element_size() for p in m.hf.parameters())

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
        """Run `tokens` at positions start.. through the draft; logits ``[V]`` after the last one."""
        model, session = self.drafter, self.session
        device = model.device
        if len(tokens) > 1 and append_only(self.method):
            ids = torch.tensor(tokens, device=device)
            hidden = forward(model, ids, start, lambda pos: Step(session, "prefill", pos, False))
        else:  # one decode step per token (evicting methods decode one token at a time)
            for i, tok in enumerate(tokens):
                hidden = forward(model, torch.tensor([tok], device=device), start + i,
                                 lambda pos: Step(session, "decode", pos))
        return logits_of(model, hidden)[-1]

    def propose(self, context: list[int], gamma: int) -> Proposal:
        if self.session is None:
            raise AttnkitError("the draft source was not started")
        L = len(context)
        if self.cached >= L:  # cannot happen in the loop: the context always ends with an unfed token
            raise AttnkitError("draft cache is ahead of the context")
        logits = self._feed(context[self.cached:], self.cached)
        self.cached = L
        self._round_start = L
        snapshot = not append_only(self.method)
        self._snapshots = []
        tokens, probs = [], []
        for i in range(gamma):
            if self.sampling.do_sample:
                p = next_token_distribution(logits, self.sampling)
                tok = int(torch.multinomial(p, 1, generator=self.generator))
                probs.append(p)
            else:
                tok = int(logits.argmax(-1))
            tokens.append(tok)
            if i < gamma - 1:
                if snapshot:
                    self._snapshots.append(snapshot_session(self.session))  # state after token L - 1 + i
                logits = self._feed([tok], L + i)
                self.cached = L + i + 1
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def feedback(self, accepted: int) -> None:
        keep = self._round_start + accepted  # context + the accepted drafts
        if self.cached > keep:
            if append_only(self.method):
                truncate_session(self.session, keep)
            else:
                restore_session(self.session, self._snapshots[accepted])
            self.cached = keep
        self._snapshots = []


# ---- prompt lookup -----------------------------------------------------------------------------------
@dataclass
class PromptLookupDraft(DraftSource):
    """n-gram lookup in prompt + output: find the most recent earlier occurrence of the context's last
    ``n`` tokens (``n`` from `max_ngram` down to `min_ngram`) and propose what followed it (see
    :meth:`lookup`). A
    deterministic draft (point-mass ``p``). The index of n-grams grows with the context (each
    position is indexed once), so a lookup is a dictionary access, not a scan."""

    max_ngram: int = 3
    min_ngram: int = 1
    kind: str = field(default="prompt_lookup", init=False)

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise AttnkitError(f"prompt_lookup: {name} must be a whole number >= 1, got {v!r}")
        if self.min_ngram > self.max_ngram:
            raise AttnkitError(f"prompt_lookup: min_ngram ({self.min_ngram}) is larger than max_ngram "
                               f"({self.max_ngram})")
        self._reset()

    def _reset(self):
        # n -> {n-gram: largest end index e whose continuation context[e + 1] is known}
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        self._indexed_to = -1  # n-grams ending at e <= _indexed_to are in the index
        self._tokens: list[int] = []  # the context the index was built from, up to _indexed_to + 1

    def describe(self) -> str:
        return f"prompt_lookup(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

    def start(self, run: DraftRun) -> Session | None:
        self._reset()
        return None

    def _extend_index(self, context: list[int]) -> None:
        known = len(self._tokens)
        if context[:known] != self._tokens:  # not a continuation of the indexed context: start over
            self._reset()
            known = 0
        last = len(context) - 2  # the last n-gram end with a known continuation
        for e in range(self._indexed_to + 1, last + 1):
            for n, table in self._index.items():
                if e - n + 1 >= 0:
                    table[tuple(context[e - n + 1:e + 1])] = e
        if last > self._indexed_to:
            self._indexed_to = last
            self._tokens.extend(context[known:last + 2])

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        """Up to `gamma` tokens: what followed the latest earlier occurrence (ending at ``e``) of the
        longest matching suffix n-gram. When that continuation runs into the end of the context it
        goes on through the proposal itself (a copy with period ``L - 1 - e``: ``...abcab`` -> ``cab``),
        which is what copying the earlier occurrence predicts."""
        self._extend_index(context)
        L = len(context)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            e = self._index[n].get(tuple(context[L - n:]))
            if e is not None:
                out = context[e + 1:min(L, e + 1 + gamma)]
                while len(out) < gamma:
                    out.append(out[len(out) - (L - 1 - e)])
                return out
        return []

    def propose(self, context: list[int], gamma: int) -> Proposal:
        return Proposal(self.lookup(context, gamma), None)


# ---- construction from a kind and a spec ---------------------------------------------------------------
DEFAULT_SELF_METHOD = "streaming:budget_tokens=256,sinks=4"
DEFAULT_DRAFT_MODEL = "tiny-draft"


def _key_values(spec: str, what: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise AttnkitError(f"{what}: expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def make_draft(kind: str, spec: str | LoadedModel | Method | None = None, target: LoadedModel | None = None
               ) -> DraftSource:
    """A draft source from the CLI's ``--speculate KIND [--draft SPEC]``:

    - ``draft_model``: SPEC is a model spec (default ``tiny-draft``) or a :class:`LoadedModel`; an
      optional ``@method-spec`` suffix gives the draft its own attention method
      (``tiny-draft@window:window=256``);
    - ``prompt_lookup``: SPEC is ``max_ngram=N,min_ngram=M`` (defaults 3 and 1);
    - ``self``: SPEC is the draft cache's method spec (default ``streaming:budget_tokens=256,sinks=4``)
      or a :class:`Method`.
    """
    from attnkit.model import load_model

    if kind == "prompt_lookup":
        if spec is not None and not isinstance(spec, str):
            raise AttnkitError(f"prompt_lookup takes a spec string like 'max_ngram=3,min_ngram=1', got "
                               f"{type(spec).__name__}")
        opts = _key_values(spec or "", "prompt_lookup spec")
        unknown = sorted(set(opts) - {"max_ngram", "min_ngram"})
        if unknown:
            raise AttnkitError(f"prompt_lookup has no option {', '.join(unknown)}; options: max_ngram, min_ngram")
        try:
            values = {k: int(v) for k, v in opts.items()}
        except ValueError:
            raise AttnkitError(f"prompt_lookup options must be whole numbers, got {spec!r}") from None
        return PromptLookupDraft(**values)
    if kind == "self":
        if isinstance(spec, Method):
            method = spec
        else:
            method = parse_method_spec(spec or DEFAULT_SELF_METHOD)
        if append_only(method):
            raise AttnkitError("self-speculation drafts with a compressed cache: give an eviction method such as "
                               f"{DEFAULT_SELF_METHOD!r}, not {method.describe()!r} (that is the target itself)")
        return ModelDraft(None, method, kind="self")
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
        return ModelDraft(model, method, kind="draft_model")
    raise AttnkitError(f"unknown draft source {kind!r}; choose one of {', '.join(DRAFT_KINDS)}")
