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
- ``LeverageScorePress`` / ``NonCausalAttnPress`` / ``CompactorPress`` (``compression_ratio``) -> ``leverage`` /
  ``non_causal_attention`` / ``compactor(budget_tokens=n)`` (the same defaults; compactor's blending defaults to
  ``1 - n / L``, the ratio itself where ``L (1 - compression_ratio)`` is whole). kvpress draws the leverage sketch
  from torch's global generator: its worker runs ``torch.manual_seed(--seed)`` right before the prompt's forward
  and attnkit takes ``sketch_seed=--seed`` (``SEEDED``), which draws the same sketch for every layer.
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
- ``KVgradPress(compression_ratio=r, layerwise=True, n_sink)`` -> ``kvgrad(budget_tokens=n, head_budgets="adaptive",
  alpha_safeguard=0, n_sink)``, mapped as KVzipPress (both at chunk_size 512, their default); "kvgrad vs
  layerwise=False" is the same diagnostic. KVgradPress also masks evicted keys (``masked_key_indices``).
- ``ComposedPress([P1(r1), P2(r2)])`` (``--composed P1+P2,...``, ``--composed-ratios r1:r2``) -> ``P1(budget_tokens=k1,
  then=P2(budget_tokens=k2))`` with kvpress's counts ``k1 = int(L (1 - r1))``, ``k2 = int(k1 (1 - r2))``.
- ``CapPress(compression_ratio)`` -> ``cap(budget_tokens=n)`` (the same defaults: ``tau=5``, 512 future positions,
  4 sinks); both append while decoding.
- ``KVComposePress(compression_ratio=r[, structured=False])`` -> ``kvcompose(budget=1 - r[, structured=false])``: one
  budget for the whole model, so ``kept`` is the mean per layer. kvpress replays the prompt inside its forward; its
  worker calls it without position ids, as kvpress's pipeline does (the replay then runs after the prompt, as
  attnkit's), and reads the kept rows of the compressed cache (structured) or ``masked_key_indices``.
- ``ChunkKVPress(press=P, chunk_length=c)`` (ChunkKV, arXiv 2502.00299; ``--chunk-length``) with ``P`` one of
  ``SnapKVPress`` (the first ``--snapkv`` set), ``KnormPress``, ``KeyDiffPress``, ``ExpectedAttentionPress`` ->
  the same method with ``chunk_length=c, budget_tokens=k*c``, ``k = max(1, int(ceil(L / c) * (1 -
  compression_ratio)))`` the whole chunks kvpress keeps. kvpress sums the chunk scores over the kv heads (every
  head keeps the same chunks); attnkit ranks chunks per kv head, so the kept positions agree on a model with one
  kv head (``--model random:llama:...,kv_heads=1``), where both rules are the same, and differ by design with more.
  A prompt that ``c`` does not divide ends in a partial chunk, which kvpress keeps as a whole (fewer than ``k*c``
  entries) and attnkit fills to ``k*c``: use prompt lengths ``c`` divides.
- ``ThinKPress(key_channel_compression_ratio=c)`` alone and ``ComposedPress([SnapKVPress(r, 64, 5), ThinKPress(c)])``
  (``--think c,...``) -> ``think(key_channels=c)`` and ``snapkv(budget_tokens=n, window_size=64, kernel_size=5, ...)
  +think(key_channels=c)``: the kept positions, and per layer and kv head the key channels every held key has at 0
  after the prompt (``zeroed_channels``; kvpress's tracer matches a kept row to its snapshot with those channels
  zeroed), must agree.
- ``QFilterPress(compression_ratio)`` -> ``qfilter(config=FILE, budget_tokens=n)`` (``--qfilter N``: the filters
  calibrated here by ``attnkit calibrate qfilter`` on N windows of 256 tokens; kvpress's ``q_filters`` set on the
  instance to their negation, since it scores ``-<k, f>``, and its hub download answered on the instance).
- ``ExpectedAttentionStatsPress(compression_ratio)`` -> ``expected_attention(stats=FILE, budget_tokens=n)``
  (``--ea-stats N``: the statistics of ``attnkit calibrate expected_attention`` on N windows of 256 tokens, set as the
  press's ``mu`` / ``cov``, so its ``post_init_from_model`` loads nothing).
- kvpress's wrapper presses (``--wrappers WRAPPER:SCORER+SCORER,...``, around ``snapkv`` (the first ``--snapkv``
  set), ``knorm``, ``keydiff``, ``kvzap`` (``--kvzap``) or
  ``qfilter`` (``--qfilter``); attnkit: the same scorer with a parameter):
  ``criticalkv`` = ``CriticalKVPress(P)`` -> ``criticalkv=true``; ``criticalkv_ada`` = ``CriticalAdaKVPress(P)``
  (kvpress masks: ``masked_key_indices``) -> ``criticalkv=true, head_budgets=adaptive``; ``chunk`` =
  ``ChunkPress(P, chunk_length=s)`` -> ``segment_length=s`` (``--segment-length``); ``block`` = the prompt fed to
  kvpress in blocks (the first ``n``, then ``--block-size`` each) under ``DecodingPress(P, compression_interval=1,
  target_size=n)``, the press closed before decoding, -> ``block_size=m``, plus a diagnostic row against
  ``BlockPress(P, block_size=m)`` itself (kvpress's simulation over the full-attention prompt: differs by design past
  the first layer); snapkv's block rows use ``kernel_size=1``, since kvpress holds a compressed cache in score order
  and pools along it; ``ratio_decoding`` = ``PrefillDecodingPress(P(ratio), CompressionRatioDecodingPress(P,
  compression_interval=N, target_compression_ratio=1 - f))`` -> ``decode_every=N, decode_fraction=f``
  (``--ratio-decoding N:f``); ``dms`` = ``DMSPress(P, threshold=T, sliding_window_size=w, decoding)`` (kvpress masks:
  ``masked_key_indices``, read before every decode step with ``--dms-decoding``) -> ``score_threshold=T,
  threshold_window=w, threshold_decode`` (``--dms-thresholds SCORER=T;...``, ``--dms-window``, ``--dms-decoding``; the
  kept column is unused: counts per head vary); ``rerotation`` = ``KeyRerotationPress(P(ratio))`` -> ``budget_tokens=n,
  positions=reindexed``: kvpress's kept positions are read from the indices its ``rerotate_keys`` receives (re-rotated
  keys match no row), and it decodes at its cache's length ``B + i`` (transformers' ``generate``), whose distances
  attnkit's ``n - B .. n - 1`` relabelling reproduces; attnkit's relabelled positions are mapped back to the original
  ones (``original_labels``), so kept and attended sets, tokens and logits all compare.
- ``FinchPress(compression_ratio, normalize_scores, rerotate_keys=False)`` (``--finch Q``) -> ``finch(budget_tokens=n,
  question_tokens=Q, normalize, positions="original")``. kvpress's window is set on the instance (``window_size=Q``, as
  its delimiter token would set it, and a delimiter id that the prompt does not hold), so both read the same prompt.
  With ``rerotate_keys=True`` kvpress's kept keys are re-rotated (no longer matched by bytes) and its pipeline
  generates at the compressed positions, which this worker does not: attnkit's ``positions=reindexed`` is checked in
  ``tests/methods/test_finch.py`` instead.
- ``SimLayerKVPress(lazy_threshold, n_last, n_recent, n_initial)`` (``--simlayerkv``) -> ``simlayerkv`` with the
  same four; no budget (the kept column is unused): each layer keeps what its lazy test says.
- ``EntropyGatedChunkKVPress(press=P, chunk_length=c, low_entropy_chunk_length=k)`` (``--entropy-chunk c:k``) around
  the presses of ``CHUNKKV_SCORERS`` -> that scorer with ``chunk_length=c, low_entropy_chunk_length=k,
  budget_tokens=n``. As for ChunkKV, kvpress scores the chunks summed over the kv heads: the rules meet on a model
  with one kv head (``--model random:llama:...,kv_heads=1``).
- ``FastKVzipPress(compression_ratio, layerwise, n_sink, window_ratio=0.02)`` (``--fastkvzip STEPS``: gates trained
  here by ``attnkit calibrate fastkvzip`` on 4 windows of 256 tokens for STEPS steps, written in the authors' torch
  format and loaded into kvpress's ``FastKVzipGate`` modules, set as the press's ``gates``) -> ``fastkvzip(config=that
  file, budget_tokens=n, layerwise)``: ``layerwise=False`` (both sides' default) prunes the ``layers x kv x (N - n)``
  lowest scores of the whole model, ``layerwise=True`` each layer's ``kv x (N - n)``.
- ``LUKVPress(ExpectedAttentionPress(epsilon=0.02), compression_ratio, sink=4, window=1)`` (``--lukv P``: a budget
  curve profiled here by ``attnkit calibrate lukv`` on P pairs per task of 512 tokens, 16 answer tokens, saved as
  ``.npy`` and set as the press's ``_budget_curves``) -> ``lukv(curve=that file, budget_tokens=n)``.
- ``RestoreKVPress(compression_ratio=r, layerwise=True, n_sink, chunk_size)`` (``--restorekv FILE``: restore weights
  of ``attnkit calibrate restorekv`` for the model, written as kvpress loads them, a peft adapter folder plus
  ``restore_embeddings.safetensors``, and loaded into the model by the press's own ``load_adapter`` call) ->
  ``restorekv(config=FILE, budget_tokens=n, head_budgets="adaptive", alpha_safeguard=0, n_sink, chunk_size)``, ``r``
  chosen so that KVzipPress, at ``r + R/L`` after the restore tokens joined, prunes ``kv x (L - n + R)`` entries per
  layer, as attnkit keeps ``kv x (n - R)`` prompt entries and the ``R`` restore entries per kv head. Both sides hold the
  restore entries at positions ``L .. L+R-1`` and feed later tokens from ``L + R`` on (kvpress's pipeline places them
  at the cache's length; the worker does the same, ``at_cache_length``).
- ``MergingPress(press=P, similarity_threshold=t, merge_fraction=f)`` with ``P`` ``KnormPress`` or ``SnapKVPress``
  (``--merging``, ``--merge-params``) -> the same scorer with ``merge=true, similarity_threshold=t, merge_fraction=f``
  at ``budget_tokens=n``: the kept positions are the scorer's; the merged values show in the decode steps' logits.
- ``CAMPress(base_press=KnormPress(), compression_interval=N, target_size=n, merge_budget=m)`` (``--cam N:m``), torch's
  global generator seeded with ``--seed`` before the generation (the request's ``seed``) -> ``cam(budget_tokens=n,
  decode_every=N, merge_budget=m, seed)``: the prompt held whole, back to ``n`` every ``N`` tokens, the same draws.
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


@contextlib.contextmanager
def original_labels(labels: dict):
    """While active, ``positions=reindexed``'s relabelling (:func:`attnkit.methods.rerotation.reindex`) records per
    layer and kv head each new label's original position in `labels` (``case["original_labels"]``), so the kept and
    attended sets are reported by the positions kvpress's trace names (generated tokens keep theirs)."""
    from attnkit.methods import rerotation

    original = rerotation.reindex

    def reindex(ctx):
        before = ctx.kv.view()[2][0].clone()
        original(ctx)
        after = ctx.kv.view()[2][0]
        labels[str(ctx.index)] = [dict(zip(a.tolist(), b.tolist())) for a, b in zip(after, before)]

    rerotation.reindex = reindex
    try:
        yield
    finally:
        rerotation.reindex = original


def relabelled(held: dict, labels: dict) -> dict:
    """`held` (per layer and kv head, sorted positions) with :func:`original_labels`'s labels undone."""
    if not labels:
        return held
    return {i: [sorted(labels.get(i, [{}] * len(rows))[h].get(p, p) for p in row) for h, row in enumerate(rows)]
            for i, rows in held.items()}


def attnkit_generate(model, ids: list[int], case: dict, new_tokens: int, trace: bool) -> dict:
    from attnkit.forward import forward, logits_of, prefill
    from attnkit.methods.spec import make_method
    from attnkit.runner import generate
    from attnkit.session import Step, new_session

    method = make_method(case["method"], **case["params"])
    patch = pad_counting_pool() if case.get("pad_counting_pool") else contextlib.nullcontext()
    labels: dict = {}
    relabel = original_labels(labels) if case.get("original_labels") else contextlib.nullcontext()
    with patch, relabel, torch.inference_mode():
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
        after_prefill = relabelled(_held(session, model.geometry.n_kv_heads), labels)
        zeroed = {str(i): [torch.nonzero((layer.view()[0][0, h] == 0).all(dim=0)).flatten().tolist()
                           for h in range(layer.view()[0].shape[1])]
                  for i, layer in enumerate(session.cache.layers)} if case.get("zeroed_channels") else None
        tokens, all_logits, attended = [int(logits.argmax())], [logits.tolist()], []
        for i in range(1, new_tokens):
            hidden = forward(model, torch.tensor([tokens[-1]]), n + i - 1, lambda pos: Step(session, "decode", pos))
            logits = logits_of(model, hidden)[-1]
            tokens.append(int(logits.argmax()))
            all_logits.append(logits.tolist())
            attended.append(relabelled(dict(traced.step), labels))
        out = {"tokens": tokens, "after_prefill": after_prefill, "attended": attended, "logits": all_logits,
               "final_cache_len": [layer.length for layer in session.cache.layers]}
        if zeroed is not None:
            out["zeroed_channels"] = zeroed
        return out


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
        prompt_rule_cases(pair, name, keep, args, snap_sets[:1])
        merging_cases(pair, name, n, keep, args)
        cam_cases(pair, name, n, keep, args)
        calibrated_cases(pair, name, n, keep, args)
        trained_cases(pair, name, n, keep, args)
        restorekv_cases(pair, name, n, keep, args)
        wrapper_cases(pair, name, n, keep, args, snap_sets[:1])
        composed_cases(pair, name, n, args, snap_sets[:1] or [(64, 5)])
        duo_cases(pair, name, args)
    return rows, list(ours.values()), list(theirs.values())


CHUNKKV_SCORERS = ("snapkv", "knorm", "keydiff", "expected_attention")


def prompt_rule_cases(pair, name: str, keep: int, args, snap_sets) -> None:
    """finch (``--finch Q,...``: question lengths), simlayerkv (``--simlayerkv THRESHOLD:N_LAST:N_RECENT:N_INITIAL,
    ...``) and ChunkKV's entropy gate (``--entropy-chunk C:K,...``) against ``FinchPress``, ``SimLayerKVPress`` and
    ``EntropyGatedChunkKVPress`` (see the module docstring)."""
    r = args.compression_ratio
    for question in (int(x) for x in args.finch.split(",") if x):
        for normalize in (True, False):
            label = f"finch q{question}" + ("" if normalize else " unnormalized")
            pair(label, f"{name}/finch-q{question}-{normalize}",
                 {"method": "finch", "params": {"budget_tokens": keep, "question_tokens": question,
                                                "normalize": normalize, "positions": "original"}},
                 f"{name}/finch-q{question}-{normalize}",
                 {"press": {"kind": "class", "name": "FinchPress", "compression_ratio": r, "expect_prefill_kept": keep,
                            "params": {"compression_ratio": r, "normalize_scores": normalize, "rerotate_keys": False},
                            "attrs": {"delimiter_token_id": -1, "window_size": question}}},
                 "kvpress's window set as its delimiter would (none in the prompt); rerotate_keys=False")
    for setting in filter(None, args.simlayerkv.split(",")):
        threshold, n_last, n_recent, n_initial = setting.split(":")
        params = {"lazy_threshold": float(threshold), "n_last": int(n_last), "n_recent": int(n_recent),
                  "n_initial": int(n_initial)}
        pair(f"simlayerkv {setting}", f"{name}/simlayerkv-{setting}", {"method": "simlayerkv", "params": params},
             f"{name}/simlayerkv-{setting}", {"press": {"kind": "class", "name": "SimLayerKVPress", "params": params}},
             "kept counts per layer from the lazy test")
    for setting in filter(None, args.entropy_chunk.split(",")):
        c, k = (int(x) for x in setting.split(":"))
        for method in CHUNKKV_SCORERS:
            if method == "snapkv":
                if not snap_sets:
                    continue
                w, kernel = snap_sets[0]
                inner = {"name": "SnapKVPress", "params": {"compression_ratio": r, "window_size": w,
                                                           "kernel_size": kernel}}
                params = {"window_size": w, "kernel_size": kernel, "pooling": "avg", "gqa_reduce": "mean"}
            else:
                inner, params = {"name": PRESSES[method], "params": {"compression_ratio": r}}, {}
            label = f"entropy chunk {method} c{c} k{k}"
            a_case = {"method": method, "params": dict(params, budget_tokens=keep, chunk_length=c,
                                                       low_entropy_chunk_length=k)}
            k_case = {"press": {"kind": "class", "name": "EntropyGatedChunkKVPress", "compression_ratio": r,
                                "params": {"press": inner, "chunk_length": c, "low_entropy_chunk_length": k}}}
            pair(label, f"{name}/{method}-entropy{c}-{k}", a_case, f"{name}/{method}-entropy{c}-{k}", k_case,
                 f"EntropyGatedChunkKVPress({inner['name']})")
            if method == "snapkv" and args.diagnose:  # kvpress's pooling counts the zero padding at the edges
                pair(label + " +pad", f"{name}/{method}-entropy{c}-{k}+pad",
                     dict(a_case, pad_counting_pool=True, diagnostic=True), f"{name}/{method}-entropy{c}-{k}", k_case,
                     "diagnostic: attnkit pooling with count_include_pad=True")


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


def merging_cases(pair, name: str, n: int, keep: int, args) -> None:
    """``MergingPress(press=P, similarity_threshold=t, merge_fraction=f)`` around ``KnormPress`` or ``SnapKVPress``
    (``--merging knorm,snapkv:W:K``; ``--merge-params t:f,...``) against the same scorer with ``merge=true`` at the
    same budget: the kept positions are the scorer's, the merged values show in the decode steps' logits."""
    for scorer in filter(None, args.merging.split(",")):
        method, *snap = scorer.split(":")
        if method == "snapkv":
            w, k = (int(x) for x in snap)
            inner = {"name": "SnapKVPress", "params": {"compression_ratio": args.compression_ratio, "window_size": w,
                                                       "kernel_size": k}}
            params = {"window_size": w, "kernel_size": k, "pooling": "avg", "gqa_reduce": "mean"}
        else:
            inner = {"name": PRESSES[method], "params": {"compression_ratio": args.compression_ratio}}
            params = {}
        for t, f in (tuple(float(x) for x in s.split(":")) for s in args.merge_params.split(",") if s):
            label = f"merging {scorer} t{t:g} f{f:g}"
            pair(label, f"{name}/{scorer}-merge-{t:g}-{f:g}",
                 {"method": method, "params": dict(params, budget_tokens=keep, merge=True, similarity_threshold=t,
                                                   merge_fraction=f)},
                 f"{name}/{scorer}-merge-{t:g}-{f:g}",
                 {"press": {"kind": "class", "name": "MergingPress", "compression_ratio": args.compression_ratio,
                            "expect_prefill_kept": keep,
                            "params": {"press": inner, "similarity_threshold": t, "merge_fraction": f}}},
                 f"MergingPress({inner['name']})")


def cam_cases(pair, name: str, n: int, keep: int, args) -> None:
    """``CAMPress(KnormPress(), compression_interval=N, target_size=B, merge_budget=m)`` (``--cam N:m,...``, ``B``
    the kept count) with torch's global generator seeded with ``--seed`` before the generation, against
    ``cam(budget_tokens=B, decode_every=N, merge_budget=m, seed)``: the prompt is held whole, the cache compressed back
    to ``B`` every ``N`` tokens, the Bernoulli merges drawn alike."""
    for every, m in (tuple(int(x) for x in s.split(":")) for s in args.cam.split(",") if s):
        pair(f"cam knorm N{every} m{m}", f"{name}/cam-{every}-{m}",
             {"method": "cam", "params": {"budget_tokens": keep, "decode_every": every, "merge_budget": m,
                                          "seed": args.seed}},
             f"{name}/cam-{every}-{m}",
             {"press": {"kind": "class", "name": "CAMPress", "compression_ratio": 0.0, "expect_prefill_kept": n,
                        "seed": args.seed,
                        "params": {"base_press": {"name": "KnormPress", "params": {}}, "compression_interval": every,
                                   "target_size": keep, "merge_budget": m}}},
             "CAMPress(KnormPress), seeded; the prompt whole until step N")


def calibrated_cases(pair, name: str, n: int, keep: int, args) -> None:
    """ThinK's rows (``--think``: alone, and composed after SnapKV), Q-Filters' (``--qfilter``) and calibrated Expected
    Attention's (``--ea-stats``), see the module docstring."""
    for c in (float(x) for x in args.think.split(",") if x):
        think = {"name": "ThinKPress", "params": {"key_channel_compression_ratio": c}}
        pair(f"think c{c:g}", f"{name}/think-{c:g}", {"method": "think", "params": {"key_channels": c},
                                                      "zeroed_channels": True},
             f"{name}/think-{c:g}", {"press": dict(think, kind="class", zeroed_channels=True)},
             "ThinKPress alone: every position kept, key channels zeroed")
        snap = {"window_size": 64, "kernel_size": 5}
        inner = {"method": "snapkv", "params": dict(snap, budget_tokens=keep, pooling="avg", gqa_reduce="mean")}
        pair(f"snapkv w64 k5 + think c{c:g}", f"{name}/snapkv-think-{c:g}",
             {"method": "think", "params": {"key_channels": c, "cache": inner}, "zeroed_channels": True},
             f"{name}/snapkv-think-{c:g}",
             {"press": {"kind": "class", "name": "ComposedPress", "zeroed_channels": True,
                        "params": {"presses": [{"name": "SnapKVPress", "params": dict(
                            snap, compression_ratio=args.compression_ratio)}, think]}}},
             "ComposedPress([SnapKVPress, ThinKPress])")
    if args.qfilter_file:
        pair("qfilter", f"{name}/qfilter", {"method": "qfilter", "params": {"config": args.qfilter_file,
                                                                          "budget_tokens": keep}},
             f"{name}/qfilter", {"press": {"kind": "qfilter", "file": args.qfilter_file, "expect_prefill_kept": keep,
                                           "compression_ratio": args.compression_ratio}},
             "QFilterPress with attnkit calibrate qfilter's filters (negated)")
    if args.ea_stats_file:
        pair("expected_attention stats", f"{name}/ea-stats",
             {"method": "expected_attention", "params": {"stats": args.ea_stats_file, "budget_tokens": keep}},
             f"{name}/ea-stats", {"press": {"kind": "expected_attention_stats", "file": args.ea_stats_file,
                                            "expect_prefill_kept": keep, "compression_ratio": args.compression_ratio}},
             "ExpectedAttentionStatsPress with attnkit calibrate expected_attention's statistics")


def trained_cases(pair, name: str, n: int, keep: int, args) -> None:
    """fastkvzip's rows (``--fastkvzip``: gates trained here, written in the authors' torch format and read by both
    sides: ``FastKVzipPress`` across layers, its default, and with ``layerwise=True``) and lukv's (``--lukv``: a budget
    curve profiled here, ``LUKVPress(ExpectedAttentionPress(epsilon=0.02))`` on the same ``.npy``). kvpress masks the
    dropped keys (read back from its attention patch); attnkit removes them."""
    kv, layers = args.kv_heads, args.n_layers
    if args.fastkvzip_file:
        for layerwise, total in ((False, layers * kv), (True, kv)):
            ratio = ratio_pruning(total * n, total * (n - keep))
            label = "fastkvzip" + (" layerwise" if layerwise else "")
            pair(label, f"{name}/{label.replace(' ', '-')}",
                 {"method": "fastkvzip", "params": {"config": args.fastkvzip_file, "budget_tokens": keep,
                                                    "n_sink": args.n_sink, "layerwise": layerwise}},
                 f"{name}/{label.replace(' ', '-')}",
                 {"press": {"kind": "fastkvzip", "file": args.fastkvzip_file, "compression_ratio": ratio,
                            "layerwise": layerwise, "n_sink": args.n_sink, "window_ratio": 0.02, "masked_keys": True}},
                 f"FastKVzipPress(layerwise={layerwise}) with attnkit calibrate fastkvzip's gates (torch file)")
    if args.lukv_file:
        pair("lukv", f"{name}/lukv", {"method": "lukv", "params": {"curve": args.lukv_file, "budget_tokens": keep}},
             f"{name}/lukv", {"press": {"kind": "lukv", "file": args.lukv_file, "masked_keys": True, "sink": 4,
                                        "window": 1, "epsilon": 0.02, "compression_ratio": args.compression_ratio}},
             "LUKVPress(ExpectedAttentionPress(epsilon=0.02)) with attnkit calibrate lukv's curve (.npy)")


def wrapped_press(scorer: str, args, snap_sets, ratio: float | None, kernel: int | None = None) -> tuple[dict, dict]:
    """(kvpress's inner press spec, attnkit's parameters of the same scorer) for a wrapper row."""
    if scorer == "snapkv":
        w, k = snap_sets[0]
        k = k if kernel is None else kernel
        press = {"window_size": w, "kernel_size": k}
        inner = {"name": "SnapKVPress", "params": press if ratio is None else dict(press, compression_ratio=ratio)}
        return inner, dict(press, pooling="avg", gqa_reduce="mean")
    if scorer in ("kvzap", "qfilter"):  # weights calibrated here (--kvzap N, --qfilter N), read by both sides
        file = args.kvzap_file if scorer == "kvzap" else args.qfilter_file
        if not file:
            raise SystemExit(f"wrapping {scorer} needs its weights: give --{scorer} N")
        return ({"kind": scorer, "file": file, "compression_ratio": ratio or 0.0},
                {"config": file, "window": 0} if scorer == "kvzap" else {"config": file})
    return {"name": PRESSES[scorer], "params": {} if ratio is None else {"compression_ratio": ratio}}, {}


def wrapper_cases(pair, name: str, n: int, keep: int, args, snap_sets) -> None:
    """The rows of kvpress's wrapper presses (``--wrappers``; see the module docstring) for one prompt."""
    cr = args.compression_ratio
    for item in filter(None, args.wrappers.split(",")):
        wrapper, scorers = item.split(":")
        for scorer in scorers.split("+"):
            tag = f"{name}/{wrapper}-{scorer}"
            if wrapper in ("criticalkv", "criticalkv_ada"):
                inner, params = wrapped_press(scorer, args, snap_sets, cr)
                ada = wrapper == "criticalkv_ada"
                press = {"kind": "class", "name": "CriticalAdaKVPress" if ada else "CriticalKVPress",
                         "compression_ratio": cr, "expect_prefill_kept": keep, "params": {"press": inner}}
                if ada:
                    press.update(masked_keys=True)
                    params = dict(params, head_budgets="adaptive")
                pair(f"{wrapper} {scorer}", tag, {"method": scorer, "params": dict(params, budget_tokens=keep,
                                                                                    criticalkv=True)},
                     tag, {"press": press}, f"{press['name']}({scorer})")
            elif wrapper == "chunk":
                inner, params = wrapped_press(scorer, args, snap_sets, cr)
                s = args.segment_length
                pair(f"chunk {scorer} s{s}", tag, {"method": scorer, "params": dict(params, budget_tokens=keep,
                                                                                   segment_length=s)},
                     tag, {"press": {"kind": "class", "name": "ChunkPress", "compression_ratio": cr,
                                     "params": {"press": inner, "chunk_length": s}}}, f"ChunkPress({scorer})")
            elif wrapper == "block":
                m = args.block_size
                inner, params = wrapped_press(scorer, args, snap_sets, None, kernel=1)
                a_case = {"method": scorer, "params": dict(params, budget_tokens=keep, block_size=m)}
                chunks = [keep] + [m] * ((n - keep) // m) + ([(n - keep) % m] if (n - keep) % m else [])
                pair(f"block {scorer} m{m}", tag, a_case, tag,
                     {"press": {"kind": "class", "name": "DecodingPress", "prefill_chunks": chunks, "prompt_only": True,
                                "params": {"base_press": inner, "compression_interval": 1, "target_size": keep}}},
                     "kvpress fed block by block under DecodingPress(interval 1, target n)")
                sim, _ = wrapped_press(scorer, args, snap_sets, cr, kernel=1)
                pair(f"block {scorer} m{m} vs BlockPress", tag, a_case, f"{tag}-simulated",
                     {"diagnostic": True, "press": {"kind": "class", "name": "BlockPress", "compression_ratio": cr,
                                                    "expect_prefill_kept": keep,
                                                    "params": {"press": sim, "block_size": m}}},
                     "diagnostic: BlockPress prunes block by block after a full-attention prefill")
            elif wrapper == "ratio_decoding":
                every, f = args.ratio_decoding.split(":")
                every, f = int(every), float(f)
                inner, params = wrapped_press(scorer, args, snap_sets, None)
                prefill, _ = wrapped_press(scorer, args, snap_sets, cr)
                pair(f"ratio_decoding {scorer} N{every} f{f:g}", tag,
                     {"method": scorer, "params": dict(params, budget_tokens=keep, decode_every=every,
                                                       decode_fraction=f)},
                     tag, {"press": {"kind": "class", "name": "PrefillDecodingPress", "compression_ratio": cr,
                                     "expect_prefill_kept": keep,
                                     "params": {"prefilling_press": prefill, "decoding_press": {
                                         "name": "CompressionRatioDecodingPress",
                                         "params": {"base_press": inner, "compression_interval": every,
                                                    "target_compression_ratio": 1 - f}}}}},
                     "PrefillDecodingPress(P, CompressionRatioDecodingPress(P))")
            elif wrapper == "dms":
                thresholds = dict(t.split("=") for t in args.dms_thresholds.split(";") if t)
                if scorer not in thresholds:
                    raise SystemExit(f"dms around {scorer} needs its threshold: --dms-thresholds {scorer}=T")
                t, w, decoding = float(thresholds[scorer]), args.dms_window, args.dms_decoding
                inner, params = wrapped_press(scorer, args, snap_sets, None)
                pair(f"dms {scorer} t{t:g} w{w}" + (" decoding" if decoding else ""), tag,
                     {"method": scorer, "params": dict(params, score_threshold=t, threshold_window=w,
                                                       threshold_decode=decoding)},
                     tag, {"press": {"kind": "class", "name": "DMSPress", "masked_keys": True, "decoding": decoding,
                                     "params": {"press": inner, "threshold": t, "sliding_window_size": w,
                                                "decoding": decoding}}},
                     f"DMSPress({scorer}); kept counts per head vary (kept: unused)")
            elif wrapper == "rerotation":
                inner, params = wrapped_press(scorer, args, snap_sets, cr)
                pair(f"rerotation {scorer}", tag, {"method": scorer, "original_labels": True,
                                                   "params": dict(params, budget_tokens=keep, positions="reindexed")},
                     tag, {"press": {"kind": "class", "name": "KeyRerotationPress", "rerotated": True,
                                     "compression_ratio": cr, "expect_prefill_kept": keep,
                                     "params": {"press": inner}}},
                     f"KeyRerotationPress({scorer}); kvpress decodes at the cache's length")
            else:
                raise SystemExit(f"unknown wrapper {wrapper!r}: criticalkv, criticalkv_ada, chunk, block, "
                                 f"ratio_decoding, dms, rerotation")


def composed_cases(pair, name: str, n: int, args, snap_sets) -> None:
    """``--composed FIRST+SECOND,...`` (``--composed-ratios R1:R2``): the first scorer with ``then=SECOND`` against
    ``ComposedPress([FIRST(R1), SECOND(R2)])``, each ratio applying to what its press receives: attnkit takes
    kvpress's counts, ``k1 = int(n (1 - R1))`` and ``k2 = int(k1 (1 - R2))``, as ``budget_tokens``."""
    r1, r2 = (float(r) for r in args.composed_ratios.split(":"))
    k1 = max(1, int(n * (1 - r1)))
    k2 = max(1, int(k1 * (1 - r2)))
    for item in filter(None, args.composed.split(",")):
        first, second = item.split("+")
        inner1, params1 = wrapped_press(first, args, snap_sets, r1)
        inner2, params2 = wrapped_press(second, args, snap_sets, r2)
        tag = f"{name}/composed-{first}-{second}"
        a_case = {"method": first, "params": dict(params1, budget_tokens=k1,
                                                  then={"method": second, "params": dict(params2, budget_tokens=k2)})}
        pair(f"composed {first}({r1:g})+{second}({r2:g})", tag, a_case, tag,
             {"press": {"kind": "class", "name": "ComposedPress",
                        "params": {"presses": [inner1, inner2]}}},
             f"ComposedPress; kept {k1} then {k2}", keep=k2)


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
           "cur": "CURPress", "observed_attention": "ObservedAttentionPress",
           "cap": "CapPress",
           "leverage": "LeverageScorePress", "non_causal_attention": "NonCausalAttnPress",
           "compactor": "CompactorPress"}
# parameters both sides take alike (kvpress's RandomPress draws differently on every call without a seed)
SHARED_PARAMS = {"random": {"seed": 0}, "lagkv": {"lag_size": 64}}
# attnkit's sketch seed per method: kvpress draws its Gaussian sketch from torch's global generator, unseeded; its
# worker seeds that generator with the same value right before the prompt's forward, so both draw the same sketches
SEEDED = {"leverage": "sketch_seed", "compactor": "sketch_seed"}
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


def restorekv_cases(pair, name: str, n: int, keep: int, args) -> None:
    """restorekv's row (``--restorekv FILE``): mapped as kvzip's, the budget counting the ``R`` restore entries."""
    if not args.restorekv_dir:
        return
    kv, r = args.kv_heads, args.restore_tokens
    pruned, total = kv * (n - keep + r), kv * n
    ratio = pruned / total - r / n
    for _ in range(64):  # KVzipPress's count: int(total * min(1, ratio + R/n)), after RestoreKVPress adds R/n
        got = int(total * min(1.0, ratio + r / n))
        if got == pruned:
            break
        ratio = math.nextafter(ratio, math.inf if got < pruned else -math.inf)
    else:
        raise SystemExit(f"no compression_ratio prunes exactly {pruned} of {total} with {r} restore tokens")
    params = {"config": args.restorekv, "budget_tokens": keep, "head_budgets": "adaptive", "alpha_safeguard": 0.0,
              "n_sink": args.n_sink, "chunk_size": args.kvzip_chunk}
    pair("restorekv", f"{name}/restorekv", {"method": "restorekv", "params": params}, f"{name}/restorekv",
         {"press": {"kind": "restorekv", "file": args.restorekv_dir, "compression_ratio": ratio, "layerwise": True,
                    "n_sink": args.n_sink, "chunk_size": args.kvzip_chunk, "masked_keys": True,
                    "at_cache_length": True}},
         "RestoreKVPress(layerwise=True) with attnkit calibrate restorekv's weights (peft folder); attnkit "
         "head_budgets=adaptive,alpha_safeguard=0")


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


def kvgrad_cases(pair, name: str, n: int, keep: int, args) -> None:
    """kvgrad's rows, mapped as kvzip's: ``kvgrad(budget_tokens=keep, head_budgets=adaptive, alpha_safeguard=0,
    n_sink)`` against ``KVgradPress(compression_ratio=r, layerwise=True, n_sink)`` (both at their default chunk_size,
    512), ``r`` pruning the layer's ``kv x (n - keep)`` lowest scores across its kv heads; as a diagnostic, against
    kvpress's default ``layerwise=False`` (one ranking over all layers)."""
    params = {"budget_tokens": keep, "head_budgets": "adaptive", "alpha_safeguard": 0.0, "n_sink": args.n_sink}
    ratio = ratio_pruning(args.kv_heads * n, args.kv_heads * (n - keep))
    for layerwise in (True, False) if args.diagnose else (True,):
        pair("kvgrad" if layerwise else "kvgrad vs layerwise=False", f"{name}/kvgrad",
             {"method": "kvgrad", "params": params}, f"{name}/kvgrad-{'layerwise' if layerwise else 'global'}",
             {"diagnostic": not layerwise,
              "press": {"kind": "class", "name": "KVgradPress", "masked_keys": True, "compression_ratio": ratio,
                        "params": {"compression_ratio": ratio, "layerwise": layerwise, "n_sink": args.n_sink}}},
             "attnkit head_budgets=adaptive,alpha_safeguard=0; kvpress layerwise=True" if layerwise else
             "diagnostic: kvpress's default ranks across layers, attnkit keeps kv x B per layer")


def kvcompose_cases(pair, name: str, args) -> None:
    """kvcompose's rows: ``kvcompose(budget=1 - r)`` against ``KVComposePress(compression_ratio=r)``, structured (the
    layer keeps its kept rows: matched to the prompt's keys) and not (kvpress masks: ``masked_key_indices``). kvpress
    runs its replay inside the prompt's forward, called without position ids as its pipeline does (``"replay"``)."""
    r = args.compression_ratio
    for structured in (True, False):
        label = "kvcompose" if structured else "kvcompose unstructured"
        pair(label, f"{name}/{label}", {"method": "kvcompose", "params": {"budget": 1 - r, "structured": structured}},
             f"{name}/{label}", {"press": {"kind": "class", "name": "KVComposePress", "compression_ratio": r,
                                           "masked_keys": True, "replay": "removed" if structured else "masked",
                                           "params": {"compression_ratio": r, "structured": structured}}},
             "counts per layer (and head) from one budget; kvpress's unstructured cache keeps its replay")


def scorer_cases(pair, name: str, n: int, keep: int, args) -> None:
    """The rows of knorm, keydiff, tova, expected_attention and kvzip (``--scorers``), and of ``decode_every``
    (``--decode-every``) for the prompt `name` of `n` tokens, `keep` of them kept; ``pair`` adds a row (see
    :func:`build_cases`)."""
    for method in filter(None, args.scorers.split(",")):
        if method == "kvzip":
            kvzip_cases(pair, name, n, keep, args)
            continue
        if method == "kvcompose":
            kvcompose_cases(pair, name, args)
            continue
        if method == "kvgrad":
            kvgrad_cases(pair, name, n, keep, args)
            continue
        press, shared = PRESSES[method], SHARED_PARAMS.get(method, {})
        k_case = {"press": {"kind": "class", "name": press,
                            "params": dict(shared, compression_ratio=args.compression_ratio),
                            "compression_ratio": args.compression_ratio, "expect_prefill_kept": keep,
                            "eager": method in EAGER}}
        a_case = {"method": method, "params": dict(shared, budget_tokens=keep)}
        if method in SEEDED:
            a_case["params"][SEEDED[method]] = k_case["press"]["torch_seed"] = args.seed
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
        if prompts:
            row["prefill_kept"]["unequal_by_same_tokens"] = unequal_by_same_tokens(
                [a["after_prefill"]], [b["after_prefill"]], prompts.get(row["prompt"], []))
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
        if "zeroed_channels" in a and "zeroed_channels" in b:  # ThinK: the pruned key channels per layer and kv head
            row["zeroed_channels"] = compare_sets(a["zeroed_channels"], b["zeroed_channels"])
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
        pk, at = r["prefill_kept"], r["attended"]
        if pk["equal"] < pk["total"] and pk.get("unequal_by_same_tokens"):
            lines.append(f"{r['prompt']} {r['method']}: of the {pk['total'] - pk['equal']} unequal prefill kept sets, "
                         f"{pk['unequal_by_same_tokens']} differ only by positions holding the same tokens (ties)")
        if at["equal"] < at["total"] and at.get("unequal_by_same_tokens"):
            lines.append(f"{r['prompt']} {r['method']}: of the {at['total'] - at['equal']} unequal attended sets, "
                         f"{at['unequal_by_same_tokens']} differ only by positions holding the same tokens (ties)")
    for r in rows:
        if "zeroed_channels" in r:
            zc = r["zeroed_channels"]
            lines.append(f"{r['prompt']} {r['method']}: zeroed key channels equal on {zc['equal']}/{zc['total']} "
                         f"(layer, kv head) pairs (+{zc['only_ours']}/-{zc['only_theirs']})")
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
                   help=f"of {', '.join(PRESSES)}, kvzip, kvcompose (empty: none)")
    p.add_argument("--kvzip-chunk", type=int, default=2048, help="kvzip's chunk_size (context tokens per "
                   "reconstruction forward), the same on both sides")
    p.add_argument("--duo", default="RS/SR:16:64",
                   help="duo_attention's head pattern (one R or S per kv head, layers separated by /), sinks and "
                        "recent window, PATTERN:SINKS:RECENT, against DuoAttentionPress (empty: none)")
    p.add_argument("--chunk-length", default="16", help="ChunkKV chunk lengths (comma-separated) for ChunkKVPress "
                   f"around the presses of {', '.join(CHUNKKV_SCORERS)} (empty: none)")
    p.add_argument("--wrappers", default="", help="kvpress's wrapper presses around scorers, WRAPPER:SCORER+SCORER,"
                   "... (criticalkv, criticalkv_ada, chunk, block, ratio_decoding around snapkv, knorm, keydiff, "
                   "kvzap; empty: none)")
    p.add_argument("--dms-thresholds", default="knorm=-1.8;keydiff=-0.1", help="the --wrappers dms thresholds, "
                   "SCORER=T;... (DMSPress's threshold, attnkit's score_threshold, on each scorer's own scale)")
    p.add_argument("--dms-window", type=int, default=128, help="DMSPress's sliding_window_size (threshold_window)")
    p.add_argument("--dms-decoding", action="store_true", help="DMSPress(decoding=True): threshold_decode=true")
    p.add_argument("--segment-length", type=int, default=256,
                   help="ChunkPress's chunk_length (attnkit: segment_length)")
    p.add_argument("--composed", default="", help="FIRST+SECOND scorer pairs (comma-separated): FIRST with then=SECOND "
                   "against kvpress's ComposedPress([FIRST, SECOND]), e.g. snapkv+knorm,knorm+keydiff")
    p.add_argument("--composed-ratios", default="0.5:0.5", help="R1:R2, the compression_ratio of each press of "
                   "--composed, each applying to what that press receives")
    p.add_argument("--block-size", type=int, default=130, help="BlockPress's block_size (attnkit: block_size)")
    p.add_argument("--ratio-decoding", default="4:0.25", help="N:f, CompressionRatioDecodingPress's interval and kept "
                   "fraction 1 - target_compression_ratio (attnkit: decode_every=N, decode_fraction=f)")
    p.add_argument("--merging", default="", help="MergingPress around these presses (knorm, snapkv:W:K; "
                   "comma-separated) against the same attnkit scorer with merge=true (empty: none)")
    p.add_argument("--merge-params", default="0:1,0.2:0.75", help="similarity_threshold:merge_fraction sets for "
                   "--merging")
    p.add_argument("--cam", default="", help="CAMPress(KnormPress) decode_every:merge_budget sets against cam "
                   "(empty: none)")
    p.add_argument("--think", default="", help="ThinK key_channels fractions (comma-separated): ThinKPress alone and "
                   "ComposedPress([SnapKVPress, ThinKPress]) against think and snapkv+think (empty: none)")
    p.add_argument("--qfilter", type=int, default=0, help="calibrate Q-Filters on this many windows of 256 tokens and "
                   "compare qfilter with QFilterPress on them (0: none)")
    p.add_argument("--fastkvzip", type=int, default=0, help="train Fast KVzip's gates on 4 windows of 256 tokens for this "
                   "many steps and compare fastkvzip with FastKVzipPress on those weights (0: none)")
    p.add_argument("--lukv", type=int, default=0, help="profile LU-KV's budget curve on this many pairs per task (512 "
                   "tokens, 16 answer tokens) and compare lukv with LUKVPress on that curve (0: none)")
    p.add_argument("--restorekv", default="", help="restore weights of `attnkit calibrate restorekv` for the model: "
                   "compare restorekv with RestoreKVPress on them (written as its peft folder; empty: none)")
    p.add_argument("--ea-stats", type=int, default=0, help="calibrate Expected Attention's query statistics on this "
                   "many windows of 256 tokens and compare expected_attention:stats with ExpectedAttentionStatsPress "
                   "(0: none)")
    p.add_argument("--finch", default="", help="finch's question lengths (comma-separated) against FinchPress with "
                   "that window (empty: none)")
    p.add_argument("--simlayerkv", default="", help="THRESHOLD:N_LAST:N_RECENT:N_INITIAL sets (comma-separated) of "
                   "simlayerkv against SimLayerKVPress (empty: none)")
    p.add_argument("--entropy-chunk", default="", help="CHUNK:LOW_ENTROPY_CHUNK_LENGTH sets (comma-separated) for "
                   f"EntropyGatedChunkKVPress around the presses of {', '.join(CHUNKKV_SCORERS)} against the same "
                   "scorer with chunk_length and low_entropy_chunk_length (empty: none)")
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
    args.qfilter_file = args.ea_stats_file = None
    if args.qfilter or args.ea_stats:  # calibration files made here for the model, read by both sides
        from attnkit.calibrate.expected_attention import calibrate_expected_attention
        from attnkit.calibrate.qfilter import calibrate_qfilter
        from attnkit.methods.expected_attention_stats import save_moments
        from attnkit.methods.qfilter import dumps_filters
        folder = Path(tempfile.mkdtemp(prefix="compare-calibrated-"))
        if args.qfilter:
            args.qfilter_file = str(folder / "qfilter.json")
            Path(args.qfilter_file).write_text(dumps_filters(calibrate_qfilter(model, samples=args.qfilter,
                                                                               length=256)))
        if args.ea_stats:
            mean, cov, meta = calibrate_expected_attention(model, samples=args.ea_stats, length=256)
            args.ea_stats_file = str(save_moments(folder / "expected_attention.safetensors", mean, cov, meta))
    args.n_layers = model.geometry.n_layers
    args.fastkvzip_file = args.lukv_file = None
    if args.fastkvzip or args.lukv:  # trained here for the model, read by both sides in kvpress's formats
        folder = Path(tempfile.mkdtemp(prefix="compare-trained-"))
        if args.fastkvzip:
            from attnkit.calibrate.fastkvzip import calibrate_fastkvzip
            from attnkit.methods.fastkvzip_gates import save_kvpress_format
            gates, _meta = calibrate_fastkvzip(model, samples=4, length=256, heldout=1, steps=args.fastkvzip)
            args.fastkvzip_file = str(save_kvpress_format(folder / "q_dim16_sink16.pt", gates))
        if args.lukv:
            from attnkit.calibrate.lukv import calibrate_lukv
            curve, _meta = calibrate_lukv(model, samples=args.lukv, length=512, new_tokens=16)
            args.lukv_file = str(folder / "lukv.npy")
            import numpy as np
            np.save(args.lukv_file, curve)
    args.restorekv_dir, args.restore_tokens = None, 0
    if args.restorekv:  # the same weights for kvpress: a peft adapter folder and the restore embeddings
        from attnkit.methods.restorekv_weights import load_weights, save_kvpress_format
        weights = load_weights(args.restorekv)
        weights.check_model(model)
        args.restore_tokens = weights.tokens
        args.restorekv = str(Path(args.restorekv).resolve())
        args.restorekv_dir = str(save_kvpress_format(Path(tempfile.mkdtemp(prefix="compare-restorekv-")),
                                                     weights.embeddings, weights.lora, weights.meta))
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
