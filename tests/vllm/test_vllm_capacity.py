"""vLLM's own block pool under attnkit: compression hands blocks back (after a prompt and while decoding), the
scheduler gets each request's plan, preempted requests recompute to attnkit's tokens, and the planned admission
spares compressed requests their preemptions. One attnkit engine of its own, configured as ``test_vllm.py``'s (96
blocks of 128 tokens, prompts chunked by 1024), so that these long tests run on the other pytest-xdist worker
beside that module's."""

import pytest
from test_vllm import ATTNKIT, BLOCKS, KVZAP, Output, assert_same_tokens, in_process_engines, params, shut_down, tokens

import attnkit
from attnkit.eval.data.task_registry import get_task
from attnkit.methods.base import resolve_method
from attnkit.vllm.stats import SchedulerWatch


@pytest.fixture(scope="module")
def model():
    return attnkit.load_model("tiny")


@pytest.fixture(scope="module")
def engine():
    (ours,) = in_process_engines(dict(ATTNKIT, disable_log_stats=False))
    ours.watch = SchedulerWatch.attach(ours)  # vLLM's own scheduler statistics of this engine
    yield ours
    shut_down(ours)


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


def test_a_kvzap_request_preempted_mid_decode_recomputes_to_the_same_tokens(engine, model, monkeypatch):
    """kvzap scores each entry from its layer's input: a request preempted after hundreds of generated tokens (five
    whole requests growing past the 96 blocks preempt the last admitted, the kvzap one) recomputes its prompt and
    generated tokens in one prefill, the inputs of each noted again, and still gives attnkit's whole output."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted, preempt = [], Scheduler._preempt_request

    def noting(self, request, *args, **kwargs):
        preempted.append((request.request_id, request.num_computed_tokens - request.num_prompt_tokens))
        return preempt(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_preempt_request", noting)
    prompts = [get_task("passkey").make(model.tokenizer, n, seed=60 + i).prompt for i, n in enumerate([2000] * 5 + [300])]
    spec = f"kvzap:config={KVZAP},budget_tokens=256,decode_every=64"
    specs, news = ["full"] * 5 + [spec], [400] * 5 + [600]  # whole: 16 blocks each, 19 at the end; kvzap: 3-4
    out = tokens(engine.generate(prompts, [params(s, max_tokens=n) for s, n in zip(specs, news)], use_tqdm=False))
    mine = [generated for rid, generated in preempted if rid.rsplit("-", 1)[0] == out[-1].request_id]
    assert mine and min(mine) >= 2 * 64, preempted  # after two compressions at least
    assert_same_tokens([out[-1]], model, [prompts[-1]], spec, max_tokens=news[-1], engine=engine)


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
