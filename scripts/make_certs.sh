#!/usr/bin/env bash
# Makes a private CA and certificates for hypic's TLS flags (proto/rpc/security.h), with the openssl command:
#   DIR/ca.crt, ca.key        the CA (--tls-ca, --tls-client-ca)
#   DIR/server.crt, .key      the SERVICE identity (subject CN hypic-service): every service serves with it
#                             (--tls-cert, --tls-key) and presents it when it calls another (--tls-client-cert,
#                             --tls-client-key); the internal services accept their RPCs only from it
#                             (--tls-service-identity, default hypic-service)
#   DIR/client.crt, .key      the USER identity (subject CN hypic-user, client authentication only): what users,
#                             clients and the HTTP front present; under mutual TLS it reaches the router's public
#                             RPCs and health checks only (deploy/README.md "Trust model")
# The server certificate names localhost, 127.0.0.1, ::1 and every --name given (DNS names of the services, e.g.
# hypic-router.hypic.svc.cluster.local, or *.hypic-scatter.hypic.svc.cluster.local). For development and tests; in
# production use your own CA (cert-manager in Kubernetes, deploy/README.md "TLS and tokens").
#
#   scripts/make_certs.sh DIR [--name DNS]... [--days N]
set -euo pipefail
DIR=${1:?usage: scripts/make_certs.sh DIR [--name DNS]... [--days N]}
shift
NAMES=() DAYS=365
while (($#)); do
  case "$1" in
    --name) NAMES+=("$2"); shift 2 ;;
    --days) DAYS=$2; shift 2 ;;
    *) echo "make_certs.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
command -v openssl >/dev/null || { echo "make_certs.sh: the openssl command is missing (apt-get install openssl)" >&2; exit 1; }
mkdir -p "$DIR"
cd "$DIR"
SAN="DNS:localhost,IP:127.0.0.1,IP:::1"
for n in "${NAMES[@]}"; do SAN+=",DNS:$n"; done
q() { "$@" >/dev/null 2>&1 || { echo "make_certs.sh: failed: $*" >&2; "$@"; exit 1; }; }
q openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.crt \
  -days "$DAYS" -subj "/CN=hypic development CA" -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign"
issue() {  # name, subject CN, extended key usage, subjectAltName (optional)
  q openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2"
  local ext="basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=$3"
  [[ -n "${4:-}" ]] && ext+="
subjectAltName=$4"
  q openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" -days "$DAYS" \
    -extfile <(printf '%s\n' "$ext")
  rm -f "$1.csr"
}
issue server "hypic-service" serverAuth,clientAuth "$SAN"
issue client "hypic-user" clientAuth
chmod 600 ./*.key
echo "certificates in $DIR: ca.crt, server.crt/.key (services: CN hypic-service, $SAN), client.crt/.key (users: CN hypic-user)"
