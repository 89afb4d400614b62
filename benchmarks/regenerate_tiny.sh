#!/usr/bin/env bash
# Rerun every result of docs/benchmarks.md that depends on the bundled model's weights (after `tiny` changes):
#   bash benchmarks/regenerate_tiny.sh OUT [JOB ...]
# Each JOB writes its output to OUT/JOB.txt (its results directories under OUT) and OUT/JOB.done when it ends
# well; a JOB with its .done file is skipped, so a stopped run goes on (the evaluations inside a job are resumable
# too). Threads: OMP_NUM_THREADS (default 1); two calls with different JOBs use two cores. DRY=1 prints the
# commands instead (tests/benchmarks/test_benchmark_scripts.py parses each one). Python: $PYTHON (default python). The jobs, in order
# (default: all), with the section of docs/benchmarks.md each one feeds:
#   eval        "Accuracy of the bundled model": full and a 256-token window, 50 samples per cell
#   duo         sweeps/duo_tiny.json, DuoAttention's calibrated heads (committed; the eviction sweep reads it)
#   eviction    "Eviction methods at budgets 10-90 %" (sweeps/eviction_budgets.yaml) and its report
#   protocols   "Query-aware against query-agnostic SnapKV": SnapKV at 30 %, the question inside or after
#   tune        "`attnkit tune` on `tiny`"
#   minference  "Sparse prefill": a searched pattern config, its accuracy against full
#   share       "Share-Attention, Select-Attention, GemFilter": a share config, then the speed table
#   duo_eval    "DuoAttention": accuracy and memory of the calibrated heads against controls, decode speed
#   kivi        "KV-cache quantization": logits and bytes of KIVI against full
#   spec        "Speculative decoding": prompt lookup and the draft model (tiny-draft), acceptance and speed
#   batch_eval  "Batches": `attnkit eval` of tiny at 2048 tokens, batch 8 against batch 1
set -uo pipefail
out=${1:?usage: bash benchmarks/regenerate_tiny.sh OUT [JOB ...]}
shift
ALL=(eval duo eviction protocols tune minference share duo_eval kivi spec batch_eval)
jobs=("$@")
[ ${#jobs[@]} -gt 0 ] || jobs=("${ALL[@]}")
T=${OMP_NUM_THREADS:-1}
export OMP_NUM_THREADS=$T
A=(run "${PYTHON:-python}" -m attnkit.cli)
B=(run "${PYTHON:-python}")
C=sweeps/duo_tiny.json
mkdir -p "$out"

run() {  # DRY=1: print the commands (one a line, quoted for the shell) instead of running them
  if [ -n "${DRY:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

job() {
  case $1 in
    eval) "${A[@]}" eval --model tiny --lengths 1024,2048,3968 --samples 50 --methods full,window:window=256 \
            --tasks passkey,needle_heldout,niah_multikey,niah_multivalue,kv_retrieval,variable_tracking,code_completion,perplexity \
            --out "$out/eval_tiny" ;;
    duo) "${A[@]}" calibrate duo --model tiny --out "$C" --threads "$T" ;;
    eviction) "${A[@]}" eval --sweep sweeps/eviction_budgets.yaml --out "$out/eviction_budgets" &&
              "${A[@]}" report "$out/eviction_budgets" ;;
    protocols) for n in 3968:60 1024:20; do
                 "${A[@]}" eval --model tiny --tasks passkey,needle_heldout,niah_multikey --lengths "${n%:*}" \
                   --samples "${n#*:}" --methods full,snapkv:budget=0.3 --protocol query-aware,query-agnostic \
                   --out "$out/protocols_${n%:*}" || return 1
               done ;;
    tune) "${A[@]}" tune --model tiny --tasks passkey,code_completion --lengths 2048 --floor 0.95 --target kv \
            --out "$out/tune_kv" ;;
    minference) "${A[@]}" calibrate patterns --model tiny --length 3968 --flops-budget 0.25 --static \
                  --threads "$T" --out "$out/patterns_tiny.json" &&
                "${A[@]}" eval --model tiny --tasks passkey,code_completion,perplexity --lengths 2048,3968 --samples 20 \
                  --out "$out/minference" --methods \
                  "full,minference:config=$out/patterns_tiny.json,minference_static:config=$out/patterns_tiny.json,a_shape:n_init=64,n_local=512" ;;
    share) "${A[@]}" calibrate heads --model tiny --out "$out/share_tiny.json" --threads "$T" &&
           "${B[@]}" benchmarks/bench_share_select.py --model tiny --context 3968 --new-tokens 32 --threads "$T" \
             --share-config "$out/share_tiny.json" --out "$out/bench_share_select.json" ;;
    duo_eval) "${A[@]}" eval --model tiny --tasks passkey --lengths 2048 --samples 10 \
                --out "$out/duo_eval_passkey" --methods \
                "full,duo_attention:config=$C,duo_attention:config=$C,retrieval_ratio=0.25,duo_attention:config=$C,retrieval_ratio=0.5,duo_attention:retrieval_ratio=0,sinks=128,recent=256" &&
              "${A[@]}" bench --model tiny --context 4000 --new-tokens 64 --repeats 3 --threads "$T" --bandwidth-mib 0 \
                --methods "full,duo_attention:config=$C,duo_attention:config=$C,retrieval_ratio=0.5,duo_attention:retrieval_ratio=0,sinks=128,recent=256" ;;
    kivi) "${B[@]}" benchmarks/bench_kivi.py --model tiny --lengths 1024,2048 --new-tokens 64 --threads "$T" \
            --out "$out/bench_kivi.json" ;;
    spec) "${B[@]}" benchmarks/bench_speculative.py prompt_lookup --model tiny --context 2048 --new-tokens 128 \
            --gamma 4 --adaptive-gamma --max-gamma 16 --prompts 64 --threads "$T" &&
          "${B[@]}" benchmarks/bench_speculative.py draft_model --model tiny --draft tiny-draft --context 2048 \
            --draft-confidence 0.4 --prompts 4 --threads "$T" ;;
    batch_eval) "${B[@]}" benchmarks/bench_batch.py --threads "$T" --repeats 3 --skip fixed,cap,scaling \
                  --out "$out/batch_eval" ;;
    *) echo "unknown job $1; the jobs: ${ALL[*]}" >&2
       return 2 ;;
  esac
}

for j in "${jobs[@]}"; do
  if [ -n "${DRY:-}" ]; then job "$j" || exit $?; continue; fi
  if [ -e "$out/$j.done" ]; then echo "$j: done before"; continue; fi
  echo "$j: running ($(date -u +%H:%M) UTC), output in $out/$j.txt"
  start=$(date +%s)
  { echo "# $(lscpu | sed -n 's/^Model name: *//p'), $T thread(s), $(date -u +%F)"; job "$j"; } > "$out/$j.txt" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    echo "$(( $(date +%s) - start )) s" > "$out/$j.done"; echo "$j: done in $(cat "$out/$j.done")"
  else
    echo "$j: failed (rc $rc); see $out/$j.txt"; exit $rc
  fi
done
