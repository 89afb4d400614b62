"""attnkit's ``triattention`` side by side with the authors' TriAttention (github.com/WeianMao/triattention): the same
weights, keys and query statistics; per prompt, compression, layer and kv head, whether the kept positions are the
same. A checkout's files are all it needs (where a mirror lacks a large blob and ``git archive`` stops, export the
files one by one with ``git ls-tree -r --name-only HEAD`` and ``git show HEAD:FILE``). Its raw output:
docs/results/triattention_reference.txt.

    git --git-dir=<mirror of WeianMao/triattention> archive HEAD | tar -x -C /tmp/triattention-ref
    OMP_NUM_THREADS=1 python benchmarks/compare_triattention.py --reference /tmp/triattention-ref \\
        > docs/results/triattention_reference.txt

attnkit generates greedily with ``triattention`` (the bundled model and its committed statistics by default) on
``--prompts`` held-out texts of ``--length`` tokens; at every compression (the prompt's, then every
``--decode-every`` generated tokens, ``--rounds`` of them) it records what each layer held (keys after RoPE, their
positions, the next query's position ``t0``) and what it kept. The same keys go to the reference's own selection,
imported from the checkout: its vLLM runtime's ``build_triattention_selector`` (``triattention/vllm/runtime/
selector_hf.py``) in ``per_layer_per_head`` mode, which scores each query head with its own statistics (its Triton
kernel, ``triattention_scoring``), standardises the scores, takes the maximum over the kv group, protects the last
``window_size`` entries and keeps the top ``kv_budget`` per kv head: attnkit's rule. The statistics file is
converted to the reference's format (``metadata`` + ``layerXX_headYY`` entries with ``q_mean_real``,
``q_mean_imag``, ``q_abs_mean``, and the model's ``inv_freq``); ``round_start`` is attnkit's ``t0``.

Also printed: how far attnkit's per-query-head scores are from the reference's other scoring path, the HF one
(``triattention/methods/pruning_utils.py``: RoPE inverted with the model's rotary tables, the series in amplitude
and phase form), and how many of attnkit's kept positions at the prompt's compression the reference's default mode
keeps too (``per_head``: one choice per kv head shared by all layers, their standardised scores averaged over the
layers), a difference by design (docs/methods.md, triattention).

On a CPU the reference's Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set here before Triton
is imported). The one shim: the reference's ``TriAttentionConfig`` defaults its device to ``cuda``; on a machine
without CUDA the script hands the selector a subclass whose default device is the CPU (nothing else changes).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the reference's Triton kernel on a CPU, read when Triton loads

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import attnkit  # noqa: E402
from attnkit.calibrate.kvzap import text_windows  # noqa: E402
from attnkit.forward import forward, logits_of, prefill  # noqa: E402
from attnkit.methods.triattention import TriAttention  # noqa: E402
from attnkit.methods.triattention_stats import load_stats, trig_scores  # noqa: E402
from attnkit.rope import Rope  # noqa: E402
from attnkit.session import Step, new_session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RecordingTriAttention(TriAttention):
    """attnkit's ``triattention``, recording at every compression what each layer held and what it kept."""

    def compact(self, ctx, count, spare, next_pos):
        keys, _, positions = ctx.kv.view()
        entry = {"layer": ctx.index, "t0": int(next_pos), "keys": keys.clone(), "positions": positions.clone()}
        super().compact(ctx, count, spare, next_pos)
        entry["kept"] = ctx.kv.view()[2].clone()
        self.records.append(entry)


def reference_stats_file(stats, folder: Path) -> Path:
    """The statistics in the reference's format (``scripts/calibrate.py``'s payload) with the model's frequencies."""
    payload = {"metadata": {"head_dim": stats.head_dim, "rope_style": "half", "inv_freq": stats.inv_freq.clone(),
                            "sampled_heads": [[i, h] for i in range(stats.n_layers) for h in range(stats.n_heads)]},
               "stats": {}}
    for i in range(stats.n_layers):
        for h in range(stats.n_heads):
            payload["stats"][f"layer{i:02d}_head{h:02d}"] = {
                "q_mean_real": stats.center[i][h].real.clone(), "q_mean_imag": stats.center[i][h].imag.clone(),
                "q_abs_mean": stats.abs_mean[i][h].clone()}
    path = folder / "stats.pt"
    torch.save(payload, path)
    return path


def reference_selectors(reference: Path, stats_pt: Path, budget: int, window: int, every: int):
    """The reference's selections: (per layer and kv head, the default cross-layer one), and its HF scoring module."""
    sys.path.insert(0, str(reference))
    core_config = importlib.import_module("triattention.vllm.core.config")
    runtime_config = importlib.import_module("triattention.vllm.runtime.config")
    selector_hf = importlib.import_module("triattention.vllm.runtime.selector_hf")
    if not torch.cuda.is_available():  # the shim: the compressor's device defaults to cuda
        @dataclass
        class OnCpu(core_config.TriAttentionConfig):
            device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
        core_config.TriAttentionConfig = OnCpu
    out = []
    for mode in ("per_layer_per_head", "per_head"):
        cfg = runtime_config.TriAttentionRuntimeConfig(
            kv_budget=budget, divide_length=every, window_size=window, sparse_stats_path=stats_pt,
            pruning_mode=mode, layer_perhead_aggregation="max", sparse_normalize_scores=True,
            sparse_score_aggregation="mean", protect_prefill=False, include_prefill_in_budget=True)
        select, select_group, status = selector_hf.build_triattention_selector(cfg)
        assert status == "enabled", status
        out.append(select if mode == "per_layer_per_head" else select_group)
    return out[0], out[1], importlib.import_module("triattention.methods.pruning_utils")


@torch.inference_mode()
def hf_path_scores(pu, model, keys, positions, stats, layer, t0, offset_max, dtype=torch.float32):
    """Per query head, the reference's HF-path scores ``[heads, L]`` of one layer (one row), its inputs in `dtype`
    (float32 as the reference runs it; float64 to see how much of a difference is float32's phases)."""
    rotary = model.hf.model.rotary_emb
    d, g = keys.shape[-1], stats.n_heads // stats.n_kv_heads
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    omega = rotary.inv_freq.to(dtype)[:d // 2]
    offsets = pu.build_geometric_offsets(offset_max, torch.device("cpu")).to(dtype)
    freq_scale_sq = pu.compute_frequency_scaling(rotary, d, torch.float32, torch.device("cpu")).pow(2).to(dtype)
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    rows = []
    for h in range(stats.n_heads):
        kv = h // g
        pos = positions[0, kv]
        cos, sin = rotary(torch.zeros(1, pos.shape[0], d), pos[None])
        k_unrot = pu.invert_rope(keys[0, kv].to(dtype), cos[0].to(dtype), sin[0].to(dtype), scale, style="half")
        amp, phi, extra = pu.compute_frequency_statistics_from_means(
            stats.center[layer][h].to(complex_dtype), stats.abs_mean[layer][h].to(dtype), k_unrot, style="half")
        rows.append(pu.score_keys_for_round(pos, t0, amp, phi, omega, extra, offsets, "mean", freq_scale_sq))
    return torch.stack(rows)


def run_prompt(model, method, ids, rounds, every):
    method.records.clear()
    steps = rounds * every
    session = new_session(model, method, ids.shape[0], steps + 1)
    with torch.inference_mode():
        token = int(logits_of(model, prefill(model, session, ids)).argmax())
        for i in range(steps):
            hidden = forward(model, torch.tensor([token]), ids.shape[0] + i, lambda p: Step(session, "decode", p))
            token = int(logits_of(model, hidden[-1:]).argmax())
    return list(method.records)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", required=True, help="a checkout of github.com/WeianMao/triattention (its files)")
    p.add_argument("--model", default="tiny", help="model spec (default: tiny)")
    p.add_argument("--stats", default=str(ROOT / "sweeps" / "triattention_tiny.json"),
                   help="attnkit's statistics of the model (attnkit calibrate triattention)")
    p.add_argument("--prompts", type=int, default=4, help="held-out texts compared (default: 4)")
    p.add_argument("--length", type=int, default=512, help="prompt tokens (default: 512)")
    p.add_argument("--budget", type=int, default=128, help="B, entries per kv head kept (default: 128)")
    p.add_argument("--window", type=int, default=32, help="recent tokens kept (default: 32)")
    p.add_argument("--decode-every", type=int, default=32, help="generated tokens between compressions (default: 32)")
    p.add_argument("--rounds", type=int, default=2, help="compressions while decoding, after the prompt's (default: 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = attnkit.load_model(args.model)
    stats = load_stats(args.stats)
    method = RecordingTriAttention(config=args.stats, budget_tokens=args.budget, window_size=args.window,
                                   decode_every=args.decode_every)
    object.__setattr__(method, "records", [])
    rope = Rope.from_model(model)
    tmp = Path(tempfile.mkdtemp(prefix="triattention-ref-"))
    select, select_default, pu = reference_selectors(Path(args.reference), reference_stats_file(stats, tmp),
                                                     args.budget, args.window, args.decode_every)
    print(f"model {args.model}, statistics {Path(args.stats).name}, {args.prompts} held-out prompts of {args.length} "
          f"tokens, B={args.budget}, window_size={args.window}, decode_every={args.decode_every}, {args.rounds} "
          f"compressions while decoding; reference: per_layer_per_head selection (its Triton kernel"
          f"{' in the interpreter' if os.environ.get('TRITON_INTERPRET') == '1' else ''})")
    cases = same = positions_total = positions_same = 0
    worst = [0.0, 0.0]  # attnkit's scores against the HF path's: as it runs (float32), and in float64
    default_kept = default_total = 0
    for n, window_ids in enumerate(text_windows(model, "heldout", args.prompts, args.length, seed=7)):
        records = run_prompt(model, method, torch.tensor(window_ids), args.rounds, args.decode_every)
        prompt_round = [r for r in records if r["t0"] == args.length]
        for r in records:
            rnd = 0 if r["t0"] == args.length else (r["t0"] - args.length) // args.decode_every
            keys, pos, kept = r["keys"], r["positions"], r["kept"]
            got = select(keys_dense=keys, total_tokens=keys.shape[2], prefill_len=args.length, protect_prefill=False,
                         layer_idx=r["layer"], round_start=r["t0"], budget_total=args.budget)
            theirs = torch.gather(pos[0], 1, torch.as_tensor(got["indices"]).long())
            flags = []
            for h in range(keys.shape[1]):
                a, b = set(kept[0, h].tolist()), set(theirs[h].tolist())
                cases += 1
                same += a == b
                positions_total += len(a)
                positions_same += len(a & b)
                flags.append(f"kv{h} " + ("same" if a == b else f"differs ({len(a - b)} of {len(a)})"))
            if rnd == 0:
                center, abs_mean = stats.layer(r["layer"], "cpu")
                ours = trig_scores(keys.float(), center, abs_mean, rope.inv_freq, r["t0"],
                                   method._offsets).reshape(stats.n_heads, -1)
                for i, dtype in enumerate((torch.float32, torch.float64)):
                    ref = hf_path_scores(pu, model, keys, pos, stats, r["layer"], r["t0"], method.offset_max_length,
                                         dtype)
                    worst[i] = max(worst[i], float(((ours.double() - ref.double()).abs() / (1 + ref.abs())).max()))
            print(f"prompt {n} {'prompt' if rnd == 0 else f'decode {rnd}'} (t0={r['t0']}, {keys.shape[2]} held -> "
                  f"{args.budget}) layer {r['layer']}: " + ", ".join(flags))
        layers = [(r["layer"], r["keys"]) for r in prompt_round]
        shared = select_default(layer_inputs=layers, total_tokens=args.length, prefill_len=args.length,
                                protect_prefill=False, round_start=args.length, budget_total=args.budget)
        shared = torch.as_tensor(shared["indices"]).long()
        for r in prompt_round:
            for h in range(shared.shape[0]):
                default_kept += len(set(r["kept"][0, h].tolist()) & set(shared[h].tolist()))
                default_total += shared.shape[1]
    print(f"kept positions identical in {same} of {cases} (prompt, compression, layer, kv head) cases; "
          f"{positions_same} of {positions_total} kept positions shared")
    print(f"per-query-head scores against the reference's HF path (pruning_utils) at the prompt's compression: "
          f"largest |difference| / (1 + |score|) {worst[0]:.2e} (its inputs in float64: {worst[1]:.2e})")
    print(f"the reference's default mode (one choice per kv head shared by all layers) keeps {default_kept} of "
          f"attnkit's {default_total} per-layer kept positions at the prompt's compression "
          f"({100 * default_kept / max(1, default_total):.1f} %; a difference by design)")
    return 0 if same == cases else 1


if __name__ == "__main__":
    sys.exit(main())
