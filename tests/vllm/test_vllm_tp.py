"""attnkit inside vLLM with tensor parallelism: two CPU workers, each holding one of ``tiny``'s two kv heads. Each kv
head chooses its own entries, so a shard needs nothing from the other, and the tokens are attnkit's: for the prompt
scorers, the methods that act while decoding (per step and re-compressing), the draws and calibration files of
Keyformer, random, leverage, compactor, TriAttention, q-filters, Expected Attention, MInference and KVzap read at the
shard's own heads (attnkit.heads.HeadShard), the choices of TOVA, Keyformer's shared score and compactor over every
head (each worker's sums added to the other's), and Quest's pages. Methods whose choice depends on what a shard does
not hold are refused (attnkit.vllm.shards)."""

import os

import pytest
from test_vllm import EA_STATS, KVZAP, QFILTER, SWEEPS, TINY, TRIATTENTION

import attnkit
from attnkit.eval.data.task_registry import get_task

MINFERENCE = os.path.join(SWEEPS, "minference_tiny_yarn8_32k.json")  # per-head patterns of tiny's geometry


def two_workers() -> dict:
    """vLLM's settings for an engine of two tensor-parallel CPU workers: vLLM's CPU workers bind their threads to NUMA
    nodes, and on one node each is given half of this process's cores (both the same one where it has one: an xdist
    worker of ./run test); the engine core runs in this process, the two workers in their own (on two cores a child
    engine process's busy loop would take time from the workers)."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    ranks = (cores[:half], cores[half:] or cores[:half])
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, r)) for r in ranks), "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def two_worker_engine(backend: str, length: int):
    """An engine of two tensor-parallel workers started by `backend` (vLLM's ``distributed_executor_backend``), every
    prompt prefilled whole (no chunked prefill), as attnkit.generate does, so the tokens compare exactly."""
    from vllm import LLM

    return LLM(model=TINY, dtype="float32", enforce_eager=True, max_model_len=length, tensor_parallel_size=2,
               distributed_executor_backend=backend, enable_chunked_prefill=False, max_num_batched_tokens=length,
               additional_config={"attnkit": {"recipe": "snapkv:budget=0.3", "allow": "*"}})


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel CPU workers need two cores")
def test_tensor_parallel_workers_give_attnkit_tokens(monkeypatch):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    for name, value in two_workers().items():
        monkeypatch.setenv(name, value)
    model = attnkit.load_model("tiny")
    prompts = [get_task("passkey").make(model.tokenizer, n, seed=50 + i).prompt for i, n in enumerate((800, 1600))]
    llm = two_worker_engine("mp", 4096)
    try:
        specs = ["streaming:budget_tokens=256", f"minference:config={MINFERENCE}+snapkv:budget=0.3",  # heads' patterns
                 # per step; Keyformer's Gumbel noise of each shard's heads
                 "h2o:budget_tokens=256", "keyformer:budget_tokens=256",
                 # their choice reads every head: each worker's sums added to the other's
                 "tova:budget_tokens=256", "keyformer:budget_tokens=300,score=shared", "compactor:budget=0.3",
                 "keyformer:budget_tokens=256,noise=gaussian,decode_every=8", "tova:budget_tokens=256,decode_every=8",
                 "h2o:budget_tokens=256,decode_every=8",  # buffered: the steps between compressions as plain rows
                 f"triattention:config={TRIATTENTION},budget_tokens=256,decode_every=8",
                 f"qfilter:config={QFILTER},budget=0.3", "random:budget=0.3,seed=7", "leverage:budget=0.3",
                 f"expected_attention:stats={EA_STATS},budget_tokens=256,decode_every=8",
                 "rkv:budget_tokens=256,decode_every=8", "snapkv:budget_tokens=256,decode_every=8",
                 "knorm:budget_tokens=256,decode_every=8", "keydiff:budget_tokens=256,decode_every=8",
                 "quest:page_size=128,token_budget=512,dense_layers=0",  # each shard its kv heads' summaries
                 # the surrogate's scores of each shard's kv heads, its weight check summed over the workers
                 f"kvzap:config={KVZAP},budget_tokens=256,decode_every=8"]
        # all of them submitted together, one prompt each (the two in turn): the methods side by side in each step, as
        # a server runs them
        mine = [prompts[i % 2] for i in range(len(specs))]
        params = [SamplingParams(max_tokens=24, temperature=0, extra_args={"attnkit": s}) for s in specs]
        out = [list(o.outputs[0].token_ids) for o in llm.generate(mine, params, use_tqdm=False)]
        for got, prompt, spec in zip(out, mine, specs):
            assert got == attnkit.generate(model, [prompt], spec, max_new_tokens=24)[0].token_ids, spec
        # every method the host serves runs on a shard of tiny's heads (what a shard cannot run is refused before the
        # workers: tests/vllm_host/test_vllm_shards.py); one the host never runs is refused when submitted, and the
        # engine serves on
        with pytest.raises(VLLMValidationError, match="kvzip"):
            llm.generate(prompts[:1], [SamplingParams(max_tokens=4, extra_args={"attnkit": "kvzip:budget=0.3"})],
                         use_tqdm=False)
        sp = SamplingParams(max_tokens=4, temperature=0)
        assert len(llm.generate(prompts[:1], [sp], use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        llm.llm_engine.engine_core.shutdown()
