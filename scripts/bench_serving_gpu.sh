#!/usr/bin/env bash
# Serving benchmark on one GPU (issue 25): hypic-bench-cluster's `serving` rows (hypic cold; warm from the combine
# worker's device tier, from its host tier, from the segment cache alone, with the fetch bandwidth; prefix cold / same
# order / reordered; full) and its `load` scenario on one arrival trace for the modes hypic, prefix and full (the
# highest rate whose p90 TTFT meets the SLO, TTFT p90 and ITL p99 there), at Qwen3.5-35B-A3B dimensions
# (bench/gpu/qwen3_5_35b_a3b.json) with benchmark-only random weights, every worker on cuda:0, no scatter workers by
# default (the combine worker prefills cold segments itself) and the services' own memory budgets (no memory flags).
#
#   scripts/bench_serving_gpu.sh --bin DIR --out OUT     run the prebuilt binaries in DIR (hypic-bench-cluster and the
#                                                         hypic-* services); shared libraries from DIR/../lib when it
#                                                         exists (added to LD_LIBRARY_PATH)
#   ... --scenarios LIST                                 hypic-bench-cluster scenarios (default serving,load)
#   ... --load-modes LIST                                load scenario modes (default hypic,prefix,full)
#   ... --layers N                                       cut the model to its first N layers (num_hidden_layers and
#                                                         the layer_types pattern's first N entries; default: all 40)
#   ... --scatter-workers N                              scatter workers (default 0), on cuda:0 too
#   ... --extra "ARGS"                                   more hypic-bench-cluster arguments (split on white space); a
#                                                         flag given here replaces this script's value for it (e.g.
#                                                         --extra "--rates 1,2 --max-tokens 64")
#   ... --tokenizer FILE                                 tokenizer.json for the services (default
#                                                         models/trained/qwen35-dense/tokenizer.json, see below)
#   ... --commit SHA                                     commit recorded (default: $HYPIC_GIT_COMMIT, else git, else
#                                                         DIR/COMMIT)
#   ... --cpu-smoke                                      the script end to end on the CPU: the trained dense model
#                                                         (models/trained/qwen35-dense), --device cpu, no random
#                                                         weights, tiny sizes (--layers is ignored)
#   ... -h | --help                                      this text
# Writes OUT/serving_h200.json (command, date_utc, git_commit, gpu, then hypic-bench-cluster's output: host, model,
# workload, scenarios.serving, scenarios.load, notes, expectation_mismatches), OUT/serving_h200.md, and OUT/bench.log
# (the benchmark's stderr). Exit status: hypic-bench-cluster's (0 ok, 1 a cluster or request failure, 2 bad usage, 3 a
# row's reuse expectation did not hold; the outputs are written whenever it produced its JSON).
#
# Tokenizer: the benchmark sends token ids (segments and queries as hypic.v1.TokenIds), drawn uniformly over the
# tokenizer's ordinary ids (bench/cluster/workload.h SegmentSource::random_ids); the router still loads --tokenizer
# (and refuses one with more ids than the model's vocabulary), the combine worker detokenizes what it decodes (ids
# past the tokenizer's vocabulary have no text, which is fine here). The trained checkpoints' byte-level BPE of 2048
# ids is in the repository (no network needed on the GPU host) and fits the 248320-id vocabulary; a segment's cost
# is its token count, so drawing ids from 2048 of them measures the same prefill work as any other ids.
set -euo pipefail
SCENARIOS="serving,load"
LOAD_MODES="hypic,prefix,full"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "bench_serving_gpu.sh: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see --help)"; }

BIN="" OUT="" LAYERS="" SCATTER=0 EXTRA="" TOKENIZER="models/trained/qwen35-dense/tokenizer.json" COMMIT="" SMOKE=0
COMMAND="scripts/bench_serving_gpu.sh$(printf ' %q' "$@")"
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --bin) need_value "$@"; BIN="$2"; shift 2 ;;
    --out) need_value "$@"; OUT="$2"; shift 2 ;;
    --layers) need_value "$@"; LAYERS="$2"; shift 2 ;;
    --scatter-workers) need_value "$@"; SCATTER="$2"; shift 2 ;;
    --scenarios) [[ $# -ge 2 ]] || die "--scenarios needs a value"; SCENARIOS="$2"; shift 2 ;;
    --load-modes) need_value "$@"; LOAD_MODES="$2"; shift 2 ;;
    --extra) [[ $# -ge 2 ]] || die "--extra needs a value (see --help)"; EXTRA="$2"; shift 2 ;;
    --tokenizer) need_value "$@"; TOKENIZER="$2"; shift 2 ;;
    --commit) need_value "$@"; COMMIT="$2"; shift 2 ;;
    --cpu-smoke) SMOKE=1; shift ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -n "$BIN" ]] || die "--bin DIR is required (see --help)"
[[ -n "$OUT" ]] || die "--out OUT is required (see --help)"
[[ -d "$BIN" ]] || die "--bin $BIN: no such directory"
BIN="$(cd "$BIN" && pwd)"
for t in hypic-bench-cluster hypic-router hypic-scatter-worker hypic-combine-worker hypic-segment-cache hypic-client; do
  [[ -x "$BIN/$t" ]] || die "$BIN/$t not found (build it first)"
done
[[ "$SCATTER" =~ ^[0-9]+$ ]] || die "--scatter-workers: '$SCATTER' is not a count"
if [[ -n "$LAYERS" ]]; then
  if ! [[ "$LAYERS" =~ ^[0-9]+$ ]] || ((LAYERS < 1)); then die "--layers: '$LAYERS' is not a positive count"; fi
fi
[[ -f "$TOKENIZER" ]] || die "--tokenizer $TOKENIZER: no such file"
if [[ -d "$BIN/../lib" ]]; then
  LIB="$(cd "$BIN/../lib" && pwd)"
  export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [[ -z "$COMMIT" ]]; then COMMIT="${HYPIC_GIT_COMMIT:-}"; fi
if [[ -z "$COMMIT" ]]; then COMMIT="$(git rev-parse HEAD 2>/dev/null || true)"; fi
if [[ -z "$COMMIT" && -f "$BIN/COMMIT" ]]; then COMMIT="$(head -n1 "$BIN/COMMIT")"; fi
COMMIT="${COMMIT:-unknown}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d /tmp/hypic-bench-serving.XXXXXX)"
keep_logs() {  # the combine worker's and router's logs of each cluster the benchmark started (the last 4 MB of each)
  [[ -n "${OUT:-}" && -d "${OUT:-}" ]] || return 0
  # hypic-bench-cluster's work dir: <tag>/cluster/logs/<service>.log (the launcher's work dir under each cluster's).
  for f in "$WORK"/bench/*/cluster/logs/combine*.log "$WORK"/bench/*/cluster/logs/router*.log; do
    [[ -f "$f" ]] && tail -c 4000000 "$f" > "$OUT/$(basename "$(dirname "$(dirname "$(dirname "$f")")")")-$(basename "$f")"
  done
  return 0
}
trap 'keep_logs; rm -rf "$WORK"' EXIT
export NCCL_NVLS_ENABLE=0  # NVLink multicast off (used only with scatter workers on other GPUs)

# The model directory: config.json alone (the workers make random weights from it on the device).
MODEL="$WORK/model"
mkdir -p "$MODEL"
if ((SMOKE)); then
  MODEL="models/trained/qwen35-dense"
  DEVICE="cpu"
  WORKER_ARGS=()
  WEIGHTS="the checkpoint's (CPU smoke run)"
else
  python3 - "$MODEL/config.json" "${LAYERS:-0}" <<'EOF'
import json, sys
out, layers = sys.argv[1], int(sys.argv[2])
cfg = json.load(open("bench/gpu/qwen3_5_35b_a3b.json"))
n = cfg["num_hidden_layers"]
if len(cfg["layer_types"]) != n:
    sys.exit(f"bench/gpu/qwen3_5_35b_a3b.json: {len(cfg['layer_types'])} layer_types for {n} layers")
if layers:
    if layers > n:
        sys.exit(f"--layers {layers}: the model has {n} layers")
    cfg["num_hidden_layers"] = layers
    cfg["layer_types"] = cfg["layer_types"][:layers]
json.dump(cfg, open(out, "w"), indent=2)
EOF
  DEVICE="cuda:0"
  WORKER_ARGS=(--random-weights-seed=1)
  WEIGHTS="random (--random-weights-seed 1)"
fi
LAYERS_USED="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["num_hidden_layers"])' "$MODEL/config.json")"

# Launcher flags: every worker on $DEVICE (the launcher's --device covers scatter and combine workers), random weights;
# the services log at info (one line per request and per segment-cache fetch: the logs OUT keeps, see keep_logs).
LA=(--launcher-arg=--device="$DEVICE" --launcher-arg=--log-level=info)
for a in ${WORKER_ARGS[@]+"${WORKER_ARGS[@]}"}; do
  LA+=(--launcher-arg=--scatter-arg="$a" --launcher-arg=--combine-arg="$a")
done

# shellcheck disable=SC2054  # the commas are in values (--rates)
# Sizes (a flag that --extra names is left out here, so that --extra replaces it: the benchmark refuses a flag twice).
if ((SMOKE)); then
  SIZES=(--query-tokens 16 --max-tokens 8 --serving-prompts 1 --serving-segments 3 --serving-segment-tokens 64
         --rates 2,8 --load-requests 6 --load-segments 3 --load-segment-tokens 64 --load-pool 6 --slo-ms 1000
         --ready-timeout-s 120 --request-timeout-s 120)
else
  # Serving: 3 prompts of 8 x 2048 tokens (16k-token prompts); load: the same prompt shape, half the segments warm,
  # 16 Poisson arrivals per rate; 32 decoded tokens per request so that the inter-token latencies mean something.
  SIZES=(--query-tokens 64 --max-tokens 32 --serving-prompts 3 --serving-segments 8 --serving-segment-tokens 2048
         --rates 0.5,1,2,4,8 --load-requests 16 --load-segments 8 --load-segment-tokens 2048 --load-pool 32
         --load-hit-ratio 0.75 --slo-ms 1000 --ready-timeout-s 900 --request-timeout-s 600)
fi
read -r -a EXTRA_ARGS <<<"$EXTRA"
given() {  # given FLAG: --extra names FLAG (as "FLAG VALUE" or "FLAG=VALUE")
  local a
  for a in ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}; do [[ "$a" == "$1" || "$a" == "$1="* ]] && return 0; done
  return 1
}
KEEP=()
for ((i = 0; i < ${#SIZES[@]}; i += 2)); do
  given "${SIZES[i]}" || KEEP+=("${SIZES[i]}" "${SIZES[i + 1]}")
done
for f in --scenarios --scatter-workers --load-modes --model --tokenizer --bin-dir --out-json --out-md --work-dir; do
  if given "$f"; then die "--extra: $f is this script's own (use its option, or run hypic-bench-cluster directly)"; fi
done

GPU="cpu (smoke run)"
if ((SMOKE == 0)); then
  GPU="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n1 || true)"
  GPU="${GPU:-unknown (nvidia-smi failed)}"
fi
echo "bench_serving_gpu.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ), $LAYERS_USED layers, $SCATTER scatter worker(s), $DEVICE; GPU: $GPU" >&2
DATE_UTC="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
rc=0
"$BIN/hypic-bench-cluster" --model "$MODEL" --tokenizer "$TOKENIZER" --bin-dir "$BIN" \
  --launcher deploy/local_cluster.py "${LA[@]}" --scenarios "$SCENARIOS" --scatter-workers "$SCATTER" \
  --load-modes "$LOAD_MODES" ${KEEP[@]+"${KEEP[@]}"} ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} \
  --note "commit measured: $COMMIT; made by scripts/bench_serving_gpu.sh ($LAYERS_USED layers, weights: $WEIGHTS)" \
  --work-dir "$WORK/bench" --out-json "$WORK/bench.json" --out-md "$WORK/bench.md" \
  > "$WORK/stdout.md" 2> >(tee "$OUT/bench.log" >&2) || rc=$?
if [[ ! -s "$WORK/bench.json" ]]; then
  echo "bench_serving_gpu.sh: hypic-bench-cluster exited with status $rc and wrote no results; its log: $OUT/bench.log" >&2
  if [[ -d "$WORK/bench" ]]; then
    find "$WORK/bench" -name '*.log' -print0 | while IFS= read -r -d '' f; do
      echo "--- $f (last 30 lines)" >&2
      tail -n 30 "$f" >&2
    done
  fi
  exit $((rc == 0 ? 1 : rc))
fi

CONFIG_SOURCE="bench/gpu/qwen3_5_35b_a3b.json"
((SMOKE)) && CONFIG_SOURCE="$MODEL/config.json"
python3 - "$WORK/bench.json" "$WORK/bench.md" "$OUT" "$COMMAND" "$DATE_UTC" "$COMMIT" "$GPU" "$LAYERS_USED" \
  "$SCATTER" "$rc" "$CONFIG_SOURCE" "$WEIGHTS" <<'EOF'
import json, sys
src, md_src, out, command, date, commit, gpu, layers, scatter, rc, config_source, weights = sys.argv[1:]
bench = json.load(open(src))
doc = {"command": command, "date_utc": date, "git_commit": commit, "gpu": gpu,
       "model_config": {"source": config_source, "num_hidden_layers": int(layers), "weights": weights},
       "scatter_workers": int(scatter), "bench_exit_status": int(rc), "bench_command": bench.pop("command", "")}
doc.update(bench)
# The summary the issue's targets are read from: serving rows and, per mode, the load figures.
serving = bench.get("scenarios", {}).get("serving", {})
doc["rows"] = [{k: r.get(k) for k in ("row", "ttft_ms_p50", "ttft_ms_p90", "unexpected", "fetch_gbps_per_segment")}
               for r in serving.get("rows", [])]
load = bench.get("scenarios", {}).get("load", {})
doc["load"] = [{k: m.get(k) for k in ("mode", "qps_at_slo", "ttft_ms_p90", "itl_ms_p99")} for m in load.get("modes", [])]
doc["itl_ms_p99_unloaded"] = load.get("itl_ms_p99_unloaded")
json.dump(doc, open(f"{out}/serving_h200.json", "w"), indent=2)
with open(f"{out}/serving_h200.md", "w") as f:
    f.write(f"<!-- made by: {command} -->\n\n- command: `{command}`\n- date (UTC): {date}\n- commit: {commit}\n"
            f"- GPU: {gpu}\n- model: {config_source}, {layers} layers, weights: {weights}; {scatter} scatter "
            f"worker(s)\n- hypic-bench-cluster exit status: {rc}\n\n")
    f.write(open(md_src).read())
EOF
echo "bench_serving_gpu.sh: wrote $OUT/serving_h200.json and $OUT/serving_h200.md (benchmark exit status $rc)" >&2
exit "$rc"
