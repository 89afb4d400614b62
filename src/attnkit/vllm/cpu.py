"""attnkit's backend over vLLM's CPU attention (``CPU_ATTN``, which vLLM's CPU platform always picks): engine-tested.

The CPU cache layout depends on the instruction set vLLM's kernels were built for (``layer.isa``), so the map from
an entry to where it lies is learnt from vLLM's own writing op (:func:`attnkit.vllm.paged.learn_layout`).
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from attnkit.vllm import paged
from attnkit.vllm.backend import AttnkitBuilderMixin, AttnkitImplMixin, attnkit_backend


class AttnkitCPUMetadataBuilder(AttnkitBuilderMixin, CPUAttentionMetadataBuilder):
    windowed = True

    def window(self, length, seq_lens, block_table):
        starts = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        schedule = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0], num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=starts, causal=True,
            sliding_window_size=length, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype)
        return starts, seq_lens, block_table, schedule


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

    def windowed_attention(self, layer, query, key_cache, value_cache, run, out):
        starts, seq_lens, block_table, schedule = run.meta
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=self.scale, causal=True, alibi_slopes=self.alibi_slopes, sliding_window=run.length,
            block_table=block_table, softcap=self.logits_soft_cap, scheduler_metadata=schedule, s_aux=self.sinks,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)


AttnkitCPUBackend = attnkit_backend(CPUAttentionBackend, AttnkitCPUImpl, AttnkitCPUMetadataBuilder, "AttnkitCPUBackend")
