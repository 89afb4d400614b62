"""Train model v2, a small general in-context retriever (issue #29), one stage of its curriculum at a time.

    nice -n 19 python training/train_v2.py --stage model_v2 --run-dir runs/model_v2   # starts, or resumes it there
    python training/train_v2.py --stage model_v2 --run-dir runs/model_v2 --max-minutes 60   # stop (saved) past an hour
    # another stage's own schedule from v2's weights (the key-recall drill):
    python training/train_v2.py --stage model_v2_drill --run-dir runs/model_v2_drill --init-from runs/model_v2/export
    # the draft model for speculative decoding: its own weights, the target's tokenizer
    python training/train_v2.py --stage model_v2_draft --run-dir runs/model_v2_draft \
        --tokenizer-from runs/model_v2/export   # the vocabulary every stage keeps
    # the whole lineage of the best weights, from nothing: training/chain_v2.py

The stages are the entries of training/curriculum_v2.json (``--config``, the default); ``--config`` also takes a
file holding one config of the same form (the tests' toy runs).

Run from the checkout with PYTHONPATH=src:training. The run directory holds the tokenizer (trained on the
first start from the training corpus, see tokenizer_v2.py), ckpt.pt (model, optimizer, step, phase),
export/ (the newest weights and tokenizer in Hugging Face form) and log.jsonl (the curves: per-kind answer
losses every 25 steps, and a probe on held-out phrasings and filler every `probe.every` steps).

Why this curriculum (see /work/shared/notes/training-probe.md and the tiny run): retrieval does not form from
a plain mixture; copying and associative recall form first on many cheap short sequences, with the loss
on the answers (filler weighted by the phase's prompt_weight) and the learning rate held at its peak, and a
phase ends only when its gate (mean answer loss of one row kind over the last 100 rows) is passed, at most
after max_steps. Then the context is lengthened up to 4096 tokens, the longest evaluated length (the probe
found no length generalisation). The learning rate decays (cosine to 10 %) over the final phase only.
RoPE's base bounds the distance over which a query can match a key by content (Men et al. 2024, "Base of RoPE
Bounds Context Length", arXiv:2405.14591); with 32 dimensions per head, 10,000 is too small for 4096 tokens, so
the later configs raise it to 500,000 (docs/benchmarks.md, "The RoPE base bounded the reach").

CPU: the trainer shares 2 cores with other work; OMP_WAIT_POLICY=PASSIVE (set here before torch loads)
stops idle OpenMP threads from spinning. bf16 autocast is used on a GPU and on CPUs with native bf16
(faster than fp32 there: docs/benchmarks.md); on AVX2-only CPUs it would be many times slower, so fp32. With a
GPU (cuda), the same script trains there. --fp32 trains in float32 anywhere: the chain's base stage, whose first
skill, copying, formed in float32 but not in bf16 autocast (docs/benchmarks.md, "Rebuilding model v2").
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from attnkit.eval.data import retrieval_data as R  # noqa: E402
from attnkit.eval.data.tasks import TASKS  # noqa: E402
from data_v2 import BOS, PAD, Rows  # noqa: E402
from prefetch_v2 import Prefetcher  # noqa: E402
from tokenizer_v2 import load_tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
CURRICULUM = HERE / "curriculum_v2.json"
PROBE_TASKS = ("needle_heldout", "needle_multikey_heldout", "needle_multivalue_heldout", "kv_listing_heldout",
               "variable_chain_heldout", "passkey", "niah_multikey", "kv_retrieval", "variable_tracking")


def lr_at(step: int, final_phase_start: int | None, final_steps: int, peak: float, warmup: int = 100) -> float:
    """Linear warm-up, then the peak rate held until the final phase, cosine to 10 % over it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if final_phase_start is None or step < final_phase_start:
        return peak
    t = min(1.0, (step - final_phase_start) / max(1, final_steps))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def optimizer_step(model, opt, ids: torch.Tensor, weights: torch.Tensor, bf16: bool, clip: float):
    """One training step on a batch: next-token cross-entropy per position (in autocast where `bf16`), its mean
    weighted by `weights` ([rows, length - 1]), backward, gradient clipping, the optimizer's step. Returns the
    per-position losses and the loss, detached."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(ids[:, :-1]).logits
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                         reduction="none").view(ids.shape[0], -1)
    loss = (ce * weights).sum() / weights.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return ce.detach(), loss.detach()


def fast_bf16(device: str) -> bool:
    """bf16 autocast on a GPU, or on a CPU with native bf16 matrix instructions; elsewhere (AVX2 CPUs)
    PyTorch runs bf16 matrix products through a slow reference kernel, far slower than fp32."""
    if device == "cuda":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast(device: str, bf16: bool):
    return torch.autocast(device, dtype=torch.bfloat16, enabled=bf16)


def make_model(config: dict, vocab_size: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab_size, rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=1, pad_token_id=PAD,
                      tie_word_embeddings=True, attention_bias=False, mlp_bias=False, **config["model"])
    torch.manual_seed(config["seed"])
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def probe(model, tok, length: int, n: int, device: str, bf16: bool) -> dict:
    """Exact-answer accuracy on evaluation samples (held-out phrasings and filler for the v2 tasks, the
    eval split of the acceptance tasks), teacher-forced: every answer token is the argmax, which is
    exactly when greedy decoding writes the answer. Also the accuracy of the answer's first token with
content (finding the needle comes before copying all of it)."""
    model.eval()
    out = {}
    for name in PROBE_TASKS:
        task = R.EVAL_TASKS.get(name) or TASKS[name]
        first = exact = 0
        for seed in range(n):
            s = task.make(tok, length - 48, (seed + 0.5) / n, 10_000 + seed, "eval")
            prompt = [BOS] + tok.encode(s.prompt, add_special_tokens=False)
            target = tok.encode(s.target.split("\n")[0], add_special_tokens=False)
            ids = torch.tensor([prompt + target], device=device)
            with autocast(device, bf16):
                logits = model(ids[:, :-1]).logits
            pred = logits[0, len(prompt) - 1 :].argmax(-1).tolist()
            # the first token with content: with digits split, " 4821" starts with a bare space token
            k = next((i for i, t in enumerate(target) if tok.decode([t]).strip()), 0)
            first += pred[k] == target[k]
            exact += pred == target
        out[name] = [round(first / n, 2), round(exact / n, 2)]
    model.train()
    return out


def curriculum(path: Path | None = None) -> list[dict]:
    """The curriculum's entries, in its order: each ``{"config": {...}, "chain": bool, ...}`` (its "about" says
    what the keys mean)."""
    return json.loads((path or CURRICULUM).read_text())["stages"]


def load_config(path: Path, stage: str | None) -> dict:
    """The config of `stage` in the curriculum at `path`, or the one config a config file holds."""
    data = json.loads(Path(path).read_text())
    if "stages" not in data:
        if stage is not None:
            raise SystemExit(f"--stage {stage}: {path} holds one config ({data.get('name')}), not a curriculum")
        return data
    names = [entry["config"]["name"] for entry in data["stages"]]
    if stage not in names:
        raise SystemExit(f"--stage {stage}: not a stage of {path}; the stages are {', '.join(names)}")
    return data["stages"][names.index(stage)]["config"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=CURRICULUM,
                    help="the curriculum (default: training/curriculum_v2.json) or a file of one config")
    ap.add_argument("--stage", default=None, help="the curriculum's stage to train (its config's name)")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (after saving) past this wall time")
    ap.add_argument("--max-steps", type=int, default=None, help="stop (after saving) at this step")
    ap.add_argument("--extra-final-steps", type=int, default=0, help="lengthen the last phase (continue later)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start a run without a checkpoint from an export directory (weights, tokenizer and "
                         "training.json of an earlier run): its step and phase go on, with a fresh optimizer whose "
                         "learning rate warms up again")
    ap.add_argument("--tokenizer-from", type=Path, default=None,
                    help="a new run's tokenizer from this export directory, its weights from scratch (a draft model "
                         "for speculative decoding must share its target's tokenizer)")
    ap.add_argument("--fp32", action="store_true", help="float32 throughout, also where bf16 autocast is fast")
    ap.add_argument("--save-every", type=int, default=None, help="steps between checkpoints (default: the config's)")
    ap.add_argument("--probe-every", type=int, default=None,
                    help="steps between probes (default: the config's; 0: none)")
    ap.add_argument("--data-workers", type=int, default=None,
                    help="processes writing batches ahead (default: 4 on a GPU, 0 on a CPU, whose cores train)")
    return ap


def main() -> None:
    train(parser().parse_args())


def train(args: argparse.Namespace) -> bool:
    """Runs (or resumes) one config's schedule; True once it is done (every phase, or --max-steps reached),
    False when stopped by --max-minutes."""

    config = load_config(args.config, args.stage)
    phases = [dict(p) for p in config["phases"]]
    phases[-1]["steps"] += args.extra_final_steps
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = args.run_dir / "ckpt.pt"
    tok_from = args.init_from if args.init_from is not None and not ckpt.exists() else args.tokenizer_from
    if tok_from is not None and not (args.run_dir / "tokenizer").exists():
        PreTrainedTokenizerFast.from_pretrained(tok_from).save_pretrained(args.run_dir / "tokenizer")
    tok = load_tokenizer(args.run_dir, config)
    model = make_model(config, len(tok)).to(device)
    oc = config["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=oc["lr"], betas=tuple(oc["betas"]), weight_decay=oc["weight_decay"])
    st = {"step": 0, "seconds": 0.0, "tokens": 0, "phase_idx": 0, "phase_start": 0}
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        st = state["state"]
        print(f"resumed at step {st['step']} ({st['seconds'] / 60:.1f} min trained)", flush=True)
    elif args.init_from is not None:
        loaded = model.load_state_dict(load_file(args.init_from / "model.safetensors"), strict=False)
        if loaded.unexpected_keys or set(loaded.missing_keys) - {"lm_head.weight"}:  # the head is the tied embedding
            raise SystemExit(f"{args.init_from} does not hold this config's model: {loaded}")
        model.tie_weights()
        meta = json.loads((args.init_from / "training.json").read_text())
        old_base, new_base = meta["config"]["model"]["rope_theta"], config["model"]["rope_theta"]
        if old_base != new_base:  # a larger base lets content match over longer distances (arXiv:2405.14591)
            print(f"RoPE base {old_base:g} -> {new_base:g}: the weights carry over, the rotations change", flush=True)
        if meta["config"]["name"] == config["name"]:  # the same run's schedule goes on
            st = {k: meta[k] for k in st} | {"rewarm_from": meta["step"]}
        else:  # another config's weights: its own schedule from the start
            st["rewarm_from"] = 0
        print(f"initialised from {args.init_from} ({meta['config']['name']}, step {meta['step']}), at step "
              f"{st['step']} of {config['name']} (fresh optimizer)", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    bf16 = fast_bf16(device) and not args.fp32
    precision = "bf16 autocast" if bf16 else "fp32"
    print(f"{config['name']}: {n_params / 1e6:.2f}M parameters, vocab {len(tok)}, device {device}, "
          f"{precision}", flush=True)

    pc = config["probe"]
    probe_every = pc["every"] if args.probe_every is None else args.probe_every
    save_every = args.save_every or config["save_every"]
    workers = args.data_workers if args.data_workers is not None else (4 if device == "cuda" else 0)
    batches = Prefetcher(Rows(tok, config), workers, source=(args.run_dir, config))
    log = (args.run_dir / "log.jsonl").open("a")
    started = time.time()
    window: dict[str, list[float]] = collections.defaultdict(list)
    recent: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=100))

    def record(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": st, "config": config}, tmp)
        tmp.replace(ckpt)  # an interrupted save never leaves a broken checkpoint
        model.save_pretrained(args.run_dir / "export", safe_serialization=True)
        tok.save_pretrained(args.run_dir / "export")
        meta = {**st, "parameters": n_params, "phase": phases[min(st["phase_idx"], len(phases) - 1)]["name"],
                "device": device, "precision": precision,
                "config": config, "command": "python training/train_v2.py --run-dir RUN_DIR"}
        (args.run_dir / "export" / "training.json").write_text(json.dumps(meta, indent=2) + "\n")

    model.train()
    while st["phase_idx"] < len(phases):
        t0 = time.time()
        phase, step = phases[st["phase_idx"]], st["step"]
        final_start = st["phase_start"] if st["phase_idx"] == len(phases) - 1 else None
        lr = lr_at(step, final_start, phase["steps"], oc["lr"], oc["warmup"])
        if "rewarm_from" in st:  # a fresh optimizer's moments are estimated anew: warm the rate up again
            lr *= min(1.0, (step - st["rewarm_from"] + 1) / oc["warmup"])
        for group in opt.param_groups:
            group["lr"] = lr
        ids, weights, answer, kinds = batches.batch(phase, step)
        ce, loss = optimizer_step(model, opt, ids.to(device), weights.to(device), bf16, oc["clip"])
        st["step"] = step = step + 1
        st["seconds"] += time.time() - t0
        st["tokens"] += ids.numel()
        ce = ce.cpu()
        for r, kind in enumerate(kinds):
            if answer[r].any():
                value = ce[r][answer[r]].mean().item()
                window[kind].append(value)
                recent[kind].append(value)
        if step % 25 == 0 or step in (1, 5, 10):
            record({"step": step, "phase": phase["name"], "lr": round(lr, 6), "loss": round(loss.item(), 4),
                    "answer_loss": {k: round(sum(v) / len(v), 3) for k, v in sorted(window.items())},
                    "tok_per_s": round(ids.numel() / (time.time() - t0)), "minutes": round(st["seconds"] / 60, 1)})
            window.clear()
        if probe_every and step % probe_every == 0:
            length = max(pc["min_len"], phase["seq_len"])
            record({"step": step, "probe_len": length, "probe": probe(model, tok, length, pc["n"], device, bf16)})
        in_phase = step - st["phase_start"]
        gate = phase.get("gate")
        losses = recent[gate[0]] if gate else ()
        gate_open = gate is None or (len(losses) >= 50 and sum(losses) / len(losses) < gate[1])
        if (in_phase >= phase["steps"] and gate_open) or in_phase >= phase.get("max_steps", phase["steps"]):
            record({"step": step, "event": f"phase {phase['name']} done after {in_phase} steps", "gate_open": gate_open})
            st["phase_idx"], st["phase_start"] = st["phase_idx"] + 1, step
            recent.clear()  # the next gate judges answers at the next length only
            save()
        elif step % save_every == 0:
            save()
        if (args.max_minutes and (time.time() - started) / 60 > args.max_minutes) or step == args.max_steps:
            save()
            print(f"stopping at step {step}", flush=True)
            break
    batches.close()
    log.close()
    finished = st["phase_idx"] >= len(phases) or st["step"] == args.max_steps
    print(f"{'done' if finished else 'stopped'}: step {st['step']}, {st['seconds'] / 60:.1f} min", flush=True)
    return finished


if __name__ == "__main__":
    main()
