"""A C++ kernel for Quest's decoding step on a CPU: each query's attention over the chosen pages of the cache, read
where they lie (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv 2406.10774).

torch has no attention over a list of pages: it must gather the chosen keys and values into new tensors and attend
over the copy, so every chosen entry is read, written and read again, and a step pays for a dozen small operations.
The kernel (``attnkit/native/paged.cpp``, built on first use by :mod:`attnkit.native`) reads each chosen entry once
with an online softmax, page by page. Without it (no compiler, ``ATTNKIT_NATIVE=0``) :mod:`attnkit.methods.quest`
gathers with torch; both agree to float32 rounding (``tests/methods/test_quest.py``).
"""

from __future__ import annotations

import ctypes

import torch

from attnkit import native

_P, _I64, _F, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURE = ("attnkit_paged_decode",
             [_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F, _P, _I32],
             _I32)


CHOOSE = ("attnkit_quest_choose", [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _P],
          _I32)


def library() -> ctypes.CDLL | None:
    """The compiled kernels (:func:`attnkit.native.load`), or None."""
    lib = native.load("paged", SIGNATURE)
    if lib is not None and lib.attnkit_quest_choose.argtypes is None:  # the second entry point's signature
        lib.attnkit_quest_choose.argtypes, lib.attnkit_quest_choose.restype = CHOOSE[1], CHOOSE[2]
    return lib


def kernel_pays(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the kernel runs here: float32 on a CPU, and the kernel built."""
    return q.device.type == "cpu" and q.dtype == keys.dtype == torch.float32 and library() is not None


def choose_pages(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, count: int, per_query_head: bool,
                 visible_from: int = 0, page_size: int = 16) -> torch.Tensor:
    """:func:`attnkit.methods.quest_pages.page_bounds` then :func:`~attnkit.methods.quest_pages.choose_pages` in one
    pass over the summaries ``[b, kv, pages, d]`` (the same pages, in ascending order, ``[b, kv, c, count]``)."""
    b, hq, _, d = q.shape
    kv, pages = page_min.shape[1], page_min.shape[2]
    c = hq // kv if per_query_head else 1
    q = q.reshape(b, hq, d).float().contiguous()
    page_min, page_max = (t if t.stride(-1) == 1 else t.contiguous() for t in (page_min, page_max))
    if page_min.stride() != page_max.stride():  # one set of strides for both
        page_min, page_max = page_min.contiguous(), page_max.contiguous()
    out = torch.empty(b, kv, c, count, dtype=torch.int64)
    qs = torch.tensor([q.stride(0), q.stride(1)], dtype=torch.int64)
    ss = torch.tensor(page_min.stride()[:3], dtype=torch.int64)
    code = library().attnkit_quest_choose(q.data_ptr(), qs.data_ptr(), page_min.data_ptr(), page_max.data_ptr(),
                                          ss.data_ptr(), b, hq, kv, c, pages, d, count, visible_from, page_size,
                                          out.data_ptr())
    if code:
        raise ValueError(f"the page-choice kernel refused q {tuple(q.shape)}, summaries {tuple(page_min.shape)}, "
                         f"count {count} (code {code})")
    return out


def paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor, page_size: int,
                 length: int, scaling: float, visible_from: int = 0, threads: int | None = None) -> torch.Tensor:
    """Attention ``[b, hq, 1, dv]`` of one query per head, q ``[b, hq, 1, d]``, over the pages `pages`
    ``[b, kv, c, p]`` (c = 1: a kv group shares its pages; c = hq / kv: each query head its own) of keys and values
    ``[b, kv, slots, d]``: slots below `length` and at or above `visible_from` only."""
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel is not available (see kernel_pays)")
    b, hq, n, d = q.shape
    if n != 1:
        raise ValueError(f"the paged-attention kernel takes one query per head, got {n}")
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    pages = pages.to(torch.int64).contiguous()
    dv = values.shape[-1]
    out = torch.empty(b, hq, 1, dv, dtype=torch.float32)
    qs = torch.tensor([q.stride(0), q.stride(1)], dtype=torch.int64)
    ks = torch.tensor(keys.stride()[:3], dtype=torch.int64)
    vs = torch.tensor(values.stride()[:3], dtype=torch.int64)
    code = lib.attnkit_paged_decode(q.data_ptr(), qs.data_ptr(), keys.data_ptr(), ks.data_ptr(), values.data_ptr(),
                                    vs.data_ptr(), pages.data_ptr(), b, hq, keys.shape[1], pages.shape[2],
                                    pages.shape[3], d, dv, page_size, length, visible_from, float(scaling),
                                    out.data_ptr(), threads or torch.get_num_threads())
    if code:
        raise ValueError(f"the paged-attention kernel refused q {tuple(q.shape)}, keys {tuple(keys.shape)}, pages "
                         f"{tuple(pages.shape)} (code {code})")
    return out
