"""Turning logits into the next token: greedy, or sampling with temperature, top-k and top-p.

The same :func:`next_token_distribution` serves plain decoding and speculative decoding, so target and
draft see identical processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        if self.temperature <= 0:
            raise AttnkitError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise AttnkitError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise AttnkitError(f"top_p must be in (0, 1], got {self.top_p}")

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
