"""Triton kernels for the per-key statistics of a prompt on a GPU, tiled over queries and keys so that no logit is
ever written to memory.

The blocked passes of :mod:`attnkit.methods.scoring` write every logit of a block to memory, several times over
(logits, softmax, weights); on a GPU that traffic, not the arithmetic, sets their cost. The scores H2O (Zhang et al.,
2023, arXiv 2306.14048), Keyformer (Adnan et al., MLSys 2024, arXiv 2403.09054, eq. 9 at temperature 1) and KVzip
(Kim et al., 2025, arXiv 2505.23416, the maximum attention a key receives while the context is reconstructed) need
are all, per key ``j``, a sum or maximum over queries ``i`` (and over the query heads of ``j``'s kv group) of

    w_ij = exp(q_i . k_j * scale - c_i) * f_ij

where ``c_i`` is a per-query shift known before the key's pass and ``f_ij`` is 1, or Keyformer's Gumbel factor
``exp(zeta_ij)`` read from the draw table of :mod:`attnkit.methods.keyformer_noise` at the query row's offset plus
the key position (the same entries the blocked pass reads). With ``c_i`` the log-sum-exp of query ``i``'s logits
(what a flash-attention kernel returns beside its output) ``w_ij`` is the attention probability ``p_ij``; with
``c_i = lse_i + log Z_i``, ``Z_i = sum_j p_ij f_ij``, it is eq. 9's ``softmax(x + zeta)``.

Two kernels, written by hand because no library computes column statistics of attention:

- :func:`row_normalisers` gives ``c_i`` per (row, query head, query): the log-sum-exp of its visible logits, or,
  given the log-sum-exp, ``lse_i + log Z_i``. Query tiles in parallel, one sweep over the keys each can see.
- :func:`column_statistics` gives the statistic per (row, kv head, key): key tiles in parallel, one sweep over the
  queries that can see them, every query head of the group in turn.

Visibility is by position: key ``j`` is seen by query ``i`` when ``k_pos[j] <= q_pos[i]`` (both ascending, shared by
every row and head), which covers a prompt's causal mask and KVzip's reconstruction (the prompt's keys, then the
input's own). Float32 inputs are multiplied in IEEE float32 (no TF32), so the logits are the ones torch computes.
"""

from __future__ import annotations

import os

import torch

from attnkit.attention import flash_with_lse, has_flash, sdpa

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only or Windows install: kernels_pay() says no, and nothing below is called
    triton = tl = None

BLOCK_QUERIES = 64
BLOCK_KEYS = 64


def kernels_pay(q: torch.Tensor) -> bool:
    """Whether these kernels should compute a whole prompt's statistic: on a CUDA device, when Triton is installed
    (torch's CUDA builds on Linux bring it). They tile queries and keys, where the blocked passes of
    :mod:`attnkit.methods.scoring` write every logit to memory."""
    return triton is not None and q.device.type == "cuda"


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


@_jit
def _tile(P, rows, n, stride, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows `rows` of an ``[n, D]`` matrix at `P` (row stride `stride`, columns contiguous) as a ``[rows, BLOCK_D]``
    block, zero past its end."""
    rd = tl.arange(0, BLOCK_D)
    return tl.load(P + rows[:, None] * stride + rd[None, :], mask=(rows[:, None] < n) & (rd[None, :] < D), other=0.0)


@_jit
def _row_kernel(Q, K, QPOS, KPOS, KLIM, SHIFT, TABLE, OFFS, OUT,
                sqb, sqh, sqm, skb, skh, skn,
                HQ, G, M, L, scale,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                FACTOR: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qmask = rm < M
    q = _tile(Q + b * sqb + h * sqh, rm, M, sqm, D, BLOCK_D)
    qp = tl.load(QPOS + rm, mask=qmask, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    shift = tl.zeros([BLOCK_M], tl.float32)
    off = tl.zeros([BLOCK_M], tl.int64)
    if FACTOR:
        shift = tl.load(SHIFT + bh * M + rm, mask=qmask, other=0.0)
        off = tl.load(OFFS + h * M + rm, mask=qmask, other=0)
    lim = tl.load(KLIM + pid_m)
    for start in range(0, lim, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        kmask = rn < L
        k = _tile(K + b * skb + (h // G) * skh, rn, L, skn, D, BLOCK_D)
        kp = tl.load(KPOS + rn, mask=kmask, other=0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        vis = (kp[None, :] <= qp[:, None]) & kmask[None, :] & qmask[:, None]
        if FACTOR:
            f = tl.load(TABLE + off[:, None] + kp[None, :], mask=vis, other=0.0)
            l_i += tl.sum(tl.where(vis, tl.exp(s - shift[:, None]), 0.0) * f, 1)
        else:
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - base) + tl.sum(tl.exp(s - base[:, None]), 1)
            m_i = m_new
    l_i = tl.where(qmask, l_i, 1.0)  # rows past the end saw no key
    if FACTOR:
        res = shift + tl.log(l_i)
    else:
        res = m_i + tl.log(l_i)
    tl.store(OUT + bh * M + rm, res, mask=qmask)


@_jit
def _column_kernel(Q, K, QPOS, KPOS, QFIRST, SHIFT, TABLE, OFFS, OUT,
                   sqb, sqh, sqm, skb, skh, skn,
                   HQ, KV, G, M, L, scale,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   FACTOR: tl.constexpr, ROW_MAX: tl.constexpr, GROUP_MAX: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    bk = tl.program_id(1)
    b = bk // KV
    kvh = bk % KV
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = rn < L
    k = _tile(K + b * skb + kvh * skh, rn, L, skn, D, BLOCK_D)
    kp = tl.load(KPOS + rn, mask=kmask, other=0)
    acc = tl.zeros([BLOCK_N], tl.float32)
    first = tl.load(QFIRST + pid_n)
    for start in range(first, M, BLOCK_M):
        rm = start + tl.arange(0, BLOCK_M)
        qmask = rm < M
        qp = tl.load(QPOS + rm, mask=qmask, other=0)
        vis = (kp[None, :] <= qp[:, None]) & kmask[None, :] & qmask[:, None]
        w = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for j in range(0, G):
            h = kvh * G + j
            q = _tile(Q + b * sqb + h * sqh, rm, M, sqm, D, BLOCK_D)
            c = tl.load(SHIFT + (b * HQ + h) * M + rm, mask=qmask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            p = tl.where(vis, tl.exp(s - c[:, None]), 0.0)
            if FACTOR:
                off = tl.load(OFFS + h * M + rm, mask=qmask, other=0)
                p = p * tl.load(TABLE + off[:, None] + kp[None, :], mask=vis, other=0.0)
            if GROUP_MAX:
                w = tl.maximum(w, p)
            else:
                w += p
        if not GROUP_MAX:
            w = w / G
        if ROW_MAX:
            acc = tl.maximum(acc, tl.max(w, 0))
        else:
            acc += tl.sum(w, 0)
    tl.store(OUT + bk * L + rn, acc, mask=kmask)


def _prepared(q: torch.Tensor, keys: torch.Tensor):
    """The operands as the kernels take them (the head dimension contiguous), the head block size and the precision
    of the products (IEEE for float32: the logits torch computes, not TF32's)."""
    if q.shape[1] % keys.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {keys.shape[1]} kv heads")
    if q.dtype != keys.dtype:
        raise ValueError(f"queries in {q.dtype} and keys in {keys.dtype}: give both in one dtype")
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    if q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        # Triton's interpreter (the tests' CPU runs) multiplies bfloat16 blocks wrongly; float32 holds them exactly
        q, keys = q.float(), keys.float()
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    return q, keys, max(16, triton.next_power_of_2(q.shape[-1])), precision


def row_normalisers(q: torch.Tensor, keys: torch.Tensor, scaling: float, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    lse: torch.Tensor | None = None, table: torch.Tensor | None = None,
                    offsets: torch.Tensor | None = None, block: tuple[int, int] = (BLOCK_QUERIES, BLOCK_KEYS)
                    ) -> torch.Tensor:
    """Per query ``[b, hq, m]`` float32: the log-sum-exp of its scaled logits over the keys it sees
    (``k_pos <= q_pos``), or, given that log-sum-exp `lse` ``[b, hq, m]`` and the Gumbel factors' `table` (1-D float32)
    and row `offsets` ``[hq, m]`` (int64), ``lse_i + log sum_j p_ij table[offsets_i + k_pos_j]``.

    q ``[b, hq, m, d]``, keys ``[b, kv, L, d]`` (never expanded to the query heads), positions ascending int64."""
    q, keys, block_d, precision = _prepared(q, keys)
    b, hq, m, d = q.shape
    length = keys.shape[2]
    bm, bn = block
    ends = q_pos[torch.arange(bm - 1, m + bm - 1, bm, device=q.device).clamp_(max=m - 1)]
    klim = torch.searchsorted(k_pos, ends, right=True).to(torch.int32)
    out = torch.empty(b, hq, m, dtype=torch.float32, device=q.device)
    factor = lse is not None  # without it the kernel reads no shift, table or offsets (`out` stands in)
    _row_kernel[(triton.cdiv(m, bm), b * hq)](
        q, keys, q_pos, k_pos, klim, lse.float().contiguous() if factor else out, table if factor else out,
        offsets.contiguous() if factor else out, out,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        hq, hq // keys.shape[1], m, length, scaling,
        D=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, FACTOR=factor, PRECISION=precision)
    return out


def column_statistics(q: torch.Tensor, keys: torch.Tensor, scaling: float, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      shift: torch.Tensor, *, rows: str = "sum", reduce: str = "mean",
                      table: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                      block: tuple[int, int] = (BLOCK_QUERIES, BLOCK_KEYS)) -> torch.Tensor:
    """Per key ``[b, kv, L]`` float32: ``w_ij = exp(q_i . k_j * scaling - shift_i)`` (times
    ``table[offsets_i + k_pos_j]`` when a table is given) over the queries that see it (``k_pos <= q_pos``), reduced
    over the query heads of its kv group with `reduce` (mean or max, per query) and over the queries with `rows`
    (sum or max). `shift` ``[b, hq, m]`` is :func:`row_normalisers`'s output (or a flash kernel's log-sum-exp).

    q ``[b, hq, m, d]``, keys ``[b, kv, L, d]``, positions ascending int64."""
    q, keys, block_d, precision = _prepared(q, keys)
    b, hq, m, d = q.shape
    kv, length = keys.shape[1], keys.shape[2]
    bm, bn = block
    starts = k_pos[torch.arange(0, length, bn, device=q.device)]
    first = (torch.searchsorted(q_pos, starts) // bm * bm).to(torch.int32)  # the first query tile that sees the tile
    out = torch.empty(b, kv, length, dtype=torch.float32, device=q.device)
    factor = table is not None  # without it the kernel reads no table or offsets (`out` stands in)
    _column_kernel[(triton.cdiv(length, bn), b * kv)](
        q, keys, q_pos, k_pos, first, shift.float().contiguous(), table if factor else out,
        offsets.contiguous() if factor else out, out,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        hq, kv, hq // kv, m, length, scaling,
        D=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, FACTOR=factor, ROW_MAX=rows == "max",
        GROUP_MAX=reduce == "max", PRECISION=precision)
    return out


def prompt_attention_with_statistics(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                                     q_pos: torch.Tensor, *, reduce: str = "mean", weights=None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole prompt's causal attention output ``[b, hq, n, d]`` and the statistic of
    :func:`attnkit.methods.scoring.attention_with_statistics` ``[b, kv, n]`` for keys at the queries' own positions
    `q_pos` (a prompt's first chunk, no window): with `weights` None the attention probabilities (H2O), with
    :class:`~attnkit.methods.keyformer_noise.GumbelFactorWeights` eq. 9 at temperature 1 (Keyformer).

    The output and each query's log-sum-exp come from one flash kernel where torch has one for the device and dtype
    (:func:`attnkit.attention.has_flash`), otherwise from SDPA and :func:`row_normalisers`; Keyformer's
    row normaliser ``Z_i`` is one more sweep over the keys (:func:`row_normalisers` with the table); the statistic is
    :func:`column_statistics`."""
    if has_flash(q):
        out, lse = flash_with_lse(q, keys, values, scaling)
    else:
        out = sdpa(q, keys, values, scaling, is_causal=True)
        lse = row_normalisers(q, keys, scaling, q_pos, q_pos)
    table = offsets = None
    if weights is not None:
        table, offsets = weights.table_and_offsets(q.shape[1] // keys.shape[1], q_pos, int(q_pos[-1]))
        lse = row_normalisers(q, keys, scaling, q_pos, q_pos, lse=lse, table=table, offsets=offsets)
    return out, column_statistics(q, keys, scaling, q_pos, q_pos, lse, reduce=reduce, table=table, offsets=offsets)
