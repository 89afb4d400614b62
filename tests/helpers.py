"""Shared test helpers: the small random model's options and reproducible random token ids."""

import torch

SMALL = "layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"


def random_ids(n: int, seed: int = 0, vocab: int = 259) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))
