#!/usr/bin/env bash
# Builds the hypic container images with podman:
#
#   localhost/hypic-base:bookworm-<key>      Debian 12 minbase made with debootstrap (about 77 MB), cached
#   localhost/hypic-runtime:<version>        base + the shared libraries the binaries load + hypic-client + user 10001
#   localhost/hypic-<service>:<version>      runtime + one binary: router, scatter-worker, combine-worker,
#                                            segment-cache, openai (only when hypic-openai is built), client
#   localhost/hypic-runtime-gpu:<version>    runtime + libcudart, libcublas, libcublasLt, libnccl (when they exist)
#   localhost/hypic-<worker>:<version>-gpu   runtime-gpu + the CUDA build's scatter-worker / combine-worker
#
# Usage: deploy/images/build.sh [options]
#   --version V         image tag (default: the project version in CMakeLists.txt)
#   --bin-dir DIR       binaries of the CPU build (default: build/bin)
#   --gpu-bin-dir DIR   binaries of the CUDA build (default: build-gpu/bin)
#   --cuda-lib-dir DIR  the CUDA runtime libraries (default: /usr/local/cuda/lib64)
#   --cudnn-lib-dir DIR also copy cuDNN 9 (libcudnn*.so.9 from DIR, and NVRTC from --cuda-lib-dir, which its
#                       runtime-compiled engines open) into the GPU runtime layer, so that the workers' long prefill
#                       attention runs on cuDNN's fused SDPA (kernels/cuda/attention.h; opened at run time, so without
#                       it they run our own kernels). About 1 GB more; off by default
#   --no-gpu            do not build the GPU variant even when the CUDA libraries and binaries exist
#   --cache-dir DIR     where the base image's OCI archive is kept (default: $HYPIC_IMAGE_CACHE, else
#                       ${HYPIC_CACHE_DIR:-~/.cache/hypic}/images); a second run loads it instead of running debootstrap
#   --rebuild-base      run debootstrap again even when the base is cached
#   --debian-mirror URL (default: $HYPIC_DEBIAN_MIRROR, else http://deb.debian.org/debian)
#
# Libraries: ldd lists what each binary loads; the files the base already has (the same Debian 12 packages:
# libc, libstdc++, libgcc_s, zlib, ...) are left to it, the rest (gRPC, protobuf, abseil, OpenBLAS, spdlog, ...) is
# copied from this host, which built the binaries, to the same paths: 59 MB, where installing the Debian packages
# that hold them would take 75 MB (libgrpc29 also brings libprotoc and the unsecure gRPC variants,
# libopenblas0-pthread the BLAS/LAPACK alternatives) plus apt's lists during the build; it needs no network and no
# apt inside the image, and loads exactly the files the binaries were linked and tested against. The binaries are
# stripped (the CPU build's carry debug information: the router 12 -> 2 MB).
# What the image does not have: a package database entry for the copied libraries (a scanner that reads dpkg's
# status misses them; their versions are those of this host, listed in the image by /usr/share/hypic/libs.txt).
#
# Needs: Debian 12, root (podman rootful; debootstrap), the packages podman runc debootstrap (installed with
# apt-get when missing), network access to the Debian archive for the first base only.
# Exit status: 0 when every image was built; 1 with a message otherwise.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/deploy/images"
die() { echo "build.sh: $*" >&2; exit 1; }
note() { echo "build.sh: $*" >&2; }

VERSION="$(sed -n 's/^project(hypic[^)]*VERSION \([0-9][0-9.]*\).*/\1/p' "$ROOT/CMakeLists.txt" | head -n1)"
BIN_DIR="$ROOT/build/bin"
GPU_BIN_DIR="$ROOT/build-gpu/bin"
CUDA_LIB_DIR="/usr/local/cuda/lib64"
CUDNN_LIB_DIR=""
GPU=1
REBUILD_BASE=0
MIRROR="${HYPIC_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
while (($#)); do
  case "$1" in
    --version) VERSION="$2"; shift 2 ;;
    --bin-dir) BIN_DIR="$2"; shift 2 ;;
    --gpu-bin-dir) GPU_BIN_DIR="$2"; shift 2 ;;
    --cuda-lib-dir) CUDA_LIB_DIR="$2"; shift 2 ;;
    --cudnn-lib-dir) CUDNN_LIB_DIR="$2"; shift 2 ;;
    --no-gpu) GPU=0; shift ;;
    --cache-dir) export HYPIC_IMAGE_CACHE="$2"; shift 2 ;;
    --rebuild-base) REBUILD_BASE=1; shift ;;
    --debian-mirror) MIRROR="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[[ -n "$VERSION" ]] || die "cannot read the version from CMakeLists.txt; pass --version"
BIN_DIR="$(cd "$BIN_DIR" 2>/dev/null && pwd)" || die "--bin-dir: no such directory"

# shellcheck source=deploy/images/podman-env.sh
source "$HERE/podman-env.sh"
hypic_podman_require podman runc debootstrap binutils
hypic_podman_setup
CACHE="$HYPIC_IMAGE_CACHE"
mkdir -p "$CACHE"

T0=$SECONDS
declare -A TIMES

# ---------------------------------------------------------------- base (debootstrap minbase, cached as OCI archive)
SUITE=bookworm
BASE_RECIPE=3  # bump when the recipe below changes: a new key, so a new base
BASE_KEY="$(printf '%s\n' "$SUITE" minbase "$MIRROR" "$BASE_RECIPE" | sha256sum | cut -c1-12)"
BASE_IMAGE="localhost/hypic-base:$SUITE-$BASE_KEY"
BASE_ARCHIVE="$CACHE/hypic-base-$SUITE-$BASE_KEY.oci.tar"
BASE_FILES="$CACHE/hypic-base-$SUITE-$BASE_KEY.files"

make_base() {
  local work rootfs
  work="$(mktemp -d "$CACHE/.base.XXXXXX")"
  rootfs="$work/rootfs"
  trap 'rm -rf "$work"' RETURN
  note "making the Debian $SUITE base with debootstrap (variant minbase, $MIRROR); about 2 minutes"
  debootstrap --variant=minbase --arch=amd64 "$SUITE" "$rootfs" "$MIRROR" > "$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
  local security="${MIRROR%/debian}/debian-security"
  cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $security $SUITE-security main
EOF
  # Nothing installed later (an image derived from this base) brings docs, man pages or locales back.
  cat > "$rootfs/etc/dpkg/dpkg.cfg.d/01-hypic-nodoc" <<'EOF'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-exclude=/usr/share/lintian/*
EOF
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' > "$rootfs/etc/apt/apt.conf.d/01-hypic-norecommends"
  note "applying $SUITE-updates and $SUITE-security"
  { chroot "$rootfs" apt-get update -qq && DEBIAN_FRONTEND=noninteractive chroot "$rootfs" apt-get -y -qq upgrade; } \
    > "$work/upgrade.log" 2>&1 || { tail -n 20 "$work/upgrade.log" >&2; die "apt-get upgrade in the base failed"; }
  chroot "$rootfs" apt-get clean
  (cd "$rootfs" && rm -rf var/lib/apt/lists/* var/cache/apt/*.bin var/cache/debconf/*-old var/lib/dpkg/*-old \
     var/log/* usr/share/man usr/share/info usr/share/locale usr/share/lintian etc/resolv.conf etc/hostname \
   && find usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete \
   && find usr/share/doc -mindepth 1 -type d -empty -delete)
  (cd "$rootfs" && find . \( -type f -o -type l \) -printf '/%P\n') | sort > "$work/files"
  tar --numeric-owner -C "$rootfs" -c . | podman import --quiet \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["/bin/bash"]' --message "hypic base: Debian $SUITE minbase" - "$BASE_IMAGE" > /dev/null
  podman save --quiet --format oci-archive -o "$work/base.oci.tar" "$BASE_IMAGE"
  mv "$work/base.oci.tar" "$BASE_ARCHIVE"
  mv "$work/files" "$BASE_FILES"
}

t=$SECONDS
if ((REBUILD_BASE)); then
  podman rmi -f "$BASE_IMAGE" > /dev/null 2>&1 || true
  rm -f "$BASE_ARCHIVE" "$BASE_FILES"
fi
if podman image exists "$BASE_IMAGE" && [[ -f "$BASE_FILES" ]]; then
  note "base $BASE_IMAGE: present"
elif [[ -f "$BASE_ARCHIVE" && -f "$BASE_FILES" ]]; then
  note "base $BASE_IMAGE: loading the cached $BASE_ARCHIVE"
  podman load --quiet -i "$BASE_ARCHIVE" > /dev/null
  podman image exists "$BASE_IMAGE" || podman tag "$(podman images -q --filter dangling=true | head -n1)" "$BASE_IMAGE"
else
  make_base
fi
podman image exists "$BASE_IMAGE" || die "no base image $BASE_IMAGE"
TIMES[base]=$((SECONDS - t))

# ---------------------------------------------------------------- build context
CTX="$(mktemp -d "$CACHE/.ctx.XXXXXX")"
trap 'rm -rf "$CTX"' EXIT
mkdir -p "$CTX/bin" "$CTX/libs" "$CTX/bin-gpu" "$CTX/cuda"
cp "$HERE"/Containerfile.* "$CTX/"

declare -A IN_BASE
while IFS= read -r f; do IN_BASE["$f"]=1; done < <(sed -e 's#^/lib/#/usr/lib/#' -e 's#^/lib64/#/usr/lib64/#' "$BASE_FILES")
declare -A COLLECTED

# collect_libs BINARY: copies the libraries BINARY loads that neither the base nor an earlier binary brought, to
# CTX/libs/<path> (or, for CUDA toolkit libraries, CTX/cuda/<name> taken from CUDA_LIB_DIR).
collect_libs() {
  local bin="$1" line name path norm
  while IFS= read -r line; do
    [[ "$line" == *"not found"* ]] && die "$bin: ldd: $line"
    name="$(awk '{print $1}' <<<"$line")"
    path="$(awk '$2 == "=>" {print $3}' <<<"$line")"
    [[ "$path" == /* ]] || continue
    norm="$(sed -e 's#^/lib/#/usr/lib/#' -e 's#^/lib64/#/usr/lib64/#' <<<"$path")"
    [[ -n "${IN_BASE[$norm]:-}" || -n "${COLLECTED[$norm]:-}" ]] && continue
    COLLECTED["$norm"]=1
    case "$name" in
      libcudart.so*|libcublas.so*|libcublasLt.so*|libnccl.so*)
        [[ -e "$CUDA_LIB_DIR/$name" ]] || die "$bin loads $name, which $CUDA_LIB_DIR lacks (--cuda-lib-dir)"
        cp -L "$CUDA_LIB_DIR/$name" "$CTX/cuda/$name" ;;
      *)
        [[ "$norm" == /usr/local/cuda* ]] && die "$bin loads $path: not a library the GPU runtime image carries"
        mkdir -p "$CTX/libs$(dirname "$norm")"
        cp -L "$path" "$CTX/libs$norm"
        echo "$norm" >> "$CTX/libs.txt" ;;
    esac
  done < <(ldd "$bin")
}

# Services and the binaries of each image (openai only when built).
SERVICES=(router scatter-worker combine-worker segment-cache client)
declare -A BINARY=([router]=hypic-router [scatter-worker]=hypic-scatter-worker [combine-worker]=hypic-combine-worker
                   [segment-cache]=hypic-segment-cache [openai]=hypic-openai [client]=hypic-model)
if [[ -x "$BIN_DIR/hypic-openai" ]]; then
  SERVICES+=(openai)
else
  note "no $BIN_DIR/hypic-openai (the HTTP front is not built yet): skipping the hypic-openai image"
fi
bins=(hypic-client)
for s in "${SERVICES[@]}"; do bins+=("${BINARY[$s]}"); done
for b in "${bins[@]}"; do
  [[ -x "$BIN_DIR/$b" ]] || die "$BIN_DIR/$b not found (build with scripts/build.sh, or pass --bin-dir)"
  strip --strip-unneeded -o "$CTX/bin/$b" "$BIN_DIR/$b"
  collect_libs "$BIN_DIR/$b"
done
mkdir -p "$CTX/libs/usr/share/hypic"
# The image's record of what was copied: path, Debian package, version (of this host).
dpkg -S $(cat "$CTX/libs.txt") 2>/dev/null | sed 's/, [^:]*//' | awk -F': ' '{print $2, $1}' | sort \
  | while read -r path pkg; do echo "$path $pkg $(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null)"; done \
  > "$CTX/libs/usr/share/hypic/libs.txt"
note "$(wc -l < "$CTX/libs.txt") libraries beyond the base ($(du -sh "$CTX/libs" | cut -f1))"

IMAGES=()
OLD_IDS=()
build_image() {  # tag containerfile [build args...]
  local tag="$1" file="$2"
  shift 2
  local t=$SECONDS old
  old="$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)"
  podman build --quiet --layers -f "$CTX/$file" --build-arg "VERSION=$VERSION" "$@" -t "$tag" "$CTX" > "$CTX/build.log" 2>&1 \
    || { cat "$CTX/build.log" >&2; die "podman build of $tag failed"; }
  IMAGES+=("$tag")
  TIMES["$tag"]=$((SECONDS - t))
  [[ -n "$old" && "$old" != "$(podman image inspect --format '{{.Id}}' "$tag")" ]] && OLD_IDS+=("$old")
  return 0
}

# ---------------------------------------------------------------- CPU images
RUNTIME="localhost/hypic-runtime:$VERSION"
build_image "$RUNTIME" Containerfile.runtime --build-arg "BASE=$BASE_IMAGE"
for s in "${SERVICES[@]}"; do
  build_image "localhost/hypic-$s:$VERSION" "Containerfile.$s" --build-arg "RUNTIME=$RUNTIME"
done

# ---------------------------------------------------------------- GPU variant (CUDA build's workers)
gpu_reason=""
if ((GPU == 0)); then
  gpu_reason="--no-gpu"
elif ! ls "$CUDA_LIB_DIR"/libcudart.so.* "$CUDA_LIB_DIR"/libcublas.so.* "$CUDA_LIB_DIR"/libcublasLt.so.* > /dev/null 2>&1; then
  gpu_reason="no libcudart/libcublas/libcublasLt in $CUDA_LIB_DIR"
elif [[ ! -x "$GPU_BIN_DIR/hypic-scatter-worker" || ! -x "$GPU_BIN_DIR/hypic-combine-worker" ]]; then
  gpu_reason="no CUDA build of the workers in $GPU_BIN_DIR"
elif [[ "$(ldd "$GPU_BIN_DIR/hypic-scatter-worker")" != *libcudart* ]]; then
  gpu_reason="$GPU_BIN_DIR/hypic-scatter-worker is not a CUDA build"
fi
if [[ -z "$gpu_reason" ]]; then
  before="$(wc -l < "$CTX/libs.txt")"
  for b in hypic-scatter-worker hypic-combine-worker; do
    strip --strip-unneeded -o "$CTX/bin-gpu/$b" "$GPU_BIN_DIR/$b"
    collect_libs "$GPU_BIN_DIR/$b"
  done
  # The GPU layer adds only cuda/: anything else the CUDA build loads must be in the CPU runtime already.
  if (($(wc -l < "$CTX/libs.txt") != before)); then
    die "the CUDA build loads libraries the CPU build does not: $(tail -n +$((before + 1)) "$CTX/libs.txt" | tr '\n' ' ')"
  fi
  if [[ -n "$CUDNN_LIB_DIR" ]]; then  # dlopen'd (not in ldd's list): the whole cuDNN 9 set, sub-libraries included
    ls "$CUDNN_LIB_DIR"/libcudnn.so.9 > /dev/null 2>&1 || die "--cudnn-lib-dir: no libcudnn.so.9 in $CUDNN_LIB_DIR"
    for f in "$CUDNN_LIB_DIR"/libcudnn*.so.9; do cp -L "$f" "$CTX/cuda/"; done
    # cuDNN's runtime-compiled engines (the fused SDPA among them) open NVRTC at run time: the toolkit's copy.
    ls "$CUDA_LIB_DIR"/libnvrtc.so.[0-9]* > /dev/null 2>&1 || die "--cudnn-lib-dir: no libnvrtc in $CUDA_LIB_DIR"
    for f in "$CUDA_LIB_DIR"/libnvrtc.so.[0-9]* "$CUDA_LIB_DIR"/libnvrtc-builtins.so.[0-9]*; do
      [[ -e "$f" ]] && cp -P "$f" "$CTX/cuda/"  # links stay links: one copy of each library
    done
    for f in "$CTX"/cuda/libnvrtc.so.[0-9]* "$CTX"/cuda/libnvrtc-builtins.so.[0-9]*; do  # dangling: copy the target
      [[ -L "$f" && ! -e "$f" ]] && cp -L "$CUDA_LIB_DIR/$(basename "$f")" "$f.tmp" && mv -f "$f.tmp" "$f"
    done
    nvrtc="$(cd "$CTX/cuda" && ls libnvrtc.so.[0-9]* | sort | head -n1)"  # the soname (shortest)
    ln -sf "$nvrtc" "$CTX/cuda/libnvrtc.so"  # cuDNN may open the unversioned name
  fi
  note "CUDA libraries: $(cd "$CTX/cuda" && echo *) ($(du -sh "$CTX/cuda" | cut -f1))"
  RUNTIME_GPU="localhost/hypic-runtime-gpu:$VERSION"
  build_image "$RUNTIME_GPU" Containerfile.runtime-gpu --build-arg "RUNTIME=$RUNTIME"
  for s in scatter-worker combine-worker; do
    build_image "localhost/hypic-$s:$VERSION-gpu" "Containerfile.$s" --build-arg "RUNTIME=$RUNTIME_GPU" --build-arg BIN=bin-gpu
  done
else
  note "GPU variant skipped: $gpu_reason"
fi

# The images this run replaced (now untagged): removed, the service images before the runtime they were built on;
# one still used by a container stays.
for ((i = ${#OLD_IDS[@]} - 1; i >= 0; i--)); do podman rmi "${OLD_IDS[i]}" > /dev/null 2>&1 || true; done

# ---------------------------------------------------------------- summary
echo "base $BASE_IMAGE ($(podman image inspect --format '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.1f MB", $1/1e6}'), ${TIMES[base]} s)"
for img in "${IMAGES[@]}"; do
  size="$(podman image inspect --format '{{.Size}}' "$img" | awk '{printf "%.1f MB", $1/1e6}')"
  printf '%-46s %10s  %3d s\n' "$img" "$size" "${TIMES[$img]}"
done
echo "images built in $((SECONDS - T0)) s (cache: $CACHE)"
