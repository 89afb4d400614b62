"""Keyformer's regularising noise: Gumbel (or Gaussian) draws added to the logits before the score
softmax (Adnan et al., MLSys 2024, "Keyformer: KV Cache Reduction through Key Tokens Selection for
Efficient Generative Inference", arXiv 2403.09054, eq. 4-6 and 11-12).

The paper draws one noise value per logit: per (layer, head, query, key). Hashing every pair costs more
than the attention itself on a long prompt, and torch's own generators (the CPU one; Philox on a GPU)
are no cheaper per draw on a CPU and would tie the draws to the device and to how the prompt is cut
into blocks. Instead the draws come from a fixed table of :data:`TABLE_SIZE` (plus the largest key
position) independent draws, entry t made from the uniforms hashed from t alone
(:func:`counter_uniforms`, then a Gumbel draw ``-log(-log(u))`` or, by Box-Muller, a Gaussian one with
the Gumbel's mean and standard deviation). The row of (seed, layer, head, query position) starts at a
hashed offset (:func:`row_offsets`), and the key at position j reads entry ``offset + j``: one hash per
row, and a prompt block's noise is a copy of contiguous table rows (:func:`table_draws`).

Within a row the draws are distinct table entries, so independent; rows start at independent uniform
offsets, so two rows share draws only where their windows of the table overlap, a fraction about
``keys / TABLE_SIZE`` of pairs, each time at other key positions. Because nothing depends on a
generator's state, the noise a (query, key) pair of a head gets does not depend on prompt chunking, on
the batch, on the slot the key occupies, on the device or on the order of computation, so a chunked or
per-head evicting run equals the dense reference draw for draw. :class:`DecodeNoise` computes the same
draws for decode steps.

The prompt's draws at temperature 1 are read as factors ``exp(zeta) = 1 / -log(u)`` (:func:`gumbel_factor`), and
those are rounded to bfloat16 in their table: a prompt's sweep reads one per query-key pair, each query row from its
own stretch of a table far larger than a CPU's caches, so the reads are what Keyformer's sweep adds to H2O's, and
two bytes a draw halve them (:mod:`attnkit.methods.scoring_native` reads the table as bfloat16). A draw zeta moves by
at most 0.004 (``exp(zeta)`` by at most 2^-8 of itself, half of bfloat16's step), against its spread of 1.28; every
host reads the same rounded entries.
"""

from __future__ import annotations

import functools
import math

import torch

from attnkit.session import LayerContext

NOISES = ("gumbel", "gaussian", "constant", "none")
EULER_GAMMA = 0.5772  # mean of the standard Gumbel distribution (Keyformer section 4.6.3)
GUMBEL_STD = 1.2825   # its standard deviation, pi / sqrt(6)


# ---- counter-based uniforms ---------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer mixing function (the MurmurHash3 finaliser) on Python ints or int64 tensors
    holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def _signed32(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


_M1, _M2 = _signed32(0x85EBCA6B), _signed32(0xC2B2AE35)
_KEY_SALT = 0x27220A95  # mixed into every key position before it is hashed


def _to_i32(x: torch.Tensor) -> torch.Tensor:
    """int64 tensor of values in [0, 2**32) -> int32 with the same bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _stream_base(seed: int, stream: int, second: bool) -> int:
    base = _mix32(_mix32((seed * 0x9E3779B1 + 0x632BE5AB) & _MASK32) ^ ((stream * 0x85EBCA77 + 0x27D4EB2F) & _MASK32))
    return _mix32(base ^ 0x5BD1E995) if second else base


def head_hashes(seed: int, stream: int, heads: torch.Tensor, second: bool = False) -> torch.Tensor:
    """The (seed, stream, head) part of :func:`counter_uniforms`'s row hash (int64, values < 2**32)."""
    return _mix32(heads.to(torch.int64) ^ _stream_base(seed, stream, second))


def row_hashes(heads_hashed: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """The row hash of :func:`counter_uniforms`: :func:`head_hashes` with the query position mixed in (int32)."""
    return _to_i32(_mix32(heads_hashed ^ q_pos.to(torch.int64)))


def row_hash_ints(heads_hashed: list[int], q: int) -> list[int]:
    """:func:`row_hashes` on Python ints for one query position (the int32 values, signed): cheaper than
    tensor operations for the few heads of a decode step."""
    return [_signed32(_mix32(h ^ q)) for h in heads_hashed]


def key_hashes(k_pos: torch.Tensor) -> torch.Tensor:
    """The column hash of :func:`counter_uniforms`, one per key position (int32)."""
    return _to_i32(_mix32(k_pos.to(torch.int64) ^ _KEY_SALT))


def uniforms_from_hashes(rows: torch.Tensor, keys: torch.Tensor,
                         buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Uniforms on (0, 1) from int32 :func:`row_hashes` and :func:`key_hashes`, broadcast together.

    Both hashes are already fully mixed, so their combination gets one multiply-xorshift-multiply round
    (enough to decorrelate rows that share keys; half the work of a full :func:`_mix32` at full size).
    `buffers`: two int32 tensors of the broadcast shape to compute in (the result is a float32 view of
    the second) instead of fresh ones."""
    x, scratch = buffers if buffers is not None else (None, None)
    x = torch.bitwise_xor(rows, keys, out=x).mul_(_M1)
    t = torch.bitwise_right_shift(x, 16, out=scratch)
    t &= 0xFFFF
    x ^= t
    x.mul_(_M2)
    # the top 23 bits as the mantissa of a float in [1, 2), shifted to (m + 1/2) / 2**23 in (0, 1) (exact)
    x = torch.bitwise_right_shift(x, 9, out=scratch)
    x &= 0x7FFFFF
    x |= 0x3F800000
    return x.view(torch.float32).sub_(1.0 - 2.0 ** -24)


def counter_uniforms(seed: int, stream: int, heads: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, second: bool = False) -> torch.Tensor:
    """Uniform draws on (0, 1) indexed by (seed, stream, head, query position, key position), broadcast
    together (float32).

    Each draw is a hash of its coordinates, so the noise a (query, key) pair of a head gets does not
    depend on chunking, on which slot the key occupies, on the device or on the order of computation.
    The (head, query) and key coordinates are mixed separately on the small tensors (:func:`row_hashes`,
    :func:`key_hashes`, which a caller may also compute once and reuse); only their combination is mixed
    at full size (:func:`uniforms_from_hashes`).
    """
    return uniforms_from_hashes(row_hashes(head_hashes(seed, stream, heads, second), q_pos), key_hashes(k_pos))


# ---- Keyformer's draws -----------------------------------------------------------------------------
# Draws are read from a table of TABLE_SIZE (+ the largest key position) independent draws: row (seed, layer,
# head, query position) starts at a hashed offset and key position j reads entry offset + j.
TABLE_SIZE = 1 << 22
_TABLES: dict[tuple[str, str, torch.dtype], torch.Tensor] = {}
_TABLE_CHUNK = {"cpu": 1 << 16}  # entries built at once, by device type (others: the whole table at once)
_TABLE_STREAM = 0x7AB1E  # the counter stream of the table's entries


@functools.cache
def table_counters() -> tuple[int, int, int, int]:
    """What a kernel needs to compute an entry of the draw table instead of reading it (the decode kernel's Gumbel
    draws, :mod:`attnkit.methods.decode_native`): the row hash of the table's entries (:func:`row_hashes` of its
    stream at head 0, query 0), the key salt of :func:`key_hashes` and the two multipliers of :func:`_mix32` and
    :func:`uniforms_from_hashes`, as unsigned 32-bit integers. Entry ``t`` is then
    ``uniforms_from_hashes(row, key_hashes(t))`` put through the kind's transform."""
    zero = torch.zeros(1, dtype=torch.int64)
    row = int(row_hashes(head_hashes(0, _TABLE_STREAM, zero), zero)) & _MASK32
    return row, _KEY_SALT, _M1 & _MASK32, _M2 & _MASK32


def _table(kind: str, device: torch.device, length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first `length` (or more) entries of the draw table of `kind` (gumbel, gaussian or factor: exp
    of the Gumbel draws, rounded to bfloat16) on `device`, as `dtype` (bfloat16: the factors, exactly). Entry t comes
    from the uniforms hashed from t alone, so the table is the same on every device and however far it has grown."""
    key = (kind, str(device), dtype)
    table = _TABLES.get(key)
    if dtype != torch.float32 and (table is None or table.shape[0] < length):
        table = _TABLES[key] = _table(kind, device, length).to(dtype)
    if table is None or table.shape[0] < length:
        size = TABLE_SIZE + (1 << max(16, (max(1, length - TABLE_SIZE) - 1).bit_length()))
        table = torch.empty(size, dtype=torch.float32, device=device)
        # elementwise, so built in chunks: a CPU keeps each chunk's temporaries in its caches instead of
        # streaming table-sized ones through memory (docs/benchmarks.md); the entries are the same either way
        chunk = _TABLE_CHUNK.get(device.type, size)
        for start in range(0, size, chunk):
            table[start:start + chunk] = _table_entries(kind, torch.arange(start, min(size, start + chunk),
                                                                           device=device))
        _TABLES[key] = table
    return table


def _table_entries(kind: str, t: torch.Tensor) -> torch.Tensor:
    """Entries `t` of the `kind` table (see :func:`_table`)."""
    heads = torch.zeros(1, dtype=torch.int64, device=t.device)
    u = counter_uniforms(0, _TABLE_STREAM, heads, heads, t)
    if kind == "gumbel":
        return gumbel_from_uniforms(u)
    if kind == "factor":  # exp(-log(-log u)) = 1 / -log(u), a bfloat16 value (the module's docstring)
        return u.log_().neg_().reciprocal_().to(torch.bfloat16).float()
    return gaussian_from_uniforms(u, counter_uniforms(0, _TABLE_STREAM, heads, heads, t, second=True))


def row_offsets(seed: int, layer: int, kv_heads: int, groups: int, q_pos: torch.Tensor,
                first_head: int = 0) -> torch.Tensor:
    """Where each (head, query) row of layer `layer` starts in the table: ``[1, kv, g, queries, 1]`` int64,
    hashed from (seed, layer, head, query position) into ``[0, TABLE_SIZE)``. The heads are the model's
    ``first_head ...`` (a tensor-parallel shard's: :func:`attnkit.heads.first_head`)."""
    heads = torch.arange(first_head, first_head + kv_heads * groups, device=q_pos.device).view(1, kv_heads, groups, 1, 1)
    rows = row_hashes(head_hashes(seed, layer, heads), q_pos.view(1, 1, 1, -1, 1))
    return rows.to(torch.int64) & (TABLE_SIZE - 1)


def table_draws(kind: str, offsets: torch.Tensor, k_pos: torch.Tensor, largest: int | None = None) -> torch.Tensor:
    """Entries ``offset + key position`` of the `kind` table for `offsets` ``[1, kv, g, queries, 1]`` and
    `k_pos` ``[keys]`` or ``[b, kv, keys]`` -> ``[1 or b, kv, g, queries, keys]``. Ascending contiguous
    1-D positions are copied row by row from a strided view of the table (one pass, no index tensor).
    `largest`: a bound on the key positions when the caller knows one (a decode step's query position), so
    the table's size needs no reduction over `k_pos` (and no read back from the device)."""
    kp = k_pos.view(1, 1, 1, 1, -1) if k_pos.dim() == 1 else k_pos[:, :, None, None, :]
    n = k_pos.shape[-1]
    table = _table(kind, offsets.device, TABLE_SIZE + (int(k_pos.max()) if largest is None else largest) + 1)
    if k_pos.dim() == 1 and n > 1 and int(k_pos[-1]) - int(k_pos[0]) == n - 1 and bool((k_pos[1:] > k_pos[:-1]).all()):
        rows = table.as_strided((table.shape[0] - n + 1, n), (1, 1))
        return rows.index_select(0, (offsets + int(k_pos[0])).flatten()).view(*offsets.shape[:-1], n)
    index = offsets + kp
    return table.index_select(0, index.view(-1)).view(index.shape)  # the entries take reads, faster on a CPU


def keyformer_noise(kind: str, seed: int, layer: int, kv_heads: int, groups: int, q_pos: torch.Tensor,
                    k_pos: torch.Tensor, first_head: int = 0) -> torch.Tensor | float:
    """The noise zeta added to the logits (eq. 4), broadcastable to ``[b, kv, g, queries, keys]``.

    `q_pos` is ``[queries]``; `k_pos` is ``[keys]`` or per kv head ``[b, kv, keys]``. Gumbel draws are
    ``-log(-log(u))`` (density eq. 5), Gaussian ones ``N(0.5772, 1.2825^2)`` (eq. 11, Box-Muller), read
    from the draw table at the row offset of (seed, layer, head, query position) plus the key position.
    """
    if kind == "none":
        return 0.0
    if kind == "constant":
        return EULER_GAMMA
    return table_draws(kind, row_offsets(seed, layer, kv_heads, groups, q_pos, first_head), k_pos)


def gumbel_factor(seed: int, layer: int, kv_heads: int, groups: int, q_pos: torch.Tensor,
                  k_pos: torch.Tensor, first_head: int = 0) -> torch.Tensor:
    """``exp(zeta)`` for the Gumbel draws ``zeta`` of :func:`keyformer_noise` (the same table entries, each
    ``exp(-log(-log u)) = 1 / -log(u)``). At temperature 1, eq. 9 is then ``p * exp(zeta)`` renormalised,
    with ``p`` the attention probabilities the output already needed: no second softmax."""
    return table_draws("factor", row_offsets(seed, layer, kv_heads, groups, q_pos, first_head), k_pos)


class GumbelFactorWeights:
    """Eq. 9 at temperature 1 with Gumbel noise, as the weights of
    :func:`attnkit.methods.scoring.attention_with_statistics`: ``softmax(x + zeta) = p * exp(zeta) / sum(p * exp(zeta))``
    from the attention probabilities ``p`` the output needed (no second softmax), with :func:`gumbel_factor`'s draws.
    :meth:`table_and_offsets` gives the same draws to a kernel that reads the table itself
    (:mod:`attnkit.methods.scoring_triton`)."""

    def __init__(self, seed: int, layer: int, kv_heads: int, first_head: int = 0):
        self.seed, self.layer, self.kv_heads, self.first_head = seed, layer, kv_heads, first_head

    def __call__(self, logits: torch.Tensor, probs: torch.Tensor, q_pos: torch.Tensor,
                 k_pos: torch.Tensor) -> torch.Tensor:
        probs *= gumbel_factor(self.seed, self.layer, self.kv_heads, logits.shape[2], q_pos, k_pos, self.first_head)
        return probs.div_(probs.sum(dim=-1, keepdim=True))

    def table_and_offsets(self, groups: int, q_pos: torch.Tensor, largest: int,
                          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The factor table (1-D, as `dtype`: float32, or bfloat16, which holds its entries exactly; covering key
        positions up to `largest`) and each (query head, query) row's offset into it, ``[kv_heads x groups, queries]``
        int64: the draw of key position j is ``table[offset + j]``."""
        offsets = row_offsets(self.seed, self.layer, self.kv_heads, groups, q_pos, self.first_head)
        table = _table("factor", q_pos.device, TABLE_SIZE + largest + 1, dtype)
        return table, offsets.reshape(self.kv_heads * groups, -1)


def gumbel_from_uniforms(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel draws ``-log(-log(u))`` (density eq. 5), computed in place in `u`."""
    return u.log_().neg_().log_().neg_()


def gaussian_from_uniforms(u: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """``N(0.5772, 1.2825^2)`` draws (eq. 11) from two uniforms by Box-Muller, computed in place in `u`."""
    return u.log_().mul_(-2.0).sqrt_().mul_(u2.mul_(2 * math.pi).cos_()).mul_(GUMBEL_STD).add_(EULER_GAMMA)


class DecodeNoise:
    """:func:`keyformer_noise` for decode steps, bit for bit, at a fraction of its cost.

    A decode step needs fresh noise for each (layer, head, held key) and the step's one query. The
    (layer, head) part of the row offsets is hashed once per generation, the query position is mixed in
    once per step for all layers together (on Python ints: a few small tensor operations would cost
    more); each layer then reads its held keys' entries from the table.
    """

    def __init__(self, kind: str, seed: int, n_layers: int, heads: int, device: torch.device, first_head: int = 0):
        self.kind = kind
        self.device = device
        self.n_heads = heads
        self.heads = [head_hashes(seed, layer, torch.arange(first_head, first_head + heads)).tolist()
                      for layer in range(n_layers)]
        self.step = None
        self.q = 0  # the step's query position
        self.offsets = torch.empty(0, dtype=torch.int64)
        self.head_table = None  # self.heads as a tensor, for stacked steps

    def __call__(self, ctx: LayerContext, k_pos: torch.Tensor) -> torch.Tensor:
        """Noise ``[b, kv, g, 1, keys]`` for the held keys at `k_pos` ``[b, kv, keys]`` of layer ``ctx.index``."""
        # every held key is at or before the query
        return table_draws(self.kind, self.row_offsets(ctx, k_pos.shape[1], k_pos.device), k_pos, largest=self.q)

    def table(self, device: torch.device) -> torch.Tensor:
        """The draw table on `device` (a layer's), covering :meth:`row_offsets` plus every key position up to the
        step's query."""
        return _table(self.kind, device, TABLE_SIZE + self.q + 1)

    def row_offsets(self, ctx: LayerContext, kv_heads: int, device: torch.device) -> torch.Tensor:
        """Where the step's rows start in :meth:`table`, per query head of layer ``ctx.index``: ``[1 or b, kv, g, 1,
        1]`` int64 on `device` (the layer's: the draw of key position j is ``table[offset + j]``)."""
        # a stacked step (attnkit.session.Step.per_row) has one query position per row: its offsets are kept for
        # those positions (the host's layers each build their own stacked step)
        queries = tuple(ctx.q_pos.flatten().tolist()) if ctx.step.per_row else None
        if self.step is not ctx.step and (queries is None or queries != self.step):  # first layer of a new step
            self.step = ctx.step if queries is None else queries
            if queries is None:
                self.q = int(ctx.q_pos[-1])
                rows = [[[h & (TABLE_SIZE - 1) for h in row_hash_ints(layer, self.q)] for layer in self.heads]]
                self.offsets = torch.tensor(rows, dtype=torch.int64).to(self.device)  # [1, layers, heads]
            else:  # many rows: the same hashes as tensor operations
                self.q = max(queries)
                if self.head_table is None:
                    self.head_table = torch.tensor(self.heads, dtype=torch.int64)
                at = torch.tensor(queries, dtype=torch.int64).view(-1, 1, 1)
                hashed = row_hashes(self.head_table[None], at).to(torch.int64)
                self.offsets = (hashed & (TABLE_SIZE - 1)).to(self.device)
        offsets = self.offsets[:, ctx.index].to(device)  # a few numbers per head, to this layer's device
        return offsets.view(-1, kv_heads, self.n_heads // kv_heads, 1, 1)
