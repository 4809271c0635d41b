#!/usr/bin/env bash
# Issue 28: reduce-overhead at the quick size with the early static cache (HF marks its
# tensors static only when initialised outside the compiled forward), children run directly
# so their output streams to $OUT even if the step is cut (PYTHONPATH=/tmp/tf:/tmp/site: 4.57.3).
cd "$(dirname "$0")/../benches" || exit 2
: "${OUT:?set OUT to the folder the outputs go to (scripts/gpu-run.sh does)}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
ro() {  # NAME KIND EXTRA...  (reduce-overhead, quick size, the early static cache)
    local name=$1 kind=$2; shift 2
    IMP_MEM_CACHE_DIR=/tmp/cR timeout ${RO_SECS:-250} python3 bench_torch_hf.py --child $kind --compile reduce-overhead \
        --batch 8 --prompt 256 --new 16 --reps 2 --kv-cache early "$@" > $OUT/$name.txt 2>&1
    echo "== $name rc=$?"; grep -v '^RESULT' $OUT/$name.txt | tail -5 | cut -c1-400
    grep '^RESULT' $OUT/$name.txt | cut -c1-200
}
ro rod default
ro roi imp --mode scope
