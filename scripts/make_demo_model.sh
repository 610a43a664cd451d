#!/usr/bin/env bash
# Makes the demo model once and prints its directory on stdout (nothing else goes to stdout).
#
#   scripts/make_demo_model.sh BIN_DIR       BIN_DIR holds hypic-model
#
# The demo model is `hypic-model init --config deploy/models/demo.json --seed 1`: a small checkpoint of a
# real hybrid architecture with RANDOM weights and the real 151936-token Qwen vocabulary, sized to run on
# two CPU cores. It lives in $HYPIC_CACHE_DIR/models/demo-seed1 (default cache directory
# ${XDG_CACHE_HOME:-~/.cache}/hypic) and is reused while a stamp file shows it was made from the current
# deploy/models/demo.json and its weights file has the recorded size; otherwise it is made again.
# Concurrent runs are safe (each builds in a private directory and renames it into place).
# Exit status: 0 on success; 1 with a message on stderr.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "make_demo_model.sh: $*" >&2; exit 1; }
(($# == 1)) || die "usage: scripts/make_demo_model.sh BIN_DIR"
MODEL_BIN="$1/hypic-model"
[[ -x "$MODEL_BIN" ]] || die "$MODEL_BIN not found (build it first)"
CONFIG="$ROOT/deploy/models/demo.json"
[[ -f "$CONFIG" ]] || die "$CONFIG is missing"
CACHE_ROOT="${HYPIC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hypic}"
MODEL="$CACHE_ROOT/models/demo-seed1"

stamp_of() {  # the config's digest, the seed and the size of the weights file in directory $1
  echo "config $(sha256sum "$CONFIG" | cut -d' ' -f1) seed 1 weights $(stat -c %s "$1/model.safetensors" 2>/dev/null || echo none)"
}

if [[ ! -f "$MODEL/.demo-stamp" || "$(cat "$MODEL/.demo-stamp")" != "$(stamp_of "$MODEL")" ]]; then
  echo "make_demo_model.sh: making the demo model: hypic-model init --config deploy/models/demo.json --seed 1" >&2
  mkdir -p "$CACHE_ROOT/models" || die "cannot create $CACHE_ROOT/models"
  work="$(mktemp -d "$CACHE_ROOT/models/.demo.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  "$MODEL_BIN" init --config "$CONFIG" --seed 1 --out "$work/m" >&2 || die "hypic-model init failed"
  stamp_of "$work/m" > "$work/m/.demo-stamp"
  rm -rf "$MODEL"
  # A concurrent run may have placed its copy first; both are the same deterministic checkpoint.
  mv -T "$work/m" "$MODEL" 2>/dev/null || true
  [[ -f "$MODEL/.demo-stamp" ]] || die "could not place the demo model in $MODEL"
fi
echo "$MODEL"
