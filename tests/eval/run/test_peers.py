"""The kvpress peer's worker ships inside the package (attnkit.eval.run.peers, attnkit.eval.run.kvpress_worker)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import attnkit
from attnkit import AttnkitError
from attnkit.eval.run import peers
from attnkit.recipe import peer


def test_the_worker_is_part_of_the_package():
    package = Path(attnkit.__file__).resolve().parent
    assert peers.WORKER.is_file() and peers.WORKER.parent == package / "eval" / "run"


def test_the_worker_imports_no_attnkit():
    # it runs in kvpress's environment, with another transformers and without attnkit
    tree = ast.parse(peers.WORKER.read_text(encoding="utf-8"))
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert "kvpress" in modules and not any(m.split(".")[0] == "attnkit" for m in modules)


def test_a_missing_worker_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(peer.ENV_VAR, sys.executable)
    monkeypatch.setattr(peers, "WORKER", tmp_path / "kvpress_worker.py")
    with pytest.raises(AttnkitError, match="kvpress worker .* is missing"):
        peers.require_kvpress()
