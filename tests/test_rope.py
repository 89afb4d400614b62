"""RoPE re-rotation (attnkit.rope): moving a rotated key to another position matches the model's rotation."""

import torch

import attnkit
from attnkit.rope import Rope
from helpers import SMALL, randn

torch.set_num_threads(1)


def test_rope_rotation_matches_the_model():
    model = attnkit.load_model(f"random:llama:{SMALL}")
    rope = Rope.from_model(model)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    raw = randn(1, 2, 5, 16, seed=81)
    pos = torch.tensor([[3, 7, 100, 2000, 5]])
    cos, sin = model.hf.model.rotary_emb(raw, pos)
    at_pos, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    moved = torch.tensor([[0, 50, 90, 10, 4]])
    cos2, sin2 = model.hf.model.rotary_emb(raw, moved)
    at_moved, _ = apply_rotary_pos_emb(raw, raw, cos2, sin2)
    assert (rope.rotate(at_pos, moved[0] - pos[0]) - at_moved).abs().max().item() < 1e-4
