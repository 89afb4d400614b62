"""``fastkvzip``: entries scored by a trained gate on each layer's hidden states, the lowest evicted across kv heads
and layers (Kim, Han, Yun, 2026, "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction",
arXiv 2601.17668; kvpress's ``FastKVzipPress``).

**Why.** KVzip (:mod:`attnkit.methods.kvzip`; Kim et al. 2025, arXiv 2505.23416) scores each entry by the most
attention it receives while the model repeats the prompt: accurate, but a second forward over the prompt. Fast
KVzip distils that score into a gate per layer (:mod:`attnkit.methods.fastkvzip_gates`: a low-rank attention of the
token's own key against learnt sink keys, a score in (0, 1)), trained with a binary cross-entropy against KVzip's
scores (section 3.2; ``attnkit calibrate fastkvzip``, :mod:`attnkit.calibrate.fastkvzip`), so scoring costs a few
small matrix products per token and no extra forward.

**Which entries stay** (kvpress's ``FastKVzipPress`` rule, the paper's eviction): after the prompt (``n`` tokens)
every entry of every layer and kv head has its gate score; the first ``n_sink`` positions and the last ``w``
positions are protected (score 1, above any gate's), ``w = max(1, int(n x window_ratio))`` for a prompt under
32,000 tokens and ``window_size`` from there on. Then

- ``layerwise=false`` (default, as kvpress and the paper): the ``sum_l kv x B_l`` entries of highest score across
  all layers and kv heads stay, so layers and heads keep different counts (the layer's cache is stored flat:
  :meth:`attnkit.cache.LayerKV.keep_flat`). The choice needs every layer's scores, so each layer holds its whole
  prompt until the last layer's attention is done (peak memory: the uncompressed prompt), and sequences run one per
  session (their counts differ).
- ``layerwise=true``: each layer keeps its ``kv x B`` entries of highest score across its kv heads (AdaKV's rule
  with no safeguard); batches work.

``B`` is the layer's budget (``budget`` as a fraction of the prompt, or ``budget_tokens``; a list gives one per
layer). The entries dropped are chosen as kvpress chooses them (the lowest of the whole model fix each layer's count,
then each layer drops that many of its lowest across its kv heads, both by ``topk`` of the negated scores), so equal
scores at the boundary (equal tokens in the first layer, whose input is the token's embedding) fall alike. Generated tokens are appended unscored (kvpress's press compresses the prompt only; ``decode_every`` is
refused). kvpress evicts by masking the entries it drops (they stay in memory); attnkit removes them.

**Gates.** ``config`` is attnkit's safetensors file (``attnkit calibrate fastkvzip``, refusing a model of another
geometry or other weights) or the authors' torch file as kvpress downloads it (``Jang-Hyun/Fast-KVzip``,
``<model>/q{G}_dim16_sink16.pt``), geometry checked. The gates run in float32; kvpress runs them in the file's dtype
(bfloat16 for the published ones), so with those files scores may differ at bfloat16 rounding.

At a budget that holds everything nothing is scored into a decision and the tokens are ``full``'s. The prompt's
attention is plain dense attention. The hosts that hand over the layers' inputs are attnkit's runner and
``AttnkitCache``; vLLM refuses it (its choice across kv heads gives them different counts, which a request's
blocks cannot hold).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.fastkvzip_gates import load_gates
from attnkit.methods.prompt_scorer import COUNTS_FIXED, PromptScorer, PromptScorerState
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import flag, fraction, whole

LONG_CONTEXT = 32000  # from this prompt length on, the protected window is `window_size` tokens (kvpress's rule)
PROTECTED = 1.0  # the score of the sinks and the window: above any gate's, which lie in (0, 1)


def protected_window(prompt_len: int, window_ratio: float, window_size: int) -> int:
    """The last positions of a prompt of `prompt_len` tokens the gates never evict."""
    return max(1, int(prompt_len * window_ratio)) if prompt_len < LONG_CONTEXT else window_size


def keep_all_but_lowest(rank: torch.Tensor, drop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kv head and slot ``[b, kv x L - drop]`` (ordered by head, then slot) of every entry of `rank` ``[b, kv, L]``
    but the `drop` lowest of each row across its kv heads (chosen as kvpress's ``topk`` of the negated scores)."""
    b, kv, length = rank.shape
    keep = torch.ones(b, kv * length, dtype=torch.bool, device=rank.device)
    keep.scatter_(1, (-rank.reshape(b, -1)).topk(drop, dim=-1).indices, False)
    chosen = keep.nonzero()[:, 1].view(b, -1)
    return chosen.div(length, rounding_mode="floor"), chosen % length


@dataclass
class FastKVzipState(PromptScorerState):
    """Per layer: whether the gates were checked against this layer (geometry and weights)."""

    checked: bool = False


@register
@dataclass(frozen=True)
class FastKVzip(PromptScorer):
    """Entries scored by a trained gate per layer (Fast KVzip); the lowest evicted across all layers and kv heads
    (or across the kv heads of each layer), sinks and a recent window protected."""

    config: str | None = None
    n_sink: int = 4
    window_ratio: float = 0.02
    window_size: int = 4096
    layerwise: bool = False

    name = "fastkvzip"
    summary = "KVzip's scores distilled into a trained gate per layer, evicted across layers (Fast KVzip, Kim 2026)"
    kvpress = "FastKVzipPress"
    threshold_refusal = reindex_refusal = "its gates' scores are ranked across layers (layerwise=false) or per budget"  # score_threshold, positions=reindexed
    layer_state_type = FastKVzipState
    needs_layer_inputs = True

    def __post_init__(self):
        if not isinstance(self.config, str) or not self.config:
            raise AttnkitError(f"fastkvzip needs config=FILE, gates trained for the model (`attnkit calibrate "
                               f"fastkvzip --model M --out FILE`, or the authors' .pt file); got config={self.config!r}")
        super().__post_init__()
        whole("n_sink", self.n_sink, 0, what=" (first positions never evicted)")
        fraction("window_ratio", self.window_ratio, allow_zero=True,
                 what=" (share of the prompt, at least one token, never evicted at the end of the prompt)")
        whole("window_size", self.window_size, 1, what=f" (recent tokens never evicted from {LONG_CONTEXT} on)")
        flag("layerwise", self.layerwise)
        across = "kv heads" if self.layerwise else "kv heads and layers"
        self.refuse_options(COUNTS_FIXED, f"the gates choose across {across} once, after the prompt")
        object.__setattr__(self, "_gates", load_gates(self.config))

    @property
    def batches(self) -> bool:
        return self.layerwise  # across layers, each sequence keeps its own count per layer

    def decode_only_appends(self) -> bool:
        return False  # a flat layer takes one token per step

    # ---- sizes ---------------------------------------------------------------------------------------
    def window(self, prompt_len: int) -> int:
        return protected_window(prompt_len, self.window_ratio, self.window_size)

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        s = ctx.session
        held = min(s.prompt_len, self.n_sink + self.window(s.prompt_len))
        if budget < s.prompt_len and budget < held:
            raise AttnkitError(f"fastkvzip: the {self.n_sink} sinks and {held - min(self.n_sink, held)}-token window "
                               f"of a {s.prompt_len}-token prompt fill the {budget}-slot budget of layer {ctx.index}; "
                               f"raise the budget or lower n_sink / window_ratio")

    def evicts(self, ctx: LayerContext) -> bool:
        if self.layerwise:
            return super().evicts(ctx)
        if ctx.state.evicts is None:  # across layers: every layer takes part as soon as one would evict
            s = ctx.session
            ctx.state.evicts = any(self.budget_of_layer(i, s.n_layers, s.prompt_len) < s.prompt_len
                                   for i in range(s.n_layers))
            if ctx.state.evicts:
                self.layer_budget(ctx)  # checked once per layer
        return ctx.state.evicts

    def planned_slots(self, ctx: LayerContext) -> int:
        if self.layerwise:
            return super().planned_slots(ctx)
        s = ctx.session
        return s.prompt_len + s.max_new_tokens  # at most: a layer may keep its whole prompt

    # ---- scores --------------------------------------------------------------------------------------
    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return self.score_buffer(ctx)[:, :, :ctx.kv.length]

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        n = ctx.session.prompt_len
        positions = ctx.kv.view()[2]
        return (positions < self.n_sink) | (positions >= n - self.window(n))

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        out = super().prefill_attention(ctx, q, k, v)  # stored whole, dense attention
        if self.evicts(ctx):
            if not ctx.state.checked:
                s = ctx.session
                self._gates.check_model(s.n_layers, ctx.layer_input().shape[-1], k.shape[1])
                self._gates.check_layer(ctx.index, ctx.layer_module())
                ctx.state.checked = True
            hidden = ctx.layer_input()
            if hidden.shape[1] != k.shape[2]:
                raise AttnkitError(f"fastkvzip: layer {ctx.index}'s input holds {hidden.shape[1]} tokens but its "
                                   f"attention {k.shape[2]}")
            end = ctx.kv.length
            self.score_buffer(ctx)[:, :, end - k.shape[2]:end] = self._gates.scores(ctx.index, hidden)
        return out

    # ---- eviction ------------------------------------------------------------------------------------
    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        rank = self.rank(ctx).masked_fill(self.protect(ctx, next_pos), PROTECTED)
        heads, slots = keep_all_but_lowest(rank, rank.shape[1] * (rank.shape[2] - count))
        ctx.kv.keep_flat(heads, slots, spare=spare)
        self._mark_evicting(ctx)

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        if self.layerwise:
            return super().after_prefill(ctx, q, k, v)
        s = ctx.session
        if not self.evicts(ctx) or ctx.index != s.n_layers - 1:
            return  # the other layers wait for the last one's scores
        if s.rows != 1:
            raise AttnkitError(f"fastkvzip with layerwise=false scores one sequence per session, got {s.rows}")
        layers = [i for i in range(s.n_layers) if s.cache.layers[i] is not None]
        ranks, kept = [], 0
        for i in layers:
            kv = s.cache.layers[i]
            positions = kv.view()[2]
            window = self.window(s.prompt_len)
            protect = (positions < self.n_sink) | (positions >= s.prompt_len - window)
            ranks.append(kv.extras["score"][:, :, :kv.length].masked_fill(protect, PROTECTED).cpu())
            kept += kv.keys.shape[1] * min(self.budget_of_layer(i, s.n_layers, s.prompt_len), kv.length)
        # kvpress's order of choices (its ties too): the lowest of the whole model give each layer its count, then
        # each layer drops that many of its lowest across its kv heads
        flat = torch.cat([r.reshape(-1) for r in ranks])
        offsets = torch.tensor([0] + [r.numel() for r in ranks]).cumsum(0)
        pruned = (-flat).topk(max(0, flat.shape[0] - kept)).indices
        per_layer = torch.bincount(torch.searchsorted(offsets, pruned, right=True) - 1, minlength=len(ranks))
        for i, r, drop in zip(layers, ranks, per_layer.tolist()):
            kv = s.cache.layers[i]
            heads, slots = keep_all_but_lowest(r, drop)
            kv.keep_flat(heads.to(kv.keys.device), slots.to(kv.keys.device), spare=s.max_new_tokens)
            s.layer_state[i].evicting = True

    def run_stats(self, session) -> dict:
        held = seen = 0
        for layer in session.cache.layers:
            if layer is None or layer.length == 0 or "head" not in layer.extras:
                continue
            held += int((layer.extras["head"][:, :, :layer.length] >= 0).sum())
            seen += layer.positions.shape[0] * self._gates.kv_heads * (int(layer.positions[:, :, :layer.length].max())
                                                                       + 1)
        return {"fastkvzip_kept_fraction": held / seen} if seen else {}
