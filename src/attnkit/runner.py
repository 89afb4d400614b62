"""The generation loop: prefill (optionally chunked), decode, sampling, stop conditions, statistics.

The runner owns the KV cache and the loop; the decoder itself runs through :mod:`attnkit.forward`, so
every layer's attention reaches the active method through attnkit's attention function. Batch size is 1.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from attnkit.forward import forward, logits_of, prefill
from attnkit.generation import (
    GenerationConfig,
    TokenEmitter,
    check_length,
    encode_prompt,
    sync,
)
from attnkit.methods.base import Method, resolve_method
from attnkit.model import LoadedModel, check_loaded_model
from attnkit.sampling import choose_token
from attnkit.session import Step, new_session


@dataclass
class GenerationStats:
    method: str
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    ttft_s: float  # time to first token: prefill + choosing the first token
    decode_s: float
    decode_tokens_per_s: float  # tokens after the first, per second of decoding
    peak_kv_bytes: int
    final_kv_bytes: int
    peak_rss_bytes: int
    finish_reason: str  # "length", "eos" or "stop"
    # what the method measured during the run (e.g. Select-Attention's kept tokens), by name
    method_stats: dict = field(default_factory=dict, kw_only=True)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    logits: list[torch.Tensor] | None = None  # per generated token, when asked for with keep_logits


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@torch.inference_mode()
def generate(model: LoadedModel, prompt, method: str | Method | None = "full", *, params: dict | None = None,
             config: GenerationConfig | None = None, on_token: Callable[[int, str], None] | None = None,
             keep_logits: bool = False, **options) -> Generation:
    """Generate after `prompt` with attention method `method`.

    `prompt` is text or token ids (batch size 1). `method` is a registered name (with `params`) or a
    method instance. How much to generate and how is a :class:`GenerationConfig` (`config`), or its
    fields as keywords (`options`: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``,
    ``top_p``, ``seed``, ``stop``, ``stop_at_eos``, ``chunk_size``), which override `config`'s.
    Generation stops at EOS (unless ``stop_at_eos=False``), at any ``stop`` string (the returned text
    ends before it), or after ``max_new_tokens``. `on_token(token_id, text_delta)` streams.
    `keep_logits` returns the logits each token was chosen from (float32, ``[vocab]`` each).
    """
    model = check_loaded_model(model)
    config = GenerationConfig.build(config, **options)
    method = resolve_method(method, params)
    ids = encode_prompt(model, prompt)
    max_new_tokens = config.max_new_tokens
    check_length(model, ids.shape[0], max_new_tokens)
    device = model.device
    sampling = config.sampling
    generator = sampling.generator(device)
    session = new_session(model, method, ids.shape[0], max_new_tokens)

    sync(device)
    t0 = time.perf_counter()
    logits = logits_of(model, prefill(model, session, ids, config.chunk_size))[-1]
    sync(device)
    prefill_s = time.perf_counter() - t0
    token = choose_token(logits, sampling, generator)
    ttft_s = time.perf_counter() - t0

    emit = TokenEmitter(model.tokenizer, config.eos(model.tokenizer), config.stop, on_token)
    kept_logits = [logits] if keep_logits else None
    t_decode = time.perf_counter()
    for i in range(max_new_tokens):
        if i > 0:
            hidden = forward(model, torch.tensor([emit.generated[-1]], device=device), ids.shape[0] + i - 1,
                             lambda pos: Step(session, "decode", pos))
            logits = logits_of(model, hidden)[-1]
            token = choose_token(logits, sampling, generator)
            if keep_logits:
                kept_logits.append(logits)
        if emit.push(token):
            break
    sync(device)
    decode_s = time.perf_counter() - t_decode
    text = emit.close()
    decode_steps = emit.decode_steps()
    stats = GenerationStats(
        method=method.describe(), prompt_tokens=ids.shape[0], new_tokens=len(emit.generated), prefill_s=prefill_s,
        ttft_s=ttft_s, decode_s=decode_s,
        decode_tokens_per_s=decode_steps / decode_s if decode_steps and decode_s > 0 else 0.0,
        peak_kv_bytes=session.cache.peak_bytes, final_kv_bytes=session.cache.nbytes(),
        peak_rss_bytes=peak_rss_bytes(), finish_reason=emit.finish, method_stats=method.run_stats(session),
    )
    return Generation(text, emit.generated, stats, kept_logits)


def _prefill_all(model: LoadedModel, ids, method, params, chunk_size) -> tuple[torch.Tensor, torch.Tensor]:
    model = check_loaded_model(model)
    method = resolve_method(method, params)
    ids = encode_prompt(model, ids)
    check_length(model, ids.shape[0], 0)
    session = new_session(model, method, ids.shape[0], 0)
    return ids, prefill(model, session, ids, chunk_size, all_positions=True)


@torch.inference_mode()
def score_tokens(model: LoadedModel, ids, method: str | Method | None = "full", *, params: dict | None = None,
                 chunk_size: int | None = None) -> torch.Tensor:
    """Logits ``[n, vocab]`` at every prompt position under `method`'s prefill."""
    _, hidden = _prefill_all(model, ids, method, params, chunk_size)
    return logits_of(model, hidden)


@torch.inference_mode()
def token_nll(model: LoadedModel, ids, method: str | Method | None = "full", *, params: dict | None = None,
              chunk_size: int | None = None, slice_tokens: int = 1024) -> torch.Tensor:
    """Negative log-likelihood (nats) of tokens 1..n-1 given what precedes them, under `method`'s prefill.

    Logits are formed `slice_tokens` positions at a time, so a long text never holds ``[n, vocab]``.
    """
    ids, hidden = _prefill_all(model, ids, method, params, chunk_size)
    nll = []
    for s in range(0, ids.shape[0] - 1, slice_tokens):
        e = min(ids.shape[0] - 1, s + slice_tokens)
        nll.append(torch.nn.functional.cross_entropy(logits_of(model, hidden[s:e]), ids[s + 1:e + 1],
                                                     reduction="none"))
    return torch.cat(nll)
