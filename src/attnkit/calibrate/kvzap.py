"""``attnkit calibrate kvzap``: train KVzap's per-layer surrogate of KVzip's scores (Jégou, Jeblick, 2026, "KVzap:
Fast, Adaptive, and Faithful KV Cache Pruning", arXiv 2601.07891; kvpress's ``kvzap/train.py`` and ``data.py``).

1. **Text.** ``samples`` windows of ``length`` tokens, each starting with the model's BOS token as a prompt does.
   By default (:func:`mixture_windows`) they come in equal shares from the nine kinds of :data:`MIXTURE`, the kinds
   of text in the bundled ``tiny``'s training mixture that attnkit generates (``training/data_v2.py`` draws them
   from :mod:`attnkit.eval.data.retrieval_data`): plain Python source (the training split of attnkit's corpus,
   :mod:`attnkit.eval.data.corpus`), reference-documentation prose, and seven in-context retrieval layouts (needles
   with one, several keys or several values; key-value listings with one or several queries; variable chains;
   induction copies) whose filler is source, prose or generated sentences; a kind that does not fit ``length`` in
   :data:`DRAWS` seeded draws gives a source window instead (the file counts the windows of each kind). At the
   defaults (72 windows of 1024 tokens) that is 73,656 training tokens, eight windows of each kind; ``heldout`` (9)
   more windows, one per kind from the held-out phrasings and filler, measure the fit. kvpress draws up to 500
   texts of 750-1250 tokens from each of the nine subsets of Nemotron-Pretraining-Dataset-sample (web text, maths,
   code, synthetic and SFT data) and samples 500 tokens of each, about 2.25 million; ``--samples`` scales this one.
   ``data=DIR`` (``--data``) trains on the user's own text instead (:func:`folder_texts`): every ``*.txt`` file
   below it and every ``"text"`` field of its ``*.jsonl`` files is one text; ``heldout`` texts (drawn by seed) give
   one window each to the fit and the others the training windows (a text, then a start, drawn by seed); texts
   shorter than a window are skipped.
2. **Targets.** Each batch of windows is prefilled with ``kvzip`` (:mod:`attnkit.methods.kvzip`, its defaults), which
   scores every entry of every layer by its reconstruction of the prompt; the surrogate's inputs are each layer's
   attention inputs (the hidden states after the input norm) and its targets the log of those scores, floored at
   :data:`SCORE_FLOOR` (a model's own sliding window can leave an entry 0), one per kv head. As in kvpress, only the
   text's own tokens are training rows (:func:`text_mask`): kvpress keeps the positions of the text inside its
   chat-templated repeat prompt, leaving out the template's tokens around it; here the BOS token and every special
   token of the tokenizer (``all_special_ids``) are left out, inputs and targets alike, in training and held out.
3. **Fit.** ``kind=linear``: ridge regression per layer in closed form (kvpress trains scikit-learn's ``Ridge``,
   whose default penalty ``alpha=1`` is this one's): ``W = (Xc^T Xc + alpha I)^-1 Xc^T Yc`` on centred inputs and
   targets, ``b`` restoring the means. ``kind=mlp``: per layer ``Linear(D, M) -> GELU -> Linear(M, H)`` trained on
   the mean squared error with AdamW, a cosine learning-rate schedule over the epochs, gradients clipped at norm 1
   and mini-batches of ``batch_size`` (kvpress's settings: 512 hidden units, learning rate 5e-3, 15 epochs, 512).
4. **Fit on held-out text**, per layer: the Pearson correlation of predicted and true log scores, and the share of
   kvzip's kept entries at a budget of 0.3 (the top 30 % of each window's text tokens per kv head) that the
   prediction keeps too. Both go into the file and the summary.

The file (:mod:`attnkit.methods.kvzap_predictor`) records the model, its geometry and a fingerprint of each layer's
key projection, so ``kvzap:config=FILE`` refuses another model. Everything is seeded; the linear fit is exact, so
the same arguments write the same weights (its time on `tiny`: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.samples import check_length
from attnkit.errors import AttnkitError
from attnkit.eval.data import corpus, retrieval_data
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
# the default training text, in equal shares: kinds of the bundled tiny's training mixture (training/data_v2.py)
MIXTURE = ("code", "docs", "needle", "needle_multikey", "needle_multivalue", "kv_listing", "kv_multiquery",
           "variable_chain", "induction")
DRAWS = 20  # seeded draws of a kind before its window is a source window instead (a layout too long for the window)


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


def _prefixed(model: LoadedModel, length: int) -> tuple[list[int], int]:
    """The ids a window starts with (BOS, where the tokenizer has one) and how many text tokens follow."""
    bos = model.tokenizer.bos_token_id
    return ([bos] if bos is not None else []), length - (bos is not None)


def mixture_windows(model: LoadedModel, split: str, count: int, length: int, seed: int) -> tuple[list, list]:
    """`count` seeded windows of `length` token ids (BOS first) of :data:`MIXTURE`, the kinds in turn, from their
    `split` (train or heldout: held-out phrasings and filler), and the kind of each."""
    prefix, body = _prefixed(model, length)
    rng = random.Random(f"kvzap|{split}|{seed}")
    where = "train" if split == "train" else "eval"
    out, kinds = [], []
    for i in range(count):
        kind, ids = MIXTURE[i % len(MIXTURE)], None
        if kind not in ("code", "docs"):  # a task's example: up to DRAWS layouts tried
            for _ in range(DRAWS):
                try:
                    ids = list(retrieval_data.example(kind, model.tokenizer, body, rng, where).ids)
                    break
                except ValueError:  # this draw's layout does not fit the window
                    continue
        if ids is None:  # plain text (a task none of whose draws fit the window: code, and reported as code)
            kind = kind if kind == "docs" else "code"
            ids = retrieval_data.filler(model.tokenizer, kind, where, body, rng)
        out.append(prefix + ids)
        kinds.append(kind)
    return out, kinds


def text_windows(model: LoadedModel, split: str, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` seeded windows of `length` token ids (BOS first) of the corpus split `split` (train or heldout): the
    source windows other calibrations draw (kvzap's own text is :func:`mixture_windows`)."""
    files = corpus.stdlib_files(split)
    rng = random.Random(f"kvzap|{split}|{seed}")
    prefix, body = _prefixed(model, length)
    out, draws = [], 0
    while len(out) < count:
        draws += 1
        if draws > 100 * count:
            raise AttnkitError(f"too few {split} corpus files hold {length} tokens; use a smaller --length")
        ids = model.tokenizer(corpus.read_text(rng.choice(files)), add_special_tokens=False).input_ids
        if len(ids) < body:
            continue
        start = rng.randrange(len(ids) - body + 1)
        out.append(prefix + ids[start:start + body])
    return out


def folder_texts(data) -> list[str]:
    """The texts of a folder of the user's: each ``*.txt`` file below it, and each ``"text"`` field of the lines of
    its ``*.jsonl`` files (sorted by path); refused in one line when there is none."""
    folder = Path(data) if isinstance(data, (str, Path)) and str(data) else None
    if folder is None or not folder.is_dir():
        raise AttnkitError(f"kvzap training data {str(data)!r} is not a folder (give a folder of *.txt or *.jsonl "
                           f"files with a \"text\" field)")
    texts = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl")):
        try:
            raw = path.read_text(encoding="utf-8", errors="replace")
            lines = [json.loads(line) for line in raw.splitlines() if line.strip()] if path.suffix == ".jsonl" \
                else [{"text": raw}]
        except (OSError, json.JSONDecodeError) as exc:
            raise AttnkitError(f"kvzap training data: cannot read {path} ({type(exc).__name__}: {exc})") from None
        texts += [item["text"] for item in lines if isinstance(item, dict) and isinstance(item.get("text"), str)
                  and item["text"].strip()]
    if not texts:
        raise AttnkitError(f"kvzap training data {str(data)!r} holds no text (no *.txt file, no \"text\" field in a "
                           f"*.jsonl file)")
    return texts


def data_windows(model: LoadedModel, data, count: int, heldout: int, length: int, seed: int) -> tuple[list, list]:
    """Training and held-out windows (BOS first) of the texts of folder `data` (see the module docstring)."""
    prefix, body = _prefixed(model, length)
    ids = [model.tokenizer(t, add_special_tokens=False).input_ids for t in folder_texts(data)]
    ids = [t for t in ids if len(t) >= body]
    if len(ids) <= heldout:
        raise AttnkitError(f"kvzap training data {str(data)!r}: {len(ids)} of its texts hold {body} tokens, but "
                           f"--heldout {heldout} are held out and one more is needed to train on; add text, or lower "
                           f"--length or --heldout")
    rng = random.Random(f"kvzap|data|{seed}")
    rng.shuffle(ids)

    def window(text):
        start = rng.randrange(len(text) - body + 1)
        return prefix + text[start:start + body]

    return [window(rng.choice(ids[heldout:])) for _ in range(count)], [window(t) for t in ids[:heldout]]


def text_mask(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """Which positions of `ids` are the text's own tokens, the training rows: not BOS nor any special token."""
    special = [i for i in (*tokenizer.all_special_ids, tokenizer.bos_token_id) if i is not None]
    return ~torch.isin(ids, torch.tensor(special, dtype=ids.dtype, device=ids.device))


@torch.inference_mode()
def collect_text(model: LoadedModel, windows: list[list[int]], progress: Callable[[str], None],
                 text_only: bool = True) -> tuple[list, list, list[int]]:
    """Per layer, the attention inputs ``[tokens, D]`` and log kvzip scores ``[tokens, kv_heads]`` of the text tokens
    of `windows` (:func:`text_mask`; every token where not `text_only`), and how many tokens each window gave."""
    recorder = _Recorder(budget_tokens=KVzip.n_sink + 1)  # every layer of every window scores and compresses
    n_layers = model.geometry.n_layers
    xs, ys, counts = [[] for _ in range(n_layers)], [[] for _ in range(n_layers)], []
    for start in range(0, len(windows), BATCH_ROWS):
        ids = torch.tensor(windows[start:start + BATCH_ROWS], device=model.device)
        progress(f"kvzip scores: windows {start + 1}-{start + ids.shape[0]} of {len(windows)}")
        session = new_session(model, recorder, ids.shape[1], 0, rows=ids.shape[0])
        prefill(model, session, ids)
        run = session.state
        keep = text_mask(model.tokenizer, ids) if text_only else torch.ones_like(ids, dtype=torch.bool)
        counts += keep.sum(1).tolist()
        for i in range(n_layers):
            xs[i].append(run.inputs[i][keep].cpu())
            ys[i].append(run.scores[i].clamp_min(SCORE_FLOOR).log().transpose(1, 2)[keep].cpu())  # [tokens, kv]
    return [torch.cat(x) for x in xs], [torch.cat(y) for y in ys], counts


def collect(model: LoadedModel, windows: list[list[int]], progress: Callable[[str], None]) -> tuple[list, list]:
    """:func:`collect_text` of every token of `windows`, BOS included (as fastkvzip's calibration reads them)."""
    return collect_text(model, windows, progress, text_only=False)[:2]


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


def held_out_fit(kind: str, weights: list, x: torch.Tensor, y: torch.Tensor, counts) -> dict:
    """Pearson correlation of predicted and true log scores, and the share of kvzip's top :data:`KEEP_SHARE` entries
    per kv head and window that the prediction's top share holds too (`counts`: the text tokens of each window, or
    the number of windows of as many tokens each)."""
    pred = predict(kind, weights, x[None])[0].T  # [N, H]
    pc, yc = pred - pred.mean(), y - y.mean()
    pearson = float((pc * yc).sum() / (pc.norm() * yc.norm()).clamp_min(1e-30))
    if isinstance(counts, int):
        counts = [y.shape[0] // counts] * counts
    kept = total = 0
    for p, t in zip(pred.split(counts), y.split(counts)):  # one window: [n, H]
        if not t.shape[0]:  # a window of special tokens only
            continue
        k = max(1, round(KEEP_SHARE * t.shape[0]))
        true_top = torch.zeros_like(t, dtype=torch.bool).scatter_(0, t.topk(k, dim=0).indices, True)
        pred_top = torch.zeros_like(true_top).scatter_(0, p.topk(k, dim=0).indices, True)
        kept, total = kept + int((true_top & pred_top).sum()), total + int(true_top.sum())
    return {"pearson": round(pearson, 4), "kept_overlap": round(kept / max(total, 1), 4)}


def calibrate_kvzap(model: LoadedModel, *, kind: str = "linear", samples: int = 72, length: int = 1024,
                    heldout: int = 9, seed: int = 0, data=None, alpha: float = 1.0, hidden_dim: int = 512, epochs: int = 15,
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
    if data is None:
        (train, kinds), (test, _) = (mixture_windows(model, split, count, length, seed)
                                     for split, count in (("train", samples), ("heldout", heldout)))
        source = {"data": "attnkit's mixture", "kinds": {k: kinds.count(k) for k in dict.fromkeys(kinds)}}
    else:
        train, test = data_windows(model, data, samples, heldout, length, seed)
        source = {"data": str(data)}
    xs, ys, _ = collect_text(model, train, say)
    test_x, test_y, counts = collect_text(model, test, say)
    if kind == "linear":
        layers = [fit_linear(x, y, alpha) for x, y in zip(xs, ys)]
    else:
        layers = fit_mlp(xs, ys, hidden_dim, epochs, lr, batch_size, seed, say)
    fits = [held_out_fit(kind, w, x, y, counts) for w, x, y in zip(layers, test_x, test_y)]
    geo = model.geometry
    attn = [layer.self_attn for layer in model.hf.model.layers]
    meta = {
        "model": model.spec, "architecture": geo.architecture, "n_layers": geo.n_layers,
        "hidden_size": int(xs[0].shape[1]), "n_kv_heads": geo.n_kv_heads, "fingerprints": [fingerprint(m) for m in attn],
        "target": f"log(max(kvzip score, {SCORE_FLOOR})): the most attention an entry receives while the model "
                  f"repeats the prompt (attnkit's kvzip, chunk_size={KVzip.chunk_size}, n_sink={KVzip.n_sink})",
        "input": "each layer's attention input: the hidden states after the layer's input norm",
        "training": {**source, "samples": samples, "length": length, "seed": seed, "tokens": int(xs[0].shape[0]),
                     "excluded": "BOS and the tokenizer's special tokens", **({"alpha": alpha} if kind == "linear" else
                                                        {"hidden_dim": hidden_dim, "epochs": epochs, "lr": lr,
                                                         "batch_size": batch_size})},
        "heldout": {"samples": heldout, "tokens": int(test_x[0].shape[0]),
                    "keep_share": KEEP_SHARE, "layers": fits},
        "attnkit_version": __version__,
    }
    return layers, meta


def summary(kind: str, meta: dict) -> str:
    """A few lines for the terminal: the held-out fit per layer."""
    fits = meta["heldout"]["layers"]
    rows = [f"{meta['model']}: kvzap {kind} surrogate, {meta['n_layers']} layers x {meta['n_kv_heads']} kv heads, "
            f"{meta['training']['tokens']} training tokens ({meta['training'].get('data', '?')}); held out "
            f"({meta['heldout']['tokens']} tokens):"]
    rows += [f"  layer {i:>2}: pearson {f['pearson']:.3f}, kvzip's top {KEEP_SHARE:.0%} kept {f['kept_overlap']:.3f}"
             for i, f in enumerate(fits)]
    rows.append(f"  mean: pearson {sum(f['pearson'] for f in fits) / len(fits):.3f}, kept "
                f"{sum(f['kept_overlap'] for f in fits) / len(fits):.3f}")
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate kvzap`` (arguments parsed by :mod:`attnkit.cli`)."""
    model = load_model_for_length(args.model, max(args.length, 4096))
    layers, meta = calibrate_kvzap(model, kind=args.kind, samples=args.samples, length=args.length,
                                   heldout=args.heldout, seed=args.seed, data=args.data, alpha=args.alpha, hidden_dim=args.hidden_dim,
                                   epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                                   progress=progress_to_stderr)
    path = save_predictor(args.out, args.kind, layers, meta)
    print(summary(args.kind, meta))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["MIXTURE", "calibrate_kvzap", "collect", "collect_text", "data_windows", "fit_linear", "fit_mlp", "folder_texts",
           "held_out_fit", "mixture_windows", "summary", "text_mask", "text_windows", "main"]
