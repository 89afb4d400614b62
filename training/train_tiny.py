"""Train attnkit's bundled model (`tiny`) or its draft sibling (`tiny-draft`) on a CPU.

    python training/train_tiny.py --model tiny            # full curriculum, resumes from runs/<model>/ckpt.pt
    python training/train_tiny.py --model tiny-draft

What the data is: Python standard-library source (the training split of attnkit.eval.corpus; the
held-out files are never read) and the synthetic tasks of attnkit.eval.tasks (split="train", a random
stream disjoint from evaluation), plus a copy task. Why the curriculum: retrieval does not form from a
plain mixture; the copying (induction) mechanism has to form first on many cheap short sequences, with
the loss weighted on answer tokens and the learning rate held up, before the context is lengthened to 4096.

Every `--save-every` steps it writes a checkpoint (model, optimizer, step) under runs/<model>/ and
exports the model and tokenizer to src/attnkit/assets/<model>/, so the newest export is always usable
and an interrupted run continues where it stopped.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from attnkit.eval import corpus
from attnkit.eval.tasks import TASKS
from attnkit.tokenizer import build_byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]  # the checkout: runs/ and src/attnkit/assets/ are under it

BOS, EOS, PAD = 0, 1, 2

GEOMETRIES = {
    # ~4.8M parameters: 6 layers, 8 query heads sharing 2 kv heads (GQA 4:1), head_dim 32
    "tiny": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=768),
    # ~0.5M parameters, several times cheaper per token, same tokenizer
    "tiny-draft": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=384),
}


@dataclass(frozen=True)
class Phase:
    name: str
    steps: int  # at least this many steps
    seq_len: int
    batch: int
    mix: dict  # row kind -> weight
    # stay in the phase until the mean answer loss of this row kind over the last 100 rows falls
    # below the threshold (the induction mechanism has formed), but at most max_steps
    gate: tuple[str, float] | None = None
    max_steps: int | None = None


SHORT_MIX = {"copy": 60, "passkey": 20, "kv_retrieval": 20}
LONG_MIX = {"copy": 8, "passkey": 12, "niah_multikey": 15, "niah_multivalue": 10, "kv_retrieval": 18,
            "variable_tracking": 12, "code": 25}

CURRICULA = {
    "tiny": [
        Phase("A-induction-256", 600, 256, 16, SHORT_MIX, gate=("passkey", 0.8), max_steps=3000),
        Phase("B-1024", 1100, 1024, 8, LONG_MIX),
        Phase("C-2048", 900, 2048, 4, LONG_MIX),
        Phase("D-4096", 1000, 4096, 2, LONG_MIX),
    ],
    "tiny-draft": [
        Phase("A-256", 400, 256, 16, {"copy": 30, "code": 70}),
        Phase("B-1024", 400, 1024, 8, {"copy": 10, "code": 70, "passkey": 10, "kv_retrieval": 10}),
    ],
}

ANSWER_WEIGHT = 5.0


def encode_bytes(text: str) -> list[int]:
    """Byte tokenizer fast path (checked against the real tokenizer at start-up)."""
    return [b + 3 for b in text.encode("utf-8")]


class Batches:
    """Deterministic rows: batch `step` is a pure function of (model name, step)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.tokenizer = build_byte_tokenizer()
        self.code = encode_bytes(corpus.haystack_text("train"))
        probe = "def f(x):\n    return 'é' * x\n"
        assert encode_bytes(probe) == self.tokenizer.encode(probe, add_special_tokens=False)

    def row(self, kind: str, seq_len: int, rng: random.Random) -> tuple[list[int], list[float], list[bool]]:
        """One training row of seq_len + 1 ids, per-target loss weights, and which targets are "answers"
        (the tokens whose loss shows whether retrieval works: task answers, repeated spans of copy rows)."""
        n = seq_len + 1  # inputs and shifted targets
        if kind == "code":
            start = rng.randrange(0, len(self.code) - n)
            ids = [BOS] + self.code[start : start + n - 1]
            return ids, [1.0] * (n - 1), [True] * (n - 1)
        if kind == "copy":
            return self._copy_row(n, rng)
        task = TASKS[kind]
        # reserve room for the longest target of this task, then pad after it
        reserve = {"niah_multivalue": 34, "variable_tracking": 40}.get(kind, 16)
        sample = task.make(self.tokenizer, seq_len + 1 - reserve, rng.random(), rng.randrange(2**31), "train")
        prompt = [BOS] + encode_bytes(sample.prompt)
        target = encode_bytes(sample.target)
        ids = (prompt + target)[:n]
        n_answer = len(ids) - len(prompt)
        # the filler is code, so the model keeps learning language on task rows too
        weights = [1.0] * (len(prompt) - 1) + [ANSWER_WEIGHT] * n_answer
        answer = [False] * (len(prompt) - 1) + [True] * n_answer
        pad = n - len(ids)
        return ids + [PAD] * pad, weights + [0.0] * pad, answer + [False] * pad

    def _copy_row(self, n: int, rng: random.Random) -> tuple[list[int], list[float], list[bool]]:
        """Copy rows. Half are a random string followed by itself (a fixed offset: attention-based copying
        forms within a few hundred steps); half hold spans that reappear later in shuffled order at
        varying distances, so that copying needs a content lookup (an induction head)."""
        if rng.random() < 0.5:
            half = (n - 2) // 2
            alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 -.,"
            seg = encode_bytes("".join(rng.choice(alphabet) for _ in range(half)))
            ids = [BOS] + seg + encode_bytes("\n") + seg
            ids += [PAD] * (n - len(ids))
            weights = [0.0] * (half + 1) + [1.0] * half
            answer = [False] * (half + 2) + [True] * (half - 1)
            pad = n - 1 - len(weights)
            return ids, weights + [0.0] * pad, answer[: n - 1] + [False] * (n - 1 - len(answer[: n - 1]))
        ids, weights, answer = [BOS], [], []

        def put(tokens, weight, is_answer):
            ids.extend(tokens)
            weights.extend([weight] * len(tokens))
            answer.extend([is_answer] * len(tokens))

        alphabet = "abcdefghijklmnopqrstuvwxyz0123456789-"
        while len(ids) < n:
            spans = []
            for _ in range(rng.randint(2, 4)):
                m = rng.randint(6, 40)
                span = encode_bytes("".join(rng.choice(alphabet) for _ in range(m)))
                spans.append(span)
                put(span, 0.0, False)  # a random span is unpredictable the first time
                put(self._gap(rng), 1.0, False)
            rng.shuffle(spans)
            for span in spans:
                put(span[:1], 1.0, False)  # the first token of a repeat is not predictable
                put(span[1:], 1.0, True)
                put(self._gap(rng), 1.0, False)
        return ids[:n], weights[: n - 1], answer[: n - 1]

    def _gap(self, rng: random.Random) -> list[int]:
        m = rng.randint(1, 48)
        start = rng.randrange(0, len(self.code) - m)
        return encode_bytes("\n") + self.code[start : start + m] + encode_bytes("\n")

    def batch(self, phase: Phase, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
        rng = random.Random(f"train|{self.model_name}|{step}")
        kinds = list(phase.mix)
        picks = rng.choices(kinds, weights=[phase.mix[k] for k in kinds], k=phase.batch)
        rows = [self.row(k, phase.seq_len, rng) for k in picks]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        weights = torch.tensor([r[1] for r in rows], dtype=torch.float32)
        answer = torch.tensor([r[2] for r in rows], dtype=torch.bool)
        return ids, weights, answer, picks


def make_model(name: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=259, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, **GEOMETRIES[name],
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    return model


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


@torch.no_grad()
def probe(model, batches: Batches, seq_len: int, n: int = 6) -> dict:
    """Teacher-forced answer accuracy on evaluation-split samples (first answer token; whole answer)."""
    model.eval()
    out = {}
    tok = batches.tokenizer
    for kind in ("passkey", "niah_multikey", "kv_retrieval", "variable_tracking"):
        first = exact = 0
        try:
            for seed in range(n):
                s = TASKS[kind].make(tok, seq_len - 40, (seed + 0.5) / n, 10_000 + seed, "eval")
                prompt = [BOS] + encode_bytes(s.prompt)
                target = encode_bytes(s.target)
                ids = torch.tensor([prompt + target])
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(ids[:, :-1]).logits
                pred = logits[0, len(prompt) - 1 :].argmax(-1).tolist()
                first += pred[0] == target[0]
                exact += pred == target
        except ValueError:
            continue
        out[kind] = (round(first / n, 2), round(exact / n, 2))
    model.train()
    return out


def export(model, out_dir: Path, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(out_dir)
    (out_dir / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(GEOMETRIES), default="tiny")
    ap.add_argument("--run-dir", type=Path, default=None, help="checkpoints (default runs/<model>)")
    ap.add_argument("--out", type=Path, default=None, help="export dir (default src/attnkit/assets/<model>)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--probe-every", type=int, default=250, help="steps between probes (0: none)")
    ap.add_argument("--extra-final-steps", type=int, default=0,
                    help="lengthen the last phase (to continue training in a later session)")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (after saving) past this wall time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--from-export", action="store_true",
                    help="with no checkpoint in the run dir, continue from the exported weights in --out (step and "
                         "phase from its training.json; a fresh optimizer, re-warmed over 100 steps)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    run_dir = args.run_dir or ROOT / "runs" / args.model
    out_dir = args.out or ROOT / "src" / "attnkit" / "assets" / args.model
    run_dir.mkdir(parents=True, exist_ok=True)
    phases = list(CURRICULA[args.model])
    if args.extra_final_steps:
        last = phases[-1]
        phases[-1] = dataclasses.replace(last, steps=last.steps + args.extra_final_steps)

    model = make_model(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, trained_seconds, tokens_seen = 0, 0.0, 0
    phase_idx, phase_start, final_start = 0, 0, None
    rewarm_from = None
    ckpt = run_dir / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, trained_seconds, tokens_seen = state["step"], state["seconds"], state["tokens"]
        phase_idx, phase_start = state["phase_idx"], state["phase_start"]
        final_start = phase_start if phase_idx == len(phases) - 1 else None
        print(f"resumed at step {step}, phase {phases[min(phase_idx, len(phases) - 1)].name} "
              f"({trained_seconds / 60:.1f} min trained)", flush=True)
    elif args.from_export:
        meta = json.loads((out_dir / "training.json").read_text())
        model.load_state_dict(LlamaForCausalLM.from_pretrained(out_dir).state_dict())
        step, trained_seconds, tokens_seen = meta["step"], meta["train_minutes"] * 60, meta["tokens"]
        phase_idx, phase_start = meta["phase_idx"], meta["phase_start"]
        final_start = phase_start if phase_idx == len(phases) - 1 else None
        rewarm_from = step
        print(f"continuing from the export at step {step} with a fresh optimizer", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n_params / 1e6:.2f}M parameters, phases {[p.name for p in phases]}", flush=True)

    batches = Batches(args.model)
    log = (run_dir / "log.jsonl").open("a")
    started = time.time()
    model.train()
    window: dict[str, list[float]] = {}
    recent: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=100))

    def record(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "seconds": trained_seconds,
                    "tokens": tokens_seen, "phase_idx": phase_idx, "phase_start": phase_start}, ckpt)
        export(model, out_dir, {"model": args.model, "step": step, "parameters": n_params,
                                "train_minutes": round(trained_seconds / 60, 1), "tokens": tokens_seen,
                                "phase": phases[min(phase_idx, len(phases) - 1)].name,
                                "phase_idx": phase_idx, "phase_start": phase_start,
                                "phases": [dataclasses.asdict(p) for p in phases],
                                "command": f"python training/train_tiny.py --model {args.model}"})

    while phase_idx < len(phases):
        t0 = time.time()
        phase = phases[phase_idx]
        lr = lr_at(step, final_start, phase.steps, args.lr)
        if rewarm_from is not None:
            lr *= min(1.0, (step - rewarm_from + 1) / 100)
        for group in opt.param_groups:
            group["lr"] = lr
        ids, weights, answer, kinds = batches.batch(phase, step)
        ce, loss = optimizer_step(model, opt, ids, weights, True, 1.0)
        step += 1
        trained_seconds += time.time() - t0
        tokens_seen += ids.numel()
        # per-kind answer loss: task answers, repeated spans of copy rows, every token of code rows
        with torch.no_grad():
            for r, kind in enumerate(kinds):
                if answer[r].any():
                    value = ce[r][answer[r]].mean().item()
                    window.setdefault(kind, []).append(value)
                    recent[kind].append(value)
        if step % 25 == 0:
            per_kind = {k: round(sum(v) / len(v), 3) for k, v in window.items()}
            window.clear()
            record({"step": step, "phase": phase.name, "lr": round(lr, 6), "loss": round(loss.item(), 4),
                    "answer_loss": per_kind, "tok_per_s": round(ids.numel() / (time.time() - t0)),
                    "minutes": round(trained_seconds / 60, 1)})
        if args.probe_every and step % args.probe_every == 0:
            record({"step": step, "probe_len": phase.seq_len, "probe": probe(model, batches, phase.seq_len)})
        # advance the curriculum
        in_phase = step - phase_start
        losses = recent[phase.gate[0]] if phase.gate else ()
        gate_open = phase.gate is None or (len(losses) >= 50 and sum(losses) / len(losses) < phase.gate[1])
        if (in_phase >= phase.steps and gate_open) or in_phase >= (phase.max_steps or phase.steps):
            record({"step": step, "event": f"phase {phase.name} done after {in_phase} steps", "gate_open": gate_open})
            phase_idx, phase_start = phase_idx + 1, step
            if phase_idx == len(phases) - 1:
                final_start = step
            save()
        elif step % args.save_every == 0:
            save()
        if args.max_minutes and (time.time() - started) / 60 > args.max_minutes:
            save()
            print(f"stopping at step {step}: --max-minutes reached", flush=True)
            break
    print(f"done: step {step}, {trained_seconds / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
