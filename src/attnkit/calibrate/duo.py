"""``attnkit calibrate duo``: DuoAttention's retrieval heads, found by optimising a gate per kv head (Xiao, Tang,
Zuo, Guo, Yang, Tang, Fu, Han, 2024, "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and
Streaming Heads", arXiv 2410.10819, section 2.2, "Optimization-Based Identification of Retrieval Heads").

Every kv head ``j`` of layer ``i`` gets a gate ``alpha_ij`` in [0, 1], starting at 1, that mixes the outputs of
its query heads' full and streaming attention (eq. 1)::

    attn_ij = alpha_ij full_attn + (1 - alpha_ij) streaming_attn

streaming attention being what a streaming head of ``duo_attention`` sees (the sinks and the recent window,
:func:`attnkit.methods.duo_attention.streaming_attention`). The model's weights stay frozen; only the gates are
optimised, to keep the final hidden states ``H`` (the LM head's input) of the supervised tokens close to those of
full attention while as few gates as possible stay open (eqs. 2-4)::

    L = L_distill + lambda L_reg,   L_distill = mean over supervised tokens t of mean_d (H_full[t] - H_mixed[t])^2,
                                    L_reg = mean over kv heads of |alpha_ij|

(the authors' code's normalisations; ``lambda = 0.05``, Adam with learning rate 0.02 and no weight decay, the
gates clipped to [0, 1] after every step, as there). The paper's synthetic data are passkeys hidden in long
text, supervised on the answers; here they are attnkit's own retrieval tasks (:mod:`attnkit.eval.data.task_registry`,
held-out seeds, :mod:`attnkit.calibrate.samples`), each prompt followed by its answer (the task's ``target``),
the supervised tokens being the last prompt token and the answer's. One prompt per step, in turn. The learning
rate is constant (the authors warm it up and down over 2000 steps; a small calibration runs far fewer).

Then the heads with the highest gates are retrieval heads (section 2.3, "Deploying LLMs with DuoAttention"):
``alpha >= threshold`` (default 0.5, the authors' default), or the ``retrieval_ratio`` of all kv heads of the
model (:func:`attnkit.methods.duo_attention.select_heads`). The file keeps the gates too, so ``duo_attention``
can deploy another ratio or threshold from the same calibration. The objective over all calibration prompts
before (every gate 1: exactly ``lambda``) and after the optimisation is recorded with every step's loss.

Everything is seeded (prompts) or deterministic (the optimisation), and the file holds no timestamp: the same
arguments on the same machine and thread count write the same file, byte for byte.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

import torch

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.samples import calibration_samples
from attnkit.config_file import dumps_layered_config, write_config_file
from attnkit.errors import AttnkitError
from attnkit.forward import prefill
from attnkit.methods.base import Method
from attnkit.methods.duo_attention import (
    CONFIG_FORMAT,
    DEFAULT_RECENT,
    DEFAULT_SINKS,
    duo_config_from_dict,
    select_heads,
    streaming_attention,
)
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.session import new_session
from attnkit.validate import fraction, number, one_of_two, whole
from attnkit.version import __version__

DEFAULT_TASKS = ("passkey", "kv_retrieval")
DEFAULT_LENGTH = 1024
DEFAULT_STEPS = 60
LEARNING_RATE = 0.02
REG_WEIGHT = 0.05
DEFAULT_THRESHOLD = 0.5


class _GateProbe(Method):
    """Prefill whose attention output per kv head mixes full and streaming attention by the gates (eq. 1);
    ``alpha=None``: full attention (the teacher)."""

    name = "duo-gate-probe"

    def __init__(self, alpha: torch.Tensor | None, sinks: int, recent: int):
        self.alpha, self.sinks, self.recent = alpha, sinks, recent

    def prefill_output(self, ctx, q, keys, values, positions):
        full = super().prefill_output(ctx, q, keys, values, positions)
        if self.alpha is None:
            return full
        stream = streaming_attention(q, keys, values, ctx.scaling, ctx.q_pos, positions[0, 0], self.sinks,
                                     self.recent, ctx.native_window)
        gate = self.alpha[ctx.index].repeat_interleave(q.shape[1] // keys.shape[1]).view(1, -1, 1, 1)
        return gate * full + (1 - gate) * stream


def _hidden(model: LoadedModel, ids: torch.Tensor, probe: _GateProbe) -> torch.Tensor:
    """Final hidden states ``[n, hidden]`` of every position of `ids` with `probe`'s attention."""
    return prefill(model, new_session(model, probe, ids.shape[0], 0), ids, all_positions=True)


def _objective(model, prompts, alpha, sinks, recent, reg_weight) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L_distill, L)`` of the gates `alpha` on one prompt ``(ids, supervised slice, teacher)``."""
    ids, sup, teacher = prompts
    student = _hidden(model, ids, _GateProbe(alpha, sinks, recent))[sup].float()
    distill = (student - teacher).pow(2).mean(-1).mean()
    return distill, distill + reg_weight * alpha.abs().mean()


def _check_args(steps, lr, reg_weight, sinks, recent, threshold, retrieval_ratio) -> None:
    whole("steps", steps, 1)
    number("lr", lr, 0, low_open=True, what=" (the gates' learning rate)")
    number("reg_weight", reg_weight, 0, what=" (lambda of the L1 penalty on the gates)")
    whole("sinks", sinks, 0)
    whole("recent", recent, 0)
    one_of_two("threshold", threshold, "retrieval_ratio", retrieval_ratio)
    if threshold is not None:
        fraction("threshold", threshold, allow_zero=True)
    if retrieval_ratio is not None:
        fraction("retrieval_ratio", retrieval_ratio, allow_zero=True)


def calibrate_duo(model: LoadedModel, *, length: int = DEFAULT_LENGTH, tasks: Sequence[str] = DEFAULT_TASKS,
                  samples: int = 1, seed: int = 0, split: str = "calibration", steps: int = DEFAULT_STEPS,
                  lr: float = LEARNING_RATE, reg_weight: float = REG_WEIGHT, sinks: int = DEFAULT_SINKS,
                  recent: int = DEFAULT_RECENT, threshold: float | None = None, retrieval_ratio: float | None = None,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Optimise the gates on seeded calibration prompts and return the config (JSON-ready; :func:`dumps_config`)."""
    _check_args(steps, lr, reg_weight, sinks, recent, threshold, retrieval_ratio)
    if threshold is None and retrieval_ratio is None:
        threshold = DEFAULT_THRESHOLD
    say = progress or (lambda _msg: None)
    geo = model.geometry
    samples_ = calibration_samples(model, length, list(tasks), samples, seed, split)
    prompts = []
    with torch.no_grad():
        for info, sample, ids in samples_:
            answer = torch.tensor(model.tokenizer(sample.target, add_special_tokens=False).input_ids, dtype=ids.dtype)
            full_ids = torch.cat([ids, answer])
            sup = slice(ids.shape[0] - 1, full_ids.shape[0])
            prompts.append((full_ids, sup, _hidden(model, full_ids, _GateProbe(None, sinks, recent))[sup].float()))
            info["supervised_tokens"] = sup.stop - sup.start
    alpha = torch.ones(geo.n_layers, geo.n_kv_heads, requires_grad=True)
    optimiser = torch.optim.Adam([alpha], lr=lr)

    def objective_over_prompts() -> float:
        with torch.no_grad():
            return sum(float(_objective(model, p, alpha, sinks, recent, reg_weight)[1]) for p in prompts) / len(prompts)

    initial = objective_over_prompts()
    history = []
    with torch.enable_grad():
        for step in range(steps):
            distill, loss = _objective(model, prompts[step % len(prompts)], alpha, sinks, recent, reg_weight)
            (alpha.grad,) = torch.autograd.grad(loss, [alpha])  # the gates only: the weights get no gradient
            optimiser.step()
            with torch.no_grad():
                alpha.clamp_(0, 1)
            history.append(round(float(loss.detach()), 6))
            if step % 10 == 0 or step == steps - 1:
                say(f"step {step + 1}/{steps}: loss {history[-1]:.5f} (distill {float(distill.detach()):.5f}), "
                    f"mean gate {float(alpha.detach().mean()):.3f}")
    final = objective_over_prompts()
    gates = [[round(float(a), 6) for a in layer] for layer in alpha.detach()]
    chosen = select_heads(gates, retrieval_ratio, threshold)
    layers = [{"alpha": gates[i], "retrieval_heads": [h for h, r in enumerate(chosen[i]) if r]}
              for i in range(geo.n_layers)]
    n_retrieval = sum(len(x["retrieval_heads"]) for x in layers)
    config = {
        "format": CONFIG_FORMAT,
        "model": model.spec, "architecture": geo.architecture,
        "n_layers": geo.n_layers, "n_heads": geo.n_q_heads, "n_kv_heads": geo.n_kv_heads, "head_dim": geo.head_dim,
        "sinks": sinks, "recent": recent,
        "selection": {"threshold": threshold} if threshold is not None else {"retrieval_ratio": retrieval_ratio},
        "retrieval_fraction": round(n_retrieval / (geo.n_layers * geo.n_kv_heads), 6),
        "gate": "per kv head: alpha full_attn + (1 - alpha) streaming_attn (DuoAttention eq. 1)",
        "objective": {"loss": "mean_t mean_d (H_full - H_mixed)^2 + reg_weight mean |alpha| (eqs. 2-4)",
                      "steps": steps, "lr": lr, "reg_weight": reg_weight, "optimizer": "Adam, gates clipped to [0, 1]",
                      "initial": round(initial, 6), "final": round(final, 6), "history": history},
        "length": length, "tasks": list(tasks), "samples": samples, "seed": seed, "split": split,
        "prompts": [info for info, _, _ in samples_],
        "attnkit_version": __version__,
        "layers": layers,
    }
    duo_config_from_dict(json.loads(json.dumps(config)), "the calibrated config")  # it must load back
    return config


def dumps_config(config: dict) -> str:
    """JSON text: metadata one key per line, then one line per layer."""
    return dumps_layered_config(config, lambda layer: "    " + json.dumps(layer))


def summary(config: dict) -> str:
    rows = [f"{config['model']}: {config['n_layers']} layers x {config['n_kv_heads']} kv heads, sinks {config['sinks']}"
            f" + recent {config['recent']}, selection {config['selection']}"]
    for i, layer in enumerate(config["layers"]):
        gates = " ".join(f"{a:.3f}" for a in layer["alpha"])
        rows.append(f"  layer {i:>2}: gates {gates}; retrieval heads {layer['retrieval_heads'] or '-'}")
    obj = config["objective"]
    rows.append(f"  retrieval heads {100 * config['retrieval_fraction']:.1f} % of the kv heads; objective "
                f"{obj['initial']:.5f} -> {obj['final']:.5f} in {obj['steps']} steps")
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate duo`` (arguments parsed by :mod:`attnkit.cli`)."""
    model = load_model_for_length(args.model, max(args.length + 64, 4096))
    try:
        config = calibrate_duo(model, length=args.length, tasks=args.tasks, samples=args.samples, seed=args.seed,
                               split=args.split, steps=args.steps, lr=args.lr, reg_weight=args.reg_weight,
                               sinks=args.sinks, recent=args.recent, threshold=args.threshold,
                               retrieval_ratio=args.retrieval_ratio, progress=progress_to_stderr)
    except ValueError as exc:  # a task that cannot make a prompt of this length
        raise AttnkitError(str(exc).splitlines()[0]) from None
    path = write_config_file(args.out, dumps_config(config))
    print(summary(config))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["DEFAULT_TASKS", "calibrate_duo", "dumps_config", "summary", "main"]
