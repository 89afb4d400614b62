"""The kvpress side of attnkit's peers (:mod:`attnkit.eval.run.peers`) and of ``benchmarks/compare_kvpress.py``.

kvpress (the repository NVIDIA/kvpress) pins another transformers than attnkit, so this file runs in
kvpress's own virtual environment, started by its file path (``attnkit.eval.run.peers.WORKER``)::

    .venv-kvpress/bin/python .../attnkit/eval/run/kvpress_worker.py '{"model_dir": ..., "threads": 1,
                                                                   "new_tokens": 32, "warmup": [token ids]}'

It imports only the standard library, torch, transformers and kvpress, never attnkit (whose package
``__init__`` would import attnkit's transformers-dependent modules in the wrong environment). It loads the saved model, runs one
untimed warm-up generation, prints one JSON line of versions, then answers one JSON request per stdin
line (``{"case": {"prompt": [ids], "press": {...}}, "mode": ...}``; optional ``new_tokens`` and
``stop_ids``, the tokens after which to stop) with one JSON line on stdout (``{"error": ...}`` for a bad
press), until stdin closes. ``{"kind": "class", "name": "SnapKVPress", "params": {...}}`` builds any press
by name (attnkit's ``kvpress:`` recipes), presses given as parameters included; ``"attrs"`` sets fields a press sets
itself after construction (``FinchPress``'s ``window_size``). Every case is a greedy
generation done the way kvpress's own pipeline does it: the prompt goes through the model inside ``with
press(model):`` (a prefill-only press compresses each layer's cache in a forward hook right after that
layer's prefill attention), then each new token is fed with explicit ``position_ids`` (the compressed
cache is shorter than the sequence) outside the press context, or inside it for a decoding press.
Unlike the pipeline, the first token comes from the prefill's own logits (no separate question), which
is how attnkit's runner generates.

mode "timing": wall time of prefill (forward + first token) and of the remaining decode steps, and the
process CPU time of the whole generation.
mode "trace": no timing; which original positions each layer and kv head holds, obtained from the
cache contents themselves: a forward hook placed before the press's hook snapshots the layer's keys
once HF has appended the new ones (that is also exactly the set the step attended to), and a hook
placed after it matches every key row left in the compressed cache to its row in the snapshot (keys
are stored after RoPE, so each position's row is unique; the match is by exact bytes). A press that masks
keys per head instead of removing them (``masked_key_indices``: kvpress's ``DuoAttentionPress``, ``AdaKVPress``)
keeps them in the cache but never lets a later query see them, so the masked positions are left out of
what a head holds and attends to. ``{"kind": "duo", ...}`` builds ``DuoAttentionPress`` with its head scores,
sink and recent sizes given in the request (kvpress would download them or compute them from a dataset).
``KVzipPress`` also masks evicted keys (its compression runs its own forwards when the press's context closes;
the spec says ``"masked_keys": true``): its kept positions are read from ``masked_key_indices`` once it is done.
``"at_cache_length": true`` (``RestoreKVPress``, whose restore tokens join the cache after the prompt): the held
entries are read up to the cache's length and later tokens fed there, as kvpress's pipeline feeds them.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from importlib.metadata import version

import kvpress
import numpy as np
import torch
import transformers
from kvpress import DecodingPress, DuoAttentionPress, PrefillDecodingPress, SnapKVPress, StreamingLLMPress
from kvpress.utils import compute_n_kept
from kvpress_given import FILE_PRESSES, masked_kept, press_from_file, removed_kept, zeroed_channels
from transformers import AutoModelForCausalLM, DynamicCache


def keep_temporal_order(press) -> None:
    """Diagnostic (``spec["sorted"]``): after this press's own ``compress`` gathers the kept entries in
    top-k order, put them back in the order they had in the cache (the temporal order, since HF appends).
    Done by matching key rows, on the instance only; kvpress's code is called unchanged."""
    own = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        k2, v2 = own(module, hidden_states, keys, values, attentions, kwargs)
        if k2 is keys:
            return k2, v2
        order = []
        for h in range(keys.shape[1]):
            rows = keys[0, h].contiguous().numpy()
            index = {rows[j].tobytes(): j for j in range(rows.shape[0])}
            kept = k2[0, h].contiguous().numpy()
            order.append(torch.tensor([index[kept[j].tobytes()] for j in range(kept.shape[0])]).argsort())
        idx = torch.stack(order)[None, :, :, None].expand_as(k2)
        return k2.gather(2, idx), v2.gather(2, idx)

    press.compress = compress


def press_by_name(spec: dict):
    """``{"name": "KnormPress", "params": {...}}`` -> that press; a parameter written ``{"name": ..., "params":
    ...}`` is itself built as a press (``PrefillDecodingPress(prefilling_press=..., decoding_press=
    DecodingPress(base_press=...))``)."""
    cls = getattr(kvpress, spec["name"], None)
    if not isinstance(cls, type):
        presses = sorted(n for n in dir(kvpress) if n.endswith("Press"))
        raise ValueError(f"kvpress {getattr(kvpress, '__version__', '')} has no press {spec['name']!r}; "
                         f"it has {', '.join(presses)}")
    def built(v):  # a press given as a parameter (or a list of them: ComposedPress's presses)
        if isinstance(v, list):
            return [built(x) for x in v]
        if isinstance(v, dict) and v.get("kind") in FILE_PRESSES:  # given weights, wrapped (ChunkPress)
            return press_from_file(v)
        return press_by_name(v) if isinstance(v, dict) and "name" in v else v

    params = {k: built(v) for k, v in spec.get("params", {}).items()}
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"{spec['name']}: {exc}") from None


def build_press(spec: dict, prompt_len: int):
    kind = spec["kind"]
    if kind == "none":
        return None, False
    if kind == "streaming":
        press = StreamingLLMPress(compression_ratio=spec["compression_ratio"], n_sink=spec["n_sink"])
        decoding = False
    elif kind == "snapkv":
        press = SnapKVPress(compression_ratio=spec["compression_ratio"], window_size=spec["window_size"],
                            kernel_size=spec["kernel_size"])
        decoding = False
    elif kind == "streaming_rolling":
        press = PrefillDecodingPress(
            prefilling_press=StreamingLLMPress(compression_ratio=spec["compression_ratio"], n_sink=spec["n_sink"]),
            decoding_press=DecodingPress(base_press=StreamingLLMPress(n_sink=spec["n_sink"]), compression_interval=1,
                                         target_size=spec["target_size"], hidden_states_buffer_size=0))
        decoding = True
        if spec.get("sorted"):
            keep_temporal_order(press.prefilling_press)
            keep_temporal_order(press.decoding_press.base_press)
    elif kind == "duo":  # DuoAttentionPress with the head scores, sinks and window given instead of downloaded
        press = DuoAttentionPress(head_compression_ratio=spec["head_compression_ratio"])
        pattern = (spec["sink_size"], spec["recent_size"], np.array(spec["head_scores"], dtype=float))
        press.load_attention_pattern = lambda model: pattern  # on the instance; kvpress's own selection follows
        decoding = False
    elif kind in FILE_PRESSES:  # a press whose weights or statistics a file gives (kvpress_given.py)
        press = press_from_file(spec)
        decoding = False
    elif kind == "class":  # any press by class name (attnkit's sweeps: "kvpress:SnapKVPress:...")
        press = press_by_name(spec)
        for key, value in spec.get("attrs", {}).items():  # fields a press sets itself (FinchPress's window_size)
            setattr(press, key, value)
        decoding = isinstance(press, (DecodingPress, PrefillDecodingPress)) or bool(spec.get("decoding"))
    else:
        raise ValueError(f"unknown press kind {kind!r}")
    if "expect_prefill_kept" not in spec:
        return press, decoding
    kept = compute_n_kept(prompt_len, spec["compression_ratio"])
    if kept != spec["expect_prefill_kept"]:
        raise SystemExit(f"mapping error: kvpress keeps {kept} of {prompt_len} at compression_ratio="
                         f"{spec['compression_ratio']!r}, the driver expected {spec['expect_prefill_kept']}")
    return press, decoding


class Tracer:
    """Original positions held per layer and kv head, from the cache contents (see the module docstring)."""

    def __init__(self, model):
        self.attn = [layer.self_attn for layer in model.model.layers]
        self.pos: dict[int, list[list[int]]] = {}
        self.snap: dict[int, torch.Tensor] = {}
        self.new_positions: list[int] = []
        self.after_prefill: dict[int, list[list[int]]] = {}
        self.masked: dict[int, list[set[int]]] = {}  # per layer and kv head, positions a press masks (never attended)
        self.attended: list[dict[int, list[list[int]]]] = []  # per decode step
        self.phase = "prefill"
        self.rerotated: dict[int, torch.Tensor] = {}  # per layer, the kept indices KeyRerotationPress re-rotated
        self.handles = [m.register_forward_hook(self.before_press, with_kwargs=True, prepend=True) for m in self.attn]

    def reset(self, positions: list[int], phase: str):
        self.new_positions, self.phase = positions, phase
        if phase == "decode":
            self.attended.append({})

    def before_press(self, module, args, kwargs, output):
        i = module.layer_idx
        keys = kwargs["past_key_values"].layers[i].keys
        heads = keys.shape[1]
        prev = self.pos.get(i, [[] for _ in range(heads)])
        self.pos[i] = [p + list(self.new_positions) for p in prev]
        if keys.shape[2] != len(self.pos[i][0]):
            raise RuntimeError(f"layer {i}: cache holds {keys.shape[2]} keys but {len(self.pos[i][0])} are tracked")
        self.snap[i] = keys
        if self.phase == "decode":
            self.attended[-1][i] = self.visible(i)
        return output

    def visible(self, i: int) -> list[list[int]]:
        """Sorted positions each kv head of layer `i` holds and does not mask."""
        masked = self.masked.get(i)
        return [sorted(p for p in pos if masked is None or p not in masked[h]) for h, pos in enumerate(self.pos[i])]

    def after_press(self, module, args, kwargs, output):
        i = module.layer_idx
        keys = kwargs["past_key_values"].layers[i].keys
        before = self.snap.pop(i)
        if i in self.rerotated:  # re-rotated keys match no row: the indices the press kept, in cache order
            kept = self.rerotated.pop(i)[0].tolist()
            self.pos[i] = [[self.pos[i][h][j] for j in row] for h, row in enumerate(kept)]
        elif keys is not before:
            new_pos = []
            for h in range(keys.shape[1]):
                rows = before[0, h].contiguous()
                zeroed = (keys[0, h] == 0).all(dim=0) if keys.shape[2] else None
                if zeroed is not None and bool(zeroed.any()):  # a press zeroed key channels (ThinK): match without
                    rows = rows.masked_fill(zeroed, 0)
                rows = rows.numpy()
                index = {rows[j].tobytes(): j for j in range(rows.shape[0])}
                if len(index) != rows.shape[0]:
                    raise RuntimeError(f"layer {i} head {h}: duplicate key rows, positions cannot be matched")
                kept = keys[0, h].contiguous().numpy()
                new_pos.append([self.pos[i][h][index[kept[j].tobytes()]] for j in range(kept.shape[0])])
            self.pos[i] = new_pos
        indices = getattr(module, "masked_key_indices", None)  # head-wise masking (DuoAttention, AdaKV)
        if self.phase == "prefill" and indices is not None:
            _, heads, slots = (x.tolist() for x in indices)
            self.masked[i] = [set() for _ in self.pos[i]]
            for h, j in zip(heads, slots):
                self.masked[i][h].add(self.pos[i][h][j])
        if self.phase == "prefill":
            self.after_prefill[i] = self.visible(i)
        return output

    def register_after(self):
        return [m.register_forward_hook(self.after_press, with_kwargs=True) for m in self.attn]

    def close(self):
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def recording_rerotation(tracer: Tracer | None):
    """While active, ``KeyRerotationPress.rerotate_keys`` (also FinchPress's) hands the indices it keeps to
    `tracer` (``spec["rerotated"]``: the kept keys are re-rotated, so no row matches the snapshot's bytes)."""
    from kvpress import KeyRerotationPress
    original = KeyRerotationPress.__dict__["rerotate_keys"]

    def rerotate_keys(module, indices, keys):
        if tracer is not None:
            tracer.rerotated[module.layer_idx] = indices
        return original.__func__(module, indices, keys)

    KeyRerotationPress.rerotate_keys = staticmethod(rerotate_keys)
    try:
        yield
    finally:
        KeyRerotationPress.rerotate_keys = original


@contextlib.contextmanager
def applied(press, model, tracer: Tracer | None):
    ctx = press(model) if press is not None else contextlib.nullcontext()
    with ctx:
        handles = tracer.register_after() if tracer is not None else []
        try:
            yield
        finally:
            for h in handles:
                h.remove()


@torch.inference_mode()
def generate(model, ids: list[int], spec: dict, new_tokens: int, trace: bool, stop_ids=()) -> dict:
    """One generation with the press of `spec` (``"eager": true``: with transformers' eager attention, which
    returns the attention matrix a press such as ObservedAttentionPress reads)."""
    if spec.get("eager"):
        model.set_attn_implementation("eager")
        try:
            return generate(model, ids, dict(spec, eager=False), new_tokens, trace, stop_ids)
        finally:
            model.set_attn_implementation("sdpa")
    press, decoding = build_press(spec, len(ids))
    decoding = decoding and not spec.get("prompt_only")  # a decoding press run on the prompt's blocks only
    if "seed" in spec:  # a press drawing from torch's global generator (CAMPress's Bernoulli merges): seeded per case
        torch.manual_seed(spec["seed"])
    n = len(ids)
    masked = trace and spec.get("masked_keys", False)
    tracer = Tracer(model) if trace and not masked else None
    cache = DynamicCache()
    input_ids = torch.tensor([ids])
    logits_kept = []
    if "torch_seed" in spec:  # a press drawing from torch's global generator (LeverageScorePress's sketch)
        torch.manual_seed(spec["torch_seed"])
    c0 = time.process_time()
    t0 = time.perf_counter()
    rerotation = recording_rerotation(tracer) if spec.get("rerotated") else contextlib.nullcontext()
    with rerotation, applied(press, model, tracer):
        if tracer:
            tracer.reset(list(range(n)), "prefill")
        # a press replaying the prompt inside this forward (KVComposePress, ``"replay"``) gets no position ids, as
        # kvpress's pipeline calls it, so its replay runs at the positions after the prompt
        positions = {} if spec.get("replay") else {"position_ids": torch.arange(n)[None]}
        start = 0
        for size in spec.get("prefill_chunks") or [n]:  # the prompt fed block by block (a true block-wise prefill)
            if tracer:
                tracer.reset(list(range(start, start + size)), "prefill")
            if not spec.get("replay"):
                positions = {"position_ids": torch.arange(start, start + size)[None]}
            out = model(input_ids=input_ids[:, start:start + size], past_key_values=cache, logits_to_keep=1,
                        **positions)
            start += size
        prompt_keys = [layer.keys[0, :, :n].clone() for layer in cache.layers] if spec.get("replay") else None
    logits = out.logits[0, -1]
    tokens = [int(logits.argmax())]
    prefill_s = time.perf_counter() - t0
    if trace:
        logits_kept.append(logits.float().tolist())
    # a press appending entries after the prompt (RestoreKVPress's restore tokens): later tokens at the cache's length
    held = cache.get_seq_length(0) if spec.get("at_cache_length") else n
    kept = masked_kept(model, held) if masked else None
    zeroed = zeroed_channels(cache) if trace and spec.get("zeroed_channels") else None
    if masked and spec.get("replay") == "removed":  # the press kept rows of the prompt's keys when it closed
        kept = removed_kept(cache, prompt_keys)
    t1 = time.perf_counter()
    attended_masked: list = []
    with applied(press if decoding else None, model, tracer if decoding else None):
        after_handles = tracer.register_after() if (tracer and not decoding) else []
        for i in range(new_tokens - 1):
            if tokens[-1] in stop_ids:
                break
            pos = n + i
            if tracer:
                tracer.reset([pos], "decode")
            if masked and spec.get("decoding"):  # a press masking while decoding: what this step may attend to
                seen = masked_kept(model, pos)
            # re-rotated keys sit at 0..B-1: the next token at the cache's length (transformers' generate)
            at = cache.get_seq_length(0) if spec.get("rerotated") or spec.get("at_cache_length") else pos
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                        position_ids=torch.tensor([[at]]))
            logits = out.logits[0, -1]
            tokens.append(int(logits.argmax()))
            if trace:
                logits_kept.append(logits.float().tolist())
            if masked and spec.get("decoding"):
                attended_masked.append({k: [p + [pos] for p in v] for k, v in seen.items()})
            elif masked:
                kept_now = {k: [p + list(range(held, at + 1)) for p in v] for k, v in kept.items()}
                attended_masked.append(kept_now)
        for h in after_handles:
            h.remove()
    decode_s = time.perf_counter() - t1
    cpu_s = time.process_time() - c0
    result = {"tokens": tokens, "prefill_s": prefill_s, "decode_s": decode_s, "cpu_s": cpu_s,
              "final_cache_len": [int(layer.keys.shape[2]) for layer in cache.layers],
              "kv_bytes": sum(int(layer.keys.nbytes + layer.values.nbytes) for layer in cache.layers)}
    if zeroed is not None:
        result["zeroed_channels"] = zeroed
    if masked:
        result["after_prefill"], result["attended"], result["logits"] = kept, attended_masked, logits_kept
    elif trace:
        tracer.close()
        result["after_prefill"] = {str(k): v for k, v in sorted(tracer.after_prefill.items())}
        result["attended"] = [{str(k): v for k, v in sorted(step.items())} for step in tracer.attended]
        result["logits"] = logits_kept
    return result


def main() -> int:
    setup = json.loads(sys.argv[1])
    protocol, sys.stdout = sys.stdout, sys.stderr  # stdout carries only the answers
    torch.set_num_threads(setup["threads"])
    model = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    warmup = setup["warmup"]
    generate(model, warmup, {"kind": "none", "compression_ratio": 0.0, "expect_prefill_kept": len(warmup)}, 4, False)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "kvpress": getattr(kvpress, "__version__", None), "threads": torch.get_num_threads(),
            "attn_implementation": model.config._attn_implementation}
    if meta["kvpress"] is None:
        meta["kvpress"] = version("kvpress")
    protocol.write(json.dumps(meta) + "\n")
    protocol.flush()
    for line in sys.stdin:  # one request per line: {"case": ..., "mode": "trace" | "timing"}
        request = json.loads(line)
        case = request["case"]
        try:
            result = generate(model, case["prompt"], case["press"], case.get("new_tokens", setup["new_tokens"]),
                              request["mode"] == "trace", set(case.get("stop_ids", ())))
        except (ValueError, TypeError, AssertionError) as exc:  # a bad press or parameter: answered, the worker goes on
            result = {"error": str(exc)}
        protocol.write(json.dumps(result) + "\n")
        protocol.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
