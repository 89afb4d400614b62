"""What the vLLM host does for one request, decided from the recipe alone (no vLLM import here).

A method decides and a host stores (DESIGN.md): this module turns an attnkit method into the few facts the
vLLM adapter needs to store a request in vLLM's paged blocks, on both sides of the engine:

- the scheduler's KV-cache manager frees whole blocks that no later query reads (:meth:`Plan.freeable`);
- the worker's attention computes each request's outputs over the slots it may read (:meth:`Plan.visible`),
  and runs the method's own hooks on the prompt (:mod:`attnkit.vllm.host`).

The layout in paged slots (vLLM writes position ``p`` to slot ``p`` of the request's block table, and we keep
that: no slot mapping is rewritten). A prompt compressed to ``B`` entries per kv head is *compacted into the
slots just before the first generated token*, ``[n - B, n)``, each kv head its own ``B`` entries in position
order; generated tokens then land at their own positions ``n, n + 1, ...``, right after them. So the kept
entries and the generated ones are one contiguous run of slots, and the blocks wholly before slot ``n - B``
go back to vLLM's pool as a sliding window's do (null blocks at the front of the block table). Keys are
stored after RoPE at their original positions, so where an entry sits never changes its rotation.

Methods (each kv head choosing its own entries, uniform budget per kv head and layer):

- prompt scorers (``snapkv``, ``knorm``, ``keydiff``, ``random``, ``lagkv``, ``cur``, ``observed_attention``,
  ``expected_attention``, ``cap``, ``leverage``, ``non_causal_attention``, ``compactor``, ``kvzap`` with a budget,
  whose surrogate reads the layers' inputs: :mod:`attnkit.vllm.inputs`): compacted after the prompt; generated tokens are appended (decode reads ``[n - B, p]``). ChunkKV's ``chunk_length`` runs as is: it changes
  which ``B`` entries each kv head keeps (the method's own ``compact``), not how many.
  So does ``then=SCORER`` (kvpress's ``ComposedPress``): ``B`` is the second scorer's count of what the first kept.
- ``streaming``: sinks plus a window of ``B - sinks`` recent tokens; compacted after the prompt like a scorer
  (sinks first, so the window's entries land on slots equal to their positions), then every step reads the
  sinks and the last ``B - sinks`` positions; blocks between them are freed as the window moves.
- ``window``: each token reads the last ``window`` positions, prefill included; blocks behind it are freed.
- sparse prefill (``a_shape``, ``minference_static``, ``minference``): the prompt's outputs from the method,
  the cache whole (decode is vLLM's own kernel).
- ``PREFILL+CACHE``: a sparse prefill's outputs with one of the cache policies above.
- ``quest``: nothing evicted or moved; vLLM's blocks are Quest's pages (``page_size`` must be the engine's block
  size), their key bounds kept beside the cache, and each decode step reads the blocks it chooses
  (:mod:`attnkit.vllm.pages`); the prompt is vLLM's dense kernel, and the request shares prefixes as a plain one.

Methods that act while decoding (:attr:`Plan.live`): the prompt scorers with ``decode_every=N`` (and ``rkv``,
whose default is 128), and ``h2o``, ``tova``, ``keyformer`` (one entry out per generated token, or with
``decode_every=N`` their buffered form). The worker keeps the request's attnkit session for its whole life and runs
the method's own hooks on every generated token (:mod:`attnkit.vllm.live`); after each step the entries a kv head
holds lie in the run of slots ending just before the next token's slot, whatever the method kept, so the plan
says only how many it holds (:meth:`Plan.held`): after the prompt ``min(n, B)`` (``n`` while Keyformer defers the
prompt's compression to the first generated token), then one more per generated token and back to ``B`` after
every ``N``-th (per-step eviction: ``N = 1``). Everything before the run is freed. The counts are the method's
rule for every layer and kv head alike, which is why per-layer budgets (``layer_budgets``, a list of budgets) and
per-head counts (``head_budgets=adaptive``) stay refused: a KV-cache group's layers share one block table. The
worker checks each layer's count against the plan after every call (a mismatch is an error, never a silent
difference).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from attnkit.cache import KVCache
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.compose import Compose
from attnkit.methods.full import Full
from attnkit.methods.h2o import H2O
from attnkit.methods.keyformer import Keyformer
from attnkit.methods.kvzap import KVzap
from attnkit.methods.minference import SparsePrefill
from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.quest import Quest
from attnkit.methods.snapkv import SnapKV
from attnkit.methods.streaming import Streaming
from attnkit.methods.tova import TOVA
from attnkit.methods.window import Window
from attnkit.methods.wrappers import held_after
from attnkit.recipe.core import Recipe, as_recipe, load_recipe_file
from attnkit.session import Session, layer_contexts, planned_slots
from attnkit.vllm.shards import shard_refusal

SUPPORTED = ("full, window, streaming (positions=original), snapkv, knorm, keydiff, random, lagkv, cur, cap, "
             "observed_attention, expected_attention, finch (positions=original), qfilter, leverage, "
             "non_causal_attention, compactor, kvzap (config=FILE; with enforce_eager=True), rkv (a budget or budget_tokens, one value for every layer and kv head; "
             "decode_every re-compresses while decoding, to B or with decode_fraction to a share of the tokens seen; "
             "segment_length; merge=true without decode_every; then=SCORER, a second scorer on what the first kept), "
             "h2o, tova, keyformer (per step, or buffered with decode_every), quest (page_size = the engine's block "
             "size), a_shape, minference_static, minference, and PREFILL+CACHE of a sparse prefill with one of those "
             "cache methods but quest")
PER_STEP = (H2O, TOVA, Keyformer)  # evict while decoding by their own statistics (one per token, or buffered)
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
    if method.name == "think":  # a wrapper, as kivi: the method zeroes key channels the host keeps in vLLM's blocks
        raise _unsupported(method, source, " (it zeroes key channels of stored keys, which the host does not do)")
    if isinstance(method, Compose):
        if not isinstance(method.prefill_method, (SparsePrefill, Full)):
            raise _unsupported(method.prefill_method, source, " as a prefill part")
        cache = method.cache_method
        if isinstance(cache, Window):  # the window's prefill masks by itself: nothing to compose with
            raise _unsupported(method, source, " (window computes its own prefill)")
    if isinstance(cache, (Full, SparsePrefill, Window)):
        return
    if isinstance(cache, Quest):
        if cache is not method:
            raise _unsupported(method, source, " (quest's decode steps read pages of the whole cache, which a "
                                               "prefill method's plan does not keep)")
        return
    if isinstance(cache, Streaming):
        if cache.positions != "original":
            raise _unsupported(cache, source, " (keys are stored at their original positions; use positions=original)")
    elif not isinstance(cache, (PromptScorer, *PER_STEP)) or type(cache).run_layers is not None:
        raise _unsupported(cache, source, getattr(cache, "vllm_refusal", ""))
    elif getattr(cache, "criticalkv", False):
        raise _unsupported(cache, source, " (criticalkv weighs values by each layer's output projection, which vLLM's "
                                          "attention does not hand over)")
    elif cache.needs_layer_inputs and not isinstance(cache, KVzap):  # fastkvzip
        raise _unsupported(cache, source, " (its gates choose across kv heads, and by default across layers, so they "
                                          "keep different counts, while a request's blocks hold every kv head alike)")
    elif isinstance(cache, KVzap) and cache.threshold is not None:
        raise _unsupported(cache, source, f" (threshold={cache.threshold} keeps a count per kv head that depends on "
                                          f"the scores, which the host cannot plan; use a budget)")
    elif cache.rewrites_stored_keys():
        raise _unsupported(cache, source, " (it rewrites keys it stored, which the host keeps in vLLM's blocks)")
    elif isinstance(cache, PromptScorer):
        if cache.score_threshold is not None:
            raise _unsupported(cache, source, " (score_threshold keeps a count per kv head that depends on the scores, "
                                              "which the host cannot plan)")
        if getattr(cache, "vllm_refusal", ""):  # a scorer whose kept count differs per kv head (lukv)
            raise _unsupported(cache, source, cache.vllm_refusal)
        if cache.head_budgets != "uniform":
            raise _unsupported(cache, source, " (head_budgets=adaptive holds a different count per kv head; a "
                                              "request's blocks hold every kv head alike)")
        if cache.merge and cache.decode_every:  # the live host writes back only the entries that move between slots
            raise _unsupported(cache, source, " (merge=true with decode_every merges values while decoding)")
        if cache.block_size:
            raise _unsupported(cache, source, f" (block_size={cache.block_size} compresses between prompt blocks; the "
                                              f"host holds a prompt whole in its blocks until its last chunk)")
        if isinstance(cache, SnapKV) and cache.decode_budget is not None:
            raise _unsupported(cache, source, " (decode_budget evicts generated tokens only; use decode_every)")
    if cache.layer_budgets != "uniform" or isinstance(cache.budget, (list, tuple)) \
            or isinstance(cache.budget_tokens, (list, tuple)):
        raise _unsupported(cache, source, " (one budget for every layer: a KV-cache group's layers share their "
                                          "blocks)")
    if cache.budget is None and cache.budget_tokens is None:
        raise AttnkitError(f"{source}: {cache.describe()} needs a budget (budget=FRACTION or budget_tokens=N)")


def check_pages(method: Method, block_size: int | None, source: str) -> None:
    """Refuse, in one line, Quest pages other than the engine's blocks (vLLM's blocks are its pages)."""
    cache = cache_part(method)
    if isinstance(cache, Quest) and block_size is not None and cache.page_size != block_size:
        raise AttnkitError(f"{source}: quest:page_size={cache.page_size} must be the engine's block size "
                           f"({block_size}; vLLM's blocks are quest's pages): use quest:page_size={block_size}")


def check_parallel(method: Method, tensor_parallel: int, source: str, kv_heads: int | None = None) -> None:
    """Refuse, in one line, a method that cannot run on a tensor-parallel shard of the model's `kv_heads` kv heads
    (:func:`attnkit.vllm.shards.shard_refusal`)."""
    why = shard_refusal(method, kv_heads, tensor_parallel) if tensor_parallel > 1 else ""
    if why:
        raise _unsupported(method, source, f" with tensor_parallel_size={tensor_parallel}{why}")


def decodes_live(method: Method) -> bool:
    """Whether a (supported) cache method changes the cache while decoding by its own hooks."""
    cache = cache_part(method)
    return isinstance(cache, PER_STEP) or (isinstance(cache, PromptScorer) and cache.decode_every > 0)


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
    budget: int | None = None  # B of a method acting while decoding (live)
    every: int = 0  # generated tokens between its compressions back to B (1: per step); 0: not live
    pages: bool = False  # Quest: every slot kept, each decode step reads the blocks its query chooses
    fraction: float | None = None  # decode_fraction: each compression keeps a share of the tokens seen, not `budget`
    fill: int = 0  # a per-step method filling its budget runs its hooks every `fill`-th token (0: every token)

    @property
    def live(self) -> bool:
        """Whether the method changes the cache while decoding (the worker keeps the request's session)."""
        return self.every > 0

    def compresses_at(self, position: int) -> bool:
        """Whether a live request's decode step at `position` runs the method's hooks (a per-step method's every step
        once it holds its budget, every `fill`-th before; a re-compressing one's every ``N``-th generated token)."""
        every = self.every if self.every > 1 or not self.fill or self.held(position) >= self.budget else self.fill
        return every <= 1 or (position + 1 - self.prompt_len) % every == 0

    def held(self, computed: int) -> int:
        """Entries per kv head a live request holds once `computed` tokens are processed (see the module
        docstring); they occupy slots ``[computed - held, computed)``."""
        n = self.prompt_len
        if computed <= n:
            return self.kept if computed == n and self.kept is not None else computed
        if self.fraction is not None:
            return held_after(n, self.budget, self.every, self.fraction, computed - n)
        k, r = divmod(computed - n, self.every)
        return min(min(n, self.budget) + k * self.every, self.budget) + r

    @property
    def base(self) -> int:
        """First slot the request still holds after its prompt (the compacted entries start there)."""
        return self.prompt_len - self.kept if self.kept is not None else 0

    @property
    def plain(self) -> bool:
        """Nothing differs from full attention: vLLM's own kernel serves the request."""
        return not self.hooks and self.window is None and not self.pages

    @property
    def shares_prefix(self) -> bool:
        """Its blocks hold every entry at its own position (plain, or Quest's pages): it may publish and take a
        cached prefix."""
        return self.plain or self.pages

    def visible(self, position: int) -> list[tuple[int, int]]:
        """Slot ranges ``[start, end)`` a query at `position` reads."""
        end = position + 1
        if position < self.prompt_len and self.dense_prompt:
            return [(0, end)]
        if self.live:
            return [(position - self.held(position), end)]
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
        if self.live:
            return [(0, computed - self.held(computed))] if computed > self.held(computed) else []
        ranges = [(0, self.base)]
        if self.window is not None:
            ranges.append((self.base + self.sinks, computed - self.window + 1))
        return [(a, b) for a, b in ranges if b > a]

    def peak_blocks(self, block_size: int, max_tokens: int, computed: int = 0) -> int | None:
        """The most blocks of `block_size` slots the request holds at once from `computed` tokens on, `max_tokens`
        generated (what the scheduler keeps free for it: :meth:`attnkit.vllm.manager.AttnkitManager.reservation`);
        None where the plan frees nothing, so that vLLM's own admission applies. A step computing position ``c``
        holds the blocks of slots ``[0, c]`` less those wholly inside :meth:`freeable` ``(c)``, the prompt its
        whole blocks until its last chunk."""
        if not (self.live or self.kept is not None or self.window is not None):
            return None
        if computed < self.prompt_len:  # the prompt is held whole until its last chunk
            return max(-(-self.prompt_len // block_size), self.peak_blocks(block_size, max_tokens, self.prompt_len))
        return _block_needs(self, block_size, max_tokens)(computed)

    def blocks_held(self, computed: int, block_size: int) -> int:
        """Blocks a step computing position `computed` (after the prompt) holds."""
        freed = sum(max(0, b // block_size - -(-a // block_size)) for a, b in self.freeable(computed))
        return computed // block_size + 1 - freed


@functools.lru_cache(maxsize=4096)
def _block_needs(plan: Plan, block_size: int, max_tokens: int):
    """For a position from the prompt's end on, the most blocks `plan` holds from there on (see
    :meth:`Plan.peak_blocks`). A live plan that has reached its budget (a window, its width) repeats its count with
    the period of its compressions and the blocks: the positions up to there and a period past decide, and the last
    period and a block before the end, where fewer positions remain; a compressed prompt then holds every generated
    token, so its count only grows."""
    n, bs = plan.prompt_len, block_size
    last = max(n, n + max_tokens - 2)  # the last position a step computes (the newest token is sampled, not stored)
    if not plan.live and plan.window is None:
        most = plan.blocks_held(last, bs)
        return lambda computed: most

    def most_from(first: int, stop: int) -> list[int]:
        held = [plan.blocks_held(c, bs) for c in range(first, stop + 1)]
        for i in range(len(held) - 2, -1, -1):
            held[i] = max(held[i], held[i + 1])
        return held

    period = math.lcm(max(plan.every, 1), bs)
    settled = n + (plan.budget or 0) + (plan.window or 0) + 2 * period + bs
    if plan.fraction is not None:  # a count growing with the tokens seen never settles: every position decides
        settled = last
    head = most_from(n, min(last, settled + period))
    tail_start = max(n, last - period - bs)
    tail = most_from(tail_start, last) if last > settled + period else []

    def lookup(computed: int) -> int:
        if tail and computed >= tail_start:
            return tail[min(computed, last) - tail_start]
        return head[min(computed, settled, last) - n]
    return lookup


_PLANS: dict = {}


def plan_for(method: Method, prompt_len: int, max_tokens: int, n_layers: int) -> Plan:
    """The :class:`Plan` of a request (a supported method: :func:`check_supported`), remembered: both sides ask it
    for every request at every step."""
    key = (method, prompt_len, max_tokens, n_layers)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # a method with a list among its parameters: not hashable, planned each time
        return make_plan(method, prompt_len, max_tokens, n_layers)
    if plan is None:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        plan = _PLANS[key] = make_plan(method, prompt_len, max_tokens, n_layers)
    return plan


def make_plan(method: Method, prompt_len: int, max_tokens: int, n_layers: int) -> Plan:
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
    if isinstance(cache, Quest):  # a step over every page is full attention's: plain when the budget covers all
        return Plan(prompt_len, pages=cache.pages_read(total) < -(-total // cache.page_size))
    budget = cache.budget_of_layer(0, n_layers, prompt_len)
    kept = budget if budget < prompt_len else None
    if isinstance(cache, Streaming):
        if budget >= total:
            return Plan(prompt_len, hooks=prefill_sparse)
        return Plan(prompt_len, kept, cache.sinks, budget - cache.sinks, hooks=prefill_sparse or kept is not None)
    if decodes_live(cache):
        return live_plan(cache, prompt_len, max_tokens, n_layers, prefill_sparse)
    return Plan(prompt_len, kept, hooks=prefill_sparse or kept is not None)


def live_plan(cache: Method, prompt_len: int, max_tokens: int, n_layers: int, prefill_sparse: bool) -> Plan:
    """The plan of a method acting while decoding, from the method's own answers for its first layer (every layer
    alike: one budget for all): whether it ever evicts in this request, its ``B``, and whether the prompt is
    compressed after prefill or at the first generated token."""
    ctx = layer_contexts(Session(cache, KVCache(n_layers, 1), n_layers, prompt_len, max_tokens))[0]
    # B resolved without the method's checks of its other parameters (they ran when the request was taken:
    # check_prompt), which may need what a scheduler does not have (the model's rotary frequencies)
    ctx.state.budget = cache.budget_of_layer(0, n_layers, prompt_len)
    if not cache.evicts(ctx):
        return Plan(prompt_len, hooks=prefill_sparse)
    budget, keep = cache.layer_budget(ctx), cache.prefill_keep(ctx)
    kept = keep if keep < prompt_len and not cache.defer_prefill_eviction(ctx) else None
    every = getattr(cache, "decode_every", 0) or 1  # a per-step method's filling steps (attnkit.methods.buffered)
    fill = (getattr(cache, "decode_queries_kept", lambda: None)() or 0) if not getattr(cache, "decode_every", 0) else 0
    return Plan(prompt_len, kept, hooks=True, budget=budget, every=every,
                fraction=getattr(cache, "decode_fraction", None), fill=fill)


def check_prompt(method: Method, prompt_len: int, max_tokens: int, n_layers: int, rope) -> None:
    """Raise the method's own one-line AttnkitError when its parameters do not fit a prompt of `prompt_len` tokens
    and `max_tokens` new ones (a budget whose fraction of a short prompt leaves no room for SnapKV's window, say):
    what attnkit's runner asks of every layer before any work (:meth:`~attnkit.methods.base.Method.planned_slots`),
    asked when vLLM takes the request, so that it fails alone, not a worker in the middle of a batch. `rope`: the
    model's :class:`~attnkit.rope.Rope` (methods that undo rotations check that the model has one)."""
    planned_slots(Session(method, KVCache(n_layers, 1), n_layers, prompt_len, max_tokens, rope))
