"""Rebuild model v2's weights from nothing: the stages of a chain file, in order, each from the last one's export.

    PYTHONPATH=src:training python training/chain_v2.py --runs-dir runs                 # every chain stage
    PYTHONPATH=src:training python training/chain_v2.py --runs-dir runs --max-minutes 50 # stop (saved) past 50 min
    PYTHONPATH=src:training python training/chain_v2.py --runs-dir runs --until model_v2_reach

The best weights came from a lineage of runs, each a config trained from the previous run's weights
(docs/benchmarks.md tells why each was added); the stages of `training/curriculum_v2.json` marked "chain" list
it, in order, so one command rebuilds them on
a new machine: about 25,800 steps of 4,096 tokens, hours on a CPU, far fewer on a GPU (docs/benchmarks.md,
"Rebuilding model v2"). A stage trains in RUNS_DIR/<its config's name>. Run again, the chain goes on from the
last stage begun (the ones before it are done, and their directories need not be there: a new machine needs
only the last one) and resumes it: from its checkpoint, or, where only its export is left (the checkpoint, with
the optimizer's moments, is three times larger and may not have been kept), from those weights with the
schedule going on and a fresh optimizer. The last stage's export is the model (RUNS_DIR/<name>/export).
Options not listed here (--threads, --save-every, --probe-every, --data-workers, --fp32) go to every stage; a
stage marked "fp32" in the curriculum trains in float32 anyway (the base run, whose first skill, copying, formed
in float32 but not in bf16 autocast), the others in bf16 autocast where it is fast (a GPU, a CPU with native bf16;
docs/benchmarks.md has the speeds).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import train_v2


def stage_done(run_dir: Path, config: dict, max_steps: int | None) -> bool:
    """Whether the stage's export holds its finished schedule (or its step limit)."""
    meta = run_dir / "export" / "training.json"
    if not meta.exists():
        return False
    state = json.loads(meta.read_text())
    return state["phase_idx"] >= len(config["phases"]) or (max_steps is not None and state["step"] >= max_steps)


def _begun(run_dir: Path) -> bool:
    return (run_dir / "ckpt.pt").exists() or (run_dir / "export" / "training.json").exists()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--curriculum", type=Path, default=train_v2.CURRICULUM)
    ap.add_argument("--runs-dir", type=Path, required=True)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (after saving) past this wall time")
    ap.add_argument("--until", default=None, help="stop after the stage whose config has this name")
    args, rest = ap.parse_known_args()
    stages = [entry for entry in train_v2.curriculum(args.curriculum) if entry["chain"]]
    configs = [entry["config"] for entry in stages]
    names = [c["name"] for c in configs]
    if args.until is not None and args.until not in names:
        raise SystemExit(f"--until {args.until!r}: no stage has that name; the stages are {', '.join(names)}")
    started = time.time()
    begun = [i for i, c in enumerate(configs) if _begun(args.runs_dir / c["name"])]
    first = begun[-1] if begun else 0  # the stages before the last one begun are done
    if first:
        print(f"chain: starts at {names[first]}, stage {first + 1} of {len(stages)}", flush=True)
    if args.until is not None and names.index(args.until) < first:
        print(f"chain: {args.until} is done (a later stage has begun)", flush=True)
        return
    previous, trained = None, False
    for stage, config in zip(stages[first:], configs[first:]):
        run_dir = args.runs_dir / config["name"]
        max_steps = stage.get("max_steps")
        if stage_done(run_dir, config, max_steps):
            print(f"chain: {config['name']} is done", flush=True)
        else:
            init = None
            if not (run_dir / "ckpt.pt").exists():
                init = run_dir / "export" if _begun(run_dir) else previous
            argv = ["--config", str(args.curriculum), "--stage", config["name"], "--run-dir", str(run_dir), *rest]
            if init is not None:
                argv += ["--init-from", str(init)]
            if max_steps is not None:
                argv += ["--max-steps", str(max_steps)]
            if stage.get("fp32"):  # a flag: given twice (also in the options passed on) it is still just set
                argv.append("--fp32")
            if args.max_minutes is not None:
                left = args.max_minutes - (time.time() - started) / 60
                if left <= 0 and trained:
                    print(f"chain: out of time before {config['name']}", flush=True)
                    return
                # a call trains at least one step of the first stage it reaches (saved), however short its time
                argv += ["--max-minutes", str(max(left, 1e-9))]
            trained = True
            print(f"chain: {config['name']} ({' '.join(argv)})", flush=True)
            if not train_v2.train(train_v2.parser().parse_args(argv)):
                print(f"chain: stopped in {config['name']}; run again to go on", flush=True)
                return
        previous = run_dir / "export"
        if config["name"] == args.until:
            break
    print(f"chain: done; the model is {previous}", flush=True)


if __name__ == "__main__":
    main()
