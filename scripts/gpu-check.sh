#!/usr/bin/env bash
# The GPU check (issue 4), for the H200 machine: Python 3.12 with torch, CuPy,
# pytest, hypothesis and numpy; no network, no Rust.
#
# Installs the abi3 wheel from ./wheelhouse into /tmp/site, runs the GPU tests
# (`pytest -m gpu`), the GPU benchmarks and the library-reserve measurement,
# and prints a short table. Exit status: non-zero if the tests failed.
#
#   scripts/gpu-check.sh            # everything
#   QUICK=1 scripts/gpu-check.sh    # fewer benchmark rounds
#   GPU_CHECK_SKIP_TESTS=1 / GPU_CHECK_SKIP_BENCHES=1  # one half (two calls
#                                   # of the device tool's 10-minute limit)
#   IMP_MEM_EXTRA_WHEELS=.whl       # also install these wheels (FlashInfer)
#   GPU_CHECK_TESTS="gpu/test_a.py gpu/test_b.py"  # a part of the GPU suite
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
SITE=${IMP_MEM_SITE:-/tmp/site}
OUT=${OUT:-/tmp/imp-mem-gpu-check}
mkdir -p "$OUT"

shopt -s nullglob
wheels=(wheelhouse/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "gpu-check: no wheel in ./wheelhouse (build one with maturin build --release)" >&2
    exit 2
fi

# The newest wheel, if several are there.
wheel=$(ls -t "${wheels[@]}" | head -n 1)
echo "wheel: $wheel"
rm -rf "$SITE"
"$PYTHON" -m pip install -q --no-deps --no-index --target "$SITE" "$wheel" || exit 2
# IMP_MEM_EXTRA_WHEELS: a folder of wheels installed beside it (FlashInfer's
# and its dependencies, for attention_backend="flashinfer"; without them its
# GPU tests skip and bench_flashinfer_decode reports ours alone).
if [ -n "${IMP_MEM_EXTRA_WHEELS:-}" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$IMP_MEM_EXTRA_WHEELS"/*.whl || exit 2
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export IMP_MEM_HYPOTHESIS=${IMP_MEM_HYPOTHESIS:-dev}
export IMP_MEM_CACHE_DIR=${IMP_MEM_CACHE_DIR:-$OUT/cache}
# Where GPU tests leave figures for the summary below.
export IMP_MEM_GPU_OUT="$OUT"
export NCCL_NVLS_ENABLE=0

"$PYTHON" - <<'EOF' || exit 2
import imp_mem
print("imp_mem", imp_mem.__version__, "from", imp_mem.__file__)
print("cuda_available:", imp_mem.cuda_available())
if imp_mem.cuda_available():
    print("driver:", imp_mem.cuda_driver_version(), "devices:", imp_mem.cuda_device_count())
EOF

tests_rc=0
if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
echo
echo "==> pytest -m gpu"
# From tests/ so the installed wheel, not ./python, is imported.
# GPU_CHECK_TESTS: the test files to run (paths under tests/, default every
# one). The whole GPU suite no longer fits one 10-minute call of the device
# tool (the engine files boot several processes each): split it, e.g. the
# engine files (gpu/test_engine_*.py, gpu/test_torch_serve_gpu.py) in one
# call and the rest in another.
(cd tests && selected=(${GPU_CHECK_TESTS:-.}) && \
    "$PYTHON" -m pytest -p no:cacheprovider -m gpu -q -rs --durations=25 \
    "${selected[@]}" --junitxml="$OUT/pytest.xml") 2>&1 | tee "$OUT/pytest.txt"
tests_rc=${PIPESTATUS[0]}

echo
echo "==> imp-mem demo on the GPU"
"$PYTHON" -m imp_mem demo 2>&1 | tee "$OUT/demo.txt"
demo_rc=${PIPESTATUS[0]}
[ "$demo_rc" -eq 0 ] || tests_rc=1

# The core's source conformance suite over the CUDA sources, where its test
# binary was built and carried (cargo test -p imp-mem-cuda --test
# gpu_source_conformance --no-run; this machine has no Rust).
if [ -x target/gpu/gpu_source_conformance ]; then
    echo
    echo "==> Rust source conformance on the device"
    target/gpu/gpu_source_conformance --test-threads=1 2>&1 | tee "$OUT/conformance.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || tests_rc=1
fi
fi
bench_rc=0
reserve_rc=0
if [ -z "${GPU_CHECK_SKIP_BENCHES:-}" ]; then
echo
echo "==> benchmarks"
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
"$PYTHON" benches/bench_cuda.py --json "$OUT/bench_cuda.json" "${quick[@]}" 2>&1 | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
"$PYTHON" benches/bench_gpu_tiers.py --json "$OUT/bench_gpu_tiers.json" "${quick[@]}" 2>&1 | tee -a "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
# torch on the activations tier: torch.empty + del in each mode against the
# caching allocator (the HF generate() comparison runs inside pytest above,
# tests/gpu/test_torch_gpu.py, and leaves its figures in $OUT/bench_torch_hf.json).
"$PYTHON" benches/bench_torch_alloc.py --json "$OUT/bench_torch_alloc.json" "${quick[@]}" 2>&1 | tee -a "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
# IMP_MEM_BENCHES names the scripts to run (default: all of them); the RL
# cycle writes two 16 GiB checkpoints and takes about two minutes, and
# bench_engine's roofline part boots Qwen3-8B's numbers four times (about
# three minutes). Left out by default for their length: bench_shared_gpu
# (about six minutes) and bench_engine_families (about five); name them in
# IMP_MEM_BENCHES for a call of their own.
extras=${IMP_MEM_BENCHES:-bench_paged_attention bench_engine bench_sleep bench_kv_host bench_kv_persist bench_rl_colocate}
for extra in $extras; do
    [ -f "benches/$extra.py" ] || continue
    args=()
    # Each script takes --json / --quick only if its --help says so.
    help=$("$PYTHON" "benches/$extra.py" --help 2>/dev/null)
    [[ $help == *--json* ]] && args+=(--json "$OUT/$extra.json")
    [[ $help == *--quick* ]] && args+=("${quick[@]}")
    "$PYTHON" "benches/$extra.py" "${args[@]}" 2>&1 | tee -a "$OUT/bench.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
done
# The KV manager's benchmark runs on the host CPU; this host's figures sit
# beside the CI machine's.
"$PYTHON" benches/bench_kv.py "${quick[@]}" 2>&1 | tee -a "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1

echo
echo "==> library reserve and context cost"
"$PYTHON" tools/measure_reserve.py --samples "${RESERVE_SAMPLES:-5}" 2>&1 | tee "$OUT/reserve.txt"
reserve_rc=${PIPESTATUS[0]}

fi
echo
echo "==> summary"
"$PYTHON" - "$OUT" "$tests_rc" "$bench_rc" "$reserve_rc" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, tests_rc, bench_rc, reserve_rc = Path(sys.argv[1]), *map(int, sys.argv[2:])
rows = []
try:
    suite = ET.parse(out / "pytest.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    t, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    rows.append(("gpu tests", f"{t - f - e - s} passed, {f + e} failed, {s} skipped", "rc=%d" % tests_rc))
except (OSError, ET.ParseError, IndexError) as exc:
    rows.append(("gpu tests", f"no report ({exc})", "rc=%d" % tests_rc))
try:
    results = json.loads((out / "bench_cuda.json").read_text())
    for extra in ("bench_gpu_tiers", "bench_torch_alloc", "bench_paged_attention", "bench_engine",
                  "bench_sleep", "bench_kv_host"):
        path = out / f"{extra}.json"
        if path.exists():
            data = json.loads(path.read_text())
            results += data if isinstance(data, list) else data.get("rows", [])
    for r in results:
        if not all(k in r for k in ("benchmark", "peer", "ours_us", "peer_us", "ratio", "goal")):
            continue
        rows.append((r["benchmark"] + " vs " + r["peer"],
                     f"{r['ours_us']} us / {r['peer_us']} us = {r['ratio']}x", r["goal"]))
except (OSError, ValueError) as exc:
    rows.append(("benchmarks", f"no results ({exc})", "rc=%d" % bench_rc))
rl = out / "bench_rl_colocate.json"
if rl.exists():
    for r in json.loads(rl.read_text()):
        if "ratio" in r:
            rows.append((f"RL cycle: {r['benchmark']} vs {r['peer']}",
                         f"{r['ours']} / {r['peer_value']} {r['unit']} = {r['ratio']}x", r["goal"]))
        elif isinstance(r.get("value"), bool):
            rows.append((f"RL cycle: {r['benchmark']}", str(r["value"]), "True"))
hf = out / "bench_torch_hf.json"
if hf.exists():
    data = json.loads(hf.read_text())
    for name, r in data.get("variants", {}).items():
        rows.append((f"HF generate() tokens/s, imp-mem {name} vs torch allocator",
                     f"{r['tokens_per_s_ratio']:.3f}x", ">= 0.98x"))
        rows.append((f"HF reserved / live peak, imp-mem {name} (torch allocator)",
                     f"{r['reserved_over_live_peak']:.3f} ({r['default_reserved_over_live_peak']:.3f});"
                     f" reserved / needed {r['reserved_over_needed']:.3f}",
                     "<= 1.02 (scope: needed <= 1.2)"))
        rows.append((f"HF serving, {name}: acquisitions / fallbacks / attribution / measured",
                     f"{r['backend_acquisitions_serving']} / {r['fallbacks']}"
                     f" / {r['attribution_pct']:.2f} % / {r['measured_this_start']}",
                     "0 / 0 / >= 99 % / second start False"))
        rows.append((f"HF greedy tokens identical, {name} (deterministic mode)",
                     str(r["tokens_identical"]), "True"))
for line in (out / "reserve.txt").read_text().splitlines() if (out / "reserve.txt").exists() else []:
    if line.startswith("RESERVE "):
        r = json.loads(line[8:])
        rows.append(("context / library reserve",
                     f"{r['context_bytes'] / 2**20:.1f} MiB / {r['library_reserve_bytes'] / 2**20:.1f} MiB",
                     r["key"] + ("  DIVERGED" if r["diverged"] else "")))
w0 = max(len(r[0]) for r in rows)
w1 = max(len(r[1]) for r in rows)
for a, b, c in rows:
    print(f"{a.ljust(w0)}  {b.ljust(w1)}  {c}")
EOF

exit "$tests_rc"
