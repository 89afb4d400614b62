"""``attnkit calibrate kvzap``: train KVzap's per-layer surrogate of KVzip's scores (Jégou, Jeblick, 2026, "KVzap:
Fast, Adaptive, and Faithful KV Cache Pruning", arXiv 2601.07891; kvpress's ``kvzap/train.py`` and ``data.py``).

1. **Text.** ``samples`` windows of ``length`` tokens (each starting with the model's BOS token, as a prompt does)
   from the model's own text: the training split of attnkit's corpus (:mod:`attnkit.eval.data.corpus`, the
   standard library's source, on which the bundled ``tiny`` was trained), drawn by seed; ``heldout`` more windows
   from the held-out split measure the fit. The paper samples 500 tokens of each 750-1250-token text of a
   pretraining corpus; every token of a window is used here.
2. **Targets.** Each batch of windows is prefilled with ``kvzip`` (:mod:`attnkit.methods.kvzip`, its defaults), which
   scores every entry of every layer by its reconstruction of the prompt; the surrogate's inputs are each layer's
   attention inputs (the hidden states after the input norm) and its targets the log of those scores, floored at
   :data:`SCORE_FLOOR` (a model's own sliding window can leave an entry 0), one per kv head.
3. **Fit.** ``kind=linear``: ridge regression per layer in closed form (kvpress trains scikit-learn's ``Ridge``,
   whose default penalty ``alpha=1`` is this one's): ``W = (Xc^T Xc + alpha I)^-1 Xc^T Yc`` on centred inputs and
   targets, ``b`` restoring the means. ``kind=mlp``: per layer ``Linear(D, M) -> GELU -> Linear(M, H)`` trained on
   the mean squared error with AdamW, a cosine learning-rate schedule over the epochs, gradients clipped at norm 1
   and mini-batches of ``batch_size`` (kvpress's settings: 512 hidden units, learning rate 5e-3, 15 epochs, 512).
4. **Fit on held-out text**, per layer: the Pearson correlation of predicted and true log scores, and the share of
   kvzip's kept entries at a budget of 0.3 (the top 30 % per kv head) that the prediction keeps too. Both go into
   the file and the summary.

The file (:mod:`attnkit.methods.kvzap_predictor`) records the model, its geometry and a fingerprint of each layer's
key projection, so ``kvzap:config=FILE`` refuses another model. Everything is seeded; the linear fit is exact, so
the same arguments write the same weights (its time on `tiny`: docs/benchmarks.md).
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.samples import check_length
from attnkit.errors import AttnkitError
from attnkit.eval.data import corpus
from attnkit.forward import prefill
from attnkit.methods.kvzap_predictor import KINDS, fingerprint, predict, save_predictor
from attnkit.methods.kvzip import KVzip, KVzipRun, ReconstructionStep
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.session import new_session
from attnkit.validate import choice, number, whole
from attnkit.version import __version__

SCORE_FLOOR = 1e-10  # kvzip scores below this are taken as this before the log
KEEP_SHARE = 0.3  # the budget at which the held-out overlap of kept entries is measured
BATCH_ROWS = 8  # windows prefilled together


@dataclass
class _Recording(KVzipRun):
    """Per layer: the prompt's attention inputs and its kvzip scores."""

    inputs: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Recorder(KVzip):
    """``kvzip`` that records each layer's attention inputs on the prompt and its scores when it compresses."""

    needs_layer_inputs = True

    def new_session_state(self) -> _Recording:
        return _Recording()

    def prefill_attention(self, ctx, q, k, v):
        if not isinstance(ctx.step, ReconstructionStep):
            ctx.session_state.inputs[ctx.index] = ctx.layer_input().float()
        return super().prefill_attention(ctx, q, k, v)

    def rank(self, ctx):
        score = super().rank(ctx)
        ctx.session_state.scores[ctx.index] = score.clone()
        return score


def text_windows(model: LoadedModel, split: str, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` seeded windows of `length` token ids (BOS first) of the corpus split `split` (train or heldout)."""
    files = corpus.stdlib_files(split)
    rng = random.Random(f"kvzap|{split}|{seed}")
    bos = model.tokenizer.bos_token_id
    body = length - (bos is not None)
    out, draws = [], 0
    while len(out) < count:
        draws += 1
        if draws > 100 * count:
            raise AttnkitError(f"too few {split} corpus files hold {length} tokens; use a smaller --length")
        ids = model.tokenizer(corpus.read_text(rng.choice(files)), add_special_tokens=False).input_ids
        if len(ids) < body:
            continue
        start = rng.randrange(len(ids) - body + 1)
        out.append(([bos] if bos is not None else []) + ids[start:start + body])
    return out


@torch.inference_mode()
def collect(model: LoadedModel, windows: list[list[int]], progress: Callable[[str], None]) -> tuple[list, list]:
    """Per layer, the attention inputs ``[tokens, D]`` and log kvzip scores ``[tokens, kv_heads]`` of `windows`."""
    recorder = _Recorder(budget_tokens=KVzip.n_sink + 1)  # every layer of every window scores and compresses
    n_layers = model.geometry.n_layers
    xs, ys = [[] for _ in range(n_layers)], [[] for _ in range(n_layers)]
    for start in range(0, len(windows), BATCH_ROWS):
        ids = torch.tensor(windows[start:start + BATCH_ROWS], device=model.device)
        progress(f"kvzip scores: windows {start + 1}-{start + ids.shape[0]} of {len(windows)}")
        session = new_session(model, recorder, ids.shape[1], 0, rows=ids.shape[0])
        prefill(model, session, ids)
        run = session.state
        for i in range(n_layers):
            xs[i].append(run.inputs[i].reshape(-1, run.inputs[i].shape[-1]).cpu())
            score = run.scores[i].clamp_min(SCORE_FLOOR).log().transpose(1, 2)  # [rows, n, kv]
            ys[i].append(score.reshape(-1, score.shape[-1]).cpu())
    return [torch.cat(x) for x in xs], [torch.cat(y) for y in ys]


def fit_linear(x: torch.Tensor, y: torch.Tensor, alpha: float) -> list[torch.Tensor]:
    """Ridge regression ``y ~ W x + b`` (penalty `alpha` on ``W``), in float64: ``[W, b]``."""
    x, y = x.double(), y.double()
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    gram = xc.T @ xc + alpha * torch.eye(x.shape[1], dtype=x.dtype)
    w = torch.linalg.solve(gram, xc.T @ yc).T  # [H, D]
    return [w.float(), (my - w @ mx).float()]


def fit_mlp(xs: list[torch.Tensor], ys: list[torch.Tensor], hidden_dim: int, epochs: int, lr: float, batch_size: int,
            seed: int, progress: Callable[[str], None]) -> list[list[torch.Tensor]]:
    """Every layer's ``Linear -> GELU -> Linear`` trained together (their weights stacked; each layer's loss its own):
    per layer ``[W1, b1, W2, b2]``."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.stack(xs), torch.stack(ys)  # [L, N, D], [L, N, H]
    n_layers, n, d = x.shape

    def uniform(*shape, fan_in):  # nn.Linear's initialisation
        bound = 1 / math.sqrt(fan_in)
        return torch.nn.Parameter((torch.rand(*shape, generator=gen) * 2 - 1) * bound)

    params = [uniform(n_layers, hidden_dim, d, fan_in=d), uniform(n_layers, 1, hidden_dim, fan_in=d),
              uniform(n_layers, y.shape[-1], hidden_dim, fan_in=hidden_dim),
              uniform(n_layers, 1, y.shape[-1], fan_in=hidden_dim)]
    opt = torch.optim.AdamW(params, lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    for epoch in range(epochs):
        order, total = torch.randperm(n, generator=gen), 0.0
        for s in range(0, n, batch_size):
            idx = order[s:s + batch_size]
            inner = torch.nn.functional.gelu(torch.baddbmm(params[1], x[:, idx], params[0].transpose(1, 2)))
            out = torch.baddbmm(params[3], inner, params[2].transpose(1, 2))
            loss = (out - y[:, idx]).pow(2).mean(dim=(1, 2)).sum()  # each layer's mean squared error
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            total += float(loss.detach()) * len(idx)
        sched.step()
        progress(f"mlp epoch {epoch + 1}/{epochs}: mean squared error {total / n / n_layers:.4f}")
    return [[params[0][i].detach(), params[1][i, 0].detach(), params[2][i].detach(), params[3][i, 0].detach()]
            for i in range(n_layers)]


def held_out_fit(kind: str, weights: list, x: torch.Tensor, y: torch.Tensor, windows: int) -> dict:
    """Pearson correlation of predicted and true log scores, and the share of kvzip's top :data:`KEEP_SHARE` entries
    per kv head and window that the prediction's top share holds too."""
    pred = predict(kind, weights, x[None])[0].T  # [N, H]
    pc, yc = pred - pred.mean(), y - y.mean()
    pearson = float((pc * yc).sum() / (pc.norm() * yc.norm()).clamp_min(1e-30))

    def per(t):  # [windows, H, n]
        return t.reshape(windows, -1, t.shape[-1]).transpose(1, 2)

    k = max(1, round(KEEP_SHARE * per(y).shape[-1]))
    true_top = torch.zeros_like(per(y), dtype=torch.bool).scatter_(-1, per(y).topk(k).indices, True)
    pred_top = torch.zeros_like(true_top).scatter_(-1, per(pred).topk(k).indices, True)
    return {"pearson": round(pearson, 4), "kept_overlap": round(float((true_top & pred_top).sum() / true_top.sum()), 4)}


def calibrate_kvzap(model: LoadedModel, *, kind: str = "linear", samples: int = 64, length: int = 1024,
                    heldout: int = 4, seed: int = 0, alpha: float = 1.0, hidden_dim: int = 512, epochs: int = 15,
                    lr: float = 5e-3, batch_size: int = 512,
                    progress: Callable[[str], None] | None = None) -> tuple[list, dict]:
    """Train the surrogate of `model` (see the module docstring): per layer its tensors, and the file's metadata."""
    say = progress or (lambda _msg: None)
    choice("kind", kind, KINDS)
    whole("samples", samples, 1)
    whole("heldout", heldout, 1)
    check_length(model, length)
    number("alpha", alpha, 0, None, what=" (the ridge penalty)")
    for key, value in (("hidden_dim", hidden_dim), ("epochs", epochs), ("batch_size", batch_size)):
        whole(key, value, 1)
    number("lr", lr, 0, None, low_open=True)
    xs, ys = collect(model, text_windows(model, "train", samples, length, seed), say)
    test_x, test_y = collect(model, text_windows(model, "heldout", heldout, length, seed), say)
    if kind == "linear":
        layers = [fit_linear(x, y, alpha) for x, y in zip(xs, ys)]
    else:
        layers = fit_mlp(xs, ys, hidden_dim, epochs, lr, batch_size, seed, say)
    fits = [held_out_fit(kind, w, x, y, heldout) for w, x, y in zip(layers, test_x, test_y)]
    geo = model.geometry
    attn = [layer.self_attn for layer in model.hf.model.layers]
    meta = {
        "model": model.spec, "architecture": geo.architecture, "n_layers": geo.n_layers,
        "hidden_size": int(xs[0].shape[1]), "n_kv_heads": geo.n_kv_heads, "fingerprints": [fingerprint(m) for m in attn],
        "target": f"log(max(kvzip score, {SCORE_FLOOR})): the most attention an entry receives while the model "
                  f"repeats the prompt (attnkit's kvzip, chunk_size={KVzip.chunk_size}, n_sink={KVzip.n_sink})",
        "input": "each layer's attention input: the hidden states after the layer's input norm",
        "training": {"split": "train", "samples": samples, "length": length, "seed": seed,
                     "tokens": int(xs[0].shape[0]), **({"alpha": alpha} if kind == "linear" else
                                                        {"hidden_dim": hidden_dim, "epochs": epochs, "lr": lr,
                                                         "batch_size": batch_size})},
        "heldout": {"split": "heldout", "samples": heldout, "tokens": int(test_x[0].shape[0]),
                    "keep_share": KEEP_SHARE, "layers": fits},
        "attnkit_version": __version__,
    }
    return layers, meta


def summary(kind: str, meta: dict) -> str:
    """A few lines for the terminal: the held-out fit per layer."""
    fits = meta["heldout"]["layers"]
    rows = [f"{meta['model']}: kvzap {kind} surrogate, {meta['n_layers']} layers x {meta['n_kv_heads']} kv heads, "
            f"{meta['training']['tokens']} training tokens; held out ({meta['heldout']['tokens']} tokens):"]
    rows += [f"  layer {i:>2}: pearson {f['pearson']:.3f}, kvzip's top {KEEP_SHARE:.0%} kept {f['kept_overlap']:.3f}"
             for i, f in enumerate(fits)]
    rows.append(f"  mean: pearson {sum(f['pearson'] for f in fits) / len(fits):.3f}, kept "
                f"{sum(f['kept_overlap'] for f in fits) / len(fits):.3f}")
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate kvzap`` (arguments parsed by :mod:`attnkit.cli`)."""
    model = load_model_for_length(args.model, max(args.length, 4096))
    layers, meta = calibrate_kvzap(model, kind=args.kind, samples=args.samples, length=args.length,
                                   heldout=args.heldout, seed=args.seed, alpha=args.alpha, hidden_dim=args.hidden_dim,
                                   epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                                   progress=progress_to_stderr)
    path = save_predictor(args.out, args.kind, layers, meta)
    print(summary(args.kind, meta))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["calibrate_kvzap", "collect", "fit_linear", "fit_mlp", "held_out_fit", "summary", "text_windows", "main"]
