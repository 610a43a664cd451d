#!/usr/bin/env bash
# Packs prebuilt binaries and the shared libraries they load (except the C library's, CUDA's and NCCL's, which the GPU
# host has) into parts small enough to travel to a GPU host one per call (the device machine takes the working tree
# and what a call carries, at most 64 MiB together, counted as the files' disk usage). Each file is stripped
# (binaries) and compressed with xz on its own; the parts are plain tars of those files, filled greedily up to
# --part-mib, by default what the tracked tree leaves of the 64 MiB less 256 KiB (about 6.3 MiB on 2026-12-05).
#
#   scripts/gpu_bundle.sh --bin build-gpu/bin --out .carry [--part-mib N] NAME...
#       NAME: binaries of --bin (e.g. hypic-router hypic-combine-worker test_gpu_backend)
# Writes OUT/part1.tar, OUT/part2.tar, ... and prints how many. On the GPU host, for each part in turn (the machine
# keeps /tmp between calls while it is warm):
#   mkdir -p /tmp/hypic && tar xf .carry/partN.tar -C /tmp/hypic && xz -d -f /tmp/hypic/*/*.xz
# A file too large for one part travels as pieces (NAME.xz.piece00, 01, ... in successive parts); after the last part:
#   cd /tmp/hypic && for p in */*.xz.piece00; do [[ -e $p ]] || continue; b=${p%.piece00}; cat $b.piece* > $b &&
#     rm $b.piece* && xz -d -f $b; done; chmod +x bin/*
# then run with LD_LIBRARY_PATH=/tmp/hypic/lib:<CUDA and NCCL lib dirs> and binaries from /tmp/hypic/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="" OUT="" PART_MIB="" NAMES=()
while (($#)); do
  case "$1" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    --bin) BIN="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --part-mib) PART_MIB="$2"; shift 2 ;;
    -*) echo "gpu_bundle.sh: unknown option $1" >&2; exit 2 ;;
    *) NAMES+=("$1"); shift ;;
  esac
done
[[ -n "$BIN" && -n "$OUT" && ${#NAMES[@]} -gt 0 ]] || { echo "usage: gpu_bundle.sh --bin DIR --out DIR NAME..." >&2; exit 2; }
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin" "$STAGE/lib" "$OUT"
OUT=$(cd "$OUT" && pwd)  # (absolute: the tars are written from inside the stage)
rm -f "$OUT"/part*.tar
libs=()
for n in "${NAMES[@]}"; do
  [[ -x "$BIN/$n" ]] || { echo "gpu_bundle.sh: $BIN/$n not found" >&2; exit 2; }
  strip -o "$STAGE/bin/$n" "$BIN/$n"
  while read -r l; do libs+=("$l"); done < <(ldd "$BIN/$n" | awk '/=> \//{print $3}')
done
for l in $(printf '%s\n' "${libs[@]}" | sort -u); do
  case "$(basename "$l")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libcudart.so*|libcublas*|libnccl.so*) ;;
    *) cp -L "$l" "$STAGE/lib/" ;;
  esac
done
xz -T0 -6 "$STAGE"/bin/* "$STAGE"/lib/*
# Greedy: largest first into the first part with room.
if [[ -n "$PART_MIB" ]]; then
  limit=$((PART_MIB * 1024 * 1024))
else  # the headroom the tracked tree leaves (its disk usage, as the device transfer counts it), less a margin
  tracked=$(git ls-files -z | du -c -B1 --files0-from=- | tail -1 | cut -f1)
  limit=$((64 * 1024 * 1024 - tracked - 256 * 1024))
  ((limit > 0)) || { echo "gpu_bundle.sh: the tracked tree ($tracked bytes) leaves no room under 64 MiB" >&2; exit 1; }
  echo "parts of at most $limit bytes (64 MiB less the tracked tree's $tracked bytes and 256 KiB)"
fi
# A compressed file larger than a part (the combine worker: about 6.3 MB) is split into pieces NAME.xz.piece00, 01 ...
# of at most a part less 64 KiB (tar headers), placed like any file; the host joins them after the last part.
piece=$((limit - 64 * 1024))
while read -r size f; do
  if ((size > piece)); then
    (cd "$STAGE" && split -b "$piece" -d "$f" "$f.piece" && rm "$f")
    echo "$f: $size bytes compressed, split into pieces of at most $piece bytes (joined on the host, see --help)"
  fi
done < <(cd "$STAGE" && find bin lib -type f -printf '%s %p\n')
declare -a sizes=()
n=0
while read -r size f; do
  placed=0
  for ((p = 0; p < n; p++)); do
    if ((sizes[p] + size <= limit)); then
      (cd "$STAGE" && tar rf "$OUT/part$((p + 1)).tar" "$f")
      sizes[p]=$((sizes[p] + size)); placed=1; break
    fi
  done
  if ((!placed)); then
    ((size <= limit)) || { echo "gpu_bundle.sh: $f is $size bytes compressed, above the part size ($limit bytes)" >&2; exit 1; }
    (cd "$STAGE" && tar cf "$OUT/part$((n + 1)).tar" "$f")
    sizes[n]=$size; n=$((n + 1))
  fi
done < <(cd "$STAGE" && find bin lib -type f -printf '%s %p\n' | sort -rn)
for ((p = 0; p < n; p++)); do echo "part$((p + 1)).tar: $(stat -c %s "$OUT/part$((p + 1)).tar") bytes"; done
