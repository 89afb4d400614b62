"""The cache budget and recent-window parameters of the eviction methods, and their resolution per layer.

``budget`` (a fraction of the prompt, ``0 < f <= 1``) or ``budget_tokens`` (a count), optionally one per
layer (a list; ``"512/256"`` on the command line), resolves to ``B`` slots per layer and kv head. ``B`` is
the most entries a layer ever holds while decoding, the incoming token included: a decode query attends to
at most ``B`` keys and the cache allocates exactly ``B`` slots, so ``B`` x bytes-per-token is the real
memory. H2O (Zhang et al., 2023, arXiv 2306.14048) and Keyformer (Adnan et al., MLSys 2024, arXiv
2403.09054) count their cache ``k`` before the incoming token is appended, so their ``k`` is ``B - 1``;
StreamingLLM's cache size (Xiao et al., 2023, arXiv 2309.17453) is ``B``. SnapKV (Li et al., 2024, arXiv
2404.14469) compresses only the prompt: ``B`` is the prompt's share and generated tokens come on top.

``recent`` (a fraction of ``B``) or ``recent_tokens`` (a count) is the recent window H2O and Keyformer never
evict; it must leave at least one slot, the incoming token's.

``layer_budgets="pyramid"`` spreads the same total over the layers as PyramidKV does (Cai et al., 2024,
"PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", arXiv 2406.02069,
section 3.3): lower layers, whose attention is spread wide, get more, upper layers, whose attention has
funnelled onto a few tokens, get less, in an arithmetic sequence from ``2 B' - B'/beta`` at the first layer
to ``B'/beta`` at the last (``beta`` = 20, the paper's default), ``B'`` being the budget above what the method
always keeps (SnapKV's observation window, StreamingLLM's sinks), so the mean over layers stays ``B``.
"""

from __future__ import annotations

import math

from attnkit.errors import AttnkitError
from attnkit.validate import choice, fraction, is_number, one_of_two, per_layer, whole

LAYER_BUDGETS = ("uniform", "pyramid")
PYRAMID_BETA = 20


def pyramid_share(budget: int, floor: int, layer: int, n_layers: int, beta: int = PYRAMID_BETA) -> int:
    """PyramidKV's slots for `layer` of `n_layers` when every layer's uniform share is `budget` slots, of which
    `floor` are always kept (see the module docstring): ``floor`` plus the layer's term of the arithmetic
    sequence from ``2 f - f / beta`` down to ``f / beta``, ``f = budget - floor`` (rounded, at least 1)."""
    free = budget - floor
    if n_layers == 1 or free <= 0:
        return budget
    low = free / beta
    high = 2 * free - low
    return floor + max(1, int(math.floor(high - layer * (high - low) / (n_layers - 1) + 0.5)))


def smallest_tokens(budget_tokens) -> int | None:
    """The smallest per-layer token budget (None when the budget is a fraction of the prompt)."""
    if isinstance(budget_tokens, (list, tuple)):
        return min(budget_tokens)
    return budget_tokens


def _prompt_fraction(name: str, value) -> float:
    if not is_number(value) or not 0 < value <= 1:
        raise AttnkitError(f"{name} must be a fraction of the prompt with 0 < {name} <= 1, got {value!r} "
                           f"(use budget_tokens for a token count)")
    return value


def _token_count(name: str, value) -> int:
    return whole(name, value, 1, what=" (tokens per layer)")


def check_budget(method: str, budget, budget_tokens, layer_budgets: str = "uniform") -> None:
    """Validate ``budget`` (fraction(s) of the prompt) / ``budget_tokens`` (count(s)): exactly one given;
    ``layer_budgets`` (uniform or pyramid) spreads a single value over the layers."""
    one_of_two("budget", budget, "budget_tokens", budget_tokens,
               required=f"{method} needs a cache budget: budget=<fraction of the prompt, 0 < f <= 1> or "
                        f"budget_tokens=<tokens per layer>")
    if budget is not None:
        per_layer("budget", budget, _prompt_fraction)
    if budget_tokens is not None:
        per_layer("budget_tokens", budget_tokens, _token_count)
    choice("layer_budgets", layer_budgets, LAYER_BUDGETS)
    given = budget if budget is not None else budget_tokens
    if layer_budgets != "uniform" and isinstance(given, (list, tuple)):
        raise AttnkitError(f"layer_budgets={layer_budgets} spreads one budget over the layers; give a single "
                           f"value, not one per layer ({given!r})")


def check_recent(recent, recent_tokens, budget_tokens) -> None:
    """``recent`` is a fraction of the budget, ``recent_tokens`` a count; at most one, and smaller than the budget."""
    one_of_two("recent", recent, "recent_tokens", recent_tokens)
    if recent is not None:
        fraction("recent", recent, allow_zero=True,
                 what=" (the recent window as a fraction of the budget; a recent window larger than the budget "
                      "is impossible)")
    if recent_tokens is not None:
        whole("recent_tokens", recent_tokens, 0)
        smallest = smallest_tokens(budget_tokens)
        if smallest is not None and recent_tokens >= smallest:
            raise AttnkitError(f"recent window larger than the budget: recent_tokens={recent_tokens} must be smaller "
                               f"than budget_tokens={budget_tokens!r} (one slot is the incoming token's)")


def resolve_budget(budget, budget_tokens, layer: int, n_layers: int, prompt_len: int) -> int:
    """Slots per kv head for `layer`: a fraction of the prompt (rounded, at least 1) or a count."""
    spec = budget if budget is not None else budget_tokens
    if isinstance(spec, (list, tuple)):
        if len(spec) != n_layers:
            which = "budget" if budget is not None else "budget_tokens"
            raise AttnkitError(f"{which} lists {len(spec)} values but the model has {n_layers} layers; "
                               f"give one per layer or a single value")
        spec = spec[layer]
    if budget is not None:
        return max(1, int(math.floor(spec * prompt_len + 0.5)))
    return int(spec)


def recent_window(recent, recent_tokens, default: float, budget: int, layer: int) -> int:
    """Tokens of the recent window (never evicted), at most ``budget - 1``."""
    if recent_tokens is not None:
        if recent_tokens >= budget:
            raise AttnkitError(f"recent window larger than the budget: recent_tokens={recent_tokens} but layer "
                               f"{layer} holds {budget} slots (the window must leave room for the incoming token)")
        return recent_tokens
    frac = default if recent is None else recent
    return min(int(math.floor(frac * budget)), budget - 1)
