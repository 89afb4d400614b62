import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import attnkit  # noqa: E402

SMALL = "layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"


@pytest.fixture(scope="session")
def small_llama():
    return attnkit.load_model(f"random:llama:{SMALL}")


def random_ids(n: int, seed: int = 0, vocab: int = 259) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))
