"""benchmarks/gpu_check.py keeps working where there is no GPU: its quick CPU run goes to the end and every method at
an unlimited budget gives full attention's tokens, on one device and with layers offloaded by accelerate; CUDA asked
for without a device is refused in one line."""

import json
import subprocess
import sys

import torch

from helpers import ROOT

ROOT = ROOT
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def run(*args):
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "TRITON_INTERPRET": "1"}  # the kernel part runs its kernels in Triton's interpreter
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=900)


def test_quick_cpu_run_goes_to_the_end(tmp_path):
    done = run("--device", "cpu", "--quick", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
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
    assert placement["device_map"]["model.layers.1"] == "disk" and placement["layer_devices"][1] == "cpu"
    assert {r["method"] for r in placement["rows"]} == set(METHODS)
    for row in placement["rows"]:
        assert "error" not in row, row
        if row["unlimited"]:
            assert row["tokens_equal"] and row["max_abs_logit_diff"] < 1e-3, row


def test_cuda_without_a_device_is_refused(tmp_path):
    if torch.cuda.is_available():
        return  # the refusal only exists where there is no device
    done = run("--device", "cuda", "--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "sees no CUDA device" in done.stderr
