"""The ``attnkit`` argument parser: every subcommand, every option with its help and default."""

from __future__ import annotations

from attnkit.cli.commands import cmd_bench, cmd_generate, cmd_methods
from attnkit.cli.evaluate import cmd_calibrate, cmd_demo, cmd_eval, cmd_report
from attnkit.cli.options import Parser
from attnkit.cli.serve import add_serve_parser
from attnkit.cli.speculation import add_speculation_options
from attnkit.cli.tune import cmd_tune
from attnkit.eval.data.long_output import DEFAULT_CONTINUATION_TOKENS, DEFAULT_STRETCH_TOKENS
from attnkit.eval.data.task_registry import ALL_TASKS, GENERATED_TASKS
from attnkit.eval.run.cells import DEFAULT_BATCH_SIZE

MODEL_HELP = "tiny, tiny-draft, random:<arch>[:k=v,..], a model directory or hub id, any of them with :yarn=F"
METHOD_HELP = "method spec NAME[:k=v,...] or PREFILL+CACHE (e.g. snapkv:budget=0.3, minference+snapkv)"
TASKS_HELP = f"comma-separated tasks from {', '.join(ALL_TASKS)}, or longbench:DATASET with --data"
CALIBRATION_TASKS_HELP = f"comma-separated calibration tasks from {', '.join(GENERATED_TASKS)}"
THREADS_HELP = "torch intra-op threads (default: torch's choice)"


def add_placement_options(p) -> None:
    """``--device-map`` / ``--offload-dir``: the model over several devices through accelerate."""
    p.add_argument("--device-map", default=None, metavar="MAP",
                   help="place the model's modules through accelerate: auto, NAME=DEVICE,... "
                        "(model.layers.1=disk,lm_head=cpu; devices cpu, disk, mps, N or cuda:N) or a JSON/YAML file "
                        "mapping module names to devices (needs pip install 'attnkit[accelerate]')")
    p.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="where --device-map's disk entries are written (default: a temporary folder)")


def build_parser() -> Parser:
    parser = Parser(prog="attnkit", description="Faster, lighter long-context inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("methods", help="list the registered methods and their parameters")
    p.set_defaults(func=cmd_methods)
    _generate_parser(sub)
    _bench_parser(sub)
    _eval_parser(sub)
    _tune_parser(sub)
    _calibrate_parsers(sub)

    p = sub.add_parser("report", help="an HTML page (tables, plots) and PNGs from a results directory")
    p.add_argument("dir", help="a directory holding results.jsonl (from eval --out or eval --sweep)")
    p.add_argument("--out", default=None, help="the HTML file to write (default DIR/report.html)")
    p.set_defaults(func=cmd_report)

    add_serve_parser(sub)

    p = sub.add_parser("demo", help="the main job: full attention against a window, SnapKV and Quest on the bundled "
                                    "model (scores, KV memory, speed)")
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    p.add_argument("--samples", type=int, default=6, help="prompts per task and length")
    p.add_argument("--out", default="attnkit-results/demo", help="directory for results.jsonl and the report")
    p.set_defaults(func=cmd_demo)
    return parser


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a method")
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    p.add_argument("--prompt", help="the prompt text (or --prompt-file)")
    p.add_argument("--prompt-file", metavar="FILE", help="a UTF-8 text file holding the prompt (or --prompt)")
    p.add_argument("--prompts-file", metavar="FILE.jsonl",
                   help='many prompts as one batch: one JSON object per line with a "prompt" (text or token ids); '
                        "other keys (e.g. an id) are copied into that prompt's output")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="with --prompts-file: run the prompts in batches of N, in order (default: all in one batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (>= 1)")
    p.add_argument("--method", default="full", metavar="SPEC", help=METHOD_HELP)
    p.add_argument("--param", action="append", metavar="KEY=VALUE",
                   help="a parameter of a single --method (repeatable)")
    p.add_argument("--recipe", metavar="FILE", help="JSON/YAML recipe file (instead of --method/--param)")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill the prompt in chunks of N tokens")
    p.add_argument("--do-sample", action="store_true", help="sample the next token (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (a finite number > 0)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the K most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set of tokens with mass P "
                                                               "(0 < P <= 1; nucleus sampling)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats (with "
                                                       "--prompts-file: one per line, with the prompt's index)")
    add_speculation_options(p)
    add_placement_options(p)
    p.set_defaults(func=cmd_generate)


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="prefill/decode time and KV memory of methods vs full, interleaved")
    p.add_argument("--model", default="random:llama", help=MODEL_HELP)
    p.add_argument("--context", type=int, default=4096, help="prompt tokens (>= 1)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (>= 2)")
    p.add_argument("--methods", default="full,window:window=1024", help="comma-separated method specs")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every method (>= 1)")
    p.add_argument("--batch-sizes", default="1", metavar="B,...",
                   help="comma-separated batch sizes, each method measured at each (prompts of --context tokens "
                        "decoded side by side; tok/s of the whole batch, KV per sequence and in total)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--recipe", action="append", metavar="FILE", help="a recipe file to bench too (repeatable)")
    p.add_argument("--bandwidth-mib", type=int, default=256,
                   help="tensor size for the memory-bandwidth measurement behind the decode floor (0: skip)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    add_speculation_options(p)
    add_placement_options(p)
    p.set_defaults(func=cmd_bench)


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="task scores of methods relative to full")
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: tiny, or the sweep's)")
    p.add_argument("--tasks", default=None,
                   help=f"{TASKS_HELP} (default: passkey, or every dataset of --data)")
    p.add_argument("--lengths", default="1024", help="comma-separated prompt lengths in tokens")
    p.add_argument("--methods", default=None, help="comma-separated method specs (default: full)")
    p.add_argument("--recipe", action="append", metavar="FILE", help="a recipe file to evaluate too (repeatable)")
    p.add_argument("--sweep", metavar="FILE", help="a sweep file (recipes x budgets x tasks x lengths); resumable")
    p.add_argument("--only", metavar="NAME[,NAME...]",
                   help="with --sweep: run only these recipes of the sweep (and full), by name")
    p.add_argument("--data", action="append", metavar="PATH",
                   help="LongBench, RULER or InfiniteBench JSONL items (a file, or a folder of them; repeatable): "
                        "tasks longbench:DATASET, ruler:TASK, infinitebench:TASK")
    p.add_argument("--protocol", default=None, metavar="NAME[,NAME...]",
                   help="query-aware (the question is in the compressed prompt), query-agnostic (the context is "
                        "compressed, then the question fed), multi-query (a context compressed once answers "
                        "--queries questions); comma-separated to run several side by side; default: query-aware; "
                        "with --sweep: run only these protocols of the sweep")
    p.add_argument("--queries", type=int, default=None, metavar="K",
                   help="questions per context, the task's own first (default: 1, or 4 with multi-query)")
    p.add_argument("--seeds", default=None, metavar="S,...",
                   help="seeds of a stochastic method (keyformer's noise): it runs once per seed")
    p.add_argument("--samples", type=int, default=20, help="prompts per task and length (>= 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    p.add_argument("--continuation-tokens", type=int, default=None, metavar="N",
                   help=f"task continuation: reference tokens fed one per decoding step after the prompt and scored "
                        f"in bits per byte (default: {DEFAULT_CONTINUATION_TOKENS}, or the sweep's continuation_tokens)")
    p.add_argument("--stretch-tokens", type=int, default=None, metavar="N",
                   help=f"task recall_after_stretch: held-out tokens fed one per decoding step between the needle "
                        f"prompt and the question (default: {DEFAULT_STRETCH_TOKENS}, or the sweep's stretch_tokens)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help=f"samples per generate call (default: {DEFAULT_BATCH_SIZE}, or the sweep's batch_size); the "
                        f"scores are those of one at a time; in a row, prefill_s is the prefill a sample shared with "
                        f"its batch, decode_tokens_per_s the mean rate of one sequence, throughput_tokens_per_s the "
                        f"cell's decode tokens of all sequences per second")
    p.add_argument("--out", default=None, help="directory for results.jsonl and table.txt")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--ray", action="store_true",
                   help="with --sweep: run the cells as Ray tasks on actors that keep the model loaded (one per GPU, "
                        "or --workers CPU actors); this process alone writes results.jsonl (needs pip install "
                        "'attnkit[ray]')")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --ray: the Ray cluster to use (default: start a local one)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="with --ray: actors to start (default: one per GPU, else one per CPU of the cluster)")
    add_placement_options(p)
    p.set_defaults(func=cmd_eval)


def _tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="the recipe that keeps a score floor at the least KV memory or time (resumable)")
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    p.add_argument("--tasks", default="passkey", help=f"comma-separated tasks from {', '.join(ALL_TASKS)}")
    p.add_argument("--lengths", default="1024", help="comma-separated prompt lengths in tokens")
    p.add_argument("--floor", type=float, default=0.95,
                   help="the score relative to full to keep on every task and length (0 < f <= 1)")
    p.add_argument("--target", default="kv", choices=["kv", "decode", "prefill"],
                   help="least peak KV bytes, fastest decode or fastest prefill")
    p.add_argument("--space", metavar="FILE", default=None,
                   help="a YAML/JSON space (prefill, cache, budgets, allocation, quantize, decode, recipes); default: "
                        "the target's (docs/evaluation.md)")
    p.add_argument("--samples", type=int, default=2, help="samples per task and length in the first round")
    p.add_argument("--rounds", type=int, default=3, help="successive-halving rounds (round r: samples x eta^r)")
    p.add_argument("--eta", type=int, default=2, help="keep the best 1/eta of the candidates each round (>= 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first round's prompts (the next rounds follow)")
    p.add_argument("--protocol", default="query-aware", choices=["query-aware", "query-agnostic", "multi-query"],
                   help="how the compressed cache meets the question (see eval --protocol)")
    p.add_argument("--queries", type=int, default=None, metavar="K",
                   help="questions per context (default: 1, or 4 with multi-query)")
    p.add_argument("--confirm", action="store_true", help="run the winner once more on fresh samples")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help=f"samples per generate call (default: {DEFAULT_BATCH_SIZE})")
    p.add_argument("--out", default=None, help="directory for results.jsonl, recipe.json, tune.json, report.html")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--ray", action="store_true", help="run the cells on Ray actors that keep the model loaded "
                                                      "(needs pip install 'attnkit[ray]')")
    p.add_argument("--ray-address", default=None, metavar="ADDR", help="with --ray: the Ray cluster to use")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="with --ray: actors to start")
    add_placement_options(p)
    p.set_defaults(func=cmd_tune)


def _calibrate_parsers(sub) -> None:
    p = sub.add_parser("calibrate", help="offline calibration tools that write JSON configs")
    calibrations = p.add_subparsers(dest="calibration", required=True, metavar="TOOL")
    c = calibrations.add_parser("patterns", help="MInference: search a sparse pattern per head (Alg. 1, Table 7)")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--length", type=int, required=True, help="calibration prompt length in tokens")
    c.add_argument("--flops-budget", type=float, required=True,
                   help="kernel FLOPs as a fraction of dense causal attention at --length (0 < f <= 1)")
    c.add_argument("--out", required=True, help="the JSON config to write")
    c.add_argument("--tasks", default="passkey,kv_retrieval,code_completion", help=CALIBRATION_TASKS_HELP)
    c.add_argument("--samples", type=int, default=1, help="prompts per task")
    c.add_argument("--seed", type=int, default=0, help="seed of the calibration prompts")
    c.add_argument("--block-size", type=int, default=64, help="block size of the block-sparse patterns")
    c.add_argument("--last-q", type=int, default=64, help="queries that estimate vertical/slash lines (Alg. 2)")
    c.add_argument("--static", action="store_true", help="also store the first prompt's indices (minference_static)")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="patterns")

    c = calibrations.add_parser("heads", help="Share-Attention: cluster heads by the eq. 9 distance (Sec. 4.1)")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--out", required=True, help="the JSON share config to write")
    th = c.add_mutually_exclusive_group()
    th.add_argument("--threshold", type=float, default=None, help="one threshold for every layer (default 0.18)")
    th.add_argument("--thresholds", default=None, metavar="FILE", help="one threshold per layer (JSON list or numbers)")
    th.add_argument("--threshold-schedule", default=None, metavar="LOW,HIGH[,A:B]",
                    help="HIGH for layers A..B-1 (default: the middle-to-late band), LOW for the others")
    c.add_argument("--length", type=int, default=1024, help="calibration prompt length in tokens")
    c.add_argument("--tasks", default="passkey,kv_retrieval,code_completion", help=CALIBRATION_TASKS_HELP)
    c.add_argument("--samples", type=int, default=1, help="prompts per task")
    c.add_argument("--seed", type=int, default=0, help="seed of the calibration prompts")
    c.add_argument("--split", choices=["calibration", "train"], default="calibration",
                   help="calibration: held-out text, seeds apart from eval; train: the training stream (slower)")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="heads")

    c = calibrations.add_parser("duo", help="DuoAttention: optimise a gate per kv head, retrieval heads (Sec. 2.2)")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--out", required=True, help="the JSON head config to write (duo_attention:config=FILE)")
    sel = c.add_mutually_exclusive_group()
    sel.add_argument("--threshold", type=float, default=None, help="retrieval heads: gate >= threshold (default 0.5)")
    sel.add_argument("--retrieval-ratio", type=float, default=None,
                     help="retrieval heads: this fraction of all kv heads, the highest gates")
    c.add_argument("--length", type=int, default=1024, help="calibration prompt length in tokens")
    c.add_argument("--tasks", default="passkey,kv_retrieval", help=CALIBRATION_TASKS_HELP)
    c.add_argument("--samples", type=int, default=1, help="prompts per task")
    c.add_argument("--steps", type=int, default=60, help="optimisation steps (one prompt each, in turn)")
    c.add_argument("--lr", type=float, default=0.02, help="the gates' learning rate (Adam)")
    c.add_argument("--reg-weight", type=float, default=0.05, help="lambda of the L1 penalty on the gates")
    c.add_argument("--sinks", type=int, default=128, help="attention sinks of a streaming head")
    c.add_argument("--recent", type=int, default=256, help="recent window of a streaming head")
    c.add_argument("--seed", type=int, default=0, help="seed of the calibration prompts")
    c.add_argument("--split", choices=["calibration", "train"], default="calibration",
                   help="calibration: held-out text, seeds apart from eval; train: the training stream (slower)")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="duo")

    c = calibrations.add_parser("filter-layer", help="Select-Attention: sweep the filter layer on calibration tasks")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--tasks", default="passkey,kv_retrieval", help=f"{CALIBRATION_TASKS_HELP} (scored by their metric)")
    c.add_argument("--length", type=int, default=1024, help="calibration prompt length in tokens")
    c.add_argument("--samples", type=int, default=2, help="samples per task")
    c.add_argument("--p", type=float, default=0.95, help="top-p mass kept while decoding (p_decode)")
    c.add_argument("--layers", default=None, help="comma-separated candidate layers (default: all but the last)")
    c.add_argument("--prefill-select", action="store_true", help="also select at prefill (p_prefill = --p)")
    c.add_argument("--value-weighted", action="store_true", help="weight attention by value norms")
    c.add_argument("--seed", type=int, default=0, help="seed of the calibration prompts")
    c.add_argument("--split", choices=["calibration", "train"], default="calibration",
                   help="calibration: held-out text; train: the training stream")
    c.add_argument("--out", default=None, help="optional JSON file with the table")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="filter_layer")

    c = calibrations.add_parser("kvzap", help="KVzap: train a surrogate of kvzip's scores per layer (kvzap:config=FILE)")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--out", required=True, help="the safetensors file to write (kvzap:config=FILE)")
    c.add_argument("--kind", choices=["linear", "mlp"], default="linear",
                   help="the surrogate: ridge regression (closed form) or a two-layer MLP")
    c.add_argument("--data", default=None, metavar="DIR",
                   help="train on your own text: a folder of *.txt files and *.jsonl files with a \"text\" field "
                        "(default: attnkit's mixture of nine kinds of text, docs/methods.md#kvzap)")
    c.add_argument("--samples", type=int, default=72, help="training windows (the mixture: 8 of each kind)")
    c.add_argument("--length", type=int, default=1024, help="tokens per window")
    c.add_argument("--heldout", type=int, default=9,
                   help="held-out windows that measure the fit (the mixture: one per kind; --data: texts held out)")
    c.add_argument("--seed", type=int, default=0, help="seed of the windows (and of the MLP's training)")
    c.add_argument("--alpha", type=float, default=1.0, help="linear: the ridge penalty")
    c.add_argument("--hidden-dim", type=int, default=512, help="mlp: hidden units")
    c.add_argument("--epochs", type=int, default=15, help="mlp: epochs")
    c.add_argument("--lr", type=float, default=5e-3, help="mlp: AdamW's learning rate (cosine schedule)")
    c.add_argument("--batch-size", type=int, default=512, help="mlp: tokens per step")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="kvzap")

    c = calibrations.add_parser("fastkvzip", help="Fast KVzip: train a gate per layer on kvzip's scores "
                                                  "(fastkvzip:config=FILE)")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--out", required=True, help="the safetensors file to write (fastkvzip:config=FILE)")
    c.add_argument("--samples", type=int, default=16, help="training windows of the corpus's training split")
    c.add_argument("--length", type=int, default=1024, help="tokens per window")
    c.add_argument("--heldout", type=int, default=2, help="held-out windows that measure the fit")
    c.add_argument("--seed", type=int, default=0, help="seed of the windows, the initialisation and the batches")
    c.add_argument("--dim", type=int, default=16, help="the gate's query and key dimension (the paper's 16)")
    c.add_argument("--sinks", type=int, default=16, help="learnt sink keys per kv head (the paper's 16)")
    c.add_argument("--steps", type=int, default=1000, help="SGD steps (the authors': 5000)")
    c.add_argument("--lr", type=float, default=0.2, help="SGD's learning rate (momentum 0.9, the authors' schedule)")
    c.add_argument("--batch-size", type=int, default=1000, help="tokens per step")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="fastkvzip")

    c = calibrations.add_parser("restorekv", help="RestoreKV: train restore tokens and LoRA adapters by "
                                                  "self-distillation around kvzip (restorekv:config=FILE)")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--out", required=True, help="the safetensors file to write (restorekv:config=FILE)")
    c.add_argument("--kvpress-dir", default=None, help="also write the weights as kvpress loads them (a peft "
                                                       "adapter folder plus restore_embeddings.safetensors)")
    c.add_argument("--tasks", default=None, help="task generators of the prompts (comma-separated; default: "
                                                 "passkey,niah_multikey,kv_retrieval,variable_tracking,needle_heldout)")
    c.add_argument("--samples", type=int, default=64, help="training prompts (the training split)")
    c.add_argument("--length", type=int, default=1024, help="prompt tokens")
    c.add_argument("--heldout", type=int, default=8, help="held-out prompts that measure the KL")
    c.add_argument("--new-tokens", type=int, default=64, help="continuation tokens the full-cache model writes")
    c.add_argument("--tokens", type=int, default=8, help="restore tokens (the published weights' 8)")
    c.add_argument("--rank", type=int, default=2, help="LoRA rank")
    c.add_argument("--alpha", type=float, default=2.0, help="LoRA alpha (the adapters scale by alpha / rank)")
    c.add_argument("--steps", type=int, default=400, help="Adam steps")
    c.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    c.add_argument("--lr", type=float, default=2e-3, help="Adam's learning rate (cosine decay)")
    c.add_argument("--eval-budget", type=float, default=0.2, help="the budget of the held-out KL")
    c.add_argument("--split", choices=["train", "calibration"], default="train",
                   help="text of the training prompts: the training split, or the held-out one (quicker)")
    c.add_argument("--seed", type=int, default=0, help="seed of the prompts, the initialisation and the draws")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="restorekv")

    c = calibrations.add_parser("lukv", help="LU-KV: profile a budget curve per layer and kv head around Expected "
                                             "Attention (lukv:curve=FILE)")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--out", required=True, help="the safetensors curve to write (lukv:curve=FILE)")
    c.add_argument("--npy", default=None, help="also write the curve as kvpress's .npy [99, layers, kv heads]")
    c.add_argument("--tasks", default=None, help="task generators of the context/question pairs (comma-separated; "
                                                 "default: passkey,niah_multikey,kv_retrieval,variable_tracking,"
                                                 "needle_heldout)")
    c.add_argument("--samples", type=int, default=2, help="pairs per task")
    c.add_argument("--length", type=int, default=1024, help="prompt tokens per pair")
    c.add_argument("--new-tokens", type=int, default=64, help="answer tokens the oracle utility observes")
    c.add_argument("--temperature", type=float, default=0.7, help="the answers' sampling temperature (0: greedy)")
    c.add_argument("--sink", type=int, default=4, help="first positions never evicted (lukv's sink)")
    c.add_argument("--window", type=int, default=1, help="last positions never evicted (lukv's window)")
    c.add_argument("--seed", type=int, default=0, help="seed of the pairs and of the answers' sampling")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="lukv")

    c = calibrations.add_parser("triattention", help="TriAttention: pre-RoPE query statistics per head "
                                                     "(triattention:config=FILE)")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--out", required=True, help="the JSON statistics to write (triattention:config=FILE)")
    c.add_argument("--samples", type=int, default=8, help="windows of the corpus's training split")
    c.add_argument("--length", type=int, default=1024, help="tokens per window")
    c.add_argument("--seed", type=int, default=0, help="seed of the windows")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="triattention")

    c = calibrations.add_parser("qfilter", help="Q-Filters: one query direction per layer and kv head "
                                                "(qfilter:config=FILE)")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--out", required=True, help="the JSON filters to write (qfilter:config=FILE)")
    c.add_argument("--samples", type=int, default=8, help="windows of the corpus's training split")
    c.add_argument("--length", type=int, default=1024, help="tokens per window")
    c.add_argument("--seed", type=int, default=0, help="seed of the windows")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="qfilter")

    c = calibrations.add_parser("expected_attention", help="Expected Attention: pre-RoPE query mean and covariance "
                                                           "per head (expected_attention:stats=FILE)")
    c.add_argument("--model", default="tiny", help=MODEL_HELP)
    c.add_argument("--out", required=True, help="the safetensors statistics to write (expected_attention:stats=FILE)")
    c.add_argument("--samples", type=int, default=8, help="windows of the corpus's training split")
    c.add_argument("--length", type=int, default=1024, help="tokens per window")
    c.add_argument("--n-sink", type=int, default=4, help="first positions of each window left out")
    c.add_argument("--seed", type=int, default=0, help="seed of the windows")
    c.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    c.set_defaults(func=cmd_calibrate, calibration="expected_attention")
