"""A C++ kernel for Quest's decoding step on a CPU: each query's attention over the chosen pages of the cache, read
where they lie (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv 2406.10774).

torch has no attention over a list of pages: it must gather the chosen keys and values into new tensors and attend
over the copy, so every chosen entry is read, written and read again, and a step pays for a dozen small operations.
The kernel (``attnkit/native/paged.cpp``, built on first use by :mod:`attnkit.native` for the instruction set
``$ATTNKIT_NATIVE_ISA`` names) reads each chosen entry once, gathering the chosen slots into tiles of 64 in the
worker's caches and sweeping them with an online softmax. Without it (no compiler, ``ATTNKIT_NATIVE=0``), or where
it is not faster than torch's gather on this CPU (:mod:`attnkit.native.guard`: :func:`kernel_pays` times both once
per machine and shape class), :mod:`attnkit.methods.quest` gathers with torch; both agree to float32 rounding
(``tests/methods/test_quest.py``).
"""

from __future__ import annotations

import ctypes

import torch

from attnkit import native
from attnkit.methods import quest_pages
from attnkit.native import guard

GUARD_KEYS = 16384  # most cached keys of the guard's comparison
GUARD_READ = 16  # its step reads 1 / GUARD_READ of them (Quest's token budget of a sixteenth)
_P, _I64, _F, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURE = ("attnkit_paged_decode",
             [_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F, _P, _I32],
             _I32)


CHOOSE = ("attnkit_quest_choose", [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                                   _P],
          _I32)


def _int64s(values) -> ctypes.Array:
    """Strides for the kernels, as a C array (a torch tensor costs several times more per step)."""
    return (ctypes.c_int64 * len(values))(*values)


def library() -> ctypes.CDLL | None:
    """The compiled kernels (:func:`attnkit.native.load`), or None."""
    lib = native.load("paged", SIGNATURE)
    if lib is not None and lib.attnkit_quest_choose.argtypes is None:  # the second entry point's signature
        lib.attnkit_quest_choose.argtypes, lib.attnkit_quest_choose.restype = CHOOSE[1], CHOOSE[2]
    return lib


def kernel_pays(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the kernel runs here: float32 on a CPU, the kernel built, and faster than torch's gather on this CPU
    (:func:`choice`)."""
    if not (q.device.type == "cpu" and q.dtype == keys.dtype == torch.float32):
        return False
    return choice(q, keys).on


def choice(q: torch.Tensor, keys: torch.Tensor) -> guard.Choice:
    """:func:`attnkit.native.guard.choose` for a step of this shape class (the batch, the heads, the head size, the
    length class of the cache, the threads). The comparison: the page choice and attention of the kernels
    (:func:`choose_pages`, :func:`paged_decode`) against torch's (:func:`attnkit.methods.quest_pages.page_bounds`,
    :func:`~attnkit.methods.quest_pages.choose_pages`, :func:`~attnkit.methods.quest_pages.gathered_attention`),
    over random keys of the class (at most :data:`GUARD_KEYS`, pages of 16), reading 1 / :data:`GUARD_READ` of them."""
    b, hq, _, d = q.shape
    kv, n = keys.shape[1], keys.shape[2]
    top = guard.bucket(n)
    threads = torch.get_num_threads()
    shape = f"batch={b} heads={hq}/{kv} d={d} keys<={top} threads={threads}"

    def measure():
        gen = torch.Generator().manual_seed(0)
        slots, page = min(top, GUARD_KEYS), 16
        pages = slots // page
        count = max(2, pages // GUARD_READ)
        rq = torch.randn(b, hq, 1, d, generator=gen)
        rk, rv = (torch.randn(b, kv, slots, d, generator=gen) for _ in range(2))
        low, high = (f(rk.view(b, kv, pages, page, d), dim=3) for f in (torch.amin, torch.amax))

        def kernel():
            chosen = choose_pages(rq, low, high, count, False, 0, page)
            return paged_decode(rq, rk, rv, chosen, page, slots, d ** -0.5, threads=threads)

        def torch_path():
            chosen = quest_pages.choose_pages(quest_pages.page_bounds(rq, low, high), count, False, 0, page)
            return quest_pages.gathered_attention(rq, rk, rv, chosen, page, slots, d ** -0.5)

        return guard.time_both(kernel, torch_path, repeats=5)

    return guard.choose("paged", library(), shape, measure)


def choose_pages(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, count: int, per_query_head: bool,
                 visible_from: int = 0, page_size: int = 16, first: bool = False) -> torch.Tensor:
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
    code = library().attnkit_quest_choose(q.data_ptr(), _int64s(q.stride()[:2]), page_min.data_ptr(),
                                          page_max.data_ptr(), _int64s(page_min.stride()[:3]), b, hq, kv, c, pages, d,
                                          count, visible_from, page_size, int(first), out.data_ptr())
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
    code = lib.attnkit_paged_decode(q.data_ptr(), _int64s(q.stride()[:2]), keys.data_ptr(), _int64s(keys.stride()[:3]),
                                    values.data_ptr(), _int64s(values.stride()[:3]), pages.data_ptr(), b, hq,
                                    keys.shape[1], pages.shape[2], pages.shape[3], d, dv, page_size, length,
                                    visible_from, float(scaling), out.data_ptr(), threads or torch.get_num_threads())
    if code:
        raise ValueError(f"the paged-attention kernel refused q {tuple(q.shape)}, keys {tuple(keys.shape)}, pages "
                         f"{tuple(pages.shape)} (code {code})")
    return out
