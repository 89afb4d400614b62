"""One writer per results directory: ``DIR/.attnkit.lock``, held while a sweep or an eval writes ``DIR/results.jsonl``.

Two runs appending to one results file at once would interleave their rows and each redo the other's cells (a run
decides what is left to do from the rows it read when it started), so the second is refused in one line naming the
directory, the holder's pid, host and command, and how to clear a lock left behind.

The lock is an advisory ``flock`` on the lock file: the kernel drops it when its holder exits, killed included, so
an interrupted sweep resumes without anyone clearing anything. Where ``fcntl`` is missing, the lock file's
existence is the lock (created exclusively); a holder that died leaves it, and the refusal says to delete it. The
lock file records its holder for the message and is removed on release. A process may take the lock of a directory
it already holds (a tuner that runs sweeps into its own directory): the lock is released when the outermost holder
lets go.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.run.provenance import now

try:
    import fcntl
except ImportError:  # not POSIX: the lock file's existence is the lock
    fcntl = None

LOCK_FILE = ".attnkit.lock"

_held: dict[Path, list] = {}  # directory -> [open lock file or None, depth] of the locks this process holds


def holder() -> dict:
    """What a lock file records about the process that holds it."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": now(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300] if sys.argv else "python"}


def _refusal(directory: Path, path: Path) -> AttnkitError:
    try:
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        info = {}
    who = (f"pid {info.get('pid', '?')} on {info.get('host', '?')}, running {info.get('command', '?')!r} since "
           f"{info.get('since', '?')}" if info else "a process that has not yet written its pid")
    return AttnkitError(f"{directory} is being written by another run ({who}); two runs must not write one results "
                        f"directory at once: wait for it to end, or give another --out. If that process no longer "
                        f"runs, the lock is stale: delete {path}")


def _write_holder(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(holder()) + "\n").encode("utf-8"))
    os.fsync(fd)


def _acquire_flock(directory: Path, path: Path):
    while True:
        fh = open(path, "a+b")  # held open for as long as the lock is
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            raise _refusal(directory, path) from None
        try:  # the holder before us may have removed the file after we opened it: lock the file at the path
            same = os.fstat(fh.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            _write_holder(fh.fileno())
            return fh
        fh.close()


def _acquire_exclusive(directory: Path, path: Path) -> None:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise _refusal(directory, path) from None
    try:
        _write_holder(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def results_lock(directory: str | Path) -> Iterator[Path]:
    """Hold ``directory``'s lock (the directory is created) while the block runs; a directory another run holds is
    refused with a one-line :class:`AttnkitError`. Yields the lock file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = directory.resolve()
    path = directory / LOCK_FILE
    if key in _held:
        _held[key][1] += 1
    else:
        fh = _acquire_flock(directory, path) if fcntl is not None else _acquire_exclusive(directory, path)
        _held[key] = [fh, 1]
    try:
        yield path
    finally:
        _held[key][1] -= 1
        if _held[key][1] == 0:
            fh, _ = _held.pop(key)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # before unlocking: a run waiting on this file sees it gone and locks a new one
            if fh is not None:
                fh.close()
