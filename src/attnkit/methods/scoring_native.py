"""A C++ kernel for a prompt's attention and per-key statistics on a CPU, in one sweep over the logits.

H2O's accumulated attention (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
Large Language Models", arXiv 2306.14048) and Keyformer's accumulated Gumbel-softmax score (Adnan et al., MLSys 2024,
arXiv 2403.09054, eq. 9 at temperature 1) sum, per key, a function of the attention every prompt query gives it.
With torch operations a CPU either writes every logit of a query block to memory (the one pass of
:func:`attnkit.methods.scoring.attention_with_statistics`, which falls out of the caches on a long prompt) or
computes the logits twice (SDPA's fused kernel for the output, then :func:`~attnkit.methods.scoring.attention_statistics`).
The kernel computes each tile of logits once, in the caches: the output by FlashAttention's online
softmax (Dao et al., 2022, arXiv 2205.14135, Algorithm 1), and the statistic from the same exponentials, which each
query block keeps until its rows' log-sum-exps are known and then rescales into probabilities (or Keyformer's
weights, ``p_ij exp(zeta_ij) / sum_j p_ij exp(zeta_ij)`` with the draws of :mod:`attnkit.methods.keyformer_noise`).
KVzip (Kim et al., 2025, arXiv 2505.23416) uses the same sweep for its reconstruction's output and, over the keys
its score's softmax runs over, for its score (the maximum over the queries and the group's heads). A decoding method
that scores its last steps' queries over what it holds (SnapKV's observation window when it re-compresses, H2O's
buffered steps) takes the same statistic where those queries' keys end the held entries (:func:`attention_statistics`).
It is written by hand because no library computes column statistics of attention (the GPU has the Triton kernels of
:mod:`attnkit.methods.scoring_triton`).

The kernel is ``attnkit/native/scoring.cpp``, built on first use (:mod:`attnkit.native`) for the instruction set
``$ATTNKIT_NATIVE_ISA`` names. Without it (no compiler, ``ATTNKIT_NATIVE=0``), or where it is not faster than the
torch path on this CPU (:mod:`attnkit.native.guard`: :func:`kernel_pays` times both once per machine and shape
class), the scorers keep the torch path; the results agree to float32 rounding
(``tests/methods/test_scoring_native.py``).
"""

from __future__ import annotations

import ctypes

import torch

from attnkit import native
from attnkit.attention import attend
from attnkit.methods import scoring
from attnkit.native import guard

GUARD_KEYS, GUARD_QUERIES = 4096, 256  # most keys and queries of the guard's comparison
ROWS_PER_BLOCK = 128  # query rows (query heads of a group x queries) per block: a few logit micro-tiles per key tile
BLOCK_FLOATS = 1 << 23  # most floats a block keeps (rows x keys, 32 MiB), which caps the rows on a very long prompt
_P, _I64, _F, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURE = ("attnkit_prompt_statistics",
             [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F, _P, _I64, _P, _I32, _I32, _I64,
              _P, _I64, _I64, _P, _P, _I32], _I32)


def library() -> ctypes.CDLL | None:
    """The compiled kernel (``attnkit/native/scoring.cpp``, :func:`attnkit.native.load`), or None."""
    return native.load("scoring", SIGNATURE)


def kernel_pays(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None, *,
                output_only: bool = False) -> bool:
    """Whether the kernel runs for these operands: float32 on a CPU, value heads (when given) a multiple of 16 wide,
    the kernel built (:func:`library`), and faster than the torch path here (:func:`choice`; `output_only`: its
    sweep for the output alone against SDPA's fused kernel)."""
    operands = (q, keys) if values is None else (q, keys, values)
    if not (q.device.type == "cpu" and all(t.dtype == torch.float32 for t in operands)
            and (values is None or values.shape[-1] % 16 == 0)):
        return False
    return choice(q, keys, values, output_only=output_only).on


def choice(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None, *,
           output_only: bool = False) -> guard.Choice:
    """:func:`attnkit.native.guard.choose` for these operands' shape class: the sweep with the output (`values`
    given), the output alone (`output_only`) or the statistic alone, the heads and their sizes, the length class of
    the keys, the threads. The comparison: the kernel against :func:`attnkit.methods.scoring.attention_with_statistics`
    (with the output), :func:`attnkit.attention.attend` (the output alone: SDPA's kernels) or
    :func:`~attnkit.methods.scoring.attention_statistics` (the statistic alone), on random operands of the class,
    the last queries of the prompt (at most :data:`GUARD_QUERIES`; for the output alone, a whole causal prompt) over
    at most :data:`GUARD_KEYS` keys."""
    b, hq, m, d = q.shape
    kv, n = keys.shape[1], keys.shape[2]
    dv = None if values is None else values.shape[-1]
    if output_only and values is None:
        raise ValueError("the output alone needs values")
    top = guard.bucket(n)
    threads = torch.get_num_threads()
    kind = "output" if output_only else "sweep" if values is not None else "statistic"
    shape = f"{kind} heads={hq}/{kv} d={d} dv={dv} keys<={top} threads={threads}"

    def measure():
        gen = torch.Generator().manual_seed(0)
        keys_n = min(top, GUARD_KEYS)
        # the output alone: a prompt's whole causal attention (SDPA's causal kernel), every other: its last queries
        queries = keys_n if output_only else min(m, keys_n, GUARD_QUERIES)
        rq = torch.randn(1, hq, queries, d, generator=gen)
        rk = torch.randn(1, kv, keys_n, d, generator=gen)
        rv = None if dv is None else torch.randn(1, kv, keys_n, dv, generator=gen)
        q_pos, k_pos = torch.arange(keys_n - queries, keys_n), torch.arange(keys_n)
        if output_only:
            return guard.time_both(lambda: prompt_attention(rq, rk, rv, d ** -0.5, threads=threads),
                                   lambda: attend(rq, rk, rv, d ** -0.5, q_pos, k_pos))
        if rv is None:
            return guard.time_both(lambda: prompt_statistics(rq, rk, d ** -0.5, threads=threads),
                                   lambda: scoring.attention_statistics(rq, rk, d ** -0.5, q_pos, k_pos))
        return guard.time_both(lambda: prompt_attention_with_statistics(rq, rk, rv, d ** -0.5, threads=threads),
                               lambda: scoring.attention_with_statistics(rq, rk, rv, d ** -0.5, q_pos, k_pos))

    return guard.choose("scoring", library(), shape, measure)


def is_prompt_tail(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Whether the keys sit at positions ``0..L-1`` in order and the queries at the last of them: a prompt's first
    chunk, or a later chunk after the whole of the ones before it."""
    n, m = k_pos.shape[-1], q_pos.shape[-1]
    span = torch.arange(n, device=k_pos.device, dtype=k_pos.dtype)
    return k_pos.dim() == 1 and m <= n and torch.equal(k_pos, span) and torch.equal(q_pos, span[n - m:])


def ends_with_queries(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Whether the keys, in their order, end with the queries' own (strictly ascending positions) and every key before
    those lies before the first query: then query ``i`` sees every key up to its own index, as in a prompt's tail
    (:func:`is_prompt_tail`), whatever the earlier keys' positions. `k_pos` is ``[keys]`` or per kv head ``[b, kv,
    keys]``: a decoding method's held entries, the steps since it last scored appended last."""
    n, m = k_pos.shape[-1], q_pos.shape[-1]
    if not 0 < m <= n or q_pos.dim() != 1:
        return False
    q_pos = q_pos.to(k_pos.device)
    fits = (k_pos[..., n - m:] == q_pos).all()
    if n > m:
        fits &= k_pos[..., :n - m].amax() < q_pos[0]
    if m > 1:
        fits &= (q_pos.diff() > 0).all()
    return bool(fits)


def attention_statistics(q: torch.Tensor, keys: torch.Tensor, scaling: float, q_pos: torch.Tensor,
                         k_pos: torch.Tensor, *, reduce: str = "mean", window: int | None = None) -> torch.Tensor:
    """:func:`attnkit.methods.scoring.attention_statistics` of the attention probabilities: by the kernel's statistic
    alone (:func:`prompt_statistics`) where the keys end with the queries' own (:func:`ends_with_queries`), no window
    hides any, and the kernel pays (:func:`kernel_pays`); by the torch path otherwise. A decoding method that scores
    the queries of its last steps over what it holds (SnapKV's observation window, H2O's buffered steps) takes one
    sweep in the caches where torch writes every logit and its softmax."""
    if window is None and ends_with_queries(q_pos, k_pos) and kernel_pays(q, keys):
        return prompt_statistics(q, keys, scaling, reduce=reduce)
    return scoring.attention_statistics(q, keys, scaling, q_pos, k_pos, reduce=reduce, window=window)


def prompt_attention_with_statistics(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, *,
                                     reduce: str = "mean", rows: str = "sum", weights=None,
                                     threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries at the last ``m`` of ``L`` contiguous positions and the per-key statistic of
    :func:`attnkit.methods.scoring.attention_with_statistics`, from one sweep of the kernel.

    q ``[b, hq, m, d]``, keys ``[b, kv, L, d]`` at positions ``0..L-1``, values ``[b, kv, L, dv]`` (float32 on a
    CPU, any strides with the last axis contiguous; :func:`kernel_pays`). `weights` None gives the attention
    probabilities (H2O), a :class:`~attnkit.methods.keyformer_noise.GumbelFactorWeights` eq. 9 at temperature 1
    (Keyformer); they are reduced over the query heads of each kv group with `reduce` (mean or max) and over the
    queries with `rows` (sum or max). Returns the output ``[b, hq, m, dv]`` and the statistic ``[b, kv, L]``
    (float32). `threads`: workers (None: ``torch.get_num_threads()``)."""
    return _sweep(q, keys, values, scaling, reduce, rows, weights, threads)


def prompt_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, *,
                     threads: int | None = None) -> torch.Tensor:
    """The output of :func:`prompt_attention_with_statistics` alone (no statistic): for KVzip's reconstruction, whose
    output attends to every key while its score's softmax runs over some of them."""
    return _sweep(q, keys, values, scaling, "mean", "sum", None, threads, statistic=False)[0]


def prompt_attention_with_subset_statistics(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                            scaling: float, scored: torch.Tensor, columns: slice, *,
                                            reduce: str = "mean", rows: str = "sum", threads: int | None = None
                                            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`prompt_attention_with_statistics` where the statistic's softmax runs over the keys `scored` (a bool
    mask ``[L]``) only, ``exp(l_ij) / sum over scored j' of exp(l_ij')``, while the output attends to every key: KVzip's
    reconstruction (its output and its score in one sweep, where two sweeps computed each). Returns the output and
    the statistic of the keys `columns` (scored keys) ``[b, kv, columns]``; or None where the scored keys' sum of
    exponentials, relative to a row's maximum over all keys, fell below ``1e-25`` (they lie about 57 or more below
    it, so float32 exponentials lose them): the caller then scores them in a sweep of their own
    (:func:`prompt_statistics` over the scored keys, gathered)."""
    if scored.shape != keys.shape[2:3] or scored.dtype != torch.bool:
        raise ValueError(f"scored must be a bool mask over the {keys.shape[2]} keys, got {scored.dtype} "
                         f"{tuple(scored.shape)}")
    if not 0 <= columns.start <= columns.stop <= keys.shape[2] or not bool(scored[columns].all()):
        raise ValueError(f"columns {columns.start}..{columns.stop} must be scored keys among {keys.shape[2]}")
    out, stats = _sweep(q, keys, values, scaling, reduce, rows, None, threads, scored=scored, columns=columns)
    return None if out is None else (out, stats[..., columns])


def prompt_statistics(q: torch.Tensor, keys: torch.Tensor, scaling: float, *, reduce: str = "mean", rows: str = "sum",
                      weights=None, threads: int | None = None) -> torch.Tensor:
    """The statistic of :func:`prompt_attention_with_statistics` alone (no values, no output): for a prompt whose
    output another method computes, and for KVzip's score over the keys its softmax runs over."""
    return _sweep(q, keys, None, scaling, reduce, rows, weights, threads)[1]


def _strides(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor(t.stride()[:3], dtype=torch.int64)


def _sweep(q, keys, values, scaling, reduce, rows, weights, threads, statistic=True, scored=None, columns=None):
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU scoring kernel is not available (see kernel_pays)")
    operands = (q, keys) if values is None else (q, keys, values)
    wrong = [f"{t.dtype} on {t.device}" for t in operands if t.device.type != "cpu" or t.dtype != torch.float32]
    if wrong:
        raise ValueError(f"the CPU scoring kernel takes float32 tensors on a CPU, not {wrong[0]}")
    b, hq, m, d = q.shape
    kv, n = keys.shape[1], keys.shape[2]
    if hq % kv:
        raise ValueError(f"{hq} query heads are not a multiple of {kv} kv heads")
    q, keys = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys))
    g = hq // kv
    tile = lib.attnkit_key_tile()  # the kernel's key tiles: every row reads that many keys (and draws) at once
    padded = -(-n // tile) * tile
    rows_per_block = max(g, min(ROWS_PER_BLOCK, BLOCK_FLOATS // padded))
    table = offsets = None
    if weights is not None:
        table, offsets = weights.table_and_offsets(g, torch.arange(n - m, n), padded - 1, torch.bfloat16)
        offsets = offsets.contiguous()
    out = dv = None
    if values is not None:
        values = values if values.stride(-1) == 1 else values.contiguous()
        dv = values.shape[-1]
        out = torch.empty(b, hq, m, dv, dtype=torch.float32)
    stats = torch.empty(b, kv, n, dtype=torch.float32) if statistic else None
    mask = None if scored is None else scored.to(torch.uint8).contiguous()
    lo, hi = (0, n) if columns is None else (columns.start, columns.stop)
    qs, ks = _strides(q), _strides(keys)
    vs = qs if values is None else _strides(values)  # unread without values
    code = lib.attnkit_prompt_statistics(
        q.data_ptr(), qs.data_ptr(), keys.data_ptr(), ks.data_ptr(), None if values is None else values.data_ptr(),
        vs.data_ptr(), b, hq, kv, m, n, d, dv or 0, float(scaling), None if table is None else table.data_ptr(),
        0 if table is None else table.numel(), None if offsets is None else offsets.data_ptr(),
        int(reduce == "max"), int(rows == "max"), max(1, rows_per_block // g), None if mask is None else mask.data_ptr(),
        lo, hi, None if out is None else out.data_ptr(), None if stats is None else stats.data_ptr(),
        threads or torch.get_num_threads())
    if code == 4:  # the scored keys' exponentials lost precision (only with `scored`)
        return None, None
    if code == 3:
        raise MemoryError(f"the CPU scoring kernel could not allocate its buffers for {n} keys")
    if code:
        shapes = f"q {tuple(q.shape)}, keys {tuple(keys.shape)}"
        shapes += "" if values is None else f", values {tuple(values.shape)}"
        raise ValueError(f"the CPU scoring kernel refused {shapes} (code {code}): it takes no more queries than keys, "
                         f"and value heads a multiple of 16 wide")
    return out, stats
