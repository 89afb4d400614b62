"""Methods on a tensor-parallel shard of the heads (attnkit.heads): a shard holding the model's second half of the
heads (numbered from 0 in it, told which by its HeadShard) reads those heads' draws and statistics, and a choice over
every head (TOVA, Keyformer's shared score, compactor's standardisation) adds the shards' sums, so the shards together
keep what the whole model keeps (Keyformer's noise and TriAttention's statistics: their own test files; vLLM:
tests/vllm/test_vllm_tp.py)."""

import pytest
import torch

import attnkit
from attnkit.errors import AttnkitError
from attnkit.heads import HeadShard
from attnkit.methods.expected_attention_stats import save_moments
from attnkit.methods.qfilter import dumps_filters
from helpers import ROPE, drive, drive_shards, qkv, randn

PROMPT = 30


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A hand-made q-filter file and Expected Attention statistics file for 4 query heads, 2 kv heads, head_dim 8."""
    folder = tmp_path_factory.mktemp("shard")
    u = torch.nn.functional.normalize(randn(2, 8, seed=4), dim=-1)
    (folder / "f.json").write_text(dumps_filters({"format": "attnkit.qfilter/1", "model": "hand-made", "n_layers": 1,
                                                  "n_heads": 4, "n_kv_heads": 2, "head_dim": 8,
                                                  "inv_freq": ROPE.inv_freq.tolist(), "layers": [{"filters": u.tolist()}]}))
    a = randn(1, 4, 8, 8, seed=6)
    save_moments(folder / "s.safetensors", randn(1, 4, 8, seed=5) * 2, a @ a.transpose(-1, -2) / 8,
                 {"model": "hand-made", "inv_freq": ROPE.inv_freq.tolist()})
    return folder


@pytest.mark.parametrize("spec, unaware", [
    ("random:budget_tokens=14,seed=3", "differs"),
    ("random:budget_tokens=14,decode_every=4", "differs"),
    ("leverage:budget_tokens=14,sketch_dimension=4", "differs"),
    ("compactor:budget_tokens=20,sketch_dimension=4", "differs"),
    ("qfilter:config={f},budget_tokens=14,decode_every=3", "refused"),
    ("expected_attention:stats={s},budget_tokens=14,n_sink=2", "refused"),
    ("expected_attention:stats={s},budget_tokens=14,decode_every=3", "refused")])
def test_each_shard_reads_its_own_heads(files, spec, unaware):
    method = attnkit.parse_method_spec(spec.format(f=files / "f.json", s=files / "s.safetensors"))
    q, k, v = qkv(50, hq=4, kv=2, seed=21)
    k = k * torch.tensor([2.0, 5.0]).view(1, 2, 1, 1)  # spread the scores, the kv heads at different scales
    _, outs, held = drive(method, q, k, v, PROMPT)
    shard_outs, shard_held = drive_shards(method, q, k, v, PROMPT)
    assert shard_held == held
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(shard_outs, outs))
    if unaware == "refused":  # half the heads, not told which: the file's geometry is not the layer's
        with pytest.raises(AttnkitError, match="calibrated for 'hand-made'"):
            drive(method, q[:, 2:], k[:, 1:], v[:, 1:], PROMPT)
    else:  # the second half drawing as heads 0..: other entries
        _, _, got = drive(method, q[:, 2:], k[:, 1:], v[:, 1:], PROMPT)
        assert [step[0] for step in got] != [step[1] for step in held]


@pytest.mark.parametrize("spec", ["tova:budget_tokens=14", "tova:budget_tokens=14,decode_every=4",
                                  "keyformer:budget_tokens=14,score=shared"])
def test_a_choice_over_every_head_adds_the_shards_sums(spec):
    """TOVA's mean over every query head and Keyformer's shared score: each shard adds its heads' sum to the others'
    (the host's all-reduce: here the threads of drive_shards), and they keep what the whole model keeps; a shard
    alone, without a way to add, is refused."""
    method = attnkit.parse_method_spec(spec)
    q, k, v = qkv(50, hq=4, kv=2, seed=23)
    _, outs, held = drive(method, q, k, v, PROMPT)
    shard_outs, shard_held = drive_shards(method, q, k, v, PROMPT)
    assert shard_held == held
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(shard_outs, outs))
    with pytest.raises(AttnkitError, match="reads every head of the model"):
        drive(method, q[:, 2:], k[:, 1:], v[:, 1:], PROMPT, shard=HeadShard(2, 1, 4, 2, ranks=2))


@pytest.mark.parametrize("sketch", [0, 4])
def test_compactor_standardises_over_every_head_of_the_model(sketch):
    """Compactor's blend standardises leverage and attention over every kv head: each shard adds its heads' sums to
    the others', and the shards keep what the whole model keeps; a shard standardising over its own heads alone would
    keep other entries."""
    method = attnkit.parse_method_spec(f"compactor:budget_tokens=20,sketch_dimension={sketch}")
    q, k, v = qkv(60, hq=4, kv=2, seed=0)
    k = k * torch.tensor([0.5, 3.0]).view(1, 2, 1, 1)
    _, outs, held = drive(method, q, k, v, 50)
    shard_outs, shard_held = drive_shards(method, q, k, v, 50)
    assert shard_held == held
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(shard_outs, outs))
    alone = drive(method, q[:, :2], k[:, :1], v[:, :1], 50, shard=HeadShard(0, 0, 4, 2))[2]  # no sum across
    assert [step[0] for step in alone] != [step[0] for step in held]
