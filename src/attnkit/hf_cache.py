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

Positions stay the original ones even after eviction: :meth:`get_seq_length` reports the tokens
*seen*, which is what ``generate`` builds position ids and masks from, while the tensors hold only
the kept entries (:attr:`kv`, :meth:`nbytes`).

Supported: batch size 1 without padding (the method masks by original positions itself, the model's
own sliding window included; the mask transformers builds is checked to say the same), greedy or sampled
decoding, one prefill forward followed by one-token steps.
Not supported (clear errors): a mask that hides more than that (padding, a custom mask), beam search,
several sequences per prompt, ``prefill_chunk_size`` and assisted decoding (several tokens per forward
after the prompt), cropping.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from attnkit import masks, validate
from attnkit.attention import ATTN_IMPLEMENTATION, defer_attention
from attnkit.cache import KVCache
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method, resolve_method
from attnkit.rope import Rope
from attnkit.session import Session, Step


def check_positional_mask(mask: torch.Tensor, q_pos: torch.Tensor, window: int | None, rows: int = 256) -> bool:
    """Refuse an attention mask ``[batch, 1 or heads, queries, keys]`` (boolean, True = attend, or additive)
    that differs from causal attention by position within `window` (:func:`attnkit.masks.sliding_window`):
    keys are positions ``0 .. keys-1``, queries `q_pos`. Compared a block of `rows` queries at a time."""
    rule = masks.sliding_window(window)
    k_pos = torch.arange(mask.shape[-1], device=mask.device)
    for s in range(0, mask.shape[-2], rows):
        block = mask[..., s:s + rows, :]
        allowed = block if block.dtype == torch.bool else block > torch.finfo(block.dtype).min / 2
        expected = masks.boolean_mask(rule, q_pos[s:s + rows].to(mask.device), k_pos)
        if not bool((allowed == expected).all()):
            raise AttnkitError("the attention mask hides tokens that causal attention by position would see (a "
                               "padded prompt?); AttnkitCache masks by position itself and does not support "
                               "padding or custom masks yet: give one unpadded prompt")
    return True


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
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._owner.reset()

    def _unsupported(self, what: str):
        raise AttnkitError(f"AttnkitCache does not support {what}")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("cropping (assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("several sequences per prompt (num_return_sequences / num_beams > 1)")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("selecting batch entries")


class AttnkitCache(Cache):
    """A transformers cache that runs an attnkit method (eviction or any other) inside ``model.generate``.

    `model` is a :class:`~attnkit.model.LoadedModel` or a transformers causal LM whose attention
    implementation is ``"attnkit"``; `method` a registered name (with `params`) or a method instance;
    `max_new_tokens` the generation length passed to ``generate`` (it sizes the cache and sets
    Keyformer's temperature schedule, eq. 10 of the Keyformer paper).
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
            raise AttnkitError(f"method {self.method.name!r} changes which tokens the decoder layers see (a model-level "
                               f"hook), which model.generate cannot do; use attnkit.generate instead")
        self.max_new_tokens = max_new_tokens
        self.n_layers = config.get_text_config(decoder=True).num_hidden_layers
        self.rope = Rope.from_model(hf)
        self.session: Session | None = None
        self._seen = [0] * self.n_layers
        self._step: Step | None = None
        self._step_start = -1
        super().__init__(layers=[_AttnkitLayer(self, i) for i in range(self.n_layers)])

    # ---- what transformers calls ---------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Record the layer call for the attention function (nothing is stored here) and count the tokens."""
        if key_states.shape[0] != 1:
            raise AttnkitError(f"AttnkitCache supports batch size 1 (one prompt; no beam search or several "
                               f"sequences per prompt), got a batch of {key_states.shape[0]}")
        n = key_states.shape[-2]
        seen = self._seen[layer_idx]
        if self.session is None:
            self.session = Session(self.method, KVCache(self.n_layers), self.n_layers, n, self.max_new_tokens,
                                   rope=self.rope)
        prompt_len = self.session.prompt_len
        if seen == 0 and n != prompt_len:
            raise AttnkitError(f"layer {layer_idx} got a {n}-token prompt but layer 0 got {prompt_len}")
        if seen > 0 and n != 1:
            raise AttnkitError(f"AttnkitCache takes the prompt in one forward, then one token per forward; got "
                               f"{n} tokens after {seen} (prefill_chunk_size and assisted decoding are not supported)")
        if seen + n > prompt_len + self.max_new_tokens:
            raise AttnkitError(f"this AttnkitCache was built for max_new_tokens={self.max_new_tokens}; "
                               f"generation went past it (pass the same max_new_tokens to generate)")
        defer_attention(self, layer_idx, key_states)
        self._seen[layer_idx] = seen + n
        return key_states, value_states

    def layer_attention(self, layer_idx: int, query, key, value, scaling: float, sliding_window,
                        attention_mask=None) -> torch.Tensor:
        """The deferred attention call of `layer_idx`: run the method on this forward's step.

        The method masks by original positions itself (causal, and the model's own sliding window), so the
        mask transformers built must say exactly that; a mask that hides more (a padded prompt's padding, a
        custom mask) is refused rather than ignored."""
        n = key.shape[-2]
        start = self._seen[layer_idx] - n
        if self._step is None or self._step_start != start:  # first layer of a new forward
            phase = "prefill" if start == 0 else "decode"
            self._step = Step(self.session, phase, torch.arange(start, start + n, device=query.device), True)
            self._step_start = start
        if attention_mask is not None:
            # the layers of one forward share their mask objects: each is checked once
            self._step.shared_value(("mask_checked", id(attention_mask), sliding_window),
                                    lambda: check_positional_mask(attention_mask, self._step.q_pos, sliding_window))
        return self._step.attention(layer_idx, query, key, value, scaling, sliding_window)

    def reset(self) -> None:
        """Forget everything, so the cache can serve a new generation."""
        self.session = None
        self._seen = [0] * self.n_layers
        self._step, self._step_start = None, -1

    # ---- what users read -------------------------------------------------------------------------
    def seen_tokens(self, layer_idx: int = 0) -> int:
        """Tokens this layer has seen (prompt + generated): original positions continue from here."""
        return self._seen[layer_idx]

    @property
    def kv(self) -> KVCache | None:
        """The attnkit KV cache holding the kept entries (None before the first forward)."""
        return None if self.session is None else self.session.cache

    def kept_lengths(self) -> list[int]:
        """Entries held per layer (the same in every kv head)."""
        return [0] * self.n_layers if self.kv is None else self.kv.lengths()

    def nbytes(self) -> int:
        """Bytes of key and value storage held now."""
        return 0 if self.kv is None else self.kv.nbytes()

    @property
    def peak_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.peak_bytes

    def __repr__(self) -> str:
        return f"AttnkitCache({self.method.describe()}, seen={self._seen[0]}, kept={self.kept_lengths()})"
