"""Decode steps of several methods on one batch, interleaved one step at a time in one process; optionally
beside the same methods from an earlier git revision of attnkit (before/after in the same process).

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_steps.py --threads 1 --before main --out results/steps.json

Every (version, method) first prefills its own batch of `--batch` random prompts. Each round then copies
those sessions and decodes `--steps` tokens, one step of every (version, method) in turn, so a drift of the
machine hits all of them alike. A step is what the runner does per token: one forward over the batch, the
LM head, the greedy choice. Each step's thread CPU time (what the step cost, without the time other
processes held the core) and wall time are recorded; figures are medians over all steps of all rounds, and
ratios are to `full` of the same version (the first method must be `full`).

`full` is prefilled with `--context` tokens. The other methods are prefilled with `--method-context` tokens
(default: `--context`): an eviction method holds its budget after prefill whatever the prompt's length, so
its decode step costs the same, and a short prompt saves minutes of prefill per method. The ratios are then
decode steps at the same held KV as with `--context`-token prompts (`bench_batch.py` measures whole runs).

`--floor` adds `full` after a 16-token prompt: the step's cost with (almost) no context -- layers, LM head,
greedy choice, Python -- which no cache method goes below, so ``full's step / the floor`` bounds every method's
ratio (`bench_eviction.py` measures the same floor beside whole runs).

`--profile LABELS` breaks the steps of those runs (this checkout's) down by torch operation afterwards: calls
per step and the median time of a call (torch.profiler), so what a method adds to a step is visible op by op.

`--before REV` extracts ``src/attnkit`` at git revision REV into a temporary directory as the package
``attnkit_before`` (the package name replaced in its sources) and runs its methods on the same random-weight
model beside this checkout's; the tokens and logits of the first round are checked equal, bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import attnkit

TINY_GEOMETRY = "random:llama:layers=6,hidden=256,heads=8,kv_heads=2,head_dim=32,intermediate=768,context=16384"
BEFORE = "attnkit_before"
FLOOR_PROMPT = 16  # prompt tokens of the --floor row


def load_revision(rev: str, into: Path):
    """attnkit's package at git revision `rev`, importable as ``attnkit_before`` (extracted under `into`)."""
    root = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", rev, "src/attnkit"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / BEFORE
    (into / "src" / "attnkit").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\battnkit\b", BEFORE, path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module(BEFORE)


class Version:
    """The modules of one attnkit package (this checkout's, or another revision's) that a step needs."""

    def __init__(self, package):
        def module(name):
            return importlib.import_module(f"{package.__name__}.{name}")
        self.model, self.forward, self.session = module("model"), module("forward"), module("session")
        self.spec, self.capacity = module("methods.spec"), module("bench.capacity")


@torch.inference_mode()
def prepared(version: Version, model, spec: str, length: int, batch: int, steps: int) -> dict:
    """A session of `spec` after prefilling `batch` random prompts of `length` tokens, and its first token."""
    session = version.session.new_session(model, version.spec.parse_method_spec(spec), length, steps + 1, rows=batch)
    ids = torch.tensor(version.capacity.prompts_of(model, length, batch), device=model.device)
    hidden = version.forward.prefill(model, session, ids)
    return {"session": session, "token": version.forward.logits_of(model, hidden[:, -1]).argmax(-1)}


@torch.inference_mode()
def decode_step(version: Version, model, session, token: torch.Tensor, i: int) -> torch.Tensor:
    """The `i`-th decoding step of `session` (1 = the token after the prompt): the logits ``[rows, vocab]``."""
    pos = torch.tensor([session.prompt_len + i - 1], device=model.device)
    step = version.session.Step(session, "decode", pos)
    return version.forward.logits_of(model, version.forward.forward_rows(model, token[:, None], pos, step)[:, -1])


def run(runs: list[dict], steps: int, rounds: int) -> None:
    """Decode every run's batch `rounds` times for `steps` steps, one step of each run in turn."""
    for r in range(rounds):
        live = [(run, copy.deepcopy(run["session"]), run["token"].clone()) for run in runs]
        for i in range(1, steps + 1):
            for j, (run, session, token) in enumerate(live):
                wall, cpu = time.perf_counter(), time.thread_time()
                logits = decode_step(run["version"], run["model"], session, token, i)
                token = logits.argmax(-1)
                token.tolist()  # the runner reads the tokens back every step
                run["cpu"].append(time.thread_time() - cpu)
                run["wall"].append(time.perf_counter() - wall)
                live[j] = (run, session, token)
                if r == 0:
                    run["logits"].append(logits)


@torch.inference_mode()
def op_profile(run_: dict, steps: int) -> list[tuple[str, float, float]]:
    """Where a step's time goes: per top-level torch operation, (name, calls per step, median microseconds per
    call), over `steps` decoding steps of a fresh copy of the run's session (torch.profiler; medians, so a
    call that another process interrupted does not weigh)."""
    from torch.profiler import profile
    session, token = copy.deepcopy(run_["session"]), run_["token"].clone()
    with profile() as prof:
        for i in range(1, steps + 1):
            token = decode_step(run_["version"], run_["model"], session, token, i).argmax(-1)
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.cpu_parent is None:
            times.setdefault(event.name, []).append(event.cpu_time_total)
    rows = [(name, len(t) / steps, statistics.median(t)) for name, t in times.items()]
    return sorted(rows, key=lambda r: -r[1] * r[2])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=TINY_GEOMETRY)
    p.add_argument("--context", type=int, default=8192, help="prompt tokens of full attention")
    p.add_argument("--method-context", type=int, default=None, help="prompt tokens of the other methods "
                                                                    "(default: --context)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--budget-tokens", type=int, default=512)
    p.add_argument("--methods", default=None, help="comma-separated method specs, full first (default: full and "
                                                   "every eviction method at --budget-tokens)")
    p.add_argument("--steps", type=int, default=63, help="decoding steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--floor", action="store_true", help=f"add full after a {FLOOR_PROMPT}-token prompt (the floor)")
    p.add_argument("--before", default=None, help="a git revision whose attnkit runs beside this checkout's")
    p.add_argument("--profile", default=None, help="comma-separated labels (methods, floor) whose step is broken "
                                                   "down by torch operation after the timing (this checkout's)")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    b = f"budget_tokens={args.budget_tokens}"
    names = ("streaming", "h2o", "tova", "keyformer", "snapkv", "knorm", "keydiff", "expected_attention")
    specs = args.methods.split(",") if args.methods else ["full"] + [f"{name}:{b}" for name in names]
    if specs[0] != "full":
        p.error("the first method must be full (the ratios are to it)")
    versions = {"after": Version(attnkit)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            versions = {"before": Version(load_revision(args.before, Path(tmp))), **versions}
        runs = []
        for name, version in versions.items():
            model = version.model.load_model(args.model)
            for label in specs + (["floor"] if args.floor else []):
                spec = "full" if label == "floor" else label
                length = {"full": args.context, "floor": FLOOR_PROMPT}.get(label, args.method_context or args.context)
                runs.append({"version_name": name, "version": version, "model": model, "spec": label, "length": length,
                             **prepared(version, model, spec, length, args.batch, args.steps),
                             "cpu": [], "wall": [], "logits": []})
        run(runs, args.steps, args.rounds)
        profiles = {label: op_profile(next(r for r in runs if r["version_name"] == "after" and r["spec"] == label),
                                      args.profile_steps)
                    for label in (args.profile.split(",") if args.profile else [])}
    rows = []
    for run_ in runs:
        full = next(r for r in runs if r["version_name"] == run_["version_name"] and r["spec"] == "full")
        cpu, wall = statistics.median(run_["cpu"]), statistics.median(run_["wall"])
        rows.append({"version": run_["version_name"], "spec": run_["spec"], "prompt_tokens": run_["length"],
                     "batch": args.batch, "step_cpu_ms": cpu * 1e3, "step_wall_ms": wall * 1e3,
                     "tokens_per_cpu_s": args.batch / cpu, "vs_full_cpu": statistics.median(full["cpu"]) / cpu,
                     "vs_full_wall": statistics.median(full["wall"]) / wall, "steps": len(run_["cpu"])})
    if args.before:
        for spec in specs + (["floor"] if args.floor else []):
            pair = [r for r in runs if r["spec"] == spec]
            same = all(torch.equal(x, y) for x, y in zip(pair[0]["logits"], pair[1]["logits"]))
            for row in rows:
                if row["spec"] == spec:
                    row["same_logits_as_before"] = same
    print(f"Model {args.model}, batch {args.batch}, {torch.get_num_threads()} threads, {args.rounds} rounds of "
          f"{args.steps} steps; medians per step; x full: full's step / the method's, same version\n")
    print("| version | method | prompt | step CPU ms | x full (CPU) | x full (wall) |"
          + (" same logits as before |" if args.before else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.before else ""))
    for row in rows:
        print(f"| {row['version']} | {row['spec']} | {row['prompt_tokens']} | {row['step_cpu_ms']:.2f} | "
              f"{row['vs_full_cpu']:.2f} | {row['vs_full_wall']:.2f} |"
              + (f" {row['same_logits_as_before']} |" if args.before else ""))
    for label, ops in profiles.items():
        print(f"\nOperations of a step of {label} ({args.profile_steps} steps; top-level torch calls):\n")
        print("| operation | calls / step | median us / call | us / step |\n|---|---|---|---|")
        for name, calls, median in ops[:25]:
            print(f"| {name} | {calls:g} | {median:.1f} | {calls * median:.0f} |")
        print(f"| (all operations) | {sum(c for _, c, _ in ops):g} | | {sum(c * m for _, c, m in ops):.0f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "rows": rows, "profiles": profiles}, indent=1)
                                  + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
