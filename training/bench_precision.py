"""Model v2's training step (config_v2.json; the trainer's own `optimizer_step`: forward, loss, backward, clipping,
AdamW) in float32 against bf16 autocast, interleaved, on random tokens, 4,096 tokens a step; prints the median
times and the ratio per sequence length. Why the chain trains its later stages in bf16 autocast where it is fast
(docs/benchmarks.md, "Rebuilding model v2").

    PYTHONPATH=src:training python training/bench_precision.py --lengths 1024,4096 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import train_v2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = json.loads((Path(train_v2.__file__).parent / "config_v2.json").read_text())
    vocab = config["tokenizer"]["vocab_size"]
    model = train_v2.make_model(config, vocab).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(bf16: bool, length: int) -> float:
        ids = torch.randint(3, vocab, (4096 // length, length), device=device)
        weights = torch.ones(ids.shape[0], length - 1, device=device)
        start = time.perf_counter()
        train_v2.optimizer_step(model, opt, ids, weights, bf16, config["optimizer"]["clip"])
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    print(f"device {device}, native bf16: {train_v2.fast_bf16(device)}")
    for length in (int(n) for n in args.lengths.split(",")):
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for bf16 in (False, True):
                times[bf16].append(step(bf16, length))
        fp32, bf16 = statistics.median(times[False]), statistics.median(times[True])
        print(f"length {length}: float32 {fp32:.2f} s, bf16 autocast {bf16:.2f} s a step: bf16 {fp32 / bf16:.2f}x")


if __name__ == "__main__":
    main()
