"""Where a result row comes from: the versions of the software, the CPU, attnkit's own git commit, the time.

Every row of a run carries the same provenance (read once per process), so two result files can be
told apart and a number traced back to the code that measured it: ``versions["attnkit"]`` always, and
``git_commit`` only when attnkit itself runs from a git checkout of its repository (:func:`checkout_commit`).
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import platform
import subprocess
import tomllib
from pathlib import Path

import torch
import transformers

from attnkit.version import __version__

HERE = Path(__file__).resolve()


def now() -> str:
    """The current UTC time, to the second, in ISO 8601."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


@functools.lru_cache(maxsize=1)
def versions() -> dict:
    """Versions of attnkit, torch, transformers and Python."""
    return {"attnkit": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; else what :mod:`platform` says) and its core
    count: speed ratios change with the machine (the Python overhead of a step against its arithmetic)."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{name or platform.processor() or platform.machine() or 'unknown CPU'}, {os.cpu_count()} cores"


# where this file lies in attnkit's own repository
SOURCE_PATH = Path("src", "attnkit", "eval", "run", "provenance.py")


def _git(where: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text if out.returncode == 0 and text else None


def _names_attnkit(pyproject: Path) -> bool:
    try:
        return tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("name") == "attnkit"
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False


def checkout_commit(path: Path) -> str | None:
    """HEAD of attnkit's own git checkout holding `path` (this module's file), or None.

    Only a work tree whose top level is attnkit's repository counts: its ``pyproject.toml`` names the project
    ``attnkit`` and `path` is its tracked ``src/attnkit/eval/run/provenance.py``. An installed attnkit (a wheel in a
    virtual environment) that lies inside some other repository -- a user's project, even one that commits its
    virtual environment or vendors attnkit's sources in a subfolder -- records no commit rather than that
    repository's, which says nothing about attnkit's code. An editable install runs from the checkout and counts."""
    path = Path(path).resolve()
    top = _git(path.parent, "rev-parse", "--show-toplevel")
    if top is None or (Path(top) / SOURCE_PATH).resolve() != path or not _names_attnkit(Path(top) / "pyproject.toml"):
        return None
    if _git(path.parent, "ls-files", "--error-unmatch", path.name) is None:
        return None
    return _git(path.parent, "rev-parse", "HEAD")


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD of the attnkit checkout this process runs from, or None (an installed wheel, no git, no commits):
    :func:`checkout_commit` of this file."""
    return checkout_commit(HERE)
