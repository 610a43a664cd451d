#!/usr/bin/env bash
# Validates the candidate kernel paths (kernels/cuda/switches.h: written and tested against their references but not
# yet measured, off by default) on a GPU host, in stages that each fit one device call of about 10 minutes:
#
#   scripts/validate_candidates.sh --bin DIR [--out DIR (default: bench/results)] [--all] STAGE
#     kernels  the kernel tests, which run every candidate beside its default in one process (test_gpu_ops,
#              test_gpu_ops_table, test_gpu_gated_delta, test_gpu_attention, test_gpu_moe), then test_gpu_moe "[moe]"
#              with HYPIC_CANDIDATES=1 under the MoE wgmma variants 1 .. 4 and 6 .. 9 (HYPIC_MOE_WGMMA, read once per process),
#              test_gpu_gated_delta "[gated_delta]" with HYPIC_GDN_SCAN_WGMMA=1 HYPIC_GDN_WY_WGMMA=1 (every prefill
#              case on the wgmma kernels), test_gpu_attention "[attention]" and test_gpu_families "[mla]" with
#              HYPIC_CANDIDATES=1 (the decode kernels' PDL launches, the MLA per-group chunks)
#     backend  test_gpu_backend "[backend]" and test_gpu_conformance, as they are (the end-to-end bit checks and the
#              device-sampling conformance run inside) and with HYPIC_CANDIDATES=1
#     bench    hypic-bench-prefill-gpu (Qwen3.5-35B-A3B dimensions, random weights) with --ab over the candidates
#              not measured yet (their README row says so; --all: every candidate) and HYPIC_CANDIDATES (each full-prefill length and the warm splice, off and on alternating run by run;
#              greedy decode at each batch in blocks of steps),
#              decode batches 1 / 16 / 64 with sampling on the host and on the device: OUT/candidates_ab.{json,md,log}
#     bench-decode-80g  greedy decode only, side by side (--ab as the bench stage), sized for an 80 GB card (an H100,
#              when no H200 is lent: 64.6 GiB of weights leave no room for batches 16 / 64 at 32k contexts): batch 1 at
#              32k contexts, batch 16 at 4k (--segments 2), batch 64 at 2k (--segments 1 --max-batch-tokens 4096), 16
#              steps per block: OUT/candidates_ab_decode_80g_b{1,16,64}.{json,md,log}. The MoE routing and decode
#              GEMMs do not depend on the context length; the attention decode does: its switches want the H200 rows
#     kernel-bench  kernels alone: gdn_bench (one Gated DeltaNet layer at 4k / 16k / 32k / 16 x 2k tokens, with the
#              scan and / or the WY kernel on wgmma, HYPIC_GDN_SCAN_WGMMA / HYPIC_GDN_WY_WGMMA, beside the default in
#              the same process): OUT/gdn_bench.{json,log};
#              then the MoE layer at 512 .. 32768 tokens (test_gpu_moe "[.bench_wgmma]": our wgmma tiles, the mma.sync
#              tiles and cuBLAS's grouped GEMM, ms and TFLOP/s) under each wgmma variant of HYPIC_MOE_WGMMA (1 default,
#              2 the down GEMM on 128 x 128 tiles at 2 blocks per SM, 3 persistent blocks, 4 both, 5 without the
#              64-row tiles, 6 warp-specialised persistent blocks with TMA weight loads, 7 those in clusters of two on
#              m-tile pairs, 8 gate_up alone on them, 9 the 64-row tiles on them; read once per process):
#              OUT/moe_variants.log
#     bench-all  the benchmark twice in one call, every measurement (decode included) with all candidates off
#              (HYPIC_CANDIDATES=0), then on (=1): OUT/candidates_all_{0,1}.{json,md,log}
#     bench-lengths  full prefills at prompt lengths off the powers of two (1000 .. 24000 tokens, each off and on)
#              with --ab HYPIC_ATTN_CUDNN_BUCKETS, the padded cuDNN buckets (where the bench stage's 4k / 32k are
#              exact buckets; a plan's compile falls in the warm-up run: steady state, as every later prompt of an
#              already seen bucket): OUT/candidates_ab_lengths.{json,md,log}; then 16k, 32k and 48k prompts in the
#              workers' default passes of 16384 tokens (--max-batch-tokens 16384: no group reaches the default rule's
#              27064 queries) with --ab over the buckets and HYPIC_ATTN_CUDNN_PREFIX (the rule counting a chunk's
#              cached slots: the later chunks of the 32k / 48k prompts go to cuDNN): OUT/candidates_ab_passes.*
#
# DIR holds the binaries (a build with -DHYPIC_WITH_CUDA=ON, or scripts/gpu_bundle.sh's unpacked bin/ with its lib/ on
# LD_LIBRARY_PATH). Exit status: non-zero when any test or the benchmark failed.
set -euo pipefail
SCRIPT="$0"
usage() { sed -n '2,/^set -euo/p' "$SCRIPT" | sed '$d' | sed 's/^# \{0,1\}//'; }
BIN="" OUT="" STAGE="" ALL=0
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --bin) BIN="${2:?--bin needs a directory}"; shift 2 ;;
    --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
    --all) ALL=1; shift ;;
    kernels|backend|bench|bench-all|bench-lengths|bench-decode-80g|kernel-bench) STAGE="$1"; shift ;;
    *) echo "validate_candidates.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$BIN" && -n "$STAGE" ]] || { usage >&2; exit 2; }
BIN=$(realpath "$BIN")  # (relative to where the script was called from, before the cd below)
if [[ -n "$OUT" ]]; then mkdir -p "$OUT" && OUT=$(realpath "$OUT"); fi
cd "$(dirname "$SCRIPT")/.."
[[ -n "$OUT" ]] || OUT="$PWD/bench/results"  # (default: the checkout's bench/results)
candidates=$(sed -n '/kCandidateSwitches\[\] = {/,/};/p' kernels/cuda/switches.h | { grep -o '"HYPIC_[A-Z0-9_]*"' || true; } |
             tr -d '"' | paste -sd, -)
[[ -n "$candidates" ]] || { echo "validate_candidates.sh: no candidates found in kernels/cuda/switches.h" >&2; exit 2; }
echo "candidates: $candidates"
# The candidates whose README row still says "not measured yet" (the bench stage's default set).
unmeasured=$(grep -o '^| `HYPIC_[A-Z0-9_]*` |.*not measured yet' README.md | grep -o '^| `HYPIC_[A-Z0-9_]*`' |
             tr -d '|` ' | paste -sd, -)
ab=$candidates
if [[ $ALL == 0 && -n "$unmeasured" ]]; then ab=$unmeasured; fi
echo "benchmarked side by side (bench): $ab"
status=0
run() { echo "== $*"; "$@" || status=$?; }
case "$STAGE" in
  kernels)
    for t in test_gpu_ops test_gpu_ops_table test_gpu_gated_delta test_gpu_attention test_gpu_moe; do
      run "$BIN/$t" --durations yes
    done
    for v in 1 2 3 4 6 7 8 9; do run env HYPIC_CANDIDATES=1 HYPIC_MOE_WGMMA=$v "$BIN/test_gpu_moe" "[moe]"; done
    run env HYPIC_GDN_SCAN_WGMMA=1 HYPIC_GDN_WY_WGMMA=1 "$BIN/test_gpu_gated_delta" "[gated_delta]"  # (splits, graphs)
    run env HYPIC_CANDIDATES=1 "$BIN/test_gpu_attention" "[attention]"
    run env HYPIC_CANDIDATES=1 "$BIN/test_gpu_families" "[mla]"
    ;;
  backend)
    run "$BIN/test_gpu_backend" "[backend]"
    run "$BIN/test_gpu_conformance"
    run env HYPIC_CANDIDATES=1 "$BIN/test_gpu_backend" "[backend]"
    run env HYPIC_CANDIDATES=1 "$BIN/test_gpu_conformance"
    ;;
  bench)
    mkdir -p "$OUT"
    echo "== hypic-bench-prefill-gpu --ab"
    "$BIN/hypic-bench-prefill-gpu" --config bench/gpu/qwen3_5_35b_a3b.json --lengths 4096,32768 \
      --skip parts,build,notc,beside --refresh "" --refresh-tail "" --warmup 1 --reps 3 \
      --decode-batches 1,16,64 --decode-warmup 2 --decode-steps 5 --ab "$ab,HYPIC_CANDIDATES" \
      --json "$OUT/candidates_ab.json" --md "$OUT/candidates_ab.md" 2>&1 | tee "$OUT/candidates_ab.log" || status=$?
    ;;
  bench-decode-80g)
    mkdir -p "$OUT"
    for shape in "1:" "16:--segments 2" "64:--segments 1 --max-batch-tokens 4096"; do
      b=${shape%%:*}
      echo "== hypic-bench-prefill-gpu decode batch $b ${shape#*:} --ab"
      # shellcheck disable=SC2086  # (the shape's options split into words)
      "$BIN/hypic-bench-prefill-gpu" --config bench/gpu/qwen3_5_35b_a3b.json --lengths 512 \
        --skip parts,prefill,splice,build,notc,beside --refresh "" --refresh-tail "" ${shape#*:} \
        --decode-batches "$b" --decode-warmup 2 --decode-steps 16 --ab "$ab,HYPIC_CANDIDATES" \
        --json "$OUT/candidates_ab_decode_80g_b$b.json" --md "$OUT/candidates_ab_decode_80g_b$b.md" 2>&1 |
        tee "$OUT/candidates_ab_decode_80g_b$b.log" || status=$?
    done
    ;;
  bench-lengths)
    mkdir -p "$OUT"
    echo "== hypic-bench-prefill-gpu --ab HYPIC_ATTN_CUDNN_BUCKETS (then also HYPIC_ATTN_CUDNN_PREFIX, in passes)"
    "$BIN/hypic-bench-prefill-gpu" --config bench/gpu/qwen3_5_35b_a3b.json --lengths 1000,2000,3000,6000,12000,24000 \
      --skip parts,build,notc,beside,splice,decode --refresh "" --refresh-tail "" --warmup 1 --reps 3 \
      --ab HYPIC_ATTN_CUDNN_BUCKETS --json "$OUT/candidates_ab_lengths.json" --md "$OUT/candidates_ab_lengths.md" 2>&1 |
      tee "$OUT/candidates_ab_lengths.log" || status=$?
    "$BIN/hypic-bench-prefill-gpu" --config bench/gpu/qwen3_5_35b_a3b.json --lengths 16384,32768,49152 \
      --max-batch-tokens 16384 --skip parts,build,notc,beside,splice,decode --refresh "" --refresh-tail "" \
      --warmup 1 --reps 3 --ab HYPIC_ATTN_CUDNN_BUCKETS,HYPIC_ATTN_CUDNN_PREFIX \
      --json "$OUT/candidates_ab_passes.json" \
      --md "$OUT/candidates_ab_passes.md" 2>&1 | tee "$OUT/candidates_ab_passes.log" || status=$?
    ;;
  kernel-bench)
    mkdir -p "$OUT"
    echo "== gdn_bench"
    "$BIN/gdn_bench" --json "$OUT/gdn_bench.json" 2>&1 | tee "$OUT/gdn_bench.log" || status=$?
    for v in 1 2 3 4 5 6 7 8 9; do
      echo "== HYPIC_MOE_WGMMA=$v test_gpu_moe [.bench_wgmma]"
      HYPIC_MOE_WGMMA=$v "$BIN/test_gpu_moe" "[.bench_wgmma]" || status=$?
    done 2>&1 | tee "$OUT/moe_variants.log"
    ;;
  bench-all)
    mkdir -p "$OUT"
    for on in 0 1; do
      echo "== hypic-bench-prefill-gpu, HYPIC_CANDIDATES=$on"
      HYPIC_CANDIDATES=$on "$BIN/hypic-bench-prefill-gpu" --config bench/gpu/qwen3_5_35b_a3b.json \
        --lengths 4096,8192,32768 --skip parts,build,notc,beside --refresh "" --refresh-tail "" --warmup 1 --reps 3 \
        --json "$OUT/candidates_all_$on.json" --md "$OUT/candidates_all_$on.md" 2>&1 |
        tee "$OUT/candidates_all_$on.log" || status=$?
    done
    ;;
esac
exit $status
