"""``attnkit calibrate lukv``: LU-KV's offline profile, a budget curve per layer and kv head (Tang, Jiao, Chen, Liu, Li,
Chen, 2026, "Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV Cache Eviction",
arXiv 2602.08585; the authors' ``evaluation/curve_data`` steps 1 and 2, which kvpress's ``LUKVPress`` docstring names).

1. **Pairs** of a context and a question: ``samples`` seeded samples per task of attnkit's task generators
   (:func:`attnkit.calibrate.samples.calibration_samples`, never evaluation samples), each split into its context
   (BOS first) and its question (the authors profile a novel's chapters with questions).
2. **The scorer's ranking**: the context alone is prefilled with ``expected_attention`` (the scorer the curve is for,
   with lukv's defaults: ``epsilon=0.02``, ``n_sink=4``), whose score of every entry is recorded as the compression
   after the prompt would rank them.
3. **The oracle utility** (the paper's long-horizon utility): context and question are prefilled with full attention
   and ``new_tokens`` answer tokens generated (sampled at ``temperature``, seeded; the authors' 64 at 0.7). Each entry
   ``j`` of the context, in layer ``l`` and kv head ``h``, gets the most, over the answer's decode steps and the query
   heads ``g`` of the group, of ``a[g, j] x ||W_O^g v_j|| / Z_l``: the attention the answer's query gives it times
   the norm of its value through the head's slice of the output projection, ``Z_l`` the sum of those norms over the
   layer's query heads and context entries.
4. **Allocation per pair** (the paper's convex-hull relaxation and marginal-utility greedy solver): in each head the
   entries other than the first ``sink`` and last ``window`` are ordered by the scorer, best first, and carry their
   oracle utilities; evicting from the worst, the cumulative utility lost is replaced by its lower convex hull, whose
   slopes are non-decreasing marginal costs. For each global compression ratio ``r = 1..99 %`` the
   ``round(r x layers x kv x n)`` cheapest evictions across every layer and kv head are taken (ties: layer, head, order),
   no head going below ``max(round(0.01 n), sink + window)`` entries; head ``(l, h)``'s prune ratio is its evictions
   over ``n``.
5. The curve is the mean of the pairs' (``[99, layers, kv heads]``), written as attnkit's safetensors (metadata: the
   model, the scorer, the settings) and readable by ``lukv:curve=FILE``; ``--npy`` also writes kvpress's ``.npy``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.samples import calibration_samples
from attnkit.forward import forward, logits_of, prefill
from attnkit.generation import encode_prompt
from attnkit.methods.expected_attention import ExpectedAttention
from attnkit.methods.full import Full
from attnkit.methods.lukv import LEVELS, save_curve
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.session import Step, new_session
from attnkit.validate import number, whole
from attnkit.version import __version__

TASKS = ("passkey", "niah_multikey", "kv_retrieval", "variable_tracking", "needle_heldout")
LIMIT = 99  # the authors' threshold: no head pruned below 1 % of its entries


@dataclass
class _Scores:
    scores: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _ScoreRecorder(ExpectedAttention):
    """``expected_attention`` recording each layer's scores when it compresses the prompt."""

    def new_session_state(self) -> _Scores:
        return _Scores()

    def rank(self, ctx):
        score = super().rank(ctx)
        ctx.session_state.scores[ctx.index] = score[0].float().cpu().clone()
        return score


@dataclass
class _Utility:
    context: int = 0
    norms: dict = field(default_factory=dict)  # layer -> [hq, n] normalised ||W_O^g v_j||
    utility: dict = field(default_factory=dict)  # layer -> [kv, n] running maximum


@dataclass(frozen=True)
class _UtilityRecorder(Full):
    """Full attention that records, at every decode step, each context entry's attention weighted by its value's
    output norm (see the module docstring), the most per kv head."""

    o_proj: tuple = ()

    def new_session_state(self) -> _Utility:
        return _Utility()

    def decode_attention(self, ctx, q, k, v):
        out = super().decode_attention(ctx, q, k, v)
        run, i = ctx.session_state, ctx.index
        keys, values, _ = ctx.kv.view()
        b, kv, _, d = keys.shape
        hq, n = q.shape[1], run.context
        group = hq // kv
        if i not in run.norms:
            w = self.o_proj[i].float().to(values.device).view(-1, hq, d)  # [hidden, hq, d]
            v_ctx = values[0, :, :n].float().repeat_interleave(group, dim=0)  # [hq, n, d]
            norms = torch.einsum("gnd,mgd->gnm", v_ctx, w).norm(dim=-1)
            run.norms[i] = norms / (norms.sum() + 1e-9)
            run.utility[i] = torch.zeros(kv, n, device=values.device)
        logits = torch.einsum("gd,gld->gl", q[0, :, -1].float(), keys[0].float().repeat_interleave(group, dim=0))
        probs = torch.softmax(logits * ctx.scaling, dim=-1)[:, :n] * run.norms[i]
        run.utility[i] = torch.maximum(run.utility[i], probs.view(kv, group, n).amax(1))
        return out


def split_sample(model: LoadedModel, sample) -> tuple[torch.Tensor, torch.Tensor]:
    """(context ids with BOS, question ids) of a task sample."""
    ids = encode_prompt(model, sample.prompt)
    context = encode_prompt(model, sample.context) if sample.question else ids
    if context.shape[0] > ids.shape[0] or not torch.equal(ids[:context.shape[0]], context):
        question = sample.question if not isinstance(sample.question, str) else \
            model.tokenizer(sample.question, add_special_tokens=False).input_ids
        return context, torch.as_tensor(list(question), dtype=torch.long)
    return context, ids[context.shape[0]:]


@torch.inference_mode()
def profile_pair(model: LoadedModel, scorer: dict, context: torch.Tensor, question: torch.Tensor,
                 new_tokens: int, temperature: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(oracle utility, scorer's score), each ``[layers, kv, n]`` for a context of ``n`` tokens; `scorer`: the
    parameters of ``expected_attention``."""
    n = context.shape[0]
    recorder = _ScoreRecorder(**scorer, budget_tokens=scorer.get("n_sink", ExpectedAttention.n_sink) + 1)
    session = new_session(model, recorder, n, 0)
    prefill(model, session, context)
    scores = torch.stack([session.state.scores[i] for i in range(model.geometry.n_layers)])
    o_proj = tuple(layer.self_attn.o_proj.weight for layer in model.hf.model.layers)
    oracle = _UtilityRecorder(o_proj=o_proj)
    ids = torch.cat([context, question])
    session = new_session(model, oracle, ids.shape[0], new_tokens)
    session.state.context = n
    gen = torch.Generator().manual_seed(seed)
    logits = logits_of(model, prefill(model, session, ids)[-1:])[0]
    for step in range(new_tokens - 1):
        if temperature > 0:
            token = torch.multinomial(torch.softmax(logits / temperature, -1).cpu(), 1, generator=gen)
        else:
            token = logits.argmax(-1, keepdim=True).cpu()
        hidden = forward(model, token.to(model.device), ids.shape[0] + step, lambda p: Step(session, "decode", p))
        logits = logits_of(model, hidden[-1:])[0]
    utility = torch.stack([session.state.utility[i].cpu() for i in range(model.geometry.n_layers)])
    return utility.numpy().astype(np.float64), scores.numpy().astype(np.float64)


def hull_costs(lost: np.ndarray) -> np.ndarray:
    """Marginal costs ``[m]`` of evicting `lost` ``[m]`` (the utilities in eviction order) one after another: the
    slopes of the lower convex hull of their cumulative sum (non-decreasing)."""
    cum = np.concatenate([[0.0], np.cumsum(lost)])
    hull = [0]
    for x in range(1, cum.shape[0]):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (b - a) * (cum[x] - cum[a]) - (x - a) * (cum[b] - cum[a]) <= 0:
                hull.pop()
            else:
                break
        hull.append(x)
    costs = np.empty(lost.shape[0])
    for a, b in zip(hull, hull[1:]):
        costs[a:b] = (cum[b] - cum[a]) / (b - a)
    return costs


def pair_curve(utility: np.ndarray, scores: np.ndarray, sink: int, window: int) -> np.ndarray | None:
    """One pair's prune ratios ``[99, layers, kv]`` (see the module docstring); None if nothing can be evicted."""
    layers, heads, n = utility.shape
    mid = n - sink - window
    if mid <= 0:
        return None
    floor = max(int(round((1 - LIMIT / 100) * n)), sink + window)
    allowed = max(0, min(mid, n - floor))
    cost, layer_of, head_of, order_of = [], [], [], []
    for lay in range(layers):
        for h in range(heads):
            s, u = scores[lay, h, sink:n - window], utility[lay, h, sink:n - window]
            ranked = u[np.argsort(-s, kind="stable")]  # best first by the scorer
            c = hull_costs(ranked[::-1])[:allowed]  # evicting from the worst
            cost.append(c)
            layer_of.append(np.full(c.shape[0], lay))
            head_of.append(np.full(c.shape[0], h))
            order_of.append(np.arange(c.shape[0]))
    cost, layer_of, head_of, order_of = (np.concatenate(a) for a in (cost, layer_of, head_of, order_of))
    taken = np.lexsort((order_of, head_of, layer_of, cost))
    unit = (layer_of * heads + head_of)[taken]
    out = np.zeros((LEVELS, layers, heads))
    total = layers * heads * n
    for i in range(LEVELS):
        target = int(round((i + 1) / 100.0 * total))
        removed = np.bincount(unit[:target], minlength=layers * heads)
        out[i] = removed.reshape(layers, heads) / n
    return out


def calibrate_lukv(model: LoadedModel, *, tasks=TASKS, samples: int = 2, length: int = 1024, new_tokens: int = 64,
                   temperature: float = 0.7, sink: int = 4, window: int = 1, seed: int = 0,
                   scorer: dict | None = None,
                   progress: Callable[[str], None] | None = None) -> tuple[np.ndarray, dict]:
    """Profile `model`'s budget curve (see the module docstring): the curve ``[99, layers, kv]`` and its metadata."""
    say = progress or (lambda _msg: None)
    whole("new_tokens", new_tokens, 2, what=" (answer tokens the oracle observes)")
    number("temperature", temperature, 0, None, what=" (0: greedy answers)")
    whole("sink", sink, 0)
    whole("window", window, 0)
    scorer = dict(scorer or {"epsilon": 0.02})
    ExpectedAttention(**scorer, budget=1.0)  # its parameters checked
    pairs = calibration_samples(model, length, list(tasks), samples, seed)
    total, used = None, 0
    for k, (info, sample, _ids) in enumerate(pairs):
        context, question = split_sample(model, sample)
        say(f"pair {k + 1}/{len(pairs)}: {info['task']}, {context.shape[0]} context + {question.shape[0]} question "
            f"tokens")
        utility, scores = profile_pair(model, scorer, context.to(model.device), question.to(model.device),
                                       new_tokens, temperature, seed + k)
        curve = pair_curve(utility, scores, sink, window)
        if curve is not None:
            total = curve if total is None else total + curve
            used += 1
    if not used:
        raise ValueError("no pair had a context longer than sink + window")
    geo = model.geometry
    meta = {"model": model.spec, "architecture": geo.architecture, "n_layers": geo.n_layers,
            "n_kv_heads": geo.n_kv_heads,
            "scorer": "expected_attention:" + ",".join(f"{k}={v}" for k, v in sorted(scorer.items())),
            "sink": sink, "window": window, "allocation": "global over layers and kv heads", "limit": LIMIT,
            "profiling": {"tasks": list(tasks), "samples": samples, "length": length, "pairs": used,
                          "new_tokens": new_tokens, "temperature": temperature, "seed": seed},
            "utility": "max over answer decode steps and the group's query heads of attention x ||W_O^g v|| / Z",
            "attnkit_version": __version__}
    return (total / used).astype(np.float32), meta


def summary(curve: np.ndarray, meta: dict) -> str:
    """The kept share per layer (mean over kv heads) at 50 % and 80 % compression."""
    rows = [f"{meta['model']}: lukv budget curve, {meta['n_layers']} layers x {meta['n_kv_heads']} kv heads, "
            f"{meta['profiling']['pairs']} pairs; kept share per layer (kv heads: min-max):"]
    for r in (50, 80):
        kept = 1 - curve[r - 1]
        rows.append(f"  compression {r}%: " + ", ".join(f"L{i} {k.mean():.2f} ({k.min():.2f}-{k.max():.2f})"
                                                          for i, k in enumerate(kept)))
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate lukv`` (arguments parsed by :mod:`attnkit.cli`)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model_for_length(args.model, max(args.length + args.new_tokens + 64, 4096))
    curve, meta = calibrate_lukv(model, tasks=args.tasks or TASKS, samples=args.samples, length=args.length,
                                 new_tokens=args.new_tokens, temperature=args.temperature, sink=args.sink,
                                 window=args.window, seed=args.seed, progress=progress_to_stderr)
    path = save_curve(args.out, curve, meta)
    if args.npy:
        np.save(args.npy, curve)
        print(f"wrote {args.npy}", file=sys.stderr)
    print(summary(curve, meta))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["calibrate_lukv", "hull_costs", "pair_curve", "profile_pair", "split_sample", "summary", "main"]
