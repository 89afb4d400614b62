"""Fast KVzip's gates: per layer, a small attention-like module that scores every token's KV entry from the layer's
input hidden states (Kim, Han, Yun, 2026, "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV
Eviction", arXiv 2601.17668, section 3: the "low-rank sink attention" gate), and the files that hold their weights
(written by ``attnkit calibrate fastkvzip``, read by ``fastkvzip:config=FILE``).

**The gate** of layer ``l``, for a token whose attention input (the hidden state after the layer's input norm) is
``x`` (``D`` values), with ``H`` kv heads, ``G`` gate queries per kv head, a gate dimension ``d`` (16 in the
paper) and ``S`` learnt sink keys per kv head (16 in the paper)::

    q[h, g] = RMSNorm(W_q x + b_q)[h, g]  (d values)      k[h] = RMSNorm(W_k x)[h]  (d values)
    l[h, g]    = q[h, g] . k[h] / sqrt(d) + b[h, g]
    l_s[h, g]  = q[h, g] . k_base[h, s] / sqrt(d)          (s < S)
    gate[h, g] = exp(l) / (exp(l) + sum_s exp(l_s)) = 1 / (1 + sum_s exp(l_s - l[h, g]))
    score[h]   = mean over g of gate[h, g]                in (0, 1)

so a token's own key competes, inside a softmax, with ``S`` sink keys that the query of the same token also sees:
the score says how much of the token's attention mass its own entry would keep against a learnt baseline. Both
norms are RMSNorms over the ``d`` values with a learnt scale (epsilon 1e-6). Computed in float32.

**Files.** Two formats are read:

- kvpress's and the authors' (``Jang-Hyun/Fast-KVzip`` on the Hugging Face hub, ``<model>/q{G}_dim16_sink16.pt``):
  a ``torch.save`` dictionary whose ``"module"`` entry is the list of the layers' state dicts (``q_proj.weight``
  ``[H*G*d, D]``, ``q_proj.bias``, ``k_proj.weight`` ``[H*d, D]``, ``q_norm.weight`` ``[d]``, ``k_norm.weight``,
  ``k_base`` ``[H, 1, S, d]``, ``b`` ``[H, 1, G]``), loaded with ``weights_only=True`` (the numpy arrays of its
  training curves allowed, nothing else); any dtype, upcast to float32. It carries no record of its model, so only
  the geometry is checked.
- attnkit's: safetensors with the same tensors named ``layers.{l}.<name>``, float32, and metadata (JSON under
  ``attnkit``) recording the model, its geometry, a fingerprint of each layer's key projection and the training
  settings, so another model's weights are refused in one line.

:func:`save_kvpress_format` writes the first format from the second, so the same weights load into kvpress's
``FastKVzipGate`` modules (``benchmarks/compare_kvpress.py --fastkvzip``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attnkit.errors import AttnkitError
from attnkit.methods.kvzap_predictor import FINGERPRINT_TOLERANCE, fingerprint

FORMAT = "attnkit-fastkvzip-1"
NAMES = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight", "k_base", "b")
NORM_EPS = 1e-6  # the RMSNorms' epsilon (Qwen3's RMSNorm default, as the authors' gate uses)
HINT = "train gates for it with `attnkit calibrate fastkvzip --model M --out FILE`"


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight


def gate_scores(w: dict, hidden: torch.Tensor) -> torch.Tensor:
    """Scores ``[b, H, n]`` (float32, in (0, 1)) of attention inputs ``[b, n, D]`` under one layer's gate `w`."""
    x = hidden.float()
    b, n, _ = x.shape
    heads, _, sinks, d = w["k_base"].shape
    group = w["b"].shape[-1]
    q = rms_norm(torch.nn.functional.linear(x, w["q_proj.weight"], w["q_proj.bias"]).view(b, n, heads, group, d),
                 w["q_norm.weight"])
    k = rms_norm(torch.nn.functional.linear(x, w["k_proj.weight"]).view(b, n, heads, d), w["k_norm.weight"])
    scale = 1.0 / math.sqrt(d)
    own = torch.einsum("bnhgd,bnhd->bhng", q, k) * scale + w["b"].view(1, heads, 1, group)  # [b, H, n, G]
    if sinks == 0:  # no sink keys: a plain sigmoid of the token's own logit
        return torch.sigmoid(own).mean(-1)
    base = torch.einsum("bnhgd,hsd->bhnsg", q, w["k_base"].view(heads, sinks, d)) * scale  # [b, H, n, S, G]
    gate = 1.0 / (1.0 + torch.exp(base - own.unsqueeze(3)).sum(3))
    return gate.mean(-1)


@dataclass(frozen=True)
class FastKVzipGates:
    """Trained gates: one dict of float32 CPU tensors per layer (:data:`NAMES`), the file's metadata and source."""

    layers: list
    meta: dict
    source: str
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.layers[0]["k_proj.weight"].shape[1])

    @property
    def kv_heads(self) -> int:
        return int(self.layers[0]["k_base"].shape[0])

    @property
    def group(self) -> int:
        return int(self.layers[0]["b"].shape[-1])

    def scores(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Gate scores ``[b, kv_heads, n]`` of layer `layer`'s attention inputs ``[b, n, D]``."""
        key = (layer, hidden.device)
        w = self._on_device.get(key)
        if w is None:
            w = self._on_device[key] = {name: t.to(hidden.device) for name, t in self.layers[layer].items()}
        return gate_scores(w, hidden)

    def check_model(self, n_layers: int, hidden_size: int, kv_heads: int) -> None:
        """Refuse, in one line, a model whose geometry is not the one these gates were trained for."""
        if (n_layers, hidden_size, kv_heads) != (self.n_layers, self.hidden_size, self.kv_heads):
            raise AttnkitError(f"{self.source} holds gates for {self.meta.get('model', 'a model')!r} "
                               f"({self.n_layers} layers, hidden size {self.hidden_size}, {self.kv_heads} kv heads) "
                               f"but the model has {n_layers} layers, hidden size {hidden_size}, {kv_heads} kv heads; "
                               f"{HINT}")

    def check_layer(self, layer: int, module) -> None:
        """Refuse, in one line, a layer whose key projection is not the one the gates were trained on (attnkit's
        files only: kvpress's record no fingerprint)."""
        recorded = (self.meta.get("fingerprints") or [None] * self.n_layers)[layer]
        got = None if recorded is None or module is None else fingerprint(module)
        if got is not None and abs(got - recorded) > FINGERPRINT_TOLERANCE * max(abs(recorded), 1e-30):
            raise AttnkitError(f"{self.source} was trained on the weights of {self.meta.get('model', '?')!r}, not this "
                               f"model's (layer {layer}'s key projection differs); {HINT}")


def _checked(layers: list[dict], source: str) -> list[dict]:
    """The layers' tensors as float32, refused in one line unless every layer holds the same well-shaped gate."""
    if not layers:
        raise AttnkitError(f"{source}: no layer's gate in the file")
    out = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or set(layer) != set(NAMES):
            got = sorted(layer) if isinstance(layer, dict) else type(layer).__name__
            raise AttnkitError(f"{source}: layer {i}'s gate holds {got}, expected {list(NAMES)}")
        out.append({name: torch.as_tensor(layer[name]).detach().float().cpu() for name in NAMES})
    w = out[0]
    if w["k_base"].dim() != 4 or w["b"].dim() != 3 or w["k_proj.weight"].dim() != 2:
        raise AttnkitError(f"{source}: k_base must be [H, 1, S, d], b [H, 1, G], k_proj.weight [H*d, D]")
    heads, _, _, d = w["k_base"].shape
    group, hidden = w["b"].shape[-1], w["k_proj.weight"].shape[1]
    shapes = {"q_proj.weight": (heads * group * d, hidden), "q_proj.bias": (heads * group * d,),
              "k_proj.weight": (heads * d, hidden), "q_norm.weight": (d,), "k_norm.weight": (d,),
              "k_base": tuple(w["k_base"].shape), "b": (heads, 1, group)}
    for i, layer in enumerate(out):
        for name, shape in shapes.items():
            if tuple(layer[name].shape) != shape:
                raise AttnkitError(f"{source}: layer {i}'s {name} has shape {tuple(layer[name].shape)}, expected "
                                   f"{shape} (the layers' gates must agree)")
            if not bool(torch.isfinite(layer[name]).all()):
                raise AttnkitError(f"{source}: layer {i}'s {name} holds non-finite values")
    return out


def _load_torch(path: str, source: str) -> list:
    import numpy as np  # the authors' files hold their training curves as numpy arrays beside the weights

    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    allowed = [np.ndarray, np.dtype, reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct")]
    allowed += [getattr(np.dtypes, name) for name in ("Float64DType", "Float32DType") if hasattr(np, "dtypes")]
    try:
        with torch.serialization.safe_globals(allowed):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise AttnkitError(f"{source} is neither attnkit's safetensors gates nor kvpress's torch file of gates "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); {HINT}") from None
    layers = data.get("module") if isinstance(data, dict) else data
    if not isinstance(layers, (list, tuple)):
        raise AttnkitError(f"{source}: kvpress's gate file holds a dictionary with a 'module' list of per-layer state "
                           f"dicts; this one holds {type(layers).__name__}")
    return list(layers)


def load_gates(path) -> FastKVzipGates:
    """Gates from attnkit's safetensors file or kvpress's torch file (see the module docstring), refused in one
    line if the file is neither."""
    source = f"fastkvzip config {str(path)!r}"
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        raise AttnkitError(f"{source} does not exist; {HINT} (or give kvpress's q{{G}}_dim16_sink16.pt)")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception:  # not safetensors: kvpress's torch file
        return FastKVzipGates(_checked(_load_torch(str(path), source), source), {}, source)
    if header.get("format") != FORMAT:
        raise AttnkitError(f"{source} is not a fastkvzip gate file (format {header.get('format')!r}, expected "
                           f"{FORMAT!r}); {HINT}")
    meta = json.loads(header.get("attnkit", "{}"))
    layers, i = [], 0
    while f"layers.{i}.k_base" in tensors:
        layers.append({name: tensors.pop(f"layers.{i}.{name}", None) for name in NAMES})
        i += 1
    if tensors:
        raise AttnkitError(f"{source}: unexpected tensors {', '.join(sorted(tensors)[:4])}")
    return FastKVzipGates(_checked([{k: v for k, v in layer.items() if v is not None} for layer in layers], source),
                          meta, source)


def save_gates(path, layers: list[dict], meta: dict) -> Path:
    """Write gates (one dict of :data:`NAMES` tensors per layer) in attnkit's safetensors format; returns the path."""
    tensors = {f"layers.{i}.{name}": layer[name].detach().float().contiguous().cpu()
               for i, layer in enumerate(layers) for name in NAMES}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": FORMAT, "attnkit": json.dumps(meta)})
    return path


def save_kvpress_format(path, layers: list[dict]) -> Path:
    """Write gates as kvpress's and the authors' torch file (``{"module": [state dict per layer]}``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": [{name: layer[name].detach().float().contiguous().cpu() for name in NAMES}
                           for layer in layers]}, str(path))
    return path
