"""The C++ kernels' builds per instruction set (:mod:`attnkit.native`) and the guard that keeps a kernel off where
it is not faster than the torch path (:mod:`attnkit.native.guard`): its decision from measured times, its choices
cached per machine, build and shape class, forced either way by ``ATTNKIT_NATIVE``, and reported in a run's
statistics. No test here depends on this machine's timings: the comparisons are given their times."""

import hashlib
import json
import os
import platform
import shutil
import subprocess

import pytest
import torch

import attnkit
from attnkit import native
from attnkit.errors import AttnkitError
from attnkit.methods import quest_native, scoring_native
from attnkit.methods.spec import parse_method_spec
from attnkit.native import guard
from attnkit.sparse import kernels as sparse_kernels
from helpers import ROOT, random_ids

pytestmark = pytest.mark.skipif(scoring_native.library() is None, reason="no C++ compiler")  # CI has one
BUILDS = [i for i in native.runnable() if i != "native"] or ["native"]  # every instruction set this CPU runs


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No choice made yet in this process, the choices' file in `tmp_path` (the libraries loaded stay loaded)."""
    for name in ("scoring", "paged", "sparse"):
        native.load(name)
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path))
    monkeypatch.setattr(guard, "_memo", {})
    monkeypatch.setattr(guard, "_consulted", {})
    return tmp_path


@pytest.mark.parametrize("isa", BUILDS)
def test_each_instruction_set_builds_and_says_which(isa):
    lib = native.load("scoring", scoring_native.SIGNATURE, isa)
    assert native.built_isa(lib) == isa or isa == "native" and native.built_isa(lib) in native.WIDTHS.values()
    assert isa in lib.build and lib is native.load("scoring", scoring_native.SIGNATURE, isa)  # built once


def test_a_bad_instruction_set_is_refused_in_one_line(monkeypatch):
    with pytest.raises(AttnkitError, match=r"ATTNKIT_NATIVE_ISA must be one of native, avx2, avx512; got 'sse4'"):
        native.isa("sse4")
    monkeypatch.setenv(native.ENV_ISA, "sse4")
    with pytest.raises(AttnkitError, match="'sse4'"):
        scoring_native.library()
    monkeypatch.setenv(native.ENV_SWITCH, "yes")
    with pytest.raises(AttnkitError, match=r"ATTNKIT_NATIVE must be one of 0, 1, auto; got 'yes'"):
        native.switch()


def test_an_instruction_set_the_cpu_lacks_is_refused(monkeypatch):
    """An AVX2 machine (the AVX-512 flags hidden) refuses the AVX-512 build, naming what it lacks and what it runs."""
    flags = native.cpu_flags() - {"avx512f", "avx512bw", "avx512dq", "avx512vl"} | {"avx2", "fma"}
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    with pytest.raises(AttnkitError) as err:
        native.isa("avx512")
    assert str(err.value) == ("ATTNKIT_NATIVE_ISA=avx512: this CPU lacks avx512f, avx512bw, avx512dq, avx512vl; "
                              "allowed here: native, avx2")
    assert native.runnable() == ["native", "avx2"]


def test_settings_are_restored(monkeypatch):
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    monkeypatch.setenv(native.ENV_ISA, "native")
    with native.settings(BUILDS[0], "0"):
        assert native.isa() == BUILDS[0] and native.switch() == "0" and scoring_native.library() is None
    assert native.isa() == "native" and native.switch() == "auto"


def test_the_decision_from_measured_times():
    assert guard.decide([1.0, 2.0, 1.1], [1.5, 1.6, 1.4])[0]  # medians 1.1 < 1.5
    assert not guard.decide([1.5], [1.5])[0]  # not faster: the torch path
    on, why = guard.decide([2.0, 2.2, 9.0], [1.0, 1.1, 1.2])
    assert not on and why == "not faster than torch here (2.2e+03 ms vs 1.1e+03 ms)"
    assert not guard.decide([0.95], [1.0], margin=0.9)[0]  # within a margin, off
    with pytest.raises(ValueError):
        guard.decide([], [1.0])
    assert [guard.bucket(n) for n in (1, 256, 257, 4096, 5000)] == [256, 256, 1024, 4096, 16384]


def test_a_choice_is_measured_once_per_machine_build_and_shape(fresh, monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "auto")
    lib = scoring_native.library()
    calls = []

    def slower():
        calls.append(1)
        return [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]

    choice = guard.choose("scoring", lib, "some shape", slower)
    assert not choice.on and choice.isa == native.built_isa(lib) and calls == [1, 1]  # slower twice: off
    assert guard.choose("scoring", lib, "some shape", slower) is choice and calls == [1, 1]  # kept in the process
    saved = json.loads((fresh / "kernels" / guard.FILE).read_text())
    assert list(saved) == [f"{native.cpu_model()} | {lib.build} | some shape"]
    monkeypatch.setattr(guard, "_memo", {})  # a new process on this machine reads the file
    assert not guard.choose("scoring", lib, "some shape", slower).on and calls == [1, 1]
    assert guard.choose("scoring", lib, "another shape", lambda: ([1.0], [2.0])).on
    # slower in one comparison (the machine busy for a moment), faster in the next: on
    times = iter([([2.0], [1.0]), ([1.0], [2.0])])
    assert guard.choose("scoring", lib, "a third shape", lambda: next(times)).on
    monkeypatch.setenv(native.ENV_SWITCH, "1")  # forced: no comparison
    assert guard.choose("scoring", lib, "some shape", slower) == guard.Choice(True, choice.isa, "ATTNKIT_NATIVE=1")
    assert guard.choose("scoring", None, "some shape", slower).describe() == "off, -, not built (see the warning)"


def test_a_slower_kernel_is_left_off(fresh, monkeypatch):
    """The scoring, paged and sparse kernels each ask the guard; where the measured kernel is slower, the torch path
    runs and the run's statistics say so."""
    monkeypatch.setenv(native.ENV_SWITCH, "auto")
    measured = []

    def times(kernel, torch_path, repeats=guard.REPEATS):  # both paths run, and the kernel is found slower
        kernel(), torch_path()
        measured.append(1)
        return [2.0], [1.0]

    monkeypatch.setattr(guard, "time_both", times)
    eager = sparse_kernels.flex_sparse_attention
    monkeypatch.setattr(sparse_kernels, "flex_sparse_attention", lambda *a: eager(*a, compiled=False))  # no compiling
    q, k = torch.randn(1, 4, 8, 32), torch.randn(1, 2, 300, 32)
    assert not scoring_native.kernel_pays(q, k, k) and not scoring_native.kernel_pays(q, k)
    assert not quest_native.kernel_pays(q[:, :, :1], k)
    layout = attnkit.sparse.build_layout(["block_sparse"] * 4, 300, 0, 64, tiles=torch.ones(4, 5, 5, dtype=torch.bool))
    assert not sparse_kernels.native_pays(q, k, k, layout)
    assert len(measured) == 8  # each compared twice: off only where it loses again
    report = guard.report()
    assert set(report) == {"native_scoring", "native_paged", "native_sparse"}
    assert all(text.startswith("off, ") and "not faster than torch here" in text for text in report.values())
    line = guard.summary()  # the benchmarks' one-line form
    assert line.split("; ") == [f"{kernel}: {report['native_' + kernel]}" for kernel in ("paged", "scoring", "sparse")]
    assert guard.summary(guard.mark()) == "-"


def test_the_output_alone_is_compared_with_sdpa_on_a_whole_prompt(fresh, monkeypatch):
    """The scoring sweep's output alone (kvzip's prompt) is its own shape class, compared with what it replaces there,
    attnkit's dense attention (SDPA's causal kernel) over a whole causal prompt; the two agree."""
    monkeypatch.setenv(native.ENV_SWITCH, "auto")
    outs = {}

    def times(kernel_path, torch_path, repeats=guard.REPEATS):
        outs["kernel"], outs["torch"] = kernel_path(), torch_path()
        return [2.0], [1.0]

    monkeypatch.setattr(guard, "time_both", times)
    q, k = torch.randn(1, 4, 300, 32), torch.randn(1, 2, 300, 32)
    choice = scoring_native.choice(q, k, k, output_only=True)
    assert not choice.on and outs["kernel"].shape == outs["torch"].shape == (1, 4, 1024, 32)  # the length class
    torch.testing.assert_close(outs["kernel"], outs["torch"], rtol=1e-4, atol=1e-5)
    assert scoring_native.choice(q, k, k) is not choice  # the sweep with its statistic: a class of its own
    with pytest.raises(ValueError, match="needs values"):
        scoring_native.choice(q, k, output_only=True)


def test_the_sparse_guard_times_both_paths_on_a_sparse_layout(fresh, monkeypatch):
    """The sparse kernel is compared with the path it replaces, FlexAttention, over the same sparse layout: a share
    of the causal tiles, neither all nor only the forced ones (over a dense layout the comparison would miss what
    the kernel skips)."""
    monkeypatch.setenv(native.ENV_SWITCH, "auto")
    seen, outs = {}, {}
    real_native, real_flex = sparse_kernels.native_sparse_attention, sparse_kernels.flex_sparse_attention

    def kernel(q, k, v, layout, scaling):
        seen["kernel"] = layout
        return real_native(q, k, v, layout, scaling)

    def flex(q, k, v, layout, scaling):
        seen["flex"] = layout
        return real_flex(q, k, v, layout, scaling, compiled=False)

    def times(kernel_path, torch_path, repeats=guard.REPEATS):
        outs["kernel"], outs["flex"] = kernel_path(), torch_path()
        return [1.0], [2.0]

    monkeypatch.setattr(sparse_kernels, "native_sparse_attention", kernel)
    monkeypatch.setattr(sparse_kernels, "flex_sparse_attention", flex)
    monkeypatch.setattr(guard, "time_both", times)
    q, k = torch.randn(1, 4, 8, 32), torch.randn(1, 2, 300, 32)
    layout = attnkit.sparse.build_layout(["block_sparse"] * 4, 300, 0, 64, tiles=torch.ones(4, 5, 5, dtype=torch.bool))
    assert sparse_kernels.native_choice(q, k, k, layout).on
    layout = seen["kernel"]
    assert seen["flex"] is layout and layout.n_keys == 1024 and layout.n_heads == 4
    forced = 2 * 16 - 1  # the diagonal and the first tile of 16 tile rows
    assert all(forced < float(tiles) < 16 * 17 / 2 for tiles in layout.main.sum((1, 2)))
    torch.testing.assert_close(outs["kernel"], outs["flex"], rtol=1e-4, atol=1e-5)


def test_a_runs_statistics_say_which_kernels_ran(small_llama, monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    out = attnkit.generate(small_llama, random_ids(90, seed=3), parse_method_spec("h2o:budget=0.3"),
                           max_new_tokens=3, stop_at_eos=False)
    assert out.stats.method_stats["native_scoring"] == f"on, {native.built_isa(scoring_native.library())}, " \
                                                        f"ATTNKIT_NATIVE=1"
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    out = attnkit.generate(small_llama, random_ids(90, seed=3), parse_method_spec("h2o:budget=0.3"),
                           max_new_tokens=3, stop_at_eos=False)
    assert out.stats.method_stats["native_scoring"] == "off, -, ATTNKIT_NATIVE=0"
    full = attnkit.generate(small_llama, random_ids(90, seed=3), "full", max_new_tokens=3, stop_at_eos=False)
    assert not any(name.startswith("native_") for name in full.stats.method_stats)  # consulted nothing


def run_check(compiler: list[str], kernel: str, run: list[str] = ()) -> str:
    """``tests/native_check.cpp`` built for `kernel` by `compiler` (the command and its flags), cached under the
    kernels' build folder by a digest of the sources and the command, then run (through `run`, e.g. qemu-user):
    its output."""
    sources = [ROOT / "tests" / "native_check.cpp", *sorted(native.FOLDER.glob("*.cpp")), native.FOLDER / "tile.h"]
    digest = hashlib.sha256(b"\0".join([p.read_bytes() for p in sources] + [" ".join(compiler).encode(),
                                                                             kernel.encode()])).hexdigest()[:16]
    binary = native.cache_folder() / "checks" / f"{kernel}-{digest}"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")  # workers building at once each rename a whole one
        subprocess.run([*compiler, "-O3", "-std=c++17", "-pthread", f"-DKERNEL_{kernel.upper()}", f"-I{native.FOLDER}",
                        str(sources[0]), "-o", str(tmp)], check=True, capture_output=True)
        tmp.replace(binary)
    done = subprocess.run([*run, str(binary)], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else f"exit {done.returncode}: {done.stdout.strip()}"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86-64 build")
@pytest.mark.parametrize("kernel", ["scoring", "sparse", "paged"])
def test_the_128_bit_build_equals_the_reference(kernel):
    """The vectors of 4 floats and the tiles for 16 registers that an x86-64 CPU without AVX2 (SSE2) gets, and an
    ARM CPU's NEON build shares."""
    assert run_check([native.compiler(), "-march=x86-64"], kernel) == "ok 4"


@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")),
                    reason="no aarch64 cross compiler and qemu-user here")
@pytest.mark.parametrize("kernel", ["scoring", "sparse", "paged"])
def test_the_neon_build_equals_the_reference_under_qemu(kernel):
    assert run_check(["aarch64-linux-gnu-g++", "-static"], kernel, ["qemu-aarch64"]) == "ok 4"
