"""Every benchmark script imports against today's package: a module moved or renamed in the library breaks a
script (`from attnkit import ...`) long before anyone runs that benchmark again, and the docs quote their
commands. Importing runs no benchmark (each script's work is behind ``if __name__ == "__main__"``)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_there_are_benchmark_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_a_benchmark_script_imports(script):
    spec = importlib.util.spec_from_file_location(f"bench_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
