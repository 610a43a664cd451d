#!/usr/bin/env bash
# Makes the trained checkpoints of issue 12 on a GPU host (PyTorch 2.11, transformers 5.17, tokenizers):
# the task tokenizer, the held-out sets, both models trained side by side on one GPU, and HF's full-recomputation
# accuracy of each on the held-out sets. Everything lands in OUT:
#   OUT/tokenizer.json                      byte-level BPE of the task (2048 tokens)
#   OUT/heldout_test.jsonl                  32 small prompts (4 documents of 128-192 tokens): the CTest set
#   OUT/heldout_bench.jsonl                 200 prompts (4-32 documents of 128-1024 tokens): the benchmark set
#   OUT/next-moe/, OUT/qwen35-dense/        checkpoints (config.json, model.safetensors bf16, tokenizer.json,
#                                           training.json) and hf_eval_{test,bench}.json
#   OUT/*.log                               the training logs
#
#   tools/train_checkpoints.sh OUT [--minutes M] [--continue PREV] [--bench-limit N] [--moe-tokens-per-step N]
#       [--fla-path DIR] [--smoke] [--train-args "..."]
# --continue PREV: start from the checkpoints of an earlier OUT (its tokenizer is reused, and each model continues
#   at the curriculum level it reached); --moe-tokens-per-step N: batch size of next-moe (its steps cost about
#   three times the dense model's); --bench-limit: prompts of the benchmark set evaluated with
#   HF (default 60); --train-args: more options for every `train_task_model.py train`;
# --smoke: 5 steps per model and 2 prompts per evaluation, to check the pipeline in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
T="$ROOT/tools/train_task_model.py"
OUT=${1:?usage: tools/train_checkpoints.sh OUT [--minutes M] [--continue PREV] [--bench-limit N] [--fla-path DIR] [--smoke]}
shift
MINUTES=6
FLA=()
SMOKE=0
PREV=""
LIMIT_BENCH=60
EXTRA=()
MOE_TPS=()
while (($#)); do
  case "$1" in
    --minutes) MINUTES=$2; shift 2 ;;
    --fla-path) FLA=(--fla-path "$2"); shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --continue) PREV=$2; shift 2 ;;
    --bench-limit) LIMIT_BENCH=$2; shift 2 ;;
    --moe-tokens-per-step) MOE_TPS=(--tokens-per-step "$2"); shift 2 ;;
    --train-args) read -r -a EXTRA <<<"$2"; shift 2 ;;
    *) echo "train_checkpoints.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
if [[ -n $PREV ]]; then
  cp "$PREV/tokenizer.json" "$OUT/"
else
  python3 "$T" tokenizer --out "$OUT/tokenizer.json" --seed 20261201
fi
python3 "$T" heldout --tokenizer "$OUT/tokenizer.json" --out "$OUT/heldout_test.jsonl" --prompts 32 \
    --docs 4:4 --doc-tokens 128:192 --seed 7101 --id-prefix t
python3 "$T" heldout --tokenizer "$OUT/tokenizer.json" --out "$OUT/heldout_bench.jsonl" --prompts 200 \
  --docs 4:32 --doc-tokens 128:1024 --seed 7102 --id-prefix q
STEPS=()
LIMIT_TEST=0
if ((SMOKE)); then STEPS=(--max-steps 5 --log-every 1); MINUTES=2; LIMIT_TEST=2; LIMIT_BENCH=2; fi
pids=()
for preset in next-moe qwen35-dense; do
  seed=1; [[ $preset == qwen35-dense ]] && seed=2
  INIT=()
  if [[ -n $PREV ]]; then INIT=(--init-from "$PREV/$preset"); seed=$((seed + 10)); fi
  TPS=(); [[ $preset == next-moe ]] && TPS=("${MOE_TPS[@]}")
  python3 "$T" train --preset $preset --tokenizer "$OUT/tokenizer.json" --out "$OUT/$preset" \
    --minutes "$MINUTES" --seed $seed --workers 6 "${INIT[@]}" "${FLA[@]}" "${STEPS[@]}" "${TPS[@]}" "${EXTRA[@]}" \
    >"$OUT/train_$preset.log" 2>&1 &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
tail -n 5 "$OUT"/train_*.log
((fail == 0)) || { echo "train_checkpoints.sh: a training run failed (logs above)" >&2; exit 1; }
pids=()
for preset in next-moe qwen35-dense; do   # both evaluations side by side, each its test set then its bench set
  { python3 "$T" eval --model "$OUT/$preset" --dataset "$OUT/heldout_test.jsonl" --limit $LIMIT_TEST \
      --out-json "$OUT/$preset/hf_eval_test.json" "${FLA[@]}" &&
    python3 "$T" eval --model "$OUT/$preset" --dataset "$OUT/heldout_bench.jsonl" --limit $LIMIT_BENCH \
      --out-json "$OUT/$preset/hf_eval_bench.json" "${FLA[@]}"; } >"$OUT/eval_$preset.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
cat "$OUT"/eval_*.log
exit $fail
