"""``a_shape``: every head A-shaped during prefill, dense decoding over the full cache (MInference 1.0:
Accelerating Pre-filling for Long-Context LLMs via Dynamic Sparse Attention, Jiang et al. 2024, arXiv
2407.02490, section 3.2; the "Ours w/ only A-shape" / StreamingLLM-style prefill baseline of Tables 2-4).

Query ``i`` attends to key ``j <= i`` iff ``j < n_init`` (initial tokens) or ``i - j < n_local`` (local
window; :func:`attnkit.masks.a_shape`), plus key block 0 and its own block of ``block_size`` tokens, which every MInference pattern
keeps. Unlike the ``streaming`` eviction method, nothing leaves the cache: only the prompt's attention
is sparse, and generated tokens see the whole prompt. The defaults are the A-shape setting of the
paper's search space (Table 7: 1024 initial tokens, a 4096-token window).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.methods.minference import DENSE_ABOVE, SparsePrefill
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.sparse.patterns import DEFAULT_BLOCK, HeadPattern, check_block
from attnkit.validate import fraction, whole


@register
@dataclass(frozen=True)
class AShape(SparsePrefill):
    """A-shape sparse prefill (n_init global tokens + n_local window) for every head; dense decoding."""

    n_init: int = 1024
    n_local: int = 4096
    block_size: int = DEFAULT_BLOCK
    compile: bool = True
    dense_above: float = DENSE_ABOVE

    name = "a_shape"
    summary = "A-shape sparse prefill: n_init initial tokens + n_local window, dense decode (MInference)"

    def __post_init__(self):
        for name in ("n_init", "n_local"):
            whole(name, getattr(self, name), 0)
        check_block(self.block_size)
        fraction("dense_above", self.dense_above)

    def block(self) -> int:
        return self.block_size

    def layer_patterns(self, ctx: LayerContext, n_heads: int) -> list[HeadPattern]:
        return [HeadPattern("a_shape", n_init=self.n_init, n_local=self.n_local)] * n_heads
