"""``full``: ordinary attention over every cached token, the reference every method is measured against.

It honours the model's own masking: a layer that the model defines with a sliding window (Mistral's
``sliding_window``, Qwen2's sliding layers) sees only that window, exactly as transformers computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.methods.base import Method
from attnkit.methods.spec import register


@register
@dataclass(frozen=True)
class Full(Method):
    """Dense causal attention; the KV cache holds prompt + generated tokens."""

    name = "full"
    summary = "dense attention, every token kept (the reference)"

    def decode_only_appends(self) -> bool:
        return True
