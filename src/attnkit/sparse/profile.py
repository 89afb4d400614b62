"""Where sparse prefill spends its time: the index (Alg. 2/3 estimates and the layout), the build (padding,
gathering the vertical columns, the BlockMask) and the kernel -- the split MInference 1.0 (Jiang et al.
2024, arXiv 2407.02490) reports as index-building overhead against kernel time."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from attnkit.sparse.layout import SparseLayout


@dataclass
class PrefillProfile:
    """Seconds spent in sparse prefill, by part: ``index`` (Alg. 2/3 estimates and the layout), ``build``
    (padding, gathering the vertical columns, the BlockMask) and ``kernel`` (FlexAttention); plus layer
    calls that ran sparse / fell back to dense, and the summed density of the sparse ones."""

    index_s: float = 0.0
    build_s: float = 0.0
    kernel_s: float = 0.0
    sparse_calls: int = 0
    dense_calls: int = 0
    density_sum: float = 0.0

    @property
    def overhead_s(self) -> float:
        """Everything but the kernel: what the paper calls the cost of building the sparse index."""
        return self.index_s + self.build_s

    def as_dict(self) -> dict:
        calls = self.sparse_calls
        return {"index_s": self.index_s, "build_s": self.build_s, "kernel_s": self.kernel_s,
                "sparse_calls": calls, "dense_calls": self.dense_calls,
                "mean_density": self.density_sum / calls if calls else None}


_PROFILE: PrefillProfile | None = None


@contextlib.contextmanager
def profile():
    """Collect a :class:`PrefillProfile` of the sparse prefills run inside the block (synchronising the
    device around each part, so only use it for measurements)."""
    global _PROFILE
    previous, _PROFILE = _PROFILE, PrefillProfile()
    try:
        yield _PROFILE
    finally:
        _PROFILE = previous


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(part: str):
    """Add the time spent in the block to `part` (index, build or kernel) of the active profile, if any."""
    prof = _PROFILE
    if prof is None:
        yield
        return
    _sync()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _sync()
        setattr(prof, f"{part}_s", getattr(prof, f"{part}_s") + time.perf_counter() - t0)


def record_call(layout: SparseLayout | None, dense_heads: torch.Tensor | None = None) -> None:
    """Count a layer call in the active profile (None: it ran dense). `dense_heads` (bool ``[h]``): heads
    that ran dense instead of their layout's pairs; they count as density 1."""
    prof = _PROFILE
    if prof is None:
        return
    if layout is None or layout.dense or (dense_heads is not None and bool(dense_heads.all())):
        prof.dense_calls += 1
    else:
        density = layout.density
        if dense_heads is not None:
            density = torch.where(dense_heads.to(density.device), 1.0, density)
        prof.sparse_calls += 1
        prof.density_sum += float(density.mean())
