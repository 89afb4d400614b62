"""Make model v2 attnkit's bundled `tiny`, and its draft `tiny-draft` (issue #29), from the chain's exports.

    PYTHONPATH=src:training python training/chain_v2.py --runs-dir runs        # the model (hours on a CPU)
    PYTHONPATH=src:training python training/train_v2.py --stage model_v2_draft \
        --run-dir runs/model_v2_draft --tokenizer-from runs/model_v2/export --fp32   # its draft
    PYTHONPATH=src:training python training/bundle_v2.py --runs-dir runs        # into src/attnkit/assets

Each bundled directory gets its export's config, generation config and tokenizer, the weights stored in float16
(half the bytes in the repository; attnkit loads them as float32, so the model runs in float32 with weights
rounded once to float16: docs/benchmarks.md measures what that rounding changes) and training.json, which
records how the weights were made: every stage of the chain with its steps, tokens, minutes, device and
precision, and the commands that rebuild them. --log-out writes the stages' logs as one file (each record gains
its stage's name) for docs/results/.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import train_v2
from attnkit.eval.data.tasks import TASKS
from attnkit.generation import encode_prompt
from attnkit.model import load_model
from chain_v2 import stage_done

HERE = Path(__file__).resolve().parent
ASSETS = HERE.parent / "src" / "attnkit" / "assets"
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
REBUILD = ["PYTHONPATH=src:training python training/chain_v2.py --runs-dir runs",
           "PYTHONPATH=src:training python training/train_v2.py --stage model_v2_draft "
           "--run-dir runs/model_v2_draft --tokenizer-from runs/model_v2/export --fp32",
           "PYTHONPATH=src:training python training/bundle_v2.py --runs-dir runs"]


def stage_record(run_dir: Path, stage: str) -> dict:
    """What a stage's export says about its run, or where only its log came back (gpu_chain.sh returns the
    newest stage's export and every stage's log), what the log says."""
    record = {"name": run_dir.name, "config": f"training/curriculum_v2.json, stage {stage}"}
    meta_file, log_file = run_dir / "export" / "training.json", run_dir / "log.jsonl"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        return {**record, "steps": meta["step"], "tokens": meta["tokens"], "minutes": round(meta["seconds"] / 60, 1),
                "device": meta.get("device"), "precision": meta.get("precision")}
    if log_file.is_file():
        last = [r for r in map(json.loads, log_file.read_text().splitlines()) if "minutes" in r][-1]
        return {**record, "steps": last["step"], "minutes": last["minutes"]}
    raise SystemExit(f"{run_dir}: the stage has neither an export nor a log; run training/chain_v2.py to the end")


def bundle(export: Path, dest: Path, meta: dict, dtype: torch.dtype) -> None:
    """Copy an export to dest, its weights stored as dtype, training.json replaced by meta."""
    missing = [f for f in (*COPIED, "model.safetensors") if not (export / f).is_file()]
    if missing:
        raise SystemExit(f"{export}: not a finished export (missing {', '.join(missing)})")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in COPIED:
        shutil.copyfile(export / name, dest / name)
    weights = load_file(export / "model.safetensors")
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, dest / "model.safetensors",
              metadata={"format": "pt"})
    (dest / "model.safetensors").chmod(0o644)  # safetensors writes it readable by its owner only
    (dest / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def lineage(runs: Path, curriculum: Path) -> list[dict]:
    """The chain's stages as they ran; the last one (the model) must have finished."""
    stages = [entry for entry in train_v2.curriculum(curriculum) if entry["chain"]]
    names = [entry["config"]["name"] for entry in stages]
    if not stage_done(runs / names[-1], stages[-1]["config"], stages[-1].get("max_steps")):
        raise SystemExit(f"{runs / names[-1]}: the chain's last stage has not finished; run training/chain_v2.py "
                         f"--runs-dir {runs} to the end first")
    return [stage_record(runs / name, name) for name in names]


def rounding_effect(export: Path, bundled: Path, length: int) -> list[str]:
    """How the stored weights change the model: the largest logit difference and the share of positions whose
    argmax agrees, the bundled model (run in float32) against its export, on each eval task's first sample."""
    trained, stored = load_model(str(export)), load_model(str(bundled))
    lines = []
    for name, task in TASKS.items():
        sample = task.make(trained.tokenizer, length, seed=0)
        ids = encode_prompt(trained, sample.prompt + sample.target)[None]  # BOS first, as the runner feeds it
        with torch.no_grad():
            a, b = trained.hf(ids).logits[0], stored.hf(ids).logits[0]
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        lines.append(f"{name}: {ids.shape[1]} tokens, max |logit difference| {(a - b).abs().max().item():.4f}, "
                     f"argmax agrees at {agree:.2%} of positions")
    return lines


def write_log(runs: Path, names: list[str], out: Path) -> None:
    """The stages' log.jsonl files as one, in chain order, each record tagged with its stage."""
    with out.open("w") as f:
        for name in names:
            for line in (runs / name / "log.jsonl").read_text().splitlines():
                f.write(json.dumps({"stage": name, **json.loads(line)}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs-dir", type=Path, required=True)
    ap.add_argument("--curriculum", type=Path, default=train_v2.CURRICULUM)
    ap.add_argument("--draft", default="model_v2_draft", help="the draft's stage (and run directory under --runs-dir)")
    ap.add_argument("--dest", type=Path, default=ASSETS, help="where `tiny` and `tiny-draft` go")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="how the weights are stored")
    ap.add_argument("--check", type=int, default=None, metavar="LENGTH",
                    help="print what storing the weights changed in tiny's logits on LENGTH-token eval prompts")
    ap.add_argument("--log-out", type=Path, default=None, help="write the stages' logs here as one file")
    args = ap.parse_args()
    stages = lineage(args.runs_dir, args.curriculum)
    draft_config = train_v2.load_config(args.curriculum, args.draft)
    final = args.runs_dir / stages[-1]["name"] / "export"
    draft_dir = args.runs_dir / args.draft
    if not stage_done(draft_dir, draft_config, None):
        raise SystemExit(f"{draft_dir}: the draft has not finished its schedule (training/train_v2.py goes on)")
    if (final / "tokenizer.json").read_text() != (draft_dir / "export" / "tokenizer.json").read_text():
        raise SystemExit(f"{draft_dir}: the draft's tokenizer is not the model's (train it with --tokenizer-from)")
    common = {"stored_dtype": args.dtype, "rebuild": REBUILD}
    for name, export, records in (("tiny", final, stages),
                                  ("tiny-draft", draft_dir / "export", [stage_record(draft_dir, args.draft)])):
        parameters = json.loads((export / "training.json").read_text())["parameters"]
        bundle(export, args.dest / name, {"model": name, "parameters": parameters, "stages": records, **common},
               DTYPES[args.dtype])
    if args.log_out is not None:
        write_log(args.runs_dir, [s["name"] for s in stages], args.log_out)
    print(f"bundled {final} as tiny and {draft_dir / 'export'} as tiny-draft in {args.dest} ({args.dtype})")
    if args.check is not None:
        print("\n".join(rounding_effect(final, args.dest / "tiny", args.check)))


if __name__ == "__main__":
    main()
