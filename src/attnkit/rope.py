"""Re-rotating cached keys to other positions (rotary position embedding, RoPE).

Keys are cached after RoPE at their original positions. A method that wants a key to look as if it
sat at another position (StreamingLLM's in-cache positions, Keyformer's "new positions") does not
need the key before RoPE: rotations compose, ``R(a) R(b) = R(a + b)``, so rotating a cached key by
``delta = new - old`` gives exactly the key RoPE would have produced at ``new``. :class:`Rope` does
that with the model's own inverse frequencies and the same half-split convention as transformers'
Llama-family ``apply_rotary_pos_emb``; it works for every RoPE type whose frequencies do not depend
on the sequence length (default, linear, llama3, yarn). The model's ``attention_scaling`` (yarn's
magnitude factor) is already inside the cached key and is deliberately not applied again.
"""

from __future__ import annotations

import torch


class Rope:
    """Rotations by arbitrary position offsets with a model's rotary frequencies.

    `inv_freq` is ``[head_dim / 2]`` (``rotary_emb.inv_freq`` of a transformers model); pass the
    module itself as `source` instead to read its frequencies at every call (they can live on another
    device or be updated by the model).
    """

    def __init__(self, inv_freq: torch.Tensor | None = None, source=None):
        if (inv_freq is None) == (source is None):
            raise ValueError("give exactly one of inv_freq or source (a rotary embedding module)")
        self._inv_freq = inv_freq
        self._source = source

    @classmethod
    def from_model(cls, model) -> Rope | None:
        """The rotary helper of a :class:`~attnkit.model.LoadedModel` (or a transformers causal LM),
        or None when the model has no rotary embedding module with ``inv_freq``."""
        hf = getattr(model, "hf", model)
        rotary = getattr(getattr(hf, "model", None), "rotary_emb", None)
        if rotary is None or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
            return None
        return cls(source=rotary)

    @classmethod
    def from_config(cls, config) -> Rope:
        """The rotary helper of a transformers model configuration (for a host that runs the model with its own
        code, such as vLLM): the default frequencies ``theta^(-2i/d)`` over the rotated dimensions, or those of
        transformers' initialisation for the configuration's RoPE type (linear, llama3, yarn, ...)."""
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type != "default":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            return cls(inv_freq=ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")[0])
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(inv_freq=1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)))

    @property
    def inv_freq(self) -> torch.Tensor:
        return self._source.inv_freq if self._source is not None else self._inv_freq

    def cos_sin(self, positions: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[..., head_dim]`` (float32) of the rotation by `positions` (any shape, may be < 0)."""
        inv = self.inv_freq.to(device=device or positions.device, dtype=torch.float32)
        angles = positions.to(device=inv.device, dtype=torch.float32)[..., None] * inv
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def rotate(self, x: torch.Tensor, delta: torch.Tensor | int) -> torch.Tensor:
        """`x` ``[..., n, head_dim]`` rotated by `delta` positions (``[..., n]`` broadcastable, or a scalar).

        Computed in float32 and returned in ``x.dtype``; a zero offset returns `x` unchanged.
        """
        if not isinstance(delta, torch.Tensor):
            delta = torch.tensor(delta, device=x.device)
        cos, sin = self.cos_sin(delta, device=x.device)
        if cos.dim() == 1:  # scalar offset
            cos, sin = cos.expand(x.shape[-2], -1), sin.expand(x.shape[-2], -1)
        xf = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)
