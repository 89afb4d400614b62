"""Whether a built kernel runs: a short timed comparison with the torch path it replaces, once per machine, build and
shape class.

The kernels are tuned for the CPUs they were measured on; on another CPU (another instruction set, other caches) a
kernel can lose to torch's own operations, and attnkit must never be slower by its own choice. So the first time a
process needs a kernel for a shape class (:func:`choose`), its caller times the kernel and the torch path side by
side on inputs of that class (interleaved, a few repeats) and :func:`decide` keeps the kernel only where it is
faster by a margin (:data:`MARGIN`: within it, the torch path, the reference, runs); one found slower is compared once
more and left off only where it loses again (a burst of other work during one comparison would otherwise keep a
kernel off for good). The choice is kept in the
process and in ``choices.json`` beside the builds (:func:`attnkit.native.cache_folder`), keyed by the CPU's model
and features, the build (the kernel, its instruction set, a digest of its sources and flags) and the shape class,
so a machine measures each once. ``ATTNKIT_NATIVE=1`` runs the kernel without timing, ``ATTNKIT_NATIVE=0`` never
builds one. Every choice a run consulted is reported in its statistics (:func:`report`:
``native_<kernel>: "on|off, <isa>, <why>"``).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from attnkit import native

MARGIN = 1.0  # the kernel runs where its median time is below this share of the torch path's
REPEATS = 3  # timed runs of each path in a comparison, after one untimed run of each
FILE = "choices.json"

_lock = threading.Lock()
_memo: dict[str | tuple, Choice] = {}  # by the file's key, and by (build, shape, switch) for repeat calls
_consulted: dict[tuple[str, bool, str], tuple[int, Choice]] = {}  # (kernel, on, isa) -> (tick, its last choice)
_tick = [0]


@dataclass(frozen=True)
class Choice:
    """Whether a kernel runs (`on`), the instruction set of its build (`isa`; ``-`` where none is built) and why."""

    on: bool
    isa: str
    why: str

    def describe(self) -> str:
        return f"{'on' if self.on else 'off'}, {self.isa}, {self.why}"


def decide(kernel_s: Sequence[float], torch_s: Sequence[float], margin: float = MARGIN) -> tuple[bool, str]:
    """Whether the kernel runs, given times (seconds) of the kernel and of the torch path measured side by side: its
    median below `margin` times torch's; and why, in words."""
    if not kernel_s or not torch_s:
        raise ValueError("decide needs at least one time of the kernel and one of the torch path")
    k, t = statistics.median(kernel_s), statistics.median(torch_s)
    on = k < margin * t
    return on, f"{'faster' if on else 'not faster'} than torch here ({k * 1e3:.3g} ms vs {t * 1e3:.3g} ms)"


def bucket(n: int) -> int:
    """The length class of `n` keys: the least power of 4 from 256 up that holds them (the comparison runs at that
    length, or at a cap its caller sets)."""
    top = 256
    while top < n:
        top *= 4
    return top


def time_both(kernel: Callable[[], object], torch_path: Callable[[], object], repeats: int = REPEATS
              ) -> tuple[list[float], list[float]]:
    """Seconds of `repeats` runs of each path, interleaved (a drift of the machine hits both alike), after one
    untimed run of each (builds, allocations, first-touch of memory)."""
    kernel(), torch_path()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in zip((kernel, torch_path), times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def _path() -> str:
    return str(native.cache_folder() / FILE)


def _read() -> dict:
    try:
        with open(_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(key: str, entry: dict) -> None:
    """Adds one choice to the file (read, add, write whole, atomic rename; processes deciding at once may each
    lose the other's new entry, which is then measured again)."""
    folder = native.cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        data = _read()
        data[key] = entry
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, folder / FILE)
    except OSError:
        pass  # a read-only cache: the choice holds for this process


def choose(kernel: str, lib, shape: str, measure: Callable[[], tuple[Sequence[float], Sequence[float]]]) -> Choice:
    """The choice for `kernel` (a name for the report) built as `lib` (a loaded library, or None where none is built)
    on operands of shape class `shape` (a short text: what the comparison depends on). `measure` runs the
    comparison, returning the kernel's times and the torch path's; it is called only where no choice is known."""
    switch = native.switch()
    if lib is None:
        why = "ATTNKIT_NATIVE=0" if switch == "0" else "not built (see the warning)"
        return _note(kernel, Choice(False, "-", why))
    known = _memo.get((lib.build, shape, switch))  # a per-step caller consults on every layer and step
    if known is not None:
        return _note(kernel, known)
    isa = native.built_isa(lib)
    if switch == "1":
        found = _memo[(lib.build, shape, switch)] = Choice(True, isa, "ATTNKIT_NATIVE=1")
        return _note(kernel, found)
    key = f"{native.cpu_model()} | {lib.build} | {shape}"
    found = _memo.get(key)
    if found is None:
        with _lock:
            found = _memo.get(key)
            if found is None:
                entry = _read().get(key)
                if not (isinstance(entry, dict) and isinstance(entry.get("on"), bool)):
                    on, why = decide(*measure())
                    if not on:  # a moment's load can last a whole comparison: off only if it loses twice
                        on, why = decide(*measure())
                    entry = {"on": on, "why": why}
                    _write(key, entry)
                found = _memo[key] = Choice(entry["on"], isa, str(entry.get("why", "")))
        _memo[(lib.build, shape, switch)] = found
    return _note(kernel, found)


def _note(kernel: str, choice: Choice) -> Choice:
    _tick[0] += 1
    _consulted[(kernel, choice.on, choice.isa)] = (_tick[0], choice)
    return choice


def mark() -> int:
    """A point in the process's consultations: :func:`report` with it gives only those made after it."""
    return _tick[0]


def report(since: int = 0) -> dict[str, str]:
    """The choices of every kernel consulted after `since` (:func:`mark`), for a run's statistics:
    ``{"native_<kernel>": "on|off, <isa>, <why>"}``, where shape classes of one run were chosen differently, each
    outcome (on or off, the build) with its last reason, joined by ``; ``."""
    found: dict[str, list[tuple[int, Choice]]] = {}
    for (kernel, _, _), (tick, choice) in _consulted.items():
        if tick > since:
            found.setdefault(kernel, []).append((tick, choice))
    return {f"native_{kernel}": "; ".join(c.describe() for _, c in sorted(found[kernel], key=lambda x: x[0]))
            for kernel in sorted(found)}


def summary(since: int = 0) -> str:
    """:func:`report` in one line for a benchmark's table: ``<kernel>: on|off, <isa>, <why>`` joined by ``; ``, or
    ``-`` where no kernel was consulted."""
    return "; ".join(f"{k.removeprefix('native_')}: {v}" for k, v in report(since).items()) or "-"


def forget() -> None:
    """Drops the choices this process holds (not the file's): the next consultation reads the file again."""
    with _lock:
        _memo.clear()
        _consulted.clear()
