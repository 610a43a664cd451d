#!/usr/bin/env bash
# Builds the text files the tokenizer benchmark encodes (not committed: they come from documents
# installed on a Debian machine with nodejs and python3.11, so their content is reproducible there).
#
#   bench/tokenizer_bench_text.sh OUT_DIR
#
# Writes OUT_DIR/docs.txt   (~4 MB: the Node.js API reference, Markdown prose with code samples,
#                             /usr/share/doc/nodejs/api/*.md in name order),
#        OUT_DIR/code.txt   (~2 MB: Python standard library sources, /usr/lib/python3.11/{asyncio,
#                             email,http,json,logging,unittest,xml}/*.py in name order),
#        OUT_DIR/multi.txt  (the multilingual / edge-case golden corpus tests/fixtures/tokenizer/
#                             corpus/*.txt, repeated to ~0.5 MB).
# Fails with a message if a source folder is missing.
set -euo pipefail
OUT=${1:?usage: $0 OUT_DIR}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$OUT"

take() {  # take LIMIT_BYTES FILE... : concatenates files until LIMIT_BYTES is reached
  local limit=$1; shift
  local total=0
  for f in "$@"; do
    [[ -f "$f" ]] || continue
    cat "$f"
    total=$((total + $(stat -c %s "$f")))
    ((total < limit)) || break
  done
}

docs=(/usr/share/doc/nodejs/api/*.md)
[[ -f "${docs[0]}" ]] || { echo "missing /usr/share/doc/nodejs/api (apt-get install nodejs-doc or nodejs)" >&2; exit 1; }
take 4000000 "${docs[@]}" > "$OUT/docs.txt"

py=/usr/lib/python3.11
[[ -d "$py/asyncio" ]] || { echo "missing $py (python3.11 standard library)" >&2; exit 1; }
mapfile -t code < <(ls "$py"/{asyncio,email,http,json,logging,unittest,xml/*}/*.py 2>/dev/null | sort)
take 2000000 "${code[@]}" > "$OUT/code.txt"

: > "$OUT/multi.txt"
while (( $(stat -c %s "$OUT/multi.txt") < 500000 )); do
  cat "$ROOT"/tests/fixtures/tokenizer/corpus/*.txt >> "$OUT/multi.txt"
done
ls -l "$OUT"/docs.txt "$OUT"/code.txt "$OUT"/multi.txt >&2
