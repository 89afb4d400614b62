"""Time the decoder layers' projections of a model for forwards over a few tokens (speculative
decoding's verification), with the weights in transformers' default layout (``[out, in]`` row-major)
and stored input-major (the same tensor with the memory layout of its transpose, strides ``(1, out)``,
so that MKL's GEMM needs no transposition), side by side in one run.

    OMP_NUM_THREADS=1 python scripts/bench_linear_layout.py --model tiny --threads 1
    OMP_NUM_THREADS=1 python scripts/bench_linear_layout.py --threads 1 --tokens 1,2,3,4,5,9,17 \
        --model random:llama:layers=2,hidden=1024,heads=8,kv_heads=2,head_dim=128,intermediate=4096

Measured here (2026-11-22, three runs for ``tiny``, two for the 1024x4096 model; ratio input-major /
default): ``tiny`` (256x768 matrices) 0.81-0.96 at 4 tokens, 0.90-1.04 at 8, 0.90-1.08 at 16 and
1.02-1.15 at 1-2, no gain beyond the run-to-run spread; the 1024x4096 model 0.94-1.12 at 4-17 tokens and
1.36-1.59 at 2-3. An isolated loop of multiplications (warm caches) had shown input-major 20-35 %
faster at 4-8 tokens; inside a forward that gain is gone. attnkit keeps the default layout.

Every layer's projections run in model order, with one attention call over a 2k-token cache between
layers, as in a forward (the weights and the cache then compete for the CPU caches, as they do in
decoding). Figures are medians over repeats of the summed time of all projection calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import attnkit  # noqa: E402


def projection_time(weights: list[torch.Tensor], tokens: int, per_layer: int, repeats: int,
                    cache_tokens: int = 2048) -> float:
    """Median over `repeats` of the summed seconds of ``F.linear`` over all `weights` (in order), with
    one attention call over a `cache_tokens` cache after every `per_layer` weights."""
    inputs = {w.shape[1]: torch.randn(1, tokens, w.shape[1]) for w in weights}
    q = torch.randn(1, 2, 4 * tokens, 32)
    k, v = torch.randn(1, 2, cache_tokens, 32), torch.randn(1, 2, cache_tokens, 32)
    runs = []
    for _ in range(repeats + 3):
        total = 0.0
        for i, w in enumerate(weights):
            start = time.perf_counter()
            F.linear(inputs[w.shape[1]], w)
            total += time.perf_counter() - start
            if i % per_layer == per_layer - 1:
                F.scaled_dot_product_attention(q, k, v)
        runs.append(total)
    return statistics.median(runs[3:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", default="1,2,4,8,16", help="comma-separated forward lengths")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = attnkit.load_model(args.model)
    layers = model.hf.model.layers
    default = [m.weight.detach() for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    input_major = [w.t().contiguous().t() for w in default]
    per_layer = len(default) // len(layers)
    print(f"{args.model}: {len(default)} projections, {torch.get_num_threads()} threads; "
          "ms for all of them per forward")
    print(f"{'tokens':>6} {'default':>9} {'input-major':>12} {'ratio':>6}")
    with torch.inference_mode():
        for n in (int(x) for x in args.tokens.split(",")):
            t_default = projection_time(default, n, per_layer, args.repeats)
            t_major = projection_time(input_major, n, per_layer, args.repeats)
            print(f"{n:>6} {t_default * 1e3:>9.2f} {t_major * 1e3:>12.2f} {t_major / t_default:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
