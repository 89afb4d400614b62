"""The vLLM tests under pytest-xdist (``./run test``: two workers): each worker keeps to its own share of the cores,
and so do the vLLM engines it starts (``VLLM_CPU_OMP_THREADS_BIND``), so that one worker's engine never waits on a
thread that the other's has taken: vLLM's CPU workers bind one thread per core and wait for each other every step.
A module's tests run on one worker (``--dist loadfile``), so that its engines are started once."""

import os
import sys

import pytest
import torch


def _share() -> list[int] | None:
    """This xdist worker's cores: the process's cores split evenly by worker; None outside xdist or with fewer cores
    than workers."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if not worker or count < 2 or len(cores) < count:
        return None
    k, n = int(worker.removeprefix("gw")), len(cores)
    return cores[k * n // count:(k + 1) * n // count]


SHARE = _share()
if SHARE:
    os.sched_setaffinity(0, SHARE)  # the engines and servers this worker starts inherit it
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, SHARE))
    torch.set_num_threads(len(SHARE))


@pytest.fixture(scope="module", autouse=True)
def fresh_vllm_settings():
    """Each module's engines read vLLM's environment variables anew: vLLM caches them once an engine of the process
    has started (``vllm.envs.enable_envs_cache``), and a module run after another's in the same worker sets its own
    (the tensor-parallel test's thread binding)."""
    settings = sys.modules.get("vllm.envs")
    if settings is not None:
        settings.disable_envs_cache()
