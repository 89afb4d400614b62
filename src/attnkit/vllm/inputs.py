"""Each layer's attention input in a vLLM worker, for methods that read it (``kvzap``'s surrogate; no vLLM import).

A method that scores entries from the hidden states a layer's attention reads (``needs_layer_inputs``:
:meth:`attnkit.session.LayerContext.layer_input`) needs them beside the layer's q, k and v, which is all vLLM's
attention backend is given. vLLM's decoder layers of the architectures attnkit serves (:data:`ARCHITECTURES`) hold
the attention as a module with a merged ``qkv_proj`` and an ``attn`` (vLLM's ``Attention``, named after its layer):
what ``qkv_proj`` reads is the layer's input after its input norm, the hidden states attnkit's own hosts hand over
(:func:`attnkit.attention.watch_layer_inputs`). A forward pre-hook on each ``qkv_proj`` (torch's own interface; no
vLLM code is patched) notes that input for the forward in progress, and the attention backend hands each row's part
of it to the row's session. The hooks are installed the first time a step has a request that needs them, and the
notes are cleared at every forward's start, so a layer whose input was not seen in this forward is an error, never
a stale input. A compiled model (vLLM's torch.compile, anything but ``enforce_eager=True``) would not run Python
hooks as written: such requests are refused when vLLM takes them (:func:`check_layer_inputs`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from safetensors import safe_open

from attnkit.errors import AttnkitError
from attnkit.heads import HeadShard
from attnkit.methods.base import Method
from attnkit.methods.kvzap import KVzap
from attnkit.vllm.plan import cache_part

# vLLM model classes whose attention modules hold ``qkv_proj`` and ``attn`` (Llama, Mistral, Qwen2, Qwen3)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class KeyProjection:
    """What kvzap's weight check reads of a layer (:func:`attnkit.methods.kvzap_predictor.fingerprint`): the sum of
    squares of its key projection, which vLLM holds inside the merged ``qkv_proj`` (the rows after the query
    heads'), each tensor-parallel worker its share of the kv heads (the workers' sums added). vLLM's CPU linears keep
    only a packed copy of their weight for their kernel: there the weight is read back through the layer's own
    product (its ``quant_method.apply``, which runs no hook) with the identity, block by block, without the bias;
    a product with the identity reproduces each weight exactly."""

    BLOCK = 256  # identity rows per product

    def __init__(self, qkv_proj, shard: HeadShard | None):
        self.qkv_proj, self.shard, self.value = qkv_proj, shard, None

    def key_fingerprint(self) -> float | None:
        if self.value is None:
            proj = self.qkv_proj
            weight = getattr(proj, "weight", None)
            if weight is None or weight.device.type == "meta":  # offloaded: nothing to check against
                return None
            first, size = proj.num_heads * proj.head_size, proj.num_kv_heads * proj.head_size
            if weight.dim() == 2 and weight.shape[0] > 0:
                total = weight.detach()[first:first + size].double().pow(2).sum()
            else:
                total = torch.zeros((), dtype=torch.float64)
                dim = proj.input_size
                with torch.no_grad():
                    for start in range(0, dim, self.BLOCK):
                        rows = min(self.BLOCK, dim - start)
                        probe = torch.zeros(rows, dim, dtype=weight.dtype, device=weight.device)
                        probe[:, start:start + rows] = torch.eye(rows, dtype=weight.dtype, device=weight.device)
                        out = proj.quant_method.apply(proj, probe, None)
                        total += out[:, first:first + size].double().pow(2).sum().cpu()
            if self.shard is not None and self.shard.ranks > 1:
                total = self.shard.sum_across(total)  # every worker checks the same layer of the same request
            self.value = float(total)
        return self.value


class LayerInputs:
    """The attention inputs ``[tokens, hidden]`` of the forward in progress, by layer index."""

    def __init__(self):
        self.noted: dict[int, torch.Tensor] = {}
        self.modules: dict[int, KeyProjection] | None = None  # None: hooks not installed yet

    def install(self, model: torch.nn.Module, layer_index, shard: HeadShard | None) -> None:
        """Hook every attention module of `model` (once); ``layer_index(name)``: the layer of an ``attn``'s
        ``layer_name``."""
        if self.modules is not None:
            return
        modules = {}
        for module in model.modules():
            attn, proj = getattr(module, "attn", None), getattr(module, "qkv_proj", None)
            name = getattr(attn, "layer_name", None)
            if name is None or not isinstance(proj, torch.nn.Module):
                continue
            index = layer_index(name)
            proj.register_forward_pre_hook(self._noter(index))
            modules[index] = KeyProjection(proj, shard)
        if not modules:
            raise RuntimeError(f"attnkit: {type(model).__name__} has no attention module with a qkv_proj whose input "
                               f"could be read (the layers' inputs are read on {', '.join(ARCHITECTURES)})")
        self.modules = modules

    def _noter(self, index: int):
        def note(module, args):
            self.noted[index] = args[0]
        return note

    def begin_forward(self) -> None:
        self.noted.clear()

    def of(self, layer: int, tokens: int) -> tuple[torch.Tensor, KeyProjection]:
        """Layer `layer`'s input in this forward (`tokens` rows, as its queries) and its key projection."""
        hidden = self.noted.get(layer)
        if self.modules is None or hidden is None or hidden.shape[0] != tokens:
            got = "no hooks" if self.modules is None else "none" if hidden is None else f"{hidden.shape[0]} rows"
            raise RuntimeError(f"attnkit: layer {layer}'s attention input for {tokens} tokens was not seen in this "
                               f"forward ({got})")
        return hidden, self.modules[layer]


def check_layer_inputs(method: Method, eager: bool, architectures, source: str) -> None:
    """Refuse, in one line, a method that reads the layers' input hidden states (kvzap) where the worker cannot hand
    them over: a compiled model (the hooks need ``enforce_eager=True``), or a model class whose attention modules it
    does not know (:data:`ARCHITECTURES`)."""
    if not method.needs_layer_inputs:
        return
    why = ""
    if not eager:
        why = "without enforce_eager=True (it reads each layer's input hidden states through hooks that a compiled " \
              "model does not run as written)"
    else:
        unknown = [a for a in architectures or ["?"] if a not in ARCHITECTURES]
        if unknown:
            why = f"on {unknown[0]} (the layers' input hidden states are read on {', '.join(ARCHITECTURES)})"
    if why:
        raise AttnkitError(f"{source}: {method.describe()} is not supported inside vLLM {why}")


class CheckpointKey:
    """A layer's key projection as a checkpoint file holds it (what :func:`check_surrogate` compares)."""

    def __init__(self, value: float):
        self.value = value

    def key_fingerprint(self) -> float:
        return self.value


@functools.lru_cache(maxsize=4)
def checkpoint_keys(folder: str, n_layers: int) -> tuple[CheckpointKey, ...] | None:
    """Each layer's key projection in a local checkpoint folder of safetensors files under the Hugging Face names
    (``model.layers.{i}.self_attn.k_proj.weight``), as :class:`CheckpointKey` (None: not such a folder)."""
    found = {}
    for path in sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                parts = name.split(".")
                if name.endswith("self_attn.k_proj.weight") and len(parts) > 2 and parts[-4].isdigit():
                    found[int(parts[-4])] = CheckpointKey(float(f.get_tensor(name).double().pow(2).sum()))
    if sorted(found) != list(range(n_layers)):
        return None
    return tuple(found[i] for i in range(n_layers))


def check_surrogate(method: Method, n_layers: int, hidden_size: int, kv_heads: int, model: str) -> None:
    """Refuse, in one line, a kvzap surrogate trained for another model, before any worker runs it: its geometry and,
    where `model` is a local checkpoint folder, its layers' key projections (the workers check those again on
    their own weights, :class:`KeyProjection`)."""
    cache = cache_part(method)
    if isinstance(cache, KVzap):
        cache.check_model(n_layers, hidden_size, kv_heads, checkpoint_keys(model, n_layers))
