#!/usr/bin/env bash
# A/B of the prompt's retriever-order line on a finished (or warmed-up) Beauty run built WITHOUT it:
# the same relabelled scan copies and validation lists, as built (arm A) and with the line added
# (arm B), each trained 300 steps from the run's straight-copy warm-up, then teacher-forced SID
# copying (`dgr2 sid-copy`) and greedy validity (`dgr2 eval --split valid`) on 48 validation lists.
# docs/EXPERIMENTS.md, "A retriever-order line". Run from the repository root on an idle machine:
#
#   nohup env OMP_NUM_THREADS=2 scripts/ab-order-line.sh ../beauty-run ../ab-order-line > ../ab-order-line.log 2>&1 &
set -euo pipefail

RUN=${1:?usage: scripts/ab-order-line.sh RUN_DIR OUT_DIR}
OUT=${2:?usage: scripts/ab-order-line.sh RUN_DIR OUT_DIR}
PY=${PY:-.venv/bin/python}
DGR2=${DGR2:-.venv/bin/dgr2}
DRAW=${DRAW:-copy-random_sids-relabel_last_code-seed2-trace_stylescan_brand.jsonl}
START=$RUN/runs/ar/01_copy_warmup/model
CFG='{"max_steps":300,"epochs":1,"batch_size":32,"lr":1.0e-3,"warmup_steps":10,"max_valid_examples":300,"save_every":100,"autocast":"bf16"}'
mkdir -p "$OUT"

for arm in A B; do
  D=$OUT/data$arm
  if [[ ! -e $D/valid.jsonl ]]; then
    LINE=$([[ $arm == B ]] && echo --add || echo --keep)
    $PY -m reranker.data.order_line "$LINE" --data "$RUN/rerank_data" --out "$D" \
      --file "copies/$DRAW:train.jsonl" --file valid.jsonl:valid.jsonl
  fi
  R=$OUT/run$arm
  $PY -m reranker.stages.pipeline --stage sft --input "$START" --output "$R/model" --run-dir "$R" --data "$D" \
    --config-json "$CFG" --no-progress
  for ck in "$R"/checkpoints/step*.pt; do
    step=$(basename "$ck" | sed 's/^step0*\([0-9]*\)-.*/\1/')
    M=$OUT/model$arm-$step
    [[ -d $M ]] || $DGR2 model export --checkpoint "$ck" --like "$START" --out "$M"
    $DGR2 sid-copy --model "$M" --data "$D" --file valid.jsonl --limit 48 > "$OUT/sid-copy$arm-$step.txt"
    $DGR2 eval --model "$M" --data "$D" --split valid --limit 48 --batch-size 16 --workers 1 --decoder ar \
      --out "$OUT/eval$arm-$step.json" > "$OUT/eval$arm-$step.log" 2>&1
  done
done
echo "done: $OUT/sid-copy*.txt, $OUT/eval*.json"
