"""The scheduler's side: a KV-cache spec that carries the attnkit configuration, and its block manager.

Registered with vLLM's KV-cache spec registry (:func:`attnkit.vllm.plugin.register`), the spec is what attnkit's attention backend
returns from ``customize_spec`` for every layer when the engine's ``additional_config`` names a recipe. Its
manager is vLLM's full-attention manager plus one rule: blocks that no later query of a request reads
(:meth:`attnkit.vllm.plan.Plan.freeable`: the prompt entries a compression dropped, the stretch between
streaming's sinks and window, what a window left behind) go back to the pool as null blocks in the block
table, the way vLLM's sliding-window and R-SWA managers free theirs. The plan is a function of the recipe,
the request's prompt length and its own method (:mod:`attnkit.vllm.requests`), so the scheduler and the
workers agree on it without talking.

Prefix caching: a request whose plan changes its blocks (compaction, freed blocks) never publishes them as a
cached prefix (:meth:`AttnkitManager.cache_blocks`), and never takes a cached prefix either (the scheduler's prefix
lookup is refused it: :func:`attnkit.vllm.requests.refuses_prefix_hit`, through :mod:`attnkit.vllm.patches`);
plain requests and Quest's (every entry kept, the block summaries beside them) share prefixes as usual.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from attnkit.vllm import metrics, requests
from attnkit.vllm.config import EngineConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttnkitSpec(FullAttentionSpec):
    """A full-attention layer whose blocks attnkit's plan may free (``config``: the engine's attnkit config, JSON)."""

    config: str = ""

    @classmethod
    def merge(cls, specs):
        merged = super().merge(specs)
        return dataclasses.replace(merged, config=specs[0].config)


class AttnkitManager(FullAttentionManager):
    """vLLM's full-attention manager that also frees the blocks a request's plan no longer reads."""

    def __init__(self, kv_cache_spec: AttnkitSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.scheduled = requests.ScheduledRequests(EngineConfig.from_json(kv_cache_spec.config))

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        plan = self.scheduled.plan(request_id, num_prompt_tokens)
        if plan is None or plan.plain:
            return
        bs, free = self.block_size, self.block_pool.get_num_free_blocks()
        for start, end in plan.freeable(processed_computed_tokens):
            self._remove_blocks_in_range(request_id, -(-start // bs), end // bs)
        freed = self.block_pool.get_num_free_blocks() - free
        if freed:
            metrics.BLOCKS_FREED.inc(freed)

    def reservation(self, request, num_tokens: int) -> int:
        """Blocks to keep free when the scheduler admits `request` (waiting or preempted) with slots for
        `num_tokens` tokens: what the requests this manager holds will still take before their plans' peaks
        (:meth:`attnkit.vllm.plan.Plan.peak_blocks`), and what `request` will past this allocation. Requests whose
        plan frees nothing, and a plan whose peak exceeds the pool, reserve nothing (vLLM's own admission: admit
        while the prompt fits, preempt when the cache is full); without requests held, nothing is reserved."""
        pool, bs = self.block_pool.num_gpu_blocks, self.block_size
        own = self.scheduled.peak_blocks(request.request_id, bs)
        total = max(0, own - -(-num_tokens // bs)) if own is not None and own < pool else 0
        held_any = False
        for request_id, blocks in self.req_to_blocks.items():
            if request_id == request.request_id or not blocks:
                continue
            held_any = True
            peak = self.scheduled.peak_blocks(request_id, bs)
            if peak is not None and peak < pool:
                total += max(0, peak - sum(not b.is_null for b in blocks))
        return total if held_any else 0

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.scheduled.forget(request_id)

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        plan = self.scheduled.plan(request.request_id, request.num_prompt_tokens)
        if plan is None or plan.shares_prefix:
            super().cache_blocks(request, num_tokens, *args, **kwargs)


def attnkit_managers(kv_cache_manager) -> list[AttnkitManager]:
    """The attnkit block managers of an engine's KV-cache manager (vLLM's ``KVCacheManager``): one per attnkit layer
    group, none for a plain engine (found once, kept on the manager)."""
    found = getattr(kv_cache_manager, "_attnkit_managers", None)
    if found is None:
        managers = kv_cache_manager.coordinator.single_type_managers
        found = kv_cache_manager._attnkit_managers = [m for m in managers if isinstance(m, AttnkitManager)]
    return found


def scheduled_requests(kv_cache_manager) -> list[requests.ScheduledRequests]:
    """The attnkit bookkeeping of an engine's KV-cache manager: one per attnkit layer group."""
    return [m.scheduled for m in attnkit_managers(kv_cache_manager)]
