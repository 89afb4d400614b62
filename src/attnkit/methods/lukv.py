"""``lukv``: Expected Attention's scores kept to a budget per layer and kv head read from an offline profile (Tang,
Jiao, Chen, Liu, Li, Chen, 2026, "Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV
Cache Eviction", arXiv 2602.08585; kvpress's ``LUKVPress`` around ``ExpectedAttentionPress(epsilon=2e-2)``).

**Why.** A score-based eviction keeps each head's best entries by the score, but heads differ in how well their
score predicts what later queries will read: some need many entries to hold what the answer uses, others few. LU-KV
allocates the budget across all layers and kv heads to maximise the long-horizon utility of the kept entries (the
attention the answer's tokens give them, weighted by their values' output norms), a combinatorial problem it relaxes
by a convex hull of each head's cumulative utility and solves greedily by marginal utility. The allocation depends on
the model and the scorer but barely on the prompt, so it is profiled offline once (``attnkit calibrate lukv``,
:mod:`attnkit.calibrate.lukv`) into a *budget curve*: for each global compression ratio ``r = 1%..99%``, the share
``p[r, l, h]`` of each layer's and kv head's entries to prune.

**Which entries stay.** After the prompt (``n`` tokens) each layer scores its entries as ``expected_attention`` does
(:mod:`attnkit.methods.expected_attention`, its parameters; ``epsilon`` defaults to kvpress's 0.02 here), protects its
first ``sink`` and last ``window`` positions, and keeps per kv head ``h`` a count from the curve's row for the
requested compression ``r = 1 - B / n`` (``B`` from ``budget`` or ``budget_tokens``; the row ``round(100 r) - 1``,
clamped to 1..99 %), as kvpress rounds it: the ideal counts ``(1 - p[r, l, h]) n`` (float32) are floored, the layer's
total ``round(sum)`` restored by one more entry to the heads of largest fractional part, each count clamped to
``1..n``. Each head keeps its protected entries, then its best by score (ties: the lower position), so heads and
layers hold different counts (the layer is stored flat: :meth:`attnkit.cache.LayerKV.keep_flat`); the total over the
layers is about ``(1 - r) x`` the prompt's entries. Generated tokens are appended (kvpress's press compresses the
prompt only; ``decode_every`` is refused).

**Curves.** ``curve`` is kvpress's and the authors' ``.npy`` (``[99, layers, kv heads]``, ``allow_pickle=False``; the
published one is for Llama-3.1-8B with ``ExpectedAttentionPress(epsilon=2e-2)``, ``sink=4``, ``window=1``) or
attnkit's safetensors (``attnkit calibrate lukv``: the same array as ``curve``, and metadata recording the model,
the scorer and the profiling settings). A curve of another geometry is refused in one line.

At a budget that holds everything nothing is scored into a decision and the tokens are ``full``'s. The counts per
kv head differ, which vLLM's blocks (every kv head alike) cannot hold: refused there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attnkit.errors import AttnkitError
from attnkit.methods.expected_attention import ExpectedAttention
from attnkit.methods.prompt_scorer import COUNTS_FIXED
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import whole

FORMAT = "attnkit-lukv-1"
LEVELS = 99  # the curve's rows: global compression ratios 1 % .. 99 %
HINT = "profile one for it with `attnkit calibrate lukv --model M --out FILE`"


@dataclass(frozen=True)
class BudgetCurve:
    """A profile ``[99, layers, kv heads]`` of prune ratios (float32), its metadata and source."""

    curve: torch.Tensor
    meta: dict
    source: str

    def check_model(self, n_layers: int, kv_heads: int) -> None:
        if tuple(self.curve.shape[1:]) != (n_layers, kv_heads):
            raise AttnkitError(f"{self.source} is a curve for {self.curve.shape[1]} layers x {self.curve.shape[2]} kv "
                               f"heads ({self.meta.get('model', 'its model')!r}) but the model has {n_layers} x "
                               f"{kv_heads}; {HINT}")


def load_curve(path) -> BudgetCurve:
    """A budget curve from kvpress's ``.npy`` or attnkit's safetensors file, refused in one line otherwise."""
    source = f"lukv curve {str(path)!r}"
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        raise AttnkitError(f"{source} does not exist; {HINT} (or give kvpress's [99, layers, kv heads] .npy)")
    meta = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            if header.get("format") != FORMAT or "curve" not in f.keys():
                raise AttnkitError(f"{source} is not a lukv curve (format {header.get('format')!r}, expected "
                                   f"{FORMAT!r}); {HINT}")
            array = f.get_tensor("curve").numpy()
            meta = json.loads(header.get("attnkit", "{}"))
    except AttnkitError:
        raise
    except Exception:  # not safetensors: kvpress's .npy
        try:
            array = np.load(str(path), allow_pickle=False)
        except Exception as exc:
            raise AttnkitError(f"{source} is neither attnkit's safetensors curve nor a numpy .npy array "
                               f"({type(exc).__name__}); {HINT}") from None
    if array.ndim != 3 or array.shape[0] != LEVELS or not np.issubdtype(array.dtype, np.floating):
        raise AttnkitError(f"{source}: a budget curve is a float array [{LEVELS}, layers, kv heads], got "
                           f"{array.dtype} {list(array.shape)}")
    if not np.isfinite(array).all():
        raise AttnkitError(f"{source}: the curve holds non-finite values")
    return BudgetCurve(torch.as_tensor(np.ascontiguousarray(array)).float(), meta, source)


def save_curve(path, curve: np.ndarray, meta: dict) -> Path:
    """Write a curve ``[99, layers, kv heads]`` in attnkit's safetensors format; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"curve": torch.as_tensor(np.asarray(curve, dtype=np.float32)).contiguous()}, str(path),
              metadata={"format": FORMAT, "attnkit": json.dumps(meta)})
    return path


def curve_row(ratio: float) -> int:
    """The curve's row for a global compression ratio (kvpress's: ``round(100 r) - 1`` within 0..98)."""
    return max(0, min(LEVELS - 1, int(round(ratio * 100)) - 1))


def head_counts(prune: torch.Tensor, length: int) -> torch.Tensor:
    """Entries each kv head keeps of `length`, from its prune ratios ``[kv]`` (float32), rounded as kvpress does."""
    heads = prune.shape[0]
    ideal = (1.0 - prune.float()).clamp(0.0, 1.0) * length
    total = min(heads * length, max(heads, int(torch.round(ideal.sum()))))
    counts = torch.floor(ideal).long()
    rest = total - int(counts.sum())
    if rest > 0:
        counts[torch.topk(ideal - counts, k=min(rest, heads)).indices] += 1
    return counts.clamp(1, length)


@register
@dataclass(frozen=True)
class LUKV(ExpectedAttention):
    """Expected Attention's scores, each layer's and kv head's kept count read from an offline LU-KV budget curve;
    sinks and a recent window protected."""

    epsilon: float = 0.02
    curve: str | None = None
    sink: int = 4
    window: int = 1

    name = "lukv"
    summary = "budgets per layer and kv head from an offline utility profile, around Expected Attention (LU-KV, 2026)"
    kvpress = "LUKVPress"
    threshold_refusal = reindex_refusal = "its budget curve gives each kv head its own count"  # score_threshold, positions=reindexed

    def __post_init__(self):
        if not isinstance(self.curve, str) or not self.curve:
            raise AttnkitError(f"lukv needs curve=FILE, a budget curve for the model (`attnkit calibrate lukv --model "
                               f"M --out FILE`, or kvpress's .npy); got curve={self.curve!r}")
        super().__post_init__()
        whole("sink", self.sink, 0, what=" (first positions never evicted)")
        whole("window", self.window, 0, what=" (last prompt positions never evicted)")
        if isinstance(self.budget, (list, tuple)) or isinstance(self.budget_tokens, (list, tuple)) \
                or self.layer_budgets != "uniform":
            raise AttnkitError("lukv takes one budget (the global compression ratio 1 - B/n picks the curve's row); "
                               "the curve sets each layer's and kv head's share")
        self.refuse_options(COUNTS_FIXED, "the curve sets every layer's and kv head's count once, after the prompt")
        object.__setattr__(self, "_curve", load_curve(self.curve))

    vllm_refusal = " (its kept count differs per kv head, which vLLM's blocks hold alike)"

    def decode_only_appends(self) -> bool:
        return False  # a flat layer takes one token per step

    # ---- sizes ---------------------------------------------------------------------------------------
    def counts(self, ctx: LayerContext) -> torch.Tensor:
        """Entries each kv head of this layer keeps of the prompt (see the module docstring)."""
        s = ctx.session
        ratio = 1.0 - self.layer_budget(ctx) / s.prompt_len
        return head_counts(self._curve.curve[curve_row(ratio), ctx.index], s.prompt_len)

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        super().check_layer(ctx, budget)
        s = ctx.session
        self._curve.check_model(s.n_layers, self._curve.curve.shape[2] if ctx.kv is None else ctx.kv.keys.shape[1])

    def planned_slots(self, ctx: LayerContext) -> int:
        s = ctx.session
        if not self.evicts(ctx):
            return super().planned_slots(ctx)
        counts = self.counts(ctx)
        return -(-int(counts.sum()) // counts.shape[0]) + s.max_new_tokens  # per kv head, on average (flat layer)

    # ---- eviction ------------------------------------------------------------------------------------
    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        positions = ctx.kv.view()[2]
        return (positions < self.sink) | (positions >= ctx.session.prompt_len - self.window)

    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        kv = ctx.kv
        self._curve.check_model(ctx.session.n_layers, kv.keys.shape[1])
        ctx.state.next_pos = int(next_pos)
        rank = self.rank(ctx).float().masked_fill(self.protect(ctx, next_pos), float("inf"))
        ctx.state.next_pos = None
        b, heads, length = rank.shape
        counts = self.counts(ctx).to(rank.device)
        order = torch.sort(rank, dim=-1, descending=True, stable=True).indices  # ties: the lower slot first
        keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(
            -1, order, torch.arange(length, device=rank.device).expand_as(order) < counts.view(1, heads, 1))
        head, slot = keep.nonzero(as_tuple=True)[1:]  # ordered by row, head, slot; every row keeps the same count
        kv.keep_flat(head.view(b, -1), slot.view(b, -1), spare=spare)
        self._mark_evicting(ctx)
