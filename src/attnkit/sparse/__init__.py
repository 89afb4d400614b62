"""Sparse prefill attention (MInference): the three head patterns, their dynamic index building, the layout
of the pairs each head computes, the FlexAttention kernel that computes them and its dense reference.

MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic Sparse Attention (Jiang et al.
2024, arXiv 2407.02490). The modules, bottom up:

- :mod:`attnkit.sparse.patterns`: :class:`HeadPattern` (section 3.2's a_shape / vertical_slash /
  block_sparse), the block sizes, :func:`padded_length`.
- :mod:`attnkit.sparse.index`: Alg. 2 and Alg. 3 estimates, top-k selections and ranks, slash diagonals.
- :mod:`attnkit.sparse.layout`: :class:`SparseLayout` (tiles, gathered vertical columns, the token rule as
  :mod:`attnkit.masks` rules), :func:`build_layout`, :func:`layout_for_patterns`, :func:`kernel_flops`.
- :mod:`attnkit.sparse.profile`: the prefill profiler (index / build / kernel time, sparse and dense calls).
- :mod:`attnkit.sparse.kernels`: the FlexAttention ``BlockMask`` and :func:`sparse_attention` (on a CPU in
  float32, a C++ kernel).
- :mod:`attnkit.sparse.reference`: :func:`dense_mask` and :func:`reference_attention`, the tests' reference.

Queries are the last ``nq`` of ``n`` contiguous key positions ``0 .. n-1`` (a prompt, or its last chunk);
batch size 1; q ``[1, q_heads, nq, d]``, k/v ``[1, kv_heads, n, d]`` (GQA: never expanded). The names below
are the package's public interface.
"""

from attnkit.sparse.index import (
                                  descending_rank,
                                  estimate_block_sparse,
                                  estimate_vertical_slash,
                                  head_logits,
                                  slash_diagonals,
                                  static_block_rows,
                                  top_k_mask,
)
from attnkit.sparse.kernels import block_mask, sparse_attention
from attnkit.sparse.layout import SparseLayout, build_layout, kernel_flops, layout_for_patterns
from attnkit.sparse.patterns import (
                                  BLOCK_SIZES,
                                  DEFAULT_BLOCK,
                                  DEFAULT_LAST_Q,
                                  NEVER,
                                  PATTERN_PARAMS,
                                  PATTERNS,
                                  HeadPattern,
                                  check_block,
                                  padded_length,
)
from attnkit.sparse.profile import PrefillProfile, profile, record_call, timed
from attnkit.sparse.reference import dense_mask, reference_attention

__all__ = [
    "BLOCK_SIZES", "DEFAULT_BLOCK", "DEFAULT_LAST_Q", "NEVER", "PATTERN_PARAMS", "PATTERNS", "HeadPattern",
    "check_block", "padded_length", "descending_rank", "estimate_block_sparse", "estimate_vertical_slash",
    "head_logits", "slash_diagonals", "static_block_rows", "top_k_mask", "SparseLayout", "build_layout",
    "kernel_flops", "layout_for_patterns", "PrefillProfile", "profile", "record_call", "timed", "block_mask",
    "sparse_attention", "dense_mask", "reference_attention",
]
