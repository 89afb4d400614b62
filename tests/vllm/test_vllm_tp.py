"""attnkit inside vLLM with tensor parallelism: two CPU workers, each holding one of ``tiny``'s two kv heads. Each kv
head chooses its own entries, so a shard needs nothing from the other, and the tokens are attnkit's."""

import os

import pytest

import attnkit
from attnkit.eval.data.task_registry import get_task

TINY = os.path.join(os.path.dirname(attnkit.__file__), "assets", "tiny")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel CPU workers need two cores")
def test_tensor_parallel_workers_give_attnkit_tokens(monkeypatch):
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    # vLLM's CPU workers bind their threads to NUMA nodes; on one node, each worker is given half of this process's
    # cores (both the same one where it has one: an xdist worker of ./run test)
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    ranks = (cores[:half], cores[half:] or cores[:half])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, r)) for r in ranks))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    # the engine core in this process, the two workers in their own: on two cores a child engine process's busy loop
    # would take time from the workers
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = attnkit.load_model("tiny")
    prompts = [get_task("passkey").make(model.tokenizer, n, seed=50 + i).prompt for i, n in enumerate((1200, 2600))]
    llm = LLM(model=TINY, dtype="float32", enforce_eager=True, max_model_len=4096, tensor_parallel_size=2,
              distributed_executor_backend="mp", additional_config={"attnkit": {"recipe": "snapkv:budget=0.3",
                                                                                 "allow": "*"}})
    try:
        for spec in ("snapkv:budget=0.3", "streaming:budget_tokens=256", "minference+snapkv:budget=0.3",
                     "h2o:budget_tokens=256", "snapkv:budget_tokens=256,decode_every=8",
                     "quest:page_size=128,token_budget=512,dense_layers=0"):  # each shard its kv heads' summaries
            sp = SamplingParams(max_tokens=24, temperature=0, extra_args={"attnkit": spec})
            got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, [sp] * 2, use_tqdm=False)]
            assert got == [g.token_ids for g in attnkit.generate(model, prompts, spec, max_new_tokens=24)], spec
        # TOVA's choice for a kv head averages every head's attention, which one shard does not hold
        with pytest.raises(VLLMValidationError, match="tensor_parallel_size=2"):
            llm.generate(prompts[:1], [SamplingParams(max_tokens=4, extra_args={"attnkit": "tova:budget=0.3"})],
                         use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
