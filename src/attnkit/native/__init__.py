"""attnkit's C++ kernels for the CPU: built the first time a process needs one, cached per machine, called through
:mod:`ctypes`.

Each kernel is one plain C++17 file here (GCC/Clang vector extensions, ``std::thread`` or OpenMP) with a C entry
point, and ``tile.h`` holds what they share (vectors of the target's register width, their exponential, FlashAttention's
micro-tiles, sized at build time for the instruction set: 32 registers of 16 floats with AVX-512, 16 of 8 with AVX2).
They use neither torch's nor Python's headers, so one compiler call builds each: the system's compiler (``$CXX``,
else ``c++``, ``g++`` or ``clang++``) for the instruction set ``$ATTNKIT_NATIVE_ISA`` names (:data:`ISAS`):
``native`` (the default: the machine it runs on, ``-march=native``, retried without where the compiler refuses it),
``avx2`` or ``avx512`` (x86-64; refused in one line on a CPU without them), so both builds can be measured on one
machine. ``torch.utils.cpp_extension`` would compile against both sets of headers and needs ninja, for nothing the
kernels use. A build goes to ``$ATTNKIT_CACHE_DIR`` (default ``~/.cache/attnkit``) under a name that hashes the
sources, the compiler's path, the flags and the CPU's features, so a home directory shared by different machines
keeps one build per kind of machine, and processes building at once each install a whole library (an atomic
rename). Without a compiler, or with ``ATTNKIT_NATIVE=0``, :func:`load` returns None and its callers run torch
operations instead (one warning per kernel says why). Whether a built kernel runs is :mod:`attnkit.native.guard`'s
decision (a timed comparison with the torch path, once per machine and shape class, unless ``ATTNKIT_NATIVE=1``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.validate import choice

FOLDER = Path(__file__).parent
ENV_SWITCH = "ATTNKIT_NATIVE"  # 0: never build or use the kernels; 1: always where built; unset: the guard decides
ENV_ISA = "ATTNKIT_NATIVE_ISA"
ENV_CACHE = "ATTNKIT_CACHE_DIR"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread")
# a kernel's own flags, dropped where the compiler refuses them: the kernels run on OpenMP's threads (torch's pool
# where torch links the same runtime); without, decode serially and the others on threads of their own (run_workers)
OWN_FLAGS = {name: ("-fopenmp",) for name in ("decode", "scoring", "sparse", "paged")}
# the compiler's target per instruction set; `native` is dropped when the compiler refuses it
ISAS = {"native": ("-march=native",), "avx2": ("-mavx2", "-mfma"),
        "avx512": ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma")}
NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl")}  # /proc/cpuinfo flags
WIDTHS = {16: "avx512", 8: "avx2", 4: "128-bit"}  # a build's vector width in floats -> what it runs

_lock = threading.Lock()
_libraries: dict[tuple[str, str], ctypes.CDLL] = {}
_failures: dict[tuple[str, str], str] = {}
_resolved: dict[tuple, str] = {}  # (the ISA asked for, $ATTNKIT_NATIVE, $ATTNKIT_NATIVE_ISA) -> the ISA, "": off


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: ``$CXX``, else ``c++``, ``g++`` or ``clang++`` on the PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def _cpuinfo(field: tuple[str, ...]) -> str:
    """The first line of ``/proc/cpuinfo`` starting with one of `field`, after its colon (read once a process)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in info.splitlines() if line.startswith(field)), "")
    return line.partition(":")[2].strip()


def _cpu() -> str:
    """What a build depends on besides the sources and the compiler: the architecture and the CPU's features."""
    return f"{platform.machine()} {_cpuinfo(('flags', 'Features')) or platform.processor()}"


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else the platform's) and a digest of its features: what a choice
    measured on this machine holds for."""
    name = _cpuinfo(("model name", "Model name", "CPU part")) or platform.processor() or platform.machine()
    return f"{name} [{hashlib.sha256(_cpu().encode()).hexdigest()[:8]}]"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` names them (empty where it cannot be read)."""
    return frozenset(_cpuinfo(("flags", "Features")).split())


def isa(name: str | None = None) -> str:
    """The instruction set to build for: `name`, else ``$ATTNKIT_NATIVE_ISA``, else ``native``; one of
    :data:`ISAS`, and one this CPU runs (an x86-64 CPU with the flags of :data:`NEEDS`), else a one-line
    :class:`AttnkitError`."""
    chosen = name if name is not None else os.environ.get(ENV_ISA) or "native"
    choice(ENV_ISA, chosen, ISAS)
    missing = [flag for flag in NEEDS.get(chosen, ()) if flag not in cpu_flags()]
    if chosen in NEEDS and (missing or platform.machine().lower() not in ("x86_64", "amd64")):
        allowed = ", ".join(i for i in ISAS if i not in NEEDS or all(f in cpu_flags() for f in NEEDS[i]))
        lacks = ", ".join(missing) or f"x86-64 (this is {platform.machine()})"
        raise AttnkitError(f"{ENV_ISA}={chosen}: this CPU lacks {lacks}; allowed here: {allowed}")
    return chosen


def runnable() -> list[str]:
    """The instruction sets of :data:`ISAS` this CPU runs (``native`` always)."""
    found = []
    for name in ISAS:
        try:
            found.append(isa(name))
        except AttnkitError:
            pass
    return found


def _build(name: str, target_isa: str) -> Path:
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++ or clang++)")
    source = FOLDER / f"{name}.cpp"
    tune = ISAS[target_isa]
    own = OWN_FLAGS.get(name, ())
    parts = [source.read_bytes(), (FOLDER / "tile.h").read_bytes(), cxx.encode(), " ".join(FLAGS + tune + own).encode(),
             _cpu().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    folder = cache_folder()
    target = folder / f"{name}-{target_isa}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    error = ""
    tries = [tune + own, tune] if own else [tune]
    tries += [flags[len(tune):] for flags in tries] if target_isa == "native" else []  # -march=native refused
    for flags in tries:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        done = subprocess.run([cxx, *FLAGS, *flags, f"-I{FOLDER}", str(source), "-o", tmp], capture_output=True,
                              text=True)
        if done.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        lines = done.stderr.strip().splitlines()  # the compiler's first error, else its last line
        error = next((line.strip() for line in lines if "error" in line), lines[-1].strip() if lines else
                     f"exit {done.returncode}")
    raise RuntimeError(f"{cxx} could not build {source.name} for {target_isa}: {error}")


def cache_folder() -> Path:
    """Where builds (and the guard's choices) are kept: ``$ATTNKIT_CACHE_DIR/kernels``, default
    ``~/.cache/attnkit/kernels``."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "attnkit") / "kernels"


def switch() -> str:
    """``$ATTNKIT_NATIVE``: ``0`` (never), ``1`` (always, where built) or ``auto`` (unset: the guard decides)."""
    return choice(ENV_SWITCH, os.environ.get(ENV_SWITCH) or "auto", ("0", "1", "auto"))


def load(name: str, signature: tuple[str, list, type] | None = None, target_isa: str | None = None
         ) -> ctypes.CDLL | None:
    """The kernel ``<name>.cpp`` compiled for `target_isa` (None: :func:`isa`) and loaded (built on the first
    call), or None where it cannot be (``ATTNKIT_NATIVE=0``, no compiler, a failed build: one warning says which).
    `signature`: the entry point's name, argument types and result type, set once when the library is loaded."""
    asked = (target_isa, os.environ.get(ENV_SWITCH), os.environ.get(ENV_ISA))
    resolved = _resolved.get(asked)  # a per-step caller asks on every layer and step: the variables checked once
    if resolved is None:
        resolved = _resolved[asked] = "" if switch() == "0" else isa(target_isa)
    if not resolved:
        return None
    target_isa = resolved
    lib = _libraries.get((name, target_isa))
    if lib is not None and (signature is None or getattr(lib, signature[0]).argtypes is not None):
        return lib
    with _lock:
        key = (name, target_isa)
        if key in _failures:
            return None
        lib = _libraries.get(key)
        if lib is None:
            try:
                path = _build(name, target_isa)
                lib = ctypes.CDLL(str(path))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _failures[key] = str(exc)
                warnings.warn(f"attnkit: the C++ kernel {name!r} is not available ({exc}); torch operations run "
                              f"instead (slower, same results)", RuntimeWarning, stacklevel=3)
                return None
            lib.attnkit_vector_width.restype = ctypes.c_int
            lib.attnkit_vector_width.argtypes = []
            lib.build = path.stem  # what the guard's choices are keyed by: the kernel, its ISA, its sources and flags
            _libraries[key] = lib
        if signature is not None and getattr(lib, signature[0]).argtypes is None:
            entry, argtypes, restype = signature
            getattr(lib, entry).argtypes = argtypes
            getattr(lib, entry).restype = restype
        return lib


def built_isa(lib: ctypes.CDLL) -> str:
    """The instruction set a loaded kernel's vectors were built for (``avx512``, ``avx2``, ``128-bit``: SSE or
    NEON), from the width it reports."""
    width = lib.attnkit_vector_width()
    return WIDTHS.get(width, f"{width * 32}-bit")


@contextmanager
def settings(isa_name: str | None = None, native: str | None = None) -> Iterator[None]:
    """The block run with ``$ATTNKIT_NATIVE_ISA`` = `isa_name` and ``$ATTNKIT_NATIVE`` = `native` (None: as they
    are), both restored after: how a benchmark runs both builds and the torch path in one process."""
    if isa_name is not None:
        isa(isa_name)
    if native is not None:
        choice(ENV_SWITCH, native, ("0", "1", "auto"))
    saved = {name: os.environ.get(name) for name in (ENV_ISA, ENV_SWITCH)}
    try:
        for name, value in ((ENV_ISA, isa_name), (ENV_SWITCH, native)):
            if value is not None:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
