"""``attnkit calibrate fastkvzip``: train Fast KVzip's gates on KVzip's scores (Kim, Han, Yun, 2026, "Fast KVzip:
Efficient and Accurate LLM Inference with Gated KV Eviction", arXiv 2601.17668, section 3.2; the authors' ``optim.py``
in github.com/Janghyun1230/FastKVzip).

1. **Data.** ``samples`` windows of ``length`` tokens (BOS first) of the model's own text, the training split of
   attnkit's corpus (:func:`attnkit.calibrate.kvzap.text_windows`); ``heldout`` windows of the held-out split measure
   the fit. Each batch is prefilled with attnkit's ``kvzip`` (:func:`attnkit.calibrate.kvzap.collect`): per layer, the
   attention inputs of every token (the gate's input) and every entry's KVzip score per kv head (the target, in
   [0, 1]: the most attention it receives while the model repeats the prompt). The authors collect the same pairs on
   FineWeb-Edu contexts of about 10k tokens.
2. **Gates** (:mod:`attnkit.methods.fastkvzip_gates`): per layer ``dim``-dimensional gate queries (``G`` per kv head,
   the model's query heads per kv head) and keys, ``sinks`` learnt sink keys per kv head (the paper's 16 and 16). The
   projections start as ``nn.Linear``'s default (uniform in +-1/sqrt(D)), the norms' scales at 1, the sink keys and
   biases at 0.
3. **Objective** (the paper's distillation, the authors' default loss): the binary cross-entropy between the gate's
   score ``s`` and KVzip's score ``y`` of each entry, ``-(y log s + (1 - y) log(1 - s))``, averaged over the tokens of a
   mini-batch, summed over kv heads and layers. SGD with momentum 0.9, ``steps`` steps (the authors' 5,000) of
   ``batch_size`` tokens (1,000) reshuffled each epoch, learning rate ``lr`` (0.2) times the authors' schedule: a
   warm-up of ``step / 100`` over the first 1 % of the steps, then 1, 1/2 from half the steps, 1/4 from three quarters.
4. **Held out**, per layer: the cross-entropy, the authors' accuracy (whether score and target sit on the same side
   of 0.05) and the share of KVzip's top 30 % entries per window and kv head that the gate's top 30 % holds.

The file records the model, its geometry and a fingerprint of each layer's key projection
(``fastkvzip:config=FILE`` refuses another model). Seeded: the same arguments write the same weights.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.kvzap import KEEP_SHARE, collect, text_windows
from attnkit.calibrate.samples import check_length
from attnkit.methods.fastkvzip_gates import NAMES, gate_scores, save_gates
from attnkit.methods.kvzap_predictor import fingerprint
from attnkit.methods.kvzip import KVzip
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.validate import number, whole
from attnkit.version import __version__

ACC_THRESHOLD = 0.05  # the authors' accuracy: score and target on the same side of it


def lr_factor(step: int, steps: int) -> float:
    """The authors' schedule: ``step / 100`` during the first 1 % of the steps, then 1, 1/2, 1/4."""
    if step < 0.01 * steps:
        return 0.01 * step
    if step >= 0.75 * steps:
        return 0.25
    return 0.5 if step >= 0.5 * steps else 1.0


def init_gate(hidden: int, heads: int, group: int, dim: int, sinks: int, gen: torch.Generator) -> dict:
    """One layer's gate at the start of training (see the module docstring)."""
    bound = 1 / math.sqrt(hidden)

    def uniform(*shape):
        return (torch.rand(*shape, generator=gen) * 2 - 1) * bound

    return {"q_proj.weight": uniform(heads * group * dim, hidden), "q_proj.bias": uniform(heads * group * dim),
            "k_proj.weight": uniform(heads * dim, hidden), "q_norm.weight": torch.ones(dim),
            "k_norm.weight": torch.ones(dim), "k_base": torch.zeros(heads, 1, sinks, dim),
            "b": torch.zeros(heads, 1, group)}


def bce(score: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy per entry (log clamped at -100, as torch's)."""
    return -(target * score.log().clamp_min(-100) + (1 - target) * (1 - score).log().clamp_min(-100))


def train_gates(xs: list[torch.Tensor], ys: list[torch.Tensor], *, group: int, dim: int, sinks: int, steps: int,
                lr: float, batch_size: int, seed: int, progress: Callable[[str], None]) -> list[dict]:
    """Every layer's gate trained on its inputs ``[N, D]`` and KVzip scores ``[N, kv]`` (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    n, hidden = xs[0].shape
    heads = ys[0].shape[1]
    layers = [{k: torch.nn.Parameter(v) for k, v in init_gate(hidden, heads, group, dim, sinks, gen).items()}
              for _ in xs]
    opt = torch.optim.SGD([p for layer in layers for p in layer.values()], lr=lr, momentum=0.9)
    per_epoch = max(1, n // batch_size)
    order = torch.randperm(n, generator=gen)
    for step in range(steps):
        split = step % per_epoch
        if split == 0 and step:
            order = torch.randperm(n, generator=gen)
        idx = order[split * batch_size:(split + 1) * batch_size]
        loss = sum(bce(gate_scores(w, x[idx][None])[0], y[idx].T).mean(-1).sum() for w, x, y in zip(layers, xs, ys))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(step, steps)
        opt.step()
        if (step + 1) % max(1, steps // 10) == 0:
            progress(f"step {step + 1}/{steps}: loss {float(loss.detach()) / len(layers):.4f} per layer")
    return [{k: v.detach().clone() for k, v in layer.items()} for layer in layers]


@torch.no_grad()
def held_out_fit(w: dict, x: torch.Tensor, y: torch.Tensor, windows: int) -> dict:
    """A layer's held-out cross-entropy (summed over kv heads), accuracy and top-30 % overlap with KVzip."""
    score = gate_scores(w, x[None])[0]  # [kv, N]
    target = y.T
    loss = float(bce(score, target).mean(-1).sum())
    acc = float(((score >= ACC_THRESHOLD) == (target >= ACC_THRESHOLD)).float().mean())

    def per(t):  # [windows, kv, n]
        return t.reshape(t.shape[0], windows, -1).transpose(0, 1)

    k = max(1, round(KEEP_SHARE * per(target).shape[-1]))
    true_top = torch.zeros_like(per(target), dtype=torch.bool).scatter_(-1, per(target).topk(k).indices, True)
    pred_top = torch.zeros_like(true_top).scatter_(-1, per(score).topk(k).indices, True)
    overlap = float((true_top & pred_top).sum() / true_top.sum())
    return {"bce": round(loss, 4), "accuracy": round(acc, 4), "kept_overlap": round(overlap, 4)}


def calibrate_fastkvzip(model: LoadedModel, *, samples: int = 16, length: int = 1024, heldout: int = 2, seed: int = 0,
                        dim: int = 16, sinks: int = 16, steps: int = 1000, lr: float = 0.2, batch_size: int = 1000,
                        progress: Callable[[str], None] | None = None) -> tuple[list, dict]:
    """Train the gates of `model` (see the module docstring): per layer its tensors, and the file's metadata."""
    say = progress or (lambda _msg: None)
    whole("samples", samples, 1)
    whole("heldout", heldout, 1)
    check_length(model, length)
    whole("dim", dim, 1, what=" (the gate's query and key dimension)")
    whole("sinks", sinks, 0, what=" (learnt sink keys per kv head)")
    whole("steps", steps, 1)
    whole("batch_size", batch_size, 1, what=" (tokens per step)")
    number("lr", lr, 0, None, low_open=True)
    geo = model.geometry
    group = geo.n_q_heads // geo.n_kv_heads
    xs, logs = collect(model, text_windows(model, "train", samples, length, seed), say)
    test_x, test_logs = collect(model, text_windows(model, "heldout", heldout, length, seed), say)
    ys, test_ys = [y.exp() for y in logs], [y.exp() for y in test_logs]  # kvzip's scores (floored at 1e-10)
    layers = train_gates(xs, ys, group=group, dim=dim, sinks=sinks, steps=steps, lr=lr, batch_size=batch_size,
                         seed=seed, progress=say)
    fits = [held_out_fit(w, x, y, heldout) for w, x, y in zip(layers, test_x, test_ys)]
    attn = [layer.self_attn for layer in model.hf.model.layers]
    meta = {
        "model": model.spec, "architecture": geo.architecture, "n_layers": geo.n_layers,
        "hidden_size": int(xs[0].shape[1]), "n_kv_heads": geo.n_kv_heads, "group": group, "dim": dim, "sinks": sinks,
        "fingerprints": [fingerprint(m) for m in attn],
        "target": f"attnkit's kvzip score (chunk_size={KVzip.chunk_size}, n_sink={KVzip.n_sink}): the most attention "
                  f"an entry receives while the model repeats the prompt",
        "input": "each layer's attention input: the hidden states after the layer's input norm",
        "training": {"split": "train", "samples": samples, "length": length, "seed": seed,
                     "tokens": int(xs[0].shape[0]), "loss": "binary cross-entropy", "optimizer": "SGD momentum 0.9",
                     "steps": steps, "lr": lr, "batch_size": batch_size},
        "heldout": {"split": "heldout", "samples": heldout, "tokens": int(test_x[0].shape[0]),
                    "keep_share": KEEP_SHARE, "layers": fits},
        "tensors": list(NAMES), "attnkit_version": __version__,
    }
    return layers, meta


def summary(meta: dict) -> str:
    """A few lines for the terminal: the held-out fit per layer."""
    fits = meta["heldout"]["layers"]
    rows = [f"{meta['model']}: fastkvzip gates, {meta['n_layers']} layers x {meta['n_kv_heads']} kv heads "
            f"(G={meta['group']}, dim {meta['dim']}, {meta['sinks']} sinks), {meta['training']['tokens']} training "
            f"tokens, {meta['training']['steps']} steps; held out ({meta['heldout']['tokens']} tokens):"]
    rows += [f"  layer {i:>2}: cross-entropy {f['bce']:.3f}, accuracy {f['accuracy']:.3f}, kvzip's top "
             f"{KEEP_SHARE:.0%} kept {f['kept_overlap']:.3f}" for i, f in enumerate(fits)]
    rows.append(f"  mean: accuracy {sum(f['accuracy'] for f in fits) / len(fits):.3f}, kept "
                f"{sum(f['kept_overlap'] for f in fits) / len(fits):.3f}")
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate fastkvzip`` (arguments parsed by :mod:`attnkit.cli`)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model_for_length(args.model, max(args.length, 4096))
    layers, meta = calibrate_fastkvzip(model, samples=args.samples, length=args.length, heldout=args.heldout,
                                       seed=args.seed, dim=args.dim, sinks=args.sinks, steps=args.steps, lr=args.lr,
                                       batch_size=args.batch_size, progress=progress_to_stderr)
    path = save_gates(args.out, layers, meta)
    print(summary(meta))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["calibrate_fastkvzip", "held_out_fit", "init_gate", "lr_factor", "summary", "train_gates", "main"]
