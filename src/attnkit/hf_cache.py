"""attnkit methods inside plain ``model.generate(...)``: a transformers :class:`~transformers.Cache`.

    import attnkit
    from attnkit.hf_cache import AttnkitCache

    model = attnkit.load_model("tiny")            # attn_implementation "attnkit"
    cache = AttnkitCache(model, "h2o", params={"budget_tokens": 256}, max_new_tokens=64)
    out = model.hf.generate(ids, past_key_values=cache, max_new_tokens=64, do_sample=False)

The tokens are the same as ``attnkit.generate(model, ids, "h2o", params=..., max_new_tokens=64)``:
both routes run the same method hooks on the same :class:`~attnkit.session.Session`.

How the cache and the attention function meet. In transformers (5.x) an attention module calls
``past_key_values.update(k, v, layer_idx)`` and then the registered attention function with what
``update`` returned; the function never sees the cache. :meth:`AttnkitCache.update` therefore stores
nothing: it records the pending layer call with :func:`attnkit.attention.defer_attention` (a
per-thread slot keyed by the identity of the key tensor it returns) and returns k and v unchanged;
``attnkit_attention`` claims that call and hands q, k, v to :meth:`AttnkitCache.layer_attention`, which
runs the method (storing, evicting, attending) exactly as the runner does. If the model does not use
attnkit's attention function the constructor refuses it, and a call that was never claimed is
reported at the next ``update``. One cache serves one generation in one thread at a time (as any
transformers cache); :meth:`reset` makes it reusable.

Positions stay the original ones even after eviction: :meth:`get_seq_length` reports the columns
*seen* (padding included), which is what ``generate`` builds position ids and masks from, while the
tensors hold only the kept entries of real tokens (:meth:`kept_lengths`, :meth:`nbytes`, :meth:`row_nbytes`).

A padded batch. ``generate`` on a left-padded batch (the tokenizer's ``padding_side="left"``, a 2-D
``attention_mask``) numbers each row's real tokens 0, 1, .. (position ids from the mask's cumulative sum)
and hides its leading padding columns in the 4-D mask it hands the attention function. The first forward
reads each row's padding from that mask (the first column any query sees); rows with the same padding
(prompts of the same length) share one :class:`~attnkit.session.Session` whose cache rows they are, other
rows are other sessions (one per row for methods whose state is per sequence, ``Method.batches``), and
each layer's attention is split by session (:class:`~attnkit.session.RowsStep`, rows gathered by session
when they are not contiguous). Padding columns are never stored and their outputs are zeros. Every
forward's mask must then be exactly causal attention by position after each row's padding (within the
model's own window), and the position ids those positions, so each row gets the tokens of its prompt
alone through ``attnkit.generate``. Several sequences per prompt (``num_return_sequences``) are rows of
the batch like any other.

Supported: a batch (left padded or not), greedy or sampled decoding, ``num_return_sequences``, one
prefill forward followed by one-token steps.
Not supported (clear errors): a mask that hides more than left padding (right padding, a custom mask) or
position ids that are not the mask's, beam search, rows selected or repeated after the prefill,
``prefill_chunk_size`` and assisted decoding (several tokens per forward after the prompt), cropping.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from attnkit import masks, validate
from attnkit.attention import ATTN_IMPLEMENTATION, defer_attention, watch_layer_inputs
from attnkit.cache import KVCache
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method, resolve_method
from attnkit.rope import Rope
from attnkit.runner import group_prompts
from attnkit.session import RowsStep, Session, Step


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """True = attend, for a boolean or an additive mask."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def check_positional_mask(mask: torch.Tensor, q_pos: torch.Tensor, window: int | None, rows: int = 256,
                          padding: torch.Tensor | None = None) -> bool:
    """Refuse an attention mask ``[batch, 1 or heads, queries, keys]`` (boolean, True = attend, or additive)
    that differs from causal attention by position within `window` (:func:`attnkit.masks.sliding_window`)
    after each row's left padding: key column ``c`` of row ``b`` is position ``c - padding[b]`` (columns
    before ``padding[b]`` hidden from every query; no padding when None), queries are at the columns `q_pos`.
    Compared a block of `rows` queries at a time."""
    rule = masks.sliding_window(window)
    pad = torch.zeros(1, dtype=torch.long) if padding is None else padding
    pad = pad.to(mask.device)[:, None]
    k_pos = torch.arange(mask.shape[-1], device=mask.device)[None] - pad  # [batch, keys]
    for s in range(0, mask.shape[-2], rows):
        q = q_pos[s:s + rows].to(mask.device)[None] - pad  # [batch, queries]
        expected = (k_pos[:, None] >= 0) & rule(None, q[:, :, None], k_pos[:, None])
        agrees = _allowed(mask[..., s:s + rows, :]) == expected[:, None]
        if not bool(agrees.all()):
            row = int((~agrees).flatten(1).any(1).int().argmax())
            raise AttnkitError(f"the attention mask of batch row {row} is not causal attention by position after the "
                               f"row's left padding (a right-padded or custom mask?); AttnkitCache masks by position "
                               f"itself and honours left padding only")
    return True


def mask_padding(mask: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's left padding ``[rows]``: the first key column any query of the prompt's mask sees."""
    seen = _allowed(mask).any(dim=-2).any(dim=1).expand(rows, -1)  # [rows, keys]
    empty = ~seen.any(-1)
    if bool(empty.any()):
        raise AttnkitError(f"batch row {int(empty.int().argmax())} has no token its attention mask shows (an "
                           f"all-padding prompt); every prompt needs at least one token")
    return seen.int().argmax(-1)


class _AttnkitLayer(CacheLayerMixin):
    """One model layer's face of an :class:`AttnkitCache` towards transformers (lengths only)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: AttnkitCache, index: int):
        super().__init__()
        self._owner = owner
        self.index = index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._owner.update(key_states, value_states, self.index)

    def get_seq_length(self) -> int:
        return self._owner.seen_tokens(self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        seen = self.get_seq_length()
        if seen and not query_length:  # generate cut a prompt no longer than what the cache holds down to nothing
            raise AttnkitError(self._owner.used_message())
        return seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._owner.reset()

    def _unsupported(self, what: str):
        raise AttnkitError(f"AttnkitCache does not support {what}")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("beam search (reorder_cache); use greedy or sampled decoding")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("cropping (assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("repeating the rows of a filled cache (batch_repeat_interleave); pass the prompts "
                          "with num_return_sequences to generate instead")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("selecting batch entries")


class AttnkitCache(Cache):
    """A transformers cache that runs an attnkit method (eviction or any other) inside ``model.generate``.

    `model` is a :class:`~attnkit.model.LoadedModel` or a transformers causal LM whose attention
    implementation is ``"attnkit"``; `method` a registered name (with `params`) or a method instance;
    `max_new_tokens` the generation length passed to ``generate`` (it sizes the cache and sets
    Keyformer's temperature schedule, eq. 10 of the Keyformer paper). The batch may be left padded
    (see the module docstring).
    """

    def __init__(self, model, method: str | Method = "full", *, params: dict | None = None,
                 max_new_tokens: int):
        hf = getattr(model, "hf", model)
        config = getattr(hf, "config", None)
        if config is None:
            raise AttnkitError(f"AttnkitCache needs a transformers model or attnkit LoadedModel, got {type(model).__name__}")
        impl = getattr(config, "_attn_implementation", None)
        if impl != ATTN_IMPLEMENTATION:
            raise AttnkitError(f"the model uses attn_implementation={impl!r}; AttnkitCache needs "
                               f"{ATTN_IMPLEMENTATION!r} (attnkit.prepare(model, tokenizer) or "
                               f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}))")
        if not (validate.is_whole(max_new_tokens) and max_new_tokens >= 1):
            raise AttnkitError(f"max_new_tokens must be the generation length (a whole number >= 1), "
                               f"got {max_new_tokens!r}")
        self.method = resolve_method(method, params)
        if self.method.run_layers is not None:
            raise AttnkitError(f"method {self.method.name!r} runs the decoder layers itself (a model-level hook: it "
                               f"changes which tokens the layers see, or runs a forward of its own after the prompt), "
                               f"which model.generate cannot do; use attnkit.generate instead")
        if getattr(self.method, "needs_layer_inputs", False):
            watch_layer_inputs(hf)  # the layers' attention inputs reach note_layer_input
        self.max_new_tokens = max_new_tokens
        self.n_layers = config.get_text_config(decoder=True).num_hidden_layers
        self.rope = Rope.from_model(hf)
        self.reset()
        super().__init__(layers=[_AttnkitLayer(self, i) for i in range(self.n_layers)])

    # ---- what transformers calls ---------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Record the layer call for the attention function (nothing is stored here) and count the columns."""
        rows, n = key_states.shape[0], key_states.shape[-2]
        seen = self._seen[layer_idx]
        if self.rows == 0:  # the prompt's forward, first layer
            self.rows, self._prompt_len = rows, n
        if rows != self.rows:
            raise AttnkitError(f"layer {layer_idx} got a batch of {rows} rows but the prompt had {self.rows}; "
                               f"AttnkitCache keeps the batch generate started with")
        if seen == 0 and n != self._prompt_len:
            raise AttnkitError(f"layer {layer_idx} got a {n}-token prompt but layer 0 got {self._prompt_len}")
        if seen > 0 and n != 1:
            raise AttnkitError(f"AttnkitCache takes the prompt in one forward, then one token per forward; got "
                               f"{n} tokens after {seen} (prefill_chunk_size and assisted decoding are not supported; a second "
                               f"generate needs cache.reset() or a new AttnkitCache)")
        if seen + n > self._prompt_len + self.max_new_tokens:
            raise AttnkitError(f"this AttnkitCache was built for max_new_tokens={self.max_new_tokens}; "
                               f"generation went past it (pass the same max_new_tokens to generate)")
        defer_attention(self, layer_idx, key_states)
        self._seen[layer_idx] = seen + n
        return key_states, value_states

    def note_layer_input(self, layer_idx: int, hidden: torch.Tensor, module=None) -> None:
        """The layer's attention input (:func:`attnkit.attention.watch_layer_inputs`), handed to this forward's step
        with the layer's attention call."""
        self._layer_input = (layer_idx, hidden, module)

    def layer_attention(self, layer_idx: int, query, key, value, scaling: float, sliding_window,
                        attention_mask=None, position_ids=None) -> torch.Tensor:
        """The deferred attention call of `layer_idx`: run the method on this forward's step.

        The method masks by original positions itself (causal, and the model's own sliding window), so the
        mask transformers built must say exactly that after each row's left padding, and the position ids
        (q and k are rotated at them) must be those positions; anything else (right padding, a custom mask
        or custom positions) is refused rather than ignored."""
        n = key.shape[-2]
        start = self._seen[layer_idx] - n
        if self._step is None or self._step_start != start:  # first layer of a new forward
            self._begin_forward(start, n, attention_mask, query.device)
        # the layers of one forward share their mask and position objects: each is checked once
        if (id(attention_mask), sliding_window) not in self._checked:
            self._check_mask(attention_mask, start, n, sliding_window)
            self._checked.add((id(attention_mask), sliding_window))
        if position_ids is not None and id(position_ids) not in self._checked:
            self._check_positions(position_ids, start, n)
            self._checked.add(id(position_ids))
        if self._layer_input is not None and self._layer_input[0] == layer_idx:
            _, hidden, module = self._layer_input
            self._layer_input = None
            rows = None if self._order is None else self._order.to(hidden.device)
            self._step.note_layer_input(layer_idx, hidden if rows is None else hidden[rows], module)
        if self._order is None:
            return self._step.attention(layer_idx, query, key, value, scaling, sliding_window)
        order = self._order.to(query.device)
        out = self._step.attention(layer_idx, query[order], key[order], value[order], scaling, sliding_window)
        return out[self._inverse.to(out.device)]

    def _begin_forward(self, start: int, n: int, mask, device) -> None:
        """A new forward: on the prompt's, read each row's padding and start a session per group of rows of
        the same prompt length; then one step per session at its rows' own positions."""
        if start == 0:
            pad = torch.zeros(self.rows, dtype=torch.long) if mask is None else mask_padding(mask, self.rows)
            self.paddings = pad.tolist()
            lengths = [self._prompt_len - p for p in self.paddings]
            self.groups = [(tuple(rows), Session(self.method, KVCache(self.n_layers, len(rows)), self.n_layers,
                                                 lengths[rows[0]], self.max_new_tokens, rope=self.rope))
                           for rows in group_prompts(lengths, self.method)]
            order = [r for rows, _ in self.groups for r in rows]
            if order != sorted(order):
                self._order = torch.tensor(order)
                self._inverse = torch.argsort(self._order)
        parts, row = [], 0
        for rows, session in self.groups:
            tokens = min(n, start + n - self.paddings[rows[0]])  # the columns of this forward after the padding
            first = start + n - tokens - self.paddings[rows[0]]
            step = Step(session, "prefill" if start == 0 else "decode", torch.arange(first, first + tokens, device=device))
            parts.append((row, row + len(rows), tokens, step))
            row += len(rows)
        self._step = parts[0][3] if len(parts) == 1 and parts[0][2] == n else RowsStep(parts)
        self._step_start = start
        self._checked = set()

    def _check_mask(self, mask, start: int, n: int, window) -> None:
        if mask is None:
            if any(self.paddings):
                raise AttnkitError("a forward without attention mask after a left-padded prompt; AttnkitCache needs "
                                   "generate's mask at every step")
            return
        check_positional_mask(mask, torch.arange(start, start + n), window, padding=torch.tensor(self.paddings))

    def _check_positions(self, position_ids: torch.Tensor, start: int, n: int) -> None:
        if position_ids.dim() != 2:
            raise AttnkitError(f"AttnkitCache needs position ids [batch, tokens], got shape {tuple(position_ids.shape)}")
        pad = torch.tensor(self.paddings, device=position_ids.device)[:, None]
        expected = torch.arange(start, start + n, device=position_ids.device)[None] - pad
        wrong = (position_ids != expected) & (expected >= 0)  # padding columns' positions are never used
        if bool(wrong.any()):
            row = int(wrong.any(-1).int().argmax())
            raise AttnkitError(f"the position ids of batch row {row} are not its positions after its left padding "
                               f"(column - padding); AttnkitCache needs the positions generate derives from the mask")

    def reset(self) -> None:
        """Forget everything, so the cache can serve a new generation."""
        self.rows = 0  # batch rows (0 before the first forward)
        self.paddings: list[int] = []  # leading padding columns per row
        # (batch rows, session) per group of rows that share a session, in the order the steps take them
        self.groups: list[tuple[tuple[int, ...], Session]] = []
        self._seen = [0] * self.n_layers
        self._prompt_len = 0
        self._order = self._inverse = None  # rows gathered by group when the groups are not contiguous
        self._step, self._step_start = None, -1
        self._checked: set = set()
        self._layer_input = None  # (layer, hidden, module) until the layer's attention call takes it

    def used_message(self) -> str:
        return (f"this AttnkitCache already holds a generation ({self._seen[0]} tokens seen): call cache.reset() "
                f"before another generate, or give each generate a new AttnkitCache")

    # ---- what users read -------------------------------------------------------------------------
    def seen_tokens(self, layer_idx: int = 0) -> int:
        """Columns this layer has seen (prompt, padding included, + generated): what generate counts."""
        return self._seen[layer_idx]

    def session_of(self, row: int) -> Session | None:
        """The session holding batch row `row` (None before the first forward)."""
        if not self.groups:
            return None
        if not (validate.is_whole(row) and 0 <= row < self.rows):
            raise AttnkitError(f"row must be a batch row 0..{self.rows - 1}, got {row!r}")
        return next(session for rows, session in self.groups if row in rows)

    @property
    def kv(self) -> KVCache | None:
        """The attnkit KV cache holding the kept entries when one session holds the whole batch (batch size 1,
        or prompts of one length); None before the first forward. Several sessions: :meth:`session_of`."""
        if len(self.groups) > 1:
            raise AttnkitError(f"this batch is held by {len(self.groups)} sessions (prompts of different lengths); "
                               f"read one row's cache with session_of(row).cache")
        return self.groups[0][1].cache if self.groups else None

    def kept_lengths(self, row: int = 0) -> list[int]:
        """Entries batch row `row` holds per layer, per kv head (a head-adaptive layer, stored flat, holds a
        different number in each head: its figure is the total over the heads)."""
        session = self.session_of(row)
        return [0] * self.n_layers if session is None else session.cache.lengths()

    def nbytes(self) -> int:
        """Bytes of key and value storage the whole batch holds now."""
        return sum(session.cache.nbytes() for _, session in self.groups)

    def row_nbytes(self, row: int = 0) -> int:
        """Bytes batch row `row` holds now (its share of its session's cache)."""
        session = self.session_of(row)
        return 0 if session is None else session.cache.row_nbytes()

    @property
    def peak_bytes(self) -> int:
        """The most the batch held: the sum of its sessions' peaks (they run in the same forwards; exact for
        one session, an upper bound otherwise)."""
        return sum(session.cache.peak_bytes for _, session in self.groups)

    def __repr__(self) -> str:
        return (f"AttnkitCache({self.method.describe()}, rows={self.rows}, seen={self._seen[0]}, "
                f"kept={self.kept_lengths() if self.groups else []})")
