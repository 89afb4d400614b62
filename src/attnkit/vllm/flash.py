"""attnkit's backend over vLLM's FlashAttention backend (``FLASH_ATTN``, CUDA): written against the same interfaces
as the CPU one, its layout pieces unit-tested on CPU tensors, **not yet run in an engine** (vLLM's CUDA wheel cannot
reach the GPU machines this project is lent). An engine that runs it warns once at start-up.

FlashAttention's cache of a layer is ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, keys in the first half of
each entry's row and values in the second (vLLM splits it as ``kv_cache.transpose(1, 2).split(head_dim, -1)``), so
an entry ``(slot, dim)`` lies at row ``slot``, column ``dim`` of its block (:func:`attnkit.vllm.paged.identity_layout`);
entries are written by vLLM's ``reshape_and_cache_flash`` (``vllm._custom_ops``, the op its FlashAttention backend
calls on CUDA). CUDA graphs cannot capture attnkit's rows (their
gathers depend on each request's plan), so an engine with attnkit on this backend must run eagerly
(:func:`attnkit.vllm.patches.check_engine`).
"""

from __future__ import annotations

import logging

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from attnkit.vllm import paged
from attnkit.vllm.backend import AttnkitBuilderMixin, AttnkitImplMixin, attnkit_backend, serving

_warned: list[bool] = []


def flash_split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[num_blocks, kv_heads, block_size, head_dim]`` (views) of FlashAttention's cache."""
    head_dim = kv_cache.shape[-1] // 2
    return kv_cache[..., :head_dim], kv_cache[..., head_dim:]


class AttnkitFlashMetadataBuilder(AttnkitBuilderMixin, FlashAttentionMetadataBuilder):
    pass


class AttnkitFlashImpl(AttnkitImplMixin, FlashAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if serving() is not None and not _warned:
            _warned.append(True)
            logging.getLogger(__name__).warning(
                "attnkit's FlashAttention path has not been run in an engine before; check its tokens against "
                "attnkit.generate (docs/vllm.md)")

    def cache_layout(self, layer, kv_cache):
        def store(key, value, key_cache, value_cache, slots):
            ops.reshape_and_cache_flash(key, value, key_cache.transpose(1, 2), value_cache.transpose(1, 2), slots,
                                        self.kv_cache_dtype, layer._k_scale, layer._v_scale)

        key_cache, value_cache = flash_split(kv_cache)
        return key_cache, value_cache, paged.identity_layout(kv_cache.shape[2], kv_cache.shape[-1] // 2), store


AttnkitFlashBackend = attnkit_backend(FlashAttentionBackend, AttnkitFlashImpl, AttnkitFlashMetadataBuilder,
                                      "AttnkitFlashBackend")
