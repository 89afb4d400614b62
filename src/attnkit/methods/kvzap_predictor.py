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

**kvpress's published weights** (``nvidia/KVzap-{linear,mlp}-MODEL``, read by ``KVzapModel.from_pretrained``) load
too, from a folder on disk: ``config.json`` (``model_type`` ``kvzap`` and ``KVzapConfig``'s ``input_dim``,
``output_dim``, ``n_modules``, ``hidden_dim``: None for the linear model) and ``model.safetensors`` (or the shards
its index names) holding the state dict named as above, in whatever dtype (read as float32). ``config=`` names the
folder or that model.safetensors; the kind comes from ``hidden_dim``, the tensors must match the config. Such a
folder records no model weights, so only the geometry is checked (layers, hidden size, kv heads), and its scores
are in kvpress's units: the log of KVzip+ scores, not of attnkit's ``kvzip`` scores.
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
    calls). A host whose modules hold the key projection inside a merged one (vLLM's ``qkv_proj``) hands over an object
    that computes it (``key_fingerprint()``: :class:`attnkit.vllm.inputs.KeyProjection`)."""
    own = getattr(module, "key_fingerprint", None)
    if own is not None:
        return own()
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


def _read(path: Path, source: str) -> tuple[dict, dict]:
    """A safetensors file's metadata and tensors, refused in one line if it is not one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # not safetensors
        raise AttnkitError(f"{source} is not a kvzap surrogate ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}); write one with `attnkit calibrate "
                           f"kvzap`") from None


def _kvpress_config(folder: Path, source: str) -> dict | None:
    """The fields of a ``KVzapConfig`` in `folder`'s config.json (None where there is no kvzap config.json)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("model_type") != "kvzap":
        return None
    fields = {key: config.get(key) for key in ("input_dim", "output_dim", "n_modules", "hidden_dim")}
    if not all(isinstance(v, int) and v > 0 for k, v in fields.items() if k != "hidden_dim" or v is not None):
        raise AttnkitError(f"{source}: config.json's KVzapConfig fields are not positive integers ({fields})")
    return fields


def _kvpress_tensors(folder: Path, source: str) -> dict:
    """The state dict of a ``KVzapModel.save_pretrained`` folder: model.safetensors, or the shards its index names."""
    if (folder / "model.safetensors").is_file():
        return _read(folder / "model.safetensors", source)[1]
    try:
        shards = sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise AttnkitError(f"{source}: a KVzapModel folder without model.safetensors (or its index); other weight "
                           f"files (pytorch_model.bin) are not read") from None
    return {name: t for shard in shards for name, t in _read(folder / shard, source)[1].items()}


def load_predictor(path) -> KVzapPredictor:
    """A surrogate from its file, or from kvpress's published ``KVzapModel`` weights (a ``save_pretrained`` folder,
    or its model.safetensors with the folder's config.json beside it); refused in one line if it is neither."""
    source = f"kvzap config {str(path)!r}"
    if not isinstance(path, (str, Path)) or not str(path) or not Path(path).exists():
        raise AttnkitError(f"{source} does not exist (write one with `attnkit calibrate kvzap --model M --out FILE`)")
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    header, tensors = ({}, None) if path.is_dir() else _read(path, source)
    if header.get("format") == FORMAT:
        try:
            meta = json.loads(header.get("attnkit", "{}"))
        except ValueError:
            meta = None
        kind = meta.get("kind") if isinstance(meta, dict) else None
        if kind not in KINDS:
            raise AttnkitError(f"{source}: its attnkit metadata is not JSON naming a kind of {KINDS}")
        config = None
    else:
        config = _kvpress_config(folder, source)
        if config is None:
            raise AttnkitError(f"{source} is not a kvzap surrogate (format {header.get('format')!r}; expected "
                               f"{FORMAT!r}, or kvpress's KVzapModel folder with its config.json); write one with "
                               f"`attnkit calibrate kvzap`")
        tensors = _kvpress_tensors(folder, source) if tensors is None else tensors
        kind = "linear" if config["hidden_dim"] is None else "mlp"
        meta = {"model": folder.name, "format": "kvpress KVzapModel", "n_layers": config["n_modules"],
                "hidden_size": config["input_dim"], "n_kv_heads": config["output_dim"], "kind": kind,
                "target": "kvpress's: the log of KVzip+ scores (thresholds in its units)"}
    layers, i = [], 0
    while all(name in tensors for name in tensor_names(kind, i)):
        layers.append([tensors.pop(name).float() for name in tensor_names(kind, i)])
        i += 1
    if not layers or tensors:
        raise AttnkitError(f"{source}: tensors missing or unexpected ({', '.join(sorted(tensors)) or 'no layer 0'})")
    d, h = layers[0][0].shape[-1], layers[0][-1].shape[0]
    m = layers[0][0].shape[0] if kind == "mlp" else None
    shapes = [(h, d), (h,)] if kind == "linear" else [(m, d), (m,), (h, m), (h,)]
    if not all([tuple(t.shape) for t in layer] == shapes for layer in layers):
        raise AttnkitError(f"{source}: the layers' tensors differ in shape")
    if config is not None and (config["n_modules"], config["input_dim"], config["output_dim"],
                               config["hidden_dim"]) != (len(layers), d, h, m):
        raise AttnkitError(f"{source}: config.json ({config}) does not match its tensors ({len(layers)} layers, "
                           f"input {d}, output {h}, hidden {m})")
    if not all(math.isfinite(float(t.abs().sum())) for layer in layers for t in layer):
        raise AttnkitError(f"{source}: the layers' tensors hold non-finite values")
    return KVzapPredictor(kind, layers, meta, source)
