#!/usr/bin/env bash
# The test suite under sanitizers (issue 15): builds the whole project into its own tree with GCC's
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/; leaks reported at exit, UB fatal)
#   tsan  ThreadSanitizer (build-tsan/)
# and runs every CTest test there (the integration tests start the sanitized services, so their races and memory
# errors show too). The CUDA backend is left out (sanitizers do not cover device code).
#
#   scripts/sanitize.sh asan|tsan [-R REGEX] [--jobs N]
#
# Exit status: ctest's (non-zero when a test failed, which includes a sanitizer report: halt_on_error is set).
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${1:?usage: scripts/sanitize.sh asan|tsan [-R REGEX] [--jobs N]}
shift
JOBS=$(nproc) FILTER=()
while (($#)); do
  case "$1" in
    -R) FILTER=(-R "$2"); shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    *) echo "sanitize.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$KIND" in
  asan) FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
        export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:abort_on_error=0"
        export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" ;;
  tsan) FLAGS="-fsanitize=thread -fno-omit-frame-pointer"
        export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/scripts/tsan.supp" ;;
  *) echo "sanitize.sh: want asan or tsan, got $KIND" >&2; exit 2 ;;
esac
BUILD="build-$KIND"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHYPIC_WITH_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="$FLAGS" \
  -DCMAKE_SHARED_LINKER_FLAGS="$FLAGS" >/dev/null
cmake --build "$BUILD" -j "$JOBS"
cd "$BUILD" && ctest --output-on-failure -j "$JOBS" "${FILTER[@]}"
