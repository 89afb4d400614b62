"""A C++ kernel for the decode step of a per-step eviction method on a CPU: one query per row and query head over the
entries its kv head holds, with the logits and probabilities the method scores by, the entries read where they lie.

H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
arXiv 2306.14048, section 3), TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs", arXiv 2401.06104,
section 4) and Keyformer (Adnan et al., MLSys 2024, arXiv 2403.09054, eq. 9) evict by each step's attention over the
held entries, which no attention kernel returns, so the step's attention is computed by
:func:`attnkit.methods.scoring.attend_with_logits`. In vLLM's paged cache torch must first copy every held entry out
of its block (a gather per layer and step, the largest part of a per-step step there). The kernel
(``attnkit/native/decode.cpp``, built on first use by :mod:`attnkit.native` for ``$ATTNKIT_NATIVE_ISA``) reads each
entry once from where it lies, given as :class:`Entries` (a storage, each entry's element offset and the distance of
its numbers): the keys into tiles kept in the worker's caches, the value rows where they lie; every query head of the
kv group is swept over them. Its arithmetic never depends on where the entries lie, so attnkit's runner (a strided
cache tensor), ``AttnkitCache`` and vLLM's blocks (read in place) give the same bits, and therefore the same tokens;
it is written by hand because no library attends over entries addressed one by one and returns the probabilities.

With Keyformer's score (:class:`KeyformerScore`) the same call also computes eq. 9 of the step from its logits. The
kernel runs on OpenMP's threads (torch's pool where torch links the same runtime), one row and kv head each.

Where it runs (:func:`runs`): a CPU, float32, one query per row, no sliding-window mask, value heads a multiple of 16
wide, the kernel built and, by :mod:`attnkit.native.guard`, faster than torch's product-softmax-product
(:func:`torch_attend`) on this CPU: one comparison per machine, build and head size, a choice that depends on nothing
a host sets (its batches, a tensor-parallel worker's share of the heads), so every host on the machine makes the same
one. Elsewhere torch's operations run on a copy of the entries (:meth:`Entries.tensor`); both agree to float32
rounding (``tests/methods/test_decode_native.py``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from attnkit import native
from attnkit.native import guard

GUARD_ROWS, GUARD_KEYS = 32, 2048  # the guard's comparison, a serving batch: rows (requests), entries per kv head
GUARD_REPEATS = 15  # its timed runs of each path (short calls: more of them than the prompt kernels' comparisons)
_P, _I64, _F, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURE = ("attnkit_decode_attention",
             [_P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _F, _P, _P, _P, _P, _P, _P, _P, _P,
              _F, _I32, _P, _I32], _I32)
LOWEST = ("attnkit_lowest", [_P, _P, _P, _P, _I64, _I64, _I64, _P], None)


@dataclass(frozen=True)
class Entries:
    """Keys or values ``[b, kv, n, dim]`` that lie anywhere in `storage` (float32, a CPU tensor: its first element
    is offset 0): entry ``(row, head, j)`` starts at element ``offsets[row, head, j]`` (int64 ``[b, kv, n]``), its
    numbers `step` elements apart. A strided tensor (:meth:`of`) and vLLM's paged blocks are both this."""

    storage: torch.Tensor
    offsets: torch.Tensor
    step: int
    dim: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Entries:
        """The entries of a strided tensor ``[b, kv, n, dim]``, read where they lie."""
        b, kv, n, dim = t.shape
        s = t.stride()
        offsets = (torch.arange(b).view(-1, 1, 1) * s[0] + torch.arange(kv).view(1, -1, 1) * s[1]
                   + torch.arange(n).view(1, 1, -1) * s[2])
        return cls(t, offsets, s[3], dim)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.offsets.shape, self.dim))

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def nbytes(self) -> int:
        """The bytes of the entries themselves (not of the storage they lie in)."""
        return self.offsets.numel() * self.dim * self.storage.element_size()

    def __getitem__(self, index) -> Entries:
        """Entries picked along the first three axes (``[:, :, :n]``: a layer's filled slots)."""
        return Entries(self.storage, self.offsets[index], self.step, self.dim)

    def with_offsets(self, offsets: torch.Tensor) -> Entries:
        return Entries(self.storage, offsets, self.step, self.dim)

    def tensor(self) -> torch.Tensor:
        """A copy ``[b, kv, n, dim]``, for torch's operations."""
        return self._flat().take(self._numbers(self.offsets))

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the entries that start at element offsets `source` over those at `target` (pairwise, any shape),
        within the storage: the sets must not overlap."""
        flat = self._flat()
        flat[self._numbers(target).flatten()] = flat.take(self._numbers(source)).flatten()

    def _flat(self) -> torch.Tensor:
        """The storage from its first element on, one dimension."""
        store = self.storage
        return store.as_strided((store.untyped_storage().nbytes() // store.element_size() - store.storage_offset(),),
                                (1,))

    def _numbers(self, offsets: torch.Tensor) -> torch.Tensor:
        """Where every number of the entries at `offsets` lies: ``offsets.shape + (dim,)``."""
        return (offsets.unsqueeze(-1) + torch.arange(self.dim, device=offsets.device) * self.step).to(self.device)


def tensor(t: torch.Tensor | Entries) -> torch.Tensor:
    """`t` as a tensor (a copy of :class:`Entries`)."""
    return t.tensor() if isinstance(t, Entries) else t


def library() -> ctypes.CDLL | None:
    """The compiled kernel (:func:`attnkit.native.load`), or None."""
    return native.load("decode", SIGNATURE)


def runs(q: torch.Tensor, keys, values, visible) -> bool:
    """Whether :func:`attend` runs for these operands (see the module's docstring)."""
    return (q.shape[2] == 1 and visible is None and keys.dtype == values.dtype == q.dtype and keys.device == q.device
            and reads_in_place(q.device, q.dtype, q.shape[-1], values.shape[-1]))


def reads_in_place(device: torch.device, dtype: torch.dtype, dim: int, value_dim: int) -> bool:
    """Whether one query per row over entries of this kind runs on the kernel (where a host may hand it
    :class:`Entries` instead of copies)."""
    if not (device.type == "cpu" and dtype == torch.float32 and value_dim % 16 == 0):
        return False
    return choice(dim, value_dim).on


def choice(dim: int, value_dim: int) -> guard.Choice:
    """:func:`attnkit.native.guard.choose` for heads of this size: the kernel against torch's
    :func:`torch_attend` on :data:`GUARD_ROWS` rows of :data:`GUARD_KEYS` random
    entries, 8 query heads on 2 kv heads. The class leaves out the batch, the length, the head counts and the threads
    on purpose: a host's batches, or a tensor-parallel worker's share of the heads, must not change which arithmetic a
    request gets."""
    shape = f"decode d={dim} dv={value_dim} compared on {GUARD_ROWS} rows x {GUARD_KEYS} entries x {GUARD_REPEATS}"

    def measure():
        gen = torch.Generator().manual_seed(0)
        rq = torch.randn(GUARD_ROWS, 8, 1, dim, generator=gen)
        rk = torch.randn(GUARD_ROWS, 2, GUARD_KEYS, dim, generator=gen)
        rv = torch.randn(GUARD_ROWS, 2, GUARD_KEYS, value_dim, generator=gen)
        return guard.time_both(lambda: attend(rq, rk, rv, dim ** -0.5),
                               lambda: torch_attend(rq, rk, rv, dim ** -0.5),
                               repeats=GUARD_REPEATS)

    return guard.choose("decode", library(), shape, measure)


def torch_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                 visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~attnkit.methods.scoring.attend_with_logits` by torch's operations, on tensors: a product, a softmax
    and a product, any number of queries per row, `visible` a mask or None."""
    b, hq, n, d = q.shape
    kv, n_keys = keys.shape[1], keys.shape[2]
    g = hq // kv
    qg = q.reshape(b, kv, g * n, d)
    logits = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(scaling).view(b, kv, g, n, n_keys)
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.view(b, kv, g * n, n_keys).to(values.dtype), values)
    return out.view(b, hq, n, values.shape[-1]), logits, probs


@dataclass(frozen=True)
class KeyformerScore:
    """What :func:`attend` needs for Keyformer's score of the step (eq. 9 of arXiv 2403.09054): per row and query
    head ``softmax((logit + zeta) / tau)``, reduced over the kv group (``mean`` or ``max``). ``zeta`` of key position
    ``j`` is ``table[offsets[row, head] + j]`` (the draws of :mod:`attnkit.methods.keyformer_noise`), or `shift` for
    every key where `table` and `counters` are None; `positions` ``[b, kv, n]`` are the held keys' positions, `tau`
    ``[b]`` each row's temperature. With `counters` (:func:`~attnkit.methods.keyformer_noise.table_counters`) the
    kernel computes each Gumbel draw of the table from its counter instead of reading it: the same integers, the
    logarithms within about a float's last bit of torch's, and no cache miss per draw (a step's rows start at new
    random offsets of a table of millions of entries)."""

    table: torch.Tensor | None
    offsets: torch.Tensor | None
    positions: torch.Tensor
    tau: torch.Tensor
    reduce: str
    shift: float = 0.0
    counters: tuple[int, int, int, int] | None = None


def attend(q: torch.Tensor, keys: torch.Tensor | Entries, values: torch.Tensor | Entries, scaling: float,
           threads: int | None = None, score: KeyformerScore | None = None, logits: bool = True,
           probabilities: bool = True):
    """:func:`~attnkit.methods.scoring.attend_with_logits` for one query per row (`q` ``[b, hq, 1, d]``) by the
    kernel: the output ``[b, hq, 1, dv]``, the logits and the probabilities ``[b, kv, g, 1, n]`` (float32; either
    None where `logits` or `probabilities` is False: a caller that needs only some of them is spared writing the
    others); with `score`, Keyformer's score ``[b, kv, n]`` after them."""
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU decode kernel is not available (see runs)")
    b, hq, _, d = q.shape
    kv, n = keys.shape[1], keys.shape[2]
    dv = values.shape[-1]
    if tuple(keys.shape[:3]) != (b, kv, n) or tuple(values.shape[:3]) != (b, kv, n) or hq % kv or keys.shape[3] != d:
        raise ValueError(f"decode kernel: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)} "
                         f"do not fit")
    q = q if q.stride(-1) == 1 else q.contiguous()
    (kp, koff, ks), (vp, voff, vs) = (_address(t) for t in (keys, values))
    out = torch.empty(b, hq, 1, dv, dtype=torch.float32)
    shape = (b, kv, hq // kv, 1, n)
    probs = torch.empty(shape, dtype=torch.float32) if probabilities else None
    logits = torch.empty(shape, dtype=torch.float32) if logits else None
    weights = table = offsets = positions = tau = counters = None
    if score is not None:
        weights = torch.empty(b, kv, n, dtype=torch.float32)
        positions = score.positions.to(torch.int64).contiguous()
        tau = score.tau.to(torch.float32).expand(b).contiguous()
        if score.table is not None or score.counters is not None:
            table, offsets = score.table, score.offsets.to(torch.int64).reshape(b, hq).contiguous()
        if score.counters is not None:
            counters = _int64s(score.counters)
    code = lib.attnkit_decode_attention(
        q.data_ptr(), _int64s(q.stride()[:2]), b, hq, kv, n, d, dv, kp, _pointer(koff), ks, vp, _pointer(voff), vs,
        float(scaling), out.data_ptr(), _pointer(logits), _pointer(probs), _pointer(table), counters, _pointer(offsets),
        _pointer(positions), _pointer(tau), float(score.shift if score else 0.0),
        int(score is not None and score.reduce == "max"), _pointer(weights), threads or torch.get_num_threads())
    if code:
        raise ValueError(f"the CPU decode kernel refused q {tuple(q.shape)}, values {tuple(values.shape)} "
                         f"(code {code}): it takes value heads a multiple of 16 wide")
    return (out, logits, probs) if score is None else (out, logits, probs, weights)


def lowest(rank: torch.Tensor, protect: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`attnkit.methods.scoring.lowest` by the kernel's loop (``attnkit_lowest``): the slot ``[b, kv, 1]`` of the
    lowest-ranked unprotected entry per kv head, the same index as torch's argmin over the rank with the protected
    entries at +inf (a per-step method's victim: a few thousand numbers a layer and step, where torch's three
    operations cost more than their arithmetic). None where the loop does not run: not a float32 rank ``[b, kv, n]``
    on a CPU with a boolean mask (broadcast to it) or none, or the kernel not built (``ATTNKIT_NATIVE=0``)."""
    if rank.device.type != "cpu" or rank.dtype != torch.float32 or rank.dim() != 3 or (
            protect is not None and (protect.dtype != torch.bool or protect.device != rank.device)):
        return None
    lib = native.load("decode", LOWEST)
    if lib is None:
        return None
    b, kv, n = rank.shape
    if protect is not None:
        protect = protect.expand(b, kv, n)
    out = torch.empty(b, kv, 1, dtype=torch.int64)
    lib.attnkit_lowest(rank.data_ptr(), _int64s(rank.stride()), _pointer(protect),
                       _int64s(protect.stride()) if protect is not None else None, b, kv, n, out.data_ptr())
    return out


def _int64s(values) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _address(t: torch.Tensor | Entries) -> tuple[int, torch.Tensor | None, ctypes.Array]:
    """The kernel's view of keys or values: the first element's address, the entries' offsets (contiguous int64; None:
    a strided tensor's, from its strides) and the strides (row, head, entry, number)."""
    if isinstance(t, Entries):
        return t.storage.data_ptr(), t.offsets.to(torch.int64).contiguous(), _int64s((0, 0, 0, t.step))
    return t.data_ptr(), None, _int64s(t.stride())
