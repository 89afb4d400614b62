"""attnkit's figures among vLLM's Prometheus metrics (``/metrics`` of its OpenAI server), from the scheduler and the
workers: requests per method, blocks handed back to vLLM's pool, KV entries kept by compressions, compaction time.

They are ``prometheus_client`` metrics, which vLLM itself uses. The server's ``/metrics`` shows metrics of other
processes (the engine core, its workers) when ``PROMETHEUS_MULTIPROC_DIR`` names a directory for them before vLLM
starts: ``attnkit serve`` sets one (a temporary directory) unless it is already set; vLLM sets one itself only for
several API servers. In-process engines (``vllm.LLM``) count them in the process's default registry.
"""

from __future__ import annotations

import importlib.metadata

from prometheus_client import Counter, Histogram

REQUESTS = Counter("attnkit_requests", "Requests whose method the attnkit plugin runs, by method", ["method"])
BLOCKS_FREED = Counter("attnkit_blocks_freed", "KV-cache blocks attnkit's plans handed back to vLLM's pool")
COMPRESSIONS = Counter("attnkit_compressions", "Compressions of one layer of one request (after the prompt or "
                                               "while decoding)")
ENTRIES_KEPT = Counter("attnkit_kv_entries_kept", "KV entries per kv head kept by those compressions, summed")
COMPACTION = Histogram("attnkit_compaction_seconds", "Time of one layer's compression of one request in the worker "
                                                    "(the method's hooks and the moves of its entries)",
                       buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0))


def method_label(method) -> str:
    """``snapkv``, ``minference+snapkv``: the names of a (composed) method."""
    parts = [getattr(method, "prefill_method", None), getattr(method, "cache_method", None)]
    return "+".join(p.name for p in parts) if all(parts) else method.name


def compacted(seconds: float, kept: int, requests: int = 1) -> None:
    """One layer's call that compressed `requests` requests to `kept` entries per kv head each took `seconds` per
    request."""
    _observe(COMPACTION, seconds, requests)
    COMPRESSIONS.inc(requests)
    ENTRIES_KEPT.inc(kept * requests)


# prometheus_client's Histogram takes one observation per call, and a stacked step of a per-step method observes
# once per request, per layer and generated token. In the versions tested the same `times` observations are one
# update of its own parts (the sum, and the count of the first bucket that holds the value, as observe does); on any
# other version, one observe per observation.
_BULK = importlib.metadata.version("prometheus_client").startswith("0.26.")


def _observe(histogram: Histogram, seconds: float, times: int) -> None:
    if times == 1 or not _BULK:
        for _ in range(times):
            histogram.observe(seconds)
        return
    histogram._sum.inc(seconds * times)
    for bound, bucket in zip(histogram._upper_bounds, histogram._buckets):
        if seconds <= bound:
            bucket.inc(times)
            break
