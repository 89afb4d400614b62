"""Running the decoder over chosen tokens at their original positions.

attnkit drives the Hugging Face modules itself (embeddings, rotary embedding, decoder layers, final
norm, LM head); each layer's attention reaches the active method through attnkit's attention function
(:mod:`attnkit.attention`), which receives the :class:`attnkit.session.Step` passed here. The runner
and the methods that choose which tokens a layer sees (Select-Attention, GemFilter) share these
functions, so no method needs the runner.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from attnkit import validate
from attnkit.errors import AttnkitError
from attnkit.model import LoadedModel
from attnkit.session import Session, Step


def forward(model: LoadedModel, ids: torch.Tensor, start: int, step_factory: Callable[[torch.Tensor], Step],
            all_positions: bool = False) -> torch.Tensor:
    """Run the decoder on `ids` at positions start..; final-norm hidden states of every position (or only
    the last). `ids` ``[n]`` gives ``[n or 1, hidden]``; ``[rows, n]`` (sequences of one session, at the
    same positions) gives ``[rows, n or 1, hidden]``."""
    positions = torch.arange(start, start + ids.shape[-1], device=ids.device)
    step = step_factory(positions)
    if ids.dim() == 1:
        return forward_rows(model, ids[None], positions, step, all_positions)[0]
    return forward_rows(model, ids, positions, step, all_positions)


def forward_rows(model: LoadedModel, ids: torch.Tensor, positions: torch.Tensor, step,
                 all_positions: bool = False) -> torch.Tensor:
    """Run the decoder on a batch `ids` ``[rows, n]`` at `positions` (``[n]`` shared by the rows, or
    ``[rows, n]`` each its own), attention through `step` (a :class:`Step`, or a
    :class:`attnkit.session.RowsStep` over several sessions); final-norm hidden states
    ``[rows, n or 1, hidden]``."""
    base = model.hf.model
    hidden = base.embed_tokens(ids)
    session = getattr(step, "session", None)  # a RowsStep or speculative decoding's tee has none
    hook = None if session is None else session.method.run_layers
    if hook is None:
        hidden = run_decoder_layers(model, hidden, positions, step)
    else:  # model-level hook: the method runs the layers (it may change which tokens later layers see)
        hidden = hook(model, step, hidden, all_positions)
    return base.norm(hidden if all_positions else hidden[:, -1:])


def run_decoder_layers(model: LoadedModel, hidden: torch.Tensor, positions: torch.Tensor, step: Step,
                       layers: Sequence[int] | None = None) -> torch.Tensor:
    """Run decoder layers `layers` (default: all) on `hidden` ``[rows, n, hidden]`` at the original
    `positions` (``[n]``, or ``[rows, n]`` per row; RoPE is applied at those positions, whatever they
    are), attention through `step`.

    The building block of the ``run_layers`` hook: a method may run layers 0..L on the new tokens and the
    layers after L on another set of tokens (at their own positions, with another :class:`Step`)."""
    base = model.hf.model
    position_ids = positions[None] if positions.dim() == 1 else positions
    position_embeddings = base.rotary_emb(hidden, position_ids)
    for i in layers if layers is not None else range(len(base.layers)):
        hidden = base.layers[i](hidden, attention_mask=None, position_ids=position_ids, past_key_values=None,
                                use_cache=False, position_embeddings=position_embeddings, attnkit_step=step)
    return hidden


def run_layer_attention(model: LoadedModel, hidden: torch.Tensor, positions: torch.Tensor, step: Step,
                        index: int) -> None:
    """Run only the attention of decoder layer `index` on `hidden` (its input norm, then its attention module, through
    `step`), for a caller that needs what the attention does (a method's scores) and not the layer's output: the
    residual, the second norm and the MLP are skipped. Llama, Mistral and Qwen2/3 layers share these modules. A layer
    placed by accelerate runs whole: its hook moves the weights and inputs for the layer, not for its modules."""
    base = model.hf.model
    layer = base.layers[index]
    if getattr(layer, "_hf_hook", None) is not None:
        run_decoder_layers(model, hidden, positions, step, layers=[index])
        return
    position_ids = positions[None] if positions.dim() == 1 else positions
    layer.self_attn(hidden_states=layer.input_layernorm(hidden), attention_mask=None, position_ids=position_ids,
                    past_key_values=None, use_cache=False,
                    position_embeddings=base.rotary_emb(hidden, position_ids), attnkit_step=step)


def logits_of(model: LoadedModel, hidden: torch.Tensor) -> torch.Tensor:
    """LM-head logits (float32) of final hidden states ``[n, hidden]``."""
    return model.hf.lm_head(hidden).float()


def prefill(model: LoadedModel, session: Session, ids: torch.Tensor, chunk_size: int | Sequence[int] | None = None,
            all_positions: bool = False) -> torch.Tensor:
    """Feed the prompt `ids` ``[n]`` (or the prompts ``[rows, n]`` of a session's rows) in chunks of
    `chunk_size` tokens if given, or of the chunk lengths given (:func:`chunk_bounds`); final hidden states of the
    last position ``[1, hidden]``, or of every position ``[n, hidden]`` (with a leading ``rows`` axis for
    ``[rows, n]``)."""
    return prefill_steps(model, ids, lambda pos, last: Step(session, "prefill", pos, last), chunk_size, all_positions)


def chunk_bounds(n: int, chunk_size) -> list[tuple[int, int]]:
    """``(start, end)`` of the chunks an `n`-token prompt is fed in: one chunk (None), chunks of `chunk_size` tokens,
    or the given chunk lengths (a list summing to `n`: the chunks a serving engine's scheduler chose)."""
    if isinstance(chunk_size, (list, tuple)):
        if not chunk_size or sum(chunk_size) != n or any(not isinstance(c, int) or c < 1 for c in chunk_size):
            raise AttnkitError(f"chunk_size={list(chunk_size)}: chunk lengths must be positive integers summing to "
                               f"the prompt's {n} tokens")
        ends = list(itertools.accumulate(chunk_size))
        return list(zip([0] + ends[:-1], ends))
    validate.optional_whole("chunk_size", chunk_size, 1)
    chunk = chunk_size or n
    return [(start, min(n, start + chunk)) for start in range(0, n, chunk)]


def prefill_steps(model: LoadedModel, ids: torch.Tensor, make_step: Callable[[torch.Tensor, bool], Step],
                  chunk_size: int | None = None, all_positions: bool = False) -> torch.Tensor:
    """:func:`prefill` with the step of each chunk from ``make_step(positions, last_chunk)`` (a step-like
    object that feeds several sessions from one forward, for speculative decoding's shared prefill)."""
    n = ids.shape[-1]
    outputs = []
    for start, end in chunk_bounds(n, chunk_size):
        hidden = forward(model, ids[..., start:end], start, lambda pos, last=(end == n): make_step(pos, last),
                         all_positions)
        if all_positions or end == n:
            outputs.append(hidden)
    return torch.cat(outputs, dim=-2) if all_positions else outputs[-1]
