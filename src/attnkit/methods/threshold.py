"""``score_threshold=T`` on a prompt scorer: drop the entries whose score is below ``T`` once they are older than a
sliding window, instead of keeping a budget (kvpress's ``DMSPress`` around a ``ScorerPress``; the eviction rule of
DMS: Łańcucki, Nawrot, Ho, Habib, Fan, Kuksa, Ponti, Richter-Powell, Sriram, Gudmundsson, Nitiscu and Maddison, 2025,
"Inference-Time Hyper-Scaling with KV Cache Compression", arXiv 2506.05345).

**What DMS is, and what this is not.** DMS retrofits a model with a *trained* eviction decision per kv head and token
(``alpha_t in {0, 1}``, learnt with a Gumbel-sigmoid relaxation from one neuron of the query projection) and delays
each eviction by a sliding window of ``w`` tokens, so a token marked for eviction still serves the next ``w``
queries. kvpress's ``DMSPress`` (0.5.5) keeps only the second half: any scorer's score, a fixed threshold and the
delayed eviction, over a dense prefill; it has no trained evictors (the paper's checkpoints are separate models).
This module is that threshold rule, with attnkit's scorers; it is *not* the paper's trained DMS.

**The rule**, per layer and kv head, with ``s_i`` the scorer's score of entry ``i`` (:meth:`PromptScorer.rank`; KNorm's
``-||k_i||``, KeyDiff's ``-cos(k_i, anchor)``, SnapKV's votes, ...) and ``w`` = ``threshold_window`` (default 128, the
paper's and kvpress's)::

    after the prompt (n tokens):  keep i  iff  s_i >= T  or  i >= n - w
    decoding (threshold_decode):  at the step of the token at position t, drop i = t - w - 1 if s_i < T

so heads, layers and prompts keep different counts (the layer is stored flat, as ``head_budgets=adaptive`` stores it:
:meth:`attnkit.cache.LayerKV.keep_flat`). The prompt is scored once, over the whole prompt (dense prefill, as
kvpress). With ``threshold_decode=true`` (kvpress's ``decoding=True``) every generated token is scored as it comes by
the scorer's score of that entry alone (:meth:`PromptScorer.entry_score`; only a score that depends on the entry
alone, KNorm's, is offered: kvpress's per-token call of another scorer sees a one-token context and is not a rule of
the paper); otherwise generated tokens are appended (kvpress's default ``decoding=False``). ``score_threshold=-inf``
drops nothing (exactly ``full``). A threshold is not a budget: ``budget``/``budget_tokens``, ``decode_every``,
``head_budgets``, ``chunk_length``, ``criticalkv``, ``segment_length``, ``block_size``, ``merge`` and
``positions=reindexed`` are refused with it, as are the scorers whose score needs a budget or whose layers are
compressed by a pass of their own (``threshold_refusal``: finch, compactor without ``blending``, kvzip, kvgrad,
fastkvzip, lukv). Sequences are scored alone (their counts differ). kvzap's ``threshold``
(:mod:`attnkit.methods.kvzap`) is the same rule over its predicted score and runs on the functions here.

vLLM: refused (the kept count per kv head depends on the scores, so the host cannot plan it).
"""

from __future__ import annotations

import math

import torch

from attnkit import masks
from attnkit.errors import AttnkitError
from attnkit.methods.scoring import flat_attention
from attnkit.session import LayerContext
from attnkit.validate import flag, number, whole

WINDOW = 128  # the paper's sliding window (kvpress's DMSPress sliding_window_size)

# a PromptScorer parameter that means a budget, and its default
BUDGET_ONLY = {"budget": None, "budget_tokens": None, "decode_every": 0, "head_budgets": "uniform",
               "layer_budgets": "uniform", "chunk_length": 0, "merge": False, "criticalkv": False,
               "segment_length": 0, "block_size": 0, "decode_fraction": None, "positions": "original", "then": None}


def check_threshold(method) -> bool:
    """Validate a prompt scorer's threshold parameters (one line naming the bad value); True when it has a threshold
    (then it needs no budget)."""
    whole("threshold_window", method.threshold_window, 0, what=" (recent tokens never dropped by score_threshold)")
    flag("threshold_decode", method.threshold_decode)
    if method.score_threshold is None:
        if method.threshold_window != WINDOW or method.threshold_decode:
            raise AttnkitError(f"threshold_window={method.threshold_window} and threshold_decode="
                               f"{method.threshold_decode} apply with score_threshold=T only")
        return False
    number("score_threshold", method.score_threshold, None, None,
           what=f" (entries scoring below it are dropped, on {method.name}'s score scale; -inf drops nothing)")
    if method.threshold_refusal:
        raise AttnkitError(f"{method.name}: score_threshold={method.score_threshold} is not supported: "
                           f"{method.threshold_refusal}")
    for key, default in BUDGET_ONLY.items():
        value = getattr(method, key, default)
        if value != default:
            raise AttnkitError(f"{method.name}: {key}={value!r} applies to a budget; with score_threshold="
                               f"{method.score_threshold} the entries below it leave as they age out of the window "
                               f"(give one of them)")
    if method.threshold_decode and not method.scores_entries_alone:
        raise AttnkitError(f"{method.name}: threshold_decode=true scores each generated token alone, which "
                           f"{method.name}'s score (over other entries or queries) does not; use knorm, or "
                           f"threshold_decode=false (generated tokens appended)")
    return True


def threshold_evicts(ctx: LayerContext, threshold: float, window: int, decode: bool) -> bool:
    """Whether a threshold can drop anything in this layer and generation (otherwise the layer is ``full``)."""
    if ctx.state.evicts is None:
        s = ctx.session
        seen = s.prompt_len + (s.max_new_tokens if decode else 0)
        ctx.state.evicts = threshold > -math.inf and seen > window
    return ctx.state.evicts


def keep_above(ctx: LayerContext, score: torch.Tensor, threshold: float, window: int, room: int) -> None:
    """After the prompt: keep per kv head the entries scoring at least `threshold` and the last `window` positions,
    in a flat layer with `room` spare slots (`score` ``[1, kv, length]`` is written to the ``score`` extra, so that it
    moves with its entry)."""
    kv, s = ctx.kv, ctx.session
    if kv.keys.shape[0] != 1:
        raise AttnkitError(f"{s.method.name} with a threshold scores one sequence per session, got "
                           f"{kv.keys.shape[0]}")
    length = kv.length
    buf = kv.extras.get("score")
    if buf is None:
        buf = kv.extras["score"] = torch.zeros(kv.positions.shape, dtype=torch.float32, device=kv.positions.device)
    buf[:, :, :length] = score
    positions = kv.view()[2]
    keep = (score >= threshold) | (positions >= s.prompt_len - window)
    heads, slots = keep[0].nonzero(as_tuple=True)  # ordered by head, then slot
    kv.keep_flat(heads[None], slots[None], room=room)


def decode_room(ctx: LayerContext, window: int, decode: bool) -> int:
    """Spare slots of the flat layer for the generated tokens: one per kv head and step while appending; with
    decode-time eviction the slots freed are reused, so ``window + 1`` steps' worth at most."""
    steps = ctx.session.max_new_tokens
    return ctx.kv.keys.shape[1] * (min(steps, window + 1) if decode else steps)


def decode_step(ctx: LayerContext, q, k, v, new_score: torch.Tensor | None, threshold: float,
                window: int) -> torch.Tensor:
    """One decode step over a flat layer: with `new_score` (``[b, kv]``, the incoming token's score) the entry leaving
    the window is dropped first if it scores below `threshold` and the token takes a freed slot when every kv head has
    one; without, the token is appended. Returns the attention output."""
    if q.shape[2] != 1:
        raise AttnkitError(f"{ctx.session.method.name} with a threshold decodes one token per step, got {q.shape[2]} "
                           f"at once")
    kv = ctx.kv
    length, kv_heads = kv.length, k.shape[1]
    heads, score = kv.extras["head"], kv.extras["score"]
    reused = False
    if new_score is not None:
        old = (kv.positions[:, 0, :length] < ctx.q_pos - window) & (score[:, 0, :length] < threshold)
        heads[:, 0, :length].masked_fill_(old, -1)
        free = heads[:, 0, :length] < 0
        if int(free.sum(-1).min()) >= kv_heads:  # every row reuses dropped slots, one per kv head
            slots = torch.sort((~free).int(), dim=-1, stable=True).indices[:, :kv_heads]  # [b, kv]
            rows = torch.arange(slots.shape[0], device=slots.device)[:, None]
            kv.keys[rows, 0, slots] = k[:, :, 0]
            kv.values[rows, 0, slots] = v[:, :, 0]
            kv.positions[rows, 0, slots] = ctx.q_pos.reshape(-1)[0]
            heads[rows, 0, slots] = torch.arange(kv_heads, device=slots.device)
            score[rows, 0, slots] = new_score
            reused = True
    if not reused:
        kv.append_flat(k, v, ctx.q_pos)
        if new_score is not None:
            kv.extras["score"][:, 0, kv.length - kv_heads:kv.length] = new_score
    keys, values, positions = kv.view()
    allowed = None
    if ctx.native_window is not None:
        allowed = masks.boolean_mask(masks.sliding_window(ctx.native_window), ctx.q_pos, positions)
    return flat_attention(q, keys, values, kv.extras["head"][:, :, :kv.length], kv_heads, ctx.scaling, allowed)
