"""Text that every machine has: the Python standard library's own source.

The files split once, by a fixed list, into a training part and a held-out part. Evaluation
(code completion, perplexity, the haystack of the retrieval tasks) reads only held-out files; the
training script reads only the others.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

# Held out from training, always. Chosen as ordinary, self-contained modules of varied style.
HELD_OUT_FILES: tuple[str, ...] = (
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "csv.py",
    "difflib.py",
    "fractions.py",
    "graphlib.py",
    "heapq.py",
    "ipaddress.py",
    "shlex.py",
    "statistics.py",
    "textwrap.py",
    "json/decoder.py",
    "json/encoder.py",
    "email/quoprimime.py",
    "email/_parseaddr.py",
)

_SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo", "tkinter"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def stdlib_files(split: str) -> tuple[Path, ...]:
    """Source files of the standard library for `split` ("train" or "heldout"), sorted by path."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_root()
    held = {root / name for name in HELD_OUT_FILES}
    if split == "heldout":
        missing = [str(p) for p in held if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"held-out standard-library files not found: {missing}")
        return tuple(sorted(held))
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _SKIPPED_DIRS for part in rel.parts[:-1]) or path in held:
            continue
        files.append(path)
    return tuple(files)


@functools.cache
def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@functools.lru_cache(maxsize=4)
def haystack_text(split: str) -> str:
    """All files of `split` joined into one long text (the filler of the retrieval tasks)."""
    return "\n".join(read_text(p) for p in stdlib_files(split))
