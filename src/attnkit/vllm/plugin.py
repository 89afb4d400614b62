"""The ``vllm.general_plugins`` entry point (``attnkit = "attnkit.vllm.plugin:register"``), which vLLM loads in
every one of its processes (API server, engine core, workers)."""

from __future__ import annotations

from attnkit.vllm import versions


def register() -> None:
    """Register attnkit's KV-cache spec and its attention backends over vLLM's CPU and FlashAttention ones (inert
    until an engine's ``additional_config`` has an ``attnkit`` key) and install the wrappers of
    :mod:`attnkit.vllm.patches`. On a vLLM version the plugin is not tested with, none of that is imported or
    registered, and only the check that refuses an engine asking for attnkit is installed
    (:mod:`attnkit.vllm.versions`)."""
    if not versions.tested():
        versions.refuse_attnkit_engines()
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from attnkit.vllm import patches
    from attnkit.vllm.manager import AttnkitManager, AttnkitSpec

    patches.apply()
    KVCacheSpecRegistry._ensure_registered()  # vLLM's own specs first: it fills only an empty registry
    KVCacheSpecRegistry.register(AttnkitSpec, AttnkitManager, uniform_type_base_spec=FullAttentionSpec)
    register_backend(AttentionBackendEnum.CPU_ATTN, "attnkit.vllm.cpu.AttnkitCPUBackend")
    register_backend(AttentionBackendEnum.FLASH_ATTN, "attnkit.vllm.flash.AttnkitFlashBackend")
