#!/usr/bin/env bash
# libFuzzer runs of hypic's parsers (tests/fuzz): builds the targets with clang into build-fuzz/ (a separate tree:
# only the sources the targets need, -fsanitize=fuzzer,address,undefined), assembles a seed corpus from the
# fixtures, runs each target for a set time and prints, per target, the executions, the corpus size and the crashes
# (crash, leak, timeout or out-of-memory inputs, kept under build-fuzz/findings/TARGET/).
#
#   scripts/fuzz.sh                       every target, 60 s each
#   scripts/fuzz.sh --seconds 300         every target, 300 s each
#   scripts/fuzz.sh --smoke               every target, 5 s each (what CI can afford)
#   scripts/fuzz.sh --only fuzz_entry     one target (repeatable)
#   scripts/fuzz.sh --build-only          configure and build, nothing else
# Environment: FUZZ_BUILD_DIR (default build-fuzz), CXX (default clang++-14), JOBS (default nproc).
# The corpus grows in FUZZ_BUILD_DIR/corpus/TARGET across runs (seeds in FUZZ_BUILD_DIR/seeds/TARGET).
# Exit status: 0 when no target found anything; 1 when one did (or on a setup error).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SECONDS_EACH=60
ONLY=()
BUILD_ONLY=0
while (($#)); do
  case "$1" in
    --seconds) SECONDS_EACH=$2; shift 2 ;;
    --smoke) SECONDS_EACH=5; shift ;;
    --only) ONLY+=("$2"); shift 2 ;;
    --build-only) BUILD_ONLY=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $1 (see --help)" >&2; exit 1 ;;
  esac
done
TARGETS=(fuzz_safetensors fuzz_config_json fuzz_tokenizer_load fuzz_tokenizer_encode fuzz_entry fuzz_chunks)
((${#ONLY[@]})) && TARGETS=("${ONLY[@]}")
B=${FUZZ_BUILD_DIR:-build-fuzz}
CXX=${CXX:-clang++-14}
CC_=${CC:-clang-14}
JOBS=${JOBS:-$(nproc)}

# ---- toolchain (Debian packages) ----
if ! command -v "$CXX" >/dev/null 2>&1 || ! ls /usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  echo "[fuzz] installing clang-14 and libclang-rt-14-dev"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang-14 libclang-rt-14-dev
fi

# ---- build ----
t0=$(date +%s)
cmake -S tests/fuzz -B "$B" -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_C_COMPILER="$CC_" >/dev/null
cmake --build "$B" -j "$JOBS" --target "${TARGETS[@]}"
echo "[fuzz] build: $(( $(date +%s) - t0 )) s"
((BUILD_ONLY)) && exit 0

# ---- seed corpus ----
QWEN3=$(bash scripts/fetch_tokenizer.sh)
export HYPIC_SOURCE_DIR="$ROOT" HYPIC_FUZZ_QWEN3="$QWEN3"
SEEDS="$B/seeds"
rm -rf "$SEEDS"
mkdir -p "$SEEDS"/{fuzz_safetensors,fuzz_config_json,fuzz_tokenizer_load,fuzz_tokenizer_encode,fuzz_entry,fuzz_chunks}
python3 tests/fuzz/make_seeds.py --source "$ROOT" --qwen3 "$QWEN3" --out "$SEEDS"
for t in fuzz_entry fuzz_chunks; do
  if [[ " ${TARGETS[*]} " == *" $t "* ]]; then HYPIC_FUZZ_WRITE_SEEDS="$SEEDS/$t" "$B/$t" >/dev/null 2>&1; fi
done

# ---- runs ----
# Per target: the longest input it may be given (-max_len), and its dictionary-free options.
declare -A MAXLEN=([fuzz_safetensors]=16384 [fuzz_config_json]=8192 [fuzz_tokenizer_load]=65536
                   [fuzz_tokenizer_encode]=8192 [fuzz_entry]=65536 [fuzz_chunks]=8192)
status=0
summary=()
for t in "${TARGETS[@]}"; do
  corpus="$B/corpus/$t"
  findings="$B/findings/$t"
  rm -rf "$findings"
  mkdir -p "$corpus" "$findings"
  log="$B/logs/$t.log"
  mkdir -p "$B/logs"
  echo "[fuzz] $t: ${SECONDS_EACH} s"
  set +e
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0} \
  UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
  "$B/$t" "$corpus" "$SEEDS/$t" -max_total_time="$SECONDS_EACH" -max_len="${MAXLEN[$t]:-8192}" -timeout=10 \
    -rss_limit_mb=3072 -artifact_prefix="$findings/" -print_final_stats=1 >"$log" 2>&1
  rc=$?
  set -e
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  crashes=$(find "$findings" -type f | wc -l)
  corpus_n=$(find "$corpus" -type f | wc -l)
  summary+=("$(printf '%-24s executions %10s  corpus %6s  crashes %3s  exit %s' "$t" "${execs:-?}" "$corpus_n" "$crashes" "$rc")")
  if ((rc != 0 || crashes > 0)); then
    status=1
    echo "[fuzz] $t found something (exit $rc); log $log, inputs in $findings:"
    grep -E 'ERROR|FUZZ_CHECK|runtime error|Test unit written' "$log" | head -20 || true
  fi
done
echo "[fuzz] summary (${SECONDS_EACH} s per target; 'crashes' counts saved crash/leak/timeout/oom inputs):"
printf '  %s\n' "${summary[@]}"
exit $status
