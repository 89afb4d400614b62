"""Which methods run on a tensor-parallel shard of the kv heads (no vLLM import here).

With ``tensor_parallel_size`` above 1, each vLLM worker holds some of a layer's kv heads and their query heads,
numbered from 0 in that worker. A method runs on a shard as on the whole model when its choice for a kv head reads
only that head's entries and queries. Two kinds of method do not, and are refused in one line at engine start or at
request submission (a refusal inside a worker would end the engine):

- a choice that reads every kv head's statistics (TOVA's mean over the heads, Keyformer's shared score): a shard
  does not hold the others;
- a choice that depends on which heads of the model a shard holds: calibration files, which hold something per
  layer and head (q-filters, Expected Attention's and TriAttention's query statistics, MInference's patterns, the
  trained surrogates and gates) and draws made per kv head of the model
  (Keyformer's Gumbel or Gaussian noise, random scores, the Gaussian sketch of leverage and compactor). A shard
  would read head 0's where it holds head 1, and keep other entries than attnkit's runner without a word.

The rest run on their shard as on the whole model (``tests/vllm/test_vllm_tp.py``).
"""

from __future__ import annotations

from attnkit.methods.base import Method
from attnkit.methods.compactor import Compactor
from attnkit.methods.compose import Compose
from attnkit.methods.keyformer import Keyformer
from attnkit.methods.leverage import Leverage
from attnkit.methods.random_scores import Random
from attnkit.methods.tova import TOVA

CROSSES = " (its choice for a kv head reads every kv head's statistics, which a shard does not hold)"


def _head_specific(part: Method) -> str:
    """Why `part` depends on which heads of the model a shard holds ("" where it does not)."""
    calibration = getattr(part, "config", None) or getattr(part, "stats", None)
    if calibration:  # every calibration file attnkit writes holds something per layer and head
        return f"its calibration file {calibration} holds each head of the whole model's"
    if isinstance(part, Keyformer) and part.noise in ("gumbel", "gaussian"):
        return f"its {part.noise} noise is drawn per head of the whole model (noise=none or noise=constant runs)"
    if isinstance(part, Random):
        return "its scores are drawn per kv head of the whole model"
    if isinstance(part, (Leverage, Compactor)) and part.sketch_dimension:
        return "its Gaussian sketch is drawn per kv head of the whole model (sketch_dimension=0 runs)"
    return ""


def shard_refusal(method: Method) -> str:
    """Why `method` cannot run on a tensor-parallel shard of the kv heads, as the tail of a refusal ("" where it
    can)."""
    parts = [method.prefill_method, method.cache_method] if isinstance(method, Compose) else [method]
    for part in parts:
        if isinstance(part, TOVA) or (isinstance(part, Keyformer) and part.score == "shared"):
            return CROSSES
        why = _head_specific(part)
        if why:
            return f" ({why}, and a shard numbers the heads it holds from 0)"
    return ""
