"""``quest``: query-aware page selection while decoding (Tang, Zhao, Zhu, Xiao, Kasikci, Han, 2024, "Quest:
Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774).

Nothing is evicted: the cache holds every entry full attention holds. Its slots are cut into pages of
``page_size`` (default 16, the paper's); per page and kv head the element-wise minimum ``m`` and maximum ``M`` of the
keys are kept beside them (:class:`~attnkit.methods.quest_pages.PagedLayerKV`, updated on every append, so chunked
prefill changes nothing). Each decoding step, per kv head, the upper bound of each page's logits,

    U = sum_i max(q_i m_i, q_i M_i)                                        (Section 3.2, Algorithm 1)

ranks the pages, and the step attends over the top pages only, ``token_budget // page_size`` of them (or
``budget`` x the context's tokens), the current (last) page always among them, as the paper's kernel forces it. The
step reads the chosen pages' keys and values plus the summaries (``2 / page_size`` of the keys), where full reads
every entry; the run's stats give both (``quest_bytes_read_per_step``, ``quest_full_bytes_per_step``,
``quest_read_fraction``) beside the bytes held (``peak_kv_bytes``: full's plus the summaries).

Choices the paper leaves open or makes for multi-head models:

- **The first page** (the attention sink of StreamingLLM) is chosen by its bound like any other, as in the paper's
  kernel and evaluation code; ``first_page=true`` always reads it as well (one page of the budget).
- **GQA.** A kv group shares one choice, by the maximum of its query heads' bounds (``per_query_head=false``): the
  group reads the same pages, so the bytes read per kv head are the budget's. ``per_query_head=true`` is the paper's
  rule for multi-head attention (each query head its own pages): a group then reads up to ``groups`` x the budget.
- **Dense layers.** The paper's code runs the first two layers densely (``dense_layers=2``); a model with no more
  layers than that is refused, since Quest would do nothing there (``dense_layers=0`` applies it to every layer).
- **Prefill** is full attention (Quest accelerates decoding); the page choice starts with the first generated token.
- **Exactness.** When the budget covers the context (every page chosen) the step is the plain dense one, so at an
  unlimited budget the tokens and logits are full attention's.
- **Sliding-window layers** (Mistral, Qwen's windowed layers): pages entirely outside the window are never chosen
  and the slots outside it are masked, as full attention masks them. Slots are positions here (nothing is evicted),
  which is checked once per layer.
- **One token per step**: the choice is per query, so a step of several tokens (a speculative verification) is
  refused in one line.

The step's attention runs on a C++ kernel on a CPU (:mod:`attnkit.methods.quest_native`) and a Triton kernel on a GPU
(:mod:`attnkit.methods.quest_triton`), each reading the chosen pages where they lie; elsewhere the pages are gathered
with torch (:func:`~attnkit.methods.quest_pages.gathered_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from attnkit.cache import LayerKV
from attnkit.errors import AttnkitError
from attnkit.methods import quest_native, quest_triton
from attnkit.methods.base import Method
from attnkit.methods.quest_pages import PagedLayerKV, choose_pages, gathered_attention, page_bounds
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import flag, fraction, one_of_two, whole


@dataclass
class QuestState:
    """Per layer: whether its slots were checked to be positions, and the bytes its decoding steps read."""

    checked: bool = False
    steps: int = 0  # decoding steps of one sequence on this layer
    read: int = 0  # bytes one sequence's steps read here (keys, values, summaries)
    full: int = 0  # bytes full attention would have read


@register
@dataclass(frozen=True)
class Quest(Method):
    """Every entry kept; each decoding step attends over the pages of highest key bound (Quest)."""

    token_budget: int | None = None
    budget: float | None = None
    page_size: int = 16
    dense_layers: int = 2
    per_query_head: bool = False
    first_page: bool = False

    name = "quest"
    summary = "decode-time page selection by key min/max bounds, nothing evicted (Quest, Tang et al. 2024)"
    layer_state_type: ClassVar[type] = QuestState
    # a sweep's budget: a fraction of the context, or the tokens a step reads (attnkit.recipe.budget)
    budget_params: ClassVar[tuple[str, str]] = ("budget", "token_budget")

    def __post_init__(self):
        whole("page_size", self.page_size, 1, what=" (tokens per page)")
        whole("dense_layers", self.dense_layers, 0, what=" (first layers attending densely)")
        one_of_two("token_budget", self.token_budget, "budget", self.budget,
                   required="quest needs token_budget (tokens read per step) or budget (a fraction of the context)")
        flag("first_page", self.first_page)
        if self.token_budget is not None:
            forced = self.forced_pages()
            whole("token_budget", self.token_budget, forced * self.page_size,
                  what=f" (tokens read per step: at least the {'first and the ' if forced == 2 else ''}current page, "
                       f"{forced} x page_size={self.page_size})")
        else:
            fraction("budget", self.budget, what=" (the fraction of the context read per step)")
        flag("per_query_head", self.per_query_head)

    def new_layer_state(self) -> QuestState:
        return QuestState()

    # ---- sizes -------------------------------------------------------------------------------------
    def forced_pages(self) -> int:
        """Pages every sparse step reads whatever their bounds: the current one, and the first with ``first_page``."""
        return 2 if self.first_page else 1

    def pages_read(self, tokens: int) -> int:
        """Pages a step over `tokens` held entries reads: all when the budget covers them, else at least the forced
        ones (:meth:`forced_pages`)."""
        budget = self.token_budget if self.token_budget is not None else self.budget * tokens
        if budget >= tokens:  # the budget covers the context: every page, the last one partial
            return -(-tokens // self.page_size)
        return max(self.forced_pages(), int(budget) // self.page_size)

    def sparse(self, ctx: LayerContext) -> bool:
        return ctx.index >= self.dense_layers

    def planned_slots(self, ctx: LayerContext) -> int:
        if self.dense_layers >= ctx.session.n_layers:
            raise AttnkitError(f"quest: dense_layers={self.dense_layers} leaves none of the model's "
                               f"{ctx.session.n_layers} layers sparse; lower it (0 applies Quest to every layer)")
        return super().planned_slots(ctx)

    def allocate_layer(self, ctx: LayerContext, k: torch.Tensor, slots: int, ring: bool) -> LayerKV:
        layer = super().allocate_layer(ctx, k, slots, ring)
        return PagedLayerKV.around(layer, self.page_size) if self.sparse(ctx) else layer

    # ---- decoding ----------------------------------------------------------------------------------
    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        if q.shape[2] != 1:
            raise AttnkitError(f"quest chooses pages per query and decodes one token per step, got {q.shape[2]} at "
                               f"once (speculative verification is not supported with it)")
        kv = ctx.kv
        kv.append(k, v, ctx.q_pos)
        n = kv.length
        pages = -(-n // self.page_size)
        count = self.pages_read(n) if self.sparse(ctx) else pages
        entry = kv.keys.shape[1] * (kv.keys.shape[-1] + kv.values.shape[-1]) * kv.keys.element_size()
        st = ctx.state
        st.steps += 1
        st.full += n * entry
        if count >= pages:  # the budget covers the context: the plain dense step, exactly full's
            st.read += n * entry
            return self._attend_held(ctx, q)
        if not st.checked:
            held = kv.positions[:, :, :n]
            if not torch.equal(held, torch.arange(n, device=held.device).expand_as(held)):
                raise AttnkitError("quest pages the cache by slot and needs every position 0.. in order (a cache "
                                   "that was compressed or padded cannot be paged)")
            st.checked = True
        visible_from = 0
        if ctx.native_window is not None:
            visible_from = max(0, int(ctx.q_pos[-1]) - ctx.native_window + 1)
        keys, values, _ = kv.view()
        summaries = kv.page_min[:, :, :pages], kv.page_max[:, :, :pages]
        native = quest_native.kernel_pays(q, keys)
        if native:  # bounds and choice in one pass over the summaries
            chosen = quest_native.choose_pages(q, *summaries, count, self.per_query_head, visible_from, self.page_size,
                                               self.first_page)
        else:
            chosen = choose_pages(page_bounds(q, *summaries), count, self.per_query_head, visible_from, self.page_size,
                                  self.first_page)
        last = n - (pages - 1) * self.page_size  # entries in the current page
        st.read += chosen.shape[2] * ((count - 1) * self.page_size + last) * entry
        st.read += pages * 2 * kv.keys.shape[1] * kv.keys.shape[-1] * kv.keys.element_size()
        if native:
            return quest_native.paged_decode(q, keys, values, chosen, self.page_size, n, ctx.scaling, visible_from)
        if quest_triton.kernel_pays(q):
            return quest_triton.paged_decode(q, keys, values, chosen, self.page_size, n, ctx.scaling, visible_from)
        return gathered_attention(q, keys, values, chosen, self.page_size, n, ctx.scaling, visible_from)

    def run_stats(self, session) -> dict:
        states = [st for st in session.layer_state if isinstance(st, QuestState)]
        steps = states[0].steps if states else 0
        if not steps:
            return {}
        read, full = sum(st.read for st in states), sum(st.full for st in states)
        return {"quest_bytes_read_per_step": read / steps, "quest_full_bytes_per_step": full / steps,
                "quest_read_fraction": read / full}
