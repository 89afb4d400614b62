"""Turning logits into the next token: greedy, or sampling with temperature, top-k and top-p.

The same :func:`next_token_distribution` serves plain decoding and speculative decoding, so target and
draft see identical processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit import validate


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        validate.flag("do_sample", self.do_sample)
        validate.number("temperature", self.temperature, 0, low_open=True, what=" (finite)")
        validate.optional_whole("top_k", self.top_k, 1)
        if self.top_p is not None:
            validate.fraction("top_p", self.top_p)
        validate.optional_whole("seed", self.seed, 0)

    def generator(self, device) -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def next_token_distribution(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Probabilities over the vocabulary after temperature, top-k and top-p (last axis)."""
    logits = logits.float() / config.temperature
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = logits.topk(config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if config.top_p is not None and config.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above
        sorted_probs = sorted_probs.masked_fill(before >= config.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose_token(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> int:
    """Next token id from the last-position logits ``[vocab]``."""
    if not config.do_sample:
        return int(logits.argmax(-1))
    probs = next_token_distribution(logits, config)
    return int(torch.multinomial(probs, 1, generator=generator))
