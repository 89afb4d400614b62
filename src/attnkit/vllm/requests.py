"""Which request each row of a batch is, and the plan of each, on both sides of the engine (no vLLM import).

vLLM tells neither its KV-cache managers nor its attention backends which request carries which method: the
managers see a request id and a prompt length, the attention metadata sees rows. Two small hooks
(:mod:`attnkit.vllm.patches`) fill that in:

- scheduler: when the scheduler looks a request up in the prefix cache (every request does, once per
  admission), :func:`record_request` notes its ``extra_args['attnkit']``, and :func:`scheduler_plan` gives
  the managers the request's plan from its id;
- worker: while the model runner builds a step's attention metadata, :func:`batch_rows` reads the runner's
  own table of the batch's requests (id, prompt, sampling parameters) row by row.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from attnkit.methods.base import Method
from attnkit.vllm.config import KEY, EngineConfig
from attnkit.vllm.plan import Plan, plan_for

# generated tokens of a request that sets no max_tokens
UNBOUNDED = 1 << 40

# request id -> (its extra_args['attnkit'] (None: the engine's recipe), its max_tokens): whether a method evicts at
# all may depend on how many tokens a request generates, so both sides plan with the same count
_scheduled: dict[str, tuple] = {}
_engine: list[EngineConfig] = []  # the scheduler's engine config, set by its KV-cache manager
_runner = contextvars.ContextVar("attnkit_vllm_runner", default=None)


def request_spec(sampling_params):
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get(KEY)


def max_tokens_of(sampling_params) -> int:
    value = getattr(sampling_params, "max_tokens", None)
    return UNBOUNDED if value is None else value


def record_request(request) -> None:
    """Note the attnkit spec and the token count a request gives (scheduler side)."""
    _scheduled[request.request_id] = (request_spec(request.sampling_params), max_tokens_of(request.sampling_params))


def forget_request(request_id: str) -> None:
    _scheduled.pop(request_id, None)


def set_scheduler_engine(engine: EngineConfig) -> None:
    _engine[:] = [engine]


def refuses_prefix_hit(request) -> bool:
    """Whether a request's plan compacts or frees its blocks, so that it must not take cached ones."""
    if not _engine:
        return False
    plan = scheduler_plan(_engine[0], request.request_id, request.num_prompt_tokens)
    return plan is not None and not plan.plain


def scheduler_plan(engine: EngineConfig, request_id: str, prompt_len: int | None) -> Plan | None:
    """The plan the scheduler frees a request's blocks by (None: the request is unknown to attnkit)."""
    if prompt_len is None or request_id not in _scheduled:
        return None
    spec, max_tokens = _scheduled[request_id]
    return plan_for(engine.request_method(spec), prompt_len, max_tokens, n_layers=1)


@dataclass(frozen=True)
class Row:
    """One row of a step's batch: its request, method and plan, and the positions its tokens take."""

    request_id: str
    method: Method
    plan: Plan
    max_tokens: int
    start: int  # position of the row's first token in this step
    tokens: int  # tokens the row computes in this step

    @property
    def kernel_prompt(self) -> bool:
        """Whether vLLM's kernel computes this request's prompt outputs (plain dense attention: the method only
        observes and compresses) while the method's hooks run beside it."""
        return self.plan.hooks and self.method.dense_prefill_output()

    @property
    def in_prompt(self) -> bool:
        return self.start < self.plan.prompt_len

    @property
    def kept_queries(self) -> int | None:
        """For a live row decoding one token on a step that cannot compress: the recent queries its method keeps
        (the step runs as plain attention, batched with the other rows, and the method catches up later:
        :mod:`attnkit.vllm.live`); None: the method's hooks must run on this step."""
        plan = self.plan
        if not plan.live or self.tokens != 1 or self.in_prompt or plan.compresses_at(self.start):
            return None
        return getattr(self.method, "decode_queries_kept", lambda: None)()


def set_runner(runner):
    return _runner.set(runner)


def reset_runner(token) -> None:
    _runner.reset(token)


def known_requests() -> set[str]:
    """The ids of every request the model runner holds (running, waiting for a step or preempted), so that a
    worker keeps a request's state while it sits out a step and drops it once the request is gone."""
    runner = _runner.get()
    if runner is None:
        raise RuntimeError("attnkit: attention metadata built outside the model runner's _build_attention_metadata")
    return set(runner.requests)


def batch_rows(engine: EngineConfig, n_layers: int, starts: list[int], tokens: list[int]) -> list[Row]:
    """The rows of the step whose metadata is being built (the runner's batch order), with their plans."""
    runner = _runner.get()
    if runner is None:
        raise RuntimeError("attnkit: attention metadata built outside the model runner's _build_attention_metadata")
    ids = runner.input_batch.req_ids
    rows = []
    for i, (start, count) in enumerate(zip(starts, tokens)):
        state = runner.requests[ids[i]]
        params = state.sampling_params
        method = engine.request_method(request_spec(params))
        max_tokens = max_tokens_of(params)
        plan = plan_for(method, state.num_prompt_tokens, max_tokens, n_layers)
        rows.append(Row(ids[i], method, plan, max_tokens, start, count))
    return rows
