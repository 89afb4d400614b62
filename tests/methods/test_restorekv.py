"""restorekv (RestoreKV, arXiv 2608.01247; kvpress's RestoreKVPress), with restore weights trained a few steps here per
architecture: at an unlimited budget (kvpress's compression_ratio=0) no restore token is added and the output is
exactly full's, batched too; at a compressing budget a batch gives each prompt its tokens alone; the kept prompt
positions are kvzip's at B - R (uniform and adaptive), every kv head holds the R restore entries at positions
n..n+R-1, whose keys and values equal a plain recomputation through transformers' own forward (LoRA added to the
restore tokens' rows only), and later tokens sit R positions later; AttnkitCache, compose and vLLM refuse it in one
line, as do bad parameters and another model's weights; the command writes a file the method reads, and kvpress's
peft folder."""

import json

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.calibrate.restorekv import calibrate_restorekv
from attnkit.cli import main
from attnkit.forward import forward, prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods.restorekv_weights import load_weights, save_weights
from attnkit.methods.spec import parse_method_spec
from attnkit.session import Step, new_session
from attnkit.vllm.plan import check_supported
from helpers import ROOT, SMALL, assert_equals_full, random_ids

torch.set_num_threads(1)

NEW = 6
ARCHS = ["llama", "mistral", "qwen3"]


@pytest.fixture(scope="module")
def weights(arch_models, tmp_path_factory):
    """Restore weights per architecture: 2 prompts of 192 tokens, 3 steps, then each adapter's B perturbed at random
    (B starts at zero, so after so few steps the adapters would barely act)."""
    folder = tmp_path_factory.mktemp("restorekv")
    out = {}
    for arch, model in arch_models.items():
        trained = calibrate_restorekv(model, tasks=("passkey",), samples=2, length=192, heldout=1, new_tokens=6,
                                      steps=3, batch_size=1, budgets=(0.5,), eval_budget=0.5, split="calibration")
        g = torch.Generator().manual_seed(len(out))
        lora = {k: (a, b + 0.05 * torch.randn(b.shape, generator=g)) for k, (a, b) in trained.lora.items()}
        out[arch] = str(save_weights(folder / f"{arch}.safetensors", trained.embeddings, lora, trained.meta))
    return out


def spec(weights, arch, params):
    return parse_method_spec(f"restorekv:config={weights[arch]},{params}")


def prompt(n=150, seed=3):
    return random_ids(n, seed=seed)


# ---- unlimited budget: nothing added, exactly full --------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", ["budget=1.0", "budget_tokens=150", "budget_tokens=400,head_budgets=adaptive"])
def test_unlimited_budget_adds_no_restore_token_and_equals_full(arch_models, weights, arch, params):
    out, _ = assert_equals_full(arch_models[arch], prompt(), spec(weights, arch, params), NEW)
    assert out.stats.method_stats["restore_tokens"] == 0


def test_unlimited_budget_batch_equals_full(arch_models, weights):
    prompts = [random_ids(n, seed=s).tolist() for s, n in enumerate((120, 120, 90))]
    assert_equals_full(arch_models["qwen3"], prompts, spec(weights, "qwen3", "budget=1.0"), NEW)


# ---- batches: each prompt's tokens as alone -------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_batch_equals_alone(arch_models, weights, arch):
    model, method = arch_models[arch], spec(weights, arch, "budget=0.4")
    prompts = [random_ids(n, seed=10 + s).tolist() for s, n in enumerate((120, 120, 90))]
    batch = attnkit.generate(model, prompts, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
    for p, out in zip(prompts, batch):
        alone = attnkit.generate(model, p, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
        assert out.token_ids == alone.token_ids
        assert max((a - b).abs().max().item() for a, b in zip(out.logits, alone.logits)) < 1e-4
        assert (out.stats.final_kv_bytes, out.stats.peak_kv_bytes) == (alone.stats.final_kv_bytes,
                                                                       alone.stats.peak_kv_bytes)
        assert out.stats.method_stats["restore_tokens"] == 8


# ---- what the cache holds after the prompt ----------------------------------------------------------------
def held(session, layer):
    """Per row and kv head, the positions the layer holds (a flat layer's by owner)."""
    kv = session.cache.layers[layer]
    pos = kv.view()[2]
    if "head" not in kv.extras:
        return [[sorted(pos[r, h].tolist()) for h in range(pos.shape[1])] for r in range(pos.shape[0])]
    owner = kv.extras["head"][:, 0, :kv.length]
    heads = int(owner.max()) + 1
    return [[sorted(pos[r, 0][owner[r] == h].tolist()) for h in range(heads)] for r in range(pos.shape[0])]


def session_after_prompt(model, method, ids):
    session = new_session(model, method, ids.shape[-1], NEW, rows=1 if ids.dim() == 1 else ids.shape[0])
    with torch.inference_mode():
        prefill(model, session, ids if ids.dim() == 2 else ids[None])
    return session


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("extra", ["", ",head_budgets=adaptive,alpha_safeguard=0"])
def test_kept_positions_are_kvzips_at_b_minus_r_plus_the_restore_positions(arch_models, weights, arch, extra):
    model, ids, n, budget = arch_models[arch], prompt(), 150, 40
    ours = session_after_prompt(model, spec(weights, arch, f"budget_tokens={budget}{extra}"), ids)
    plain = session_after_prompt(model, parse_method_spec(f"kvzip:budget_tokens={budget - 8}{extra}"), ids)
    for layer in range(model.geometry.n_layers):
        mine, ref = held(ours, layer), held(plain, layer)
        assert [[p for p in h if p < n] for h in mine[0]] == ref[0]
        assert all([p for p in h if p >= n] == list(range(n, n + 8)) for h in mine[0])
        assert sum(len(h) for h in mine[0]) == model.geometry.n_kv_heads * budget  # kvzip's bytes at B


def lora_reference(model, path, ids):
    """Restore keys and values per layer from transformers' own forward over the prompt's token embeddings followed
    by the restore embeddings, the adapters' ``scaling B A x`` added to the restore rows only: ``[kv, R, d]``."""
    w = load_weights(path)
    n = ids.shape[0]
    hf = model.hf
    x = torch.cat([hf.model.embed_tokens(ids[None]), w.embeddings[None]], 1)
    rows = torch.zeros(1, x.shape[1], 1)
    rows[:, n:] = 1
    handles = [hf.model.layers[i].get_submodule(name).register_forward_hook(
        lambda m, args, out, a=a, b=b: out + rows * (args[0] @ a.T @ b.T) * w.scaling)
        for (i, name), (a, b) in w.lora.items()]
    try:
        with torch.no_grad():
            cache = hf.model(inputs_embeds=x, use_cache=True).past_key_values
    finally:
        for h in handles:
            h.remove()
    r = w.tokens  # the last entries (a sliding-window layer of transformers keeps only its window)
    return [(layer.keys[0, :, -r:], layer.values[0, :, -r:]) for layer in cache.layers]


@pytest.mark.parametrize("arch", ARCHS)
def test_restore_entries_equal_a_plain_forward_and_later_tokens_sit_r_later(arch_models, weights, arch):
    model, ids, n = arch_models[arch], prompt(), 150
    session = session_after_prompt(model, spec(weights, arch, "budget_tokens=40"), ids)
    for layer, (k_ref, v_ref) in enumerate(lora_reference(model, weights[arch], ids)):
        keys, values, pos = session.cache.layers[layer].view()
        restore = pos[0, 0] >= n
        assert pos[0, 0][restore].tolist() == list(range(n, n + 8))
        assert torch.allclose(keys[0][:, restore], k_ref, atol=1e-5)
        assert torch.allclose(values[0][:, restore], v_ref, atol=1e-5)
    with torch.inference_mode():
        forward(model, torch.tensor([[5]]), n, lambda pos: Step(session, "decode", pos))
    assert all(int(layer.view()[2][0, 0, -1]) == n + 8 for layer in session.cache.layers)


# ---- refusals --------------------------------------------------------------------------------------------
def test_what_it_cannot_do_is_refused_in_one_line(arch_models, weights, tmp_path):
    model = arch_models["llama"]
    foreign = weights["qwen3"]
    cases = [
        (lambda: AttnkitCache(model, spec(weights, "llama", "budget=0.3"), max_new_tokens=4),
         r"method 'restorekv' runs the decoder layers itself .* use attnkit.generate instead"),
        (lambda: parse_method_spec(f"a_shape:n_init=16,n_local=32+restorekv:config={weights['llama']},budget=0.3"),
         r"'restorekv' runs the decoder layers itself \(a model-level hook\) and cannot be composed"),
        (lambda: check_supported(spec(weights, "llama", "budget=0.3"), "--method"),
         r"restorekv.*not supported inside vLLM \(it runs a second pass of learned tokens"),
        (lambda: attnkit.generate(model, prompt(), spec(weights, "llama", "budget_tokens=12"), max_new_tokens=2),
         r"the 12-slot budget of layer 0 leaves 4 prompt entries after the 8 restore entries"),
        (lambda: attnkit.generate(model, prompt(), f"restorekv:config={foreign},budget=0.3", max_new_tokens=2),
         r"holds restore weights for 'random:qwen3.*\(qwen3, 2 layers.* but the model is llama"),
        (lambda: attnkit.generate(arch_models["mistral"], prompt(), f"restorekv:config={weights['llama']},budget=0.3",
                                  max_new_tokens=2), r"holds restore weights for 'random:llama.*model is mistral"),
        (lambda: attnkit.generate(model, prompt(), f"restorekv:config={ROOT / 'sweeps/restorekv_tiny.safetensors'},"
                                                   f"budget=0.3", max_new_tokens=2),
         r"holds restore weights for 'tiny' \(llama, 6 layers, hidden size 256, 2 kv heads\) but the model is llama, "
         r"2 layers"),
    ]
    for call, pattern in cases:
        with pytest.raises(AttnkitError, match=pattern) as err:
            call()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("params, message", [
    ("budget=0.3", r"restorekv needs config=FILE"),
    ("config=missing.safetensors,budget=0.3", r"restorekv config 'missing.safetensors' does not exist"),
    ("config=x.safetensors,budget=0.3,chunk_length=8", r"chunk_length=8 is not supported"),
    ("config=x.safetensors,budget=0.3,positions=reindexed", r"positions='reindexed' is not supported"),
    ("config=x.safetensors,budget=0.3,score_threshold=0.1", r"score_threshold=0.1 is not supported"),
])
def test_bad_parameters_are_refused_in_one_line(params, message):
    with pytest.raises(AttnkitError, match=message) as err:
        parse_method_spec(f"restorekv:{params}")
    assert "\n" not in str(err.value)


def test_weights_of_other_weights_of_the_same_geometry_are_refused(arch_models, weights, tmp_path):
    w = load_weights(weights["llama"])
    other = save_weights(tmp_path / "other.safetensors", w.embeddings, w.lora,
                         dict(w.meta, fingerprints=[f * 1.5 for f in w.meta["fingerprints"]]))
    with pytest.raises(AttnkitError, match=r"was trained on the weights of 'random:llama.*layer 0's key projection"):
        attnkit.generate(arch_models["llama"], prompt(), f"restorekv:config={other},budget=0.3", max_new_tokens=2)


def test_a_file_of_another_kind_is_refused(weights, tmp_path):
    other = tmp_path / "other.safetensors"
    save_weights(other, torch.zeros(8, 64), {}, {"rank": 2, "alpha": 2, "n_layers": 2, "hidden_size": 64})
    raw = other.read_bytes().replace(b"attnkit-restorekv-1", b"attnkit-somethings1")
    other.write_bytes(raw)
    with pytest.raises(AttnkitError, match=r"is not a restorekv weights file"):
        parse_method_spec(f"restorekv:config={other},budget=0.3")


# ---- the command and the committed weights -----------------------------------------------------------------
def test_the_command_writes_a_file_the_method_reads_and_kvpress_folder(arch_models, tmp_path):
    out, folder = tmp_path / "rk.safetensors", tmp_path / "kvpress"
    assert main(["calibrate", "restorekv", "--model", f"random:llama:{SMALL}", "--out", str(out), "--kvpress-dir",
                 str(folder), "--tasks", "passkey", "--samples", "1", "--length", "192", "--heldout", "1",
                 "--new-tokens", "4", "--steps", "1", "--batch-size", "1", "--eval-budget", "0.5",
                 "--split", "calibration"]) == 0
    gen = attnkit.generate(arch_models["llama"], prompt(), f"restorekv:config={out},budget=0.3", max_new_tokens=NEW,
                           stop_at_eos=False)
    assert len(gen.token_ids) == NEW and gen.stats.method_stats["restore_tokens"] == 8
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and "q_proj" in config["target_modules"]
    assert {p.name for p in folder.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                                  "restore_embeddings.safetensors"}


def test_committed_weights_for_tiny_lower_the_held_out_kl():
    w = load_weights(ROOT / "sweeps" / "restorekv_tiny.safetensors")
    held_out = w.meta["heldout"]
    assert w.meta["model"] == "tiny" and w.tokens == 8
    assert held_out["kl_trained"] < held_out["kl_untrained"]
