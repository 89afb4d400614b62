"""The results store (attnkit.eval.run.results): appending rows, repairing a cut-off tail, reading any file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from attnkit import AttnkitError
from attnkit.cli import main
from attnkit.eval.run import provenance
from attnkit.eval.run.results import RESULTS_FILE, append_row, read_results, repair_tail
from attnkit.version import __version__
from helpers import ROOT

ROOT = ROOT


def test_append_repair_and_read(tmp_path):
    path = tmp_path / RESULTS_FILE
    append_row(path, {"schema": 2, "cell": "a", "score": 0.5})
    append_row(path, {"schema": 2, "cell": "b", "score": 1.0})
    with path.open("a") as fh:
        fh.write('{"schema": 2, "cell": "c')  # a row cut off while being written
    with pytest.warns(UserWarning, match="unterminated last line"):
        assert [r["cell"] for r in read_results(tmp_path)] == ["a", "b"]
    assert repair_tail(path) and not repair_tail(path)
    assert [r["cell"] for r in read_results(path)] == ["a", "b"]


@pytest.mark.parametrize("content", [
    bytes(range(256)) * 4,  # a binary file
    '{"task": "café"}\n'.encode("latin-1"),  # text in another encoding
])
def test_a_file_that_is_not_utf8_is_a_one_line_error(tmp_path, capsys, content):
    (tmp_path / RESULTS_FILE).write_bytes(content)
    with pytest.raises(AttnkitError, match="is not a results file") as info:
        read_results(tmp_path)
    message = str(info.value)
    assert str(tmp_path / RESULTS_FILE) in message and "\n" not in message
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnkit: error:") and RESULTS_FILE in err and "\n" not in err


def test_provenance():
    assert set(provenance.versions()) == {"attnkit", "torch", "transformers", "python"}
    assert "cores" in provenance.cpu_name()
    commit = provenance.git_commit()  # attnkit's own checkout, when it runs from one
    assert commit is None or len(commit) == 40


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.org", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def _repo(root: Path, files: dict[str, str], track: bool = True) -> str:
    """A git repository at `root` holding `files` (committed when `track`, with one other file); its HEAD."""
    for name, text in {"README": "x", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    _git(root, "init", "-q")
    _git(root, "add", *(["-A"] if track else ["README"]))
    _git(root, "commit", "-q", "-m", "first")
    return _git(root, "rev-parse", "HEAD")


ATTNKIT = '[project]\nname = "attnkit"\n'
SOURCE = "src/attnkit/eval/run/provenance.py"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_only_from_attnkit_checkout(tmp_path):
    assert provenance.versions()["attnkit"] == __version__
    # an installed wheel in a user's project that commits its virtual environment: the user's commit is not attnkit's
    wheel = ".venv/lib/python3.11/site-packages/attnkit/eval/run/provenance.py"
    _repo(tmp_path / "user", {"pyproject.toml": '[project]\nname = "mine"\n', wheel: ""})
    assert provenance.checkout_commit(tmp_path / "user" / wheel) is None
    # attnkit's sources vendored in a subfolder of a user's repository: not attnkit's own checkout either
    _repo(tmp_path / "vendor", {"third_party/attnkit/pyproject.toml": ATTNKIT, f"third_party/attnkit/{SOURCE}": ""})
    assert provenance.checkout_commit(tmp_path / "vendor" / "third_party" / "attnkit" / SOURCE) is None
    # a checkout of attnkit's repository records its own HEAD (one whose file is untracked, nothing)
    head = _repo(tmp_path / "checkout", {"pyproject.toml": ATTNKIT, SOURCE: ""})
    assert provenance.checkout_commit(tmp_path / "checkout" / SOURCE) == head
    _repo(tmp_path / "untracked", {"pyproject.toml": ATTNKIT, SOURCE: ""}, track=False)
    assert provenance.checkout_commit(tmp_path / "untracked" / SOURCE) is None
    # another project laid out like attnkit is not attnkit
    _repo(tmp_path / "fork", {"pyproject.toml": '[project]\nname = "other"\n', SOURCE: ""})
    assert provenance.checkout_commit(tmp_path / "fork" / SOURCE) is None
    # and this process: its own checkout's HEAD when the tests run from one
    mine = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    is_checkout = mine.returncode == 0 and (ROOT / SOURCE).resolve() == Path(provenance.__file__).resolve()
    assert provenance.git_commit() == (mine.stdout.strip() if is_checkout else None)
