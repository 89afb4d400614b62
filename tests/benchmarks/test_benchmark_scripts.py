"""Every benchmark script imports against today's package: a module moved or renamed in the library breaks a
script (`from attnkit import ...`) long before anyone runs that benchmark again, and the docs quote their
commands. Importing runs no benchmark (each script's work is behind ``if __name__ == "__main__"``)."""

import argparse
import importlib.util
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from attnkit.cli import main as cli_main
from helpers import ROOT

ROOT = ROOT
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def test_there_are_benchmark_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_a_benchmark_script_imports(script):
    spec = importlib.util.spec_from_file_location(f"bench_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"


class _Parsed(Exception):
    """Raised once a command's arguments parsed: nothing is run."""


def _regenerate_commands(tmp_path: Path) -> list[list[str]]:
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "regenerate_tiny.sh"), str(tmp_path)],
                          env={**os.environ, "DRY": "1"}, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    return [shlex.split(line) for line in done.stdout.splitlines()]


def test_every_command_of_regenerate_tiny_parses(tmp_path, monkeypatch):
    """benchmarks/regenerate_tiny.sh reruns the docs' results of the bundled model: a flag renamed in the CLI
    or a benchmark script would break it hours into a run, so each of its commands is parsed here."""
    commands = _regenerate_commands(tmp_path)
    assert len(commands) >= 15 and not list(tmp_path.iterdir())  # a dry run writes nothing
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    scripts = {s.relative_to(s.parents[1]).as_posix(): s for s in SCRIPTS}
    for argv in commands:
        if argv[1:3] == ["-m", "attnkit.cli"]:
            main, args = cli_main, argv[3:]
        else:
            spec = importlib.util.spec_from_file_location("regenerate_step", scripts[argv[1]])
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            main, args = module.main, argv[2:]
        with pytest.raises(_Parsed):
            main(args)


def test_regenerate_tiny_refuses_an_unknown_job(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "regenerate_tiny.sh"), str(tmp_path), "evl"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and "evl: failed" in done.stdout and "unknown job evl" in (tmp_path / "evl.txt").read_text()
