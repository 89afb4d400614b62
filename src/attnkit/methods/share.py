"""``share``: Share-Attention, heads of a layer that attend alike share one softmax (section 4.1 of
Taniguchi, Xiao, Dong, Oyamada and Onizuka (谷口 令, 肖 川, 董 于洋, 小山田 昌史, 鬼塚 真), "Attention
スコアの分布類似性を用いた大規模言語モデルの動作効率化および省メモリ化" -- making LLM inference faster and
smaller with the similarity of attention score distributions; "the paper" below).

The paper observes (section 3.1, Fig. 1-2) that within a layer several heads produce nearly the same
attention matrix. An offline calibration (:mod:`attnkit.calibrate.heads`, the paper's three steps of
section 4.1) measures the distance of eq. 9,

    distance(A, A') = sqrt(sum (A - A')^2) / sqrt(N)      (eq. 9; N the input length)

between every pair of heads, clusters heads closer than a per-layer threshold and writes a JSON config: per
layer ``{"essential_heads": [...], "share_to": {"head": essential_head}}``.

At inference only the *essential* heads compute ``softmax(q K^T / sqrt(d))`` (eq. 5 at prefill, eq. 8 at
decode); every shared head ``h`` takes the probabilities of its essential head ``e`` and multiplies them by
its OWN values::

    out_h = softmax(q_e K_{kv(e)}^T / sqrt(d)) V_{kv(h)}

With GQA the two may sit in different kv groups (the paper, end of section 3.1, finds no regularity by
group): the logits use the essential head's kv head, the values the shared head's kv head. Keys and values
are cached as usual (kv heads only, never expanded); sharing saves computation, not memory.

The prompt is attended in query chunks of at most :data:`attnkit.methods.scoring.SCORE_BLOCK_ELEMENTS`
(head x query x key) probabilities, and a chunk only reads the keys its queries can see, so no N x N matrix
exists. A layer in which no head is shared keeps the fused dense kernel (it is exactly ``full``). The
fraction of QK^T + softmax head-operations avoided is :meth:`Share.skipped_fraction` (one minus the mean
retention rate of the paper's Fig. 7).

A whole prompt in one chunk (``fused_prefill=true``, default) instead goes through the fused SDPA kernel,
one call per (essential head's kv head, shared head's kv head) pair (:func:`shared_prefill_fused`): the
explicit path must write every probability to memory and read it back, a quadratic memory traffic the fused
kernel never pays; the fused one skips every shared head within its essential head's kv group but
recomputes the softmax of a head shared across groups (the paper's section 5 notes the same limit:
FlashAttention would need a kernel that applies one softmax to several V).

Parameters: ``config`` is the calibrated JSON file (or a dict of the same shape); ``config=none`` means no
sharing at all (every head essential: the threshold-0 setting of the paper's Fig. 6), which is ``full``.
A config whose layer, head or kv-head counts differ from the model's is refused with an
:class:`~attnkit.errors.AttnkitError` naming both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnkit.attention import attend, position_mask, sdpa
from attnkit.config_file import read_config_file
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.scoring import block_elements_for
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import flag, is_whole

CONFIG_FORMAT = "attnkit-share-heads/1"


@dataclass(frozen=True)
class LayerPlan:
    """How one layer computes its heads: the essential heads sorted by kv group (``essential``), the
    contiguous run of them in each kv group (``groups``: ``(kv_head, start, end)``), and for every query
    head the row of the essential probabilities it uses (``source``, an index into ``essential``)."""

    essential: tuple[int, ...]
    groups: tuple[tuple[int, int, int], ...]
    source: tuple[int, ...]

    @property
    def shares(self) -> bool:
        return len(self.essential) < len(self.source)

    @classmethod
    def build(cls, n_heads: int, n_kv: int, share_to: dict[int, int]) -> LayerPlan:
        """A plan from ``share_to`` (shared head -> its essential head); unlisted heads are essential."""
        g = n_heads // n_kv
        target = [share_to.get(h, h) for h in range(n_heads)]
        essential = sorted({t for t in target}, key=lambda h: (h // g, h))
        row = {h: i for i, h in enumerate(essential)}
        groups = []
        for i, h in enumerate(essential):
            kv = h // g
            if groups and groups[-1][0] == kv:
                groups[-1][2] = i + 1
            else:
                groups.append([kv, i, i + 1])
        return cls(tuple(essential), tuple(tuple(x) for x in groups), tuple(row[t] for t in target))

    @classmethod
    def identity(cls, n_heads: int, n_kv: int) -> LayerPlan:
        return cls.build(n_heads, n_kv, {})

    def pairs(self, n_kv: int) -> dict[tuple[int, int], list[tuple[int, list[int]]]]:
        """For the fused prefill: ``(keys' kv head, values' kv head) -> [(essential head, [heads served])]``.
        A shared head in its essential head's kv group needs no computation of its own."""
        g = len(self.source) // n_kv
        out: dict[tuple[int, int], dict[int, list[int]]] = {}
        for h, row in enumerate(self.source):
            e = self.essential[row]
            out.setdefault((e // g, h // g), {}).setdefault(e, []).append(h)
        return {key: sorted(m.items()) for key, m in sorted(out.items())}


def shared_positions(k_pos: torch.Tensor) -> torch.Tensor:
    if k_pos.dim() == 1:
        return k_pos
    if bool((k_pos == k_pos[:1, :1]).all()):
        return k_pos[0, 0]
    raise AttnkitError("share: the kv heads of this layer hold different token positions (per-head eviction); "
                       "a shared head reuses another head's probabilities slot by slot, so every kv head must "
                       "hold the same tokens")


def essential_probabilities(q: torch.Tensor, keys: torch.Tensor, scaling: float, q_pos: torch.Tensor,
                            k_pos: torch.Tensor, window: int | None, plan: LayerPlan) -> torch.Tensor:
    """Eq. 5 / eq. 8 probabilities of the essential heads only: ``[b, n_essential, queries, keys]`` (float32).

    `q` ``[b, q_heads, c, d]`` at `q_pos`; `keys` ``[b, kv_heads, n, d]`` at the 1-D ascending `k_pos`. Each
    essential head's logits use its own kv head's keys (one matmul per kv group, nothing expanded)."""
    b, c, d, n = q.shape[0], q.shape[2], q.shape[3], keys.shape[2]
    logits = torch.empty(b, len(plan.essential), c, n, dtype=torch.float32, device=q.device)
    for kv, s, e in plan.groups:
        first, last = plan.essential[s], plan.essential[e - 1]
        # the group's essential heads folded into the query axis: one [m*c, d] x [d, n] product per kv head
        qs = q[:, first:last + 1] if last - first == e - s - 1 else q[:, list(plan.essential[s:e])]
        prod = torch.matmul(qs.reshape(b, 1, (e - s) * c, d), keys[:, kv:kv + 1].transpose(-1, -2))
        logits[:, s:e] = prod.view(b, e - s, c, n)
    logits.mul_(scaling)
    if window is not None or int(q_pos.min()) < int(k_pos.max()):  # some key is hidden from some query
        logits.masked_fill_(~position_mask(q_pos, k_pos, window), float("-inf"))
    return torch.softmax(logits, dim=-1)


def shared_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, window: int | None, plan: LayerPlan,
                     block_elements: int | None = None) -> torch.Tensor:
    """Attention output ``[b, q_heads, c, d]`` where head h uses the probabilities of ``essential[source[h]]``
    and the values of its own kv head (section 4.1 of the paper). Queries are taken in chunks of at most
    `block_elements` (head x query x key) entries; a chunk reads only the keys before its last query."""
    b, hq, c, _ = q.shape
    kv = keys.shape[1]
    g = hq // kv
    k_pos = shared_positions(k_pos)
    n = keys.shape[2]
    if block_elements is None:
        block_elements = block_elements_for(q.device)
    block = max(1, block_elements // max(1, b * hq * n))
    source = torch.tensor(plan.source, device=q.device)
    ascending = n < 2 or bool((k_pos[1:] > k_pos[:-1]).all())
    out = torch.empty(b, hq, c, values.shape[-1], dtype=values.dtype, device=q.device)
    for s in range(0, c, block):
        e = min(c, s + block)
        qp = q_pos[s:e]
        lim = int(torch.searchsorted(k_pos, qp.max(), right=True)) if ascending else n
        if lim == 0:
            out[:, :, s:e] = 0
            continue
        probs = essential_probabilities(q[:, :, s:e], keys[:, :, :lim], scaling, qp, k_pos[:lim], window, plan)
        # each kv head's query heads folded into the query axis: one [g*c, n] x [n, d] product per kv head
        per_head = probs[:, source].to(values.dtype).view(b, kv, g * (e - s), lim)
        out[:, :, s:e] = torch.matmul(per_head, values[:, :, :lim]).view(b, hq, e - s, -1)
    return out


def shared_prefill_fused(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                         plan: LayerPlan) -> torch.Tensor:
    """The causal prompt attention of :func:`shared_attention` (queries = keys, same positions, no window) with
    the fused kernel: one SDPA call per (keys' kv head, values' kv head) pair of the plan, over only the
    essential heads that serve it. A shared head in its essential head's kv group costs nothing (a copy of the
    essential head's output); one in another group costs a softmax of its own (the fused kernel never exposes
    the probabilities), so this path skips fewer head-operations than the explicit one when sharing crosses
    kv groups (:meth:`Share.skipped_fraction` reports both)."""
    b, hq, n, d = q.shape
    out = torch.empty(b, hq, n, values.shape[-1], dtype=values.dtype, device=q.device)
    for (kk, vk), items in plan.pairs(keys.shape[1]).items():
        heads = [e for e, _ in items]
        res = sdpa(q[:, heads], keys[:, kk:kk + 1], values[:, vk:vk + 1], scaling, is_causal=True)
        for i, (_, served) in enumerate(items):
            out[:, served] = res[:, i:i + 1]
    return out


# ---- the config file ---------------------------------------------------------------------------------
def _read(source) -> tuple[dict, str]:
    if isinstance(source, dict):
        return source, "the share config"
    data = read_config_file(source, "share config", " (write one with `attnkit calibrate heads`)")
    return data, f"share config {str(source)!r}"


def parse_share_config(data: dict, what: str = "the share config") -> list[dict[int, int]]:
    """Check a config's structure; per layer the ``share_to`` map (shared head -> essential head).

    Every head of a layer must be essential or shared to an essential head of the same layer, exactly once."""
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise AttnkitError(f"{what}: expected a JSON object with a 'layers' list (from `attnkit calibrate heads`)")
    n_heads = data.get("n_heads")
    if not is_whole(n_heads) or n_heads < 1:
        raise AttnkitError(f"{what}: 'n_heads' (query heads per layer) must be a positive integer, got {n_heads!r}")
    if data.get("n_layers", len(data["layers"])) != len(data["layers"]):
        raise AttnkitError(f"{what}: 'n_layers' is {data.get('n_layers')} but 'layers' lists {len(data['layers'])}")
    out = []
    for i, layer in enumerate(data["layers"]):
        if not isinstance(layer, dict) or not isinstance(layer.get("essential_heads"), list):
            raise AttnkitError(f"{what}: layer {i} needs an 'essential_heads' list")
        essential = layer["essential_heads"]
        raw = layer.get("share_to", {})
        if not isinstance(raw, dict):
            raise AttnkitError(f"{what}: layer {i} 'share_to' must map head -> essential head")
        try:
            share_to = {int(k): int(v) for k, v in raw.items()}
        except (TypeError, ValueError):
            raise AttnkitError(f"{what}: layer {i} 'share_to' must map head numbers to head numbers") from None
        heads = sorted(list(essential) + list(share_to))
        if heads != list(range(n_heads)):
            raise AttnkitError(f"{what}: layer {i} must list each of its {n_heads} heads once, as essential or "
                               f"shared; got essential {essential} and shared {sorted(share_to)}")
        bad = {h: e for h, e in share_to.items() if e not in essential}
        if bad:
            raise AttnkitError(f"{what}: layer {i} shares heads to non-essential heads: {bad}")
        out.append(share_to)
    return out


@dataclass
class ShareConfig:
    """A loaded share config: the recorded geometry and each layer's share_to map."""

    n_layers: int
    n_heads: int
    n_kv_heads: int | None
    share_to: list[dict[int, int]]
    source: str
    _plans: dict = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, source) -> ShareConfig:
        data, what = _read(source)
        share_to = parse_share_config(data, what)
        return cls(len(share_to), data["n_heads"], data.get("n_kv_heads"), share_to, what)

    def check(self, n_layers: int, n_heads: int, n_kv: int, model: str = "the model") -> None:
        if (self.n_layers, self.n_heads) != (n_layers, n_heads) or self.n_kv_heads not in (None, n_kv):
            raise AttnkitError(
                f"{self.source} was calibrated for {self.n_layers} layers x {self.n_heads} query heads "
                f"({self.n_kv_heads} kv heads) but {model} has {n_layers} layers x {n_heads} query heads "
                f"({n_kv} kv heads); calibrate it for this model with `attnkit calibrate heads`")

    def plan(self, layer: int, n_kv: int) -> LayerPlan:
        if layer not in self._plans:
            self._plans[layer] = LayerPlan.build(self.n_heads, n_kv, self.share_to[layer])
        return self._plans[layer]

    def retention(self) -> list[float]:
        """Per layer, computed heads / heads (the paper's retention rate of Fig. 7, as a fraction)."""
        return [(self.n_heads - len(m)) / self.n_heads for m in self.share_to]


@dataclass
class ShareRun:
    """A sharing method's state for one generation: whether its config was checked against the model."""

    checked: bool = False


def layer_plan(run: ShareRun, config: ShareConfig | None, n_layers: int, layer: int, q: torch.Tensor,
               k: torch.Tensor) -> LayerPlan | None:
    """The plan of `layer` from `config` (None = no sharing), checked against the model's geometry (layers
    from the session, heads from q and k) once per generation (`run`)."""
    if config is None:
        return None
    if not run.checked:
        config.check(n_layers, q.shape[1], k.shape[1])
        run.checked = True
    return config.plan(layer, k.shape[1])


def _plain_causal(q_pos: torch.Tensor, k_pos: torch.Tensor, window) -> bool:
    """Queries and keys are the same contiguous run of positions, no window: SDPA's causal kernel applies."""
    if window is not None or k_pos.dim() != 1 or q_pos.shape[0] != k_pos.shape[0] or q_pos.shape[0] < 2:
        return False
    lo, hi = int(k_pos[0]), int(k_pos[-1])
    return int(q_pos[0]) == lo and int(q_pos[-1]) == hi and hi - lo + 1 == k_pos.shape[0]


def attend_shared(plan: LayerPlan | None, q, keys, values, scaling, q_pos, k_pos, window,
                  fused: bool = True) -> torch.Tensor:
    """Dense attention when the layer shares nothing; else the fused prefill (:func:`shared_prefill_fused`)
    for a plain causal prompt when `fused`, or the explicit :func:`shared_attention`."""
    if plan is None or not plan.shares:
        return attend(q, keys, values, scaling, q_pos, k_pos, window)
    if fused and _plain_causal(q_pos, shared_positions(k_pos), window):
        return shared_prefill_fused(q, keys, values, scaling, plan)
    return shared_attention(q, keys, values, scaling, q_pos, k_pos, window, plan)


@register
@dataclass(frozen=True)
class Share(Method):
    """Share-Attention (Taniguchi et al., section 4.1; distance of eq. 9, clusters of Fig. 2, retention of
    Fig. 7): only essential heads compute eq. 5 / eq. 8's softmax, shared heads reuse it with their own V."""

    config: str | dict | None = None
    fused_prefill: bool = True

    name = "share"
    batches = False  # head clusters are chosen from one sequence's own attention: one session per sequence
    summary = "Share-Attention: heads share an essential head's softmax (Taniguchi et al., eq. 9 clusters)"

    def __post_init__(self):
        if self.config is not None and not isinstance(self.config, (str, dict)):
            raise AttnkitError(f"config must be a share config file (from `attnkit calibrate heads`), a dict, or none "
                             f"for no sharing; got {type(self.config).__name__}")
        flag("fused_prefill", self.fused_prefill)
        object.__setattr__(self, "_config", None if self.config is None else ShareConfig.load(self.config))  # derived

    def skipped_fraction(self, n_kv: int | None = None) -> float:
        """Fraction of the QK^T + softmax head-operations that sharing avoids (all layers, every query) on the
        explicit path (decode, chunked prefill). With `n_kv` (the model's kv heads): on the fused prefill
        instead, where a head shared across kv groups is recomputed (:func:`shared_prefill_fused`)."""
        if self._config is None:
            return 0.0
        if n_kv is None:
            return 1.0 - sum(self._config.retention()) / self._config.n_layers
        cfg = self._config
        computed = sum(sum(len(items) for items in cfg.plan(i, n_kv).pairs(n_kv).values())
                       for i in range(cfg.n_layers))
        return 1.0 - computed / (cfg.n_layers * cfg.n_heads)

    def new_session_state(self) -> ShareRun:
        return ShareRun()

    def _plan(self, ctx: LayerContext, q, k) -> LayerPlan | None:
        return layer_plan(ctx.session_state, self._config, ctx.session.n_layers, ctx.index, q, k)

    def prefill_output(self, ctx: LayerContext, q, keys, values, positions) -> torch.Tensor:
        plan = self._plan(ctx, q, keys)
        return attend_shared(plan, q, keys, values, ctx.scaling, ctx.q_pos, positions, ctx.native_window,
                             self.fused_prefill)

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        ctx.kv.append(k, v, ctx.q_pos)
        keys, values, positions = ctx.kv.view()
        plan = self._plan(ctx, q, keys)
        return attend_shared(plan, q, keys, values, ctx.scaling, ctx.q_pos, positions, ctx.native_window)
