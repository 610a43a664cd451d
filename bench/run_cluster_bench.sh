#!/usr/bin/env bash
# Builds hypic, then runs every scenario of hypic-bench-cluster on local clusters of the demo model and
# writes bench/results/cluster_cpu.{json,md,png} (override the stem with --out STEM; a plain run overwrites the committed results).
#
#   bench/run_cluster_bench.sh                       the committed CPU run (about 3 minutes on 2 cores, build not counted)
#   bench/run_cluster_bench.sh --quick               a small run (under a minute) to check the harness
#   bench/run_cluster_bench.sh --model DIR --tokenizer FILE --out /tmp/mine -- --prompts 20 --rates 1,2,4,8
#
# Options: --build-dir DIR (default $BUILD_DIR or build), --skip-build, --model DIR (default: the demo
# model, scripts/make_demo_model.sh), --tokenizer FILE (default: scripts/fetch_tokenizer.sh), --out STEM,
# --quick; arguments after -- go to hypic-bench-cluster (they override the sizes below; see its --help).
# Segments are windows of the license texts in /usr/share/common-licenses (real text, every segment new).
# The plot needs gnuplot (Debian gnuplot-nox, installed by scripts/setup.sh); without it the PNG is skipped
# with a message. Interrupting (Ctrl-C) stops every cluster: the harness handles SIGINT/SIGTERM itself.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
die() { echo "run_cluster_bench.sh: $*" >&2; exit 1; }

BUILD_DIR="${BUILD_DIR:-build}" SKIP_BUILD=0 MODEL="" TOKENIZER="" OUT="bench/results/cluster_cpu" QUICK=0
EXTRA=()
while (($#)); do
  case "$1" in
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --skip-build) SKIP_BUILD=1; shift ;;
    --model) MODEL="$2"; shift 2 ;;
    --tokenizer) TOKENIZER="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_cluster_bench.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
BIN="$BUILD_DIR/bin"
TARGETS=(hypic-segment-cache hypic-scatter-worker hypic-combine-worker hypic-router hypic-client hypic-model
         hypic-bench-cluster)
if ((!SKIP_BUILD)); then
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null || die "cmake configure failed"
  cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target "${TARGETS[@]}" || die "the build failed"
fi
for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || die "$BIN/$t not found (drop --skip-build)"; done
[[ -n "$TOKENIZER" ]] || TOKENIZER="$(./scripts/fetch_tokenizer.sh)" || die "no tokenizer (pass --tokenizer FILE)"
[[ -n "$MODEL" ]] || MODEL="$(./scripts/make_demo_model.sh "$BIN")" || die "no model (pass --model DIR)"

CORPUS=()
for f in /usr/share/common-licenses/{GPL-3,LGPL-2.1,MPL-2.0,Apache-2.0,Artistic,CC0-1.0}; do
  [[ -f "$f" ]] && CORPUS+=(--corpus "$f")
done
((${#CORPUS[@]})) || echo "run_cluster_bench.sh: no license texts found; segments will be random token ids" >&2

if ((QUICK)); then
  SIZES=(--prompts 2 --segments 3 --segment-tokens 128 --worker-counts 1,2 --scaling-requests 2
         --scaling-segments 4 --scaling-segment-tokens 64 --schedule-requests 2 --long-tokens 256 --short-tokens 32
         --rates 1,4 --load-requests 6 --load-segments 2 --load-segment-tokens 64 --load-pool 4 --max-tokens 4)
else
  # Sized to finish in about 10 minutes on 2 CPU cores with the demo model.
  SIZES=(--prompts 10 --segments 4 --segment-tokens 512 --query-tokens 16 --max-tokens 8 --hit-ratio 0.5
         --worker-counts 1,2,4 --scaling-requests 6 --scaling-segments 8 --scaling-segment-tokens 256
         --schedule-requests 6 --long-tokens 1024 --short-tokens 128
         --rates 0.5,1,2,4,8 --load-requests 20 --load-segments 4 --load-segment-tokens 256 --load-hit-ratio 0.5
         --load-pool 16 --slo-ms 1500)
fi
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
# Uncommitted changes to what the CPU cluster is built from would make the numbers unreproducible: say so.
git diff --quiet HEAD -- CMakeLists.txt engine kernels/cpu proto segment_cache router scatter_worker combine_worker \
  client deploy bench/cluster 2>/dev/null || COMMIT="$COMMIT (plus uncommitted changes to the cluster's sources)"
mkdir -p "$(dirname "$OUT")"
echo "run_cluster_bench.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ), model $MODEL" >&2
"$BIN/hypic-bench-cluster" --model "$MODEL" --tokenizer "$TOKENIZER" --bin-dir "$BIN" \
  --launcher deploy/local_cluster.py ${CORPUS[@]+"${CORPUS[@]}"} "${SIZES[@]}" ${EXTRA[@]+"${EXTRA[@]}"} \
  --note "commit measured: $COMMIT; made by bench/run_cluster_bench.sh" --out-json "$OUT.json" --out-md "$OUT.md"
if command -v gnuplot >/dev/null 2>&1; then
  python3 bench/plot_cluster.py "$OUT.json" "$OUT.png"
else
  echo "run_cluster_bench.sh: gnuplot not found (apt-get install gnuplot-nox); skipped $OUT.png" >&2
fi
