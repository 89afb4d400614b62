#!/usr/bin/env bash
# Model v2's chain (training/chain_v2.py), then its draft model, on a CUDA machine lent by the device tool:
#   bash training/gpu_chain.sh MINUTES
# trains for at most MINUTES in all (saved on stopping; the models trained from scratch, the base stage and the
# draft, in float32, the other stages in bf16 autocast: docs/benchmarks.md "Rebuilding model v2"), prints the
# progress, and leaves under $OUT what comes back: chain.log (every line), logs.tgz (each run's log.jsonl) and
# stage.tgz.part-* (the newest stage's run directory without its checkpoint, in pieces under the 16 MiB a returned
# file may have). Here:
#   mkdir -p runs/NAME && cat DIR/stage.tgz.part-* | tar xz -C runs/NAME   # NAME: the stage chain.log names last
# A later call on a fresh machine goes on from that stage when `carry` brings runs/NAME back. A chain begun on a
# CPU goes on the same way with carry ["runs/NAME/export", "runs/NAME/log.jsonl"] (its checkpoint, with the
# optimizer's moments, is larger than carry takes: the stage then resumes from its export with a fresh optimizer).
set -uo pipefail
export PYTHONPATH=src:training PYTHONUNBUFFERED=1
: "${OUT:?run this through the device tool, which sets OUT}"
start=$(date +%s)
python3 training/chain_v2.py --runs-dir runs --max-minutes "${1:-8}" --save-every 500 --probe-every 1000 \
    --data-workers 6 > "$OUT/chain.log" 2>&1
rc=$?
final=$(sed -n 's/^chain: done; the model is //p' "$OUT/chain.log")  # the last stage's export, once done
left=$(python3 -c "print(${1:-8} - ($(date +%s) - $start) / 60)")
if [ $rc = 0 ] && [ -n "$final" ] && python3 -c "import sys; sys.exit($left < 0.5)"; then
  python3 training/train_v2.py --stage model_v2_draft --run-dir runs/model_v2_draft \
      --tokenizer-from "$final" --max-minutes "$left" --save-every 500 --data-workers 6 --fp32 >> "$OUT/chain.log" 2>&1
  tar czf "$OUT/draft.tgz" -C runs/model_v2_draft export log.jsonl
fi
grep -v '"answer_loss"\|Writing model shards' "$OUT/chain.log" | tail -60
last=$(ls -td runs/model_v2*/ | grep -v _draft | head -1)
echo "newest stage: $last"
tar czf - -C "$last" --exclude ckpt.pt --exclude ckpt.tmp . | split -b 15M - "$OUT/stage.tgz.part-"
tar czf "$OUT/logs.tgz" runs/*/log.jsonl
exit $rc
