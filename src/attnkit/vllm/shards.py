"""Which methods run on a tensor-parallel shard of the kv heads (no vLLM import here).

With ``tensor_parallel_size`` above 1, each vLLM worker holds some of a layer's kv heads and their query heads,
numbered from 0 in that worker. A method runs on a shard as on the whole model when its choice for a kv head reads
only that head's entries and queries, or sums over every head that the workers add together (TOVA's mean over the
heads, Keyformer's shared score, Compactor's standardisation: :func:`attnkit.heads.sum_over_heads`), and whatever it
draws or calibrates per head of the model is read at the shard's own heads: the worker hands its sessions the
model-wide index of its first heads (:class:`attnkit.heads.HeadShard`), and the noise, scores, sketches, statistics
and patterns of Keyformer, random, leverage, compactor, TriAttention, q-filters, Expected Attention, MInference and
KVzap's surrogate (its scores of the shard's kv heads, its weight check summed over the workers) are read there.
The others are refused in one line at engine start or at request submission (a refusal inside a worker
would end the engine):

- a calibration file that holds something per head of the model and that its method does not read at the shard's
  heads (DuoAttention's, Fast KVzip's gates): a shard would read head 0's where it holds head 1, and
  keep other entries than attnkit's runner;
- any method but full attention and the position-only ``window`` and ``streaming`` when there are more workers than
  kv heads: vLLM then copies a kv head to several workers, each with part of its query heads, and the copies would
  choose apart.

The rest run on their shard as on the whole model (``tests/vllm/test_vllm_tp.py``).
"""

from __future__ import annotations

from attnkit.methods.base import Method
from attnkit.methods.compactor import Compactor
from attnkit.methods.compose import Compose
from attnkit.methods.expected_attention import ExpectedAttention
from attnkit.methods.full import Full
from attnkit.methods.keyformer import Keyformer
from attnkit.methods.kvzap import KVzap
from attnkit.methods.leverage import Leverage
from attnkit.methods.minference import MInference, MInferenceStatic
from attnkit.methods.qfilter import QFilter
from attnkit.methods.random_scores import Random
from attnkit.methods.streaming import Streaming
from attnkit.methods.triattention import TriAttention
from attnkit.methods.window import Window

# methods whose draws or calibration files are read at the shard's own heads (attnkit.heads.held_heads)
READS_SHARD = (Keyformer, TriAttention, QFilter, ExpectedAttention, Random, MInference, MInferenceStatic,
               Leverage, Compactor, KVzap)  # exactly these: no subclass


def _head_specific(part: Method) -> str:
    """Why `part` depends on which heads of the model a shard holds ("" where it does not)."""
    if type(part) in READS_SHARD:
        return ""
    calibration = getattr(part, "config", None) or getattr(part, "stats", None)
    if calibration:  # every calibration file attnkit writes holds something per layer and head
        return f"its calibration file {calibration} holds each head of the whole model's"
    return ""


def shard_refusal(method: Method, kv_heads: int | None = None, ranks: int = 2) -> str:
    """Why `method` cannot run on a tensor-parallel shard of the kv heads, `ranks` workers sharing a model of `kv_heads`
    kv heads (None: not known), as the tail of a refusal ("" where it can)."""
    parts = [method.prefill_method, method.cache_method] if isinstance(method, Compose) else [method]
    if kv_heads is not None and ranks > kv_heads and not all(isinstance(p, (Full, Window, Streaming)) for p in parts):
        return (f" (the model has {kv_heads} kv heads: vLLM copies each to several workers, each with part of its "
                f"query heads, and the copies would keep different entries; window and streaming run)")
    for part in parts:
        why = _head_specific(part)
        if why:
            return f" ({why}, and a shard numbers the heads it holds from 0)"
    return ""
