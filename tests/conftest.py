import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton's kernels (attnkit.methods.scoring_triton) run on this CPU through its interpreter; Triton reads this when
# its own language functions are defined, so before anything imports it
os.environ.setdefault("TRITON_INTERPRET", "1")
# the C++ kernels run wherever they are built, without the guard's timed comparison (attnkit.native.guard), so no
# test depends on this machine's timings; tests of the guard set ATTNKIT_NATIVE themselves
os.environ.setdefault("ATTNKIT_NATIVE", "1")

import torch  # noqa: E402

# under pytest-xdist (./run test: a worker per core) each worker computes on one thread: two workers of two threads
# each on two cores wait on each other's spinning threads
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= (os.cpu_count() or 1) > 1:
    torch.set_num_threads(1)

import attnkit  # noqa: E402
from helpers import REPORT_SWEEP, SMALL  # noqa: E402

# the slowest test files, started first under pytest-xdist's --dist loadfile, which hands files to the workers in
# collection order: a long file left for last would hold one worker while the other idles
SLOW_FIRST = ("eval/run/test_ray_sweep.py", "speculative/test_speculative_generate.py", "test_batch.py",
              "test_readme.py", "cli/test_cli.py", "training/test_train_v2_run.py", "test_device_map.py",
              "eval/report/test_report_scale.py", "methods/test_chunk_length.py", "test_hf_cache.py",
              "vllm/test_vllm.py", "vllm/test_vllm_capacity.py", "vllm/test_vllm_server.py", "vllm/test_vllm_tp.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    here = os.path.dirname(os.path.abspath(__file__))

    def order(item):
        return rank.get(os.path.relpath(str(item.path), here), len(SLOW_FIRST))

    items.sort(key=order)  # stable: within a file and among the others, the collection order


@pytest.fixture(scope="session")
def small_llama():
    return attnkit.load_model(f"random:llama:{SMALL}")


@pytest.fixture(scope="session")
def arch_models():
    """Small random models of the three architectures the methods are checked on (Mistral with its own sliding
    window); shared, never modified."""
    return {"llama": attnkit.load_model(f"random:llama:{SMALL}"),
            "mistral": attnkit.load_model(f"random:mistral:{SMALL},sliding_window=48"),
            "qwen3": attnkit.load_model(f"random:qwen3:{SMALL}")}


@pytest.fixture(scope="session")
def kvzap_configs(arch_models, tmp_path_factory):
    """kvzap's linear surrogate per architecture of `arch_models`, trained on 2 windows of 128 tokens (held out: 1): a
    short training, enough for the tests of what kvzap does with its scores."""
    from attnkit.calibrate.kvzap import calibrate_kvzap
    from attnkit.methods.kvzap_predictor import save_predictor
    folder = tmp_path_factory.mktemp("kvzap")
    out = {}
    for arch, model in arch_models.items():
        layers, meta = calibrate_kvzap(model, samples=2, length=128, heldout=1)
        out[arch] = str(save_predictor(folder / f"{arch}.safetensors", "linear", layers, meta))
    return out


@pytest.fixture(scope="session")
def triattention_configs(arch_models, tmp_path_factory):
    """triattention's query statistics per architecture of `arch_models`, from 2 windows of 96 tokens."""
    from attnkit.calibrate.triattention import calibrate_triattention
    from attnkit.methods.triattention_stats import dumps_stats
    folder = tmp_path_factory.mktemp("triattention")
    out = {}
    for arch, model in arch_models.items():
        path = folder / f"{arch}.json"
        path.write_text(dumps_stats(calibrate_triattention(model, samples=2, length=96)))
        out[arch] = str(path)
    return out


@pytest.fixture(scope="session")
def greedy_models():
    """The speculative tests' target and a different draft model (shared by their files, never modified)."""
    return attnkit.load_model(f"random:llama:{SMALL}"), attnkit.load_model(f"random:llama:{SMALL},seed=3")


@pytest.fixture(scope="module")
def report_sweep(tmp_path_factory):
    """The results file of :data:`helpers.REPORT_SWEEP` (the report's tests), run once per module that asks."""
    from attnkit.eval.run import results as results_store
    from attnkit.eval.run.sweep import run_sweep, sweep_from_dict

    out = tmp_path_factory.mktemp("sweep")
    run_sweep(sweep_from_dict(REPORT_SWEEP), out, progress=False)
    return out / results_store.RESULTS_FILE
