"""Training curves of a run of train_v2.py from its log.jsonl: the answer loss of each row kind against the
step (chance is ln(vocabulary)), phase boundaries, and the held-out probe (exact and first-token accuracy).

    python training/plot_curves.py runs/model_v2/log.jsonl --out docs/results/model_v2_curves.png

A log of several runs (training/bundle_v2.py --log-out: each record names its ``stage``) is drawn as one run: each
stage's steps follow the previous stage's last, and the lines mark where stages (not phases) begin. Losses are
drawn as the mean of each ``--smooth`` consecutive records of a kind, since single batches are noisy.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_log(path: Path) -> tuple[dict, dict, list]:
    """(answer losses by kind: [(step, loss)], probe accuracies by task: [(step, first, exact)], marks: where each
    stage begins in a log of stages, else where each phase ends: [(step, name)])."""
    losses, probes, marks = defaultdict(list), defaultdict(list), []
    stage, offset, last = None, 0, 0
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("stage", stage) != stage:  # a new stage: its steps start after the previous stage's
            stage, offset = rec["stage"], last
            marks.append((offset, stage))
        step = offset + rec["step"]
        last = max(last, step)
        for kind, value in rec.get("answer_loss", {}).items():
            losses[kind].append((step, value))
        for task, (first, exact) in rec.get("probe", {}).items():
            probes[task].append((step, first, exact))
        if "event" in rec and stage is None:
            marks.append((step, rec["event"]))
    return losses, probes, marks


def smoothed(points: list, width: int) -> tuple[list, list]:
    """Steps and mean values of each `width` consecutive points."""
    groups = [points[i:i + width] for i in range(0, len(points), width)]
    return [g[-1][0] for g in groups], [sum(v for _, v in g) / len(g) for g in groups]


def plot(path: Path, out: Path, smooth: int = 1) -> None:
    losses, probes, marks = read_log(path)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 9), sharex=True)
    for kind, points in sorted(losses.items()):
        steps, values = smoothed(points, smooth)
        top.plot(steps, values, label=kind, linewidth=1)
    top.set_yscale("log")
    top.set_ylabel("answer loss (nats per answer token)")
    top.set_title(f"{path}: answer loss by row kind")
    for task, points in sorted(probes.items()):
        steps, _, exact = zip(*points)
        bottom.plot(steps, exact, marker="o", markersize=3, label=task, linewidth=1)
    bottom.set_ylabel("probe: exact answers (teacher-forced)")
    bottom.set_xlabel("step")
    bottom.set_ylim(-0.05, 1.05)
    for ax in (top, bottom):
        for step, _ in marks:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
        ax.legend(fontsize=7, ncol=3, loc="best")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smooth", type=int, default=1, help="records of a kind averaged per point (default 1)")
    args = ap.parse_args()
    if args.smooth < 1:
        ap.error(f"--smooth must be a whole number >= 1, got {args.smooth}")
    plot(args.log, args.out, args.smooth)


if __name__ == "__main__":
    main()
