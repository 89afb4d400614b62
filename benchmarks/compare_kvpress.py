"""attnkit's eviction methods side by side with kvpress (NVIDIA/kvpress): same model, prompts, parameters.

    python benchmarks/compare_kvpress.py --prompt-lens 2048,4096 --new-tokens 32 --repeats 3 \
        --out results/compare_kvpress.json

kvpress pins an older transformers, so it lives in its own virtual environment (``--kvpress-python``,
default ``.venv-kvpress/bin/python``; ``pip install torch==2.13.0`` there first, then ``pip install
kvpress``). This script (attnkit's environment) builds the model, saves it with ``save_pretrained``
to a temporary directory, and starts two kinds of worker process on it: ``--worker attnkit`` (this
file, in this environment) and :mod:`attnkit.eval.run.kvpress_worker` (kvpress's environment, run by its
file path; it never imports attnkit). Both read the same token-id prompts from a JSON request and write JSON results.

Both workers stay alive for the whole run (one JSON request per line on stdin, one answer line on
stdout), each after one untimed warm-up generation. Every case runs first in "trace" mode (which
positions every layer and kv head holds, the logits of every step) and then ``--repeats`` times in
"timing" mode (instrumentation off: wall time of prefill + first token and of the remaining decode
steps, and the process CPU time of the generation; medians reported), the attnkit and kvpress runs of
a case back to back, which side goes first alternating, so both see the same load on the machine.
Every generation is greedy for exactly ``--new-tokens`` tokens (no stop at EOS), one thread.

Parameter mapping (kvpress -> attnkit), exact:

- kept prompt entries: kvpress keeps ``n = int(L * (1 - compression_ratio))`` (``kvpress.utils.
  compute_n_kept``; the worker checks it) -> attnkit ``budget_tokens = n``.
- ``StreamingLLMPress(compression_ratio, n_sink)`` -> ``streaming(budget_tokens=n, sinks=n_sink)``.
  kvpress compresses only the prompt and then appends every generated token; attnkit's streaming is a
  rolling cache of ``n`` slots (incoming token included) for the whole generation. So the kept prompt
  positions must agree exactly, the generations only up to where the caches start to differ.
- "streaming-rolling": attnkit's same run against kvpress's rolling variant, ``PrefillDecodingPress(
  StreamingLLMPress(ratio keeping n - 1), DecodingPress(StreamingLLMPress(n_sink), compression_interval=1,
  target_size=n - 1))``: kvpress attends and then drops to ``n - 1``, attnkit drops and then attends, so
  both attend to ``n`` entries at every decode step (attnkit still holds ``n`` prompt entries right after
  prefill, kvpress ``n - 1``; the one more is evicted before attnkit's first decode attention).
- ``SnapKVPress(compression_ratio, window_size, kernel_size)`` -> ``snapkv(budget_tokens=n,
  window_size, kernel_size, pooling="avg", gqa_reduce="mean")``; both append every generated token.
- ``KnormPress`` / ``KeyDiffPress`` (``compression_ratio``) -> ``knorm`` / ``keydiff(budget_tokens=n)``; both
  append every generated token. With ``decode_every=N`` (``--decode-every``): kvpress's ``PrefillDecodingPress(
  Press(compression_ratio), DecodingPress(Press(), compression_interval=N, target_size=n))``. In the first
  layer a key's norm depends only on its token (RoPE is a rotation), so knorm's ties there may break either way.
- ``ExpectedAttentionPress(compression_ratio)`` -> ``expected_attention(budget_tokens=n)`` (the same defaults:
  ``n_future_positions=512``, ``n_sink=4``, covariance and value norms on); both append while decoding.
- ``TOVAPress(compression_ratio)`` -> ``tova(budget_tokens=n)``: kvpress compresses only the prompt, attnkit's
  tova then drops one entry per step, so only the kept prompt positions must agree. "tova-rolling": against
  ``PrefillDecodingPress(TOVAPress(ratio keeping n - 1), DecodingPress(TOVAPress(), compression_interval=1,
  target_size=n - 1))``, attended sets equal at every step (as for streaming-rolling).
- ``DuoAttentionPress(head_compression_ratio)`` with its head pattern, sinks and recent window given (its
  ``load_attention_pattern`` answered on the instance with the pattern as scores, 1 retrieval / 0 streaming) ->
  ``duo_attention(pattern, sinks, recent)`` (``--duo``). kvpress masks a streaming head's prompt keys between the
  sinks and the recent window (fake keys at decode; the entries stay in memory) and appends every generated
  token; attnkit removes them and rolls the window while decoding. So the kept (kvpress: unmasked) prompt positions
  and the first decode step's attended sets must agree exactly, the later steps differ by design.
- ``KVzipPress(compression_ratio=r, layerwise=True, n_sink, chunk_size)`` -> ``kvzip(budget_tokens=n,
  head_budgets="adaptive", alpha_safeguard=0, n_sink, chunk_size)`` (``--kvzip-chunk``), ``r`` chosen so that
  KVzipPress prunes ``int(kv_heads * L * r) = kv_heads * (L - n)`` entries per layer across its kv heads, as
  attnkit's adaptive budget keeps ``kv_heads * n``; both append while decoding. "kvzip vs layerwise=False"
  (diagnostic): against kvpress's default, which ranks the scores of all layers together (layers keep different
  counts; attnkit's budgets are per layer, by design). KVzipPress masks evicted keys instead of removing them, so
  its kept positions are read from ``masked_key_indices`` (see :mod:`attnkit.eval.run.kvpress_worker`).
- ``ChunkKVPress(press=P, chunk_length=c)`` (ChunkKV, arXiv 2502.00299; ``--chunk-length``) with ``P`` one of
  ``SnapKVPress`` (the first ``--snapkv`` set), ``KnormPress``, ``KeyDiffPress``, ``ExpectedAttentionPress`` ->
  the same method with ``chunk_length=c, budget_tokens=k*c``, ``k = max(1, int(ceil(L / c) * (1 -
  compression_ratio)))`` the whole chunks kvpress keeps. kvpress sums the chunk scores over the kv heads (every
  head keeps the same chunks); attnkit ranks chunks per kv head, so the kept positions agree on a model with one
  kv head (``--model random:llama:...,kv_heads=1``), where both rules are the same, and differ by design with more.
  A prompt that ``c`` does not divide ends in a partial chunk, which kvpress keeps as a whole (fewer than ``k*c``
  entries) and attnkit fills to ``k*c``: use prompt lengths ``c`` divides.
- "snapkv+pad": attnkit's SnapKV with the average pooling counting the zero padding
  (``count_include_pad=True``, as ``F.avg_pool1d`` does by default in kvpress and in the SnapKV paper's
  code), patched in at run time in the attnkit worker only: a diagnostic, not a library option.

Kept positions: attnkit's are ``LayerKV.positions`` (split by head in a flat layer); kvpress's are recovered from
its cache contents by forward hooks that match every kept key row to the full cache's rows, less the positions a
press masks per head (``masked_key_indices``; see :mod:`attnkit.eval.run.kvpress_worker`).
"attended" compares, at every decode step, layer and kv head, the set of positions the new token
attended to.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnkit.eval.run.peers import WORKER, LineWorker

ROOT = Path(__file__).resolve().parents[1]  # the checkout: .venv-kvpress and results/


# ---- the attnkit worker ------------------------------------------------------------------------------
@contextlib.contextmanager
def pad_counting_pool():
    """SnapKV's average pooling with count_include_pad=True (diagnostic; restored on exit)."""
    import attnkit.methods.snapkv as snapkv_module

    original = snapkv_module.avg_or_max_pool

    def pooled(x, kernel, how):
        if kernel <= 1 or how != "avg":
            return original(x, kernel, how)
        shape = x.shape
        out = torch.nn.functional.avg_pool1d(x.reshape(-1, 1, shape[-1]), kernel, stride=1, padding=kernel // 2,
                                             count_include_pad=True)
        return out.reshape(shape)

    snapkv_module.avg_or_max_pool = pooled
    try:
        yield
    finally:
        snapkv_module.avg_or_max_pool = original


def held_by_head(layer, n_kv: int) -> list[list[int]]:
    """Sorted positions each kv head of a layer holds (batch row 0); a flat layer (``head_budgets=adaptive``,
    ``duo_attention``) is split by the head owning each slot."""
    pos = layer.view()[2][0]
    if "head" not in layer.extras:
        return [sorted(p.tolist()) for p in pos]
    owner = layer.extras["head"][0, 0, :layer.length]
    return [sorted(pos[0][owner == h].tolist()) for h in range(n_kv)]


def _held(session, n_kv: int) -> dict[str, list[list[int]]]:
    return {str(i): held_by_head(layer, n_kv) for i, layer in enumerate(session.cache.layers)}


class AttendedTrace:
    """`method` as the session's method, recording per layer the positions a decode step attended to, before
    ``after_decode`` (which may re-compress the layer: ``decode_every``); everything else is the method's own."""

    def __init__(self, method, n_kv: int):
        self._method, self._n_kv = method, n_kv
        self.step: dict[str, list[list[int]]] = {}

    def __getattr__(self, name):
        return getattr(self._method, name)

    def after_decode(self, ctx) -> None:
        self.step[str(ctx.index)] = held_by_head(ctx.kv, self._n_kv)
        self._method.after_decode(ctx)


def attnkit_generate(model, ids: list[int], case: dict, new_tokens: int, trace: bool) -> dict:
    from attnkit.forward import forward, logits_of, prefill
    from attnkit.methods.spec import make_method
    from attnkit.runner import generate
    from attnkit.session import Step, new_session

    method = make_method(case["method"], **case["params"])
    patch = pad_counting_pool() if case.get("pad_counting_pool") else contextlib.nullcontext()
    with patch, torch.inference_mode():
        if not trace:
            c0 = time.process_time()
            gen = generate(model, ids, method, max_new_tokens=new_tokens, stop_at_eos=False)
            return {"tokens": gen.token_ids, "prefill_s": gen.stats.ttft_s, "decode_s": gen.stats.decode_s,
                    "cpu_s": time.process_time() - c0}
        x = torch.tensor(ids)
        n = len(ids)
        traced = AttendedTrace(method, model.geometry.n_kv_heads)
        session = new_session(model, traced, n, new_tokens)
        logits = logits_of(model, prefill(model, session, x))[-1]
        after_prefill = _held(session, model.geometry.n_kv_heads)
        tokens, all_logits, attended = [int(logits.argmax())], [logits.tolist()], []
        for i in range(1, new_tokens):
            hidden = forward(model, torch.tensor([tokens[-1]]), n + i - 1, lambda pos: Step(session, "decode", pos))
            logits = logits_of(model, hidden)[-1]
            tokens.append(int(logits.argmax()))
            all_logits.append(logits.tolist())
            attended.append(dict(traced.step))
        return {"tokens": tokens, "after_prefill": after_prefill, "attended": attended, "logits": all_logits,
                "final_cache_len": [layer.length for layer in session.cache.layers]}


def attnkit_worker(setup_json: str) -> int:
    """The attnkit side: the same line protocol as attnkit.eval.run.kvpress_worker."""
    import transformers

    from attnkit.model import load_model

    setup = json.loads(setup_json)
    protocol, sys.stdout = sys.stdout, sys.stderr  # stdout carries only the answers
    torch.set_num_threads(setup["threads"])
    model = load_model(setup["model_dir"])
    attnkit_generate(model, setup["warmup"], {"method": "full", "params": {}}, 4, False)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads()}
    protocol.write(json.dumps(meta) + "\n")
    protocol.flush()
    for line in sys.stdin:
        request = json.loads(line)
        case = request["case"]
        result = attnkit_generate(model, case["prompt"], case, setup["new_tokens"], request["mode"] == "trace")
        protocol.write(json.dumps(result) + "\n")
        protocol.flush()
    return 0


# ---- the driver ----------------------------------------------------------------------------------------
def make_prompts(model, lens: list[int], kinds: list[str], seed: int) -> list[tuple[str, list[int]]]:
    """Token-id prompts of each kind and length: ``random`` ids, ``repeat`` (a random block repeated), or the prompt of any generated task of
    ``attnkit eval`` (``passkey``, ``code_completion``, ``needle_heldout``, ...): code, prose, key-value text."""
    from attnkit.eval.data.task_registry import TASKS

    vocab = model.geometry.vocab_size
    bos = list(model.tokenizer("").input_ids)
    out = []
    for n in lens:
        for kind in kinds:
            if kind == "random":
                g = torch.Generator().manual_seed(seed + n)
                body = torch.randint(3, vocab, (n - len(bos),), generator=g).tolist()
                ids = bos + body
            elif kind == "repeat":  # a random 40-token block repeated: many equal tokens, so many tied key norms
                g = torch.Generator().manual_seed(seed + n)
                block = torch.randint(3, vocab, (40,), generator=g).tolist()
                ids = bos + (block * (n // 40 + 1))[:n - len(bos)]
            elif kind in TASKS:
                ids = list(model.tokenizer(TASKS[kind].make(model.tokenizer, n, seed=seed).prompt).input_ids)
            else:
                raise SystemExit(f"unknown prompt kind {kind!r}; use random, repeat or a task: {', '.join(TASKS)}")
            out.append((f"{kind}-{len(ids)}", ids))
    return out


def ratio_keeping(n_prompt: int, keep: int) -> float:
    """A compression_ratio r with int(n_prompt * (1 - r)) == keep (kvpress's rounding)."""
    r = 1.0 - keep / n_prompt
    for _ in range(64):
        got = int(n_prompt * (1 - r))
        if got == keep:
            return r
        r = math.nextafter(r, -math.inf if got < keep else math.inf)
    raise SystemExit(f"no compression_ratio keeps exactly {keep} of {n_prompt}")


def build_cases(prompts, args) -> tuple[list[dict], list[dict], list[dict]]:
    """(rows, attnkit cases, kvpress cases); a row pairs one attnkit case with one kvpress case."""
    rows, ours, theirs = [], {}, {}
    snap_sets = [tuple(int(v) for v in s.split(":")) for s in args.snapkv.split(",") if s]
    for name, ids in prompts:
        n = len(ids)
        keep = int(n * (1 - args.compression_ratio))

        def pair(label, a_id, a_case, k_id, k_case, note="", n=n, name=name, ids=ids, keep=keep):
            ours.setdefault(a_id, dict(a_case, id=a_id, prompt=ids))
            theirs.setdefault(k_id, dict(k_case, id=k_id, prompt=ids))
            rows.append({"prompt": name, "prompt_len": n, "method": label, "kept": keep, "ours": a_id,
                         "theirs": k_id, "note": note})

        pair("full", f"{name}/full", {"method": "full", "params": {}},
             f"{name}/none", {"press": {"kind": "none", "compression_ratio": 0.0, "expect_prefill_kept": n}},
             "no compression: control")
        s_id = f"{name}/streaming"
        s_case = {"method": "streaming", "params": {"budget_tokens": keep, "sinks": args.n_sink}}
        pair("streaming", s_id, s_case, f"{name}/streaming",
             {"press": {"kind": "streaming", "compression_ratio": args.compression_ratio, "n_sink": args.n_sink,
                        "expect_prefill_kept": keep}},
             "kvpress prefill-only; attnkit rolls during decode")
        r_ratio = ratio_keeping(n, keep - 1)
        pair("streaming-rolling", s_id, s_case, f"{name}/streaming_rolling",
             {"press": {"kind": "streaming_rolling", "compression_ratio": r_ratio, "n_sink": args.n_sink,
                        "target_size": keep - 1, "expect_prefill_kept": keep - 1}},
             "kvpress PrefillDecodingPress+DecodingPress(interval 1); prefill keeps n-1 by design")
        if args.diagnose:
            pair("streaming-rolling +sorted", s_id, s_case, f"{name}/streaming_rolling+sorted",
                 {"diagnostic": True,
                  "press": {"kind": "streaming_rolling", "compression_ratio": r_ratio, "n_sink": args.n_sink,
                            "target_size": keep - 1, "expect_prefill_kept": keep - 1, "sorted": True}},
                 "diagnostic: kvpress's kept entries put back in temporal order after each compression")
        for w, k in snap_sets:
            label = f"snapkv w{w} k{k}"
            k_case = {"press": {"kind": "snapkv", "compression_ratio": args.compression_ratio, "window_size": w,
                                "kernel_size": k, "expect_prefill_kept": keep}}
            params = {"budget_tokens": keep, "window_size": w, "kernel_size": k, "pooling": "avg",
                      "gqa_reduce": "mean"}
            pair(label, f"{name}/snapkv-w{w}-k{k}", {"method": "snapkv", "params": params},
                 f"{name}/snapkv-w{w}-k{k}", k_case)
            if args.adakv:  # AdaKV around SnapKV: kvpress masks the dropped keys (read back from its attention patch)
                inner = {"name": "SnapKVPress", "params": {"compression_ratio": args.compression_ratio,
                                                           "window_size": w, "kernel_size": k}}
                pair(label + " adakv", f"{name}/snapkv-w{w}-k{k}-adakv",
                     {"method": "snapkv", "params": dict(params, head_budgets="adaptive")},
                     f"{name}/snapkv-w{w}-k{k}-adakv",
                     {"press": {"kind": "class", "name": "AdaKVPress", "masked_keys": True,
                                "compression_ratio": args.compression_ratio, "expect_prefill_kept": keep,
                                "params": {"press": inner, "alpha_safeguard": 0.2}}},
                     "AdaKVPress(SnapKVPress); kvpress masks the dropped keys and keeps them in memory")
            if args.pyramid:  # PyramidKV's per-layer budgets around SnapKV's scores
                pair(label + " pyramid", f"{name}/snapkv-w{w}-k{k}-pyramid",
                     {"method": "snapkv", "params": dict(params, layer_budgets="pyramid")},
                     f"{name}/snapkv-w{w}-k{k}-pyramid",
                     {"press": {"kind": "class", "name": "PyramidKVPress", "compression_ratio": args.compression_ratio,
                                "params": {"compression_ratio": args.compression_ratio, "window_size": w,
                                           "kernel_size": k}}},
                     "PyramidKVPress; per-layer counts compared in the trace")
            if args.diagnose:
                pair(label + " +pad", f"{name}/snapkv-w{w}-k{k}+pad",
                     {"method": "snapkv", "params": params, "pad_counting_pool": True, "diagnostic": True},
                     f"{name}/snapkv-w{w}-k{k}", k_case, "diagnostic: attnkit pooling with count_include_pad=True",
                     )
        scorer_cases(pair, name, n, keep, args)
        per_layer_cases(pair, name, n, args)
        if args.kvzap_file:  # kvzap's budget mode against KVzapPress running the same surrogate's weights
            pair("kvzap", f"{name}/kvzap", {"method": "kvzap", "params": {"config": args.kvzap_file, "window": 0,
                                                                        "budget_tokens": keep}},
                 f"{name}/kvzap", {"press": {"kind": "kvzap", "file": args.kvzap_file, "expect_prefill_kept": keep,
                                             "compression_ratio": args.compression_ratio}},
                 "KVzapPress with attnkit calibrate kvzap's weights (linear)")
        chunkkv_cases(pair, name, n, args, snap_sets[:1])
        duo_cases(pair, name, args)
    return rows, list(ours.values()), list(theirs.values())


CHUNKKV_SCORERS = ("snapkv", "knorm", "keydiff", "expected_attention")


def chunkkv_cases(pair, name: str, n: int, args, snap_sets) -> None:
    """ChunkKV's rows (``--chunk-length``): ``ChunkKVPress`` around a scorer press against that scorer with
    ``chunk_length``, at the budget of the whole chunks kvpress keeps (see the module docstring)."""
    for c in (int(x) for x in args.chunk_length.split(",") if x):
        chunks = math.ceil(n / c)
        keep = max(1, int(chunks * (1 - args.compression_ratio))) * c
        for method in CHUNKKV_SCORERS:
            if method == "snapkv":
                if not snap_sets:
                    continue
                w, k = snap_sets[0]
                inner = {"name": "SnapKVPress", "params": {"compression_ratio": args.compression_ratio,
                                                           "window_size": w, "kernel_size": k}}
                params = {"window_size": w, "kernel_size": k, "pooling": "avg", "gqa_reduce": "mean"}
                label = f"chunkkv snapkv w{w} k{k} c{c}"
            else:
                inner = {"name": PRESSES[method], "params": {"compression_ratio": args.compression_ratio}}
                params, label = {}, f"chunkkv {method} c{c}"
            a_case = {"method": method, "params": dict(params, budget_tokens=keep, chunk_length=c)}
            k_case = {"press": {"kind": "class", "name": "ChunkKVPress", "compression_ratio": args.compression_ratio,
                                "params": {"press": inner, "chunk_length": c}}}
            pair(label, f"{name}/{method}-chunk{c}", a_case, f"{name}/{method}-chunk{c}", k_case,
                 f"ChunkKVPress({inner['name']}); kept = {keep // c} chunks", keep=keep)


def per_layer_cases(pair, name: str, n: int, args) -> None:
    """knorm with one budget per layer against ``PerLayerCompressionPress(KnormPress(), compression_ratios)``
    (``--per-layer R0,R1,...``: a ratio per layer; each layer keeps kvpress's ``int(n (1 - r))``)."""
    if not args.per_layer:
        return
    ratios = [float(r) for r in args.per_layer.split(",")]
    kept = [int(n * (1 - r)) for r in ratios]
    pair(f"knorm per layer {args.per_layer}", f"{name}/knorm-per-layer",
         {"method": "knorm", "params": {"budget_tokens": kept}}, f"{name}/knorm-per-layer",
         {"press": {"kind": "class", "name": "PerLayerCompressionPress", "compression_ratio": sum(ratios) / len(ratios),
                    "params": {"press": {"name": "KnormPress", "params": {}}, "compression_ratios": ratios}}},
         f"PerLayerCompressionPress(KnormPress); kept per layer {kept}", keep=min(kept))


def duo_cases(pair, name: str, args) -> None:
    """duo_attention against DuoAttentionPress given the same head pattern (``--duo PATTERN:SINKS:RECENT``):
    kvpress's head scores are 1 for a retrieval head and 0 for a streaming head and its head_compression_ratio the
    streaming heads' share, so its own selection (the lowest scores) picks exactly the pattern's streaming heads."""
    if not args.duo:
        return
    pattern, sinks, recent = args.duo.split(":")
    scores = [[1.0 if c == "R" else 0.0 for c in layer] for layer in pattern.split("/")]
    streaming = sum(row.count(0.0) for row in scores)
    pair(f"duo_attention {pattern} s{sinks} r{recent}", f"{name}/duo",
         {"method": "duo_attention", "params": {"pattern": pattern, "sinks": int(sinks), "recent": int(recent)}},
         f"{name}/duo", {"press": {"kind": "duo", "head_compression_ratio": streaming / sum(map(len, scores)),
                                   "head_scores": scores, "sink_size": int(sinks), "recent_size": int(recent)}},
         "kvpress masks the streaming heads' prompt keys (still held) and appends; attnkit drops them and rolls")


PRESSES = {"knorm": "KnormPress", "keydiff": "KeyDiffPress", "tova": "TOVAPress",
           "expected_attention": "ExpectedAttentionPress", "random": "RandomPress", "lagkv": "LagKVPress",
           "cur": "CURPress", "observed_attention": "ObservedAttentionPress"}
# parameters both sides take alike (kvpress's RandomPress draws differently on every call without a seed)
SHARED_PARAMS = {"random": {"seed": 0}, "lagkv": {"lag_size": 64}}
# presses that read the attention matrix: kvpress runs them with transformers' eager attention
EAGER = ("observed_attention",)
# re-compressing while decoding matches kvpress's DecodingPress for knorm and keydiff; expected_attention's query
# statistics differ there by design (attnkit: every query so far; kvpress: a buffer of recent hidden states), and
# random's draws follow each side's order of the held entries (docs/methods.md), which differ after a compression
DECODE_EVERY_TWINS = ("knorm", "keydiff", "random")


def decoding_press(press: str, prefill_ratio: float, every: int, target: int, shared: dict | None = None) -> dict:
    """kvpress's prompt compression followed by re-compression every `every` tokens to `target` entries (`shared`:
    the press's other parameters)."""
    shared = shared or {}
    return {"name": "PrefillDecodingPress", "params": {
        "prefilling_press": {"name": press, "params": dict(shared, compression_ratio=prefill_ratio)},
        "decoding_press": {"name": "DecodingPress", "params": {"base_press": {"name": press, "params": dict(shared)},
                                                               "compression_interval": every,
                                                               "target_size": target}}}}


def ratio_pruning(total: int, pruned: int) -> float:
    """A compression_ratio r with int(total * r) == pruned (how KVzipPress counts the entries a layer drops)."""
    r = pruned / total
    for _ in range(64):
        got = int(total * r)
        if got == pruned:
            return r
        r = math.nextafter(r, math.inf if got < pruned else -math.inf)
    raise SystemExit(f"no compression_ratio prunes exactly {pruned} of {total}")


def kvzip_cases(pair, name: str, n: int, keep: int, args) -> None:
    """kvzip's rows: ``kvzip(budget_tokens=keep, head_budgets=adaptive, alpha_safeguard=0)`` against ``KVzipPress(
    layerwise=True)`` pruning the layer's ``kv x (n - keep)`` lowest scores across its kv heads (equal by design),
    and, as a diagnostic, against kvpress's default ``layerwise=False`` (the lowest scores of the whole model:
    layers keep different counts, which attnkit's per-layer budgets do not do)."""
    kv = args.kv_heads
    params = {"budget_tokens": keep, "head_budgets": "adaptive", "alpha_safeguard": 0.0, "n_sink": args.n_sink,
              "chunk_size": args.kvzip_chunk}
    press = {"n_sink": args.n_sink, "chunk_size": args.kvzip_chunk}
    ratio = ratio_pruning(kv * n, kv * (n - keep))
    a_id = f"{name}/kvzip"
    pair("kvzip", a_id, {"method": "kvzip", "params": params}, f"{name}/kvzip-layerwise",
         {"press": {"kind": "class", "name": "KVzipPress", "masked_keys": True, "compression_ratio": ratio,
                    "params": dict(press, compression_ratio=ratio, layerwise=True)}},
         "attnkit head_budgets=adaptive,alpha_safeguard=0; kvpress layerwise=True")
    if not args.diagnose:
        return
    pair("kvzip vs layerwise=False", a_id, {"method": "kvzip", "params": params}, f"{name}/kvzip-global",
         {"diagnostic": True,
          "press": {"kind": "class", "name": "KVzipPress", "masked_keys": True, "compression_ratio": ratio,
                    "params": dict(press, compression_ratio=ratio, layerwise=False)}},
         "diagnostic: kvpress's default ranks across layers, attnkit keeps kv x B per layer")


def scorer_cases(pair, name: str, n: int, keep: int, args) -> None:
    """The rows of knorm, keydiff, tova, expected_attention and kvzip (``--scorers``), and of ``decode_every``
    (``--decode-every``) for the prompt `name` of `n` tokens, `keep` of them kept; ``pair`` adds a row (see
    :func:`build_cases`)."""
    for method in filter(None, args.scorers.split(",")):
        if method == "kvzip":
            kvzip_cases(pair, name, n, keep, args)
            continue
        press, shared = PRESSES[method], SHARED_PARAMS.get(method, {})
        k_case = {"press": {"kind": "class", "name": press,
                            "params": dict(shared, compression_ratio=args.compression_ratio),
                            "compression_ratio": args.compression_ratio, "expect_prefill_kept": keep,
                            "eager": method in EAGER}}
        a_case = {"method": method, "params": dict(shared, budget_tokens=keep)}
        note = "kvpress prefill-only; attnkit drops one per step" if method == "tova" else ""
        pair(method, f"{name}/{method}", a_case, f"{name}/{method}", k_case, note)
        if method == "tova":
            r_ratio = ratio_keeping(n, keep - 1)
            pair("tova-rolling", f"{name}/{method}", a_case, f"{name}/tova_rolling",
                 {"press": dict(decoding_press(press, r_ratio, 1, keep - 1), kind="class", compression_ratio=r_ratio,
                                expect_prefill_kept=keep - 1)},
                 "kvpress PrefillDecodingPress+DecodingPress(interval 1); prefill keeps n-1 by design")
            continue
        for every in (int(e) for e in args.decode_every.split(",") if e and method in DECODE_EVERY_TWINS):
            pair(f"{method} decode_every={every}", f"{name}/{method}-every{every}",
                 {"method": method, "params": dict(shared, budget_tokens=keep, decode_every=every)},
                 f"{name}/{method}-every{every}",
                 {"press": dict(decoding_press(press, args.compression_ratio, every, keep, shared), kind="class",
                                compression_ratio=args.compression_ratio, expect_prefill_kept=keep)},
                 "kvpress PrefillDecodingPress+DecodingPress(interval N, target n)")


def start_worker(side: str, args, model_dir: str, warmup: list[int], log) -> LineWorker:
    """A worker process kept alive for the whole comparison: one JSON request line in, one answer line out."""
    setup = json.dumps({"model_dir": model_dir, "threads": args.threads, "new_tokens": args.new_tokens,
                        "warmup": warmup})
    if side == "attnkit":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "attnkit", setup]
    else:
        cmd = [args.kvpress_python, str(WORKER), setup]
    return LineWorker(cmd, args.threads, side, log)


def compare_sets(a: dict[str, list[list[int]]], b: dict[str, list[list[int]]]) -> dict:
    """Per (layer, kv head): equal sets?, and how many positions only one side holds."""
    equal = total = only_a = only_b = 0
    examples = []
    for layer in sorted(a, key=int):
        for h, (pa, pb) in enumerate(zip(a[layer], b[layer])):
            sa, sb = set(pa), set(pb)
            total += 1
            equal += sa == sb
            only_a += len(sa - sb)
            only_b += len(sb - sa)
            if sa != sb and len(examples) < 4:
                examples.append({"layer": int(layer), "head": h, "only_ours": sorted(sa - sb)[:8],
                                 "only_theirs": sorted(sb - sa)[:8]})
    return {"equal": equal, "total": total, "only_ours": only_a, "only_theirs": only_b, "examples": examples}


def unequal_by_same_tokens(a_steps, b_steps, seq: list[int]) -> int:
    """Unequal (step, layer, kv head) sets whose differences are positions holding the same tokens (`seq`: the
    prompt and the generated tokens): with a key depending only on its token and position, as in the first
    layer, a score that RoPE leaves unchanged (knorm's norm) ties there, and either side may keep either."""
    count = 0
    for x, y in zip(a_steps, b_steps):
        for layer in x:
            for pa, pb in zip(x[layer], y[layer]):
                sa, sb = set(pa), set(pb)
                count += sa != sb and sorted(seq[p] for p in sa - sb) == sorted(seq[p] for p in sb - sa)
    return count


def summarize(rows, ours_trace, theirs_trace, ours_times, theirs_times, n_sink: int, prompts=None) -> None:
    for row in rows:
        a, b = ours_trace[row["ours"]], theirs_trace[row["theirs"]]
        row["prefill_kept"] = compare_sets(a["after_prefill"], b["after_prefill"])
        steps = [compare_sets(x, y) for x, y in zip(a["attended"], b["attended"])]
        seq = (prompts or {}).get(row["prompt"], []) + a["tokens"]
        row["attended"] = {"equal": sum(s["equal"] for s in steps), "total": sum(s["total"] for s in steps),
                           "unequal_by_same_tokens": unequal_by_same_tokens(a["attended"], b["attended"], seq)
                           if prompts and a["tokens"] == b["tokens"] else None,
                           "first_unequal_step": next((i + 1 for i, s in enumerate(steps) if s["equal"] < s["total"]),
                                                      None),
                           "only_ours": sum(s["only_ours"] for s in steps),
                           "only_theirs": sum(s["only_theirs"] for s in steps)}
        ta, tb = a["tokens"], b["tokens"]
        same = [x == y for x, y in zip(ta, tb)]
        row["tokens"] = {"ours": ta, "theirs": tb, "equal": sum(same), "total": len(same),
                         "first_diff": next((i for i, s in enumerate(same) if not s), None)}
        la, lb = torch.tensor(a["logits"]), torch.tensor(b["logits"])
        diff = (la - lb).abs().amax(dim=-1)
        row["max_abs_logit_diff"] = {"first": float(diff[0]), "all": float(diff.max()),
                                     "by_step": [float(f"{x:.3g}") for x in diff.tolist()],
                                     "until_first_token_diff": float(diff[: row["tokens"]["first_diff"] or len(diff)]
                                                                     .max())}
        row["final_cache_len"] = {"ours": a["final_cache_len"], "theirs": b["final_cache_len"]}
        if row["method"].startswith("streaming-rolling"):
            row["decode_evictions"] = {"ours": eviction_stats(a["attended"], n_sink),
                                       "theirs": eviction_stats(b["attended"], n_sink)}
        for side, times, key in (("ours", ours_times, row["ours"]), ("theirs", theirs_times, row["theirs"])):
            if not all(key in t for t in times):  # a diagnostic case: traced, not timed
                row[f"time_{side}"] = None
                continue
            pre = [t[key]["prefill_s"] for t in times]
            dec = [t[key]["decode_s"] for t in times]
            tot = [p + d for p, d in zip(pre, dec)]
            cpu = [t[key]["cpu_s"] for t in times]
            row[f"time_{side}"] = {"prefill_s": statistics.median(pre), "decode_s": statistics.median(dec),
                                   "total_s": statistics.median(tot), "cpu_s": statistics.median(cpu),
                                   "prefill_all": pre, "decode_all": dec, "cpu_all": cpu}
            toks = [t[key]["tokens"] for t in times]
            row[f"timing_tokens_match_trace_{side}"] = all(t == (a if side == "ours" else b)["tokens"] for t in toks)
        for part in ("prefill_s", "decode_s", "total_s", "cpu_s"):
            timed = row["time_ours"] is not None and row["time_theirs"] is not None
            row[f"ratio_{part}"] = row["time_ours"][part] / row["time_theirs"][part] if timed else None


def eviction_stats(attended: list[dict[str, list[list[int]]]], n_sink: int) -> dict:
    """Between consecutive decode steps of a rolling cache: how many entries left, how many of them were
    the oldest non-sink entry (what StreamingLLM evicts), how many were sinks."""
    total = oldest = sinks = 0
    examples = []
    for step, (before, after) in enumerate(zip(attended, attended[1:]), start=1):
        for layer in before:
            for h, (pb, pa) in enumerate(zip(before[layer], after[layer])):
                gone = set(pb) - set(pa)
                total += len(gone)
                non_sink = [p for p in pb if p >= n_sink]
                oldest += len(gone) == 1 and bool(non_sink) and gone == {min(non_sink)}
                sinks += sum(p < n_sink for p in gone)
                if len(examples) < 6 and layer == "0" and h == 0:
                    examples.append({"after_step": step, "layer": 0, "head": 0, "evicted": sorted(gone),
                                     "oldest_non_sink": min(non_sink) if non_sink else None})
    return {"evicted": total, "oldest_non_sink": oldest, "sinks_evicted": sinks, "examples": examples}


def format_table(rows) -> str:
    head = (f"{'prompt':<20} {'method':<26} {'kept':>5} {'prefill kept =':>15} {'attended =':>12} "
            f"{'tokens =':>9} {'1st':>4} {'|dlogit|':>8} {'prefill s':>19} {'decode s':>19} {'total':>6} {'cpu':>5}")
    sub = (f"{'':<20} {'':<26} {'':>5} {'(layer x head)':>15} {'(steps)':>12} {'':>9} {'diff':>4} {'1st tok':>8} "
           f"{'ours/theirs=ratio':>19} {'ours/theirs=ratio':>19} {'ratio':>6} {'ratio':>5}")
    lines = [head, sub, "-" * len(head)]
    for r in rows:
        pk, at, tk = r["prefill_kept"], r["attended"], r["tokens"]
        to, tt = r["time_ours"], r["time_theirs"]
        if to is None or tt is None:
            times = f"{'(diagnostic, not timed)':>39}"
        else:
            times = (f"{to['prefill_s']:>6.3f}/{tt['prefill_s']:<6.3f}={r['ratio_prefill_s']:<5.2f} "
                     f"{to['decode_s']:>6.3f}/{tt['decode_s']:<6.3f}={r['ratio_decode_s']:<5.2f} "
                     f"{r['ratio_total_s']:>6.2f} {r['ratio_cpu_s']:>5.2f}")
        lines.append(
            f"{r['prompt']:<20} {r['method']:<26} {r['kept']:>5} {pk['equal']:>4}/{pk['total']:<3}"
            f"{'(+' + str(pk['only_ours']) + '/-' + str(pk['only_theirs']) + ')':>8} "
            f"{at['equal']:>5}/{at['total']:<6} {tk['equal']:>3}/{tk['total']:<5} "
            f"{'-' if tk['first_diff'] is None else tk['first_diff']:>4} {r['max_abs_logit_diff']['first']:>8.1e} "
            f"{times}")
    for r in rows:
        at = r["attended"]
        if at["equal"] < at["total"] and at.get("unequal_by_same_tokens"):
            lines.append(f"{r['prompt']} {r['method']}: of the {at['total'] - at['equal']} unequal attended sets, "
                         f"{at['unequal_by_same_tokens']} differ only by positions holding the same tokens (ties)")
    lines.append("prefill kept =: (layer, kv head) pairs whose kept prompt positions are the same set; (+a/-b): "
                 "positions only attnkit / only kvpress holds, summed. attended =: (decode step, layer, kv head) "
                 "triples attending to the same positions. tokens =: greedy tokens equal at the same index; 1st "
                 "diff: index of the first different token. |dlogit| 1st tok: max abs difference of the first "
                 "token's logits. Times: medians of the repeats (wall); ratio = attnkit / kvpress; prefill includes "
                 "the first token, total = prefill + decode; cpu = the same ratio of the process CPU time of "
                 "the whole generation (less sensitive to other load on the machine).")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=["attnkit"], help=argparse.SUPPRESS)
    p.add_argument("--model", default="random:llama:layers=2,hidden=256,heads=8,kv_heads=2,head_dim=32",
                   help="attnkit model spec (random:... gets context = longest prompt + new tokens)")
    p.add_argument("--prompt-lens", default="2048,4096")
    p.add_argument("--prompts", default="random,passkey,code_completion,needle_heldout",
                   help="prompt kinds: random token ids, repeat (a random block repeated), or the prompt of a "
                        "generated eval task (code, held-out prose and code, ...)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compression-ratio", type=float, default=0.75)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--snapkv", default="64:5,32:7", help="window_size:kernel_size sets, comma-separated")
    p.add_argument("--adakv", action="store_true", help="also snapkv with head_budgets=adaptive against "
                   "AdaKVPress(SnapKVPress) for every --snapkv set")
    p.add_argument("--pyramid", action="store_true", help="also snapkv with layer_budgets=pyramid against "
                   "PyramidKVPress for every --snapkv set")
    p.add_argument("--per-layer", default="", help="compression ratios, one per layer, for knorm with a budget "
                   "per layer against PerLayerCompressionPress(KnormPress) (empty: none)")
    p.add_argument("--kvzap", type=int, default=0, help="train kvzap's linear surrogate on this many windows of 256 "
                   "tokens and compare kvzap's budget mode with KVzapPress on those weights (0: none)")
    p.add_argument("--scorers", default=",".join(PRESSES) + ",kvzip",
                   help=f"of {', '.join(PRESSES)}, kvzip (empty: none)")
    p.add_argument("--kvzip-chunk", type=int, default=2048, help="kvzip's chunk_size (context tokens per "
                   "reconstruction forward), the same on both sides")
    p.add_argument("--duo", default="RS/SR:16:64",
                   help="duo_attention's head pattern (one R or S per kv head, layers separated by /), sinks and "
                        "recent window, PATTERN:SINKS:RECENT, against DuoAttentionPress (empty: none)")
    p.add_argument("--chunk-length", default="16", help="ChunkKV chunk lengths (comma-separated) for ChunkKVPress "
                   f"around the presses of {', '.join(CHUNKKV_SCORERS)} (empty: none)")
    p.add_argument("--trim", type=int, default=0, help="cut every prompt to a multiple of this many tokens (a "
                   "prompt the chunk length divides: kvpress keeps a partial last chunk whole; 0: no cut)")
    p.add_argument("--decode-every", default="1,4", help=f"decode_every values for {', '.join(DECODE_EVERY_TWINS)} "
                   "(empty: none)")
    p.add_argument("--no-diagnose", dest="diagnose", action="store_false",
                   help="skip the diagnostic rows (snapkv +pad, streaming-rolling +sorted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kvpress-python", default=str(ROOT / ".venv-kvpress" / "bin" / "python"))
    p.add_argument("--out", default=str(ROOT / "results" / "compare_kvpress.json"))
    args, rest = p.parse_known_args(argv)
    if args.worker:
        return attnkit_worker(*rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if not Path(args.kvpress_python).exists():
        raise SystemExit(f"no kvpress environment at {args.kvpress_python}; see the module docstring")

    from attnkit.model import load_model

    torch.set_num_threads(args.threads)
    lens = [int(x) for x in args.prompt_lens.split(",") if x]
    kinds = [x for x in args.prompts.split(",") if x]
    t_start = time.time()
    if args.model.startswith("random:"):
        model = load_model(args.model, context=max(lens) + args.new_tokens)
    else:
        model = load_model(args.model)
    args.kv_heads = model.geometry.n_kv_heads
    prompts = make_prompts(model, lens, kinds, args.seed)
    if args.trim:
        prompts = [(f"{name.rsplit('-', 1)[0]}-{len(ids) // args.trim * args.trim}",
                    ids[:len(ids) // args.trim * args.trim]) for name, ids in prompts]
    args.kvzap_file = None
    if args.kvzap:  # the surrogate, trained here on the model's own weights, read by both sides
        from attnkit.calibrate.kvzap import calibrate_kvzap
        from attnkit.methods.kvzap_predictor import save_predictor
        layers, meta = calibrate_kvzap(model, samples=args.kvzap, length=256, heldout=1)
        args.kvzap_file = str(save_predictor(Path(tempfile.mkdtemp(prefix="compare-kvzap-")) / "kvzap.safetensors",
                                             "linear", layers, meta))
    rows, ours, theirs = build_cases(prompts, args)
    warmup = min((ids for _, ids in prompts), key=len)  # a full-size warm-up generation (4 tokens), untimed
    with tempfile.TemporaryDirectory(prefix="compare-kvpress-") as tmp_dir:
        tmp = Path(tmp_dir)
        model_dir = str(tmp / "model")
        model.hf.save_pretrained(model_dir)
        model.tokenizer.save_pretrained(model_dir)
        print(f"model {args.model} saved to {model_dir}; {len(ours)} attnkit cases, {len(theirs)} kvpress cases; "
              f"worker logs in {tmp}", file=sys.stderr)
        with open(tmp / "attnkit.log", "w") as log_a, open(tmp / "kvpress.log", "w") as log_k:
            try:
                workers = {"attnkit": start_worker("attnkit", args, model_dir, warmup, log_a),
                           "kvpress": start_worker("kvpress", args, model_dir, warmup, log_k)}
            except SystemExit:
                for name in ("attnkit.log", "kvpress.log"):
                    sys.stderr.write((tmp / name).read_text()[-4000:])
                raise
            t0 = time.time()
            ours_trace = {c["id"]: workers["attnkit"].request({"case": c, "mode": "trace"}) for c in ours}
            theirs_trace = {c["id"]: workers["kvpress"].request({"case": c, "mode": "trace"}) for c in theirs}
            print(f"  traces: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
            # timing: per repeat, every timed case of both sides back to back (which side goes first alternates)
            by_id = {"attnkit": {c["id"]: c for c in ours}, "kvpress": {c["id"]: c for c in theirs}}
            pairs = []
            for row in rows:
                pair = (row["ours"], row["theirs"])
                if pair not in pairs and not by_id["attnkit"][pair[0]].get("diagnostic") \
                        and not by_id["kvpress"][pair[1]].get("diagnostic"):
                    pairs.append(pair)
            ours_times, theirs_times = [], []
            for r in range(args.repeats):
                t0 = time.time()
                got = {"attnkit": {}, "kvpress": {}}
                for i, pair in enumerate(pairs):
                    order = [("attnkit", pair[0]), ("kvpress", pair[1])]
                    for side, key in (order if (r + i) % 2 == 0 else order[::-1]):
                        if key not in got[side]:
                            got[side][key] = workers[side].request({"case": by_id[side][key], "mode": "timing"})
                ours_times.append(got["attnkit"])
                theirs_times.append(got["kvpress"])
                print(f"  timing repeat {r + 1}/{args.repeats}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
            for w in workers.values():
                w.close()
    ours_trace = {"meta": workers["attnkit"].meta, "results": ours_trace}
    theirs_trace = {"meta": workers["kvpress"].meta, "results": theirs_trace}
    summarize(rows, ours_trace["results"], theirs_trace["results"], ours_times, theirs_times, args.n_sink,
              dict(prompts))
    table = format_table(rows)
    print(f"\n{args.model}, compression_ratio={args.compression_ratio}, n_sink={args.n_sink}, "
          f"{args.new_tokens} new tokens, {args.repeats} repeats, {args.threads} thread(s) "
          f"({time.time() - t_start:.0f} s)")
    print(f"attnkit: {ours_trace['meta']}\nkvpress: {theirs_trace['meta']}\n")
    print(table)
    out = {"model": args.model, "compression_ratio": args.compression_ratio, "n_sink": args.n_sink,
           "snapkv": args.snapkv, "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads,
           "attnkit_env": ours_trace["meta"], "kvpress_env": theirs_trace["meta"], "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nrows: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
