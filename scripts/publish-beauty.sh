#!/usr/bin/env bash
# After `dgr2 pipeline --config configs/beauty.yaml --out RUN` has finished: the stage table, the
# release bundle, and every published measurement of the released pair, in order. Each step leaves
# a marker in RUN/publish/, so a killed call resumes at the step it was in (FORCE=1 redoes them all).
# When the run's models change (a recipe step rerun), move RUN/publish aside first: every step then
# runs again in order, starting with the archiving of the earlier release's result files.
# ONLY=step,step runs just the named steps (a remeasurement after a code change, say ONLY=loadtest,bench
# on a machine whose run directory holds only the pipeline's data step: the loadtest needs the retriever).
# Run it from the repository root on an otherwise idle machine (the speed and load figures are
# timings):
#
#   nohup env OMP_NUM_THREADS=2 scripts/publish-beauty.sh ../beauty-run > ../beauty-run/publish.log 2>&1 &
set -euo pipefail

RUN=${1:?usage: scripts/publish-beauty.sh RUN_DIR (the dgr2 pipeline --out directory)}
BUNDLE=models/amazon-beauty
DGR2=${DGR2:-.venv/bin/dgr2}
AR_PORT=${AR_PORT:-50061}
DIFF_PORT=${DIFF_PORT:-50062}
WORKERS=${WORKERS:-2}  # decode workers per server: worker 0 takes a lone batch on both threads, busy ones one each
# Batch caps: with 2 workers, batches of 4 keep both busy at concurrency 8 (AR: 2 x batch 4 served
# 1.5x the requests of 1 x batch 8, docs/EXPERIMENTS.md); diffusion gains little from batching here.
AR_MAX_BATCH=${AR_MAX_BATCH:-4}
DIFF_MAX_BATCH=${DIFF_MAX_BATCH:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$RUN/publish"

step() {  # step NAME COMMAND...: run COMMAND once; its marker says it finished
  local name=$1; shift
  if [[ -n "${ONLY:-}" && ",$ONLY," != *",$name,"* ]]; then
    echo "[$name] not in ONLY=$ONLY, skipped"; return
  fi
  if [[ -e "$RUN/publish/$name.done" && -z "${FORCE:-}" ]]; then
    echo "[$name] done before, skipped"; return
  fi
  echo "[$name] $(date -u +%H:%M:%S) $*"
  "$@"
  date -u +%FT%TZ > "$RUN/publish/$name.done"
}

SERVERS=()
stop_servers() { if ((${#SERVERS[@]})); then kill -TERM "${SERVERS[@]}" 2>/dev/null || true; wait "${SERVERS[@]}" 2>/dev/null || true; SERVERS=(); fi; }
trap stop_servers EXIT

serve_pair() {  # the AR teacher and the diffusion student, each its own server, for the loadtest
  "$DGR2" serve --model "$BUNDLE/teacher" --port "$AR_PORT" --max-queue 40 --decode-workers "$WORKERS" \
    --max-batch "$AR_MAX_BATCH" --retrieval "$RUN/retrieval" &
  SERVERS+=($!)
  "$DGR2" serve --model "$BUNDLE/student" --port "$DIFF_PORT" --max-queue 40 --decode-workers "$WORKERS" \
    --max-batch "$AR_MAX_BATCH" --decoder-max-batch "diffusion=$DIFF_MAX_BATCH" --retrieval "$RUN/retrieval" &
  SERVERS+=($!)
  for port in "$AR_PORT" "$DIFF_PORT"; do
    for _ in $(seq 120); do
      "$DGR2" client health --target "127.0.0.1:$port" > /dev/null 2>&1 && break
      sleep 2
    done
    "$DGR2" client health --target "127.0.0.1:$port"
  done
  # 5,000 requests per decoder and concurrency (two to four hours on a 2-core machine); the duration
  # limit only guards against a hung server (it is part of the resume key). Finished configurations are
  # kept in a resume file in docs/results, committed and named by the release they measured: a stopped
  # call resumes at the configuration it was in, on this machine or another, and a new release starts
  # over. The matrix runs each concurrency's AR and diffusion back to back and each run records its
  # commit and CPU, so every ratio comes from two runs measured together.
  local release=unreleased
  if [[ -e "$BUNDLE/release.json" ]]; then release=$(sha256sum "$BUNDLE/release.json" | cut -c1-12); fi
  "$DGR2" loadtest --target "ar=127.0.0.1:$AR_PORT,diffusion=127.0.0.1:$DIFF_PORT" \
    --requests "$BUNDLE/test.jsonl" --n 5000 --decoders ar,diffusion --concurrency 1,8,32 \
    --duration-limit-s 7200 --overload 400 --overload-rate 200 \
    --resume-file "docs/results/service-load-runs-$release.jsonl" \
    --out docs/results/service-load.json
  stop_servers
}

archive_replaced() {  # result files of earlier Beauty models: this run's replace them (their archive page keeps them)
  local present=()
  for f in docs/results/*beauty*.json docs/results/service-load.json; do if [[ -e $f ]]; then present+=("$f"); fi; done
  if ((${#present[@]})); then "$DGR2" bench --archive "${present[@]}"; fi
}

# 0. Earlier Beauty results to the archive, once (the marker keeps a later call from archiving this run's).
step archive archive_replaced
# 1. The stage table of the finished run (a pipeline call that runs nothing: a step not done with this
#    code and these settings stops it), and the run's retriever. DATA: the --data the run was given.
step table "$DGR2" pipeline --config configs/beauty.yaml --data "${DATA:-../shared/data/amazon-beauty}" --out "$RUN" \
  --summary-only --record docs/results/pipeline-beauty.json --results docs/results/stages-beauty.json
step retrieval "$DGR2" results --artifacts "$RUN/retrieval" --out docs/results/retrieval-beauty.json \
  --command "dgr2 pipeline --config configs/beauty.yaml --data DATA --out $RUN (its retrieval step)"
# 2. The non-LM baselines, and the AR teacher against them on the same test users.
step baselines "$DGR2" baselines --config configs/beauty.yaml --data-dir "$RUN/rerank_data" \
  --results docs/results/rerank-baselines-beauty.json
step report-ar "$DGR2" report ar --eval "$RUN/eval/AR_GR2.json" --data "$RUN/rerank_data" \
  --out docs/results/rerank-ar-beauty.json
# 3. The release bundle: teacher, final student, SIDs, test prompts, model card.
step release "$DGR2" release --run "$RUN" --out "$BUNDLE" --force
# 4. The bundle alone reproduces the final row (compare its Recall@1 with stages-beauty.json).
step eval-bundle "$DGR2" eval --model "$BUNDLE/student" --data "$BUNDLE" \
  --out docs/results/rerank-student-bundle-beauty.json
# 5. Every decoder side by side on the released pair (two threads, then one: small decode steps split
#    poorly over two threads here), then the independent-rows schedule at batch 8.
step speed "$DGR2" speed --ar "$BUNDLE/teacher" --diffusion "$BUNDLE/student" --data "$BUNDLE" \
  --batch-sizes 1,8 --taus 0.9,0.8,0.6 --accuracy-limit 500 --out docs/results/diffusion-speed-beauty.json
# Both precisions on 64 prompts first: 8 prompts can hold more of the student's wrong answers, which
# are its slow ones, than its failure rate gives (docs/EXPERIMENTS.md, "The speed measured on 64 prompts").
# Hugging Face `generate` runs beside AR so the AR reference is shown no slower than what users have.
for dtype in float32 bfloat16; do
  suffix=$([[ $dtype == float32 ]] && echo "" || echo "-$dtype")
  step "speed-64prompts$suffix" "$DGR2" speed --ar "$BUNDLE/teacher" --diffusion "$BUNDLE/student" \
    --data "$BUNDLE" --n-prompts 64 --compute-dtype "$dtype" --taus 0.9 --batch-sizes 1,8 --schedule independent \
    --exact-decoders hf_generate,ar_lookup --accuracy-limit 500 --lengths '' --forward-blocks '' --threads 2 \
    --out "docs/results/diffusion-speed-beauty-64prompts$suffix.json"
done
step speed-1-thread "$DGR2" speed --ar "$BUNDLE/teacher" --diffusion "$BUNDLE/student" --data "$BUNDLE" \
  --threads 1 --batch-sizes 1,8 --taus 0.9 --no-accuracy --lengths '' --forward-blocks '' \
  --out docs/results/diffusion-speed-beauty-1thread.json
# The two column-saving approximations (diffusion_decode's `window` and `reuse_settled`), with their
# accuracy on the same 500 users: a candidate default only if it keeps the accuracy contract.
for approx in "--reuse-settled" "--window 16 --reuse-settled" "--window 8 --reuse-settled"; do
  name=$(echo "$approx" | tr -d '-' | tr ' ' '_')
  step "speed-$name" "$DGR2" speed --ar "$BUNDLE/teacher" --diffusion "$BUNDLE/student" --data "$BUNDLE" \
    --batch-sizes 1,8 --taus 0.9 $approx --exact-decoders '' --lengths '' --forward-blocks '' \
    --accuracy-limit 500 --out "docs/results/diffusion-speed-beauty-$name.json"
done
step speed-independent "$DGR2" speed --ar "$BUNDLE/teacher" --diffusion "$BUNDLE/student" --data "$BUNDLE" \
  --batch-sizes 8 --taus 0.9 --schedule independent --exact-decoders '' --lengths '' --forward-blocks '' \
  --accuracy-limit 500 --out docs/results/diffusion-speed-beauty-independent.json
# Prompt-lookup drafts inside a block (the student was not trained with them): kept only if they win
# at the same accuracy.
step speed-drafts "$DGR2" speed --ar "$BUNDLE/teacher" --diffusion "$BUNDLE/student" --data "$BUNDLE" \
  --batch-sizes 1,8 --taus 0.9 --lookup-drafts --exact-decoders '' --lengths '' --forward-blocks '' \
  --accuracy-limit 500 --out docs/results/diffusion-speed-beauty-drafts.json
# bfloat16 matmuls for the diffusion decode on the 8 prompts (AR timed in float32 and in bfloat16 beside it).
step speed-bfloat16 "$DGR2" speed --ar "$BUNDLE/teacher" --diffusion "$BUNDLE/student" --data "$BUNDLE" \
  --compute-dtype bfloat16 --taus 0.9 --batch-sizes 1,8 --schedule independent --accuracy-limit 500 \
  --lengths '' --threads 2 --out docs/results/diffusion-speed-beauty-bfloat16.json
# 6. The service under load, one server per model, plus a deliberate overload.
step loadtest serve_pair
# 7. RecBole's Trainer.evaluate on every test user: SASRec alone, + AR, + diffusion. One step per
#    re-ranker (about 1.5 h and 1 h here), the second adding its row to the first's file.
step e2e-ar "$DGR2" e2e --config configs/beauty.yaml --run "$RUN" \
  --reranker "AR GR2=$BUNDLE/teacher:ar" --batch-size 8 --out docs/results/recbole-e2e-beauty.json
step e2e-diffusion "$DGR2" e2e --config configs/beauty.yaml --run "$RUN" \
  --reranker "diffusion=$BUNDLE/student:diffusion" --batch-size 8 --out docs/results/recbole-e2e-beauty.json --add-to
# 8. docs/BENCHMARKS.md and its plots from the result files.
step bench "$DGR2" bench
echo "published: $(date -u +%FT%TZ)"
