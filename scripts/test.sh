#!/usr/bin/env bash
# The test command: installs what is missing, builds, runs every CTest test (unit + integration).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
BUILD_DIR=${BUILD_DIR:-build}
cd "$BUILD_DIR" && ctest --output-on-failure -j "${JOBS:-$(nproc)}"
