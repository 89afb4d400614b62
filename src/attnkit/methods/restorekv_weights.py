"""RestoreKV's trained weights and the pass that turns them into cache entries (the method is
:mod:`attnkit.methods.restorekv`; the weights are written by ``attnkit calibrate restorekv``).

**Weights.** ``R`` restore embeddings ``E`` ``[R, D]`` (inputs of the decoder, in place of token embeddings) and a
LoRA pair per adapted projection (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv 2106.09685, eq. 3): for a linear map ``W`` of a decoder layer (``self_attn.q_proj`` ... ``mlp.down_proj``)
``h = W x + (alpha / r) B A x`` with ``A`` ``[r, in]``, ``B`` ``[out, r]``, as peft's ``LoraLayer`` computes it (no
dropout at inference). The adapters act only while the restore tokens pass through the model.

**The restore pass** (:func:`restore_entries`): after the prompt (``n`` tokens) is cached whole, the restore
embeddings run once through every decoder layer at positions ``n .. n+R-1`` with the adapters on; in each layer
their queries attend to that layer's whole cached prompt and, causally, to their own keys (the model's own sliding
window applied). Each layer's restore keys (after RoPE) and values are returned; they never enter the cache here.

**File.** safetensors holding ``restore_embeddings`` and ``layers.{l}.{module}.lora_A`` / ``.lora_B``, float32, with
metadata (JSON under ``attnkit``) recording the model, its geometry, the LoRA rank, alpha and target modules, a
fingerprint of each layer's key projection and the training settings: another model's file is refused in one line.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attnkit.attention import attend
from attnkit.errors import AttnkitError
from attnkit.forward import run_decoder_layers
from attnkit.methods.kvzap_predictor import FINGERPRINT_TOLERANCE, fingerprint

FORMAT = "attnkit-restorekv-1"
EMBEDDINGS = "restore_embeddings"
HINT = "train weights for it with `attnkit calibrate restorekv --model M --out FILE`"


@dataclass
class RestoreWeights:
    """Restore embeddings ``[R, D]``, LoRA pairs ``{(layer, module): (A, B)}`` (float32, CPU), metadata, source."""

    embeddings: torch.Tensor
    lora: dict
    meta: dict
    source: str
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def tokens(self) -> int:
        return int(self.embeddings.shape[0])

    @property
    def scaling(self) -> float:
        return float(self.meta["alpha"]) / float(self.meta["rank"])

    def check_model(self, model) -> None:
        """Refuse, in one line, a model (an attnkit LoadedModel) other than the one these weights were trained for:
        its geometry, the shapes of the adapted projections, and each layer's key projection (fingerprint)."""
        layers = model.hf.model.layers
        hidden = model.hf.config.hidden_size
        geo = model.geometry
        want = (self.meta.get("architecture", geo.architecture), self.meta.get("n_layers"),
                self.meta.get("hidden_size"), self.meta.get("n_kv_heads", geo.n_kv_heads))
        if want != (geo.architecture, len(layers), hidden, geo.n_kv_heads) or self.embeddings.shape[1] != hidden:
            raise AttnkitError(f"{self.source} holds restore weights for {self.meta.get('model', 'a model')!r} "
                               f"({want[0]}, {want[1]} layers, hidden size {want[2]}, {want[3]} kv heads) but the "
                               f"model is {geo.architecture}, {len(layers)} layers, hidden size {hidden}, "
                               f"{geo.n_kv_heads} kv heads; {HINT}")
        for (i, name), (a, b) in self.lora.items():
            module = layers[i].get_submodule(name) if i < len(layers) else None
            weight = getattr(module, "weight", None)
            if weight is None or tuple(weight.shape) != (b.shape[0], a.shape[1]):
                raise AttnkitError(f"{self.source}: layer {i}'s {name} adapter is {b.shape[0]}x{a.shape[1]}, which "
                                   f"this model's projection does not match; {HINT}")
        prints = self.meta.get("fingerprints") or [None] * len(layers)
        for i, recorded in enumerate(prints):
            got = None if recorded is None else fingerprint(layers[i].self_attn)
            if got is not None and abs(got - recorded) > FINGERPRINT_TOLERANCE * max(abs(recorded), 1e-30):
                raise AttnkitError(f"{self.source} was trained on the weights of {self.meta.get('model', '?')!r}, not "
                                   f"this model's (layer {i}'s key projection differs); {HINT}")

    def on(self, device, dtype) -> tuple[torch.Tensor, dict]:
        """The embeddings and LoRA pairs on `device` in `dtype` (copied once per device and dtype)."""
        key = (str(device), dtype)
        if key not in self._on_device:
            self._on_device[key] = (self.embeddings.to(device, dtype),
                                    {k: (a.to(device, dtype), b.to(device, dtype)) for k, (a, b) in self.lora.items()})
        return self._on_device[key]


@contextlib.contextmanager
def adapted(hf_model, lora: dict, scaling: float):
    """While active, every adapted projection of `hf_model` adds ``scaling * B A x`` to its output (forward hooks,
    removed on exit); `lora` maps ``(layer, module name)`` to ``(A, B)`` (tensors or parameters: gradients flow)."""
    layers = hf_model.model.layers
    handles = []

    def hook(a, b):
        return lambda module, args, out: out + torch.nn.functional.linear(
            torch.nn.functional.linear(args[0], a), b) * scaling

    try:
        for (i, name), (a, b) in lora.items():
            handles.append(layers[i].get_submodule(name).register_forward_hook(hook(a, b)))
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class RestorePass:
    """The attention of the restore tokens (a step-like object the attention function hands each layer's q, k, v
    to): per layer, the whole cached prompt ``keys[l]`` / ``values[l]`` ``[rows, kv, n, d]`` (positions ``0..n-1``)
    and the tokens' own entries, causal; their keys and values are kept in :attr:`entries`."""

    keys: list
    values: list
    q_pos: torch.Tensor
    entries: dict = field(default_factory=dict)
    session = None  # no session: forward's model-level hook is never consulted

    def note_layer_input(self, layer, hidden, module=None) -> None:
        pass

    def attention(self, layer: int, q, k, v, scaling: float, native_window) -> torch.Tensor:
        self.entries[layer] = (k, v)
        n = self.keys[layer].shape[2]
        q_pos = self.q_pos.to(q.device)
        k_pos = torch.cat([torch.arange(n, device=q.device), q_pos])
        return attend(q, torch.cat([self.keys[layer].to(k.dtype), k], 2),
                      torch.cat([self.values[layer].to(v.dtype), v], 2), scaling, q_pos, k_pos, native_window)


def restore_entries(model, embeddings: torch.Tensor, lora: dict, scaling: float, keys: list, values: list
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's restore keys and values ``[rows, kv, R, d]``: the embeddings `embeddings` ``[R, D]`` passed once
    through the decoder at positions ``n..n+R-1`` (``n`` the cached prompt's length) with the adapters `lora` on,
    attending to each layer's cached prompt ``keys[l]`` / ``values[l]`` (see the module docstring). Differentiable
    in `embeddings` and `lora` when autograd is on (the trainer's use)."""
    rows, n = keys[0].shape[0], keys[0].shape[2]
    x = embeddings[None].expand(rows, -1, -1)
    pos = torch.arange(n, n + embeddings.shape[0], device=embeddings.device)
    step = RestorePass(keys, values, pos)
    with adapted(model.hf, lora, scaling):
        run_decoder_layers(model, x, pos, step)
    return [step.entries[i] for i in range(len(keys))]


def load_weights(path) -> RestoreWeights:
    """The weights of an ``attnkit calibrate restorekv`` file, refused in one line if it is not one."""
    source = f"restorekv config {str(path)!r}"
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        raise AttnkitError(f"{source} does not exist; {HINT}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:
        raise AttnkitError(f"{source} is not a safetensors file ({type(exc).__name__}); {HINT}") from None
    if header.get("format") != FORMAT:
        raise AttnkitError(f"{source} is not a restorekv weights file (format {header.get('format')!r}, expected "
                           f"{FORMAT!r}); {HINT}")
    meta = json.loads(header.get("attnkit", "{}"))
    emb = tensors.pop(EMBEDDINGS, None)
    if emb is None or emb.dim() != 2 or emb.shape[0] < 1:
        raise AttnkitError(f"{source}: no [R, hidden] tensor {EMBEDDINGS!r}")
    lora = {}
    for i in range(int(meta.get("n_layers", 0))):
        for name in meta.get("targets", []):
            a, b = tensors.pop(f"layers.{i}.{name}.lora_A", None), tensors.pop(f"layers.{i}.{name}.lora_B", None)
            if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise AttnkitError(f"{source}: layer {i}'s {name} needs lora_A [r, in] and lora_B [out, r]")
            lora[(i, name)] = (a.float(), b.float())
    if tensors:
        raise AttnkitError(f"{source}: unexpected tensors {', '.join(sorted(tensors)[:4])}")
    for t in [emb, *(x for pair in lora.values() for x in pair)]:
        if not bool(torch.isfinite(t).all()):
            raise AttnkitError(f"{source} holds non-finite weights")
    if not all(k in meta for k in ("rank", "alpha", "n_layers", "hidden_size")):
        raise AttnkitError(f"{source}: its metadata lacks rank, alpha, n_layers or hidden_size; {HINT}")
    return RestoreWeights(emb.float(), lora, meta, source)


def save_weights(path, embeddings: torch.Tensor, lora: dict, meta: dict) -> Path:
    """Write restore weights (see the module docstring); `meta` must hold ``rank``, ``alpha``, ``targets``,
    ``n_layers`` and ``hidden_size``. Returns the path."""
    tensors = {EMBEDDINGS: embeddings.detach().float().contiguous().cpu()}
    for (i, name), (a, b) in lora.items():
        tensors[f"layers.{i}.{name}.lora_A"] = a.detach().float().contiguous().cpu()
        tensors[f"layers.{i}.{name}.lora_B"] = b.detach().float().contiguous().cpu()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": FORMAT, "attnkit": json.dumps(meta)})
    return path


def save_kvpress_format(folder, embeddings: torch.Tensor, lora: dict, meta: dict) -> Path:
    """Write the weights as kvpress's ``RestoreKVPress`` loads them from the hub: a peft LoRA adapter
    (``adapter_config.json``, ``adapter_model.safetensors`` with peft's tensor names) and
    ``restore_embeddings.safetensors``, in `folder`. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({EMBEDDINGS: embeddings.detach().float().contiguous().cpu()},
              str(folder / "restore_embeddings.safetensors"))
    tensors = {}
    for (i, name), (a, b) in lora.items():
        prefix = f"base_model.model.model.layers.{i}.{name}"
        tensors[f"{prefix}.lora_A.weight"] = a.detach().float().contiguous().cpu()
        tensors[f"{prefix}.lora_B.weight"] = b.detach().float().contiguous().cpu()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(meta["rank"]),
              "lora_alpha": float(meta["alpha"]), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted({name.split(".")[-1] for name in meta["targets"]}),
              "base_model_name_or_path": str(meta.get("model", "")), "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
