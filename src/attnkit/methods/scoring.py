"""The scoring pass the score-based eviction methods share: attention statistics per key, decode attention
that also returns its logits, and the choice of which entries stay.

H2O's accumulated attention (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models", arXiv 2306.14048), Keyformer's accumulated Gumbel-softmax score (Adnan
et al., MLSys 2024, arXiv 2403.09054, eq. 9) and SnapKV's observation-window votes (Li et al., 2024,
arXiv 2404.14469) are all a per-key sum, over some queries, of a function of the scaled logits
``q . k / sqrt(d)``. :func:`attention_statistics` computes that sum in blocks of queries, never more than
:data:`SCORE_BLOCK_ELEMENTS` query x key entries at once, so no N x N matrix exists even for a 32k-token
prompt. With GQA the cache holds kv heads only: the query heads of a group are reduced per query
(:data:`GQA_REDUCTIONS`: mean or max over the group) before they are accumulated, so a choice is per kv head
and does not depend on how queries were chunked.

A method that scores every prompt query (H2O, Keyformer) computes its prompt attention with
:func:`attention_with_statistics` instead: the same blocks give the attention output and the statistic,
so the logits and the softmax of the prompt are computed once, not once by SDPA and again for the score.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnkit import masks
from attnkit.attention import flash_with_lse, has_flash
from attnkit.methods import decode_native

# Largest number of (query head x query x key) entries one block of the score computation holds, by
# device type. Each entry costs a few 4-byte temporaries (logits, weights; hashed noise). On a CPU small
# blocks stay in its caches, so a few MiB per block is fastest; on a GPU each block costs kernel launches and
# a host sync whatever its size, so blocks of a few hundred MiB (docs/benchmarks.md, "On a GPU").
SCORE_BLOCK_ELEMENTS = {"cpu": 1 << 20, "default": 1 << 26}


def block_elements_for(device: torch.device) -> int:
    """:data:`SCORE_BLOCK_ELEMENTS` for `device`'s type."""
    return SCORE_BLOCK_ELEMENTS.get(device.type, SCORE_BLOCK_ELEMENTS["default"])


# Most keys for which :func:`attention_with_statistics` is the cheaper way to get a prompt's output and
# statistic, by device type (None: no limit), where :mod:`attnkit.methods.scoring_native`'s kernel does not run.
# Each block of queries reads every key and value it sees; on a CPU a long prompt's blocks are either too few rows
# to reuse them or too large to stay in its caches, and past this many keys SDPA's fused kernel plus the separate
# :func:`attention_statistics` (no values, no output) is faster (``benchmarks/bench_scoring.py``, docs/benchmarks.md).
ONE_PASS_MAX_KEYS = {"cpu": 8192, "default": None}
# Fewest queries per block of :func:`attention_with_statistics` (below it the per-block overhead of the
# tensor operations dominates on a long prompt).
MIN_BLOCK_QUERIES = 16

GQA_REDUCTIONS = ("mean", "max")


# ---- statistics ------------------------------------------------------------------------------------
def reduce_heads(x: torch.Tensor, how: str, dim: int = 2) -> torch.Tensor:
    """Reduce the query heads of each kv group (axis `dim`) to the kv head: mean or max."""
    return x.mean(dim) if how == "mean" else x.amax(dim)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and optional window) visibility by original positions (:func:`attnkit.masks.sliding_window`),
    shaped to broadcast against logits ``[b, kv, g, c, l]``: ``k_pos`` 1-D -> ``[c, l]``; per head
    ``[b, kv, l]`` -> ``[b, kv, 1, c, l]``."""
    allowed = masks.boolean_mask(masks.sliding_window(window), q_pos, k_pos)
    return allowed if k_pos.dim() == 1 else allowed.unsqueeze(2)


def softmax_weights(logits: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The ordinary attention probabilities (eq. 1 of Keyformer; H2O's accumulated attention)."""
    return torch.softmax(logits, dim=-1)


def attention_statistics(q: torch.Tensor, keys: torch.Tensor, scaling: float, q_pos: torch.Tensor,
                         k_pos: torch.Tensor, *, reduce: str = "mean",
                         weights: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                         window: int | None = None, block_elements: int | None = None) -> torch.Tensor:
    """Attention each key receives, summed over the queries: ``[b, kv_heads, keys]`` (float32).

    For every query ``i`` (at ``q_pos[i]``) the per-key weights are ``weights(logits, q_pos, k_pos)`` of
    the scaled logits ``q_i . k_j * scaling`` (a fresh ``[b, kv, g, queries, keys]`` float32 tensor the
    function may overwrite; keys at later positions, or outside `window`, are ``-inf``); the default
    is the softmax, i.e. the attention probabilities. The query heads of a kv
    group are reduced per query with `reduce` (mean/max), then summed over queries. Queries are taken
    in blocks of at most `block_elements` (query head x query x key) entries, and with 1-D ascending
    `k_pos` a block only reads the keys it can see, so neither memory nor time is quadratic in a
    single allocation. `k_pos` is ``[keys]`` (ascending) or per kv head ``[b, kv_heads, keys]``.
    """
    b, hq, n, d = q.shape
    kv, n_keys = keys.shape[1], keys.shape[2]
    if hq % kv:
        raise ValueError(f"{hq} query heads are not a multiple of {kv} kv heads")
    g = hq // kv
    weights = weights or softmax_weights
    out = torch.zeros(b, kv, n_keys, dtype=torch.float32, device=q.device)
    block = _block_queries(q, n_keys, block_elements)
    grouped = q.reshape(b, kv, g, n, d)
    shared = k_pos.dim() == 1
    for s in range(0, n, block):
        e = min(n, s + block)
        qp = q_pos[s:e]
        if shared:  # keys ascending: this block sees keys [:lim], and only keys [first_hidden:] hide from some query
            bounds = torch.searchsorted(k_pos, qp[[0, -1]], right=True).tolist()
            first_hidden, lim = bounds
            if lim == 0:
                continue
            kp = k_pos[:lim]
        else:  # per kv head: keys from the first that lies after the block's earliest query on (any head's) may hide
            lim, kp = n_keys, k_pos
            later = (k_pos > qp.min()).reshape(-1, n_keys).any(dim=0)
            first_hidden = int(later.int().argmax()) if bool(later.any()) else n_keys
        qb = grouped[:, :, :, s:e].reshape(b, kv, g * (e - s), d)
        logits = torch.matmul(qb, keys[:, :, :lim].transpose(-1, -2)).float().mul_(scaling)
        logits = logits.view(b, kv, g, e - s, lim)
        if window is not None:
            logits.masked_fill_(~visible(qp, kp, window), float("-inf"))
        elif first_hidden < lim:
            tail = kp[first_hidden:] if shared else kp[:, :, first_hidden:]
            logits[..., first_hidden:].masked_fill_(~visible(qp, tail, None), float("-inf"))
        w = weights(logits, qp, kp)
        if reduce == "mean":
            out[:, :, :lim] += w.sum(dim=(2, 3)).div_(g)
        else:
            out[:, :, :lim] += w.amax(dim=2).sum(dim=2)
    return out


def _block_queries(q: torch.Tensor, n_keys: int, block_elements: int | None, floor: int = 1) -> int:
    """Queries per block so that one block holds at most `block_elements` (query head x query x key)
    entries (:data:`SCORE_BLOCK_ELEMENTS` by device type), but at least `floor`."""
    if block_elements is None:
        block_elements = block_elements_for(q.device)
    return max(floor, block_elements // max(1, q.shape[0] * q.shape[1] * n_keys))


def attention_with_statistics(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                              q_pos: torch.Tensor, k_pos: torch.Tensor, *, reduce: str = "mean",
                              weights: Callable[..., torch.Tensor] | None = None, window: int | None = None,
                              block_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt attention and the per-key statistic of :func:`attention_statistics` in one pass.

    Returns the attention output ``[b, hq, n, d]`` (what SDPA gives for queries at `q_pos` over the keys
    at `k_pos`, causal by position and within `window`) and the statistic ``[b, kv_heads, keys]``
    (float32). Per block of queries: the scaled logits over only the keys the block can see (ascending
    1-D `k_pos`: a prefix, cut at the front by `window`), their softmax, the output ``probs @ values``,
    and ``weights(logits, probs, q_pos, k_pos)`` (both ``[b, kv, g, queries, keys]`` float32 and free to
    overwrite once the output is taken; None: the probabilities themselves, H2O's accumulated attention)
    reduced over the query heads of each kv group with `reduce` and summed over the queries. Blocks hold
    about `block_elements` entries (:data:`SCORE_BLOCK_ELEMENTS`, at least :data:`MIN_BLOCK_QUERIES`
    queries), so no N x N matrix exists. Every query must see at least one key (a prompt query sees itself).
    """
    b, hq, n, d = q.shape
    kv, n_keys = keys.shape[1], keys.shape[2]
    if hq % kv:
        raise ValueError(f"{hq} query heads are not a multiple of {kv} kv heads")
    if k_pos.dim() != 1:
        raise ValueError("attention_with_statistics takes the keys' positions shared by every row and head")
    g = hq // kv
    stats = torch.zeros(b, kv, n_keys, dtype=torch.float32, device=q.device)
    out = torch.empty(b, kv, g, n, values.shape[-1], dtype=q.dtype, device=q.device)
    grouped = q.reshape(b, kv, g, n, d)
    block = _block_queries(q, n_keys, block_elements, MIN_BLOCK_QUERIES)
    for s in range(0, n, block):
        e = min(n, s + block)
        qp = q_pos[s:e]
        # keys ascending: the block sees keys [lo:lim]; only keys [first_hidden:] hide from some of its queries
        first_hidden, lim = torch.searchsorted(k_pos, qp[[0, -1]], right=True).tolist()
        lo = 0 if window is None else int(torch.searchsorted(k_pos, qp[:1] - window, right=True))
        if lim <= lo:
            raise ValueError(f"queries at positions {int(qp[0])}..{int(qp[-1])} see no key")
        kp = k_pos[lo:lim]
        qb = grouped[:, :, :, s:e].reshape(b, kv, g * (e - s), d) * scaling  # scaled here: one pass less
        logits = torch.matmul(qb, keys[:, :, lo:lim].transpose(-1, -2)).float().view(b, kv, g, e - s, lim - lo)
        if window is not None:
            logits.masked_fill_(~visible(qp, kp, window), float("-inf"))
        elif first_hidden < lim:
            logits[..., first_hidden:].masked_fill_(~visible(qp, k_pos[first_hidden:lim], None), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        block_out = torch.matmul(probs.view(b, kv, g * (e - s), lim - lo).to(values.dtype), values[:, :, lo:lim])
        out[:, :, :, s:e] = block_out.view(b, kv, g, e - s, -1)
        w = probs if weights is None else weights(logits, probs, qp, kp)
        if reduce == "mean":
            stats[:, :, lo:lim] += w.sum(dim=(2, 3)).div_(g)
        else:
            stats[:, :, lo:lim] += w.amax(dim=2).sum(dim=2)
    return out.view(b, hq, n, -1), stats


def fused_pays(q: torch.Tensor) -> bool:
    """Whether :func:`fused_attention_with_statistics` should compute a whole prompt's output and H2O's statistic:
    on a CUDA device with flash kernels (:func:`attnkit.attention.has_flash`), where the blocked pass would write
    every logit to memory. On a CPU the C++ kernel of :mod:`attnkit.methods.scoring_native`, or without it the blocked
    pass, is faster (docs/benchmarks.md, "The cost of scoring")."""
    return q.device.type == "cuda" and has_flash(q)


def fused_attention_with_statistics(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole prompt's causal attention output ``[b, hq, n, d]`` and H2O's statistic ``[b, kv, n]`` (the
    attention each key receives, summed over the queries, averaged over the query heads of its kv group) from
    two fused attention calls, no logit ever written to memory.

    The first call is the prompt's attention, which also returns ``lse_i``, the log-sum-exp of query ``i``'s
    scaled logits. Key ``j``'s statistic per query head is ``s_j = sum_{i >= j} exp(q_i . k_j * scaling - lse_i)``,
    itself an attention call with the roles swapped: the keys ask, the queries answer, ``-lse_i / scaling`` rides
    in one more dimension of each query (split into a rounded part and its remainder, so half precision keeps it
    to about 1e-4) against a 1 in each key's, and both sequences run backwards so ``i >= j`` is the ordinary
    causal condition; that call's own log-sum-exp is ``log s_j``. Same result as :func:`attention_with_statistics`
    with ``reduce="mean"`` and the probabilities as weights, for keys at the queries' own ascending positions
    (a prompt's first chunk) and no window.
    """
    b, hq, n, d = q.shape
    kv = keys.shape[1]
    g = hq // kv
    out, lse = flash_with_lse(q, keys, values, scaling)
    shift = -lse.float() / scaling
    hi = shift.to(q.dtype)
    lo = (shift - hi.float()).to(q.dtype)
    width = -(-(d + 2) // 8) * 8  # the kernels take head sizes in multiples of 8
    answer = q.new_zeros(b, hq, n, width)
    answer[..., :d], answer[..., d], answer[..., d + 1] = q, hi, lo
    ask = q.new_zeros(b, hq, n, width)
    ask[..., :d], ask[..., d:d + 2] = keys.repeat_interleave(g, dim=1), 1
    _, lse_keys = flash_with_lse(ask.flip(2), answer.flip(2), torch.zeros_like(ask), scaling)
    stats = lse_keys.float().flip(-1).exp_().view(b, kv, g, n).mean(2)
    return out, stats


def one_pass_pays(device: torch.device, n_keys: int) -> bool:
    """Whether :func:`attention_with_statistics` should compute a prompt chunk over `n_keys` keys
    (:data:`ONE_PASS_MAX_KEYS`); otherwise SDPA and :func:`attention_statistics` separately."""
    limit = ONE_PASS_MAX_KEYS.get(device.type, ONE_PASS_MAX_KEYS["default"])
    return limit is None or n_keys <= limit


def attend_with_logits(q: torch.Tensor, keys, values, scaling: float, visible: torch.Tensor | None = None,
                       native: bool | None = None, logits: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Attention of decode queries that also returns what a scoring method needs.

    q ``[b, hq, n, d]`` (n small), keys/values ``[b, kv, L, d]`` (tensors, never expanded to the query heads, or
    :class:`~attnkit.methods.decode_native.Entries` read where they lie), `visible` a boolean mask broadcastable to
    ``[b, kv, g, n, L]`` or None. Returns the output ``[b, hq, n, d]``, the float32 logits and the probabilities, both
    ``[b, kv, g, n, L]``. `native` (None: where :func:`attnkit.methods.decode_native.runs`) computes one query per
    row with the CPU kernel, the same bits wherever the entries lie; otherwise torch's operations
    (:func:`~attnkit.methods.decode_native.torch_attend`) on a copy. With `logits` False a caller that reads only the
    output and the probabilities may get None for the logits (the kernel then does not write them).
    """
    if native is None:
        native = decode_native.runs(q, keys, values, visible)
    if native:
        return decode_native.attend(q, keys, values, scaling, logits=logits)
    return decode_native.torch_attend(q, decode_native.tensor(keys), decode_native.tensor(values), scaling, visible)


def flat_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, heads: torch.Tensor, kv_heads: int,
                   scaling: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of decode queries ``[b, hq, n, d]`` over a flat layer (:meth:`attnkit.cache.LayerKV.keep_flat`):
    keys/values ``[b, 1, L, d]`` holding the entries of every kv head, `heads` ``[b, 1, L]`` the kv head of each
    slot (of `kv_heads`). One matmul of every query head against every slot, the logits masked where the slot's head is not the
    query head's kv group (and where `allowed`, broadcastable to ``[b, hq, n, L]``, is False: a model's own
    sliding window), a softmax, times the values: per query head, exactly dense attention over its kv head's
    entries. Returns ``[b, hq, n, d]``."""
    hq = q.shape[1]
    group = torch.arange(hq, device=q.device).div(hq // kv_heads, rounding_mode="floor")
    own = heads.unsqueeze(2) == group.view(1, hq, 1, 1)  # [b, hq, 1, L]
    if allowed is not None:
        own = own & allowed
    logits = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scaling).masked_fill_(~own, float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1).to(values.dtype), values)


# ---- selection -------------------------------------------------------------------------------------
def keep_top(rank: torch.Tensor, protect: torch.Tensor | None, count: int) -> torch.Tensor:
    """Slot indices ``[b, kv, count]`` (ascending) of the protected entries plus the highest-ranked others,
    chosen per kv head. `rank` ``[b, kv, L]``: higher is kept first."""
    r = rank.float()
    if protect is not None:
        r = r.masked_fill(protect, float("inf"))
    return r.topk(count, dim=-1).indices.sort(dim=-1).values


def adaptive_keep(rank: torch.Tensor, protect: torch.Tensor | None, count: int,
                  alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaKV's head-adaptive selection (Feng et al., 2024, arXiv 2407.11550, Algorithm 1): the ``kv x count``
    entries of highest `rank` ``[b, kv, L]`` across all kv heads of a row, so the heads whose scores
    concentrate keep fewer entries and the others more. Every head keeps its protected entries, and its
    best ones up to ``int(alpha x count)`` entries in all (at least one when ``alpha > 0``): the safeguard of
    the AdaKV authors' code and kvpress's ``alpha_safeguard``, the protected entries counting toward it as
    kvpress's highest-scored window does. Returns the kv head and slot of each kept entry, ``[b, kv x count]``
    each, ordered by head, then slot."""
    b, kv, length = rank.shape
    r = rank.float()
    if protect is not None:
        r = r.masked_fill(protect, float("inf"))
    safe = int(count * alpha)
    if alpha > 0:
        safe = max(1, safe)
    if safe:
        r = r.scatter(-1, r.topk(safe, dim=-1).indices, float("inf"))
    chosen = r.reshape(b, kv * length).topk(kv * count, dim=-1).indices.sort(dim=-1).values
    return chosen.div(length, rounding_mode="floor"), chosen % length


def lowest(rank: torch.Tensor, protect: torch.Tensor | None) -> torch.Tensor:
    """Slot ``[b, kv, 1]`` of the lowest-ranked unprotected entry per kv head (the one to evict): on a CPU the
    kernel's loop (:func:`attnkit.methods.decode_native.lowest`), elsewhere torch's argmin, the same index."""
    picked = decode_native.lowest(rank, protect)
    if picked is not None:
        return picked
    r = rank.float()
    if protect is not None:
        r = r.masked_fill(protect, float("inf"))
    return r.argmin(dim=-1, keepdim=True)


def avg_or_max_pool(x: torch.Tensor, kernel: int, how: str) -> torch.Tensor:
    """Pool ``[..., L]`` along the last axis with an odd `kernel`, stride 1, same length (SnapKV's
    clustering by pooling, arXiv 2404.14469). At the edges average pooling divides by the full kernel,
    the zero padding counted, as the SnapKV authors' code does (``avg_pool1d`` defaults), so the same
    positions are kept as there."""
    if kernel <= 1:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])
    pad = kernel // 2
    if how == "max":
        pooled = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=pad)
    else:
        pooled = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=pad, count_include_pad=True)
    return pooled.reshape(shape)
