"""Keyformer's regularising noise: Gumbel (or Gaussian) draws added to the logits before the score
softmax (Adnan et al., MLSys 2024, "Keyformer: KV Cache Reduction through Key Tokens Selection for
Efficient Generative Inference", arXiv 2403.09054, eq. 4-6 and 11-12).

Each draw is a hash of its coordinates (seed, layer, head, query position, key position) turned into a
uniform on (0, 1) (:func:`counter_uniforms`), then into a Gumbel draw ``-log(-log(u))`` or, by Box-Muller,
a Gaussian one with the Gumbel's mean and standard deviation. Because nothing depends on a generator's
state, the noise a (query, key) pair of a head gets does not depend on prompt chunking, on the slot the
key occupies, on the device or on the order of computation, so a chunked or per-head evicting run equals
the dense reference draw for draw. :class:`DecodeNoise` computes the same draws for decode steps at a
fraction of the cost.

Why a hash and not torch's own generators (Philox on a GPU, the CPU generator): a generator would have
to be seeded per (seed, layer, block of query positions) and draw a whole block of keys to keep the
draws independent of chunking, and on a CPU torch's generator produces a uniform more slowly than the
hash combines two precomputed 32-bit hashes (``benchmarks/bench_scoring.py``'s notes in
``docs/benchmarks.md``), besides tying the draws to the device. The hash keeps every guarantee above
at a lower cost.
"""

from __future__ import annotations

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
    return _to_i32(_mix32(k_pos.to(torch.int64) ^ 0x27220A95))


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
def keyformer_noise(kind: str, seed: int, layer: int, kv_heads: int, groups: int, q_pos: torch.Tensor,
                    k_pos: torch.Tensor) -> torch.Tensor | float:
    """The noise zeta added to the logits (eq. 4), broadcastable to ``[b, kv, g, queries, keys]``.

    `q_pos` is ``[queries]``; `k_pos` is ``[keys]`` or per kv head ``[b, kv, keys]``. Gumbel draws are
    ``-log(-log(u))`` (density eq. 5), Gaussian ones ``N(0.5772, 1.2825^2)`` (eq. 11, Box-Muller), with
    ``u`` hashed from (seed, layer, head, query position, key position).
    """
    if kind == "none":
        return 0.0
    if kind == "constant":
        return EULER_GAMMA
    u = _uniforms(seed, layer, kv_heads, groups, q_pos, k_pos)
    if kind == "gumbel":
        return gumbel_from_uniforms(u)
    return gaussian_from_uniforms(u, _uniforms(seed, layer, kv_heads, groups, q_pos, k_pos, second=True))


def gumbel_factor(seed: int, layer: int, kv_heads: int, groups: int, q_pos: torch.Tensor,
                  k_pos: torch.Tensor) -> torch.Tensor:
    """``exp(zeta)`` for the Gumbel draws ``zeta`` of :func:`keyformer_noise` (the same uniforms ``u``):
    ``exp(-log(-log u)) = 1 / -log(u)``. At temperature 1, eq. 9 is then ``p * exp(zeta)`` renormalised,
    with ``p`` the attention probabilities the output already needed: one logarithm per pair instead of
    two and the exponential of a second softmax."""
    return _uniforms(seed, layer, kv_heads, groups, q_pos, k_pos).log_().neg_().reciprocal_()


def _uniforms(seed: int, layer: int, kv_heads: int, groups: int, q_pos: torch.Tensor, k_pos: torch.Tensor,
              second: bool = False) -> torch.Tensor:
    """:func:`counter_uniforms` of layer `layer` shaped ``[1 or b, kv, g, queries, keys]``."""
    heads = torch.arange(kv_heads * groups, device=q_pos.device).view(1, kv_heads, groups, 1, 1)
    qp = q_pos.view(1, 1, 1, -1, 1)
    kp = k_pos.view(1, 1, 1, 1, -1) if k_pos.dim() == 1 else k_pos[:, :, None, None, :]
    return counter_uniforms(seed, layer, heads, qp, kp, second)


def gumbel_from_uniforms(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel draws ``-log(-log(u))`` (density eq. 5), computed in place in `u`."""
    return u.log_().neg_().log_().neg_()


def gaussian_from_uniforms(u: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """``N(0.5772, 1.2825^2)`` draws (eq. 11) from two uniforms by Box-Muller, computed in place in `u`."""
    return u.log_().mul_(-2.0).sqrt_().mul_(u2.mul_(2 * math.pi).cos_()).mul_(GUMBEL_STD).add_(EULER_GAMMA)


class DecodeNoise:
    """:func:`keyformer_noise` for decode steps, bit for bit, at a fraction of its cost.

    A decode step needs fresh noise for each (layer, head, held key) and the step's one query. Of the
    hashes behind the draws (:func:`counter_uniforms`), the (layer, head) part
    is computed once per generation, the query position is mixed in once per step for all layers
    together (on Python ints: a few small tensor operations would cost more), and the key-position
    hashes are looked up in a table over positions (grown on demand); each layer then only combines
    them at full size, in buffers reused from step to step.
    """

    def __init__(self, kind: str, seed: int, n_layers: int, heads: int, device: torch.device):
        self.kind = kind
        self.device = device
        self.n_heads = heads
        h = torch.arange(heads)
        draws = (False,) if kind == "gumbel" else (False, True)
        self.heads = {second: [head_hashes(seed, layer, h, second).tolist() for layer in range(n_layers)]
                      for second in draws}
        self.keys = key_hashes(torch.arange(0, device=device))
        self.step = None
        self.rows: dict[bool, torch.Tensor] = {}
        self.buffers = [torch.empty(0, dtype=torch.int32, device=device)] * 3

    def _new_step(self, q: int) -> None:
        if q >= self.keys.shape[0]:
            self.keys = key_hashes(torch.arange(max(q + 1, 2 * self.keys.shape[0]), device=self.device))
        self.rows = {second: torch.tensor([row_hash_ints(layer, q) for layer in table],
                                          dtype=torch.int32).to(self.device)
                     for second, table in self.heads.items()}

    def __call__(self, ctx: LayerContext, k_pos: torch.Tensor) -> torch.Tensor:
        """Noise ``[b, kv, g, 1, keys]`` for the held keys at `k_pos` ``[b, kv, keys]`` of layer ``ctx.index``;
        valid until the next call (it lives in a buffer reused by every call of the same shape)."""
        if self.step is not ctx.step:  # first layer of a new step
            self.step = ctx.step
            self._new_step(int(ctx.q_pos[-1]))
        b, kv_heads, n = k_pos.shape
        groups = self.n_heads // kv_heads
        shape = (b, kv_heads, groups, 1, n)
        if self.buffers[0].shape != shape:
            self.buffers = [torch.empty(shape, dtype=torch.int32, device=k_pos.device) for _ in range(3)]
        x, first, second = self.buffers
        cols = self.keys.take(k_pos)[:, :, None, None, :]
        u = [uniforms_from_hashes(rows[ctx.index].view(1, kv_heads, groups, 1, 1), cols, (x, out))
             for rows, out in zip(self.rows.values(), (first, second))]
        return gumbel_from_uniforms(*u) if self.kind == "gumbel" else gaussian_from_uniforms(*u)
