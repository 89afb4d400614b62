"""benchmarks/gpu_check.py keeps working where there is no GPU: its quick CPU run goes to the end and every method at
an unlimited budget gives full attention's tokens, on one device and with layers offloaded by accelerate; CUDA asked
for without a device is refused in one line.

The script's main() runs in this process (a new interpreter spends seconds importing torch and transformers), on one
thread, and on the tests' small random model with three layers (``--model``: layer 1 offloaded between two that are
not) rather than `tiny`'s geometry: every part and every method runs as on `tiny`, at a fraction of the arithmetic."""

import importlib.util
import json

import torch

from helpers import ROOT, SMALL

ROOT = ROOT
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
MODEL = "random:llama:" + SMALL.replace("layers=2", "layers=3")
_spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def run(*args) -> int:
    """`python benchmarks/gpu_check.py ARGS` on one thread (the kernel part runs its kernels in Triton's interpreter:
    TRITON_INTERPRET=1, set by conftest.py); its exit status."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return gpu_check.main(list(args))
    finally:
        torch.set_num_threads(threads)


def test_quick_cpu_run_goes_to_the_end(tmp_path):
    assert run("--device", "cpu", "--quick", "--model", MODEL, "--out", str(tmp_path)) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    exact = {r["method"]: r for r in result["exactness"]}
    from attnkit.methods.spec import METHODS
    assert set(exact) == set(METHODS)
    for row in exact.values():
        assert "error" not in row, row
        if row["unlimited"]:
            assert row["tokens_equal"] and row["max_abs_logit_diff"] < 1e-3, row
        assert row["max_abs_logit_diff_until_parting"] <= row["max_abs_logit_diff"]
        assert (row["full_top2_margin_at_parting"] is None) == row["tokens_equal"], row
    assert {r["method"] for r in result["prefill"]} == {"full", "minference:compile=false",
                                                           "minference:dense_above=1,compile=false",
                                                           "a_shape:compile=false"}
    assert {r["batch_size"] for r in result["decode"]} == {1, 2}
    kernels = result["kernel_statistics"]  # part 0's second half: every statistic, the shortest length
    assert {r["statistic"] for r in kernels} == {"h2o_mean", "h2o_max", "keyformer", "kvzip_chunk"}
    assert all(r["length"] == 128 and r["max_rel_statistic_diff"] < 1e-4 for r in kernels), kernels
    assert "### Decode at 512 tokens" in (tmp_path / "gpu_check.md").read_text()
    # part 4: odd layers and the head offloaded to the disk by accelerate, every method still exact
    placement = result["placement"]
    assert [placement["device_map"][f"model.layers.{i}"] for i in range(3)] == ["cpu", "disk", "cpu"]
    assert placement["layer_devices"][1] == "cpu"
    assert {r["method"] for r in placement["rows"]} == set(METHODS)
    for row in placement["rows"]:
        assert "error" not in row, row
        if row["unlimited"]:
            assert row["tokens_equal"] and row["max_abs_logit_diff"] < 1e-3, row


def test_cuda_without_a_device_is_refused(tmp_path, capsys):
    if torch.cuda.is_available():
        return  # the refusal only exists where there is no device
    assert run("--device", "cuda", "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "sees no CUDA device" in err
    assert not (tmp_path / "gpu_check.json").exists()
