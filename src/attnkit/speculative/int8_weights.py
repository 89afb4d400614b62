"""A draft that runs the model at int8 weights (``--draft-weights int8``): weight-only int8 copies of a
model's linear layers, beside its own, for drafting only.

Self-speculation (TriForce, Sun et al. 2024, arXiv 2404.11912; MagicDec, Chen et al. 2024, arXiv
2408.11049) drafts with the target's weights over a compressed cache. Where the weights, not the cache,
are most of what a draft forward costs (a small model, a CPU), the draft can also run them at lower
precision, as QuantSpec (Tiwari et al. 2025, "QuantSpec: Self-Speculative Decoding with Hierarchical
Quantized KV Cache", ICML, arXiv 2502.10424: the target's architecture at 4-bit weights and a 4-bit KV
cache drafts, the target verifies) and QSpec (Zhao et al. 2024, arXiv 2410.11305: drafts at low
precision, verifies at high) do. Losslessness does not depend on it: the target verifies with its own
weights, and the acceptance rule uses the distribution the draft really drew from (Leviathan et al.
2023, arXiv 2211.17192, section 2.3).

Each linear layer's weight ``W`` ``[out, in]`` is stored as int8 with one scale per output channel
(symmetric absmax, round to nearest):

    s_j = max_i |W_ji| / 127,    Q_ji = round(W_ji / s_j) in [-127, 127],    y = (x Q^T) * s (+ bias)

computed by torch's weight-only int8 kernel (``aten::_weight_int8pack_mm``) on activations in bfloat16
for a float32 model (its float32-activation path is much slower on a CPU), else in the model's dtype.
The copies cost a quarter of the float32 weights' bytes; embeddings, norms and rotary tables are shared
with the model, not copied.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.errors import AttnkitError
from attnkit.model import LoadedModel
from attnkit.validate import choice

DRAFT_WEIGHTS = ("same", "int8")  # "same": the draft runs the model's own weights

# The kernel's bfloat16 path reads the input dimension in blocks: on some torch builds (CPU) an input
# dimension that is not a multiple of 16 crashed it (7, 100) or gave wrong results (200). Inputs are
# zero-padded to a multiple of this instead (the padded columns of the weight are zero too).
_INPUT_MULTIPLE = 16
_INT8_MM = torch.ops.aten._weight_int8pack_mm


def check_draft_weights(value, name: str = "draft_weights") -> str:
    """The draft's weights: ``"same"`` (None means the same) or ``"int8"``; a clear error otherwise."""
    return "same" if value is None else choice(name, value, DRAFT_WEIGHTS)


class Int8WeightLinear(nn.Module):
    """``nn.Linear`` with its weight held as int8 and per-output-channel scales (module docstring)."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype):
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pad = (-self.in_features) % _INPUT_MULTIPLE
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        quantized = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("qweight", F.pad(quantized, (0, self.pad)).contiguous())
        self.register_buffer("scale", scale.to(compute_dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def dequantized_weight(self) -> torch.Tensor:
        """``Q * s`` ``[out, in]`` in float32: the weight this layer multiplies by."""
        return self.qweight[:, :self.in_features].float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).to(self.scale.dtype)  # the activations' dtype for the kernel
        if self.pad:
            flat = F.pad(flat, (0, self.pad))
        y = _INT8_MM(flat, self.qweight, self.scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, {self.scale.dtype}"


def _with_int8_linears(module: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
    """A copy of the module tree in which every ``nn.Linear`` is an :class:`Int8WeightLinear`; every other
    module is a shallow copy holding the very same parameters and buffers (nothing else is copied)."""
    if isinstance(module, nn.Linear):
        return Int8WeightLinear(module, compute_dtype)
    clone = copy.copy(module)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {name: None if child is None else _with_int8_linears(child, compute_dtype)
                      for name, child in module._modules.items()}
    return clone


def _check_kernel(device: torch.device, dtype: torch.dtype) -> None:
    try:
        _INT8_MM(torch.zeros(1, _INPUT_MULTIPLE, dtype=dtype, device=device),
                 torch.zeros(1, _INPUT_MULTIPLE, dtype=torch.int8, device=device),
                 torch.ones(1, dtype=dtype, device=device))
    except (NotImplementedError, RuntimeError) as exc:
        raise AttnkitError(f"int8 draft weights need torch's weight-only int8 kernel (aten::_weight_int8pack_mm) "
                           f"for {device.type} with {dtype} activations, which this torch build does not have "
                           f"({str(exc).splitlines()[0]}); draft with the model's own weights instead "
                           f"(draft weights 'same')") from None


def int8_weight_view(model: LoadedModel) -> LoadedModel:
    """`model` with int8 copies of its linear layers (the LM head included) and everything else shared:
    a second :class:`LoadedModel` to draft with. The model itself is not changed."""
    if model.placed:  # the copies are made from weights in memory, on one device
        raise AttnkitError(f"int8 draft weights need the model's weights in memory on one device; model "
                           f"{model.spec!r} is placed by device_map (offloaded or spread): draft with the model's "
                           f"own weights (draft weights 'same')")
    dtype = model.dtype
    compute = torch.bfloat16 if dtype == torch.float32 else dtype
    _check_kernel(model.device, compute)
    with torch.no_grad():
        hf = _with_int8_linears(model.hf, compute)
    return LoadedModel(hf, model.tokenizer, model.geometry, model.spec)


def int8_bytes(model: LoadedModel) -> int:
    """Bytes of the int8 copies (weights, scales, biases) a view from :func:`int8_weight_view` holds."""
    return sum(b.nbytes for m in model.hf.modules() if isinstance(m, Int8WeightLinear)
               for b in m.buffers(recurse=False))
