import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import attnkit  # noqa: E402
from helpers import SMALL  # noqa: E402


@pytest.fixture(scope="session")
def small_llama():
    return attnkit.load_model(f"random:llama:{SMALL}")


@pytest.fixture(scope="session")
def greedy_models():
    """The speculative tests' target and a different draft model (shared by their files, never modified)."""
    return attnkit.load_model(f"random:llama:{SMALL}"), attnkit.load_model(f"random:llama:{SMALL},seed=3")
