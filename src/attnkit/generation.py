"""What a generation call is configured by (:class:`GenerationConfig`), and what every decoding loop
shares: the prompt's token ids, the length check, stop conditions and streaming (:class:`TokenEmitter`).

The plain runner and speculative decoding read the same config, so both accept exactly the same
options with the same checks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnkit import validate
from attnkit.errors import AttnkitError
from attnkit.model import LoadedModel
from attnkit.sampling import SamplingConfig


@dataclass(frozen=True)
class GenerationConfig:
    """How many tokens, how they are chosen, where generation stops, how the prompt is fed."""

    max_new_tokens: int = dataclasses.field(default=64, metadata={"help": "tokens to generate at most"})
    do_sample: bool = dataclasses.field(default=False, metadata={"help": "sample instead of greedy decoding"})
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "sampling temperature (> 0)"})
    top_k: int | None = dataclasses.field(default=None, metadata={"help": "sample among the k most likely tokens"})
    top_p: float | None = dataclasses.field(default=None, metadata={
        "help": "sample among the most likely tokens holding probability p (0 < p <= 1)"})
    seed: int | None = dataclasses.field(default=None, metadata={"help": "random seed of the sampling"})
    stop: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "help": "stop strings: the text ends before the first one generated"})
    stop_at_eos: bool = dataclasses.field(default=True, metadata={"help": "stop at the tokenizer's EOS token"})
    chunk_size: int | None = dataclasses.field(default=None, metadata={
        "help": "feed the prompt in chunks of this many tokens (default: all at once)"})

    def __post_init__(self):
        validate.whole("max_new_tokens", self.max_new_tokens, 1)
        self.sampling  # noqa: B018  (SamplingConfig checks the sampling fields)
        validate.flag("stop_at_eos", self.stop_at_eos)
        validate.optional_whole("chunk_size", self.chunk_size, 1)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Sequence):
            stop = tuple(stop)
        else:
            raise AttnkitError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise AttnkitError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        object.__setattr__(self, "stop", stop)

    @classmethod
    def build(cls, config: GenerationConfig | None = None, **options) -> GenerationConfig:
        """`config` (or the defaults) with `options` (field names) replaced; unknown names are refused."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise AttnkitError(f"config must be a GenerationConfig, got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise AttnkitError(f"unknown generation option(s) {', '.join(unknown)}; options: {', '.join(sorted(names))}")
        base = config or cls()
        return dataclasses.replace(base, **options) if options else base

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.do_sample, self.temperature, self.top_k, self.top_p, self.seed)

    def eos(self, tokenizer) -> int | None:
        """The token id that ends generation, or None."""
        return getattr(tokenizer, "eos_token_id", None) if self.stop_at_eos else None


def encode_prompt(model: LoadedModel, prompt, what: str = "the prompt") -> torch.Tensor:
    """Prompt text or token ids -> a 1-D LongTensor of ids, with clear errors for what is not allowed."""
    if isinstance(prompt, str):
        if not prompt:
            raise AttnkitError(f"{what} is empty")
        ids = model.tokenizer(prompt).input_ids
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2:
            if prompt.shape[0] != 1:
                raise AttnkitError(f"{what} is a batch of {prompt.shape[0]}; this call takes one prompt")
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise AttnkitError(f"{what} must be a 1-D tensor of token ids, got shape {tuple(prompt.shape)}")
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise AttnkitError(f"{what} is a batch of {len(prompt)}; this call takes one prompt")
        return encode_prompt(model, prompt[0], what)
    elif isinstance(prompt, Sequence):
        ids = list(prompt)
    else:
        raise AttnkitError(f"{what} must be text or token ids, got {type(prompt).__name__}")
    if len(ids) == 0:
        raise AttnkitError(f"{what} is empty")
    if not all(validate.is_whole(i) for i in ids):
        bad = next(i for i in ids if not validate.is_whole(i))
        raise AttnkitError(f"token ids must be whole numbers, got {bad!r} in {what}")
    vocab = model.geometry.vocab_size
    bad = [i for i in ids if not 0 <= int(i) < vocab]
    if bad:
        raise AttnkitError(f"token id {bad[0]} in {what} is outside the vocabulary (0..{vocab - 1})")
    return torch.tensor(ids, dtype=torch.long, device=model.device)


def _is_ids(prompt) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and all(validate.is_whole(i) for i in prompt)


def encode_prompts(model: LoadedModel, prompt) -> tuple[list[torch.Tensor], bool]:
    """One prompt or a batch -> (1-D id tensors, whether a batch was given).

    A batch is a list of texts, a list of id lists, or a 2-D tensor ``[batch, n]``; one prompt is a
    text, a list of ids or a 1-D tensor. Texts and id lists cannot be mixed in one batch."""
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 2:
        if prompt.shape[0] == 0:
            raise AttnkitError("the batch of prompts is empty")
        return [encode_prompt(model, row, f"prompt {i}") for i, row in enumerate(prompt)], True
    if isinstance(prompt, str) or isinstance(prompt, torch.Tensor) or _is_ids(prompt) and len(prompt) > 0:
        return [encode_prompt(model, prompt)], False
    if isinstance(prompt, Sequence) and not isinstance(prompt, str):
        if len(prompt) == 0:
            raise AttnkitError("the batch of prompts is empty: give at least one text or list of token ids")
        texts = [isinstance(p, str) for p in prompt]
        if any(texts) and not all(texts):
            first = texts.index(not texts[0])
            raise AttnkitError(f"a batch mixes texts and token ids (prompt 0 is {'text' if texts[0] else 'ids'}, "
                               f"prompt {first} is {'text' if texts[first] else 'ids'}); give all texts or all "
                               f"token id lists")
        return [encode_prompt(model, p, f"prompt {i}") for i, p in enumerate(prompt)], True
    raise AttnkitError(f"prompt must be text, token ids, or a list of them, got {type(prompt).__name__}")


def check_length(model: LoadedModel, prompt_len: int, max_new_tokens: int, what: str = "the prompt") -> None:
    limit = model.geometry.max_positions
    if prompt_len > limit:
        raise AttnkitError(f"{what} has {prompt_len} tokens; model {model.spec!r} allows at most {limit}")
    if prompt_len + max_new_tokens > limit:
        raise AttnkitError(f"{what} ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                           f"{prompt_len + max_new_tokens} exceeds the {limit} positions model {model.spec!r} allows")


def available_memory(device: torch.device | str) -> int:
    """Bytes free for new tensors on `device`: CUDA's free memory, or the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA), so a timer read after it measures the work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _stop_prefix_overlap(text: str, stops: Sequence[str]) -> int:
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

    def __init__(self, tokenizer, eos, stops: Sequence[str], on_token):
        self.tokenizer, self.eos, self.stops, self.on_token = tokenizer, eos, list(stops), on_token
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

    def decode_steps(self) -> int:
        """Decoding steps after the first token (an EOS that ended generation counts as one)."""
        return max(0, len(self.generated) - 1 + (self.finish == "eos"))
