#!/usr/bin/env bash
# Whole-model GPU benchmark at Qwen3.5-35B-A3B dimensions (benchmark-only random weights), in one call on a host
# with an NVIDIA GPU: first Hugging Face transformers (tools/hf_prefill_bench.py: bf16, fla GDN when --fla-path
# is given, SDPA, grouped_mm experts; 8 layers timed, scaled to 40), then hypic's CUDA backend
# (hypic-bench-prefill-gpu: full prefill at 4k/8k/16k/32k with the time split by part, entry build with and
# without T_C, the 16 x 2k hypic splice, batched decode), which merges the HF times and the best library kernels at
# the parts' shapes (tools/best_kernels_bench.py: cuDNN SDPA with the output gate, a torch grouped_mm MoE block, fla,
# each timed over its layers back to back as hypic's parts are; the parts_vs_best table) into OUT/prefill_h200.json and OUT/prefill_h200.md (command, UTC time, commit, measured ceilings, ratios).
#
#   scripts/bench_gpu.sh --out OUT                 configure + build into build-gpu-bench/ (BUILD_DIR overrides), run
#   scripts/bench_gpu.sh --bin DIR --out OUT       run prebuilt binaries from DIR (hypic-bench-prefill-gpu, and
#                                                  hypic-model for --fixtures); shared libraries from --lib DIR,
#                                                  else DIR/../lib when it exists (added to LD_LIBRARY_PATH)
#   ... --lib DIR                                  folder of shared libraries the prebuilt binaries need
#   ... --fla-path DIR                             a flash-linear-attention checkout for the HF run (optional; without
#                                                  it HF runs its torch GDN fallback and the report says so)
#   ... --quick                                    quick mode for both (1 warm-up, 2 timed runs; about 2 minutes)
#   ... --skip-hf                                  run hypic's benchmark alone (the HF and best-kernel columns stay empty)
#   ... --bench-args "ARGS"                        extra arguments for hypic-bench-prefill-gpu (e.g. "--reps 7")
#   ... --hf-args "ARGS"                           extra arguments for tools/hf_prefill_bench.py (e.g. "--layers 4")
#   ... --fixtures                                 also make the GPU tests' HF bf16 fixtures: hypic-model init of every
#                                                  tests/gpu/configs/*.json with the checkpoint tests/gpu/test_gpu_backend.cpp
#                                                  uses (--seed 20261201 --std 0.05 --dtype bf16) into OUT/checkpoints,
#                                                  then tools/make_gpu_fixtures.py (150-token prompt, seed 7, without
#                                                  fla) into OUT/fixtures (copy them to tests/fixtures/gpu/)
#   ... --no-bench                                 run neither benchmark (with --fixtures: the fixtures alone)
#   ... --commit SHA                               commit recorded in the results (default: git, else DIR/COMMIT)
#   ... --stage all|library|hypic                  all (the default): everything above in this call; library: the HF
#                                                  run and the best library kernels alone (OUT/hf_prefill.json,
#                                                  OUT/best_kernels.json); hypic: hypic's benchmark alone, merging
#                                                  the library stage's JSON found in OUT or named below. At full size
#                                                  the two take about 5 + 10 minutes on an H200: two device calls of
#                                                  at most 10 minutes each, back to back on the same machine
#   ... --hf-json FILE                             HF results to merge instead of running HF: tools/hf_prefill_bench.py's
#                                                  JSON, or an earlier prefill_h200.json (its "hf" object; HF's times
#                                                  do not depend on hypic's code). The report keeps that run's command
#   ... --best-json FILE                           the best library kernels' JSON of an earlier library stage
#   ... --bench-timeout S                          limit of hypic's benchmark, seconds (default 590: the full run
#                                                  takes 9-10 minutes on an H200)
#   ... --library-timeout S                        limit of each of the HF and library-kernel runs (default 290)
#   ... -h | --help                                this text
# Writes into OUT: prefill_h200.json, prefill_h200.md, hf_prefill.json, best_kernels.json, hf_merged.json (the HF
# results given to the report), prefill_bench.log,
# hf_prefill.log, best_kernels.log,
# gpu_memory.csv (nvidia-smi samples, MiB, every 500 ms). Exit status: non-zero when a benchmark failed.
# Needs Python 3 with PyTorch and transformers for the HF run; the GPU needs about 125 GB free (hypic's backend
# holds 65 GiB of weights and a 41 GiB KV pool for the 64 decode contexts of 32k tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
BIN="" LIB="" OUT="" FLA_PATH="" QUICK=0 SKIP_HF=0 BENCH_ARGS="" HF_ARGS="" FIXTURES=0 NO_BENCH=0 COMMIT=""
STAGE=all HF_JSON="" BEST_JSON="" BENCH_TIMEOUT=590 LIBRARY_TIMEOUT=290
LENGTHS=4096,8192,16384,32768  # full-prefill lengths of both benchmarks (issue 27's targets: 4k, 8k, 32k)
ARGS_SEEN="$*"
need_value() { [[ $# -ge 2 && -n "$2" ]] || { echo "bench_gpu.sh: $1 needs a value (see --help)" >&2; exit 2; }; }
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --bin) need_value "$@"; BIN="$2"; shift 2 ;;
    --lib) need_value "$@"; LIB="$2"; shift 2 ;;
    --out) need_value "$@"; OUT="$2"; shift 2 ;;
    --fla-path) need_value "$@"; FLA_PATH="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --skip-hf) SKIP_HF=1; shift ;;
    --bench-args) need_value "$@"; BENCH_ARGS="$2"; shift 2 ;;
    --hf-args) need_value "$@"; HF_ARGS="$2"; shift 2 ;;
    --fixtures) FIXTURES=1; shift ;;
    --no-bench) NO_BENCH=1; shift ;;
    --commit) need_value "$@"; COMMIT="$2"; shift 2 ;;
    --stage) need_value "$@"; STAGE="$2"; shift 2 ;;
    --hf-json) need_value "$@"; HF_JSON="$2"; shift 2 ;;
    --best-json) need_value "$@"; BEST_JSON="$2"; shift 2 ;;
    --bench-timeout) need_value "$@"; BENCH_TIMEOUT="$2"; shift 2 ;;
    --library-timeout) need_value "$@"; LIBRARY_TIMEOUT="$2"; shift 2 ;;
    *) echo "bench_gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$OUT" ]] || { echo "bench_gpu.sh: --out OUT is required (see --help)" >&2; exit 2; }
case "$STAGE" in all|library|hypic) ;; *) echo "bench_gpu.sh: --stage must be all, library or hypic, got '$STAGE'" >&2; exit 2 ;; esac
for t in "$BENCH_TIMEOUT" "$LIBRARY_TIMEOUT"; do
  [[ "$t" =~ ^[1-9][0-9]*$ ]] || { echo "bench_gpu.sh: a timeout must be a whole number of seconds, got '$t'" >&2; exit 2; }
done
for f in "$HF_JSON" "$BEST_JSON"; do
  [[ -z "$f" || -s "$f" ]] || { echo "bench_gpu.sh: $f not found or empty" >&2; exit 2; }
done
RUN_LIBRARY=1 RUN_HYPIC=1
[[ "$STAGE" == hypic ]] && RUN_LIBRARY=0
[[ "$STAGE" == library ]] && RUN_HYPIC=0
((NO_BENCH)) && RUN_LIBRARY=0 RUN_HYPIC=0
if [[ -z "$BIN" ]] && ((RUN_HYPIC || FIXTURES)); then
  BUILD_DIR=${BUILD_DIR:-build-gpu-bench}
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DHYPIC_WITH_CUDA=ON >/dev/null
  cmake --build "$BUILD_DIR" --target hypic-bench-prefill-gpu hypic-model -j "${JOBS:-$(nproc)}"
  BIN="$BUILD_DIR/bin"
fi
[[ -z "$BIN" ]] || BIN="$(cd "$BIN" && pwd)"
((RUN_HYPIC == 0)) || [[ -x "$BIN/hypic-bench-prefill-gpu" ]] || { echo "bench_gpu.sh: $BIN/hypic-bench-prefill-gpu not found" >&2; exit 2; }
if [[ -z "$LIB" && -n "$BIN" && -d "$BIN/../lib" ]]; then LIB="$BIN/../lib"; fi
if [[ -n "$LIB" ]]; then
  LIB="$(cd "$LIB" && pwd)"
  export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [[ -z "$COMMIT" ]]; then COMMIT="$(git rev-parse HEAD 2>/dev/null || true)"; fi
if [[ -z "$COMMIT" && -f "$BIN/COMMIT" ]]; then COMMIT="$(head -n1 "$BIN/COMMIT")"; fi
export HYPIC_GIT_COMMIT="${COMMIT:-unknown}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
COMMAND="scripts/bench_gpu.sh $ARGS_SEEN"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
# GPU memory samples for the report (this script's own sampler, stopped by its pid at the end).
SAMPLER=""
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv,noheader,nounits -lms 500 \
    >"$OUT/gpu_memory.csv" 2>/dev/null &
  SAMPLER=$!
fi
stop_sampler() { if [[ -n "$SAMPLER" ]]; then kill "$SAMPLER" 2>/dev/null || true; wait "$SAMPLER" 2>/dev/null || true; SAMPLER=""; fi; }
trap stop_sampler EXIT

status=0
quick=()
((QUICK)) && quick=(--quick)
fla=()
[[ -n "$FLA_PATH" ]] && fla=(--fla-path "$FLA_PATH")
if ((RUN_LIBRARY)); then
  if ((SKIP_HF == 0)) && [[ -z "$HF_JSON" ]]; then
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 timeout -k 10 "$LIBRARY_TIMEOUT" python3 tools/hf_prefill_bench.py \
      --config bench/gpu/qwen3_5_35b_a3b.json --out-json "$OUT/hf_prefill.json" "${fla[@]}" "${quick[@]}" $HF_ARGS 2>&1 |
      tee "$OUT/hf_prefill.log" || status=$?
  fi
  # The best library kernels at our parts' shapes (cuDNN SDPA, a torch grouped_mm MoE block, fla): parts_vs_best.
  if [[ -z "$BEST_JSON" ]]; then
    PYTHONUNBUFFERED=1 timeout -k 10 "$LIBRARY_TIMEOUT" python3 tools/best_kernels_bench.py \
      --config bench/gpu/qwen3_5_35b_a3b.json --lengths "$LENGTHS" --out-json "$OUT/best_kernels.json" "${fla[@]}" 2>&1 |
      tee "$OUT/best_kernels.log" || status=$?
  fi
fi
if ((RUN_HYPIC)); then
  hf=()
  # HF results: named, else this OUT's library stage; an earlier prefill_h200.json gives its "hf" object.
  hf_in="$HF_JSON"
  [[ -z "$hf_in" && $SKIP_HF -eq 0 && -s "$OUT/hf_prefill.json" ]] && hf_in="$OUT/hf_prefill.json"
  if [[ -n "$hf_in" ]]; then
    python3 - "$hf_in" "$OUT/hf_merged.json" <<'PY' || { echo "bench_gpu.sh: $hf_in holds no HF results" >&2; exit 2; }
import json, sys
d = json.load(open(sys.argv[1]))
if "lengths" not in d and isinstance(d.get("hf"), dict):
    d = d["hf"]  # an earlier prefill_h200.json
if "lengths" not in d:
    sys.exit(1)
json.dump(d, open(sys.argv[2], "w"), indent=1)
PY
    hf=(--hf-json "$OUT/hf_merged.json")
  fi
  best_in="$BEST_JSON"
  [[ -z "$best_in" && -s "$OUT/best_kernels.json" ]] && best_in="$OUT/best_kernels.json"
  [[ -n "$best_in" ]] && hf+=(--best-json "$best_in")
  # shellcheck disable=SC2086
  timeout -k 10 "$BENCH_TIMEOUT" "$BIN/hypic-bench-prefill-gpu" --config bench/gpu/qwen3_5_35b_a3b.json \
    --lengths "$LENGTHS" --json "$OUT/prefill_h200.json" --md "$OUT/prefill_h200.md" "${hf[@]}" "${quick[@]}" \
    --git-commit "$HYPIC_GIT_COMMIT" --command "$COMMAND" $BENCH_ARGS 2>&1 | tee "$OUT/prefill_bench.log" || status=$?
fi

if ((FIXTURES)); then
  [[ -x "$BIN/hypic-model" ]] || { echo "bench_gpu.sh: --fixtures needs $BIN/hypic-model" >&2; exit 2; }
  mkdir -p "$OUT/checkpoints" "$OUT/fixtures"
  specs=()
  for cfg in tests/gpu/configs/*.json; do
    name="$(basename "$cfg" .json)"
    "$BIN/hypic-model" init --config "$cfg" --seed 20261201 --std 0.05 --dtype bf16 --out "$OUT/checkpoints/$name" ||
      status=$?
    specs+=("$name=$OUT/checkpoints/$name")
  done
  PYTHONUNBUFFERED=1 timeout -k 10 240 python3 tools/make_gpu_fixtures.py --out "$OUT/fixtures" --tokens 150 --seed 7 \
    "${specs[@]}" 2>&1 |
    tee "$OUT/fixtures/make_gpu_fixtures.log" || status=$?
fi
stop_sampler
if [[ -s "$OUT/gpu_memory.csv" ]]; then
  awk -F', *' '{ if ($2 + 0 > m) m = $2 + 0; t = $3 } END { if (m) printf "peak GPU memory used: %d MiB of %d MiB\n", m, t }' \
    "$OUT/gpu_memory.csv"
fi
exit $status
