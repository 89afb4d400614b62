"""Which request each row of a batch is, and the plan of each, on both sides of the engine (no vLLM import).

vLLM tells neither its KV-cache managers nor its attention backends which request carries which method: the
managers see a request id and a prompt length, the attention metadata sees rows. Small hooks
(:mod:`attnkit.vllm.patches`) fill that in:

- scheduler: when the scheduler looks a request up in the prefix cache, and every time it gives a request slots
  (no request runs without), the engine's :class:`ScheduledRequests` notes its ``extra_args['attnkit']``, and
  gives the managers the request's plan from its id (a request it never noted is an error);
- worker: while the model runner builds a step's attention metadata, :func:`batch_rows` reads the runner's
  own table of the batch's requests (id, prompt, sampling parameters) row by row.

Both sides keep their state on vLLM's own objects (the scheduler's KV-cache managers, the model runner), never in
module globals, so that two engines in one process never judge each other's requests.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from attnkit.methods.base import Method
from attnkit.vllm.config import KEY, EngineConfig
from attnkit.vllm.plan import Plan, plan_for

# generated tokens of a request that sets no max_tokens
UNBOUNDED = 1 << 40

_runner = contextvars.ContextVar("attnkit_vllm_runner", default=None)


def request_spec(sampling_params):
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get(KEY)


def max_tokens_of(sampling_params) -> int:
    value = getattr(sampling_params, "max_tokens", None)
    return UNBOUNDED if value is None else value


class ScheduledRequests:
    """The scheduler's side of one engine: each request's ``extra_args['attnkit']`` (None: the engine's recipe) and
    its token count, noted when the scheduler looks it up in the prefix cache and again whenever it gives it slots
    (:mod:`attnkit.vllm.patches`), so that no request is scheduled without them; whether a method evicts at all may
    depend on how many tokens a request generates, so both sides plan with the same count."""

    def __init__(self, engine: EngineConfig):
        self.engine = engine
        self.known: dict[str, tuple] = {}
        self.computed: dict[str, int] = {}  # tokens computed when the scheduler last gave the request slots

    def record(self, request) -> None:
        self.known[request.request_id] = (request_spec(request.sampling_params),
                                          max_tokens_of(request.sampling_params), request.num_prompt_tokens)
        self.computed[request.request_id] = request.num_computed_tokens

    def forget(self, request_id: str) -> None:
        self.known.pop(request_id, None)
        self.computed.pop(request_id, None)

    def plan(self, request_id: str, prompt_len: int | None) -> Plan | None:
        """The plan the scheduler frees a request's blocks by (None before its prompt length is known). A request
        the scheduler never noted is an error, not a plain request: its blocks would never be freed."""
        if prompt_len is None:
            return None
        if request_id not in self.known:
            raise RuntimeError(f"attnkit: request {request_id!r} reached the KV-cache manager without passing the "
                               f"wrapped slot allocation (vLLM took it by a path the plugin does not wrap); its plan "
                               f"is unknown")
        spec, max_tokens, _ = self.known[request_id]
        return plan_for(self.engine.request_method(spec), prompt_len, max_tokens, n_layers=1)

    def peak_blocks(self, request_id: str, block_size: int) -> int | None:
        """:meth:`Plan.peak_blocks` of a request this engine noted, from the tokens it had computed when last given
        slots (None: unknown, or its plan frees nothing)."""
        if request_id not in self.known:
            return None
        _, max_tokens, prompt_len = self.known[request_id]
        return self.plan(request_id, prompt_len).peak_blocks(block_size, max_tokens, self.computed[request_id])

    def refuses_prefix_hit(self, request) -> bool:
        """Whether a request's plan compacts or frees its blocks, so that it must not take cached ones."""
        plan = self.plan(request.request_id, request.num_prompt_tokens)
        return plan is not None and not plan.shares_prefix


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
    def quest_prompt(self) -> bool:
        """Whether this is a quest request's prompt chunk and nothing else: vLLM's kernel computes it alone."""
        return self.plan.pages and self.start + self.tokens <= self.plan.prompt_len

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


def runner_state(make):
    """The attnkit state of the model runner building this step's metadata (``make()`` the first time): kept on the
    runner, so that each engine's worker has its own."""
    runner = _current_runner()
    state = getattr(runner, "_attnkit_state", None)
    if state is None:
        state = runner._attnkit_state = make()
    return state


def current_model():
    """The model of the model runner building this step's metadata."""
    return _current_runner().get_model()


def _current_runner():
    runner = _runner.get()
    if runner is None:
        raise RuntimeError("attnkit: attention metadata built outside the model runner's _build_attention_metadata")
    return runner


def known_requests() -> set[str]:
    """The ids of every request the model runner holds (running, waiting for a step or preempted), so that a
    worker keeps a request's state while it sits out a step and drops it once the request is gone."""
    return set(_current_runner().requests)


def batch_rows(engine: EngineConfig, n_layers: int, starts: list[int], tokens: list[int]) -> list[Row]:
    """The rows of the step whose metadata is being built (the runner's batch order), with their plans."""
    runner = _current_runner()
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
