"""Which methods a tensor-parallel shard of the kv heads runs (attnkit.vllm.shards), without an engine: the refusal
names the method, the tensor-parallel size and what a shard lacks, in one line; the methods that choose per kv head
from that head alone pass (tests/vllm/test_vllm_tp.py runs both kinds in vLLM)."""

import os

import pytest

from attnkit.errors import AttnkitError
from attnkit.methods.base import resolve_method
from attnkit.vllm.plan import check_parallel

SWEEPS = os.path.join(os.path.dirname(__file__), "..", "..", "sweeps")
REFUSED = [(f"duo_attention:config={SWEEPS}/duo_tiny.json", "calibration file")]
# the draws and calibration files of Keyformer, random, TriAttention, q-filters, Expected Attention and MInference are read at the
# shard's heads (attnkit.heads.HeadShard); TOVA's and Keyformer's shared sums over every head add the shards' sums
RUN = ["snapkv:budget=0.3", "h2o:budget=0.3", "keyformer:budget=0.3,noise=constant", "keyformer:budget=0.3,noise=none",
       "keyformer:budget=0.3", "keyformer:budget=0.3,noise=gaussian", "tova:budget=0.3",
       "keyformer:budget=0.3,score=shared",
       f"triattention:config={SWEEPS}/triattention_tiny.json,budget_tokens=256", "random:budget=0.3",
       f"minference:config={SWEEPS}/minference_tiny_yarn8_32k.json",
       f"qfilter:config={SWEEPS}/qfilter_tiny.json,budget=0.3",
       f"expected_attention:stats={SWEEPS}/expected_attention_tiny.safetensors,budget=0.3",
       "rkv:budget_tokens=256", "expected_attention:budget=0.3", "leverage:budget=0.3,sketch_dimension=0",
       "leverage:budget=0.3", "compactor:budget=0.3", "compactor:budget=0.3,sketch_dimension=0",
       "minference+snapkv:budget=0.3", "streaming:budget_tokens=256", "quest:page_size=128,token_budget=512"]


@pytest.mark.parametrize("spec, reason", REFUSED)
def test_methods_a_shard_cannot_run_are_refused_in_one_line(spec, reason):
    check_parallel(resolve_method(spec), 1, "extra_args['attnkit']")  # one worker holds every head
    with pytest.raises(AttnkitError) as info:
        check_parallel(resolve_method(spec), 2, "extra_args['attnkit']")
    message = str(info.value)
    assert "tensor_parallel_size=2" in message and reason in message and "\n" not in message, message


@pytest.mark.parametrize("spec", RUN)
def test_methods_choosing_from_each_kv_head_alone_run_on_a_shard(spec):
    check_parallel(resolve_method(spec), 2, "extra_args['attnkit']")


@pytest.mark.parametrize("spec", ["snapkv:budget=0.3", "keyformer:budget=0.3", "quest:page_size=128,token_budget=512"])
def test_more_workers_than_kv_heads_refuse_methods_whose_copies_would_choose_apart(spec):
    check_parallel(resolve_method(spec), 2, "extra_args['attnkit']", kv_heads=2)
    with pytest.raises(AttnkitError) as info:
        check_parallel(resolve_method(spec), 4, "extra_args['attnkit']", kv_heads=2)
    message = str(info.value)
    assert "tensor_parallel_size=4" in message and "2 kv heads" in message and "\n" not in message, message


@pytest.mark.parametrize("spec", ["full", "window:window=256", "streaming:budget_tokens=256"])
def test_more_workers_than_kv_heads_run_full_attention_and_position_only_methods(spec):
    check_parallel(resolve_method(spec), 4, "extra_args['attnkit']", kv_heads=2)
