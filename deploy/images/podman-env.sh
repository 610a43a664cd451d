# Sourced by deploy/images/build.sh and scripts/deploy_test.sh: makes podman usable on this kind of machine
# (Debian 12, root, no systemd, cgroup v1, a hard nofile limit of 20000) and names the image cache.
#
# hypic_podman_setup writes a containers.conf with
#   runtime = "runc", cgroup_manager = "cgroupfs", events_logger = "file",
#   default_ulimits nofile and nproc = 16384 (podman's default asks for more than the machine allows)
# and only where none is in force:
#   - $CONTAINERS_CONF set: that file, written only if it does not exist;
#   - else /etc/containers/containers.conf if it exists: used as it is (not touched);
#   - else that file is written when writable (root), otherwise $HYPIC_IMAGE_CACHE/containers.conf is written
#     and exported as CONTAINERS_CONF (project-local, nothing outside the cache touched).
# Debian packages needed: podman runc debootstrap (hypic_podman_require installs them with apt-get when root).

HYPIC_IMAGE_CACHE="${HYPIC_IMAGE_CACHE:-${HYPIC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hypic}/images}"

hypic_containers_conf_text() {
  cat <<'CONF'
# Written by hypic deploy/images/podman-env.sh (runc, no systemd, cgroupfs, limits the machine allows)
[containers]
default_ulimits = ["nofile=16384:16384", "nproc=16384:16384"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
}

hypic_podman_require() {  # installs the Debian packages named in $@ that are missing (root only)
  local missing=()
  for p in "$@"; do [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" == "install ok installed" ]] || missing+=("$p"); done
  ((${#missing[@]} == 0)) && return 0
  if [[ $(id -u) -ne 0 ]]; then
    echo "podman-env: missing Debian packages: ${missing[*]} (apt-get install them as root)" >&2
    return 1
  fi
  echo "podman-env: installing ${missing[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2 \
    || { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2; }
}

hypic_podman_setup() {
  mkdir -p "$HYPIC_IMAGE_CACHE"
  if [[ -n "${CONTAINERS_CONF:-}" ]]; then
    [[ -f "$CONTAINERS_CONF" ]] || { mkdir -p "$(dirname "$CONTAINERS_CONF")"; hypic_containers_conf_text > "$CONTAINERS_CONF"; }
  elif [[ -f /etc/containers/containers.conf ]]; then
    :
  elif [[ -w /etc/containers || ( ! -e /etc/containers && $(id -u) -eq 0 ) ]]; then
    mkdir -p /etc/containers
    hypic_containers_conf_text > /etc/containers/containers.conf
    echo "podman-env: wrote /etc/containers/containers.conf" >&2
  else
    export CONTAINERS_CONF="$HYPIC_IMAGE_CACHE/containers.conf"
    [[ -f "$CONTAINERS_CONF" ]] || hypic_containers_conf_text > "$CONTAINERS_CONF"
  fi
  podman info >/dev/null 2>&1 || { echo "podman-env: 'podman info' fails:" >&2; podman info >&2; return 1; }
}
