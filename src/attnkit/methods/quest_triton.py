"""A Triton kernel for Quest's decoding step on a GPU: each query's attention over the chosen pages of the cache,
read where they lie (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv 2406.10774, Section 3.3: the kernel that loads only the top-K pages).

One program per (row, query head) walks its kv head's chosen pages: each page's keys and values loaded once, an
online softmax over them (Milakov and Gimelshein, 2018, arXiv 1805.02867). torch would gather the pages into a copy
first; this is the GPU counterpart of :mod:`attnkit.methods.quest_native`. Float32 products are IEEE float32 (no
TF32), so the logits are the ones torch computes. ``tests/methods/test_quest.py`` runs it in Triton's interpreter.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: kernel_pays() says no, and nothing below is called
    triton = tl = None


def kernel_pays(q: torch.Tensor) -> bool:
    """Whether the kernel runs: on a CUDA device with Triton installed."""
    return triton is not None and q.device.type == "cuda"


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


@_jit
def _paged_decode(Q, K, V, PAGES, OUT, sqb, sqh, skb, skh, sks, svb, svh, svs, HQ, G, C, P, length, lo, scale,
                  D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, KV: tl.constexpr):
    row = tl.program_id(0)
    b = row // HQ
    h = row % HQ
    kh = h // G
    c = tl.where(C == 1, 0, h % G)
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h * sqh + dims, mask=dims < D, other=0.0).to(tl.float32)
    page_list = PAGES + ((b * KV + kh) * C + c) * P
    offs = tl.arange(0, BLOCK)
    m = tl.full((1,), float("-inf"), tl.float32)
    total = tl.zeros((1,), tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for i in range(0, P):
        page = tl.load(page_list + i)
        slots = page * PAGE + offs
        live = (offs < PAGE) & (slots < length) & (slots >= lo)
        k = tl.load(K + b * skb + kh * skh + slots[:, None] * sks + dims[None, :],
                    mask=live[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
        logits = tl.sum(k * q[None, :], axis=1) * scale
        logits = tl.where(live, logits, float("-inf"))
        top = tl.maximum(m, tl.max(logits, axis=0))
        safe = tl.where(top == float("-inf"), 0.0, top)
        alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - safe))
        p = tl.where(live, tl.exp(logits - safe), 0.0)
        v = tl.load(V + b * svb + kh * svh + slots[:, None] * svs + vdims[None, :],
                    mask=live[:, None] & (vdims[None, :] < DV), other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        total = total * alpha + tl.sum(p, axis=0)
        m = top
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(OUT + row * DV + vdims, out, mask=vdims < DV)


def paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor, page_size: int,
                 length: int, scaling: float, visible_from: int = 0) -> torch.Tensor:
    """:func:`attnkit.methods.quest_native.paged_decode` on a GPU: attention ``[b, hq, 1, dv]`` of one query per head
    over the pages `pages` ``[b, kv, c, p]`` of keys and values ``[b, kv, slots, d]``."""
    b, hq, n, d = q.shape
    if n != 1:
        raise ValueError(f"the paged-attention kernel takes one query per head, got {n}")
    kv, dv = keys.shape[1], values.shape[-1]
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    pages = pages.to(torch.int64).contiguous()
    out = torch.empty(b, hq, dv, dtype=torch.float32, device=q.device)
    _paged_decode[(b * hq,)](q, keys, values, pages, out, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
                             keys.stride(2), values.stride(0), values.stride(1), values.stride(2), hq, hq // kv,
                             pages.shape[2], pages.shape[3], length, visible_from, float(scaling), D=d, DV=dv,
                             PAGE=page_size, BLOCK=triton.next_power_of_2(page_size),
                             BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv), KV=kv)
    return out.to(q.dtype).unsqueeze(2)
