"""Training curves of a run of train_v2.py from its log.jsonl: the answer loss of each row kind against the
step (chance is ln(vocabulary)), phase boundaries, and the held-out probe (exact and first-token accuracy).

    python training/plot_curves.py runs/model_v2/log.jsonl --out docs/results/model_v2_curves.png
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
    """(answer losses by kind: [(step, loss)], probe accuracies by task: [(step, first, exact)], phase ends)."""
    losses, probes, phases = defaultdict(list), defaultdict(list), []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        for kind, value in rec.get("answer_loss", {}).items():
            losses[kind].append((rec["step"], value))
        for task, (first, exact) in rec.get("probe", {}).items():
            probes[task].append((rec["step"], first, exact))
        if "event" in rec:
            phases.append((rec["step"], rec["event"]))
    return losses, probes, phases


def plot(path: Path, out: Path) -> None:
    losses, probes, phases = read_log(path)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 9), sharex=True)
    for kind, points in sorted(losses.items()):
        steps, values = zip(*points)
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
        for step, _ in phases:
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
    args = ap.parse_args()
    plot(args.log, args.out)


if __name__ == "__main__":
    main()
