"""``attnkit calibrate restorekv``: train RestoreKV's restore embeddings and LoRA adapters by self-distillation
(RestoreKV, arXiv 2608.01247; kvpress's ``RestoreKVPress``, whose published weights are peft adapters trained this
way. The paper's data and step counts were not readable offline here: the settings below are this tool's).

1. **Data.** ``samples`` prompts of ``length`` tokens from the bundled task generators (``tasks``; the training
   split's text by default, seeds offset as every calibration's: :func:`attnkit.calibrate.samples.calibration_samples`)
   and ``heldout`` prompts of the held-out split (``split="calibration"`` draws the training prompts there too, with
   seeds :data:`APART` later: quicker to tokenize, for tests). Per prompt, once (nothing here depends on what is trained): every
   layer's whole cache and KVzip's score of each entry (attnkit's ``kvzip``), and the full-cache model's greedy
   continuation of ``new_tokens`` tokens with its next-token distributions (the teacher).
2. **Student.** At a budget ``B`` drawn per prompt and step from ``budgets`` (fractions of the prompt), each layer keeps
   its ``B - R`` best prompt entries per kv head by KVzip's score (sinks kept, ``restorekv``'s default
   ``head_budgets=uniform``); the restore embeddings pass once over the whole cache with the adapters on
   (:func:`attnkit.methods.restorekv_weights.restore_entries`) and their entries join; the continuation is
   teacher-forced at positions ``n + R ..`` over that cache, the adapters off.
3. **Objective.** ``KL(teacher || student)`` of the next-token distributions over the continuation (its first token
   comes from the prompt's own, uncompressed, logits), averaged over tokens and the ``batch_size`` prompts of a
   step; gradients reach the embeddings and adapters only through the student's attention to the restore entries.
   Adam, learning rate ``lr`` with a cosine decay, ``steps`` steps. The embeddings start as ``R`` token embeddings
   drawn from the vocabulary, ``A`` as peft's default (uniform in +-1/sqrt(in)), ``B`` at zero.
4. **Held out**: the KL at ``eval_budget`` of ``kvzip`` alone (the same bytes, no restore entries), of the untrained
   restore weights and of the trained ones.

The file records the model, its geometry, the adapters' rank, alpha and targets, a fingerprint of each layer's key
projection and these settings (``restorekv:config=FILE`` refuses another model); ``--kvpress-dir`` also writes the
weights as a peft adapter folder plus ``restore_embeddings.safetensors``, as kvpress loads them. Seeded.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnkit.attention import attend
from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.samples import calibration_samples
from attnkit.errors import AttnkitError
from attnkit.forward import prefill, run_decoder_layers
from attnkit.methods.budget import resolve_budget
from attnkit.methods.kvzap_predictor import fingerprint
from attnkit.methods.kvzip import KVzip
from attnkit.methods.restorekv_weights import restore_entries, save_kvpress_format, save_weights
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.runner import generate
from attnkit.session import new_session
from attnkit.validate import number, whole
from attnkit.version import __version__

TASKS = ("passkey", "niah_multikey", "kv_retrieval", "variable_tracking", "needle_heldout")
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
BUDGETS = (0.1, 0.2, 0.3, 0.5)
APART = 100_000  # seed offset of the training prompts when they come from the held-out (calibration) split


@dataclass
class Prompt:
    """One prompt's fixed training material: per layer the whole cache ``[kv, n, d]`` and KVzip's scores ``[kv, n]``,
    the teacher's continuation ``[T]`` and its log-probabilities after each continuation token but the last
    ``[T-1, V]``."""

    keys: list
    values: list
    scores: list
    tokens: torch.Tensor
    teacher: torch.Tensor


@dataclass(frozen=True)
class _Recorder(KVzip):
    """``kvzip`` keeping, for each layer it compresses, the whole cache and its scores before the compression."""

    def new_session_state(self):
        state = super().new_session_state()
        state.recorded = {}
        return state

    def rank(self, ctx):
        score = super().rank(ctx)
        keys, values, _ = ctx.kv.view()
        ctx.session_state.recorded[ctx.index] = (keys[0].clone(), values[0].clone(), score[0].clone())
        return score


def prepare(model: LoadedModel, prompts: list, new_tokens: int, progress: Callable[[str], None]) -> list[Prompt]:
    """The fixed material of every prompt (see the module docstring): kvzip's record, then the teacher's run."""
    recorder = _Recorder(budget_tokens=KVzip.n_sink + 1)  # every layer scores and compresses
    out = []
    for j, ids in enumerate(prompts):
        if j % 16 == 0:
            progress(f"prompts {j + 1}-{min(len(prompts), j + 16)} of {len(prompts)}: kvzip scores, teacher")
        with torch.inference_mode():
            session = new_session(model, recorder, ids.shape[0], 0)
            prefill(model, session, ids[None].to(model.device))
            rec = session.state.recorded
            gen = generate(model, ids, "full", max_new_tokens=new_tokens, stop_at_eos=False, keep_logits=True)
        with torch.inference_mode(False):  # plain tensors: autograd may save them
            layers = [rec[i] for i in range(model.geometry.n_layers)]
            out.append(Prompt([k.clone() for k, _, _ in layers], [v.clone() for _, v, _ in layers],
                              [s.float().clone() for _, _, s in layers], torch.tensor(gen.token_ids),
                              torch.stack([lg.float() for lg in gen.logits[1:]]).log_softmax(-1).clone()))
    return out


def kept_slots(scores: torch.Tensor, keep: int, n_sink: int) -> torch.Tensor:
    """The `keep` best slots per kv head ``[kv, keep]`` (ascending) by `scores` ``[kv, n]``, the first `n_sink` first."""
    ranked = scores.clone()
    ranked[:, :n_sink] = float("inf")
    return ranked.topk(min(keep, ranked.shape[1]), dim=-1).indices.sort(-1).values


@dataclass
class StudentStep:
    """The continuation's attention (a step-like object the attention function hands each layer's q, k, v to): per
    layer the kept prompt entries at their positions, then the restore entries, then its own keys, causal."""

    kept: list  # per layer (keys [1, kv, m, d], values, positions [1, kv, m])
    restore: list  # per layer (keys [1, kv, R, d], values), or empty: none
    restore_pos: torch.Tensor
    q_pos: torch.Tensor
    session = None

    def note_layer_input(self, layer, hidden, module=None) -> None:
        pass

    def attention(self, layer: int, q, k, v, scaling: float, native_window) -> torch.Tensor:
        keys, values, pos = self.kept[layer]
        kv = k.shape[1]
        parts_k, parts_v, parts_p = [keys, k], [values, v], [pos, self.q_pos.expand(1, kv, -1)]
        if self.restore:
            rk, rv = self.restore[layer]
            parts_k.insert(1, rk)
            parts_v.insert(1, rv)
            parts_p.insert(1, self.restore_pos.expand(1, kv, -1))
        return attend(q, torch.cat(parts_k, 2), torch.cat(parts_v, 2), scaling, self.q_pos, torch.cat(parts_p, -1),
                      native_window)


def student_kl(model: LoadedModel, p: Prompt, budget: int, n_sink: int, weights: tuple | None) -> torch.Tensor:
    """``KL(teacher || student)`` per continuation token, averaged: the student keeps `budget` slots per kv head, ``R``
    of them the restore entries of `weights` (``(embeddings, lora, scaling)``; None: kvzip alone, `budget` prompt
    entries and no shift)."""
    n = p.keys[0].shape[1]
    r = 0 if weights is None else weights[0].shape[0]
    kept = []
    for keys, values, scores in zip(p.keys, p.values, p.scores):
        slots = kept_slots(scores, budget - r, n_sink)
        idx = slots[..., None].expand(-1, -1, keys.shape[-1])
        kept.append((keys.gather(1, idx)[None], values.gather(1, idx)[None], slots[None]))
    restore = []
    if weights is not None:
        embeddings, lora, scaling = weights
        restore = restore_entries(model, embeddings, lora, scaling, [k[None] for k in p.keys],
                                  [v[None] for v in p.values])
    ids = p.tokens[:-1][None].to(model.device)
    q_pos = torch.arange(n + r, n + r + ids.shape[1], device=model.device)
    step = StudentStep(kept, restore, torch.arange(n, n + r, device=model.device), q_pos)
    base = model.hf.model
    hidden = base.norm(run_decoder_layers(model, base.embed_tokens(ids), q_pos, step))
    logp = model.hf.lm_head(hidden).float().log_softmax(-1)[0]
    return (p.teacher.exp() * (p.teacher - logp)).sum(-1).mean()


class FrozenModel:
    """While active, no parameter of the model asks for a gradient (their flags restored on exit)."""

    def __init__(self, model: LoadedModel):
        self.params = list(model.hf.parameters())

    def __enter__(self):
        self.flags = [p.requires_grad for p in self.params]
        for p in self.params:
            p.requires_grad_(False)

    def __exit__(self, *exc):
        for p, flag in zip(self.params, self.flags):
            p.requires_grad_(flag)


def init_weights(model: LoadedModel, tokens: int, rank: int, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """The restore embeddings (token embeddings drawn from the vocabulary) and LoRA pairs at the start."""
    table = model.hf.model.embed_tokens.weight.detach()
    embeddings = table[torch.randint(0, table.shape[0], (tokens,), generator=gen)].float().cpu().clone()
    lora = {}
    for i, layer in enumerate(model.hf.model.layers):
        for name in TARGETS:
            out_dim, in_dim = layer.get_submodule(name).weight.shape
            bound = 1 / math.sqrt(in_dim)
            lora[(i, name)] = ((torch.rand(rank, in_dim, generator=gen) * 2 - 1) * bound, torch.zeros(out_dim, rank))
    return embeddings, lora


@dataclass
class Trained:
    embeddings: torch.Tensor
    lora: dict
    meta: dict = field(default_factory=dict)


def held_out(model, prompts: list[Prompt], budget_share: float, n_sink: int, weights) -> float:
    with torch.no_grad():
        return sum(float(student_kl(model, p, resolve_budget(budget_share, None, 0, 1, p.keys[0].shape[1]), n_sink,
                                    weights)) for p in prompts) / len(prompts)


def calibrate_restorekv(model: LoadedModel, *, tasks=TASKS, samples: int = 64, length: int = 1024, heldout: int = 8,
                        new_tokens: int = 64, tokens: int = 8, rank: int = 2, alpha: float = 2.0, steps: int = 400,
                        batch_size: int = 4, lr: float = 2e-3, budgets=BUDGETS, eval_budget: float = 0.2,
                        seed: int = 0, split: str = "train", progress: Callable[[str], None] | None = None
                        ) -> Trained:
    """Train the restore weights of `model` (see the module docstring)."""
    say = progress or (lambda _msg: None)
    for name, value, low in (("samples", samples, 1), ("heldout", heldout, 1), ("new_tokens", new_tokens, 2),
                             ("tokens", tokens, 1), ("rank", rank, 1), ("steps", steps, 0), ("batch_size", batch_size, 1)):
        whole(name, value, low)
    number("alpha", alpha, 0, None, low_open=True)
    number("lr", lr, 0, None, low_open=True)
    shares = [number("budgets", b, 0, 1, low_open=True) for b in budgets]
    number("eval_budget", eval_budget, 0, 1, low_open=True)
    n_sink = KVzip.n_sink
    if min(resolve_budget(b, None, 0, 1, length) for b in [*shares, eval_budget]) - tokens <= n_sink:
        raise AttnkitError(f"a budget of {min([*shares, eval_budget])} of {length} tokens leaves no prompt entry beside the {tokens} "
                           f"restore entries and {n_sink} sinks; raise the budgets or the length")
    gen = torch.Generator().manual_seed(seed)
    # on the calibration split the training prompts take seeds apart from the held-out ones
    train_seed = seed + APART if split == "calibration" else seed
    train = [ids for _, _, ids in calibration_samples(model, length, list(tasks), -(-samples // len(tasks)),
                                                      train_seed, split=split)][:samples]
    test = [ids for _, _, ids in calibration_samples(model, length, list(tasks), -(-heldout // len(tasks)), seed)]
    train_p, test_p = prepare(model, train, new_tokens, say), prepare(model, test[:heldout], new_tokens, say)
    embeddings, lora = init_weights(model, tokens, rank, gen)
    device, dtype = model.device, model.hf.model.embed_tokens.weight.dtype
    emb = torch.nn.Parameter(embeddings.to(device, dtype))
    pairs = {k: (torch.nn.Parameter(a.to(device, dtype)), torch.nn.Parameter(b.to(device, dtype)))
             for k, (a, b) in lora.items()}
    params = [emb] + [t for pair in pairs.values() for t in pair]
    scaling = alpha / rank
    before = {"kvzip": held_out(model, test_p, eval_budget, n_sink, None),
              "untrained": held_out(model, test_p, eval_budget, n_sink, (emb, pairs, scaling))}
    say(f"held-out KL at budget {eval_budget}: kvzip {before['kvzip']:.4f}, untrained restorekv "
        f"{before['untrained']:.4f}")
    opt = torch.optim.Adam(params, lr=lr)
    with FrozenModel(model):
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / max(1, steps)))
            loss = 0.0
            for _ in range(batch_size):
                p = train_p[int(torch.randint(0, len(train_p), (1,), generator=gen))]
                share = shares[int(torch.randint(0, len(shares), (1,), generator=gen))]
                budget = resolve_budget(share, None, 0, 1, p.keys[0].shape[1])
                kl = student_kl(model, p, budget, n_sink, (emb, pairs, scaling)) / batch_size
                kl.backward()
                loss += float(kl.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            if (step + 1) % max(1, steps // 10) == 0:
                say(f"step {step + 1}/{steps}: KL {loss:.4f}")
    after = held_out(model, test_p, eval_budget, n_sink, (emb, pairs, scaling))
    say(f"held-out KL at budget {eval_budget}: trained restorekv {after:.4f}")
    geo = model.geometry
    meta = {
        "model": model.spec, "architecture": geo.architecture, "n_layers": geo.n_layers,
        "hidden_size": int(model.hf.config.hidden_size), "n_kv_heads": geo.n_kv_heads, "head_dim": geo.head_dim,
        "tokens": tokens, "rank": rank, "alpha": alpha, "targets": list(TARGETS),
        "fingerprints": [fingerprint(layer.self_attn) for layer in model.hf.model.layers],
        "training": {"tasks": list(tasks), "split": split, "samples": len(train_p), "length": length,
                     "new_tokens": new_tokens, "budgets": list(budgets), "steps": steps, "batch_size": batch_size,
                     "lr": lr, "optimizer": "Adam, cosine decay", "loss": "KL(teacher || student) per token",
                     "seed": seed, "n_sink": n_sink, "head_budgets": "uniform"},
        "heldout": {"samples": len(test_p), "budget": eval_budget, "kl_kvzip": round(before["kvzip"], 5),
                    "kl_untrained": round(before["untrained"], 5), "kl_trained": round(after, 5)},
        "attnkit_version": __version__,
    }
    return Trained(emb.detach().float().cpu(), {k: (a.detach().float().cpu(), b.detach().float().cpu())
                                                for k, (a, b) in pairs.items()}, meta)


def summary(meta: dict) -> str:
    """A few lines for the terminal: what was trained and the held-out KL."""
    t, h = meta["training"], meta["heldout"]
    return (f"{meta['model']}: restorekv, {meta['tokens']} restore tokens, LoRA rank {meta['rank']} on "
            f"{len(meta['targets'])} projections x {meta['n_layers']} layers; {t['samples']} prompts of {t['length']} "
            f"tokens, {t['steps']} steps of {t['batch_size']}\n"
            f"  held out ({h['samples']} prompts, budget {h['budget']}): KL kvzip {h['kl_kvzip']:.4f}, untrained "
            f"{h['kl_untrained']:.4f}, trained {h['kl_trained']:.4f}")


def main(args) -> int:
    """``attnkit calibrate restorekv`` (arguments parsed by :mod:`attnkit.cli`)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model_for_length(args.model, max(args.length + args.new_tokens + args.tokens, 4096))
    trained = calibrate_restorekv(model, tasks=args.tasks or TASKS, samples=args.samples, length=args.length,
                                  heldout=args.heldout, new_tokens=args.new_tokens, tokens=args.tokens, rank=args.rank,
                                  alpha=args.alpha, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                  eval_budget=args.eval_budget, seed=args.seed, split=args.split,
                                  progress=progress_to_stderr)
    path = save_weights(args.out, trained.embeddings, trained.lora, trained.meta)
    if args.kvpress_dir:
        save_kvpress_format(args.kvpress_dir, trained.embeddings, trained.lora, trained.meta)
        print(f"wrote {args.kvpress_dir} (kvpress's RestoreKVPress: peft adapter + restore_embeddings)",
              file=sys.stderr)
    print(summary(trained.meta))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["calibrate_restorekv", "held_out", "init_weights", "kept_slots", "prepare", "student_kl", "summary", "main"]
