"""Where a result row comes from: the versions of the software, the CPU, attnkit's own git commit, the time.

Every row of a run carries the same provenance (read once per process), so two result files can be
told apart and a number traced back to the code that measured it.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import platform
import subprocess
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


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text if out.returncode == 0 and text else None


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD of attnkit's own git checkout, or None: not a checkout (an installed wheel), no git, no commits.

    Only a repository that tracks this very file counts: an installed attnkit inside some other
    repository (a virtual environment in a project's directory) must not report that project's commit."""
    if _git("ls-files", "--error-unmatch", HERE.name) is None:
        return None
    return _git("rev-parse", "HEAD")
