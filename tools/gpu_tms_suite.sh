#!/bin/bash
# torch_memory_saver's own test suite (test/test_examples.py and examples/)
# against torch_memory_saver 0.0.10 and against imp-mem's drop-in, only the
# import redirected (IMP_MEM_TORCH_MEMORY_SAVER=1 through the wheel's .pth),
# then benches/bench_tms_dropin.py; issue 51. One device call, about 6
# minutes on an H100. Prints `tms-suite: <implementation> <P> passed <F>
# failed <S> skipped` per implementation; logs under $OUT.
#
# Prepare, in an ignored folder D of the checkout the device call sends
# (e.g. .scratch/tms), then run `bash tools/gpu_tms_suite.sh D` there with D
# and the folder of the 0.0.10 wheel carried:
#   D/imp_mem-*.whl                the imp-mem wheel under test (maturin build --release)
#   D/torch_memory_saver-0.0.10-*.whl
#   D/suite/test/                  git -C <torch_memory_saver repo> archive 4a43c97 test | tar -x -C D/suite
#                                  (4a43c97: its Python sources are 0.0.10's, byte for byte)
#   D/wheels/pytest,pluggy,iniconfig wheels (where the device lacks pytest)
set -u
D=$(cd "$1" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/tms-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
inst() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$@"; }
inst /tmp/tms010 "$D"/torch_memory_saver-0.0.10-*.whl || exit 1
inst /tmp/ours "$D"/imp_mem-*.whl || exit 1
python3 -c 'import pytest' 2>/dev/null || inst /tmp/pyt "$D"/wheels/*.whl
# /tmp/ours processed as a site dir at start, so the wheel's .pth (the switch) runs.
mkdir -p /tmp/site-ours && echo "import site; site.addsitedir('/tmp/ours')" > /tmp/site-ours/sitecustomize.py
count() {
    python3 - "$1" <<'PY'
import re, sys
text = sys.stdin.read()
c = {k: 0 for k in ("passed", "failed", "skipped", "error", "deselected")}
for line in text.splitlines()[::-1]:
    if re.search(r"\d+ (passed|failed|skipped|error)", line):
        for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", line):
            c["error" if k.startswith("error") else k] += int(n)
        break
print(f"tms-suite: {sys.argv[1]} {c['passed']} passed {c['failed'] + c['error']} failed "
      f"{c['skipped']} skipped ({c['deselected']} deselected)")
PY
}
cd "$D/suite/test"
echo "=== suite: torch_memory_saver 0.0.10"
PYTHONPATH=/tmp/tms010:/tmp/pyt timeout 200 python3 -m pytest -p no:cacheprovider -q -rfEs \
    test_examples.py > "$OUT/suite-tms010.log" 2>&1
tail -15 "$OUT/suite-tms010.log"; count torch_memory_saver-0.0.10 < "$OUT/suite-tms010.log"
SELECT=()
if ! PYTHONPATH=/tmp/ours python3 -c 'import imp_mem._preload' 2>/dev/null; then
    echo "(imp_mem._preload absent from this wheel: the preload cases are deselected)"
    SELECT=(-k "not (preload or training_engine or nested_region or cuda_vmm_granularity)")
fi
echo "=== suite: imp-mem drop-in"
IMP_MEM_TORCH_MEMORY_SAVER=1 PYTHONPATH=/tmp/site-ours:/tmp/ours:/tmp/pyt timeout 200 \
    python3 -m pytest -p no:cacheprovider -q -rfEs test_examples.py "${SELECT[@]}" \
    > "$OUT/suite-imp-mem.log" 2>&1
tail -40 "$OUT/suite-imp-mem.log"; count imp-mem < "$OUT/suite-imp-mem.log"
cd "$ROOT"
echo "=== bench: 16 GiB, retain_cpu_backup on"
PYTHONPATH=/tmp/tms010:/tmp/ours timeout 120 python3 benches/bench_tms_dropin.py --size 16
echo "=== bench: 4 GiB, retain_cpu_backup off (the savers' default)"
PYTHONPATH=/tmp/tms010:/tmp/ours timeout 60 python3 benches/bench_tms_dropin.py --size 4 --no-retain
echo "=== done"
