"""``think``: prune the least important key channels of the prompt's cached keys, under any cache method (Xu, Jie,
Hooper, Kiani, Haq, Qin, Yao, Lin, 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning", arXiv 2407.21018;
kvpress's ``ThinKPress``).

ThinK compresses the key cache along its channels, not its tokens, so it composes with any method that chooses
tokens. Per kv head it scores each channel ``i`` of the head dimension by how much the channel contributes to the
logits of the latest queries (the paper's eq. 4, the Frobenius norm of ``Q[:, i] K[:, i]^T``, which is
``||Q[:, i]|| ||K[:, i]||``): with ``Q`` the prompt's last ``window_size`` queries of the head's group (after RoPE,
as the attention sees them) and ``K`` the keys the layer holds once its cache method has compressed the prompt,

    s_i = mean_{h in group} mean_t q_{h,t,i}^2  x  mean_j k_{j,i}^2      (the square of the paper's score, up to
                                                                          constant factors: the same order)

and the ``int(d x key_channels)`` channels of lowest score are pruned from every held prompt key of that kv head
(at ``key_channels=0`` nothing is, and the outputs are the cache method's exactly). Tokens generated afterwards are
stored whole, as in kvpress, whose press acts on the prompt only.

**Zeroed, not dropped.** The pruned channels are set to zero in place; the key tensors keep their shape, so this
saves no memory (the byte counts say so: the layer holds its full keys, plus the pruned channels' indices,
``int(d x key_channels)`` int64 per kv head). That is what kvpress does too. Dropping them would need every read of
the cache (each attention path, each method's scores, each host's blocks) to gather the surviving channels of each
kv head and a key width per slot (generated tokens keep all theirs); attnkit does not do that, so ``think`` measures
ThinK's effect on accuracy, not its memory.

**Composition.** A trailing part of a spec, as a quantizer is: ``snapkv:budget=0.3+think:key_channels=0.5`` is
kvpress's ``ComposedPress([SnapKVPress(0.7), ThinKPress(0.5)])``; ``think:key_channels=0.5`` alone prunes the channels
of the full cache; in a recipe, ``"quantize": {"method": "think", ...}``. The cache method does everything it does
alone; ThinK's own state (the window's queries during the prompt, the pruned channels after it) lives in the layer's
storage (:class:`ThinLayerKV`). Refused, in one line: a cache method with storage of its own (``kivi``, ``quest``), one
that re-rotates keys it stored (``streaming:positions=reindex``: a rotation would mix a zeroed channel with its RoPE
pair), one that runs the layers itself (``select``, ``gemfilter``), and a flat layer (``head_budgets=adaptive``,
``duo_attention``: kvpress's ``ComposedPress`` refuses ``AdaKVPress`` likewise). vLLM: refused (the host does not
rewrite the keys it keeps in vLLM's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnkit.cache import LayerKV
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.cache_wrapper import CacheWrapper, wrappable
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import fraction, whole


class ThinLayerKV(LayerKV):
    """A layer's full-precision storage (:class:`attnkit.cache.LayerKV`) that also holds ThinK's state: the prompt's
    last queries until the prompt is compressed (``window_q`` ``[b, hq, w, d]``), then the pruned channels
    (``pruned`` ``[b, kv, n]`` int64, ascending per kv head; None before, or with nothing pruned)."""

    window_q: torch.Tensor | None = None
    pruned: torch.Tensor | None = None

    @classmethod
    def wrap(cls, layer: LayerKV) -> ThinLayerKV:
        return cls(layer.keys, layer.values, layer.positions, layer.length, layer.ring, layer.extras)

    def nbytes(self) -> int:
        return super().nbytes() + (0 if self.pruned is None else self.pruned.nbytes)

    def clone(self, rows: torch.Tensor | None = None) -> ThinLayerKV:
        out = ThinLayerKV.wrap(super().clone(rows))
        for name in ("window_q", "pruned"):
            t = getattr(self, name)
            if t is not None:
                setattr(out, name, t.clone() if rows is None else t[rows.to(t.device)])
        return out

    def keep_rows(self, rows: torch.Tensor) -> None:
        super().keep_rows(rows)
        for name in ("window_q", "pruned"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[rows.to(t.device)])


def channel_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """ThinK's score of every key channel ``[b, kv, d]`` (float32): the mean square of the window's queries
    `queries` ``[b, kv * g, w, d]`` over the window and the group, times the mean square of the held keys `keys`
    ``[b, kv, L, d]`` over the entries."""
    b, kv, _, d = keys.shape
    q = queries.float().pow(2).mean(dim=2).view(b, kv, -1, d).mean(dim=2)
    return q * keys.float().pow(2).mean(dim=2)


def pruned_channels(queries: torch.Tensor, keys: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` channels of lowest :func:`channel_scores` per kv head, ascending ``[b, kv, count]``."""
    return channel_scores(queries, keys).topk(count, dim=-1, largest=False).indices.sort(dim=-1).values


def _wrapped(value) -> Method:
    method = wrappable(value, Think, "think", again="the cache method already prunes key channels (one think part per "
                       "spec)", layers="; think cannot prune its keys", storage="whose keys think cannot prune",
                       rotates="which would mix a pruned channel with its RoPE pair")
    inner = getattr(method, "cache_method", method)
    if getattr(inner, "head_budgets", "uniform") != "uniform" or inner.name == "duo_attention":
        raise AttnkitError(f"{inner.describe()} holds a different number of entries per kv head (a flat layer), which "
                           f"think does not prune; use head_budgets=uniform")
    return method


@register
@dataclass(frozen=True)
class Think(CacheWrapper):
    """The cache of `cache` with the ``key_channels`` share of each kv head's prompt key channels of least query x key
    energy zeroed (ThinK); generated tokens stored whole."""

    key_channels: float = 0.5
    window_size: int = 32
    cache: str | dict | Method = "full"
    _cache: Method = field(default=None, init=False, repr=False, compare=False)

    name = "think"
    quantizer = True  # a trailing "+think:..." part of a spec holds the cache of what precedes it (its storage)
    summary = "zero the key channels of least query x key energy under any cache method (ThinK, Xu et al. 2024)"
    kvpress = "ThinKPress"

    def __post_init__(self):
        fraction("key_channels", self.key_channels, allow_zero=True, allow_one=False,
                 what=" (the share of each kv head's key channels pruned)")
        whole("window_size", self.window_size, 1, what=" (the prompt's last queries that score the channels)")
        self.wrap(_wrapped(self.cache))

    def own_description(self) -> str:
        return f"think(key_channels={self.key_channels}, window_size={self.window_size})"

    # ---- the storage and ThinK's pruning (generated tokens are stored whole: the other steps are the wrapped
    # method's, CacheWrapper's) -------------------------------------------------------------------------------
    def allocate_layer(self, ctx: LayerContext, k, slots: int, ring: bool) -> ThinLayerKV:
        return ThinLayerKV.wrap(self._cache.allocate_layer(ctx, k, slots, ring))

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        out = self._cache.prefill_attention(ctx, q, k, v)
        kv = ctx.kv
        if self.key_channels and isinstance(kv, ThinLayerKV):  # the prompt's last queries, across its chunks
            window = q if kv.window_q is None else torch.cat([kv.window_q, q], dim=2)
            kv.window_q = window[:, :, -self.window_size:]
        return out

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        self._cache.after_prefill(ctx, q, k, v)  # the cache method compresses the prompt first
        kv = ctx.kv
        if not self.key_channels or not isinstance(kv, ThinLayerKV) or kv.window_q is None:
            return
        if "head" in kv.extras:
            raise AttnkitError(f"think: layer {ctx.index} holds a flat layer (a different count per kv head), whose "
                               f"key channels think does not prune; use head_budgets=uniform")
        keys = kv.view()[0]
        count = int(keys.shape[-1] * self.key_channels)
        queries, kv.window_q = kv.window_q, None
        if count == 0 or keys.shape[2] == 0:
            return
        kv.pruned = pruned_channels(queries, keys, count)
        kv.keys[:, :, :kv.length].scatter_(-1, kv.pruned.unsqueeze(2).expand(-1, -1, kv.length, -1), 0)
