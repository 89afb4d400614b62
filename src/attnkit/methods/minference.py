"""``minference`` / ``minference_static``: dynamic sparse prefill with a pattern per head (MInference 1.0:
Accelerating Pre-filling for Long-Context LLMs via Dynamic Sparse Attention, Jiang et al. 2024, arXiv
2407.02490).

Every query head has one of three patterns (section 3.2): ``a_shape``, ``vertical_slash`` (Alg. 2) or
``block_sparse`` (Alg. 3). At each prompt the dynamic heads estimate their indices from the prompt
itself (the last 64 queries for vertical-slash, mean-pooled blocks for block-sparse) and the layer's
attention runs as one sparse kernel (:mod:`attnkit.sparse`). Only the *prefill outputs* are
sparse: the KV cache keeps every prompt token and decoding attends densely to all of it (the paper's
setting: "all baselines perform sparse computation only during pre-filling").

Where the patterns come from:

- ``config=FILE``: the per-layer, per-head patterns found offline by the kernel-aware search (Alg. 1;
  ``attnkit calibrate patterns``, :mod:`attnkit.calibrate.patterns`). A file whose layer or head
  counts differ from the model's is refused.
- no config: a uniform config, every head ``vertical_slash`` with ``k_v=500, k_s=1500`` (a setting of
  the paper's Table 7 search space; the paper finds vertical-slash best for most heads, Fig. 11).
  ``pattern=block_sparse`` (with ``k_b``, default 100) or other ``k_v``/``k_s`` give the single-pattern
  ablations of Table 4 ("Ours w/ only block-sparse", "w/ only vertical-slash").

``minference_static`` is the "Ours w/ static" ablation (Table 2/4): the vertical-slash and
block-sparse heads use indices estimated ONCE, on the first calibration prompt, and stored in the config
(``attnkit calibrate patterns --static``): the same columns, diagonals and blocks for every prompt. A
prompt longer than the calibration prompt reuses the last stored block row for its extra rows.

A head whose layout computes more than ``dense_above`` of its causal pairs (default 0.5) runs dense attention
instead: with FlexAttention that is faster (:data:`DENSE_ABOVE`), and dense attention computes every pair the
pattern keeps and more, so the output only moves towards ``full``. Where the CPU's C++ sparse kernel runs, it
computes those heads' dense causal attention too, in the same call (it spends less per pair than SDPA's kernel,
which a layer of only dense heads would otherwise run). ``dense_above=1`` keeps every head on its pattern (for
studying a pattern's own accuracy).

The output equals ``full`` exactly whenever a layer's pattern keeps every causal pair (e.g. any prompt
no longer than ``k_s``): that layer then runs the very same dense path. Layers of a model's own sliding
window, caches whose keys are not the contiguous prompt, and multi-token steps after the prompt (e.g. a
speculative verification) also run dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnkit.attention import attend
from attnkit.config_file import read_config_file
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.sparse.kernels import native_pays, sparse_attention
from attnkit.sparse.layout import layout_for_patterns
from attnkit.sparse.patterns import DEFAULT_BLOCK, DEFAULT_LAST_Q, PATTERN_PARAMS, HeadPattern, check_block
from attnkit.sparse.profile import record_call, timed
from attnkit.validate import fraction, whole

CONFIG_FORMAT = "attnkit.minference-patterns/1"
# A head whose layout computes more than this fraction of its causal pairs runs dense attention instead: the
# CPU FlexAttention kernel spends more per pair than SDPA's fused kernel, and this is about where the two cost
# the same (docs/benchmarks.md, "`minference` with its default parameters"); dense attention computes a superset
# of the pattern's pairs, so the output only moves towards full's. The same value on every device, so a recipe
# gives the same outputs everywhere.
DENSE_ABOVE = 0.5
DEFAULT_UNIFORM = {"vertical_slash": HeadPattern("vertical_slash", k_v=500, k_s=1500),
                   "block_sparse": HeadPattern("block_sparse", k_b=100)}


# ---- the config file ---------------------------------------------------------------------------------
@dataclass
class PatternConfig:
    """Per-layer, per-head patterns plus the metadata the search wrote (model, length, FLOPs budget...)."""

    layers: list[list[HeadPattern]]
    block_size: int = DEFAULT_BLOCK
    last_q: int = DEFAULT_LAST_Q
    meta: dict = field(default_factory=dict)
    source: str = "pattern config"

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_heads(self) -> int:
        return len(self.layers[0]) if self.layers else 0

    def check_model(self, n_layers: int, n_heads: int) -> None:
        """Refuse a config made for another geometry, with a clear error."""
        if self.n_layers != n_layers or any(len(layer) != n_heads for layer in self.layers):
            counts = sorted({len(layer) for layer in self.layers})
            heads = "/".join(map(str, counts))
            raise AttnkitError(
                f"{self.source} describes {self.n_layers} layers x {heads} heads, but the model has {n_layers} "
                f"layers x {n_heads} query heads; calibrate a config for this model "
                f"(attnkit calibrate patterns --model ...)")


def pattern_config_from_dict(data, source: str = "pattern config") -> PatternConfig:
    if not isinstance(data, dict):
        raise AttnkitError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != CONFIG_FORMAT:
        raise AttnkitError(f"{source}: not a MInference pattern config (format {data.get('format')!r}, "
                           f"expected {CONFIG_FORMAT!r}); write one with `attnkit calibrate patterns`")
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers or not all(isinstance(x, list) and x for x in layers):
        raise AttnkitError(f"{source}: 'layers' must be a non-empty list of non-empty lists of head patterns")
    try:
        block = check_block(data.get("block_size", DEFAULT_BLOCK))
    except AttnkitError as exc:
        raise AttnkitError(f"{source}: {exc}") from None
    last_q = whole(f"{source}: last_q", data.get("last_q", DEFAULT_LAST_Q), 1)
    parsed = [[HeadPattern.from_dict(p, f"{source}, layer {i}, head {h}") for h, p in enumerate(layer)]
              for i, layer in enumerate(layers)]
    for key in ("n_layers", "n_heads"):
        if key in data and data[key] != (len(parsed) if key == "n_layers" else len(parsed[0])):
            raise AttnkitError(f"{source}: {key}={data[key]} does not match its 'layers' list")
    meta = {k: v for k, v in data.items() if k not in ("format", "layers", "block_size", "last_q", "n_layers",
                                                       "n_heads")}
    return PatternConfig(parsed, block, last_q, meta, source)


def load_pattern_config(path: str | Path) -> PatternConfig:
    """Read a pattern config written by ``attnkit calibrate patterns`` (clear errors for bad files)."""
    data = read_config_file(path, "pattern config", " (write one with `attnkit calibrate patterns`)")
    return pattern_config_from_dict(data, f"pattern config {str(path)!r}")


# ---- the methods ------------------------------------------------------------------------------------------
class SparsePrefill(Method):
    """Shared machinery: the cache keeps every token (base behaviour), decoding is dense, and the prompt's
    attention outputs come from :meth:`layer_patterns` through :func:`attnkit.sparse.kernels.sparse_attention`.
    Subclasses give the patterns, ``block`` and ``last_q``."""

    compile: bool = True
    batches = False  # the sparse index is built from one sequence's own attention: one session per sequence

    # density above which a head's prompt attention runs dense (1: only when its pattern keeps every pair);
    # the methods declare it as a parameter
    dense_above: float = DENSE_ABOVE

    def layer_patterns(self, ctx: LayerContext, n_heads: int) -> list[HeadPattern]:
        raise NotImplementedError

    def block(self) -> int:
        return DEFAULT_BLOCK

    def estimate_rows(self) -> int:
        return DEFAULT_LAST_Q

    def column_width(self, patterns: list[HeadPattern], n: int) -> int:
        """Width of the gathered vertical columns: fixed per method and length, so that every layer (and
        every prompt of this padded length) reuses one compiled kernel."""
        return 0

    def prefill_output(self, ctx: LayerContext, q, keys, values, positions) -> torch.Tensor:
        if not self._sparse_applies(ctx, q, keys, positions):
            record_call(None)
            return super().prefill_output(ctx, q, keys, values, positions)
        patterns = self.layer_patterns(ctx, q.shape[1])
        n = keys.shape[2]
        with timed("index"):
            layout = layout_for_patterns(patterns, q, keys, ctx.scaling, block=self.block(),
                                         last_q=self.estimate_rows(), width=self.column_width(patterns, n) or None)
        if layout.dense:  # every causal pair kept: exactly what `full` computes
            record_call(layout)
            return super().prefill_output(ctx, q, keys, values, positions)
        limit = self.dense_above
        dense = layout.density > limit if limit < 1 else torch.zeros(q.shape[1], dtype=torch.bool, device=q.device)
        record_call(layout, dense)
        if not bool(dense.any()):
            return sparse_attention(q, keys, values, layout, ctx.scaling, compiled=self.compile).to(q.dtype)
        if self.compile and native_pays(q, keys, values, layout):  # the CPU kernel: dense heads too, in the same call
            return sparse_attention(q, keys, values, layout.with_dense_heads(dense), ctx.scaling).to(q.dtype)
        if bool(dense.all()):
            return super().prefill_output(ctx, q, keys, values, positions)
        # the dense heads keep their place in the kernel's call (the same shapes: no new compiled graph) with
        # no tiles, so it computes nothing for them; their output is dense attention over the same keys
        out = sparse_attention(q, keys, values, layout.without_heads(dense), ctx.scaling,
                               compiled=self.compile).to(q.dtype)
        heads = dense.nonzero().flatten()
        kv_heads = heads // (q.shape[1] // keys.shape[1])
        # keys are the contiguous prompt at positions 0..n-1 for every head (_sparse_applies checked it)
        out[:, heads] = attend(q[:, heads], keys[:, kv_heads], values[:, kv_heads], ctx.scaling, ctx.q_pos,
                               positions[0, 0], None).to(q.dtype)
        return out

    @staticmethod
    def _sparse_applies(ctx: LayerContext, q, keys, positions) -> bool:
        if ctx.native_window is not None:  # the model's own sliding window: its masking, dense
            return False
        if q.shape[0] != 1:
            raise AttnkitError(f"sparse prefill supports batch size 1, got {q.shape[0]}")
        n, nq = keys.shape[2], q.shape[2]
        if nq < 2 or int(ctx.q_pos[0]) != n - nq or int(ctx.q_pos[-1]) != n - 1:
            return False
        if int(ctx.q_pos[-1]) >= ctx.session.prompt_len:  # tokens after the prompt (e.g. verifying drafts)
            return False
        # the keys must be the contiguous prompt 0..n-1 in order (they are, unless a cache reordered them)
        first = positions[0, 0]
        return bool((positions[..., 0] == 0).all() and (positions[..., -1] == n - 1).all()
                    and torch.equal(first, torch.arange(n, device=first.device)))


@dataclass
class MInferenceRun:
    """MInference's state for one generation: whether its pattern config was checked against the model."""

    checked: bool = False


@register
@dataclass(frozen=True)
class MInference(SparsePrefill):
    """Dynamic sparse prefill, a pattern per head from `config` (or a uniform pattern); dense decoding."""

    config: str | None = None
    pattern: str | None = None
    k_v: int | None = None
    k_s: int | None = None
    k_b: int | None = None
    block_size: int | None = None
    last_q: int | None = None
    compile: bool = True
    dense_above: float = DENSE_ABOVE
    _config: PatternConfig | None = field(default=None, init=False, repr=False, compare=False)

    name = "minference"
    summary = "dynamic sparse prefill, A-shape/vertical-slash/block-sparse per head (MInference)"
    static = False

    def __post_init__(self):
        given = [n for n in ("pattern", "k_v", "k_s", "k_b") if getattr(self, n) is not None]
        if self.config is not None:
            if given:
                raise AttnkitError(f"config fixes the pattern of every head; drop {', '.join(given)} (or drop config "
                                 f"for a uniform pattern)")
            object.__setattr__(self, "_config", load_pattern_config(self.config))  # derived from `config`
            if self.block_size is not None and self.block_size != self._config.block_size:
                raise AttnkitError(f"block_size={self.block_size} differs from the config's {self._config.block_size}")
            if self.static:
                self._check_static()
        else:
            if self.static:
                raise AttnkitError("minference_static needs config=FILE written by `attnkit calibrate patterns --static`")
            pattern = self.pattern or "vertical_slash"
            if pattern not in DEFAULT_UNIFORM:
                raise AttnkitError(f"pattern must be vertical_slash or block_sparse (use the a_shape method for A-shape), "
                                 f"got {pattern!r}")
            wrong = [n for n in ("k_v", "k_s", "k_b") if getattr(self, n) is not None
                     and n not in PATTERN_PARAMS[pattern]]
            if wrong:
                raise AttnkitError(f"{', '.join(wrong)} is not a parameter of pattern {pattern}")
            for n in PATTERN_PARAMS[pattern]:
                if getattr(self, n) is not None:
                    whole(n, getattr(self, n), 0)
        if self.block_size is not None:
            check_block(self.block_size)
        if self.last_q is not None:
            whole("last_q", self.last_q, 1)
        fraction("dense_above", self.dense_above)

    def _check_static(self) -> None:
        for i, layer in enumerate(self._config.layers):
            for h, p in enumerate(layer):
                if p.pattern != "a_shape" and not p.is_static:
                    raise AttnkitError(f"{self._config.source} has no static indices (layer {i}, head {h}); write it "
                                     f"with `attnkit calibrate patterns --static`")

    def uniform_pattern(self) -> HeadPattern:
        base = DEFAULT_UNIFORM[self.pattern or "vertical_slash"]
        params = {n: getattr(self, n) if getattr(self, n) is not None else getattr(base, n)
                  for n in PATTERN_PARAMS[base.pattern]}
        return HeadPattern(base.pattern, **params)

    def block(self) -> int:
        if self._config is not None:
            return self._config.block_size
        return self.block_size or DEFAULT_BLOCK

    def estimate_rows(self) -> int:
        if self.last_q is not None:
            return self.last_q
        return self._config.last_q if self._config is not None else DEFAULT_LAST_Q

    def new_session_state(self) -> MInferenceRun:
        return MInferenceRun()

    def layer_patterns(self, ctx: LayerContext, n_heads: int) -> list[HeadPattern]:
        if self._config is None:
            return [self.uniform_pattern()] * n_heads
        run = ctx.session_state
        if not run.checked:  # a tensor-parallel shard's layers: against the whole model's heads
            self._config.check_model(ctx.session.n_layers, ctx.session.model_heads(n_heads, None)[0])
            run.checked = True
        layer = self._config.layers[ctx.index][ctx.session.held_heads(n_heads)]
        return layer if self.static else [p.dynamic() for p in layer]

    def column_width(self, patterns: list[HeadPattern], n: int) -> int:
        if self._config is None:
            most = max((p.k_v for p in patterns if p.pattern == "vertical_slash"), default=0)
        elif self.static:
            most = max((len(p.vertical) for layer in self._config.layers for p in layer
                        if p.pattern == "vertical_slash"), default=0)
        else:
            most = max((p.k_v for layer in self._config.layers for p in layer if p.pattern == "vertical_slash"),
                       default=0)
        b = self.block()
        most = min(most, max(0, n - b))
        return -(-most // b) * b


@register
@dataclass(frozen=True)
class MInferenceStatic(MInference):
    """The "w/ static" ablation: fixed indices from the calibration prompt (config written with --static)."""

    name = "minference_static"
    summary = "MInference with static indices estimated once at calibration (Table 4 ablation)"
    static = True
