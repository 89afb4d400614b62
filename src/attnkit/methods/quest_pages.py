"""Quest's page summaries and page choice, as functions of tensors (Tang et al., 2024, "Quest: Query-Aware Sparsity
for Efficient Long-Context LLM Inference", arXiv 2406.10774, Section 3).

The cache's slots are cut into pages of ``page_size`` consecutive slots. Per page and kv head Quest keeps the
element-wise minimum ``m`` and maximum ``M`` of its keys; for a query ``q`` no key of the page can have a logit above

    U(q, page) = sum_i max(q_i m_i, q_i M_i) = relu(q) . M + min(q, 0) . m        (Quest, Section 3.2)

so each decoding step reads only the pages of highest bound. The bound is two small matrix products over the
summaries (``2 / page_size`` of the keys' bytes), never a product with the keys themselves.

:class:`PagedLayerKV` is the storage: a :class:`~attnkit.cache.LayerKV` that keeps the summaries up to date on every
append (a prompt chunk or a generated token), so a prompt prefilled in chunks has the summaries of one prefilled at
once, and whose byte count includes them. It never evicts: every entry stays, the step reads less.
:func:`choose_pages` is the selection every host calls (the page of each slot is ``slot // page_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.cache import LayerKV
from attnkit.errors import AttnkitError


@dataclass
class PagedLayerKV(LayerKV):
    """Keys and values of every token, with each page's element-wise key minimum and maximum ``[b, kv, pages, d]``
    (``page_min``/``page_max``; pages ``0 .. ceil(length / page_size) - 1`` are filled)."""

    page_size: int = 16
    page_min: torch.Tensor | None = None
    page_max: torch.Tensor | None = None

    @classmethod
    def around(cls, layer: LayerKV, page_size: int) -> PagedLayerKV:
        """Paged storage of the same shape as `layer` (empty), with room for the summaries of its capacity."""
        if layer.ring:
            raise AttnkitError("quest keeps every entry; a ring buffer cache cannot hold its pages")
        out = cls(layer.keys, layer.values, layer.positions, layer.length, False, layer.extras, page_size)
        out.page_min, out.page_max = out._summaries(out.capacity)
        return out

    def _summaries(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, kv, _, d = self.keys.shape
        pages = -(-capacity // self.page_size)
        return (self.keys.new_zeros(b, kv, pages, d), self.keys.new_zeros(b, kv, pages, d))

    @property
    def pages(self) -> int:
        """Filled pages (the last may be partial)."""
        return -(-self.length // self.page_size)

    def nbytes(self) -> int:
        return super().nbytes() + self.page_min.nbytes + self.page_max.nbytes

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        start = self.length
        super().append(k, v, pos)
        self._summarise(start, self.length)

    def _summarise(self, start: int, end: int) -> None:
        """Bring the summaries of the pages holding slots ``start .. end - 1`` up to date."""
        ps = self.page_size
        first = start // ps
        if end - start == 1 and start % ps:  # one token into a started page: fold it in, in place
            key = self.keys[:, :, start]
            torch.minimum(self.page_min[:, :, first], key, out=self.page_min[:, :, first])
            torch.maximum(self.page_max[:, :, first], key, out=self.page_max[:, :, first])
            return
        lo = first * ps
        whole = (end - lo) // ps
        if whole:
            blocks = self.keys[:, :, lo:lo + whole * ps].unflatten(2, (whole, ps))
            self.page_min[:, :, first:first + whole] = blocks.amin(3)
            self.page_max[:, :, first:first + whole] = blocks.amax(3)
        if lo + whole * ps < end:
            rest = self.keys[:, :, lo + whole * ps:end]
            self.page_min[:, :, first + whole] = rest.amin(2)
            self.page_max[:, :, first + whole] = rest.amax(2)

    def _grow(self, capacity: int) -> None:
        super()._grow(capacity)
        lo, hi = self._summaries(capacity)
        lo[:, :, :self.page_min.shape[2]] = self.page_min
        hi[:, :, :self.page_max.shape[2]] = self.page_max
        self.page_min, self.page_max = lo, hi

    def clone(self, rows: torch.Tensor | None = None) -> PagedLayerKV:
        base = super().clone(rows)
        rows = None if rows is None else rows.to(self.positions.device)
        out = PagedLayerKV(base.keys, base.values, base.positions, base.length, False, base.extras, self.page_size)
        out.page_min, out.page_max = ((t.clone() if rows is None else t[rows]) for t in (self.page_min, self.page_max))
        return out

    def keep_rows(self, rows: torch.Tensor) -> None:
        super().keep_rows(rows)
        rows = rows.to(self.positions.device)
        self.page_min, self.page_max = self.page_min[rows], self.page_max[rows]

    def keep(self, indices: torch.Tensor, spare: int = 0) -> None:
        raise AttnkitError("quest keeps every entry of the cache; it does not compose with a method that evicts")

    def write_slots(self, slots, k, v, pos) -> None:
        raise AttnkitError("quest keeps every entry of the cache; it does not compose with a method that evicts")

    write_slot = write_slots


def page_bounds(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of each page's logits ``[b, kv, g, pages]`` for one query per head, q ``[b, hq, 1, d]``
    (unscaled; the scale is positive and changes no ranking), summaries ``[b, kv, pages, d]``."""
    b, hq, _, d = q.shape
    kv = page_min.shape[1]
    qg = q.reshape(b, kv, hq // kv, d)
    return qg.clamp(min=0) @ page_max.transpose(-1, -2) + qg.clamp(max=0) @ page_min.transpose(-1, -2)


def choose_pages(bounds: torch.Tensor, count: int, per_query_head: bool, visible_from: int | None = None,
                 page_size: int = 16, first: bool = False) -> torch.Tensor:
    """The `count` pages each kv head reads (``[b, kv, 1, count]``; ``[b, kv, g, count]`` with `per_query_head`), in
    ascending page order, from `bounds` ``[b, kv, g, pages]`` (:func:`page_bounds`): the last (current) page always
    (as Quest's kernel), the first too with `first`, then the highest bounds. A kv group shares one choice by the
    maximum of its query heads' bounds (the group reads the same entries, so the cache is read once per kv head; a
    page stays when any head of the group may attend to it strongly), or each query head has its own (the paper's
    multi-head rule). With `visible_from` (a sliding-window layer: slots, which are positions, below it are hidden)
    a page entirely before it is never chosen over a visible one, and the first page is never forced."""
    scores = bounds if per_query_head else bounds.amax(2, keepdim=True)
    scores = scores.clone()
    pages = scores.shape[-1]
    scores[..., -1] = float("inf")
    if visible_from is None or visible_from <= 0:
        if first:
            scores[..., 0] = float("inf")
    else:
        hidden = (torch.arange(pages, device=scores.device) + 1) * page_size <= visible_from
        scores.masked_fill_(hidden, float("-inf"))
    return scores.topk(count, dim=-1, sorted=False).indices.sort(dim=-1).values


def gathered_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor,
                       page_size: int, length: int, scaling: float, visible_from: int = 0) -> torch.Tensor:
    """Attention ``[b, hq, 1, dv]`` of one query per head over the chosen `pages` ``[b, kv, c, p]`` (see
    :func:`choose_pages`) of keys/values ``[b, kv, slots, d]``, with torch: the pages' entries gathered, the slots at or
    past `length` or below `visible_from` masked. The reference the kernels are tested against, and the path where
    no kernel runs."""
    b, hq, _, d = q.shape
    kv, c = keys.shape[1], pages.shape[2]
    g = hq // kv
    slots = (pages.unsqueeze(-1) * page_size + torch.arange(page_size, device=pages.device)).flatten(-2)
    valid = (slots < length) & (slots >= visible_from)
    slots = slots.clamp(max=length - 1)

    def gather(t: torch.Tensor) -> torch.Tensor:
        index = slots.unsqueeze(-1).expand(-1, -1, -1, -1, t.shape[-1])
        return t.unsqueeze(2).expand(-1, -1, c, -1, -1).gather(3, index)

    # [b, kv, c, queries, d]: a group's queries side by side over its shared pages, or each head over its own
    queries = q.reshape(b, kv, 1, g, d) if c == 1 else q.reshape(b, kv, g, 1, d)
    mask = None if bool(valid.all()) else valid.unsqueeze(-2)
    out = torch.nn.functional.scaled_dot_product_attention(queries, gather(keys), gather(values), attn_mask=mask,
                                                           scale=scaling)
    return out.reshape(b, hq, 1, values.shape[-1])
