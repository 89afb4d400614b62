"""``kivi``: the KV cache of any cache method quantized to 2, 4 or 8 bits (Liu, Yuan, Jin, Zhong, Xu, Braverman,
Chen and Hu, 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024, arXiv 2402.02750).

KIVI quantizes keys **per channel** (a group of ``group`` tokens shares one zero point and scale per channel) and
values **per token** (groups of ``group`` consecutive channels), asymmetrically (zero point = the group's minimum,
scale = its range / ``2^bits - 1``; the paper's section 3), and keeps the newest tokens in full precision: the
**residual**, between ``residual`` and ``residual + group - 1`` tokens, whose oldest ``group`` tokens are
quantized together as the window moves on (its Algorithm 1). The formulas are in :mod:`attnkit.quant.kivi`, the
storage in :mod:`attnkit.quant.layer`.

It wraps a cache method (``cache``, default ``full``): on the command line a trailing ``+kivi`` part,
``snapkv:budget=0.3+kivi:bits=4`` or ``minference+snapkv:budget=0.3+kivi:bits=2``; in a recipe the part
``"quantize": {"method": "kivi", "params": {"bits": 4}}``. The wrapped method does everything it does alone
(prefill, scoring, compression, eviction, its prefill method's outputs); only its layer's storage is KIVI's:

- the prompt is attended, scored and compressed in full precision, then what the method kept is quantized
  (KIVI quantizes what the method keeps, so the prompt-time scores of snapkv, knorm, h2o, ... see exact keys);
- while decoding, every read of the cache (attention, and the scores h2o, tova or keyformer compute from it)
  sees the dequantized entries, the residual's exactly; eviction drops or overwrites slots as without kivi.

A method that overwrites keys it already stored (``streaming`` with ``positions=reindex``) or runs the decoder
layers itself (``select``, ``gemfilter``) is refused. With ``residual`` at least the prompt plus the generated
tokens nothing is ever quantized and the outputs are the wrapped method's exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnkit.methods.base import Method
from attnkit.methods.cache_wrapper import CacheWrapper, wrappable
from attnkit.methods.spec import register
from attnkit.quant.kivi import BITS
from attnkit.quant.layer import KiviLayerKV
from attnkit.session import LayerContext
from attnkit.validate import choice, whole


def _wrapped(value) -> Method:
    return wrappable(value, Kivi, "kivi", again="the cache method is already quantized (one kivi part per spec)",
                     layers=" and cannot be quantized", storage="which a quantized cache cannot hold",
                     rotates="which a quantized cache cannot do without quantizing them again")


@register
@dataclass(frozen=True)
class Kivi(CacheWrapper):
    """The cache of `cache` held as KIVI codes: keys per channel, values per token, a full-precision residual."""

    bits: int = 4
    residual: int = 128
    group: int = 32
    cache: str | dict | Method = "full"
    _cache: Method = field(default=None, init=False, repr=False, compare=False)

    name = "kivi"
    quantizer = True  # a trailing "+kivi:..." part of a spec wraps what precedes it (attnkit.methods.spec)
    summary = "KV cache quantized to 2/4 bits: keys per channel, values per token, recent tokens exact (KIVI, Liu et al. 2024)"

    def __post_init__(self):
        choice("bits", self.bits, BITS)
        whole("residual", self.residual, 0, what=" (newest tokens kept in full precision)")
        whole("group", self.group, 1, what=" (tokens per key group, channels per value group)")
        self.wrap(_wrapped(self.cache))

    def own_description(self) -> str:
        return f"kivi(bits={self.bits}, residual={self.residual}, group={self.group})"

    def decode_only_appends(self) -> bool:
        return False  # the residual moves on: dropping the newest slots would not undo a step

    # ---- the storage ----------------------------------------------------------------------------------------
    def allocate_layer(self, ctx: LayerContext, k, slots: int, ring: bool) -> KiviLayerKV:
        return KiviLayerKV.allocate_dense(self.bits, self.residual, self.group, k.shape[0], k.shape[1], slots,
                                          k.shape[-1], k.dtype, k.device, ring, ctx.session.prompt_len)

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        self._cache.after_prefill(ctx, q, k, v)
        if isinstance(ctx.kv, KiviLayerKV):
            ctx.kv.seal(ctx.session.prompt_len)  # what the method kept after the prompt

    def after_decode(self, ctx: LayerContext) -> None:
        self._cache.after_decode(ctx)
        if isinstance(ctx.kv, KiviLayerKV):
            ctx.kv.settle()
