"""attnkit's backend over vLLM's CPU attention (``CPU_ATTN``, which vLLM's CPU platform always picks): engine-tested.

The CPU cache layout depends on the instruction set vLLM's kernels were built for (``layer.isa``), so the map from
an entry to where it lies is learnt from vLLM's own writing op (:func:`attnkit.vllm.paged.learn_layout`).
"""

from __future__ import annotations

from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from attnkit.vllm import paged
from attnkit.vllm.backend import AttnkitBuilderMixin, AttnkitImplMixin, attnkit_backend


class AttnkitCPUMetadataBuilder(AttnkitBuilderMixin, CPUAttentionMetadataBuilder):
    pass


class AttnkitCPUImpl(AttnkitImplMixin, CPUAttentionBackendImpl):
    def cache_layout(self, layer, kv_cache):
        def store(key, value, key_cache, value_cache, slots):
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, layer.isa,
                                           k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                           kv_cache_dtype=self.kv_cache_dtype)

        blocks, heads, block_size, width = kv_cache.shape
        layout = paged.learn_layout(("cpu", layer.isa, block_size, width // 2, heads, kv_cache.dtype), store,
                                    paged.split_cache, block_size, width // 2, heads, kv_cache.dtype)
        key_cache, value_cache = paged.split_cache(kv_cache)
        return key_cache, value_cache, layout, store


AttnkitCPUBackend = attnkit_backend(CPUAttentionBackend, AttnkitCPUImpl, AttnkitCPUMetadataBuilder, "AttnkitCPUBackend")
