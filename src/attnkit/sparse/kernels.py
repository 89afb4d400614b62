"""The sparse prefill kernel: one FlexAttention call per layer over a :class:`SparseLayout` (on a CPU in float32, one
call of the C++ kernel ``attnkit/native/sparse.cpp`` over the same tiles: :func:`native_sparse_attention`).

:func:`sparse_attention` runs :func:`torch.nn.attention.flex_attention.flex_attention` (compiled with
``torch.compile``, CPU and CUDA) with a ``BlockMask`` built directly from the layout's tile indices
(``BlockMask.from_kv_blocks``; no ``create_block_mask`` over the N x N grid). Tiles that need no mask
(strictly below the diagonal, inside the pattern) are passed as *full* blocks; only the diagonal tile, the
edges of an A-shape head's window and gathered tiles that straddle causality or hold an already-covered
column evaluate the ``mask_mod`` (the layout's token rule, :meth:`SparseLayout.token_rule`). The vertical
columns of each head are gathered behind the keys (the PIT idea of MInference 1.0's Alg. 5, Jiang et al.
2024, arXiv 2407.02490), so each head is one softmax. Sequence lengths are padded up to a few sizes per
octave (:func:`attnkit.sparse.patterns.padded_length`) so a compiled graph is reused across prompts; padded
rows have no tiles and cost nothing.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from attnkit import native
from attnkit.errors import AttnkitError
from attnkit.masks import and_, flex_mask_mod, sinks
from attnkit.native import guard
from attnkit.sparse.layout import SparseLayout, build_layout
from attnkit.sparse.patterns import padded_length
from attnkit.sparse.profile import timed

_COMPILED = None
GUARD_KEYS = 2048  # most keys of the guard's comparison
GUARD_SHARE = 0.25  # share of the causal tiles the guard's layout computes (MInference's layouts keep less)
_P, _I64, _F, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
NATIVE_SIGNATURE = ("attnkit_sparse_attention",
                    [_P, _P, _P, _P, _P, _P] + [_I64] * 6 + [_F] + [_I64] * 4 + [_P] * 5 + [_I64, _P, _P, _P, _I32],
                    _I32)


def _flex_fn(compiled: bool):
    if not compiled:
        return flex_attention
    global _COMPILED
    if _COMPILED is None:  # one compiled function for the process; dynamo keeps one graph per shape
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


def _compact(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[h, rows, W]`` bool -> BlockMask counts ``[1, h, rows]`` and indices ``[1, h, rows, W]`` (int32):
    the selected tile indices of each row first, ascending (work in proportion to the selected tiles)."""
    h, rows, w = sel.shape
    hh, rr, jj = sel.nonzero(as_tuple=True)  # row-major: ascending within each row
    counts = sel.sum(-1, dtype=torch.int32)
    row = hh * rows + rr
    starts = counts.flatten().cumsum(0) - counts.flatten()
    slot = torch.arange(row.shape[0], device=sel.device) - starts[row]
    idx = torch.zeros(h * rows * w, dtype=torch.int32, device=sel.device)
    idx[row * w + slot] = jj.to(torch.int32)
    return counts[None], idx.view(1, h, rows, w)


def block_mask(layout: SparseLayout, groups: int, q_len: int, n_pad: int, complete: bool = False) -> BlockMask:
    """The FlexAttention ``BlockMask`` of a layout, built from tile indices (``BlockMask.from_kv_blocks``).

    Keys are the padded keys (``n_pad``) followed, per kv head, by the gathered columns of its `groups`
    query heads (``C`` each); queries are ``q_len`` rows starting at position ``first_row * block``.
    The ``mask_mod`` is only evaluated on partial tiles by the compiled kernel; `complete` makes it exact
    on its own (eager FlexAttention applies it to every pair and ignores the tile lists)."""
    B = layout.block
    h, rows, nb = layout.main.shape
    width = 0 if layout.columns is None else layout.columns.shape[1]
    cb = width // B
    nbp = n_pad // B
    q_rows = q_len // B
    dev = layout.main.device

    def lay_out(main_part, vert_part):  # [h, rows, nb] (+ [h, rows, cb]) -> [h, q_rows, nbp + groups * cb]
        out = F.pad(main_part, (0, nbp - nb, 0, q_rows - rows))
        if not cb:
            return out
        segs = torch.zeros(h, rows, groups, cb, dtype=torch.bool, device=dev)
        heads = torch.arange(h, device=dev)
        segs[heads, :, heads % groups] = vert_part
        return torch.cat([out, F.pad(segs.view(h, rows, groups * cb), (0, 0, 0, q_rows - rows))], -1)

    num_p, idx_p = _compact(lay_out(layout.main & ~layout.main_full,
                                    layout.vert & ~layout.vert_full if cb else None))
    num_f, idx_f = _compact(lay_out(layout.main_full, layout.vert_full))

    main = layout.main
    qbase = torch.tensor(layout.first_row * B, device=dev)
    r0 = torch.tensor(layout.first_row, device=dev)
    token_rule = layout.token_rule()
    if complete:  # eager FlexAttention ignores the tile lists: the tile itself must be selected, among real keys
        token_rule = and_(token_rule, sinks(n_pad), layout.tile_rule())

    if not cb:
        mask_mod = flex_mask_mod(token_rule, q_pos=qbase, k_pos=0)
    else:
        # what the mask reads has the same shapes and strides for every prompt of this padded length, so the
        # compiled kernel is reused (a closure tensor's shape and strides, and every int it reads, such as an
        # unpadded row count, are guards of the compiled graph): the columns as a tensor of their own (they
        # may be a view into a tensor as long as the prompt), the tiles padded to the padded grid
        cols = layout.columns.contiguous()
        tiles = F.pad(main, (0, nbp - nb, 0, q_rows - rows))

        def mask_mod(b, h, q_idx, kv_idx):  # keys past n_pad: the gathered column c of query head h's group
            qa = q_idx + qbase
            c = kv_idx - n_pad - (h % groups) * width
            col = cols[h, c.clamp(0, width - 1)]
            row = (qa // B - r0).clamp(0, q_rows - 1)
            seen = (col < (qa // B) * B) & ~tiles[h, row, (col // B).clamp(0, nbp - 1)]
            if complete:
                seen = seen & (c >= 0) & (c < width)
            return torch.where(kv_idx < n_pad, token_rule(h, qa, kv_idx), seen)

    return BlockMask.from_kv_blocks(num_p, idx_p, num_f, idx_f, BLOCK_SIZE=B, mask_mod=mask_mod,
                                    seq_lengths=(q_len, n_pad + groups * width), compute_q_blocks=False)


def native_pays(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout) -> bool:
    """Whether :func:`sparse_attention` runs the C++ kernel (``attnkit/native/sparse.cpp``): float32 on a CPU, tiles
    of 16 to 64 keys (a multiple of 16), value heads a multiple of 16 wide, the kernel built
    (:func:`attnkit.native.load`), and faster than torch here (:func:`native_choice`)."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and layout.block % 16 == 0
            and layout.block <= 64 and v.shape[-1] % 16 == 0 and native_choice(q, k, v, layout).on)


def native_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout) -> guard.Choice:
    """:func:`attnkit.native.guard.choose` for this shape class (the heads, their sizes, the tile, the length class
    of the keys, the threads): the kernel against the path it replaces, FlexAttention compiled
    (:func:`flex_sparse_attention`), over one sparse layout of the class (random operands, at most
    :data:`GUARD_KEYS` keys, a fixed share of each query row's causal tiles chosen at random; the diagonal and
    first tiles always). Timing them on the pairs a sparse prefill computes is the point: over a dense layout, the
    comparison would miss what the kernel skips and FlexAttention pays per tile. The first comparison compiles
    FlexAttention once for the guard's shape (seconds, once per machine: the choice is cached)."""
    _, hq, _, d = q.shape
    kvh, n, dv = k.shape[1], k.shape[2], v.shape[-1]
    top, block = guard.bucket(n), layout.block
    shape = f"heads={hq}/{kvh} d={d} dv={dv} block={block} keys<={top} threads={torch.get_num_threads()}"

    def measure():
        gen = torch.Generator().manual_seed(0)
        keys = min(top, GUARD_KEYS)
        rq = torch.randn(1, hq, keys, d, generator=gen)
        rk, rv = torch.randn(1, kvh, keys, d, generator=gen), torch.randn(1, kvh, keys, dv, generator=gen)
        tiles = -(-keys // block)
        chosen = (torch.rand(hq, tiles, tiles, generator=gen) < GUARD_SHARE).tril()
        sparse = build_layout(["block_sparse"] * hq, keys, 0, block, tiles=chosen)
        return guard.time_both(lambda: native_sparse_attention(rq, rk, rv, sparse, d ** -0.5),
                               lambda: flex_sparse_attention(rq, rk, rv, sparse, d ** -0.5))

    return guard.choose("sparse", native.load("sparse", NATIVE_SIGNATURE), shape, measure)


def native_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout,
                            scaling: float) -> torch.Tensor:
    """:func:`sparse_attention` by the C++ kernel: per query head and query tile row, FlashAttention's online softmax
    over the layout's main tiles (the token rule inside the masked ones) and its tiles of gathered columns, nothing
    else computed, no graph compiled."""
    lib = native.load("sparse", NATIVE_SIGNATURE)
    if lib is None:
        raise RuntimeError("the sparse prefill kernel is not available (see native_pays)")
    _, hq, nq, d = q.shape
    kvh, n, dv = k.shape[1], k.shape[2], v.shape[-1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    flags = [None if t is None else t.to(torch.uint8).contiguous()
             for t in (layout.main, layout.main_full, layout.vert, layout.vert_full)]
    init, local = (t.to(torch.int64).contiguous() for t in (layout.init, layout.local))
    columns = None if layout.columns is None else layout.columns.to(torch.int64).contiguous()
    out = torch.empty(1, hq, nq, dv, dtype=torch.float32)
    strides = [torch.tensor(t.stride()[:3], dtype=torch.int64) for t in (q, k, v)]
    rows, tiles = layout.main.shape[1:]
    code = lib.attnkit_sparse_attention(
        q.data_ptr(), strides[0].data_ptr(), k.data_ptr(), strides[1].data_ptr(), v.data_ptr(), strides[2].data_ptr(),
        hq, kvh, nq, n, d, dv, float(scaling), layout.block, layout.first_row, rows, tiles, flags[0].data_ptr(),
        flags[1].data_ptr(), init.data_ptr(), local.data_ptr(), None if columns is None else columns.data_ptr(),
        0 if columns is None else columns.shape[1], None if flags[2] is None else flags[2].data_ptr(),
        None if flags[3] is None else flags[3].data_ptr(), out.data_ptr(), torch.get_num_threads())
    if code == 3:
        raise MemoryError(f"the sparse prefill kernel could not allocate its buffers for {n} keys")
    if code:
        raise AttnkitError(f"the sparse prefill kernel refused q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                           f"{tuple(v.shape)} with a layout of {layout.block}-token tiles (code {code})")
    return out


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout, scaling: float,
                     compiled: bool = True) -> torch.Tensor:
    """Attention of the layout's pairs in one FlexAttention call (see the module docstring) -> ``[1, hq, nq, d]``;
    on a CPU in float32 (`compiled`), one call of the C++ kernel instead (:func:`native_pays`,
    :func:`native_sparse_attention`), the same pairs.

    Queries are the last ``nq`` of the ``n`` contiguous key positions; batch size 1; q ``[1, q_heads, nq, d]``,
    k/v ``[1, kv_heads, n, d]`` (GQA: never expanded). `compiled=False` runs FlexAttention eagerly (it then
    materialises the scores: small inputs only)."""
    b, hq, nq = q.shape[:3]
    n = k.shape[2]
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise AttnkitError("sparse prefill on CPU is inference only (FlexAttention has no CPU backward); run it "
                           "under torch.inference_mode() or torch.no_grad()")
    if n != layout.n_keys or n - nq != layout.q_start or hq != layout.n_heads:
        raise AttnkitError(f"layout for {layout.n_heads} heads, {layout.n_keys} keys from query {layout.q_start} "
                           f"does not fit q {tuple(q.shape)} / k {tuple(k.shape)}")
    if compiled and b == 1 and native_pays(q, k, v, layout):
        with timed("kernel"):
            return native_sparse_attention(q, k, v, layout, scaling)
    return flex_sparse_attention(q, k, v, layout, scaling, compiled)


def flex_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout, scaling: float,
                          compiled: bool = True) -> torch.Tensor:
    """:func:`sparse_attention` by FlexAttention (the module docstring), whatever the device."""
    hq, nq, d = q.shape[1:]
    kvh, n = k.shape[1], k.shape[2]
    groups = hq // kvh
    B = layout.block
    with timed("build"):
        front = layout.q_start - layout.first_row * B
        q_len = padded_length(front + nq, B)
        n_pad = padded_length(n, B)
        width = 0 if layout.columns is None else layout.columns.shape[1]
        qp = q.new_zeros(1, hq, q_len, d)
        qp[:, :, front : front + nq] = q
        kp = k.new_zeros(1, kvh, n_pad + groups * width, d)
        vp = v.new_zeros(1, kvh, n_pad + groups * width, v.shape[-1])
        kp[:, :, :n] = k
        vp[:, :, :n] = v
        if width:
            idx = layout.columns.clamp(max=n - 1).reshape(kvh, groups * width)
            kp[0, :, n_pad:] = k[0].gather(1, idx[..., None].expand(-1, -1, d))
            vp[0, :, n_pad:] = v[0].gather(1, idx[..., None].expand(-1, -1, v.shape[-1]))
        mask = block_mask(layout, groups, q_len, n_pad, complete=not compiled)
    # the GPU kernel's tiles must divide the block (its default tiles may be larger than 64)
    options = {"BLOCK_M": B, "BLOCK_N": B} if q.device.type == "cuda" and compiled and B < 128 else None
    with timed("kernel"):
        fn = _flex_fn(compiled)
        with torch._dynamo.config.patch(recompile_limit=64):
            out = fn(qp, kp, vp, block_mask=mask, scale=scaling, enable_gqa=groups > 1, kernel_options=options)
    return out[:, :, front : front + nq]
