"""Three of kvpress's wrapper presses as parameters of every prompt scorer (:class:`~attnkit.methods.prompt_scorer.
PromptScorer`): whatever the scorer's score, they change *where* and *when* a layer is compressed, not how entries
rank. (CriticalKV, which changes the ranking, is :mod:`attnkit.methods.critical`.)

``segment_length=s`` (kvpress's ``ChunkPress``; the split of FINCH: Corallo, Papotti, 2024, "FINCH: Prompt-guided
Key-Value Cache Compression for Large Language Models", TACL 12): the prompt is cut into segments of ``s`` positions
(``[j s, (j + 1) s)``, the last one shorter) and each keeps its share of the budget, so that no stretch of the prompt
is emptied because another scores higher. Per kv head: the protected entries (SnapKV's window, sinks) stay, and the
other ``B - protected`` slots are shared by the segments in proportion to their unprotected entries, each segment's
share ``floor(m_j (B - P) / M)`` and the slots left over going one each to the segments of largest remainder (the
largest-remainder rule; ties to the earlier segment), so exactly ``B`` are kept; within a segment the best-ranked
stay (:func:`keep_segments`). The score is the scorer's own over the whole layer (SnapKV's prompt-end window votes
for every segment, as FINCH's question does). kvpress instead calls the scorer on each chunk alone (a chunk-local
SnapKV window, whose queries it rotates at the prompt's last positions; a chunk-local KeyDiff anchor) and keeps
``max(1, int(len x (1 - compression_ratio)))`` per chunk, which sums to ``B`` or a little less: for a score of one
entry at a time (KNorm, a kvzap surrogate) and a ratio whose share of every chunk is whole, both keep the same
entries. The prompt only: refused with ``decode_every``, ``chunk_length`` and ``head_budgets=adaptive``.

``block_size=m`` (kvpress's ``BlockPress``; the block-wise prompt processing of KeyDiff: Park, Jones, Morse, Goel,
Lee, Kim, 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv 2504.15364): the prompt is attended block by block and the layer is
compressed back to ``B`` after every block, so prefill never holds more than ``B + m`` entries per kv head (the
layer's capacity) whatever the prompt's length. The first block is the first ``B`` positions, then blocks of ``m``
(the boundaries ``B + k m``, as kvpress's); each block's queries attend over the entries kept so far and the block's
own, the scorer ranks everything held (SnapKV's window: the block's last queries), and the prompt's last block ends
with the usual compression after prefill. The boundaries are the method's, whatever chunks the host feeds the
prompt in (:func:`prefill_in_blocks` splits a chunk at them). kvpress's ``BlockPress`` only simulates this: it
attends the whole prompt in full first, then prunes block by block, so past the first layer its keys are full
attention's and its choice differs by design; kvpress run on the prompt's blocks one forward at a time with a
``DecodingPress(compression_interval=1, target_size=B)`` is the true block-wise prefill and keeps attnkit's entries
(``benchmarks/compare_kvpress.py --block-size``). Refused with ``head_budgets=adaptive`` and for scorers whose
statistic needs the whole prompt at once (a statistic over every prompt query, a reconstruction, the layer inputs,
rewritten keys).

``decode_fraction=f`` (kvpress's ``CompressionRatioDecodingPress``), with ``decode_every=N``: every ``N`` generated
tokens the layer is compressed to ``max(1, int(f x t))`` entries per kv head, ``t`` the tokens seen so far (the
prompt and the generated ones), instead of back to ``B``; a layer holding no more than that is left alone. So the
cache grows with the sequence at the rate ``f``. After ``g = k N + r`` generated tokens a layer holds
``min(n, B) + r`` (``k = 0``) or ``min(min(n, B) + k N, max(1, int(f (n + k N)))) + r`` (:func:`held_after`), a
function of the prompt length and the tokens generated, which vLLM's host plans by.
"""

from __future__ import annotations

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.eviction import EvictionMethod
from attnkit.methods.scoring import keep_top
from attnkit.session import LayerContext, Step
from attnkit.validate import fraction, whole


def check_wrappers(method) -> None:
    """Validate a prompt scorer's ``segment_length``, ``block_size`` and ``decode_fraction`` (one line each)."""
    whole("segment_length", method.segment_length, 0,
          what=" (prompt tokens per segment keeping its own share of the budget; 0 = off)")
    whole("block_size", method.block_size, 0,
          what=" (prompt tokens attended between compressions back to the budget; 0 = the whole prompt)")
    if method.segment_length:
        for name, value, off in (("decode_every", method.decode_every, 0), ("chunk_length", method.chunk_length, 0),
                                 ("head_budgets", method.head_budgets, "uniform")):
            if value != off:
                raise AttnkitError(f"segment_length={method.segment_length} shares the prompt's budget among its "
                                   f"segments at one budget per kv head; {name}={value!r} is not supported with it")
    if method.block_size:
        if method.adaptive:
            raise AttnkitError(f"block_size={method.block_size} compresses between prompt blocks at one budget per kv "
                               f"head; head_budgets=adaptive is not supported with it (use head_budgets=uniform)")
        cls = type(method)
        whole_prompt = (cls.prefill_scorer is not EvictionMethod.prefill_scorer or cls.run_layers is not None
                        or getattr(cls, "needs_layer_inputs", False) is True or method.rewrites_stored_keys()
                        or cls.defer_prefill_eviction is not EvictionMethod.defer_prefill_eviction)
        if whole_prompt:
            raise AttnkitError(f"{method.name} scores with the whole prompt at once; block_size={method.block_size} "
                               f"(compressing between prompt blocks) is not supported with it")
    if method.decode_fraction is not None:
        fraction("decode_fraction", method.decode_fraction,
                 what=" (the share of the tokens seen so far each re-compression keeps)")
        if not method.decode_every:
            raise AttnkitError(f"decode_fraction={method.decode_fraction} sizes the re-compressions while decoding; "
                               f"give decode_every=N (generated tokens between them) with it")


# ---- ChunkPress: a share of the budget per segment ---------------------------------------------------------------
def keep_segments(rank: torch.Tensor, protect: torch.Tensor | None, positions: torch.Tensor, count: int,
                  segment_length: int) -> torch.Tensor:
    """Slot indices ``[b, kv, count]`` (ascending) kept per kv head: the protected entries, then each segment's share of
    the rest by descending `rank` (see the module docstring)."""
    r = rank.float()
    free = torch.ones_like(r, dtype=torch.bool) if protect is None else ~protect
    slots = count - (r.shape[-1] - free.sum(-1, keepdim=True))  # [b, kv, 1]: the budget left to unprotected entries
    if bool((slots < 0).any()):  # more protected entries than the budget: the method's own rule (not reached)
        return keep_top(r, protect, count)
    seg = positions.long().div(segment_length, rounding_mode="floor")
    n_seg = int(seg.max()) + 1 if seg.numel() else 1
    members = torch.zeros(*r.shape[:-1], n_seg, dtype=torch.long, device=r.device).scatter_add_(-1, seg, free.long())
    total = members.sum(-1, keepdim=True).clamp(min=1)
    share = members * slots
    quota = share.div(total, rounding_mode="floor")
    left = slots - quota.sum(-1, keepdim=True)
    by_remainder = (-(share % total)).argsort(dim=-1, stable=True)  # largest remainder first, then earlier
    place = torch.empty_like(by_remainder).scatter_(-1, by_remainder, torch.arange(n_seg, device=r.device)
                                                    .expand_as(by_remainder))
    quota = quota + (place < left).long()
    # each unprotected entry's place among its segment's unprotected entries, best rank first
    score = r.masked_fill(~free, float("-inf"))
    by_rank = score.argsort(dim=-1, descending=True, stable=True)
    order = by_rank.gather(-1, (seg.gather(-1, by_rank) * 2 + (~free).gather(-1, by_rank).long())
                           .argsort(dim=-1, stable=True))
    seg_sorted = seg.gather(-1, order)
    sizes = torch.zeros_like(members).scatter_add_(-1, seg, torch.ones_like(seg))
    first = torch.cumsum(sizes, -1) - sizes  # where each segment starts in that order (its unprotected entries first)
    within = torch.arange(r.shape[-1], device=r.device) - first.gather(-1, seg_sorted)
    chosen = within < quota.gather(-1, seg_sorted)
    kept = torch.zeros_like(free).scatter_(-1, order, chosen) | ~free
    return (~kept).to(torch.uint8).argsort(dim=-1, stable=True)[..., :count]


# ---- BlockPress: the prompt attended block by block ----------------------------------------------------------------
def block_capacity(method, ctx: LayerContext, capacity: int) -> int:
    """The layer's capacity while its prompt is attended in blocks: ``B + block_size`` at most."""
    return min(capacity, method.layer_budget(ctx) + method.block_size)


def prefill_in_blocks(method, ctx: LayerContext, q, k, v, attend) -> torch.Tensor:
    """A prompt chunk's outputs with the layer compressed back to ``B`` at every block boundary ``B + j m`` inside it
    (see the module docstring); ``attend(ctx, q, k, v)`` stores and attends one piece (the method's own prefill
    hook) under a step of the piece's positions."""
    if not ctx.session.method.dense_prefill_output():
        raise AttnkitError(f"{method.name} with block_size={method.block_size} attends its prompt blocks itself; "
                           f"another method's prefill cannot be composed with it")
    budget, size, n = method.layer_budget(ctx), method.block_size, ctx.session.prompt_len
    positions = ctx.step.q_pos
    start, total = int(positions[0]), q.shape[2]
    outs, i = [], 0
    while i < total:
        p = start + i
        end = budget if p < budget else budget + ((p - budget) // size + 1) * size
        j = min(total, end - start)
        step = Step(ctx.session, "prefill", positions[i:j], last_chunk=False)
        step.layer_input = ctx.step.layer_input
        piece = LayerContext(step, ctx.index, ctx.scaling, ctx.native_window, ctx.state_of, ctx.session_state_of,
                             ctx.device)
        outs.append(attend(piece, q[:, :, i:j], k[:, :, i:j], v[:, :, i:j]))
        ctx.session.cache.track_peak()  # a block's peak: B + block_size entries at most
        if start + j == end and end < n and ctx.kv.length > budget:
            method.compact(piece, budget, min(size, n - end), end)
        i = j
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


# ---- CompressionRatioDecodingPress: a share of the tokens seen -----------------------------------------------------
def fraction_target(decode_fraction: float, seen: int) -> int:
    """Entries per kv head a re-compression keeps after `seen` tokens: ``max(1, int(f x seen))`` (kvpress's rule)."""
    return max(1, int(seen * decode_fraction))


def held_after(prompt_len: int, budget: int, every: int, decode_fraction: float, generated: int) -> int:
    """Entries per kv head after `generated` tokens (see the module docstring): each re-compression keeps
    ``min(held, target)``, and the targets grow by at most ``every`` between two, so the count has a closed form."""
    first = min(prompt_len, budget)
    k, r = divmod(generated, every)
    if not k:
        return first + r
    return min(first + k * every, fraction_target(decode_fraction, prompt_len + k * every)) + r


def fraction_limit(prompt_len: int, budget: int, every: int, decode_fraction: float, max_new_tokens: int) -> int:
    """The most entries per kv head a layer holds while decoding, the incoming one included."""
    total = prompt_len + max_new_tokens
    return max(min(prompt_len, budget), fraction_target(decode_fraction, total)) + every


def fraction_evicts(prompt_len: int, budget: int, every: int, decode_fraction: float, max_new_tokens: int) -> bool:
    """Whether a re-compression within `max_new_tokens` generated tokens keeps fewer entries than the layer holds."""
    held = min(prompt_len, budget)
    for k in range(1, max_new_tokens // every + 1):
        target = fraction_target(decode_fraction, prompt_len + k * every)
        if target < held + every:
            return True
        held += every
    return False
