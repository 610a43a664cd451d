#!/usr/bin/env bash
# The deployment end to end on this machine, with podman instead of a Kubernetes cluster:
#
#   1. builds the images (deploy/images/build.sh --no-gpu: the base is cached, a second run takes seconds);
#   2. makes the tiny test model (tests/integration/tiny_model.json, hypic-model init, as the integration tests do)
#      with the real Qwen3 tokenizer (scripts/fetch_tokenizer.sh) in a temporary directory;
#   3. renders the cpu-dev overlay through a temporary overlay on top of it (the model's hostPath -> that directory,
#      the images' tag -> this version, the metrics flags dropped when the images' binaries lack them), validates
#      the overlays (deploy/k8s/validate: schemas, cross-checks, and the same objects as `kubectl kustomize` when
#      kubectl is installed);
#   4. adapts it for podman kube play (deploy/k8s/validate/podman.mjs: StatefulSets -> pods named like their DNS
#      names, gRPC liveness probes -> hypic-client health checks, every port published on 127.0.0.1) and plays it
#      on a podman network of its own (DNS: pods find each other by name, as in Kubernetes);
#   5. waits until every health check passes (podman healthcheck run) and the router has every worker in rotation;
#   6. sends a multi-document request through the router's published port (build/bin/hypic-client generate), cold
#      then warm (every segment a cache hit), and one streamed chat completion through the HTTP front with curl
#      (when the hypic-openai image exists);
#   7. scrapes every metrics endpoint with curl and checks that the counters moved (reports "metrics not available"
#      when the binaries have no --metrics-listen yet);
#   8. tears everything down (podman kube down, the volumes and the network it made, the temporary directory) and
#      checks that nothing is left.
#
# Usage: scripts/deploy_test.sh [--skip-build] [--keep] [--ready-timeout S]
#   --skip-build       use the images as they are (fails if one is missing)
#   --keep             leave the pods running (and print how to remove them) instead of tearing down
#   --ready-timeout S  how long the pods may take to pass their health checks (default 180)
# HYPIC_DEPLOY_TEST_METRICS=0 runs as if the binaries had no --metrics-listen (the metrics step is then skipped).
# Needs: Debian 12 as root (podman, runc, debootstrap are installed when missing), node and npm (the validator's
# packages are installed into deploy/k8s/validate/node_modules on first use), curl, build/bin from scripts/build.sh.
# Exit status 0 when every check passed; the last line says "deploy_test: N passed, M failed".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN="$ROOT/build/bin"
VALIDATE="$ROOT/deploy/k8s/validate"
SKIP_BUILD=0
KEEP=0
READY_TIMEOUT=180
while (($#)); do
  case "$1" in
    --skip-build) SKIP_BUILD=1; shift ;;
    --keep) KEEP=1; shift ;;
    --ready-timeout) READY_TIMEOUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "deploy_test: unknown option $1" >&2; exit 2 ;;
  esac
done

PASSED=0
FAILED=0
pass() { PASSED=$((PASSED + 1)); echo "deploy_test: ok   $*"; }
fail() { FAILED=$((FAILED + 1)); echo "deploy_test: FAIL $*"; }
die() { echo "deploy_test: $*" >&2; FAILED=$((FAILED + 1)); exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
declare -A TIMING
TIMING_ORDER=()
timing() { TIMING["$1"]="$2"; TIMING_ORDER+=("$1"); }

# shellcheck source=deploy/images/podman-env.sh
source "$ROOT/deploy/images/podman-env.sh"
hypic_podman_require podman runc debootstrap curl
hypic_podman_setup
command -v node > /dev/null || die "node not found (Node.js 18 or later)"
VERSION="$(sed -n 's/^project(hypic[^)]*VERSION \([0-9][0-9.]*\).*/\1/p' CMakeLists.txt | head -n1)"

WORK="$(mktemp -d /tmp/hypic-deploy-test.XXXXXX)"
chmod 755 "$WORK"  # the pods (uid 10001) read the model from here
NET="hypic-deploy-test-$$"
PLAY="$WORK/play.yaml"
STATE="$WORK/state.json"
NET_MADE=0
PLAYED=0

teardown() {  # returns 1 when something is left behind
  local rc=0
  set +e
  if ((KEEP && PLAYED)); then
    echo "deploy_test: --keep: the pods run on; remove them with:"
    echo "  podman kube down $PLAY; podman volume rm $(python3 -c "import json;print(' '.join(json.load(open('$STATE'))['volumes']))"); podman network rm $NET; rm -rf $WORK"
    return $rc
  fi
  if ((PLAYED)); then
    podman kube down "$PLAY" > /dev/null 2>&1
    for pod in $(python3 -c "import json;print(' '.join(json.load(open('$STATE'))['pods']))"); do
      podman pod exists "$pod" && podman pod rm -f "$pod" > /dev/null 2>&1
    done
    for v in $(python3 -c "import json;print(' '.join(json.load(open('$STATE'))['volumes']))"); do
      podman volume exists "$v" && podman volume rm -f "$v" > /dev/null 2>&1
    done
  fi
  ((NET_MADE)) && podman network rm -f "$NET" > /dev/null 2>&1
  local left=""
  if [[ -f "$STATE" ]]; then
    for pod in $(python3 -c "import json;print(' '.join(json.load(open('$STATE'))['pods']))"); do
      podman pod exists "$pod" && left+=" pod:$pod"
    done
    for v in $(python3 -c "import json;print(' '.join(json.load(open('$STATE'))['volumes']))"); do
      podman volume exists "$v" && left+=" volume:$v"
    done
  fi
  podman network exists "$NET" 2>/dev/null && left+=" network:$NET"
  rm -rf "$WORK"
  if [[ -n "$left" ]]; then
    echo "deploy_test: FAIL left behind:$left"
    rc=1
  elif ((PLAYED)); then
    echo "deploy_test: torn down: no pod, volume or network left"
  fi
  return $rc
}
finish() {
  local rc=$?
  ((rc == 130)) && echo "deploy_test: interrupted"
  teardown || { rc=1; FAILED=$((FAILED + 1)); }
  echo "deploy_test: $PASSED passed, $FAILED failed"
  ((FAILED == 0)) || rc=1
  exit $rc
}
trap finish EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- 1. images
if ((SKIP_BUILD)); then
  for s in router scatter-worker combine-worker segment-cache; do
    podman image exists "localhost/hypic-$s:$VERSION" || die "--skip-build: no image localhost/hypic-$s:$VERSION"
  done
else
  t=$(now)
  "$ROOT/deploy/images/build.sh" --no-gpu || die "deploy/images/build.sh failed"
  timing "image build (deploy/images/build.sh --no-gpu)" "$(since "$t") s"
fi
OPENAI=0
podman image exists "localhost/hypic-openai:$VERSION" && OPENAI=1
# The metrics flags exist when the images' binaries have them (they are landing service by service).
METRICS=1
services=(router scatter-worker combine-worker segment-cache)
((OPENAI)) && services+=(openai)
for s in "${services[@]}"; do
  help="$(podman run --rm --entrypoint "/usr/local/bin/hypic-$s" "localhost/hypic-$s:$VERSION" --help 2>&1 || true)"
  [[ "$help" == *--metrics-listen* ]] || METRICS=0
done
[[ "${HYPIC_DEPLOY_TEST_METRICS:-}" == 0 ]] && METRICS=0  # pretend the binaries have no metrics flags (tests this script)

# ---------------------------------------------------------------- 2. model
mkdir -p "$WORK/model"
"$BIN/hypic-model" init --config tests/integration/tiny_model.json --seed 1 --std 0.2 --out "$WORK/model" > /dev/null \
  || die "hypic-model init failed"
TOKENIZER="$(scripts/fetch_tokenizer.sh)" || die "scripts/fetch_tokenizer.sh failed"
cp "$TOKENIZER" "$WORK/model/tokenizer.json"
chmod -R a+rX "$WORK/model"

# ---------------------------------------------------------------- 3. render and validate
if [[ ! -d "$VALIDATE/node_modules/kubernetes-models" ]]; then
  (cd "$VALIDATE" && npm ci --ignore-scripts --no-audit --no-fund --silent) || die "npm ci in deploy/k8s/validate failed"
fi
mkdir -p "$WORK/overlay"
REL="$(python3 -c "import os,sys;print(os.path.relpath(sys.argv[1], sys.argv[2]))" "$ROOT/deploy/k8s/overlays/cpu-dev" "$WORK/overlay")"
{
  echo "resources: [$REL]"
  echo "patches:"
  echo "  - path: model.yaml"
  ((METRICS)) || echo "  - path: no-metrics.yaml"
  echo "images:"
  for s in router scatter-worker combine-worker segment-cache openai; do
    echo "  - {name: localhost/hypic-$s, newTag: \"$VERSION\"}"
  done
} > "$WORK/overlay/kustomization.yaml"
python3 - "$WORK/overlay/model.yaml" "$WORK/model" <<'EOF'
import sys
out, model = sys.argv[1], sys.argv[2]
docs = []
for kind, name in [("Deployment", "hypic-router"), ("Deployment", "hypic-openai"),
                   ("StatefulSet", "hypic-scatter-worker"), ("StatefulSet", "hypic-combine-worker")]:
    docs.append(f"""apiVersion: apps/v1
kind: {kind}
metadata:
  name: {name}
spec:
  template:
    spec:
      volumes:
        - name: model
          hostPath:
            path: {model}
            type: Directory
""")
open(out, "w").write("---\n".join(docs))
EOF
printf 'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: hypic-config\ndata:\n  HYPIC_METRICS_FLAGS: ""\n' \
  > "$WORK/overlay/no-metrics.yaml"

if node "$VALIDATE/validate.mjs" --compare-kubectl deploy/k8s/overlays/cpu-dev deploy/k8s/overlays/gpu "$WORK/overlay" \
    > "$WORK/validate.log" 2>&1; then
  pass "overlays cpu-dev, gpu and the test's overlay render and validate"
else
  fail "validation:"; cat "$WORK/validate.log"
fi
sed 's/^/    /' "$WORK/validate.log"
node "$VALIDATE/render.mjs" "$WORK/overlay" --out "$WORK/rendered.yaml" || die "render failed"
EXCLUDE=()
((OPENAI)) || EXCLUDE=(--exclude hypic-openai)
node "$VALIDATE/podman.mjs" "$WORK/rendered.yaml" --out "$PLAY" --state "$STATE" --publish "${EXCLUDE[@]}" \
  || die "podman.mjs failed"
((OPENAI)) || echo "deploy_test: no image localhost/hypic-openai:$VERSION: the HTTP front is left out"

port_of() { python3 -c "import json,sys;print(json.load(open('$STATE'))['pods'][sys.argv[1]]['ports'][sys.argv[2]])" "$1" "$2"; }

# ---------------------------------------------------------------- 4. play
podman network create "$NET" > /dev/null && NET_MADE=1
t_play=$(now)
PLAYED=1
if ! podman kube play --network "$NET" "$PLAY" > "$WORK/play.log" 2>&1; then
  grep -v "failed to connect to syslog" "$WORK/play.log" >&2
  die "podman kube play failed"
fi

# ---------------------------------------------------------------- 5. healthy
containers() { python3 -c "import json;s=json.load(open('$STATE'));print(' '.join(c for p in s['pods'].values() for c in p['$1']))"; }
dump_logs() {
  for c in $(containers containers); do
    echo "---- $c ($(podman inspect --format '{{.State.Status}} exit {{.State.ExitCode}}' "$c" 2>/dev/null))"
    podman logs --tail 15 "$c" 2>&1 | sed 's/^/    /'
  done
}
deadline=$((SECONDS + READY_TIMEOUT))
pending=" $(containers health) "
while [[ -n "${pending// /}" ]]; do
  for c in $pending; do
    if podman healthcheck run "$c" > /dev/null 2>&1; then pending="${pending/ $c / }"; fi
  done
  [[ -z "${pending// /}" ]] && break
  if ((SECONDS > deadline)); then
    fail "health checks still failing after ${READY_TIMEOUT} s:$pending"
    dump_logs
    exit 1
  fi
  sleep 1
done
RPORT="$(port_of hypic-router grpc)"
ROUTER="127.0.0.1:$RPORT"
if ((OPENAI)); then
  OPORT="$(port_of hypic-openai http)"
  until curl -sf "http://127.0.0.1:$OPORT/health" > /dev/null; do
    ((SECONDS > deadline)) && { fail "the HTTP front's /health never answered 200"; dump_logs; exit 1; }
    sleep 1
  done
fi
# The router takes a worker into rotation after its first good probe (--health-interval-ms).
n_scatter="$(python3 -c "import json;print(sum(1 for p in json.load(open('$STATE'))['pods'] if p.startswith('hypic-scatter-worker-')))")"
until "$BIN/hypic-client" info --router "$ROUTER" 2>/dev/null | python3 -c "
import json, sys
i = json.load(sys.stdin)
ok = sum(w.get('available', False) for w in i.get('scatter_workers', [])) >= $n_scatter
ok = ok and any(w.get('available', False) for w in i.get('combine_workers', []))
sys.exit(0 if ok else 1)"; do
  ((SECONDS > deadline)) && { fail "the router never had every worker in rotation"; "$BIN/hypic-client" info --router "$ROUTER"; dump_logs; exit 1; }
  sleep 1
done
timing "kube play to every health check passing and the workers in rotation" "$(since "$t_play") s"
pass "every health check passes ($(containers health | wc -w) containers$( ((OPENAI)) && echo ", and the HTTP front's /health")), the router has $n_scatter scatter workers and the combine worker in rotation"

# ---------------------------------------------------------------- 6. requests
generate() {  # label -> the report's JSON in $WORK/<label>.json
  local t
  t=$(now)
  if "$BIN/hypic-client" generate --router "$ROUTER" --segment-file README.md --segment-file deploy/README.md \
      --segment-file tests/fixtures/README.md --query "Which services does the cluster run?" --max-tokens 8 \
      --ignore-eos --json --timeout-seconds 120 > "$WORK/$1.json" 2> "$WORK/$1.err"; then
    timing "request $1 (3 documents, 8 tokens), client wall time" "$(since "$t") s"
    return 0
  fi
  cat "$WORK/$1.err" >&2
  return 1
}
report_check() {  # label expectation(cold|warm)
  python3 - "$WORK/$1.json" "$2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
rep, want = r["report"], sys.argv[2]
segs = rep["segments"]
src = [s["source"] for s in segs]
problems = []
if len(segs) != 3: problems.append(f"{len(segs)} segments")
if rep["completion_tokens"] != 8: problems.append(f"{rep['completion_tokens']} tokens")
if want == "cold" and not all(s == "SEGMENT_SOURCE_SCATTER" for s in src): problems.append(f"sources {src}")
if want == "cold" and not all(s["built_by"] for s in segs): problems.append("a segment without built_by")
if want == "warm" and not all(s["cache_hit"] and s["reused"] for s in segs): problems.append(f"not all hits: {src}")
if not rep["cache_available"]: problems.append("cache unavailable")
t = rep["ttft"]
print(f"TTFT {t['total_ms']:.1f} ms = router {t['router_ms']:.1f} + lookup {t['lookup_ms']:.1f} + scatter "
      f"{t['scatter_ms']:.1f} + transfer {t['transfer_ms']:.1f} + splice {t['splice_ms']:.1f} + first decode "
      f"{t['first_decode_ms']:.1f}; tokens {rep['prompt_tokens']} prompt, {rep['completion_tokens']} generated; "
      f"segments {[(s['num_tokens'], s['source'].replace('SEGMENT_SOURCE_', '').lower(), s['built_by']) for s in segs]}")
if problems:
    print("problems: " + "; ".join(problems))
    sys.exit(1)
EOF
}
if generate cold; then
  if out="$(report_check cold cold)"; then pass "cold request through the router: $out"; else fail "cold request: $out"; fi
else
  fail "cold request failed"
fi
# The entries are put in the cache asynchronously: wait until the replica holds all three.
for _ in $(seq 1 50); do
  n="$(podman exec hypic-segment-cache-0.hypic-segment-cache-segment-cache /usr/local/bin/hypic-client cache-stats \
        --cache 127.0.0.1:50051 2>/dev/null | python3 -c "import json,sys;print(json.load(sys.stdin).get('entries',0))" || echo 0)"
  ((n >= 3)) && break
  sleep 0.2
done
if generate warm; then
  if out="$(report_check warm warm)"; then pass "warm request (every segment a cache hit): $out"; else fail "warm request: $out"; fi
else
  fail "warm request failed"
fi

if ((OPENAI)); then
  t=$(now)
  body='{"messages": [{"role": "user", "content": "Name the services of a hypic cluster."}], "documents": ["The router plans.\n\n", "The scatter workers prefill.\n\n"], "max_tokens": 8, "ignore_eos": true, "stream": true}'
  if curl -sSN --max-time 120 -H 'Content-Type: application/json' -d "$body" \
      "http://127.0.0.1:$OPORT/v1/chat/completions" > "$WORK/chat.sse" 2> "$WORK/chat.err"; then
    timing "streamed chat completion through the HTTP front (curl)" "$(since "$t") s"
    events="$(grep -c '^data: {' "$WORK/chat.sse" || true)"
    if grep -q '^data: \[DONE\]' "$WORK/chat.sse" && ((events >= 3)) && ! grep -q '"error"' "$WORK/chat.sse"; then
      pass "streamed chat completion through the HTTP front: $events chunks then [DONE]"
    else
      fail "streamed chat completion: $(head -c 600 "$WORK/chat.sse")"
    fi
  else
    fail "curl to the HTTP front failed: $(cat "$WORK/chat.err")"
  fi
fi

# ---------------------------------------------------------------- 7. metrics
metric_sum() {  # file name: the sum of the samples of metric `name` (any labels)
  awk -v n="$2" '$1 == n || index($1, n "{") == 1 { s += $NF } END { printf "%.0f", s }' "$1"
}
if ((METRICS)); then
  ok=1
  details=""
  for pod in $(python3 -c "import json;print(' '.join(json.load(open('$STATE'))['pods']))"); do
    mport="$(port_of "$pod" metrics)"
    f="$WORK/metrics.${pod%%.*}"
    if ! curl -sSf --max-time 10 "http://127.0.0.1:$mport/metrics" > "$f" 2> "$WORK/curl.err"; then
      fail "metrics of $pod: $(cat "$WORK/curl.err")"; ok=0; continue
    fi
  done
  check_metric() {  # file metric minimum
    local v
    v="$(metric_sum "$WORK/metrics.$1" "$2")"
    details+=" $2{pod=$1}=$v"
    if ((v < $3)); then fail "metric $2 of $1 is $v, expected >= $3"; ok=0; fi
  }
  check_metric hypic-router "hypic:prompt_tokens_total" 1
  check_metric hypic-router "hypic:generation_tokens_total" 16
  check_metric hypic-router "hypic:segment_cache_queries_total" 6
  check_metric hypic-router "hypic:segment_cache_hits_total" 3
  check_metric hypic-router "hypic:time_to_first_token_seconds_count" 2
  check_metric hypic-router "hypic:inter_token_latency_seconds_count" 1
  # LPT spreads the three cold documents over both workers: each one built at least one.
  check_metric hypic-scatter-worker-0 "hypic:segments_built_total" 1
  check_metric hypic-scatter-worker-1 "hypic:segments_built_total" 1
  check_metric hypic-scatter-worker-0 "hypic:entry_bytes_sent_total" 1
  check_metric hypic-segment-cache-0 "hypic:cache_stored_total" 3
  check_metric hypic-segment-cache-0 "hypic:cache_hits_total" 3
  check_metric hypic-combine-worker-0 "hypic:entry_bytes_received_total" 1
  ((OPENAI)) && [[ -s "$WORK/metrics.hypic-openai" ]] && details+=" (HTTP front: $(grep -c '^hypic' "$WORK/metrics.hypic-openai") samples)"
  ((ok)) && pass "metrics scraped from every pod, counters moved:$details"
  # Every series the Grafana dashboard queries exists in what the pods export.
  if missing="$(python3 - deploy/grafana/hypic.json "$WORK"/metrics.* <<'EOF'
import json, re, sys
dash = json.load(open(sys.argv[1]))
used = {m for p in dash["panels"] for t in p.get("targets", []) for m in re.findall(r"hypic:[a-z_]+", t["expr"])}
used |= {m for v in dash["templating"]["list"] for m in re.findall(r"hypic:[a-z_]+", json.dumps(v.get("query", "")))}
have = set()
for f in sys.argv[2:]:
    for line in open(f):
        if line.startswith("hypic:"):
            have.add(re.split(r"[{ ]", line, maxsplit=1)[0])
missing = sorted(used - have)
print(" ".join(missing) if missing else f"all {len(used)} series")
sys.exit(1 if missing else 0)
EOF
)"; then
    pass "the Grafana dashboard's queries name series the pods export ($missing)"
  else
    fail "the Grafana dashboard queries series no pod exports: $missing"
  fi
else
  echo "deploy_test: metrics not available (the images' binaries have no --metrics-listen): not checked"
fi

# ---------------------------------------------------------------- summary
for k in "${TIMING_ORDER[@]}"; do printf 'deploy_test: time  %-70s %s\n' "$k" "${TIMING[$k]}"; done
if ((KEEP)); then
  echo "deploy_test: router at $ROUTER$( ((OPENAI)) && echo ", HTTP front at http://127.0.0.1:$OPORT")"
fi
exit 0  # finish (the EXIT trap) tears down and prints the count
