"""attnkit's C++ kernels for the CPU: built the first time a process needs one, cached per machine, called through
:mod:`ctypes`.

Each kernel is one plain C++17 file here (GCC/Clang vector extensions, ``std::thread``) with a C entry point, and
``tile.h`` holds what they share (16-float vectors, their exponential, FlashAttention's micro-tiles). They use
neither torch's nor Python's headers, so one compiler call builds each: the system's compiler (``$CXX``, else
``c++``, ``g++`` or ``clang++``), for the machine it runs on (``-march=native``, retried without where the compiler
refuses it). ``torch.utils.cpp_extension`` would compile against both sets of headers and needs ninja, for nothing
the kernels use. A build goes to ``$ATTNKIT_CACHE_DIR`` (default ``~/.cache/attnkit``) under a name that hashes the
sources, the compiler's path, the flags and the CPU's features, so a home directory shared by different machines
keeps one build per kind of machine, and processes building at once each install a whole library (an atomic
rename). Without a compiler, or with ``ATTNKIT_NATIVE=0``, :func:`load` returns None and its callers run torch
operations instead (one warning per kernel says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

FOLDER = Path(__file__).parent
ENV_SWITCH = "ATTNKIT_NATIVE"  # 0: never build or use the kernels
ENV_CACHE = "ATTNKIT_CACHE_DIR"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread")
TUNE = ("-march=native",)  # dropped when the compiler refuses it

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}
_failures: dict[str, str] = {}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cpu() -> str:
    """What a build depends on besides the sources and the compiler: the architecture and the CPU's features."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def _build(name: str) -> Path:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++ or clang++)")
    source = FOLDER / f"{name}.cpp"
    parts = [source.read_bytes(), (FOLDER / "tile.h").read_bytes(), compiler.encode(), " ".join(FLAGS + TUNE).encode(),
             _cpu().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    folder = Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "attnkit") / "kernels"
    target = folder / f"{name}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    error = ""
    for tune in (TUNE, ()):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        done = subprocess.run([compiler, *FLAGS, *tune, f"-I{FOLDER}", str(source), "-o", tmp], capture_output=True,
                              text=True)
        if done.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        error = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
    raise RuntimeError(f"{compiler} could not build {source.name}: {error}")


def load(name: str, signature: tuple[str, list, type] | None = None) -> ctypes.CDLL | None:
    """The kernel ``<name>.cpp`` compiled and loaded (built on the first call), or None where it cannot be
    (``ATTNKIT_NATIVE=0``, no compiler, a failed build: one warning says which). `signature`: the entry point's
    name, argument types and result type, set once when the library is loaded."""
    with _lock:
        if name in _libraries or name in _failures:
            return _libraries.get(name)
        if os.environ.get(ENV_SWITCH, "1") == "0":
            _failures[name] = f"{ENV_SWITCH}=0"
            return None
        try:
            lib = ctypes.CDLL(str(_build(name)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _failures[name] = str(exc)
            warnings.warn(f"attnkit: the C++ kernel {name!r} is not available ({exc}); torch operations run instead "
                          f"(slower, same results)", RuntimeWarning, stacklevel=3)
            return None
        if signature is not None:
            entry, argtypes, restype = signature
            getattr(lib, entry).argtypes = argtypes
            getattr(lib, entry).restype = restype
        _libraries[name] = lib
        return lib
