#!/usr/bin/env bash
# Issue 28: is a second (recalled) start slower than a first, on the GPU or the host? The HF
# bench's children run directly (full size, compiled default), each profiled (--profile), the
# GPU's clocks and the host's load after each. torch's child runs between the two recalled starts
# and a fresh measuring start comes last, so a slowness of the sequence's position (the host, the
# GPU warming) reads apart from one of the recalled tier.
# For the device tool: scripts/gpu-run.sh 'bash scripts/probe-second-start.sh'.
cd "$(dirname "$0")/../benches" || exit 2
: "${OUT:?set OUT to the folder the outputs go to (scripts/gpu-run.sh does)}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
one() {  # NAME CACHE KIND EXTRA...
    local name=$1 cache=$2 kind=$3; shift 3
    IMP_MEM_CACHE_DIR=$cache timeout 150 python3 bench_torch_hf.py --child $kind --compile default \
        --batch 32 --prompt 1024 --new 64 --reps 4 --profile "$@" > $OUT/$name.txt 2>&1
    echo "== $name rc=$?"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader
    echo "load $(cut -d' ' -f1-4 /proc/loadavg); CPU MHz $(awk '/MHz/ {s+=$4; n++} END {if (n) printf "%.0f", s/n}' /proc/cpuinfo)"
    ps -eo pcpu,etimes,comm --sort=-pcpu | sed -n 2,4p | tr '\n' ';'; echo
    python3 - $OUT/$name.txt <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("RESULT "):
        d = json.loads(line[7:])
        print({k: d.get(k) for k in ("seconds_runs", "recalled", "committed", "fallbacks", "fallbacks_warmup", "pass_hints")})
        print("profile", d.get("profile"))
        c = d.get("pool_counters") or {}
        print("pool", {k: c.get(k) for k in ("cross_stream_reuses", "reclaims", "allocs_total", "ooms")})
        print("hooks", d.get("hook_stats"))
PY
}
one a1 /tmp/cA imp --mode process
one a2 /tmp/cA imp --mode process
one d1 /tmp/cD default
one a3 /tmp/cA imp --mode process
one b1 /tmp/cB imp --mode process
