"""The layers' attention inputs in a vLLM worker (attnkit.vllm.inputs), on plain modules (no engine): the hooks note
each layer's input for the forward in progress and never hand over a stale one, the key projection's weight is
read back exactly from a linear that keeps only a packed copy, and requests that need the inputs are refused where a
worker could not hand them over."""

from types import SimpleNamespace

import pytest
import torch
from test_vllm_host import KVZAP

from attnkit.errors import AttnkitError
from attnkit.methods.base import resolve_method
from attnkit.methods.kvzap_predictor import fingerprint
from attnkit.vllm.inputs import ARCHITECTURES, KeyProjection, LayerInputs, check_layer_inputs, check_surrogate


class PackedQKV(torch.nn.Module):
    """A stand-in for vLLM's merged q, k, v projection on its CPU platform: the weight removed after loading (an
    empty parameter), the product through ``quant_method.apply`` on a copy kept aside."""

    def __init__(self, hidden, heads, kv_heads, head_size, keep_weight=False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size, self.input_size = heads, kv_heads, head_size, hidden
        self.packed = torch.randn((heads + 2 * kv_heads) * head_size, hidden)
        self.bias = torch.nn.Parameter(torch.randn(self.packed.shape[0]))
        self.weight = torch.nn.Parameter(self.packed.clone() if keep_weight else torch.empty(0))
        packed = self.packed
        self.quant_method = SimpleNamespace(apply=lambda layer, x, bias=None: torch.nn.functional.linear(x, packed,
                                                                                                         bias))

    def forward(self, x):
        return self.quant_method.apply(self, x, self.bias), None


class Attention(torch.nn.Module):
    def __init__(self, index, hidden=40):
        super().__init__()
        self.qkv_proj = PackedQKV(hidden, 4, 2, 8)
        self.attn = SimpleNamespace(layer_name=f"model.layers.{index}.self_attn.attn")

    def forward(self, x):
        return self.qkv_proj(x)[0]


@pytest.mark.parametrize("keep_weight", [False, True])
def test_the_key_projection_is_read_back_exactly(keep_weight):
    """The sum of squares kvzap's weight check compares, from the k rows of the merged weight, or where the linear
    kept only a packed copy, through its own product with the identity in blocks (without its bias)."""
    torch.manual_seed(0)
    proj = PackedQKV(600, 4, 2, 8, keep_weight)  # more inputs than one block of the identity
    k_rows = proj.packed[32:48].double()
    assert fingerprint(KeyProjection(proj, None)) == pytest.approx(float(k_rows.pow(2).sum()), rel=1e-12)


def test_hooks_note_each_layers_input_for_the_forward_in_progress_only():
    model = torch.nn.Sequential(Attention(0), Attention(1))
    inputs = LayerInputs()
    with pytest.raises(RuntimeError, match="no hooks"):
        inputs.of(0, 3)
    inputs.install(model, lambda name: int(name.split(".")[2]), None)
    x = torch.randn(3, 40)
    model[0](x), model[1](2 * x)
    hidden, module = inputs.of(1, 3)
    assert torch.equal(hidden, 2 * x) and module.qkv_proj is model[1].qkv_proj
    with pytest.raises(RuntimeError, match="layer 0's attention input for 5 tokens"):
        inputs.of(0, 5)  # another step's tokens
    inputs.begin_forward()
    with pytest.raises(RuntimeError, match="not seen in this forward"):
        inputs.of(0, 3)  # never a stale input
    with pytest.raises(RuntimeError, match="no attention module with a qkv_proj"):
        LayerInputs().install(torch.nn.Linear(2, 2), int, None)


def test_requests_that_read_the_layer_inputs_are_refused_where_the_worker_cannot_hand_them_over():
    kvzap = resolve_method(f"kvzap:config={KVZAP},budget=0.3")
    check_layer_inputs(kvzap, True, ["LlamaForCausalLM"], "extra_args['attnkit']")
    check_layer_inputs(resolve_method("snapkv:budget=0.3"), False, ["GPT2LMHeadModel"], "x")  # reads none
    for eager, arch, message in ((False, ARCHITECTURES[0], "enforce_eager=True"),
                                 (True, "GPT2LMHeadModel", "on GPT2LMHeadModel")):
        with pytest.raises(AttnkitError, match=message) as info:
            check_layer_inputs(kvzap, eager, [arch], "extra_args['attnkit']")
        assert "\n" not in str(info.value)


def test_a_surrogate_for_another_model_is_refused_before_any_worker_runs_it(tmp_path):
    """The geometry, and the key projections of a local checkpoint folder, against the surrogate's record."""
    from pathlib import Path

    import attnkit

    tiny = str(Path(attnkit.__file__).parent / "assets" / "tiny")
    kvzap = resolve_method(f"kvzap:config={KVZAP},budget=0.3")
    check_surrogate(kvzap, 6, 256, 2, tiny)
    check_surrogate(kvzap, 6, 256, 2, "org/not-a-folder")  # a hub id: its weights checked by the workers
    with pytest.raises(AttnkitError, match="6 layers, hidden size 256, 2 kv heads"):
        check_surrogate(kvzap, 6, 512, 2, tiny)
    other = tmp_path / "other"
    other.mkdir()
    from safetensors.torch import load_file, save_file

    weights = load_file(str(Path(tiny) / "model.safetensors"))
    weights["model.layers.3.self_attn.k_proj.weight"] *= 1.1
    save_file(weights, str(other / "model.safetensors"))
    with pytest.raises(AttnkitError, match="layer 3's key projection differs"):
        check_surrogate(kvzap, 6, 256, 2, str(other))
