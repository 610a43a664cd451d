#!/usr/bin/env bash
# The answer-quality benchmark of issue 12: every splice mode (and hypic at w = 0, 2, 4, 8, 16, 32, and hypic_w8
# with the query-aware refresh of k = 2 and 4 segments, alone and with a tail of the last 2 segments) against full
# recomputation on a held-out set, for one or more trained checkpoints, on the CPU engine; writes OUT.{json,md,png}
# through tools/quality_report.py.
#
#   scripts/bench_quality.sh --out bench/results/quality --dataset SET.jsonl \
#       --model NAME=DIR [--model NAME=DIR ...] [--jobs N] [--threads T] [--limit N] [--bin-dir build/bin]
#       [--refresh K,K,...]   (refresh counts; default 2,4)
#       [--refresh-tail T,...] (refresh tails; default 2; "none" = no tail modes)
#
# Each model's prompts are split over --jobs processes (hypic-eval --shard I/N), each with --threads BLAS threads
# (OPENBLAS_NUM_THREADS); the checkpoint directory must hold tokenizer.json. Shard reports and logs are kept in
# OUT.shards/. Exit status: 0 when every shard and the report succeeded.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="" DATASET="" JOBS=$(nproc) THREADS=1 LIMIT=0 BIN="$ROOT/build/bin" REFRESH=2,4 TAIL=2
MODELS=()
while (($#)); do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --dataset) DATASET=$2; shift 2 ;;
    --model) MODELS+=("$2"); shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --limit) LIMIT=$2; shift 2 ;;
    --bin-dir) BIN=$2; shift 2 ;;
    --refresh) REFRESH=$2; shift 2 ;;
    --refresh-tail) TAIL=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "bench_quality.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[[ -n $OUT && -n $DATASET && ${#MODELS[@]} -gt 0 ]] || { sed -n '2,15p' "$0" >&2; exit 2; }
TAIL_ARGS=()
[[ $TAIL == none ]] || TAIL_ARGS=(--refresh-tail "$TAIL")
[[ -x $BIN/hypic-eval ]] || { echo "bench_quality.sh: no $BIN/hypic-eval (build first)" >&2; exit 1; }
SH="$OUT.shards"
mkdir -p "$SH"
specs=()
for spec in "${MODELS[@]}"; do
  name=${spec%%=*} dir=${spec#*=}
  [[ -f $dir/tokenizer.json ]] || { echo "bench_quality.sh: $dir has no tokenizer.json" >&2; exit 1; }
  pids=()
  for ((i = 0; i < JOBS; i++)); do
    OPENBLAS_NUM_THREADS=$THREADS "$BIN/hypic-eval" --model "$dir" --tokenizer "$dir/tokenizer.json" \
      --dataset "$DATASET" --seam-widths 0,2,4,8,16,32 --refresh "$REFRESH" "${TAIL_ARGS[@]}" --limit "$LIMIT" \
      --shard "$i/$JOBS" --json-out "$SH/$name-$i.json" >"$SH/$name-$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "bench_quality.sh: a shard of $name failed (logs in $SH)" >&2; exit 1; }; done
  specs+=(--model "$name=$(ls "$SH/$name"-*.json | paste -sd, -)")
done
commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || true)
python3 "$ROOT/tools/quality_report.py" --out "$OUT" --commit "$commit" "${specs[@]}"
