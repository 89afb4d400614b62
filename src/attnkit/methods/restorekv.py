"""``restorekv``: KVzip's eviction plus ``R`` learned restore tokens whose entries join the compressed cache
(RestoreKV, arXiv 2608.01247; kvpress's ``RestoreKVPress``. The paper, its title and authors were not readable
offline here: the rule below is the one the press's docstring and code state, its steps numbered as below).

**Why.** An evicted entry is lost to every later query. RestoreKV lets ``R`` extra tokens (8 in the published
weights) read the whole cache *before* eviction and write what they gather into ``R`` cache entries per kv head and
layer that are never evicted: a learned, context-conditioned summary of what eviction drops, paid for with the same
bytes (the evictor keeps ``R`` fewer entries).

**The rule.** After the prompt (``n`` tokens) is prefilled:

1. KVzip (:mod:`attnkit.methods.kvzip`; Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
   Reconstruction", arXiv 2505.23416) scores every prompt entry by the most attention it receives while the model
   repeats the prompt.
2. The restore embeddings ``E`` ``[R, D]`` pass once through the decoder at positions ``n .. n+R-1``, every adapted
   projection ``W`` replaced by ``W + (alpha/r) B A`` (LoRA), attending to the whole cached prompt and causally to
   themselves; their keys and values of every layer are the restore entries
   (:func:`attnkit.methods.restorekv_weights.restore_entries`). The adapters act in this pass only.
3. Each layer keeps ``B - R`` prompt entries per kv head by KVzip's score (``head_budgets=adaptive``: the
   ``kv x (B - R)`` best across its kv heads; with ``alpha_safeguard=0`` kvpress's ``layerwise=True`` rule), the first
   ``n_sink`` positions always kept, then appends the ``R`` restore entries at positions ``n .. n+R-1``: ``B`` slots
   per kv head, the bytes of ``kvzip`` at ``B``.
4. Every later token (the generated ones, a question fed after the prompt) sits ``R`` positions later, at
   ``n + R + i``, as kvpress's pipeline places them after the restore tokens (the cache's length).

Only ``E`` and the LoRA pairs are trained, by self-distillation: the KL divergence from the full-cache model's
next-token distributions to the compressed-plus-restore model's on continuations the full model writes itself
(``attnkit calibrate restorekv``, :mod:`attnkit.calibrate.restorekv`). ``config`` is that file; another model's is
refused in one line.

**At an unlimited budget** (every layer's ``B >= n``: kvpress's ``compression_ratio=0``) nothing is scored and no
restore token is added: exactly ``full``. Once any layer's budget is below the prompt, every layer gets the restore
entries (kvpress adds them whenever it compresses), a layer whose ``B - R`` still holds the whole prompt evicting
nothing.

**Against kvpress.** The same scores, kept positions, restore pass and positions; kvpress's default
``layerwise=False`` ranks all layers' scores together, attnkit keeps ``kv x (B - R)`` per layer as its budgets require
(kvpress's ``layerwise=True`` with ``head_budgets=adaptive,alpha_safeguard=0``, as for kvzip). kvpress masks evicted
entries (they stay in memory); attnkit removes them. kvpress downloads its weights from the hub
(``higokri/RestoreKV-<model>``); attnkit's calibration writes the same adapters as a peft folder for it. KVzip+'s
normalisation (``kvzip_plus_normalization``, the hub's ``_plus`` weights) is not implemented, as in ``kvzip``.
``AttnkitCache`` (inside ``model.generate``), ``compose`` and vLLM refuse it: it runs the model's layers itself and
moves every later position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.forward import run_decoder_layers
from attnkit.methods.kvzip import KVzip, KVzipRun, ReconstructionStep, prompt_then
from attnkit.methods.restorekv_weights import load_weights, restore_entries
from attnkit.methods.spec import register
from attnkit.session import LayerContext, Session, Step

# the shared parameters of the prompt scorers that restorekv does not take, with their defaults
NOT_SUPPORTED = ("chunk_length", "low_entropy_chunk_length", "merge", "criticalkv", "segment_length", "block_size",
                 "decode_fraction", "then", "score_threshold", "positions")


@dataclass
class RestoreRun(KVzipRun):
    """Per generation: KVzip's prompt embeddings, and how many restore entries joined the cache (0: none yet)."""

    restored: int = 0


@register
@dataclass(frozen=True)
class RestoreKV(KVzip):
    """KVzip keeping ``B - R`` prompt entries per kv head, plus ``R`` learned restore entries computed from the whole
    cache before eviction (RestoreKV); later positions shift by ``R``."""

    config: str | None = None

    name = "restorekv"
    summary = "kvzip plus learned restore tokens that read the full cache before eviction (RestoreKV, 2026)"
    kvpress = "RestoreKVPress"
    vllm_refusal = (" (it runs a second pass of learned tokens through adapted layers after the prompt and moves every "
                    "later position, which vLLM's model runner does not do)")

    def __post_init__(self):
        if not isinstance(self.config, str) or not self.config:
            raise AttnkitError(f"restorekv needs config=FILE, restore weights trained for the model (`attnkit "
                               f"calibrate restorekv --model M --out FILE`); got config={self.config!r}")
        self.refuse_options(NOT_SUPPORTED, "KVzip's budget rules only: the restore entries join each layer after its "
                                           "compression")
        super().__post_init__()
        object.__setattr__(self, "_weights", load_weights(self.config))

    @property
    def restore_tokens(self) -> int:
        return self._weights.tokens

    def new_session_state(self) -> RestoreRun:
        return RestoreRun()

    # ---- sizes: B slots per kv head, R of them the restore entries -----------------------------------------
    def restoring(self, session: Session) -> bool:
        """Whether the restore entries join this generation's cache: some layer's budget is below the prompt."""
        return any(self.budget_of_layer(i, session.n_layers, session.prompt_len) < session.prompt_len
                   for i in range(session.n_layers))

    def extra(self, ctx: LayerContext) -> int:
        return self.restore_tokens if self.restoring(ctx.session) else 0

    def prefill_keep(self, ctx: LayerContext) -> int:
        return self.layer_budget(ctx) - self.extra(ctx)

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        s, r = ctx.session, self.restore_tokens
        if self.restoring(s) and budget - r < s.prompt_len and budget - r <= self.n_sink:
            raise AttnkitError(f"restorekv: the {budget}-slot budget of layer {ctx.index} leaves "
                               f"{max(0, budget - r)} prompt entries after the {r} restore entries, fewer than the "
                               f"n_sink={self.n_sink} sinks and one chosen entry; raise the budget")

    def spare_after_prefill(self, ctx: LayerContext, kept: int) -> int:
        return super().spare_after_prefill(ctx, kept) + self.extra(ctx)

    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        slots, ring = super().layer_capacity(ctx)
        return (slots + self.extra(ctx) if not self.evicts(ctx) else slots), ring

    def planned_slots(self, ctx: LayerContext) -> int:
        return super().planned_slots(ctx) + self.extra(ctx)

    # ---- the model-level hook: the prompt, the restore pass, KVzip's reconstruction, later tokens shifted -----
    def run_layers(self, model, step: Step, hidden: torch.Tensor, all_positions: bool) -> torch.Tensor:
        session = step.session
        run = session.state
        if run.restored and not isinstance(step, ReconstructionStep):  # after the restore tokens: R positions on
            shifted = dataclasses.replace(step, q_pos=step.q_pos + run.restored, memo={})
            return run_decoder_layers(model, hidden, shifted.q_pos, shifted)
        return prompt_then(model, step, hidden, ReconstructionStep, self.restoring,
                           lambda session, embeddings: self.restore_then_evict(model, session, embeddings))

    def restore_then_evict(self, model, session: Session, embeddings: torch.Tensor) -> None:
        """After the prompt: the restore entries from the whole cache, KVzip's eviction to ``B - R``, the entries
        appended at ``n .. n+R-1``."""
        entries = self.restore(model, session)  # from the whole cache, before any eviction
        self.reconstruct(model, session, embeddings)  # KVzip's scores; each evicting layer keeps B - R
        positions = torch.arange(session.prompt_len, session.prompt_len + self.restore_tokens)
        for layer, (k, v) in zip(session.cache.layers, entries):
            pos = positions.to(k.device)
            if "head" in layer.extras:  # a flat layer (head_budgets=adaptive): each kv head owns its entries
                layer.append_flat(k, v, pos)
            else:
                layer.append(k, v, pos)
        session.state.restored = self.restore_tokens

    def restore(self, model, session: Session) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ``R`` restore keys and values from its whole cached prompt (the weights checked first)."""
        weights = self._weights
        weights.check_model(model)
        layers = session.cache.layers
        if any(layer is None or layer.length != session.prompt_len for layer in layers):
            raise AttnkitError("restorekv reads every layer's whole prompt before eviction, which this model's "
                               "cache does not hold (a layer without a cache)")
        keys = [layer.view()[0] for layer in layers]
        values = [layer.view()[1] for layer in layers]
        embeddings, lora = weights.on(keys[0].device, keys[0].dtype)
        return restore_entries(model, embeddings, lora, weights.scaling, keys, values)

    def run_stats(self, session) -> dict:
        return {"restore_tokens": session.state.restored}
