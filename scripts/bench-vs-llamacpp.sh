#!/usr/bin/env bash
# Side-by-side CPU benchmark: spinfer vs llama.cpp's llama-bench on the same GGUF.
#
# Usage:
#   scripts/bench-vs-llamacpp.sh [options] [MODEL] [LLAMA_BENCH]
#
#   MODEL        GGUF file (default: models/SmolLM2-135M-Instruct.Q4_1.gguf;
#                e.g. models/gemma-3-270m-Q4_K_M.gguf)
#   LLAMA_BENCH  llama-bench binary (default: ${LLAMA_BENCH:-/opt/llamacpp/build/bin/llama-bench})
#
# Options:
#   --llama-only      skip building/running spinfer (llama.cpp column only)
#   --reps N          repetitions per thread count (default 5)
#   --threads "1 2"   thread counts to test (default "1 2")
#   --raw FILE        also write every per-rep measurement to FILE (JSON lines)
#   --no-membw        skip the memory-bandwidth probe
#   --sparsity FILE   run spinfer with this sparsity sidecar (spinfer bench --sparsity FILE)
#   --head-index FILE run spinfer with the sparse output head of this index
#                     (spinfer calibrate-head); --head-probes N its probes
#   --depth D         start every test from a cache already holding D tokens
#                     (spinfer bench --depth D, llama-bench -d D): a long
#                     conversation's later turns
#   --spinfer BIN     use this spinfer binary and skip the cargo build (e.g. one
#                     built from a clean checkout while target/ is in use)
#   -h, --help        this help
#
# For each thread count and each rep, spinfer and llama-bench are run
# INTERLEAVED (order alternates per rep) so slow drifts in machine load hit both
# equally. Reported numbers are medians over reps; ratio = spinfer / llama.cpp
# (> 1 means spinfer is faster).
#
# Contracts:
#   target/release/spinfer bench --model M --threads T --json
#       prints ONE JSON object with keys pp128, pp512, tg128 (tokens/s) and
#       peak_rss_bytes.
#   llama-bench -m M -t T -p 128,512 -n 128 -r 1 -o json
#       prints a JSON array of records with n_prompt, n_gen, avg_ts.
#
# The "implied decode bandwidth" is tg128 tok/s x bytes of weights read per
# decoded token: spinfer's own count (`bytes_per_token` in its JSON: every
# matmul's weights, the output head included, one embedding row) when it
# reports one, else the model FILE SIZE (which also counts a separate input
# embedding table, metadata and tokenizer). KV-cache traffic is ignored. It is
# printed next to scripts/membw.c's measured streaming-read bandwidth.
#
# Peak RSS: spinfer's own report (peak_rss_bytes); llama-bench's is measured
# with /usr/bin/time -f %M when that exists (its whole process, all tests).
# Works for any GGUF both engines load (SmolLM2, Gemma 3, ...): pass the model
# path; nothing in here is specific to one architecture.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMA_ONLY=0
REPS=5
THREADS="1 2"
RAW_OUT=""
DO_MEMBW=1
SPARSITY=""
HEAD_INDEX=""
HEAD_PROBES=""
SPINFER_BIN="${SPINFER:-}"
DEPTH=0
POS=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --llama-only) LLAMA_ONLY=1; shift ;;
    --reps) REPS="${2:?--reps needs a value}"; shift 2 ;;
    --reps=*) REPS="${1#*=}"; shift ;;
    --threads) THREADS="${2:?--threads needs a value}"; shift 2 ;;
    --threads=*) THREADS="${1#*=}"; shift ;;
    --raw) RAW_OUT="${2:?--raw needs a file}"; shift 2 ;;
    --raw=*) RAW_OUT="${1#*=}"; shift ;;
    --no-membw) DO_MEMBW=0; shift ;;
    --sparsity) SPARSITY="${2:?--sparsity needs a file}"; shift 2 ;;
    --sparsity=*) SPARSITY="${1#*=}"; shift ;;
    --head-index) HEAD_INDEX="${2:?--head-index needs a file}"; shift 2 ;;
    --head-probes) HEAD_PROBES="${2:?--head-probes needs a value}"; shift 2 ;;
    --depth) DEPTH="${2:?--depth needs a value}"; shift 2 ;;
    --depth=*) DEPTH="${1#*=}"; shift ;;
    --spinfer) SPINFER_BIN="${2:?--spinfer needs a binary}"; shift 2 ;;
    --spinfer=*) SPINFER_BIN="${1#*=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; POS+=("$@"); break ;;
    -*) echo "error: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) POS+=("$1"); shift ;;
  esac
done
[[ ${#POS[@]} -le 2 ]] || { echo "error: too many arguments" >&2; usage >&2; exit 2; }
[[ "$REPS" =~ ^[1-9][0-9]*$ ]] || { echo "error: --reps must be a positive integer" >&2; exit 2; }
THREADS="${THREADS//,/ }"

# Resolve user-supplied paths relative to the caller's cwd, defaults relative to the repo.
abspath() { if [[ "$1" = /* ]]; then printf '%s\n' "$1"; else printf '%s/%s\n' "$PWD" "$1"; fi; }
if [[ ${#POS[@]} -ge 1 ]]; then MODEL="$(abspath "${POS[0]}")"; else MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"; fi
if [[ ${#POS[@]} -ge 2 ]]; then LB="${POS[1]}"; else LB="${LLAMA_BENCH:-/opt/llamacpp/build/bin/llama-bench}"; fi
if [[ "$LB" == */* ]]; then LB="$(abspath "$LB")"; else LB="$(command -v "$LB" || true)"; fi

[[ -f "$MODEL" ]] || { echo "error: model not found: $MODEL" >&2; exit 1; }
SPINFER_EXTRA=()
[[ "$DEPTH" =~ ^[0-9]+$ ]] || { echo "error: --depth needs a whole number, got '$DEPTH'" >&2; exit 2; }
if [[ -n "$SPARSITY" ]]; then
  SPARSITY="$(abspath "$SPARSITY")"
  [[ -f "$SPARSITY" ]] || { echo "error: sparsity sidecar not found: $SPARSITY" >&2; exit 1; }
  SPINFER_EXTRA=(--sparsity "$SPARSITY")
fi
if [[ -n "$HEAD_INDEX" ]]; then
  HEAD_INDEX="$(abspath "$HEAD_INDEX")"
  [[ -f "$HEAD_INDEX" ]] || { echo "error: head index not found: $HEAD_INDEX" >&2; exit 1; }
  SPINFER_EXTRA+=(--head-index "$HEAD_INDEX")
  [[ -n "$HEAD_PROBES" ]] && SPINFER_EXTRA+=(--head-probes "$HEAD_PROBES")
fi
[[ -n "$LB" && -x "$LB" ]] || { echo "error: llama-bench not found/executable: ${POS[1]:-${LLAMA_BENCH:-/opt/llamacpp/build/bin/llama-bench}}" >&2; exit 1; }
command -v python3 >/dev/null || { echo "error: python3 is required" >&2; exit 1; }
if [[ -n "$SPINFER_BIN" ]]; then
  SPINFER_BIN="$(abspath "$SPINFER_BIN")"
  [[ -x "$SPINFER_BIN" ]] || { echo "error: spinfer binary not found/executable: $SPINFER_BIN" >&2; exit 1; }
fi
TIMEV=()
[[ -x /usr/bin/time ]] && TIMEV=(/usr/bin/time -f "maxrss_kib=%M")

cd "$ROOT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/bench-vs-llamacpp.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
RAW="$WORK/raw.jsonl"
: > "$RAW"

SPINFER="${SPINFER_BIN:-$ROOT/target/release/spinfer}"
if [[ $LLAMA_ONLY -eq 0 && -z "$SPINFER_BIN" ]]; then
  echo ">> cargo build --release -p spinfer-cli" >&2
  cargo build --release -p spinfer-cli >&2
  [[ -x "$SPINFER" ]] || { echo "error: $SPINFER was not built" >&2; exit 1; }
fi

# --- one measurement each; both append a normalised JSON line to $RAW ---------
run_spinfer() { # threads rep
  local t=$1 r=$2 out="$WORK/spinfer.t$1.r$2.out" err="$WORK/spinfer.t$1.r$2.err"
  if ! "$SPINFER" bench --model "$MODEL" --threads "$t" --depth "$DEPTH" --json "${SPINFER_EXTRA[@]}" >"$out" 2>"$err"; then
    echo "error: spinfer bench failed (threads=$t rep=$r):" >&2; tail -n 20 "$err" >&2; exit 1
  fi
  python3 - "$out" "$t" "$r" >>"$RAW" <<'PY'
import json, sys
path, t, r = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
text = open(path).read()
try:
    obj = json.loads(text)
except json.JSONDecodeError:  # tolerate log lines around the object: take the last JSON line
    obj = None
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line); break
            except json.JSONDecodeError:
                pass
    if obj is None:
        sys.exit(f"spinfer bench output has no JSON object: {path}")
missing = [k for k in ("pp128", "pp512", "tg128") if k not in obj]
if missing:
    sys.exit(f"spinfer bench JSON lacks {missing}: {obj}")
rec = {"tool": "spinfer", "threads": t, "rep": r,
       "pp128": float(obj["pp128"]), "pp512": float(obj["pp512"]), "tg128": float(obj["tg128"]),
       "peak_rss_bytes": obj.get("peak_rss_bytes"), "bytes_per_token": obj.get("bytes_per_token")}
print(json.dumps(rec))
PY
}

run_llama() { # threads rep
  local t=$1 r=$2 out="$WORK/llama.t$1.r$2.json" err="$WORK/llama.t$1.r$2.err"
  if ! "${TIMEV[@]}" "$LB" -m "$MODEL" -t "$t" -p 128,512 -n 128 -d "$DEPTH" -r 1 -o json >"$out" 2>"$err"; then
    echo "error: llama-bench failed (threads=$t rep=$r):" >&2; tail -n 20 "$err" >&2; exit 1
  fi
  python3 - "$out" "$t" "$r" "$err" >>"$RAW" <<'PY'
import json, re, sys
path, t, r, errpath = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
recs = json.load(open(path))
rec = {"tool": "llama.cpp", "threads": t, "rep": r}
m = re.findall(r"maxrss_kib=(\d+)", open(errpath, errors="replace").read())
if m:
    rec["peak_rss_bytes"] = int(m[-1]) * 1024
for x in recs:
    key = None
    if x["n_gen"] == 0 and x["n_prompt"] in (128, 512):
        key = f"pp{x['n_prompt']}"
    elif x["n_prompt"] == 0 and x["n_gen"] == 128:
        key = "tg128"
    if key:
        rec[key] = float(x["avg_ts"])
        rec["build_commit"] = x.get("build_commit")
missing = [k for k in ("pp128", "pp512", "tg128") if k not in rec]
if missing:
    sys.exit(f"llama-bench JSON lacks {missing}: {path}")
print(json.dumps(rec))
PY
}

for t in $THREADS; do
  for ((r = 1; r <= REPS; r++)); do
    echo ">> threads=$t rep=$r/$REPS" >&2
    if [[ $LLAMA_ONLY -eq 1 ]]; then
      run_llama "$t" "$r"
    elif (( r % 2 )); then
      run_spinfer "$t" "$r"; run_llama "$t" "$r"
    else
      run_llama "$t" "$r"; run_spinfer "$t" "$r"
    fi
  done
done

# --- memory bandwidth probe ---------------------------------------------------
MEMBW_OUT="$WORK/membw.txt"
: > "$MEMBW_OUT"
if [[ $DO_MEMBW -eq 1 && -f "$ROOT/scripts/membw.c" ]]; then
  CC="${CC:-cc}"
  if "$CC" -O3 -march=native -fopenmp "$ROOT/scripts/membw.c" -o "$WORK/membw" 2>"$WORK/membw.cc.err" \
     || "$CC" -O3 -march=native -Wno-unknown-pragmas "$ROOT/scripts/membw.c" -o "$WORK/membw" 2>>"$WORK/membw.cc.err"; then
    echo ">> membw probe (1 GiB, threads: $THREADS)" >&2
    # shellcheck disable=SC2086
    "$WORK/membw" 1024 8 $THREADS >"$MEMBW_OUT" || echo "warning: membw probe failed" >&2
  else
    echo "warning: could not compile scripts/membw.c:" >&2; cat "$WORK/membw.cc.err" >&2
  fi
fi

[[ -n "$RAW_OUT" ]] && cp "$RAW" "$RAW_OUT"

# --- summary ------------------------------------------------------------------
python3 - "$RAW" "$MEMBW_OUT" "$MODEL" "$LB" "$REPS" "$LLAMA_ONLY" "$DEPTH" <<'PY'
import json, os, re, statistics, sys
raw, membw_path, model, lb, reps, llama_only, depth = sys.argv[1:8]
recs = [json.loads(l) for l in open(raw) if l.strip()]
threads = sorted({r["threads"] for r in recs})
metrics = ["pp128", "pp512", "tg128"]
model_bytes = os.path.getsize(model)

def med(tool, t, m):
    v = [r[m] for r in recs if r["tool"] == tool and r["threads"] == t and r.get(m) is not None]
    return statistics.median(v) if v else None

def fmt(x, nd=1):
    return "—" if x is None else f"{x:.{nd}f}"

commit = next((r.get("build_commit") for r in recs if r.get("build_commit")), "?")
print(f"\nModel: {os.path.relpath(model)} ({model_bytes / 2**20:.1f} MiB)")
print(f"llama-bench: {lb} (build {commit}); {reps} interleaved reps per thread count; medians in tokens/s")
if depth != "0":
    print(f"every test starts from a cache holding {depth} tokens (spinfer bench --depth, llama-bench -d)")
print()
print("| threads | metric | spinfer median | llama.cpp median | ratio |")
print("|---:|---|---:|---:|---:|")
for t in threads:
    for m in metrics:
        s, l = med("spinfer", t, m), med("llama.cpp", t, m)
        ratio = f"{s / l:.2f}x" if s and l else "—"
        print(f"| {t} | {m} | {fmt(s)} | {fmt(l)} | {ratio} |")
print()
print("ratio = spinfer / llama.cpp (> 1: spinfer faster)")

print()
for tool in (["llama.cpp"] if llama_only == "1" else ["spinfer", "llama.cpp"]):
    for t in threads:
        v = [r["peak_rss_bytes"] for r in recs
             if r["tool"] == tool and r["threads"] == t and r.get("peak_rss_bytes") is not None]
        if v:
            print(f"{tool} peak RSS (threads={t}): {max(v) / 2**20:.1f} MiB (max over reps)")
        else:
            print(f"{tool} peak RSS (threads={t}): not reported")

membw = {}
if os.path.exists(membw_path):
    for line in open(membw_path):
        m = re.search(r"threads=(\d+).*best_gbps=([\d.]+).*median_gbps=([\d.]+)", line)
        if m:
            membw[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))

bpt = next((r["bytes_per_token"] for r in recs if r.get("bytes_per_token")), None)
print()
if bpt:
    print("Decode memory bandwidth, ESTIMATE: bytes/token = weights read per decoded token as spinfer "
          f"reports it ({bpt / 1e6:.1f} MB; file {model_bytes / 1e6:.1f} MB; KV cache ignored)")
else:
    bpt = model_bytes
    print("Decode memory bandwidth, ESTIMATE: bytes/token = model file size "
          f"({model_bytes / 1e6:.1f} MB), i.e. whole weight file streamed once per token (KV cache ignored)")
print()
print("| threads | spinfer tg128 implied GB/s | llama.cpp tg128 implied GB/s | membw probe best GB/s (median) |")
print("|---:|---:|---:|---:|")
for t in threads:
    s, l = med("spinfer", t, "tg128"), med("llama.cpp", t, "tg128")
    sbw = s * bpt / 1e9 if s else None
    lbw = l * bpt / 1e9 if l else None
    mb = membw.get(t)
    mbs = f"{mb[0]:.2f} ({mb[1]:.2f})" if mb else "—"
    print(f"| {t} | {fmt(sbw, 2)} | {fmt(lbw, 2)} | {mbs} |")
if not membw:
    print("\n(membw probe not run)")
PY
