import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import attnkit  # noqa: E402
from helpers import SMALL  # noqa: E402


@pytest.fixture(scope="session")
def small_llama():
    return attnkit.load_model(f"random:llama:{SMALL}")
