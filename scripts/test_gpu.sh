#!/usr/bin/env bash
# Builds and runs the GPU tests (tests/gpu, Catch2) on a host with an NVIDIA GPU. They are not part
# of the default ctest, which runs on machines without a GPU.
#
#   scripts/test_gpu.sh                 configure + build into build-gpu/ (BUILD_DIR overrides), run every GPU
#                                       test (tests/gpu/test_gpu_*: kernels, weights, the CUDA backend against
#                                       the CPU engine and the HF bf16 fixtures, the NCCL data plane), then, on a host
#                                       of 2+ GPUs, tests/gpu/test_gpu_data_plane_cluster.py (entries over NCCL
#                                       through a real cluster, a scatter worker killed mid-transfer), and
#                                       tests/gpu/test_gpu_families_cluster.py (Kimi-Linear, MiniMax, Ring-linear
#                                       served by a cluster on cuda:0: hit == miss, reordered hits)
#   scripts/test_gpu.sh --bin DIR       run prebuilt binaries from DIR (the test_gpu_* binaries; with --bench also
#                                       gdn_bench and libhypic_gdn_capi.so)
#   ... --bench OUTDIR                  also run bench/gpu/gdn_bench and tools/bench_fla_reference.py
#                                       (ours and fla interleaved in one process), writing gdn_h200.json /
#                                       gdn_h200.md and logs into OUTDIR
#   ... --fla-path DIR                  a flash-linear-attention checkout for the reference (optional)
#   ... --bench-args "ARGS"             extra arguments for bench_fla_reference.py (--layouts, --profile, --rounds N)
#   ... --candidates                    also rerun every test_gpu_* binary with HYPIC_CANDIDATES=1: the kernel paths
#                                       written but not yet measured on a GPU, off by default (kernels/cuda/switches.h;
#                                       README "Kernel switches")
#   ... -h | --help                     this text
# Extra arguments after -- go to the Catch2 test binary (e.g. -- "[conv]").
# Needs the CUDA toolkit (nvcc; kernels built for sm_90, Hopper) and an NVIDIA GPU of that architecture;
# --bench also needs Python 3 with PyTorch (and, for the fla columns, a flash-linear-attention checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
BIN="" BENCH_OUT="" FLA_PATH="" BENCH_ARGS="" CATCH_ARGS=() CANDIDATES=0
need_value() { [[ $# -ge 2 && -n "$2" ]] || { echo "test_gpu.sh: $1 needs a value (see --help)" >&2; exit 2; }; }
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --bin) need_value "$@"; BIN="$2"; shift 2 ;;
    --bench) need_value "$@"; BENCH_OUT="$2"; shift 2 ;;
    --fla-path) need_value "$@"; FLA_PATH="$2"; shift 2 ;;
    --bench-args) need_value "$@"; BENCH_ARGS="$2"; shift 2 ;;
    --candidates) CANDIDATES=1; shift ;;
    --) shift; CATCH_ARGS=("$@"); break ;;
    *) echo "test_gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$BIN" ]]; then
  BUILD_DIR=${BUILD_DIR:-build-gpu}
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHYPIC_WITH_CUDA=ON >/dev/null
  targets=()
  for src in tests/gpu/test_gpu_*.cpp; do targets+=("$(basename "$src" .cpp)"); done
  targets+=(hypic-router hypic-scatter-worker hypic-combine-worker hypic-segment-cache hypic-client hypic-model)
  [[ -n "$BENCH_OUT" ]] && targets+=(gdn_bench hypic_gdn_capi)
  cmake --build "$BUILD_DIR" --target "${targets[@]}" -j "${JOBS:-$(nproc)}"
  BIN="$BUILD_DIR/bin"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
status=0
found=0
for t in "$BIN"/test_gpu_*; do
  [[ -x "$t" ]] || continue
  found=1
  echo "== $(basename "$t")"
  "$t" --durations yes "${CATCH_ARGS[@]}" || status=$?
done
((found)) || { echo "test_gpu.sh: no test_gpu_* binaries in $BIN" >&2; exit 2; }
if ((CANDIDATES)); then
  for t in "$BIN"/test_gpu_*; do
    [[ -x "$t" ]] || continue
    echo "== $(basename "$t") (HYPIC_CANDIDATES=1)"
    HYPIC_CANDIDATES=1 "$t" --durations yes "${CATCH_ARGS[@]}" || status=$?
  done
  # The MoE wgmma variants (read once per process: the 128 x 128 down tiles, the persistent kernels, the
  # warp-specialised ones, alone, in cluster pairs, for gate_up only and on 64-row tiles) with them.
  if [[ -x "$BIN/test_gpu_moe" ]]; then
    for v in 2 3 4 6 7 8 9; do
      echo "== test_gpu_moe [moe] (HYPIC_CANDIDATES=1 HYPIC_MOE_WGMMA=$v)"
      HYPIC_CANDIDATES=1 HYPIC_MOE_WGMMA=$v "$BIN/test_gpu_moe" "[moe]" || status=$?
    done
  fi
fi
if [[ -x "$BIN/hypic-router" ]]; then
  echo "== test_gpu_data_plane_cluster.py"
  NCCL_NVLS_ENABLE=0 HYPIC_BIN_DIR="$BIN" python3 tests/gpu/test_gpu_data_plane_cluster.py -v || status=$?
  echo "== test_gpu_families_cluster.py"
  HYPIC_BIN_DIR="$BIN" HYPIC_TOKENIZER="${HYPIC_TOKENIZER:-tests/fixtures/tokenizer/tiny_subword.json}" \
    python3 tests/gpu/test_gpu_families_cluster.py -v || status=$?
else
  echo "test_gpu.sh: no service binaries in $BIN: skipped the cluster tests (test_gpu_*_cluster.py)" >&2
fi
if [[ -n "$BENCH_OUT" ]]; then
  mkdir -p "$BENCH_OUT"
  "$BIN/gdn_bench" --json "$BENCH_OUT/gdn_ours.json" | tee "$BENCH_OUT/gdn_bench.log" || status=$?
  fla=()
  [[ -n "$FLA_PATH" ]] && fla=(--fla-path "$FLA_PATH")
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 python3 tools/bench_fla_reference.py --ours-lib "$(cd "$BIN" && pwd)/libhypic_gdn_capi.so" \
    --ours-json "$BENCH_OUT/gdn_ours.json" --out-json "$BENCH_OUT/gdn_h200.json" --out-md "$BENCH_OUT/gdn_h200.md" \
    "${fla[@]}" $BENCH_ARGS 2>&1 | tee "$BENCH_OUT/reference.log" || status=$?
fi
exit $status
