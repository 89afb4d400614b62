"""Time the decoder layers' projections of a model for forwards over a few tokens (speculative
decoding's verification), with the weights in transformers' default layout (``[out, in]`` row-major),
stored input-major (the same tensor with the memory layout of its transpose, strides ``(1, out)``,
so that MKL's GEMM needs no transposition; ``F.linear`` on that view, and ``x @ W^T`` on the contiguous
transpose), and prepacked for oneDNN (``torch.ops.mkldnn._reorder_linear_weight`` then
``_linear_pointwise``, private operators that torch.compile's CPU freezing uses), side by side in one run.

    OMP_NUM_THREADS=1 python scripts/bench_linear_layout.py --model tiny --threads 1
    OMP_NUM_THREADS=1 python scripts/bench_linear_layout.py --threads 1 --tokens 1,2,3,4,5,9,17 \
        --model random:llama:layers=2,hidden=1024,heads=8,kv_heads=2,head_dim=128,intermediate=4096

Measured here (2026-11-22, three runs for ``tiny``, two for the 1024x4096 model; ratio input-major /
default): ``tiny`` (256x768 matrices) 0.81-0.96 at 4 tokens, 0.90-1.04 at 8, 0.90-1.08 at 16 and
1.02-1.15 at 1-2, no gain beyond the run-to-run spread; the 1024x4096 model 0.94-1.12 at 4-17 tokens and
1.36-1.59 at 2-3. An isolated loop of multiplications (warm caches) had shown input-major 20-35 %
faster at 4-8 tokens; inside a forward that gain is gone. attnkit keeps the default layout.

Later the same day, with the two other variants (one run each, ``--tokens 1,2,3,4,5,6,8,12,16``; ms
for all projections, and / default):
- ``tiny``: default 0.75 ms at 1-3 rows, 1.01 at 4, 1.42 at 8, 2.36 at 16; input-major 0.74-0.91 of
  that at 4-16 rows (1.02-1.10 at 1-3); ``x @ W^T`` 0.67-0.84 at 4-16; oneDNN prepacked 1.12-2.18
  (a fixed overhead per call, large against matrices this small).
- the 1024x4096 model (2 layers, ``--repeats 15``): default 5.98 ms at 1 row, 6.8-7.7 at 2-3, 14.2 at 4,
  19.4 at 8; input-major 1.48-1.84 of that at 2-3 rows; oneDNN prepacked 1.17 at 1 row, 1.18-1.34 at 2-3
  and 0.50-0.69 at 4-16 (8.9 ms at 4 rows, 10.6 at 8).
MKL's cost is a staircase in the rows: 1-3 cost about what one does (the weights are read once; the
step is memory-bound), a fourth adds most of a step. oneDNN's prepacked weights would make verifying
4-12 tokens on a model of that size about half as dear, at the price of a second copy of the weights
(or of the default layout's one-token speed); attnkit does not use them yet.

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


def projection_time(weights: list, in_features: list[int], tokens: int, per_layer: int, repeats: int,
                    cache_tokens: int = 2048, project=F.linear) -> float:
    """Median over `repeats` of the summed seconds of ``project(x, w)`` over all `weights` (in order;
    ``x`` has ``in_features[i]`` columns), with one attention call over a `cache_tokens` cache after every
    `per_layer` weights."""
    inputs = {f: torch.randn(1, tokens, f) for f in set(in_features)}
    q = torch.randn(1, 2, 4 * tokens, 32)
    k, v = torch.randn(1, 2, cache_tokens, 32), torch.randn(1, 2, cache_tokens, 32)
    runs = []
    for _ in range(repeats + 3):
        total = 0.0
        for i, (w, f) in enumerate(zip(weights, in_features)):
            start = time.perf_counter()
            project(inputs[f], w)
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
    transposed = [w.t().contiguous() for w in default]
    prepacked = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in default]
    per_layer = len(default) // len(layers)
    in_features = [w.shape[1] for w in default]
    variants = [("default", default, F.linear), ("input-major", input_major, F.linear),
                ("x @ W^T", transposed, torch.matmul),
                ("oneDNN packed", prepacked,
                 lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))]
    print(f"{args.model}: {len(default)} projections, {torch.get_num_threads()} threads; "
          "ms for all of them per forward, and / default")
    print(f"{'tokens':>6} " + " ".join(f"{name:>20}" for name, _, _ in variants))
    with torch.inference_mode():
        for n in (int(x) for x in args.tokens.split(",")):
            times = [projection_time(ws, in_features, n, per_layer, args.repeats, project=fn)
                     for _, ws, fn in variants]
            print(f"{n:>6} " + " ".join(f"{t * 1e3:>11.2f} ({t / times[0]:>5.2f})" for t in times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
