"""CONTRIBUTING.md's worked example (a new eviction method in one file) works as written: its method file
registers, equals full attention at an unlimited budget and evicts under a budget."""

import re
import types
from pathlib import Path

import pytest

import attnkit
from attnkit.methods.spec import METHODS
from helpers import SMALL

GUIDE = Path(__file__).resolve().parent.parent / "CONTRIBUTING.md"


@pytest.fixture(scope="module")
def knorm():
    # attnkit ships its own `knorm` (the prompt-scorer one); the guide's example takes the name while it runs
    shipped = METHODS.pop("knorm")
    try:
        blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), re.M | re.S)
        module = types.ModuleType("attnkit.methods.knorm")
        exec(compile(blocks[0], "CONTRIBUTING.md", "exec"), module.__dict__)
        yield module.KNorm
    finally:
        METHODS["knorm"] = shipped


def test_the_example_method_registers(knorm):
    assert METHODS["knorm"] is knorm
    assert attnkit.make_method("knorm", budget=0.5).budget == 0.5


def test_the_example_method_equals_full_and_evicts(knorm):
    model = attnkit.load_model(f"random:llama:{SMALL}")
    prompt = "the quick brown fox " * 30
    full = attnkit.generate(model, prompt, "full", max_new_tokens=16)
    assert attnkit.generate(model, prompt, "knorm", params={"budget": 1.0}, max_new_tokens=16).token_ids == \
        full.token_ids
    out = attnkit.generate(model, prompt, "knorm", params={"budget_tokens": 64}, max_new_tokens=16)
    assert out.stats.final_kv_bytes < out.stats.peak_kv_bytes
