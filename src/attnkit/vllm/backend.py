"""attnkit's attention backend for vLLM's CPU platform: vLLM's own CPU attention, plus attnkit's methods.

Registered over ``CPU_ATTN`` (the CPU platform always picks that backend), it is vLLM's backend unchanged until
the engine's ``additional_config`` has an ``attnkit`` key: every class below then defers to its vLLM parent.
With it:

- ``customize_spec`` gives each layer an :class:`~attnkit.vllm.manager.AttnkitSpec` carrying the engine's
  configuration, so the scheduler frees blocks by each request's plan;
- the metadata builder sorts a step's rows: requests whose plan is plain full attention
  (:attr:`attnkit.vllm.plan.Plan.plain`) keep vLLM's kernel and metadata, built for them alone; the others
  are listed with their rows' tokens and block tables;
- the attention computes the plain rows with vLLM's kernel and the others with :mod:`attnkit.vllm.host`,
  reading and writing their slots through :mod:`attnkit.vllm.paged`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from attnkit.rope import Rope
from attnkit.vllm import host, paged, requests
from attnkit.vllm.config import EngineConfig
from attnkit.vllm.manager import AttnkitSpec


@functools.lru_cache(maxsize=8)
def _engine_from(text: str) -> EngineConfig | None:
    return EngineConfig.from_json(text) if text else None


def engine_config(vllm_config) -> EngineConfig | None:
    """The checked attnkit configuration of an engine (None: attnkit is off)."""
    engine = EngineConfig.parse(getattr(vllm_config, "additional_config", None))
    return None if engine is None else _engine_from(engine.to_json())


# the engine this worker process serves, noted when its attention layers are built (vLLM asks the backend for
# each layer's KV-cache spec later, outside its configuration context)
_SERVING: list[EngineConfig | None] = [None]


class AttnkitCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return AttnkitCPUImpl

    @staticmethod
    def get_builder_cls():
        return AttnkitCPUMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        engine = _SERVING[0]
        if engine is None or type(spec) is not FullAttentionSpec:
            return spec
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
        return AttnkitSpec(**fields, config=engine.to_json())


@dataclasses.dataclass
class AttnkitMetadata(CPUAttentionMetadata):
    """vLLM's metadata of the whole step, plus attnkit's rows and the metadata of the plain rows alone."""

    attnkit_rows: list | None = None  # (first token, end token, Row, block table row)
    plain: CPUAttentionMetadata | None = None
    plain_index: torch.Tensor | None = None  # the plain rows' tokens
    attnkit_layers: int = 0  # the model's decoder layers (an attnkit session per request spans them)
    attnkit_rope: object = None  # the model's rotary frequencies (attnkit.rope.Rope)


class AttnkitCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.engine = _engine_from(kv_cache_spec.config) if isinstance(kv_cache_spec, AttnkitSpec) else None
        self.n_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.rope = Rope.from_config(vllm_config.model_config.hf_text_config) if self.engine else None

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
        host.PREFILLS.retain({r.request_id for r in rows})
        plain = [i for i, r in enumerate(rows) if r.plan.plain]
        out = AttnkitMetadata(**{f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)})
        if len(plain) == num_reqs:
            return out
        out.attnkit_layers, out.attnkit_rope = self.n_layers, self.rope
        out.attnkit_rows = [(qsl[i], qsl[i + 1], r, cm.block_table_tensor[i]) for i, r in enumerate(rows)
                            if not r.plan.plain and tokens[i]]
        if plain:
            index = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in plain])
            sub_qsl = torch.tensor([0] + list(torch.tensor([tokens[i] for i in plain]).cumsum(0)), dtype=torch.int32)
            sel = torch.tensor(plain)
            seq_lens = cm.seq_lens[sel]
            sub = dataclasses.replace(
                cm, num_reqs=len(plain), num_actual_tokens=int(sub_qsl[-1]),
                max_query_len=max(tokens[i] for i in plain), max_seq_len=int(seq_lens.max()),
                query_start_loc=sub_qsl.to(cm.query_start_loc.device), query_start_loc_cpu=sub_qsl,
                seq_lens=seq_lens, block_table_tensor=cm.block_table_tensor[sel],
                slot_mapping=cm.slot_mapping[index.to(cm.slot_mapping.device)])
            out.plain, out.plain_index = super().build(0, sub, fast_build), index
        return out


class AttnkitCPUImpl(CPUAttentionBackendImpl):
    layer_index: int | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _SERVING[0] = engine_config(get_current_vllm_config())

    def _paged(self, layer, kv_cache: torch.Tensor, block_row: torch.Tensor) -> host.PagedRequest:
        block_size = kv_cache.shape[2]
        key_cache, value_cache = paged.split_cache(kv_cache)

        def store(key, value, k_cache, v_cache, slots, isa):
            ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa, k_scale=layer._k_scale_float,
                                           v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)

        layout = paged.learn_layout(store, layer.isa, block_size, kv_cache.shape[-1] // 2, kv_cache.shape[1],
                                    kv_cache.dtype)

        def write(slots, keys, values):
            blocks, offsets = paged.physical_slots(block_row, slots, block_size)
            store(keys[0].transpose(0, 1).contiguous(), values[0].transpose(0, 1).contiguous(), key_cache,
                  value_cache, blocks * block_size + offsets, layer.isa)

        return host.PagedRequest(lambda slots: paged.gather(kv_cache, layout, block_row, slots), write)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        rows = getattr(attn_metadata, "attnkit_rows", None)
        if not rows:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if self.layer_index is None:
            self.layer_index = extract_layer_index(layer.layer_name)
        if attn_metadata.plain is not None:
            index = attn_metadata.plain_index
            part = output.new_empty((index.shape[0],) + tuple(output.shape[1:]))
            super().forward(layer, query[index], key[index], value[index], kv_cache, attn_metadata.plain, part)
            output[index] = part
        call = host.LayerCall(self.layer_index, attn_metadata.attnkit_layers, self.scale, attn_metadata.attnkit_rope)
        for first, end, row, block_row in rows:
            q = query[first:end].transpose(0, 1).unsqueeze(0)
            k = key[first:end].transpose(0, 1).unsqueeze(0)
            v = value[first:end].transpose(0, 1).unsqueeze(0)
            paged_row = self._paged(layer, kv_cache, block_row)
            out = host.row_attention(row, call, q, k, v, paged_row)
            output[first:end] = out[0].transpose(0, 1).reshape(output[first:end].shape).to(output.dtype)
        return output

