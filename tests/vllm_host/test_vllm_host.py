"""The vLLM host's layout logic on plain tensors (no engine): plans, the layout map of the paged cache, and one
request's attention over a paged store, against attnkit's own runner."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit.cache import KVCache
from attnkit.errors import AttnkitError
from attnkit.methods.base import resolve_method
from attnkit.methods.observed_attention import ObservedAttention
from attnkit.rope import Rope
from attnkit.session import Session, Step
from attnkit.vllm import host, paged
from attnkit.vllm.config import EngineConfig
from attnkit.vllm.plan import plan_for
from attnkit.vllm.requests import Row


def test_plans_follow_the_method_and_the_prompt():
    snap = plan_for(resolve_method("snapkv:budget_tokens=300"), 1000, 50, 6)
    assert (snap.kept, snap.base, snap.plain) == (300, 700, False)
    assert snap.visible(500) == [(0, 501)] and snap.visible(1010) == [(700, 1011)]
    assert snap.freeable(999) == [] and snap.freeable(1000) == [(0, 700)]
    assert plan_for(resolve_method("snapkv:budget_tokens=2000"), 1000, 50, 6).plain  # nothing to evict
    stream = plan_for(resolve_method("streaming:budget_tokens=300,sinks=4"), 1000, 50, 6)
    assert stream.visible(1000) == [(700, 704), (705, 1001)]  # sinks, then the last 296 positions
    assert stream.freeable(1200) == [(0, 700), (704, 905)]
    window = plan_for(resolve_method("window:window=100"), 1000, 50, 6)
    assert window.visible(10) == [(0, 11)] and window.visible(500) == [(401, 501)]
    assert window.freeable(500) == [(0, 401)]
    assert plan_for(resolve_method("window:window=1050"), 1000, 50, 6).plain
    sparse = plan_for(resolve_method("minference+snapkv:budget=0.5"), 1000, 50, 6)
    assert sparse.hooks and sparse.kept == 500


@pytest.mark.parametrize("spec", ["snapkv:budget_tokens=512,decode_every=128", "h2o:budget_tokens=300",
                                  "keyformer:budget_tokens=300,decode_every=50", "streaming:budget_tokens=400",
                                  "window:window=500", "snapkv:budget_tokens=256", "full",
                                  "quest:page_size=128,token_budget=256", "minference",
                                  "knorm:budget_tokens=256,decode_every=64,decode_fraction=0.2"])
def test_a_plans_peak_blocks_are_the_most_it_holds_from_then_on(spec):
    """What the scheduler reserves for a request (``admission: planned``): from each point of its life, the most
    blocks its plan holds at once later on, worked out by stepping through every position; None where the plan
    frees nothing (vLLM's own admission)."""
    for n, new in ((300, 3000), (1000, 2500), (2000, 40), (100, 700)):
        plan = plan_for(resolve_method(spec), n, new, 1)
        frees = plan.live or plan.kept is not None or plan.window is not None
        assert frees == (spec not in ("full", "minference") and not spec.startswith("quest")
                         and (n, spec) != (100, "snapkv:budget_tokens=256"))  # a 100-token prompt: nothing evicted
        if not frees:
            assert plan.peak_blocks(128, new) is None
            continue
        held = [plan.blocks_held(c, 128) for c in range(n, n + new - 1)]
        for computed in range(0, n + new - 1, 5):
            later = held[max(0, computed - n):] + ([-(-n // 128)] if computed < n else [])
            assert plan.peak_blocks(128, new, computed) == max(later), (n, new, computed)
        if (plan.live or plan.window) and new > 2000:  # a bounded plan holds far less than the whole request
            assert plan.peak_blocks(128, new) <= -(-(n + new) // 128) // 2


def test_engine_configs_refuse_what_vllm_cannot_run_in_one_line():
    assert EngineConfig.parse({}) is None
    config = EngineConfig.parse({"attnkit": {"recipe": "minference+snapkv:budget=0.3"}})
    assert set(config.allow) == {"minference", "snapkv", "full"}
    assert EngineConfig.from_json(config.to_json()) == config and config.admission == "planned"
    vllm_rule = EngineConfig.parse({"attnkit": {"recipe": "snapkv:budget=0.3", "admission": "vllm"}})
    assert EngineConfig.from_json(vllm_rule.to_json()).admission == "vllm"
    with pytest.raises(AttnkitError, match="admission.*'planned', 'vllm', got 'greedy'"):
        EngineConfig.parse({"attnkit": {"recipe": "snapkv:budget=0.3", "admission": "greedy"}})
    for bad in ("quest", "snapkv:budget=0.3,decode_budget=64", "snapkv:budget=[0.3,0.3,0.3,0.3,0.3,0.3]",
                "h2o:budget=0.3,layer_budgets=pyramid", "streaming:budget_tokens=64,positions=reindex",
                "kvzip:budget=0.3", "snapkv:budget=0.3+kivi:bits=4", f"kvzap:config={KVZAP},threshold=-4",
                f"fastkvzip:config={SWEEPS / 'fastkvzip_tiny.safetensors'},budget=0.3",
                "snapkv:budget=0.3,head_budgets=adaptive"):
        with pytest.raises(AttnkitError) as info:
            EngineConfig.parse({"attnkit": {"recipe": bad}})
        assert "\n" not in str(info.value)
    with pytest.raises(AttnkitError, match="not allowed by this engine"):
        config.request_method("streaming:budget_tokens=64")


def transposed_store(key, value, key_cache, value_cache, slots):
    """A stand-in for vLLM's write op whose key blocks are stored transposed, as its "vec" path does."""
    block = key_cache.shape[2]
    for t, slot in enumerate(slots.tolist()):
        b, off = divmod(slot, block)
        kt = key_cache[b].reshape(key_cache.shape[1], -1).view(key_cache.shape[1], key_cache.shape[3], block)
        kt[:, :, off] = key[t]
        value_cache[b, :, off] = value[t]


def test_the_layout_map_reads_back_what_the_write_op_stored():
    layout = paged.learn_layout(("test-vec", 16, 8), transposed_store, paged.split_cache, 16, 8, 2, torch.float32)
    cache = torch.zeros(4, 2, 16, 16)
    keys, values = torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    block_row = torch.tensor([3, 0, 2])
    slots = torch.arange(40)
    k_cache, v_cache = paged.split_cache(cache)
    blocks, offsets = paged.physical_slots(block_row, slots, 16)
    transposed_store(keys, values, k_cache, v_cache, blocks * 16 + offsets)
    got_k, got_v = paged.gather(k_cache, v_cache, layout, block_row, torch.tensor([0, 17, 39, 5]))
    assert torch.equal(got_k[0], keys[[0, 17, 39, 5]].transpose(0, 1))
    assert torch.equal(got_v[0], values[[0, 17, 39, 5]].transpose(0, 1))
    for span in (range(3, 37), range(16, 32), range(39, 40), range(5, 5)):  # consecutive slots, read block by block
        run_k, run_v = paged.gather(k_cache, v_cache, layout, block_row, span)
        assert torch.equal(run_k[0], keys[span.start:span.stop].transpose(0, 1))
        assert torch.equal(run_v[0], values[span.start:span.stop].transpose(0, 1))


@pytest.mark.parametrize("order", [None, paged.TRANSPOSED, "permuted"])
def test_one_gather_of_many_requests_reads_each_heads_own_slots(order):
    """The stacked step's gather (attnkit.vllm.stacked): several requests' entries, each kv head at its own slots
    through its request's block table, in every layout kind the map describes, equal each request's own reads."""
    gen = torch.Generator().manual_seed(3)
    size, dim, kv = 16, 8, 2
    if order == "permuted":
        order = torch.randperm(size * dim, generator=gen)
    layout = paged.Layout(order, None)
    k_cache, v_cache = paged.split_cache(torch.randn(40, kv, 2 * size, dim, generator=gen))
    tables = torch.stack([torch.randperm(40, generator=gen)[:12] for _ in range(3)])
    # each request's entries in one run of slots (a few waiting in an earlier block), in no particular order
    slots = torch.stack([torch.stack([torch.randperm(60, generator=gen)[:50] + 20 * r + 10 for _ in range(kv)])
                         for r in range(3)])
    keys, values = paged.gather_heads(k_cache, v_cache, layout, tables, slots)
    for r in range(3):
        for h in range(kv):
            want_k, want_v = paged.gather(k_cache, v_cache, layout, tables[r], slots[r, h])
            assert torch.equal(keys[r, h], want_k[0, h]) and torch.equal(values[r, h], want_v[0, h])


class DictStore:
    """A request's slots as plain tensors (the PagedRequest protocol)."""

    def __init__(self, kv, d, size):
        self.k, self.v = torch.zeros(1, kv, size, d), torch.zeros(1, kv, size, d)

    def request(self, block_size=1):
        return host.PagedRequest(lambda s: (self.k[:, :, list(s)], self.v[:, :, list(s)]), self.write, self.heads,
                                 block_size)

    def heads(self, slots):  # [kv, n]: each kv head's own slots
        index = slots[None, :, :, None].expand(1, -1, -1, self.k.shape[-1])
        return self.k.gather(2, index), self.v.gather(2, index)

    def write(self, slots, keys, values):
        self.k[:, :, slots], self.v[:, :, slots] = keys, values


N, NEW = 80, 20
SWEEPS = Path(__file__).parents[2] / "sweeps"
KVZAP = SWEEPS / "kvzap_tiny.safetensors"
ENGINE = dict(model=str(Path(attnkit.__file__).parent / "assets" / "tiny"), dtype="float32", enforce_eager=True,
              max_model_len=4096)


def assert_host_outputs(row, got, expected):
    """The host's outputs are attnkit's, except the prompt's where vLLM's kernel computes them (dense attention,
    :attr:`Row.kernel_prompt`): the host leaves zeros there, which the backend does not write."""
    first = N if row.kernel_prompt else 0
    torch.testing.assert_close(got[:, :, first:], expected[:, :, first:], rtol=1e-5, atol=1e-5)
    assert row.kernel_prompt == (not bool(got[:, :, :N].any()))


def session_reference(method, seed: int, rope=None, hidden=None):
    """Random q, k, v of a 100-token layer call and what attnkit's own session computes for it: the 80-token
    prompt in one prefill step, then the 20 generated tokens one decode step each (each step handed its tokens' rows
    of `hidden`, the layer's input hidden states, where given)."""
    torch.manual_seed(seed)
    q, k, v = torch.randn(1, 4, N + NEW, 16), torch.randn(1, 2, N + NEW, 16), torch.randn(1, 2, N + NEW, 16)
    session = Session(method, KVCache(1, 1), 1, N, NEW, rope)

    def step(phase, a, b):
        one = Step(session, phase, torch.arange(a, b))
        if hidden is not None:
            one.note_layer_input(0, hidden[None, a:b])
        return one.attention(0, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], 0.25, None)

    out = [step("prefill", 0, N)] + [step("decode", p, p + 1) for p in range(N, N + NEW)]
    return q, k, v, torch.cat(out, dim=2)


@pytest.mark.parametrize("spec", ["snapkv:budget_tokens=40", "streaming:budget_tokens=48,sinks=4", "window:window=30",
                                  "snapkv:budget_tokens=40,chunk_length=8", "knorm:budget_tokens=36,chunk_length=5",
                                  "minference+snapkv:budget_tokens=40"])
def test_a_recomputed_request_crossing_its_prompt_end_gets_attnkit_outputs(spec):
    """A preempted request recomputes prompt and generated tokens in one prefill: the host runs the hooks up to the
    prompt's end, compresses into the slots before the first generated token, then attends over what was kept,
    which is what attnkit's own session computes for the prompt and then one token at a time."""
    n, new, kv, d = N, NEW, 2, 16
    method = resolve_method(spec)
    q, k, v, expected = session_reference(method, 0)
    store = DictStore(kv, d, n + new)
    store.write(torch.arange(n + new), k, v)  # vLLM stores the step's keys at their slots before attention
    row = Row("r", method, plan_for(method, n, new, 1), new, 0, n + new)
    state = host.WorkerState()
    got = host.row_attention(row, host.LayerCall(0, 1, 0.25, None, state), q, k, v, store.request())
    assert_host_outputs(row, got, expected)
    assert "r" not in state.prefills.open  # the prompt's session closed after its last layer


def flash_store(key, value, key_cache, value_cache, slots):
    """vLLM's ``reshape_and_cache_flash`` on a CPU: entry t to its slot, caches in FlashAttention's convention
    ``[num_blocks, block_size, kv_heads, head_dim]``."""
    block = key_cache.shape[1]
    key_cache[slots // block, slots % block] = key
    value_cache[slots // block, slots % block] = value


def flash_request(kv_cache, block_row, monkeypatch):
    """One request's slots in a FlashAttention-layout cache, through attnkit's FlashAttention backend's own layout
    pieces (vLLM's CUDA op replaced by :func:`flash_store`)."""
    import inspect
    from types import SimpleNamespace

    from vllm import _custom_ops as ops

    from attnkit.vllm.flash import AttnkitFlashImpl

    # the op attnkit calls must exist in the installed vLLM with the arguments it passes (only its CUDA kernel is
    # missing here): a renamed or reshaped op fails these tests
    assert list(inspect.signature(ops.reshape_and_cache_flash).parameters) == [
        "key", "value", "key_cache", "value_cache", "slot_mapping", "kv_cache_dtype", "k_scale", "v_scale"]
    monkeypatch.setattr(ops, "reshape_and_cache_flash",
                        lambda k, v, kc, vc, slots, dtype, ks, vs: flash_store(k, v, kc, vc, slots))
    impl = SimpleNamespace(kv_cache_dtype="auto")
    layer = SimpleNamespace(_k_scale=1.0, _v_scale=1.0)
    key_cache, value_cache, layout, store = AttnkitFlashImpl.cache_layout(impl, layer, kv_cache)
    return host.PagedRequest(*paged.request_slots(key_cache, value_cache, layout, block_row, kv_cache.shape[2], store))


def test_flashattention_layout_reads_back_what_vllm_writes(monkeypatch):
    """Entries written the way vLLM's FlashAttention backend writes them (``kv_cache.transpose(1, 2).split(d, -1)``)
    are read back by attnkit's gather, and attnkit's writes land where that backend reads."""
    cache = torch.zeros(5, 2, 16, 16)
    block_row = torch.tensor([4, 1, 3])
    keys, values = torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    k_fa, v_fa = cache.transpose(1, 2).split(8, dim=-1)  # vLLM's own split
    slots = block_row[torch.arange(40) // 16] * 16 + torch.arange(40) % 16
    flash_store(keys, values, k_fa, v_fa, slots)
    request = flash_request(cache, block_row, monkeypatch)
    got_k, got_v = request.gather(torch.tensor([0, 17, 39, 5]))
    assert torch.equal(got_k[0], keys[[0, 17, 39, 5]].transpose(0, 1))
    assert torch.equal(got_v[0], values[[0, 17, 39, 5]].transpose(0, 1))
    new_k, new_v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    request.write(torch.tensor([20, 21, 2]), new_k, new_v)
    assert torch.equal(k_fa[1, 4], new_k[0, :, 0]) and torch.equal(v_fa[4, 2], new_v[0, :, 2])


@pytest.mark.parametrize("spec", ["snapkv:budget_tokens=40", "streaming:budget_tokens=48,sinks=4"])
def test_the_host_in_flashattention_layout_gets_attnkit_outputs(spec, monkeypatch):
    """The recompute case again, the request's slots in a FlashAttention-layout cache of scattered blocks."""
    n, new, kv, d = N, NEW, 2, 16
    method = resolve_method(spec)
    q, k, v, expected = session_reference(method, 1)
    request = flash_request(torch.zeros(12, kv, 16, 2 * d), torch.tensor([7, 2, 9, 0, 11, 5, 3]), monkeypatch)
    request.write(torch.arange(n + new), k, v)
    row = Row("f", method, plan_for(method, n, new, 1), new, 0, n + new)
    got = host.row_attention(row, host.LayerCall(0, 1, 0.25, None, host.WorkerState()), q, k, v, request)
    assert_host_outputs(row, got, expected)


LIVE_SPECS = ["h2o:budget_tokens=40", "tova:budget_tokens=40", "keyformer:budget_tokens=40",
              "keyformer:budget_tokens=40,score=shared", "keyformer:budget_tokens=40,positions=new", "h2o:budget_tokens=90", "snapkv:budget_tokens=40,decode_every=6",
              "knorm:budget_tokens=36,decode_every=7", "keydiff:budget_tokens=40,decode_every=5",
              "expected_attention:budget_tokens=40,decode_every=6", "rkv:budget_tokens=40,decode_every=8",
              "minference+h2o:budget_tokens=40", "snapkv:budget_tokens=40,decode_every=4,chunk_length=4",
              "h2o:budget_tokens=40,decode_every=6", "tova:budget_tokens=40,decode_every=5", "keyformer:budget_tokens=40,decode_every=6",
              "keyformer:budget_tokens=40,decode_every=4,noise=gaussian,tau_end=3.0",
              "knorm:budget_tokens=40,decode_every=4,decode_fraction=0.3"]


ROPE16 = Rope(inv_freq=1.0 / (100.0 ** (torch.arange(0, 16, 2).float() / 16)))  # expected_attention un-rotates


def live_calls(row_of, store, q, k, v, chunks, state, block_size=1, hidden=None):
    """Run a live request's layer calls over `chunks` (``(start, end)``, one forward each; None: a forward without
    the request), as vLLM does: the call's
    keys written at their slots first, every block of `block_size` slots wholly before the plan's run poisoned after
    each call (a read of a freed slot would show), the outputs of each call kept; with `hidden`, each call handed its
    tokens' layer inputs as the backend hands them over."""
    outs = []
    for chunk in chunks:
        state.begin_forward({"r"})
        if chunk is None:  # a forward without this request's rows (it sits the step out)
            continue
        start, end = chunk
        store.write(torch.arange(start, end), k[:, :, start:end], v[:, :, start:end])
        row = row_of(start, end - start)
        if row.kept_queries is not None:  # a step that cannot compress: plain attention, the method told later
            outs.append(host.visible_attention(row.plan, start, q[:, :, start:end], store.request(), 0.25))
            state.live.skipped("r", 0, start, q[0, :, start] if row.kept_queries else None,
                               None if hidden is None else hidden[start])
        else:
            inputs = None if hidden is None else (hidden[start:end], None)
            outs.append(host.row_attention(row, host.LayerCall(0, 1, 0.25, ROPE16, state), q[:, :, start:end],
                                           k[:, :, start:end], v[:, :, start:end], store.request(block_size), inputs))
        for lo, hi in row.plan.freeable(end):
            lo, hi = -(-lo // block_size) * block_size, hi // block_size * block_size
            store.k[:, :, lo:hi], store.v[:, :, lo:hi] = float("nan"), float("nan")
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("spec", LIVE_SPECS)
@pytest.mark.parametrize("chunking", ["stepwise", "stepwise in blocks of 8", "recomputed"])
def test_a_method_acting_while_decoding_gets_attnkit_outputs(spec, chunking):
    """Methods that evict while decoding (per step, buffered, re-compressing every N tokens) in the host: the prompt in
    two chunks then one token per forward, or all of it recomputed in one chunk after a preemption. Outputs equal
    attnkit's session's; the layer holds the plan's count in the run before the next slot (a per-step method's
    entries may wait in the run's first block: with blocks of 8 slots); every freed slot (block) is poisoned with NaN
    after each call, so a read of one would show."""
    n, new, kv, d = N, NEW, 2, 16
    block_size = 8 if "blocks" in chunking else 1
    method = resolve_method(spec)
    q, k, v, expected = session_reference(method, 2, ROPE16)
    plan = plan_for(method, n, new, 1)
    assert plan.live
    store = DictStore(kv, d, n + new)
    chunks = [(0, n + new)] if chunking == "recomputed" else [(0, 50), (50, n)] + [(p, p + 1) for p in range(n, n + new)]
    state = host.WorkerState()
    got = live_calls(lambda s, t: Row("r", method, plan, new, s, t), store, q, k, v, chunks, state, block_size)
    assert_host_outputs(Row("r", method, plan, new, 0, 1), got, expected)
    entry = state.live.open["r"]
    state, held = entry.layers[0], plan.held(n + new)
    if chunking != "recomputed" and plan.every > 1 and getattr(method, "decode_queries_kept", lambda: None)() is not None:
        # the steps that cannot compress ran as plain attention: the layer's state is that of the last compression
        assert state.end == n + new - (n + new - n) % plan.every and not entry.pending == (state.end == n + new)
        return
    floor = n + new - held
    if plan.every == 1:
        floor -= floor % block_size
    assert state.kv.length == held and int(state.slots.min()) >= floor
    for head in range(kv):
        slots = state.slots[head].tolist()
        assert len(set(slots)) == held and max(slots) < n + new
        assert not bool(store.k[0, head, slots].isnan().any())
    if block_size == 1:
        assert sorted(state.slots[0].tolist()) == list(range(n + new - held, n + new))
    assert plan.freeable(n + new) == [(0, n + new - held)]


def test_live_plans_count_what_each_method_holds():
    h2o = plan_for(resolve_method("h2o:budget_tokens=40"), 80, 20, 6)
    assert (h2o.kept, h2o.every, h2o.held(80), h2o.held(81), h2o.held(100)) == (40, 1, 40, 40, 40)
    short = plan_for(resolve_method("h2o:budget_tokens=40"), 30, 20, 6)
    assert [short.held(c) for c in (30, 35, 40, 41, 50)] == [30, 35, 40, 40, 40]
    keyformer = plan_for(resolve_method("keyformer:budget_tokens=40,score=shared"), 80, 20, 6)  # at the first token
    assert (keyformer.kept, keyformer.held(80), keyformer.held(81), keyformer.freeable(80)) == (None, 80, 40, [])
    snap = plan_for(resolve_method("snapkv:budget_tokens=40,decode_every=8"), 80, 20, 6)
    assert [snap.held(c) for c in (80, 81, 87, 88, 89, 96)] == [40, 41, 47, 40, 41, 40]
    assert snap.freeable(89) == [(0, 48)]
    assert not plan_for(resolve_method("snapkv:budget_tokens=100,decode_every=8"), 80, 20, 6).live  # never evicts
    assert plan_for(resolve_method("rkv:budget_tokens=40"), 80, 200, 6).every == 128


def test_runs_read_in_place_by_vllms_windowed_kernel_equal_the_gathered_attention():
    """Decode rows whose plan shows one run of slots ending at their own (compacted and windowed requests) are read in
    place by vLLM's CPU kernel with a sliding window of the run's length: the same outputs as attnkit's gathered
    attention over exactly those slots, with stale entries just before each run and NaN in freed blocks."""
    from types import SimpleNamespace

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from attnkit.vllm.cpu import AttnkitCPUImpl, AttnkitCPUMetadataBuilder

    torch.manual_seed(0)
    blocks, kv, size, d, heads = 40, 2, 16, 32, 8
    isa = _get_attn_isa(torch.float32, size, d)
    cache = torch.zeros(blocks, kv, size, 2 * d)
    k_cache, v_cache = paged.split_cache(cache)
    slots = torch.arange(blocks * size)
    ops.cpu_attn_reshape_and_cache(torch.randn(len(slots), kv, d), torch.randn(len(slots), kv, d), k_cache, v_cache,
                                   slots, isa)
    cache[0] = float("nan")  # the block freed blocks point to
    ends = [70, 95, 41, 128, 77]  # each request's query position; its run: [end + 1 - length, end + 1)
    lengths = [30, 30, 17, 64, 78]
    table = torch.zeros(len(ends), 9, dtype=torch.int32)
    for r, (end, length) in enumerate(zip(ends, lengths)):
        held = torch.arange((end + 1 - length) // size, end // size + 1)
        table[r, held] = torch.randperm(blocks - 1)[: len(held)].int() + 1  # freed blocks stay 0
    query = torch.randn(len(ends), heads, d)
    builder = SimpleNamespace(num_heads=heads, num_kv_heads=kv, head_dim=d, dtype=torch.float32, isa=isa,
                              kv_cache_dtype="auto")
    impl = SimpleNamespace(scale=d ** -0.5, alibi_slopes=None, logits_soft_cap=0.0, sinks=None, kv_cache_dtype="auto")
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    cm = SimpleNamespace(query_start_loc=torch.arange(len(ends) + 1, dtype=torch.int32), block_table_tensor=table,
                         seq_lens=torch.tensor(ends, dtype=torch.int32) + 1)
    layout = paged.learn_layout(("cpu", isa, size, d, kv, torch.float32), lambda *a: ops.cpu_attn_reshape_and_cache(
        *a, isa), paged.split_cache, size, d, kv, torch.float32)
    qsl = list(range(len(ends) + 1))
    runs = {length: [r for r, n in enumerate(lengths) if n == length] for length in set(lengths)}
    builder.window = lambda *args: AttnkitCPUMetadataBuilder.window(builder, *args)
    windows = AttnkitCPUMetadataBuilder.windows(builder, cm, runs, qsl)
    assert [run.length for run in windows.runs] == sorted(runs)
    for run in windows.runs:
        members = windows.index[run.first:run.end].tolist()
        assert members == runs[run.length]
        out = torch.empty(len(members), heads, d)
        AttnkitCPUImpl.windowed_attention(impl, layer, query[members], k_cache, v_cache, run, out)
        entries = paged.PaddedEntries.of([table[r] for r in members],
                                         [torch.arange(ends[r] + 1 - run.length, ends[r] + 1) for r in members], size)
        keys, values = entries.gather(k_cache, v_cache, layout)
        assert not keys.isnan().any()
        expected = host.batched_decode(query[members].unsqueeze(2), keys, values, entries.valid, d ** -0.5)
        torch.testing.assert_close(out, expected.squeeze(2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["snapkv:budget_tokens=40", "expected_attention:budget_tokens=40",
                                  "h2o:budget_tokens=40", "observed_attention:budget_tokens=40"])
def test_a_request_sitting_out_steps_in_the_middle_of_its_prompt_keeps_its_state(spec):
    """vLLM may schedule no tokens of a partly prefilled request for a step (its token budget taken by others): the
    worker keeps the method's state (SnapKV's window queries, Expected Attention's moments) until the request is gone,
    so the prompt's second chunk, steps later, gives attnkit's outputs; a request the runner no longer holds is
    forgotten."""
    n, new, kv, d = N, NEW, 2, 16
    method = resolve_method(spec)
    q, k, v, expected = session_reference(method, 3, ROPE16)
    plan = plan_for(method, n, new, 1)
    state = host.WorkerState()
    chunks = [(0, 70), None, None, (70, n)] + [(p, p + 1) for p in range(n, n + new)]
    got = live_calls(lambda s, t: Row("r", method, plan, new, s, t), DictStore(kv, d, n + new), q, k, v, chunks, state)
    assert_host_outputs(Row("r", method, plan, new, 0, 1), got, expected)
    state.begin_forward({"other"})
    assert "r" not in state.prefills.open and "r" not in state.live.open


@dataclass(frozen=True)
class StatisticsBesideEntries(ObservedAttention):
    """observed_attention with its prompt statistic kept beside the entries (``kv.extras``), as a method may."""

    def add_prefill_scores(self, ctx, stats):
        self.score_buffer(ctx)[:, :, :ctx.kv.length] += stats

    def rank(self, ctx):
        return self.score_buffer(ctx)[:, :, :ctx.kv.length]


def test_statistics_kept_beside_the_entries_are_carried_across_prompt_chunks():
    """The host gathers a prompt chunk's layer anew from the slots; the per-entry statistics (``kv.extras``) of the
    chunks before it are carried to it (entry i is position i until the prompt's end), so a method that keeps its
    scores there compresses by all of them: attnkit's outputs."""
    n, new, kv, d = N, NEW, 2, 16
    method = StatisticsBesideEntries(budget_tokens=40)
    q, k, v, expected = session_reference(method, 3, ROPE16)
    plan = plan_for(method, n, new, 1)
    chunks = [(0, 30), (30, 70), (70, n)] + [(p, p + 1) for p in range(n, n + new)]
    got = live_calls(lambda s, t: Row("r", method, plan, new, s, t), DictStore(kv, d, n + new), q, k, v, chunks,
                     host.WorkerState())
    assert_host_outputs(Row("r", method, plan, new, 0, 1), got, expected)


def tiny_surrogate(tmp_path, hidden_size=8, kv=2):
    """A kvzap surrogate of random weights for a one-layer model of `hidden_size` and `kv` kv heads."""
    from attnkit.methods.kvzap_predictor import save_predictor

    torch.manual_seed(9)
    meta = {"model": "synthetic", "n_layers": 1, "hidden_size": hidden_size, "n_kv_heads": kv}
    return str(save_predictor(tmp_path / "kvzap.safetensors", "linear",
                              [[torch.randn(kv, hidden_size), torch.randn(kv)]], meta))


@pytest.mark.parametrize("params", ["budget_tokens=40,window=8", "budget_tokens=40,decode_every=6,window=8"])
@pytest.mark.parametrize("chunking", ["stepwise", "recomputed"])
def test_kvzap_scores_the_layer_inputs_the_backend_hands_over(tmp_path, params, chunking):
    """kvzap in the host: each call handed its tokens' layer inputs (the prompt in three chunks, its scores carried
    between them; then one token per forward, the steps that cannot compress run as plain attention and caught up
    with their inputs; or all of it recomputed in one chunk): attnkit's session's outputs."""
    n, new, kv, d = N, NEW, 2, 16
    method = resolve_method(f"kvzap:config={tiny_surrogate(tmp_path)},{params}")
    hidden = torch.randn(n + new, 8)
    q, k, v, expected = session_reference(method, 4, ROPE16, hidden)
    plan = plan_for(method, n, new, 1)
    chunks = [(0, n + new)] if chunking == "recomputed" else \
        [(0, 30), (30, 70), (70, n)] + [(p, p + 1) for p in range(n, n + new)]
    if chunking == "recomputed" and not plan.live:
        chunks = [(0, n)] + [(p, p + 1) for p in range(n, n + new)]  # a prompt-only plan: vLLM's kernel decodes
    got = live_calls(lambda s, t: Row("r", method, plan, new, s, t), DictStore(kv, d, n + new), q, k, v, chunks,
                     host.WorkerState(), hidden=hidden)
    assert_host_outputs(Row("r", method, plan, new, 0, 1), got, expected)


def test_each_engine_keeps_its_own_requests():
    """Two engines in one process (a plain one beside an attnkit one, as in notebooks): each model runner has its own
    worker state and each scheduler its own notes, so a step of one never drops or judges the other's requests."""
    from types import SimpleNamespace

    from attnkit.vllm import requests

    runners = [SimpleNamespace(requests={}), SimpleNamespace(requests={})]
    states = []
    for runner in runners:
        token = requests.set_runner(runner)
        try:
            states.append(requests.runner_state(host.WorkerState))
            assert requests.runner_state(host.WorkerState) is states[-1]
        finally:
            requests.reset_runner(token)
    assert states[0] is not states[1]
    states[0].prefills.open["a"] = object()
    states[1].begin_forward(set())  # the other engine's step, holding none of the first's requests
    assert "a" in states[0].prefills.open
    engine = EngineConfig.parse({"attnkit": {"recipe": "snapkv:budget_tokens=64"}})
    first, second = requests.ScheduledRequests(engine), requests.ScheduledRequests(engine)
    first.record(SimpleNamespace(request_id="0", sampling_params=None, num_prompt_tokens=300, num_computed_tokens=0))
    assert not first.plan("0", 300).plain
    with pytest.raises(RuntimeError, match="'0' reached the KV-cache manager without"):
        second.plan("0", 300)  # another engine's request "0" is not this one's


def test_a_recipe_file_is_read_once_at_engine_start(tmp_path, monkeypatch):
    """The process that configures the engine reads the recipe file and hands on a mapping: the scheduler, workers and
    request checks never read it again (a file changed or removed later changes nothing)."""
    from vllm.engine.arg_utils import EngineArgs

    import attnkit.vllm.plugin
    from attnkit.vllm.config import engine_of

    attnkit.vllm.plugin.register()
    recipe = tmp_path / "recipe.json"
    recipe.write_text('{"method": "snapkv", "params": {"budget_tokens": 64}}')
    config = EngineArgs(**ENGINE, additional_config={"attnkit": {"recipe": str(recipe)}}).create_engine_config()
    recipe.unlink()
    handed_on = config.additional_config["attnkit"]
    assert isinstance(handed_on["recipe"], dict) and handed_on["allow"] == ["full", "snapkv"]
    assert engine_of(config).method.name == "snapkv"


def test_an_untested_vllm_gets_nothing_registered_and_refuses_attnkit_engines(monkeypatch):
    """On a vLLM version the plugin is not tested with, registering installs nothing but the engine check: no
    backend, spec or wrapper of vLLM's internals; an engine asking for attnkit is refused in one line naming the
    tested versions, a plain one is configured as vLLM's own."""
    from vllm.engine.arg_utils import EngineArgs

    import attnkit.vllm.plugin
    from attnkit.vllm import patches, versions

    monkeypatch.setattr(EngineArgs, "create_engine_config", EngineArgs.create_engine_config)  # restored afterwards
    monkeypatch.setattr(versions, "vllm_version", lambda: "0.99.1")
    monkeypatch.setattr(patches, "apply", lambda: pytest.fail("an untested vLLM got the plugin's wrappers"))
    attnkit.vllm.plugin.register()
    with pytest.raises(AttnkitError) as info:
        EngineArgs(**ENGINE, additional_config={"attnkit": {"recipe": "snapkv:budget=0.3"}}).create_engine_config()
    assert "tested with vLLM 0.32.x; this is vLLM 0.99.1" in str(info.value) and "\n" not in str(info.value)
    assert "attnkit" not in (EngineArgs(**ENGINE).create_engine_config().additional_config or {})


@pytest.mark.parametrize("size, store_kind", [(16, "vllm"), (32, "vllm"), (16, "transposed"), (16, "flash")])
def test_quest_pages_in_vllm_blocks_choose_and_read_what_attnkit_quest_does(size, store_kind):
    """Quest in vLLM (:mod:`attnkit.vllm.pages`): block summaries kept as vLLM's write op stores keys (prompt chunks,
    then one token at a time, into blocks reused from an earlier request whose stale summaries must not count),
    bounds and choice per kv head or per query head, the chosen blocks read where they lie: the outputs of attnkit's
    own Quest (its page summaries, choice and gathered attention) over each request's keys in position order."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from attnkit.methods.quest_pages import choose_pages, gathered_attention, page_bounds
    from attnkit.vllm import pages

    torch.manual_seed(1)
    blocks, kv, d, heads = 48, 2, 32, 8
    isa = _get_attn_isa(torch.float32, size, d)
    cache = torch.zeros(blocks, kv, size, 2 * d)
    if store_kind == "flash":  # FlashAttention's cache convention (vLLM's CUDA op stood in for)
        from attnkit.vllm.flash import flash_split

        def store(k, v, kc, vc, slots):
            flash_store(k, v, kc.transpose(1, 2), vc.transpose(1, 2), slots)

        layout, (k_cache, v_cache) = paged.identity_layout(size, d), flash_split(cache)
    else:
        store = transposed_store if store_kind == "transposed" else lambda *a: ops.cpu_attn_reshape_and_cache(*a, isa)
        layout = paged.learn_layout((store_kind, isa, size, d, kv, torch.float32), store, paged.split_cache, size, d,
                                    kv, torch.float32)
        k_cache, v_cache = paged.split_cache(cache)
    summaries = pages.Summaries(k_cache)

    def write(k, v, slots):
        store(k, v, k_cache, v_cache, slots)
        summaries.update(k, slots)

    # an earlier request filled every block with large keys: their summaries are stale once a block is reused
    every = torch.arange(blocks * size)
    write(torch.randn(len(every), kv, d) * 50, torch.randn(len(every), kv, d), every)
    lengths = [7 * size + 3, 11 * size, 5 * size + 1, 9 * size + size // 2]
    specs = [f"quest:page_size={size},token_budget={3 * size},dense_layers=0",
             f"quest:page_size={size},token_budget={4 * size},dense_layers=0,per_query_head=true",
             f"quest:page_size={size},budget=0.5,dense_layers=0",
             f"quest:page_size={size},token_budget={2 * size},dense_layers=0,per_query_head=true,first_page=true"]
    free = torch.randperm(blocks)
    tables, keys, values = torch.zeros(len(lengths), 12, dtype=torch.int32), [], []
    for r, n in enumerate(lengths):
        own = free[: -(-n // size)]
        free = free[len(own):]
        tables[r, : len(own)] = own.int()
        k, v = torch.randn(n, kv, d), torch.randn(n, kv, d)
        keys.append(k)
        values.append(v)
        physical = own[torch.arange(n) // size] * size + torch.arange(n) % size
        cut = n - 5  # a prompt in two chunks, then tokens one by one
        for a, b in [(0, cut // 2), (cut // 2, cut)] + [(t, t + 1) for t in range(cut, n)]:
            write(k[a:b], v[a:b], physical[a:b])
    q = torch.randn(len(lengths), heads, d)
    queries = [pages.Query(r, n - 1, r, resolve_method(s)) for r, (n, s) in enumerate(zip(lengths, specs))]
    (dense, groups), = pages.layer_groups(queries, 1, size, tables, torch.tensor(lengths))
    assert dense == () and sorted(g.per_query_head for g in groups) == [False, True]
    for group in groups:
        got = pages.sparse_attention(q[group.rows], k_cache, v_cache, layout, summaries, group, d ** -0.5)
        for j, r in enumerate(group.rows.tolist()):
            method, n = queries[r].method, lengths[r]
            k, v = keys[r].transpose(0, 1)[None], values[r].transpose(0, 1)[None]
            count = -(-n // size)
            padded = torch.cat([k, k[:, :, :1].expand(-1, -1, count * size - n, -1)], dim=2)
            low = torch.stack([padded[:, :, p * size:min((p + 1) * size, n)].amin(2) for p in range(count)], dim=2)
            high = torch.stack([padded[:, :, p * size:min((p + 1) * size, n)].amax(2) for p in range(count)], dim=2)
            chosen = choose_pages(page_bounds(q[r][None, :, None], low, high), method.pages_read(n),
                                  method.per_query_head, None, size, method.first_page)
            expected = gathered_attention(q[r][None, :, None], k, v, chosen, size, n, d ** -0.5)
            torch.testing.assert_close(got[j], expected[0, :, 0], rtol=1e-5, atol=1e-5)
    with pytest.raises(AttnkitError, match="page_size"):
        pages.layer_groups([pages.Query(0, 100, 0, resolve_method("quest:token_budget=64,page_size=8"))], 1, size,
                           tables[:1], torch.tensor([101]))


def test_a_per_step_layer_that_filled_its_budget_as_plain_rows_stacks_again():
    """A per-step request whose prompt is shorter than its budget runs its filling steps as plain decode rows and
    catches up (skip_appends): afterwards its layer state counts no steps of its own and holds no queued query, so it
    stacks with other requests' (attnkit.vllm.stacked), and its outputs are attnkit's."""
    n, new, kv, d = N, NEW, 2, 16
    method = resolve_method("h2o:budget_tokens=90")  # 10 filling steps, then one eviction per step
    q, k, v, expected = session_reference(method, 5, ROPE16)
    plan = plan_for(method, n, new, 1)
    assert plan.fill and not plan.compresses_at(n) and plan.compresses_at(n + 10)
    state = host.WorkerState()
    chunks = [(0, n)] + [(p, p + 1) for p in range(n, n + new)]
    got = live_calls(lambda s, t: Row("r", method, plan, new, s, t), DictStore(kv, d, n + new), q, k, v, chunks, state)
    assert_host_outputs(Row("r", method, plan, new, 0, 1), got, expected)
    layer_state = state.live.open["r"].session.layer_state[0]
    layer_state = getattr(layer_state, "cache", layer_state)  # the method's own, where vLLM's kernel gave the prompt
    assert layer_state.decoded == 0 and layer_state.queued_q is None


def test_many_compressions_of_one_call_count_as_many_observations():
    """A stacked step observes its compaction time once per request (attnkit.vllm.metrics.compacted): its histogram
    then reads as that many observations would, bucket by bucket, in the count and in the sum."""
    from prometheus_client import CollectorRegistry, Histogram

    from attnkit.vllm import metrics

    registry = CollectorRegistry()
    buckets = (1e-4, 3e-4, 1e-3)
    bulk, each = (Histogram(name, name, buckets=buckets, registry=registry) for name in ("bulk", "each"))
    for seconds, times in ((2e-4, 32), (5.0, 3), (1e-4, 1), (7e-4, 0)):
        metrics._observe(bulk, seconds, times)
        for _ in range(times):
            each.observe(seconds)

    def samples(histogram, name):
        return {(s.name.replace(name, ""), tuple(s.labels.items())): s.value for s in histogram.collect()[0].samples
                if not s.name.endswith("_created")}

    got, want = samples(bulk, "bulk"), samples(each, "each")
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-9 for k in got), (got, want)
    assert want[("_count", ())] == 36
