"""Quest in vLLM: vLLM's blocks are Quest's pages (Tang, Zhao, Zhu, Xiao, Kasikci, Han, 2024, "Quest: Query-Aware
Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774; the method: :mod:`attnkit.methods.quest`).

Nothing is evicted or moved: a quest request's blocks hold every entry at its own position, as a plain request's.

- **Summaries** (:class:`Summaries`): per layer, per physical block and kv head, the element-wise minimum ``m`` and
  maximum ``M`` of the keys written to the block, kept beside vLLM's cache and updated where vLLM writes keys (the
  backend's ``do_kv_cache_update``: every prompt chunk and generated token of every request of an engine that may
  run quest, so a block a request takes from the prefix cache carries its summary). A block fills from its first
  slot (just allocated, or its request recomputed), so writing that slot restarts the block's summary.
- **Choice** (:func:`sparse_attention`): each decode query of a quest request (one per row; each generated
  position of a recomputed row) ranks its request's blocks by Quest's bound ``U = sum_i max(q_i m_i, q_i M_i)``
  (Section 3.2, Algorithm 1), forces the current block (and the first with ``first_page``) as attnkit's Quest does,
  takes ``Quest.pages_read`` of them, and attends over the chosen blocks, read where they lie. At a layer its method
  keeps dense (``dense_layers``), or a step whose budget covers every block, the query is vLLM's own kernel's
  (:func:`layer_groups`).

So a request gives attnkit's tokens for ``quest:page_size=<the engine's block size>``: the same pages, bounds and
choice, over the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.methods.quest import Quest
from attnkit.methods.quest_pages import page_bounds
from attnkit.vllm import paged
from attnkit.vllm.plan import check_pages


class Summaries:
    """Each physical block's key minimum and maximum per kv head (``low``, ``high``: ``[num_blocks, kv_heads, d]``)
    for one layer's cache."""

    def __init__(self, key_cache: torch.Tensor):
        blocks, heads, self.block_size, dim = key_cache.shape
        self.low = key_cache.new_full((blocks, heads, dim), float("inf"))
        self.high = key_cache.new_full((blocks, heads, dim), float("-inf"))
        self.owner = key_cache.data_ptr()

    def update(self, key: torch.Tensor, slots: torch.Tensor) -> None:
        """Fold keys ``[tokens, kv_heads, d]`` written to physical `slots` (negative: padding) into their blocks."""
        slots = slots.long()
        key = key[:slots.shape[0]]
        if bool((slots < 0).any()):
            key, slots = key[slots >= 0], slots[slots >= 0]
        blocks = slots // self.block_size
        fresh = blocks[slots % self.block_size == 0]
        self.low[fresh] = float("inf")
        self.high[fresh] = float("-inf")
        key = key.to(self.low.dtype)
        index = blocks[:, None, None].expand_as(key)
        self.low.scatter_reduce_(0, index, key, "amin")
        self.high.scatter_reduce_(0, index, key, "amax")


def summaries_of(impl, key_cache: torch.Tensor) -> Summaries:
    """The summaries kept for `impl`'s layer cache (made on first use, again if vLLM allocated the cache anew)."""
    found = getattr(impl, "_attnkit_summaries", None)
    if found is None or found.owner != key_cache.data_ptr():
        found = impl._attnkit_summaries = Summaries(key_cache)
    return found


@dataclass(frozen=True)
class Query:
    """One decode query of a quest request in a step: its token in the step, its position, its row of the step."""

    token: int
    position: int
    row: int
    method: Quest


@dataclass(frozen=True)
class Sparse:
    """Queries ``rows`` of a step's :class:`QuestStep` choosing pages at a layer, and what their choice needs that
    no layer changes: their requests' first ``pages`` blocks (``table``), the pages each may not choose (``hidden``:
    past its length) and must (``forced``: the current, and the first with ``first_page``), the ranks it takes
    (``taken``: as many as it reads) and the slots of its chosen blocks it reads (``valid``: all but the tail of the
    current block, which sorts last); each query head its own choice (``per_query_head``) or its kv group's."""

    rows: torch.Tensor
    per_query_head: bool
    table: torch.Tensor
    hidden: torch.Tensor
    forced: torch.Tensor
    taken: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, rows: list[int], counts: list[int], per_query_head: bool, tables: torch.Tensor,
           lengths: torch.Tensor, block_size: int, firsts: list[bool]) -> Sparse:
        index = torch.tensor(rows)
        device = tables.device
        count, length = torch.tensor(counts, device=device), lengths[index].to(device)
        pages = (length + block_size - 1) // block_size
        page = torch.arange(int(pages.max()), device=device)
        rank = torch.arange(int(count.max()), device=device)
        slot = torch.arange(rank.shape[0] * block_size, device=device)
        # the j-th chosen block (ascending) is whole but for the last, the current page: its first slots only
        last = (slot // block_size == count[:, None] - 1) & (slot % block_size >= length[:, None] - (pages[:, None] - 1)
                                                              * block_size)
        valid = (slot // block_size < count[:, None]) & ~last
        forced = ((page == 0) & torch.tensor(firsts, device=device)[:, None]) | (page == pages[:, None] - 1)
        return cls(index, per_query_head, tables[index.to(device)][:, :page.shape[0]].long(),
                   (page >= pages[:, None])[:, None, None], forced[:, None, None],
                   (rank < count[:, None])[:, None, None], valid[:, None, None, None])


@dataclass
class QuestStep:
    """A step's quest queries: their tokens (``index``); per layer the queries vLLM's kernel computes (a key of ``dense``, the backend's metadata for them alone, or an
    empty tuple) and the groups choosing pages (:class:`Sparse`)."""

    index: torch.Tensor
    layers: list[tuple[tuple[int, ...], list[Sparse]]]
    dense: dict


def layer_groups(queries: list[Query], n_layers: int, block_size: int, tables: torch.Tensor,
                 lengths: torch.Tensor) -> list[tuple[tuple[int, ...], list[Sparse]]]:
    """Per layer, the queries computed densely (a layer before their method's ``dense_layers``, or a step whose
    budget covers every block) and the groups choosing pages (`tables`: the queries' block table rows)."""
    counts, dense_below = [], []
    for q in queries:
        check_pages(q.method, block_size, "attnkit's vLLM worker")  # checked per request before: a safeguard
        n = q.position + 1
        count = q.method.pages_read(n)
        counts.append(count)
        dense_below.append(n_layers if count >= -(-n // block_size) else q.method.dense_layers)
    layers, made = [], {}
    for layer in range(n_layers):
        dense = tuple(r for r, below in enumerate(dense_below) if layer < below)
        groups = []
        for flag in (False, True):
            rows = tuple(r for r, q in enumerate(queries) if layer >= dense_below[r] and q.method.per_query_head == flag)
            if rows and (rows, flag) not in made:
                made[rows, flag] = Sparse.of(list(rows), [counts[r] for r in rows], flag, tables, lengths, block_size,
                                             [queries[r].method.first_page for r in rows])
            if rows:
                groups.append(made[rows, flag])
        layers.append((dense, groups))
    return layers


def sparse_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layout: paged.Layout,
                     summaries: Summaries, group: Sparse, scale: float) -> torch.Tensor:
    """Outputs ``[queries, heads, d]`` of the queries of `group`, `q` ``[queries, heads, d]``, each over the blocks
    it chooses (see the module docstring)."""
    rows, heads, dim = q.shape
    kv = key_cache.shape[1]
    low = summaries.low[group.table].transpose(1, 2)  # [queries, kv, pages, d]
    high = summaries.high[group.table].transpose(1, 2)
    bounds = page_bounds(q.unsqueeze(2), low, high)  # [queries, kv, groups, pages]
    scores = bounds if group.per_query_head else bounds.amax(2, keepdim=True)
    scores = scores.masked_fill(group.hidden, float("-inf")).masked_fill(group.forced, float("inf"))
    most = group.table.shape[1]
    ranked = scores.topk(group.taken.shape[-1], dim=-1).indices  # highest first
    chosen = ranked.masked_fill(~group.taken, most).sort(dim=-1).values.clamp(max=most - 1)  # ascending, untaken last
    rows_index = torch.arange(rows, device=q.device)[:, None, None, None]
    blocks = group.table[rows_index, chosen]  # [queries, kv, c, count]
    keys = paged.head_blocks(key_cache, layout.key_order, blocks, transposed=True)  # [queries, kv, c, count, d, size]
    values = paged.head_blocks(value_cache, layout.value_order, blocks).flatten(3, 4)  # [queries, kv, c, slots, d]
    c = chosen.shape[2]
    queries = q.view(rows, kv, 1, heads // kv, dim) if c == 1 else q.view(rows, kv, heads // kv, 1, dim)
    logits = torch.matmul(queries.unsqueeze(3).to(keys.dtype), keys)  # [queries, kv, c, count, g, size]
    logits = logits.transpose(3, 4).flatten(4).float() * scale  # [queries, kv, c, g, slots]
    weights = logits.masked_fill(~group.valid, float("-inf")).softmax(-1)
    return torch.matmul(weights.to(values.dtype), values).reshape(rows, heads, -1).to(q.dtype)
