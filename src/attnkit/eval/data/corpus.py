"""Text that every machine has: the Python standard library's own source.

The files split once, by a fixed list, into a training part and a held-out part. Evaluation
(code completion, perplexity, the haystack of the retrieval tasks) reads only held-out files; the
training script reads only the others.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from array import array
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


def cache_dir() -> Path:
    """Where attnkit keeps what it can recompute: ``$ATTNKIT_CACHE_DIR``, else ``~/.cache/attnkit``."""
    return Path(os.environ.get("ATTNKIT_CACHE_DIR") or Path.home() / ".cache" / "attnkit")


def encoded(tok, text: str) -> tuple[int, ...]:
    """`tok`'s ids of `text` (no special tokens), kept on disk under a digest of the tokenizer and the text.

    Encoding the training corpus (millions of tokens) takes seconds, and every process that builds training rows
    does it: each training stage, each data worker, each test of the training scripts. The file is written
    whole and then renamed, so a reader sees all of it or nothing; an unwritable cache only costs the time."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:  # no serialised form to key on: encode every time
        return tuple(tok.encode(text, add_special_tokens=False))
    digest = hashlib.sha256(backend.to_str().encode() + b"\0" + text.encode()).hexdigest()[:32]
    path = cache_dir() / "encoded" / f"{digest}.int32"
    try:
        ids = array("i")
        ids.frombytes(path.read_bytes())
        return tuple(ids)
    except (OSError, ValueError):
        pass
    ids = tuple(tok.encode(text, add_special_tokens=False))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(array("i", ids).tobytes())
        tmp.replace(path)
    except OSError:
        pass
    return ids


def special_prefix(tokenizer) -> list[int]:
    """What the tokenizer puts before a text (BOS for Llama-style tokenizers, nothing for Qwen)."""
    return list(tokenizer("").input_ids)


@functools.lru_cache(maxsize=4)
def heldout_ids(tokenizer) -> list[int]:
    """The held-out text (never trained on) as token ids: what ``perplexity`` and the long-output tasks
    (:mod:`attnkit.eval.data.long_output`) read."""
    return tokenizer.encode(haystack_text("heldout"), add_special_tokens=False)
