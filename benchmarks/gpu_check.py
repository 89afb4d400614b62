"""The GPU check: what a CPU machine cannot measure, in one run on a CUDA device.

    python benchmarks/gpu_check.py --out results/gpu_check                     # on a machine with CUDA
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu_check  # keeps the script working (CI)

Six parts, each written to ``OUT/gpu_check.json`` (every row) and ``OUT/gpu_check.md`` (the tables):

0. **H2O's fused prompt pass** (:func:`attnkit.methods.scoring.fused_attention_with_statistics`, two flash calls)
   against the blocked pass in float32 at the ``--prefill-lengths`` up to 32k: output and statistic differences.
   Then the **Triton kernels** of the other prompt statistics (:mod:`attnkit.methods.scoring_triton`: H2O with a
   maximum over the group, Keyformer, a KVzip reconstruction chunk; H2O's mean for comparison) against the
   blocked pass in float32, with both times.
1. **Exactness** in the device's inference dtype (bfloat16 on CUDA, float32 on a CPU): every registered method
   at an unlimited budget against full attention on a batch of prompts of different lengths (greedy tokens
   equal? the largest logit difference). In bfloat16 a method that computes attention its own way (blocked
   scoring, sparse kernels) may round differently from SDPA: the table shows by how much, and where tokens part.
2. **Sparse prefill**: prefill time of ``minference`` (compiled FlexAttention kernels on CUDA) and ``a_shape``
   against full attention (SDPA, FlashAttention on CUDA) at each ``--prefill-lengths`` length; also with
   ``dense_above=1`` (every head on its pattern), which shows what a kept pair costs the kernel against SDPA on
   this device, the figure ``dense_above``'s default rests on.
3. **Decode**: tokens/s of the whole batch and KV bytes per sequence of each ``--decode-methods`` method at
   ``--decode-context`` tokens and each of ``--batch-sizes``, with the decode floor from the measured memory
   bandwidth (:func:`attnkit.bench.speed.run_bench`: methods interleaved in every repeat, medians, ratios to full).
4. **Placement**: the exactness batch again on the model spread by accelerate (``device_map``): the embedding
   and the even layers on the device, the odd layers, the final norm and the LM head on the CPU, each running
   where it sits (accelerate's main device is the CPU, so nothing placed there is moved to the GPU to run); on
   a CPU run the odd layers and the head are offloaded to the disk instead. Every method must still give full
   attention's tokens with its layers' caches on two devices (skipped, and said so, without accelerate).

The default model has the bundled ``tiny``'s geometry with random weights (timings do not depend on what
weights learnt); ``--model`` takes any attnkit model spec. ``--quick`` shrinks every length, batch and repeat
so the whole script runs in about a minute on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import attnkit
from attnkit.bench.speed import format_bench, measure_bandwidth, run_bench
from attnkit.methods.spec import METHODS, parse_method_spec, split_spec_list

TINY_GEOMETRY = "random:llama:layers=6,hidden=256,heads=8,kv_heads=2,head_dim=32,intermediate=768"


# methods whose spec here still drops attention: minference_static's indices are fixed by its calibration file
NOT_UNLIMITED = {"minference_static": "indices fixed at calibration (sparse whatever the length): for the record"}


def unlimited_specs(total: int, static_config: str, kvzap_config: str = "",
                    triattention_config: str = "", qfilter_config: str = "", fastkvzip_config: str = "",
                    lukv_config: str = "", restorekv_config: str = "") -> dict[str, str]:
    """One spec per registered method that keeps every one of `total` tokens (prompt + generated); `kvzap_config` is
    a kvzap surrogate trained for the model (:func:`kvzap_surrogate`), `triattention_config` its query statistics
    (:func:`triattention_stats`), `qfilter_config` its Q-Filters (:func:`triattention_stats` with ``qfilter``)."""
    b = f"budget_tokens={total}"
    specs = {
        "full": "full", "window": f"window:window={total}", "streaming": f"streaming:{b}", "h2o": f"h2o:{b}",
        "keyformer": f"keyformer:{b}", "snapkv": f"snapkv:{b}", "knorm": f"knorm:{b}", "keydiff": f"keydiff:{b}",
        "rkv": f"rkv:{b}", "tova": f"tova:{b}", "expected_attention": f"expected_attention:{b}",
        "random": f"random:{b}", "lagkv": f"lagkv:{b}", "cur": f"cur:{b}", "cap": f"cap:{b}", "kvcompose": f"kvcompose:{b}",
        "observed_attention": f"observed_attention:{b}", "finch": f"finch:{b}",
        "leverage": f"leverage:{b}", "non_causal_attention": f"non_causal_attention:{b}", "compactor": f"compactor:{b}",
        "simlayerkv": "simlayerkv:lazy_threshold=1.0",  # no layer lazy: every entry kept
        "minference": f"minference:k_v=0,k_s={total}", "minference_static": f"minference_static:config={static_config}",
        "a_shape": f"a_shape:n_init={total},n_local={total}", "share": "share:config=none",
        "select": "select:filter_layer=1,p_decode=1.0", "gemfilter": f"gemfilter:filter_layer=1,k={total}",
        "compose": f"minference:k_v=0,k_s={total}+h2o:{b}", "duo_attention": f"duo_attention:retrieval_ratio=0,recent={total}",
        "cam": f"cam:{b}", "kivi": f"kivi:residual={total}",  # a residual holding every token: nothing is quantized
        "kvzip": f"kvzip:{b}", "kvgrad": f"kvgrad:{b}", "kvzap": f"kvzap:config={kvzap_config},{b}",
        "quest": f"quest:token_budget={total},dense_layers=0",
        "triattention": f"triattention:config={triattention_config},{b}",
        "qfilter": f"qfilter:config={qfilter_config},{b}", "think": "think:key_channels=0",  # no channel pruned
        "fastkvzip": f"fastkvzip:config={fastkvzip_config},{b}", "lukv": f"lukv:curve={lukv_config},{b}",
        "restorekv": f"restorekv:config={restorekv_config},{b}",  # nothing evicted: no restore token added
    }
    missing = sorted(set(METHODS) - set(specs))
    if missing:
        raise SystemExit(f"gpu_check: no unlimited-budget spec for {', '.join(missing)}; add one to unlimited_specs")
    return {name: specs[name] for name in sorted(METHODS)}


def static_patterns(model_spec: str, length: int, path: Path) -> str:
    """A minference_static pattern file for the model (``attnkit calibrate patterns --static``)."""
    from attnkit.cli import main as cli_main
    rc = cli_main(["calibrate", "patterns", "--model", model_spec, "--length", str(length), "--flops-budget", "0.5",
                   "--block-size", "16", "--tasks", "passkey", "--samples", "1", "--static", "--out", str(path)])
    if rc != 0:
        raise SystemExit("gpu_check: calibrating the static patterns failed")
    return str(path)


def triattention_stats(model_spec: str, path: Path, tool: str = "triattention") -> str:
    """triattention's query statistics for the model (``attnkit calibrate triattention``, two windows of 128 tokens), or
    another calibration of the model's queries by the same arguments (`tool`: ``qfilter``)."""
    from attnkit.cli import main as cli_main
    rc = cli_main(["calibrate", tool, "--model", model_spec, "--samples", "2", "--length", "128",
                   "--out", str(path)])
    if rc != 0:
        raise SystemExit(f"gpu_check: attnkit calibrate {tool} failed")
    return str(path)


def trained_file(model_spec: str, path: Path, tool: str) -> str:
    """fastkvzip's gates (``attnkit calibrate fastkvzip``, one window of 128 tokens, 5 steps), lukv's budget curve
    (``attnkit calibrate lukv``, one passkey pair of 256 tokens, 4 answer tokens) or restorekv's weights (``attnkit
    calibrate restorekv``, one passkey prompt of 256 tokens, one step) for the model."""
    from attnkit.cli import main as cli_main
    args = {"fastkvzip": ["--samples", "1", "--length", "128", "--heldout", "1", "--steps", "5"],
            "lukv": ["--tasks", "passkey", "--samples", "1", "--length", "256", "--new-tokens", "4"],
            "restorekv": ["--tasks", "passkey", "--samples", "1", "--length", "256", "--heldout", "1", "--new-tokens",
                          "4", "--steps", "1", "--batch-size", "1", "--split", "calibration"]}[tool]
    if cli_main(["calibrate", tool, "--model", model_spec, *args, "--out", str(path)]) != 0:
        raise SystemExit(f"gpu_check: attnkit calibrate {tool} failed")
    return str(path)


def kvzap_surrogate(model_spec: str, path: Path) -> str:
    """A small kvzap surrogate for the model (``attnkit calibrate kvzap``, two windows of 128 tokens)."""
    from attnkit.cli import main as cli_main
    rc = cli_main(["calibrate", "kvzap", "--model", model_spec, "--samples", "2", "--length", "128", "--heldout", "1",
                   "--out", str(path)])
    if rc != 0:
        raise SystemExit("gpu_check: training the kvzap surrogate failed")
    return str(path)


def exactness_specs(model_spec: str, lengths: list[int], new_tokens: int, compile_kernels: bool,
                    tmp: Path) -> dict[str, str]:
    """The specs of :func:`exactness_rows`: :func:`unlimited_specs` with the model's calibrations written to `tmp`
    (once: the placed model of part 4 is the same model and takes the same files)."""
    total = max(lengths) + new_tokens
    specs = unlimited_specs(total, static_patterns(model_spec, max(256, max(lengths)), tmp / "static.json"),
                            kvzap_surrogate(model_spec, tmp / "kvzap.safetensors"),
                            triattention_stats(model_spec, tmp / "triattention.json"),
                            triattention_stats(model_spec, tmp / "qfilter.json", "qfilter"),
                            trained_file(model_spec, tmp / "fastkvzip.safetensors", "fastkvzip"),
                            trained_file(model_spec, tmp / "lukv.safetensors", "lukv"),
                            trained_file(model_spec, tmp / "restorekv.safetensors", "restorekv"))
    if not compile_kernels:
        specs = {k: (v + ",compile=false" if k in ("minference", "minference_static", "a_shape") else v)
                 for k, v in specs.items()}
        specs["compose"] = specs["compose"].replace("+", ",compile=false+", 1)
    return specs


def exactness_rows(model, specs: dict[str, str], lengths: list[int], new_tokens: int) -> list[dict]:
    """Every method of `specs` (:func:`exactness_specs`) on one batch of prompts of `lengths`, against full's."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.geometry.vocab_size, (n,), generator=g).tolist() for n in lengths]

    def run(spec):
        return attnkit.generate(model, prompts, parse_method_spec(spec), max_new_tokens=new_tokens,
                                stop_at_eos=False, keep_logits=True)

    full = run("full")
    rows = []
    for name, spec in specs.items():
        start = time.perf_counter()
        try:
            out = run(spec)
        except attnkit.AttnkitError as exc:  # a refusal is a finding, not a crash of the check
            rows.append({"method": name, "spec": spec, "error": str(exc)})
            continue
        first = [next((i for i, (a, b) in enumerate(zip(o.token_ids, f.token_ids)) if a != b), None)
                 for o, f in zip(out, full)]
        diff = max(float((a.float() - b.float()).abs().max()) for o, f in zip(out, full)
                   for a, b in zip(o.logits, f.logits))
        # up to the step where the tokens part (that step's logits still come from the same inputs): a rounding
        # difference, and full's margin between its two best tokens there (a near tie flips on such a difference)
        before = max(float((a.float() - b.float()).abs().max()) for o, f, i in zip(out, full, first)
                     for a, b in list(zip(o.logits, f.logits))[:None if i is None else i + 1])
        margins = [float(f.logits[i].float().topk(2).values.diff().abs()) for f, i in zip(full, first) if i is not None]
        rows.append({"method": name, "spec": spec, "unlimited": name not in NOT_UNLIMITED,
                     "tokens_equal": all(i is None for i in first),
                     "first_different_token": [i for i in first if i is not None][:1] or None,
                     "max_abs_logit_diff": diff, "max_abs_logit_diff_until_parting": before,
                     "full_top2_margin_at_parting": min(margins) if margins else None,
                     "wall_s": time.perf_counter() - start})
    return rows


def fused_statistics_rows(device: str, dtype: torch.dtype, lengths: list[int]) -> list[dict]:
    """H2O's fused prompt pass (two flash calls) against the blocked pass in float32 on random tensors in `tiny`'s
    head layout: the largest output difference, the largest relative difference of a key's statistic, times."""
    from attnkit.generation import sync
    from attnkit.methods import scoring

    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for n in lengths:
        q, k, v = (torch.randn(2, h, n, 32, device=device, generator=g).mul(2).to(dtype) for h in (8, 2, 2))
        pos = torch.arange(n, device=device)
        sync(device)
        t0 = time.perf_counter()
        out, stats = scoring.fused_attention_with_statistics(q, k, v, 32 ** -0.5)
        sync(device)
        t1 = time.perf_counter()
        ref_out, ref_stats = scoring.attention_with_statistics(q.float(), k.float(), v.float(), 32 ** -0.5, pos, pos)
        sync(device)
        rows.append({"length": n, "chosen_by_default": scoring.fused_pays(q),
                     "max_abs_output_diff": float((out.float() - ref_out).abs().max()),
                     "max_rel_statistic_diff": float(((stats - ref_stats).abs() / ref_stats).max()),
                     "fused_s": t1 - t0, "blocked_float32_s": time.perf_counter() - t1})
    return rows


INTERPRETED_LENGTH = 128  # Triton's interpreter runs a kernel program by program in Python: slow past this


def kernel_statistics_rows(device: str, dtype: torch.dtype, lengths: list[int]) -> list[dict]:
    """The Triton kernels of the prompt statistics (:mod:`attnkit.methods.scoring_triton`) against the blocked passes
    in float32, on random tensors in `tiny`'s head layout: H2O (mean and max over the group), Keyformer's Gumbel
    score and one KVzip reconstruction chunk (up to 2,048 queries over the prompt and themselves), with the largest
    relative difference of a key's statistic and the times of both. Runs where the kernels do (CUDA with Triton,
    or Triton's interpreter: ``TRITON_INTERPRET=1``, once, at :data:`INTERPRETED_LENGTH` tokens at most: there it
    only keeps this part working; ``tests/methods/test_scoring_triton.py`` checks the kernels)."""
    import os

    from attnkit.methods import scoring_triton

    if not scoring_triton.kernels_pay(torch.zeros(1, device=device)):
        if os.environ.get("TRITON_INTERPRET") != "1" or scoring_triton.triton is None:
            return [{"skipped": "the kernels run on CUDA with Triton installed (or under TRITON_INTERPRET=1)"}]
        lengths = [min(lengths[0], INTERPRETED_LENGTH)]
    g = torch.Generator(device=device).manual_seed(1)
    rows = []
    for n in lengths:
        q, k, v = (torch.randn(2, h, n, 32, device=device, generator=g).mul(2).to(dtype) for h in (8, 2, 2))
        m = min(n, 2048)
        qr = torch.randn(2, 8, m, 32, device=device, generator=g).mul(2).to(dtype)
        for name in ("h2o_mean", "h2o_max", "keyformer", "kvzip_chunk"):
            rows.append({"length": n, "statistic": name, **kernel_against_blocked(name, q, k, v, qr)})
    return rows


def kernel_against_blocked(name: str, q, k, v, qr) -> dict:
    """One statistic of :func:`kernel_statistics_rows` by the kernels and by the blocked pass in float32."""
    from attnkit.generation import sync
    from attnkit.methods import kvzip, scoring, scoring_triton
    from attnkit.methods.keyformer_noise import GumbelFactorWeights

    scale, pos, m = 32 ** -0.5, torch.arange(q.shape[2], device=q.device), qr.shape[2]
    weights = GumbelFactorWeights(0, 0, 2) if name == "keyformer" else None
    reduce = "max" if name == "h2o_max" else "mean"
    kr, vr = torch.cat([k, k[:, :, :m]], 2), torch.cat([v, v[:, :, :m]], 2)

    def run(kernels: bool, x, y, z, xr, yr, zr):
        if name == "kvzip_chunk":
            return kvzip.reconstruction_attention(xr, yr, zr, scale, 0, m, 0, one_pass=not kernels, kernels=kernels)[1]
        if kernels:
            return scoring_triton.prompt_attention_with_statistics(x, y, z, scale, pos, reduce=reduce, weights=weights)[1]
        return scoring.attention_with_statistics(x, y, z, scale, pos, pos, reduce=reduce, weights=weights)[1]

    if q.is_cuda:
        run(True, q, k, v, qr, kr, vr)  # Triton compiles a kernel on its first call: not timed
    sync(q.device)
    t0 = time.perf_counter()
    stats = run(True, q, k, v, qr, kr, vr)
    sync(q.device)
    t1 = time.perf_counter()
    ref = run(False, *(x.float() for x in (q, k, v, qr, kr, vr)))
    sync(q.device)
    return {"kernels_s": t1 - t0, "blocked_float32_s": time.perf_counter() - t1,
            "max_rel_statistic_diff": float(((stats - ref).abs() / ref.clamp(min=1e-6)).max())}


def placed_model(spec: str, device: str, dtype: torch.dtype, offload_dir: Path):
    """The model spread over `device` and the CPU (on a CPU run: the CPU and the disk) by accelerate, as part 4
    of the module docstring says, and the device map used."""
    import accelerate

    model = attnkit.load_model(spec, dtype=dtype)
    gpu = device.startswith("cuda")
    here, away = (torch.device(device).index or 0, "cpu") if gpu else ("cpu", "disk")
    tied = getattr(model.hf.config, "tie_word_embeddings", False)  # one weight: the head stays with the embedding
    device_map = {"model.embed_tokens": here, "model.rotary_emb": here, "model.norm": away,
                  "lm_head": here if tied else away,
                  **{f"model.layers.{i}": here if i % 2 == 0 else away for i in range(model.geometry.n_layers)}}
    accelerate.dispatch_model(model.hf, device_map, main_device="cpu", offload_dir=str(offload_dir))
    return attnkit.prepare(model.hf, model.tokenizer, spec), device_map


def format_exactness(rows: list[dict]) -> str:
    lines = ["| method | spec | tokens equal to full | max abs logit diff |", "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | `{r['spec']}` | refused: {r['error']} | |")
        else:
            first = "" if r["tokens_equal"] else (
                f" (first differs at {r['first_different_token'][0]}; logits until then within "
                f"{r['max_abs_logit_diff_until_parting']:.3g}, full's top-2 margin there "
                f"{r['full_top2_margin_at_parting']:.3g})")
            first += f"; {NOT_UNLIMITED[r['method']]}" if r["method"] in NOT_UNLIMITED else ""
            lines.append(f"| {r['method']} | `{r['spec']}` | {'yes' if r['tokens_equal'] else 'no'}{first} | "
                         f"{r['max_abs_logit_diff']:.3g} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=TINY_GEOMETRY)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="small lengths, batches and repeats (a CPU smoke run)")
    p.add_argument("--exact-lengths", default="300,517,1024", help="prompt lengths of the exactness batch")
    p.add_argument("--prefill-lengths", default="8192,32768,131072")
    p.add_argument("--prefill-methods", default="full,minference,minference:dense_above=1,a_shape")
    p.add_argument("--decode-context", type=int, default=32768)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--decode-methods", default="full,streaming:budget=0.1,h2o:budget=0.1,snapkv:budget=0.1")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: --device {args.device} but torch {torch.__version__} sees no CUDA device; on a CPU run "
              f"--device cpu --quick", file=sys.stderr)
        return 2
    if args.quick:
        args.exact_lengths, args.prefill_lengths, args.decode_context = "70,95,130", "512,1024", 512
        args.batch_sizes, args.new_tokens, args.repeats = "1,2", 4, 1
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    lengths = [int(x) for x in args.prefill_lengths.split(",")]
    exact = [int(x) for x in args.exact_lengths.split(",")]
    context = max(lengths + exact + [args.decode_context]) + args.new_tokens
    spec = args.model if "context=" in args.model or not args.model.startswith("random:") \
        else f"{args.model},context={context}"
    model = attnkit.load_model(spec, device=args.device, dtype=dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    compiled = args.device.startswith("cuda")  # FlexAttention compiles for CUDA; on a CPU the eager kernels run
    result = {"model": spec, "device": args.device, "dtype": str(dtype), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name() if compiled else "cpu", "argv": sys.argv[1:]}

    def save() -> None:  # after every part, so a run stopped at its time limit still leaves what it measured
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    result["fused_statistics"] = fused_statistics_rows(args.device, dtype, [n for n in lengths if n <= 32768])
    save()
    result["kernel_statistics"] = kernel_statistics_rows(args.device, dtype, [n for n in lengths if n <= 32768])
    save()
    with tempfile.TemporaryDirectory() as tmp:
        specs = exactness_specs(spec, exact, args.new_tokens, compiled, Path(tmp))
        result["exactness"] = exactness_rows(model, specs, exact, args.new_tokens)
        save()
        if importlib.util.find_spec("accelerate") is not None:
            placed, device_map = placed_model(spec, args.device, dtype, Path(tmp) / "offload")
            result["placement"] = {"device_map": device_map, "layer_devices": [str(d) for d in placed.layer_devices()],
                                   "rows": exactness_rows(placed, specs, exact, args.new_tokens)}
            del placed
            save()
    sparse = [m if compiled or m == "full" else m + (",compile=false" if ":" in m else ":compile=false")
              for m in split_spec_list(args.prefill_methods)]
    result["prefill"] = [row for n in lengths for row in run_bench(model, n, 2, sparse, repeats=args.repeats)]
    save()
    bandwidth = measure_bandwidth(args.device)
    sizes = tuple(int(x) for x in args.batch_sizes.split(","))
    result["decode"] = run_bench(model, args.decode_context, args.new_tokens, split_spec_list(args.decode_methods),
                                 repeats=args.repeats, bandwidth=bandwidth, batch_sizes=sizes)
    save()
    text = (f"{spec} on {result['device_name']} ({result['dtype']}, torch {result['torch']})\n\n"
            f"### H2O's fused prompt pass against the blocked pass\n\n```\n"
            + "\n".join(json.dumps(r) for r in result["fused_statistics"]) + "\n```\n\n"
            "### Triton's statistic kernels against the blocked pass\n\n```\n"
            + "\n".join(json.dumps(r) for r in result["kernel_statistics"]) + "\n```\n\n"
            f"### Exactness at an unlimited budget, prompts of {args.exact_lengths} tokens\n\n"
            f"{format_exactness(result['exactness'])}\n\n### Sparse prefill\n\n```\n{format_bench(result['prefill'])}\n```\n\n"
            f"### Decode at {args.decode_context} tokens\n\n```\n{format_bench(result['decode'])}\n```\n\n"
            f"### Exactness with the model spread by accelerate\n\n")
    placement = result.get("placement")
    text += ("accelerate is not installed: skipped (pip install 'attnkit[accelerate]')\n" if placement is None else
             f"layers on {', '.join(placement['layer_devices'])}; device_map `{json.dumps(placement['device_map'])}`"
             f"\n\n{format_exactness(placement['rows'])}\n")
    (out / "gpu_check.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
