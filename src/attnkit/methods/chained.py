"""``then=SPEC``: a second prompt scorer that compresses what the first one kept (kvpress's ``ComposedPress``).

kvpress's ``ComposedPress([P1, P2, ...])`` runs its presses one after the other on a layer's prompt cache, each on
the entries the previous one kept, its ``compression_ratio`` applying to what it receives (the final kept fraction
is the product of the kept fractions). attnkit writes the two-scorer case as a parameter of the first scorer::

    snapkv:budget=0.5,then=knorm:budget=0.5        # SnapKV keeps 50 % of the prompt, KNorm 50 % of those
    {"method": "snapkv", "params": {"budget": 0.5, "then": {"method": "knorm", "params": {"budget": 0.5}}}}

The first scorer decides its ``B1`` entries per kv head exactly as alone (its own statistics, protected entries
and rank); the second ranks the ``B1`` held entries by its own rule and keeps ``B2`` of them. ``B1`` is the first
scorer's budget of the prompt (``min(B1, n)`` are held); the second's ``budget`` is a fraction of those
(``budget_tokens``: a count, at most ``B1``). The layer's budget ``B`` -- what the capacity, the runner's memory
check, ``AttnkitCache`` and the vLLM plan see -- is ``B2``; generated tokens are appended after it.

Which scorers can come second: those whose rank is a function of the held entries alone (keys, values,
positions: ``knorm``, ``keydiff``, ``random``, ``lagkv``, ``cur``, ``leverage``), since a statistic gathered
while the prompt was attended (SnapKV's window queries, Expected Attention's moments) would belong to the whole
prompt, not to the entries it receives (kvpress's own warning about such compositions). The second scorer's
state is a fresh one at the compression: it keeps nothing between calls. Whatever needs a count per kv head or a
re-compression while decoding (``decode_every``, ``head_budgets=adaptive``, ``chunk_length``, ``merge``,
``criticalkv``, ``segment_length``, ``block_size``, ``decode_fraction``, ``score_threshold``), and
``positions=reindexed``, are refused on either scorer with it.

kvpress rounds a kept count down (``int(n (1 - r))``), attnkit to the nearest (``floor(f n + 0.5)``); with
``budget_tokens`` on both sides the counts are the ones given. Unlike ``ComposedPress`` the kept entries stay in
position order after each stage (kvpress's ``topk`` leaves them in score order); for a second scorer whose rank
does not depend on the order (KNorm, KeyDiff's mean key) the kept positions are the same.
"""

from __future__ import annotations

import functools
import inspect

from attnkit.errors import AttnkitError
from attnkit.methods.eviction import EvictionMethod, EvictionState
from attnkit.methods.scoring import keep_top
from attnkit.methods.spec import METHODS, method_from_dict, parse_method_spec
from attnkit.session import LayerContext

# the hooks through which a scorer gathers statistics of its own while the prompt is attended or decoded
OBSERVING = ("prefill_attention", "observe_prefill", "prefill_scorer", "add_prefill_scores", "after_prefill",
             "compact", "decode_attention", "attend_decode", "before_write", "after_write", "after_decode",
             "evicts", "layer_capacity", "defer_prefill_eviction")
# PromptScorer parameters that make a kept count per kv head or a compression while decoding
OFF = {"decode_every": 0, "head_budgets": "uniform", "chunk_length": 0, "merge": False, "criticalkv": False,
       "segment_length": 0, "block_size": 0, "decode_fraction": None, "score_threshold": None,
       "positions": "original"}


def as_stage(value, outer, base: type) -> EvictionMethod:
    """The second scorer of `outer` from ``then=`` (a spec string, a recipe dict or a method), validated; `base` is
    the prompt scorers' base class (:class:`~attnkit.methods.prompt_scorer.PromptScorer`)."""
    if isinstance(value, str):
        stage = parse_method_spec(value)
    elif isinstance(value, dict):
        stage = method_from_dict(value, f"{outer.name} then")
    elif isinstance(value, base):
        stage = value
    else:
        raise AttnkitError(f"{outer.name}: then must be a prompt scorer spec ('knorm:budget=0.5'), a recipe dict or "
                           f"a method, got {type(value).__name__}")
    if not isinstance(stage, base):
        raise AttnkitError(f"{outer.name}: then={stage.name!r} is not a prompt scorer; then takes one whose rank "
                           f"reads the held entries alone: {', '.join(held_rankers(base))}")
    if stage.then is not None:
        raise AttnkitError(f"{outer.name}: then={stage.name!r} has a then of its own; chain two scorers only")
    if not ranks_held_entries(type(stage), base):
        raise AttnkitError(f"{outer.name}: then={stage.name!r} ranks by statistics it gathers while the prompt is "
                           f"attended, not by the entries it would receive; then takes {', '.join(held_rankers(base))}")
    if stage.budget is None and stage.budget_tokens is None:
        raise AttnkitError(f"{outer.name}: then={stage.name!r} needs a budget (budget=FRACTION of what "
                           f"{outer.name} keeps, or budget_tokens=N)")
    for method, role in ((stage, f"then={stage.name!r}"), (outer, f"{outer.name} with then")):
        for key, off in OFF.items():
            if getattr(method, key, off) != off:
                raise AttnkitError(f"{outer.name}: {role} compresses the prompt once per kv head at one count; "
                                   f"{key}={getattr(method, key)} is not supported with it")
    if getattr(outer, "decode_budget", None) is not None:
        raise AttnkitError(f"{outer.name}: decode_budget={outer.decode_budget} is not supported with then")
    if not reaches_compact(type(outer), base):
        raise AttnkitError(f"{outer.name}: its prompt compression does not go through the shared compaction, so "
                           f"then={stage.name!r} cannot follow it")
    return stage


@functools.cache
def ranks_held_entries(cls: type, base: type) -> bool:
    """Whether a prompt scorer's rank is a function of the held entries alone: its per-layer state is the shared
    one and it overrides none of the hooks of `base` (the prompt scorers' class) through which statistics are
    gathered."""
    return (cls.layer_state_type is EvictionState and cls.run_layers is None
            and all(getattr(cls, h) is getattr(base, h) for h in OBSERVING)
            and cls.needs_layer_inputs is base.needs_layer_inputs)


def held_rankers(base: type) -> list[str]:
    """The registered scorers (subclasses of `base`) that can come second."""
    return sorted(n for n, c in METHODS.items() if issubclass(c, base) and ranks_held_entries(c, base))


@functools.cache
def reaches_compact(cls: type, base: type) -> bool:
    """Whether the prompt's compression of `cls` goes through ``compact`` of `base` (:class:`PromptScorer`, where the
    second stage runs): no model-level hook, and every override of ``after_prefill``/``compact`` on the way calls the
    next one."""
    if cls.run_layers is not None:
        return False
    for klass in cls.__mro__:
        if klass is base:
            return True
        for hook in ("after_prefill", "compact"):
            if hook in vars(klass) and f"super().{hook}(" not in inspect.getsource(vars(klass)[hook]):
                return False
    return True


def first_budget(outer, layer: int, n_layers: int, prompt_len: int) -> int:
    """``B1``: the first scorer's budget of the prompt (its own rule, PyramidKV's per-layer share included)."""
    return EvictionMethod.budget_of_layer(outer, layer, n_layers, prompt_len)


def final_budget(outer, stage, layer: int, n_layers: int, prompt_len: int) -> int:
    """``B2``: what the second scorer keeps of the ``min(B1, n)`` entries the first one holds."""
    received = min(first_budget(outer, layer, n_layers, prompt_len), prompt_len)
    return min(received, stage.budget_of_layer(layer, n_layers, received))


def stage_context(ctx: LayerContext, budget: int) -> LayerContext:
    """The second scorer's view of the layer: the same entries, a fresh state of its own with its budget."""
    state = EvictionState(budget=budget, evicts=True, evicting=True)
    return ctx.scoped(lambda s: state, lambda r: r)


def check_stage(stage, ctx: LayerContext, budget: int) -> None:
    stage.check_layer(stage_context(ctx, budget), budget)


def second_stage(stage, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
    """Keep `count` of the held entries per kv head by the second scorer's rank (its protected ones first)."""
    view = stage_context(ctx, count)
    keep = keep_top(stage.rank(view), stage.protect(view, next_pos), count)
    ctx.kv.keep_merged(keep, spare, None)


def stage_spec(value, stage) -> str | dict:
    """What ``params()`` reports for ``then``: the spec string as given, else a recipe dict (JSON-safe)."""
    if isinstance(value, (str, dict)):
        return value
    return {"method": stage.name, "params": stage.params()}
