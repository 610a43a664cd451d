#!/usr/bin/env bash
# Cold-path scaling across GPUs (issue 16): TTFT of an all-cold 32k-token prompt with 1, 2, 4 and 8 scatter workers
# (as many as the host's GPUs allow, one GPU each), LPT against round-robin on 8 variable-length segments, and the
# entries' transport (NCCL device to device against gRPC through host memory), at Qwen3.5-35B-A3B dimensions with
# benchmark-only random weights. Writes OUT.json (one row per worker count and transport with `workers`, `ttft_ms`)
# and OUT.md (default OUT: bench/results/cold_scaling_h200), via hypic-bench-cluster and bench/cold_scaling_report.py.
#
#   bench/run_cold_scaling.sh --build-dir build-gpu            on a host of several GPUs (CUDA build)
#   bench/run_cold_scaling.sh --cpu-smoke --out /tmp/cs        the harness end to end on the CPU (tiny model, gRPC)
#
# Options: --build-dir DIR (the binaries in DIR/bin; default build-gpu), --gpus N (default: nvidia-smi's count),
# --requests N (prompts per row, default 3), --out STEM, --cpu-smoke. The combine worker runs on cuda:0 and scatter
# worker i on cuda:((1 + i) mod N) (deploy/local_cluster.py), so the 8-worker row on an 8-GPU host puts one scatter
# worker on the combine worker's GPU: that pair falls back to gRPC by itself, which the rows report.
# NCCL_NVLS_ENABLE=0 is set for everything started here (NVLink multicast off).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
die() { echo "run_cold_scaling.sh: $*" >&2; exit 1; }
export NCCL_NVLS_ENABLE=0

BUILD_DIR="build-gpu" GPUS="" REQUESTS=3 OUT="bench/results/cold_scaling_h200" SMOKE=0
while (($#)); do
  case "$1" in
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --gpus) GPUS="$2"; shift 2 ;;
    --requests) REQUESTS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --cpu-smoke) SMOKE=1; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
BIN="$BUILD_DIR/bin"
for t in hypic-bench-cluster hypic-router hypic-scatter-worker hypic-combine-worker hypic-segment-cache; do
  [[ -x "$BIN/$t" ]] || die "$BIN/$t not found (build it, or pass --build-dir)"
done
WORK="$(mktemp -d /tmp/hypic-cold-scaling.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
TOKENIZER="models/trained/qwen35-dense/tokenizer.json"  # the bench sends token ids: any tokenizer.json serves

if ((SMOKE)); then
  MODEL="$WORK/model"
  "$BIN/hypic-model" init --config tests/integration/tiny_model.json --out "$MODEL" --seed 3 >/dev/null 2>&1 ||
    die "hypic-model init failed"
  DEVICES="cpu"
  COUNTS="1,2"
  SEG_TOKENS=64 SEGMENTS=4 LONG=128 SHORT=32 SCHED_WORKERS=2
  WORKER_ARGS=()
else
  [[ -n "$GPUS" ]] || GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  ((GPUS >= 2)) || die "needs a host of at least 2 GPUs (found ${GPUS:-0}); --cpu-smoke runs the harness on the CPU"
  MODEL="$WORK/model"
  mkdir -p "$MODEL"
  cp bench/gpu/qwen3_5_35b_a3b.json "$MODEL/config.json"
  DEVICES="$(seq -s, -f 'cuda:%g' 0 $((GPUS - 1)))"
  COUNTS=""
  for w in 1 2 4 8; do ((w <= GPUS)) && COUNTS="${COUNTS:+$COUNTS,}$w"; done
  # 16 equal segments of 2048 tokens = 32k tokens; 8 variable-length ones (2 x 8192 + 6 x 2730) on 4 workers.
  SEG_TOKENS=2048 SEGMENTS=16 LONG=8192 SHORT=2730 SCHED_WORKERS=$((GPUS >= 5 ? 4 : GPUS - 1))
  # Benchmark-only seeded random weights (made on each device); small pools: up to two workers share a GPU.
  WORKER_ARGS=(--random-weights-seed=1 --kv-pool-bytes=2147483648 --max-batch-tokens=16384)
fi

run() {  # run TAG TRANSPORT SCENARIO-ARGS...
  local tag="$1" transport="$2"
  shift 2
  local la=(--launcher-arg=--device="$DEVICES" --launcher-arg=--cache-replicas=1)
  for a in ${WORKER_ARGS[@]+"${WORKER_ARGS[@]}"}; do
    la+=(--launcher-arg=--scatter-arg="$a" --launcher-arg=--combine-arg="$a")
  done
  la+=(--launcher-arg=--scatter-arg=--entry-transport="$transport")
  echo "run_cold_scaling.sh: $tag ($transport), $(date -u +%H:%M:%SZ)" >&2
  "$BIN/hypic-bench-cluster" --model "$MODEL" --tokenizer "$TOKENIZER" --bin-dir "$BIN" \
    --launcher deploy/local_cluster.py "${la[@]}" --query-tokens 32 --max-tokens 4 --ready-timeout-s 600 \
    --request-timeout-s 600 "$@" --out-json "$WORK/$tag-$transport.json" --out-md "$WORK/$tag-$transport.md" \
    > "$WORK/$tag-$transport.log" 2>&1 || { tail -40 "$WORK/$tag-$transport.log" >&2; die "$tag ($transport) failed"; }
}
for transport in auto grpc; do
  run equal "$transport" --scenarios scaling --worker-counts "$COUNTS" --scaling-requests "$REQUESTS" \
    --scaling-segments "$SEGMENTS" --scaling-segment-tokens "$SEG_TOKENS"
done
run variable auto --scenarios schedule --scatter-workers "$SCHED_WORKERS" --schedule-requests "$REQUESTS" \
  --long-tokens "$LONG" --short-tokens "$SHORT"

mkdir -p "$(dirname "$OUT")"
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
python3 bench/cold_scaling_report.py --equal-nccl "$WORK/equal-auto.json" --equal-grpc "$WORK/equal-grpc.json" \
  --variable "$WORK/variable-auto.json" --devices "$DEVICES" --commit "$COMMIT" --out "$OUT"
echo "run_cold_scaling.sh: wrote $OUT.json and $OUT.md" >&2
