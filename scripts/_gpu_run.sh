#!/usr/bin/env bash
# 2026-12-01 (issues 18, 19), GPU run 3: the engine's model swap, the TP engine as a group of one on NCCL,
# sleep/wake with the overlapped wake, bench_sleep.
set -u
export PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0 IMP_MEM_GPU_OUT=$OUT IMP_MEM_HYPOTHESIS=dev
pip install -q --no-deps --no-index --target /tmp/site wheelhouse/*.whl 2>/dev/null || exit 2
T0=$(date +%s)
timeout 60 python3 benches/bench_sleep.py --json $OUT/bench_sleep.json > $OUT/bench_sleep.txt 2>&1; echo "sleep rc=$? $(( $(date +%s)-T0 ))s" >> $OUT/bench_sleep.txt
cat $OUT/bench_sleep.txt
T0=$(date +%s)
(cd tests && timeout 400 python3 -m pytest -p no:cacheprovider -q -rs -s gpu/test_engine_tp_gpu.py gpu/test_sleep_gpu.py \
   "gpu/test_engine_gpu.py::test_the_engine_swaps_between_two_shapes_and_serves_each_as_a_fresh_one" 2>&1) > $OUT/pytest.txt; echo "pytest rc=$? $(( $(date +%s)-T0 ))s" >> $OUT/pytest.txt
grep -E "passed|failed|^E |Error" $OUT/pytest.txt | head -30
