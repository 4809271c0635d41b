#!/usr/bin/env bash
# Device-side runner for the H200 (the device tool's `run`): installs the
# wheel from ./wheelhouse (and the extra wheels in ./.whl, FlashInfer's and
# torch_memory_saver's, where present; GPU_RUN_EXTRAS names another folder)
# into /tmp/site, then runs each step
# given as an argument, each under its own timeout, its output kept in
# $OUT/NAME.txt so that one slow or failing step leaves the others' details:
#
#   scripts/gpu-run.sh \
#     'pt fam 150 gpu/test_engine_families_gpu.py -k plan' \
#     'bx persist 200 bench_kv_persist.py --json $OUT/persist.json'
#
#   pt NAME SECONDS PYTEST-ARGS...   pytest -m gpu from tests/
#   bx NAME SECONDS SCRIPT ARGS...   a benchmark from benches/
#   tl NAME SECONDS SCRIPT ARGS...   a probe or sweep from tools/
#
# Carry ["wheelhouse", ".whl"]; build the wheel here first (maturin build
# --release -o wheelhouse). scripts/gpu-check.sh is the whole check; this is
# for the parts a 10-minute call can hold.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/imp-mem-gpu-run}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s)
shopt -s nullglob
extras=("${GPU_RUN_EXTRAS:-.whl}"/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site wheelhouse/*.whl "${extras[@]}" || exit 2
# The working tree's Python over the wheel's (its compiled core kept), so a
# Python-only change runs without a rebuild.
cp -r python/imp_mem/. /tmp/site/imp_mem/ || exit 2
export PYTHONPATH=/tmp/site IMP_MEM_HYPOTHESIS=dev IMP_MEM_CACHE_DIR=/tmp/impcache \
    IMP_MEM_GPU_OUT=$OUT
el() { echo $(($(date +%s) - T0)); }
pt() {
    local name=$1 secs=$2
    shift 2
    (cd tests && timeout -k 5 "$secs" python3 -m pytest -p no:cacheprovider -m gpu -q -rs \
        --durations=8 "$@") >"$OUT/$name.txt" 2>&1
    echo "== $name rc=$? ($(el) s)"
    tail -4 "$OUT/$name.txt"
}
bx() {
    local name=$1 secs=$2
    shift 2
    (cd benches && timeout -k 5 "$secs" python3 "$@") >"$OUT/$name.txt" 2>&1
    echo "== $name rc=$? ($(el) s)"
    tail -"${TAILN:-30}" "$OUT/$name.txt"
}
tl() {
    local name=$1 secs=$2
    shift 2
    (cd tools && timeout -k 5 "$secs" python3 "$@") >"$OUT/$name.txt" 2>&1
    echo "== $name rc=$? ($(el) s)"
    tail -"${TAILN:-30}" "$OUT/$name.txt"
}
for step in "$@"; do
    eval "$step"
done
echo "total $(el) s"
