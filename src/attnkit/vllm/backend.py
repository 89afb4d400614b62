"""attnkit's attention backends for vLLM: vLLM's own backend, plus attnkit's methods for the rows that need them.

Each backend is registered over one of vLLM's (``CPU_ATTN``, which the CPU platform always picks; ``FLASH_ATTN`` on
CUDA) and is that backend unchanged until the engine's ``additional_config`` has an ``attnkit`` key: every class
defers to its vLLM parent. With it:

- ``customize_spec`` gives each layer an :class:`~attnkit.vllm.manager.AttnkitSpec` carrying the engine's
  configuration, so the scheduler frees blocks by each request's plan;
- the metadata builder (:class:`AttnkitBuilderMixin`) sorts a step's rows: requests whose plan is plain full
  attention (:attr:`attnkit.vllm.plan.Plan.plain`) keep vLLM's kernel and metadata, built for them alone; the
  others are listed with their rows' tokens and block tables (``metadata.attnkit``);
- the attention (:class:`AttnkitImplMixin`) computes the plain rows with vLLM's kernel; a decode row whose plan
  shows it one run of slots ending at its own (a compacted or windowed request between its method's calls) with
  vLLM's kernel too where the backend can window it (:attr:`AttnkitBuilderMixin.windowed`: the run read in place
  through a sliding window of the run's length, one kernel call per distinct length, instead of gathered); the
  decode queries of quest requests over the blocks each chooses (:mod:`attnkit.vllm.pages`, whose block summaries
  ``do_kv_cache_update`` keeps beside the cache); the others with :mod:`attnkit.vllm.host`, reading and writing
  their slots through :mod:`attnkit.vllm.paged`. What differs
  between backends is only the cache layout: how a layer's tensor splits into keys and values, vLLM's op that
  writes entries, and the map from an entry to where it lies (:meth:`AttnkitImplMixin.cache_layout`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import FullAttentionSpec

from attnkit.heads import HeadShard
from attnkit.rope import Rope
from attnkit.vllm import host, paged, pages, requests, stacked
from attnkit.vllm.config import EngineConfig, engine_of
from attnkit.vllm.manager import AttnkitSpec


@functools.lru_cache(maxsize=8)
def _engine_from(text: str) -> EngineConfig | None:
    return EngineConfig.from_json(text) if text else None


# the engine this worker process serves, noted when its attention layers are built (vLLM asks the backend for
# each layer's KV-cache spec later, outside its configuration context)
_SERVING: list[EngineConfig | None] = [None]


def serving() -> EngineConfig | None:
    """The attnkit configuration of the engine this worker serves (None: attnkit is off)."""
    return _SERVING[0]


def attnkit_spec(spec):
    """A layer's KV-cache spec, made attnkit's when this worker's engine has attnkit on."""
    engine = _SERVING[0]
    if engine is None or type(spec) is not FullAttentionSpec:
        return spec
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    return AttnkitSpec(**fields, config=engine.to_json())


@dataclasses.dataclass
class StepPart:
    """attnkit's share of a step's metadata: its rows, and vLLM's metadata for the plain rows alone."""

    rows: list  # (first token, end token, Row, block table row)
    # rows decoding one token over their visible slots: their tokens, and their entries (paged.PaddedEntries)
    decode: tuple | None
    # rows decoding one token over one run of slots that ends at their own, read in place by vLLM's kernel through
    # a sliding window of the run's length (None: there are none)
    windows: Windows | None
    # live rows among them whose methods catch up later: (token, request id, position, queries kept, whether the
    # method reads the layer's input hidden states)
    skipped: list
    # live rows of per-step methods decoding one token, stepped together where they can (:mod:`attnkit.vllm.stacked`):
    # (token, Row, block table row)
    stacked: list
    n_layers: int
    rope: Rope | None
    state: host.WorkerState
    shard: HeadShard | None  # the model's heads this worker holds (None: all)
    plain: object = None  # vLLM's metadata of the plain rows (None: there are none)
    inputs: bool = False  # whether rows read the layers' input hidden states (attnkit.vllm.inputs)
    plain_index: torch.Tensor | None = None  # the plain rows' tokens
    quest: pages.QuestStep | None = None  # quest requests' decode queries (None: there are none)
    # the tokens whose keys Quest's block summaries take: those of requests that may share their blocks as a cached
    # prefix (plain, quest); a compressed request's blocks are never another's, and a block taken anew restarts
    # its summary at its first slot (None: every token)
    summarised: torch.Tensor | None = None


def head_shard(vllm_config) -> HeadShard | None:
    """The model's heads this worker holds under tensor parallelism (None without): vLLM gives rank ``r`` of ``n`` the
    ``r``-th ``1/n`` of the query heads and of the kv heads (or, with fewer kv heads than ranks, a copy of kv head
    ``r x kv / n``), numbered from 0 in the worker; the sum across the workers of a method's statistic over the
    heads (:func:`sum_across_workers`)."""
    ranks = vllm_config.parallel_config.tensor_parallel_size
    if ranks == 1:
        return None
    rank = get_tensor_model_parallel_rank()
    model = vllm_config.model_config
    heads, kv_heads = model.hf_text_config.num_attention_heads, model.get_total_num_kv_heads()
    return HeadShard(rank * (heads // ranks), rank * kv_heads // ranks, heads, kv_heads, ranks, sum_across_workers)


def sum_across_workers(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the tensor-parallel workers, added in rank order so that every worker gets the same bits
    (an all-reduce may add in another order on each): each worker calls it at the same point of the same layer, as
    every worker runs every layer of the same rows."""
    group = get_tp_group()
    process_group = group.cpu_group if tensor.device.type == "cpu" else group.device_group
    parts = [torch.empty_like(tensor) for _ in range(group.world_size)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=process_group)
    return functools.reduce(torch.add, parts)


def attnkit_backend(base, impl, builder, name: str):
    """vLLM's backend class `base` with attnkit's `impl` and `builder` (its mixins over base's own) and attnkit's
    KV-cache spec; registered over base (``get_name`` stays base's)."""

    def customize_spec(cls, spec):
        return attnkit_spec(super(backend, cls).customize_spec(spec))

    backend = type(name, (base,), {
        "__doc__": f"vLLM's {base.__name__}, with attnkit's methods when the engine's additional_config names them.",
        "get_impl_cls": staticmethod(lambda: impl), "get_builder_cls": staticmethod(lambda: builder),
        "customize_spec": classmethod(customize_spec)})
    return backend


class AttnkitBuilderMixin:
    """Put before a vLLM metadata builder class: its metadata, plus attnkit's rows (``metadata.attnkit``)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.engine = _engine_from(kv_cache_spec.config) if isinstance(kv_cache_spec, AttnkitSpec) else None
        self.n_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.page_block_size = kv_cache_spec.block_size
        self.rope = Rope.from_config(vllm_config.model_config.hf_text_config) if self.engine else None
        self.shard = head_shard(vllm_config) if self.engine else None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.engine is None:
            return meta
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: num_reqs + 1].tolist()
        tokens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
        positions = cm.positions.cpu()
        starts = [int(positions[a]) if n else 0 for a, n in zip(qsl[:-1], tokens)]
        rows = requests.batch_rows(self.engine, self.n_layers, starts, tokens)
        state = requests.runner_state(host.WorkerState)
        state.begin_forward(requests.known_requests())
        for r in rows:
            state.note_prompt(r.request_id, r.plan.prompt_len, r.start, r.tokens)
        if all(r.plan.plain for r in rows):
            meta.attnkit = None
            return meta
        # vLLM's kernel: the plain rows, the prompt chunks whose outputs are dense attention (their methods observe
        # and compress beside it), and quest requests' prompt chunks
        plain = [i for i, r in enumerate(rows) if r.plan.plain or (r.kernel_prompt and r.in_prompt and tokens[i])
                 or (r.quest_prompt and tokens[i])]
        part = StepPart(rows=[], decode=None, windows=None, skipped=[], stacked=[], n_layers=self.n_layers, rope=self.rope,
                        state=state, shard=self.shard)
        if any(r.method.needs_layer_inputs and tokens[i] for i, r in enumerate(rows)):
            state.inputs.install(requests.current_model(), extract_layer_index, self.shard)
            part.inputs = True
        decode, runs, quest = [], {}, []
        for i, r in enumerate(rows):
            if r.plan.plain or not tokens[i] or r.quest_prompt:
                continue
            if r.plan.pages:  # Quest: each generated position's query chooses its pages
                if r.in_prompt:  # a recomputed request: its prompt queries dense (the others are overwritten)
                    part.rows.append((qsl[i], qsl[i + 1], r, cm.block_table_tensor[i]))
                first = max(r.start, r.plan.prompt_len)
                quest += [pages.Query(qsl[i] + p - r.start, p, i, r.method) for p in range(first, r.start + tokens[i])]
                continue
            kept = r.kept_queries
            if stacked.stackable(r):
                part.stacked.append((qsl[i], r, cm.block_table_tensor[i]))
            elif tokens[i] == 1 and not (r.plan.hooks and r.in_prompt) and (not r.plan.live or kept is not None):
                visible = r.plan.visible(r.start)
                if len(visible) == 1 and self.windowed:
                    runs.setdefault(r.start + 1 - visible[0][0], []).append(i)
                else:
                    decode.append((qsl[i], host.decode_slots(r.plan, r.start), cm.block_table_tensor[i]))
                if kept is not None:
                    part.skipped.append((qsl[i], r.request_id, r.start, kept, r.method.needs_layer_inputs))
            else:
                part.rows.append((qsl[i], qsl[i + 1], r, cm.block_table_tensor[i]))
        shared = [i for i, r in enumerate(rows) if r.plan.shares_prefix and tokens[i]]
        if len(shared) < len(rows):
            part.summarised = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in shared] or
                                        [torch.zeros(0, dtype=torch.long)]).to(cm.slot_mapping.device)
        if runs:
            part.windows = self.windows(cm, runs, qsl)
        if quest:
            part.quest = self.quest_step(cm, quest)
        if decode:
            entries = paged.PaddedEntries.of([d[2] for d in decode], [d[1] for d in decode], self.page_block_size)
            part.decode = (torch.tensor([d[0] for d in decode], device=cm.query_start_loc.device), entries)
        if plain:
            index = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in plain])
            counts = torch.tensor([tokens[i] for i in plain])
            sub_qsl = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
            sel = torch.tensor(plain, device=cm.seq_lens.device)
            seq_lens = cm.seq_lens[sel]
            sub = dataclasses.replace(
                cm, num_reqs=len(plain), num_actual_tokens=int(sub_qsl[-1]), max_query_len=int(counts.max()),
                max_seq_len=int(seq_lens.max()), query_start_loc=sub_qsl.to(cm.query_start_loc.device),
                query_start_loc_cpu=sub_qsl, seq_lens=seq_lens, block_table_tensor=cm.block_table_tensor[sel],
                slot_mapping=cm.slot_mapping[index.to(cm.slot_mapping.device)])
            part.plain, part.plain_index = super().build(0, sub, fast_build), index.to(cm.slot_mapping.device)
        meta.attnkit = part
        return meta

    def quest_step(self, cm, queries: list[pages.Query]) -> pages.QuestStep:
        """The step's quest queries (:mod:`attnkit.vllm.pages`), with the kernel's metadata for each set of them a
        layer computes densely: a window as long as the longest (vLLM's kernel in place), or their slots gathered."""
        lengths = torch.tensor([q.position + 1 for q in queries])
        tables = cm.block_table_tensor[torch.tensor([q.row for q in queries], device=cm.block_table_tensor.device)]
        layers = pages.layer_groups(queries, self.n_layers, self.page_block_size, tables, lengths)
        dense = {}
        for rows, _ in layers:
            if rows and rows not in dense:
                index = torch.tensor(rows)
                if self.windowed:
                    length = int(lengths[index].max())
                    meta = self.window(length, lengths[index].to(torch.int32).to(cm.seq_lens.device), tables[index])
                    dense[rows] = Window(0, len(rows), length, meta)
                else:
                    dense[rows] = paged.PaddedEntries.of(list(tables[index]), [torch.arange(n) for n in lengths[index]],
                                                         self.page_block_size)
        index = torch.tensor([q.token for q in queries], device=cm.query_start_loc.device)
        return pages.QuestStep(index, layers, dense)

    windowed = False  # whether this backend reads a run of slots in place (:meth:`window`)

    def windows(self, cm, runs: dict[int, list[int]], qsl: list[int]) -> Windows:
        """The step's rows ``runs[length]`` (one query each, reading the `length` slots ending at their own), in
        order of length, with one :meth:`window` per length over their requests' sequence lengths and block tables
        (gathered once)."""
        order = [(length, i) for length in sorted(runs) for i in runs[length]]
        device = cm.query_start_loc.device
        rows = torch.tensor([i for _, i in order], device=cm.seq_lens.device)
        seq_lens = cm.seq_lens[rows].to(torch.int32)
        tables = cm.block_table_tensor[rows.to(cm.block_table_tensor.device)]
        groups, first = [], 0
        for length in sorted(runs):
            end = first + len(runs[length])
            groups.append(Window(first, end, length, self.window(length, seq_lens[first:end], tables[first:end])))
            first = end
        return Windows(torch.tensor([qsl[i] for _, i in order], device=device), groups)

    def window(self, length: int, seq_lens: torch.Tensor, block_table: torch.Tensor):
        """The kernel's metadata for requests of sequence lengths `seq_lens` and block table rows `block_table`, one
        query each, with a sliding window of `length` slots (a subclass that sets :attr:`windowed` builds it)."""
        raise NotImplementedError


@dataclasses.dataclass
class Window:
    """Rows ``first:end`` of a step's :class:`Windows` (each reading the `length` slots ending at its own query's) as
    one call of vLLM's kernel, with the backend's metadata for them alone (``meta``)."""

    first: int
    end: int
    length: int
    meta: object


@dataclasses.dataclass
class Windows:
    """A step's rows read in place through a window: their tokens in the step (``index``), grouped by run length."""

    index: torch.Tensor
    runs: list[Window]


class AttnkitImplMixin:
    """Put before a vLLM attention implementation class: its forward for vLLM's rows, attnkit's for the others.
    A subclass says how its backend lays out a layer's cache (:meth:`cache_layout`)."""

    layer_index: int | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        engine = _SERVING[0] = engine_of(get_current_vllm_config())
        self.keeps_pages = engine is not None and engine.may_run(pages.Quest.name)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self.keeps_pages:  # Quest's block summaries follow the keys written (StepPart.summarised)
            part = getattr(get_attention_context(layer.layer_name)[0], "attnkit", None)
            index = None if part is None else part.summarised
            if index is not None:
                if not len(index):
                    return
                key, slot_mapping = key[index], slot_mapping[index]
            key_cache = self.cache_layout(layer, kv_cache)[0]
            pages.summaries_of(self, key_cache).update(key, slot_mapping)

    def cache_layout(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, paged.Layout, object]:
        """``(key cache, value cache, layout, store)``: the layer's cache split as this backend's kernels split it
        (each ``[num_blocks, kv_heads, block_size, head_dim]``), where an entry lies inside a block
        (:class:`~attnkit.vllm.paged.Layout`), and ``store(key, value, key_cache, value_cache, slots)``: vLLM's op
        writing entries ``[n, kv_heads, head_dim]`` to physical slots."""
        raise NotImplementedError

    def windowed_attention(self, layer, query, key_cache, value_cache, run: Window, out) -> None:
        """Outputs `out` ``[rows, heads, head_dim]`` of `query` (one per row of `run`), each over the ``run.length``
        slots ending at its own, computed by vLLM's kernel reading the cache in place (backends whose builder sets
        ``windowed``)."""
        raise NotImplementedError

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        part = getattr(attn_metadata, "attnkit", None)
        if part is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if self.layer_index is None:
            self.layer_index = extract_layer_index(layer.layer_name)
        if part.plain is not None:
            index = part.plain_index
            out = output.new_empty((index.shape[0],) + tuple(output.shape[1:]))
            super().forward(layer, query[index], key[index], value[index], kv_cache, part.plain, out)
            output[index] = out
        key_cache, value_cache, layout, store = self.cache_layout(layer, kv_cache)
        block_size = key_cache.shape[2]
        call = host.LayerCall(self.layer_index, part.n_layers, self.scale, part.rope, part.state, part.shard)
        if part.windows is not None:  # rows reading one run of slots in place: vLLM's kernel, windowed
            index = part.windows.index
            queries = query[index]
            out = torch.empty_like(queries)
            for run in part.windows.runs:
                self.windowed_attention(layer, queries[run.first:run.end], key_cache, value_cache, run,
                                        out[run.first:run.end])
            output[index] = out.reshape((index.shape[0],) + tuple(output.shape[1:])).to(output.dtype)
        if part.decode is not None:  # rows decoding one token over their visible slots: one gather, one attention
            firsts, entries = part.decode
            out = self.gathered_decode(query[firsts], entries, key_cache, value_cache, layout)
            output[firsts] = out.reshape(output[firsts].shape).to(output.dtype)
        hidden, module = part.state.inputs.of(self.layer_index, query.shape[0]) if part.inputs else (None, None)
        if part.skipped:  # the skipped rows' queries in one gather: each keeps its own view of it until it catches up
            noted = query[[s[0] for s in part.skipped]].reshape(len(part.skipped), -1, key_cache.shape[-1])
        for i, (first, request_id, position, kept, reads) in enumerate(part.skipped):
            q = noted[i] if kept else None
            part.state.live.skipped(request_id, self.layer_index, position, q, hidden[first].clone() if reads else None)
        rest = []
        if part.stacked:
            rest = stacked.attention(part.stacked, call, query, key, value, (key_cache, value_cache, layout, store),
                                     output)
        for first, end, row, block_row in part.rows + rest:
            request = paged.request_slots(key_cache, value_cache, layout, block_row, block_size, store)
            q = query[first:end].transpose(0, 1).unsqueeze(0)
            k = key[first:end].transpose(0, 1).unsqueeze(0)
            v = value[first:end].transpose(0, 1).unsqueeze(0)
            inputs = (hidden[first:end], module) if row.method.needs_layer_inputs else None
            out = host.row_attention(row, call, q, k, v, host.PagedRequest(*request, block_size), inputs)
            if row.kernel_prompt:  # the prompt's outputs are the kernel's: keep them
                skip = max(0, row.plan.prompt_len - row.start)
                first, out = first + skip, out[:, :, skip:]
            if first < end:
                output[first:end] = out[0].transpose(0, 1).reshape(output[first:end].shape).to(output.dtype)
        if part.quest is not None:  # after the rows: a recomputed quest request's generated queries overwritten
            self.quest_attention(layer, query, key_cache, value_cache, layout, part.quest, output)
        return output

    def gathered_decode(self, queries, entries: paged.PaddedEntries, key_cache, value_cache, layout):
        """Outputs ``[rows, heads, d]`` of one query per row `queries` over each row's `entries`: one gather, one
        attention."""
        keys, values = entries.gather(key_cache, value_cache, layout)
        return host.batched_decode(queries.unsqueeze(2), keys, values, entries.valid, self.scale).squeeze(2)

    def quest_attention(self, layer, query, key_cache, value_cache, layout, step: pages.QuestStep, output) -> None:
        """Outputs of the step's quest queries at this layer: the dense ones by vLLM's kernel (a window covering
        them) or a gather, the others over the blocks they choose (:func:`attnkit.vllm.pages.sparse_attention`)."""
        rows, groups = step.layers[self.layer_index]
        queries = query[step.index]
        out = torch.empty_like(queries)
        if rows:
            index = torch.tensor(rows, device=queries.device)
            dense, got = step.dense[rows], torch.empty_like(queries[index])
            if isinstance(dense, Window):
                self.windowed_attention(layer, queries[index], key_cache, value_cache, dense, got)
            else:
                got = self.gathered_decode(queries[index], dense, key_cache, value_cache, layout)
            out[index] = got.reshape(out[index].shape)
        summaries = pages.summaries_of(self, key_cache) if groups else None
        for group in groups:
            index = group.rows.to(queries.device)
            out[index] = pages.sparse_attention(queries[index], key_cache, value_cache, layout, summaries, group,
                                                self.scale).reshape(out[index].shape)
        output[step.index] = out.reshape((step.index.shape[0],) + tuple(output.shape[1:])).to(output.dtype)
