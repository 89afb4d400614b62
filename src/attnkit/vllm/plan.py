"""What the vLLM host does for one request, decided from the recipe alone (no vLLM import here).

A method decides and a host stores (DESIGN.md): this module turns an attnkit method into the few facts the
vLLM adapter needs to store a request in vLLM's paged blocks, on both sides of the engine:

- the scheduler's KV-cache manager frees whole blocks that no later query reads (:meth:`Plan.freeable`);
- the worker's attention computes each request's outputs over the slots it may read (:meth:`Plan.visible`),
  and runs the method's own hooks on the prompt (:mod:`attnkit.vllm.prefill`).

The layout in paged slots (vLLM writes position ``p`` to slot ``p`` of the request's block table, and we keep
that: no slot mapping is rewritten). A prompt compressed to ``B`` entries per kv head is *compacted into the
slots just before the first generated token*, ``[n - B, n)``, each kv head its own ``B`` entries in position
order; generated tokens then land at their own positions ``n, n + 1, ...``, right after them. So the kept
entries and the generated ones are one contiguous run of slots, and the blocks wholly before slot ``n - B``
go back to vLLM's pool as a sliding window's do (null blocks at the front of the block table). Keys are
stored after RoPE at their original positions, so where an entry sits never changes its rotation.

Methods (each kv head choosing its own entries, uniform budget per kv head and layer):

- prompt scorers (``snapkv``, ``knorm``, ``keydiff``, ``expected_attention``): compacted after the prompt;
  generated tokens are appended (decode reads ``[n - B, p]``). ChunkKV's ``chunk_length`` runs as is: it changes
  which ``B`` entries each kv head keeps (the method's own ``compact``), not how many.
- ``streaming``: sinks plus a window of ``B - sinks`` recent tokens; compacted after the prompt like a scorer
  (sinks first, so the window's entries land on slots equal to their positions), then every step reads the
  sinks and the last ``B - sinks`` positions; blocks between them are freed as the window moves.
- ``window``: each token reads the last ``window`` positions, prefill included; blocks behind it are freed.
- sparse prefill (``a_shape``, ``minference_static``, ``minference``): the prompt's outputs from the method,
  the cache whole (decode is vLLM's own kernel).
- ``PREFILL+CACHE``: a sparse prefill's outputs with one of the cache policies above.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnkit.cache import KVCache
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.compose import Compose
from attnkit.methods.full import Full
from attnkit.methods.minference import SparsePrefill
from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.snapkv import SnapKV
from attnkit.methods.streaming import Streaming
from attnkit.methods.window import Window
from attnkit.recipe.core import Recipe, as_recipe, load_recipe_file
from attnkit.session import Session, planned_slots

SUPPORTED = ("full, window, streaming (positions=original), snapkv, knorm, keydiff, expected_attention (a budget or "
             "budget_tokens, one value for every layer and kv head; the prompt compressed once), a_shape, "
             "minference_static, minference, and PREFILL+CACHE of a sparse prefill with one of those cache methods")
RECIPE_SUFFIXES = (".json", ".yaml", ".yml")


def read_recipe(value, source: str) -> Recipe:
    """A recipe from what ``--method``/``--recipe`` take: a method spec, a mapping, or a recipe file."""
    if isinstance(value, str):
        if Path(value).is_file():
            return load_recipe_file(value)
        if value.strip().lower().endswith(RECIPE_SUFFIXES) and "=" not in value:  # a spec has name:key=value
            raise AttnkitError(f"{source}: recipe file {value!r} does not exist")
    return as_recipe(value, source)


def method_of(value, source: str) -> Method:
    """The attention method a recipe names, refused unless the vLLM plugin supports it (:func:`check_supported`)."""
    recipe = read_recipe(value, source)
    if recipe.decode is not None:
        raise AttnkitError(f"{source}: speculative decoding is vLLM's own (speculative_config); the attnkit plugin "
                           f"supports {SUPPORTED}")
    if recipe.peer is not None:
        raise AttnkitError(f"{source}: a kvpress recipe runs in kvpress; the attnkit plugin supports {SUPPORTED}")
    method = recipe.method()
    check_supported(method, source)
    return method


def _unsupported(method: Method, source: str, why: str = "") -> AttnkitError:
    return AttnkitError(f"{source}: {method.describe()} is not supported inside vLLM{why}; the attnkit plugin "
                        f"supports {SUPPORTED}")


def check_supported(method: Method, source: str) -> None:
    """Raise a one-line AttnkitError for a method (or a part of it) the vLLM host cannot run exactly."""
    cache = method
    if isinstance(method, Compose):
        if not isinstance(method.prefill_method, (SparsePrefill, Full)):
            raise _unsupported(method.prefill_method, source, " as a prefill part")
        cache = method.cache_method
        if isinstance(cache, Window):  # the window's prefill masks by itself: nothing to compose with
            raise _unsupported(method, source, " (window computes its own prefill)")
    if isinstance(cache, (Full, SparsePrefill, Window)):
        return
    if isinstance(cache, Streaming):
        if cache.positions != "original":
            raise _unsupported(cache, source, " (keys are stored at their original positions; use positions=original)")
    elif not isinstance(cache, PromptScorer) or type(cache).run_layers is not None:
        raise _unsupported(cache, source)
    elif cache.needs_layer_inputs:
        raise _unsupported(cache, source, " (it reads the layers' input hidden states, which vLLM's attention does "
                                          "not see)")
    else:
        if cache.decode_every or cache.head_budgets != "uniform":
            raise _unsupported(cache, source, " (decode_every and head_budgets=adaptive change the cache while "
                                              "decoding or per head count)")
        if isinstance(cache, SnapKV) and cache.decode_budget is not None:
            raise _unsupported(cache, source, " (decode_budget evicts while decoding)")
    if cache.layer_budgets != "uniform" or isinstance(cache.budget, (list, tuple)) \
            or isinstance(cache.budget_tokens, (list, tuple)):
        raise _unsupported(cache, source, " (one budget for every layer: a KV-cache group's layers share their "
                                          "blocks)")
    if cache.budget is None and cache.budget_tokens is None:
        raise AttnkitError(f"{source}: {cache.describe()} needs a budget (budget=FRACTION or budget_tokens=N)")


def cache_part(method: Method) -> Method:
    return method.cache_method if isinstance(method, Compose) else method


@dataclass(frozen=True)
class Plan:
    """How one request of prompt length ``prompt_len`` is stored and read (see the module docstring)."""

    prompt_len: int
    kept: int | None = None  # entries per kv head after the prompt (None: the prompt is not compacted)
    sinks: int = 0  # streaming's sinks (the first slots the request holds after its prompt)
    window: int | None = None  # positions a query reads back (window; streaming: B - sinks); None: all
    hooks: bool = False  # whether the prompt runs through the method's hooks (statistics, compaction, sparse)
    dense_prompt: bool = True  # the prompt's queries read every earlier prompt token (all but `window`)

    @property
    def base(self) -> int:
        """First slot the request still holds after its prompt (the compacted entries start there)."""
        return self.prompt_len - self.kept if self.kept is not None else 0

    @property
    def plain(self) -> bool:
        """Nothing differs from full attention: vLLM's own kernel serves the request."""
        return not self.hooks and self.window is None

    def visible(self, position: int) -> list[tuple[int, int]]:
        """Slot ranges ``[start, end)`` a query at `position` reads."""
        end = position + 1
        if position < self.prompt_len and self.dense_prompt:
            return [(0, end)]
        base = self.base if position >= self.prompt_len else 0
        if self.window is None:
            return [(base, end)]
        start = max(base, end - self.window)
        sink_end = base + self.sinks
        if start <= sink_end:
            return [(base, end)]
        return [(base, sink_end), (start, end)] if self.sinks else [(start, end)]

    def freeable(self, computed: int) -> list[tuple[int, int]]:
        """Slot ranges no query at position `computed` or later reads (the manager frees whole blocks in them)."""
        if computed < self.prompt_len and self.dense_prompt:
            return []
        ranges = [(0, self.base)]
        if self.window is not None:
            ranges.append((self.base + self.sinks, computed - self.window + 1))
        return [(a, b) for a, b in ranges if b > a]


def plan_for(method: Method, prompt_len: int, max_tokens: int, n_layers: int) -> Plan:
    """The :class:`Plan` of a request (a supported method: :func:`check_supported`)."""
    prefill_sparse = isinstance(method, SparsePrefill) or (
        isinstance(method, Compose) and isinstance(method.prefill_method, SparsePrefill))
    cache = cache_part(method)
    total = prompt_len + max_tokens
    if isinstance(cache, Window):
        if cache.window >= total:
            return Plan(prompt_len, hooks=prefill_sparse)
        return Plan(prompt_len, window=cache.window, dense_prompt=False)
    if isinstance(cache, (Full, SparsePrefill)):
        return Plan(prompt_len, hooks=prefill_sparse)
    budget = cache.budget_of_layer(0, n_layers, prompt_len)
    kept = budget if budget < prompt_len else None
    if isinstance(cache, Streaming):
        if budget >= total:
            return Plan(prompt_len, hooks=prefill_sparse)
        return Plan(prompt_len, kept, cache.sinks, budget - cache.sinks, hooks=prefill_sparse or kept is not None)
    return Plan(prompt_len, kept, hooks=prefill_sparse or kept is not None)


def check_prompt(method: Method, prompt_len: int, max_tokens: int, n_layers: int, rope) -> None:
    """Raise the method's own one-line AttnkitError when its parameters do not fit a prompt of `prompt_len` tokens
    and `max_tokens` new ones (a budget whose fraction of a short prompt leaves no room for SnapKV's window or
    StreamingLLM's sinks, say): what attnkit's runner asks of every layer before any work
    (:meth:`~attnkit.methods.base.Method.planned_slots`), asked here when vLLM takes the request, so that the
    request fails alone instead of a worker in the middle of a batch. `rope` is the model's
    :class:`~attnkit.rope.Rope` (methods that undo rotations check that the model has one)."""
    planned_slots(Session(method, KVCache(n_layers, 1), n_layers, prompt_len, max_tokens, rope))
