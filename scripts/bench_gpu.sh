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
#   ... -h | --help                                this text
# Writes into OUT: prefill_h200.json, prefill_h200.md, hf_prefill.json, best_kernels.json, prefill_bench.log,
# hf_prefill.log, best_kernels.log,
# gpu_memory.csv (nvidia-smi samples, MiB, every 500 ms). Exit status: non-zero when a benchmark failed.
# Needs Python 3 with PyTorch and transformers for the HF run; the GPU needs about 125 GB free (hypic's backend
# holds 65 GiB of weights and a 41 GiB KV pool for the 64 decode contexts of 32k tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
BIN="" LIB="" OUT="" FLA_PATH="" QUICK=0 SKIP_HF=0 BENCH_ARGS="" HF_ARGS="" FIXTURES=0 NO_BENCH=0 COMMIT=""
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
    *) echo "bench_gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$OUT" ]] || { echo "bench_gpu.sh: --out OUT is required (see --help)" >&2; exit 2; }
if [[ -z "$BIN" ]]; then
  BUILD_DIR=${BUILD_DIR:-build-gpu-bench}
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DHYPIC_WITH_CUDA=ON >/dev/null
  cmake --build "$BUILD_DIR" --target hypic-bench-prefill-gpu hypic-model -j "${JOBS:-$(nproc)}"
  BIN="$BUILD_DIR/bin"
fi
BIN="$(cd "$BIN" && pwd)"
((NO_BENCH)) || [[ -x "$BIN/hypic-bench-prefill-gpu" ]] || { echo "bench_gpu.sh: $BIN/hypic-bench-prefill-gpu not found" >&2; exit 2; }
if [[ -z "$LIB" && -d "$BIN/../lib" ]]; then LIB="$BIN/../lib"; fi
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
hf=()
if ((SKIP_HF == 0 && NO_BENCH == 0)); then
  fla=()
  [[ -n "$FLA_PATH" ]] && fla=(--fla-path "$FLA_PATH")
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 timeout -k 10 300 python3 tools/hf_prefill_bench.py --config bench/gpu/qwen3_5_35b_a3b.json \
    --out-json "$OUT/hf_prefill.json" "${fla[@]}" "${quick[@]}" $HF_ARGS 2>&1 | tee "$OUT/hf_prefill.log" || status=$?
  [[ -s "$OUT/hf_prefill.json" ]] && hf=(--hf-json "$OUT/hf_prefill.json")
  # The best library kernels at our parts' shapes (cuDNN SDPA, a torch grouped_mm MoE block, fla): parts_vs_best.
  PYTHONUNBUFFERED=1 timeout -k 10 300 python3 tools/best_kernels_bench.py --config bench/gpu/qwen3_5_35b_a3b.json \
    --lengths "$LENGTHS" --out-json "$OUT/best_kernels.json" "${fla[@]}" 2>&1 | tee "$OUT/best_kernels.log" || status=$?
  [[ -s "$OUT/best_kernels.json" ]] && hf+=(--best-json "$OUT/best_kernels.json")
fi
if ((NO_BENCH == 0)); then
  # shellcheck disable=SC2086
  timeout -k 10 240 "$BIN/hypic-bench-prefill-gpu" --config bench/gpu/qwen3_5_35b_a3b.json --lengths "$LENGTHS" \
    --json "$OUT/prefill_h200.json" --md "$OUT/prefill_h200.md" "${hf[@]}" "${quick[@]}" \
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
