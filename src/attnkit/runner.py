"""The generation loop: prefill (optionally chunked), decode, sampling, stop conditions, statistics.

The runner drives the Hugging Face modules itself (embeddings, rotary embedding, decoder layers,
final norm, LM head) and owns the KV cache; every layer's attention reaches the active method through
attnkit's attention function (see :mod:`attnkit.attention`). Batch size is 1.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from attnkit.cache import KVCache
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method, Session, Step, make_method
from attnkit.model import LoadedModel
from attnkit.rope import Rope
from attnkit.sampling import SamplingConfig, choose_token


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

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    logits: list[torch.Tensor] | None = None  # per generated token, when asked for with keep_logits


def resolve_method(method: str | Method | None, params: dict | None = None) -> Method:
    """A method instance from a name (+ params), an instance, or None (= full)."""
    if method is None:
        method = "full"
    if isinstance(method, Method):
        if params:
            raise AttnkitError("params are given with a method instance; set them on the instance instead")
        return method
    if isinstance(method, str):
        return make_method(method, **(params or {}))
    raise AttnkitError(f"method must be a name or a Method, got {type(method).__name__}")


def encode_prompt(model: LoadedModel, prompt) -> torch.Tensor:
    """Prompt text or token ids -> a 1-D LongTensor of ids, with clear errors for what is not allowed."""
    if isinstance(prompt, str):
        if not prompt:
            raise AttnkitError("the prompt is empty")
        ids = model.tokenizer(prompt).input_ids
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2:
            if prompt.shape[0] != 1:
                raise AttnkitError(f"batch size {prompt.shape[0]} is not supported yet; give one prompt at a time")
            prompt = prompt[0]
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise AttnkitError(f"batch size {len(prompt)} is not supported yet; give one prompt at a time")
        return encode_prompt(model, prompt[0])
    elif isinstance(prompt, Sequence):
        ids = list(prompt)
    else:
        raise AttnkitError(f"prompt must be text or token ids, got {type(prompt).__name__}")
    if len(ids) == 0:
        raise AttnkitError("the prompt is empty")
    vocab = model.geometry.vocab_size
    bad = [i for i in ids if not 0 <= int(i) < vocab]
    if bad:
        raise AttnkitError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return torch.tensor(ids, dtype=torch.long, device=model.device)


def check_length(model: LoadedModel, prompt_len: int, max_new_tokens: int) -> None:
    limit = model.geometry.max_positions
    if prompt_len > limit:
        raise AttnkitError(f"the prompt has {prompt_len} tokens; model {model.spec!r} allows at most {limit}")
    if prompt_len + max_new_tokens > limit:
        raise AttnkitError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                           f"{prompt_len + max_new_tokens} exceeds the {limit} positions model {model.spec!r} allows")


def check_benchmark_tokens(new_tokens: int, name: str = "new_tokens") -> None:
    """A benchmark times decoding over the tokens after the first: it needs at least two new tokens.
    `name` is what the caller calls the value (the argument, or a command-line flag)."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise AttnkitError(f"{name} must be a whole number >= 2 for a benchmark (decoding speed is timed over "
                           f"the tokens after the first), got {new_tokens!r}")


def forward(model: LoadedModel, ids: torch.Tensor, start: int, step_factory: Callable[[torch.Tensor], Step],
            all_positions: bool = False) -> torch.Tensor:
    """Run the decoder on `ids` ([n]) at positions start..; final-norm hidden states ``[n or 1, hidden]``
    of every position (or only the last)."""
    base = model.hf.model
    positions = torch.arange(start, start + ids.shape[0], device=ids.device)
    hidden = base.embed_tokens(ids[None])
    step = step_factory(positions)
    session = getattr(step, "session", None)  # a step-like object (speculative decoding's tee) has none
    hook = None if session is None else session.method.run_layers
    if hook is None:
        hidden = run_decoder_layers(model, hidden, positions, step)
    else:  # model-level hook: the method runs the layers (it may change which tokens later layers see)
        hidden = hook(model, step, hidden, all_positions)
    return base.norm(hidden[0] if all_positions else hidden[0, -1:])


def run_decoder_layers(model: LoadedModel, hidden: torch.Tensor, positions: torch.Tensor, step: Step,
                       layers: Sequence[int] | None = None) -> torch.Tensor:
    """Run decoder layers `layers` (default: all) on `hidden` ``[1, n, hidden]`` at the original
    `positions` ``[n]`` (RoPE is applied at those positions, whatever they are), attention through `step`.

    The building block of the ``run_layers`` hook: a method may run layers 0..L on the new tokens and the
    layers after L on another set of tokens (at their own positions, with another :class:`Step`)."""
    base = model.hf.model
    position_embeddings = base.rotary_emb(hidden, positions[None])
    for i in layers if layers is not None else range(len(base.layers)):
        hidden = base.layers[i](hidden, attention_mask=None, position_ids=positions[None], past_key_values=None,
                                use_cache=False, position_embeddings=position_embeddings, attnkit_step=step)
    return hidden


def logits_of(model: LoadedModel, hidden: torch.Tensor) -> torch.Tensor:
    """LM-head logits (float32) of final hidden states ``[n, hidden]``."""
    return model.hf.lm_head(hidden).float()


def prefill(model: LoadedModel, session: Session, ids: torch.Tensor, chunk_size: int | None = None,
            all_positions: bool = False) -> torch.Tensor:
    """Feed the prompt (in chunks of `chunk_size` tokens if given); final hidden states of the last
    position ``[1, hidden]``, or of every position ``[n, hidden]``."""
    n = ids.shape[0]
    if chunk_size is not None and chunk_size <= 0:
        raise AttnkitError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    chunk = chunk_size or n
    outputs = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        hidden = forward(model, ids[start:end], start,
                         lambda pos, last=(end == n): Step(session, "prefill", pos, last), all_positions)
        if all_positions or end == n:
            outputs.append(hidden)
    return torch.cat(outputs) if all_positions else outputs[-1]


def generation_options(max_new_tokens: int, do_sample: bool, temperature: float, top_k: int | None,
                       top_p: float | None, seed: int | None,
                       stop: Sequence[str] | str | None) -> tuple[SamplingConfig, list[str]]:
    """Validated sampling settings and stop strings of a generation call."""
    if max_new_tokens < 1:
        raise AttnkitError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise AttnkitError("stop strings must be non-empty")
    return SamplingConfig(do_sample, temperature, top_k, top_p, seed), stops


def _stop_prefix_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class TokenEmitter:
    """Stop conditions (EOS, stop strings) and streaming, token by token, for every decoding loop.

    A streamed tail that may still grow into a stop string is held back until it cannot."""

    def __init__(self, tokenizer, eos, stops: list[str], on_token):
        self.tokenizer, self.eos, self.stops, self.on_token = tokenizer, eos, stops, on_token
        self.generated: list[int] = []
        self.text, self.finish, self.streamed = "", "length", 0

    def push(self, token: int) -> bool:
        """Emit one token; True when generation must end here."""
        if self.eos is not None and token == self.eos:
            self.finish = "eos"
            return True
        self.generated.append(token)
        if self.stops or self.on_token:
            text = self.tokenizer.decode(self.generated, skip_special_tokens=True)
            cut = min((text.find(s) for s in self.stops if s in text), default=-1)
            if cut >= 0:
                text, self.finish = text[:cut], "stop"
            self.text = text
            if self.on_token:
                safe = len(text) if self.finish == "stop" else len(text) - _stop_prefix_overlap(text, self.stops)
                if safe > self.streamed:
                    self.on_token(token, text[self.streamed:safe])
                    self.streamed = safe
            if self.finish == "stop":
                return True
        return False

    def close(self) -> str:
        if not (self.stops or self.on_token):
            self.text = self.tokenizer.decode(self.generated, skip_special_tokens=True)
        if self.on_token and len(self.text) > self.streamed:
            self.on_token(self.generated[-1], self.text[self.streamed:])
        return self.text



def _sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA), so a timer read after it measures the work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def new_session(model: LoadedModel, method: Method, prompt_len: int, max_new_tokens: int) -> Session:
    n_layers = model.geometry.n_layers
    return Session(method, KVCache(n_layers), n_layers, prompt_len, max_new_tokens, rope=Rope.from_model(model))


@torch.inference_mode()
def generate(model: LoadedModel, prompt, method: str | Method | None = "full", *, params: dict | None = None,
             max_new_tokens: int = 64, chunk_size: int | None = None, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, stop: Sequence[str] | str | None = None, stop_at_eos: bool = True,
             on_token: Callable[[int, str], None] | None = None, keep_logits: bool = False) -> Generation:
    """Generate up to `max_new_tokens` tokens after `prompt` with attention method `method`.

    `prompt` is text or token ids (batch size 1). `method` is a registered name (with `params`) or a
    method instance. Generation stops at EOS (unless `stop_at_eos=False`), at any `stop` string (the
    returned text ends before it), or after `max_new_tokens`. `on_token(token_id, text_delta)` streams.
    `keep_logits` returns the logits each token was chosen from (float32, ``[vocab]`` each).
    """
    method = resolve_method(method, params)
    sampling, stops = generation_options(max_new_tokens, do_sample, temperature, top_k, top_p, seed, stop)
    ids = encode_prompt(model, prompt)
    check_length(model, ids.shape[0], max_new_tokens)
    device = model.device
    generator = sampling.generator(device)
    tokenizer = model.tokenizer
    eos = getattr(tokenizer, "eos_token_id", None) if stop_at_eos else None
    session = new_session(model, method, ids.shape[0], max_new_tokens)

    _sync(device)
    t0 = time.perf_counter()
    logits = logits_of(model, prefill(model, session, ids, chunk_size))[-1]
    _sync(device)
    prefill_s = time.perf_counter() - t0
    token = choose_token(logits, sampling, generator)
    ttft_s = time.perf_counter() - t0

    emit = TokenEmitter(tokenizer, eos, stops, on_token)
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
    _sync(device)
    decode_s = time.perf_counter() - t_decode
    text = emit.close()
    generated, finish = emit.generated, emit.finish
    decode_steps = max(0, len(generated) - 1 + (finish == "eos"))
    stats = GenerationStats(
        method=method.describe(), prompt_tokens=ids.shape[0], new_tokens=len(generated), prefill_s=prefill_s,
        ttft_s=ttft_s, decode_s=decode_s,
        decode_tokens_per_s=decode_steps / decode_s if decode_steps and decode_s > 0 else 0.0,
        peak_kv_bytes=session.cache.peak_bytes, final_kv_bytes=session.cache.nbytes(),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, finish_reason=finish,
    )
    return Generation(text, generated, stats, kept_logits)


def _prefill_all(model: LoadedModel, ids, method, params, chunk_size) -> tuple[torch.Tensor, torch.Tensor]:
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
