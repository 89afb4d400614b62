"""KVzap's surrogate: per layer, a linear map or a two-layer MLP from the attention input's hidden states to one
log importance score per kv head (Jégou, Jeblick, 2026, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning",
arXiv 2601.07891), and the file that holds it (written by ``attnkit calibrate kvzap``, read by
``kvzap:config=FILE``).

For layer ``l`` and a token whose attention input (the hidden state after the layer's input norm, what its q, k, v
projections read) is ``h`` (``D`` values), the surrogate predicts ``log s`` for each of the ``H`` kv heads::

    linear:  s_hat = W h + b                          W: [H, D]
    mlp:     s_hat = W2 GELU(W1 h + b1) + b2          W1: [M, D], W2: [H, M]

where ``s`` is the KVzip score the model gives the token's entry (:mod:`attnkit.methods.kvzip`): the most
attention it receives while the model repeats the prompt. The paper regresses the log of its KVzip+ score (the
same attention scaled by ``||W_O v|| / ||h||``); attnkit's targets are the log of attnkit's own ``kvzip`` scores,
so that ``kvzap`` approximates the method attnkit ships (:mod:`attnkit.calibrate.kvzap`).

**The file** is safetensors: the tensors named as kvpress's ``KVzapModel`` state dict names them
(``layers.{l}.weight``/``layers.{l}.bias`` for the linear model; ``layers.{l}.0.*`` and ``layers.{l}.2.*`` for the
MLP's two ``nn.Linear`` around its GELU), float32, ``[out, in]``, so the same weights load into kvpress's
``KVzapModel`` (its config: ``input_dim=D``, ``output_dim=H``, ``n_modules=L``, ``hidden_dim=M`` or None); its
metadata (JSON under ``attnkit``) records the model, its geometry, a fingerprint of each layer's key projection,
the target and the training settings. Loading refuses another format in one line, and the method refuses a model
of another geometry or other weights (:meth:`KVzapPredictor.check_model`, :meth:`KVzapPredictor.check_layer`).
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

FORMAT = "attnkit-kvzap-1"
KINDS = ("linear", "mlp")
# relative difference of a layer's key-projection fingerprint above which the weights are another model's (a model
# loaded in half precision rounds each weight, which moves the sum of squares far less than this)
FINGERPRINT_TOLERANCE = 1e-3


def tensor_names(kind: str, layer: int) -> list[str]:
    """The state-dict names of one layer's tensors, as kvpress's ``KVzapModel`` names them."""
    if kind == "linear":
        return [f"layers.{layer}.weight", f"layers.{layer}.bias"]
    return [f"layers.{layer}.0.weight", f"layers.{layer}.0.bias", f"layers.{layer}.2.weight", f"layers.{layer}.2.bias"]


def fingerprint(module) -> float | None:
    """The sum of squares of an attention module's key projection (every parameter where it has none): what a file
    records per layer, so that the weights of another model with the same geometry are refused. None where the
    weights are not in memory (a layer accelerate offloads to the disk holds them only inside its projections'
    calls)."""
    proj = getattr(module, "k_proj", None)
    params = [proj.weight] if proj is not None else list(module.parameters())
    if any(p.device.type == "meta" for p in params):
        return None
    return float(sum(p.detach().double().pow(2).sum() for p in params))


def predict(kind: str, weights: list[torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """Log scores ``[b, H, n]`` (float32) of hidden states ``[b, n, D]`` under one layer's `weights` (on their
    device and in float32)."""
    x = hidden.float()
    if kind == "linear":
        out = torch.nn.functional.linear(x, weights[0], weights[1])
    else:
        inner = torch.nn.functional.gelu(torch.nn.functional.linear(x, weights[0], weights[1]))
        out = torch.nn.functional.linear(inner, weights[2], weights[3])
    return out.transpose(1, 2)


@dataclass(frozen=True)
class KVzapPredictor:
    """A trained surrogate: its kind, one list of tensors per layer (:func:`tensor_names` order, CPU float32) and
    the file's metadata."""

    kind: str
    layers: list
    meta: dict
    source: str
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)  # weights copied per device

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.layers[0][0].shape[1])

    @property
    def kv_heads(self) -> int:
        return int(self.layers[0][-1].shape[0])

    def scores(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted log scores ``[b, kv_heads, n]`` (float32) of layer `layer`'s attention inputs ``[b, n, D]``."""
        key = (layer, hidden.device)
        weights = self._on_device.get(key)
        if weights is None:
            weights = self._on_device[key] = [t.to(hidden.device) for t in self.layers[layer]]
        return predict(self.kind, weights, hidden)

    def check_model(self, n_layers: int, hidden_size: int | None = None, kv_heads: int | None = None) -> None:
        """Refuse, in one line, a model whose geometry is not the one this surrogate was trained for."""
        if n_layers != self.n_layers or hidden_size not in (None, self.hidden_size) \
                or kv_heads not in (None, self.kv_heads):
            model = f"{n_layers} layers" + ("" if hidden_size is None else f", hidden size {hidden_size}") + (
                "" if kv_heads is None else f", {kv_heads} kv heads")
            raise AttnkitError(f"{self.source} was trained for {self.meta.get('model', '?')!r} ({self.n_layers} "
                               f"layers, hidden size {self.hidden_size}, {self.kv_heads} kv heads) but the model has "
                               f"{model}; train one for it with `attnkit calibrate kvzap --model M --out FILE`")

    def check_layer(self, layer: int, module) -> None:
        """Refuse, in one line, a layer whose key projection is not the one the surrogate was trained on."""
        recorded = (self.meta.get("fingerprints") or [None] * self.n_layers)[layer]
        if recorded is None or module is None:
            return
        got = fingerprint(module)
        if got is not None and abs(got - recorded) > FINGERPRINT_TOLERANCE * max(abs(recorded), 1e-30):
            raise AttnkitError(f"{self.source} was trained on the weights of {self.meta.get('model', '?')!r}, not "
                               f"this model's (layer {layer}'s key projection differs); train one for this model "
                               f"with `attnkit calibrate kvzap --model M --out FILE`")


def save_predictor(path: str | Path, kind: str, layers: list[list[torch.Tensor]], meta: dict) -> Path:
    """Write a surrogate (see the module docstring); returns the path."""
    tensors = {name: t.detach().float().contiguous().cpu()
               for i, layer in enumerate(layers) for name, t in zip(tensor_names(kind, i), layer)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": FORMAT, "attnkit": json.dumps({**meta, "kind": kind})})
    return path


def load_predictor(path) -> KVzapPredictor:
    """A surrogate from its file, refused in one line if it is not one."""
    source = f"kvzap config {str(path)!r}"
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        raise AttnkitError(f"{source} does not exist (write one with `attnkit calibrate kvzap --model M --out FILE`)")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        meta = json.loads(header.get("attnkit", "{}"))
    except Exception as exc:  # not safetensors, or its metadata is not JSON
        raise AttnkitError(f"{source} is not a kvzap surrogate ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}); write one with `attnkit calibrate "
                           f"kvzap`") from None
    kind = meta.get("kind")
    if header.get("format") != FORMAT or kind not in KINDS:
        raise AttnkitError(f"{source} is not a kvzap surrogate (format {header.get('format')!r}, kind {kind!r}; "
                           f"expected {FORMAT!r}); write one with `attnkit calibrate kvzap`")
    layers, i = [], 0
    while all(name in tensors for name in tensor_names(kind, i)):
        layers.append([tensors.pop(name).float() for name in tensor_names(kind, i)])
        i += 1
    if not layers or tensors:
        raise AttnkitError(f"{source}: tensors missing or unexpected ({', '.join(sorted(tensors)) or 'no layer 0'})")
    shapes_ok = all(len({tuple(layer[0].shape) for layer in layers}) == 1 and
                    all(t.dim() == (2 if j % 2 == 0 else 1) for j, t in enumerate(layer)) for layer in layers)
    if not shapes_ok or not all(math.isfinite(float(t.abs().sum())) for layer in layers for t in layer):
        raise AttnkitError(f"{source}: the layers' tensors differ in shape or hold non-finite values")
    return KVzapPredictor(kind, layers, meta, source)
